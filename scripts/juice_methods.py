"""Table 3, Fig. 2 and Table 7 of the JuICE paper with cpsuper's current methods, on the held-out
facts of the transfer study (scripts/juice_transfer.py).

Original, Prompt (`cp.PromptInstruction`), CAD, PH3 (`cp.PH3`: path patching; small and large
development sets), JuNe (`cp.JuICE(..., dual_run=False)`) and JuICE are scored toward memory by
greedy accuracy on the transfer split: the 99 world capitals the model knows, split with seed 0
into 4 selection, 14 validation and 81 test facts, and up to 30 known facts of every other
relation. JuICE is the transfer study's fit (`docs/results/juice_transfer/juice_parametric.json`:
the paper's recipe and strength grids on the same selection and validation facts); JuNe steers its
heads in one pass with strengths tuned on the same validation facts by the same objective. PH3's k
comes from the paper's grid (1, 3, 5, 7, 9, 15), as in `cpsuper reproduce`.

Table 7 (`--paraphrase-relations`): the same held-out facts, each written with a template drawn
at random among paraphrases 1-3 (`cp.robustness.paraphrase_sweep(mode="per_example")`).

Every stage is cached under --out/cache (cpsuper's step cache), so a stopped run resumes.

    python scripts/juice_methods.py --out docs/results/juice_methods
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd
import torch
from juice_intervals import paired, with_fact_ids  # scripts/juice_intervals.py, beside this script

import cpsuper as cp
from cpsuper.baselines import evaluation_intervals
from cpsuper.reproduce import StepCache
from cpsuper.tuning import tune_betas

ROOT = Path(__file__).resolve().parent.parent
FITTED = ROOT / "docs" / "results" / "juice_transfer" / "juice_parametric.json"
TEMPLATES = (1, 2, 3)  # the paraphrases of the per-template table in docs/results/juice.md


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="juice_methods")
    parser.add_argument("--n-test", type=int, default=30, help="held-out known facts per relation")
    parser.add_argument("--n-pool", type=int, default=100, help="facts sampled per relation before filtering")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--paraphrase-relations",
        nargs="*",
        default=[
            "world_capital",
            "official_language",
            "athlete_sport",
            "book_author",
            "company_founder",
            "company_headquarter",
        ],
        help="relations of the per-example paraphrase table (Table 7)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    cache = StepCache(out / "cache")
    settings = {"model": "gemma-3-270m", "seed": args.seed, "n_test": args.n_test, "n_pool": args.n_pool}

    def stage(name, compute, *helpers):
        after = [n for n in cache.keys if n != name]
        return cache.get_or_compute(name, compute, key=settings, code=[compute, *helpers], after=after)

    model = cp.load_model()
    # The transfer study's split (scripts/juice_transfer.py): the same filter, split and seed.
    capitals = stage(
        "capitals",
        lambda: cp.filter_known(model, cp.conflict_dataset("world_capital", tokenizer=model), progress=False),
    )
    parts = cp.split(capitals, n_select=4, val_frac=0.15, seed=args.seed)
    spare = parts.test[args.n_test :]  # known capitals never scored: PH3's large development set

    def test_sets():
        sets = [parts.test[: args.n_test]]
        for relation in cp.list_relations():
            if relation != "world_capital":
                pool = cp.conflict_dataset(relation, n=args.n_pool, seed=args.seed, tokenizer=model)
                sets.append(cp.filter_known(model, pool, progress=False)[: args.n_test])
        return sets

    tests = stage("tests", test_sets)

    juice = cp.JuICE.load(FITTED, model)
    fitted_on = juice.fitted_on
    if fitted_on.get("selection") != [e.subject for e in parts.select] or fitted_on.get("validation") != [
        e.subject for e in parts.validation
    ]:
        raise SystemExit(f"{FITTED} was fitted on other facts than this split; rerun scripts/juice_transfer.py.")

    def fit_june():
        june = cp.JuICE.from_dict({**juice.to_dict(), "dual_run": False}, model)
        tuning = tune_betas(june, parts.validation, objective="paper")
        return june.to_dict(), tuning

    june_cfg, june_tuning = stage("june", fit_june)
    june = cp.JuICE.from_dict(june_cfg, model)

    def fit_ph3(development):
        pruned = cp.PH3(model).fit(development, parts.validation, progress=False)
        return pruned.heads, pruned.k, pruned.tuning, pruned.patching

    ph3 = {}
    for label, development in (("small", parts.select), ("large", parts.select + spare)):
        pruned = cp.PH3(model)
        pruned.heads, pruned.k, pruned.tuning, pruned.patching = stage(
            f"ph3_{label}", lambda d=development: fit_ph3(d), fit_ph3
        )
        ph3[label] = (pruned, len(development))

    methods = {
        "Original": cp.Original(model),
        "Prompt": cp.PromptInstruction(model, direction="parametric"),
        "CAD": cp.CAD(model, alpha=1.0),
        f"PH3 (small dev, {ph3['small'][1]})": ph3["small"][0],
        f"PH3 (large dev, {ph3['large'][1]})": ph3["large"][0],
        "JuNe": june,
        "JuICE": juice,
    }
    # Original, Prompt and CAD in one call: their clean prompts are decoded once and shared.
    groups = [["Original", "Prompt", "CAD"]] + [[name] for name in list(methods)[3:]]
    results = []
    for group in groups:
        label = "eval_" + "+".join(group)
        results.append(stage(label, lambda g=group: cp.evaluate({n: methods[n] for n in g}, tests)))
    results = pd.concat(results, ignore_index=True)
    out.mkdir(parents=True, exist_ok=True)
    results.to_csv(out / "per_example.csv", index=False)
    table = cp.evaluation_table(results)
    table.round(3).to_csv(out / "table.csv")
    intervals = evaluation_intervals(results)
    intervals.round(4).to_csv(out / "table_ci.csv", index=False)
    ph3_small, ph3_large = list(methods)[3:5]
    pairs = [("JuICE", "Original"), ("JuICE", "JuNe"), (ph3_large, "JuICE"), (ph3_small, "JuICE")]
    paired(with_fact_ids(results), pairs).round(4).to_csv(out / "paired_ci.csv", index=False)
    june_tuning.to_csv(out / "beta_grid_june.csv", index=False)
    ph3_rows = []
    for label, (pruned, size) in ph3.items():
        pruned.tuning.assign(development=label).to_csv(out / f"ph3_{label}_k.csv", index=False)
        pruned.patching.to_csv(out / f"ph3_{label}_patching.csv", index=False)
        ph3_rows.append({"development": label, "facts": size, "k": pruned.k, "pruned": pruned.heads[: pruned.k]})
    (out / "fitted.json").write_text(
        json.dumps({"june": {"beta_plus": june.beta_plus, "beta_minus": june.beta_minus}, "ph3": ph3_rows}, indent=1)
    )
    try:  # Fig. 2: the figure is a view of table_ci.csv's data, so a failed export is only reported
        fig = cp.plots.plot_methods(results, title="Greedy accuracy toward memory, 142 held-out facts, six relations")
        cp.plots.save_figure(fig, out / "fig2_methods", formats="png", scale=2.0)
    except Exception as error:
        print(f"figure not written: {error}")

    # Table 7: every fact written with a template drawn at random (seeded), per relation.
    steering = {name: methods[name] for name in ("Original", "JuNe", "JuICE")}
    by_relation = {data.relations[0]: data for data in tests}
    drawn = []
    for relation in args.paraphrase_relations:
        subjects = [e.subject for e in by_relation[relation]]

        def paraphrased(relation=relation, subjects=subjects):
            spec = cp.load_relation(relation)
            datasets = {
                p: spec.dataset(subjects=subjects, seed=args.seed, tokenizer=model, paraphrase=p) for p in TEMPLATES
            }
            return cp.robustness.paraphrase_sweep(
                steering, datasets, progress=False, mode="per_example", seeds=(args.seed,), per_fact=True
            )

        drawn.append(stage(f"paraphrases_{relation}", paraphrased))
    if drawn:
        drawn = pd.concat(drawn, ignore_index=True)
        drawn.to_csv(out / "paraphrases_per_example.csv", index=False)
        evaluation_intervals(drawn).round(4).to_csv(out / "paraphrases_ci.csv", index=False)
    # stages computed by this process; those of an earlier, resumed run are kept
    timings = json.loads((out / "timings.json").read_text()) if (out / "timings.json").exists() else {}
    timings |= {r.name: {"seconds": round(r.seconds, 1), "cpu_seconds": round(r.cpu_seconds, 1)} for r in cache.records}
    (out / "timings.json").write_text(json.dumps(timings, indent=1))
    print(table.round(2).to_string())


if __name__ == "__main__":
    main()
