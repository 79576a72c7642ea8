"""Figures of attribution patching: its estimates per head and per (layer, position), and the
estimates against exact patching."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..attribution_patching import AttributionPatchingResult, patching_agreement
from ..stats import format_ci
from .style import DIVERGING, finish

__all__ = ["plot_attribution_patching", "plot_attribution_vs_exact"]


def _limit(values: np.ndarray) -> float:
    finite = np.abs(values[np.isfinite(values)])
    return float(finite.max()) if finite.size and finite.max() > 0 else 1.0


def plot_attribution_patching(result: AttributionPatchingResult, *, component: str = "resid_pre") -> go.Figure:
    """Mean estimate over facts: a layer x head heatmap, and a layer x position heatmap of
    ``component`` whose positions (counted from the end) are labelled with their span."""
    positions = result.position_summary[result.position_summary.component == component]
    if positions.empty:
        have = sorted(result.position_summary.component.unique())
        raise ValueError(f"No {component!r} estimates in this result; it has {have}.")
    heads = result.summary
    n_layers, n_heads = int(heads.layer.max()) + 1, int(heads["head"].max()) + 1
    head_grid = np.full((n_layers, n_heads), np.nan)
    head_grid[heads.layer, heads["head"]] = heads["mean"]
    order = sorted(positions.position.unique())
    labels = {p: f"{p} {s}" for p, s in positions.groupby("position").span.first().items()}
    pos_grid = np.full((n_layers, len(order)), np.nan)
    pos_grid[positions.layer, pd.Index(order).get_indexer(positions.position)] = positions["mean"]

    fig = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.25, 0.75],
        horizontal_spacing=0.12,
        subplot_titles=["per query head (hook_z)", f"{component} per position (from the end, span)"],
    )
    for col, grid, x, x_name, bar_x in (
        (1, head_grid, list(range(n_heads)), "head", 0.2),
        (2, pos_grid, [labels[p] for p in order], "position", 1.0),
    ):
        limit = _limit(grid)
        fig.add_trace(
            go.Heatmap(
                z=grid,
                x=x,
                y=list(range(n_layers)),
                zmin=-limit,
                zmax=limit,
                zmid=0,
                colorscale=DIVERGING,
                colorbar={"x": bar_x, "len": 0.9, "title": "estimate"},
                hovertemplate=f"layer %{{y}}, {x_name} %{{x}}<br>mean estimate %{{z:.4f}}<extra></extra>",
            ),
            row=1,
            col=col,
        )
        fig.update_xaxes(title_text=x_name, type="category", row=1, col=col)
        fig.update_yaxes(title_text="layer", dtick=1, row=1, col=col)
    title = (
        f"Attribution patching {result.source} → {result.destination} ({result.metric}, target {result.target}), "
        f"mean over {heads['n'].max()} facts"
    )
    return finish(fig, title, width=max(900, 70 * len(order) + 400), height=max(420, 24 * n_layers + 200))


def plot_attribution_vs_exact(estimates: AttributionPatchingResult | pd.DataFrame, exact: pd.DataFrame) -> go.Figure:
    """One point per head (``exact`` from ``exact_head_patching``) or per (component, layer,
    position) (from ``exact_position_patching``): the mean estimate over facts against the mean
    exact effect, coloured by layer, with the identity line and the Spearman correlation (95%
    bootstrap interval over facts) in the title."""
    agreement = patching_agreement(estimates, exact).set_index("statistic")
    by_head = "head" in exact.columns
    if isinstance(estimates, AttributionPatchingResult):
        estimates = estimates.heads if by_head else estimates.positions
    keys = ["layer", "head"] if by_head else ["component", "layer", "position"]
    both = estimates.merge(exact[["example", *keys, "delta"]], on=["example", *keys])
    means = both.groupby(keys, as_index=False)[["estimate", "delta"]].mean()
    label = (
        means["layer"].astype(str) + "." + means["head"].astype(str)
        if by_head
        else means.component + " L" + means["layer"].astype(str) + " pos " + means.position.astype(str)
    )
    low = float(min(means.estimate.min(), means.delta.min()))
    high = float(max(means.estimate.max(), means.delta.max()))
    fig = go.Figure(
        [
            go.Scatter(
                x=[low, high], y=[low, high], mode="lines", line={"dash": "dash", "color": "grey"}, name="y = x"
            ),
            go.Scatter(
                x=means.delta,
                y=means.estimate,
                mode="markers",
                text=label,
                name="head" if by_head else "position",
                marker={"color": means.layer, "colorscale": "Viridis", "colorbar": {"title": "layer"}, "size": 8},
                hovertemplate="%{text}<br>exact %{x:.4f}<br>estimate %{y:.4f}<extra></extra>",
            ),
        ]
    )
    rho = agreement.loc["spearman"]
    fig.update_xaxes(title_text="exact patching effect (mean over facts)")
    fig.update_yaxes(title_text="attribution patching estimate (mean over facts)")
    title = (
        f"Attribution vs exact patching: Spearman {format_ci(rho.value, rho.ci_low, rho.ci_high)} ({int(rho.n)} facts)"
    )
    return finish(fig, title, width=620, height=560)
