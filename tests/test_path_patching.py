"""Path patching to the final logits, checked against a hand-written run_with_cache computation."""

import copy

import pytest
import torch

import cpsuper as cp
from cpsuper.path_patching import patching_roles, path_patching


@pytest.fixture(scope="module")
def capitals(tiny_gemma):
    return cp.conflict_dataset("world_capital", n=3, tokenizer=tiny_gemma)


def _by_hand(model, example, conflict_type, layer, head, metric="logit_diff"):
    """One head's direct-path patch, written out: caches of both prompts, then arithmetic."""
    base_prompt, clean_prompt = example.prompts[conflict_type], example.prompts["clean"]
    with torch.no_grad():
        _, base = model.run_with_cache(base_prompt)
        _, clean = model.run_with_cache(clean_prompt)
        z_name = f"blocks.{layer}.attn.hook_z"
        diff = (clean[z_name][0, -1, head] - base[z_name][0, -1, head]) @ model.W_O[layer, head]
        post = model.blocks[layer].ln1_post if hasattr(model.blocks[layer], "ln1_post") else None
        if post is not None:  # the norm's own forward, its scale swapped for the base run's (frozen)
            own = {}
            with model.hooks(
                fwd_hooks=[(f"blocks.{layer}.ln1_post.hook_scale", lambda s, hook: own.setdefault("s", s))]
            ):
                normed = post(diff[None, None])[0, 0]
            diff = normed * own["s"][0, 0] / base[f"blocks.{layer}.ln1_post.hook_scale"][0, -1]
        resid = base[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"][0, -1]

        def logits_of(r):
            normed = model.ln_final(r[None, None])[0, 0]
            out = normed @ model.W_U + model.b_U
            cap = model.cfg.output_logits_soft_cap
            return cap * torch.tanh(out / cap) if cap > 0 else out

        p = cp.runtime.answer_token(model, example.answer, base_prompt)
        c = cp.runtime.answer_token(model, example.context_answer, base_prompt)

        def value(logits):
            if metric == "logit_diff":
                return (logits[p] - logits[c]).item()
            return logits.log_softmax(-1)[p].item()

        full = model(base_prompt)[0, -1]
        torch.testing.assert_close(logits_of(resid), full, atol=1e-4, rtol=0)  # the base is the real forward
        return value(logits_of(resid + diff)) - value(full)


@pytest.mark.parametrize("metric", ["logit_diff", "logprob"])
def test_path_patching_equals_a_hand_written_hook_computation(tiny, metric):
    data = cp.conflict_dataset("world_capital", n=3, tokenizer=tiny)
    frame = path_patching(tiny, data, metric=metric, batch_size=2, progress=False)
    n_heads = tiny.cfg.n_layers * tiny.cfg.n_heads
    assert len(frame) == len(data) * 2 * n_heads  # substitution and coherent, every head
    assert frame.delta.abs().max() > 1e-3  # the patch does something
    for example, conflict_type, layer, head in [
        (0, "substitution", 0, 1),
        (1, "coherent", 2, 3),
        (2, "coherent", 1, 0),
    ]:
        got = frame.query(
            "example == @example and conflict_type == @conflict_type and layer == @layer and head == @head"
        )
        expected = _by_hand(tiny, data[example], conflict_type, layer, head, metric)
        assert got.delta.item() == pytest.approx(expected, abs=2e-4)


def test_batched_equals_one_by_one(tiny_gemma, capitals):
    together = path_patching(tiny_gemma, capitals, batch_size=8, row_chunk=1000, progress=False)
    alone = path_patching(tiny_gemma, capitals, batch_size=1, row_chunk=1, progress=False)
    torch.testing.assert_close(torch.tensor(together.delta.values), torch.tensor(alone.delta.values), atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ["gemma", "gpt2"])
def test_a_head_with_the_same_output_on_both_prompts_has_no_effect(kind):
    # With W_V = 0 a head writes only its value bias (0 for Gemma, b_V for GPT-2), which is the
    # same on every prompt: its patch must change nothing, while other heads' patches do.
    model = copy.deepcopy(cp.tiny_model(kind, seed=1))
    data = cp.conflict_dataset("world_capital", n=2, tokenizer=model)
    kv = model.blocks[1].attn
    with torch.no_grad():
        (kv._W_V if hasattr(kv, "_W_V") else kv.W_V)[0] = 0.0
    frame = path_patching(model, data, progress=False)
    dead = 0 if kind == "gpt2" else [0, 1]  # in the GQA model, key-value head 0 serves query heads 0 and 1
    same = frame[(frame.layer == 1) & frame["head"].isin([dead] if isinstance(dead, int) else dead)]
    assert len(same) > 0 and (same.delta.abs() < 1e-6).all()
    assert frame[frame.layer == 2].delta.abs().max() > 1e-3


def test_identical_prompts_give_zero_and_roles_sort(tiny_gemma, capitals):
    frame = path_patching(tiny_gemma, capitals, conflict_types=["clean"], progress=False)
    assert (frame.delta == 0).all()
    roles = patching_roles(path_patching(tiny_gemma, capitals, progress=False))
    assert roles.delta_mean.is_monotonic_decreasing and set(roles.role) <= {"context", "memory", "none"}
    assert ((roles.role == "context") == (roles.delta_mean > 0)).all()


def test_bad_input(tiny_gemma, capitals):
    with pytest.raises(ValueError, match="Unknown metric"):
        path_patching(tiny_gemma, capitals, metric="prob", progress=False)
    with pytest.raises(ValueError, match="only clean prompts"):
        path_patching(tiny_gemma, capitals.with_prompts(["clean"]), progress=False)


@pytest.mark.slow
def test_path_patching_on_the_embedded_model(gemma):
    data = cp.conflict_dataset("world_capital", n=2, tokenizer=gemma)
    frame = path_patching(gemma, data[:1], progress=False)
    for conflict_type, layer, head in [("substitution", 17, 0), ("coherent", 12, 1), ("coherent", 3, 3)]:
        got = frame.query("conflict_type == @conflict_type and layer == @layer and head == @head")
        assert got.delta.item() == pytest.approx(_by_hand(gemma, data[0], conflict_type, layer, head), abs=2e-3)
