"""The logit lens on world-capital conflicts known to the embedded model, with bootstrap intervals.

The first 20 world-capital facts that Gemma-3-270M (float32) answers correctly on the clean prompt
(``filter_known``) are read through the logit lens (``cpsuper.lens.logit_lens``) on clean,
substitution and coherent prompts: the memorised and the context answer's first-token
probability, log-probability and rank after every layer, with 95 % percentile bootstrap
intervals over facts.

Writes, under --out:

- ``per_example.csv.gz``: every value (example x conflict type x target x layer);
- ``summary.csv``: per conflict type x target x layer, the mean probability and log-probability,
  median rank and share of facts at rank 1, each with ``*_low`` / ``*_high`` bounds, and ``n``;
- ``context_wins.csv``: per conflict type x layer, the share of facts whose context answer
  outranks the memorised one, with its interval;
- ``timing.json``: seconds taken, the facts and the settings;
- ``logit_lens_probability.png`` and ``logit_lens_rank.png`` where figure export works.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python scripts/logit_lens.py --out docs/results/logit_lens
    python scripts/logit_lens.py --out docs/results/logit_lens --summarise-only   # tables and figures from the CSVs
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pandas as pd

import cpsuper as cp
from cpsuper.lens import LogitLens, logit_lens
from cpsuper.stats import bootstrap_summary, format_ci

N_FACTS = 20
N_BOOT = 2000
SEED = 0


def context_wins(result: LogitLens) -> pd.DataFrame:
    """Per conflict type x layer: the share of facts whose context answer has the better rank."""
    wide = result.wide("rank")
    wide["context_wins"] = (wide.context < wide.parametric).astype(float)
    out = bootstrap_summary(wide, value="context_wins", by=["conflict_type", "layer"], n_boot=N_BOOT, seed=SEED)
    return out.rename(columns={"mean": "share", "ci_low": "share_low", "ci_high": "share_high"})


def first_layer(summary: pd.DataFrame, conflict_type: str, target: str) -> int | None:
    """The first layer at which the target's median rank is 1 (None: never)."""
    part = summary[(summary.conflict_type == conflict_type) & (summary.target == target)]
    top = part[part["rank"] == 1]
    return int(top.layer.min()) if len(top) else None


def print_tables(summary: pd.DataFrame, wins: pd.DataFrame) -> None:
    """The results page's tables, as Markdown."""
    for conflict_type in dict.fromkeys(summary.conflict_type):
        print(f"\n{conflict_type}: mean probability and median rank [95% CI]")
        print("| layer | memorised p | context p | memorised rank | context rank |")
        print("| --- | --- | --- | --- | --- |")
        part = summary[summary.conflict_type == conflict_type].set_index(["target", "layer"])
        for layer in sorted(set(part.index.get_level_values(1))):
            rows = [part.loc[(target, layer)] for target in ("parametric", "context")]
            cells = [format_ci(r.probability, r.probability_low, r.probability_high, digits=3) for r in rows]
            cells += [format_ci(r["rank"], r.rank_low, r.rank_high, digits=0) for r in rows]
            print(f"| {layer} | " + " | ".join(cells) + " |")
    for conflict_type in dict.fromkeys(summary.conflict_type):
        for target in ("parametric", "context"):
            layer = first_layer(summary, conflict_type, target)
            print(f"first layer with median rank 1, {conflict_type} / {target}: {layer}")
    print("\nshare of facts whose context answer outranks the memorised one")
    print(wins.round(3).to_string(index=False))


def draw(result: LogitLens, out: Path) -> None:
    """The two figures of the results page, where figure export works (kaleido and a browser)."""
    try:
        for value in ("probability", "rank"):
            fig = cp.plots.plot_logit_lens(result, value=value)
            cp.plots.save_figure(fig, out / f"logit_lens_{value}", formats="png", scale=1.0)
    except Exception as error:  # the CSVs are the results; a figure is a view of them
        print(f"figures not written: {error}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="logit_lens")
    parser.add_argument(
        "--summarise-only", action="store_true", help="print the tables and redraw the figures from the CSVs"
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.summarise_only:
        start = time.perf_counter()
        model = cp.load_model()  # float32
        loaded = time.perf_counter()
        known = cp.filter_known(model, cp.conflict_dataset("world_capital", tokenizer=model))
        facts = known[:N_FACTS]
        filtered = time.perf_counter()
        result = logit_lens(model, facts, batch_size=16, n_boot=N_BOOT, seed=SEED)
        done = time.perf_counter()
        result.per_example.to_csv(out / "per_example.csv.gz", index=False, float_format="%.6g")
        result.summary.to_csv(out / "summary.csv", index=False, float_format="%.6g")
        context_wins(result).to_csv(out / "context_wins.csv", index=False, float_format="%.6g")
        timing = {
            "load_s": round(loaded - start, 1),
            "filter_known_s": round(filtered - loaded, 1),
            "logit_lens_s": round(done - filtered, 1),
            "known_facts": len(known),
            "facts": [f"{e.subject}: {e.answer} (context {e.context_answer})" for e in facts],
            "n_layers": model.cfg.n_layers,
            "dtype": str(model.cfg.dtype),
            "n_boot": N_BOOT,
            "seed": SEED,
        }
        (out / "timing.json").write_text(json.dumps(timing, indent=1) + "\n")
    summary = pd.read_csv(out / "summary.csv")
    n_layers = json.loads((out / "timing.json").read_text())["n_layers"]
    draw(LogitLens(pd.read_csv(out / "per_example.csv.gz"), summary, n_layers), out)
    print_tables(summary, pd.read_csv(out / "context_wins.csv"))


if __name__ == "__main__":
    main()
