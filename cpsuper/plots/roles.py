"""Head roles per conflict type (:func:`cpsuper.roles.head_roles`) as layer x head grids."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..roles import ROLES
from ..stats import format_ci
from .style import conflict_label, finish, order_conflict_types

__all__ = ["ROLE_COLORS", "plot_head_roles"]

ROLE_COLORS: dict[str, str] = {
    "memory": "#0072B2",
    "context": "#E69F00",
    "mixed": "#CC79A7",
    "negligible": "#EEEEEE",
}


def _discrete_scale() -> list[list]:
    """A colour scale with one flat band per role (codes 0..len(ROLES) - 1)."""
    n, scale = len(ROLES), []
    for i, role in enumerate(ROLES):
        scale += [[i / n, ROLE_COLORS[role]], [(i + 1) / n, ROLE_COLORS[role]]]
    return scale


def plot_head_roles(roles: pd.DataFrame, *, title: str | None = None) -> go.Figure:
    """One layer x head grid per conflict type, each cell coloured by the head's role (memory,
    context, mixed, negligible); hovering shows both targets' effects with their intervals."""
    missing = [c for c in ("layer", "head", "conflict_type", "role") if c not in roles.columns]
    if missing:
        raise ValueError(f"Expected a cp.head_roles frame; it lacks the columns {missing}.")
    if roles.empty:
        raise ValueError("No head roles to draw.")
    types = order_conflict_types(roles.conflict_type)
    layers = sorted(roles.layer.unique())
    heads = sorted(roles["head"].unique())
    code = {role: i for i, role in enumerate(ROLES)}
    fig = make_subplots(
        rows=1,
        cols=len(types),
        shared_yaxes=True,
        horizontal_spacing=0.03,
        subplot_titles=[conflict_label(t) for t in types],
    )
    for k, conflict_type in enumerate(types):
        part = roles[roles.conflict_type == conflict_type].set_index(["layer", "head"])
        z = np.full((len(layers), len(heads)), np.nan)
        text = np.full((len(layers), len(heads)), "", dtype=object)
        for (layer, head), row in part.iterrows():
            i, j = layers.index(layer), heads.index(head)
            z[i, j] = code[row.role]
            effects = [
                f"Δp({t}) " + format_ci(row[f"{t}_mean"], row[f"{t}_ci_low"], row[f"{t}_ci_high"], digits=3)
                for t in ("parametric", "context")
                if f"{t}_mean" in part.columns
            ]
            text[i, j] = "<br>".join([f"L{layer}H{head}: {row.role}", *effects])
        fig.add_trace(
            go.Heatmap(
                z=z,
                x=heads,
                y=layers,
                text=text,
                hovertemplate="%{text}<extra></extra>",
                colorscale=_discrete_scale(),
                zmin=-0.5,
                zmax=len(ROLES) - 0.5,
                showscale=k == 0,
                colorbar={"tickvals": list(range(len(ROLES))), "ticktext": list(ROLES), "title": "role"},
                xgap=1,
                ygap=1,
            ),
            row=1,
            col=k + 1,
        )
        fig.update_xaxes(title_text="head", dtick=1, row=1, col=k + 1)
    fig.update_yaxes(title_text="layer", dtick=1, row=1, col=1)
    alpha = roles["alpha"].iloc[0] if "alpha" in roles.columns else None
    default = "Head roles per conflict type" + (" (head knocked out)" if alpha == 0 else "")
    return finish(fig, title or default, height=max(360, 24 * len(layers) + 160))
