"""grouped_attention: TransformerLens's grouped-query attention without repeated keys and values,
with the same activations, hooks and outputs."""

import pytest
import torch
from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache
from transformer_lens.components.grouped_query_attention import GroupedQueryAttention

import cpsuper as cp
from cpsuper.backend import final_residual
from cpsuper.grouped_attention import KVGroupedAttention
from cpsuper.precision import native_on_cpu


def _with_tl_attention(model):
    """The same model object computing attention with TransformerLens's own class (a context)."""

    class Swap:
        def __enter__(self):
            self.swapped = [m for m in model.modules() if type(m) is KVGroupedAttention]
            for m in self.swapped:
                m.__class__ = GroupedQueryAttention
            return model

        def __exit__(self, *exc):
            for m in self.swapped:
                m.__class__ = KVGroupedAttention

    return Swap()


def _decode(model, tokens, mask, steps=3, seed=0):
    """A left-padded prefill and ``steps`` cached decoding steps: the final residual of each call."""
    gen = torch.Generator().manual_seed(seed)
    kv = TransformerLensKeyValueCache.init_cache(model.cfg, model.cfg.device, tokens.shape[0])
    last = torch.full((tokens.shape[0],), tokens.shape[1] - 1)
    with torch.inference_mode():
        outs = [final_residual(model, tokens, attention_mask=mask, positions=last, past_kv_cache=kv)]
        for _ in range(steps):
            new = torch.randint(5, model.cfg.d_vocab, (tokens.shape[0], 1), generator=gen)
            step = final_residual(
                model, new, attention_mask=torch.ones_like(new), positions=torch.zeros_like(last), past_kv_cache=kv
            )
            outs.append(step)
    return outs


def _batch(model, rows=5, width=9, seed=1):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(5, model.cfg.d_vocab, (rows, width), generator=gen)
    mask = torch.ones_like(tokens)
    mask[: rows // 2, : width // 3] = 0  # left padding on some rows
    return tokens, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_attention_matches_transformer_lens_activations_and_decoding(dtype):
    model = cp.tiny_model("gemma", dtype=dtype)
    assert all(type(b.attn) is KVGroupedAttention for b in model.blocks)
    assert model.cfg.n_heads // model.cfg.n_key_value_heads > 1
    tokens, mask = _batch(model)
    names = lambda name: name.endswith(("hook_attn_scores", "hook_pattern", "hook_z"))  # noqa: E731
    _, ours = model.run_with_cache(tokens, attention_mask=mask, names_filter=names)
    with _with_tl_attention(model):
        _, theirs = model.run_with_cache(tokens, attention_mask=mask, names_filter=names)
        reference = _decode(model, tokens, mask)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 0, "atol": 0}
    assert set(ours.keys()) == set(theirs.keys()) and len(ours.keys()) == 3 * model.cfg.n_layers
    for name in theirs.keys():
        assert ours[name].shape == theirs[name].shape, name
        torch.testing.assert_close(ours[name], theirs[name], **tol)
    for a, b in zip(_decode(model, tokens, mask), reference):
        torch.testing.assert_close(a, b, **tol)


def test_hooks_on_grouped_attention_edit_the_same_way():
    """A hook that scales one head's z, or reads the pattern, acts as on TransformerLens's class."""
    model = cp.tiny_model("gemma")
    tokens, mask = _batch(model, rows=3, width=7)

    def scale(z, hook):
        z[:, :, 1] *= 3.0
        return z

    seen = {}

    def record(pattern, hook):
        seen.setdefault(hook.name, []).append(pattern.clone())

    hooks = [("blocks.0.attn.hook_z", scale), ("blocks.1.attn.hook_pattern", record)]
    ours = model.run_with_hooks(tokens, attention_mask=mask, fwd_hooks=hooks)
    with _with_tl_attention(model):
        theirs = model.run_with_hooks(tokens, attention_mask=mask, fwd_hooks=hooks)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    (a, b) = seen["blocks.1.attn.hook_pattern"]
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert not (ours - model(tokens, attention_mask=mask)).abs().max() < 1e-6  # the hook did act


def test_grouped_attention_is_idempotent_and_leaves_other_models_alone():
    model = cp.tiny_model("gemma")
    assert cp.grouped_attention.grouped_attention(model) is model
    assert all(type(b.attn) is KVGroupedAttention for b in model.blocks)
    assert isinstance(model.blocks[0].attn, GroupedQueryAttention)  # still TransformerLens's kind
    gpt2 = cp.tiny_model("gpt2")
    kinds = [type(b.attn) for b in gpt2.blocks]
    assert cp.grouped_attention.grouped_attention(gpt2) is gpt2 and [type(b.attn) for b in gpt2.blocks] == kinds
    assert KVGroupedAttention not in kinds


@pytest.mark.slow
def test_grouped_attention_is_bit_for_bit_on_the_embedded_model_in_bf16():
    """The embedded Gemma-3 in bf16: prefill and cached decoding steps equal TransformerLens's
    attention bit for bit where the CPU multiplies bf16 natively. Where PyTorch emulates bf16
    products (an AVX2-only CPU), the grouped and the repeated key/value products are accumulated
    in another order, so they agree to bf16 rounding only."""
    model = cp.load_model(dtype=torch.bfloat16)
    assert type(model.blocks[0].attn) is KVGroupedAttention
    tokens, mask = _batch(model, rows=6, width=24)
    ours = _decode(model, tokens, mask)
    with _with_tl_attention(model):
        theirs = _decode(model, tokens, mask)
    if native_on_cpu(torch.bfloat16):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    else:
        for a, b in zip(ours, theirs):  # each row's residual: the same direction and size
            a, b = a.float(), b.float()
            assert ((a - b).norm(dim=-1) / b.norm(dim=-1)).max() < 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_embedding_is_bit_for_bit_transformer_lens(dtype):
    """KVGroupedAttention.apply_rotary: the same values as TransformerLens's method, bit for bit,
    with and without a padding mask and a cache offset."""
    model = cp.tiny_model("gemma", dtype=dtype)
    attn = model.blocks[1].attn
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 6, model.cfg.n_heads, model.cfg.d_head, generator=gen).to(dtype) * 4
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :4] = 0
    for offset, attention_mask in ((0, None), (2, None), (3, mask), (0, mask[:, :6])):
        ours = attn.apply_rotary(x, offset, attention_mask)
        theirs = GroupedQueryAttention.apply_rotary(attn, x, offset, attention_mask)
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), (offset, attention_mask is not None)
        assert not torch.equal(ours, x)  # it did rotate
