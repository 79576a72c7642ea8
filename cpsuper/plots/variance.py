"""How JuICE's held-out accuracy spreads over draws of its fitting facts
(:func:`cpsuper.variance.selection_variance`): one panel per conflict type, one column of points
per recipe and method (one point per draw), with the mean over draws and its bootstrap interval."""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..variance import METRICS
from .style import color_map, conflict_label, finish, order_conflict_types

__all__ = ["plot_selection_variance"]


def plot_selection_variance(result, *, metric: str = "greedy", title: str | None = None) -> go.Figure:
    """Each draw's held-out accuracy as a point, and a box per recipe x method (x axis): its line the
    mean over draws, its edges the bootstrap interval, its whiskers the worst and best draw; one
    panel per conflict type. ``result`` is a
    :class:`~cpsuper.variance.SelectionVariance`; ``metric`` is ``"greedy"`` or ``"first_token"``."""
    if metric not in METRICS:
        raise ValueError(f"Unknown metric {metric!r}; use one of {list(METRICS)}.")
    per_draw, summary = result.per_draw, result.summary
    if per_draw.empty:
        raise ValueError("The result holds no draws to draw.")
    if "metric" in summary.columns:  # results saved before first-token accuracy have greedy only
        summary = summary[summary.metric == metric]
    column = METRICS[metric]
    if column not in per_draw.columns or summary.empty:
        raise ValueError(f"The result holds no {metric} accuracy; it predates that metric.")
    types = order_conflict_types(per_draw.conflict_type)
    methods = list(dict.fromkeys(summary.method))
    recipes = list(dict.fromkeys(summary.recipe))
    colors = color_map(methods)
    fig = make_subplots(rows=1, cols=len(types), shared_yaxes=True, subplot_titles=[conflict_label(t) for t in types])
    for col, conflict_type in enumerate(types, start=1):
        for method in methods:
            points = per_draw[(per_draw.conflict_type == conflict_type) & (per_draw.method == method)]
            stats = summary[(summary.conflict_type == conflict_type) & (summary.method == method)]
            stats = stats.set_index("recipe").reindex(recipes)
            fig.add_trace(
                go.Box(
                    x=points.recipe,
                    y=points[column],
                    name=method,
                    legendgroup=method,
                    offsetgroup=method,
                    boxpoints="all",
                    jitter=0.4,
                    pointpos=0,
                    fillcolor="rgba(0,0,0,0)",
                    line={"width": 0},
                    marker={"color": colors[method], "size": 6, "opacity": 0.6},
                    customdata=points[["draw", "beta_plus", "beta_minus"]].to_numpy(),
                    hovertemplate="draw %{customdata[0]}: %{y:.2f} (beta+ %{customdata[1]:g}, "
                    "beta- %{customdata[2]:g})<extra>" + method + "</extra>",
                    showlegend=False,  # the points draw no line, so their legend swatch would be blank
                ),
                row=1,
                col=col,
            )
            fig.add_trace(
                go.Box(
                    x=recipes,
                    q1=stats.ci_low,
                    median=stats["mean"],
                    q3=stats.ci_high,
                    lowerfence=stats.worst,
                    upperfence=stats.best,
                    name=method,
                    legendgroup=method,
                    offsetgroup=method,
                    boxpoints=False,
                    marker={"color": colors[method]},
                    line={"color": colors[method], "width": 1.5},
                    fillcolor="rgba(0,0,0,0.05)",
                    hoverinfo="skip",
                    showlegend=col == 1,
                ),
                row=1,
                col=col,
            )
    label = {"greedy": "held-out accuracy", "first_token": "held-out first-token accuracy"}[metric]
    fig.update_layout(boxmode="group", yaxis={"title": label, "range": [-0.03, 1.05]})
    title = title or (
        f"{label.capitalize()} over {per_draw.draw.nunique()} draws of the fitting facts "
        "(points: draws; box: mean with its bootstrap interval, whiskers: worst and best draw)"
    )
    return finish(fig, title, legend_title="method", height=450)
