"""Head-to-head path patching, checked against Wang et al.'s multi-pass path patching written out
with plain run_with_hooks calls (every head and MLP between sender and receiver frozen)."""

import pytest
import torch

import cpsuper as cp
from cpsuper.head_paths import head_path_patching


def _aligned(n_dst: int, n_src: int, align: str):
    n = min(n_dst, n_src)
    if align == "end":
        return list(range(n_dst - n, n_dst)), list(range(n_src - n, n_src))
    return list(range(n)), list(range(n))


_CACHES: dict = {}


def _cached(model, prompt):
    """Pass 1 (a plain run_with_cache), kept per model and prompt to save time across rows."""
    key = (id(model), prompt)
    if key not in _CACHES:
        _CACHES[key] = model.run_with_cache(prompt)[1]
    return _CACHES[key]


def _hand(model, example, sender, receiver, inp, *, source="clean", destination="substitution",
          metric="logit_diff", align="end"):  # fmt: skip
    """Sender -> receiver-input path patching in four plain passes:
    1. cache the source and destination runs;
    2. destination run with the sender's z from the source, its post-norm scale and every head and
       MLP of the layers up to the receiver frozen at the destination: read the receiver layer's q/k/v;
    3. destination run with the receiver's chosen input(s) from pass 2: read the receiver head's z;
    4. destination run with only that z replaced: the metric."""
    (ls, hs), (lr, hr) = sender, receiver
    dst_prompt, src_prompt = example.prompts[destination], example.prompts[source]
    group = model.cfg.n_heads // (model.cfg.n_key_value_heads or model.cfg.n_heads)
    with torch.no_grad():
        dst, src = _cached(model, dst_prompt), _cached(model, src_prompt)
        dpos, spos = _aligned(model.to_tokens(dst_prompt).shape[1], model.to_tokens(src_prompt).shape[1], align)

        def sender_z(z, hook):
            z = dst[hook.name].clone()
            z[:, dpos, hs] = src[hook.name][:, spos, hs]
            return z

        frozen = lambda act, hook: dst[hook.name]  # noqa: E731
        hooks = [(f"blocks.{ls}.attn.hook_z", sender_z)]
        if hasattr(model.blocks[ls], "ln1_post"):
            hooks.append((f"blocks.{ls}.ln1_post.hook_scale", frozen))
        hooks += [(f"blocks.{l}.attn.hook_z", frozen) for l in range(ls + 1, lr)]
        hooks += [(f"blocks.{l}.hook_mlp_out", frozen) for l in range(ls, lr)]
        with model.hooks(fwd_hooks=hooks):
            _, patched = model.run_with_cache(
                dst_prompt, names_filter=lambda n: n.startswith(f"blocks.{lr}.attn.hook_")
            )

        def receiver_input(act, hook):
            act = act.clone()
            slot = hr if hook.name.endswith("hook_q") else hr // group
            act[:, :, slot] = patched[hook.name][:, :, slot]
            return act

        names = [f"blocks.{lr}.attn.hook_{x}" for x in inp]
        with model.hooks(fwd_hooks=[(n, receiver_input) for n in names]):
            _, third = model.run_with_cache(dst_prompt, names_filter=f"blocks.{lr}.attn.hook_z")
        z_new = third[f"blocks.{lr}.attn.hook_z"][:, :, hr]

        def receiver_z(z, hook):
            z = z.clone()
            z[:, :, hr] = z_new
            return z

        logits = model.run_with_hooks(dst_prompt, fwd_hooks=[(f"blocks.{lr}.attn.hook_z", receiver_z)])[0, -1]
        base = model(dst_prompt)[0, -1]
        p = cp.runtime.answer_token(model, example.answer, dst_prompt)
        c = cp.runtime.answer_token(model, example.context_answer, dst_prompt)

        def value(lg):
            return (lg[p] - lg[c]).item() if metric == "logit_diff" else lg.log_softmax(-1)[p].item()

        return value(logits) - value(base)


def _check(model, data, result, tol=1e-5, **kw):
    per = result.per_example
    for row in per.itertuples():
        expected = _hand(
            model,
            data[row.example],
            (row.sender_layer, row.sender_head),
            (row.receiver_layer, row.receiver_head),
            row.input,
            **kw,
        )
        assert row.effect == pytest.approx(expected, abs=tol), row


@pytest.mark.parametrize("metric", ["logit_diff", "logprob"])
def test_equals_the_hand_written_multi_pass_path_patching(tiny, metric):
    data = cp.conflict_dataset("world_capital", n=2, tokenizer=tiny)
    receivers = [(2, 1), (1, 3)]
    result = head_path_patching(
        tiny, data, receivers, inputs=("q", "k", "v", "qkv"), metric=metric, batch_size=5, progress=False
    )
    per = result.per_example
    n = tiny.cfg.n_heads
    assert len(per) == len(data) * 4 * (2 * n + n)  # every earlier head per receiver
    assert per.effect.abs().max() > 1e-3  # the patch does something
    assert set(per.columns) >= {"example", "subject", "relation", "sender_layer", "receiver_head", "input", "effect"}
    _check(tiny, data, result, metric=metric)
    summary = result.summary
    assert len(summary) == len(per) // len(data)
    assert summary["mean"].abs().iloc[0] == pytest.approx(per.groupby(["sender_layer", "sender_head", "receiver_layer",
        "receiver_head", "input"]).effect.mean().abs().max())  # fmt: skip


def test_explicit_senders_align_start_and_other_conflict_types(tiny_gemma):
    data = cp.conflict_dataset("world_capital", n=2, tokenizer=tiny_gemma)
    result = head_path_patching(
        tiny_gemma, data, [(2, 0), (2, 3)], senders=[(0, 2), (1, 1)], inputs="k", source="clean",
        destination="coherent", align="start", progress=False,
    )  # fmt: skip
    assert len(result.per_example) == 2 * 2 * 2
    _check(tiny_gemma, data, result, destination="coherent", align="start")


def test_an_unchanged_sender_output_gives_exactly_zero(tiny):
    data = cp.conflict_dataset("world_capital", n=2, tokenizer=tiny)
    result = head_path_patching(
        tiny, data, [(2, 0)], inputs=("q", "qkv"), source="substitution", destination="substitution", progress=False
    )
    assert (result.per_example.effect == 0.0).all()


def test_q_k_v_effects_do_not_add_up_to_the_joint_patch(tiny_gemma):
    """Attention is not linear in q and k, so the joint patch is not the sum of its parts; the
    joint patch itself is checked against the hand computation above."""
    data = cp.conflict_dataset("world_capital", n=2, tokenizer=tiny_gemma)
    per = head_path_patching(tiny_gemma, data, [(2, 1)], inputs=("q", "k", "v", "qkv"), progress=False).per_example
    wide = per.pivot_table(index=["example", "sender_layer", "sender_head"], columns="input", values="effect")
    gap = (wide["q"] + wide["k"] + wide["v"] - wide["qkv"]).abs()
    assert gap.max() > 1e-4


def test_bad_input_is_refused(tiny_gemma):
    data = cp.conflict_dataset("world_capital", n=1, tokenizer=tiny_gemma)
    run = lambda *a, **k: head_path_patching(tiny_gemma, data, *a, progress=False, **k)  # noqa: E731
    with pytest.raises(ValueError, match="senders=.*not in a layer before receiver"):
        run([(1, 0)], senders=[(0, 1), (1, 2)])
    with pytest.raises(ValueError, match="inputs="):
        run([(1, 0)], inputs=("q", "o"))
    with pytest.raises(ValueError, match="receivers: Unknown head 9"):
        run([(1, 9)])
    with pytest.raises(ValueError, match="senders: Unknown layer 7"):
        run([(2, 0)], senders=[(7, 0)])
    with pytest.raises(ValueError, match="layer 0 has no earlier sender"):
        run([(0, 1)])
    with pytest.raises(ValueError, match="align="):
        run([(1, 0)], align="middle")
    with pytest.raises(ValueError, match="metric="):
        run([(1, 0)], metric="prob")


@pytest.mark.slow
def test_embedded_gemma_against_the_hand_computation(gemma):
    data = cp.conflict_dataset("world_capital", n=2, tokenizer=gemma)
    result = head_path_patching(gemma, data, [(9, 1)], senders=[(5, 0)], inputs=("q", "v"), progress=False)
    assert result.per_example.effect.abs().max() > 1e-3
    _check(gemma, data, result, tol=1e-4)  # float32 rounding of logits of size ~30 after 9 more layers


def test_plot_head_paths_draws_the_summary(tiny_gemma):
    from cpsuper.plots.head_paths import plot_head_paths

    data = cp.conflict_dataset("world_capital", n=2, tokenizer=tiny_gemma)
    result = head_path_patching(tiny_gemma, data, [(2, 1), (1, 0)], inputs=("q", "v"), progress=False)
    fig = plot_head_paths(result)
    assert [t.type for t in fig.data] == ["heatmap", "heatmap"]
    q = fig.data[0]
    assert list(q.x) == ["L1H0", "L2H1"] and list(q.y)[:2] == ["L0H0", "L0H1"] and len(q.y) == 8
    row = result.summary.query("input == 'q' and sender_layer == 1 and sender_head == 2 and receiver_layer == 2")
    assert q.z[list(q.y).index("L1H2")][1] == pytest.approx(row["mean"].item())
    assert q.z[list(q.y).index("L1H2")][0] != q.z[list(q.y).index("L1H2")][0]  # not patched: empty (NaN)
    with pytest.raises(TypeError, match="HeadPathResult"):
        plot_head_paths(result.summary)


@pytest.mark.skipif(
    cp.backend.TransformerBridge is None or cp.backend.TL_VERSION < cp.backend.BRIDGE_MIN_VERSION,
    reason="TransformerLens >= 4.3 is not installed (CI runs these in its second environment)",
)
@pytest.mark.parametrize("kind", ["gemma", "gpt2"])
def test_on_the_bridge_backend(kind):
    model = cp.tiny_model(kind, seed=0, backend="bridge")
    data = cp.conflict_dataset("world_capital", n=1, tokenizer=model)
    result = head_path_patching(model, data, [(2, 1)], senders=[(0, 1), (1, 2)], inputs=("q", "k", "v", "qkv"),
                                progress=False)  # fmt: skip
    assert result.per_example.effect.abs().max() > 1e-3
    _check(model, data, result)
