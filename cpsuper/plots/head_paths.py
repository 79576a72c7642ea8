"""Head-to-head path patching: sender x receiver heatmaps, one panel per receiver input."""

from __future__ import annotations

import plotly.graph_objects as go

from ..head_paths import INPUTS, HeadPathResult
from .heatmap import facet_heatmap

__all__ = ["plot_head_paths"]

_INPUT_LABELS = {"q": "query", "k": "key", "v": "value", "qkv": "q, k and v"}


def plot_head_paths(result: HeadPathResult, *, title: str | None = None) -> go.Figure:
    """Mean effect of each sender head (rows, ``L{layer}H{head}``) through each receiver head's
    input (columns), one panel per input (query, key, value, all three), from a
    :func:`cpsuper.head_paths.head_path_patching` result. Hover shows the bootstrap interval over
    facts and their number; pairs that were not patched stay empty."""
    if not isinstance(result, HeadPathResult):
        raise TypeError(f"plot_head_paths takes a HeadPathResult (head_path_patching), got {type(result).__name__}.")
    frame = result.summary.copy()
    frame["sender"] = [f"L{l}H{h}" for l, h in zip(frame.sender_layer, frame.sender_head)]
    frame["receiver"] = [f"L{l}H{h}" for l, h in zip(frame.receiver_layer, frame.receiver_head)]
    by_head = lambda part, name: (  # noqa: E731 - heads in (layer, head) order
        part.sort_values([f"{name}_layer", f"{name}_head"])[name].drop_duplicates().tolist()
    )
    inputs = [i for i in INPUTS if i in set(frame["input"])]
    metric = result.per_example.attrs.get("metric", "metric")
    return facet_heatmap(
        frame,
        "mean",
        x="receiver",
        y="sender",
        x_values=by_head(frame, "receiver"),
        y_values=by_head(frame, "sender"),
        col="input",
        col_values=inputs,
        panel_title=lambda r, c: _INPUT_LABELS.get(c, str(c)),
        hover={"ci_low": ("ci low", ":.3f"), "ci_high": ("ci high", ":.3f"), "n": ("facts", ":.0f")},
        diverging=True,
        value_label=f"mean effect ({metric.replace('_', ' ')})",
        categorical_x=True,
        categorical_y=True,
        labels={"receiver": "receiver head", "sender": "sender head"},
        cell=(60, 16),
        title=title,
    )
