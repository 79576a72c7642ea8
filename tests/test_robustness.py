"""Robustness sweeps for JuICE (Figure 5 / Table 7): each setting equals a JuICE built by hand."""

import numpy as np
import pandas as pd
import pytest

import cpsuper as cp
from cpsuper import juice, plots, robustness


@pytest.fixture(scope="module")
def setup(tiny_gemma):
    data = cp.conflict_dataset("world_capital", n=5, tokenizer=tiny_gemma)
    identified = cp.identify_heads(tiny_gemma, data[:2], k=12, progress=False)
    steer = cp.JuICE(
        tiny_gemma,
        k=2,
        enhance=identified.with_k(2).enhance,
        suppress=identified.with_k(2).suppress,
        beta_plus=2.0,
        beta_minus=-1.0,
        beta_pos_grid=(0.0, 2.0),
        beta_neg_grid=(0.0, -1.0),
    )
    return data, identified, steer


def _by_hand(model, heads, data, bp=2.0, bm=-1.0):
    steer = cp.JuICE(model, enhance=heads.enhance, suppress=heads.suppress, beta_plus=bp, beta_minus=bm)
    return steer.accuracy(data).groupby("conflict_type")["correct"].mean()


def test_k_sweep_equals_hand_built_juice(tiny_gemma, setup):
    data, identified, steer = setup
    frame = robustness.k_sweep(steer, identified, data[2:], ks=(1, 3), progress=False)
    assert set(frame.k) == {1, 3} and set(frame.conflict_type) == set(data.conflict_types)
    expected = _by_hand(tiny_gemma, identified.with_k(3), data[2:])
    got = frame[frame.k == 3].set_index("conflict_type").accuracy
    pd.testing.assert_series_equal(got.sort_index(), expected.sort_index(), check_names=False)
    fig = plots.plot_robustness(frame, "k")
    assert len(fig.data) == len(data.conflict_types)


def test_selection_size_sweep_equals_identifying_each_size_again(tiny_gemma, setup, monkeypatch):
    data, _, steer = setup
    calls = []
    real = juice.identify_heads  # JuICE.identify, used by the sweep, calls it
    monkeypatch.setattr(juice, "identify_heads", lambda *a, **kw: calls.append(len(a[1])) or real(*a, **kw))
    frame = robustness.selection_size_sweep(steer, data[:2], data[2:], sizes=(1, 2), progress=False)
    assert calls == [2]  # every fact scored once, each size re-aggregated
    for n in (1, 2):
        heads = cp.identify_heads(tiny_gemma, data[:n], k=2, progress=False)
        expected = _by_hand(tiny_gemma, heads, data[2:])
        got = frame[frame.n_selection == n].set_index("conflict_type").accuracy
        pd.testing.assert_series_equal(got.sort_index(), expected.sort_index(), check_names=False)
    with pytest.raises(ValueError, match="do not fit a pool of 2"):
        robustness.selection_size_sweep(steer, data[:2], data[2:], sizes=(3,), progress=False)


def test_beta_grid_and_paraphrases(tiny_gemma, setup):
    data, _, steer = setup
    grid = robustness.beta_grid(steer, data[2:], progress=False)
    assert len(grid) == 4 * len(data.conflict_types)
    zero = grid[(grid.beta_plus == 0) & (grid.beta_minus == 0)].set_index("conflict_type").accuracy
    plain = cp.evaluate({"o": cp.Original(tiny_gemma)}, data[2:]).groupby("conflict_type").correct.mean()
    pd.testing.assert_series_equal(zero.sort_index(), plain.sort_index(), check_names=False)
    fig = plots.plot_beta_grid(grid)
    assert [a.text for a in fig.layout.annotations][-1] == "mean"
    relation = cp.load_relation("world_capital")
    subjects = [e.subject for e in data[2:]]
    templates = {p: relation.dataset(subjects=subjects, paraphrase=p, tokenizer=tiny_gemma) for p in (0, 1)}
    frame = robustness.paraphrase_sweep(
        {"Original": cp.Original(tiny_gemma), "JuICE": steer}, templates, progress=False
    )
    assert set(frame.template) == {0, 1} and set(frame.method) == {"Original", "JuICE"}
    assert plots.plot_robustness(frame, "template").data


def test_per_example_template_draws_are_seeded_and_mix_templates(tiny_gemma):
    relation = cp.load_relation("world_capital")
    subjects = relation.subjects[:12]
    templates = {p: relation.dataset(subjects=subjects, paraphrase=p, tokenizer=tiny_gemma) for p in (0, 1, 2)}
    drawn = robustness.draw_templates(templates, seed=3)
    labels = [e.meta["template"] for e in drawn]
    assert len(set(labels)) > 1  # templates are mixed within one run
    assert [e.subject for e in drawn] == subjects
    for i, (example, label) in enumerate(zip(drawn, labels)):
        assert example.prompts == templates[label][i].prompts
    assert labels == [e.meta["template"] for e in robustness.draw_templates(templates, seed=3)]
    assert labels != [e.meta["template"] for e in robustness.draw_templates(templates, seed=4)]
    with pytest.raises(ValueError, match="different facts"):
        robustness.draw_templates({0: templates[0], 1: templates[1][:5]})
    small = {p: d[:3] for p, d in templates.items()}
    frame = robustness.paraphrase_sweep(
        {"Original": cp.Original(tiny_gemma)}, small, progress=False, mode="per_example", seeds=(0, 1)
    )
    assert set(frame.template) == {"random"} and set(frame.seed) == {0, 1}
    plain = cp.evaluate({"Original": cp.Original(tiny_gemma)}, robustness.draw_templates(small, seed=1))
    expected = plain.groupby("conflict_type").correct.mean()
    got = frame[frame.seed == 1].set_index("conflict_type").accuracy
    pd.testing.assert_series_equal(got.sort_index(), expected.sort_index(), check_names=False)
    with pytest.raises(ValueError, match="mode"):
        robustness.paraphrase_sweep({"Original": cp.Original(tiny_gemma)}, small, mode="mixed")
    # per_fact=True: evaluate's rows with the run's labels, whose means are the accuracies above
    rows = robustness.paraphrase_sweep(
        {"Original": cp.Original(tiny_gemma)}, small, progress=False, mode="per_example", seeds=(0, 1), per_fact=True
    )
    assert len(rows) == 2 * 3 * len(small[0].conflict_types) and set(rows.template) == {"random"}
    pd.testing.assert_frame_equal(
        rows[rows.seed == 1].drop(columns=["template", "seed"]).reset_index(drop=True), plain, check_dtype=False
    )
    means = rows.groupby(["seed", "conflict_type"]).correct.mean().rename("accuracy")
    pd.testing.assert_series_equal(means, frame.set_index(["seed", "conflict_type"]).accuracy.sort_index())
    per_template = robustness.paraphrase_sweep({"Original": cp.Original(tiny_gemma)}, small, False, per_fact=True)
    assert set(per_template.template) == {0, 1, 2} and "correct" in per_template


def test_methods_chart_has_one_bar_group_per_conflict_type_with_bootstrap_errors():
    from cpsuper.plots.methods import plot_methods
    from cpsuper.stats import bootstrap_ci

    rng = np.random.default_rng(0)
    rows = [
        {"method": m, "relation": r, "example": i, "conflict_type": c, "correct": float(rng.random() < p)}
        for m, p in (("Original", 0.3), ("JuICE", 0.8))
        for r in ("capital", "author")
        for i in range(10)
        for c in ("clean", "substitution", "coherent")
    ]
    results = pd.DataFrame(rows)
    fig = plot_methods(results, n_boot=500)
    assert [t.name for t in fig.data] == ["Original", "JuICE"]
    bar = fig.data[1]
    assert list(bar.x) == ["clean", "substitution conflict", "coherent conflict"]
    part = results.query("method == 'JuICE' and conflict_type == 'substitution'")
    values = part.sort_values(["relation", "example"]).correct.to_numpy()  # the facts in unit order
    interval = bootstrap_ci(values, n_boot=500)  # 20 facts: the two relations' example 0 differ
    assert bar.y[1] == pytest.approx(values.mean())
    assert bar.y[1] + bar.error_y.array[1] == pytest.approx(interval.ci_high)
    assert bar.y[1] - bar.error_y.arrayminus[1] == pytest.approx(interval.ci_low)
    assert bar.customdata[1][2] == 20
    with pytest.raises(ValueError, match="correct"):
        plot_methods(results.drop(columns="correct"))
