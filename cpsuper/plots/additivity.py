"""Additivity of mechanisms: the change in logit difference when classes are ablated alone and
together, against the sum of the singles, and the residual of each combination."""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .style import conflict_label, finish, order_conflict_types

__all__ = ["plot_additivity"]

_COLORS = {"alone": "#999999", "ablated together": "#0072B2", "sum of singles": "#000000", "residual": "#D55E00"}


def _errors(frame, prefix: str) -> dict:
    mean = frame[f"{prefix}_mean"]
    return {
        "type": "data",
        "array": (frame[f"{prefix}_high"] - mean).to_numpy(),
        "arrayminus": (mean - frame[f"{prefix}_low"]).to_numpy(),
    }


def plot_additivity(result) -> go.Figure:
    """Left: the mean change of the metric (with its bootstrap interval) when each class is
    ablated alone and each combination together, with the sum of the singles' changes as a
    marker. Right: each combination's residual (together minus the sum); zero means additive.
    One row per conflict type. ``result`` is what :func:`cpsuper.additivity` returned."""
    summary = result.summary
    per = result.per_example
    types = order_conflict_types(summary.conflict_type)
    fig = make_subplots(
        rows=len(types),
        cols=2,
        column_widths=[0.62, 0.38],
        shared_yaxes=False,
        subplot_titles=[t for c in types for t in (f"{conflict_label(c)}: change", f"{conflict_label(c)}: residual")],
        vertical_spacing=0.12,
    )
    for row, conflict_type in enumerate(types, start=1):
        s = summary[summary.conflict_type == conflict_type]
        single, joint = s[s.kind == "single"], s[s.kind != "single"]
        additive = per[(per.conflict_type == conflict_type) & (per.kind != "single")]
        additive = additive.groupby("condition", sort=False)["additive"].mean().reindex(joint.condition)
        show = row == 1
        for name, part in (("alone", single), ("ablated together", joint)):
            fig.add_bar(
                x=part.condition,
                y=part.delta_mean,
                error_y=_errors(part, "delta"),
                name=name,
                marker_color=_COLORS[name],
                legendgroup=name,
                showlegend=show,
                row=row,
                col=1,
            )
        fig.add_scatter(
            x=joint.condition,
            y=additive.to_numpy(),
            mode="markers",
            marker={"symbol": "line-ew-open", "size": 26, "color": _COLORS["sum of singles"], "line": {"width": 3}},
            name="sum of singles",
            legendgroup="sum of singles",
            showlegend=show,
            row=row,
            col=1,
        )
        fig.add_bar(
            x=joint.condition,
            y=joint.residual_mean,
            error_y=_errors(joint, "residual"),
            name="residual",
            marker_color=_COLORS["residual"],
            legendgroup="residual",
            showlegend=show,
            row=row,
            col=2,
        )
        fig.add_hline(y=0, line_color="#555555", line_width=1, row=row, col=2)
    ablation = summary.attrs.get("ablation", per.attrs.get("ablation", "zero"))
    fig.update_yaxes(title_text="change in metric", col=1)
    fig.update_yaxes(title_text="together - sum", col=2)
    fig.update_layout(barmode="group")
    title = f"Additivity of mechanisms ({ablation} ablation at the final position)"
    return finish(fig, title, height=320 * len(types) + 80, width=1000)
