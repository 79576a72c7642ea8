"""Causal tracing on world capitals with the embedded Gemma-3-270M (docs/results/tracing.md).

    OMP_NUM_THREADS=1 python scripts/causal_trace.py --out docs/results/tracing
    python scripts/causal_trace.py --out docs/results/tracing --from-results   # tables and figure only

Facts: world capitals whose agreeing prompt (the substitution prompt with the memorised capital in
place of the distractor) has as many tokens as the substitution prompt, then those the model
answers (cp.filter_known), the first ``--facts``. Pairs: clean -> substitution and agreeing ->
substitution, float32, one CPU thread. Writes per_example.csv.gz, span_intervals.csv,
position_intervals.csv, tables.md (the results page's tables), timing.json and causal_trace.png.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pandas as pd
import torch

import cpsuper as cp
from cpsuper.plots.export import save_figure
from cpsuper.plots.tracing import plot_causal_trace
from cpsuper.spans import SPAN_GROUPS
from cpsuper.stats import bootstrap_summary, format_ci
from cpsuper.tracing import TraceResult, agreeing_prompt, causal_trace

PAIRS = [("clean", "substitution"), ("agreeing", "substitution")]
BANDS = {"early": range(0, 6), "middle": range(6, 12), "late": range(12, 18)}


def facts(model, n: int) -> cp.ConflictDataset:
    data = cp.conflict_dataset("world_capital", seed=0, tokenizer=model)
    same = [
        i
        for i, e in enumerate(data)
        if len(model.to_tokens(agreeing_prompt(e, "substitution")[0])[0])
        == len(model.to_tokens(e.prompts["substitution"])[0])
    ]
    return cp.filter_known(model, data[same], progress=False)[:n]


def band_table(per: pd.DataFrame, value: str, target: str) -> str:
    """Mean ``value`` per pair x site x span (rows) and layer band (columns), 95 % intervals over facts."""
    rows = per[(per["target"] == target) & per[value].notna()].copy()
    rows["band"] = rows["layer"].map({l: b for b, r in BANDS.items() for l in r})
    out = bootstrap_summary(rows, value=value, by=["source", "site", "span", "band"], unit="example")
    bands = [b for b in BANDS if b in set(out["band"])]
    lines = [f"| pair | site | span | {' | '.join(bands)} |", "| --- | --- | --- |" + " --- |" * len(bands)]
    order = {s: i for i, s in enumerate(SPAN_GROUPS)}
    out["o"] = out["span"].map(order)
    for (source, site, span), part in out.sort_values(["source", "site", "o"]).groupby(
        ["source", "site", "span"], sort=False
    ):
        cells = {r.band: format_ci(r.mean, r.ci_low, r.ci_high) for r in part.itertuples()}
        lines.append(
            f"| {source} → substitution | {site} | {span} | " + " | ".join(cells.get(b, "") for b in bands) + " |"
        )
    return "\n".join(lines)


def write_tables(per: pd.DataFrame, out: Path) -> None:
    result = TraceResult.from_per_example(per)
    result.intervals("delta", by="span").to_csv(out / "span_intervals.csv", index=False)
    result.intervals("delta", by="position").to_csv(out / "position_intervals.csv", index=False)
    parts = []
    for target in ("parametric", "context"):
        parts.append(f"### delta of p({target}), per span and layer band\n\n{band_table(per, 'delta', target)}\n")
    parts.append(f"### restored share of p(parametric)\n\n{band_table(per, 'restored', 'parametric')}\n")
    (out / "tables.md").write_text("\n".join(parts))
    figure = plot_causal_trace(result, value="delta", target="parametric")
    try:
        save_figure(figure, out / "causal_trace", formats="png")
    except (ImportError, RuntimeError, ValueError) as error:  # no kaleido / browser: the data stay
        print(f"figure not written: {error}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("docs/results/tracing"))
    parser.add_argument("--facts", type=int, default=10)
    parser.add_argument("--layers", default="0,4,8,12,16", help="comma-separated layers")
    parser.add_argument("--from-results", action="store_true", help="redo tables and figure from per_example.csv.gz")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.from_results:
        torch.set_num_threads(1)
        model = cp.load_model(dtype=torch.float32)
        data = facts(model, args.facts)
        layers = [int(x) for x in args.layers.split(",")]
        start = time.perf_counter()
        result = causal_trace(model, data, pairs=PAIRS, layers=layers, target=("parametric", "context"), min_gap=0.05)
        seconds = time.perf_counter() - start
        result.per_example.to_csv(args.out / "per_example.csv.gz", index=False)
        timing = {
            "seconds": round(seconds, 1),
            "facts": len(data),
            "subjects": [e.subject for e in data],
            "layers": layers,
            "pairs": PAIRS,
            "rows": len(result.per_example),
            "threads": torch.get_num_threads(),
            "dtype": str(model.cfg.dtype),
        }
        (args.out / "timing.json").write_text(json.dumps(timing, indent=1) + "\n")
        print(json.dumps(timing))
    write_tables(pd.read_csv(args.out / "per_example.csv.gz", keep_default_na=False, na_values=[""]), args.out)


if __name__ == "__main__":
    main()
