"""A resumable step cache: each finished step's result is kept on disk as data files.

``StepCache(directory).get_or_compute(name, fn, key=...)`` returns the stored result of step
``name`` or runs ``fn()``, stores its result and returns it. An entry is found only under the
same key, a hash of

- the source code of ``fn`` (or of the functions given as ``code``), so editing a step's code
  invalidates that step's entry and no other;
- the versions of cpsuper, torch and transformer_lens;
- ``key``: what else changes the result (model name, settings, seed), as JSON values;
- the keys of the steps named in ``after``, so a step is recomputed when a step it reads is.

Results are stored as Parquet and JSON (see :mod:`cpsuper.reproduce.codec`), never pickled.
Every step's wall time and CPU time (``time.process_time``) are printed and kept in
:attr:`StepCache.records`.

The folder is treated as shared, possibly hostile, ground:

- The cache folder holds a marker file, ``cpsuper-step-cache.json``, written when cpsuper
  creates the folder (or finds it empty). A folder that exists without the marker (a user's
  folder, or the marker-less pickle cache of early versions) or that is a symbolic link is
  refused with :class:`StepCacheError`, never used and never deleted. A marked folder written
  in another format is cleared with a message.
- An entry is written into a temporary folder next to it and renamed into place, so it appears
  whole or not at all. When several runs store the same entry at once, the first rename wins
  and the others keep that entry and remove only their own temporary folders.
- An entry is read only when its ``entry.json`` matches the checksum stored in it, every file
  it names matches its SHA-256, those names are plain file names inside the entry, and the
  entry holds those regular files and no others (no links). Anything else (truncated, altered,
  partly written, pointing outside the entry) is a miss: the step is recomputed, with a
  message, and the bad entry is replaced.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import inspect
import json
import os
import secrets
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
from .codec import decode, encode, is_plain_file_name

__all__ = [
    "FORMAT",
    "MARKER",
    "StepCache",
    "StepCacheError",
    "StepRecord",
    "check_cache_folder",
    "library_versions",
    "source_hash",
]

FORMAT = 3
"""Layout version of a cache folder: 1 was the pickle cache of early versions (without a marker),
2 did not checksum ``entry.json``."""

MARKER = "cpsuper-step-cache.json"
"""The file that marks a folder as a step cache that cpsuper created."""


class StepCacheError(ValueError):
    """The step cache folder cannot be used as it is; the message says why and what to do."""


def check_cache_folder(directory: str | Path) -> None:
    """Raise :class:`StepCacheError` unless ``directory`` is missing, empty, or a step cache
    folder that cpsuper created (it holds :data:`MARKER`). Reads the folder, changes nothing."""
    directory = Path(directory)
    fix = "Choose another output folder (--out), or remove it yourself if you no longer need it."
    if directory.is_symlink():
        raise StepCacheError(
            f"The step cache folder {directory} is a symbolic link (to {os.readlink(directory)}); cpsuper "
            f"does not follow links out of the output folder. {fix}"
        )
    if not directory.exists():
        return
    if not directory.is_dir():
        raise StepCacheError(f"The step cache {directory} is a file, not a folder. {fix}")
    names = os.listdir(directory)
    if names and MARKER not in names:
        raise StepCacheError(
            f"{directory} already exists and was not created by cpsuper's step cache (it has no {MARKER}), "
            f"so cpsuper will neither use it nor delete it. {fix} (The pickle cache of early cpsuper "
            "versions has no marker either: remove it.)"
        )
    _marker_format(directory)  # a marker that is not ours is refused as well


def _marker_format(directory: Path) -> int | None:
    """The format recorded in the folder's marker; ``None`` when there is no marker."""
    marker = directory / MARKER
    if not marker.is_symlink() and not marker.exists():
        return None
    try:
        if marker.is_symlink() or not marker.is_file():
            raise ValueError("not a regular file")
        found = json.loads(marker.read_text())["format"]
        if not isinstance(found, int):
            raise ValueError(f"format {found!r}")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise StepCacheError(
            f"{marker} is not a marker written by cpsuper ({type(err).__name__}: {err}), so cpsuper will "
            f"neither use nor delete {directory}. Choose another output folder (--out), or remove {directory} "
            "yourself if you no longer need it."
        ) from None
    return found


def _checksum(meta: dict) -> str:
    """SHA-256 of an entry's metadata (without its ``checksum``) in a canonical JSON form."""
    text = json.dumps(meta, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _unique(folder: Path, stem: str) -> Path:
    """A new hidden name in ``folder`` that no other process picks (pid and random token)."""
    return folder / f".{stem}.{os.getpid()}-{secrets.token_hex(4)}"


def _remove(path: Path) -> None:
    """Remove a file, a link (never its target) or a folder (``rmtree`` does not follow links)."""
    try:
        if path.is_symlink() or not path.is_dir():
            path.unlink()
        else:
            shutil.rmtree(path, ignore_errors=True)
    except FileNotFoundError:
        pass


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
        if entry.exists() or entry.is_symlink():
            try:
                meta, value = self._read(entry, digest)
            except Exception as err:  # whatever broke, an unreadable entry is a miss; storing replaces it
                self.log(f"{name}: the cached result could not be read ({type(err).__name__}: {err}); recomputing it.")
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
        """The entry folder of step ``name`` under key ``digest``; its step folder must be a real
        folder inside the cache (a link there would lead reads and writes out of it)."""
        if not name or name.startswith(".") or any(c in name for c in "/\\\0"):
            raise ValueError(f"Step name {name!r} must be a plain folder name (no '/', no leading '.').")
        folder = self.directory / name
        if folder.is_symlink():
            raise StepCacheError(
                f"{folder} is a symbolic link (to {os.readlink(folder)}); the step cache does not follow links "
                f"out of {self.directory}. Remove the link yourself, or choose another output folder (--out)."
            )
        if folder.exists() and not folder.is_dir():
            raise StepCacheError(
                f"{folder} is a file where the step cache keeps the folder of step {name!r}. Remove it "
                "yourself, or choose another output folder (--out)."
            )
        return folder / digest

    def _prepare(self) -> None:
        """Create the folder with its marker, adopt an empty one, or clear a marked folder that an
        incompatible version of cpsuper wrote; refuse anything else (see :func:`check_cache_folder`)."""
        if not is_main_process():
            return
        check_cache_folder(self.directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        found = _marker_format(self.directory)
        if found == FORMAT:
            return
        if found is not None:
            self.log(
                f"The step cache {self.directory} was written by an incompatible version of cpsuper "
                f"(format {found}, this version reads {FORMAT}); rebuilding it."
            )
            for child in self.directory.iterdir():
                if child.name != MARKER:
                    _remove(child)
        # Written next to the folder and renamed in: a run starting now sees no marker (an empty
        # folder) or the whole marker, never a folder holding only a half-written file.
        staged = _unique(self.directory.parent, f"{self.directory.name}-marker")
        staged.write_text(json.dumps({"format": FORMAT, "written_by": "cpsuper step cache"}))
        os.replace(staged, self.directory / MARKER)

    def _check(self, entry: Path, digest: str) -> dict:
        """The entry's metadata, after checking everything in it (see the module docstring)."""
        if entry.is_symlink() or not entry.is_dir():
            raise ValueError(f"{entry.name} is not a folder")
        meta_file = entry / "entry.json"
        if meta_file.is_symlink() or not meta_file.is_file():
            raise ValueError("entry.json is missing or not a regular file")
        meta = json.loads(meta_file.read_text())
        if not isinstance(meta, dict) or meta.pop("checksum", None) != _checksum(meta):
            raise ValueError("entry.json does not match its checksum (altered or partly written)")
        if meta.get("format") != FORMAT or meta.get("key") != digest:
            raise ValueError(f"entry of format {meta.get('format')} under key {meta.get('key')}")
        files = meta.get("files")
        timings = [meta.get(k) for k in ("seconds", "cpu_seconds")]
        if not isinstance(files, dict) or "value" not in meta or not all(isinstance(t, (int, float)) for t in timings):
            raise ValueError("entry.json lacks its files, value or timings")
        bad = [f for f in files if not is_plain_file_name(f) or f == "entry.json"]
        if bad:
            raise ValueError(f"the entry names files {bad}, which are not plain file names inside it")
        present = sorted(p.name for p in entry.iterdir() if p.name != "entry.json")
        if present != sorted(files):
            raise ValueError(f"the entry holds the files {present}, but its entry.json lists {sorted(files)}")
        for file, expected in files.items():
            path = entry / file
            if path.is_symlink() or not path.is_file():
                raise ValueError(f"{file} is not a regular file")
            if _sha256(path) != expected:
                raise ValueError(f"{file} does not match its checksum (altered or partly written)")
        return meta

    def _read(self, entry: Path, digest: str) -> tuple[dict, Any]:
        meta = self._check(entry, digest)
        return meta, decode(meta["value"], entry)

    def _intact(self, entry: Path, digest: str) -> bool:
        """Whether the entry reads back (checked and decoded, since only decoding sees every frame)."""
        try:
            self._read(entry, digest)
        except Exception:
            return False
        return True

    def _write(self, name: str, digest: str, value: Any, timing: dict) -> None:
        entry = self._entry(name, digest)
        entry.parent.mkdir(exist_ok=True)
        staged = _unique(entry.parent, f"{digest}.tmp")
        staged.mkdir()
        try:
            tree = encode(value, staged)
            files = {p.name: _sha256(p) for p in sorted(staged.iterdir())}
            meta = {"format": FORMAT, "step": name, "key": digest, **timing, "files": files, "value": tree}
            meta["checksum"] = _checksum(meta)
            (staged / "entry.json").write_text(json.dumps(meta, indent=1))
            if not self._publish(staged, entry, digest):
                self.log(f"{name}: the result was not stored: {entry} kept changing under other runs.")
        finally:
            _remove(staged)  # only this run's own temporary folder (gone once it was renamed into place)

    def _publish(self, staged: Path, entry: Path, digest: str) -> bool:
        """Rename ``staged`` to ``entry``. An intact entry stored there by another run is kept (it
        holds the same result), unless ``use_cache=False`` asks to overwrite it; an old or broken
        one is moved aside and removed."""
        replace = not self.use_cache
        for _ in range(5):
            try:
                os.rename(staged, entry)  # atomic; fails while an entry is there
                return True
            except OSError as err:
                if err.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                    raise
            if not replace and self._intact(entry, digest):
                return True
            replace = False
            aside = _unique(entry.parent, f"{digest}.old")
            try:
                os.rename(entry, aside)  # moves a link itself, never its target
            except FileNotFoundError:
                continue  # another run moved it first
            _remove(aside)
        return False
