"""Figures of direct logit attribution and attention: per-head DLA heatmaps and their source
tokens, subject vs relation heads, mechanisms adding up, the cumulative direct effect layer by
layer, and attention from the final token to a prompt span."""

from __future__ import annotations

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

from .heatmap import facet_heatmap
from .style import (
    colored_by,
    conflict_label,
    conflict_panels,
    finish,
    head_label,
    relabel_facets,
)

__all__ = [
    "plot_attention_by_layer",
    "plot_attention_heatmap",
    "plot_cumulative_dla",
    "plot_head_categories",
    "plot_head_dla",
    "plot_head_sources",
    "plot_mechanisms",
]


def _one(frame: pd.DataFrame, column: str, value, what: str) -> tuple[pd.DataFrame, object]:
    """Rows of ``frame`` with ``column == value`` (default: its first value), with a clear error."""
    values = list(dict.fromkeys(frame[column]))
    value = values[0] if value is None else value
    if value not in values:
        raise ValueError(f"No {what} {value!r} in this result; it has {values}.")
    return frame[frame[column] == value], value


def _layer_head(frame: pd.DataFrame, value: str, **options) -> go.Figure:
    """A layer x head heatmap over every layer and head up to the largest present."""
    return facet_heatmap(
        frame,
        value,
        x="head",
        y="layer",
        x_values=range(int(frame["head"].max()) + 1),
        y_values=range(int(frame.layer.max()) + 1),
        **options,
    )


def plot_head_dla(
    attribution,
    conflict_type: str | None = None,
    direction: str | None = None,
    by_group: bool = True,
) -> go.Figure:
    """Head DLA heatmaps (layer x head), one panel per source group (``by_group``) or the total."""
    s, conflict_type = _one(attribution.head_sources(), "conflict_type", conflict_type, "conflict type")
    s, direction = _one(s, "direction", direction, "direction")
    if by_group:
        s = s[s.group.isin(s.groupby("group").dla.apply(lambda x: x.abs().max()).loc[lambda x: x > 0].index)]
        frame, facet = s, "group"
    else:
        frame, facet = s.groupby(["layer", "head"], as_index=False)["dla"].sum(), None
    title = f"Direct logit attribution of each head to {direction} ({conflict_label(conflict_type)}), by source tokens"
    return _layer_head(frame, "dla", col=facet, value_label="DLA", title=title)


def plot_head_sources(
    attribution,
    conflict_type: str | None = None,
    direction: str | None = None,
    top_k: int = 10,
) -> go.Figure:
    """Stacked bars: where the top-``k`` heads' DLA comes from (subject, relation, context, ...)."""
    s, conflict_type = _one(attribution.head_sources(), "conflict_type", conflict_type, "conflict type")
    s, direction = _one(s, "direction", direction, "direction")
    total = s.groupby(["layer", "head"])["dla"].sum()
    top = total.abs().sort_values(ascending=False).index[:top_k]
    s = s.set_index(["layer", "head"]).loc[top].reset_index()
    s["unit"] = [head_label(l, h) for l, h in zip(s.layer, s["head"])]
    units = [head_label(l, h) for l, h in top]
    fig = px.bar(
        s,
        x="unit",
        y="dla",
        **colored_by(s, "group"),
        barmode="relative",
        hover_data=["attention"],
        category_orders={"unit": units},
        labels={"unit": "head", "dla": "DLA", "group": "source"},
    )
    fig.add_scatter(
        x=units,
        y=[total[k] for k in top],
        mode="markers",
        marker={"symbol": "diamond", "color": "black"},
        name="total",
    )
    return finish(
        fig,
        f"Top {len(top)} heads for {direction} ({conflict_label(conflict_type)}): DLA by source",
    )


def plot_head_categories(categories: pd.DataFrame) -> go.Figure:
    """Subject-token DLA vs relation-token DLA per head, coloured by category."""
    frame = categories.assign(unit=[head_label(l, h) for l, h in zip(categories.layer, categories["head"])])
    fig = px.scatter(
        frame,
        x="subject_dla",
        y="relation_dla",
        **colored_by(frame, "category"),
        hover_name="unit",
        hover_data=[
            "dla",
            "subject_share",
            "relation_share",
            "attention_subject",
            "attention_relation",
        ],
        labels={
            "subject_dla": "DLA from subject tokens",
            "relation_dla": "DLA from relation tokens",
        },
    )
    return finish(
        fig,
        "Subject vs relation heads: DLA from subject tokens and from relation tokens",
    )


def plot_mechanisms(mechanisms: pd.DataFrame) -> go.Figure:
    """Per-mechanism direct logit of each candidate answer, with their sum (constructive
    interference: independent mechanisms adding up on the correct attribute)."""
    parts = mechanisms[mechanisms.mechanism != "sum"]
    panels = conflict_panels(parts)
    types = panels["category_orders"]["conflict_type"]
    fig = px.bar(
        parts,
        x="candidate",
        y="dla",
        **colored_by(parts, "mechanism"),
        barmode="group",
        **panels,
        labels={"dla": "direct logit"},
    )
    sums = mechanisms[mechanisms.mechanism == "sum"]
    for i, conflict_type in enumerate(types, start=1):
        part = sums[sums.conflict_type == conflict_type]
        fig.add_scatter(
            x=part.candidate,
            y=part.dla,
            mode="markers",
            marker={
                "symbol": "line-ew-open",
                "size": 30,
                "color": "black",
                "line": {"width": 3},
            },
            name="sum",
            showlegend=i == 1,
            row=1,
            col=i,
        )
    return finish(relabel_facets(fig), "Direct logit of each candidate answer by mechanism")


def plot_cumulative_dla(attribution) -> go.Figure:
    """Cumulative direct effect across the residual stream, one line per direction (e.g. the
    parametric and the context answer), one panel per conflict type: the running sum of each
    writer's direct logit attribution with the final norm's scale frozen (not a logit lens, which
    :func:`~cpsuper.plots.plot_logit_lens` draws)."""
    frame = attribution.by_layer()
    fig = px.line(
        frame,
        x="label",
        y="cumulative",
        **colored_by(frame, "direction"),
        **conflict_panels(frame),
        markers=True,
        hover_data=["dla"],
        labels={"label": "", "cumulative": "cumulative direct logit"},
    )
    fig.update_xaxes(tickangle=-60)
    return finish(
        relabel_facets(fig),
        "Cumulative direct effect on each answer's logit, layer by layer",
    )


def plot_attention_heatmap(result, column: str = "attention") -> go.Figure:
    """Attention from the final token to the span: layer x head, one panel per conflict type."""
    frame = result.by_head()
    if "known" in frame:
        frame = frame.groupby(["conflict_type", "layer", "head"], as_index=False)[column].mean()
    title = f"Attention from the last token to the {result.span} ({result.reduce} over its tokens)"
    return _layer_head(
        frame,
        column,
        col="conflict_type",
        diverging=False,
        zmin=0.0,
        value_label=column.replace("_", " "),
        title=title,
    )


def plot_attention_by_layer(result, column: str = "attention") -> go.Figure:
    """Attention to the span per layer (mean over heads and examples) by conflict type, dashed
    for unknown facts when the result was split by ``known``; error bars (for ``attention``):
    the 95 % bootstrap interval over facts."""
    frame = result.by_layer()
    bars = {}
    if column == "attention" and {"ci_low", "ci_high"} <= set(frame.columns):
        frame = frame.assign(
            err_plus=(frame.ci_high - frame.attention).clip(lower=0),
            err_minus=(frame.attention - frame.ci_low).clip(lower=0),
        )
        bars = {"error_y": "err_plus", "error_y_minus": "err_minus"}
    fig = px.line(
        frame,
        x="layer",
        y=column,
        **colored_by(frame, "conflict_type"),
        markers=True,
        **bars,
        line_dash="known" if "known" in frame else None,
        **conflict_panels(frame, facet=False),
    )
    fig.update_xaxes(dtick=1 if frame.layer.nunique() <= 30 else None)
    return finish(fig, f"Attention from the last token to the {result.span}, per layer")
