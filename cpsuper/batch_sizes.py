"""Batch sizes fitted to memory: ``batch_size="auto"`` in the sweep engine.

A resumed forward of ``rows`` prompts of ``T`` tokens holds, at its largest, one layer's
activations per row (inference mode frees each layer's intermediates before the next), the
cached residual stream it resumed from, and the final position's logits in float32. The estimate
below counts those with a margin; ``rows_that_fit`` divides a memory budget (by default half of
what the device has free) by it. It is an estimate, not a guarantee: pass an explicit
``batch_size`` when other work shares the device.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Sequence

import torch

from .backend import Model

__all__ = ["CHUNK_TOKENS", "MAX_ROWS", "free_memory", "row_bytes", "row_chunks", "rows_that_fit"]

MAX_ROWS = 1024
"""Beyond this many rows per forward, larger batches gain nothing measurable."""


def free_memory(device: str | torch.device) -> int:
    """Bytes free on ``device``: the GPU's free memory, or the host's available memory."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def row_bytes(model: Model, n_tokens: int) -> int:
    """Estimated peak bytes of one row of ``n_tokens`` in a resumed forward (twice the live
    tensors counted, for allocator slack and temporaries)."""
    cfg = model.cfg
    width = torch.finfo(cfg.dtype).bits // 8 if cfg.dtype.is_floating_point else 4
    per_token = (
        6 * cfg.d_model  # residual stream, its cached copy, normed input, attention and MLP outputs
        + 4 * cfg.n_heads * cfg.d_head  # q, k, v (per query head after expansion) and z
        + 3 * (cfg.d_mlp or 0)  # pre-activation, gate, post-activation
    )
    scores = 2 * cfg.n_heads * n_tokens * 4  # attention scores and pattern, in float32 at worst
    logits = 3 * cfg.d_vocab_out * 4  # the final position's float32 logits and their softmax
    return 2 * (n_tokens * (per_token * width + scores) + logits)


def rows_that_fit(model: Model, n_tokens: int, budget: int | None = None) -> int:
    """Rows of ``n_tokens`` per forward that fit ``budget`` bytes (default: half the free memory
    of the model's device), between 1 and :data:`MAX_ROWS`."""
    budget = free_memory(model.cfg.device) // 2 if budget is None else int(budget)
    need = row_bytes(model, n_tokens)
    if budget < need:
        raise MemoryError(
            f"A memory budget of {budget / 2**20:.1f} MiB is below one row of {n_tokens} tokens "
            f"(about {need / 2**20:.1f} MiB); free memory, shorten the prompts, or pass batch_size=1."
        )
    return min(MAX_ROWS, budget // need)


CHUNK_TOKENS = 2048
"""On a CPU, at most this many padded tokens (rows x positions) per resumed forward. Beyond it one
layer's activations outgrow the processor's caches and each token costs more (6 to 18 % at 4,608
tokens on the embedded model; docs/results/performance.md)."""
CALL_TOKENS = 32
"""What one more forward call costs, counted in tokens of work (Python, hooks, small products:
about 20 ms against 0.6 ms a token for half the embedded model's layers on a CPU core)."""


def row_chunks(widths: Sequence[int], max_rows: int, max_tokens: int | None = None) -> list[range]:
    """Cut rows into consecutive chunks, one resumed forward each, padded to their widest row.

    ``widths``: each row's length, never increasing (rows of the longest prompts first). The cut
    minimises the padded tokens plus :data:`CALL_TOKENS` per chunk, with at most ``max_rows``
    rows and ``max_tokens`` padded tokens a chunk (a single wider row still gets its own)."""
    n = len(widths)
    if max_rows < 1 or (max_tokens is not None and max_tokens < 1):
        raise ValueError(f"row_chunks needs max_rows and max_tokens >= 1, got {max_rows} and {max_tokens}.")
    if any(a < b for a, b in zip(widths, widths[1:])):
        raise ValueError("row_chunks needs the rows ordered by non-increasing width.")
    runs = [i for i in range(1, n) if widths[i] != widths[i - 1]]  # where a narrower run of rows begins
    cost, cut = [0] + [0] * n, [0] * (n + 1)
    lo = 0  # smallest first row a chunk ending at j may have
    for j in range(1, n + 1):
        lo = max(lo, j - max_rows)
        while max_tokens is not None and lo < j - 1 and (j - lo) * widths[lo] > max_tokens:
            lo += 1
        # Within a run of equal widths the earliest first row is best, so only those are tried.
        firsts = [lo, *runs[bisect.bisect_right(runs, lo) : bisect.bisect_left(runs, j)]]
        cost[j], cut[j] = min((cost[i] + (j - i) * widths[i] + CALL_TOKENS, i) for i in firsts)
    chunks, j = [], n
    while j > 0:
        chunks.append(range(cut[j], j))
        j = cut[j]
    return chunks[::-1]
