"""Significance-aware superposition and head roles (cpsuper.roles) on hand-built sweep frames."""

import numpy as np
import pandas as pd
import pytest

from cpsuper.roles import ROLES, head_roles, role_transitions, significant_flips

N = 40  # facts


def _values(rng, mean, sd, n=N):
    """Noise with sample mean exactly ``mean`` (so signs of means are known)."""
    noise = rng.normal(0.0, sd, size=n)
    return mean + (noise - noise.mean())


def _frame(effects, *, sd, seed=0, alpha=0.0, n=N):
    """Per-example sweep rows: effects[(layer, head)][(conflict_type, target)] = mean delta."""
    rng = np.random.default_rng(seed)
    rows = []
    for (layer, head), by_type in effects.items():
        for (conflict_type, target), mean in by_type.items():
            s = sd(mean) if callable(sd) else sd
            rows.append(
                pd.DataFrame(
                    {
                        "example": np.arange(n),
                        "subject": [f"s{i}" for i in range(n)],
                        "layer": layer,
                        "head": head,
                        "alpha": alpha,
                        "conflict_type": conflict_type,
                        "target": target,
                        "p_clean": 0.5,
                        "p": 0.5,
                        "delta": _values(rng, mean, s, n),
                    }
                )
            )
    return pd.concat(rows, ignore_index=True)


def _flip_sweep():
    """Heads with known effects on p(parametric) in substitution / coherent conflicts."""
    known = {
        (0, 0): (0.10, -0.10),  # clear flip
        (0, 1): (0.10, -0.001),  # sign change, but coherent is noise
        (0, 2): (0.10, 0.10),  # same sign
        (0, 3): (-0.05, 0.05),  # clear flip the other way
        (1, 0): (0.03, -0.03),  # significant, but small
    }
    nulls = {(2 + i // 4, i % 4): (0.002, -0.002) if i % 2 else (-0.002, 0.002) for i in range(20)}
    effects = {
        head: {
            ("substitution", "parametric"): s,
            ("coherent", "parametric"): c,
            ("clean", "parametric"): 0.2,
        }
        for head, (s, c) in {**known, **nulls}.items()
    }
    return _frame(effects, sd=0.02)


def _heads(frame, column):
    return {(int(l), int(h)) for l, h in frame.loc[frame[column], ["layer", "head"]].to_numpy()}


def test_significant_flips_finds_exactly_the_known_flips():
    flips = significant_flips(_flip_sweep(), n_boot=2000, seed=0)
    assert _heads(flips.heads, "significant_flip") == {(0, 0), (0, 3), (1, 0)}
    nulls = {(2 + i // 4, i % 4) for i in range(20)}
    assert _heads(flips.heads, "sign_change") == {(0, 0), (0, 1), (0, 3), (1, 0)} | nulls
    assert flips.counts() == {"heads": 25, "sign_changes": 24, "significant_flips": 3}
    assert (flips.n_significant, flips.n_sign_changes) == (3, 24)
    assert "24 of 25 heads" in str(flips) and "3 of them flip significantly" in str(flips)
    # The sorted table leads with the significant flips; the clean type was not used.
    assert flips.heads.significant_flip.head(3).all()
    assert set(flips.intervals.conflict_type) == {"substitution", "coherent"}
    row = flips.heads.set_index(["layer", "head"]).loc[(0, 1)]
    assert row.sign_substitution == 1 and row.sign_coherent == 0
    assert row.ci_low_coherent < 0 < row.ci_high_coherent
    # A minimum effect size drops the small flip only.
    big = significant_flips(_flip_sweep(), n_boot=2000, seed=0, min_effect=0.04)
    assert _heads(big.heads, "significant_flip") == {(0, 0), (0, 3)}
    assert big.n_sign_changes == 24


def test_significant_flips_is_reproducible():
    sweep = _flip_sweep()
    a = significant_flips(sweep, n_boot=300, seed=3)
    pd.testing.assert_frame_equal(a.heads, significant_flips(sweep, n_boot=300, seed=3).heads)


def test_significant_flips_errors():
    sweep = _flip_sweep()
    with pytest.raises(ValueError, match="alpha=2"):
        significant_flips(sweep, alpha=2.0)
    with pytest.raises(ValueError, match="targets"):
        significant_flips(sweep, target="context")
    with pytest.raises(ValueError, match="conflict types"):
        significant_flips(sweep, types=("substitution", "irrelevant"))
    with pytest.raises(ValueError, match="two different"):
        significant_flips(sweep, types=("coherent", "coherent"))
    with pytest.raises(ValueError, match="min_effect"):
        significant_flips(sweep, min_effect=-0.01)
    with pytest.raises(ValueError, match="n_boot"):
        significant_flips(sweep, n_boot=0)
    with pytest.raises(ValueError, match="ci must"):
        significant_flips(sweep, ci=1.0)
    with pytest.raises(ValueError, match="lacks columns"):
        significant_flips(sweep.drop(columns="head"))


# Hand-built roles: (parametric, context) mean effects of a knockout per conflict type.
ROLE_EFFECTS = {
    (0, 0): {
        "substitution": (-0.20, 0.30),
        "coherent": (0.10, -0.10),
    },  # memory -> context
    (0, 1): {
        "substitution": (0.10, 0.10),
        "coherent": (-0.10, -0.20),
    },  # mixed -> mixed
    (1, 0): {
        "substitution": (-0.20, 0.0),
        "coherent": (0.02, -0.02),
    },  # negligible -> context (small)
    (1, 1): {
        "substitution": (-0.01, 0.01),
        "coherent": (0.0, 0.0),
    },  # noise: negligible -> negligible
}
EXPECTED = {
    ((0, 0), "substitution"): "memory",
    ((0, 0), "coherent"): "context",
    ((0, 1), "substitution"): "mixed",
    ((0, 1), "coherent"): "mixed",
    ((1, 0), "substitution"): "negligible",
    ((1, 0), "coherent"): "context",
    ((1, 1), "substitution"): "negligible",
    ((1, 1), "coherent"): "negligible",
}


def _role_sweep(alpha=0.0, sign=1.0):
    effects = {
        head: {
            (t, target): sign * e for t, pair in by_type.items() for target, e in zip(("parametric", "context"), pair)
        }
        for head, by_type in ROLE_EFFECTS.items()
    }
    # Clear effects get little noise, zero effects none, the (1, 1) head a lot.
    frame = _frame(effects, sd=lambda m: 0.005 if abs(m) >= 0.02 else 0.0, alpha=alpha)
    noisy = (frame.layer == 1) & (frame["head"] == 1) & (frame.conflict_type == "substitution")
    rng = np.random.default_rng(9)
    for target in ("parametric", "context"):
        rows = noisy & (frame.target == target)
        frame.loc[rows, "delta"] = _values(rng, sign * (-0.01 if target == "parametric" else 0.01), 0.1)
    return frame


def _as_dict(roles):
    return {((int(r.layer), int(r.head)), r.conflict_type): r.role for r in roles.itertuples()}


def test_head_roles_on_a_hand_built_frame():
    roles = head_roles(_role_sweep(), n_boot=1000, seed=0)
    assert _as_dict(roles) == EXPECTED
    assert list(roles.role.cat.categories) == list(ROLES)
    assert {
        "parametric_mean",
        "parametric_ci_low",
        "parametric_ci_high",
        "context_mean",
        "context_ci_low",
        "context_ci_high",
        "n",
        "alpha",
    } <= set(roles.columns)
    row = roles.set_index(["layer", "head", "conflict_type"]).loc[(0, 0, "substitution")]
    assert row.parametric_mean == pytest.approx(-0.2) and row.context_mean == pytest.approx(0.3)
    assert row.parametric_ci_high < 0 < row.context_ci_low and row.n == N
    # A zero effect has the degenerate interval [0, 0]: not significant.
    zero = roles.set_index(["layer", "head", "conflict_type"]).loc[(1, 1, "coherent")]
    assert zero.parametric_ci_low == zero.parametric_ci_high == 0.0


def test_head_roles_threshold_and_significance():
    sweep = _role_sweep()
    strict = _as_dict(head_roles(sweep, threshold=0.05, n_boot=500))
    assert strict[((1, 0), "coherent")] == "negligible"  # 0.02 is below the threshold
    assert strict[((0, 0), "substitution")] == "memory"
    loose = _as_dict(head_roles(sweep, significant=False, n_boot=500))
    assert loose[((1, 1), "substitution")] == "memory"  # the noisy head's means alone say "memory"
    assert loose[((1, 1), "coherent")] == "negligible"  # exact zeros stay negligible


def test_head_roles_read_amplification_the_other_way():
    amplified = _role_sweep(alpha=2.0, sign=-1.0)  # amplifying a memory head raises p(parametric)
    assert _as_dict(head_roles(amplified, alpha=2.0, n_boot=500)) == EXPECTED


def test_role_transitions():
    roles = head_roles(_role_sweep(), n_boot=500)
    table = role_transitions(roles, "substitution", "coherent")
    assert list(table.index) == list(ROLES) and list(table.columns) == list(ROLES)
    assert table.index.name == "substitution" and table.columns.name == "coherent"
    assert table.to_numpy().sum() == 4
    assert table.loc["memory", "context"] == 1 and table.loc["mixed", "mixed"] == 1
    assert table.loc["negligible", "context"] == 1 and table.loc["negligible", "negligible"] == 1
    back = role_transitions(roles, "coherent", "substitution")
    np.testing.assert_array_equal(back.to_numpy(), table.to_numpy().T)
    with pytest.raises(ValueError, match="no conflict types"):
        role_transitions(roles, "substitution", "clean")


def test_head_roles_errors_and_reproducibility():
    sweep = _role_sweep()
    with pytest.raises(ValueError, match="threshold must be a non-negative"):
        head_roles(sweep, threshold=-0.1)
    with pytest.raises(ValueError, match="alpha=1"):
        head_roles(sweep, alpha=1.0)
    with pytest.raises(ValueError, match="lacks targets"):
        head_roles(sweep[sweep.target == "parametric"])
    with pytest.raises(ValueError, match="n_boot"):
        head_roles(sweep, n_boot=-1)
    pd.testing.assert_frame_equal(head_roles(sweep, n_boot=300, seed=4), head_roles(sweep, n_boot=300, seed=4))
