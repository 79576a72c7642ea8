"""Transfer evaluation of JuICE on the embedded model (the paper's Table 3 layout), plus the
robustness sweeps over K, the beta grid and paraphrased templates.

Heads are identified on 4 world-capital facts and betas tuned on a world-capital validation
split; every method is then scored (greedy continuation, an alias in the first 5 words) on
held-out facts of all six relations that the model knows. Each stage is cached under --out/cache
by cpsuper's step cache (data files, keyed by the stage's code, the library versions and the
arguments), so an interrupted run resumes where it stopped and an edited stage is recomputed.

    python scripts/juice_transfer.py --out docs/results/juice_transfer

The committed table.csv, per_example.csv, table_ci.csv and paired_ci.csv of that folder hold PH3
and Prompt rows from earlier baselines (a knockout ranking, now cp.KnockoutPruning, and a Prompt
that also prefixed clean prompts). scripts/juice_methods.py scores every method as it is now on
the same held-out facts, with this script's fitted JuICE.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

import cpsuper as cp
from cpsuper.reproduce import StepCache
from cpsuper.tuning import PAPER_BETA_NEG_GRID, PAPER_BETA_POS_GRID

# The strength grids these results were measured with (JuICE's defaults until 2026-11-27).
PAPER_GRIDS = {"beta_pos_grid": PAPER_BETA_POS_GRID, "beta_neg_grid": PAPER_BETA_NEG_GRID}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="juice_transfer")
    parser.add_argument("--n-test", type=int, default=30, help="held-out known facts per relation")
    parser.add_argument("--n-pool", type=int, default=100, help="facts sampled per relation before filtering")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--only",
        nargs="*",
        default=None,
        help="compute just these stages (e.g. tests eval_Original), to run stages in parallel",
    )
    args = parser.parse_args()
    out = Path(args.out)
    cache = StepCache(out / "cache")
    settings = {"model": "gemma-3-270m", "seed": args.seed, "n_test": args.n_test, "n_pool": args.n_pool}
    done: set[str] = set()
    earlier: dict[str, list[str]] = {}

    def stage(name, compute, *helpers):
        """The cached value of stage ``name``. Its key covers the code of ``compute`` and ``helpers``
        and the stages before it. With --only, a stage outside it that is not cached yet is left to
        another process (None), and this process exits once its own stages are done."""
        options = {
            "key": settings,
            "code": [compute, *helpers],
            "after": earlier.setdefault(name, [n for n in cache.keys if n != name]),
        }
        if args.only is not None and name not in args.only:
            return cache.lookup(name, compute, **options)[1]
        value = cache.get_or_compute(name, compute, **options)
        done.add(name)
        if args.only is not None and done >= set(args.only):
            raise SystemExit(0)
        return value

    model = cp.load_model()
    capitals = stage(
        "capitals",
        lambda: cp.filter_known(model, cp.conflict_dataset("world_capital", tokenizer=model), progress=False),
    )
    parts = cp.split(capitals, n_select=4, val_frac=0.15, seed=args.seed)

    def test_sets():
        sets = [parts.test[: args.n_test]]
        for relation in cp.list_relations():
            if relation == "world_capital":
                continue
            pool = cp.conflict_dataset(relation, n=args.n_pool, seed=args.seed, tokenizer=model)
            sets.append(cp.filter_known(model, pool, progress=False)[: args.n_test])
        return sets

    tests = stage("tests", test_sets)

    def evaluated(name, method):
        """Per-example results of one method on the test sets (cached as stage eval_<name>)."""
        return stage(f"eval_{name}", lambda: cp.evaluate({name: method}, tests))

    baselines = {
        "Original": cp.Original(model),
        "Prompt": cp.PromptInstruction(model, direction="parametric"),
        "CAD": cp.CAD(model, alpha=1.0),
    }
    for name, method in baselines.items():
        evaluated(name, method)
    identified = stage("identified", lambda: cp.identify_heads(model, parts.select, "parametric", progress=False))

    def fit(dual_run: bool):
        steer = cp.JuICE(model, direction="parametric", dual_run=dual_run, **PAPER_GRIDS)
        steer.fit(parts.select, parts.validation, progress=False, heads=identified, recipe="paper")
        return steer.to_dict(), steer.tuning

    juice_cfg, juice_tuning = stage("juice", lambda: fit(True), fit) or (None, None)
    june_cfg, june_tuning = stage("june", lambda: fit(False), fit) or (None, None)

    # Capitals the model knows that are neither selection, validation nor evaluated test facts:
    # PH3's large development set and the extra selection facts of the |D| sweep.
    spare = parts.test[args.n_test :]

    def fit_ph3(development):
        pruned = cp.PH3(model).fit(development, parts.validation, progress=False)
        return pruned.heads, pruned.k, pruned.tuning

    ph3_small, ph3_large = cp.PH3(model), cp.PH3(model)
    ph3_small.heads, ph3_small.k, ph3_small.tuning = stage("ph3", lambda: fit_ph3(parts.select), fit_ph3) or (None,) * 3
    ph3_large.heads, ph3_large.k, ph3_large.tuning = (
        stage("ph3_large", lambda: fit_ph3(parts.select + spare), fit_ph3) or (None,) * 3
    )

    juice, june = cp.JuICE.from_dict(juice_cfg, model), cp.JuICE.from_dict(june_cfg, model)
    juice.save(out / "juice_parametric.json")

    methods = {
        **baselines,
        "PH3 (small dev)": ph3_small,
        f"PH3 (large dev, {len(parts.select) + len(spare)})": ph3_large,
        "JuNe": june,
        "JuICE": juice,
    }
    results = []
    for name, method in methods.items():
        results.append(evaluated(name, method))
    results = pd.concat(results, ignore_index=True)
    results.to_csv(out / "per_example.csv", index=False)
    table = cp.evaluation_table(results)
    table.round(3).to_csv(out / "table.csv")

    # Robustness: K (same scores, re-ranked), paraphrased templates, the beta grid (validation).
    capital_test = parts.test[: args.n_test]

    def k_sweep():
        rows = []
        for k in (1, 2, 3, 5, 10, 20, 30):
            heads = identified.with_k(k)
            steer = cp.JuICE(
                model,
                "parametric",
                k=k,
                enhance=heads.enhance,
                suppress=heads.suppress,
                beta_plus=juice.beta_plus,
                beta_minus=juice.beta_minus,
            )
            acc = steer.accuracy(capital_test).groupby("conflict_type")["correct"].mean()
            rows += [{"k": k, "conflict_type": c, "accuracy": v} for c, v in acc.items()]
        return pd.DataFrame(rows)

    stage("k_sweep", k_sweep).to_csv(out / "k_sweep.csv", index=False)

    def paraphrases():
        rows = []
        subjects = [e.subject for e in capital_test]
        relation = cp.load_relation("world_capital")
        for paraphrase in range(1, 4):
            data = relation.dataset(subjects=subjects, seed=args.seed, tokenizer=model, paraphrase=paraphrase)
            for name in ("Original", "JuNe", "JuICE"):
                acc = cp.evaluate({name: methods[name]}, data).groupby("conflict_type")["correct"].mean()
                rows += [
                    {"paraphrase": paraphrase, "method": name, "conflict_type": c, "accuracy": v}
                    for c, v in acc.items()
                ]
        return pd.DataFrame(rows)

    stage("paraphrases", paraphrases).to_csv(out / "paraphrases.csv", index=False)

    # |D| from 1 to 10: the 4 selection facts plus 6 spare capitals, each fact scored once.
    more = stage("identified_more", lambda: cp.identify_heads(model, spare[:6], "parametric", progress=False))
    pooled = identified.merge(more)
    pool = parts.select + spare[:6]
    stage(
        "size_sweep",
        lambda: cp.robustness.selection_size_sweep(
            juice, pool, capital_test, sizes=range(1, 11), scored=pooled, progress=False
        ),
    ).to_csv(out / "size_sweep.csv", index=False)
    juice_tuning.to_csv(out / "beta_grid_juice.csv", index=False)
    june_tuning.to_csv(out / "beta_grid_june.csv", index=False)
    identified.scores.to_csv(out / "head_scores.csv", index=False)
    pd.DataFrame({"ph3_small_k": [ph3_small.k], "ph3_large_k": [ph3_large.k]}).to_csv(out / "ph3_k.csv", index=False)
    timings = {r.name: {"seconds": round(r.seconds, 1), "cpu_seconds": round(r.cpu_seconds, 1)} for r in cache.records}
    (out / "timings.json").write_text(json.dumps(timings, indent=1))
    print(table.round(2).to_string())


if __name__ == "__main__":
    main()
