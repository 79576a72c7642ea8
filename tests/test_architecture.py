"""The package's layout rules (ARCHITECTURE.md), checked on its source.

- no module imports another module's underscore names;
- imports run down the layers, never up (a deprecated alias inside a module ``__getattr__`` may
  import lazily from anywhere);
- only the drawing and reporting layers import plotly;
- modules stay small enough to read (data tables excepted);
- docs/api.md lists exactly the top-level names.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import cpsuper as cp

PACKAGE = Path(cp.__file__).parent
ROOT = PACKAGE.parent

# Lower numbers are lower layers; a module may import from its own layer or below.
LAYERS = {
    "cpsuper.compat": 0,
    "cpsuper.data": 0,
    "cpsuper.stats": 0,
    "cpsuper.backend": 1,
    "cpsuper.bridge": 1,
    "cpsuper.embedded": 1,
    "cpsuper.models": 1,
    "cpsuper.model_cache": 1,
    "cpsuper.runtime": 1,
    "cpsuper.decoding": 1,
    "cpsuper.interrupts": 1,
    "cpsuper.precision": 1,
    "cpsuper.weight_layout": 1,
    "cpsuper.grouped_attention": 1,
    "cpsuper.distributed": 1,
    "cpsuper.memory": 1,
    "cpsuper.kv_cache": 1,
    "cpsuper.metrics": 1,
    "cpsuper.tiny": 1,
    "cpsuper.spans": 1,
    "cpsuper.reading": 1,
    "cpsuper.interventions": 2,
    "cpsuper.engine": 2,
    "cpsuper.dual_run": 2,
    "cpsuper.scoring": 2,
    "cpsuper.answers": 2,
    "cpsuper.roles": 3,
    "cpsuper.heads": 3,
    "cpsuper.knockouts": 3,
    "cpsuper.identification": 3,
    "cpsuper.tuning": 3,
    "cpsuper.juice": 3,
    "cpsuper.variance": 3,
    "cpsuper.baselines": 3,
    "cpsuper.path_patching": 3,
    "cpsuper.additivity": 3,
    "cpsuper.attribution": 3,
    "cpsuper.mechanisms": 3,
    "cpsuper.attention": 3,
    "cpsuper.truncation": 3,
    "cpsuper.robustness": 3,
    "cpsuper.trajectories": 3,
    "cpsuper.finetune": 3,
    "cpsuper.toys": 3,
    "cpsuper.plots": 4,
    "cpsuper.explore": 5,
    "cpsuper.reproduce": 5,
    "cpsuper.cli": 6,
    "cpsuper": 7,  # the package's __init__ re-exports everything
}
PLOTTING_LAYERS = {"cpsuper.plots", "cpsuper.explore", "cpsuper.reproduce"}
LONG_MODULES_ALLOWED = {"cpsuper/data/relations.py"}  # data tables
MAX_LINES = 420


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append((".".join(parts), path))
    return out


def _layer(module: str) -> tuple[str, int]:
    best = max((name for name in LAYERS if module == name or module.startswith(name + ".")), key=len)
    return best, LAYERS[best]


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, path: Path):
    """``(line, imported module, names, inside a module __getattr__)`` for every import."""
    tree = ast.parse(path.read_text())
    lazy_alias_lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            lazy_alias_lines |= {n.lineno for n in ast.walk(node) if hasattr(n, "lineno")}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _resolve(module, path, node)
            yield node.lineno, target, [a.name for a in node.names], node.lineno in lazy_alias_lines
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, [], node.lineno in lazy_alias_lines


def test_every_module_has_a_layer():
    for module, _ in _modules():
        assert any(module == n or module.startswith(n + ".") for n in LAYERS), f"{module} has no layer in LAYERS"


def test_no_module_imports_another_modules_private_names():
    found = []
    for module, path in _modules():
        for line, target, names, _ in _imports(module, path):
            if not target.startswith("cpsuper"):
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if target.split(".")[-1].startswith("_") and target != module:
                private.append(target)
            if private and target != module:
                found.append(f"{path.relative_to(ROOT)}:{line} imports {private} from {target}")
    assert not found, "\n".join(found)


def test_imports_run_down_the_layers():
    found = []
    for module, path in _modules():
        home, level = _layer(module)
        for line, target, names, lazy_alias in _imports(module, path):
            if not target.startswith("cpsuper") or lazy_alias:
                continue
            targets = [target]
            if target == "cpsuper" or target == home:  # `from . import plots` names submodules
                targets = [f"{target}.{n}" for n in names]
            for t in targets:
                if not any(t == n or t.startswith(n + ".") for n in LAYERS):
                    continue
                other, other_level = _layer(t)
                if other_level > level and other != home:
                    found.append(
                        f"{path.relative_to(ROOT)}:{line} ({home}, layer {level}) imports {t} (layer {other_level})"
                    )
    assert not found, "\n".join(found)


def test_only_drawing_layers_import_plotly():
    found = []
    for module, path in _modules():
        home, _ = _layer(module)
        if home in PLOTTING_LAYERS:
            continue
        for line, target, _, lazy_alias in _imports(module, path):
            if target.split(".")[0] in ("plotly", "circuitsvis") and not lazy_alias:
                found.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not found, "\n".join(found)


def test_modules_stay_readable():
    long = [
        f"{path.relative_to(ROOT)}: {n} lines"
        for _, path in _modules()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
        and str(path.relative_to(ROOT)) not in LONG_MODULES_ALLOWED
    ]
    assert not long, "\n".join(long)


def test_api_page_lists_exactly_the_top_level_names():
    text = (ROOT / "docs" / "api.md").read_text()
    block = re.search(r"<!-- top-level names: start -->(.*?)<!-- top-level names: end -->", text, re.S)
    assert block, "docs/api.md lacks the generated list of top-level names (run scripts/update_api_docs.py)"
    listed = re.findall(r"`cp\.([A-Za-z_][A-Za-z0-9_]*)`", block.group(1))
    assert sorted(listed) == sorted(cp.__all__), (
        "docs/api.md is out of date; run `python scripts/update_api_docs.py`. "
        f"missing: {sorted(set(cp.__all__) - set(listed))}, extra: {sorted(set(listed) - set(cp.__all__))}"
    )


def test_api_page_modules_exist():
    import importlib

    text = (ROOT / "docs" / "api.md").read_text()
    for name in re.findall(r"^::: ([\w.]+)", text, re.M):
        importlib.import_module(name)


@pytest.mark.parametrize("name", sorted(cp.__all__))
def test_top_level_names_resolve(name):
    assert getattr(cp, name) is not None
