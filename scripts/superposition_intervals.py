"""Superposition on the embedded model with uncertainty: which head flips are significant, the
roles of every head across conflict types, Table 1 with intervals.

    python scripts/superposition_intervals.py --out docs/results/superposition

Runs one head sweep (every head knocked out, both targets, all three conflict types) on the
first 16 world-capital facts the model knows (as in docs/superposition.md) and writes CSV files
plus a short summary JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import cpsuper as cp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/results/superposition"))
    parser.add_argument("--n", type=int, default=40, help="world-capital facts to screen")
    parser.add_argument("--facts", type=int, default=16, help="known facts to sweep (the first ones found)")
    parser.add_argument("--n-boot", type=int, default=2000)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    start, cpu = time.time(), time.process_time()
    model = cp.load_model()
    known = cp.filter_known(model, cp.conflict_dataset("world_capital", n=args.n, tokenizer=model))[: args.facts]
    sweep = cp.head_sweep(model, known, (0.0,))
    sweep.per_example.to_csv(args.out / "head_sweep_per_example.csv", index=False)

    heads = cp.superposition_heads(sweep, n_boot=args.n_boot)
    heads.to_csv(args.out / "superposition_heads.csv", index=False)
    roles = cp.head_roles(sweep, n_boot=args.n_boot)
    roles.to_csv(args.out / "head_roles.csv", index=False)
    transitions = cp.role_transitions(roles, "substitution", "coherent")
    transitions.to_csv(args.out / "role_transitions_substitution_to_coherent.csv")
    intervals = sweep.intervals(n_boot=args.n_boot)
    intervals.to_csv(args.out / "head_sweep_intervals.csv", index=False)

    summary = {
        "facts": len(known),
        "heads": heads.attrs["counts"]["heads"],
        "sign_changes": heads.attrs["counts"]["sign_changes"],
        "significant_flips": heads.attrs["counts"]["superposed"],
        "sign_changes_over_1e-3": int((heads.sign_change & (heads.strength > 1e-3)).sum()),
        "roles_per_type": roles.groupby("conflict_type", observed=True)["role"].value_counts().unstack().to_dict(),
        "wall_s": round(time.time() - start, 1),
        "cpu_s": round(time.process_time() - cpu, 1),
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(json.dumps(summary, indent=1, default=str))


if __name__ == "__main__":
    main()
