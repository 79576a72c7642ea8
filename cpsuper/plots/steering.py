"""Figures of JuICE's robustness sweeps (:mod:`cpsuper.robustness`, the paper's Figure 5 and
Table 7): accuracy against a swept setting, and accuracy over the (beta+, beta-) grid."""

from __future__ import annotations

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

from .heatmap import facet_heatmap
from .style import color_map, finish, order_conflict_types, relabel_facets

__all__ = ["plot_beta_grid", "plot_robustness"]


def plot_robustness(frame: pd.DataFrame, x: str, color: str = "conflict_type") -> go.Figure:
    """Accuracy against a swept setting (``"k"``, ``"n_selection"``, ``"template"``)."""
    if x not in frame:
        raise ValueError(f"No column {x!r}; the frame has {list(frame.columns)}.")
    kind = px.line if pd.api.types.is_numeric_dtype(frame[x]) else px.bar
    extra = {"markers": True} if kind is px.line else {"barmode": "group"}
    facet = "method" if "method" in frame and color != "method" else None
    orders = {"conflict_type": order_conflict_types(frame.conflict_type)} if "conflict_type" in frame else {}
    fig = kind(
        frame,
        x=x,
        y="accuracy",
        color=color,
        facet_col=facet,
        range_y=[0, 1.05],
        color_discrete_map=color_map(frame[color]),
        category_orders=orders,
        **extra,
    )
    return finish(relabel_facets(fig), f"Accuracy against {x}")


def plot_beta_grid(frame: pd.DataFrame) -> go.Figure:
    """Heatmaps of accuracy over (beta_plus, beta_minus), one per conflict type and the mean."""
    mean = frame.groupby(["beta_plus", "beta_minus"], as_index=False)["accuracy"].mean().assign(conflict_type="mean")
    full = pd.concat([frame, mean], ignore_index=True)
    return facet_heatmap(
        full,
        "accuracy",
        x="beta_minus",
        y="beta_plus",
        col="conflict_type",
        col_values=order_conflict_types(full.conflict_type),
        categorical_x=True,
        categorical_y=True,
        diverging=False,
        zmin=0.0,
        zmax=1.0,
        text_format=".2f",
        labels={"beta_minus": "beta-", "beta_plus": "beta+"},
        cell=(60, 40),
        title="Accuracy over the beta grid",
    )
