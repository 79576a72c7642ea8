"""A resumable step cache: each finished step's result is kept on disk as data files.

``StepCache(directory).get_or_compute(name, fn, key=...)`` returns the stored result of step
``name`` or runs ``fn()``, stores its result and returns it. An entry is found only under the
same key, a hash of

- the source code of ``fn`` (or of the functions given as ``code``), so editing a step's code
  invalidates that step's entry and no other;
- the versions of cpsuper, torch and transformer_lens;
- ``key``: what else changes the result (model name, settings, seed), as JSON values;
- the keys of the steps named in ``after``, so a step is recomputed when a step it reads is.

Results are stored as Parquet and JSON (see :mod:`cpsuper.reproduce.codec`), never pickled. An
entry is written to a temporary folder and renamed into place, so an interrupted step leaves no
entry; an entry whose files are missing, truncated or altered (each file's SHA-256 is checked)
is recomputed with a message, never trusted. A cache folder written in an older format (the
pickles of earlier versions) is cleared with a message. Every step's wall time and CPU time
(``time.process_time``) are printed and kept in :attr:`StepCache.records`.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import shutil
import sys
import textwrap
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from ..distributed import is_main_process, on_every_rank
from .codec import decode, encode

__all__ = ["FORMAT", "StepCache", "StepRecord", "library_versions", "source_hash"]

FORMAT = 2
"""Layout version of a cache folder; 1 was the pickle cache of earlier versions."""

_MARKER = "cpsuper-step-cache.json"


@dataclass
class StepRecord:
    """How one step was obtained in this run: ``status`` is ``"computed"`` or ``"cached"``;
    ``seconds`` and ``cpu_seconds`` are those of the computation (earlier, when cached);
    ``seconds_this_run`` is the wall time it took now (loading, when cached)."""

    name: str
    status: str
    seconds: float
    cpu_seconds: float
    seconds_this_run: float
    key: str


def library_versions(packages: Sequence[str] = ("cpsuper", "torch", "transformer-lens")) -> dict[str, str]:
    """Installed versions of ``packages``; by default those that are part of every key."""
    out = {}
    for package in packages:
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = "not installed"
    return out


def source_hash(fn: Callable) -> str:
    """SHA-256 of a function's (or class's) source; of its compiled code where the source is not
    available. A ``functools.partial`` is identified by the function it wraps."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    try:
        text = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        code = getattr(fn, "__code__", None)
        if code is None:
            raise TypeError(
                f"Cannot read the code of {fn!r}; pass the function that computes the step as code=[...]."
            ) from None
        text = repr((code.co_code, code.co_consts, code.co_names))
    return hashlib.sha256(text.encode()).hexdigest()


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class StepCache:
    """Results of named steps under ``directory``; see the module docstring.

    ``use_cache=False`` recomputes every step (and overwrites its entry). ``log`` receives the
    one-line messages (timings, entries recomputed); by default they go to stderr.
    """

    def __init__(self, directory: str | Path, *, use_cache: bool = True, log: Callable[[str], None] | None = None):
        self.directory = Path(directory)
        self.use_cache = use_cache
        self.log = log or _stderr
        self.records: list[StepRecord] = []
        self.keys: dict[str, str] = {}
        self._prepare()

    # -- public --------------------------------------------------------------------------------

    def key(self, name: str, fn: Callable, **options) -> str:
        """The key the entry of step ``name`` is stored under; ``options`` as for :meth:`get_or_compute`."""
        unknown = set(options) - {"key", "code", "after"}
        if unknown:
            raise TypeError(f"Unknown step cache option(s) {sorted(unknown)}; use key, code or after.")
        key, code, after = options.get("key"), options.get("code"), options.get("after", ())
        missing = [n for n in after if n not in self.keys]
        if missing:
            raise ValueError(f"Step {name!r} comes after {missing}, which this cache has not run yet; run them first.")
        payload = {
            "step": name,
            "code": [source_hash(f) for f in (code if code is not None else [fn])],
            "versions": library_versions(),
            "key": dict(key or {}),
            "after": {n: self.keys[n] for n in after},
        }
        try:
            text = json.dumps(payload, sort_keys=True)
        except TypeError as err:
            raise TypeError(f"The key of step {name!r} must hold JSON values only: {err}") from None
        return hashlib.sha256(text.encode()).hexdigest()[:20]

    def lookup(self, name: str, fn: Callable, **options) -> tuple[bool, Any]:
        """``(True, result)`` if step ``name`` has a readable entry under its key, else ``(False, None)``;
        ``options`` as for :meth:`get_or_compute`."""
        digest = self.key(name, fn, **options)
        self.keys[name] = digest
        if not self.use_cache:
            return False, None
        start = time.perf_counter()
        entry = self._entry(name, digest)
        meta = value = None
        if (entry / "entry.json").exists():
            try:
                meta, value = self._read(entry, digest)
            except Exception as err:  # whatever broke, an unreadable entry is recomputed
                self.log(f"{name}: the cached result could not be read ({type(err).__name__}: {err}); recomputing it.")
                if is_main_process():
                    shutil.rmtree(entry, ignore_errors=True)
        if not on_every_rank(meta is not None):  # under torchrun all ranks compute a step, or none
            return False, None
        self.records.append(
            StepRecord(name, "cached", meta["seconds"], meta["cpu_seconds"], time.perf_counter() - start, digest)
        )
        self.log(f"{name}: cached (computed in {meta['seconds']:.1f} s, {meta['cpu_seconds']:.1f} s CPU)")
        return True, value

    def get_or_compute(
        self,
        name: str,
        fn: Callable[[], Any],
        *,
        key: Mapping | None = None,
        code: Sequence[Callable] | None = None,
        after: Sequence[str] = (),
    ) -> Any:
        """The cached result of step ``name``, or ``fn()`` computed, timed and stored.

        ``key``: JSON values that change the result (model, settings); ``code``: the functions whose
        source identifies the computation (default ``[fn]``); ``after``: earlier steps it reads."""
        found, value = self.lookup(name, fn, key=key, code=code, after=after)
        if found:
            return value
        digest = self.keys[name]
        wall, cpu = time.perf_counter(), time.process_time()
        value = fn()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        if is_main_process():  # under torchrun rank 0 stores the entry; every rank holds the value
            self._write(name, digest, value, {"seconds": wall, "cpu_seconds": cpu})
        self.records.append(StepRecord(name, "computed", wall, cpu, wall, digest))
        self.log(f"{name}: computed in {wall:.1f} s ({cpu:.1f} s CPU)")
        return value

    # -- storage -------------------------------------------------------------------------------

    def _entry(self, name: str, digest: str) -> Path:
        return self.directory / name / digest

    def _prepare(self) -> None:
        """Create the folder, or clear it when an incompatible version of cpsuper wrote it."""
        if not is_main_process():
            return
        marker = self.directory / _MARKER
        if self.directory.exists() and not self.directory.is_dir():
            raise ValueError(f"The step cache {self.directory} is a file; give a directory.")
        found = None
        if marker.exists():
            try:
                found = json.loads(marker.read_text()).get("format")
            except (OSError, ValueError, AttributeError):
                found = "unreadable"
        elif self.directory.exists() and any(self.directory.iterdir()):
            found = 1  # the pickles of earlier versions, without a marker
        if found not in (None, FORMAT):
            self.log(
                f"The step cache {self.directory} was written by an incompatible version of cpsuper "
                f"(format {found}, this version reads {FORMAT}); rebuilding it."
            )
            for child in self.directory.iterdir():
                shutil.rmtree(child) if child.is_dir() else child.unlink()
        self.directory.mkdir(parents=True, exist_ok=True)
        if found != FORMAT:
            marker.write_text(json.dumps({"format": FORMAT}))

    def _read(self, entry: Path, digest: str) -> tuple[dict, Any]:
        meta = json.loads((entry / "entry.json").read_text())
        if meta.get("format") != FORMAT or meta.get("key") != digest:
            raise ValueError(f"entry of format {meta.get('format')} under key {meta.get('key')}")
        for file, expected in meta["files"].items():
            if hashlib.sha256((entry / file).read_bytes()).hexdigest() != expected:
                raise ValueError(f"{file} does not match its checksum (altered or partly written)")
        return meta, decode(meta["value"], entry)

    def _write(self, name: str, digest: str, value: Any, timing: dict) -> None:
        entry = self._entry(name, digest)
        tmp = entry.parent / f".{digest}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            tree = encode(value, tmp)
            files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(tmp.iterdir())}
            meta = {"format": FORMAT, "step": name, "key": digest, **timing, "files": files, "value": tree}
            (tmp / "entry.json").write_text(json.dumps(meta, indent=1))
            shutil.rmtree(entry, ignore_errors=True)
            tmp.rename(entry)  # the entry appears whole or not at all
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
