"""The two toys of "How Truncating Weights Improves Reasoning" (noisy in-context recall, linear
associative memory): data statistics, frozen weights, checkpoints, and the paper's qualitative
observables at CI size (fixed seeds, one CPU core, well under a minute in all)."""

import ast
import math
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
import pytest
import torch

from cpsuper.backend import backend_of, default_backend, is_model
from cpsuper.interventions import Knockout, intervene
from cpsuper.plots.toys import plot_associative_memory, plot_noisy_recall
from cpsuper.plots.toys_truncation import (
    plot_ffn_variants,
    plot_one_step_margins,
    plot_trigger_matching,
    plot_truncation_figure1,
    plot_value_truncation,
)
from cpsuper.toys import associative_memory as am
from cpsuper.toys import margins as mg
from cpsuper.toys import noisy_recall as nr
from cpsuper.toys import noisy_recall_task as nrt
from cpsuper.toys import noisy_recall_variants as nv
from cpsuper.toys.build import read_weight, toy_parameter
from cpsuper.toys.common import checkpoint_steps
from cpsuper.truncation import low_rank_approx

# ---------------------------------------------------------------------------------------------
# Noisy in-context recall


@pytest.fixture(scope="module")
def recall_run():
    return nr.train_noisy_recall(nrt.NoisyRecallConfig(), progress=False)


def _final(run, data, measure, condition="full"):
    return nr.trajectory(run, data, measure, condition).iloc[-1]


def test_generator_noise_fraction_and_outputs():
    cfg = nrt.NoisyRecallConfig()
    gen = torch.Generator().manual_seed(5)
    chain = nrt.BigramChain.random(cfg.n_tokens, cfg.trigger, cfg.trigger_rate, cfg.concentration, gen)
    alpha = 0.3
    batch = nrt.sample_recall_batch(chain, 2000, cfg.seq_len, cfg.trigger, alpha, gen)
    after = torch.cat([batch.tokens, batch.targets[:, -1:]], 1)  # the whole sequence z_0..z_T
    follows = after[:, 1:][after[:, :-1] == cfg.trigger]
    ybar = batch.ybar[:, None].expand_as(after[:, 1:])[after[:, :-1] == cfg.trigger]
    # After a trigger only ybar or noise can come, and noise with probability alpha.
    assert bool(((follows == ybar) | (follows == cfg.noise)).all())
    frac = (follows == cfg.noise).double().mean().item()
    sigma = math.sqrt(alpha * (1 - alpha) / len(follows))
    assert abs(frac - alpha) < 4 * sigma, (frac, len(follows))
    # ybar is never the trigger; noise never appears except after a trigger.
    assert not bool((batch.ybar == cfg.trigger).any())
    noise_pos = after[:, 1:] == cfg.noise
    assert bool((after[:, :-1][noise_pos] == cfg.trigger).all())
    clean = nrt.sample_recall_batch(chain, 200, cfg.seq_len, cfg.trigger, 0.0, gen)
    assert not bool((clean.tokens == cfg.noise).any())


def test_generator_bigram_transitions():
    gen = torch.Generator().manual_seed(1)
    chain = nrt.BigramChain.random(8, trigger=0, trigger_rate=0.2, concentration=1.0, generator=gen)
    assert torch.allclose(chain.bigram.sum(-1), torch.ones(8))
    assert torch.allclose(chain.unigram @ chain.bigram, chain.unigram, atol=1e-5)  # stationary
    batch = nrt.sample_recall_batch(chain, 3000, 40, trigger=0, alpha=0.5, generator=gen)
    src, dst = batch.tokens.flatten(), batch.targets.flatten()
    for token in (1, 4):  # transitions out of non-trigger tokens follow the bigram row
        nxt = dst[src == token]
        freq = torch.bincount(nxt, minlength=9)[:8].double() / len(nxt)
        assert (freq - chain.bigram[token].double()).abs().max() < 0.03
        assert bool((nxt != 8).all())  # never noise outside triggers


def test_bigram_from_text_counts():
    chain, chars = nrt.BigramChain.from_text("abab ba")
    assert chars == [" ", "a", "b"]
    a, b, space = 1, 2, 0
    assert chain.unigram.tolist() == pytest.approx([1 / 7, 3 / 7, 3 / 7])
    # "ab" x2, "ba" x2 (one after a space), "b " x1, " b" x1: rows are next-character frequencies.
    assert chain.bigram[a].tolist() == pytest.approx([0, 0, 1])
    assert chain.bigram[b].tolist() == pytest.approx([1 / 3, 2 / 3, 0])
    assert chain.bigram[space].tolist() == pytest.approx([0, 0, 1])


def test_recall_mask_matches_brute_force():
    gen = torch.Generator().manual_seed(2)
    chain = nrt.BigramChain.random(10, trigger=3, trigger_rate=0.25, generator=gen)
    batch = nrt.sample_recall_batch(chain, 50, 30, trigger=3, alpha=0.5, generator=gen)
    repeat = nrt.recall_mask(batch.tokens, batch.ybar, 3, "repeat")
    for b in range(50):
        z, y = batch.tokens[b].tolist(), int(batch.ybar[b])
        for t in range(30):
            seen = any(z[s - 1] == 3 and z[s] == y for s in range(1, t))
            n_before = sum(1 for s in range(t + 1) if z[s] == 3)
            assert bool(batch.recall[b, t]) == (z[t] == 3 and seen)
            assert bool(repeat[b, t]) == (z[t] == 3 and n_before >= 2)
    assert batch.recall.any()


def _trainable(model) -> set[int]:
    return {id(p) for p in model.parameters() if p.requires_grad}


def test_model_is_a_plain_transformer_lens_model():
    cfg = nrt.NoisyRecallConfig(d_model=16, seq_len=12, n_tokens=6)
    model = nrt.noisy_recall_model(cfg)
    assert is_model(model) and backend_of(model) == default_backend()
    assert model.cfg.n_layers == 2 and model.cfg.n_heads == 1 and model.cfg.d_head == 16
    assert model.cfg.normalization_type is None and model.cfg.act_fn == "relu" and model.cfg.d_vocab == 7
    names = nrt.trainable_parameter_names(model)
    assert _trainable(model) == {id(toy_parameter(model, n)) for n in names} and len(names) == 10
    frozen_kinds = ("embed", "pos_embed", "unembed")
    assert not any(n.startswith(frozen_kinds) or ".b_" in n or "W_Q" in n for n in names)
    assert torch.equal(model.blocks[0].attn.W_Q[0], torch.eye(16))
    # Knocking out the second MLP through cpsuper's intervention changes the logits.
    tokens = torch.randint(6, (2, 12))
    with intervene(model, Knockout(1, "mlp")):
        dropped = model(tokens)
    assert not torch.allclose(dropped, model(tokens))


def test_frozen_parameters_do_not_change(recall_run):
    first, last = recall_run.model_at(0), recall_run.model_at()
    trainable = set(nrt.trainable_parameter_names(first))
    assert trainable.isdisjoint({"embed.W_E", "pos_embed.W_pos", "unembed.W_U", "blocks.1.attn.W_Q"})
    for name in nrt.weight_shapes(recall_run.config):
        moved = not torch.equal(read_weight(first, name), read_weight(last, name))
        assert moved == (name in trainable), name


def test_checkpoints_every_k_and_probes_per_checkpoint(recall_run):
    cfg = recall_run.config
    expected = checkpoint_steps(cfg.steps, cfg.checkpoint_every, cfg.extra_checkpoints)
    assert recall_run.steps == expected
    assert all(s % cfg.checkpoint_every == 0 for s in expected if s not in cfg.extra_checkpoints)
    assert sorted(recall_run.probes.step.unique()) == expected
    # Consecutive checkpoints hold different weights (they are copies, not one shared tensor).
    w = [state["blocks.1.mlp.W_in"] for _, state in recall_run.checkpoints]
    assert not torch.equal(w[-1], w[-2])
    assert checkpoint_steps(10, 4, (1, 99)) == [0, 1, 4, 8, 10]


def test_checkpoint_reload_gives_same_outputs_and_probes(recall_run, tmp_path):
    path = tmp_path / "run.pt"
    recall_run.save(path)
    loaded = nr.NoisyRecallRun.load(path)
    assert loaded.config == recall_run.config
    assert loaded.probes.equals(recall_run.probes)
    step = recall_run.steps[len(recall_run.steps) // 2]
    tokens = torch.randint(loaded.config.n_tokens, (3, loaded.config.seq_len))
    assert torch.equal(loaded.model_at(step)(tokens), recall_run.model_at(step)(tokens))
    # Re-running the probes on the reloaded checkpoint reproduces the recorded values.
    cfg = loaded.config
    test_gen = torch.Generator().manual_seed(cfg.seed + 2)
    noisy = nrt.sample_recall_batch(loaded.chain, cfg.n_test, cfg.seq_len, cfg.trigger, cfg.alpha, test_gen)
    clean = nrt.sample_recall_batch(loaded.chain, cfg.n_test, cfg.seq_len, cfg.trigger, 0.0, test_gen)
    again = nr.recall_probes(loaded.model_at(step), noisy, clean, cfg)
    recorded = recall_run.probes[(recall_run.probes.step == step) & (recall_run.probes.data != "train")]
    expected = recorded["value"].to_numpy()
    assert again["value"].to_numpy() == pytest.approx(expected, rel=1e-4, abs=1e-6, nan_ok=True)
    with pytest.raises(ValueError, match="holds a"):
        am.AssocMemoryRun.load(path)


def test_noise_is_learned_early_then_settles_near_alpha(recall_run):
    alpha = recall_run.config.alpha
    p_noise = nr.trajectory(recall_run, "noisy", "p_noise")
    assert p_noise[0] < 0.1  # random init: about 1 / vocabulary
    assert p_noise[p_noise.index <= 15].max() > 0.7  # overshoots toward 1 in the first steps
    late = p_noise[p_noise.index >= recall_run.config.steps * 0.6]
    assert alpha / 2 <= late.mean() <= 2 * alpha
    assert abs(late.mean() - alpha) < 0.1
    p_correct = nr.trajectory(recall_run, "noisy", "p_correct")
    assert p_correct[p_correct.index <= 15].max() < 0.1  # the induction head comes later


def test_dropping_mlp2_on_clean_data_removes_noise(recall_run):
    full_noise = _final(recall_run, "clean", "p_noise")
    full_correct = _final(recall_run, "clean", "p_correct")
    drop_noise = _final(recall_run, "clean", "p_noise", "drop mlp2")
    drop_correct = _final(recall_run, "clean", "p_correct", "drop mlp2")
    assert full_correct > 0.25  # an induction head has formed (chance is about 1/23)
    assert drop_noise < full_noise - 0.15
    assert drop_correct > full_correct + 0.15
    assert _final(recall_run, "clean", "clean_loss", "drop mlp2") < _final(recall_run, "clean", "clean_loss")
    # Rank truncation of W_in sits in between: less noise than the full model.
    for condition in recall_run.probes.condition.unique():
        if condition.startswith("mlp2 W_in rank"):
            assert _final(recall_run, "clean", "p_noise", condition) < full_noise
    # The second MLP pushes toward noise, not toward ybar.
    assert _final(recall_run, "clean", "mlp2_noise_logit") > 1.0
    assert _final(recall_run, "clean", "mlp2_noise_logit") > _final(recall_run, "clean", "mlp2_correct_logit")


def test_second_layer_attention_avoids_noise(recall_run):
    to_correct = _final(recall_run, "noisy", "attn2_to_correct")
    to_noise = _final(recall_run, "noisy", "attn2_to_noise")
    assert to_correct > 5 * to_noise
    assert to_correct > nr.trajectory(recall_run, "noisy", "attn2_to_correct")[0] * 3
    assert _final(recall_run, "noisy", "attn1_prev") > 0.25  # previous-token head in layer 1


def test_layer2_attention_map_matches_the_mean_probe(recall_run):
    model, cfg = recall_run.model_at(), recall_run.config
    batch = nrt.sample_recall_batch(
        recall_run.chain, 32, cfg.seq_len, cfg.trigger, cfg.alpha, torch.Generator().manual_seed(5)
    )
    maps = pd.concat([nr.layer2_attention_map(model, batch, cfg, row).assign(row=row) for row in range(32)])
    assert set(maps.kind) <= {"ybar", "noise", "rest"} and {"ybar", "noise"} <= set(maps.kind)
    keys = maps[maps.kind != "rest"]
    assert (keys.key < keys["query"]).all()
    assert (batch.tokens[keys.row.values, keys.key.values - 1] == cfg.trigger).all()  # keys follow the trigger
    assert maps.groupby(["row", "query"]).weight.sum().sub(1).abs().max() < 1e-5
    _, cache = model.run_with_cache(batch.tokens)
    stats = nr._attention_stats(cache, batch, cfg.noise)  # the mean probe over the same pairs
    assert keys[keys.kind == "ybar"].weight.mean() == pytest.approx(stats["attn2_to_correct"], abs=1e-5)
    assert keys[keys.kind == "noise"].weight.mean() == pytest.approx(stats["attn2_to_noise"], abs=1e-5)


def test_finetuning_on_noise_learns_it_in_a_few_steps_on_top_of_the_head():
    cfg = nrt.NoisyRecallConfig(lr=0.05, steps=10, checkpoint_every=5, extra_checkpoints=(1, 2, 3))
    pre, fine = nr.finetune_noisy_recall(cfg, pretrain_steps=150, progress=False)
    assert pre.config.alpha == 0.0 and fine.config.alpha == cfg.alpha
    start = fine.state_at(0)
    assert all(torch.equal(start[k], v) for k, v in pre.state_at().items())  # finetuning starts where pretraining ended
    p_noise = nr.trajectory(fine, "noisy", "p_noise")
    assert _final(pre, "clean", "p_correct") > 0.8 and p_noise[0] < 0.05  # clean model: head, no noise
    assert p_noise.loc[1:].max() > 0.3  # the noise is picked up within a few finetuning steps
    to_noise = nr.trajectory(fine, "noisy", "attn2_to_noise")
    assert to_noise.iloc[-1] < 0.5 * to_noise[0]  # the second layer stops attending to noise keys
    assert nr.trajectory(fine, "noisy", "attn1_prev").min() > 0.25  # the previous-token head is kept


def test_probes_leave_the_weights_unchanged(recall_run):
    model = recall_run.model_at()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = recall_run.config
    gen = torch.Generator().manual_seed(0)
    batch = nrt.sample_recall_batch(recall_run.chain, 16, cfg.seq_len, cfg.trigger, cfg.alpha, gen)
    nr.recall_probes(model, batch, batch, cfg)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not model.hook_dict["blocks.1.hook_mlp_out"].fwd_hooks


def test_noisy_recall_figure_and_configs(recall_run):
    fig = plot_noisy_recall(recall_run)
    assert isinstance(fig, go.Figure) and len(fig.data) >= 10
    paper = nrt.NoisyRecallConfig.paper()
    assert (paper.n_tokens, paper.d_model, paper.seq_len, paper.batch_size, paper.alpha, paper.lr) == (
        65,
        256,
        256,
        512,
        0.5,
        0.03,
    )
    with pytest.raises(ValueError, match="alpha"):
        nrt.NoisyRecallConfig(alpha=1.5)
    with pytest.raises(ValueError, match="n_tokens"):
        nr.train_noisy_recall(nrt.NoisyRecallConfig(n_tokens=5), chain=recall_run.chain, progress=False)


# ---------------------------------------------------------------------------------------------
# Linear associative memory


@pytest.fixture(scope="module")
def memory_run():
    return am.train_associative_memory(am.AssocMemoryConfig(), progress=False)


def test_assoc_logits_and_low_rank_exact():
    gen = torch.Generator().manual_seed(0)
    W = torch.randn(3, 6, 6, generator=gen, dtype=torch.float64)
    E = torch.randn(3, 2, 6, generator=gen, dtype=torch.float64)
    U = torch.randn(3, 4, 6, generator=gen, dtype=torch.float64)
    logits = am.assoc_logits(W, E, U)
    assert logits[1, 0, 3].item() == pytest.approx((U[1, 3] @ W[1] @ E[1, 0]).item())
    s = torch.linalg.svdvals(W)
    for k in (1, 3):
        Wk = low_rank_approx(W, k)
        assert (torch.linalg.matrix_rank(Wk) == k).all()
        err = torch.linalg.matrix_norm(W - Wk)  # Eckart-Young: the dropped singular values
        assert torch.allclose(err, s[:, k:].square().sum(-1).sqrt())
    assert torch.allclose(low_rank_approx(W, 6), W)


def test_assoc_label_statistics():
    p = am.assoc_targets(3, 0.2)
    assert p.sum(-1).tolist() == pytest.approx([1, 1, 1]) and p[1, 1] == pytest.approx(0.8)
    x, y = am.sample_assoc_labels(3, 0.2, 20000, torch.Generator().manual_seed(0))
    noise = (y == 3).double().mean().item()
    assert abs(noise - 0.2) < 4 * math.sqrt(0.2 * 0.8 / 20000)
    assert bool(((y == x) | (y == 3)).all())


def test_full_memory_learns_noise_at_rate_alpha(memory_run):
    alpha = memory_run.config.alpha
    last = memory_run.probes[memory_run.probes.step == memory_run.config.steps]
    full = last[last.model == "full"].pivot(index="seed", columns="measure", values="value")
    assert full.accuracy.min() == 1.0
    assert full.p_noise.median() == pytest.approx(alpha, abs=0.01)
    assert full.pure_loss.median() == pytest.approx(-math.log(1 - alpha), abs=0.005)


def test_rank_truncation_beats_full_memory_on_clean_labels(memory_run):
    last = memory_run.probes[(memory_run.probes.step == memory_run.config.steps)]
    pure = last[last.measure == "pure_loss"].pivot(index="seed", columns="model", values="value")
    assert (pure["rank 2"] < pure["full"]).sum() >= 15  # of 20 seeds
    assert pure["rank 2"].median() < 0.6 * pure["full"].median()
    assert pure["rank 1"].median() > pure["full"].median()  # too much truncation hurts
    summary = am.summarize_memory(memory_run)
    assert set(summary.columns) >= {"step", "model", "median", "q25", "q75"}
    first = summary[(summary.step == 0) & (summary.model == "rank 2")]["median"].item()
    assert first > pure["rank 2"].median()


def test_memory_checkpoints_and_reload(memory_run, tmp_path):
    cfg = memory_run.config
    assert memory_run.steps == checkpoint_steps(cfg.steps, cfg.checkpoint_every, cfg.extra_checkpoints)
    path = tmp_path / "memory.pt"
    memory_run.save(path)
    loaded = am.AssocMemoryRun.load(path)
    assert loaded.config == cfg
    for step in (0, 100, cfg.steps):
        assert torch.equal(loaded.logits_at(step, rank=2), memory_run.logits_at(step, rank=2))
    W = loaded.state_at(100)["W"]
    again = am.memory_probes(W, loaded.extras["inputs"], loaded.extras["outputs"], cfg.alpha, cfg.ranks)
    recorded = memory_run.probes[memory_run.probes.step == 100]
    assert again["value"].to_numpy() == pytest.approx(recorded["value"].to_numpy())
    assert not torch.equal(memory_run.state_at(100)["W"], memory_run.state_at(150)["W"])


def test_memory_figure(memory_run):
    fig = plot_associative_memory(memory_run)
    assert isinstance(fig, go.Figure) and len(fig.data) == 2 * (len(memory_run.config.ranks) + 1)


# ---------------------------------------------------------------------------------------------
# Layout: the toys draw nothing; old spellings still resolve


def test_toys_import_no_plotting_library():
    for path in sorted((Path(__file__).parent.parent / "cpsuper" / "toys").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [a.name for a in node.names]
            assert not any(n.startswith(("plotly", "cpsuper.plots")) or n == "plots" for n in names), path.name


# ---------------------------------------------------------------------------------------------
# Appendix A variants (Figures 8, 10-12) and Theorem 1's one-step margins


def test_several_triggers_each_emit_their_own_output():
    gen = torch.Generator().manual_seed(3)
    triggers = (0, 1, 2)
    chain = nrt.BigramChain.random(12, triggers, trigger_rate=0.3, generator=gen)
    assert chain.bigram[:, list(triggers)].sum(-1).min() >= 0.3 - 1e-6  # the rate is shared by the triggers
    batch = nrt.sample_recall_batch(chain, 300, 40, triggers, alpha=0.4, generator=gen)
    assert batch.ybar.shape == (300, 3) and not bool((batch.ybar < 3).any())  # no trigger is an output
    z = torch.cat([batch.tokens, batch.targets[:, -1:]], 1)
    for k, q in enumerate(triggers):
        after = z[:, 1:][z[:, :-1] == q]
        own = batch.ybar[:, k : k + 1].expand(-1, 40)[z[:, :-1] == q]
        assert bool(((after == own) | (after == 12)).all())  # trigger q -> its own output or noise
        assert abs((after == 12).double().mean().item() - 0.4) < 0.06
    for b in range(40):  # brute force: recall where the same trigger was already followed by its output
        zz = batch.tokens[b].tolist()
        for t in range(40):
            k = triggers.index(zz[t]) if zz[t] in triggers else None
            y = int(batch.ybar[b, k]) if k is not None else None
            seen = k is not None and any(zz[s - 1] == zz[t] and zz[s] == y for s in range(1, t))
            assert bool(batch.recall[b, t]) == seen
            assert int(batch.answers[b, t]) == int(batch.ybar[b, k if k is not None else 0])
    with pytest.raises(ValueError, match="extra_triggers"):
        nrt.NoisyRecallConfig(extra_triggers=(0,))


def test_feed_forward_variants_are_linear_or_absent():
    cfg = nrt.NoisyRecallConfig(d_model=8, seq_len=10, n_tokens=6, ffn=("linear", "none"))
    model = nrt.noisy_recall_model(cfg)
    x = torch.randn(2, 10, 8)
    lin, none = model.blocks[0].mlp, model.blocks[1].mlp
    assert torch.allclose(lin(x), x @ lin.W_out[:8], atol=1e-6)  # one d x d matrix
    assert torch.allclose(lin(2 * x) - lin(x), lin(x), atol=1e-5)  # linear, not ReLU
    assert torch.equal(none(x), torch.zeros_like(x))
    trainable = nrt.trainable_parameter_names(model, cfg.ffn)
    assert _trainable(model) == {id(toy_parameter(model, n)) for n in trainable}
    assert {"blocks.0.mlp.W_in", "blocks.1.mlp.W_in", "blocks.1.mlp.W_out"}.isdisjoint(trainable)
    assert "blocks.0.mlp.W_out" in trainable
    with pytest.raises(ValueError, match="ffn"):
        nrt.NoisyRecallConfig(ffn=("mlp", "conv"))


def test_rho_outside_zero_one_is_refused():
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"\(0, 1\]"):
            nrt.NoisyRecallConfig(value_truncation_fractions=(bad,))
        with pytest.raises(ValueError, match=r"\(0, 1\]"):
            nv.check_fractions([0.5, bad])
    assert nv.check_fractions([1, 0.05]) == (1.0, 0.05)


@pytest.fixture(scope="module")
def attention_only_run():
    cfg = nrt.NoisyRecallConfig(
        ffn=("none", "none"), value_truncation_fractions=(0.05, 0.5), steps=40, checkpoint_every=20, n_test=64
    )
    return nr.train_noisy_recall(cfg, progress=False)


def test_attention_only_run_and_value_truncation(attention_only_run):
    run = attention_only_run
    first, last = run.model_at(0), run.model_at()
    for name in ("blocks.0.mlp.W_in", "blocks.0.mlp.W_out", "blocks.1.mlp.W_out"):
        after = read_weight(last, name)
        assert not after.any() and torch.equal(read_weight(first, name), after)  # no feed-forward at all
    conditions = set(run.probes.condition)
    assert "drop mlp1" not in conditions and "drop mlp2" not in conditions  # nothing to drop
    assert {"attn1 W_O rank 3", "attn1 W_O rank 32"} <= conditions  # floor(rho * 64)
    model, cfg = run.model_at(), run.config
    gen = torch.Generator().manual_seed(9)
    clean = nrt.sample_recall_batch(run.chain, 32, cfg.seq_len, cfg.triggers, 0.0, gen)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    table = nv.value_truncation_stats(model, clean, cfg.noise, [1.0, 0.05])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # restored
    full = nv.answer_stats(model(clean.tokens), clean, cfg.noise)
    got = table[table.rho == 1.0].set_index("measure")["value"]
    assert got["p_noise"] == pytest.approx(full["p_noise"]) and got["p_correct"] == pytest.approx(full["p_correct"])
    low = table[table.rho == 0.05].set_index("measure")["value"]
    assert low["p_noise"] != pytest.approx(full["p_noise"])  # rank 3 of 64 changes the model
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        nv.value_truncation_stats(model, clean, cfg.noise, [0.0])
    assert isinstance(plot_value_truncation(table), go.Figure)


def test_ffn_variant_table_lines_runs_up(recall_run, attention_only_run):
    table = nv.ffn_variant_table({"main": recall_run, "attention only": attention_only_run})
    assert set(table.ffn) == {"mlp/mlp", "none/none"}
    main = table[(table.variant == "main") & (table.measure == "p_noise")].set_index("condition")["value"]
    assert main["drop mlp2"] < main["full"]  # the paper's Figure 9 / 3, as in the main run
    assert "drop mlp1" in main.index
    fig = plot_ffn_variants(table)
    assert isinstance(fig, go.Figure) and len(fig.data) == 3 * 2


def test_trigger_matching_is_large_only_at_trigger_pairs(recall_run):
    matching = nv.trigger_matching(recall_run.model_at(), recall_run.config.triggers)
    vocab = recall_run.config.d_vocab
    assert len(matching) == vocab * vocab and matching.match.sum() == 1
    summary = nv.trigger_matching_summary(matching)
    # The trained induction head keys on "previous token was the trigger" for a trigger query.
    assert summary["gap"] > 0 and summary["match_mean"] > 5 * abs(summary["rest_mean"])
    untrained = nv.trigger_matching_summary(nv.trigger_matching(recall_run.model_at(0), recall_run.config.triggers))
    assert summary["match_mean"] > untrained["match_mean"] + 1
    fig = plot_trigger_matching({"trained": matching, "step 0": nv.trigger_matching(recall_run.model_at(0), (0,))})
    assert isinstance(fig, go.Figure) and len(fig.data) == 2


def test_variant_configs_cover_the_figures():
    ci = nv.variant_configs(nrt.NoisyRecallConfig)
    paper = nv.variant_configs(nrt.NoisyRecallConfig, paper=True)
    assert paper["five_triggers"].triggers == (1, 39, 43, 53, 58) and paper["one_trigger"].triggers == (1,)
    assert len(ci["five_triggers"].triggers) == 5
    assert (ci["mlp_linear"].ffn, ci["linear_mlp"].ffn, ci["attention_only"].ffn) == (
        ("mlp", "linear"),
        ("linear", "mlp"),
        ("none", "none"),
    )
    assert paper["attention_only"].d_model == 256 and 0.05 in paper["attention_only"].value_truncation_fractions


def test_one_step_margins_agree_with_theorem_1():
    # Fixed seeds; N = T = 50, alpha = 0.5, eta_f = eta_v = 1. Tolerances: every margin within the
    # theorem's bound (O-constant 1, delta = 0.05); at m = 4096 the step-size-scaled margins within
    # 0.03 of alpha (feed-forward) and of alpha_hat (value).
    frame = mg.one_step_margins((32, 4096), seeds=(0, 1), n_test=128)
    assert frame.within_bound.all(), frame
    assert (frame.kq_grad_norm == 0).all()  # the key-query matrix gets no gradient at zero
    big = frame[frame.m == 4096].groupby("block")[["scaled_margin", "scaled_predicted", "margin"]].mean()
    assert abs(big.loc["feed_forward", "scaled_margin"] - 0.5) < 0.03
    assert abs(big.loc["value", "scaled_margin"] - big.loc["value", "scaled_predicted"]) < 0.03
    # With equal step sizes the value block's margin is about 1/N of the feed-forward block's.
    assert big.loc["value", "margin"] == pytest.approx(big.loc["feed_forward", "margin"] / 50, rel=0.1)
    small = frame[frame.m == 32].groupby("block")["error"].apply(lambda e: e.abs().mean())
    large = frame[frame.m == 4096].groupby("block")["error"].apply(lambda e: e.abs().mean())
    assert (large < small).all()  # the deviation shrinks with the sample size
    assert isinstance(plot_one_step_margins(frame), go.Figure)
    with pytest.raises(ValueError, match="sample_sizes"):
        mg.one_step_margins((0,))


def test_figure1_plot_from_sweep_table():
    rows = []
    for edit, matrix, rhos in (("truncate", "mlp_in", (0.1, 1.0)), ("drop", "mlp", (float("nan"),))):
        for layer in (0, 1):
            for rho in rhos:
                for cand, token in (("io", " Mary"), ("generic", " the")):
                    rows.append({"edit": edit, "matrix": matrix, "layer": layer, "rho": rho, "candidate": cand,
                                 "token": token, "p": 0.5})  # fmt: skip
    fig = plot_truncation_figure1(pd.DataFrame(rows))
    assert isinstance(fig, go.Figure) and len(fig.data) == 2 * 2
    assert sorted(fig.data[0].x) == [0.0, 0.1, 1.0]  # the drop is drawn at rho = 0
