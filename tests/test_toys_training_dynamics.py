"""Training-dynamics toys: context-parametric inversion and well-known vs less-known fact finetuning."""

from __future__ import annotations

import dataclasses
import math
import warnings

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest
import torch

from cpsuper.plots.toys import plot_finetuning, plot_inversion
from cpsuper.toys.build import read_weight, write_weights
from cpsuper.toys.common import KQ_PARAM, toy_matrices
from cpsuper.toys.finetuning import (
    FinetuningConfig,
    FinetuningToy,
    finetuning_measures,
    make_finetuning_data,
    pretraining_batch,
)
from cpsuper.toys.inversion import (
    InversionConfig,
    InversionToy,
    context_reliance_closed_form,
    inversion_measures,
    make_inversion_data,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _series(probes: pd.DataFrame, measure: str, run: str | None = None) -> pd.Series:
    d = probes[probes["measure"] == measure]
    if run is not None:
        d = d[d["run"] == run]
    return d.set_index("step")["value"].sort_index()


# ---------------------------------------------------------------------------------------------
# Inversion toy


@pytest.fixture(scope="module")
def inversion():
    return InversionToy().train()


def test_inversion_data_statistics():
    cfg = InversionConfig()
    data = make_inversion_data(cfg)
    k_s, k_a = cfg.n_subjects, cfg.n_answers
    assert data.train_kind.count("C") == cfg.n_context_only
    assert data.train_kind.count("C+S") == cfg.n_context_subject
    assert len(data.test_tokens) == cfg.n_test
    subjects = torch.cat([data.train_tokens[:, 1], data.test_tokens[:, 1]])
    contexts = torch.cat([data.train_tokens[:, 0], data.test_tokens[:, 0], data.test_param_answer])
    assert len(set(subjects.tolist())) == len(subjects) and subjects.max() < k_s  # each subject once
    assert len(set(contexts.tolist())) == len(contexts)  # test contexts and answers unseen in training
    assert ((contexts >= k_s) & (contexts < k_s + k_a)).all()
    assert (data.train_tokens[:, 2] == data.relation).all() and (data.test_tokens[:, 2] == data.relation).all()
    # Readouts: context alone gives its answer with delta_c; memorized subject alone gives delta_m;
    # a C subject is uniform over answers.
    probs = data.readout.softmax(0)
    for c, _s, _ in data.train_tokens.tolist():
        assert probs[c, c] == pytest.approx(cfg.delta_c, abs=1e-9)
    for (c, s, _), kind in zip(data.train_tokens.tolist(), data.train_kind, strict=True):
        answers = probs[k_s : k_s + k_a, s]
        if kind == "C+S":
            assert probs[c, s] == pytest.approx(cfg.delta_m, abs=1e-9)
        else:
            assert torch.allclose(answers, answers[0].expand_as(answers))
    for s, a in zip(data.test_tokens[:, 1].tolist(), data.test_param_answer.tolist(), strict=True):
        assert probs[a, s] == pytest.approx(cfg.delta_m, abs=1e-9)
    # Embeddings: unit norm, 1/2 within subjects and within contexts, orthogonal across and to r.
    gram = data.embed @ data.embed.T
    assert torch.allclose(gram.diagonal(), torch.ones(len(gram), dtype=gram.dtype))
    assert gram[0, 1] == pytest.approx(0.5) and gram[k_s, k_s + 1] == pytest.approx(0.5)
    assert gram[0, k_s] == pytest.approx(0.0) and gram[data.relation, :-1].abs().max() < 1e-12
    # A different seed draws different token roles.
    other = make_inversion_data(dataclasses.replace(cfg, seed=1))
    assert not torch.equal(other.train_tokens, data.train_tokens)


def test_inversion_model_realises_the_pretrained_readouts(inversion):
    model = inversion.pretrained_model()
    w_kq, w_v = toy_matrices(model)
    phi = inversion.data.embed.float().T
    assert torch.allclose(phi.T @ w_v @ phi, inversion.data.readout.float(), atol=2e-4)
    assert torch.count_nonzero(w_kq) == 1  # only the relation's self-score (the mask)


def _hand_mc(model, data, i):
    """M_C of test prompt ``i`` computed from the weights with numpy, relation masked exactly."""
    w_kq, w_v = (m.double().numpy() for m in toy_matrices(model))
    phi = data.embed.numpy()
    c, s, r = data.test_tokens[i].tolist()
    a = int(data.test_param_answer[i])
    scores = np.array([phi[c] @ w_kq @ phi[r], phi[s] @ w_kq @ phi[r]])
    sig = np.exp(scores - scores.max())
    sig /= sig.sum()
    z = phi @ w_v @ (sig[0] * phi[c] + sig[1] * phi[s])
    p = np.exp(z - z.max())
    p /= p.sum()
    return p[c] / (p[c] + p[a]), sig[0]


def test_mc_probe_equals_hand_computation(inversion):
    model = inversion.model_at(5)
    one = dataclasses.replace(
        inversion.data,
        test_tokens=inversion.data.test_tokens[2:3],
        test_param_answer=inversion.data.test_param_answer[2:3],
    )
    got = inversion_measures(model, one)
    want, sigma_c = _hand_mc(model, one, 0)
    assert got["M_C"] == pytest.approx(want, abs=1e-5)
    assert got["attn_context"] == pytest.approx(sigma_c, abs=1e-6)
    assert abs(want - 0.25) > 0.05  # the checkpoint has moved: the check is not the trivial start


@pytest.mark.parametrize("u", [0.0, 1.5, -2.0])
def test_mc_follows_closed_form_in_attention(u):
    cfg = InversionConfig()
    toy = InversionToy(cfg)
    model = toy.pretrained_model()
    theta_c = int(toy.data.theta_context.argmax())
    w_kq = read_weight(model, KQ_PARAM).detach().clone()
    w_kq[0, theta_c, toy.data.relation + 2] = u  # phi(r) is basis vector vocab+1
    write_weights(model, {KQ_PARAM: w_kq})
    got = inversion_measures(model, toy.data)
    sigma_c = 1 / (1 + math.exp(-u / math.sqrt(2)))
    assert got["attn_context"] == pytest.approx(sigma_c, abs=1e-6)
    assert got["M_C"] == pytest.approx(context_reliance_closed_form(sigma_c, cfg), abs=1e-5)
    if u == 0.0:
        assert got["M_C"] == pytest.approx(0.25, abs=1e-6)


def test_inversion_rises_then_falls_and_ablation_removes_the_fall(inversion):
    mc = _series(inversion.probes, "M_C")
    assert mc.iloc[0] == pytest.approx(0.25, abs=1e-5)
    assert mc.max() > mc.iloc[0] + 0.1
    assert mc.max() - mc.iloc[-1] > 0.05  # measured: 0.397 at step 4 -> 0.329 at step 40
    attn = _series(inversion.probes, "attn_context")
    assert attn.idxmax() == mc.idxmax() and attn.max() - attn.iloc[-1] > 0.02
    loss_c, loss_cs = _series(inversion.probes, "loss_C"), _series(inversion.probes, "loss_C+S")
    assert loss_c.iloc[-1] < loss_c.iloc[0] and loss_cs.iloc[-1] < loss_cs.iloc[0]

    ablated = InversionToy(inversion.config.ablated()).train()
    mc_ab = _series(ablated.probes, "M_C")
    assert mc_ab.iloc[-1] >= mc_ab.max() - 1e-4  # no fall
    assert mc_ab.iloc[-1] > 0.8
    assert set(ablated.probes["run"]) == {"C only"}


def test_theorem_regime_two_steps():
    mc = _series(InversionToy(InversionConfig.theorem()).train().probes, "M_C")
    assert list(mc.index) == [0, 1, 2]
    assert mc[1] > mc[0] and mc[1] > mc[2]


def test_inversion_checkpoints_every_k_and_reload(tmp_path):
    cfg = InversionConfig(steps=10, checkpoint_every=3, train_value=True, lr=2.0)
    toy = InversionToy(cfg).train()
    assert toy.trajectory.steps == [0, 3, 6, 9, 10]
    assert sorted(toy.probes["step"].unique()) == [0, 3, 6, 9, 10]
    k3, v3 = toy_matrices(toy.model_at(3))
    k6, v6 = toy_matrices(toy.model_at(6))
    assert not torch.equal(k3, k6) and not torch.equal(v3, v6)  # snapshots are copies, not aliases
    # Re-measuring a reloaded checkpoint gives exactly the recorded probes.
    again = inversion_measures(toy.model_at(6), toy.data)
    recorded = toy.probes[toy.probes["step"] == 6].set_index("measure")["value"]
    assert again == pytest.approx(recorded.to_dict(), abs=0)
    path = tmp_path / "inversion.pt"
    toy.save(path)
    back = InversionToy.load(path)
    assert back.config == cfg
    tokens = toy.data.test_tokens
    for step, make in back.model_factories():
        assert torch.equal(make()(tokens), toy.model_at(step)(tokens))
    pd.testing.assert_frame_equal(back.probes, toy.probes)
    with pytest.raises(KeyError, match="No checkpoint at step 4"):
        toy.model_at(4)


def test_inversion_trains_only_kq_by_default(inversion):
    _, v0 = toy_matrices(inversion.model_at(0))
    k_end, v_end = toy_matrices(inversion.model_at(inversion.config.steps))
    assert torch.equal(v0, v_end)
    assert not torch.equal(k_end, toy_matrices(inversion.model_at(0))[0])


def test_inversion_plot_and_errors(inversion):
    fig = plot_inversion(inversion.probes)
    assert isinstance(fig, go.Figure)
    names = {t.name for t in fig.data}
    assert any(n.startswith("M_C") for n in names) and any("attention to context" in n for n in names)
    with pytest.raises(ValueError, match="Not enough tokens"):
        InversionConfig(n_subjects=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        InversionConfig(delta_m=0.15)
    assert any("assumptions" in str(w.message) for w in caught)
    with pytest.raises(RuntimeError, match="Train the toy first"):
        _ = InversionToy().probes


# ---------------------------------------------------------------------------------------------
# Finetuning toy


@pytest.fixture(scope="module")
def finetuning():
    return FinetuningToy().train()


def test_finetuning_data_statistics():
    cfg = FinetuningConfig()
    data = make_finetuning_data(cfg)
    n_s, n_r = cfg.n_subjects, cfg.n_relations
    assert data.vocab_size == n_s + 2 * n_r + n_r * cfg.answers_per_relation
    for r in range(n_r):  # every answer belongs to its relation's answer set
        assert set(data.answer[:, r].tolist()) <= set(data.answer_tokens[r].tolist())
    # Answer frequencies follow the 1/k marginal (within sampling error over subjects x relations).
    ranks = (data.answer - data.answer_tokens[:, :1].T).flatten()
    freq = torch.bincount(ranks, minlength=cfg.answers_per_relation).double() / len(ranks)
    assert (freq - data.answer_marginal).abs().max() < 0.06
    assert freq[0] == freq.max()
    # Zipf popularity; pool and held-out partition the subjects; top is more popular than bottom.
    assert data.popularity[0] / data.popularity[1] == pytest.approx(2**cfg.zipf_alpha)
    assert data.popularity.sum() == pytest.approx(1.0)
    pool, held = set(data.ft_pool.tolist()), set(data.eval_subjects.tolist())
    assert not pool & held and len(pool | held) == n_s
    top, bottom = data.splits["top"], data.splits["bottom"]
    assert len(top) == len(bottom) == len(pool) // 2 and not set(top.tolist()) & set(bottom.tolist())
    assert data.popularity[top].min() > data.popularity[bottom].max()
    assert data.popularity[data.eval_subjects].max() > data.popularity[bottom].max()  # spans popularity
    # Pretraining stream: subject frequencies match the popularity law, relations are uniform.
    tokens, labels = pretraining_batch(data, 200_000, torch.Generator().manual_seed(0))
    emp = torch.bincount(tokens[:, 0], minlength=n_s).double() / len(tokens)
    assert (emp - data.popularity).abs().max() < 0.004
    rel = torch.bincount(tokens[:, 1] - n_s, minlength=n_r).double() / len(tokens)
    assert (rel - 1 / n_r).abs().max() < 0.01
    assert torch.equal(labels, data.answer[tokens[:, 0], tokens[:, 1] - n_s])
    qa, qa_labels, subj = data.examples(top, "qa")
    assert set(qa[:, 1].tolist()) == set(data.prompt_tokens.tolist())
    assert torch.equal(qa_labels, data.answer[subj, qa[:, 1] - data.prompt_tokens[0]])


def test_finetuning_model_is_the_one_layer_model():
    toy = FinetuningToy()
    model = toy.initial_model()
    w_kq, w_v = toy_matrices(model)
    assert w_kq.var().item() == pytest.approx(1e-3, rel=0.05)
    assert w_v.var().item() == pytest.approx(1e-3, rel=0.05)
    tokens = torch.tensor([[3, toy.data.prompt_tokens[1]], [7, toy.data.relation_tokens[0]]])
    logits = model(tokens)[:, -1]
    for row, (s, q) in enumerate(tokens.tolist()):
        att = torch.softmax(torch.stack([w_kq[s, q], w_kq[q, q]]), 0)
        assert torch.allclose(logits[row], att[0] * w_v[:, s] + att[1] * w_v[:, q], atol=1e-6)


def test_finetuning_checkpoints_and_reload(tmp_path):
    cfg = FinetuningConfig(
        n_subjects=40, pretrain_steps=20, pretrain_checkpoint_every=7, finetune_steps=10, checkpoint_every=4
    )
    toy = FinetuningToy(cfg).train()
    assert toy.runs["pretrain"].steps == [0, 7, 14, 20]
    assert toy.runs["FT-Top"].steps == toy.runs["FT-Bottom"].steps == [0, 4, 8, 10]
    # Finetuning starts from the last pretraining checkpoint.
    tokens = toy.data.examples(toy.data.eval_subjects, "qa")[0]
    assert torch.equal(toy.model_at("FT-Top", 0)(tokens), toy.model_at("pretrain", 20)(tokens))
    again = finetuning_measures(toy.model_at("FT-Bottom", 8), toy.data, "bottom")
    rec = toy.probes.query("run == 'FT-Bottom' and step == 8").set_index("measure")["value"]
    assert again == pytest.approx(rec.to_dict(), abs=0)
    path = tmp_path / "finetuning.pt"
    toy.save(path)
    back = FinetuningToy.load(path)
    assert back.config == cfg and list(back.runs) == list(toy.runs)
    for run in toy.runs:
        for step, make in back.model_factories(run):
            assert torch.equal(make()(tokens), toy.model_at(run, step)(tokens))
    with pytest.raises(KeyError, match="No run"):
        toy.model_at("FT-Whole", 0)


def test_finetuning_reaches_held_out_subjects_only_through_the_prompt_token(finetuning):
    """The paper's 'global' effect: with one-hot embeddings, finetuning changes a held-out subject's
    attention only through W_KQ[p_r, p_r]; its own key entries and value column stay as pretrained."""
    data = finetuning.data
    pre_kq, pre_v = toy_matrices(finetuning.model_at("pretrain", finetuning.config.pretrain_steps))
    end_kq, end_v = toy_matrices(finetuning.model_at("FT-Bottom", finetuning.config.finetune_steps))
    held, p = data.eval_subjects, data.prompt_tokens
    assert torch.equal(end_kq[held][:, p], pre_kq[held][:, p])
    assert torch.equal(end_v[:, held], pre_v[:, held])
    assert not torch.equal(end_kq[p][:, p].diagonal(), pre_kq[p][:, p].diagonal())
    assert not torch.equal(end_v[:, p], pre_v[:, p])


def test_finetuning_on_well_known_facts_extracts_more(finetuning):
    probes = finetuning.probes
    stored = _series(probes, "stored_all", "pretrain")
    assert stored.iloc[-1] > 0.95  # every fact is stored in pretraining format...
    acc = {run: _series(probes, "acc_eval", run) for run in ("FT-Top", "FT-Bottom")}
    assert acc["FT-Top"].iloc[0] == acc["FT-Bottom"].iloc[0] < 0.35  # ...but not yet extractable as QA
    # Best held-out QA accuracy along the trajectory (early stopping): FT-Top well above FT-Bottom.
    assert acc["FT-Top"].max() > acc["FT-Bottom"].max() + 0.08
    # FT-Top also fits its own finetuning data sooner.
    fit = {run: _series(probes, "acc_ft", run) for run in acc}
    first = {run: s[s > 0.7].index.min() for run, s in fit.items()}
    assert first["FT-Top"] < first["FT-Bottom"]
    assert isinstance(plot_finetuning(finetuning.probes), go.Figure)
