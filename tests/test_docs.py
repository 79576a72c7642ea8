"""The documentation site builds with `mkdocs build --strict` (warnings, broken links and
docstrings mkdocstrings cannot render are errors)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("mkdocs") is None and not (Path(sys.executable).parent / "mkdocs").exists(),
                    reason="mkdocs is not installed (pip install -e '.[dev]')")
def test_site_builds_strict(tmp_path):
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    for page in ["index.html", "concepts/index.html", "paper_map/index.html", "api/index.html"]:
        assert (site / page).exists(), page
    api = (site / "api" / "index.html").read_text()
    for name in ["cpsuper.models.load_model", "cpsuper.heads.head_sweep", "cpsuper.juice.JuICE"]:
        assert name in api, f"{name} is missing from the API reference"


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
