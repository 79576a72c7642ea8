"""Forced attention imbalance (cpsuper.attention.rescaled_attention / rescale_span_attention) and
the helpers of scripts/attention_imbalance.py, against hand computations on tiny models."""

import importlib.util
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import cpsuper as cp
from cpsuper.attention import rescale_span_attention, rescaled_attention
from cpsuper.backend import saving_hooks
from cpsuper.interrupts import hooked
from cpsuper.runtime import pad_tokens, tokenize_prompts

PROMPTS = ["The capital city of France is", "Paris is the capital of"]


@pytest.fixture(scope="module")
def script():
    pytest.importorskip("plotly")
    path = Path(__file__).parents[1] / "scripts" / "attention_imbalance.py"
    spec = importlib.util.spec_from_file_location("attention_imbalance", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _batch(model, prompts=PROMPTS):
    """Right-padded tokens, mask, last index, and a span mask: positions 1 and 2 of each row."""
    tokens, mask, last = pad_tokens(model, tokenize_prompts(model, prompts), "right")
    span = torch.zeros_like(tokens, dtype=torch.bool)
    span[:, 1:3] = True
    return tokens, mask, last, span


def _run(model, tokens, mask):
    padded = bool((mask == 0).any())
    with torch.inference_mode():
        return model(tokens, attention_mask=mask if padded else None, padding_side="right")


def _by_hand(row: np.ndarray, span: np.ndarray, factor: float) -> np.ndarray:
    """One head's attention row with the span's weights times ``factor``, renormalised."""
    weights = np.array([factor if s else 1.0 for s in span])
    scaled = row * weights
    return scaled / scaled.sum()


def _patterns(model, tokens, mask, hooks_context):
    """Every layer's pattern just before and just after the rewriting hooks (one forward pass)."""
    names = [f"blocks.{layer}.attn.hook_pattern" for layer in range(model.cfg.n_layers)]
    before, after = {}, {}
    with hooked(model, saving_hooks(names, before, lambda p: p.clone())):
        with hooks_context, hooked(model, saving_hooks(names, after, lambda p: p.clone())):
            _run(model, tokens, mask)
    return names, before, after


def test_factor_one_leaves_the_logits_unchanged_bit_for_bit(tiny):
    tokens, mask, last, span = _batch(tiny)
    clean = _run(tiny, tokens, mask)
    with rescaled_attention(tiny, span, 1.0, query=last):
        same = _run(tiny, tokens, mask)
    assert torch.equal(clean, same)
    with rescaled_attention(tiny, span, 0.3, query=last):
        changed = _run(tiny, tokens, mask)
    assert not torch.allclose(clean[0, last[0]], changed[0, last[0]])


@pytest.mark.parametrize("factor", [0.0, 0.25, 3.0])
def test_rescaled_rows_match_a_hand_computation_in_every_layer(tiny, factor):
    tokens, mask, last, span = _batch(tiny)
    names, before, after = _patterns(tiny, tokens, mask, rescaled_attention(tiny, span, factor, query=last))
    for name in names:
        for b in range(tokens.shape[0]):
            q = int(last[b])
            old, new = before[name][b].numpy(), after[name][b].numpy()
            for head in range(tiny.cfg.n_heads):
                expected = _by_hand(old[head, q].astype(np.float64), span[b].numpy(), factor)
                np.testing.assert_allclose(new[head, q], expected, atol=1e-6)
                assert new[head, q].sum() == pytest.approx(1.0, abs=1e-5)
            others = [i for i in range(old.shape[1]) if i != q]
            np.testing.assert_array_equal(new[:, others], old[:, others])  # only the query rows change
            if factor == 0.0:
                assert np.all(new[:, q][:, span[b].numpy()] == 0)


def test_chosen_query_heads_only_within_a_shared_key_value_group(tiny_gemma):
    assert tiny_gemma.cfg.n_key_value_heads < tiny_gemma.cfg.n_heads  # grouped-query attention
    tokens, mask, last, span = _batch(tiny_gemma)
    context = rescaled_attention(tiny_gemma, span, 0.0, query=last, layers=[1], heads=[1])
    names, before, after = _patterns(tiny_gemma, tokens, mask, context)
    np.testing.assert_array_equal(after[names[0]].numpy(), before[names[0]].numpy())  # layer 0 untouched
    old, new = before[names[1]], after[names[1]]
    for b in range(tokens.shape[0]):
        q = int(last[b])
        # heads 0 and 1 read the same key-value head; only head 1 changes
        for head in (0, 2, 3):
            assert torch.equal(new[b, head], old[b, head])
        assert torch.all(new[b, 1, q][span[b]] == 0)
        assert new[b, 1, q].sum() == pytest.approx(1.0, abs=1e-5)


def test_each_padded_row_matches_its_own_unpadded_run(tiny):
    tokens, mask, last, span = _batch(tiny)
    with rescaled_attention(tiny, span, 0.1, query=last):
        batch = _run(tiny, tokens, mask)
    for b, prompt in enumerate(PROMPTS):
        single, _, single_last, single_span = _batch(tiny, [prompt])
        with rescaled_attention(tiny, single_span, 0.1, query=single_last):
            alone = _run(tiny, single, torch.ones_like(single))
        torch.testing.assert_close(batch[b, last[b]], alone[0, -1], atol=1e-4, rtol=1e-4)


def test_hooks_come_off_after_an_exception(tiny):
    tokens, mask, last, span = _batch(tiny)
    clean = _run(tiny, tokens, mask)
    with pytest.raises(RuntimeError, match="boom"):
        with rescaled_attention(tiny, span, 0.0, query=last):
            raise RuntimeError("boom")
    for layer in range(tiny.cfg.n_layers):
        assert not tiny.hook_dict[f"blocks.{layer}.attn.hook_pattern"].fwd_hooks
    assert torch.equal(_run(tiny, tokens, mask), clean)


def test_the_control_moves_the_same_mass_between_other_tokens():
    rows = torch.tensor([[[0.5, 0.2, 0.2, 0.1]], [[0.3, 0.1, 0.05, 0.55]]])  # [batch, head, key]
    span = torch.tensor([[False, True, False, False]] * 2)
    source = torch.tensor([[False, False, True, True]] * 2)
    target = torch.tensor([[True, False, False, False]] * 2)
    factor = 0.25
    new, asked, moved = rescale_span_attention(rows, span, factor, move_from=source, move_to=target)
    plain, plain_asked, _ = rescale_span_attention(rows, span, factor)
    for b in range(2):
        p = rows[b, 0].double().numpy()
        off = p[1] - _by_hand(p, span[b].numpy(), factor)[1]  # what the plain rescaling removes
        assert asked[b, 0].item() == pytest.approx(off, abs=1e-6)
        assert plain_asked[b, 0].item() == pytest.approx(off, abs=1e-6)
        assert p[1] - plain[b, 0, 1].item() == pytest.approx(off, abs=1e-6)
        s, t = p[2] + p[3], p[0]
        expected = np.array([t + off, p[1], p[2] * (s - off) / s, p[3] * (s - off) / s])  # t is token 0 alone
        np.testing.assert_allclose(new[b, 0].numpy(), expected, atol=1e-6)
        assert new[b, 0, 1] == rows[b, 0, 1]  # the subject keeps its weight
        assert new[b, 0].sum().item() == pytest.approx(1.0, abs=1e-6)
    torch.testing.assert_close(moved, asked)


def test_the_control_is_capped_at_what_the_source_holds():
    rows = torch.tensor([[[0.3, 0.6, 0.05, 0.05]]])
    span = torch.tensor([[False, True, False, False]])
    new, asked, moved = rescale_span_attention(
        rows,
        span,
        0.0,
        move_from=torch.tensor([[False, False, True, False]]),
        move_to=torch.tensor([[True] + [False] * 3]),
    )
    assert asked.item() == pytest.approx(0.6)
    assert moved.item() == pytest.approx(0.05)
    torch.testing.assert_close(new, torch.tensor([[[0.35, 0.6, 0.0, 0.05]]]))


def test_bad_masks_are_refused(tiny):
    tokens, _, last, span = _batch(tiny)
    with pytest.raises(ValueError, match="both"):
        rescale_span_attention(torch.ones(1, 1, 3) / 3, span[:1, :3], 0.5, move_from=span[:1, :3])
    with pytest.raises(ValueError, match="share"):
        rescale_span_attention(torch.ones(1, 1, 3) / 3, span[:1, :3], 0.5, move_from=span[:1, :3], move_to=span[:1, :3])
    with pytest.raises(ValueError, match="shape"):
        rescaled_attention(tiny, span, 0.5, query=last, move_from=span[:, :2], move_to=span[:, :2])
    with pytest.raises(ValueError, match="query"):
        rescaled_attention(tiny, span, 0.5, query=last[:1])
    with pytest.raises(ValueError, match="non-negative"):
        rescaled_attention(tiny, span, -1.0, query=last)


def test_script_scores_match_plain_logits_and_the_control_keeps_the_subject(script, tiny_gemma):
    data = cp.conflict_dataset("world_capital", n=4, tokenizer=tiny_gemma).with_prompts(["clean"])
    tokens, groups, answers = script.token_masks(tiny_gemma, data, list(range(4)))
    base = script.score(tiny_gemma, tokens, groups, answers, factor=1.0, condition="subject", layers=None, batch_size=3)
    for j, ids in enumerate(tokens):
        with torch.inference_mode():
            logits = tiny_gemma(torch.tensor([ids]))[0, -1]
        assert base.top1[j] == (int(logits.argmax()) == answers[j])
        assert base.p_true[j] == pytest.approx(float(logits.softmax(-1)[answers[j]]), rel=1e-4)
        other = logits.clone()
        other[answers[j]] = -torch.inf
        assert base.margin[j] == pytest.approx(float(logits[answers[j]] - other.max()), abs=1e-4)
    argmax = [int(tiny_gemma(torch.tensor([ids]))[0, -1].argmax()) for ids in tokens]
    top = script.score(tiny_gemma, tokens, groups, argmax, factor=1.0, condition="subject", layers=None, batch_size=3)
    assert top.top1.all() and (top.margin > 0).all()  # a margin over the runner-up, not over itself
    masks = script.padded_masks(groups, max(len(t) for t in tokens))
    assert not (masks["subject"] & masks["text"]).any() and not (masks["text"] & masks["bos"]).any()
    for j, g in enumerate(groups):
        assert masks["subject"][j].sum() == (g == "subject").sum() > 0
        assert masks["bos"][j, 0] and masks["text"][j, len(g) - 1]  # the last token is other text
    control = script.score(
        tiny_gemma, tokens, groups, answers, factor=0.0, condition="control", layers=None, batch_size=3
    )
    assert (control.moved <= control.asked + 1e-7).all() and (control.asked > 0).all()


def test_erasure_thresholds_take_the_first_loss_as_the_factor_falls(script):
    factors = [1.0, 0.5, 0.1, 0.0]
    top1 = {0: [1, 1, 0, 0], 1: [1, 1, 1, 1], 2: [1, 0, 1, 0], 3: [0, 0, 0, 0]}
    per_fact = pd.DataFrame(
        [
            {"fact": f, "condition": "subject", "layers": "all", "factor": x, "top1": bool(v)}
            for f, vals in top1.items()
            for x, v in zip(factors[::-1], vals[::-1], strict=True)  # stored in any order
        ]
        + [{"fact": 0, "condition": "subject", "layers": "late", "factor": 1.0, "top1": False}]
    )
    out = script.erasure_thresholds(per_fact).set_index("fact")
    assert out.threshold.tolist() == [0.1, 0.0, 0.5, 1.0]
    assert out.erased.tolist() == [True, False, True, True]
    assert out.recovers.tolist() == [False, False, True, False]
    assert out.kept_at.iloc[:3].tolist() == [0.5, 0.0, 1.0] and np.isnan(out.kept_at.iloc[3])


def test_spearman_interval_covers_the_rank_correlation(script):
    x = np.arange(40.0)
    y = x + np.random.default_rng(0).normal(0, 5, 40)
    got = script.spearman_interval(x, y, n_boot=200)
    expected = pd.Series(x).rank().corr(pd.Series(y).rank())
    assert got["rho"] == pytest.approx(expected)
    assert got["ci_low"] <= got["rho"] <= got["ci_high"]
    assert script.spearman_interval(x, -x, n_boot=50)["rho"] == pytest.approx(-1.0)
