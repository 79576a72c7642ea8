"""batch_size="auto": rows per forward fitted to a memory budget, with the same results."""

import pandas as pd
import pytest

import cpsuper as cp
from cpsuper import memory


@pytest.fixture(scope="module")
def data(tiny_gemma):
    return cp.conflict_dataset("world_capital", n=3, tokenizer=tiny_gemma)


def test_auto_batches_give_the_fixed_batch_results(tiny_gemma, data):
    auto = cp.head_sweep(tiny_gemma, data, (0.0, 2.0), batch_size="auto", progress=False).per_example
    fixed = cp.head_sweep(tiny_gemma, data, (0.0, 2.0), batch_size=7, progress=False).per_example
    pd.testing.assert_frame_equal(auto, fixed, check_exact=False, atol=1e-6, rtol=0)


def test_rows_shrink_with_length_and_grow_with_the_budget(tiny_gemma):
    budget = 64 * memory.row_bytes(tiny_gemma, 100)
    assert memory.rows_that_fit(tiny_gemma, 100, budget) == 64
    assert memory.rows_that_fit(tiny_gemma, 200, budget) < 64 < memory.rows_that_fit(tiny_gemma, 50, budget)
    assert memory.rows_that_fit(tiny_gemma, 100, 10**15) == memory.MAX_ROWS
    assert memory.free_memory("cpu") > 0 and 1 <= memory.rows_that_fit(tiny_gemma, 100) <= memory.MAX_ROWS


def test_a_budget_below_one_row_is_refused(tiny_gemma):
    with pytest.raises(MemoryError, match="below one row of 100 tokens.*batch_size=1"):
        memory.rows_that_fit(tiny_gemma, 100, budget=memory.row_bytes(tiny_gemma, 100) - 1)


@pytest.mark.parametrize("n_tokens", [8, 64])
def test_the_estimate_covers_every_activation_of_a_layer(tiny_gemma, n_tokens):
    """Everything one layer computes for a row (all its hooks kept at once), plus the final
    position's float32 logits, is within the estimate. A tensor seen by several hooks (the
    bridge's aliases: ``attn.hook_in`` is ``ln1.hook_out``) is memory once."""
    tokens = tiny_gemma.to_tokens("x" * 400)[:, :n_tokens]
    assert tokens.shape[1] == n_tokens
    _, cache = tiny_gemma.run_with_cache(tokens, names_filter=lambda name: name.startswith("blocks.0."))
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in cache.values()}
    layer = sum(storages.values())
    assert len(cache) >= 20 and layer >= tokens.shape[1] * 4 * tiny_gemma.cfg.d_mlp * 3
    logits = tiny_gemma.cfg.d_vocab_out * 4
    assert layer + logits <= memory.row_bytes(tiny_gemma, n_tokens)


def test_auto_batches_in_truncation_and_stage_1(tiny_gemma, data):
    options = {"layers": [0, 2], "rhos": (0.5,), "progress": False}
    auto = cp.truncation_sweep(tiny_gemma, data, **options, batch_size="auto").per_example
    one = cp.truncation_sweep(tiny_gemma, data, **options, batch_size=1).per_example
    pd.testing.assert_frame_equal(auto, one, check_exact=False, atol=1e-6, rtol=0)
    auto = cp.identify_heads(tiny_gemma, data, k=2, batch_size="auto", progress=False).scores
    fixed = cp.identify_heads(tiny_gemma, data, k=2, batch_size=5, progress=False).scores
    pd.testing.assert_frame_equal(auto, fixed, check_exact=False, atol=1e-6, rtol=0)
