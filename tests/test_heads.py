import re

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest
import torch

import cpsuper as cp
from cpsuper.interventions import Knockout, ScaleHead, intervene


@pytest.fixture(scope="module")
def data(tiny_gemma):
    return cp.conflict_dataset("world_capital", n=3, tokenizer=tiny_gemma)


def _naive_delta(model, example, conflict_type, target, specs):
    prompt = example.prompts[conflict_type]
    token = cp.runtime.answer_token(model, example.target_answer(target), prompt)
    with torch.no_grad():
        clean = model(prompt)[0, -1].softmax(-1)[token]
        with intervene(model, specs):
            edited = model(prompt)[0, -1].softmax(-1)[token]
    return (edited - clean).item()


def test_knockout_sweep_matches_naive_knockouts(tiny_gemma, data):
    result = cp.knockout_sweep(tiny_gemma, data, targets=["parametric", "context"], progress=False)
    s = result.summary
    assert len(s) == 3 * 3 * 3 * 2  # layers x modules x conflict types x targets
    assert set(s.columns) >= {"layer", "module", "conflict_type", "target", "delta_mean", "delta_std", "n"}
    per = result.per_example
    for layer, module, conflict_type, target in [
        (0, "attn", "clean", "parametric"),
        (2, "layer", "coherent", "context"),
        (1, "mlp", "substitution", "parametric"),
    ]:
        rows = per[
            (per.layer == layer)
            & (per.module == module)
            & (per.conflict_type == conflict_type)
            & (per.target == target)
        ]
        expected = [
            _naive_delta(tiny_gemma, data[i], conflict_type, target, Knockout(layer, module)) for i in rows.example
        ]
        np.testing.assert_allclose(rows.delta, expected, atol=1e-6)
    row = s[(s.layer == 1) & (s.module == "mlp") & (s.conflict_type == "substitution") & (s.target == "parametric")]
    sub = per[
        (per.layer == 1) & (per.module == "mlp") & (per.conflict_type == "substitution") & (per.target == "parametric")
    ]
    assert row.delta_mean.item() == pytest.approx(sub.delta.mean())
    assert row.delta_std.item() == pytest.approx(sub.delta.std())
    assert row.n.item() == len(data)


def test_head_sweep_identity_and_naive_agreement(tiny, data):
    result = cp.head_sweep(tiny, data, alphas=(1.0, 0.0, 3.0), progress=False)
    per = result.per_example
    assert np.abs(per[per.alpha == 1.0].delta).max() < 1e-6  # scaling by one changes nothing
    for layer, head, alpha, conflict_type in [(0, 3, 0.0, "coherent"), (2, 1, 3.0, "substitution")]:
        rows = per[
            (per.layer == layer)
            & (per["head"] == head)
            & (per.alpha == alpha)
            & (per.conflict_type == conflict_type)
            & (per.target == "context")
        ]
        expected = [
            _naive_delta(tiny, data[i], conflict_type, "context", ScaleHead(layer, head, alpha)) for i in rows.example
        ]
        np.testing.assert_allclose(rows.delta, expected, atol=1e-6)


def test_head_sweep_subsets_and_bad_input(tiny_gemma, data):
    result = cp.head_sweep(
        tiny_gemma, data, alphas=(0.0,), layers=[1], heads=[0, 2], conflict_types=["clean"], progress=False
    )
    assert sorted(set(zip(result.summary.layer, result.summary["head"]))) == [(1, 0), (1, 2)]
    with pytest.raises(ValueError, match="Unknown layer 3"):
        cp.head_sweep(tiny_gemma, data, layers=[3], progress=False)
    with pytest.raises(ValueError, match="Unknown head 4"):
        cp.head_sweep(tiny_gemma, data, heads=[4], progress=False)
    with pytest.raises(ValueError, match="Unknown targets"):
        cp.head_sweep(tiny_gemma, data, targets=("memory",), progress=False)


def _summary(rows):
    return pd.DataFrame(rows, columns=["layer", "head", "alpha", "conflict_type", "target", "delta_mean"]).assign(
        delta_std=0.01, n=4, p_clean=0.2, p=0.2
    )


def test_superposition_heads_flags_sign_changes():
    summary = _summary(
        [
            (0, 0, 0.0, "substitution", "parametric", 0.10),
            (0, 0, 0.0, "coherent", "parametric", -0.20),
            (0, 1, 0.0, "substitution", "parametric", 0.10),
            (0, 1, 0.0, "coherent", "parametric", 0.30),
            (1, 0, 0.0, "substitution", "parametric", -0.001),
            (1, 0, 0.0, "coherent", "parametric", 0.5),
        ]
    )
    heads = cp.superposition_heads(summary, min_effect=0.01)
    flags = {(r.layer, r["head"]): r.superposed for _, r in heads.iterrows()}
    assert flags == {(0, 0): True, (0, 1): False, (1, 0): False}
    assert (heads.iloc[0].layer, heads.iloc[0]["head"]) == (0, 0)
    fig = cp.plots.plot_superposition(heads)
    assert "1 of 3 heads flip sign" in fig.layout.title.text


def _styled_cells(html, colour):
    rule = re.search(r"([^{}]*)\{\s*background-color: %s;\s*\}" % colour, html)
    return {(int(r), int(c)) for r, c in re.findall(r"row(\d+)_col(\d+)", rule.group(1))}


def test_rank_heads_orders_by_context_gain_in_substitution():
    rows = []
    for (layer, head), (sc, sp, cc, cpar) in {
        (0, 0): (0.05, -0.01, 0.02, -0.01),
        (1, 2): (0.20, -0.03, -0.10, 0.05),
        (2, 1): (0.10, 0.02, 0.04, -0.02),
    }.items():
        rows += [
            (layer, head, 0.0, "substitution", "context", sc),
            (layer, head, 0.0, "substitution", "parametric", sp),
            (layer, head, 0.0, "coherent", "context", cc),
            (layer, head, 0.0, "coherent", "parametric", cpar),
        ]
    table = cp.rank_heads(_summary(rows), k=2)
    assert list(zip(table.layer, table["head"])) == [(1, 2), (2, 1)]
    assert table[("coherent", "context")].tolist() == [-0.10, 0.04]
    html = cp.plots.style_head_table(table).to_html()
    # columns: layer, head, subst context, subst parametric, coherent context, coherent parametric
    assert _styled_cells(html, "#c7e9c0") == {(0, 2), (0, 3), (1, 2), (1, 4), (1, 5)}  # desired
    assert _styled_cells(html, "#fcbba1") == {(0, 4), (0, 5), (1, 3)}  # undesired
    with pytest.raises(ValueError, match="lacks"):
        cp.rank_heads(_summary(rows[:2]), k=2)


def test_head_table_escapes_conflict_type_labels():
    """A conflict type from a shared dataset is a column label of the styled table, which the
    report inlines as HTML: it must come out as text, not markup."""
    hostile = "<img src=x onerror=alert(1)>"
    rows = [(0, 0, 0.0, c, t, 0.1) for c in ("substitution", hostile) for t in ("context", "parametric")]
    table = cp.rank_heads(_summary(rows), k=1, compare=("substitution", hostile))
    html = cp.plots.style_head_table(table).to_html()
    assert "<img" not in html and "&lt;img src=x onerror=alert(1)&gt;" in html


def test_consistent_gains_counts_layers_raising_the_target_everywhere():
    rows = []
    for layer in range(3):
        for module in ("attn", "mlp"):
            for conflict_type in cp.CONFLICT_TYPES:
                gain = (
                    0.1 if (module == "attn" and layer != 1) or (module == "mlp" and conflict_type != "clean") else -0.1
                )
                rows.append((layer, module, conflict_type, "parametric", gain))
    summary = pd.DataFrame(rows, columns=["layer", "module", "conflict_type", "target", "delta_mean"])
    table = cp.knockouts.consistent_gains(summary).set_index("module")
    assert table.loc["attn", "n_consistent"] == 2 and table.loc["attn", "layers"] == [0, 2]
    assert table.loc["mlp", "n_consistent"] == 0


def test_cumulative_knockout_and_run_once_vs_twice(tiny_gemma, data):
    ranking = [(0, 1), (1, 3), (2, 0)]
    cumulative = cp.cumulative_knockout(tiny_gemma, data, ranking, progress=False)
    s = cumulative.summary
    assert s.k.tolist() == [0, 1, 2, 3]
    assert s.delta_mean.iloc[0] == 0  # k = 0 is the unmodified model
    per = cumulative.per_example
    for k in (1, 3):
        rows = per[per.k == k]
        specs = [ScaleHead(l, h, 0.0) for l, h in ranking[:k]]
        expected = [_naive_delta(tiny_gemma, data[i], "coherent", "parametric", specs) for i in rows.example]
        np.testing.assert_allclose(rows.delta, expected, atol=1e-6)

    both = cp.run_once_vs_twice(tiny_gemma, data, ranking, beta=-1.0, progress=False).summary
    once, twice = both[both.method == "run once"].set_index("k"), both[both.method == "run twice"].set_index("k")
    assert once.loc[1, "p"] == pytest.approx(twice.loc[1, "p"], abs=1e-6)  # one head: identical
    assert once.loc[3, "p"] == pytest.approx(s.set_index("k").loc[3, "p"], abs=1e-6)  # run once = joint knockout
    assert abs(once.loc[3, "p"] - twice.loc[3, "p"]) > 1e-6  # several heads: they differ
    result = cp.run_once_vs_twice(tiny_gemma, data, ranking, beta=-1.0, progress=False)
    fig = cp.plots.plot_run_once_vs_twice(result)
    assert {t.name for t in fig.data} == {"run once", "run twice"}
    # Error bars: the 95 % bootstrap interval over facts of the mean probability, so inside [0, 1].
    bands = cp.stats.bootstrap_summary(result.per_example, value="p", by=["k", "method"], unit="example")
    for trace in fig.data:
        y, plus, minus = (np.asarray(v, float) for v in (trace.y, trace.error_y.array, trace.error_y.arrayminus))
        expected = bands[bands.method == trace.name].sort_values("k")
        np.testing.assert_allclose(y + plus, expected.ci_high, atol=1e-9)
        np.testing.assert_allclose(y - minus, expected.ci_low, atol=1e-9)
        assert (y - minus >= 0).all() and (y + plus <= 1).all()


def test_plots_have_centred_colour_and_labelled_axes(tiny_gemma, data):
    sweep = cp.head_sweep(tiny_gemma, data, alphas=(0.0,), progress=False)
    fig = cp.plots.plot_head_heatmap(sweep)
    assert isinstance(fig, go.Figure)
    heatmaps = [t for t in fig.data if t.type == "heatmap"]
    assert len(heatmaps) == 3 * 2 - 1  # conflict types x targets, less clean prompts' context answer
    assert "clean · context answer" not in [a.text for a in fig.layout.annotations]
    assert all(t.zmid == 0 and t.zmin == -t.zmax for t in heatmaps)
    assert "95 % interval" in heatmaps[0].hovertemplate and "n" in heatmaps[0].hovertemplate
    assert np.asarray(heatmaps[0].z).shape == (3, 4)  # layers x heads
    # Hover: each cell's bootstrap interval over facts, as the sweep's own intervals give it.
    bands = sweep.intervals().set_index(["conflict_type", "target", "layer", "head"])
    custom = np.asarray(heatmaps[0].customdata, float)  # clean, parametric
    for layer, head in [(0, 0), (2, 3)]:
        row = bands.loc[("clean", "parametric", layer, head)]
        np.testing.assert_allclose(custom[layer, head, :2], [row.ci_low, row.ci_high])
    # "head" labels only the lowest panel of each column, so it cannot collide with a panel title below it
    assert fig.layout.xaxis.title.text == "head" and fig.layout.xaxis2.title.text is None
    assert fig.layout.xaxis4.title.text == "head"
    knockouts = cp.knockout_sweep(tiny_gemma, data, modules=("attn",), progress=False)
    knock = cp.plots.plot_knockouts(knockouts)
    assert [a.text for a in knock.layout.annotations][:3] == ["clean", "substitution conflict", "coherent conflict"]
    # Each band is the 95 % bootstrap interval over facts of the line's mean change.
    bands = knockouts.intervals().set_index(["conflict_type", "layer"])
    lines = [t for t in knock.data if t.mode and "lines" in t.mode]
    fills = [t for t in knock.data if t.fill == "toself"]
    assert len(lines) == len(fills) == 3
    for line, fill in zip(lines, fills):
        assert fill.xaxis == line.xaxis  # each band sits in its line's panel
        custom = np.asarray(line.customdata, float)
        y_fill = np.asarray(fill.y, float)
        np.testing.assert_allclose(y_fill[: len(custom)], custom[:, 1])
        np.testing.assert_allclose(y_fill[len(custom) :], custom[::-1, 0])
    clean = np.asarray(lines[0].customdata, float)
    for layer in range(3):
        np.testing.assert_allclose(clean[layer, :2], bands.loc[("clean", layer), ["ci_low", "ci_high"]].to_numpy(float))
    assert knock.layout.xaxis.title.text == "layer"
    with pytest.raises(ValueError, match="alpha=5"):
        cp.plots.plot_head_heatmap(sweep, alpha=5)
