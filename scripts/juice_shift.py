"""JuICE recipes under distribution shift: fitted on one wording family, scored on others.

Keeps the facts of --relation that the embedded model answers on clean prompts of --fit-family,
shuffles them (by --seed) into --n-pool selection candidates, --n-validation-pool validation
candidates and --n-test held-out facts, and fits JuICE on --draws seeded draws of --n-select
selection and --n-validation validation facts (every prompt in --fit-family, its template drawn at
random per fact), with each recipe (cpsuper.variance.selection_variance). Every draw's steering is
scored on the held-out facts written in the fit family and in each of --test-families (templates
drawn at random per fact), and on the known facts of each --transfer-relations relation (fitted on
one relation, tested on another). Writes per_draw.csv, summary.csv, tuning.csv, settings.json and
timings.json under --out; stage 1's per-fact changes (stage1*.csv.gz) are kept there and reused by
a later run on the same pool (--stage1-only computes just them).

    python scripts/juice_shift.py --out docs/results/juice_shift/world_capital
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import time
from pathlib import Path

import pandas as pd
import torch

import cpsuper as cp
from cpsuper.identification import NEG_GRID, POS_GRID, IdentifiedHeads
from cpsuper.tuning import BETA_NEG_GRID, BETA_POS_GRID
from cpsuper.variance import MILD_RECIPES, RECIPES, selection_variance


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="juice_shift")
    parser.add_argument("--relation", default="world_capital")
    parser.add_argument("--fit-family", default="base")
    parser.add_argument("--test-families", nargs="*", default=["dialogue", "longform"])
    parser.add_argument("--transfer-relations", nargs="*", default=["official_language"])
    parser.add_argument("--n-pool", type=int, default=8, help="selection candidates (stage 1 scores them)")
    parser.add_argument("--n-validation-pool", type=int, default=14, help="validation candidates")
    parser.add_argument("--n-test", type=int, default=16, help="held-out known facts, the same for every draw")
    parser.add_argument("--n-transfer", type=int, default=12, help="known facts per transfer relation")
    parser.add_argument("--n-select", type=int, default=6)
    parser.add_argument("--n-validation", type=int, default=10)
    parser.add_argument("--k", type=int, default=5, help="heads per sign (the paper's K)")
    parser.add_argument("--draws", type=int, default=5)
    parser.add_argument("--first-draw", type=int, default=0, help="number of the first draw (to run a study in parts)")
    parser.add_argument("--recipes", nargs="+", default=["robust-conflict", "robust", "paper"], choices=list(RECIPES))
    parser.add_argument("--clean-margin", type=float, default=0.1)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stage1-only", action="store_true", help="score stage 1 on the pool, save it, stop")
    parser.add_argument(
        "--stage1-part", default=None, help="K/N: with --stage1-only, score the K-th of N parts of the pool (parallel)"
    )
    parser.add_argument(
        "--stage1-from",
        default=None,
        help="a stage1_per_fact.csv.gz of an earlier run: its facts are the selection candidates, stage 1 is not rerun",
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    t = time.perf_counter()
    model = cp.load_model(dtype=getattr(torch, args.dtype))
    relation = cp.load_relation(args.relation)

    def written(subjects, family, name=None):
        data = relation.dataset(subjects=subjects, tokenizer=model, family=family, paraphrase="random", seed=args.seed)
        data.name = name or f"{args.relation}/{family}"
        return data

    facts = written(relation.subjects, args.fit_family)
    known = cp.filter_known(model, facts, progress=False)
    cuts = [args.n_pool, args.n_pool + args.n_validation_pool, args.n_pool + args.n_validation_pool + args.n_test]
    if len(known) < cuts[-1]:
        raise SystemExit(f"{args.relation}: the model knows {len(known)} facts; {cuts[-1]} are needed.")
    order = list(range(len(known)))
    random.Random(f"juice-shift|{args.seed}").shuffle(order)
    if args.stage1_from:  # the stored scores' facts are the selection candidates (stage 1 is not rerun)
        candidates = set(pd.read_csv(args.stage1_from).subject)
        pool = facts[[i for i, e in enumerate(facts) if e.subject in candidates]]
        rest = [i for i in order if known[i].subject not in candidates]
        validation_pool = known[rest[: args.n_validation_pool]]
        held_out = known[rest[args.n_validation_pool : args.n_validation_pool + args.n_test]]
        (out / "stage1_per_fact.csv.gz").write_bytes(Path(args.stage1_from).read_bytes())
    else:
        pool, validation_pool = known[order[: cuts[0]]], known[order[cuts[0] : cuts[1]]]
        held_out = known[order[cuts[1] : cuts[2]]]
    subjects = [e.subject for e in held_out]
    tests = {f"{args.relation}/{args.fit_family}": held_out}
    tests |= {f"{args.relation}/{family}": written(subjects, family) for family in args.test_families}
    for other in args.transfer_relations:
        other_facts = cp.conflict_dataset(other, tokenizer=model, paraphrase="random", seed=args.seed)
        tests[f"{other}/base"] = cp.filter_known(model, other_facts, progress=False)[: args.n_transfer]
    filter_s = time.perf_counter() - t

    stage1 = {}  # the pool's per-fact stage-1 changes at the paper's scales and at the beta grids'
    grids = {
        "stage1_per_fact.csv.gz": (POS_GRID, NEG_GRID),
        "stage1_mild_per_fact.csv.gz": ([b for b in BETA_POS_GRID if b > 0], [b for b in BETA_NEG_GRID if b < 0]),
    }
    mild = set(args.recipes) & set(MILD_RECIPES)
    needed = {"stage1_per_fact.csv.gz": bool(set(args.recipes) - mild), "stage1_mild_per_fact.csv.gz": bool(mild)}
    for name, (pos, neg) in grids.items():
        path, parts = out / name, sorted(out.glob(name.replace(".csv.gz", ".part*.csv.gz")))
        if args.stage1_part and needed[name]:
            k, n = map(int, args.stage1_part.split("/"))
            part = pool[[i for i in range(len(pool)) if i % n == k]]
            scored = cp.identify_heads(model, part, "parametric", pos_grid=pos, neg_grid=neg, k=args.k, progress=True)
            scored.per_example.to_csv(out / name.replace(".csv.gz", f".part{k}.csv.gz"), index=False)
        elif path.exists() or parts:
            per_fact = pd.concat([pd.read_csv(f) for f in ([path] if path.exists() else parts)], ignore_index=True)
            stage1[name] = IdentifiedHeads(per_fact.iloc[:0], [], [], args.k, per_fact)  # subset() reads per_fact
        elif needed[name]:
            stage1[name] = cp.identify_heads(
                model, pool, "parametric", pos_grid=pos, neg_grid=neg, k=args.k, progress=True
            )
            stage1[name].per_example.to_csv(path, index=False)
    if args.stage1_only:
        return

    result = selection_variance(
        model,
        pool,
        test=tests,
        draws=args.draws,
        first_draw=args.first_draw,
        n_select=args.n_select,
        n_validation=args.n_validation,
        recipes=args.recipes,
        k=args.k,
        beta_pos_grid=BETA_POS_GRID,
        beta_neg_grid=BETA_NEG_GRID,
        clean_margin=args.clean_margin,
        seed=args.seed,
        scored=stage1.get("stage1_per_fact.csv.gz"),
        scored_mild=stage1.get("stage1_mild_per_fact.csv.gz"),
        validation_pool=validation_pool,
        on_draw=lambda rows: rows.to_csv(out / "per_draw.csv", index=False),
    )
    result.per_draw.to_csv(out / "per_draw.csv", index=False)
    result.summary.round(4).to_csv(out / "summary.csv", index=False)
    result.tuning.to_csv(out / "tuning.csv", index=False)
    settings = {**result.settings, "relation": args.relation, "known": len(known), "facts": len(facts)}
    settings |= {"fit_family": args.fit_family, "test_families": args.test_families, "dtype": args.dtype}
    settings |= {"transfer_relations": args.transfer_relations}
    templates = cp.data.relations.RELATIONS_DIR / f"{args.relation}.json"
    settings |= {"templates_sha256": hashlib.sha256(templates.read_bytes()).hexdigest()}
    (out / "settings.json").write_text(json.dumps(settings, indent=1))
    timings = {"load_and_filter_s": round(filter_s, 1), **result.timings, "threads": torch.get_num_threads()}
    (out / "timings.json").write_text(json.dumps(timings, indent=1))
    cols = ["metric", "recipe", "test", "method", "conflict_type", "mean", "ci_low", "ci_high", "worst"]
    print(result.summary[cols].round(2).to_string(index=False))
    print(timings)


if __name__ == "__main__":
    main()
