"""The analysis helpers of scripts/finetune_inversion_variants.py: the rise and fall of one run,
how reliance tracks attention across checkpoints (against hand computations), and which earlier
rows ``--append`` keeps."""

import importlib.util
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import cpsuper as cp


@pytest.fixture(scope="module")
def script():
    pytest.importorskip("plotly")
    path = Path(__file__).parents[1] / "scripts" / "finetune_inversion_variants.py"
    spec = importlib.util.spec_from_file_location("finetune_inversion_variants", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _frame(attention: np.ndarray, margin: np.ndarray, steps, run="mlp", relations=None) -> pd.DataFrame:
    """Long rows as ``measure`` writes them: facts x checkpoints of two quantities, one prompt."""
    n_facts = attention.shape[0]
    relations = relations or ["official_language"] * n_facts
    rows = []
    for quantity, values in (("attention_context", attention), ("context_margin", margin)):
        for i in range(n_facts):
            for j, step in enumerate(steps):
                rows.append(
                    dict(run=run, step=step, fact=f"f{i}", relation=relations[i], conflict_type="substitution")
                    | dict(quantity=quantity, value=float(values[i, j]))
                )
    return pd.DataFrame(rows)


def _spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Rank correlation by hand: average ranks, then Pearson."""
    rx, ry = pd.Series(x).rank().to_numpy(), pd.Series(y).rank().to_numpy()
    return float(np.corrcoef(rx, ry)[0, 1])


def test_tracking_matches_hand_computations(script):
    rng = np.random.default_rng(1)
    steps = [0, 20, 40, 60]
    attention = rng.normal(size=(9, 4))
    margin = 0.5 * attention + rng.normal(size=(9, 4))
    margin[3] = 2.0  # a fact whose margin never moves: no within-fact correlation
    got = script.tracking(_frame(attention, margin, steps), n_boot=200).set_index("statistic")
    assert got.loc["checkpoint_means", "estimate"] == pytest.approx(
        np.corrcoef(attention.mean(0), margin.mean(0))[0, 1]
    )
    assert got.loc["pooled_rank", "estimate"] == pytest.approx(_spearman(attention.ravel(), margin.ravel()))
    within = [_spearman(a, m) for i, (a, m) in enumerate(zip(attention, margin)) if i != 3]
    assert got.loc["within_fact_rank", "estimate"] == pytest.approx(np.mean(within))
    assert (got.n_facts == 9).all() and (got.n_steps == 4).all()
    assert ((got.ci_low <= got.estimate + 1e-12) & (got.estimate - 1e-12 <= got.ci_high)).all()
    boot = []  # the interval by hand: resample facts, correlate the resampled checkpoint means
    for counts in cp.stats.resample_counts(9, n_boot=200, seed=0):
        drawn = np.repeat(np.arange(9), counts)
        boot.append(np.corrcoef(attention[drawn].mean(0), margin[drawn].mean(0))[0, 1])
    assert got.loc["checkpoint_means", ["ci_low", "ci_high"]].tolist() == pytest.approx(
        np.quantile(boot, [0.025, 0.975]).tolist()
    )

    later = script.tracking(_frame(attention, margin, steps), from_step=20, n_boot=50).set_index("statistic")
    assert later.loc["checkpoint_means", "estimate"] == pytest.approx(
        np.corrcoef(attention[:, 1:].mean(0), margin[:, 1:].mean(0))[0, 1]
    )
    assert (later.n_steps == 3).all()


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_tracking_is_exactly_one_for_an_increasing_map(script, sign):
    rng = np.random.default_rng(2)
    attention = rng.uniform(0.1, 0.3, size=(7, 5))
    margin = sign * (4.0 * attention + 1.0)  # linear: all three statistics are +-1 in every resample
    got = script.tracking(_frame(attention, margin, [0, 20, 40, 60, 80]), n_boot=100)
    assert np.allclose(got[["estimate", "ci_low", "ci_high"]].to_numpy(), sign)


def test_peak_then_last_picks_the_peak_of_the_chosen_run_and_facts(script):
    steps = [0, 20, 40, 60]
    curve = np.array([[1.0, 5.0, 3.0, 2.0], [0.0, 4.0, 7.0, 1.0], [2.0, 6.0, 2.0, 2.0]])  # means peak at step 20
    relations = ["world_capital", "world_capital", "official_language"]
    per = pd.concat(
        [
            _frame(curve, curve, steps, run="qk", relations=relations),
            _frame(curve, curve[:, ::-1], steps, run="mlp", relations=relations),  # another run, peaking elsewhere
        ]
    )
    got = script.peak_then_last(per, "qk").set_index(["quantity", "change"])
    rise, fall = got.loc[("context_margin", "rise")], got.loc[("context_margin", "fall")]
    assert (rise.from_step, rise.to_step, fall.from_step, fall.to_step) == (0, 20, 20, 60)
    assert rise["mean"] == pytest.approx(np.mean(curve[:, 1] - curve[:, 0]))
    assert fall["mean"] == pytest.approx(np.mean(curve[:, 3] - curve[:, 1]))
    capitals = script.peak_then_last(per, "qk", "world_capital").set_index(["quantity", "change"])
    assert capitals.loc[("context_margin", "rise"), "to_step"] == 40  # the capitals alone peak at step 40
    assert capitals.loc[("context_margin", "fall"), "mean"] == pytest.approx(np.mean(curve[:2, 3] - curve[:2, 2]))
    assert set(capitals.run) == {"qk"} and set(capitals.facts) == {"world_capital"}


def test_previous_rows_drop_the_runs_named_again_and_keep_one_base_model(script):
    steps = [0, 20, 40]
    values = np.arange(6, dtype=float).reshape(2, 3)
    old = pd.concat([_frame(values, values, steps, run="mlp"), _frame(values, values, [0, 40], run="qk")])
    kept, base = script.previous_rows(old, ["qk", "mlp-no-capitals"])
    assert set(kept.run) == {"mlp"} and len(kept) == len(old[old.run == "mlp"])
    assert "run" not in base and (base.step == 0).all()
    assert len(base) == 2 * 2  # two facts x two quantities, once each although two runs measured step 0
