"""Accuracy by method and conflict type (the JuICE paper's Figure 2): grouped bars with
percentile bootstrap intervals over facts."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from ..stats import bootstrap_summary
from .style import color_map, conflict_label, finish, order_conflict_types

__all__ = ["plot_methods"]


def method_intervals(results: pd.DataFrame, *, n_boot: int = 2000, ci: float = 0.95, seed: int = 0) -> pd.DataFrame:
    """Mean accuracy per method x conflict type with its bootstrap interval over facts (a fact is
    a relation and example index, so the facts of several datasets stay apart)."""
    missing = [c for c in ("method", "conflict_type", "example", "correct") if c not in results.columns]
    if missing:
        raise ValueError(f"Expected the frame cp.evaluate returns; it lacks the columns {missing}.")
    fact = (
        results["relation"].astype(str) + "|" + results["example"].astype(str)
        if "relation" in results
        else results.example
    )
    frame = results.assign(fact=fact)
    return bootstrap_summary(
        frame, value="correct", by=["method", "conflict_type"], unit="fact", n_boot=n_boot, ci=ci, seed=seed
    )


def plot_methods(
    results: pd.DataFrame, *, n_boot: int = 2000, ci: float = 0.95, seed: int = 0, title: str | None = None
) -> go.Figure:
    """Grouped bars of greedy accuracy: one group per conflict type, one bar per method (in the
    order of ``results``), error bars from a ``ci`` bootstrap over facts. ``results`` is the
    per-example frame of :func:`cpsuper.evaluate`."""
    summary = method_intervals(results, n_boot=n_boot, ci=ci, seed=seed)
    methods = list(dict.fromkeys(results["method"]))
    types = order_conflict_types(results["conflict_type"])
    colors = color_map(methods)
    fig = go.Figure()
    for method in methods:
        part = summary[summary.method == method].set_index("conflict_type").reindex(types)
        fig.add_bar(
            x=[conflict_label(t) for t in types],
            y=part["mean"],
            error_y={
                "type": "data",
                "array": (part.ci_high - part["mean"]).to_numpy(),
                "arrayminus": (part["mean"] - part.ci_low).to_numpy(),
            },
            name=method,
            marker_color=colors[method],
            customdata=part[["ci_low", "ci_high", "n"]].to_numpy(),
            hovertemplate="%{y:.2f} [%{customdata[0]:.2f}, %{customdata[1]:.2f}], %{customdata[2]} facts",
        )
    fig.update_layout(barmode="group", yaxis={"title": "accuracy", "range": [0, 1.05]})
    title = title or f"Accuracy by method and conflict type ({ci:.0%} bootstrap intervals over facts)"
    return finish(fig, title, legend_title="method")
