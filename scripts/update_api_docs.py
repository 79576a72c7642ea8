"""Regenerate the list of top-level names in docs/api.md from ``cpsuper.__all__``.

Run after adding or removing a public name; tests/test_architecture.py fails while the page and
the package disagree.
"""

from __future__ import annotations

import re
from pathlib import Path

import cpsuper as cp

PAGE = Path(__file__).resolve().parent.parent / "docs" / "api.md"
START, END = "<!-- top-level names: start -->", "<!-- top-level names: end -->"


def home(name: str) -> str:
    """The module that defines a top-level name (for a module or a constant: where it is re-exported)."""
    obj = getattr(cp, name)
    module = getattr(obj, "__module__", None)
    if isinstance(obj, type(cp)):
        return obj.__name__
    if module and module.startswith("cpsuper"):
        return module
    for mod in sorted(m for m in dir(cp) if isinstance(getattr(cp, m), type(cp))):
        if name in getattr(getattr(cp, mod), "__all__", ()):
            return f"cpsuper.{mod}"
    return "cpsuper"


def table() -> str:
    rows = ["| name | defined in |", "| --- | --- |"]
    rows += [f"| `cp.{name}` | `{home(name)}` |" for name in sorted(cp.__all__, key=str.lower)]
    return "\n".join(rows)


def main() -> None:
    text = PAGE.read_text()
    block = f"{START}\n{table()}\n{END}"
    if START in text:
        text = re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S)
    else:
        raise SystemExit(f"{PAGE} lacks the markers {START} / {END}; add them where the list goes.")
    PAGE.write_text(text)
    print(f"{PAGE}: {len(cp.__all__)} top-level names")


if __name__ == "__main__":
    main()
