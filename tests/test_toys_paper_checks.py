"""Checks of paper claims on the toys: the finetuning toy's gap sweeps and salience probes,
Theorem 2 of the truncation paper on the associative memory, and Proposition 2 of the inversion
paper (subject-only points)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from cpsuper.toys import associative_memory as am
from cpsuper.toys import inversion_subject as isub
from cpsuper.toys.common import toy_matrices
from cpsuper.toys.finetuning import FinetuningConfig, FinetuningToy
from cpsuper.toys.finetuning_salience import (
    erasure_thresholds,
    fact_salience,
    imbalance_accuracy,
    pretraining_counts,
    relevance_terms,
    spearman,
)
from cpsuper.toys.finetuning_sweeps import gap_summary, gap_sweep
from cpsuper.toys.inversion import InversionConfig, InversionToy

pytestmark = pytest.mark.usefixtures("one_thread")


SMALL = FinetuningConfig(
    n_subjects=40, pretrain_steps=300, pretrain_checkpoint_every=100, finetune_steps=40, checkpoint_every=10
)


@pytest.fixture(scope="module")
def small_toy():
    return FinetuningToy(SMALL).train()


# ---------------------------------------------------------------------------------------------
# Finetuning toy: sweeps and salience


def test_gap_sweep_reads_the_runs_it_trains(small_toy):
    runs, subjects = gap_sweep(SMALL, "zipf_alpha", [1.0], seeds=(0,))
    row = runs.iloc[0]
    acc = small_toy.probes.query("measure == 'acc_eval'")
    for split, run in (("top", "FT-Top"), ("bottom", "FT-Bottom")):
        series = acc[acc.run == run].set_index("step")["value"].sort_index()
        assert row[f"{split}_best"] == series.max() and row[f"{split}_final"] == series.iloc[-1]
        # Per-subject final accuracies average to the run's final held-out accuracy.
        assert subjects[split].mean() == pytest.approx(row[f"{split}_final"], abs=1e-6)
    assert row["gap_best"] == pytest.approx(row["top_best"] - row["bottom_best"])
    summary = gap_summary(runs, subjects, "zipf_alpha", n_boot=200)
    assert summary["gap_final"].iloc[0] == pytest.approx(row["gap_final"], abs=1e-6)
    assert summary["gap_final_lo"].iloc[0] <= summary["gap_final"].iloc[0] <= summary["gap_final_hi"].iloc[0]
    with pytest.raises(ValueError, match="not a FinetuningConfig field"):
        gap_sweep(SMALL, "zipf", [1.0])


def test_pretraining_counts_replay_the_stream_and_salience_follows_them(small_toy):
    data = small_toy.data
    counts = pretraining_counts(data, SMALL)
    assert counts.sum() == SMALL.pretrain_steps * SMALL.pretrain_batch
    # The replay is the stream the toy trained on: after one SGD step, exactly the drawn subjects'
    # value columns have moved (one-hot embeddings).
    one = FinetuningConfig(**{**SMALL.__dict__, "pretrain_steps": 1, "pretrain_checkpoint_every": 1})
    toy = FinetuningToy(one)
    toy.pretrain()
    _, v0 = toy_matrices(toy.model_at("pretrain", 0))
    _, v1 = toy_matrices(toy.model_at("pretrain", 1))
    moved = (v1 - v0)[:, : data.n_subjects].abs().sum(0) > 0
    drawn = pretraining_counts(toy.data, one).sum(1) > 0
    assert torch.equal(moved, drawn)
    # Salience is W_V[a, s], and it grows with how often (s, r) was seen (Theorem 4.6's direction).
    _, w_v = toy_matrices(small_toy.model_at("pretrain", SMALL.pretrain_steps))
    sal = fact_salience(small_toy.model_at("pretrain", SMALL.pretrain_steps), data)
    assert sal[3, 1] == w_v[data.answer[3, 1], 3]
    assert spearman(sal.flatten().numpy(), counts.flatten().numpy()) > 0.3
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)


def test_relevance_drive_is_the_prompt_score_gradient(small_toy):
    """Theorem 4.5's form: an example moves W_KQ[p_r, p_r] by -sigma_s sigma_p (s_rel - p_rel)."""
    data = small_toy.data
    model = small_toy.model_at("FT-Bottom", 20).train()
    subjects = data.splits["bottom"]
    terms = relevance_terms(model, data, subjects)
    tokens, labels, _ = data.examples(subjects, "qa")
    w_k = model.blocks[0].attn.W_K
    (grad,) = torch.autograd.grad(torch.nn.functional.cross_entropy(model(tokens)[:, -1], labels, reduction="sum"), w_k)
    for r, p in enumerate(data.prompt_tokens.tolist()):
        assert terms[terms.relation == r]["drive"].sum() == pytest.approx(-grad[0, p, p].item(), rel=1e-4, abs=1e-6)
    # One small step on a single example moves a held-out subject's attention against the sign of
    # s_rel - p_rel of that example.
    held = data.eval_subjects[:1]
    for i in (int(terms["diff"].idxmin()), int(terms["diff"].idxmax())):
        m = small_toy.model_at("FT-Bottom", 20)
        before = relevance_terms(m, data, held)
        rel = int(terms.relation[i])
        opt = torch.optim.SGD([q for q in m.parameters() if q.requires_grad], lr=1e-2)
        torch.nn.functional.cross_entropy(m(tokens[i : i + 1])[:, -1], labels[i : i + 1]).backward()
        opt.step()
        after = relevance_terms(m, data, held)
        change = (after.attn_subject - before.attn_subject)[before.relation == rel].item()
        assert np.sign(change) == np.sign(terms["diff"][i])


def test_erasure_threshold_predicts_accuracy_under_forced_attention(small_toy):
    data = small_toy.data
    model = small_toy.model_at("FT-Top", SMALL.finetune_steps)
    grid = np.linspace(0.0125, 0.9875, 40)  # off the interval ends of every fact below
    for s in data.eval_subjects.tolist()[:8]:
        th = erasure_thresholds(model, data, torch.tensor([s]))
        ends = np.concatenate([th["lower"], th["upper"]])
        assert not np.isclose(ends[:, None], grid).any()
        acc = imbalance_accuracy(model, data, torch.tensor([s]), grid)["accuracy"].to_numpy()
        inside = (grid[:, None] > th["lower"].to_numpy()) & (grid[:, None] < th["upper"].to_numpy())
        np.testing.assert_allclose(acc, inside.mean(1))
        correct_at_half = (th["lower"] < 0.5) & (0.5 < th["upper"])
        assert th["threshold"].notna().equals(correct_at_half)


# ---------------------------------------------------------------------------------------------
# Truncation paper, Theorem 2


def test_expected_loss_gradient_matches_autograd():
    gen = torch.Generator().manual_seed(1)
    W = torch.randn(2, 5, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    e, u = torch.randn(2, 2, 5, dtype=torch.float64), torch.randn(2, 3, 5, dtype=torch.float64)
    targets = am.assoc_targets(2, 0.3).expand(2, 2, 3)
    loss = -(targets / 2 * am.assoc_logits(W, e, u).log_softmax(-1)).sum()
    (grad,) = torch.autograd.grad(loss, W)
    assert torch.allclose(am.expected_loss_gradient(W.detach(), e, u, targets), grad, atol=1e-12)


def test_theorem2_rank_one_noise_decays_like_inverse_sqrt_t():
    flow = am.theorem2_flow((0.25, 0.35), lr=0.2, steps=4000, n_points=25)
    last = flow[flow.step == 4000].set_index(["alpha", "model"])
    for a in (0.25, 0.35):
        assert last.loc[(a, "full"), "p_noise"] == pytest.approx(a, abs=0.01)  # the full model keeps the noise
        assert last.loc[(a, "rank 1"), "p_noise"] < 0.1 < a  # the rank-1 model drops it
        assert last.loc[(a, "rank 1"), "p_clean"] > 0.88
    rate = am.fit_rate(flow, t_min=50)
    assert rate["slope"].between(-0.6, -0.4).all()
    # The truncated model's noise keeps falling once training is under way.
    late = flow[(flow.model == "rank 1") & (flow.t >= 50)]
    assert all((g.sort_values("t")["p_noise"].diff().dropna() < 0).all() for _, g in late.groupby("alpha"))
    with pytest.raises(ValueError, match="alpha"):
        am.theorem2_flow((0.0,))


# ---------------------------------------------------------------------------------------------
# Inversion paper, Proposition 2


@pytest.fixture(scope="module")
def subject_points():
    cfg = InversionConfig()
    points = isub.add_subject_points(cfg, 5)
    toy = InversionToy(cfg)
    toy.data = points.data
    return cfg, points, toy.pretrained_model()


def test_subject_points_are_memorized_and_unused(subject_points):
    cfg, points, model = subject_points
    data = points.data
    assert not set(points.tokens[:, 0].tolist()) & set(data.train_tokens[:, 1].tolist())
    assert (points.tokens[:, 1] == data.relation).all()
    # Alone, an S subject's value readout gives its answer with probability delta_M.
    readout = data.readout[:, points.tokens[:, 0]].T.softmax(-1)
    assert torch.allclose(readout[torch.arange(5), points.labels], torch.full((5,), cfg.delta_m, dtype=torch.float64))
    logits, pattern = isub.subject_point_logits(model, points.tokens)
    assert torch.allclose(pattern[:, 0], torch.full((5,), 0.5))  # r unmasked for S prompts
    with pytest.raises(ValueError, match="unused subjects"):
        isub.add_subject_points(cfg, 6)


def test_subject_points_raise_theta_s_projection_and_leave_theta_c(subject_points):
    _, points, model = subject_points
    proj = isub.kq_gradient_projections(model, points).set_index("kind")
    old = proj.loc[["C", "C+S"]].sum()
    new = proj.sum()
    assert proj.loc["S", "theta_C"] == 0.0
    assert proj.loc["S", "theta_S"] > 0
    assert new["theta_S"] > old["theta_S"] and new["theta_C"] == old["theta_C"]
    # The projection equals the explicit gradient of W_KQ read on theta and phi(r).
    data = points.data
    mask = data.train_mask(("C",))
    w_k = model.blocks[0].attn.W_K
    w_k.requires_grad_(True)
    loss = torch.nn.functional.cross_entropy(
        model(data.train_tokens[mask])[:, -1], data.train_tokens[mask, 0], reduction="sum"
    )
    (grad,) = torch.autograd.grad(loss, w_k)
    d = data.embed.shape[1]
    r = data.embed[data.relation].float()
    explicit = -(data.theta_subject.float() @ grad[0, :d] @ r).item()
    assert proj.loc["C", "theta_S"] == pytest.approx(explicit, rel=1e-4)


def test_training_with_subject_points_raises_attention_to_subject():
    cfg = InversionConfig()
    base = isub.train_with_subject_points(cfg, 0)
    ref = InversionToy(cfg).train().probes
    mc = base[base.measure == "M_C"].set_index("step")["value"]
    assert np.allclose(mc.to_numpy(), ref[ref.measure == "M_C"].sort_values("step")["value"].to_numpy(), atol=1e-6)
    more = isub.train_with_subject_points(cfg, 5)
    att = {n: p[p.measure == "attn_subject"].set_index("step")["value"] for n, p in (("0", base), ("5", more))}
    assert att["5"].iloc[1] > att["0"].iloc[1]  # the first step already differs
    assert att["5"].iloc[-1] > att["0"].iloc[-1]
    assert math.isfinite(more[more.measure == "loss_S"]["value"].iloc[-1])
    assert set(pd.unique(more["run"])) == {"+5 S"}


def test_percentile_gap_keeps_each_runs_most_popular_subjects():
    from cpsuper.toys.finetuning_sweeps import percentile_gap

    # two seeds, held-out subjects in popularity order (smaller id = more popular), made-up accuracies
    subjects = pd.DataFrame(
        {
            "zipf_alpha": 1.0,
            "seed": [0, 0, 0, 0, 1, 1, 1, 1],
            "subject": [3, 8, 1, 20, 5, 2, 9, 40],
            "top": [1.0, 0.0, 1.0, 0.0, 0.5, 1.0, 0.0, 0.0],
            "bottom": [0.0, 0.0, 0.5, 1.0, 0.0, 0.0, 1.0, 1.0],
        }
    )
    rows = percentile_gap(subjects, fractions=(0.25, 0.5, 1.0), n_boot=200).set_index("fraction")
    # top 25 %: subject 1 (seed 0) and subject 2 (seed 1); top 50 %: subjects 1, 3 and 2, 5
    assert rows.loc[0.25, ["top", "bottom", "n_units"]].tolist() == [1.0, 0.25, 2]
    assert rows.loc[0.5, ["top", "bottom"]].tolist() == [0.875, 0.125]
    assert rows.loc[0.5, "gap"] == pytest.approx(0.75)
    assert rows.loc[1.0, "gap"] == pytest.approx(subjects.top.mean() - subjects.bottom.mean())
    assert (rows.gap_lo <= rows.gap).all() and (rows.gap <= rows.gap_hi).all()
    with pytest.raises(ValueError, match="fractions"):
        percentile_gap(subjects, fractions=(0.0,))
