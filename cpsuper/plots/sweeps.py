"""Figures of intervention sweeps: module knockouts (Figure 3), layer x head superposition
heatmaps, the substitution-vs-coherent scatter, run once vs run twice (Figure 6), and the
coloured head table (Table 1)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

from ..stats import bootstrap_summary
from ..sweeps import SweepResult
from .heatmap import facet_heatmap
from .style import (
    colored_by,
    conflict_label,
    conflict_panels,
    finish,
    head_label,
    order_conflict_types,
    relabel_facets,
    scale_phrase,
    summary_frame,
    symmetric_range,
)

__all__ = [
    "plot_head_heatmap",
    "plot_knockouts",
    "plot_run_once_vs_twice",
    "plot_superposition",
    "style_head_table",
]

_ZERO_LINE = {"color": "black", "width": 1, "dash": "dot"}


def _bands(fig: go.Figure) -> go.Figure:
    """Each line trace's interval (``customdata[:, 0]`` to ``customdata[:, 1]``) as a band under it."""
    lines = list(fig.data)
    for trace in lines:
        x = np.asarray(trace.x, float)
        low, high = (np.asarray(trace.customdata, float)[:, i] for i in (0, 1))
        fig.add_scatter(
            x=np.concatenate([x, x[::-1]]),
            y=np.concatenate([high, low[::-1]]),
            fill="toself",
            fillcolor=trace.line.color,
            opacity=0.15,
            line={"width": 0},
            hoverinfo="skip",
            showlegend=False,
            legendgroup=trace.legendgroup,
            xaxis=trace.xaxis,
            yaxis=trace.yaxis,
        )
    fig.data = fig.data[len(lines) :] + fig.data[: len(lines)]  # bands below the lines
    return fig


def _with_intervals(result: SweepResult | pd.DataFrame, keys: Sequence[str], value: str = "delta") -> pd.DataFrame:
    """The sweep's summary with ``ci_low`` / ``ci_high``: the 95 % percentile bootstrap interval
    over facts of the mean ``value`` (the interval every cpsuper figure draws). A bare summary
    frame has no per-fact rows to resample: its interval columns are NaN and nothing is drawn."""
    summary = summary_frame(result)
    if not isinstance(result, SweepResult):
        return summary.assign(ci_low=np.nan, ci_high=np.nan)
    keys = [k for k in keys if k in result.per_example.columns]
    bands = bootstrap_summary(result.per_example, value=value, by=keys, unit="example")
    return summary.merge(bands[[*keys, "ci_low", "ci_high"]], on=keys, how="left")


def plot_knockouts(result: SweepResult | pd.DataFrame, target: str | None = None) -> go.Figure:
    """Figure 3: one panel per conflict type, layer on x, change in target probability on y,
    one line per module kind with its 95 % bootstrap interval over facts as a band (drawn when
    given the ``SweepResult``; a bare summary frame has no per-fact rows to resample)."""
    summary = _with_intervals(result, ["layer", "module", "conflict_type", "target"])
    target = target or summary.target.iloc[0]
    summary = summary[summary.target == target].sort_values("layer", kind="stable")
    types = order_conflict_types(summary.conflict_type)
    fig = px.line(
        summary,
        x="layer",
        y="delta_mean",
        **colored_by(summary, "module"),
        **conflict_panels(summary),
        markers=True,
        custom_data=["ci_low", "ci_high", "n", "p_clean", "p"],
        facet_col_spacing=0.04,
        labels={
            "delta_mean": f"Δ p({target} answer) when knocked out",
            "module": "module",
        },
    )
    fig.update_traces(
        hovertemplate=(
            "%{fullData.name} knocked out at layer %{x}<br>Δp = %{y:.4f} "
            "[%{customdata[0]:.4f}, %{customdata[1]:.4f}] (95 % interval)"
            "<br>n = %{customdata[2]}<br>p clean %{customdata[3]:.4f} → %{customdata[4]:.4f}<extra></extra>"
        )
    )
    fig.update_xaxes(dtick=1 if summary.layer.nunique() <= 30 else None)
    if summary.ci_low.notna().any():
        _bands(fig)
    relabel_facets(fig).add_hline(y=0, line=_ZERO_LINE, row="all", col="all")
    return finish(
        fig,
        f"Module knockouts: change in the {target} answer's probability",
        width=max(450, 380 * len(types)),
        height=440,
    )


def plot_head_heatmap(
    result: SweepResult | pd.DataFrame,
    alpha: float = 0.0,
    targets: str | Sequence[str] | None = None,
    conflict_types: Sequence[str] | None = None,
) -> go.Figure:
    """Superposition heatmaps: layers x heads, one panel per conflict type (columns) and target
    (rows), colour = mean change in the target's probability when each head is scaled by
    ``alpha``; diverging scale centred at 0; hover shows the 95 % bootstrap interval over facts
    (given the ``SweepResult``) and n. The context answer of a clean prompt appears nowhere in
    it, so that panel is left out."""
    summary = _with_intervals(result, ["layer", "head", "alpha", "conflict_type", "target"])
    summary = summary[np.isclose(summary.alpha, alpha)]
    if summary.empty:
        raise ValueError(f"No rows with alpha={alpha} in this sweep.")
    summary = summary[~((summary.conflict_type == "clean") & (summary.target == "context"))]
    if targets is None:
        targets = list(summary.target.unique())
    targets = [targets] if isinstance(targets, str) else list(targets)
    types = order_conflict_types(summary.conflict_type) if conflict_types is None else list(conflict_types)
    return facet_heatmap(
        summary,
        "delta_mean",
        x="head",
        y="layer",
        x_values=range(int(summary["head"].max()) + 1),
        y_values=range(int(summary.layer.max()) + 1),
        col="conflict_type",
        col_values=types,
        row="target",
        row_values=targets,
        panel_title=lambda t, c: f"{conflict_label(c)} · {t} answer",
        hover={"ci_low": ("95 % interval from", ":.4f"), "ci_high": ("to", ":.4f"), "n": ("n", "")},
        value_label="Δp (mean)",
        cell=(60, 28),
        title=f"Change in answer probability when a head is {scale_phrase(alpha)}",
    )


def plot_superposition(heads: pd.DataFrame) -> go.Figure:
    """Scatter of each head's effect under one conflict type vs the other (from
    :func:`cpsuper.heads.superposition_heads`); heads in the off-diagonal quadrants change sign.
    With intervals (a ``SweepResult`` was passed to ``superposition_heads``) each point carries
    its bootstrap error bars and only significant flips are marked superposed. Each axis is
    symmetric about 0 and fitted to its own data (intervals included), so small effects stay
    visible."""
    cols = [c for c in heads.columns if c.startswith("delta_")]
    if len(cols) != 2:
        raise ValueError("Pass the DataFrame returned by superposition_heads.")
    a, b = cols
    ta, tb = a.removeprefix("delta_"), b.removeprefix("delta_")
    sign_change = heads["sign_change"] if "sign_change" in heads else heads["superposed"]
    kind = np.where(
        heads.superposed, "superposed (significant flip)", np.where(sign_change, "sign change only", "same sign")
    )
    data = heads.assign(label=[head_label(l, h) for l, h in zip(heads.layer, heads["head"])], kind=kind)
    bars = {}
    if {f"ci_low_{ta}", f"ci_high_{ta}", f"ci_low_{tb}", f"ci_high_{tb}"} <= set(heads.columns):
        data["ex_plus"], data["ex_minus"] = data[f"ci_high_{ta}"] - data[a], data[a] - data[f"ci_low_{ta}"]
        data["ey_plus"], data["ey_minus"] = data[f"ci_high_{tb}"] - data[b], data[b] - data[f"ci_low_{tb}"]
        bars = {"error_x": "ex_plus", "error_x_minus": "ex_minus", "error_y": "ey_plus", "error_y_minus": "ey_minus"}
    fig = px.scatter(
        data,
        x=a,
        y=b,
        color="kind",
        hover_name="label",
        hover_data={"layer": True, "head": True, "kind": False},
        color_discrete_map={
            "superposed (significant flip)": "#D55E00",
            "sign change only": "#E69F00",
            "same sign": "#999999",
        },
        labels={a: f"Δp under {ta}", b: f"Δp under {tb}"},
        **bars,
    )
    fig.update_traces(error_x_thickness=0.8, error_y_thickness=0.8, error_x_width=0, error_y_width=0)
    fig.add_hline(y=0, line={"color": "black", "width": 1})
    fig.add_vline(x=0, line={"color": "black", "width": 1})
    xs = [data[a]] + ([data[f"ci_low_{ta}"], data[f"ci_high_{ta}"]] if bars else [])
    ys = [data[b]] + ([data[f"ci_low_{tb}"], data[f"ci_high_{tb}"]] if bars else [])
    fig.update_xaxes(range=symmetric_range(pd.concat(xs)))
    fig.update_yaxes(range=symmetric_range(pd.concat(ys)))
    target = heads["target"].iloc[0] if "target" in heads else "target"
    alpha = heads["alpha"].iloc[0] if "alpha" in heads else 0
    n_flip, n_change = int(heads.superposed.sum()), int(sign_change.sum())
    title = f"Head effects on the {target} answer ({scale_phrase(alpha)}): " + (
        f"{n_flip} of {len(heads)} heads flip significantly ({n_change} change sign)"
        if bars
        else f"{n_flip} of {len(heads)} heads flip sign"
    )
    return finish(fig, title, width=620, height=560, legend_title="")


def plot_run_once_vs_twice(result: SweepResult | pd.DataFrame) -> go.Figure:
    """Figure 6: target probability vs the number of combined heads, run once vs run twice,
    with the unmodified model as a dotted line. Error bars: the 95 % bootstrap interval over
    facts of the mean probability (with the ``SweepResult``; it stays within [0, 1])."""
    summary = _with_intervals(result, ["k", "method", "heads", "conflict_type", "target"], value="p")
    target = summary.target.iloc[0]
    summary = summary.assign(
        err_plus=(summary.ci_high - summary.p).clip(lower=0), err_minus=(summary.p - summary.ci_low).clip(lower=0)
    )
    bars = {"error_y": "err_plus", "error_y_minus": "err_minus"} if summary.ci_low.notna().any() else {}
    fig = px.line(
        summary,
        x="k",
        y="p",
        **colored_by(summary, "method"),
        markers=True,
        **bars,
        hover_data={"heads": True, "delta_mean": ":.4f", "n": True, "ci_low": ":.4f", "ci_high": ":.4f"},
        labels={
            "k": "number of heads combined (top-k)",
            "p": f"p({target} answer)",
            "method": "",
            "err_plus": "",
            "err_minus": "",
        },
    )
    fig.add_hline(
        y=float(summary.p_clean.iloc[0]),
        line={"color": "black", "dash": "dot"},
        annotation_text="unmodified model",
        annotation_position="top left",
    )
    fig.update_xaxes(dtick=1)
    return finish(
        fig,
        "Combining individually helpful heads: run once vs run twice",
        width=640,
        height=420,
    )


def style_head_table(table: pd.DataFrame, desired: dict[str, int] | None = None):
    """Colour a :func:`cpsuper.heads.rank_heads` table: green where a change goes the desired way
    (by default context up, parametric down, as for knocked-out memory heads), red otherwise.
    Returns a pandas ``Styler`` (renders as HTML in Jupyter). Column labels (conflict types come
    from datasets) are HTML-escaped; a Styler, unlike ``DataFrame.to_html``, does not escape them."""
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
    styled = table.style.apply(colour, axis=0).format("{:+.3f}", subset=value_cols)
    return styled.format_index(escape="html", axis="columns").hide(axis="index")
