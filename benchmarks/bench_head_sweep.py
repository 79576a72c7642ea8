"""Benchmark: a per-head scaling sweep, naive TransformerLens loop vs cpsuper's sweep engine.

The subset (documented in docs/superposition.md): the embedded Gemma-3-270M, layers 5, 11 and
17, all 4 query heads, scales 0, 0.5 and 2, on 4 substitution-conflict prompts of the
world-capital relation; answer = the parametric answer's first token.

Naive: one ``run_with_hooks`` per (layer, head, scale, prompt), full logits at every position,
softmax at the last one. cpsuper: ``answer_probabilities`` (one clean run, resume from the
edited layer, many rows per batch, final position only).

Run: ``python benchmarks/bench_head_sweep.py`` (add ``--model tiny-gemma`` for a smoke run).
"""

from __future__ import annotations

import argparse
import time

import torch

import cpsuper as cp
from cpsuper.edits import HeadEdit
from cpsuper.engine import answer_probabilities
from cpsuper.interventions import ScaleHead, intervene
from cpsuper.runtime import answer_token, tokenize_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--layers", type=int, nargs="+", default=None)
    parser.add_argument("--scales", type=float, nargs="+", default=[0.0, 0.5, 2.0])
    parser.add_argument("--n-prompts", type=int, default=4)
    args = parser.parse_args()

    model = cp.load_model(args.model, device="cpu")
    n = model.cfg.n_layers
    layers = args.layers or sorted({n // 3 - 1, 2 * n // 3 - 1, n - 1})
    data = cp.conflict_dataset("world_capital", n=args.n_prompts, seed=0, tokenizer=model)
    prompts = data.prompts("substitution")
    ids = torch.tensor([[answer_token(model, e.answer, p)] for e, p in zip(data, prompts)])
    grid = [(l, h, s) for l in layers for h in range(model.cfg.n_heads) for s in args.scales]
    print(
        f"{args.model}: layers {layers}, {model.cfg.n_heads} heads, scales {args.scales}, "
        f"{len(prompts)} substitution prompts -> {len(grid) * len(prompts)} intervened runs"
    )

    start = time.perf_counter()
    naive = torch.empty(len(prompts), len(grid))
    with torch.inference_mode():
        for c, (layer, head, scale) in enumerate(grid):
            for i, prompt in enumerate(prompts):
                with intervene(model, ScaleHead(layer, head, scale)):
                    logits = model(prompt)
                naive[i, c] = logits[0, -1].softmax(-1)[ids[i, 0]]
    t_naive = time.perf_counter() - start

    start = time.perf_counter()
    _, fast = answer_probabilities(
        model, tokenize_prompts(model, prompts), ids, [[HeadEdit(l, h, scale=s)] for l, h, s in grid], progress=False
    )
    t_fast = time.perf_counter() - start

    diff = (fast[:, :, 0] - naive).abs().max().item()
    print(f"naive run_with_hooks loop: {t_naive:8.2f} s")
    print(f"cpsuper sweep engine:      {t_fast:8.2f} s")
    print(f"speedup: {t_naive / t_fast:.1f}x   max |difference| of probabilities: {diff:.2e}")


if __name__ == "__main__":
    main()
