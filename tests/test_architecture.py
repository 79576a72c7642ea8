"""The package's layout rules (ARCHITECTURE.md), checked on its source.

The layer table is read from ARCHITECTURE.md itself, so the document and the code cannot drift:
every module must be in the table, and every import (at module level or inside a function, and
``import cpsuper as cp`` too) must point down the table or within its own layer. Imports under
``if TYPE_CHECKING:`` never run and are ignored. Further rules:

- no import circles between modules, function-level imports included;
- no module imports another module's underscore names;
- a public name (in a module's ``__all__``) is defined in that module; only a package's
  ``__init__`` lists names of its own submodules, so each name has one home;
- analyses take their options by keyword after the model, the data and what is swept;
- only the drawing and front-end layers import plotly or circuitsvis;
- modules stay small enough to read (data tables excepted);
- docs/api.md lists exactly the top-level names, and there are at most 60 of them.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

import cpsuper as cp

PACKAGE = Path(cp.__file__).parent
ROOT = PACKAGE.parent
DRAWING_LAYERS = {"drawing", "front ends"}
LONG_MODULES_ALLOWED = {"cpsuper/data/relations.py"}  # data tables
MAX_LINES = 420
MAX_TOP_LEVEL = 60
# Entry points that take more than the model, the data and what is swept by position, and why.
POSITIONAL_EXCEPTIONS = {
    "cpsuper.engine.run_conditions": "model, tokens, answers and conditions are all data",
    "cpsuper.sweeps.sweep_dataset": "model, dataset, conditions and their labels are all data",
    "cpsuper.engine.answer_probabilities": "model, tokens, answers and conditions are all data",
    "cpsuper.answers.whole_answer_conditions": "model, tokens, answers and conditions are all data",
    "cpsuper.dual_run.unsteered_pass": "an internal step of the dual run",
    "cpsuper.truncation.hf_weights.hf_replacements": "the weight to replace is addressed by three values",
    "cpsuper.reproduce.pipeline.reproduce": "the command line's arguments",
    "cpsuper.reproduce.settings.check_arguments": "the command line's arguments",
}


def _architecture_table() -> list[tuple[int, str, list[str]]]:
    """``(order, layer name, modules)`` per row of ARCHITECTURE.md's layer table."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not re.match(r"^\d+ ", cells[0]):
            continue
        order, name = cells[0].split(" ", 1)
        modules = re.findall(r"`([\w/]+(?:\.py|/))`", cells[1])
        rows.append((int(order), name, modules))
    return rows


def _module_name(entry: str) -> str:
    """``"plots/"`` -> ``cpsuper.plots``; ``"models.py"`` -> ``cpsuper.models``; ``__init__.py`` -> ``cpsuper``."""
    if entry == "__init__.py":
        return "cpsuper"
    return "cpsuper." + entry.removesuffix("/").removesuffix(".py").replace("/", ".")


LAYERS = {_module_name(m): (order, name) for order, name, modules in _architecture_table() for m in modules}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _layer(module: str) -> tuple[str, tuple[int, str]]:
    """The table entry covering ``module`` (itself, or the package folder it lies in)."""
    home = max((n for n in LAYERS if module == n or module.startswith(n + ".")), key=len)
    return home, LAYERS[home]


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            lines |= {n.lineno for b in node.body for n in ast.walk(b) if hasattr(n, "lineno")}
    return lines


def _imports(module: str, path: Path):
    """``(line, imported module, names)`` for every import that runs (module or function level)."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_lines(tree)
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            yield node.lineno, _resolve(module, path, node), [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []


def _targets(target: str, names: list[str]) -> list[str]:
    """The package modules an import loads: ``from . import plots`` names the submodule."""
    if not target.startswith("cpsuper"):
        return []
    subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
    if subs and len(subs) == len(names):
        return subs
    owner = target
    while owner not in MODULES:
        owner = owner.rsplit(".", 1)[0]
    return [owner, *subs]


def _graph() -> dict[str, set[str]]:
    return {
        m: {t for _, target, names in _imports(m, p) for t in _targets(target, names) if t != m}
        for m, p in MODULES.items()
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_every_module_is_in_the_architecture_table():
    missing = [m for m in MODULES if not any(m == n or m.startswith(n + ".") for n in LAYERS if n != "cpsuper")]
    missing = [m for m in missing if m != "cpsuper"]
    assert not missing, f"ARCHITECTURE.md's layer table lacks {missing}"
    stale = [n for n in LAYERS if n not in MODULES]
    assert not stale, f"ARCHITECTURE.md's layer table names modules that do not exist: {stale}"
    files = [n for n in LAYERS if MODULES.get(n, Path()).name not in ("__init__.py", "")]
    assert len(files) > 30, "the layer table was not read (ARCHITECTURE.md's format changed?)"


def test_imports_run_down_the_layers():
    found = []
    for module, path in MODULES.items():
        home, (level, name) = _layer(module)
        for line, target, names in _imports(module, path):
            for t in _targets(target, names):
                other, (other_level, other_name) = _layer(t)
                if other_level > level and other != home:
                    found.append(
                        f"{path.relative_to(ROOT)}:{line} ({name}, {level}) imports {t} ({other_name}, {other_level})"
                    )
    assert not found, "\n".join(found)


def test_no_import_circles():
    cycles = _cycles(_graph())
    assert not cycles, "import circles (function-level imports included):\n" + "\n".join(map(str, cycles))


def test_the_circle_check_can_fail():
    graph = _graph()
    graph["cpsuper.stats"] = graph["cpsuper.stats"] | {"cpsuper.juice"}  # juice imports stats, indirectly
    assert any("cpsuper.stats" in c and "cpsuper.juice" in c for c in _cycles(graph))


def test_function_level_imports_are_seen():
    seen = {t for _, t, _ in _imports("cpsuper.models", MODULES["cpsuper.models"])}
    assert "cpsuper.bridge" in seen, "load_model imports the bridge inside a function"


def test_no_module_imports_another_modules_private_names():
    found = []
    for module, path in MODULES.items():
        for line, target, names in _imports(module, path):
            if not target.startswith("cpsuper") or target == module:
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if target.split(".")[-1].startswith("_"):
                private.append(target)
            if private:
                found.append(f"{path.relative_to(ROOT)}:{line} imports {private} from {target}")
    assert not found, "\n".join(found)


def _public_names(path: Path) -> tuple[list[str], dict[str, str]]:
    """A module's ``__all__`` and, for each name it imports, the module it comes from."""
    tree = ast.parse(path.read_text())
    names, imported = [], {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            names = [e.value for e in node.value.elts]
    module = next(m for m, p in MODULES.items() if p == path)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for a in node.names:
                imported[a.asname or a.name] = _resolve(module, path, node)
    return names, imported


def test_every_public_name_has_one_home():
    found = []
    for module, path in MODULES.items():
        names, imported = _public_names(path)
        package = path.name == "__init__.py"
        for name in names:
            source = imported.get(name)
            if source is None:
                continue
            if package and (source.startswith(module + ".") or source == module):
                continue  # a package presents its own submodules' names
            found.append(f"{module}.__all__ lists {name!r}, defined in {source}")
    assert not found, "\n".join(found)


def _homes() -> dict[str, set[str]]:
    """Public name -> the modules whose ``__all__`` lists it (package ``__init__``s left out)."""
    homes: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        if path.name != "__init__.py":
            for name in _public_names(path)[0]:
                homes.setdefault(name, set()).add(module)
    return homes


def test_public_names_are_imported_from_their_home():
    homes, found = _homes(), []
    packages = {m for m, p in MODULES.items() if p.name == "__init__.py"}
    for module, path in MODULES.items():
        for line, target, names in _imports(module, path):
            for name in names:
                home = homes.get(name)
                if not home or not target.startswith("cpsuper") or target in home:
                    continue
                if target in packages and any(h.startswith(target + ".") for h in home):
                    continue
                found.append(
                    f"{path.relative_to(ROOT)}:{line} imports {name} from {target}; its home is {sorted(home)}"
                )
    assert not found, "\n".join(found)


def _model_first_functions():
    for module, path in MODULES.items():
        if module.startswith(("cpsuper.toys", "cpsuper.plots")):
            continue
        names, _ = _public_names(path)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name in names:
                positional = [a.arg for a in node.args.posonlyargs + node.args.args]
                if positional[:1] == ["model"]:
                    yield f"{module}.{node.name}", positional


def test_options_are_keyword_only_after_the_model_the_data_and_what_is_swept():
    found = [
        f"{name}({', '.join(positional)}, ...): put `*` after the third"
        for name, positional in _model_first_functions()
        if len(positional) > 3 and name not in POSITIONAL_EXCEPTIONS
    ]
    assert not found, "\n".join(found)
    assert any(name == "cpsuper.scoring.score_dataset" for name, _ in _model_first_functions())


def test_only_drawing_layers_import_plotly():
    found = []
    for module, path in MODULES.items():
        if _layer(module)[1][1] in DRAWING_LAYERS:
            continue
        for line, target, _ in _imports(module, path):
            if target.split(".")[0] in ("plotly", "circuitsvis"):
                found.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not found, "\n".join(found)


def test_modules_stay_readable():
    long = [
        f"{path.relative_to(ROOT)}: {n} lines"
        for path in MODULES.values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
        and str(path.relative_to(ROOT)) not in LONG_MODULES_ALLOWED
    ]
    assert not long, "\n".join(long)


def test_the_top_level_stays_small():
    assert len(cp.__all__) <= MAX_TOP_LEVEL, f"{len(cp.__all__)} top-level names; move plumbing into its namespace"
    assert len(set(cp.__all__)) == len(cp.__all__)


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
    obj = getattr(cp, name)
    assert obj is not None
    if inspect.isfunction(obj) or inspect.isclass(obj):
        assert obj.__module__.startswith("cpsuper.")
