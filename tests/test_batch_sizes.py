"""batch_size="auto": rows per forward fitted to a memory budget, with the same results."""

import pandas as pd
import pytest

import cpsuper as cp
from cpsuper import batch_sizes


@pytest.fixture(scope="module")
def data(tiny_gemma):
    return cp.conflict_dataset("world_capital", n=3, tokenizer=tiny_gemma)


def test_auto_batches_give_the_fixed_batch_results(tiny_gemma, data):
    auto = cp.head_sweep(tiny_gemma, data, (0.0, 2.0), batch_size="auto", progress=False).per_example
    fixed = cp.head_sweep(tiny_gemma, data, (0.0, 2.0), batch_size=7, progress=False).per_example
    pd.testing.assert_frame_equal(auto, fixed, check_exact=False, atol=1e-6, rtol=0)


def test_rows_shrink_with_length_and_grow_with_the_budget(tiny_gemma):
    budget = 64 * batch_sizes.row_bytes(tiny_gemma, 100)
    assert batch_sizes.rows_that_fit(tiny_gemma, 100, budget) == 64
    assert batch_sizes.rows_that_fit(tiny_gemma, 200, budget) < 64 < batch_sizes.rows_that_fit(tiny_gemma, 50, budget)
    assert batch_sizes.rows_that_fit(tiny_gemma, 100, 10**15) == batch_sizes.MAX_ROWS
    assert (
        batch_sizes.free_memory("cpu") > 0 and 1 <= batch_sizes.rows_that_fit(tiny_gemma, 100) <= batch_sizes.MAX_ROWS
    )


def test_a_budget_below_one_row_is_refused(tiny_gemma):
    with pytest.raises(MemoryError, match="below one row of 100 tokens.*batch_size=1"):
        batch_sizes.rows_that_fit(tiny_gemma, 100, budget=batch_sizes.row_bytes(tiny_gemma, 100) - 1)


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
    assert layer + logits <= batch_sizes.row_bytes(tiny_gemma, n_tokens)


def test_auto_batches_in_truncation_and_stage_1(tiny_gemma, data):
    options = {"layers": [0, 2], "rhos": (0.5,), "progress": False}
    auto = cp.truncation_sweep(tiny_gemma, data, **options, batch_size="auto").per_example
    one = cp.truncation_sweep(tiny_gemma, data, **options, batch_size=1).per_example
    pd.testing.assert_frame_equal(auto, one, check_exact=False, atol=1e-6, rtol=0)
    auto = cp.identify_heads(tiny_gemma, data, k=2, batch_size="auto", progress=False).scores
    fixed = cp.identify_heads(tiny_gemma, data, k=2, batch_size=5, progress=False).scores
    pd.testing.assert_frame_equal(auto, fixed, check_exact=False, atol=1e-6, rtol=0)


def _padded(widths, chunks):
    return sum(len(c) * widths[c.start] for c in chunks)


def test_row_chunks_cover_every_row_once_within_the_bounds():
    widths = [w for w in (89, 78, 78, 77, 75, 72, 70, 66, 66) for _ in range(3)]
    chunks = batch_sizes.row_chunks(widths, max_rows=8, max_tokens=400)
    assert [r for c in chunks for r in c] == list(range(len(widths)))
    assert all(1 <= len(c) <= 8 and len(c) * widths[c.start] <= 400 for c in chunks)
    fixed = [range(lo, min(lo + 8, len(widths))) for lo in range(0, len(widths), 8)]
    assert _padded(widths, chunks) < _padded(widths, fixed)  # cut where the width drops, not every 8 rows


def test_row_chunks_cut_at_width_changes_when_that_saves_padding():
    # Two prompts' rows, 40 and 10 tokens: one chunk would pad 4 rows by 30 tokens (120 > one call).
    assert batch_sizes.row_chunks([40, 40, 10, 10], max_rows=64) == [range(0, 2), range(2, 4)]
    # Equal widths: one chunk, whatever their number up to the bound.
    assert batch_sizes.row_chunks([12] * 64, max_rows=64) == [range(0, 64)]
    assert [len(c) for c in batch_sizes.row_chunks([12] * 65, max_rows=64)] == [1, 64]
    # A row wider than the token budget still gets a chunk of its own.
    assert batch_sizes.row_chunks([500, 10], max_rows=4, max_tokens=100) == [range(0, 1), range(1, 2)]


def test_row_chunks_need_rows_ordered_by_width_and_positive_bounds():
    with pytest.raises(ValueError, match="non-increasing width"):
        batch_sizes.row_chunks([10, 12], max_rows=4)
    with pytest.raises(ValueError, match="max_rows and max_tokens >= 1"):
        batch_sizes.row_chunks([10, 8], max_rows=0)


def test_row_chunks_are_the_cheapest_cut():
    """Against every way of cutting a few rows into consecutive chunks (brute force), on random
    widths and bounds."""
    import itertools
    import random

    def cost(widths, chunks):
        return sum(len(c) * widths[c.start] + batch_sizes.CALL_TOKENS for c in chunks)

    def allowed(widths, chunks, max_rows, max_tokens):
        fits = lambda c: max_tokens is None or len(c) == 1 or len(c) * widths[c.start] <= max_tokens  # noqa: E731
        return all(len(c) <= max_rows and fits(c) for c in chunks)

    for seed in range(60):
        draw = random.Random(seed)
        widths = sorted((draw.choice([3, 5, 9, 20, 40, 60]) for _ in range(draw.randint(1, 9))), reverse=True)
        max_rows, max_tokens = draw.randint(1, 5), draw.choice([None, 20, 50, 120])
        best = float("inf")
        for cuts in itertools.product([False, True], repeat=len(widths) - 1):
            bounds = [0, *[i + 1 for i, c in enumerate(cuts) if c], len(widths)]
            chunks = [range(a, b) for a, b in zip(bounds, bounds[1:])]
            if allowed(widths, chunks, max_rows, max_tokens):
                best = min(best, cost(widths, chunks))
        chunks = batch_sizes.row_chunks(widths, max_rows, max_tokens)
        assert allowed(widths, chunks, max_rows, max_tokens) and cost(widths, chunks) == best, (widths, seed)


def test_many_rows_are_cut_quickly():
    widths = sorted((w for w in range(20, 120) for _ in range(200)), reverse=True)  # 20,000 rows
    chunks = batch_sizes.row_chunks(widths, max_rows=1024, max_tokens=2048)
    assert sum(map(len, chunks)) == len(widths)


def test_small_token_chunks_give_the_results_of_one_row_at_a_time(tiny_gemma, data, monkeypatch):
    """The engine's chunks under a tiny CPU token budget (many cuts, mixed prompt lengths in a
    chunk) against one row per forward: the same sweep."""
    monkeypatch.setattr(batch_sizes, "CHUNK_TOKENS", 40)
    import cpsuper.engine as engine

    monkeypatch.setattr(engine, "CHUNK_TOKENS", 40)
    chunked = cp.head_sweep(tiny_gemma, data, (0.0, 2.0), batch_size=64, progress=False).per_example
    one = cp.head_sweep(tiny_gemma, data, (0.0, 2.0), batch_size=1, progress=False).per_example
    pd.testing.assert_frame_equal(chunked, one, check_exact=False, atol=1e-6, rtol=0)
