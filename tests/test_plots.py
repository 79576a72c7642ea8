"""cpsuper.plots on small hand-built frames: every figure builds, colours and heatmap cells mean
what they say, axes fit the data, old import paths warn, and analyses import no plotly."""

import ast
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest

import cpsuper
from cpsuper import plots
from cpsuper.plots.heatmap import facet_heatmap
from cpsuper.plots.style import CONFLICT_COLORS, symmetric_range

TYPES = ["clean", "substitution", "coherent"]
RNG = np.random.default_rng(0)


def _head_summary(n_layers=3, n_heads=4, alphas=(0.0,)):
    rows = [
        {
            "layer": l,
            "head": h,
            "alpha": a,
            "conflict_type": c,
            "target": t,
            "delta_mean": RNG.normal(0, 0.1),
            "delta_std": RNG.uniform(0, 0.05),
            "n": 5,
            "p": 0.3,
            "p_clean": 0.3,
        }
        for l in range(n_layers)
        for h in range(n_heads)
        for a in alphas
        for c in TYPES
        for t in ("parametric", "context")
    ]
    return pd.DataFrame(rows)


def _knockouts():
    rows = [
        {
            "layer": l,
            "module": m,
            "conflict_type": c,
            "target": "parametric",
            "delta_mean": RNG.normal(0, 0.1),
            "delta_std": 0.02,
            "n": 4,
            "p_clean": 0.5,
            "p": 0.45,
        }
        for l in range(3)
        for m in ("attn", "mlp")
        for c in TYPES
    ]
    return pd.DataFrame(rows)


def _superposition(x_scale=0.4, y_scale=0.05):
    x = np.array([1.0, -0.5, 0.25, -1.0]) * x_scale
    y = np.array([-0.6, -1.0, 0.3, 0.8]) * y_scale
    return pd.DataFrame(
        {
            "layer": [0, 0, 1, 1],
            "head": [0, 1, 0, 1],
            "delta_substitution": x,
            "delta_coherent": y,
            "superposed": np.sign(x) != np.sign(y),
            "target": "parametric",
            "alpha": 0.0,
        }
    )


def _run_once_vs_twice():
    return pd.DataFrame(
        [
            {
                "k": k,
                "method": m,
                "p": 0.4 + 0.05 * k,
                "delta_std": 0.01,
                "heads": "L0H1",
                "delta_mean": 0.1,
                "n": 3,
                "p_clean": 0.4,
                "target": "parametric",
            }
            for k in (1, 2)
            for m in ("run once", "run twice")
        ]
    )


def _attribution():
    sources = pd.DataFrame(
        [
            {
                "direction": "parametric",
                "conflict_type": c,
                "layer": l,
                "head": h,
                "group": g,
                "dla": RNG.normal(),
                "attention": RNG.uniform(),
            }
            for c in TYPES
            for l in range(2)
            for h in range(3)
            for g in ("subject", "relation", "other")
        ]
    )
    by_layer = pd.DataFrame(
        [
            {
                "direction": d,
                "conflict_type": c,
                "label": f"L{l}",
                "dla": 0.1,
                "cumulative": 0.1 * l,
            }
            for d in ("parametric", "context")
            for c in TYPES
            for l in range(3)
        ]
    )
    return SimpleNamespace(head_sources=lambda: sources, by_layer=lambda: by_layer)


def _categories():
    return pd.DataFrame(
        {
            "layer": [0, 1],
            "head": [1, 2],
            "subject_dla": [0.5, 0.1],
            "relation_dla": [0.1, 0.4],
            "category": ["subject", "relation"],
            "dla": [0.6, 0.5],
            "subject_share": [0.8, 0.2],
            "relation_share": [0.2, 0.8],
            "attention_subject": [0.5, 0.1],
            "attention_relation": [0.1, 0.5],
        }
    )


def _mechanisms():
    rows = [
        {"conflict_type": c, "candidate": k, "mechanism": m, "dla": 0.2}
        for c in TYPES
        for k in ("correct", "context")
        for m in ("subject", "relation")
    ]
    rows += [
        {"conflict_type": c, "candidate": k, "mechanism": "sum", "dla": 0.4}
        for c in TYPES
        for k in ("correct", "context")
    ]
    return pd.DataFrame(rows)


def _attention():
    by_head = pd.DataFrame(
        [
            {"conflict_type": c, "layer": l, "head": h, "attention": RNG.uniform()}
            for c in TYPES
            for l in range(3)
            for h in range(2)
        ]
    )
    by_layer = by_head.groupby(["conflict_type", "layer"], as_index=False).attention.mean()
    by_layer = by_layer.assign(sem=0.01, ci_low=by_layer.attention - 0.02, ci_high=by_layer.attention + 0.01)
    return SimpleNamespace(by_head=lambda: by_head, by_layer=lambda: by_layer, span="subject", reduce="sum")


def _truncation():
    summary = pd.DataFrame(
        [
            {
                "edit": "truncate",
                "matrix": "mlp_in",
                "layer": l,
                "rho": r,
                "rank": 2,
                "n": 2,
                "conflict_type": c,
                "candidate": k,
                "p_mean": 0.2,
                "p_clean_mean": 0.3,
            }
            for l in (0, 1)
            for r in (0.0, 0.5, 1.0)
            for c in TYPES
            for k in ("correct", "generic")
        ]
    )
    ratios = (
        summary[summary.candidate == "correct"]
        .drop(columns=["candidate", "p_mean", "p_clean_mean"])
        .assign(log_ratio_of_means=lambda f: f.layer + f.rho, log_ratio_of_means_clean=1.0)
    )
    ratios.attrs["ratio"] = ("correct", "generic")
    return SimpleNamespace(summary=summary, ratios=ratios)


def _beta_grid():
    return pd.DataFrame(
        [
            {
                "beta_plus": bp,
                "beta_minus": bm,
                "conflict_type": c,
                "accuracy": RNG.uniform(),
            }
            for bp in (0.0, 2.0)
            for bm in (0.0, -1.0, -2.0)
            for c in TYPES
        ]
    )


def _trajectory():
    return pd.DataFrame(
        [
            {
                "checkpoint": s,
                "order": i,
                "measure": "m",
                "quantity": q,
                "value": 0.1 * i,
            }
            for i, s in enumerate((0, 10, 20))
            for q in ("M_C", "attention_context")
        ]
    )


def _roles():
    roles = ["memory", "context", "mixed", "negligible"]
    return pd.DataFrame(
        [
            {
                "layer": l,
                "head": h,
                "conflict_type": c,
                "role": roles[(l + h + k) % 4],
                **{
                    f"{t}_{s}": v
                    for t in ("parametric", "context")
                    for s, v in (("mean", 0.1), ("ci_low", 0.0), ("ci_high", 0.2))
                },
                "n": 4,
                "alpha": 0.0,
            }
            for k, c in enumerate(("clean", "substitution", "coherent"))
            for l in range(3)
            for h in range(4)
        ]
    )


def test_head_roles_grid_colours_each_cell_by_its_role():
    frame = _roles()
    fig = plots.plot_head_roles(frame)
    assert len(fig.data) == 3 and [a.text for a in fig.layout.annotations] == [
        "clean",
        "substitution conflict",
        "coherent conflict",
    ]
    order = ["memory", "context", "mixed", "negligible"]
    coherent = frame[frame.conflict_type == "coherent"]
    for row in coherent.itertuples():
        assert fig.data[2].z[row.layer][row.head] == order.index(row.role)
        assert fig.data[2].text[row.layer][row.head].startswith(f"L{row.layer}H{row.head}: {row.role}")
    assert "0.100 [0.000, 0.200]" in fig.data[0].text[0][0]
    with pytest.raises(ValueError, match="lacks the columns"):
        plots.plot_head_roles(frame.drop(columns="role"))


def _method_results():
    rng = np.random.default_rng(0)
    return pd.DataFrame(
        [
            {"method": m, "relation": "capital", "example": i, "conflict_type": c, "correct": float(rng.random() < 0.5)}
            for m in ("Original", "JuICE")
            for i in range(6)
            for c in ("clean", "substitution", "coherent")
        ]
    )


def _lens():
    from cpsuper.lens import LogitLens, lens_summary

    rows = [
        {
            "example": i,
            "subject": f"s{i}",
            "relation": "capital",
            "conflict_type": c,
            "target": t,
            "layer": l,
            "logit": 0.0,
            "logprob": float(np.log(p)),
            "probability": p,
            "rank": int(RNG.integers(1, 50)),
        }
        for i in range(4)
        for c in TYPES
        for t in ("parametric", "context")
        for l in range(4)
        for p in [float(RNG.uniform(0.01, 0.9))]
    ]
    per = pd.DataFrame(rows)
    return LogitLens(per, lens_summary(per, n_boot=100), n_layers=3)


# Drawn in their own tests, from results that need a model run: the toys' figures
# (tests/test_toys_*.py), plot_additivity (tests/test_additivity.py), plot_selection_variance
# (tests/test_variance.py), plot_causal_trace (tests/test_tracing.py), plot_attribution_patching and
# plot_attribution_vs_exact (tests/test_attribution_patching.py), plot_head_paths (tests/test_head_paths.py).
TOY_FIGURE_MODULES = {"cpsuper.plots.toys", "cpsuper.plots.toys_juice", "cpsuper.plots.toys_truncation"}
DRAWN_ELSEWHERE = {
    "plot_additivity",
    "plot_selection_variance",
    "plot_causal_trace",
    "plot_attribution_patching",
    "plot_attribution_vs_exact",
    "plot_head_paths",
}


FIGURES = {
    "plot_attention_by_layer": lambda: plots.plot_attention_by_layer(_attention()),
    "plot_attention_heatmap": lambda: plots.plot_attention_heatmap(_attention()),
    "plot_beta_grid": lambda: plots.plot_beta_grid(_beta_grid()),
    "plot_head_categories": lambda: plots.plot_head_categories(_categories()),
    "plot_head_dla": lambda: plots.plot_head_dla(_attribution()),
    "plot_head_heatmap": lambda: plots.plot_head_heatmap(_head_summary()),
    "plot_head_roles": lambda: plots.plot_head_roles(_roles()),
    "plot_head_sources": lambda: plots.plot_head_sources(_attribution(), top_k=3),
    "plot_knockouts": lambda: plots.plot_knockouts(_knockouts()),
    "plot_cumulative_dla": lambda: plots.plot_cumulative_dla(_attribution()),
    "plot_logit_lens": lambda: plots.plot_logit_lens(_lens()),
    "plot_methods": lambda: plots.plot_methods(_method_results(), n_boot=200),
    "plot_mechanisms": lambda: plots.plot_mechanisms(_mechanisms()),
    "plot_robustness": lambda: plots.plot_robustness(_beta_grid().rename(columns={"beta_plus": "k"}), "k"),
    "plot_run_once_vs_twice": lambda: plots.plot_run_once_vs_twice(_run_once_vs_twice()),
    "plot_superposition": lambda: plots.plot_superposition(_superposition()),
    "plot_trajectory": lambda: plots.plot_trajectory(_trajectory()),
    "plot_truncation": lambda: plots.plot_truncation(_truncation()),
    "plot_truncation_heatmap": lambda: plots.plot_truncation_heatmap(_truncation()),
}


def test_every_public_plot_function_is_covered_here():
    # the toys' figures need trained runs (tests/test_toys_*.py draw them); attention_view is circuitsvis
    analyses = {
        n
        for n in plots.__all__
        if n.startswith("plot_") and getattr(plots, n).__module__ not in TOY_FIGURE_MODULES and n not in DRAWN_ELSEWHERE
    }
    assert set(FIGURES) == analyses


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_every_plot_function_returns_a_titled_figure(name):
    fig = FIGURES[name]()
    assert isinstance(fig, go.Figure) and fig.data
    assert fig.layout.title.text and fig.layout.template.layout.paper_bgcolor == "white"


def _colours(fig):
    out = {}
    for trace in fig.data:
        colour = trace.line.color if trace.mode and "lines" in trace.mode else trace.marker.color
        out[trace.name] = colour
    return out


def test_conflict_types_have_one_colour_in_every_figure():
    by_layer = _colours(FIGURES["plot_attention_by_layer"]())
    accuracy = _colours(FIGURES["plot_robustness"]())
    assert by_layer == accuracy == CONFLICT_COLORS
    assert len(set(CONFLICT_COLORS.values())) == len(CONFLICT_COLORS)


def test_superposition_axes_fit_each_axis_data():
    frame = _superposition(x_scale=0.4, y_scale=0.05)
    fig = plots.plot_superposition(frame)
    for axis, column in (
        (fig.layout.xaxis, "delta_substitution"),
        (fig.layout.yaxis, "delta_coherent"),
    ):
        low, high = axis.range
        largest = frame[column].abs().max()
        assert low == -high and largest < high <= 1.5 * largest
    assert fig.layout.yaxis.scaleanchor is None  # the small axis is not squashed to the large one's scale
    assert symmetric_range([np.nan]) == [-1.0, 1.0]


def test_head_heatmap_cells_equal_the_input():
    summary = _head_summary(alphas=(0.0, 2.0))
    summary = summary.drop(summary[(summary.layer == 2) & (summary["head"] == 3)].index)  # one missing cell
    fig = plots.plot_head_heatmap(summary, alpha=2.0, targets="parametric", conflict_types=["coherent", "clean"])
    assert [a.text for a in fig.layout.annotations] == [
        "coherent conflict · parametric answer",
        "clean · parametric answer",
    ]
    for trace, conflict_type in zip(fig.data, ["coherent", "clean"]):
        part = summary[
            (summary.alpha == 2.0) & (summary.target == "parametric") & (summary.conflict_type == conflict_type)
        ]
        z, custom = np.asarray(trace.z, float), np.asarray(trace.customdata, float)
        for row in part.itertuples():
            assert z[row.layer, row.head] == row.delta_mean and custom[row.layer, row.head, 2] == row.n
        assert np.isnan(z[2, 3])
        assert np.isnan(custom[..., :2]).all()  # a bare summary has no facts to resample: no interval
    shown = summary[
        (summary.alpha == 2.0) & (summary.target == "parametric") & summary.conflict_type.isin(["coherent", "clean"])
    ]
    assert fig.data[0].zmax == pytest.approx(shown.delta_mean.abs().max()) and fig.data[0].zmid == 0
    assert "scaled by 2" in fig.layout.title.text
    assert "knocked out" in plots.plot_head_heatmap(summary, alpha=0.0).layout.title.text
    # A clean prompt has no context answer in it: that panel is left out, not drawn empty.
    context = plots.plot_head_heatmap(summary, alpha=2.0, targets="context", conflict_types=["coherent", "clean"])
    assert [a.text for a in context.layout.annotations] == ["coherent conflict · context answer"]
    assert len(context.data) == 1


def test_facet_heatmap_leaves_out_panels_without_rows():
    frame = pd.DataFrame(
        [{"r": r, "c": c, "x": x, "y": y, "v": 1.0} for r in "ab" for c in "pq" for x in range(2) for y in range(2)]
    )
    frame = frame[~((frame.r == "b") & (frame.c == "p"))]
    fig = facet_heatmap(frame, "v", x="x", y="y", row="r", col="c", col_values=["p", "q"], row_values=["a", "b"])
    assert [a.text for a in fig.layout.annotations] == ["p · a", "q · a", "q · b"]
    assert len(fig.data) == 3
    # the x title sits under the lowest panel of each column: (a, p) has none below it
    assert fig.layout.xaxis.title.text == "x" and fig.layout.xaxis2.title.text is None
    assert fig.layout.xaxis3.title.text == "x"


def test_beta_grid_and_attention_cells_equal_the_input():
    grid = _beta_grid()
    fig = plots.plot_beta_grid(grid)
    assert [a.text for a in fig.layout.annotations] == [
        "clean",
        "substitution conflict",
        "coherent conflict",
        "mean",
    ]
    assert list(fig.data[0].x) == ["-2", "-1", "0"] and list(fig.data[0].y) == [
        "0",
        "2",
    ]
    cell = grid[(grid.conflict_type == "substitution") & (grid.beta_plus == 2.0) & (grid.beta_minus == -1.0)]
    assert fig.data[1].z[1][1] == cell.accuracy.item()
    assert fig.data[3].z[1][1] == pytest.approx(
        grid[(grid.beta_plus == 2.0) & (grid.beta_minus == -1.0)].accuracy.mean()
    )
    attention = _attention()
    heat = plots.plot_attention_heatmap(attention)
    frame = attention.by_head()
    coherent = frame[frame.conflict_type == "coherent"].set_index(["layer", "head"]).attention
    assert heat.data[2].z[2][1] == coherent[(2, 1)] and heat.data[2].zmin == 0


def test_no_analysis_module_imports_plotly():
    root = Path(cpsuper.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root)
        if relative.parts[0] in ("plots", "reproduce", "explore"):  # drawing, HTML rendering, the explorer
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            )
            offenders += [f"{relative}: {n}" for n in names if n.split(".")[0] == "plotly"]
    assert offenders == []
