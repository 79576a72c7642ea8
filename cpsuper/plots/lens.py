"""The logit lens (:func:`cpsuper.lens.logit_lens`): each answer's probability, log-probability
or rank when every layer's residual stream is read through the final norm and the unembedding."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..lens import LogitLens
from .style import color_map, conflict_label, finish, order_conflict_types

__all__ = ["plot_logit_lens"]

_VALUES = {
    "probability": "probability of the answer's first token",
    "logprob": "log-probability of the answer's first token",
    "rank": "rank of the answer's first token (1 = top)",
}
_TARGET_TITLES = {"parametric": "memorised answer", "context": "context answer"}


def _band(hex_colour: str) -> str:
    """``hex_colour`` as a translucent fill."""
    red, green, blue = (int(hex_colour.lstrip("#")[k : k + 2], 16) for k in (0, 2, 4))
    return f"rgba({red},{green},{blue},0.18)"


def plot_logit_lens(lens_result: LogitLens, *, value: str = "probability") -> go.Figure:
    """One line per conflict type over the layers (0 = the embedding, ``n_layers`` = the model's
    output), one panel per target, with the 95 % bootstrap interval over facts as a band;
    ``value`` ``"probability"`` (mean), ``"logprob"`` (mean) or ``"rank"`` (median, log axis)."""
    if not isinstance(lens_result, LogitLens):
        raise TypeError(
            f"plot_logit_lens takes the LogitLens that cp.logit_lens returns, got {type(lens_result).__name__}."
        )
    if value not in _VALUES:
        raise ValueError(f"value must be one of {list(_VALUES)}, got {value!r}.")
    summary = lens_result.summary.sort_values("layer", kind="stable")
    targets = list(dict.fromkeys(summary.target))
    types = order_conflict_types(summary.conflict_type)
    colours = color_map(types)
    fig = make_subplots(
        rows=1,
        cols=len(targets),
        shared_yaxes=True,
        horizontal_spacing=0.04,
        subplot_titles=[_TARGET_TITLES.get(t, t) for t in targets],
    )
    bands, lines = [], []
    for col, target in enumerate(targets, start=1):
        for conflict_type in types:
            part = summary[(summary.target == target) & (summary.conflict_type == conflict_type)]
            if part.empty:
                continue
            x = part.layer.to_numpy()
            low, high = part[f"{value}_low"].to_numpy(float), part[f"{value}_high"].to_numpy(float)
            colour = colours[conflict_type]
            group = {"legendgroup": conflict_type, "xaxis": f"x{'' if col == 1 else col}"}
            group["yaxis"] = f"y{'' if col == 1 else col}"
            bands.append(
                go.Scatter(
                    x=np.concatenate([x, x[::-1]]),
                    y=np.concatenate([high, low[::-1]]),
                    fill="toself",
                    fillcolor=_band(colour),
                    line={"width": 0},
                    hoverinfo="skip",
                    showlegend=False,
                    **group,
                )
            )
            lines.append(
                go.Scatter(
                    x=x,
                    y=part[value],
                    mode="lines+markers",
                    name=conflict_label(conflict_type),
                    line={"color": colour},
                    showlegend=col == 1,
                    customdata=np.stack([low, high, part.n], axis=1),
                    hovertemplate=(
                        f"{conflict_label(conflict_type)}, layer %{{x}}<br>{value} %{{y:.4g}} "
                        "[%{customdata[0]:.4g}, %{customdata[1]:.4g}]<br>n = %{customdata[2]}<extra></extra>"
                    ),
                    **group,
                )
            )
    fig.add_traces(bands + lines)  # bands below the lines
    fig.update_xaxes(title_text=f"layer ({lens_result.n_layers} = output)")
    fig.update_yaxes(title_text=_VALUES[value], col=1)
    if value == "rank":
        fig.update_yaxes(type="log", autorange="reversed")
    statistic = "median" if value == "rank" else "mean"
    return finish(
        fig,
        f"Logit lens: {statistic} {value} of each answer, layer by layer (95 % bootstrap intervals over facts)",
        width=max(500, 460 * len(targets)),
        height=440,
        legend_title="prompt",
    )
