"""Figures of weight-truncation sweeps (:func:`cpsuper.truncation.truncation_sweep`): candidate
probabilities against the kept rank fraction rho, and a layer x rho heatmap of a log ratio."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

from .heatmap import facet_heatmap
from .style import colored_by, finish, order_conflict_types, relabel_facets

if TYPE_CHECKING:
    from ..truncation import TruncationResult

__all__ = ["plot_truncation", "plot_truncation_heatmap"]


def _pick_conflict_type(frame: pd.DataFrame, conflict_type: str | None) -> pd.DataFrame:
    if conflict_type is None or "conflict_type" not in frame:
        return frame
    if conflict_type not in set(frame.conflict_type):
        raise ValueError(
            f"Conflict type {conflict_type!r} is not in this sweep; it has {sorted(set(frame.conflict_type))}."
        )
    return frame[frame.conflict_type == conflict_type]


def _types(frame: pd.DataFrame) -> list:
    return order_conflict_types(frame.conflict_type) if "conflict_type" in frame else [None]


def plot_truncation(
    result: TruncationResult,
    conflict_type: str | None = None,
    candidates: Sequence[str] | None = None,
    log_y: bool = False,
    wrap: int = 6,
    *,
    n_boot: int | None = None,
    ci: float = 0.95,
    seed: int = 0,
) -> go.Figure:
    """Mean candidate probability against rho, one line per candidate, one panel per layer.

    Dashed lines: the unedited model; a lone marker at rho = 0 labelled ``drop``: the MLP dropped.
    With several conflict types (and none chosen), one row of panels per conflict type. rho is
    shown as categories, so small fractions are not squeezed against 0. ``n_boot``: add error
    bars, the ``ci`` bootstrap interval over examples (:meth:`TruncationResult.intervals`).
    """
    summary = result.summary
    if n_boot is not None:
        bands = result.intervals("p", n_boot=n_boot, ci=ci, seed=seed)
        keys = [c for c in bands.columns if c in summary and c not in ("n",)]
        summary = summary.merge(bands[[*keys, "ci_low", "ci_high"]], on=keys, how="left")
        summary["err_plus"] = summary["ci_high"] - summary["p_mean"]
        summary["err_minus"] = summary["p_mean"] - summary["ci_low"]
    summary = _pick_conflict_type(summary, conflict_type)
    if candidates is not None:
        missing = sorted(set(candidates) - set(summary.candidate))
        if missing:
            raise ValueError(f"Candidates {missing} are not in this sweep; it has {sorted(set(summary.candidate))}.")
        summary = summary[summary.candidate.isin(candidates)]
    trunc = summary[summary.edit == "truncate"].sort_values("rho")
    rho_text = trunc["rho"].map(lambda r: f"{r:g}")
    order = list(dict.fromkeys(rho_text))
    parts = [
        trunc.assign(x=rho_text, y=trunc.p_mean, model="truncated"),
        trunc.assign(x=rho_text, y=trunc.p_clean_mean, model="unedited model"),
    ]
    dropped = summary[summary.edit == "drop"]
    if len(dropped):
        parts.append(dropped.assign(x=order[0], y=dropped.p_mean, model="MLP dropped"))
    frame = pd.concat(parts, ignore_index=True)
    error = {}
    if n_boot is not None:
        unedited = frame.model == "unedited model"  # its interval is not the setting's
        frame.loc[unedited, ["err_plus", "err_minus"]] = float("nan")
        error = {"error_y": "err_plus", "error_y_minus": "err_minus"}
    types = _types(frame)
    facet = {"facet_col": "layer"}
    if len(types) > 1:
        facet["facet_row"] = "conflict_type"
    else:
        facet["facet_col_wrap"] = min(wrap, frame.layer.nunique())
    fig = px.line(
        frame,
        x="x",
        y="y",
        **colored_by(frame, "candidate"),
        line_dash="model",
        symbol="model",
        markers=True,
        category_orders={
            "x": order,
            "conflict_type": [t for t in types if t is not None],
            "model": ["truncated", "unedited model", "MLP dropped"],
        },
        log_y=log_y,
        **facet,
        **error,
        labels={
            "x": "rho (fraction of rank kept)",
            "y": "probability",
            "layer": "layer",
        },
        hover_data={"rank": True, "n": True},
    )
    relabel_facets(fig, {str(layer): f"layer {layer}" for layer in frame.layer.unique()})
    matrix = ", ".join(dict.fromkeys(trunc.matrix)) if len(trunc) else "mlp"
    where = f" ({conflict_type})" if conflict_type else ""
    rows = len(types) if len(types) > 1 else math.ceil(frame.layer.nunique() / facet.get("facet_col_wrap", 1))
    return finish(
        fig,
        f"Candidate probability under rank truncation of {matrix}{where}",
        height=300 + 220 * (rows - 1),
    )


def plot_truncation_heatmap(
    result: TruncationResult,
    value: str = "log_ratio_of_means",
    relative: bool = False,
) -> go.Figure:
    """Layer x rho heatmap of ``log p(num) / p(den)`` (by default correct vs generic), one panel
    per conflict type. ``value``: ``"log_ratio_of_means"`` or ``"mean_log_ratio"``;
    ``relative=True`` subtracts the unedited model's value, so 0 means no change."""
    ratios = result.ratios
    if ratios is None or len(ratios) == 0:
        raise ValueError(
            "This sweep has no ratio: its candidates lack the ratio pair (by default 'correct' and 'generic')."
        )
    if value not in ("log_ratio_of_means", "mean_log_ratio"):
        raise ValueError(f"value must be 'log_ratio_of_means' or 'mean_log_ratio', got {value!r}.")
    num, den = ratios.attrs.get("ratio", ("correct", "generic"))
    trunc = ratios[ratios.edit == "truncate"].copy()
    trunc["z"] = trunc[value] - (trunc[f"{value}_clean"] if relative else 0)
    types = _types(trunc)
    what = f"log p({num}) / p({den})" + (" minus the unedited model's" if relative else "")
    return facet_heatmap(
        trunc,
        "z",
        x="rho",
        y="layer",
        col="conflict_type" if types != [None] else None,
        col_values=types,
        categorical_x=True,
        value_label="change" if relative else "log ratio",
        cell=(45, 22),
        title=f"{what} under rank truncation",
    )
