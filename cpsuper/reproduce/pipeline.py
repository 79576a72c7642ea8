"""``reproduce``: run the steps through the step cache, then write the report.

Every step's result is stored under ``OUT/cache/`` as soon as it finishes (see
:mod:`cpsuper.reproduce.cache`), so a re-run with the same arguments reuses it and a run stopped
by an error or Ctrl-C resumes at the step that did not finish, with the same report as a run that
was never stopped. The model is loaded only when some step has to run. Figures, tables and files
are rebuilt from the results every time.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from cpsuper.plots.export import check_export

from ..distributed import init_distributed, local_device
from . import steps as step_list
from .cache import StepCache, library_versions
from .outputs import write_outputs
from .settings import FULL, QUICK, check_arguments
from .steps import Run

__all__ = ["print_locations", "reproduce"]


def reproduce(
    model: str = "gemma-3-270m",
    relations: Sequence[str] | None = None,
    n_examples: int | None = None,
    out: str | Path = "cpsuper-report",
    *,
    quick: bool = False,
    device: str | None = None,
    dtype: str = "float32",
    seed: int = 0,
    use_cache: bool = True,
    progress: bool = True,
    command: str | None = None,
    export: str | Sequence[str] = (),
) -> Path:
    """Run the pipeline (reusing cached steps) and write ``report.html`` plus CSV / JSON to ``out``.

    ``export`` (e.g. ``"svg,pdf"``) also writes every figure of the report in those formats under
    ``out/figures/`` (needs the ``export`` extra). Returns the path of ``report.html``. Arguments,
    export formats included, are checked before the model is loaded.
    """
    relations = check_arguments(model, relations, n_examples, out, device, dtype)
    export = check_export(export) if export else ()
    rank, size = init_distributed()  # under torchrun: sweeps are sharded over the ranks, rank 0 writes
    if size > 1:
        device, progress = device or local_device(), progress and rank == 0
    settings = QUICK if quick else FULL
    if n_examples is not None:
        settings = dataclasses.replace(settings, n_examples=n_examples)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    arguments = {"model": model, "relations": relations, "settings": dataclasses.asdict(settings), "seed": seed}
    if dtype != "float32":  # float32 runs keep the cache keys they always had
        arguments["dtype"] = dtype
    run_key = hashlib.sha256(json.dumps(arguments, sort_keys=True).encode()).hexdigest()[:16]
    log = (lambda message: tqdm.write(message, file=sys.stderr)) if progress else None  # not through the bar
    if rank != 0:
        log = lambda message: None  # noqa: E731  (rank 0 speaks for all)
    cache = StepCache(out / "cache", use_cache=use_cache, log=log)
    run = Run(model, relations, settings, seed, device, progress, dtype=dtype)
    start = time.perf_counter()
    pipeline = step_list.STEPS  # read at call time, so a test can swap a step
    bar = tqdm(pipeline, desc="cpsuper reproduce", disable=not progress, unit="step")
    for step in bar:
        bar.set_postfix_str(step.title)
        torch.manual_seed(seed)  # each step starts from the same state, whichever steps ran before it
        run.results[step.name] = cache.get_or_compute(
            step.name, lambda step=step: step.fn(run), key=arguments, code=[step.fn, Run, *step.uses], after=step.needs
        )
    bar.close()
    titles = {s.name: s.title for s in pipeline}
    timings = [
        {
            "step": r.name,
            "title": titles[r.name],
            "status": r.status,
            "seconds": r.seconds,
            "cpu_seconds": r.cpu_seconds,
            "seconds_this_run": r.seconds_this_run,
        }
        for r in cache.records
    ]
    meta = {
        "command": command or f"cpsuper reproduce --model {model}" + (" --quick" if quick else ""),
        "model": model,
        "relations": relations,
        "n_examples": settings.n_examples,
        "quick": quick,
        "device": str(run.model.cfg.device) if run.model_loaded else _previous_device(out, run_key, device),
        "seed": seed,
        "dtype": dtype,
        "cache_key": run_key,
        "use_cache": use_cache,
        "model_loaded": run.model_loaded,
        "settings": dataclasses.asdict(settings),
        "versions": _versions(),
        "created": dt.datetime.now().isoformat(timespec="seconds"),
        "total_seconds_this_run": time.perf_counter() - start,
        "steps": timings,
    }
    if rank != 0:
        return out / "report.html"
    return write_outputs(run, meta, out, export=export)


def _previous_device(out: Path, key: str, device: str | None) -> str:
    """The device of the run that computed the cached steps (this run loaded no model)."""
    try:
        previous = json.loads((out / "manifest.json").read_text())
    except (OSError, ValueError):
        previous = {}
    if previous.get("cache_key") == key and previous.get("device"):
        return previous["device"]
    return device or "unknown (every step came from the cache)"


def _versions() -> dict:
    packages = ("cpsuper", "torch", "transformer-lens", "transformers", "plotly", "pandas")
    return {"python": platform.python_version(), **library_versions(packages)}


def print_locations(report: Path, stream=None) -> None:
    """Tell the user where the outputs are."""
    stream = stream or sys.stdout
    print(f"Report: {report.resolve()}", file=stream)
    print(f"Results (CSV / JSON, juice.json, manifest.json): {report.parent.resolve()}", file=stream)
