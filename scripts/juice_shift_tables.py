"""Markdown tables of a JuICE shift study (scripts/juice_shift.py) from its per_draw.csv.

One table per metric: a row per test set and recipe, a column per method, each cell
``clean / substitution / coherent`` as mean over draws with a 95 % bootstrap interval over draws
and the worst draw. Works on a study that stopped early (it reads only finished draws).

``JuICE, context only`` is JuICE applied only to prompts that carry a context: its clean cells
are the unsteered model's on the same draw, its conflict cells JuICE's (what an application that
knows which prompts hold a retrieved or given context would see).

    python scripts/juice_shift_tables.py docs/results/juice_shift/world_capital/per_draw.csv
"""

from __future__ import annotations

import argparse

import pandas as pd

from cpsuper.variance import summarize_draws

TYPES = ("clean", "substitution", "coherent")


def cell(rows: pd.DataFrame) -> str:
    by = rows.set_index("conflict_type")
    means = " / ".join(f"{by.loc[c, 'mean']:.2f}" for c in TYPES)
    intervals = " / ".join(f"[{by.loc[c, 'ci_low']:.2f}, {by.loc[c, 'ci_high']:.2f}]" for c in TYPES)
    worst = " / ".join(f"{by.loc[c, 'worst']:.2f}" for c in TYPES)
    return f"{means}<br>{intervals}<br>worst {worst}"


CONTEXT_ONLY = "JuICE, context only"


def with_context_only(per_draw: pd.DataFrame) -> pd.DataFrame:
    """per_draw plus :data:`CONTEXT_ONLY` rows: JuICE's conflict rows, Original's clean rows."""
    juice, original = per_draw[per_draw.method == "JuICE"], per_draw[per_draw.method == "Original"]
    gated = pd.concat([juice[juice.conflict_type != "clean"], original[original.conflict_type == "clean"]])
    return pd.concat([per_draw, gated.assign(method=CONTEXT_ONLY)], ignore_index=True)


def tables(per_draw: pd.DataFrame, methods=("Original", "JuICE", CONTEXT_ONLY, "JuNe")) -> str:
    summary = summarize_draws(with_context_only(per_draw))
    out = []
    for metric, part in summary.groupby("metric", sort=False):
        draws = int(part.draws.max())
        present = [m for m in methods if m in set(part.method)]
        out += [f"**{metric}** ({draws} draws)", "", "| test set | recipe | " + " | ".join(present) + " |"]
        out.append("| --- | --- |" + " --- |" * len(present))
        for (test, recipe), rows in part.groupby(["test", "recipe"], sort=True):
            cells = [cell(rows[rows.method == m]) for m in present]
            out.append(f"| `{test}` | `{recipe}` | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("per_draw", nargs="+", help="per_draw.csv files (concatenated)")
    args = parser.parse_args()
    per_draw = pd.concat([pd.read_csv(p) for p in args.per_draw], ignore_index=True)
    print(tables(per_draw))


if __name__ == "__main__":
    main()
