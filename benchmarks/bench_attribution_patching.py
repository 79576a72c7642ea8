"""Benchmark: attribution patching against exact patching of every query head, on the same facts.

The first --facts world-capital facts the model knows (``filter_known``), clean -> substitution,
logit difference. Attribution patching: ``attribution_patching`` (every head and every (layer,
position) of resid_pre, attn_out and mlp_out: one source forward, one destination forward and
backward per batch). Exact: ``exact_head_patching`` (one patched run per head and fact through
the sweep engine, resumed at the patched layer). Prints wall times and their ratio as JSON.

Run: ``OMP_NUM_THREADS=1 python benchmarks/bench_attribution_patching.py`` (``--model tiny-gemma``
for a smoke run).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import cpsuper as cp
from cpsuper.attribution_patching import attribution_patching, exact_head_patching


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--facts", type=int, default=8)
    parser.add_argument("--sample", type=int, default=40)
    args = parser.parse_args()

    model = cp.load_model(args.model, device="cpu", dtype=torch.float32)
    data = cp.conflict_dataset("world_capital", n=args.sample, seed=0, tokenizer=model)
    if args.model.startswith("tiny"):
        data = data[list(range(args.facts))]  # a random model knows nothing
    else:
        known = cp.filter_known(model, data, progress=False)
        data = known[list(range(min(args.facts, len(known))))]

    start = time.perf_counter()
    attribution_patching(model, data, progress=False)
    attribution = time.perf_counter() - start
    start = time.perf_counter()
    exact_head_patching(model, data, progress=False)
    exact = time.perf_counter() - start
    report = {
        "model": args.model,
        "facts": len(data),
        "threads": torch.get_num_threads(),
        "heads": model.cfg.n_layers * model.cfg.n_heads,
        "attribution_patching_s": round(attribution, 2),
        "exact_head_patching_s": round(exact, 2),
        "speed_up": round(exact / attribution, 2),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
