"""Would stronger strengths steer long paragraphs? One shift-study draw's heads over wide grids.

Takes the heads and context gate a recipe chose in one draw of a shift study (its per_draw.csv),
and scores every strength pair of wide grids on the substitution and coherent prompts of the
study's validation candidates (known world capitals that are neither selection candidates nor
test facts) written in another wording family. Facts and templates are drawn as
scripts/juice_shift.py draws them (same seed), so no test fact is used.

    python scripts/juice_strength_probe.py docs/results/juice_shift/world_capital/per_draw.csv \
        --draw 0 --recipe robust-gated --family longform \
        --out docs/results/juice_shift/strength_probe_longform.csv
"""

from __future__ import annotations

import argparse
import random

import pandas as pd

import cpsuper as cp
from cpsuper.tuning import FIT_RECIPES, beta_tuning

POOL = "docs/results/juice_variance/defaults/stage1_per_fact.csv.gz"  # the selection candidates


def heads(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in pair.split(", ")) for pair in text.strip("()").split(") (")] if text else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("per_draw")
    parser.add_argument("--draw", type=int, default=0)
    parser.add_argument("--recipe", default="robust-gated")
    parser.add_argument("--family", default="longform")
    parser.add_argument("--n-validation-pool", type=int, default=14)
    parser.add_argument("--beta-pos", type=float, nargs="+", default=[0, 1, 2, 3, 4, 5, 7])
    parser.add_argument("--beta-neg", type=float, nargs="+", default=[0, -1, -2, -3])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="strength_probe.csv")
    args = parser.parse_args()
    rows = pd.read_csv(args.per_draw)
    row = rows[(rows.draw == args.draw) & (rows.recipe == args.recipe) & (rows.method == "JuICE")].iloc[0]

    model = cp.load_model()
    relation = cp.load_relation("world_capital")
    facts = relation.dataset(tokenizer=model, paraphrase="random", seed=args.seed)
    known = cp.filter_known(model, facts, progress=False)
    order = list(range(len(known)))
    random.Random(f"juice-shift|{args.seed}").shuffle(order)  # scripts/juice_shift.py's order
    candidates = set(pd.read_csv(POOL).subject)
    validation = [known[i].subject for i in order if known[i].subject not in candidates][: args.n_validation_pool]
    shifted = relation.dataset(
        subjects=validation, tokenizer=model, family=args.family, paraphrase="random", seed=args.seed
    ).with_prompts(["substitution", "coherent"])
    steer = cp.JuICE(
        model,
        enhance=heads(row.enhance),
        suppress=heads(row.suppress if isinstance(row.suppress, str) else ""),
        beta_pos_grid=args.beta_pos,
        beta_neg_grid=args.beta_neg,
        context_gate=FIT_RECIPES[args.recipe].context_gate,
    )
    table = beta_tuning(steer, shifted).assign(draw=args.draw, recipe=args.recipe, family=args.family)
    table.round(4).to_csv(args.out, index=False)
    print(table.round(2).to_string(index=False))


if __name__ == "__main__":
    main()
