"""fast_weight_layout: TransformerLens's forward stops copying weights, and nothing else changes."""

from __future__ import annotations

import pytest
import torch

import cpsuper as cp

PROMPTS = ["The capital of France is", "Madrid is the capital of"]


def _plain(model):
    """Every parameter contiguous in its own shape: the layout TransformerLens builds."""
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.contiguous()
    return model


def _read_as_forward_reads(model) -> dict[str, torch.Tensor]:
    """The matrices TransformerLens's forward hands to F.linear, in the order it reads them."""
    out = {}
    for l, block in enumerate(model.blocks):
        attn = block.attn
        keys = ("W_Q", "_W_K", "_W_V") if hasattr(attn, "_W_K") else ("W_Q", "W_K", "W_V")
        for name in keys:
            out[f"blocks.{l}.attn.{name}"] = getattr(attn, name).permute(0, 2, 1)
        out[f"blocks.{l}.attn.W_O"] = attn.W_O.permute(2, 0, 1)
        if hasattr(block.mlp, "W_gate"):
            for name in ("W_gate", "W_in", "W_out"):
                out[f"blocks.{l}.mlp.{name}"] = getattr(block.mlp, name).T
    out["unembed.W_U"] = model.W_U.T
    return out


@pytest.mark.parametrize("kind", ["gemma", "gpt2"])
def test_logits_and_activations_are_bit_for_bit_unchanged(kind):
    fast, plain = cp.tiny_model(kind), _plain(cp.tiny_model(kind))
    assert any(not p.is_contiguous() for p in fast.parameters())  # the layout did change
    tokens = fast.to_tokens(PROMPTS)
    fast_logits, fast_cache = fast.run_with_cache(tokens)
    plain_logits, plain_cache = plain.run_with_cache(tokens)
    assert torch.equal(fast_logits, plain_logits)
    for name in ("blocks.1.attn.hook_z", "blocks.1.hook_mlp_out", "blocks.2.hook_resid_post"):
        assert torch.equal(fast_cache[name], plain_cache[name]), name


def test_what_the_forward_reads_is_already_contiguous():
    model = cp.tiny_model("gemma")
    read = _read_as_forward_reads(model)
    assert len(read) == 3 * (4 + 3) + 1
    assert [name for name, matrix in read.items() if not matrix.is_contiguous()] == []
    # load_model's tiny models and TransformerLens's plain layout, for contrast
    assert all(m.is_contiguous() for m in _read_as_forward_reads(cp.load_model("tiny-gemma")).values())
    assert not any(m.is_contiguous() for m in _read_as_forward_reads(_plain(model)).values())


def test_parameters_keep_identity_shape_and_values_and_a_second_call_changes_nothing():
    model = _plain(cp.tiny_model("gemma"))
    before = {name: (param, param.detach().clone()) for name, param in model.named_parameters()}
    assert cp.weight_layout.fast_weight_layout(model) is model
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for name, (param, values) in before.items():
        assert after[name] is param and param.shape == values.shape and torch.equal(param, values), name
    storage = {name: param.data_ptr() for name, param in model.named_parameters()}
    cp.weight_layout.fast_weight_layout(model)
    assert {name: param.data_ptr() for name, param in model.named_parameters()} == storage


def test_training_and_in_place_edits_still_work():
    model = cp.tiny_model("gemma")
    tokens = model.to_tokens(PROMPTS)
    w_in = model.blocks[0].mlp.W_in
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(tokens, return_type="loss").backward()
    assert w_in.grad is not None and w_in.grad.shape == w_in.shape
    optimizer.step()
    assert w_in.T.is_contiguous()  # the optimizer updates in place: the layout outlives training
    with torch.no_grad():
        w_in.copy_(torch.zeros_like(w_in))
    plain = _plain(cp.tiny_model("gemma"))
    with torch.no_grad():
        for p, q in zip(plain.parameters(), model.parameters()):
            p.copy_(q)
    assert torch.equal(model(tokens), plain(tokens))


@pytest.mark.parametrize("kind", ["gemma", "gpt2"])
def test_cpsupers_readout_is_transformer_lens_unembedding_in_either_layout(kind):
    from cpsuper.decoding import unembed_final

    fast, plain = cp.tiny_model(kind), _plain(cp.tiny_model(kind))
    assert fast.W_U.T.is_contiguous() and plain.W_U.is_contiguous()
    with torch.no_grad():
        plain.unembed.b_U.normal_()  # a bias, so that adding it is checked too
        fast.unembed.b_U.copy_(plain.unembed.b_U)
    tokens = fast.to_tokens(PROMPTS)
    logits, cache = plain.run_with_cache(tokens)
    final = cache[f"blocks.{plain.cfg.n_layers - 1}.hook_resid_post"][:, -1]
    read = unembed_final(fast, final)
    with torch.no_grad():  # TransformerLens's own final norm and Unembed on the same rows
        assert torch.equal(read, fast.unembed(fast.ln_final(final[:, None]))[:, 0])
    torch.testing.assert_close(read, logits[:, -1], rtol=0, atol=1e-5)  # the norm of one position vs all
    torch.testing.assert_close(unembed_final(plain, final), read, rtol=0, atol=1e-5)  # other kernels
