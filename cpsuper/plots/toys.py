"""Figures of the toy models' training runs (:mod:`cpsuper.toys`).

Each function takes a run (or its tidy probe table) and returns a ``plotly.graph_objects.Figure``:

- :func:`plot_noisy_recall`: noisy in-context recall, four panels over training;
- :func:`plot_associative_memory`: a probe of the associative memory per truncation rank;
- :func:`plot_inversion`: context reliance and attention rising then falling during finetuning;
- :func:`plot_finetuning`: held-out accuracy after finetuning on well-known vs less-known facts.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..toys.associative_memory import AssocMemoryRun, summarize_memory
from ..toys.noisy_recall import NoisyRecallRun, trajectory

__all__ = ["plot_associative_memory", "plot_finetuning", "plot_inversion", "plot_noisy_recall"]


# ---------------------------------------------------------------------------------------------
# Truncation toys

_RECALL_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"]


def plot_noisy_recall(run: NoisyRecallRun | pd.DataFrame, log_x: bool = True) -> go.Figure:
    """Trajectory of a noisy-recall run in four panels: p(noise) and p(ybar) on noisy test data;
    p(ybar) (solid) and p(noise) (dotted) on clean data for the full model, the dropped MLP
    and each truncation; layer-2 attention to earlier correct vs noise outputs and layer-1
    previous-token attention; the second MLP's direct logit toward noise and toward ``ybar``.

    With ``log_x`` the step axis is logarithmic (step 0 is then not drawn), which shows the
    early noise phase and the later induction phase on one axis.
    """
    probes = run.probes if isinstance(run, NoisyRecallRun) else run
    fig = make_subplots(
        rows=2,
        cols=2,
        horizontal_spacing=0.08,
        vertical_spacing=0.14,
        subplot_titles=[
            "noisy test data, full model",
            "clean test data: full vs layer-2 MLP dropped / truncated",
            "attention",
            "layer-2 MLP direct logit (recall positions, clean data)",
        ],
    )

    def line(data, measure, condition, name, color, row, col, dash=None, legend=True):
        s = trajectory(probes, data, measure, condition)
        fig.add_trace(
            go.Scatter(
                x=s.index,
                y=s.values,
                mode="lines+markers",
                name=name,
                legendgroup=name,
                line={"color": color, "dash": dash},
                marker={"size": 4},
                showlegend=legend,
                hovertemplate=f"{name}<br>step %{{x}}<br>%{{y:.4f}}<extra></extra>",
            ),
            row=row,
            col=col,
        )

    line("noisy", "p_noise", "full", "p(noise), noisy data", _RECALL_COLORS[1], 1, 1)
    line("noisy", "p_correct", "full", "p(ybar), noisy data", _RECALL_COLORS[0], 1, 1)
    clean = probes[probes.data == "clean"]
    conditions = clean.sort_values("rho", ascending=False).condition.unique()
    for i, condition in enumerate(conditions):
        color = _RECALL_COLORS[(i + 2) % len(_RECALL_COLORS)] if condition != "full" else "#000000"
        line("clean", "p_correct", condition, f"p(ybar), clean, {condition}", color, 1, 2)
        line("clean", "p_noise", condition, f"p(noise), clean, {condition}", color, 1, 2, dash="dot")
    line("noisy", "attn2_to_correct", "full", "layer-2 attn to earlier ybar", _RECALL_COLORS[0], 2, 1)
    line("noisy", "attn2_to_noise", "full", "layer-2 attn to earlier noise", _RECALL_COLORS[1], 2, 1)
    line("noisy", "attn1_prev", "full", "layer-1 attn to previous token", "#7f7f7f", 2, 1, dash="dash")
    line("clean", "mlp2_noise_logit", "full", "MLP2 logit: noise", _RECALL_COLORS[1], 2, 2)
    line("clean", "mlp2_correct_logit", "full", "MLP2 logit: ybar", _RECALL_COLORS[0], 2, 2)
    for row in (1, 2):
        for col in (1, 2):
            fig.update_xaxes(title_text="training step", type="log" if log_x else "linear", row=row, col=col)
    fig.update_yaxes(title_text="probability", row=1, col=1)
    fig.update_yaxes(title_text="probability", row=1, col=2)
    fig.update_yaxes(title_text="mean attention weight", row=2, col=1)
    fig.update_yaxes(title_text="logit (vs mean direction)", row=2, col=2)
    alpha = run.config.alpha if isinstance(run, NoisyRecallRun) else None
    if alpha is not None:
        fig.add_hline(y=alpha, line={"color": "gray", "dash": "dot", "width": 1}, row=1, col=1)
    fig.update_layout(height=700, width=1150, title="Noisy in-context recall: training trajectory")
    return fig


_RANK_COLORS = {
    "rank 1": "#9467bd",
    "rank 2": "#2ca02c",
    "rank 3": "#ff7f0e",
    "rank 4": "#8c564b",
    "full": "#000000",
}


def plot_associative_memory(
    run: AssocMemoryRun | pd.DataFrame, measure: str = "pure_loss", log_y: bool = True
) -> go.Figure:
    """A probe against training step for the full ``W`` and each truncation: median over seeds
    with a 25-75 % band (the paper's Figure 6 for ``measure="pure_loss"``)."""
    summary = summarize_memory(run, measure)
    fig = go.Figure()
    for model in sorted(summary.model.unique(), key=lambda m: (m == "full", m)):
        rows = summary[summary.model == model].sort_values("step")
        color = _RANK_COLORS.get(model, "#7f7f7f")
        fig.add_trace(
            go.Scatter(
                x=np.concatenate([rows.step, rows.step[::-1]]),
                y=np.concatenate([rows.q75, rows.q25[::-1]]),
                fill="toself",
                fillcolor=color,
                opacity=0.15,
                line={"width": 0},
                hoverinfo="skip",
                showlegend=False,
                legendgroup=model,
            )
        )
        fig.add_trace(
            go.Scatter(
                x=rows.step,
                y=rows["median"],
                mode="lines",
                name=model,
                legendgroup=model,
                line={"color": color, "dash": "dash" if model == "full" else None},
                hovertemplate=f"{model}<br>step %{{x}}<br>median %{{y:.4f}}<extra></extra>",
            )
        )
    cfg = run.config if isinstance(run, AssocMemoryRun) else None
    title = f"Associative memory: {measure} by truncation rank (median and 25-75 % over seeds)"
    if cfg is not None:
        title += f"<br><sup>n = {cfg.n_inputs}, d = {cfg.d}, alpha = {cfg.alpha}, {cfg.n_seeds} seeds</sup>"
    fig.update_layout(
        title=title,
        xaxis_title="gradient step",
        yaxis_title=measure,
        yaxis_type="log" if log_y else "linear",
        width=850,
        height=500,
    )
    return fig


# ---------------------------------------------------------------------------------------------
# Training-dynamics toys


def plot_inversion(probes: pd.DataFrame) -> go.Figure:
    """Context reliance and attention on counterfactual prompts (top) and training loss per example
    kind (bottom) over finetuning steps; one line style per run (e.g. with and without C+S)."""
    measures = {
        "M_C": (1, "M_C = p(ctx)/(p(ctx)+p(param))", "#d62728"),
        "attn_context": (1, "attention to context", "#1f77b4"),
        "attn_subject": (1, "attention to subject", "#ff7f0e"),
        "loss_C": (2, "loss on C", "#1f77b4"),
        "loss_C+S": (2, "loss on C+S", "#2ca02c"),
    }
    dashes = ["solid", "dash", "dot", "dashdot"]
    lines = [
        (run, measure, row, f"{label} ({run})", color, dashes[i % len(dashes)])
        for i, run in enumerate(dict.fromkeys(probes["run"]))
        for measure, (row, label, color) in measures.items()
    ]
    fig = _stacked_lines(
        probes,
        lines,
        ("Counterfactual test prompts", "Training loss by example kind"),
        ("probability / attention", "cross-entropy"),
    )
    fig.update_yaxes(range=[0, 1], row=1, col=1)
    fig.update_layout(title="Context-parametric inversion in a one-layer toy")
    return fig


def plot_finetuning(probes: pd.DataFrame) -> go.Figure:
    """Held-out QA accuracy (top) and attention to the subject on held-out prompts (bottom) over
    finetuning steps, one colour per finetuning split; dotted: facts stored in pretraining format."""
    palette = {"FT-Top": "#1f77b4", "FT-Bottom": "#d62728", "FT-Random": "#17becf", "FT-Whole": "#2ca02c"}
    measures = {
        "acc_eval": (1, "solid", "QA accuracy"),
        "stored_eval": (1, "dot", "stored (s, r) accuracy"),
        "attn_subject_eval": (2, "solid", "attention to subject"),
    }
    lines = [
        (run, measure, row, f"{run}: {label}", palette.get(run, "#7f7f7f"), dash)
        for run in dict.fromkeys(probes.loc[probes["run"] != "pretrain", "run"])
        for measure, (row, dash, label) in measures.items()
    ]
    titles = ("Held-out subjects: QA accuracy", "Held-out subjects: attention to the subject")
    fig = _stacked_lines(probes, lines, titles, ("accuracy", "attention"))
    fig.update_yaxes(range=[0, 1])
    fig.update_layout(title="QA finetuning on well-known vs less-known facts (one-layer toy)")
    return fig


def _stacked_lines(
    probes: pd.DataFrame,
    lines: list[tuple[str, str, int, str, str, str]],
    titles: tuple[str, str],
    y_titles: tuple[str, str],
) -> go.Figure:
    """Two panels over finetuning steps sharing the x axis; one trace per ``(run, measure, row,
    name, color, dash)`` in ``lines`` (skipped where the probes hold no such rows)."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08, subplot_titles=titles)
    for run, measure, row, name, color, dash in lines:
        d = probes[(probes["run"] == run) & (probes["measure"] == measure)].sort_values("step")
        if d.empty:
            continue
        line = {"color": color, "dash": dash}
        fig.add_trace(go.Scatter(x=d["step"], y=d["value"], mode="lines", name=name, line=line), row=row, col=1)
    for row, y_title in enumerate(y_titles, start=1):
        fig.update_yaxes(title_text=y_title, row=row, col=1)
    fig.update_xaxes(title_text="finetuning step (full batch)", row=2, col=1)
    fig.update_layout(height=650)
    return fig
