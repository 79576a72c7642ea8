"""`cpsuper reproduce` end to end on the random tiny model: outputs, cache reuse and resume (after a
deleted, corrupt or edited step, an exception or Ctrl-C), argument checks before the model loads,
and the report rendered in headless Chromium.
The step cache itself (storage formats, keys, corrupt entries) is tested first, without a model."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import subprocess
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import cpsuper
import cpsuper.models
from cpsuper.cli import main
from cpsuper.plots.export import check_export
from cpsuper.reading import normalize_answer
from cpsuper.reproduce import QUICK, StepCache, check_arguments
from cpsuper.reproduce import cache as step_cache
from cpsuper.reproduce import findings as report_findings
from cpsuper.reproduce import steps as reproduce_steps

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/run installs it)")

EXPECTED_FILES = [
    "report.html",
    "manifest.json",
    "juice.json",
    "facts.csv",
    "figure3_knockouts.csv",
    "head_sweep.csv",
    "superposition_heads.csv",
    "table1_memory_heads.csv",
    "table3_evaluation.csv",
    "table3_per_example.csv",
    "table3_intervals.csv",
    "table3_paper_protocol_per_example.csv",
    "table3_paper_protocol_intervals.csv",
    "dla_head_sources.csv",
    "head_categories.csv",
    "attention_subject_by_layer.csv",
    "attention_context_by_layer.csv",
    "explorer.html",
]


def _manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def _statuses(out: Path) -> dict[str, str]:
    return {s["step"]: s["status"] for s in _manifest(out)["steps"]}


def _no_model(monkeypatch, message: str) -> None:
    """Make loading any model fail (both the module function and the name cpsuper exports)."""

    def no_model(*args, **kwargs):
        raise AssertionError(message)

    monkeypatch.setattr(cpsuper.models, "load_model", no_model)
    monkeypatch.setattr(cpsuper, "load_model", no_model)


def _results(out: Path) -> dict[str, str]:
    """Every output file except the manifest, and the report without its run section (command,
    timings, date): what must not change when the same results come from the cache."""
    files = {
        p.name: p.read_text() for p in out.iterdir() if p.suffix in (".csv", ".json") and p.name != "manifest.json"
    }
    page = (out / "report.html").read_text()
    files["report.html"] = re.sub(r'<section id="run">.*?</section>', "", page, count=1, flags=re.S)
    assert files["report.html"] != page
    return files


def _reproduce(out: Path) -> int:
    return main(["reproduce", "--model", "tiny-gemma", "--quick", "--out", str(out)])


# ---------------------------------------------------------------------------------------------
# The step cache, without a model


def _value():
    frame = pd.DataFrame(
        {
            "layer": [0, 1],
            "p": np.array([0.25, 0.5], dtype="float32"),
            "name": ["a", "b"],
            "known": [True, False],
            "count": pd.array([1, None], dtype="Int64"),
            "heads": [[(0, 1)], [(1, 2), (2, 0)]],
        }
    )
    return {
        "frame": frame,
        "heads": [(0, 1), (2, 3)],
        "pair": (1, "a"),
        "none": None,
        "nan": float("nan"),
        "dataset": cpsuper.conflict_dataset("world_capital", n=2),
        "sweep": cpsuper.SweepResult(frame, frame[:1]),
    }


def _logged(cache: StepCache) -> list[str]:
    messages: list[str] = []
    cache.log = messages.append
    return messages


def test_step_results_are_stored_as_data_files_and_read_back(tmp_path):
    value = _value()

    def compute():
        return value

    StepCache(tmp_path).get_or_compute("step", compute, key={"model": "m"})
    entry = next((tmp_path / "step").iterdir())
    assert sorted(p.suffix for p in entry.iterdir()) == [".json", ".parquet", ".parquet", ".parquet"]  # no pickle
    assert pd.read_parquet(next(entry.glob("*.parquet"))).shape[0] >= 1  # readable by any Parquet tool

    found, back = StepCache(tmp_path).lookup("step", compute, key={"model": "m"})
    assert found
    pd.testing.assert_frame_equal(back["frame"], value["frame"])
    assert back["frame"].heads.tolist() == [[(0, 1)], [(1, 2), (2, 0)]]  # tuples stay tuples
    assert back["heads"] == [(0, 1), (2, 3)] and back["pair"] == (1, "a") and back["none"] is None
    assert math.isnan(back["nan"])
    assert isinstance(back["dataset"], cpsuper.ConflictDataset) and list(back["dataset"]) == list(value["dataset"])
    assert back["dataset"].name == value["dataset"].name
    assert isinstance(back["sweep"], cpsuper.SweepResult)
    pd.testing.assert_frame_equal(back["sweep"].summary, value["sweep"].summary)


def test_editing_one_step_invalidates_its_entry_and_those_after_it_only(tmp_path):
    calls = []

    def first():
        calls.append("first")
        return 1

    def first_edited():
        calls.append("first edited")
        return 1

    def second():
        calls.append("second")
        return 2

    def third():
        calls.append("third")
        return 3

    def run(first_fn):
        cache = StepCache(tmp_path)
        cache.get_or_compute("first", first_fn)
        cache.get_or_compute("second", second)
        cache.get_or_compute("third", third, after=["first"])  # reads the first step's result
        return [r.status for r in cache.records]

    assert run(first) == ["computed"] * 3
    assert run(first) == ["cached"] * 3
    calls.clear()
    assert run(first_edited) == ["computed", "cached", "computed"]
    assert calls == ["first edited", "third"]


def test_library_versions_and_settings_are_part_of_the_key(tmp_path, monkeypatch):
    def one():
        return 1

    cache = StepCache(tmp_path)
    cache.get_or_compute("step", one, key={"model": "a", "seed": 0})
    assert cache.lookup("step", one, key={"model": "a", "seed": 0})[0]
    assert not cache.lookup("step", one, key={"model": "b", "seed": 0})[0]
    assert not cache.lookup("step", one, key={"model": "a", "seed": 1})[0]
    versions = step_cache.library_versions()
    monkeypatch.setattr(step_cache, "library_versions", lambda: {**versions, "torch": "0.0.1"})
    assert not cache.lookup("step", one, key={"model": "a", "seed": 0})[0]


@pytest.mark.parametrize("damage", ["truncate entry", "truncate frame", "flip a byte", "delete frame"])
def test_a_damaged_entry_is_recomputed_never_trusted(tmp_path, damage):
    value = {"frame": pd.DataFrame({"x": [1.0, 2.0, 3.0]})}

    def compute():
        return value

    StepCache(tmp_path).get_or_compute("step", compute)
    entry = next((tmp_path / "step").iterdir())
    meta, frame = entry / "entry.json", next(entry.glob("*.parquet"))
    if damage == "truncate entry":
        meta.write_text(meta.read_text()[:40])
    elif damage == "truncate frame":
        frame.write_bytes(frame.read_bytes()[:30])
    elif damage == "flip a byte":
        data = bytearray(frame.read_bytes())
        data[len(data) // 2] ^= 0xFF
        frame.write_bytes(bytes(data))
    else:
        frame.unlink()
    cache = StepCache(tmp_path)
    messages = _logged(cache)
    back = cache.get_or_compute("step", compute)
    assert cache.records[0].status == "computed"
    assert any("could not be read" in m and "recomputing" in m for m in messages)
    pd.testing.assert_frame_equal(back["frame"], value["frame"])
    assert StepCache(tmp_path).lookup("step", compute)[0]  # and stored again


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_a_stopped_step_leaves_no_entry(tmp_path, error):
    def stopped():
        raise error("stopped")

    with pytest.raises(error):
        StepCache(tmp_path).get_or_compute("step", stopped, code=[_value])
    assert not (tmp_path / "step").exists()
    cache = StepCache(tmp_path)
    assert cache.get_or_compute("step", lambda: 5, code=[_value]) == 5
    assert cache.records[0].status == "computed"


def test_step_times_are_recorded_and_printed(tmp_path):
    def busy():
        return sum(i * i for i in range(300_000))

    cache = StepCache(tmp_path)
    messages = _logged(cache)
    cache.get_or_compute("busy", busy)
    record = cache.records[0]
    assert record.seconds > 0 and record.cpu_seconds > 0
    assert messages[-1].startswith("busy: computed in") and "s CPU" in messages[-1]
    cache = StepCache(tmp_path)
    cache.get_or_compute("busy", busy)
    assert cache.records[0].status == "cached" and cache.records[0].cpu_seconds == record.cpu_seconds


@pytest.mark.parametrize(
    "value, message",
    [
        (object(), "of type object"),
        ({1: "a"}, "keys must be strings"),
        (pd.DataFrame({0: [1]}), "column names must be strings"),
    ],
)
def test_values_that_are_not_data_are_refused(tmp_path, value, message):
    with pytest.raises(TypeError, match=message):
        StepCache(tmp_path).get_or_compute("step", lambda: value)
    assert not list((tmp_path / "step").rglob("*"))  # nothing half written


def test_a_cache_from_an_incompatible_version_is_rebuilt(tmp_path):
    (tmp_path / "cpsuper-step-cache.json").write_text('{"format": 1}')  # a marker: cpsuper made it
    (tmp_path / "facts").mkdir()
    messages: list[str] = []
    cache = StepCache(tmp_path, log=messages.append)
    assert any("incompatible version of cpsuper" in m and "rebuilding" in m for m in messages)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpsuper-step-cache.json"]
    assert cache.get_or_compute("facts", lambda: 1) == 1
    messages.clear()
    StepCache(tmp_path, log=messages.append)
    assert messages == []  # a current cache is kept


# ---------------------------------------------------------------------------------------------
# cpsuper reproduce on the tiny model


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
    assert [s["status"] for s in manifest["steps"]] == ["computed"] * len(reproduce_steps.STEPS)
    assert manifest["model"] == "tiny-gemma" and manifest["quick"] and manifest["seed"] == 0
    assert set(manifest["versions"]) >= {"cpsuper", "torch", "transformer-lens"}
    assert any("unfiltered" in note for note in manifest["notes"])  # the tiny model knows nothing
    config = json.loads((report_dir / "juice.json").read_text())
    assert config["model"] == "tiny-gemma" and config["enhance"] + config["suppress"]

    page = (report_dir / "report.html").read_text()
    assert "cpsuper reproduce --model tiny-gemma --quick" in page
    assert "UNFILTERED" in page
    assert f"by the {config['fitted_on']['recipe']} recipe" in page  # unfiltered facts: the paper's rule
    assert config["fitted_on"]["recipe"] == "paper"
    from plotly.offline import get_plotlyjs

    assert page.count(get_plotlyjs()[:200]) == 1  # plotly.js inlined exactly once
    assert not re.search(r"<script[^>]+src=", page)  # nothing fetched from a CDN


def test_every_figure_caption_names_the_one_interval_convention(report_dir):
    """Every caption of a figure that draws an interval (band, error bars, hover) calls it a 95 %
    bootstrap interval over facts; no caption speaks of standard deviations or errors."""
    page = (report_dir / "report.html").read_text()
    captions = re.findall(r"<figcaption>(.*?)</figcaption>", page, flags=re.S)
    assert len(captions) >= 8
    for caption in captions:
        assert not re.search(r"standard (deviation|error)", caption), caption
        if re.search(r"error bars|band|hover", caption):
            assert "95% bootstrap interval over facts" in caption, caption


def test_second_run_reuses_the_cache(report_dir, monkeypatch, capsys):
    before = _results(report_dir)
    _no_model(monkeypatch, "the model should not be loaded when every step is cached")
    start = time.perf_counter()
    assert main(["reproduce", "--model", "tiny-gemma", "--quick", "--out", str(report_dir)]) == 0
    manifest = _manifest(report_dir)
    assert [s["status"] for s in manifest["steps"]] == ["cached"] * len(reproduce_steps.STEPS)
    assert not manifest["model_loaded"]
    assert time.perf_counter() - start < 60
    assert "report.html" in capsys.readouterr().out  # says where the report is
    assert _results(report_dir) == before  # rebuilt from the cache: the same files and report


def test_step_times_are_recorded_and_shown(report_dir):
    steps = _manifest(report_dir)["steps"]
    assert all(s["seconds"] > 0 and s["cpu_seconds"] > 0 for s in steps)
    page = (report_dir / "report.html").read_text()
    assert "<th>wall s</th>" in page and "<th>CPU s</th>" in page


def test_interrupted_run_resumes_from_the_missing_step(report_dir):
    shutil.rmtree(report_dir / "cache" / "attention")  # as if the run had stopped before the last step finished
    assert main(["reproduce", "--model", "tiny-gemma", "--quick", "--out", str(report_dir)]) == 0
    statuses = {s["step"]: s["status"] for s in _manifest(report_dir)["steps"]}
    assert statuses.pop("attention") == "computed"
    assert set(statuses.values()) == {"cached"}


@pytest.mark.parametrize(
    "broken, step, error",
    [
        ("direct_logit_attribution", "attribution", KeyboardInterrupt),
        ("head_sweep", "head_sweep", RuntimeError),
    ],
)
def test_run_stopped_in_a_step_resumes_to_the_same_report(
    report_dir, tmp_path, monkeypatch, capsys, broken, step, error
):
    """Stop a run inside one step (Ctrl-C or an exception), run again: the steps before it come from
    the cache, and the outputs equal those of the run that was never stopped."""
    names = [s.name for s in reproduce_steps.STEPS]
    out = tmp_path / "report"
    (out / "cache").mkdir(parents=True)
    for name in ["cpsuper-step-cache.json", *names[: names.index(step)]]:  # what the stopped run had finished
        source = report_dir / "cache" / name
        (shutil.copytree if source.is_dir() else shutil.copy)(source, out / "cache" / name)

    def stop(*args, **kwargs):
        raise error("stopped")

    with monkeypatch.context() as patch:
        patch.setattr(cpsuper, broken, stop)
        if error is KeyboardInterrupt:
            assert _reproduce(out) == 130
            assert "run the same command again to resume" in capsys.readouterr().err
        else:
            with pytest.raises(RuntimeError, match="stopped"):
                _reproduce(out)
    assert not (out / "cache" / step).exists()  # the stopped step left no entry
    assert not (out / "report.html").exists()

    assert _reproduce(out) == 0
    statuses = _statuses(out)
    first = names.index(step)
    assert [statuses[n] for n in names] == ["cached"] * first + ["computed"] * (len(names) - first)
    assert _results(out) == _results(report_dir)


def test_a_corrupt_cache_entry_is_recomputed(report_dir, capsys):
    entry = next((report_dir / "cache" / "head_sweep").iterdir())
    frame = next(entry.glob("*.parquet"))
    frame.write_bytes(frame.read_bytes()[: frame.stat().st_size // 2])  # a torn file
    before = _results(report_dir)
    assert _reproduce(report_dir) == 0
    assert "head_sweep: the cached result could not be read" in capsys.readouterr().err
    statuses = _statuses(report_dir)
    assert statuses.pop("head_sweep") == "computed"
    assert set(statuses.values()) == {"cached"}
    assert _results(report_dir) == before


def test_editing_a_step_recomputes_that_step_only(report_dir, monkeypatch):
    """A step whose code changed (here: an equivalent function with different source) is
    recomputed; every other step, including those after it, comes from the cache."""
    before = _results(report_dir)

    def edited_attention_step(run):  # same result as attention_step, different code
        spans = ["subject", "context"]
        return {
            span: cpsuper.attention_to_span(run.model, run.analysis, span=span, progress=run.progress) for span in spans
        }

    edited = tuple(
        dataclasses.replace(s, fn=edited_attention_step) if s.name == "attention" else s for s in reproduce_steps.STEPS
    )
    monkeypatch.setattr(reproduce_steps, "STEPS", edited)
    assert _reproduce(report_dir) == 0
    statuses = _statuses(report_dir)
    assert statuses.pop("attention") == "computed"
    assert set(statuses.values()) == {"cached"}
    assert _results(report_dir) == before


@pytest.mark.parametrize("kind", ["a user's folder", "a link"])
def test_a_cache_folder_cpsuper_did_not_create_stops_the_run_and_is_kept(tmp_path, monkeypatch, kind):
    out = tmp_path / "report"
    out.mkdir()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("months of work")
    if kind == "a link":
        (out / "cache").symlink_to(mine)
    else:
        shutil.copytree(mine, out / "cache")
    _no_model(monkeypatch, "the cache folder must be checked before the model is loaded")
    with pytest.raises(SystemExit) as err:
        _reproduce(out)
    message = str(err.value)
    assert str(out / "cache") in message and "--out" in message and "remove" in message
    assert ("symbolic link" in message) == (kind == "a link")
    assert (out / "cache" / "thesis.tex").read_text() == (mine / "thesis.tex").read_text() == "months of work"
    assert sorted(p.name for p in (out / "cache").iterdir()) == ["thesis.tex"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--relations", "world_capital", "moon_phase"], "Unknown relation"),
        (["--n-examples", "0"], "--n-examples must be at least 1"),
        (["--device", "banana"], "Unknown device"),
        (["--out", "FILE"], "is a file"),
        (["--export", "svg,jpg"], "supported: svg, pdf, png"),
    ],
)
def test_bad_arguments_fail_before_the_model_loads(tmp_path, monkeypatch, args, message):
    _no_model(monkeypatch, "bad arguments must fail before the model is loaded")
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
        check=False,
        capture_output=True,
        text=True,
        timeout=180,
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
def test_report_explorer_page_answers_a_click_in_chromium(report_dir):
    """The report links explorer.html; a click on a head (sent through the page's hash) selects it
    and redraws its panels, offline and with no console error."""
    assert 'href="explorer.html"' in (report_dir / "report.html").read_text()
    done = _chromium(
        "--enable-logging=stderr",
        "--v=0",
        "--dump-dom",
        (report_dir / "explorer.html").resolve().as_uri() + "#click=2,1",
    )
    title = re.search(r"<title>(.*?)</title>", done.stdout).group(1)
    assert title.startswith("selected L2H1"), title
    assert 'data-selected="L2H1"' in done.stdout and done.stdout.count('class="main-svg"') >= 4
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
    assert not [line for line in console if "Uncaught" in line or ":ERROR:CONSOLE" in line]


@needs_chromium
def test_report_screenshot(report_dir):
    shot = report_dir / "report.png"
    _chromium(f"--screenshot={shot}", "--window-size=1400,4000", (report_dir / "report.html").resolve().as_uri())
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 50_000


# ---------------------------------------------------------------------------------------------
# What the report says it found


CI = r"-?\d+\.\d+ \[-?\d+\.\d+, -?\d+\.\d+\]"  # 0.53 [0.37, 0.70]


def _findings(page: str) -> list[str]:
    return [re.sub(r"<[^>]+>", "", f) for f in re.findall(r'<div class="finding[^"]*">(.*?)</div>', page, re.S)]


def test_every_section_says_what_the_paper_reports_and_what_this_run_shows(report_dir):
    page = (report_dir / "report.html").read_text()
    sections = re.split(r'<h2 id="', page)[1:]
    assert len(sections) == 10  # eight analyses, the head explorer and the file list
    for section in sections[:-2]:  # the explorer section states no finding: it links a page
        lines = _findings(section)
        assert lines, section[:40]
        for line in lines:
            assert "The paper reports:" in line and "This run shows:" in line
            assert re.search(r"(\b|n = )\d+ (held-out )?facts", line), line  # n is given
    compared = [f for f in _findings(page) if "no comparison" not in f]
    assert len(compared) >= 6  # knockouts, superposition, Table 1, Table 2, Figure 6, Table 3
    for line in compared:
        assert re.search(CI, line), line  # every compared claim carries a bootstrap interval
        assert re.search(r"(agrees|differs|inconclusive)", line)


def test_small_samples_are_flagged(report_dir):
    page = (report_dir / "report.html").read_text()
    warnings = re.findall(r'<p class="small-sample">(.*?)</p>', page, re.S)
    assert len(warnings) >= 8  # four facts per analysis, three per Table 3 cell
    assert all("Small sample: n = " in w for w in warnings)
    assert "3 in the" in page  # Table 3 pools 18 facts, but each cell holds 3


def test_no_small_sample_warning_from_ten_facts_on():
    rows = [
        {
            "example": i,
            "conflict_type": ct,
            "module": "attn",
            "layer": 0,
            "target": "parametric",
            "delta": 0.1 + i / 100,
        }
        for i in range(12)
        for ct in ("substitution", "coherent")
    ]
    (finding,) = report_findings.knockout_findings(pd.DataFrame(rows))
    assert finding.n == 12 and not finding.small and finding.verdict == "agrees"
    (few,) = report_findings.knockout_findings(pd.DataFrame([r for r in rows if r["example"] < 4]))
    assert few.small and few.n == 4
    flat = pd.DataFrame([{**r, "delta": 0.0} for r in rows])
    assert report_findings.knockout_findings(flat)[0].verdict == "differs"  # 12 facts, no gain: not the paper


def test_table3_has_intervals_relations_as_rows_and_fixed_order(report_dir):
    table = pd.read_csv(report_dir / "table3_intervals.csv")
    methods = ["Original", "Prompt", "CAD", "PH3", "JuNe", "JuICE"]
    assert list(table.columns) == ["conflict", "relation", "facts", *methods]
    assert list(dict.fromkeys(table.conflict)) == ["clean", "substitution", "coherent"]
    for _, rows in table.groupby("conflict", sort=False):
        assert list(rows.relation[:2]) == ["average over relations", "world_capital"]
        assert len(rows) == 7
    cells = [c for c in table[methods].to_numpy().ravel() if isinstance(c, str)]  # skipped cells stay empty
    assert len(cells) >= 0.8 * table[methods].size
    assert all(re.fullmatch(CI, c) for c in cells), cells[:3]
    page = (report_dir / "report.html").read_text()
    assert "average over relations" in page and re.search(r"<td>" + CI + "</td>", page)


def test_table3_under_both_protocols_and_whether_juice_steers(report_dir):
    """Table 3 is reported under cpsuper's protocol and the paper's (substring reading, 10 / 15
    tokens, unfiltered facts); the report says whether the fitted JuICE steers."""
    ours = pd.read_csv(report_dir / "table3_per_example.csv")
    paper = pd.read_csv(report_dir / "table3_paper_protocol_per_example.csv")
    intervals = pd.read_csv(report_dir / "table3_paper_protocol_intervals.csv")
    assert set(paper.method) == set(ours.method) and list(intervals.columns) == list(
        pd.read_csv(report_dir / "table3_intervals.csv").columns
    )
    # The paper's reading of each continuation, recomputed by hand: an alias anywhere in the
    # normalized first five words; JuICE decodes more tokens than Original.
    facts = {(r.relation, r.subject): r for r in _facts_table(report_dir).itertuples()}
    for row in paper.sample(n=min(40, len(paper)), random_state=0).itertuples():
        fact = facts[(row.relation, row.subject)]
        text = "" if pd.isna(row.continuation) else row.continuation
        head = normalize_answer(" ".join(text.split()[:5]))
        aliases = cpsuper.load_relation(row.relation).fact(row.subject).aliases
        assert row.correct == float(any(normalize_answer(a) in head for a in (fact.answer, *aliases)))
    config = json.loads((report_dir / "juice.json").read_text())
    page = (report_dir / "report.html").read_text()
    assert "under the JuICE paper's evaluation protocol" in page
    assert ("This fit does not steer" in page) is (not config["steers"])
    assert ("(the context gate)" in page) is (config.get("context_gate") is not None)


def _facts_table(report_dir):
    return pd.read_csv(report_dir / "facts.csv")


def test_every_figure_caption_gives_n(report_dir):
    page = (report_dir / "report.html").read_text()
    captions = re.findall(r"<figcaption>(.*?)</figcaption>", page, re.S)
    assert len(captions) == _manifest(report_dir)["n_figures"]
    assert all(re.search(r"n = \d+", c) for c in captions), captions


def test_export_writes_one_svg_per_figure(report_dir, tmp_path):
    try:  # the check `--export` itself makes, so the test skips exactly where the command would refuse
        check_export("svg")
    except ImportError as missing:
        pytest.skip(str(missing))
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (.ci/run installs it); kaleido draws in it")
    out = tmp_path / "report"
    shutil.copytree(report_dir / "cache", out / "cache")  # the same results, from the cache
    assert main(["reproduce", "--model", "tiny-gemma", "--quick", "--out", str(out), "--export", "svg"]) == 0
    manifest = _manifest(out)
    svgs = sorted((out / "figures").glob("*.svg"))
    assert len(svgs) == manifest["n_figures"] >= 8
    assert [p.suffix for p in (out / "figures").iterdir()] == [".svg"] * len(svgs)  # only the format asked for
    assert {f"figures/{p.name}" for p in svgs} <= set(manifest["files"])
    for svg in svgs:
        root = ET.parse(svg).getroot()
        assert root.tag.endswith("svg") and len(root) > 0, svg.name


def test_bf16_weights_load_in_bf16_and_read_out_in_float32():
    """--dtype bfloat16: the run's model is loaded in bf16 and its steps score in float32."""
    import torch

    run = reproduce_steps.Run("tiny-gemma", ["world_capital"], QUICK, 0, None, False, dtype="bfloat16")
    assert run.model.cfg.dtype == torch.bfloat16
    facts = reproduce_steps.facts_step(run)
    assert len(facts["sampled"]["world_capital"]) == QUICK.n_examples
    scores = cpsuper.score_dataset(
        run.model, facts["sampled"]["world_capital"][:2], conflict_types=["clean"], progress=False
    )
    probabilities = scores[scores.measure.str.startswith("p_")]
    assert len(probabilities) == 4 and probabilities.value.between(0, 1).all()


def test_every_step_runs_on_a_bf16_model(tmp_path):
    """`cpsuper reproduce --quick --dtype bfloat16` end to end (the DLA step once failed on bf16
    weights): every output is written, the manifest records the dtype, the DLA is finite."""
    import pandas as pd

    out = tmp_path / "bf16"
    assert main(["reproduce", "--model", "tiny-gemma", "--quick", "--dtype", "bfloat16", "--out", str(out)]) == 0
    manifest = _manifest(out)
    assert manifest["dtype"] == "bfloat16" and all((out / f).exists() for f in manifest["files"])
    dla = pd.read_csv(out / "dla_components.csv")
    assert len(dla) > 0 and dla["dla"].notna().all() and dla["dla"].abs().lt(float("inf")).all()


def test_an_unknown_dtype_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        main(["reproduce", "--model", "tiny-gemma", "--dtype", "int8", "--out", str(tmp_path / "out")])
    with pytest.raises(ValueError, match="--dtype 'int8' is not one of float32, bfloat16, float16"):
        check_arguments("tiny-gemma", None, None, tmp_path / "out", None, "int8")


def test_table2_ranks_juice_stage_one_knockouts_as_its_own_sweep_would(monkeypatch):
    run = reproduce_steps.Run("tiny-gemma", ["world_capital"], QUICK, 0, None, False)
    run.results["facts"] = reproduce_steps.facts_step(run)
    run.results["juice"] = reproduce_steps.juice_step(run)
    assert "coherent" in run.results["juice"]["identified"].conflict_types
    fresh = cpsuper.heads.top_knockout_heads(run.model, run.parts.select, k=QUICK.table2_k, progress=False)

    def no_sweep(*args, **kwargs):
        raise AssertionError("Table 2's ranking ran a head sweep that JuICE stage 1 had already run")

    monkeypatch.setattr(cpsuper.heads, "head_sweep", no_sweep)
    combined = reproduce_steps.combine_step(run)
    pd.testing.assert_frame_equal(combined["ranking"], fresh, atol=1e-6, rtol=0)
    assert len(fresh) > 1


def _table3_results(juice, others, n=12, relations=("world_capital", "official_language")):
    """Greedy correctness per fact: ``juice[(relation, conflict_type)]`` facts right for JuICE,
    ``others[(method, conflict_type)]`` for the other methods (the same on every relation)."""
    rows = []
    for relation in relations:
        for ct in ("clean", "substitution", "coherent"):
            right = {
                "JuICE": juice.get((relation, ct), juice.get(ct, 0)),
                **{m: k for (m, c), k in others.items() if c == ct},
            }
            for method, k in right.items():
                rows += [
                    {"relation": relation, "example": i, "method": method, "conflict_type": ct, "correct": i < k}
                    for i in range(n)
                ]
    return pd.DataFrame(rows)


def test_table3_verdict_tests_the_whole_claim():
    base = {("Original", "clean"): 12, ("Original", "substitution"): 1, ("Original", "coherent"): 0}
    base |= {("JuNe", "clean"): 12, ("JuNe", "substitution"): 6, ("JuNe", "coherent"): 4}
    paper_like = _table3_results({"clean": 12, "substitution": 11, "coherent": 9}, base)
    (agrees,) = report_findings.evaluation_findings(paper_like)
    assert agrees.verdict == "agrees", agrees.run

    clean_lost = _table3_results({"clean": 8, "substitution": 11, "coherent": 9}, base)
    (finding,) = report_findings.evaluation_findings(clean_lost)
    assert finding.verdict == "partly" and "loses clean accuracy" in finding.run

    june_ahead = _table3_results({"clean": 12, "substitution": 11, "coherent": 5}, base | {("JuNe", "coherent"): 9})
    (finding,) = report_findings.evaluation_findings(june_ahead)
    assert finding.verdict == "partly" and "JuNe (0.75) beat JuICE" in finding.run

    one_flat = {"clean": 12, "substitution": 11, "coherent": 9, ("official_language", "coherent"): 0}
    (finding,) = report_findings.evaluation_findings(_table3_results(one_flat, base))
    assert finding.verdict == "partly" and "no coherent gain on official_language" in finding.run

    no_gain = _table3_results({"clean": 12, "substitution": 1, "coherent": 0}, base)
    assert report_findings.evaluation_findings(no_gain)[0].verdict == "differs"
