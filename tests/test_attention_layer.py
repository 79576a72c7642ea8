"""layer_attention: the per-layer subject attention (maximum over the subject's tokens within each
head, then the mean over the layer's heads), checked against patterns read by hand."""

import numpy as np
import pytest
import torch

import cpsuper as cp
from cpsuper.attention import attention_to_span, layer_attention


@pytest.fixture(scope="module")
def capitals(tiny_gemma):
    return cp.conflict_dataset("world_capital", n=5, tokenizer=tiny_gemma).with_prompts(["clean"])


def _subject_positions(model, prompt: str, subject: str) -> np.ndarray:
    """Token positions whose characters overlap the subject, from the tokenizer's own offsets."""
    start = prompt.index(subject)
    end = start + len(subject)
    encoded = model.tokenizer(prompt, return_offsets_mapping=True)
    assert encoded["input_ids"] == model.to_tokens(prompt)[0].tolist()
    return np.array([a < end and b > start and a < b for a, b in encoded["offset_mapping"]])


def _by_hand(model, dataset) -> dict[tuple[int, int], float]:
    """(example, layer) -> mean over heads of the maximum over subject tokens of the last row."""
    out = {}
    for i, example in enumerate(dataset):
        prompt = example.prompts["clean"]
        mask = _subject_positions(model, prompt, example.subject)
        with torch.inference_mode():
            _, cache = model.run_with_cache(prompt)
        for layer in range(model.cfg.n_layers):
            last_row = cache[f"blocks.{layer}.attn.hook_pattern"][0, :, -1].float().numpy()  # [head, src]
            out[i, layer] = float(last_row[:, mask].max(axis=1).mean())
    return out


def test_layer_attention_is_the_head_mean_of_the_subject_maximum(tiny, capitals):
    frame = layer_attention(tiny, capitals, "subject", progress=False, batch_size=2)
    assert len(frame) == len(capitals) * tiny.cfg.n_layers
    assert set(frame.columns) >= {"example", "subject", "conflict_type", "layer", "attention", "n_heads", "reduce"}
    assert (frame.n_heads == tiny.cfg.n_heads).all() and (frame.reduce == "max").all()
    assert (frame.n_span_tokens >= 2).all()  # several subject tokens, so max, sum and mean differ
    expected = _by_hand(tiny, capitals)
    got = frame.set_index(["example", "layer"]).attention
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=1e-6)
    # a sum over the subject's tokens would be larger on every row of this data
    summed = layer_attention(tiny, capitals, "subject", reduce="sum", progress=False)
    assert (summed.attention.to_numpy() > frame.attention.to_numpy() + 1e-6).all()


def test_per_layer_averages_attention_to_span_over_heads(tiny_gemma, capitals):
    result = attention_to_span(tiny_gemma, capitals, "subject", reduce="max", progress=False)
    per_layer = result.per_layer()
    heads = result.per_example.groupby(["example", "layer"]).attention.agg(["mean", "max"])
    joined = per_layer.join(heads, on=["example", "layer"])
    np.testing.assert_allclose(joined.attention, joined["mean"], atol=1e-7)
    assert (joined["max"] > joined["mean"] + 1e-6).any()  # the heads differ: a max over them would show
    # the head mean of the per-layer rows equals the result's own per-layer summary
    by_layer = result.by_layer().set_index("layer").attention
    np.testing.assert_allclose(per_layer.groupby("layer").attention.mean(), by_layer, atol=1e-7)
