"""Intervals wired into the analyses: sweeps, superposition, score summaries."""

import numpy as np
import pytest

import cpsuper as cp


@pytest.fixture(scope="module")
def sweep(tiny_gemma):
    data = cp.conflict_dataset("world_capital", n=6, tokenizer=tiny_gemma)
    return cp.head_sweep(tiny_gemma, data, (0.0,), progress=False)


def test_sweep_intervals_bracket_the_summary_means(sweep):
    iv = sweep.intervals(n_boot=500, seed=1)
    summary = sweep.summary.rename(columns={"n": "n_summary"})
    merged = iv.merge(summary, on=["layer", "head", "alpha", "conflict_type", "target"])
    assert len(merged) == len(sweep.summary)
    assert np.allclose(merged["mean"], merged["delta_mean"], atol=1e-9)
    assert (merged.ci_low <= merged["mean"] + 1e-12).all() and (merged["mean"] <= merged.ci_high + 1e-12).all()
    assert (merged["n"] == 6).all()


def test_superposition_is_significance_aware(sweep):
    heads = cp.superposition_heads(sweep, n_boot=500)
    flips = cp.roles.significant_flips(sweep, n_boot=500).heads.set_index(["layer", "head"])
    for _, row in heads.iterrows():
        significant = bool(flips.loc[(row.layer, row["head"]), "significant_flip"])
        assert row.superposed == (significant and row.sign_change)
    assert heads.superposed.sum() <= heads.sign_change.sum()
    assert heads.attrs["counts"]["sign_changes"] == int(heads.sign_change.sum())
    # The summary frame alone has no per-fact data: superposed is the plain sign change.
    plain = cp.superposition_heads(sweep.summary)
    assert (plain.superposed == plain.sign_change).all()
    fig = cp.plots.plot_superposition(heads)
    assert fig.data[0].error_x is not None and "flip significantly" in fig.layout.title.text


def test_summarize_scores_intervals(tiny_gemma):
    data = cp.conflict_dataset("world_capital", n=5, tokenizer=tiny_gemma)
    scores = cp.score_dataset(tiny_gemma, data, greedy=False, progress=False)
    table = cp.summarize_scores(scores, ci=0.9, n_boot=300)
    assert (table.ci_low <= table["mean"] + 1e-12).all() and (table["mean"] <= table.ci_high + 1e-12).all()
    constant = table[table.measure == "context_wins"]
    degenerate = constant[constant["std"] == 0]
    assert np.allclose(degenerate.ci_low, degenerate["mean"]) and np.allclose(degenerate.ci_high, degenerate["mean"])
    with pytest.raises(ValueError, match="ci"):
        cp.summarize_scores(scores, ci=1.5)


def test_unpaired_difference_resamples_each_set_on_its_own():
    rng = np.random.default_rng(3)
    a, b = rng.normal(1.0, 1.0, 30), rng.normal(0.0, 2.0, 45)
    got = cp.stats.unpaired_difference(a, b, n_boot=500, seed=7)
    boot = (
        cp.stats.resample_counts(30, n_boot=500, seed=7) @ a / 30
        - cp.stats.resample_counts(45, n_boot=500, seed=8) @ b / 45
    )
    assert got.mean == pytest.approx(a.mean() - b.mean())
    assert (got.ci_low, got.ci_high) == pytest.approx(tuple(np.quantile(boot, [0.025, 0.975])))
    assert got.n == 75 and got.ci_low < got.mean < got.ci_high
    assert tuple(cp.stats.unpaired_difference([2.0] * 5, [0.5] * 9))[:3] == pytest.approx((1.5, 1.5, 1.5))
    with pytest.raises(ValueError, match="not finite"):
        cp.stats.unpaired_difference([1.0, np.nan], [0.0])
