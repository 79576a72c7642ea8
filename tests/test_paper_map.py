"""docs/paper_map.md says, per paper item, what cpsuper does, how far it got and where the
measurement is. These checks keep it honest without running a model: every row has one of the
five statuses (with a reason where one is owed), every row that claims a result links a page and
names a command, every relative link and anchor resolves, every script exists and every function
name resolves at its public home. A last check keeps the results pages from naming JuICE recipes
that no longer exist. Each checker is also run on text made to fail it, so none is vacuous."""

from __future__ import annotations

import importlib
import re
import types
import unicodedata
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAPER_MAP = DOCS / "paper_map.md"

HEADER = ["item", "what cpsuper does", "status", "evidence"]
STATUSES = ("done on the embedded model", "done on a toy", "partial", "not done", "out of reach")
CLAIMS_RESULT = ("done on the embedded model", "done on a toy", "partial")
OWES_REASON = ("partial", "not done", "out of reach")


# ------------------------------------------------------------------------------------------------
# Parsing


def _cells(line: str) -> list[str]:
    """The cells of a markdown table row (pipes escaped as \\| stay inside a cell)."""
    body = line.strip()
    body = body[1:] if body.startswith("|") else body
    body = body[:-1] if body.endswith("|") and not body.endswith("\\|") else body
    return [c.strip() for c in re.split(r"(?<!\\)\|", body)]


def _is_separator(line: str) -> bool:
    return bool(re.fullmatch(r"\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?", line.strip()))


def tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every table of the text as (header cells, data rows), outside fenced code."""
    lines, found, i = _outside_fences(text), [], 0
    while i < len(lines):
        if lines[i].lstrip().startswith("|") and i + 1 < len(lines) and _is_separator(lines[i + 1]):
            header, rows, i = _cells(lines[i]), [], i + 2
            while i < len(lines) and lines[i].lstrip().startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            found.append((header, rows))
        else:
            i += 1
    return found


def _outside_fences(text: str) -> list[str]:
    """The lines of the text with fenced code blocks blanked (line numbers kept)."""
    out, fence = [], None
    for line in text.splitlines():
        marker = re.match(r"\s*(```|~~~)", line)
        if fence is None and marker:
            fence = marker.group(1)
            out.append("")
        elif fence is not None:
            if line.strip().startswith(fence):
                fence = None
            out.append("")
        else:
            out.append(line)
    return out


def rows(text: str) -> list[dict[str, str]]:
    return [dict(zip(HEADER, r)) for header, body in tables(text) if header == HEADER for r in body]


# ------------------------------------------------------------------------------------------------
# Anchors: Python-Markdown's toc slugs, as mkdocs makes them


def slugify(heading: str) -> str:
    """Python-Markdown's default toc slug: ASCII only, punctuation removed, lowercase, runs of
    spaces and hyphens to one hyphen (the rule mkdocs uses for heading ids)."""
    value = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode("ascii")
    value = re.sub(r"[^\w\s-]", "", value).strip().lower()
    return re.sub(r"[-\s]+", "-", value)


def _heading_text(raw: str) -> str:
    """A heading's text as rendered: links reduced to their text, HTML tags dropped."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", raw)
    return re.sub(r"<[^>]+>", "", text)


def anchors(text: str) -> set[str]:
    """The ids of every heading of a markdown page (duplicates get _1, _2, ... as in toc)."""
    ids: set[str] = set()
    for line in _outside_fences(text):
        m = re.match(r"(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = slugify(_heading_text(m.group(2)))
        while slug in ids or not slug:
            n = re.match(r"^(.*)_([0-9]+)$", slug)
            slug = f"{n.group(1)}_{int(n.group(2)) + 1}" if n else f"{slug}_1"
        ids.add(slug)
    return ids


# ------------------------------------------------------------------------------------------------
# Checkers: each returns a list of problems (empty when the text passes)

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_SPAN = re.compile(r"`([^`]+)`")
_SCRIPT = re.compile(r"\b((?:scripts|benchmarks)/[\w./-]+\.py)\b")
_NAME = re.compile(r"^(cp(?:super)?(?:\.[A-Za-z_]\w*)+)")


def status_problems(status: str) -> list[str]:
    value = next((s for s in STATUSES if status == s or status.startswith(s + ":")), None)
    if value is None:
        return [f"status {status!r} does not start with one of {STATUSES} (then nothing or ': reason')"]
    reason = status[len(value) :].lstrip(":").strip()
    if value in OWES_REASON and not reason:
        return [f"status {status!r}: {value!r} must say {'what is missing' if value == 'partial' else 'why'}"]
    return []


def link_problems(text: str, page: Path) -> list[str]:
    """Every relative link resolves to a file, and every #anchor to a heading of its target."""
    problems = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.is_file():
            problems.append(f"{target}: {file} does not exist")
        elif anchor and (file.suffix != ".md" or anchor not in anchors(file.read_text())):
            problems.append(f"{target}: no heading with the id {anchor!r} in {file.name}")
    return problems


def script_problems(text: str) -> list[str]:
    paths = {p for span in _SPAN.findall(text) for p in _SCRIPT.findall(span)}
    return [f"{p} does not exist" for p in sorted(paths) if not (ROOT / p).is_file()]


def resolve_public(dotted: str) -> object:
    """Resolve `cp.X...` / `cpsuper.mod.X...`: import the longest module prefix, then walk the
    attributes. The first name after a module must be public there (in its __all__, or a
    submodule), and a deprecated alias counts as stale."""
    parts = dotted.split(".")
    parts[0] = "cpsuper"
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ImportError:
            continue
    rest = parts[i:]
    if rest and hasattr(obj, "__all__"):
        first = getattr(obj, rest[0], None)
        submodule = isinstance(first, types.ModuleType) and first.__name__ == f"{obj.__name__}.{rest[0]}"
        if rest[0] not in obj.__all__ and not submodule:
            raise AttributeError(f"{rest[0]!r} is not public in {obj.__name__} (not in its __all__)")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for name in rest:
            obj = getattr(obj, name)
    return obj


def name_problems(text: str) -> list[str]:
    names = {m.group(1) for span in _SPAN.findall(text) if (m := _NAME.match(span))}
    problems = []
    for dotted in sorted(names):
        try:
            resolve_public(dotted)
        except (AttributeError, DeprecationWarning) as error:
            problems.append(f"{dotted}: {error}")
    return problems


def _names_a_command(evidence: str) -> bool:
    """A script path, a `cpsuper ...` command or a Python call in backticks."""
    return any(
        _SCRIPT.search(span) or span.startswith("cpsuper ") or re.search(r"\w\(.*\)", span)
        for span in _SPAN.findall(evidence)
    )


def row_problems(text: str) -> list[str]:
    """Every table is a paper-map table; every row has a valid status; every row that claims a
    result links a page and names the command that produced it."""
    problems = [f"a table with header {h} (expected {HEADER})" for h, _ in tables(text) if h != HEADER]
    for row in rows(text):
        item = row.get("item", "?")
        if len(row) != len(HEADER) or not all(row.values()):
            problems.append(f"{item}: expected {len(HEADER)} non-empty cells, got {list(row.values())}")
            continue
        problems += [f"{item}: {p}" for p in status_problems(row["status"])]
        if row["status"].startswith(CLAIMS_RESULT):
            if not _LINK.search(row["evidence"]):
                problems.append(f"{item}: claims a result but its evidence links no page")
            if not _names_a_command(row["evidence"]):
                problems.append(f"{item}: claims a result but its evidence names no command")
    return problems


# Recipe names in the results pages: recipe="x", recipes=("x", ...), --recipes x y, `robust-...`,
# "robust-...".
_RECIPE_PATTERNS = [
    re.compile(r"""\brecipe\s*=\s*["']([\w-]+)["']"""),
    re.compile(r"`(robust[\w-]*)`"),
    re.compile(r"""["'](robust[\w-]*)["']"""),
]


def recipe_names(text: str) -> set[str]:
    names = {n for pattern in _RECIPE_PATTERNS for n in pattern.findall(text)}
    for group in re.findall(r"\brecipes\s*=\s*\(([^)]*)\)", text):
        names |= set(re.findall(r"""["']([\w-]+)["']""", group))
    for group in re.findall(r"--recipes((?:\s+(?!-)[a-z][\w-]*)+)", text):
        names |= set(group.split())
    return names


def known_recipes() -> set[str]:
    from cpsuper import tuning, variance

    return set(tuning.FIT_RECIPES) | set(variance.RECIPES)


def recipe_problems(text: str) -> list[str]:
    known = known_recipes()
    return [
        f"recipe {n!r} is neither in FIT_RECIPES nor in variance.RECIPES" for n in sorted(recipe_names(text) - known)
    ]


# ------------------------------------------------------------------------------------------------
# The paper map


@pytest.fixture(scope="module")
def paper_map() -> str:
    return PAPER_MAP.read_text()


def test_the_paper_map_has_rows_for_every_paper(paper_map):
    found = rows(paper_map)
    assert len(found) >= 60, f"only {len(found)} rows parsed"
    assert len([h for h, _ in tables(paper_map)]) == 5, "expected one table per paper"
    for status in STATUSES:
        assert any(r["status"].startswith(status) for r in found), f"no row is {status!r}"


def test_every_row_has_a_valid_status_and_claims_carry_evidence(paper_map):
    problems = row_problems(paper_map)
    assert not problems, "\n".join(problems)


def test_every_relative_link_and_anchor_resolves(paper_map):
    assert _LINK.findall(paper_map), "expected links"
    problems = link_problems(paper_map, PAPER_MAP)
    assert not problems, "\n".join(problems)


def test_every_script_exists(paper_map):
    assert _SCRIPT.search(paper_map), "expected script paths"
    problems = script_problems(paper_map)
    assert not problems, "\n".join(problems)


def test_every_name_resolves_at_its_public_home(paper_map):
    problems = name_problems(paper_map)
    assert not problems, "\n".join(problems)


def test_every_name_on_every_page_resolves_at_its_public_home():
    """A page that names `cp.X` or `cpsuper.mod.X` in code must name something that exists there
    today (the changelog, which records old names, is left out)."""
    pages = sorted(DOCS.rglob("*.md")) + [ROOT / "README.md", ROOT / "ARCHITECTURE.md"]
    problems = [f"{p.relative_to(ROOT)}: {q}" for p in pages for q in name_problems(p.read_text())]
    assert not problems, "\n".join(problems)


def test_results_pages_name_only_existing_recipes():
    pages = sorted((DOCS / "results").rglob("*.md"))
    assert pages
    found = set().union(*(recipe_names(p.read_text()) for p in pages))
    assert {"paper", "robust", "robust-conflict"} <= found, f"the recipe scan found only {found}"
    problems = [f"{p.relative_to(DOCS)}: {q}" for p in pages for q in recipe_problems(p.read_text())]
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------------------------
# The checks are not vacuous


def test_slugify_follows_python_markdown():
    assert slugify('"Madrid is located in"') == "madrid-is-located-in"
    assert slugify("Robustness on the same 30 held-out capitals (clean / substitution / coherent)") == (
        "robustness-on-the-same-30-held-out-capitals-clean-substitution-coherent"
    )
    assert slugify("1. Noisy in-context recall (`cpsuper.toys.noisy_recall`)") == (
        "1-noisy-in-context-recall-cpsupertoysnoisy_recall"
    )
    assert anchors("# A\n## On X\n```\n# not a heading\n```\n## On X\n") == {"a", "on-x", "on-x_1"}


def test_anchors_agree_with_python_markdown_on_every_page():
    """The slug rule above gives the ids Python-Markdown's toc gives (mkdocs' own rule)."""
    markdown = pytest.importorskip("markdown")
    for page in sorted(DOCS.rglob("*.md")):
        md = markdown.Markdown(extensions=["toc", "tables", "fenced_code"])
        md.convert(page.read_text())

        def ids(tokens):
            for token in tokens:
                yield token["id"]
                yield from ids(token["children"])

        assert anchors(page.read_text()) == set(ids(md.toc_tokens)), page.name


@pytest.mark.parametrize(
    "status",
    ["done", "Done on a toy", "partial", "partial:", "not done", "out of reach:  ", "maybe: later", "done on a toys"],
)
def test_bad_statuses_fail(status):
    assert status_problems(status)


@pytest.mark.parametrize(
    "status", ["done on a toy", "done on the embedded model: 16 facts", "partial: no figure", "not done: why"]
)
def test_good_statuses_pass(status):
    assert not status_problems(status)


def test_a_result_without_evidence_fails():
    head = "| item | what cpsuper does | status | evidence |\n| --- | --- | --- | --- |\n"
    assert row_problems(head + "| Fig. 1 | `cp.head_sweep` | done on a toy | [a](a.md); `f()` |\n") == []
    assert row_problems(head + "| Fig. 1 | `cp.head_sweep` | done on a toy | `scripts/x.py` |\n")
    assert row_problems(head + "| Fig. 1 | `cp.head_sweep` | partial: no bars | [a](a.md) |\n")
    assert row_problems(head + "| Fig. 1 | `cp.head_sweep` | not done | none |\n")
    assert row_problems(head + "| Fig. 1 | `cp.head_sweep` | done |\n")
    assert row_problems("| paper | cpsuper |\n| --- | --- |\n| Fig. 1 | `cp.head_sweep` |\n")


def test_broken_links_and_anchors_fail():
    assert not link_problems("[r](results/juice.md#robustness) [x](https://example.org/x#y)", PAPER_MAP)
    assert link_problems("[r](results/no_such_page.md)", PAPER_MAP)
    assert link_problems("[r](results/juice.md#no-such-heading)", PAPER_MAP)
    assert link_problems("[r](#no-such-heading-here)", PAPER_MAP)


def test_missing_scripts_and_names_fail():
    assert not script_problems("`scripts/juice_transfer.py`")
    assert script_problems("`scripts/no_such_script.py` and `python benchmarks/nope.py --x`")
    assert not name_problems("`cp.head_sweep`, `cp.plots.plot_methods`, `cpsuper.path_patching.patching_roles`")
    assert name_problems("`cp.no_such_function`")
    assert name_problems("`cp.plots.no_such_plot`")
    assert name_problems("`cpsuper.heads.np`")  # exists in the module, but is not public there


def test_unknown_recipes_fail():
    text = 'fit(recipe="robust-gone") `robust-old` recipes=("paper", "stale") --recipes paper retired --k 3'
    assert recipe_names(text) == {"robust-gone", "robust-old", "paper", "stale", "retired"}
    assert len(recipe_problems(text)) == 4
    assert not recipe_problems('recipe="paper" `robust-conflict` --recipes robust robust-median\n  robust-k --x')
