"""The package a user installs: the wheel and the sdist hold the licence, the type marker, every
data file and the citation metadata, and CITATION.cff is valid and agrees with pyproject.toml.

The build runs the PEP 517 backend (setuptools) in a subprocess, without build isolation, on a
copy of the source tree, so it needs no network and leaves no build/ or *.egg-info in the
checkout. It takes a few seconds.
"""

from __future__ import annotations

import email.parser
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
NAME, VERSION = PYPROJECT["project"]["name"], PYPROJECT["project"]["version"]

# Top-level entries of the checkout that are not source (environments, build outputs, caches).
_NOT_SOURCE = {".git", ".venv", "build", "dist", "out", "site", ".pytest_cache", ".ruff_cache"}


def package_files() -> set[str]:
    """Every file of the cpsuper package in the checkout (modules and data), as wheel paths."""
    return {
        str(p.relative_to(ROOT))
        for p in (ROOT / "cpsuper").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo")
    }


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, Path]:
    """Build the wheel and the sdist once from a copy of the checkout."""
    tmp = tmp_path_factory.mktemp("packaging")
    src, out = tmp / "src", tmp / "dist"

    def ignore(directory: str, names: list[str]) -> set[str]:
        top, here = Path(directory) == ROOT, Path(directory)
        skip = {"__pycache__"} | ({n for n in names if (here / n).is_dir() and n == "cache"})  # run caches
        return {n for n in names if (top and n in _NOT_SOURCE) or n in skip or n.endswith(".egg-info")}

    shutil.copytree(ROOT, src, ignore=ignore)
    # The output folder is read before the first build: the backend rewrites sys.argv.
    code = (
        "import sys; from setuptools import build_meta as backend; "
        "out = sys.argv[1]; backend.build_wheel(out); backend.build_sdist(out)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(out)], cwd=src, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, f"building the wheel and sdist failed:\n{result.stdout}\n{result.stderr}"
    wheels, sdists = sorted(out.glob("*.whl")), sorted(out.glob("*.tar.gz"))
    assert len(wheels) == len(sdists) == 1, sorted(out.iterdir())
    return {"wheel": wheels[0], "sdist": sdists[0]}


def test_wheel_contents(dists):
    with zipfile.ZipFile(dists["wheel"]) as wheel:
        names = set(wheel.namelist())
        info = f"{NAME}-{VERSION}.dist-info"
        metadata = email.parser.Parser().parsestr(wheel.read(f"{info}/METADATA").decode())
        licence = wheel.read(f"{info}/licenses/LICENSE").decode()
    missing = package_files() - names
    assert not missing, f"files of the package missing from the wheel (package-data?): {sorted(missing)}"
    assert "cpsuper/py.typed" in names
    assert {"cpsuper/data/sayings.csv", "cpsuper/data/relations/world_capital.csv"} <= names
    assert licence == (ROOT / "LICENSE").read_text()
    assert metadata["License-Expression"] == "MIT"
    assert metadata.get_all("License-File") == ["LICENSE"]
    assert metadata["Author"] == "cpsuper authors"
    assert "Typing :: Typed" in metadata.get_all("Classifier")
    urls = dict(u.split(", ", 1) for u in metadata.get_all("Project-URL"))
    assert {"Homepage", "Documentation", "Repository", "Issues"} <= set(urls)
    assert "interpretability" in metadata["Keywords"].split(",")
    assert metadata["Requires-Python"] == PYPROJECT["project"]["requires-python"]


def test_sdist_contents(dists):
    with tarfile.open(dists["sdist"]) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    for required in ["LICENSE", "CITATION.cff", "README.md", "pyproject.toml", "cpsuper/py.typed"]:
        assert required in names, f"{required} is missing from the sdist"
    missing = package_files() - names
    assert not missing, f"files of the package missing from the sdist: {sorted(missing)}"


def test_license_file():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License")
    assert re.search(r"Copyright \(c\) \d{4} the cpsuper authors", text)
    assert PYPROJECT["project"]["license"] == "MIT"
    assert PYPROJECT["project"]["license-files"] == ["LICENSE"]


ARXIV = re.compile(r"arXiv:(\d{4}\.\d{4,5})")


def citation() -> dict:
    return yaml.safe_load((ROOT / "CITATION.cff").read_text())


def test_citation_cff_is_valid_and_agrees_with_pyproject():
    cff = citation()
    for key in ["cff-version", "message", "title", "authors"]:  # required by CFF 1.2.0
        assert cff.get(key), f"CITATION.cff lacks {key}"
    assert cff["cff-version"] == "1.2.0"
    assert cff["type"] == "software"
    assert str(cff["version"]) == VERSION, "CITATION.cff's version differs from pyproject.toml's"
    assert cff["license"] == PYPROJECT["project"]["license"]
    assert [a.get("name") for a in cff["authors"]] == [a["name"] for a in PYPROJECT["project"]["authors"]]


def test_citation_cff_references_the_five_papers():
    refs = citation()["references"]
    titles = [r["title"] for r in refs]
    assert len(set(titles)) == 5
    for expected in [
        "Taming Knowledge Conflicts",
        "Truncating Weights",
        "Summing Up the Facts",
        "Context-Parametric Inversion",
        "Factual Knowledge Extraction",
    ]:
        assert any(expected in t for t in titles), f"no reference titled ...{expected}..."
    for ref in refs:
        assert ref["type"] and ref["authors"], ref["title"]
        for person in ref["authors"]:  # a person has both names, an entity a name
            assert ("family-names" in person and "given-names" in person) or "name" in person, person
        for ident in ref.get("identifiers", []):
            assert ident["type"] in {"doi", "url", "swh", "other"}
            m = ARXIV.fullmatch(ident["value"])
            assert m, ident
            assert ref["url"] == f"https://arxiv.org/abs/{m.group(1)}", "url and arXiv id disagree"
