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
    "plot_attention_by_layer",
    "plot_attention_heatmap",
    "plot_head_categories",
    "plot_head_dla",
    "plot_head_heatmap",
    "plot_head_sources",
    "plot_knockouts",
    "plot_logit_lens",
    "plot_mechanisms",
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
                    fill="toself", fillcolor=color, opacity=0.15, line={"width": 0},
                    hoverinfo="skip", showlegend=False, legendgroup=module,
                ),
                row=1, col=col,
            )
            fig.add_trace(
                go.Scatter(
                    x=rows.layer, y=rows.delta_mean, mode="lines+markers", name=module, legendgroup=module,
                    line={"color": color}, showlegend=col == 1,
                    customdata=np.stack([std, rows.n, rows.p_clean, rows.p], axis=1),
                    hovertemplate=(
                        f"{module} knocked out at layer %{{x}}<br>Δp = %{{y:.4f}} ± %{{customdata[0]:.4f}}"
                        "<br>n = %{customdata[1]}<br>p clean %{customdata[2]:.4f} → %{customdata[3]:.4f}"
                        "<extra></extra>"
                    ),
                ),
                row=1, col=col,
            )
        fig.add_hline(y=0, line={"color": "black", "width": 1, "dash": "dot"}, row=1, col=col)
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
                    colorbar={"title": "Δp"}, showscale=(r == 1 and c == 1),
                    hovertemplate=(
                        "layer %{y}, head %{x}<br>Δp mean %{z:.4f}<br>std %{customdata[0]:.4f}"
                        "<br>n %{customdata[1]}<extra></extra>"
                    ),
                ),
                row=r, col=c,
            )
            # shared x axes: the axis title only under the bottom row, clear of the titles below
            fig.update_xaxes(title_text="head" if r == len(targets) else None, dtick=1, row=r, col=c)
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
    fig.add_hline(y=0, line={"color": "black", "width": 1})
    fig.add_vline(x=0, line={"color": "black", "width": 1})
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
        y=float(summary.p_clean.iloc[0]), line={"color": "black", "dash": "dot"},
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


# ---------------------------------------------------------------------------------------------
# Attribution and attention


def _one(frame: pd.DataFrame, column: str, value, what: str) -> tuple[pd.DataFrame, object]:
    """Rows of ``frame`` with ``column == value`` (default: its first value), with a clear error."""
    values = list(dict.fromkeys(frame[column]))
    value = values[0] if value is None else value
    if value not in values:
        raise ValueError(f"No {what} {value!r} in this result; it has {values}.")
    return frame[frame[column] == value], value


def _layer_head_heatmap(frame: pd.DataFrame, value: str, facet: str | None, title: str, zlabel: str,
                        diverging: bool = True) -> go.Figure:
    n_layers, n_heads = int(frame.layer.max()) + 1, int(frame["head"].max()) + 1
    panels = list(dict.fromkeys(frame[facet])) if facet else [None]
    if facet == "conflict_type":
        panels = _ordered(panels)
    grids = []
    for panel in panels:
        part = frame if panel is None else frame[frame[facet] == panel]
        grid = np.full((n_layers, n_heads), np.nan)
        grid[part.layer.to_numpy(int), part["head"].to_numpy(int)] = part[value].to_numpy(float)
        grids.append(grid)
    stack = np.stack(grids)
    limit = float(np.nanmax(np.abs(stack))) or 1.0
    fig = px.imshow(
        stack, facet_col=0, origin="lower", aspect="auto", labels={"x": "head", "y": "layer", "color": zlabel},
        color_continuous_scale="RdBu_r" if diverging else "Viridis",
        zmin=-limit if diverging else 0, zmax=limit, title=title,
    )
    if diverging:
        fig.update_coloraxes(cmid=0)
    for i, panel in enumerate(panels):
        fig.layout.annotations[i].text = "" if panel is None else _LABELS.get(panel, str(panel))
    fig.update_xaxes(dtick=1)
    fig.update_layout(template="plotly_white", height=max(350, 24 * n_layers + 140),
                      width=max(420, (55 * n_heads + 90) * len(panels)))
    return fig


def plot_head_dla(attribution, conflict_type: str | None = None, direction: str | None = None,
                  by_group: bool = True) -> go.Figure:
    """Head DLA heatmaps (layer x head), one panel per source group (``by_group``) or the total."""
    s, conflict_type = _one(attribution.head_sources(), "conflict_type", conflict_type, "conflict type")
    s, direction = _one(s, "direction", direction, "direction")
    if by_group:
        s = s[s.group.isin(s.groupby("group").dla.apply(lambda x: x.abs().max()).loc[lambda x: x > 0].index)]
        frame, facet = s, "group"
    else:
        frame, facet = s.groupby(["layer", "head"], as_index=False)["dla"].sum(), None
    return _layer_head_heatmap(frame, "dla", facet, f"Direct logit attribution of each head to {direction} "
                               f"({_LABELS.get(conflict_type, conflict_type)}), by source tokens", "DLA")


def plot_head_sources(attribution, conflict_type: str | None = None, direction: str | None = None,
                      top_k: int = 10) -> go.Figure:
    """Stacked bars: where the top-``k`` heads' DLA comes from (subject, relation, context, ...)."""
    s, conflict_type = _one(attribution.head_sources(), "conflict_type", conflict_type, "conflict type")
    s, direction = _one(s, "direction", direction, "direction")
    total = s.groupby(["layer", "head"])["dla"].sum()
    top = total.abs().sort_values(ascending=False).index[:top_k]
    s = s.set_index(["layer", "head"]).loc[top].reset_index()
    s["unit"] = [f"L{l}H{h}" for l, h in zip(s.layer, s["head"])]
    fig = px.bar(s, x="unit", y="dla", color="group", barmode="relative", hover_data=["attention"],
                 category_orders={"unit": [f"L{l}H{h}" for l, h in top]},
                 title=f"Top {len(top)} heads for {direction} ({_LABELS.get(conflict_type, conflict_type)}): DLA by source",
                 labels={"unit": "head", "dla": "DLA", "group": "source"})
    fig.add_scatter(x=[f"L{l}H{h}" for l, h in top], y=[total[k] for k in top], mode="markers",
                    marker={"symbol": "diamond", "color": "black"}, name="total")
    return fig.update_layout(template="plotly_white")


def plot_head_categories(categories: pd.DataFrame) -> go.Figure:
    """Subject-token DLA vs relation-token DLA per head, coloured by category."""
    frame = categories.assign(unit=[f"L{l}H{h}" for l, h in zip(categories.layer, categories["head"])])
    fig = px.scatter(frame, x="subject_dla", y="relation_dla", color="category", hover_name="unit",
                     hover_data=["dla", "subject_share", "relation_share", "attention_subject", "attention_relation"],
                     title="Subject vs relation heads: DLA from subject tokens and from relation tokens",
                     labels={"subject_dla": "DLA from subject tokens", "relation_dla": "DLA from relation tokens"})
    return fig.update_layout(template="plotly_white")


def plot_mechanisms(mechanisms: pd.DataFrame) -> go.Figure:
    """Per-mechanism direct logit of each candidate answer, with their sum (constructive
    interference: independent mechanisms adding up on the correct attribute)."""
    parts = mechanisms[mechanisms.mechanism != "sum"]
    fig = px.bar(parts, x="candidate", y="dla", color="mechanism", barmode="group", facet_col="conflict_type",
                 category_orders={"conflict_type": _ordered(parts.conflict_type)},
                 title="Direct logit of each candidate answer by mechanism", labels={"dla": "direct logit"})
    sums = mechanisms[mechanisms.mechanism == "sum"]
    for i, conflict_type in enumerate(_ordered(parts.conflict_type), start=1):
        part = sums[sums.conflict_type == conflict_type]
        fig.add_scatter(x=part.candidate, y=part.dla, mode="markers", marker={"symbol": "line-ew-open", "size": 30,
                        "color": "black", "line": {"width": 3}}, name="sum", showlegend=i == 1, row=1, col=i)
    return fig.update_layout(template="plotly_white")


def plot_logit_lens(attribution) -> go.Figure:
    """Cumulative direct effect across the residual stream, one line per direction (e.g. the
    parametric and the context answer), one panel per conflict type."""
    frame = attribution.by_layer()
    fig = px.line(frame, x="label", y="cumulative", color="direction", facet_col="conflict_type", markers=True,
                  category_orders={"conflict_type": _ordered(frame.conflict_type)},
                  hover_data=["dla"], labels={"label": "", "cumulative": "cumulative direct logit"},
                  title="Cumulative direct effect on each answer's logit, layer by layer")
    return fig.update_layout(template="plotly_white").update_xaxes(tickangle=-60)


def plot_attention_heatmap(result, column: str = "attention") -> go.Figure:
    """Attention from the final token to the span: layer x head, one panel per conflict type."""
    frame = result.by_head()
    if "known" in frame:
        frame = frame.groupby(["conflict_type", "layer", "head"], as_index=False)[column].mean()
    title = f"Attention from the last token to the {result.span} ({result.reduce} over its tokens)"
    return _layer_head_heatmap(frame, column, "conflict_type", title, column.replace("_", " "), diverging=False)


def plot_attention_by_layer(result, column: str = "attention") -> go.Figure:
    """Attention to the span per layer (mean over heads and examples) by conflict type, dashed
    for unknown facts when the result was split by ``known``."""
    frame = result.by_layer()
    fig = px.line(frame, x="layer", y=column, color="conflict_type", markers=True, error_y="sem" if column == "attention" else None,
                  line_dash="known" if "known" in frame else None,
                  category_orders={"conflict_type": _ordered(frame.conflict_type)},
                  title=f"Attention from the last token to the {result.span}, per layer")
    return fig.update_layout(template="plotly_white")
