"""Sweeps sharded over processes: two CPU ranks (gloo) launched by torchrun on a tiny model must
return what one process returns, fail together with a message naming the failing rank, and
refuse more ranks than conditions. The single-rank helpers are checked in-process."""

import base64
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import cpsuper as cp
from cpsuper import distributed

WORKERS = Path(__file__).parent / "workers"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _run(command: list[str], **env: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env={**os.environ, **env})
    assert done.returncode == 0, done.stderr[-3000:]


def _launch(tmp_path: Path, mode: str) -> list[dict]:
    _run([*TORCHRUN, str(WORKERS / "sharded_sweep.py"), str(tmp_path), mode])
    return [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in (0, 1)]


@pytest.fixture(scope="module")
def data(tiny_gemma):
    return cp.conflict_dataset("world_capital", n=3, tokenizer=tiny_gemma)


def test_two_ranks_equal_one_process(tmp_path, tiny_gemma, data):
    ranks = _launch(tmp_path, "sweeps")
    assert [(r["rank"], r["size"]) for r in ranks] == [(0, 2), (1, 2)]
    assert not any("error" in r for r in ranks), [r.get("error") for r in ranks]
    # 3 layers x 4 heads x 2 alphas = 24 conditions per conflict type; each rank ran 12 of them
    assert all(r["head_sweep_calls"] == [24, 12] * 3 for r in ranks)
    single = {
        "heads": cp.head_sweep(tiny_gemma, data, alphas=(0.0, 2.0), progress=False).per_example,
        "knockouts": cp.knockout_sweep(tiny_gemma, data, progress=False).per_example,
        "identified": cp.identify_heads(tiny_gemma, data, k=2, progress=False).scores,
    }
    for name, expected in single.items():
        for r in ranks:  # every rank holds the whole result, in the single-process order
            pd.testing.assert_frame_equal(r[name], expected, check_exact=False, atol=1e-6, rtol=0)


def test_a_failing_rank_stops_every_rank_with_its_name(tmp_path):
    ranks = _launch(tmp_path, "fail")
    for r in ranks:
        assert r["error"].startswith("ShardFailed"), r["error"]
        assert "rank 1: RuntimeError: injected failure" in r["error"] and "rank 0:" not in r["error"]


def test_more_ranks_than_conditions_is_refused(tmp_path):
    for r in _launch(tmp_path, "too_many"):
        assert "2 ranks for 1 sweep conditions" in r["error"] and "at most 1 processes" in r["error"]


def test_single_process_helpers(monkeypatch):
    assert distributed.world() == (0, 1) and cp.distributed.is_main_process() and not distributed.sharding()
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert cp.distributed.init_distributed() == (0, 1)  # a plain run: no process group is created
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert cp.distributed.init_distributed() == (0, 1)
    assert cp.distributed.local_device() in ("cpu", "cuda:0")


def _outputs(out: Path) -> dict[str, str]:
    files = {p.name: p.read_text() for p in out.iterdir() if p.suffix in (".csv", ".json")}
    files.pop("manifest.json")  # timings and the date
    page = (out / "report.html").read_text()
    files["report.html"] = re.sub(r'<section id="run">.*?</section>', "", page, count=1, flags=re.S)
    return files


# A number in a page: a plotly typed array ("dtype":"f8","bdata":"<base64>") or a decimal literal.
_NUMBERS = re.compile(r'"dtype":"(\w+)","bdata":"([^"]*)"|-?\d+\.\d+(?:e[-+]?\d+)?')


def _text_and_numbers(page: str) -> tuple[str, np.ndarray]:
    """The page with every number replaced by a mark (to compare byte for byte) and the numbers
    in order (to compare up to float rounding). Typed arrays that hold integers stay in the text."""
    numbers: list[np.ndarray] = []

    def take(match: re.Match) -> str:
        if match.group(1) is None:
            numbers.append(np.array([float(match.group())]))
            return "#"
        if not np.dtype(match.group(1)).kind == "f":
            return match.group()
        raw = base64.b64decode(match.group(2).replace("\\u002f", "/"))
        numbers.append(np.frombuffer(raw, dtype=match.group(1)).astype(float))
        return '"bdata":"#"'

    text = _NUMBERS.sub(take, page)
    return text, np.concatenate(numbers) if numbers else np.zeros(0)


def test_reproduce_under_torchrun_writes_the_single_process_report(tmp_path):
    worker = str(WORKERS / "sharded_reproduce.py")
    _run([*TORCHRUN, worker, str(tmp_path / "two")])
    # torchrun gives each rank one thread: the single run does the same, so sums add up alike
    _run([sys.executable, worker, str(tmp_path / "one")], OMP_NUM_THREADS="1")
    two, one = _outputs(tmp_path / "two"), _outputs(tmp_path / "one")
    assert len(one) > 20 and two.keys() == one.keys()
    # Tables: the same rows and labels, numbers equal up to float32 summation order (a loaded
    # machine can pick other kernels in the two runs); everything else byte for byte.
    for name in [n for n in one if n.endswith(".csv")]:
        pd.testing.assert_frame_equal(
            pd.read_csv(tmp_path / "two" / name), pd.read_csv(tmp_path / "one" / name), rtol=1e-5, atol=1e-6
        )
    assert [name for name in one if not name.endswith((".csv", ".html")) and two[name] != one[name]] == []
    # The report: its text byte for byte, the numbers in its tables and figures up to the same rounding.
    (text_two, numbers_two), (text_one, numbers_one) = map(_text_and_numbers, (two["report.html"], one["report.html"]))
    assert text_two == text_one and len(numbers_one) > 100
    np.testing.assert_allclose(numbers_two, numbers_one, rtol=1e-5, atol=1e-6)
