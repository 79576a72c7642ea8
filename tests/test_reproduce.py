"""`cpsuper reproduce` end to end on the random tiny model: outputs, cache reuse and resume, argument
checks before the model loads, and the report rendered in headless Chromium."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

import cpsuper.models
from cpsuper.cli import main

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/run installs it)")

EXPECTED_FILES = [
    "report.html", "manifest.json", "juice.json", "facts.csv", "figure3_knockouts.csv", "head_sweep.csv",
    "superposition_heads.csv", "table1_memory_heads.csv", "table3_evaluation.csv", "table3_per_example.csv",
    "dla_head_sources.csv", "head_categories.csv", "attention_subject_by_layer.csv",
    "attention_context_by_layer.csv",
]


def _manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory) -> Path:
    """One quick run on the random tiny Gemma (it knows no facts: the pipeline falls back to the
    unfiltered facts and says so)."""
    out = tmp_path_factory.mktemp("reproduce") / "report"
    assert main(["reproduce", "--model", "tiny-gemma", "--quick", "--out", str(out)]) == 0
    return out


def test_writes_every_output(report_dir, capsys):
    for name in EXPECTED_FILES:
        assert (report_dir / name).is_file(), name
    manifest = _manifest(report_dir)
    assert [s["status"] for s in manifest["steps"]] == ["computed"] * 8
    assert manifest["model"] == "tiny-gemma" and manifest["quick"] and manifest["seed"] == 0
    assert set(manifest["versions"]) >= {"cpsuper", "torch", "transformer-lens"}
    assert any("unfiltered" in note for note in manifest["notes"])  # the tiny model knows nothing
    config = json.loads((report_dir / "juice.json").read_text())
    assert config["model"] == "tiny-gemma" and config["enhance"] + config["suppress"]

    page = (report_dir / "report.html").read_text()
    assert "cpsuper reproduce --model tiny-gemma --quick" in page
    assert "UNFILTERED" in page
    from plotly.offline import get_plotlyjs

    assert page.count(get_plotlyjs()[:200]) == 1  # plotly.js inlined exactly once
    assert not re.search(r"<script[^>]+src=", page)  # nothing fetched from a CDN


def test_second_run_reuses_the_cache(report_dir, monkeypatch, capsys):
    def no_model(*args, **kwargs):
        raise AssertionError("the model should not be loaded when every step is cached")

    monkeypatch.setattr(cpsuper.models, "load_model", no_model)
    start = time.perf_counter()
    assert main(["reproduce", "--model", "tiny-gemma", "--quick", "--out", str(report_dir)]) == 0
    manifest = _manifest(report_dir)
    assert [s["status"] for s in manifest["steps"]] == ["cached"] * 8
    assert not manifest["model_loaded"]
    assert time.perf_counter() - start < 60
    assert "report.html" in capsys.readouterr().out  # says where the report is


def test_interrupted_run_resumes_from_the_missing_step(report_dir):
    cache = next((report_dir / "cache").iterdir())
    (cache / "attention.pkl").unlink()  # as if the run had stopped before the last step finished
    assert main(["reproduce", "--model", "tiny-gemma", "--quick", "--out", str(report_dir)]) == 0
    statuses = {s["step"]: s["status"] for s in _manifest(report_dir)["steps"]}
    assert statuses.pop("attention") == "computed"
    assert set(statuses.values()) == {"cached"}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--relations", "world_capital", "moon_phase"], "Unknown relation"),
        (["--n-examples", "0"], "--n-examples must be at least 1"),
        (["--device", "banana"], "Unknown device"),
        (["--out", "FILE"], "is a file"),
    ],
)
def test_bad_arguments_fail_before_the_model_loads(tmp_path, monkeypatch, args, message):
    def no_model(*a, **k):
        raise AssertionError("bad arguments must fail before the model is loaded")

    monkeypatch.setattr(cpsuper.models, "load_model", no_model)
    a_file = tmp_path / "taken.txt"
    a_file.write_text("not a directory")
    args = [str(a_file) if a == "FILE" else a for a in args]
    if "--out" not in args:
        args += ["--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as err:
        main(["reproduce", "--model", "tiny-gemma", "--quick", *args])
    assert message in str(err.value)
    assert not (tmp_path / "out").exists()


def test_cuda_device_without_a_gpu_fails_early(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit, match="no CUDA GPU"):
        main(["reproduce", "--device", "cuda", "--out", str(tmp_path / "out")])


def _chromium(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=15000", *args],
        check=False, capture_output=True, text=True, timeout=180,
    )


@needs_chromium
def test_report_renders_in_chromium(report_dir):
    url = (report_dir / "report.html").resolve().as_uri()
    done = _chromium("--enable-logging=stderr", "--v=0", "--dump-dom", url)
    dom = done.stdout
    n_figures = _manifest(report_dir)["n_figures"]
    figures = dom.split('<figure class="figure">')[1:]
    assert len(figures) == n_figures >= 8
    for i, figure in enumerate(figures):
        assert 'class="main-svg"' in figure, f"figure {i + 1} did not render"
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
    errors = [line for line in console if "Uncaught" in line or "Error" in line or ":ERROR:CONSOLE" in line]
    assert not errors, errors


@needs_chromium
def test_report_screenshot(report_dir):
    shot = report_dir / "report.png"
    _chromium(f"--screenshot={shot}", "--window-size=1400,4000", (report_dir / "report.html").resolve().as_uri())
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 50_000
