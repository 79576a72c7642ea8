"""Truncation and MLP drops on world-capital conflicts, with bootstrap intervals over facts.

The first 30 world-capital facts the embedded model knows (``filter_known``) are swept: ``mlp_in``
kept at rho in {0.01, 0.05, 0.2} and the whole MLP dropped, at every layer, on clean,
substitution and coherent prompts. The settings the docs single out are then checked on the next
30 known facts. Every mean comes with a 95 % percentile bootstrap interval over facts, and every
change from the unedited model with a paired one (each fact is its own control).

Writes, under --out:

- ``selection_per_example.csv.gz`` / ``heldout_per_example.csv.gz``: every probability;
- ``selection_intervals.csv`` / ``heldout_intervals.csv``: per setting x conflict type x
  candidate, ``p`` and ``delta`` (= p - p_clean) with ``*_low`` / ``*_high`` bounds and ``n``;
- ``timing.json``: seconds taken and the settings.

    HF_HUB_OFFLINE=1 python scripts/truncation_capitals.py --out docs/results/truncation_capitals
    python scripts/truncation_capitals.py --out docs/results/truncation_capitals --summarise-only
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pandas as pd

import cpsuper as cp
from cpsuper.truncation import TruncationResult, truncation_sweep

N_FACTS = 30
RHOS = (0.01, 0.05, 0.2)
N_BOOT = 2000
# (label, conflict type, candidate): the measures the docs' tables show.
MEASURES = [
    ("clean p(true)", "clean", "correct"),
    ('clean p(" the")', "clean", "generic"),
    ("subst. p(context)", "substitution", "correct"),
    ("subst. p(true)", "substitution", "parametric"),
    ("coherent p(context)", "coherent", "correct"),
]


def intervals(result: TruncationResult) -> pd.DataFrame:
    """``p`` and ``delta`` with their intervals, one row per setting x conflict type x candidate."""
    p = result.intervals("p", n_boot=N_BOOT)
    keys = [c for c in p.columns if c not in ("mean", "ci_low", "ci_high", "n")]
    p = p.rename(columns={"mean": "p", "ci_low": "p_low", "ci_high": "p_high"})
    for value in ("p_clean", "delta"):
        extra = result.intervals(value, n_boot=N_BOOT).drop(columns="n")
        extra = extra.rename(columns={"mean": value, "ci_low": f"{value}_low", "ci_high": f"{value}_high"})
        p = p.merge(extra, on=keys)
    return p


def heldout(model, facts) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The settings chosen on the selection facts, on other facts."""
    runs = [
        truncation_sweep(model, facts, layers=[0, 1, 16], rhos=[0.2], which="mlp_in", batch_size=32),
        truncation_sweep(model, facts, layers=[16], rhos=[0.01], which="mlp_gate", drop=False, batch_size=32),
    ]
    return pd.concat([r.per_example for r in runs], ignore_index=True), pd.concat(map(intervals, runs))


def significant_counts(table: pd.DataFrame) -> pd.DataFrame:
    """Per measure x setting kind: at how many layers the change is significantly up / down."""
    rows = []
    for label, conflict_type, candidate in MEASURES:
        part = table[(table.conflict_type == conflict_type) & (table.candidate == candidate)]
        for setting, group in part.groupby(part.edit.where(part.edit == "drop", part.rho.astype(str))):
            rows.append(
                {
                    "measure": label,
                    "setting": setting,
                    "layers": len(group),
                    "up": int((group.delta_low > 0).sum()),
                    "down": int((group.delta_high < 0).sum()),
                }
            )
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="truncation_capitals")
    parser.add_argument("--summarise-only", action="store_true", help="print the tables from the CSVs")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.summarise_only:
        start = time.perf_counter()
        model = cp.load_model()
        known = cp.filter_known(model, cp.conflict_dataset("world_capital", tokenizer=model))
        loaded = time.perf_counter()
        selection = truncation_sweep(model, known[:N_FACTS], rhos=RHOS, which="mlp_in", batch_size=32)
        swept = time.perf_counter()
        selection.per_example.to_csv(out / "selection_per_example.csv.gz", index=False, float_format="%.6g")
        intervals(selection).to_csv(out / "selection_intervals.csv", index=False, float_format="%.6g")
        per, table = heldout(model, known[N_FACTS : 2 * N_FACTS])
        per.to_csv(out / "heldout_per_example.csv.gz", index=False, float_format="%.6g")
        table.to_csv(out / "heldout_intervals.csv", index=False, float_format="%.6g")
        done = time.perf_counter()
        timing = {
            "load_s": round(loaded - start, 1),
            "selection_sweep_s": round(swept - loaded, 1),
            "heldout_s": round(done - swept, 1),
            "known_facts": len(known),
            "selection": [e.subject for e in known[:N_FACTS]],
            "heldout": [e.subject for e in known[N_FACTS : 2 * N_FACTS]],
            "rhos": list(RHOS),
            "n_boot": N_BOOT,
        }
        (out / "timing.json").write_text(json.dumps(timing, indent=1) + "\n")
    table = pd.read_csv(out / "selection_intervals.csv")
    print(significant_counts(table).to_string(index=False))
    held = pd.read_csv(out / "heldout_intervals.csv")
    for label, conflict_type, candidate in MEASURES:
        part = held[(held.conflict_type == conflict_type) & (held.candidate == candidate)]
        first = part.iloc[0]
        print(label, "full model", cp.stats.format_ci(first.p_clean, first.p_clean_low, first.p_clean_high))
        for row in part.itertuples():
            print(
                f"  {row.edit:8s} {row.matrix:9s} L{row.layer:<2d} rho={row.rho!s:5s} "
                f"{cp.stats.format_ci(row.p, row.p_low, row.p_high)}  "
                f"delta {cp.stats.format_ci(row.delta, row.delta_low, row.delta_high)}"
            )


if __name__ == "__main__":
    main()
