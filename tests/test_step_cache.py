"""The step cache of `cpsuper reproduce` on hostile ground, without a model: folders it did not
create (a user's folder, a link) are refused and left as they are, links are never followed, an
edited entry.json or a file name leading out of its entry is a miss, and processes storing the
same entries at once all finish with valid entries."""

from __future__ import annotations

import functools
import hashlib
import json
import multiprocessing
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from cpsuper.reproduce import StepCache
from cpsuper.reproduce import cache as step_cache
from cpsuper.reproduce.cache import StepCacheError


def _logged(cache: StepCache) -> list[str]:
    messages: list[str] = []
    cache.log = messages.append
    return messages


@pytest.mark.parametrize("content", ["notes", "old pickles", "foreign marker"])
def test_a_folder_cpsuper_did_not_create_is_refused_and_kept(tmp_path, content):
    """Without the marker cpsuper writes when it creates its folder, the folder is someone
    else's: it is refused with a message saying what to do, and nothing in it is touched."""
    folder = tmp_path / "cache"
    folder.mkdir()
    if content == "notes":
        (folder / "notes.txt").write_text("my notes")
    elif content == "old pickles":  # the layout of early versions: OUT/cache/<key>/<step>.pkl
        (folder / "0123abcd").mkdir()
        (folder / "0123abcd" / "facts.pkl").write_bytes(b"\x80\x04")
    else:
        (folder / "cpsuper-step-cache.json").write_text("my own settings")
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    with pytest.raises(StepCacheError, match="(not created by cpsuper|not a marker written by cpsuper).*remove"):
        StepCache(folder)
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before


def _one():
    return 1


def test_an_empty_folder_becomes_a_cache(tmp_path):
    StepCache(tmp_path).get_or_compute("step", _one)
    assert (tmp_path / "cpsuper-step-cache.json").is_file() and StepCache(tmp_path).lookup("step", _one)[0]


def test_links_are_refused_never_followed(tmp_path):
    """A cache folder or step folder that is a symbolic link is refused; an entry that is a link
    is a miss, and replacing it removes the link, never what it points to."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("keep")
    (tmp_path / "linked").symlink_to(elsewhere)
    with pytest.raises(StepCacheError, match="symbolic link.*does not follow links"):
        StepCache(tmp_path / "linked")

    cache_dir = tmp_path / "cache"
    cache = StepCache(cache_dir)
    (cache_dir / "step").symlink_to(elsewhere)
    with pytest.raises(StepCacheError, match="step is a symbolic link.*Remove the link"):
        cache.get_or_compute("step", _one)
    (cache_dir / "step").unlink()

    digest = cache.key("step", _one)
    (cache_dir / "step").mkdir()
    (cache_dir / "step" / digest).symlink_to(elsewhere)
    cache = StepCache(cache_dir)
    messages = _logged(cache)
    assert cache.get_or_compute("step", _one) == 1 and cache.records[0].status == "computed"
    assert any("is not a folder" in m for m in messages)
    assert sorted(p.name for p in elsewhere.iterdir()) == ["keep.txt"]  # the target is untouched
    assert StepCache(cache_dir).lookup("step", _one)[0]  # and the entry stored as a folder


def _entry_of(folder: Path) -> tuple[Path, dict]:
    entry = next((folder / "step").iterdir())
    return entry, json.loads((entry / "entry.json").read_text())


def _rewrite(entry: Path, meta: dict, *, checksum: bool) -> None:
    """Write ``meta`` as the entry's entry.json, with a checksum recomputed to match it (a writer
    that knows the format) or with the old one kept (an edit or damage)."""
    if checksum:
        meta.pop("checksum")
        meta["checksum"] = step_cache._checksum(meta)
    (entry / "entry.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("field", ["value", "seconds"])
def test_a_tampered_entry_json_is_recomputed(tmp_path, field):
    def compute():
        return {"n": 5, "frame": pd.DataFrame({"x": [1.0, 2.0]})}

    StepCache(tmp_path).get_or_compute("step", compute)
    entry, meta = _entry_of(tmp_path)
    if field == "value":
        meta["value"]["$dict"]["n"] = 6
    else:
        meta["seconds"] = 1e6
    _rewrite(entry, meta, checksum=False)
    cache = StepCache(tmp_path)
    messages = _logged(cache)
    back = cache.get_or_compute("step", compute)
    assert back["n"] == 5 and cache.records[0].status == "computed"
    assert any("entry.json does not match its checksum" in m for m in messages)
    again = StepCache(tmp_path)
    assert again.get_or_compute("step", compute)["n"] == 5 and again.records[0].status == "cached"


@pytest.mark.parametrize("where", ["absolute frame", "frame in a parent", "listed file in a parent"])
def test_file_names_that_leave_the_entry_are_a_miss(tmp_path, where):
    """Even with a checksum that matches, an entry naming a file outside itself is never read:
    the step is recomputed and stored again, and the next run finds the good entry."""

    def compute():
        return {"frame": pd.DataFrame({"x": [1.0, 2.0]})}

    StepCache(tmp_path / "cache").get_or_compute("step", compute)
    entry, meta = _entry_of(tmp_path / "cache")
    outside = tmp_path / "outside.parquet"
    pd.DataFrame({"x": [666.0]}).to_parquet(outside)
    digest = hashlib.sha256(outside.read_bytes()).hexdigest()
    name = str(outside) if where == "absolute frame" else "../../../outside.parquet"
    meta["value"]["$dict"]["frame"]["$frame"] = name
    if where == "listed file in a parent":
        meta["files"] = {name: digest}
        (entry / "frame-0.parquet").unlink()
    _rewrite(entry, meta, checksum=True)
    cache = StepCache(tmp_path / "cache")
    messages = _logged(cache)
    assert cache.get_or_compute("step", compute)["frame"]["x"].tolist() == [1.0, 2.0]
    assert cache.records[0].status == "computed"
    assert any("plain file name" in m for m in messages), messages
    again = StepCache(tmp_path / "cache")
    assert again.get_or_compute("step", compute)["frame"]["x"].tolist() == [1.0, 2.0]
    assert again.records[0].status == "cached"


def _store_steps(directory: str, barrier, n_steps: int) -> None:
    """One of several processes storing the same entries at the same moments (the barrier)."""
    cache = StepCache(directory, log=lambda message: None)
    for i in range(n_steps):
        barrier.wait(timeout=60)
        cache.get_or_compute(f"step{i}", functools.partial(_frame_of, i), code=[_frame_of])


def _frame_of(i: int) -> pd.DataFrame:
    return pd.DataFrame({"step": i, "x": np.arange(20_000, dtype="float64")})


def test_concurrent_runs_store_the_same_entries_and_all_finish(tmp_path):
    """Three processes store the same 20 entries at the same moments (before atomic entries, one
    of them failed with 'Directory not empty'): all finish, the entries read back valid, and no
    temporary folder is left."""
    context = multiprocessing.get_context("spawn")  # fork is unsafe once Arrow's threads run
    n, n_steps = 3, 20
    barrier = context.Barrier(n)
    workers = [context.Process(target=_store_steps, args=(str(tmp_path), barrier, n_steps)) for _ in range(n)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=300)
    assert [w.exitcode for w in workers] == [0] * n
    cache = StepCache(tmp_path)
    for i in range(n_steps):
        found, back = cache.lookup(f"step{i}", functools.partial(_frame_of, i), code=[_frame_of])
        assert found
        pd.testing.assert_frame_equal(back, _frame_of(i))
    assert not [p for p in tmp_path.rglob(".*")]  # every temporary folder was removed
