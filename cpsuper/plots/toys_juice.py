"""Figure of the JuICE theory toy (:mod:`cpsuper.toys.juice_theory`): run once vs run twice."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

__all__ = ["plot_juice_theory"]

_METHODS = {
    "run_once": ("run once (JuNe / PH3)", "#ff7f0e"),
    "run_twice": ("run twice (JuICE)", "#1f77b4"),
}
_TASKS = {
    "conflict": "conflict prompts (induction cue + subject)",
    "recall": "recall-only prompts (no induction cue)",
    "induction": "induction-only prompts",
}


def plot_juice_theory(
    frame: pd.DataFrame, *, target: str = "parametric", tasks: tuple[str, ...] = ("conflict", "recall")
) -> go.Figure:
    """Probability of the ``target`` answer (solid) and the share of prompts where it is the top
    token (dotted) against the steering strength ``beta``: one row per task, one column per model
    (superposed, separate), one colour per method. ``frame`` is what
    :func:`~cpsuper.toys.juice_theory.theory_study` or :func:`~cpsuper.toys.juice_theory.steer`
    returned."""
    data = frame[(frame["target"] == target) & frame["task"].isin(tasks)]
    if data.empty:
        raise ValueError(f"No rows for target {target!r} and tasks {tasks}.")
    models = list(dict.fromkeys(data["model"]))
    rows = [t for t in tasks if t in set(data["task"])]
    titles = [f"{model}: {_TASKS.get(task, task)}" for task in rows for model in models]
    fig = make_subplots(
        rows=len(rows), cols=len(models), subplot_titles=titles, shared_xaxes=True, vertical_spacing=0.12
    )
    for r, task in enumerate(rows, start=1):
        for c, model in enumerate(models, start=1):
            panel = data[(data["task"] == task) & (data["model"] == model)]
            for method, (label, color) in _METHODS.items():
                line = panel[panel["method"] == method].sort_values("beta")
                if line.empty:
                    continue
                first = r == 1 and c == 1
                for column, dash, name in (("p", None, label), ("accuracy", "dot", f"{label}: accuracy")):
                    fig.add_trace(
                        go.Scatter(
                            x=line["beta"],
                            y=line[column],
                            mode="lines+markers",
                            name=name,
                            legendgroup=name,
                            showlegend=first,
                            line={"color": color, "dash": dash},
                            marker={"size": 5},
                            hovertemplate=f"{name}<br>beta %{{x}}<br>%{{y:.3f}}<extra></extra>",
                        ),
                        row=r,
                        col=c,
                    )
    fig.update_yaxes(range=[-0.03, 1.03])
    fig.update_xaxes(title_text="steering strength beta (run once: scale 1 + beta; run twice: add beta x clean)")
    fig.update_yaxes(title_text=f"p({target} answer) / accuracy", col=1)
    fig.update_layout(
        template="plotly_white",
        title="JuICE theory toy: steering the heads that carry the induction cue",
        width=1000,
        height=380 * len(rows) + 80,
        margin={"t": 90},
    )
    return fig
