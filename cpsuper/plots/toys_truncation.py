"""Figures of the truncation paper's remaining results (appendix A, Theorem 1, Figure 1).

Each function takes a tidy frame from :mod:`cpsuper.toys` (or the Figure 1 script's CSV) and
returns a ``plotly.graph_objects.Figure``:

- :func:`plot_trigger_matching`: Figure 8, ``<W_V^1 W_E(i), W_KQ^2 W_E(j)>`` as heatmaps;
- :func:`plot_ffn_variants`: Figures 10-12, clean-data answer measures per condition and variant;
- :func:`plot_value_truncation`: Figure 12, answer measures against the ``W_O`` rank fraction;
- :func:`plot_one_step_margins`: Theorem 1, empirical against predicted margins by sample size;
- :func:`plot_truncation_figure1`: Figure 1, candidate probabilities against rho per layer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

__all__ = [
    "plot_ffn_variants",
    "plot_one_step_margins",
    "plot_trigger_matching",
    "plot_truncation_figure1",
    "plot_value_truncation",
]

_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf"]
_MEASURES = ("p_correct", "p_noise", "clean_loss")


def plot_trigger_matching(matchings: pd.DataFrame | Mapping[str, pd.DataFrame]) -> go.Figure:
    """One heatmap per run of :func:`~cpsuper.toys.noisy_recall_variants.trigger_matching`
    (rows: the key's source token ``i``; columns: the query token ``j``); the paper finds large
    values only on the diagonal at the triggers."""
    runs = {"": matchings} if isinstance(matchings, pd.DataFrame) else dict(matchings)
    fig = make_subplots(rows=1, cols=len(runs), subplot_titles=list(runs), horizontal_spacing=0.08)
    for col, frame in enumerate(runs.values(), start=1):
        grid = frame.pivot(index="key_token", columns="query_token", values="score")
        limit = float(np.nanmax(np.abs(grid.to_numpy()))) or 1.0
        fig.add_trace(
            go.Heatmap(
                z=grid.to_numpy(),
                x=grid.columns,
                y=grid.index,
                colorscale="RdBu",
                zmid=0,
                zmin=-limit,
                zmax=limit,
                showscale=col == len(runs),
            ),
            row=1,
            col=col,
        )
        fig.update_xaxes(title_text="query token j", row=1, col=col)
        fig.update_yaxes(title_text="key source token i" if col == 1 else None, autorange="reversed", row=1, col=col)
    fig.update_layout(title="Second-layer key-query score of layer-1 values", template="plotly_white")
    return fig


def plot_ffn_variants(table: pd.DataFrame, measures: Sequence[str] = _MEASURES) -> go.Figure:
    """Grouped bars from :func:`~cpsuper.toys.noisy_recall_variants.ffn_variant_table`: one
    panel per measure, conditions (full, drop mlp1, drop mlp2, truncations) on the x axis, one
    colour per variant."""
    fig = make_subplots(rows=1, cols=len(measures), subplot_titles=list(measures))
    variants = list(dict.fromkeys(table.variant))
    for col, measure in enumerate(measures, start=1):
        part = table[table.measure == measure]
        for k, variant in enumerate(variants):
            rows = part[part.variant == variant]
            fig.add_trace(
                go.Bar(
                    x=rows.condition,
                    y=rows.value,
                    name=f"{variant} ({rows.ffn.iloc[0]})" if len(rows) else variant,
                    marker_color=_COLORS[k % len(_COLORS)],
                    legendgroup=variant,
                    showlegend=col == 1,
                ),
                row=1,
                col=col,
            )
    fig.update_layout(barmode="group", title="Clean test data: full model and dropped blocks", template="plotly_white")
    return fig


def plot_value_truncation(table: pd.DataFrame, measures: Sequence[str] = _MEASURES) -> go.Figure:
    """Answer measures against ``rho`` from
    :func:`~cpsuper.toys.noisy_recall_variants.value_truncation_stats` (columns ``rho`` and
    ``measure``, ``value``); ``rho = 1`` is the full model. Log-scaled rho axis."""
    fig = make_subplots(rows=1, cols=len(measures), subplot_titles=list(measures))
    for col, measure in enumerate(measures, start=1):
        rows = table[table.measure == measure].sort_values("rho")
        fig.add_trace(
            go.Scatter(x=rows.rho, y=rows.value, mode="lines+markers", marker_color=_COLORS[col - 1], showlegend=False),
            row=1,
            col=col,
        )
        fig.update_xaxes(type="log", title_text="rho (fraction of W_O's rank kept)", row=1, col=col)
    fig.update_layout(title="First-layer W_O truncation, attention-only model", template="plotly_white")
    return fig


def plot_one_step_margins(frame: pd.DataFrame, *, scaled: bool = True) -> go.Figure:
    """Theorem 1 from :func:`~cpsuper.toys.margins.one_step_margins`: per block, the margin
    after one step against the sample size ``m`` (mean over seeds, bars = spread over seeds),
    the prediction (dashed) and prediction +- the theorem's bound with constant 1 (shaded).
    ``scaled`` divides by the step size (``eta_f``, ``eta_v / N``) so both predictions read
    about ``alpha``."""
    blocks = list(dict.fromkeys(frame.block))
    fig = make_subplots(rows=1, cols=len(blocks), subplot_titles=blocks, shared_yaxes=scaled)
    margin, predicted = ("scaled_margin", "scaled_predicted") if scaled else ("margin", "predicted")
    for col, block in enumerate(blocks, start=1):
        part = frame[frame.block == block]
        ratio = (part[margin] / part["margin"]).replace([np.inf, -np.inf], np.nan).fillna(1.0)
        part = part.assign(bound_shown=part["bound"] * ratio)
        stats = part.groupby("m").agg(
            y=(margin, "mean"), err=(margin, "std"), pred=(predicted, "mean"), bound=("bound_shown", "mean")
        )
        stats = stats.reset_index()
        band_x = list(stats.m) + list(stats.m[::-1])
        band_y = list(stats.pred + stats.bound) + list((stats.pred - stats.bound)[::-1])
        fig.add_trace(
            go.Scatter(x=band_x, y=band_y, fill="toself", line_width=0, fillcolor="rgba(150,150,150,0.25)",
                       name="prediction +- bound", showlegend=col == 1),
            row=1, col=col,
        )  # fmt: skip
        fig.add_trace(
            go.Scatter(x=stats.m, y=stats.pred, mode="lines", line_dash="dash", line_color="black",
                       name="predicted", showlegend=col == 1),
            row=1, col=col,
        )  # fmt: skip
        fig.add_trace(
            go.Scatter(x=stats.m, y=stats.y, error_y={"type": "data", "array": stats.err.fillna(0)},
                       mode="lines+markers", marker_color=_COLORS[col - 1], name=f"{block} (measured)"),
            row=1, col=col,
        )  # fmt: skip
        fig.update_xaxes(type="log", title_text="samples m in the gradient step", row=1, col=col)
    fig.update_yaxes(title_text="margin / step size" if scaled else "noise margin", row=1, col=1)
    fig.update_layout(title="Noise margin after one gradient step (Theorem 1)", template="plotly_white")
    return fig


def plot_truncation_figure1(
    table: pd.DataFrame, *, matrix: str = "mlp_in", layers: Sequence[int] | None = None
) -> go.Figure:
    """Figure 1 from ``scripts/truncation_figure1.py``'s ``per_setting.csv``: probability of
    each candidate against rho, one panel per layer, for one truncated ``matrix`` (rho = 0 is
    the dropped MLP, identical to truncating to rank 0 on Gemma, which has no MLP biases)."""
    drops = table[table.edit == "drop"].assign(rho=0.0)
    part = pd.concat([table[table.matrix == matrix], drops], ignore_index=True)
    layers = sorted(part.layer.unique()) if layers is None else list(layers)
    cols = min(len(layers), 6)
    nrows = -(-len(layers) // cols)
    fig = make_subplots(rows=nrows, cols=cols, subplot_titles=[f"layer {layer}" for layer in layers], shared_yaxes=True)
    candidates = list(dict.fromkeys(part.candidate))
    for n, layer in enumerate(layers):
        row, col = n // cols + 1, n % cols + 1
        for k, cand in enumerate(candidates):
            rows = part[(part.layer == layer) & (part.candidate == cand)].sort_values("rho")
            label = rows.token.iloc[0] if len(rows) else cand
            fig.add_trace(
                go.Scatter(x=rows.rho, y=rows.p, mode="lines+markers", marker_color=_COLORS[k % len(_COLORS)],
                           name=f"{cand} ({label.strip()})", legendgroup=cand, showlegend=n == 0),
                row=row, col=col,
            )  # fmt: skip
    fig.update_layout(title=f"Candidate probabilities vs rho ({matrix})", template="plotly_white")
    return fig
