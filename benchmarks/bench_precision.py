"""Benchmark: a head sweep in float32 against the same sweep under ``cp.precision.mixed_precision`` (bf16).

Workload: every query head knocked out (and scaled by 2) on the known world-capital facts of
the embedded Gemma-3-270M, three conflict types, both targets; the sweep engine as a user calls
it (``cp.head_sweep``). Reports wall time of each precision (best of ``--repeats``), the speed-up,
the largest difference in any probability (``p_clean`` and ``p``), and how many of the top-10
heads by mean knockout effect on the parametric answer (per conflict type) the two runs share.

Run: ``python benchmarks/bench_precision.py`` (``--model tiny-gemma`` for a smoke run); it prints
one JSON object (also written to ``--out`` when given).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import cpsuper as cp


def _timed(fn, repeats: int):
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def _top_heads(summary, conflict_type: str, k: int) -> set[tuple[int, int]]:
    part = summary.query("alpha == 0 and target == 'parametric' and conflict_type == @conflict_type")
    top = part.assign(size=part.delta_mean.abs()).nlargest(k, "size")
    return set(zip(top.layer, top["head"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--n", type=int, default=24, help="world-capital facts to screen for known ones")
    parser.add_argument("--facts", type=int, default=4, help="known facts to sweep")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    model = cp.load_model(args.model, device="cpu")
    pool = cp.conflict_dataset("world_capital", n=args.n, seed=0, tokenizer=model)
    try:
        facts = cp.filter_known(model, pool, progress=False)
    except ValueError:  # a random test model knows nothing: sweep the facts as they are
        facts = pool
    facts = cp.ConflictDataset(list(facts)[: args.facts], name="world_capital")

    def sweep():
        return cp.head_sweep(model, facts, (0.0, 2.0), progress=False)

    fp32_s, fp32 = _timed(sweep, args.repeats)
    with cp.precision.mixed_precision(model, args.precision):
        low_s, low = _timed(sweep, args.repeats)

    a, b = fp32.per_example, low.per_example
    overlap = {
        c: len(_top_heads(fp32.summary, c, 10) & _top_heads(low.summary, c, 10))
        for c in ("clean", "substitution", "coherent")
    }
    report = {
        "model": args.model,
        "facts": len(facts),
        "rows": len(a),
        "threads": int(os.environ.get("OMP_NUM_THREADS", "0")) or None,
        "precision": args.precision,
        "fp32_s": round(fp32_s, 2),
        "low_s": round(low_s, 2),
        "speedup": round(fp32_s / low_s, 2),
        "max_abs_diff_p": float((a.p - b.p).abs().max()),
        "max_abs_diff_p_clean": float((a.p_clean - b.p_clean).abs().max()),
        "max_abs_diff_delta": float((a.delta - b.delta).abs().max()),
        "top10_overlap": overlap,
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
