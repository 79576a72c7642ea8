"""Benchmark: the README Quickstart on the TransformerBridge against the reference HookedTransformer.

Each run is a fresh subprocess with one torch thread (``OMP_NUM_THREADS=1``): the Quickstart's
steps (load the embedded model, ``conflict_dataset``, ``filter_known``, ``score_dataset``, the
knockout and head sweeps on two facts, the fixed JuICE steering's ``generate`` on four coherent
prompts, plus plain greedy continuations of the same prompts), timed per step in CPU seconds
(``time.process_time``) and wall seconds. Memory: the process's peak resident set (``VmHWM``)
after loading, then the high-water mark is reset (``5`` written to ``/proc/self/clear_refs``)
before each later step, so the working peak is the largest of those steps' peaks.

The configurations run interleaved (by default hooked, the bridge as ``load_model`` loads it,
hooked, ...; ``bridge_processed`` / ``bridge_raw`` force the bridge's weight processing on or
off) ``--repeats`` times, so that the load of a shared machine falls on all of them alike; the
medians per step and the bridge / reference ratios are printed and written. The bridge's results
are compared with the reference's: the largest difference of any probability (scores, knockout
and head-sweep cells) and whether the greedy continuations are identical.

Run: ``python benchmarks/bench_backends.py --out docs/results/benchmarks/backends.json``
(``--facts 8`` for a shorter run; ``--model tiny-gemma`` for a smoke run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HOOKED_PYTHON = "/work/main/.venv/bin/python"
BRIDGE_PYTHON = "/work/main/.venv-tl4/bin/python"
CONFIGS = {  # name: (backend, process_weights: None for load_model's default)
    "hooked": ("hooked", None),
    "bridge": ("bridge", None),
    "bridge_processed": ("bridge", True),
    "bridge_raw": ("bridge", False),
}
WORKER_FLAG = {None: "default", True: "1", False: "0"}
STEPS = (
    "import",
    "load_model",
    "conflict_dataset",
    "filter_known",
    "score_dataset",
    "knockout_sweep",
    "head_sweep",
    "juice_generate",
    "greedy",
)
ENHANCE = [(10, 0), (8, 1), (9, 3), (6, 3), (11, 1)]
SUPPRESS = [(8, 0), (10, 1), (16, 3)]


def vm_hwm_gb() -> float:
    """The process's peak resident set so far (VmHWM), in GB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 1e9
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_hwm() -> None:
    """Reset the peak resident set to the current one (Linux's clear_refs, value 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def worker(backend: str, process_weights: bool | None, model_name: str, facts: int, out: Path) -> None:
    """One run of the Quickstart's steps; writes timings, memory and results to ``out``."""
    times: dict[str, dict[str, float]] = {}
    peaks: dict[str, float] = {}
    state: dict = {}

    def step(name, fn):
        if name not in ("import", "load_model"):
            reset_hwm()
        cpu, wall = time.process_time(), time.perf_counter()
        value = fn()
        times[name] = {"cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall}
        peaks[name] = vm_hwm_gb()
        return value

    def do_import():
        import cpsuper as cp  # noqa: PLC0415

        state["cp"] = cp

    step("import", do_import)
    cp = state["cp"]
    options = {"backend": backend}
    if backend == "bridge" and process_weights is not None:
        options["process_weights"] = process_weights
    model = step("load_model", lambda: cp.load_model(model_name, device="cpu", **options))
    data = step("conflict_dataset", lambda: cp.conflict_dataset("world_capital", n=facts, tokenizer=model))
    known = step("filter_known", lambda: cp.filter_known(model, data, progress=False))
    scores = step("score_dataset", lambda: cp.score_dataset(model, known, progress=False))
    few = known[:2]
    n_layers = model.cfg.n_layers
    ko_layers = [layer for layer in (3, 11, 13) if layer < n_layers] or [0]
    hs_layers = [layer for layer in (5, 11) if layer < n_layers] or [0]
    ko = step("knockout_sweep", lambda: cp.knockout_sweep(model, few, layers=ko_layers, progress=False))
    hs = step("head_sweep", lambda: cp.head_sweep(model, few, alphas=(0.0,), layers=hs_layers, progress=False))
    n_heads = model.cfg.n_heads
    enhance = [(layer % n_layers, head % n_heads) for layer, head in ENHANCE]
    suppress = [(layer % n_layers, head % n_heads) for layer, head in SUPPRESS]
    prompts = known.prompts("coherent")[:4]

    def juice():
        steer = cp.JuICE(
            model, direction="parametric", enhance=enhance, suppress=suppress, beta_plus=3.0, beta_minus=0.0
        )
        return steer.generate(prompts)

    steered = step("juice_generate", juice)
    plain = step("greedy", lambda: cp.scoring.greedy_continuations(model, prompts, progress=False))

    def cells(result) -> list:
        frame = result.per_example
        keys = [c for c in frame.columns if c not in ("p", "p_clean", "delta")]
        frame = frame.sort_values(keys)
        return [[str(v) for v in row] for row in frame[keys].itertuples(index=False)], frame["p"].tolist(), keys

    score_keys = [c for c in scores.columns if c != "value"]
    scores = scores.sort_values(score_keys)
    record = {
        "times": times,
        "peaks_gb": peaks,
        "load_peak_gb": max(peaks["import"], peaks["load_model"]),
        "working_peak_gb": max(v for k, v in peaks.items() if k not in ("import", "load_model")),
        "n_facts": len(data),
        "known_subjects": [e.subject for e in known],
        "score_keys": [[str(v) for v in row] for row in scores[score_keys].itertuples(index=False)],
        "score_values": [float(v) for v in scores["value"]],
        "knockout": cells(ko),
        "heads": cells(hs),
        "juice_generate": steered,
        "greedy": plain,
        "n_threads": __import__("torch").get_num_threads(),
    }
    out.write_text(json.dumps(record))


def run_once(python: str, config: str, model_name: str, facts: int) -> dict:
    """One worker subprocess for ``config``; its record."""
    backend, process_weights = CONFIGS[config]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "record.json"
        cmd = [python, __file__, "--worker", backend, WORKER_FLAG[process_weights], str(out)]
        cmd += ["--model", model_name, "--facts", str(facts)]
        subprocess.run(cmd, env=env, check=True)
        return json.loads(out.read_text())


def compare(reference: dict, other: dict) -> dict:
    """Largest probability difference and identical continuations, ``other`` against ``reference``."""

    def max_diff(a_keys, a_vals, b_keys, b_vals) -> float | None:
        if a_keys != b_keys:  # a column one side lacks (e.g. a newer frame's constant column): drop constants
            a_keys, b_keys = (
                [[v for j, v in enumerate(row) if j in varying(k)] for row in k] for k in (a_keys, b_keys)
            )
            if a_keys != b_keys:
                return None
        return max((abs(x - y) for x, y in zip(a_vals, b_vals)), default=0.0)

    def varying(keys) -> set[int]:
        return {j for j in range(len(keys[0])) if len({row[j] for row in keys}) > 1} if keys else set()

    return {
        "same_known_facts": reference["known_subjects"] == other["known_subjects"],
        "scores_max_diff": max_diff(
            reference["score_keys"], reference["score_values"], other["score_keys"], other["score_values"]
        ),
        "knockout_max_diff": max_diff(*reference["knockout"][:2], *other["knockout"][:2]),
        "heads_max_diff": max_diff(*reference["heads"][:2], *other["heads"][:2]),
        "juice_generate_identical": reference["juice_generate"] == other["juice_generate"],
        "greedy_identical": reference["greedy"] == other["greedy"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hooked-python", default=HOOKED_PYTHON, help="python of the TransformerLens 3 venv")
    parser.add_argument("--bridge-python", default=BRIDGE_PYTHON, help="python of the TransformerLens 4 venv")
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--facts", type=int, default=16, help="world-capital facts (the Quickstart's n=16)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--configs", default="hooked,bridge", help=f"comma-separated, of {list(CONFIGS)}")
    parser.add_argument("--out", type=Path, default=None, help="write the records and medians as JSON here")
    parser.add_argument("--csv", type=Path, default=None, help="write the median table as CSV here")
    parser.add_argument("--summarize", type=Path, default=None, help="only print the table of an earlier --out")
    parser.add_argument("--worker", nargs=3, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        backend, process_weights, out = args.worker
        flags = {flag: value for value, flag in WORKER_FLAG.items()}
        worker(backend, flags[process_weights], args.model, args.facts, Path(out))
        return

    configs = args.configs.split(",")
    python = {c: args.hooked_python if CONFIGS[c][0] == "hooked" else args.bridge_python for c in configs}
    meta = {"model": args.model, "facts": args.facts, "repeats": args.repeats, "configs": configs}
    meta["pythons"] = python
    if args.summarize:  # the table from an earlier (possibly unfinished) run's JSON
        saved = json.loads(args.summarize.read_text())
        meta, runs = saved["meta"], {c: r for c, r in saved["runs"].items() if r}
        configs = [c for c in meta["configs"] if c in runs]
        meta["repeats"] = min(len(r) for r in runs.values())
        args.repeats = meta["repeats"]
    else:
        runs: dict[str, list[dict]] = {c: [] for c in configs}
        for repeat in range(args.repeats):
            for config in configs:
                start = time.perf_counter()
                runs[config].append(run_once(python[config], config, args.model, args.facts))
                print(f"repeat {repeat + 1}/{args.repeats} {config}: {time.perf_counter() - start:.0f} s", flush=True)
                if args.out:  # kept after every run, so that an interrupted benchmark still has its data
                    args.out.parent.mkdir(parents=True, exist_ok=True)
                    args.out.write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))

    medians = {
        c: {
            **{
                f"{s}_{kind}": statistics.median(r["times"][s][kind] for r in runs[c])
                for s in STEPS
                for kind in ("cpu_s", "wall_s")
            },
            "total_cpu_s": statistics.median(sum(r["times"][s]["cpu_s"] for s in STEPS) for r in runs[c]),
            "total_wall_s": statistics.median(sum(r["times"][s]["wall_s"] for s in STEPS) for r in runs[c]),
            "load_peak_gb": statistics.median(r["load_peak_gb"] for r in runs[c]),
            "working_peak_gb": statistics.median(r["working_peak_gb"] for r in runs[c]),
        }
        for c in configs
    }
    reference = "hooked" if "hooked" in configs else configs[0]
    rows = [f"{s}_{kind}" for s in STEPS for kind in ("cpu_s", "wall_s")]
    rows += ["total_cpu_s", "total_wall_s", "load_peak_gb", "working_peak_gb"]
    others = [c for c in configs if c != reference]

    header = f"{'median':<26}" + "".join(f"{c:>18}" for c in configs) + "".join(f"{c + '/ref':>22}" for c in others)
    print(f"\n{args.model}, {runs[reference][0]['n_facts']} facts, {args.repeats} repeats, one thread")
    print(header)
    table = []
    for row in rows:
        values = [medians[c][row] for c in configs]
        ratios = [
            medians[c][row] / medians[reference][row] if medians[reference][row] else float("nan") for c in others
        ]
        table.append(
            {"measure": row, **dict(zip(configs, values)), **{f"{c}/{reference}": r for c, r in zip(others, ratios)}}
        )
        print(f"{row:<26}" + "".join(f"{v:>18.3f}" for v in values) + "".join(f"{r:>21.2f}x" for r in ratios))

    if "score_keys" in runs[reference][0]:
        checks = {c: compare(runs[reference][0], runs[c][0]) for c in others}
        checks.update({f"{reference} repeat": compare(runs[reference][0], r) for r in runs[reference][1:2]})
    else:  # a final record, whose runs no longer hold the per-row values: its checks as written
        checks = saved["checks"]
    print()
    for name, check in checks.items():
        print(f"{name} against {reference}: " + ", ".join(f"{k}={v}" for k, v in check.items()))

    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        # the final record keeps each run's times, memory and continuations; the per-row values went into `checks`
        light = ("times", "peaks_gb", "load_peak_gb", "working_peak_gb", "n_facts", "known_subjects", "n_threads")
        light += ("juice_generate", "greedy")
        runs = {c: [{k: r[k] for k in light} for r in rs] for c, rs in runs.items()}
        args.out.write_text(json.dumps({"meta": meta, "medians": medians, "checks": checks, "runs": runs}, indent=1))
    if args.csv:
        import csv  # noqa: PLC0415

        args.csv.parent.mkdir(parents=True, exist_ok=True)
        with args.csv.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(table[0]))
            writer.writeheader()
            writer.writerows(table)


if __name__ == "__main__":
    sys.exit(main())
