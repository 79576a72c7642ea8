"""The look every cpsuper figure shares: one colour per conflict type, target, module and method,
readable labels, symmetric axis ranges and one layout finish.

Colours come from the Okabe-Ito palette (safe for the common colour-vision deficiencies); a name
keeps its colour in every figure, so "substitution" is the same vermillion in an attention plot
and in an accuracy plot.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from ..data.examples import CONFLICT_TYPES
from ..sweeps import SweepResult

__all__ = [
    "CANDIDATE_COLORS",
    "COLORS",
    "CONFLICT_COLORS",
    "DIVERGING",
    "METHOD_COLORS",
    "MODULE_COLORS",
    "SEQUENTIAL",
    "SPAN_COLORS",
    "TARGET_COLORS",
    "color_map",
    "colored_by",
    "conflict_label",
    "conflict_panels",
    "finish",
    "head_label",
    "order_conflict_types",
    "relabel_facets",
    "scale_phrase",
    "summary_frame",
    "symmetric_range",
]

CONFLICT_COLORS: dict[str, str] = {"clean": "#0072B2", "substitution": "#D55E00", "coherent": "#009E73"}
TARGET_COLORS: dict[str, str] = {"parametric": "#CC79A7", "context": "#E69F00", "parametric-context": "#56B4E9"}
MODULE_COLORS: dict[str, str] = {"attn": "#56B4E9", "mlp": "#CC79A7", "layer": "#555555"}
METHOD_COLORS: dict[str, str] = {
    "Original": "#555555", "Prompt": "#E69F00", "CAD": "#56B4E9", "PH3": "#CC79A7", "JuNe": "#009E73",
    "JuICE": "#D55E00", "run once": "#0072B2", "run twice": "#D55E00",
}  # fmt: skip
CANDIDATE_COLORS: dict[str, str] = {"correct": "#0072B2", "generic": "#555555", "context": "#E69F00"}
SPAN_COLORS: dict[str, str] = {
    "bos": "#999999", "prefix": "#555555", "context": "#56B4E9", "context_answer": "#E69F00",
    "subject": "#0072B2", "relation": "#009E73", "end": "#D55E00",
}  # fmt: skip
"""One colour per prompt span (:data:`cpsuper.spans.SPAN_GROUPS`); kept out of :data:`COLORS`,
whose ``context`` is the context answer's colour."""
COLORS: dict[str, str] = {**CANDIDATE_COLORS, **METHOD_COLORS, **MODULE_COLORS, **TARGET_COLORS, **CONFLICT_COLORS}
"""Every named colour; later groups win a clash (a conflict type's colour is never overridden)."""

_SPARE = ["#0072B2", "#D55E00", "#009E73", "#E69F00", "#CC79A7", "#56B4E9", "#F0E442", "#000000", "#999999"]
DIVERGING = "RdBu_r"
"""Signed effects: blue below 0, white at 0, red above (centre the scale with ``zmid=0``)."""
SEQUENTIAL = "Viridis"
"""Non-negative quantities (attention, accuracy)."""

_CONFLICT_LABELS = {
    "substitution": "substitution conflict",
    "coherent": "coherent conflict",
    "clean": "clean",
}


def conflict_label(value) -> str:
    """Panel title for a conflict type ("substitution conflict"); other values as text."""
    return _CONFLICT_LABELS.get(value, str(value))


def scale_phrase(alpha: float) -> str:
    """What scaling a unit by ``alpha`` means in words: 0 is "knocked out"."""
    return "knocked out" if alpha == 0 else f"scaled by {alpha:g}"


def head_label(layer, head) -> str:
    """``L3H1`` for layer 3, head 1."""
    return f"L{int(layer)}H{int(head)}"


def summary_frame(result: SweepResult | pd.DataFrame) -> pd.DataFrame:
    """The aggregate frame of a sweep, whether given the result or its summary."""
    return result.summary if isinstance(result, SweepResult) else result


def order_conflict_types(values: Iterable) -> list:
    """Distinct values with the conflict types first, in the package's order (clean,
    substitution, coherent), then anything else in order of appearance."""
    values = list(dict.fromkeys(values))
    return [c for c in CONFLICT_TYPES if c in values] + [c for c in values if c not in CONFLICT_TYPES]


def color_map(values: Iterable) -> dict:
    """Colour for each distinct value: its fixed colour where it has one, otherwise a palette
    colour not already used in this figure (in order of appearance)."""
    values = list(dict.fromkeys(values))
    out = {v: COLORS[v] for v in values if v in COLORS}
    spare = [c for c in _SPARE if c not in out.values()] or _SPARE
    for i, v in enumerate(v for v in values if v not in out):
        out[v] = spare[i % len(spare)]
    return out


def colored_by(frame: pd.DataFrame, column: str) -> dict:
    """plotly express options colouring by ``column`` with each value's fixed colour."""
    return {"color": column, "color_discrete_map": color_map(frame[column])}


def conflict_panels(frame: pd.DataFrame, *, facet: bool = True) -> dict:
    """plotly express options for one panel per conflict type (``facet=False``: only their
    order), clean, substitution, coherent first."""
    options: dict = {"category_orders": {"conflict_type": order_conflict_types(frame["conflict_type"])}}
    return {"facet_col": "conflict_type", **options} if facet else options


def symmetric_range(values, *, margin: float = 0.15) -> list[float]:
    """``[-m, m]`` with ``m`` the largest absolute finite value plus ``margin`` of it, so the
    data fill the axis and 0 sits in the middle (``[-1, 1]`` when there is nothing to show)."""
    array = np.abs(np.asarray(values, dtype=float))
    array = array[np.isfinite(array)]
    limit = float(array.max()) * (1 + margin) if array.size else 0.0
    return [-limit, limit] if limit > 0 else [-1.0, 1.0]


def relabel_facets(fig: go.Figure, labels: Mapping | None = None) -> go.Figure:
    """Turn plotly express's ``column=value`` panel titles into the value's label."""

    def rename(annotation) -> None:
        if annotation.text and "=" in annotation.text:
            value = annotation.text.split("=", 1)[1]
            annotation.update(text=(labels or {}).get(value, conflict_label(value)))

    return fig.for_each_annotation(rename)


def finish(
    fig: go.Figure,
    title: str | None = None,
    *,
    width: int | None = None,
    height: int | None = None,
    legend_title: str | None = None,
) -> go.Figure:
    """The shared layout: white template, the title clear of the mode bar, sizes."""
    fig.update_layout(template="plotly_white", margin={"t": 90})
    if title is not None:
        fig.update_layout(title={"text": title, "y": 0.98, "yanchor": "top", "x": 0.01, "xanchor": "left"})
    if width is not None:
        fig.update_layout(width=width)
    if height is not None:
        fig.update_layout(height=height)
    if legend_title is not None:
        fig.update_layout(legend_title_text=legend_title)
    return fig
