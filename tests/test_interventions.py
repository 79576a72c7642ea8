import pytest
import torch

from cpsuper.edits import HeadEdit, ModuleEdit
from cpsuper.engine import answer_probabilities
from cpsuper.interventions import AddHeadOutput, Knockout, ScaleHead, intervene, mean_activation
from cpsuper.runtime import tokenize_prompts

PROMPTS = [
    "The name of the capital city of France is",
    "The name of the capital city of Japan is Lima. The name of the capital city of Japan is",
    "Madrid is located in",
]


def _last_logits(model, prompt):
    with torch.no_grad():
        return model(prompt)[0, -1]


def test_scaling_a_head_by_one_changes_nothing(tiny):
    reference = _last_logits(tiny, PROMPTS[1])
    with intervene(tiny, [ScaleHead(layer, head, 1.0) for layer in range(3) for head in range(4)]):
        assert torch.equal(_last_logits(tiny, PROMPTS[1]), reference)


def test_scaling_a_head_changes_only_downstream(tiny):
    _, clean = tiny.run_with_cache(PROMPTS[0])
    with intervene(tiny, ScaleHead(1, 2, 0.0)):
        _, cache = tiny.run_with_cache(PROMPTS[0])
    assert torch.equal(cache["blocks.1.hook_resid_pre"], clean["blocks.1.hook_resid_pre"])
    assert torch.equal(cache["blocks.1.attn.hook_z"][:, :, 2], torch.zeros_like(clean["blocks.1.attn.hook_z"][:, :, 2]))
    assert torch.equal(cache["blocks.1.attn.hook_z"][:, :, :2], clean["blocks.1.attn.hook_z"][:, :, :2])
    assert not torch.allclose(cache["blocks.1.hook_attn_out"], clean["blocks.1.hook_attn_out"])


def test_gqa_heads_are_query_heads(tiny_gemma):
    """Query heads 0 and 1 share a KV head in the tiny GQA model, but scaling one leaves the
    other's output untouched."""
    _, clean = tiny_gemma.run_with_cache(PROMPTS[0])
    with intervene(tiny_gemma, ScaleHead(0, 0, 3.0)):
        _, cache = tiny_gemma.run_with_cache(PROMPTS[0])
    z, z0 = cache["blocks.0.attn.hook_z"], clean["blocks.0.attn.hook_z"]
    torch.testing.assert_close(z[:, :, 0], 3 * z0[:, :, 0])
    assert torch.equal(z[:, :, 1], z0[:, :, 1])


def test_zeroing_every_head_equals_attention_knockout_without_bias(tiny_gemma):
    for layer in range(3):
        with intervene(tiny_gemma, [ScaleHead(layer, h, 0.0) for h in range(4)]):
            heads_zeroed = _last_logits(tiny_gemma, PROMPTS[0])
        with intervene(tiny_gemma, Knockout(layer, "attn")):
            knocked_out = _last_logits(tiny_gemma, PROMPTS[0])
        torch.testing.assert_close(heads_zeroed, knocked_out, atol=1e-5, rtol=0)


def test_zeroing_every_head_leaves_the_output_bias(tiny_gpt2):
    """With an attention output bias, zeroed heads still write b_O: the module knockout differs
    from zeroing all heads by exactly that bias."""
    layer = 1
    with intervene(tiny_gpt2, [ScaleHead(layer, h, 0.0) for h in range(4)]):
        _, cache = tiny_gpt2.run_with_cache(PROMPTS[0])
    b_O = tiny_gpt2.blocks[layer].attn.b_O
    torch.testing.assert_close(
        cache[f"blocks.{layer}.hook_attn_out"], b_O.expand_as(cache[f"blocks.{layer}.hook_attn_out"])
    )
    with intervene(tiny_gpt2, Knockout(layer, "attn")):
        knocked = _last_logits(tiny_gpt2, PROMPTS[0])
    with intervene(tiny_gpt2, [ScaleHead(layer, h, 0.0) for h in range(4)]):
        zeroed = _last_logits(tiny_gpt2, PROMPTS[0])
    assert not torch.allclose(knocked, zeroed, atol=1e-4)


def test_knockout_equals_zeroing_the_hook(tiny):
    for module, hooks in [
        ("attn", ["hook_attn_out"]),
        ("mlp", ["hook_mlp_out"]),
        ("layer", ["hook_attn_out", "hook_mlp_out"]),
    ]:
        with intervene(tiny, Knockout(2, module)):
            knocked = _last_logits(tiny, PROMPTS[2])
        zero = lambda act, hook: torch.zeros_like(act)  # noqa: E731
        with torch.no_grad():
            manual = tiny.run_with_hooks(PROMPTS[2], fwd_hooks=[(f"blocks.2.{h}", zero) for h in hooks])[0, -1]
        assert torch.equal(knocked, manual)


def test_mean_ablation_uses_the_mean(tiny):
    mean = mean_activation(tiny, PROMPTS, "blocks.1.hook_mlp_out")
    with intervene(tiny, Knockout(1, "mlp", mean=mean)):
        _, cache = tiny.run_with_cache(PROMPTS[0])
    torch.testing.assert_close(cache["blocks.1.hook_mlp_out"][0, 3], mean)
    _, clean = tiny.run_with_cache(PROMPTS[0])
    tokens = clean["blocks.1.hook_mlp_out"][0]
    assert mean.shape == tokens.shape[-1:]


def test_added_recorded_output_of_one_head_equals_scaling(tiny):
    _, clean = tiny.run_with_cache(PROMPTS[1])
    recorded = clean["blocks.1.attn.hook_z"][:, :, 3]
    with intervene(tiny, AddHeadOutput(1, 3, 2.0, recorded)):
        dual = _last_logits(tiny, PROMPTS[1])
    with intervene(tiny, ScaleHead(1, 3, 3.0)):
        once = _last_logits(tiny, PROMPTS[1])
    torch.testing.assert_close(dual, once, atol=1e-5, rtol=0)


def test_hooks_are_removed_after_an_error(tiny):
    reference = _last_logits(tiny, PROMPTS[0])
    with pytest.raises(RuntimeError, match="boom"):
        with intervene(tiny, [ScaleHead(0, 0, 0.0), Knockout(1, "mlp")]):
            raise RuntimeError("boom")
    assert all(not hp.fwd_hooks for hp in tiny.hook_dict.values())
    assert torch.equal(_last_logits(tiny, PROMPTS[0]), reference)


def test_bad_heads_and_layers_are_named(tiny):
    with pytest.raises(ValueError, match="Unknown layer 7: this model has layers 0..2"):
        with intervene(tiny, ScaleHead(7, 0, 0.0)):
            pass
    with pytest.raises(ValueError, match="Unknown head 4 in layer 1: this model has query heads 0..3"):
        with intervene(tiny, ScaleHead(1, 4, 0.0)):
            pass
    with pytest.raises(ValueError, match="Unknown module 'ffn'"):
        with intervene(tiny, Knockout(1, "ffn")):
            pass


# --- the sweep engine against one run_with_hooks per condition ------------------------------


def _naive_probabilities(model, prompts, answer_ids, condition):
    out = []
    for prompt, ids in zip(prompts, answer_ids):
        _, clean = model.run_with_cache(prompt)
        specs = []
        for e in condition:
            if isinstance(e, HeadEdit):
                if e.scale != 1.0:
                    specs.append(ScaleHead(e.layer, e.head, e.scale))
                if e.add:
                    specs.append(
                        AddHeadOutput(e.layer, e.head, e.add, clean[f"blocks.{e.layer}.attn.hook_z"][:, :, e.head])
                    )
            else:
                specs.append(Knockout(e.layer, e.module))
        with intervene(model, specs):
            probs = _last_logits(model, prompt).softmax(-1)
        out.append(probs[ids])
    return torch.stack(out)


CONDITIONS = [
    [],
    [HeadEdit(0, 1, scale=0.0)],
    [HeadEdit(1, 3, scale=2.0)],
    [HeadEdit(2, 0, scale=-1.0)],
    [ModuleEdit(1, "attn")],
    [ModuleEdit(0, "mlp")],
    [ModuleEdit(2, "layer")],
    [HeadEdit(0, 2, scale=0.0), HeadEdit(2, 1, scale=0.0)],  # knocked out together
    [HeadEdit(0, 2, add=3.0), HeadEdit(1, 0, add=-1.0)],  # dual run (JuICE)
    [HeadEdit(0, 2, scale=4.0), HeadEdit(1, 0, scale=0.0)],  # single run (JuNe)
]


def test_engine_equals_one_run_with_hooks_per_condition(tiny):
    prompts = PROMPTS + ["The book Pride and Prejudice was written by"]
    token_lists = tokenize_prompts(tiny, prompts)
    answer_ids = torch.tensor([[17, 400], [5, 6], [900, 33], [250, 251]])
    clean, swept = answer_probabilities(
        tiny, token_lists, answer_ids, CONDITIONS, batch_size=5, prompt_batch_size=3, progress=False
    )
    for c, condition in enumerate(CONDITIONS):
        expected = _naive_probabilities(tiny, prompts, answer_ids, condition)
        torch.testing.assert_close(swept[:, c], expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(clean, swept[:, 0], atol=0, rtol=0)


def test_dual_run_differs_from_single_run_when_heads_interact(tiny):
    """With two heads in different layers, adding the *recorded* output (JuICE) is not the
    same as scaling in one pass (JuNe): the later head's input changed."""
    token_lists = tokenize_prompts(tiny, PROMPTS)
    ids = torch.tensor([[5, 6]] * 3)
    _, out = answer_probabilities(tiny, token_lists, ids, CONDITIONS[8:], progress=False)
    assert not torch.allclose(out[:, 0], out[:, 1], rtol=1e-3, atol=0)  # relative: tiny models give small probabilities


def test_engine_batches_do_not_matter(tiny):
    token_lists = tokenize_prompts(tiny, PROMPTS)
    ids = torch.tensor([[5, 6]] * 3)
    _, a = answer_probabilities(tiny, token_lists, ids, CONDITIONS, batch_size=1, prompt_batch_size=1, progress=False)
    _, b = answer_probabilities(tiny, token_lists, ids, CONDITIONS, batch_size=64, prompt_batch_size=16, progress=False)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_small_chunks_are_unembedded_together_within_the_batch_size(tiny, monkeypatch):
    """Resumed chunks of a few rows wait and are read out together (the unembedding costs nearly
    as much for a dozen rows as for a hundred), never more than ``batch_size`` rows at once, and
    every value lands in its own (prompt, condition) place."""
    import cpsuper.engine as engine

    sizes = []
    real = engine.unembed_final
    counted = lambda model, resid: sizes.append(len(resid)) or real(model, resid)  # noqa: E731
    monkeypatch.setattr(engine, "unembed_final", counted)  # the clean run's and GroupedReadout's read-outs
    token_lists = tokenize_prompts(tiny, PROMPTS)
    ids = torch.tensor([[5, 6], [7, 8], [9, 10]])
    _, grouped = answer_probabilities(tiny, token_lists, ids, CONDITIONS, batch_size=16, progress=False)
    # the clean run (3 prompts), then the resumed chunks: 15 rows from layer 0, 6 from layer 1 and 6
    # from layer 2; the last two share one read-out
    assert sizes == [3, 15, 12]
    for c, condition in enumerate(CONDITIONS):
        torch.testing.assert_close(
            grouped[:, c], _naive_probabilities(tiny, PROMPTS, ids, condition), atol=1e-6, rtol=1e-5
        )


def test_engine_rejects_bad_edits(tiny):
    token_lists = tokenize_prompts(tiny, PROMPTS[:1])
    with pytest.raises(ValueError, match="Unknown head 9"):
        answer_probabilities(tiny, token_lists, torch.tensor([[1]]), [[HeadEdit(0, 9)]], progress=False)


@pytest.mark.parametrize("start", [0, 2])
def test_final_positions_run_the_last_mlp_on_those_positions_only(tiny, start):
    from cpsuper.backend import cut_after_last_attention, final_residual, is_bridge
    from cpsuper.runtime import pad_tokens

    tokens, _, last = pad_tokens(tiny, tokenize_prompts(tiny, PROMPTS), "right")
    assert len(set(last.tolist())) > 1  # rows of different lengths
    _, cache = tiny.run_with_cache(tokens)
    resume = cache[f"blocks.{start}.hook_resid_pre"]
    rows = torch.arange(len(last))
    full = final_residual(tiny, resume, start_at_layer=start)[rows, last]
    if is_bridge(tiny):  # not cut there (the bridge's blocks are Hugging Face's): the full run's rows
        assert cut_after_last_attention(tiny, rows, last) is None
        torch.testing.assert_close(final_residual(tiny, resume, positions=last, start_at_layer=start), full)
        return
    mlp, seen = tiny.blocks[-1].mlp, []
    forward = mlp.forward
    mlp.forward = lambda x, **kw: seen.append(x.shape[:2]) or forward(x, **kw)  # not a hook: the cut stays
    try:
        cut = final_residual(tiny, resume, positions=last, start_at_layer=start)
        assert seen == [(len(last), 1)]
        torch.testing.assert_close(cut, full, atol=1e-6, rtol=1e-6)
        # A hook on the last block's MLP side must see every position, so nothing is cut then.
        with tiny.hooks([(f"blocks.{tiny.cfg.n_layers - 1}.hook_mlp_out", lambda x, hook: x)]):
            torch.testing.assert_close(final_residual(tiny, resume, positions=last, start_at_layer=start), full)
        assert seen[-1] == tokens.shape
    finally:
        del mlp.forward


def test_logits_and_decoding_plain_and_steered_run_the_last_mlp_at_the_read_positions_only(tiny_gemma):
    import cpsuper as cp
    from cpsuper.backend import is_bridge

    if is_bridge(tiny_gemma):
        pytest.skip("the bridge's last block is not cut (test_final_positions_run_the_last_mlp_... covers that)")
    mlp, seen = tiny_gemma.blocks[-1].mlp, []
    forward = mlp.forward
    mlp.forward = lambda x, **kw: seen.append(tuple(x.shape[:2])) or forward(x, **kw)
    try:
        plain = cp.scoring.final_logits(tiny_gemma, PROMPTS, batch_size=8)
        steer = cp.JuICE(tiny_gemma, enhance=[(1, 1)], beta_plus=1.0)
        steered = steer.logits(PROMPTS)
        assert seen == [(len(PROMPTS), 1)] * 2
        steer.generate(PROMPTS, max_new_tokens=3, batch_size=8)  # cached: prompt, then one token per step
        assert seen[2:] == [(len(PROMPTS), 1)] * 3
    finally:
        del mlp.forward
    assert not torch.allclose(plain, steered)
