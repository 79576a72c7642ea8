"""Reduced-precision runs (bf16 / fp16) of any analysis, with a float32 readout.

``with cp.mixed_precision(model, "bf16"): ...`` runs every forward pass inside the block under
``torch.autocast`` for the model's device: matrix products in the low precision (accumulated in
float32 by the kernels), norms and softmaxes in float32 as autocast keeps them. cpsuper's readout
(:func:`cpsuper.decoding.unembed_final`) leaves autocast and unembeds in the weights' own precision,
and every metric (softmax over the vocabulary, log-probabilities) is taken on float32 logits.
So head sweeps, knockouts, JuICE stage 1, steering, scoring and truncation sweeps all take the
option without an argument of their own, and a run outside the block is untouched.

Measure what it costs in agreement before trusting a conclusion to it:
``benchmarks/bench_precision.py`` reports speed against float32, the largest probability
difference and the overlap of the top heads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .backend import Model

__all__ = ["PRECISIONS", "mixed_precision"]

PRECISIONS: dict[str, torch.dtype | None] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": None,
    "float32": None,
}
"""Accepted spellings; ``fp32`` runs the block unchanged (handy for a sweep over precisions)."""


def _dtype(precision: str | torch.dtype | None) -> torch.dtype | None:
    if precision is None or precision == torch.float32:
        return None
    if isinstance(precision, torch.dtype):
        if precision in (torch.bfloat16, torch.float16):
            return precision
        raise ValueError(f"Unsupported precision {precision}; use torch.bfloat16, torch.float16 or torch.float32.")
    if precision not in PRECISIONS:
        raise ValueError(f"Unknown precision {precision!r}; use one of {sorted(PRECISIONS)}.")
    return PRECISIONS[precision]


@contextlib.contextmanager
def mixed_precision(model: Model, precision: str | torch.dtype | None = "bf16") -> Iterator[None]:
    """Run the model's forward passes inside the block in ``precision`` (``"bf16"``, ``"fp16"`` or
    ``"fp32"``), on whatever device the model is; readouts and metrics stay float32.

    >>> with cp.mixed_precision(model, "bf16"):
    ...     sweep = cp.head_sweep(model, facts, (0.0,))
    """
    dtype = _dtype(precision)
    if dtype is None:
        yield
        return
    device = torch.device(model.cfg.device or "cpu").type
    if model.cfg.dtype not in (torch.float32, dtype):
        raise ValueError(
            f"The model's weights are {model.cfg.dtype}; mixed precision {dtype} runs on float32 weights "
            "(load the model in float32, or run it as it is without this block)."
        )
    with torch.autocast(device_type=device, dtype=dtype):
        yield
