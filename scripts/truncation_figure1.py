"""The truncation paper's Figure 1 on the embedded model: an indirect-object sentence in which
"a" replaces "the" (so " the" never appears in the context), and the probability of four
candidates (the indirect object, the subject, " them", " the") as one MLP input matrix of one
layer is replaced by its rank-floor(rho * 640) approximation, for every layer and rho.

Writes, under --out:

- ``per_setting.csv``: one row per matrix x layer x rho x candidate (``p``, ``p_clean``, ``delta``);
  drops of the whole MLP appear with ``edit = "drop"`` and ``rho`` empty;
- ``best_layers.csv``: per matrix x layer, the rho that raises p(indirect object) most and the
  four candidates' probabilities there, sorted by that gain;
- ``timing.json``: seconds taken and the settings.

    HF_HUB_OFFLINE=1 python scripts/truncation_figure1.py --out docs/results/truncation_figure1
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pandas as pd

import cpsuper as cp

TEMPLATE = "When {io} and {s} went to a store, {s} gave a drink to"
RHOS = (0.01, 0.05, 0.1, 0.2, 0.5, 0.8, 1.0)
MATRICES = ("mlp_in", "mlp_gate")


def figure1(model, io: str, subject: str, rhos=RHOS, matrices=MATRICES) -> pd.DataFrame:
    """The sweep as one tidy frame (columns of ``TruncationResult.per_example`` plus ``delta``)."""
    prompt = TEMPLATE.format(io=io, s=subject)
    candidates = {"io": f" {io}", "subject": f" {subject}", "them": " them"}
    frames = []
    for k, which in enumerate(matrices):
        res = cp.truncation_sweep(
            model, prompt, rhos=rhos, which=which, candidates=candidates, drop=(k == 0), progress=False
        )
        frames.append(res.per_example)
    table = pd.concat(frames, ignore_index=True)
    table["delta"] = table["p"] - table["p_clean"]
    keep = ["prompt", "edit", "matrix", "layer", "rho", "rank", "candidate", "token", "p", "p_clean", "delta"]
    return table[[c for c in keep if c in table.columns]]


def best_layers(table: pd.DataFrame) -> pd.DataFrame:
    """Per matrix x layer, the setting with the largest gain in p(io), with all candidates there."""
    table = table.assign(rho=table["rho"].fillna(0.0))  # a drop is rho = 0 (no MLP biases on Gemma)
    wide = table.pivot_table(index=["edit", "matrix", "layer", "rho"], columns="candidate", values="p").reset_index()
    clean = table.drop_duplicates("candidate").set_index("candidate")["p_clean"]
    wide["io_gain"] = wide["io"] - clean["io"]
    best = wide.loc[wide.groupby(["edit", "matrix", "layer"])["io_gain"].idxmax()]
    return best.sort_values("io_gain", ascending=False).reset_index(drop=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="truncation_figure1")
    parser.add_argument("--io", default="Mary", help="indirect object (a single-token name)")
    parser.add_argument("--subject", default="John", help="subject (a single-token name)")
    parser.add_argument("--summarise-only", action="store_true", help="rebuild best_layers.csv from per_setting.csv")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.summarise_only:
        best = best_layers(pd.read_csv(out / "per_setting.csv"))
        best.to_csv(out / "best_layers.csv", index=False, float_format="%.6g")
        print(best.head(10).to_string())
        return
    start = time.perf_counter()
    model = cp.load_model()
    loaded = time.perf_counter()
    table = figure1(model, args.io, args.subject)
    swept = time.perf_counter()
    table.to_csv(out / "per_setting.csv", index=False, float_format="%.6g")
    best = best_layers(table)
    best.to_csv(out / "best_layers.csv", index=False, float_format="%.6g")
    timing = {
        "prompt": TEMPLATE.format(io=args.io, s=args.subject),
        "rhos": list(RHOS),
        "matrices": list(MATRICES),
        "load_s": round(loaded - start, 1),
        "sweep_s": round(swept - loaded, 1),
    }
    (out / "timing.json").write_text(json.dumps(timing, indent=2) + "\n")
    print(best.head(10).to_string())
    print(timing)


if __name__ == "__main__":
    main()
