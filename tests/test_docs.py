"""The documentation site builds with `mkdocs build --strict` (warnings, broken links and
docstrings mkdocstrings cannot render are errors)."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(
    shutil.which("mkdocs") is None and not (Path(sys.executable).parent / "mkdocs").exists(),
    reason="mkdocs is not installed (pip install -e '.[dev]')",
)
def test_site_builds_strict(tmp_path):
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    for page in ["index.html", "concepts/index.html", "paper_map/index.html", "api/index.html"]:
        assert (site / page).exists(), page
    api = (site / "api" / "index.html").read_text()
    for name in ["cpsuper.models.load_model", "cpsuper.heads.head_sweep", "cpsuper.juice.JuICE"]:
        assert name in api, f"{name} is missing from the API reference"
    check_offline(site)


# A tag that makes the browser fetch a script, stylesheet, image or frame from the network.
_REMOTE = re.compile(r"<(script|link|img|iframe|source)\b[^>]*\b(?:src|href)\s*=\s*[\"']?(?:https?:)?//", re.IGNORECASE)


def check_offline(site: Path) -> None:
    """Every built page reads offline: nothing is loaded from a CDN, and code blocks are coloured
    at build time (Pygments spans plus the stylesheet the hook writes), not by highlight.js."""
    pages = sorted(site.rglob("*.html"))
    assert pages, "no pages were built"
    remote = {str(p.relative_to(site)): m.group(0) for p in pages if (m := _REMOTE.search(p.read_text()))}
    assert not remote, f"pages that load resources from the network: {remote}"
    css = site / "css" / "pygments.css"
    assert css.exists() and ".highlight .k " in css.read_text(), "the Pygments stylesheet was not generated"
    index = (site / "index.html").read_text()
    assert 'href="css/pygments.css"' in index
    assert '<div class="highlight"><pre><span></span><code><span class="kn">import</span>' in index, (
        "the index page's python block was not highlighted by Pygments"
    )
    assert "hljs" not in index


def test_offline_check_catches_a_cdn_script(tmp_path):
    """The offline check is not vacuous: a page with the theme's old CDN script fails it."""
    (tmp_path / "css").mkdir()
    (tmp_path / "css" / "pygments.css").write_text(".highlight .k { color: #008000 }")
    ok = '<link href="css/pygments.css" rel="stylesheet"><div class="highlight"><pre><span></span><code><span class="kn">import</span>'
    (tmp_path / "index.html").write_text(ok + '<a href="https://www.mkdocs.org/">MkDocs</a>')
    check_offline(tmp_path)  # links to other sites are fine; only loaded resources count
    (tmp_path / "page.html").write_text(
        '<script src="https://cdnjs.cloudflare.com/ajax/libs/highlight.js/11.8.0/highlight.min.js"></script>'
    )
    with pytest.raises(AssertionError, match="page.html"):
        check_offline(tmp_path)


def test_every_page_is_in_the_nav():
    """A new page in docs/ should be reachable from the site's navigation."""
    import yaml

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())

    def files(nav):
        for item in nav:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            if isinstance(value, list):
                yield from files(value)
            else:
                yield value

    in_nav = set(files(config["nav"]))
    pages = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").glob("*.md")}
    assert pages <= in_nav, f"pages missing from the nav in mkdocs.yml: {sorted(pages - in_nav)}"


def test_paper_map_cites_the_papers_and_points_at_real_files():
    """The paper map cites every paper listed in CITATION.cff (title and arXiv id) and names only
    files that exist in the repository."""
    import yaml

    text = (ROOT / "docs" / "paper_map.md").read_text()
    flat = " ".join(text.split())
    for ref in yaml.safe_load((ROOT / "CITATION.cff").read_text())["references"]:
        assert ref["title"] in flat, f"the paper map does not cite {ref['title']!r}"
        for ident in ref.get("identifiers", []):
            assert ident["value"] in flat, f"the paper map lacks {ident['value']} ({ref['title']})"
    paths = re.findall(r"`([\w./-]+\.(?:py|md|cff|csv|json|ipynb|txt|html))`", text)
    paths += re.findall(r"`([\w.-]+/(?:[\w.-]+/)*)`", text)  # folders
    assert paths, "expected the paper map to name some files"
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"the paper map points to files that are not in the repository: {missing}"


def test_paper_map_names_real_functions():
    """Every ``cp.name`` and ``cpsuper.module.name`` on the paper map exists at its current home
    (a name kept only as a deprecated alias counts as stale)."""
    import importlib
    import warnings

    import cpsuper as cp

    text = (ROOT / "docs" / "paper_map.md").read_text()
    unknown = []
    for dotted in sorted(set(re.findall(r"`(cp(?:super)?(?:\.[A-Za-z_]\w*)+)", text))):
        parts = dotted.split(".")
        if parts[0] == "cp":
            obj, rest = cp, parts[1:]
        else:  # import the longest importable module prefix, then walk attributes
            i = len(parts)
            while i > 1:
                try:
                    obj = importlib.import_module(".".join(parts[:i]))
                    break
                except ImportError:
                    i -= 1
            obj, rest = (cp if i == 1 else obj), parts[i:]
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            try:
                for name in rest:
                    obj = getattr(obj, name)
            except (AttributeError, DeprecationWarning) as error:
                unknown.append(f"{dotted} ({error})")
    assert not unknown, f"the paper map names functions that do not exist or have moved: {unknown}"


# Guides say how to do something; measurements (with the machines and code they ran on) live on the
# results pages under docs/results/, and the history of what got faster in CHANGELOG.md. Every page
# under docs/ is a guide except the results pages and the generated API reference.
DOCS = ROOT / "docs"
GENERATED = {"api.md"}
GUIDES = sorted(
    str(p.relative_to(DOCS))
    for p in DOCS.rglob("*.md")
    if p.relative_to(DOCS).parts[0] != "results" and str(p.relative_to(DOCS)) not in GENERATED
)
RESULTS_PAGES = sorted(str(p.relative_to(DOCS)) for p in (DOCS / "results").rglob("*.md"))
# Results pages that still carry dates while their author rewrites them; each entry must still
# fail the check (so the list cannot go stale) and should be removed once the page is fixed.
RESULTS_PAGES_BEING_REWRITTEN: set[str] = set()
GUIDE_MAX_LINES = 260
DATED = re.compile(r"\b20\d\d-\d\d-\d\d\b|\bSession\b|\bsession 20")


def dates_in(text: str) -> list[str]:
    return DATED.findall(text)


def test_the_page_lists_are_not_empty():
    assert "juice.md" in GUIDES and "index.md" in GUIDES and "api.md" not in GUIDES
    assert "results/performance.md" in RESULTS_PAGES and not any(p.startswith("results/") for p in GUIDES)
    assert RESULTS_PAGES_BEING_REWRITTEN <= set(RESULTS_PAGES)


@pytest.mark.parametrize("page", GUIDES)
def test_guides_are_short_and_carry_no_dates(page):
    text = (DOCS / page).read_text()
    n_lines = len(text.splitlines())
    assert n_lines <= GUIDE_MAX_LINES, (
        f"{page} has {n_lines} lines (at most {GUIDE_MAX_LINES}); move measurements to docs/results/"
    )
    dates = dates_in(text)
    assert not dates, f"{page} carries dates {dates}; a guide states how things are, not when they were measured"


@pytest.mark.parametrize("page", RESULTS_PAGES)
def test_results_pages_carry_no_dates(page):
    dates = dates_in((DOCS / page).read_text())
    if page in RESULTS_PAGES_BEING_REWRITTEN:
        assert dates, f"{page} no longer carries dates: remove it from RESULTS_PAGES_BEING_REWRITTEN"
        pytest.skip(f"{page} is being rewritten (RESULTS_PAGES_BEING_REWRITTEN)")
    assert not dates, (
        f"{page} carries dates {dates}; name the command, code and conditions of a measurement, "
        "not the day it was made (the history of changes belongs in CHANGELOG.md)"
    )


def test_the_date_check_catches_dates():
    """The checks above are not vacuous: each kind of date they look for is found."""
    for text in ["measured on 2026-11-27", "Session 4 of the work", "in session 2026 notes"]:
        assert dates_in(text), text
    for text in ["Possession is nine-tenths of the", "20260-11-27", "a 2026 paper", "bf16 2.05x"]:
        assert not dates_in(text), text
