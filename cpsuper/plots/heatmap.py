"""The one heatmap every cpsuper figure uses: a value on a y x x grid (layer x head, layer x rho,
beta+ x beta-), in panels by up to two columns of the frame.

Plotly express's ``imshow`` facets only columns and loses per-cell hover data, so the panels are
laid out here once, with go.Heatmap traces that share one colour scale.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .style import DIVERGING, SEQUENTIAL, conflict_label, finish, order_conflict_types

__all__ = ["facet_heatmap"]


def _text(value) -> str:
    return f"{value:g}" if isinstance(value, (float, np.floating)) else str(value)


def _ticks(categorical: bool, few: bool) -> dict:
    """Category axes keep their order; integer axes with few values get one tick per value."""
    return {"type": "category"} if categorical else {"dtick": 1} if few else {}


def _grid(part: pd.DataFrame, value: str, x: str, y: str, xs: Sequence, ys: Sequence) -> np.ndarray:
    grid = np.full((len(ys), len(xs)), np.nan)
    rows, cols = pd.Index(ys).get_indexer(part[y]), pd.Index(xs).get_indexer(part[x])
    keep = (rows >= 0) & (cols >= 0)
    grid[rows[keep], cols[keep]] = part[value].to_numpy(float)[keep]
    return grid


def facet_heatmap(
    frame: pd.DataFrame,
    value: str,
    *,
    x: str,
    y: str,
    x_values: Sequence | None = None,
    y_values: Sequence | None = None,
    col: str | None = None,
    row: str | None = None,
    col_values: Sequence | None = None,
    row_values: Sequence | None = None,
    panel_title: Callable[[object, object], str] | None = None,
    hover: Mapping[str, tuple[str, str]] | None = None,
    diverging: bool = True,
    zmin: float | None = None,
    zmax: float | None = None,
    value_label: str | None = None,
    text_format: str | None = None,
    categorical_x: bool = False,
    categorical_y: bool = False,
    labels: Mapping[str, str] | None = None,
    cell: tuple[int, int] = (55, 26),
    title: str | None = None,
) -> go.Figure:
    """Heatmaps of ``frame[value]`` with ``y`` on the vertical and ``x`` on the horizontal axis,
    one panel per value of ``col`` (columns) and ``row`` (rows).

    Cells without a row in ``frame`` stay empty; a panel without any is left out.
    ``diverging``: a scale centred at 0 and symmetric over all panels (otherwise
    ``SEQUENTIAL`` from ``zmin``/``zmax`` or the data's range).
    ``hover`` maps extra columns to ``(label, d3 format)`` shown on hover;
    ``text_format`` writes each cell's value in it; ``labels`` renames the axes; categorical
    axes show each value as text, evenly spaced. ``panel_title(row_value, col_value)`` names
    the panels (default: the conflict-type label of whichever is set).
    """
    x_values = sorted(frame[x].unique()) if x_values is None else list(x_values)
    y_values = sorted(frame[y].unique()) if y_values is None else list(y_values)
    cols = [None] if col is None else order_conflict_types(frame[col]) if col_values is None else list(col_values)
    rows = [None] if row is None else list(dict.fromkeys(frame[row])) if row_values is None else list(row_values)
    hover = dict(hover or {})
    panel_title = panel_title or (lambda r, c: " · ".join(conflict_label(v) for v in (c, r) if v is not None))

    panels = {}
    for r in rows:
        for c in cols:
            part = frame
            if r is not None:
                part = part[part[row] == r]
            if c is not None:
                part = part[part[col] == c]
            panels[r, c] = {name: _grid(part, name, x, y, x_values, y_values) for name in [value, *hover]}
    stack = np.stack([p[value] for p in panels.values()])
    finite = stack[np.isfinite(stack)]
    if diverging:
        limit = float(np.abs(finite).max()) if finite.size else 0.0
        scale = {
            "zmin": -(limit or 1.0),
            "zmax": limit or 1.0,
            "zmid": 0,
            "colorscale": DIVERGING,
        }
    else:
        low = zmin if zmin is not None else (float(finite.min()) if finite.size else 0.0)
        high = zmax if zmax is not None else (float(finite.max()) if finite.size else 1.0)
        scale = {
            "zmin": low,
            "zmax": high if high > low else low + 1.0,
            "colorscale": SEQUENTIAL,
        }

    label = value_label or value.replace("_", " ")
    x_name, y_name = (dict(labels or {}).get(a, a) for a in (x, y))
    shown_x = [_text(v) for v in x_values] if categorical_x else list(x_values)
    shown_y = [_text(v) for v in y_values] if categorical_y else list(y_values)
    template = (
        f"{y_name} %{{y}}, {x_name} %{{x}}<br>{label} %{{z:.4f}}"
        + "".join(f"<br>{name} %{{customdata[{i}]{fmt}}}" for i, (name, fmt) in enumerate(hover.values()))
        + "<extra></extra>"
    )
    # A panel with no rows at all (e.g. a target that a conflict type does not have) is left out:
    # no axes and no title, rather than an empty square.
    present = {(r, c): bool(np.isfinite(panels[r, c][value]).any()) for r in rows for c in cols}
    if not any(present.values()):
        present = dict.fromkeys(present, True)
    complete = all(present.values())
    fig = make_subplots(
        rows=len(rows),
        cols=len(cols),
        shared_xaxes=complete,
        shared_yaxes=True,
        specs=[[{} if present[r, c] else None for c in cols] for r in rows],
        subplot_titles=[panel_title(r, c) for r in rows for c in cols if present[r, c]],
        horizontal_spacing=0.03,
        vertical_spacing=(0.08 if complete else 0.14) if len(rows) > 1 else 0.0,
    )
    first = next(key for key, shown in present.items() if shown)
    for i, r in enumerate(rows, start=1):
        for j, c in enumerate(cols, start=1):
            if not present[r, c]:
                continue
            grids = panels[r, c]
            trace = go.Heatmap(
                z=grids[value],
                x=shown_x,
                y=shown_y,
                **scale,
                showscale=(r, c) == first,
                colorbar={"title": label},
                hovertemplate=template,
                customdata=np.stack([grids[name] for name in hover], axis=-1) if hover else None,
                texttemplate=f"%{{z:{text_format}}}" if text_format else None,
            )
            fig.add_trace(trace, row=i, col=j)
            # the x title under the lowest panel of each column only, clear of the panel titles below
            lowest = all(not present[below, c] for below in rows[i:])
            fig.update_xaxes(
                title_text=x_name if lowest else None,
                row=i,
                col=j,
                **_ticks(categorical_x, len(x_values) <= 40),
            )
        left = next((j for j, c in enumerate(cols, start=1) if present[r, c]), None)
        if left is not None:
            fig.update_yaxes(
                title_text=y_name,
                row=i,
                col=left,
                **_ticks(categorical_y, len(y_values) <= 30),
            )
    width = max(450, (cell[0] * len(x_values) + 90) * len(cols))
    height = max(350, cell[1] * len(y_values) * len(rows) + 140)
    return finish(fig, title, width=width, height=height)
