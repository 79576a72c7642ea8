"""HookedTransformer weights stored in the memory layout its forward pass reads them in.

TransformerLens 3.x keeps ``W_in`` as ``[d_model, d_mlp]``, ``W_Q`` as ``[head, d_model, d_head]``
and so on, but its forward hands ``F.linear`` the transposed matrix, made contiguous on every call:
``W_gate.T.contiguous()`` in the gated MLP, ``rearrange(W_Q, "h m d -> (h d) m")`` and
``rearrange(W_O, ...).contiguous()`` in attention. Each forward copies every MLP and attention
matrix of the model (400 MB for Gemma-3-270M), which costs more than the arithmetic of a decoding
step or of a small resumed batch.

:func:`fast_weight_layout` stores each such parameter as a strided view of a tensor laid out the way
the forward reads it. The parameter keeps its shape, values, name and identity (only its strides
change), the ``.contiguous()`` / ``rearrange`` calls become free views, and ``F.linear`` receives
the same contiguous matrix as before, so logits are bit-for-bit unchanged. The unembedding is
stored ``[d_vocab, d_model]`` too: TransformerLens's ``Unembed`` copies ``W_U.T`` on every call, and
a product with few rows (a decoding step, a resumed chunk's read-out) runs 1.2x to 1.8x faster
against that layout than against ``[d_model, d_vocab]`` (docs/results/performance.md). Re-storing it holds
two copies of that one matrix for a moment (0.67 GB for Gemma-3-270M in float32); the embedded
model's cache stores it in that order, so loading it needs no copy. ``load_model``,
``from_hf_model`` and ``tiny_model`` apply it to every HookedTransformer they return (the embedded
model's cache already stores these tensors in that order); a TransformerBridge needs nothing
(Hugging Face's ``nn.Linear`` already stores ``[out, in]``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .backend import Model, is_bridge

__all__ = ["fast_weight_layout"]

# parameter name -> the permutation of its dimensions that TransformerLens's forward reads
# contiguously (the gated MLP and the attention projections)
_READ_ORDER: dict[str, tuple[int, ...]] = {
    "W_gate": (1, 0),
    "W_in": (1, 0),
    "W_out": (1, 0),
    "W_Q": (0, 2, 1),
    "W_K": (0, 2, 1),
    "W_V": (0, 2, 1),
    "_W_K": (0, 2, 1),
    "_W_V": (0, 2, 1),
    "W_O": (2, 0, 1),
    "W_U": (1, 0),
}
# TransformerLens classes (and their subclasses) whose forward makes those copies
_COPYING_CLASSES = {"GatedMLP", "AbstractAttention", "Unembed"}


def fast_weight_layout(model: Model) -> Model:
    """Re-store the weights TransformerLens copies on every forward so that it no longer needs to.

    Values, shapes and parameter objects are unchanged; returns ``model``. Idempotent. A bridge
    model, and modules TransformerLens does not copy from (the plain MLP, embeddings, norms), are
    left as they are. Weight edits that write into a parameter (``param.copy_``, ``param.data =``)
    keep working; a reassigned tensor simply loses the speed-up.
    """
    if is_bridge(model):
        return model
    with torch.no_grad():
        for name, order in read_orders(model).items():
            param = model.get_parameter(name)
            read = param.data.permute(*order)
            if not read.is_contiguous():
                param.data = read.contiguous().permute(*inverse(order))
    return model


def read_orders(model: Model) -> dict[str, tuple[int, ...]]:
    """Parameter name -> the order of dimensions in which TransformerLens's forward reads it, for
    each parameter :func:`fast_weight_layout` re-stores. A model cache stores these tensors
    permuted to that order (contiguous), so that loading them needs no copy."""
    orders = {}
    for prefix, module in model.named_modules():
        if not _COPYING_CLASSES & {cls.__name__ for cls in type(module).__mro__}:
            continue
        for name, param in module.named_parameters(recurse=False):
            order = _READ_ORDER.get(name)
            if order is not None and param.dim() == len(order):
                orders[f"{prefix}.{name}" if prefix else name] = order
    return orders


def read_cached_weights(file: Path, model: Model, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file written in :func:`read_orders`'s orders, viewed back in
    ``model``'s parameter shapes (no copy) and cast to ``dtype``.

    Each tensor is read through its own memory map, released once it is cast: a bf16 load then
    holds the file's pages of one tensor at a time beside the bf16 weights, not the whole float32
    file (1.8 GB for Gemma-3-270M). A float32 load keeps each tensor on its map, copying nothing."""
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        names = list(f.keys())
    orders, state = read_orders(model), {}
    for name in names:
        with safe_open(str(file), framework="pt") as f:
            tensor = f.get_tensor(name)
        state[name] = (tensor.permute(*inverse(orders[name])) if name in orders else tensor).to(dtype)
    return state


def inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    """The permutation that undoes ``order``."""
    return tuple(sorted(range(len(order)), key=order.__getitem__))
