"""The head explorer in Jupyter: ipywidgets controls and plotly ``FigureWidget`` panels, linked
by clicks on the layer x head heatmap. Runs in the kernel; needs no other server.

Intervals (one vectorised bootstrap over the whole sweep) and span DLA are computed once; roles
once per scale; each head's panels and each attention view are computed when first asked for
and cached.
"""

from __future__ import annotations

import html

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from ..attribution import Attribution
from ..backend import Model
from ..data.examples import ConflictDataset
from ..plots.attention_view import attention_view
from ..plots.style import (
    CONFLICT_COLORS,
    DIVERGING,
    SPAN_COLORS,
    TARGET_COLORS,
    conflict_label,
    head_label,
    order_conflict_types,
    scale_phrase,
    symmetric_range,
)
from ..stats import sweep_intervals
from .data import (
    check_attribution,
    check_sweep,
    explorer_head,
    head_dla,
    head_effects,
    head_position_effects,
    span_sources,
    sweep_roles,
)

__all__ = ["HeadExplorer", "explore"]


def _text(value) -> str:
    """A dataset label as plotly text or HTML content: plotly reads a small subset of HTML in
    titles, ticks, legends and hovers, and the ``HTML`` widgets read all of it. Labels come from
    shared datasets, so they are escaped and always show as the literal text."""
    return html.escape(str(value), quote=False)


def _widgets():
    try:
        import ipywidgets

        go.FigureWidget()  # plotly's FigureWidget needs anywidget
    except ImportError as err:
        raise ImportError(
            f"The Jupyter head explorer needs ipywidgets and anywidget ({err}); install them with "
            "`pip install 'cpsuper[explore]'` (or `pip install ipywidgets anywidget`). "
            "cp.write_explorer_page writes the static version without them."
        ) from None
    return ipywidgets


class HeadExplorer:
    """State and widgets of one explorer. ``widget`` is the VBox to display; :meth:`select`
    is what a click on the heatmap calls."""

    def __init__(
        self,
        model: Model,
        dataset: ConflictDataset,
        sweep,
        attribution: Attribution | None = None,
        *,
        direction: str | None = None,
        head: tuple[int, int] | None = None,
        n_boot: int = 1000,
        ci: float = 0.95,
        seed: int = 0,
    ):
        w = _widgets()
        self.model, self.dataset = model, dataset
        self.per = check_sweep(model, dataset, sweep)
        self.intervals = sweep_intervals(self.per, n_boot=n_boot, ci=ci, seed=seed)
        self.ci, self._boot = ci, {"n_boot": n_boot, "ci": ci, "seed": seed}
        self.spans = None
        if attribution is not None:
            self.spans = span_sources(check_attribution(model, attribution), direction=direction)
        self._roles: dict[float, tuple[pd.DataFrame | None, str]] = {}
        self._heads: dict[tuple, tuple[pd.DataFrame, pd.DataFrame | None]] = {}
        self._views: dict[tuple, object] = {}
        self._positions: dict[tuple, pd.DataFrame] = {}
        self.view = None
        types = order_conflict_types(self.per["conflict_type"])
        alphas = sorted(float(a) for a in self.per["alpha"].unique())
        self.target = w.Dropdown(options=list(dict.fromkeys(self.per["target"])), description="target")
        self.conflict_type = w.Dropdown(options=[(conflict_label(c), c) for c in types], description="conflict")
        self.alpha = w.Dropdown(options=[(scale_phrase(a), a) for a in alphas], description="scale")
        examples = sorted(int(i) for i in self.per["example"].unique())
        self.example = w.Dropdown(options=[(f"{i}: {dataset[i].subject}", i) for i in examples], description="example")
        self.title = w.HTML()
        self.roles = w.HTML()
        self.attention = w.Output(layout={"border": "1px solid #ddd"})
        self.heatmap = go.FigureWidget(
            data=[
                go.Heatmap(colorscale=DIVERGING, zmid=0, colorbar={"title": "Δ"}),
                go.Scatter(
                    mode="markers",
                    marker={"symbol": "square-open", "size": 18, "color": "black"},
                    hoverinfo="skip",
                ),
            ],
            layout={"height": 420, "width": 520, "template": "plotly_white", "showlegend": False,
                    "xaxis": {"title": "head", "dtick": 1}, "yaxis": {"title": "layer", "dtick": 1},
                    "margin": {"t": 50, "l": 60, "r": 20, "b": 50}},
        )  # fmt: skip
        self.heatmap.data[0].on_click(self._on_click)
        self.effects = go.FigureWidget(layout=_panel_layout("effect of the head", "Δ " + self._metric()))
        self.dla = go.FigureWidget(layout=_panel_layout("source-token DLA by span", "DLA"))
        self.positions = go.FigureWidget(layout=_panel_layout("effect per prompt position", "Δ p"))
        self.positions.layout.update(
            width=1040, height=380, barmode="relative", margin={"t": 80}, xaxis={"tickangle": -60, "automargin": True}
        )
        for dropdown in (self.target, self.conflict_type, self.alpha):
            dropdown.observe(lambda _change: self._refresh(), names="value")
        self.example.observe(lambda _change: self._show_example(), names="value")
        controls = w.HBox([self.target, self.conflict_type, self.alpha, self.example])
        right = w.VBox([self.title, self.effects, self.dla])
        self.widget = w.VBox(
            [controls, w.HBox([self.heatmap, right]), self.positions, w.HBox([self.attention, self.roles])]
        )
        self.widget.explorer = self
        self.head = explorer_head(model, *head) if head is not None else self._strongest()
        self._refresh()

    def _metric(self) -> str:
        return str(self.per.attrs.get("metric", "probability"))

    def _grid(self) -> pd.DataFrame:
        rows = self.intervals
        rows = rows[
            np.isclose(rows["alpha"].to_numpy(dtype=float), self.alpha.value)
            & (rows["target"] == self.target.value)
            & (rows["conflict_type"] == self.conflict_type.value)
        ]
        return rows

    def _strongest(self) -> tuple[int, int]:
        rows = self._grid()
        best = rows.loc[rows["mean"].abs().idxmax()]
        return int(best["layer"]), int(best["head"])

    def _on_click(self, trace, points, state) -> None:
        if points.point_inds:
            self.select(int(points.ys[0]), int(points.xs[0]))

    def head_panels(self, layer: int, head: int) -> tuple[pd.DataFrame, pd.DataFrame | None]:
        """The selected scale's effects and the span DLA of one head (cached)."""
        key = (layer, head, self.alpha.value)
        if key not in self._heads:
            effects = head_effects(self.intervals, layer, head, self.alpha.value)
            dla = head_dla(self.spans, layer, head) if self.spans is not None else None
            self._heads[key] = (effects, dla)
        return self._heads[key]

    def head_roles(self) -> tuple[pd.DataFrame | None, str]:
        """:func:`cpsuper.roles.head_roles` at the selected scale (cached per scale)."""
        alpha = self.alpha.value
        if alpha not in self._roles:
            self._roles[alpha] = sweep_roles(self.per, alpha, **self._boot)
        return self._roles[alpha]

    def select(self, layer: int, head: int) -> None:
        """Show head ``(layer, head)`` in every panel (a ValueError for a head outside the model)."""
        self.head = explorer_head(self.model, layer, head)
        self._show_head()

    def _refresh(self) -> None:
        rows = self._grid()
        L, H = self.model.cfg.n_layers, self.model.cfg.n_heads
        grids = {c: np.full((L, H), np.nan) for c in ("mean", "ci_low", "ci_high", "n")}
        for c, grid in grids.items():
            grid[rows["layer"].to_numpy(int), rows["head"].to_numpy(int)] = rows[c].to_numpy(float)
        limit = symmetric_range(grids["mean"])[1]
        with self.heatmap.batch_update():
            self.heatmap.data[0].update(
                z=grids["mean"],
                x=list(range(H)),
                y=list(range(L)),
                zmin=-limit,
                zmax=limit,
                customdata=np.dstack([grids["ci_low"], grids["ci_high"], grids["n"]]),
                hovertemplate=(
                    "L%{y}H%{x}<br>Δ %{z:.4f}<br>"
                    f"{self.ci:.0%} CI [%{{customdata[0]:.4f}}, %{{customdata[1]:.4f}}]"
                    "<br>n = %{customdata[2]}<extra></extra>"
                ),
            )
            self.heatmap.layout.title = (
                f"p({_text(self.target.value)}), {_text(conflict_label(self.conflict_type.value))}, "
                f"head {scale_phrase(self.alpha.value)}"
            )
        self._show_head()

    def _show_head(self) -> None:
        layer, head = self.head
        self.heatmap.data[1].update(x=[head], y=[layer])
        effects, dla = self.head_panels(layer, head)
        label = head_label(layer, head)
        self.title.value = f"<h3>{label}: {scale_phrase(self.alpha.value)}</h3>"
        with self.effects.batch_update():
            self.effects.data = []
            for target in dict.fromkeys(effects["target"]):
                part = effects[effects["target"] == target]
                self.effects.add_bar(
                    x=[_text(conflict_label(c)) for c in part["conflict_type"]],
                    y=part["mean"],
                    name=f"p({_text(target)})",
                    marker_color=TARGET_COLORS.get(target),
                    error_y={
                        "type": "data",
                        "symmetric": False,
                        "array": part["ci_high"] - part["mean"],
                        "arrayminus": part["mean"] - part["ci_low"],
                    },
                    customdata=part["n"],
                    hovertemplate="%{x}: Δ %{y:.4f}, n = %{customdata}",  # the trace's name shows beside it
                )
            self.effects.layout.title = f"{label}: effect per conflict type ({self.ci:.0%} bootstrap CI)"
        with self.dla.batch_update():
            self.dla.data = []
            if dla is None:
                self.dla.layout.title = "source-token DLA: pass attribution=cp.direct_logit_attribution(...)"
            else:
                for c in order_conflict_types(dla["conflict_type"]):
                    part = dla[dla["conflict_type"] == c]
                    self.dla.add_bar(
                        x=part["span"].astype(str),
                        y=part["dla"],
                        name=_text(conflict_label(c)),
                        marker_color=CONFLICT_COLORS.get(c),
                        customdata=part["attention"],
                        hovertemplate="%{x}: DLA %{y:.4f}, attention %{customdata:.3f}<extra></extra>",
                    )
                self.dla.layout.title = f"{label}: DLA ({_text(self.spans.attrs['direction'])}) by prompt span"
        self.roles.value = self._roles_html(layer, head)
        self._show_example()

    def _show_example(self) -> None:
        self._show_positions()
        self._show_attention()

    def head_positions(self, layer: int, head: int) -> pd.DataFrame | None:
        """The selected example's per-position effect of one head
        (:func:`cpsuper.explore.data.head_position_effects`; cached), or None on a clean prompt."""
        key = (layer, head, self.example.value, self.conflict_type.value, self.target.value)
        if self.conflict_type.value == "clean" or self.conflict_type.value not in self.dataset[key[2]].prompts:
            return None
        if key not in self._positions:
            example, conflict_type, target = key[2:]
            self._positions[key] = head_position_effects(
                self.model, self.dataset, (layer, head), example=example, conflict_type=conflict_type, target=target
            )
        return self._positions[key]

    def _show_positions(self) -> None:
        layer, head = self.head
        frame = self.head_positions(layer, head)
        with self.positions.batch_update():
            self.positions.data = []
            if frame is None:
                self.positions.layout.title = (
                    "effect per prompt position: pick a conflict type (a clean prompt has none)"
                )
                return
            labels = [f"{p} {_text(t)}" for p, t in zip(frame["position"], frame["token"])]
            for span in dict.fromkeys(frame["span"]):
                part = frame["span"] == span
                self.positions.add_bar(
                    x=[label for label, keep in zip(labels, part) if keep],
                    y=frame.loc[part, "delta"],
                    name=_text(span),
                    marker_color=SPAN_COLORS.get(span),
                    hovertemplate="%{x}: Δ %{y:.4g}<extra>%{fullData.name}</extra>",
                )
            self.positions.layout.xaxis.update(categoryorder="array", categoryarray=labels)
            self.positions.layout.title = (
                f"{head_label(layer, head)}: Δ p({_text(self.target.value)}), example {self.example.value} <br>"
                f"<sup>its output at one position at a time taken from the {frame['source'].iloc[0]} prompt</sup>"
            )

    def _roles_html(self, layer: int, head: int) -> str:
        table, note = self.head_roles()
        if table is None:
            return f"<p><b>Role</b>: not available ({_text(note)})</p>"
        rows = table[(table["layer"] == layer) & (table["head"] == head)]
        cells = "".join(
            f"<tr><td>{_text(conflict_label(r.conflict_type))}</td><td><b>{_text(r.role)}</b></td>"
            f"<td>{r.parametric_mean:+.4f}</td><td>{r.context_mean:+.4f}</td><td>{r.n}</td></tr>"
            for r in rows.itertuples()
        )
        head_text = "<tr><th>conflict</th><th>role</th><th>Δp(param.)</th><th>Δp(context)</th><th>n</th></tr>"
        return f"<p><b>{head_label(layer, head)}: role per conflict type</b></p><table>{head_text}{cells}</table>"

    def _show_attention(self) -> None:
        # The Output widget's outputs are set directly (append_display_data), not captured with
        # ``with output: display(...)``: capturing re-parents messages to the running cell, which
        # headless clients (nbclient) can wait on until their cell timeout.
        from IPython.display import HTML

        layer, head = self.head
        i, c = self.example.value, self.conflict_type.value
        key = (layer, head, i, c)
        self.attention.outputs = ()
        prompt = self.dataset[i].prompts.get(c)
        if prompt is None:
            self.attention.append_display_data(HTML(f"<p>Example {i} has no {_text(c)} prompt.</p>"))
            return
        if key not in self._views:
            self._views[key] = attention_view(self.model, prompt, [(layer, head)])
        self.view = self._views[key]  # the circuitsvis view on show
        label = f"<p><b>{head_label(layer, head)}</b> attention, example {i} ({_text(conflict_label(c))})</p>"
        self.attention.append_display_data(HTML(label))
        self.attention.append_display_data(self._views[key])


def _panel_layout(title: str, y_title: str) -> dict:
    return {
        "title": title,
        "height": 260,
        "width": 520,
        "template": "plotly_white",
        "barmode": "group",
        "yaxis": {"title": y_title, "zeroline": True},
        "margin": {"t": 50, "l": 60, "r": 20, "b": 40},
    }


def explore(model: Model, dataset: ConflictDataset, *, sweep, **options):
    """The linked head explorer for Jupyter (an ipywidgets ``VBox``; display it or make it a
    cell's last expression).

    ``sweep`` is a :func:`cpsuper.head_sweep` result of this ``model`` on this ``dataset``.
    ``options`` are :class:`HeadExplorer`'s: ``attribution`` (a
    :func:`cpsuper.direct_logit_attribution` result, read along ``direction``, default
    "parametric-context" when present), ``head`` (the first head shown; default the largest
    effect), ``n_boot``, ``ci``, ``seed`` (bootstrap intervals). Dropdowns choose the target,
    conflict type, scale and example; clicking a heatmap cell selects a head. The explorer object
    is ``widget.explorer``.
    """
    return HeadExplorer(model, dataset, sweep, **options).widget
