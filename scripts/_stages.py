"""Cached, resumable stages for the evaluation scripts: each stage's value is pickled under
``out/cache``, so an interrupted run picks up where it stopped."""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable, Sequence
from pathlib import Path


def cached_stages(out: Path, timings: dict[str, float], only: Sequence[str] | None = None) -> Callable:
    """``stage(name, compute)``: the cached value of ``name``, computing (and timing) it if absent.

    With ``only``, stages outside it are left to another process (``None`` is returned) and the
    process exits once all of ``only`` are cached, so stages can run in parallel."""
    cache = out / "cache"
    cache.mkdir(parents=True, exist_ok=True)

    def stage(name, compute):
        path = cache / f"{name}.pkl"
        if path.exists():
            return pickle.loads(path.read_bytes())
        if only is not None and name not in only:
            return None
        start = time.time()
        value = compute()
        timings[name] = round(time.time() - start, 1)
        path.write_bytes(pickle.dumps(value))
        print(f"{name}: {timings[name]} s", flush=True)
        if only is not None and all((cache / f"{n}.pkl").exists() for n in only):
            raise SystemExit(0)
        return value

    return stage
