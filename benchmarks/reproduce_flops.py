"""Count the floating-point operations of each ``cpsuper reproduce`` step (``--quick`` by default).

Runs the pipeline with every step wrapped in ``torch.utils.flop_counter.FlopCounterMode`` and
prints, per step, the counted TFLOP, the step's CPU seconds and the achieved GFLOP/s, with the
float32 matrix-product peak of this machine measured in the same process: the time the arithmetic
alone needs. Run: ``OMP_NUM_THREADS=1 python benchmarks/reproduce_flops.py --out /tmp/flops``.

The counts are exact; the CPU seconds are not a step's normal cost, because the counter intercepts
every operator, which adds CPU time of its own. Compare the floors with the step times of a plain
``cpsuper reproduce`` (docs/reproduce.md does).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from cpsuper.reproduce import reproduce
from cpsuper.reproduce import steps as step_list


def matmul_peak(rows: int = 4096, d_in: int = 640, d_out: int = 2048, repeats: int = 10) -> float:
    a, b = torch.randn(rows, d_in), torch.randn(d_in, d_out)
    a @ b
    start = time.process_time()
    for _ in range(repeats):
        a @ b
    return 2 * rows * d_in * d_out * repeats / (time.process_time() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--full", action="store_true", help="the full run instead of --quick")
    parser.add_argument("--out", type=Path, required=True, help="a fresh directory (nothing is reused)")
    args = parser.parse_args()
    counted: dict[str, dict] = {}

    def counting(step):
        def fn(run):
            with FlopCounterMode(display=False) as counter:
                start = time.process_time()
                result = step.fn(run)
                seconds = time.process_time() - start
            counted[step.name] = {"tflop": counter.get_total_flops() / 1e12, "cpu_s": seconds}
            return result

        return dataclasses.replace(step, fn=fn)

    step_list.STEPS = tuple(counting(step) for step in step_list.STEPS)
    reproduce(args.model, out=args.out, quick=not args.full, use_cache=False, progress=False)
    peak = matmul_peak()
    total = {"tflop": sum(c["tflop"] for c in counted.values()), "cpu_s": sum(c["cpu_s"] for c in counted.values())}
    report = {"peak_gflop_per_s": peak / 1e9, "steps": counted, "total": total}
    for part in [*counted.values(), total]:
        part["gflop_per_s"] = part["tflop"] * 1e3 / part["cpu_s"]
        part["floor_cpu_s"] = part["tflop"] * 1e12 / peak
    print(json.dumps(report, indent=1))
    (args.out / "flops.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
