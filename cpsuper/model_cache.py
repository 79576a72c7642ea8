"""A verified on-disk cache folder: a manifest that hashes every file, atomic replacement, a lock.

Used by :mod:`cpsuper.models` for the converted embedded model, but it knows nothing about
models. A cache folder holds files plus ``manifest.json``, which records:

- ``config``: a JSON object describing what the files mean (for models, the configuration);
- ``files``: every file's size and SHA-256 (weights, tokenizer files, ...);
- ``digest``: one SHA-256 over the config and all file hashes, so that an edited configuration or
  a changed file list is detected even though the manifest itself is plain text;
- ``stat``: for large files, the size, ``mtime_ns``, ``ctime_ns`` and inode seen when the hash
  was last computed.

Verification hashes small files every time (milliseconds) and large files only when their
``stat`` fingerprint changed, or on request (``verify="full"``). A write that changes a file
changes its ctime, which no user-level tool can set back, so edits, truncation and bit flips made
through the file system are caught by the quick check. What only ``verify="full"`` catches: a
change that leaves size, mtime, ctime and inode as recorded - silent media corruption (bit rot)
or edits of the raw disk, and a write landing within the same kernel clock tick (a few
milliseconds) as the hash that recorded the fingerprint.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks, writes are still atomic
    fcntl = None

__all__ = [
    "MANIFEST",
    "STAT_MIN_BYTES",
    "CorruptCache",
    "Verify",
    "cache_lock",
    "replace_dir",
    "sha256_file",
    "staging_dir",
    "verify_dir",
    "write_manifest",
]

MANIFEST = "manifest.json"
STAT_MIN_BYTES = 64 << 20
"""Files at least this large are re-hashed only when their stat fingerprint changes."""

Verify = Literal["quick", "full"]


class CorruptCache(Exception):
    """A cache folder does not match its manifest (the caller rebuilds it)."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _fingerprint(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _digest(config: dict, files: dict) -> str:
    payload = {"config": config, "files": {name: entry["sha256"] for name, entry in files.items()}}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _listing(folder: Path) -> list[str]:
    names = (p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    return sorted(n for n in names if n != MANIFEST)


def write_manifest(folder: Path, *, fmt: int, config: dict, source: str = "") -> dict:
    """Hash every file in ``folder`` and write its manifest; returns the manifest."""
    folder = Path(folder)
    files, stat = {}, {}
    for name in _listing(folder):
        path = folder / name
        files[name] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
        if files[name]["size"] >= STAT_MIN_BYTES:
            stat[name] = _fingerprint(path)
    manifest = {
        "format": fmt,
        "source": source,
        "config": config,
        "files": files,
        "digest": _digest(config, files),
        "stat": stat,
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def _read_manifest(folder: Path, fmt: int) -> dict:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as err:
        raise CorruptCache(f"unreadable manifest ({err})") from err
    if not isinstance(manifest, dict) or manifest.get("format") != fmt:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise CorruptCache(f"cache format {found!r}, this cpsuper version writes format {fmt}")
    for key, kind in (("config", dict), ("files", dict), ("digest", str), ("stat", dict)):
        if not isinstance(manifest.get(key), kind):
            raise CorruptCache(f"the manifest lacks a valid {key!r} entry")
    for name, entry in manifest["files"].items():
        if not (
            isinstance(entry, dict) and isinstance(entry.get("size"), int) and isinstance(entry.get("sha256"), str)
        ):
            raise CorruptCache(f"the manifest entry for {name!r} is malformed")
    if _digest(manifest["config"], manifest["files"]) != manifest["digest"]:
        raise CorruptCache("the recorded configuration or file list was edited (manifest digest mismatch)")
    return manifest


def verify_dir(folder: Path, *, fmt: int, verify: Verify = "quick") -> dict:
    """Check ``folder`` against its manifest; return the manifest or raise :class:`CorruptCache`.

    ``verify="quick"`` re-hashes large files only when their stat fingerprint changed (and then
    records the new fingerprint when the hash still matches); ``"full"`` re-hashes everything.
    """
    if verify not in ("quick", "full"):
        raise ValueError(f"verify must be 'quick' or 'full', got {verify!r}.")
    folder = Path(folder)
    manifest = _read_manifest(folder, fmt)
    files = manifest["files"]
    present = _listing(folder)
    if present != sorted(files):
        missing, extra = sorted(set(files) - set(present)), sorted(set(present) - set(files))
        raise CorruptCache(f"files missing {missing} or unexpected {extra}")
    refreshed = {}
    for name, entry in files.items():
        path = folder / name
        if path.stat().st_size != entry["size"]:
            raise CorruptCache(
                f"{name} is truncated or resized ({path.stat().st_size} bytes, expected {entry['size']})"
            )
        recorded = manifest["stat"].get(name)
        if verify == "quick" and recorded is not None and _fingerprint(path) == recorded:
            continue
        if sha256_file(path) != entry["sha256"]:
            raise CorruptCache(f"checksum mismatch in {name}")
        if entry["size"] >= STAT_MIN_BYTES and _fingerprint(path) != recorded:
            refreshed[name] = _fingerprint(path)
    if refreshed:
        _refresh_stat(folder, manifest, refreshed)
    return manifest


def _refresh_stat(folder: Path, manifest: dict, refreshed: dict) -> None:
    """Record new fingerprints of files whose hash still matched (e.g. after a copy), so that
    the next load is quick again. Best effort: skipped when the folder is read-only or locked."""
    try:
        with cache_lock(folder, blocking=False) as locked:
            if not locked or json.loads((folder / MANIFEST).read_text()) != manifest:
                return  # being rebuilt, or replaced since it was verified
            updated = {**manifest, "stat": {**manifest["stat"], **refreshed}}
            tmp = folder.with_name(f".{folder.name}.{MANIFEST}.{uuid.uuid4().hex}.tmp")  # outside the listing
            tmp.write_text(json.dumps(updated, indent=1))
            os.replace(tmp, folder / MANIFEST)
    except (OSError, ValueError):
        pass


@contextlib.contextmanager
def cache_lock(folder: Path, *, blocking: bool = True) -> Iterator[bool]:
    """Hold an exclusive lock on ``folder`` (the file ``<folder>.lock`` beside it) while
    converting or replacing it. Yields whether the lock is held (``False`` only when not
    ``blocking`` and another process holds it). Raises ``OSError`` when the parent folder
    cannot be written."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(folder.name + ".lock"), "a+") as handle:
        if fcntl is None:
            yield True
            return
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def staging_dir(target: Path) -> Path:
    """A fresh hidden folder beside ``target`` to write a new cache into."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    folder.chmod(0o755)
    return folder


def replace_dir(staged: Path, target: Path) -> None:
    """Put ``staged`` in place of ``target`` with renames only: a reader sees the old folder, no
    folder, or the new one - never a half-written one. Call under :func:`cache_lock`."""
    staged, target = Path(staged), Path(target)
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.{uuid.uuid4().hex}.old")
        os.replace(target, old)
    os.replace(staged, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
