"""How often the context gate opens, per kind of prompt, on the embedded model.

The gate (cpsuper.context_gate) steers a prompt when the unsteered model's next-token probability
on the prompt's own tokens (its prompt-token mass) reaches a threshold. This script measures that
mass on clean, substitution and coherent prompts of known facts of three relations in each wording
family (templates drawn at random per fact), and on the context-direction tasks, and writes, per
set and prompt type, the share of prompts the gate opens for at thresholds 0.1 ... 0.5.

The default threshold is chosen here, on the fitting data of the shift study alone: the
repository's 14 world-capital selection facts, every clean template of the `base` family. It is the
smallest of 0.1, 0.2, ... that opens for at most a tenth of those clean prompts, the share of clean
facts the default clean margin lets a steering cost (context_gate_fitting.csv lists each share).

    python scripts/context_gate_rates.py --out docs/results/juice_shift
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

import cpsuper as cp
from cpsuper.context_gate import prompt_token_mass
from cpsuper.data.context_tasks_loader import CONTEXT_TASK_KINDS, load_context_tasks
from cpsuper.tuning import DEFAULT_CLEAN_MARGIN

THRESHOLDS = (0.1, 0.2, 0.3, 0.4, 0.5)
POOL = "docs/results/juice_variance/defaults/stage1_per_fact.csv.gz"  # the 14-fact selection pool


def masses(model, data: cp.ConflictDataset, name: str) -> pd.DataFrame:
    return pd.concat(
        [
            pd.DataFrame({"set": name, "prompt_type": c, "mass": prompt_token_mass(model, data.prompts(c)).numpy()})
            for c in data.conflict_types
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="juice_shift")
    parser.add_argument("--n-facts", type=int, default=30, help="known facts per relation and family")
    parser.add_argument("--n-items", type=int, default=40, help="items per context-direction task")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = cp.load_model()

    capitals = cp.load_relation("world_capital")
    pool = sorted(set(pd.read_csv(POOL).subject))
    fitting = pd.concat(
        [
            masses(model, capitals.dataset(subjects=pool, tokenizer=model, paraphrase=i).with_prompts(["clean"]), "")
            for i in range(len(capitals.wording("base").clean))
        ]
    )
    tenths = [round(0.1 * i, 1) for i in range(1, 11)]
    shares = pd.DataFrame({"threshold": tenths, "clean_open": [(fitting.mass >= t).mean() for t in tenths]})
    shares.assign(n_prompts=len(fitting)).round(4).to_csv(out / "context_gate_fitting.csv", index=False)
    chosen = float(shares[shares.clean_open <= DEFAULT_CLEAN_MARGIN].threshold.min())
    print(shares.round(3).to_string(index=False), f"\nthreshold {chosen}")

    frames = []
    for name in ("world_capital", "official_language", "book_author"):
        relation = cp.load_relation(name)
        base = relation.dataset(tokenizer=model, paraphrase="random", seed=0)
        known = [e.subject for e in cp.filter_known(model, base, progress=False)][: args.n_facts]
        for family in relation.family_names:
            data = relation.dataset(subjects=known, tokenizer=model, family=family, paraphrase="random", seed=1)
            frames.append(masses(model, data, f"{name}/{family}"))
    for kind in CONTEXT_TASK_KINDS:
        frames.append(masses(model, load_context_tasks(kind)[: args.n_items], kind))
    per_prompt = pd.concat(frames, ignore_index=True)
    rates = per_prompt.groupby(["set", "prompt_type"], sort=False).mass.agg(
        n="size", **{f"open_at_{t:g}": (lambda m, t=t: (m >= t).mean()) for t in THRESHOLDS}
    )
    rates = rates.reset_index().assign(chosen_threshold=chosen)
    rates.round(3).to_csv(out / "context_gate_rates.csv", index=False)
    print(rates.round(2).to_string(index=False))


if __name__ == "__main__":
    main()
