"""The JuICE paper's theory toy (Section 5, Appendix G): run once vs run twice under superposition."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import plotly.graph_objects as go
import pytest
import torch

from cpsuper.plots.toys_juice import plot_juice_theory
from cpsuper.toys.juice_theory import (
    METHODS,
    TASKS,
    TheoryConfig,
    TheoryToy,
    closed_form_logits,
    conflict_switch,
    identify_heads,
    steer,
    steering_logits,
    theory_study,
)

BETAS = (0.0, -0.3, -0.5, -0.7, -1.0, -1.5)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def superposed():
    return TheoryToy.build(TheoryConfig())


@pytest.fixture(scope="module")
def separate():
    return TheoryToy.build(TheoryConfig(superposition=False))


def _row(frame, **keys):
    mask = np.ones(len(frame), dtype=bool)
    for k, v in keys.items():
        mask &= frame[k].to_numpy() == v
    assert mask.sum() == 1, keys
    return frame[mask].iloc[0]


def test_prompts_follow_the_papers_recipe(superposed):
    T = superposed.config.seq_len
    noise = set(superposed.noise.tolist())
    for task in TASKS:
        data = superposed.prompts(task, 64, seed=3)
        assert data.tokens.shape == (64, T)
        assert (data.tokens[:, -1] == 0).all()  # the final token is the trigger q
        for row, toks in enumerate(data.tokens.tolist()):
            body = toks[:-1]
            n_q = body.count(0)
            assert n_q == (0 if task == "recall" else 1)
            if task != "recall":
                j = body.index(0)
                assert 1 <= j <= T - 3 and body[j + 1] == data.context[row] and body[j + 1] in noise
            if task != "induction":
                subject = data.parametric[row].item() - superposed.config.n_facts
                assert body.count(subject) == 1
            filler = [t for t in body if t in noise]
            assert len(filler) == len(set(filler))  # noise drawn without replacement
    again = superposed.prompts("conflict", 64, seed=3)
    assert torch.equal(again.tokens, superposed.prompts("conflict", 64, seed=3).tokens)


def test_perfect_solver_proposition_5_2(superposed, separate):
    for toy in (superposed, separate):
        frame = steer(toy, [0.0], tasks=["recall", "induction"], n_prompts=128)
        assert (frame.accuracy_clean == 1.0).all()
        assert (frame.p_clean > 0.99).all()


@pytest.mark.parametrize("superposition", [True, False])
def test_model_matches_the_papers_closed_form(superposition, superposed, separate):
    toy = superposed if superposition else separate
    rows = torch.arange(32)
    for task in TASKS:
        data = toy.prompts(task, 32, seed=1)
        for method, beta in [
            (None, 0.0),
            ("run_once", -0.4),
            ("run_twice", -0.4),
            ("run_once", -1.0),
            ("run_twice", -1.5),
        ]:
            if method is None:
                logits = toy.model(data.tokens)[:, -1]
            else:
                logits = steering_logits(toy.model, data.tokens, toy.context_heads, beta, method)
            expected = closed_form_logits(toy.config, task, method, beta)
            for target, answer in (("parametric", data.parametric), ("context", data.context)):
                if (answer < 0).any():
                    assert math.isnan(expected[target])
                    continue
                got = logits[rows, answer].detach()
                assert torch.allclose(got, torch.full_like(got, expected[target]), atol=1e-3), (task, method, target)


def test_conflict_follows_corollary_5_4():
    frame = conflict_switch(TheoryConfig(), (3, 4, 6, 8), n_prompts=64)
    for r in frame.itertuples():
        winner = r.share_parametric if r.predicted == "parametric" else r.share_context
        assert winner == 1.0, r
    assert set(frame.predicted) == {"parametric", "context"}


def test_both_heads_are_identified_as_context_heads(superposed, separate):
    roles = identify_heads(superposed, n_prompts=64)
    assert roles.loc[roles.role == "context", ["layer", "head"]].values.tolist() == [[0, 0], [1, 0]]
    roles = identify_heads(separate, n_prompts=64)
    by_head = {(r.layer, r.head): r.role for r in roles.itertuples()}
    assert by_head == {(0, 0): "context", (0, 1): "neither", (1, 0): "context", (1, 1): "parametric"}


def test_zero_strength_is_exactly_clean(superposed):
    data = superposed.prompts("conflict", 32)
    with torch.inference_mode():
        clean = superposed.model(data.tokens)[:, -1]
    for method in METHODS:
        steered = steering_logits(superposed.model, data.tokens, superposed.context_heads, 0.0, method)
        assert torch.equal(steered, clean)
        assert not torch.equal(
            steering_logits(superposed.model, data.tokens, superposed.context_heads, -0.3, method), clean
        )


@pytest.fixture(scope="module")
def sweep(superposed, separate):
    return [steer(t, BETAS, tasks=["conflict", "recall"], n_prompts=64) for t in (superposed, separate)]


def test_run_twice_beats_run_once_under_superposition(superposed, sweep):
    frame = sweep[0]
    once = _row(frame, method="run_once", beta=-1.0, task="conflict", target="parametric")
    twice = _row(frame, method="run_twice", beta=-1.0, task="conflict", target="parametric")
    assert once.accuracy_clean == 0.0  # the induction part dominates before steering
    # Proposition 5.5: removing both heads in one pass leaves every token at chance ...
    assert once.accuracy == 0.0 and once.p == pytest.approx(1 / superposed.config.vocab, abs=1e-3)
    # ... while the dual run recovers the fact.
    assert twice.accuracy == 1.0 and twice.p > 0.99
    conflict = frame[(frame.task == "conflict") & (frame.target == "parametric")]
    best = conflict.groupby("method").p.max()
    assert best["run_twice"] > 0.99 and best["run_once"] < 0.5
    beyond = conflict[conflict.beta < -1]
    assert (beyond[beyond.method == "run_twice"].accuracy == 1.0).all()
    assert (beyond[beyond.method == "run_once"].accuracy == 0.0).all()


def test_without_superposition_both_methods_work(sweep):
    frame = sweep[1]
    conflict = frame[(frame.task == "conflict") & (frame.target == "parametric") & (frame.beta <= -0.3)]
    assert (conflict.accuracy == 1.0).all() and (conflict.p > 0.9).all()
    recall = frame[frame.task == "recall"]
    assert (recall.accuracy == 1.0).all()


def test_recall_prompts_see_no_difference_between_the_methods(superposed, sweep):
    recall = sweep[0][sweep[0].task == "recall"].pivot_table(index="beta", columns="method", values="p")
    assert np.allclose(recall["run_once"], recall["run_twice"], atol=1e-6)
    # ... and the superposed head's recall fades for both as the strength grows
    assert recall.loc[-1.0].max() < 0.05
    data = superposed.prompts("recall", 16)
    a, b = (steering_logits(superposed.model, data.tokens, superposed.context_heads, -0.6, m) for m in METHODS)
    assert torch.allclose(a, b, atol=1e-5)


def test_near_orthogonal_embeddings_keep_the_claim():
    toy = TheoryToy.build(TheoryConfig(orthogonal=False, d_model=512))
    frame = steer(toy, [-1.0], tasks=["conflict"], n_prompts=64)
    assert _row(frame, method="run_twice", target="parametric").accuracy > 0.9
    assert _row(frame, method="run_once", target="parametric").accuracy < 0.1


def test_study_and_figure():
    frame = theory_study(TheoryConfig(n_noise=12, n_facts=4), betas=(0.0, -1.0), n_prompts=16)
    assert set(frame.model) == {"superposed", "separate"}
    assert set(frame.heads) == {"0.0 1.0"}
    fig = plot_juice_theory(frame)
    assert isinstance(fig, go.Figure)
    names = {t.name for t in fig.data}
    assert {"run once (JuNe / PH3)", "run twice (JuICE)"} <= names
    assert len(fig.data) == 2 * 2 * 2 * 2  # panels x methods x (p, accuracy)


def test_bad_input(superposed):
    with pytest.raises(ValueError, match="seq_len"):
        TheoryConfig(seq_len=4)
    with pytest.raises(ValueError, match="n_noise"):
        TheoryConfig(n_noise=3)
    with pytest.raises(ValueError, match="d_model"):
        TheoryConfig(d_model=32)
    with pytest.raises(ValueError, match="task"):
        superposed.prompts("coherent")
    with pytest.raises(ValueError, match="method"):
        steering_logits(superposed.model, superposed.prompts("recall", 2).tokens, [(0, 0)], -1.0, "run_thrice")
    with pytest.raises(ValueError, match="method"):
        closed_form_logits(replace(superposed.config), "recall", "twice")
