"""Head-to-head path patching on world capitals with the embedded Gemma-3-270M
(docs/results/head_paths.md).

    OMP_NUM_THREADS=1 python scripts/head_paths.py --out docs/results/head_paths
    python scripts/head_paths.py --out docs/results/head_paths --from-results   # tables and figure only

Facts: world capitals the model answers (cp.filter_known), the first ``--facts``. Receivers: the
``--receivers`` heads with the largest mean |effect| in cp.path_patching (each head's direct path
to the logits, clean -> substitution, logit difference) on those facts. Senders: every head of
every earlier layer. Inputs q, k, v; source clean, destination substitution; float32, one CPU
thread. Writes ranking.csv, per_example.csv.gz, summary.csv, tables.md, timing.json and
head_paths.png.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pandas as pd
import torch

import cpsuper as cp
from cpsuper.head_paths import HeadPathResult, head_path_patching, head_path_summary
from cpsuper.path_patching import path_patching
from cpsuper.plots.export import save_figure
from cpsuper.plots.head_paths import plot_head_paths
from cpsuper.stats import bootstrap_summary, format_ci


def receivers_from_ranking(model, data, n: int) -> tuple[list[tuple[int, int]], pd.DataFrame]:
    per = path_patching(model, data, conflict_types="substitution", progress=False)
    ranking = bootstrap_summary(per, value="delta", by=["layer", "head"], unit="example")
    ranking = ranking.iloc[ranking["mean"].abs().argsort()[::-1]].reset_index(drop=True)
    return [(int(r.layer), int(r.head)) for r in ranking.head(n).itertuples()], ranking


def write_tables(result: HeadPathResult, ranking: pd.DataFrame, out: Path, top: int = 8) -> None:
    summary = result.summary
    summary.to_csv(out / "summary.csv", index=False)
    lines = ["### Receivers: largest direct effects on the logits (cp.path_patching)\n"]
    lines += ["| head | mean effect [95 % CI] |", "| --- | --- |"]
    lines += [
        f"| L{r.layer}H{r.head} | {format_ci(r.mean, r.ci_low, r.ci_high)} |" for r in ranking.head(5).itertuples()
    ]
    for inp in ("q", "k", "v"):
        part = summary[summary["input"] == inp].head(top)
        lines += [f"\n### Largest sender -> receiver effects through {inp}\n"]
        lines += ["| sender | receiver | mean effect [95 % CI] |", "| --- | --- | --- |"]
        lines += [
            f"| L{r.sender_layer}H{r.sender_head} | L{r.receiver_layer}H{r.receiver_head} | "
            f"{format_ci(r.mean, r.ci_low, r.ci_high)} |"
            for r in part.itertuples()
        ]
    per = result.per_example
    share = per.groupby(["receiver_layer", "receiver_head", "input"]).effect.apply(lambda e: e.abs().sum())
    lines += ["\n### Sum of |effect| over senders and facts, per receiver and input\n"]
    lines += ["| receiver | q | k | v |", "| --- | --- | --- | --- |"]
    for (layer, head), part in share.groupby(level=[0, 1]):
        cells = part.droplevel([0, 1])
        lines.append(f"| L{layer}H{head} | " + " | ".join(f"{cells.get(i, float('nan')):.2f}" for i in "qkv") + " |")
    (out / "tables.md").write_text("\n".join(lines) + "\n")
    try:
        save_figure(plot_head_paths(result), out / "head_paths", formats="png")
    except (ImportError, RuntimeError, ValueError) as error:  # no kaleido / browser: the data stay
        print(f"figure not written: {error}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("docs/results/head_paths"))
    parser.add_argument("--facts", type=int, default=8)
    parser.add_argument("--receivers", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--from-results", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.from_results:
        per = pd.read_csv(args.out / "per_example.csv.gz")
        per.attrs["metric"] = "logit_diff"
        write_tables(HeadPathResult(per, head_path_summary(per)), pd.read_csv(args.out / "ranking.csv"), args.out)
        return
    torch.manual_seed(0)
    model = cp.load_model("gemma-3-270m", device="cpu")
    data = cp.filter_known(model, cp.conflict_dataset("world_capital", seed=0, tokenizer=model), progress=False)
    data = data[: args.facts]
    start = time.perf_counter()
    receivers, ranking = receivers_from_ranking(model, data, args.receivers)
    ranked = time.perf_counter() - start
    ranking.to_csv(args.out / "ranking.csv", index=False)
    print("receivers:", receivers, "subjects:", [e.subject for e in data])
    start = time.perf_counter()
    result = head_path_patching(model, data, receivers, inputs=("q", "k", "v"), batch_size=args.batch_size)
    seconds = time.perf_counter() - start
    result.per_example.to_csv(args.out / "per_example.csv.gz", index=False)
    timing = {"facts": len(data), "receivers": receivers, "rows": len(result.per_example)}
    timing.update(
        path_patching_s=round(ranked, 1), head_path_patching_s=round(seconds, 1), threads=torch.get_num_threads()
    )
    (args.out / "timing.json").write_text(json.dumps(timing, indent=1) + "\n")
    write_tables(result, ranking, args.out)
    print(json.dumps(timing))


if __name__ == "__main__":
    main()
