"""Execute every notebook under notebooks/ top to bottom, as a user would, and fail on any error.

Each notebook runs in a fresh ``python3`` kernel (the one installed with ipykernel in the current
environment) on a copy in a temporary directory, so files it writes never land in the repository.
The kernel gets ``HF_HUB_OFFLINE=1``. Committed notebooks must carry no outputs.

    python -m pytest tests/test_notebooks.py            # all of them (several minutes on a CPU)
    python -m pytest tests/test_notebooks.py -m "not slow"   # only the checks that need no model
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
CELL_TIMEOUT = int(os.environ.get("CPSUPER_NOTEBOOK_CELL_TIMEOUT", "900"))  # seconds per cell

# Notebooks that load the embedded Gemma-3-270M (slow marker); the others train toy models only.
USES_EMBEDDED_MODEL = {
    "01_quickstart.ipynb",
    "02_superposition.ipynb",
    "03_juice_steering.ipynb",
    "04_where_answers_come_from.ipynb",
    "05_memory_in_weights.ipynb",
    "06_head_explorer.ipynb",
    "07_head_roles.ipynb",
    "08_where_in_the_prompt.ipynb",
}

PLOTLY = "application/vnd.plotly.v1+json"


def _outputs(nb) -> tuple[str, set[str]]:
    """All stream text and the set of rich output types of an executed notebook."""
    text, kinds = [], set()
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                text.append(out.text)
            kinds.update(out.get("data", {}))
    return "".join(text), kinds


def _check_head_roles(nb) -> None:
    # The notebook's last code cells assert the invariants of its roles, transitions and flips
    # and print this line; the figure of cp.plots.plot_head_roles must be among the outputs.
    text, kinds = _outputs(nb)
    assert "all checks passed" in text, "07_head_roles: the invariant checks did not run"
    assert PLOTLY in kinds, f"07_head_roles: no plotly figure among the outputs {sorted(kinds)}"


def _check_where_in_the_prompt(nb) -> None:
    # Each section ends with a cell that asserts its invariants and prints one line: the logit
    # lens's last layer equals a plain forward pass, the causal trace has subject rows at every
    # traced layer and starts from the lens's probabilities, attribution patching covers every
    # head with a finite Spearman against exact patching, and zero ablation is the default knockout
    # while one-token answers score the same whole. Four figures: lens, trace, attribution
    # heatmaps, attribution vs exact.
    text, _ = _outputs(nb)
    checks = ("logit lens", "causal trace", "attribution patching", "ablation and metric")
    for line in (f"{check} check" for check in checks):
        assert line in text, f"08_where_in_the_prompt: {line!r} is not among the outputs"
    figures = sum(PLOTLY in out.get("data", {}) for cell in nb.cells for out in cell.get("outputs", []))
    assert figures == 4, f"08_where_in_the_prompt: {figures} plotly figures among the outputs, expected 4"


# Checks on an executed notebook's outputs, beyond running without error.
OUTPUT_CHECKS = {
    "07_head_roles.ipynb": _check_head_roles,
    "08_where_in_the_prompt.ipynb": _check_where_in_the_prompt,
}


def _params(mark_slow: bool):
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        marks = [pytest.mark.slow] if mark_slow and path.name in USES_EMBEDDED_MODEL else []
        yield pytest.param(path, id=path.stem, marks=marks)


def test_notebooks_exist():
    names = {p.name for p in NOTEBOOKS.glob("*.ipynb")}
    assert USES_EMBEDDED_MODEL <= names, f"missing notebooks: {sorted(USES_EMBEDDED_MODEL - names)}"


@pytest.mark.parametrize("path", list(_params(mark_slow=False)))
def test_notebook_is_committed_without_outputs(path: Path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    dirty = [
        i for i, cell in enumerate(nb.cells) if cell.cell_type == "code" and (cell.outputs or cell.execution_count)
    ]
    assert not dirty, f"{path.name}: cells {dirty} carry outputs or execution counts; strip them before committing."


@pytest.mark.parametrize("path", list(_params(mark_slow=True)))
def test_notebook_runs(path: Path, tmp_path: Path, monkeypatch):
    # The kernel inherits this process's environment: no model hub, and one tokenizer thread.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    # Make the kernel import cpsuper from this checkout even when it is not installed editable.
    repo = str(NOTEBOOKS.parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))
    copy = tmp_path / path.name
    shutil.copy(path, copy)
    nb = nbformat.read(copy, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
        allow_errors=False,
    )
    start = time.perf_counter()
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as error:
        pytest.fail(f"{path.name} failed:\n{error}", pytrace=False)
    elapsed = time.perf_counter() - start
    print(f"\n{path.name}: executed in {elapsed:.0f} s", file=sys.stderr)
    if os.environ.get("CPSUPER_NOTEBOOK_OUT"):  # keep the executed copy for inspection
        out = Path(os.environ["CPSUPER_NOTEBOOK_OUT"])
        out.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, out / path.name)
    if path.name in OUTPUT_CHECKS:
        OUTPUT_CHECKS[path.name](nb)
