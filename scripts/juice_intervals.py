"""Bootstrap intervals for the committed JuICE evaluations (no model run needed).

    python scripts/juice_intervals.py

Reads the per-fact results that scripts/juice_transfer.py and scripts/juice_context.py wrote
(docs/results/juice_*/per_example.csv) and writes, beside them:

- table_ci.csv: accuracy per method x relation x conflict type with a 95 % percentile bootstrap
  interval over facts, plus the pooled row "all relations" (every held-out fact counted once);
- paired_ci.csv: paired differences between methods on the same facts (same resamples).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

import cpsuper as cp

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
PAIRS = [("JuICE", "Original"), ("JuICE", "JuNe"), ("PH3 (large dev, 55)", "JuICE"), ("PH3 (small dev)", "JuICE")]
CONTEXT_PAIRS = [("JuICE", "Original"), ("JuICE", "JuNe"), ("CAD", "JuICE"), ("PH3 (small dev)", "JuICE")]


def with_fact_ids(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.assign(fact=frame["relation"].astype(str) + "/" + frame["example"].astype(str))


def accuracy_table(frame: pd.DataFrame) -> pd.DataFrame:
    per_relation = cp.stats.bootstrap_summary(
        frame, value="correct", by=["method", "relation", "conflict_type"], unit="fact"
    )
    pooled = cp.stats.bootstrap_summary(frame, value="correct", by=["method", "conflict_type"], unit="fact")
    pooled.insert(1, "relation", "all relations")
    table = pd.concat([per_relation, pooled], ignore_index=True)
    table["accuracy"] = cp.stats.ci_strings(table)
    return table


def paired(frame: pd.DataFrame, pairs) -> pd.DataFrame:
    rows = []
    for a, b in pairs:
        if not {a, b} <= set(frame["method"]):
            continue
        for by in (["relation", "conflict_type"], ["conflict_type"]):
            out = cp.stats.paired_summary(frame, a=a, b=b, value="correct", by=by, unit="fact")
            if "relation" not in out:
                out.insert(0, "relation", "all relations")
            rows.append(out.assign(a=a, b=b))
    table = pd.concat(rows, ignore_index=True)
    table["difference"] = [
        cp.stats.format_ci(m, lo, hi) for m, lo, hi in zip(table["diff"], table.ci_low, table.ci_high)
    ]
    table["supported"] = (table.ci_low > 0) | (table.ci_high < 0)
    return table


def main() -> None:
    for name, pairs in (("juice_transfer", PAIRS), ("juice_context", CONTEXT_PAIRS)):
        folder = RESULTS / name
        frame = with_fact_ids(pd.read_csv(folder / "per_example.csv"))
        accuracy_table(frame).to_csv(folder / "table_ci.csv", index=False)
        diffs = paired(frame, pairs)
        diffs.to_csv(folder / "paired_ci.csv", index=False)
        pooled = diffs[diffs.relation == "all relations"]
        print(name)
        print(pooled[["a", "b", "conflict_type", "difference", "n", "supported"]].to_string(index=False))


if __name__ == "__main__":
    main()
