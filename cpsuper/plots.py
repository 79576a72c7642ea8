"""Plotly figures (and one styled table) from the analyses' DataFrames.

Every function takes what an analysis returned and gives back a figure; nothing is shown or
written as a side effect (call ``fig.show()`` or ``fig.write_html(...)``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import plotly.express as px
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .data.examples import CONFLICT_TYPES
from .engine import SweepResult

__all__ = [
    "plot_head_heatmap",
    "plot_knockouts",
    "plot_run_once_vs_twice",
    "plot_superposition",
    "style_head_table",
]

_MODULE_COLORS = {"attn": "#1f77b4", "mlp": "#d62728", "layer": "#2ca02c"}
_LABELS = {"substitution": "substitution conflict", "coherent": "coherent conflict", "clean": "clean"}


def _summary(result: SweepResult | pd.DataFrame) -> pd.DataFrame:
    return result.summary if isinstance(result, SweepResult) else result


def _ordered(values) -> list[str]:
    values = list(dict.fromkeys(values))
    return [c for c in CONFLICT_TYPES if c in values] + [c for c in values if c not in CONFLICT_TYPES]


def plot_knockouts(result: SweepResult | pd.DataFrame, target: str | None = None) -> go.Figure:
    """Figure 3: one panel per conflict type, layer on x, change in target probability on y,
    one line per module kind with a band of +/- one standard deviation across examples."""
    summary = _summary(result)
    target = target or summary.target.iloc[0]
    summary = summary[summary.target == target]
    types = _ordered(summary.conflict_type)
    fig = make_subplots(
        rows=1, cols=len(types), shared_yaxes=True, subplot_titles=[_LABELS.get(t, t) for t in types],
        horizontal_spacing=0.04,
    )
    for col, conflict_type in enumerate(types, start=1):
        part = summary[summary.conflict_type == conflict_type]
        for module in part.module.unique():
            rows = part[part.module == module].sort_values("layer")
            color = _MODULE_COLORS.get(module, "#7f7f7f")
            std = rows.delta_std.fillna(0)
            fig.add_trace(
                go.Scatter(
                    x=np.concatenate([rows.layer, rows.layer[::-1]]),
                    y=np.concatenate([rows.delta_mean + std, (rows.delta_mean - std)[::-1]]),
                    fill="toself", fillcolor=color, opacity=0.15, line=dict(width=0),
                    hoverinfo="skip", showlegend=False, legendgroup=module,
                ),
                row=1, col=col,
            )
            fig.add_trace(
                go.Scatter(
                    x=rows.layer, y=rows.delta_mean, mode="lines+markers", name=module, legendgroup=module,
                    line=dict(color=color), showlegend=col == 1,
                    customdata=np.stack([std, rows.n, rows.p_clean, rows.p], axis=1),
                    hovertemplate=(
                        f"{module} knocked out at layer %{{x}}<br>Δp = %{{y:.4f}} ± %{{customdata[0]:.4f}}"
                        "<br>n = %{customdata[1]}<br>p clean %{customdata[2]:.4f} → %{customdata[3]:.4f}"
                        "<extra></extra>"
                    ),
                ),
                row=1, col=col,
            )
        fig.add_hline(y=0, line=dict(color="black", width=1, dash="dot"), row=1, col=col)
        fig.update_xaxes(title_text="layer", row=1, col=col)
    fig.update_yaxes(title_text=f"Δ p({target} answer) when knocked out", row=1, col=1)
    fig.update_layout(
        title=f"Module knockouts: change in the {target} answer's probability", legend_title_text="module",
        template="plotly_white", height=420, width=max(450, 380 * len(types)),
    )
    return fig


def plot_head_heatmap(
    result: SweepResult | pd.DataFrame,
    alpha: float = 0.0,
    targets: str | Sequence[str] | None = None,
    conflict_types: Sequence[str] | None = None,
) -> go.Figure:
    """Superposition heatmaps: layers x heads, one panel per conflict type (columns) and target
    (rows), colour = mean change in the target's probability when each head is scaled by
    ``alpha``; diverging scale centred at 0, hover shows mean, std and n."""
    summary = _summary(result)
    summary = summary[np.isclose(summary.alpha, alpha)]
    if summary.empty:
        raise ValueError(f"No rows with alpha={alpha} in this sweep.")
    targets = list(summary.target.unique()) if targets is None else ([targets] if isinstance(targets, str) else list(targets))
    types = _ordered(summary.conflict_type) if conflict_types is None else list(conflict_types)
    limit = float(summary.delta_mean.abs().max()) or 1.0
    n_layers, n_heads = int(summary.layer.max()) + 1, int(summary["head"].max()) + 1
    fig = make_subplots(
        rows=len(targets), cols=len(types), shared_xaxes=True, shared_yaxes=True,
        subplot_titles=[f"{_LABELS.get(c, c)} · {t} answer" for t in targets for c in types],
        horizontal_spacing=0.03, vertical_spacing=0.08,
    )
    for r, target in enumerate(targets, start=1):
        for c, conflict_type in enumerate(types, start=1):
            part = summary[(summary.target == target) & (summary.conflict_type == conflict_type)]
            grid = {name: np.full((n_layers, n_heads), np.nan) for name in ("delta_mean", "delta_std", "n")}
            for name, values in grid.items():
                values[part.layer.to_numpy(), part["head"].to_numpy()] = part[name].to_numpy()
            fig.add_trace(
                go.Heatmap(
                    z=grid["delta_mean"], x=list(range(n_heads)), y=list(range(n_layers)),
                    zmin=-limit, zmax=limit, zmid=0, colorscale="RdBu_r",
                    customdata=np.stack([grid["delta_std"], grid["n"]], axis=-1),
                    colorbar=dict(title="Δp"), showscale=(r == 1 and c == 1),
                    hovertemplate=(
                        "layer %{y}, head %{x}<br>Δp mean %{z:.4f}<br>std %{customdata[0]:.4f}"
                        "<br>n %{customdata[1]}<extra></extra>"
                    ),
                ),
                row=r, col=c,
            )
            fig.update_xaxes(title_text="head", dtick=1, row=r, col=c)
        fig.update_yaxes(title_text="layer", dtick=1 if n_layers <= 30 else None, row=r, col=1)
    fig.update_layout(
        title=f"Change in answer probability when a head is scaled by {alpha:g}",
        template="plotly_white", height=max(350, 28 * n_layers * len(targets) + 120),
        width=max(450, (60 * n_heads + 120) * len(types)),
    )
    return fig


def plot_superposition(heads: pd.DataFrame) -> go.Figure:
    """Scatter of each head's effect under one conflict type vs the other (from
    :func:`cpsuper.heads.superposition_heads`); heads in the off-diagonal quadrants change sign."""
    cols = [c for c in heads.columns if c.startswith("delta_")]
    if len(cols) != 2:
        raise ValueError("Pass the DataFrame returned by superposition_heads.")
    a, b = cols
    data = heads.assign(
        label=[f"L{l}H{h}" for l, h in zip(heads.layer, heads["head"])],
        kind=np.where(heads.superposed, "sign flips (superposed)", "same sign"),
    )
    fig = px.scatter(
        data, x=a, y=b, color="kind", hover_name="label", hover_data={"layer": True, "head": True, "kind": False},
        color_discrete_map={"sign flips (superposed)": "#d62728", "same sign": "#7f7f7f"},
        labels={a: f"Δp under {a.removeprefix('delta_')}", b: f"Δp under {b.removeprefix('delta_')}"},
        template="plotly_white",
    )
    limit = float(np.nanmax(np.abs(data[[a, b]].to_numpy()))) * 1.1 or 1.0
    fig.add_hline(y=0, line=dict(color="black", width=1))
    fig.add_vline(x=0, line=dict(color="black", width=1))
    fig.update_xaxes(range=[-limit, limit])
    fig.update_yaxes(range=[-limit, limit], scaleanchor="x")
    target = heads["target"].iloc[0] if "target" in heads else "target"
    alpha = heads["alpha"].iloc[0] if "alpha" in heads else 0
    fig.update_layout(
        title=f"Head effects on the {target} answer (scale {alpha:g}): {int(heads.superposed.sum())} of {len(heads)} heads flip sign",
        legend_title_text="", width=620, height=560,
    )
    return fig


def plot_run_once_vs_twice(result: SweepResult | pd.DataFrame) -> go.Figure:
    """Figure 6: target probability vs the number of combined heads, run once vs run twice,
    with the unmodified model as a dotted line."""
    summary = _summary(result)
    target = summary.target.iloc[0]
    fig = px.line(
        summary, x="k", y="p", color="method", markers=True, error_y="delta_std",
        hover_data={"heads": True, "delta_mean": ":.4f", "n": True},
        labels={"k": "number of heads combined (top-k)", "p": f"p({target} answer)", "method": ""},
        template="plotly_white",
    )
    fig.add_hline(
        y=float(summary.p_clean.iloc[0]), line=dict(color="black", dash="dot"),
        annotation_text="unmodified model", annotation_position="top left",
    )
    fig.update_xaxes(dtick=1)
    fig.update_layout(title="Combining individually helpful heads: run once vs run twice", width=640, height=420)
    return fig


def style_head_table(table: pd.DataFrame, desired: dict[str, int] | None = None):
    """Colour a :func:`cpsuper.heads.rank_heads` table: green where a change goes the desired way
    (by default context up, parametric down, as for knocked-out memory heads), red otherwise.
    Returns a pandas ``Styler`` (renders as HTML in Jupyter)."""
    desired = desired or {"context": 1, "parametric": -1}

    def colour(column: pd.Series) -> list[str]:
        if not isinstance(column.name, tuple) or column.name[-1] not in desired:
            return [""] * len(column)
        sign = desired[column.name[-1]]
        return [
            "background-color: #c7e9c0" if v * sign > 0 else "background-color: #fcbba1" if v * sign < 0 else ""
            for v in column
        ]

    value_cols = [c for c in table.columns if isinstance(c, tuple) and c[-1] in desired]
    return table.style.apply(colour, axis=0).format("{:+.3f}", subset=value_cols).hide(axis="index")
