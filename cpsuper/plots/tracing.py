"""Causal-tracing heatmaps: layer x position, one panel per site (and per pair, if several)."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from ..spans import SPAN_GROUPS
from ..tracing import TraceResult
from .heatmap import facet_heatmap

__all__ = ["plot_causal_trace"]

_SITE_LABELS = {"resid_pre": "resid", "attn_out": "attn", "mlp_out": "mlp"}


def plot_causal_trace(
    result: TraceResult,
    *,
    value: str = "restored",
    by: str = "position",
    target: str | None = None,
    n_boot: int = 2000,
    ci: float = 0.95,
    seed: int = 0,
    title: str | None = None,
) -> go.Figure:
    """Mean ``value`` (``"restored"`` share or ``"delta"``) of a :func:`cpsuper.causal_trace`
    result on a layer x position grid, one panel per site and source -> destination pair,
    stacked in one column so that the positions keep their width. ``by="position"`` labels each
    column by its position from the end, span and token (the token only where every fact has the
    same there, "mostly <span>" where prompts of different lengths put different spans there;
    the position alone when the pairs have different destinations); ``by="span"`` averages each
    span.
    Hover shows the bootstrap interval over facts and their number. ``target``: which answer's
    trace to draw when the result holds both (default: the parametric one).
    """
    if not isinstance(result, TraceResult):
        raise TypeError(f"plot_causal_trace takes a TraceResult (cp.causal_trace), got {type(result).__name__}.")
    frame = result.intervals(value, by=by, n_boot=n_boot, ci=ci, seed=seed)
    targets = sorted(set(frame["target"]), key=lambda t: (t != "parametric", t))
    target = targets[0] if target is None else target
    if target not in targets:
        raise ValueError(f"target {target!r} is not in this trace; it has {targets}.")
    frame = frame[frame["target"] == target].copy()
    frame["pair"] = frame["source"] + "→" + frame["destination"]
    if by == "position":
        order = sorted(frame["position"].unique())
        if frame["destination"].nunique() == 1:  # one destination prompt type: its tokens name the columns
            label = _position_labels(result.per_example, order)
        else:
            label = {p: str(p) for p in order}
        frame["column"] = frame["position"].map(label)
        columns = [label[p] for p in order]
    else:
        present = set(frame["span"])
        columns = [s for s in SPAN_GROUPS if s in present]
        frame["column"] = frame["span"]
    sites = [s for s in _SITE_LABELS if s in set(frame["site"])]
    pairs = list(dict.fromkeys(frame["pair"]))
    several = len(pairs) > 1

    def panel(site: str, pair: str) -> str:
        return f"{_SITE_LABELS.get(site, site)} · {pair}" if several else _SITE_LABELS.get(site, site)

    frame["panel"] = [panel(s, p) for s, p in zip(frame["site"], frame["pair"])]
    shown = "restored share" if value == "restored" else "delta"
    return facet_heatmap(
        frame,
        "mean",
        x="column",
        y="layer",
        x_values=columns,
        y_values=sorted(frame["layer"].unique()),
        row="panel",
        row_values=[panel(s, p) for s in sites for p in pairs],
        panel_title=lambda r, c: r,
        hover={"ci_low": ("ci low", ":.3f"), "ci_high": ("ci high", ":.3f"), "n": ("facts", ":.0f")},
        diverging=True,
        value_label=f"mean {shown} ({target})",
        categorical_x=True,
        categorical_y=True,
        labels={"column": "position from the end", "layer": "layer"},
        cell=(34 if by == "position" else 60, 30),
        title=title,
    )


def _position_labels(per_example: pd.DataFrame, positions) -> dict[int, str]:
    """Column labels ``"-3 subject: Paris"``: the span and token of that position from the end when
    every fact has the same there; the span alone when only it is shared; ``"mostly <span>"`` when
    prompts of different lengths put different spans there."""
    facts = per_example.drop_duplicates(["example", "position"])
    label = {}
    for p in positions:
        here = facts[facts["position"] == p]
        spans, tokens = here["span"].value_counts(), here["token"].value_counts()
        span = spans.index[0]
        if len(tokens) == 1:
            token = tokens.index[0]
            label[p] = f"{p} {span}: {token.strip() or repr(token)}"
        else:
            label[p] = f"{p} {span}" if len(spans) == 1 else f"{p} mostly {span}"
    return label
