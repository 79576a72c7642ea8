"""Benchmark: causal tracing, a naive hook loop against cpsuper.tracing.causal_trace.

Naive: one ``run_with_hooks`` per (prompt, site, layer, position), each a full forward pass with
logits at every position, the patched value taken from a clean source run cached once per fact.
cpsuper: ``causal_trace`` (the sweep engine: one clean run per prompt, patched rows resumed at
their layer, many rows per forward pass, final position only). Both read the first-token
probability of the memorised answer; the largest difference between the two is reported.

Run: ``OMP_NUM_THREADS=1 python benchmarks/bench_tracing.py`` (``--model tiny-gemma`` for a
smoke run; ``--json PATH`` writes the numbers).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import cpsuper as cp
from cpsuper.runtime import answer_token, tokenize_prompts
from cpsuper.tracing import causal_trace

HOOKS = {
    "resid_pre": "blocks.{}.hook_resid_pre",
    "attn_out": "blocks.{}.hook_attn_out",
    "mlp_out": "blocks.{}.hook_mlp_out",
}


def naive_trace(model, data, sites, layers, positions) -> dict:
    """{(example, site, layer, position): p} from one run_with_hooks per patched run."""
    out = {}
    with torch.inference_mode():
        for i, example in enumerate(data):
            src_prompt, dst_prompt = example.prompts["clean"], example.prompts["substitution"]
            src, dst = tokenize_prompts(model, [src_prompt, dst_prompt])
            answer = answer_token(model, example.answer, dst_prompt)
            _, cache = model.run_with_cache(torch.tensor([src]))
            for site in sites:
                for layer in layers:
                    name = HOOKS[site].format(layer)
                    for position in positions:
                        d, s = len(dst) + position, len(src) + position

                        def patch(act, hook, d=d, s=s, name=name, cache=cache):
                            act[0, d] = cache[name][0, s]
                            return act

                        logits = model.run_with_hooks(torch.tensor([dst]), fwd_hooks=[(name, patch)])
                        out[i, site, layer, position] = float(logits[0, -1].softmax(-1)[answer])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--facts", type=int, default=2)
    parser.add_argument("--layers", type=int, nargs="+", default=[0, 6, 12])
    parser.add_argument("--positions", type=int, nargs="+", default=list(range(-8, 0)))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    model = cp.load_model(args.model, device="cpu")
    data = cp.conflict_dataset("world_capital", n=args.facts, seed=0, tokenizer=model)
    sites = ("resid_pre", "attn_out", "mlp_out")
    runs = len(data) * len(sites) * len(args.layers) * len(args.positions)
    print(
        f"{args.model}: {len(data)} facts x {len(sites)} sites x layers {args.layers} x "
        f"{len(args.positions)} positions = {runs} runs"
    )

    start = time.perf_counter()
    naive = naive_trace(model, data, sites, args.layers, args.positions)
    t_naive = time.perf_counter() - start
    start = time.perf_counter()
    trace = causal_trace(model, data, sites=sites, layers=args.layers, positions=args.positions, progress=False)
    t_fast = time.perf_counter() - start

    per = trace.per_example
    diff = max(abs(r.p - naive[r.example, r.site, r.layer, r.position]) for r in per.itertuples())
    report = {
        "model": args.model,
        "runs": runs,
        "rows": len(per),
        "threads": torch.get_num_threads(),
        "naive_seconds": round(t_naive, 2),
        "causal_trace_seconds": round(t_fast, 2),
        "speedup": round(t_naive / t_fast, 2),
        "max_abs_difference": float(diff),
    }
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
