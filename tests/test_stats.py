"""Bootstrap intervals over facts (cpsuper.stats): exact identities, agreement with a naive
resampling loop, pairing, and the error cases."""

import numpy as np
import pandas as pd
import pytest

from cpsuper.stats import (
    Interval,
    bootstrap_ci,
    bootstrap_summary,
    ci_strings,
    format_ci,
    paired_bootstrap,
    paired_summary,
    resample_counts,
    sweep_intervals,
)


def _naive(x, n_boot, ci, seed, stat=np.mean):
    """Reference: resample with explicit indices, take the percentile interval."""
    idx = np.random.default_rng(seed).integers(0, len(x), size=(n_boot, len(x)))
    boot = stat(np.asarray(x)[idx], axis=1)
    tail = (1 - ci) / 2
    return np.quantile(boot, [tail, 1 - tail])


def _tidy(n_examples=30, seed=1):
    """A fake sweep per-example frame: 3 layers x 2 heads x 2 conflict types x 2 targets."""
    idx = pd.MultiIndex.from_product(
        [
            range(n_examples),
            range(3),
            range(2),
            [0.0],
            ["substitution", "coherent"],
            ["parametric", "context"],
        ],
        names=["example", "layer", "head", "alpha", "conflict_type", "target"],
    )
    frame = idx.to_frame(index=False)
    frame["subject"] = "s" + frame["example"].astype(str)
    frame["p_clean"], frame["p"] = 0.5, 0.5
    frame["delta"] = np.random.default_rng(seed).normal(0.01 * frame["layer"], 0.05)
    return frame


def test_constant_gives_a_degenerate_interval():
    assert bootstrap_ci([0.7] * 25) == Interval(0.7, 0.7, 0.7, 25)
    assert bootstrap_ci([0.3] * 7, statistic="median") == Interval(0.3, 0.3, 0.3, 7)
    frame = pd.DataFrame({"example": np.tile(range(12), 2), "g": np.repeat(["a", "b"], 12), "delta": 0.1})
    frame.loc[frame.g == "b", "delta"] = -0.45
    out = bootstrap_summary(frame, by=["g"], n_boot=500)
    assert out["mean"].tolist() == out["ci_low"].tolist() == out["ci_high"].tolist() == [0.1, -0.45]


def test_matches_a_naive_resampling_loop():
    x = np.random.default_rng(3).exponential(size=37)
    for stat, fn in [("mean", np.mean), ("median", np.median)]:
        got = bootstrap_ci(x, n_boot=700, ci=0.9, seed=11, statistic=stat)
        np.testing.assert_allclose([got.ci_low, got.ci_high], _naive(x, 700, 0.9, 11, fn), rtol=1e-12)
        assert got.mean == pytest.approx(fn(x)) and got.n == 37
    counts = resample_counts(37, n_boot=700, seed=11)
    assert counts.shape == (700, 37) and (counts.sum(1) == 37).all()


def test_intervals_shrink_as_facts_are_added():
    x = np.random.default_rng(0).normal(0.2, 1.0, size=640)
    widths = [np.subtract(*bootstrap_ci(x[:n])[2:0:-1]) for n in (10, 40, 160, 640)]
    assert all(w > 0 for w in widths)
    assert widths == sorted(widths, reverse=True) and widths[-1] < widths[0] / 4
    assert bootstrap_ci(x, ci=0.5)[1] > bootstrap_ci(x, ci=0.99)[1]  # a lower level is narrower


def test_same_seed_same_result_other_seed_differs():
    frame = _tidy()
    by = ["layer", "head", "conflict_type", "target"]
    first = bootstrap_summary(frame, by=by, n_boot=300, seed=5)
    pd.testing.assert_frame_equal(first, bootstrap_summary(frame, by=by, n_boot=300, seed=5))
    other = bootstrap_summary(frame, by=by, n_boot=300, seed=6)
    assert not np.allclose(first.ci_low, other.ci_low)
    np.testing.assert_array_equal(first["mean"], other["mean"])


def test_grouped_equals_one_dimensional_per_group():
    frame = _tidy().sample(frac=1.0, random_state=0)  # row order must not matter
    out = bootstrap_summary(frame, by=["layer", "head", "conflict_type", "target"], n_boot=400, seed=2)
    assert len(out) == 3 * 2 * 2 * 2 and (out.n == 30).all()
    for _, row in out.sample(5, random_state=1).iterrows():
        rows = frame[
            (frame.layer == row.layer)
            & (frame["head"] == row["head"])
            & (frame.conflict_type == row.conflict_type)
            & (frame.target == row.target)
        ]
        ref = bootstrap_ci(rows.sort_values("example").delta, n_boot=400, seed=2)
        assert ref.mean == pytest.approx(row["mean"], abs=1e-12)
        assert (ref.ci_low, ref.ci_high) == pytest.approx((row.ci_low, row.ci_high), abs=1e-12)


def test_units_keep_their_rows_together():
    """Grouping over several rows per fact: the estimate is the row mean, the resampled unit the fact."""
    frame = _tidy(n_examples=20)
    out = bootstrap_summary(frame, by=["conflict_type"], n_boot=300)
    assert (out.n == 20).all()
    np.testing.assert_allclose(out["mean"], frame.groupby("conflict_type").delta.mean().sort_index())
    # Facts with identical rows everywhere except a per-fact offset: the interval reflects the
    # 20 per-fact offsets, not 240 independent rows.
    frame["delta"] = frame["example"] * 0.01
    by_fact = bootstrap_summary(frame, by=["conflict_type"], n_boot=300).iloc[0]
    per_fact = bootstrap_ci(np.arange(20) * 0.01, n_boot=300)
    assert (by_fact.ci_low, by_fact.ci_high) == pytest.approx((per_fact.ci_low, per_fact.ci_high))
    assert bootstrap_summary(frame, unit="subject", n_boot=300).n.item() == 20


def test_groups_with_different_facts_use_their_own_facts():
    frame = _tidy(n_examples=10)
    frame = frame[~((frame.conflict_type == "coherent") & (frame.example >= 6))]
    out = bootstrap_summary(frame, by=["conflict_type"], n_boot=200)
    assert out.set_index("conflict_type").n.to_dict() == {
        "coherent": 6,
        "substitution": 10,
    }
    assert out.ci_low.lt(out["mean"]).all() and out.ci_high.gt(out["mean"]).all()


def test_paired_bootstrap_of_a_method_against_itself_is_exactly_zero():
    x = np.random.default_rng(0).random(33)
    assert paired_bootstrap(x, x) == Interval(0.0, 0.0, 0.0, 33)
    frame = _tidy().assign(method="JuICE")
    out = paired_summary(frame, a="JuICE", b="JuICE", by=["conflict_type"], n_boot=200)
    assert (out["diff"] == 0).all() and (out.ci_low == 0).all() and (out.ci_high == 0).all()


def test_paired_bootstrap_uses_the_pairing():
    rng = np.random.default_rng(4)
    base = rng.normal(0.5, 0.3, size=40)  # facts differ a lot
    a, b = (
        base + rng.normal(0.05, 0.01, size=40),
        base,
    )  # method a is a little better on every fact
    paired = paired_bootstrap(a, b, seed=1)
    assert paired.mean == pytest.approx(a.mean() - b.mean())
    assert paired.ci_low > 0  # significant when paired ...
    ia, ib = bootstrap_ci(a, seed=1), bootstrap_ci(b, seed=2)
    assert ia.ci_low < ib.ci_high  # ... though the separate intervals overlap
    # Series are paired by fact, whatever their order.
    sa, sb = pd.Series(a, index=range(40)), pd.Series(b, index=range(40))
    assert paired_bootstrap(sa, sb.iloc[::-1], seed=1) == paired
    # The frame version agrees with the 1-D one.
    frame = pd.DataFrame(
        {
            "example": np.tile(range(40), 2),
            "method": np.repeat(["a", "b"], 40),
            "acc": np.concatenate([a, b]),
        }
    )
    row = paired_summary(frame, a="a", b="b", value="acc", seed=1).iloc[0]
    assert row["diff"] == pytest.approx(paired.mean) and row.n == 40
    assert (row.ci_low, row.ci_high) == pytest.approx((paired.ci_low, paired.ci_high))
    assert row.mean_a == pytest.approx(a.mean()) and row.mean_b == pytest.approx(b.mean())


def test_paired_comparison_over_different_facts_is_an_error():
    with pytest.raises(ValueError, match="different facts"):
        paired_bootstrap([0.1, 0.2, 0.3], [0.1, 0.2])
    with pytest.raises(ValueError, match="different facts"):
        paired_bootstrap(
            pd.Series([0.1, 0.2], index=["x", "y"]),
            pd.Series([0.1, 0.2], index=["x", "z"]),
        )
    frame = _tidy(n_examples=8)
    both = pd.concat([frame.assign(method="a"), frame[frame.example != 3].assign(method="b")])
    with pytest.raises(ValueError, match=r"different facts.*only under 'a': \[3\]"):
        paired_summary(both, a="a", b="b", by=["conflict_type"])
    with pytest.raises(ValueError, match="No rows with method == 'c'"):
        paired_summary(both, a="a", b="c")


@pytest.mark.parametrize("n_boot", [0, -5, 2.5, True])
def test_bad_n_boot(n_boot):
    with pytest.raises(ValueError, match="n_boot"):
        bootstrap_ci([1.0, 2.0], n_boot=n_boot)
    with pytest.raises(ValueError, match="n_boot"):
        bootstrap_summary(_tidy(3), n_boot=n_boot)


@pytest.mark.parametrize("ci", [0.0, 1.0, 1.5, -0.1, 95])
def test_bad_ci(ci):
    with pytest.raises(ValueError, match="ci must lie"):
        bootstrap_ci([1.0, 2.0], ci=ci)
    with pytest.raises(ValueError, match="ci must lie"):
        paired_bootstrap([1.0, 2.0], [1.0, 2.0], ci=ci)


def test_empty_and_non_finite_data():
    with pytest.raises(ValueError, match="empty"):
        bootstrap_ci([])
    with pytest.raises(ValueError, match="empty"):
        bootstrap_summary(_tidy(3).iloc[:0], by=["layer"])
    for bad in (np.nan, np.inf):
        with pytest.raises(ValueError, match="not finite"):
            bootstrap_ci([0.1, bad, 0.3])
        frame = _tidy(3)
        frame.loc[4, "delta"] = bad
        with pytest.raises(ValueError, match="not finite"):
            bootstrap_summary(frame, by=["layer"])
        with pytest.raises(ValueError, match="not finite"):
            paired_bootstrap([0.1, 0.2], [bad, 0.2])
    with pytest.raises(ValueError, match="statistic"):
        bootstrap_ci([0.1, 0.2], statistic="max")
    with pytest.raises(ValueError, match="no columns"):
        bootstrap_summary(_tidy(3), by=["module"])


def test_format_ci():
    assert format_ci(0.5312, 0.3749, 0.7) == "0.53 [0.37, 0.70]"
    assert format_ci(-0.001, -0.2, 0.004, digits=2) == "0.00 [-0.20, 0.00]"
    assert format_ci(0.12345, 0.1, 0.2, digits=3) == "0.123 [0.100, 0.200]"
    assert str(Interval(0.5312, 0.3749, 0.7, 10)) == "0.53 [0.37, 0.70]"
    frame = pd.DataFrame({"mean": [0.5, -0.25], "ci_low": [0.4, -0.3], "ci_high": [0.6, -0.2]})
    assert ci_strings(frame).tolist() == ["0.50 [0.40, 0.60]", "-0.25 [-0.30, -0.20]"]


def test_sweep_intervals_groups_like_the_sweep_summary():
    per = _tidy(n_examples=12)
    out = sweep_intervals(per, n_boot=200)
    assert list(out.columns) == [
        "layer",
        "head",
        "alpha",
        "conflict_type",
        "target",
        "mean",
        "ci_low",
        "ci_high",
        "n",
    ]
    assert len(out) == 24 and (out.n == 12).all()
    means = per.groupby(["layer", "head", "alpha", "conflict_type", "target"]).delta.mean().to_numpy()
    np.testing.assert_allclose(out["mean"], means)
