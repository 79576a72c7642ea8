"""Reduced-precision runs (bf16 / fp16) of any analysis, with a float32 readout.

``with cp.precision.mixed_precision(model, "bf16"): ...`` runs every forward pass inside the block under
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
import warnings
from collections.abc import Iterator

import torch

from .backend import Model

__all__ = ["PRECISIONS", "mixed_precision", "native_on_cpu", "warn_if_slow_on_cpu"]

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


_ONEDNN_CHECKS = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}


def native_on_cpu(dtype: torch.dtype) -> bool:
    """Whether this CPU runs ``dtype`` matrix products on native instructions (oneDNN's own check:
    AVX-512 or AMX for bf16, AVX512-FP16 or AMX-FP16 for fp16). Without them PyTorch falls back to
    scalar kernels: on an AVX2 core a bf16 or fp16 product ran at 0.5 GFLOP/s against float32's 50."""
    if dtype not in _ONEDNN_CHECKS:
        return True
    try:
        return bool(getattr(torch.ops.mkldnn, _ONEDNN_CHECKS[dtype])())
    except (AttributeError, RuntimeError):  # a build without oneDNN: cannot tell, so do not warn
        return True


def warn_if_slow_on_cpu(device: str | torch.device | None, dtype: torch.dtype | None, *, stacklevel: int = 2) -> None:
    """Warn when ``dtype`` is a reduced precision that this CPU would emulate (:func:`native_on_cpu`):
    the numbers stay right, but a sweep can take tens of times longer than in float32."""
    if dtype not in _ONEDNN_CHECKS or torch.device(device or "cpu").type != "cpu" or native_on_cpu(dtype):
        return
    warnings.warn(
        f"{dtype} on this CPU (capability {torch.backends.cpu.get_cpu_capability()}) has no native matrix "
        "products, so PyTorch emulates them, often tens of times slower than float32. The results are "
        "unaffected; for speed here use float32, or run on a GPU or a CPU with AVX-512/AMX.",
        RuntimeWarning,
        stacklevel=stacklevel + 1,
    )


@contextlib.contextmanager
def mixed_precision(model: Model, precision: str | torch.dtype | None = "bf16") -> Iterator[None]:
    """Run the model's forward passes inside the block in ``precision`` (``"bf16"``, ``"fp16"`` or
    ``"fp32"``), on whatever device the model is; readouts and metrics stay float32.

    >>> with cp.precision.mixed_precision(model, "bf16"):
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
    warn_if_slow_on_cpu(device, dtype, stacklevel=3)  # the caller's `with` line
    with torch.autocast(device_type=device, dtype=dtype):
        yield
