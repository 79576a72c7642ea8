"""HTML of the report: ``templates/report.html.j2`` filled with tables and figures.

Figures are embedded without their own copy of plotly.js; the page inlines it once in its head,
so the report is one self-contained file that works offline. Every value placed in the page is
escaped by Jinja2 unless it is HTML made here (tables, figure divs).
"""

from __future__ import annotations

from pathlib import Path

import jinja2
import pandas as pd
import plotly.graph_objects as go
from markupsafe import Markup

__all__ = ["Figures", "heads_text", "render_report", "table_html"]

_TEMPLATES = Path(__file__).with_name("templates")
_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(_TEMPLATES),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
    keep_trailing_newline=True,
)


def table_html(frame: pd.DataFrame, *, index: bool = False, floatfmt: str = "{:.3f}") -> Markup:
    """A frame as an HTML table that scrolls sideways when wider than the page."""
    table = frame.to_html(index=index, border=0, classes="tbl", float_format=floatfmt.format, na_rep="")
    return Markup(f'<div class="scroll">{table}</div>')


def heads_text(heads) -> str:
    """``L3H1, L5H0``, or ``none``."""
    return ", ".join(f"L{l}H{h}" for l, h in heads) or "none"


class Figures:
    """Turns plotly figures into numbered divs (``figure-1``, ...), counts them and keeps each
    under a file stem (``01_knockouts``) for ``--export``."""

    def __init__(self):
        self.count = 0
        self.kept: dict[str, object] = {}

    def __call__(self, fig, name: str = "figure") -> Markup:
        self.count += 1
        self.kept[f"{self.count:02d}_{name}"] = fig
        height = fig.layout.height or 460
        # The page is wider than most figures' own width: let each fill its column, so long
        # titles are not cut and do not run under the mode bar (shown on hover only).
        fig = go.Figure(fig).update_layout(width=None, autosize=True)
        div = fig.to_html(
            full_html=False,
            include_plotlyjs=False,
            default_height=f"{height}px",
            default_width="100%",
            div_id=f"figure-{self.count}",
            config={"displaylogo": False, "displayModeBar": "hover", "responsive": True},
        )
        return Markup(div)


def render_report(**context) -> str:
    """The page: ``context`` holds ``meta``, ``steps`` (a table), ``notes`` and one entry per section."""
    from plotly.offline import get_plotlyjs

    return _ENV.get_template("report.html.j2").render(plotlyjs=Markup(get_plotlyjs()), **context).lstrip()
