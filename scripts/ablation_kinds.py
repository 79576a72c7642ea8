"""Figure 3 and Table 1 under zero, mean and resample ablation (docs/results/ablation.md).

    OMP_NUM_THREADS=1 python scripts/ablation_kinds.py --out docs/results/ablation
    python scripts/ablation_kinds.py --out docs/results/ablation --from-results   # tables only

Facts: world capitals the embedded Gemma-3-270M answers (cp.filter_known), the first ``--facts``;
float32, one CPU thread. Module knockouts (attn, mlp, layer at every layer, all conflict types,
target parametric) and single-head knockouts (alpha = 0, every head, substitution and coherent,
both targets), each under the three ablation kinds; the mean is over every token of the same
facts' prompts (all conflict types), resampling uses seed 0. Writes knockouts.csv.gz and
heads.csv.gz (per fact), knockout_intervals.csv, head_intervals.csv, tables.md and timing.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

import cpsuper as cp
from cpsuper.ablation import ABLATIONS
from cpsuper.knockouts import consistent_gains
from cpsuper.stats import format_ci
from cpsuper.sweeps import SweepResult, summarize_sweep


def run(out: Path, n_facts: int) -> None:
    torch.manual_seed(0)
    model = cp.load_model(dtype=torch.float32, device="cpu")
    data = cp.filter_known(
        model, cp.conflict_dataset("world_capital", n=2 * n_facts, seed=0, tokenizer=model), progress=False
    )
    data = data[:n_facts]
    timing = {"facts": [e.subject for e in data]}
    knockouts, heads = [], []
    for kind in ABLATIONS:
        start = time.perf_counter()
        knockouts.append(cp.knockout_sweep(model, data, ablation=kind, seed=0, progress=False).per_example)
        timing[f"knockouts_{kind}_s"] = round(time.perf_counter() - start, 1)
        start = time.perf_counter()
        sweep = cp.head_sweep(
            model, data, (0.0,), conflict_types=["substitution", "coherent"], ablation=kind, seed=0, progress=False
        )
        heads.append(sweep.per_example)
        timing[f"heads_{kind}_s"] = round(time.perf_counter() - start, 1)
        print(kind, timing, flush=True)
    pd.concat(knockouts).to_csv(out / "knockouts.csv.gz", index=False)
    pd.concat(heads).to_csv(out / "heads.csv.gz", index=False)
    (out / "timing.json").write_text(json.dumps(timing, indent=1))


def _result(per: pd.DataFrame, keys: list[str]) -> SweepResult:
    return SweepResult(per, summarize_sweep(per, [*keys, "conflict_type", "target"]))


def tables(out: Path) -> None:
    knock = pd.read_csv(out / "knockouts.csv.gz")
    heads = pd.read_csv(out / "heads.csv.gz")
    kres = _result(knock, ["layer", "module", "ablation"])
    hres = _result(heads, ["layer", "head", "alpha", "ablation"])
    kci, hci = kres.intervals(), hres.intervals()
    kci.to_csv(out / "knockout_intervals.csv", index=False)
    hci.to_csv(out / "head_intervals.csv", index=False)
    parts = []

    # Figure 3: consistent gains per kind, then the per-layer effects side by side.
    lines = ["| ablation | module | layers whose knockout raises p(parametric) under every conflict type |"]
    lines.append("| --- | --- | --- |")
    for kind in ABLATIONS:
        for row in consistent_gains(kres.summary[kres.summary.ablation == kind]).itertuples():
            lines.append(f"| {kind} | {row.module} | {row.n_consistent} of {row.n_layers}: {row.layers} |")
    parts.append("### Figure 3: consistent gains\n\n" + "\n".join(lines) + "\n")
    for module in ("attn", "mlp", "layer"):
        part = kci[kci.module == module]
        types = [c for c in ("clean", "substitution", "coherent") if c in set(part.conflict_type)]
        cols = [(c, k) for c in types for k in ABLATIONS]
        head = "| layer | " + " | ".join(f"{c} {k}" for c, k in cols) + " |"
        lines = [head, "| --- |" + " --- |" * len(cols)]
        cell = {
            (r.layer, r.conflict_type, r.ablation): format_ci(r.mean, r.ci_low, r.ci_high) for r in part.itertuples()
        }
        for layer in sorted(part.layer.unique()):
            lines.append(f"| {layer} | " + " | ".join(cell.get((layer, c, k), "") for c, k in cols) + " |")
        parts.append(f"### Figure 3: delta p(parametric), {module} knockout\n\n" + "\n".join(lines) + "\n")
    # agreement of the per-layer effects between kinds
    lines = ["| module | conflict type | Spearman zero vs mean | zero vs resample | mean vs resample |"]
    lines.append("| --- | --- | --- | --- | --- |")
    for (module, ctype), part in kres.summary.groupby(["module", "conflict_type"], sort=False):
        wide = part.pivot_table(index="layer", columns="ablation", values="delta_mean")
        rho = wide.rank().corr()  # Spearman: Pearson on ranks (no scipy needed)
        lines.append(
            f"| {module} | {ctype} | {rho.loc['zero', 'mean']:.2f} | {rho.loc['zero', 'resample']:.2f} | "
            f"{rho.loc['mean', 'resample']:.2f} |"
        )
    parts.append("### Figure 3: rank agreement of per-layer effects\n\n" + "\n".join(lines) + "\n")

    # Table 1: top-4 heads by context gain in substitution conflicts, per kind.
    tops = {}
    for kind in ABLATIONS:
        table = cp.rank_heads(hres.summary[hres.summary.ablation == kind], k=4)
        tops[kind] = list(zip(table.layer, table["head"]))
        rows = hci[(hci.ablation == kind)]
        cell = {
            (r.layer, r.head, r.conflict_type, r.target): format_ci(r.mean, r.ci_low, r.ci_high)
            for r in rows.itertuples()
        }
        cols = [(c, t) for c in ("substitution", "coherent") for t in ("context", "parametric")]
        lines = ["| head | " + " | ".join(f"{c} {t}" for c, t in cols) + " |", "| --- |" + " --- |" * len(cols)]
        for l, h in tops[kind]:
            lines.append(f"| L{l}H{h} | " + " | ".join(cell[(l, h, c, t)] for c, t in cols) + " |")
        parts.append(
            f"### Table 1 under {kind} ablation (top 4 by substitution context gain)\n\n" + "\n".join(lines) + "\n"
        )
    lines = ["| ablation | top 4 | in zero's top 4 | Spearman with zero over all heads (substitution, context) |"]
    lines.append("| --- | --- | --- | --- |")
    sub = hres.summary[(hres.summary.conflict_type == "substitution") & (hres.summary.target == "context")]
    wide = sub.pivot_table(index=["layer", "head"], columns="ablation", values="delta_mean")
    for kind in ABLATIONS:
        kept = len(set(tops[kind]) & set(tops["zero"]))
        rho = wide["zero"].rank().corr(wide[kind].rank())  # Spearman
        names = ", ".join(f"L{l}H{h}" for l, h in tops[kind])
        lines.append(f"| {kind} | {names} | {kept} of 4 | {rho:.2f} |")
    parts.append("### Table 1: agreement with zero ablation\n\n" + "\n".join(lines) + "\n")
    # how large are the effects under each kind
    lines = ["| ablation | mean abs delta, heads (substitution, context) | mean abs delta, modules (p(parametric)) |"]
    lines.append("| --- | --- | --- |")
    for kind in ABLATIONS:
        h = np.abs(sub[sub.ablation == kind].delta_mean).mean()
        k = np.abs(kres.summary[kres.summary.ablation == kind].delta_mean).mean()
        lines.append(f"| {kind} | {h:.4f} | {k:.4f} |")
    parts.append("### Effect sizes\n\n" + "\n".join(lines) + "\n")
    (out / "tables.md").write_text("\n".join(parts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("docs/results/ablation"))
    parser.add_argument("--facts", type=int, default=10)
    parser.add_argument("--from-results", action="store_true", help="only rebuild the tables from saved data")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.from_results:
        run(args.out, args.facts)
    tables(args.out)


if __name__ == "__main__":
    main()
