"""How much JuICE's held-out accuracy varies with the few facts it is fitted on (issue 16).

Filters one relation's facts down to those the embedded model knows, shuffles them (by --seed)
into a development pool of --n-pool facts and --n-test held-out facts, scores stage 1 once on the
pool, and fits JuICE on --draws seeded draws of selection and validation facts from the pool with
each recipe (cpsuper.variance.selection_variance). Writes per_draw.csv, summary.csv, tuning.csv,
settings.json and timings.json under --out.

--relation may also name a context-direction task (docs/context_tasks.md, e.g. proverb_ending)
with --direction context: stage 1 then scores the instruction prompts, and the clean prompts
(the text alone) measure plain recall, which the robust recipe protects.

    python scripts/juice_variance.py --out docs/results/juice_variance
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import pandas as pd
import torch

import cpsuper as cp
from cpsuper.data.context_tasks_loader import CONTEXT_TASK_KINDS, load_context_tasks
from cpsuper.identification import IdentifiedHeads
from cpsuper.reproduce.settings import FULL, QUICK
from cpsuper.variance import RECIPES, selection_variance


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="juice_variance")
    parser.add_argument("--relation", default="world_capital", help="a relation or a context-direction task")
    parser.add_argument("--direction", choices=("parametric", "context"), default="parametric")
    parser.add_argument("--n-facts", type=int, default=None, help="facts sampled before filtering (default: all)")
    parser.add_argument("--n-pool", type=int, default=10, help="development facts the draws pick from")
    parser.add_argument("--n-test", type=int, default=15, help="held-out known facts, the same for every draw")
    parser.add_argument("--n-select", type=int, default=4)
    parser.add_argument("--n-validation", type=int, default=3)
    parser.add_argument("--k", type=int, default=5, help="heads per sign (the paper's K)")
    parser.add_argument("--draws", type=int, default=10)
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--grids", choices=("quick", "paper"), default="quick", help="stage-1 scale grids")
    parser.add_argument("--beta-pos", type=float, nargs="+", default=[0.0, 1.0, 2.0, 4.0], help="beta+ grid")
    parser.add_argument("--beta-neg", type=float, nargs="+", default=[0.0, -1.0], help="beta- grid")
    parser.add_argument("--clean-margin", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--scored", default=None, help="stage1_per_fact.csv.gz of an earlier run on the same pool: skip stage 1"
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stage1 = {"quick": QUICK, "paper": FULL}[args.grids]

    t = time.perf_counter()
    model = cp.load_model()
    if args.relation in CONTEXT_TASK_KINDS:
        facts = load_context_tasks(args.relation)
    else:
        facts = cp.conflict_dataset(args.relation, n=args.n_facts, seed=args.seed, tokenizer=model)
    known = cp.filter_known(model, facts, progress=False)
    filter_s = time.perf_counter() - t
    need = args.n_pool + args.n_test
    if len(known) < need:
        raise SystemExit(f"{args.relation}: the model knows {len(known)} facts; {need} are needed.")
    order = list(range(len(known)))
    random.Random(f"juice-variance|{args.seed}").shuffle(order)
    pool, test = known[order[: args.n_pool]], known[order[args.n_pool : need]]
    scored = None
    if args.scored:
        per_fact = pd.read_csv(args.scored)
        scored = IdentifiedHeads(per_fact.iloc[:0], [], [], 5, per_fact)  # subset() reads only per_fact
    result = selection_variance(
        model,
        pool,
        test=test,
        draws=args.draws,
        n_select=args.n_select,
        n_validation=args.n_validation,
        recipes=args.recipes,
        k=args.k,
        direction=args.direction,
        pos_grid=stage1.pos_grid,
        neg_grid=stage1.neg_grid,
        beta_pos_grid=args.beta_pos,
        beta_neg_grid=args.beta_neg,
        clean_margin=args.clean_margin,
        seed=args.seed,
        scored=scored,
        on_draw=lambda rows: rows.to_csv(out / "per_draw.csv", index=False),
    )
    result.per_draw.to_csv(out / "per_draw.csv", index=False)
    result.summary.round(4).to_csv(out / "summary.csv", index=False)
    result.tuning.to_csv(out / "tuning.csv", index=False)
    result.scored.per_example.to_csv(out / "stage1_per_fact.csv.gz", index=False)
    settings = {**result.settings, "relation": args.relation, "known": len(known), "sampled": len(facts)}
    settings |= {"stage1_grids": args.grids}
    (out / "settings.json").write_text(json.dumps(settings, indent=1))
    timings = {"load_and_filter_s": round(filter_s, 1), **result.timings, "threads": torch.get_num_threads()}
    (out / "timings.json").write_text(json.dumps(timings, indent=1))
    cols = ["metric", "recipe", "method", "conflict_type", "mean", "ci_low", "ci_high", "worst", "share_meeting"]
    print(result.summary[cols].round(2).to_string(index=False))
    print(timings)


if __name__ == "__main__":
    main()
