"""Every ```python block in README.md and docs/*.md runs.

Each page's blocks run in order in one namespace (so a later block can use what an earlier one
defined), in a temporary working directory (snippets may write files). Pages whose snippets use
the embedded Gemma-3-270M are marked slow; the model is loaded once per test session and shared
between pages.

Conventions for writers of docs:

- Only fences opened with ```python run; ```bash, ```text, output blocks and indented code do not.
- A block that deliberately cannot run as written (it needs a GPU, the network, or objects the
  reader supplies) is preceded by the line ``<!-- snippet: skip -->``. Use it sparingly; prefer a
  cheap runnable form with a sentence on how to run the full setting.
- Pages owned by other authors can list blocks the runner must leave out in ``SKIP`` below
  (matched by a substring of the block), each with the reason. Remove entries once the page is
  fixed.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SKIP_MARKER = "<!-- snippet: skip -->"

# page -> [(substring identifying the block, reason)]
SKIP: dict[str, list[tuple[str, str]]] = {
    "docs/toys_truncation.md": [
        ("NoisyRecallConfig.paper(seq_len=64", "mid-size run: about 6.5 minutes on one core"),
        ("BigramChain.from_text(text)", "needs a text the reader supplies (`text` is undefined)"),
    ],
    "docs/truncation.md": [
        ("with truncate(model, Truncation(16", "uses `model` before the page loads it (the load is in a later block)"),
        ("truncation_sweep(model, known_facts", "`known_facts` is undefined on the page"),
        ('for which in ["mlp_in", "mlp_gate"', "four full sweeps over 18 layers x 9 rank fractions: minutes"),
    ],
    "docs/toys_training_dynamics.md": [
        ("FinetuningConfig.larger()", "the larger finetuning run: about 5.5 minutes"),
    ],
}

_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")


def python_blocks(text: str) -> list[tuple[int, str, bool]]:
    """(first line number, code, marked skip) for each fenced ```python block, in order."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1
        if lang.lower() in ("python", "py", "python3"):
            previous = next((l.strip() for l in reversed(lines[: start - 1]) if l.strip()), "")
            blocks.append((start + 1, "\n".join(body), previous == SKIP_MARKER))
    return blocks


def pages() -> list[str]:
    found = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
    return [p for p in found if python_blocks((ROOT / p).read_text())]


def uses_embedded_model(page: str) -> bool:
    code = "\n".join(c for _, c, skip in python_blocks((ROOT / page).read_text()) if not skip)
    return bool(re.search(r"load_model\(\s*(\)|device|dtype|\"gemma|'gemma)", code))


def _params():
    for page in pages():
        marks = [pytest.mark.slow] if uses_embedded_model(page) else []
        yield pytest.param(page, marks=marks, id=page)


_MODELS: dict = {}


@pytest.fixture
def shared_model(monkeypatch):
    """Make ``cp.load_model()`` of the embedded model return one shared instance per session
    (loading it costs seconds; the snippets never modify weights). Other names load normally."""
    import cpsuper as cp

    original = cp.load_model

    def load_model(name: str = cp.hub.DEFAULT_MODEL, *args, **kwargs):
        if name in (cp.hub.DEFAULT_MODEL, "gemma-3-270m") and not args and not kwargs:
            if "gemma" not in _MODELS:
                _MODELS["gemma"] = original()
            return _MODELS["gemma"]
        return original(name, *args, **kwargs)

    monkeypatch.setattr(cp, "load_model", load_model)
    yield


def test_extractor_finds_blocks_and_markers():
    text = "\n".join(
        [
            "```python",
            "a = 1",
            "```",
            "```bash",
            "echo no",
            "```",
            SKIP_MARKER,
            "",
            "```python",
            "raise SystemExit",
            "```",
            "    ```python",
            "    b = a + 1",
            "    ```",
        ]
    )
    blocks = python_blocks(text)
    assert [(code, skip) for _, code, skip in blocks] == [
        ("a = 1", False),
        ("raise SystemExit", True),
        ("b = a + 1", False),
    ]
    assert blocks[0][0] == 2


@pytest.mark.parametrize("page", list(_params()))
def test_page_snippets_run(page, shared_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    namespace: dict = {"__name__": f"snippets:{page}"}
    skips = SKIP.get(page, [])
    for line, code, marked in python_blocks((ROOT / page).read_text()):
        reason = "marked skip" if marked else next((r for s, r in skips if s in code), None)
        if reason:
            print(f"{page}:{line}: skipped ({reason})")
            continue
        started, cpu = time.perf_counter(), time.process_time()
        try:
            exec(compile("\n" * (line - 1) + code, str(ROOT / page), "exec"), namespace)
        except Exception as error:
            raise AssertionError(f"The snippet at {page}, line {line}, failed: {error!r}") from error
        print(f"{page}:{line}: {time.perf_counter() - started:.1f} s ({time.process_time() - cpu:.1f} s CPU)")
