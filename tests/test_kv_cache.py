"""kv_cache: a left-padded batch prefilled in groups of similar width equals its joint prefill."""

import torch
from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache

import cpsuper as cp
from cpsuper.backend import final_residual
from cpsuper.decoding import greedy_batch
from cpsuper.kv_cache import prefill_groups, stack_group_caches
from cpsuper.runtime import pad_tokens


def _prompts(model, lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(5, model.cfg.d_vocab, (n,), generator=gen).tolist() for n in lengths]


def test_prefill_groups_cut_only_where_padding_costs_more_than_a_call():
    assert prefill_groups([12, 12, 11, 12]) is None  # one prefill is cheapest
    assert prefill_groups([5]) is None
    groups = prefill_groups([12, 90, 11, 88, 13, 89])  # context-free twins beside their partners
    assert sorted(map(sorted, groups)) == [[0, 2, 4], [1, 3, 5]]


def test_stacked_group_caches_equal_the_joint_prefill_on_real_positions():
    model = cp.tiny_model("gemma")
    lengths = [4, 30, 3, 29]
    tokens, mask, _ = pad_tokens(model, _prompts(model, lengths), "left")
    last = torch.full((len(lengths),), tokens.shape[1] - 1)
    joint = TransformerLensKeyValueCache.init_cache(model.cfg, "cpu", len(lengths))
    with torch.inference_mode():
        final_residual(model, tokens, attention_mask=mask, positions=last, past_kv_cache=joint)
        groups = prefill_groups(lengths)
        assert sorted(map(sorted, groups)) == [[0, 2], [1, 3]]
        parts = []
        for rows in groups:
            width = max(lengths[r] for r in rows)
            parts.append(TransformerLensKeyValueCache.init_cache(model.cfg, "cpu", len(rows)))
            final_residual(
                model,
                tokens[rows, -width:],
                attention_mask=mask[rows, -width:],
                positions=torch.full((len(rows),), width - 1),
                past_kv_cache=parts[-1],
            )
        stacked = stack_group_caches(TransformerLensKeyValueCache.init_cache(model.cfg, "cpu", 4), groups, parts, mask)
    assert torch.equal(stacked.previous_attention_mask, joint.previous_attention_mask)
    real = mask.bool()
    for ours, theirs in zip(stacked.entries, joint.entries):
        for name in ("past_keys", "past_values"):
            a, b = getattr(ours, name), getattr(theirs, name)
            assert a.shape == b.shape
            torch.testing.assert_close(a[real], b[real], rtol=1e-5, atol=1e-5)
            for rows in groups:  # left of a group's own width: zeros, kept out by the mask
                assert not a[rows, : tokens.shape[1] - max(lengths[r] for r in rows)].any()


def test_greedy_decoding_of_mixed_widths_equals_each_prompt_alone():
    """A batch whose prefill runs in two groups decodes each prompt as it decodes alone."""
    model = cp.tiny_model("gemma")
    prompts = _prompts(model, [3, 28, 4, 27, 26], seed=3)
    widths = []
    handle = model.blocks[0].register_forward_hook(lambda mod, args, out: widths.append(out.shape[:2]))
    try:
        first, ids = greedy_batch(model, prompts, 5)
    finally:
        handle.remove()
    assert sorted(tuple(w) for w in widths if w[1] > 1) == [(2, 4), (3, 28)]  # two prefills, own widths
    for row, prompt in enumerate(prompts):
        alone_first, alone_ids = greedy_batch(model, [prompt], 5)
        assert ids[row] == alone_ids[0]
        torch.testing.assert_close(first[row], alone_first[0], rtol=1e-4, atol=1e-4)
