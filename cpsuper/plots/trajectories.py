"""Figures of measurements across training checkpoints (:func:`cpsuper.trajectories.checkpoint_trajectory`)."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

from .style import colored_by, finish

__all__ = ["plot_trajectory"]


def plot_trajectory(trajectory: pd.DataFrame, quantities: Sequence[str] | None = None) -> go.Figure:
    """One line per measured quantity over the checkpoints, in checkpoint order."""
    frame = trajectory if quantities is None else trajectory[trajectory.quantity.isin(quantities)]
    if frame.empty:
        raise ValueError(f"No quantities {quantities} in this trajectory; it has {sorted(set(trajectory.quantity))}.")
    frame = frame.sort_values("order")
    fig = px.line(
        frame,
        x="checkpoint",
        y="value",
        **colored_by(frame, "quantity"),
        markers=True,
        labels={"checkpoint": "checkpoint", "value": ""},
    )
    if not pd.api.types.is_numeric_dtype(frame.checkpoint):
        fig.update_xaxes(
            type="category",
            categoryorder="array",
            categoryarray=list(dict.fromkeys(frame.checkpoint)),
        )
    return finish(fig, "Measures across training checkpoints")
