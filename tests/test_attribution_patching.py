"""Attribution patching against exact patching and against a hand-written autograd computation."""

import numpy as np
import pandas as pd
import pytest
import torch

import cpsuper as cp
from cpsuper.attribution_patching import (
    attribution_patching,
    exact_head_patching,
    exact_position_patching,
    patching_agreement,
)
from cpsuper.backend import HookedTransformer, HookedTransformerConfig
from cpsuper.hub import quiet_deprecation
from cpsuper.tiny import tiny_tokenizer

ATOL = 1e-5


@pytest.fixture(scope="module")
def linear_model():
    """Attention-only, no norms, and a last layer whose keys are zero (uniform causal attention):
    the logit difference is then exactly linear in the last layer's ``hook_z`` and in its
    ``hook_resid_pre`` at every position, so attribution patching must equal exact patching."""
    tokenizer = tiny_tokenizer()
    cfg = HookedTransformerConfig(
        n_layers=2,
        d_model=32,
        d_head=8,
        n_heads=4,
        n_ctx=256,
        d_vocab=len(tokenizer),
        attn_only=True,
        normalization_type=None,
        act_fn="gelu",
        positional_embedding_type="standard",
        default_prepend_bos=True,
        tokenizer_prepends_bos=True,
        seed=0,
    )
    with quiet_deprecation():
        model = HookedTransformer(cfg, tokenizer=tokenizer).eval()
    with torch.no_grad():
        model.blocks[-1].attn.W_K.zero_()
        model.blocks[-1].attn.b_K.zero_()
    return model


def _dataset(model, n=3):
    return cp.conflict_dataset("world_capital", n=n, tokenizer=model)


def _aligned(n_src, n_dst):
    """Hand alignment from the end: the shorter prompt's BOS pairs with nothing when lengths differ."""
    n = min(n_src, n_dst) - (n_src != n_dst)
    return list(range(n_src - n, n_src)), list(range(n_dst - n, n_dst))


def _hand_metric(model, logits, example, prompt, metric="logit_diff"):
    t = cp.runtime.answer_token(model, example.answer, prompt)
    o = cp.runtime.answer_token(model, example.context_answer, prompt)
    last = logits[0, -1].float()
    if metric == "logit_diff":
        return last[t] - last[o]
    logprob = last.log_softmax(-1)[t]
    return logprob if metric == "logprob" else logprob.exp()


def _hand_estimates(model, example, name, metric="logit_diff"):
    """(a_source - a_destination) . d metric / d a on the destination, per aligned position:
    ``[n_aligned, ...]`` (for hook_z: ``[n_aligned, heads]``), written with run_with_hooks and
    torch.autograd.grad."""
    src_prompt, dst_prompt = example.prompts["clean"], example.prompts["substitution"]
    with torch.no_grad():
        _, cache = model.run_with_cache(src_prompt, names_filter=[name])
    a_src = cache[name][0]
    saved = {}

    def keep(act, hook):
        if not act.requires_grad:
            act = act.detach().requires_grad_(True)
        saved["a"] = act
        return act

    with torch.enable_grad():
        logits = model.run_with_hooks(dst_prompt, fwd_hooks=[(name, keep)])
        (grad,) = torch.autograd.grad(_hand_metric(model, logits, example, dst_prompt, metric), saved["a"])
    a_dst = saved["a"][0].detach()
    s, d = _aligned(len(a_src), len(a_dst))
    return ((a_src[s] - a_dst[d]) * grad[0, d]).sum(-1)


def _hand_patch(model, example, name, head, s, d, metric="logit_diff"):
    """Exact patching by hand: the destination run with ``name`` at positions ``d`` (and ``head``)
    replaced by the source run's values at ``s``; the metric's change."""
    src_prompt, dst_prompt = example.prompts["clean"], example.prompts["substitution"]
    with torch.no_grad():
        _, cache = model.run_with_cache(src_prompt, names_filter=[name])

        def put(act, hook):
            act = act.clone()
            if head is None:
                act[0, d] = cache[name][0, s]
            else:
                act[0, d, head] = cache[name][0, s, head]
            return act

        base = _hand_metric(model, model(dst_prompt), example, dst_prompt, metric)
        patched = _hand_metric(
            model, model.run_with_hooks(dst_prompt, fwd_hooks=[(name, put)]), example, dst_prompt, metric
        )
    return float(patched - base)


# ---------------------------------------------------------------------------------------------
# Exact where the model is linear


def test_linear_model_heads_equal_exact_patching(linear_model):
    ds = _dataset(linear_model)
    result = attribution_patching(linear_model, ds, progress=False)
    exact = exact_head_patching(linear_model, ds, progress=False)
    last = linear_model.cfg.n_layers - 1
    keys = ["example", "layer", "head"]
    both = result.heads.merge(exact, on=keys)
    both = both[both.layer == last]
    assert len(both) == len(ds) * linear_model.cfg.n_heads
    assert both.delta.abs().max() > 1e-2  # the patches do something
    np.testing.assert_allclose(both.estimate, both.delta, atol=ATOL, rtol=0)


def test_linear_model_resid_pre_positions_equal_exact_patching(linear_model):
    ds = _dataset(linear_model)
    result = attribution_patching(linear_model, ds, components=["resid_pre"], progress=False)
    exact = exact_position_patching(linear_model, ds, progress=False)
    last = linear_model.cfg.n_layers - 1
    keys = ["example", "component", "layer", "position"]
    both = result.positions.merge(exact, on=keys)
    both = both[both.layer == last]
    assert len(both) == sum(len(_aligned(*_lengths(linear_model, e))[0]) for e in ds)
    assert both.delta.abs().max() > 1e-2
    np.testing.assert_allclose(both.estimate, both.delta, atol=ATOL, rtol=0)


def _lengths(model, example):
    return tuple(len(model.to_tokens(example.prompts[c])[0]) for c in ("clean", "substitution"))


# ---------------------------------------------------------------------------------------------
# Equal to a hand-written autograd computation


@pytest.mark.parametrize("metric", ["logit_diff", "logprob"])
def test_estimates_equal_hand_autograd(tiny, metric):
    ds = _dataset(tiny, n=2)
    result = attribution_patching(tiny, ds, metric=metric, progress=False)
    n_layers = tiny.cfg.n_layers
    for i, example in enumerate(ds):  # noqa: B007 - read by query's @i
        for layer in range(n_layers):
            hand = _hand_estimates(tiny, example, f"blocks.{layer}.attn.hook_z", metric).sum(0)  # [heads]
            got = result.heads.query("example == @i and layer == @layer").sort_values("head").estimate
            np.testing.assert_allclose(got, hand.numpy(), atol=ATOL, rtol=0)
            for component in ("resid_pre", "attn_out", "mlp_out"):
                hand = _hand_estimates(tiny, example, f"blocks.{layer}.hook_{component}", metric)
                rows = result.positions.query("example == @i and layer == @layer and component == @component")
                np.testing.assert_allclose(rows.sort_values("position").estimate, hand.numpy(), atol=ATOL, rtol=0)
    assert (result.heads.estimate.abs() > 1e-4).any()


def test_probability_metric_is_the_chain_rule_of_logprob(tiny_gemma):
    ds = _dataset(tiny_gemma, n=2)
    logprob = attribution_patching(tiny_gemma, ds, metric="logprob", progress=False).heads
    prob = attribution_patching(tiny_gemma, ds, metric="probability", progress=False).heads
    # d p / d a = p * d log p / d a, with p the destination's probability
    np.testing.assert_allclose(prob.estimate, np.exp(logprob.p_clean) * logprob.estimate, atol=ATOL, rtol=1e-5)


def test_positions_carry_spans_and_offsets(tiny_gemma):
    ds = _dataset(tiny_gemma, n=2)
    result = attribution_patching(tiny_gemma, ds, progress=False)
    for i, example in enumerate(ds):  # noqa: B007 - read by query's @i
        tokens = tiny_gemma.to_tokens(example.prompts["substitution"])[0].tolist()
        spans = cp.spans.example_spans(tiny_gemma, example, "substitution")
        rows = result.positions.query("example == @i")
        assert rows.position.max() == -1
        assert all(spans[len(tokens) + p] == s for p, s in zip(rows.position, rows.span))
    assert set(result.summary.columns) >= {"layer", "head", "mean", "ci_low", "ci_high", "n"}
    assert (result.summary.ci_low <= result.summary["mean"] + 1e-12).all()
    assert set(result.position_summary.columns) >= {"component", "layer", "position", "span", "mean", "ci_low"}


def test_batched_equals_one_by_one(tiny_gemma):
    ds = _dataset(tiny_gemma, n=4)
    one = attribution_patching(tiny_gemma, ds, batch_size=1, progress=False)
    many = attribution_patching(tiny_gemma, ds, batch_size=4, progress=False)
    for a, b in ((one.heads, many.heads), (one.positions, many.positions)):
        pd.testing.assert_frame_equal(a.drop(columns=["estimate", "p_clean"]), b.drop(columns=["estimate", "p_clean"]))
        np.testing.assert_allclose(a.estimate, b.estimate, atol=ATOL, rtol=0)
        np.testing.assert_allclose(a.p_clean, b.p_clean, atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------
# Exact patching equals a hand loop


def test_exact_head_patching_equals_hand_loop(tiny):
    ds = _dataset(tiny, n=2)
    exact = exact_head_patching(tiny, ds, batch_size=5, progress=False)
    assert len(exact) == len(ds) * tiny.cfg.n_layers * tiny.cfg.n_heads
    np.testing.assert_allclose(exact.p - exact.p_clean, exact.delta, atol=1e-9)
    for i, example in enumerate(ds):  # noqa: B007 - read by query's @i
        s, d = _aligned(*_lengths(tiny, example))
        for layer, head in [(0, 1), (1, 3), (tiny.cfg.n_layers - 1, 0)]:
            hand = _hand_patch(tiny, example, f"blocks.{layer}.attn.hook_z", head, s, d)
            got = exact.query("example == @i and layer == @layer and head == @head").delta.item()
            assert got == pytest.approx(hand, abs=ATOL)


def test_exact_position_patching_equals_hand_loop(tiny):
    ds = _dataset(tiny, n=2)
    exact = exact_position_patching(tiny, ds, components=["resid_pre", "mlp_out"], batch_size=7, progress=False)
    for i, example in enumerate(ds):  # noqa: B007 - read by query's @i
        n_dst = _lengths(tiny, example)[1]
        s, d = _aligned(*_lengths(tiny, example))
        assert len(exact.query("example == @i")) == 2 * tiny.cfg.n_layers * len(d)
        for component, layer, k in [("resid_pre", 1, 0), ("resid_pre", 2, -1), ("mlp_out", 0, -3)]:
            hand = _hand_patch(tiny, example, f"blocks.{layer}.hook_{component}", None, [s[k]], [d[k]])
            position = d[k] - n_dst  # noqa: F841 - read by query's @position
            got = exact.query("example == @i and component == @component and layer == @layer and position == @position")
            assert got.delta.item() == pytest.approx(hand, abs=ATOL)


def test_agreement_of_identical_and_opposite_rankings(tiny_gemma):
    ds = _dataset(tiny_gemma, n=3)
    result = attribution_patching(tiny_gemma, ds, progress=False)
    same = result.heads.assign(delta=result.heads.estimate)
    agree = patching_agreement(result, same, top_k=5).set_index("statistic")
    assert agree.loc["spearman", "value"] == pytest.approx(1.0)
    assert agree.loc["top_k_overlap", ["value", "ci_low", "ci_high"]].tolist() == [1.0, 1.0, 1.0]
    opposite = patching_agreement(result, same.assign(delta=-same.delta)).set_index("statistic")
    assert opposite.loc["spearman", "value"] == pytest.approx(-1.0)
    # hand Spearman of the mean effects (no ties in random values)
    rng = np.random.default_rng(0)
    noisy = same.assign(delta=same.delta + rng.normal(0, 0.05, len(same)))
    got = patching_agreement(result, noisy).set_index("statistic").loc["spearman", "value"]
    a = result.heads.groupby(["layer", "head"]).estimate.mean().rank()
    b = noisy.groupby(["layer", "head"]).delta.mean().rank()
    assert got == pytest.approx(np.corrcoef(a, b)[0, 1])


# ---------------------------------------------------------------------------------------------
# Bad input, and the model left as it was


def test_bad_input(tiny_gemma):
    ds = _dataset(tiny_gemma, n=2)
    with pytest.raises(ValueError, match="float32"):
        attribution_patching(cp.tiny_model("gemma", dtype=torch.bfloat16), ds, progress=False)
    with torch.inference_mode(), pytest.raises(ValueError, match="inference_mode"):
        attribution_patching(tiny_gemma, ds, progress=False)
    with pytest.raises(ValueError, match="empty"):
        attribution_patching(tiny_gemma, ds[[]], progress=False)
    with pytest.raises(ValueError, match="bogus"):
        attribution_patching(tiny_gemma, ds, source="bogus", progress=False)
    with pytest.raises(ValueError, match="align='end'"):
        attribution_patching(tiny_gemma, ds, align="exact", progress=False)
    with pytest.raises(ValueError, match="align='end'"):
        exact_head_patching(tiny_gemma, ds, align="exact", progress=False)
    with pytest.raises(ValueError, match="metric"):
        attribution_patching(tiny_gemma, ds, metric="logit", progress=False)
    with pytest.raises(ValueError, match="both 'clean'"):
        attribution_patching(tiny_gemma, ds, destination="clean", progress=False)
    with pytest.raises(ValueError, match="components"):
        attribution_patching(tiny_gemma, ds, components=["resid_post"], progress=False)


def test_align_exact_on_equal_lengths_equals_end(tiny_gemma):
    ds = _dataset(tiny_gemma, n=2)
    examples = [
        cp.data.ConflictExample(
            e.relation,
            e.subject,
            e.answer,
            e.context_answer,
            {"clean": e.prompts["clean"], "coherent": e.prompts["clean"]},
        )
        for e in ds
    ]
    same = cp.data.ConflictDataset(examples, name="same")
    a = attribution_patching(tiny_gemma, same, destination="coherent", align="exact", progress=False)
    b = attribution_patching(tiny_gemma, same, destination="coherent", align="end", progress=False)
    assert len(a.positions) == len(b.positions) > 0
    np.testing.assert_allclose(a.heads.estimate, b.heads.estimate, atol=ATOL)
    np.testing.assert_allclose(a.heads.estimate, 0.0, atol=ATOL)  # identical prompts: nothing to patch


def test_hooks_and_grad_mode_restored_after_an_exception(tiny_gemma):
    ds = _dataset(tiny_gemma, n=2)

    def broken(module, args, output):  # fails inside the forward passes, while their hooks are attached
        raise RuntimeError("injected")

    handle = tiny_gemma.blocks[-1].register_forward_hook(broken)
    try:
        for run in (attribution_patching, exact_head_patching, exact_position_patching):
            with torch.no_grad():
                with pytest.raises(RuntimeError, match="injected"):
                    run(tiny_gemma, ds, progress=False)
                assert not torch.is_grad_enabled()
            assert torch.is_grad_enabled()
            assert all(not hp._forward_hooks and not hp._backward_hooks for hp in tiny_gemma.hook_dict.values())
    finally:
        handle.remove()
    assert all(p.grad is None for p in tiny_gemma.parameters())


def test_no_parameter_gradients_left_behind(tiny_gpt2):
    attribution_patching(tiny_gpt2, _dataset(tiny_gpt2, n=2), progress=False)
    assert all(p.grad is None for p in tiny_gpt2.parameters())
    assert all(not hp._forward_hooks for hp in tiny_gpt2.hook_dict.values())


def test_plots(tiny_gemma):
    from cpsuper.plots.attribution_patching import plot_attribution_patching, plot_attribution_vs_exact

    ds = _dataset(tiny_gemma, n=2)
    result = attribution_patching(tiny_gemma, ds, progress=False)
    fig = plot_attribution_patching(result)
    heads, positions = fig.data
    assert np.asarray(heads.z).shape == (tiny_gemma.cfg.n_layers, tiny_gemma.cfg.n_heads)
    assert positions.x[-1].startswith("-1 ")  # the final token, labelled with its span
    mean = result.summary.query("layer == 1 and head == 2")["mean"].item()
    assert np.asarray(heads.z)[1, 2] == pytest.approx(mean)
    with pytest.raises(ValueError, match="resid_post"):
        plot_attribution_patching(result, component="resid_post")
    exact = exact_head_patching(tiny_gemma, ds, progress=False)
    fig = plot_attribution_vs_exact(result, exact)
    assert len(fig.data[1].x) == tiny_gemma.cfg.n_layers * tiny_gemma.cfg.n_heads
    assert "Spearman" in fig.layout.title.text
    fig = plot_attribution_vs_exact(result, exact_position_patching(tiny_gemma, ds, progress=False))
    assert len(fig.data[1].x) > 0


@pytest.mark.slow
def test_embedded_model_equals_hand_autograd(gemma):
    data = cp.conflict_dataset("world_capital", n=1, tokenizer=gemma)
    result = attribution_patching(gemma, data, components=["resid_pre"], progress=False)
    for layer in (0, gemma.cfg.n_layers - 1):
        hand = _hand_estimates(gemma, data[0], f"blocks.{layer}.attn.hook_z").sum(0)
        got = result.heads.query("layer == @layer").sort_values("head").estimate
        np.testing.assert_allclose(got, hand.numpy(), atol=1e-4, rtol=1e-4)
