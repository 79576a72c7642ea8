"""Where a truncated matrix lives on a TransformerBridge: the Hugging Face parameter behind each of
TransformerLens's weight views, and the layout change between the two.

TransformerLens names the matrices ``W_in [d_model, d_mlp]``, ``W_O [head, d_head, d_model]``,
``W_V [kv_head, d_model, d_head]`` ...; the bridge computes those views from the Hugging Face
modules it wraps, so a truncation is written into the module's own parameter (``nn.Linear``
stores ``[out, in]``, GPT-2's ``Conv1D`` stores ``[in, out]``) and swapped back on exit like any
other parameter (:class:`cpsuper.interrupts.swapped_parameters`).
"""

from __future__ import annotations

import einops
import torch
from torch import Tensor

from ..backend import Model

__all__ = ["hf_matrices", "hf_replacements", "parameter_name"]

# TransformerLens matrix -> (which block part, Hugging Face module names to look for, in order)
_MODULES = {
    "mlp_in": ("mlp", ("up_proj", "c_fc", "fc1")),
    "mlp_gate": ("mlp", ("gate_proj",)),
    "mlp_out": ("mlp", ("down_proj", "c_proj", "fc2")),
    "attn_o": ("attn", ("o_proj", "c_proj", "out_proj", "dense")),
    "attn_v": ("attn", ("v_proj",)),
}


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    return getattr(module, "_original_component", module)


def _module(model: Model, layer: int, matrix: str) -> torch.nn.Module | None:
    part, names = _MODULES[matrix]
    original = getattr(getattr(model.blocks[layer], part, None), "original_component", None)
    for name in names:
        if original is not None and hasattr(original, name):
            return _unwrap(getattr(original, name))
    return None


def hf_matrices(model: Model) -> tuple[str, ...]:
    """The truncatable matrices (names of :data:`~cpsuper.truncation.MATRICES`) a bridged model has.
    ``attn_v`` needs a separate value projection (GPT-2's fused ``c_attn`` has none)."""
    names = [m for m in ("mlp_in", "mlp_gate", "mlp_out", "attn_v", "attn_o") if _module(model, 0, m) is not None]
    if "attn_v" in names:
        names += ["attn_ov"]
    return tuple(n for n in ("mlp_in", "mlp_gate", "mlp_out", "attn_v", "attn_o", "attn_ov") if n in names)


def parameter_name(model: Model, param: Tensor) -> str:
    """The name under which ``model.named_parameters()`` lists ``param`` (by identity)."""
    for name, candidate in model.named_parameters():
        if candidate is param:
            return name
    raise RuntimeError("A weight of this bridge is not registered as one of its parameters.")


def _to_hf(module: torch.nn.Module, matrix: str, new: Tensor) -> Tensor:
    """A TransformerLens-layout matrix in the layout of ``module.weight``."""
    linear = isinstance(module, torch.nn.Linear)  # [out, in]; Conv1D keeps [in, out]
    if matrix.startswith("mlp_"):
        return new.T if linear else new
    if matrix == "attn_o":  # [head, d_head, d_model]
        return einops.rearrange(new, "h d m -> m (h d)" if linear else "h d m -> (h d) m")
    return einops.rearrange(new, "k m d -> (k d) m")  # attn_v: v_proj is a Linear


def hf_replacements(model: Model, layer: int, matrix: str, new: Tensor) -> dict[str, Tensor]:
    """Parameter name -> tensor that puts ``new`` (TransformerLens layout of ``matrix``, or
    ``"b_O"``'s ``[d_model]``) into the bridged model's Hugging Face weights."""
    if matrix == "b_O":
        module = _module(model, layer, "attn_o")
        if module is None or module.bias is None:
            raise ValueError(f"Layer {layer}'s attention output projection has no bias to shift.")
        return {parameter_name(model, module.bias): new.detach().clone()}
    module = _module(model, layer, matrix)
    if module is None:
        raise ValueError(f"This bridged model has no Hugging Face module for {matrix!r} in layer {layer}.")
    return {parameter_name(model, module.weight): _to_hf(module, matrix, new).contiguous()}
