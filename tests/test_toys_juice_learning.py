"""Proposition 5.3 of the JuICE paper: gradient descent from zero learns the superposed layer."""

from __future__ import annotations

import pytest
import torch

from cpsuper.toys.juice_learning import layer_forward, layer_readouts, learn_second_layer
from cpsuper.toys.juice_theory import TheoryConfig, TheoryToy

SMALL = TheoryConfig(n_facts=4, n_noise=12, seq_len=6, d_model=80)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def learned():
    return learn_second_layer(SMALL, steps=60, lr=10.0, n_train=256, n_eval=128, record_every=1)


def _construction(toy):
    return toy.model.W_K[1, 0].double(), toy.model.W_V[1, 0].double().T


def test_forward_and_readouts_reproduce_the_construction():
    toy = TheoryToy.build(SMALL)
    W_KQ, W_OV = _construction(toy)
    data = toy.prompts("conflict", 32)
    _, cache = toy.model.run_with_cache(data.tokens)
    ours = layer_forward(cache["blocks.1.hook_resid_pre"].double(), W_KQ, W_OV, toy.model.W_U.double())
    assert torch.allclose(ours.float(), toy.model(data.tokens)[:, -1], atol=1e-3)
    r = layer_readouts(toy, W_KQ, W_OV)
    for name in ("c1", "c2", "c3", "c4"):
        assert r[name] == pytest.approx(getattr(SMALL, name), abs=1e-4)
    assert r["cos_kq"] == pytest.approx(1.0) and r["cos_ov"] == pytest.approx(1.0)


def test_first_step_learns_values_only_then_scores(learned):
    h = learned.history.set_index("step")
    assert (h.loc[0, ["c1", "c2", "c3", "c4"]] == 0).all()
    assert h.loc[1, "c1"] == 0 and h.loc[1, "c2"] == 0  # W_KQ has no gradient while W_OV is zero
    assert h.loc[1, "c3"] > 0 and h.loc[1, "c4"] > 0
    assert h.loc[5, "c1"] > 0 and h.loc[5, "c2"] > 0


def test_gradient_descent_reaches_the_superposed_solution(learned):
    last = learned.history.iloc[-1]
    assert last.acc_recall == 1.0 and last.acc_induction == 1.0
    assert learned.history.loss.iloc[-1] < 0.5 * learned.history.loss.iloc[0]
    assert last.c1 > last.c2 > 0 and last.c3 > 0 and last.c4 > 0
    assert last.cos_kq > 0.6 and last.cos_ov > 0.6
    # Corollary 5.4 with the learned constants predicts the conflict answer the model gives
    assert last.predicted == "context" and last.conflict_context == 1.0


def test_learned_layer_is_written_into_the_toy(learned):
    toy = learned.toy
    W_KQ, W_OV = _construction(toy)
    assert torch.allclose(W_KQ, learned.W_KQ, atol=1e-5) and torch.allclose(W_OV, learned.W_OV, atol=1e-5)
