"""mkdocs hooks for the cpsuper site (see mkdocs.yml).

The docstrings use Sphinx-style cross-reference roles (``:func:`truncate```), which mkdocstrings
renders literally as ``:func:`` followed by the code span. Drop the role prefix so the reference
reads as plain code.
"""

import re

_ROLE = re.compile(r":(?:py:)?(?:func|mod|class|meth|attr|data|obj|exc):(?=<code>)")


def on_page_content(html, page, config, files):
    return _ROLE.sub("", html)
