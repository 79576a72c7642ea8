"""The two TransformerLens model classes cpsuper drives, and the few places where they differ.

- TransformerLens 3.x: :class:`~transformer_lens.HookedTransformer`, TransformerLens's own
  re-implementation of each architecture (cpsuper's reference backend).
- TransformerLens >= 4.3: ``TransformerBridge``, which wraps the Hugging Face model itself and, in
  compatibility mode, exposes the same hook names (``blocks.{l}.attn.hook_z``,
  ``blocks.{l}.hook_resid_pre``, ``ln_final.hook_in`` ...), ``start_at_layer`` and weight views.

Analyses see either through the :data:`Model` annotation and the helpers here:

- :func:`final_residual` runs to the residual stream after the last block. ``stop_at_layer`` does
  that on HookedTransformer, but on the bridge ``stop_at_layer=n_layers`` returns logits, so the
  bridge run is stopped at ``ln_final.hook_in`` (the way the bridge itself stops early);
- :func:`query_head_weights` gives ``W_V`` / ``W_K`` per *query* head: the bridge keeps them per
  key/value head under grouped-query attention ([layer, kv_head, d_model, d_head]);
- :func:`is_norm` recognises a normalisation module by its ``hook_scale``, not by its class, and
  :func:`norm_affine` reads its gain, bias and centring (Gemma's norms scale by ``1 + weight``);
- :func:`saving_hooks` stores activations under the names asked for (a bridge alias such as
  ``blocks.0.hook_resid_pre`` reports the name of the hook it points to);
- :func:`require_resident_weights` names, with the fix, a feature that reads weights a Hugging
  Face ``device_map`` offloaded to the CPU or disk.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from importlib.metadata import version
from typing import TYPE_CHECKING, Any, Literal

import torch
from jaxtyping import Float
from torch import Tensor

from .interrupts import hooked, skipped_blocks

try:  # TransformerLens 3.x
    from transformer_lens import HookedTransformer, HookedTransformerConfig
except ImportError:  # TransformerLens >= 4 removed them
    HookedTransformer = HookedTransformerConfig = None
try:
    from transformer_lens.model_bridge import TransformerBridge
except ImportError:
    TransformerBridge = None

if TYPE_CHECKING:  # what analyses accept: either backend's model
    from transformer_lens import HookedTransformer as _Hooked
    from transformer_lens.model_bridge import TransformerBridge as _Bridge

    Model = _Hooked | _Bridge
else:
    Model = Any

__all__ = [
    "Model",
    "TL_VERSION",
    "backend_of",
    "check_backend",
    "cut_after_last_attention",
    "default_backend",
    "final_residual",
    "is_bridge",
    "is_model",
    "is_norm",
    "norm_affine",
    "offloaded",
    "query_head_weights",
    "require_resident_weights",
    "saving_hooks",
]

Backend = Literal["hooked", "bridge"]
TL_VERSION: tuple[int, ...] = tuple(int(p) for p in version("transformer-lens").split(".")[:2] if p.isdigit())
BRIDGE_MIN_VERSION = (4, 3)  # start_at_layer on the bridge (3.x's bridge raises NotImplementedError)


def default_backend() -> Backend:
    """``"hooked"`` where TransformerLens 3.x is installed, else ``"bridge"``."""
    return "hooked" if HookedTransformer is not None else "bridge"


def check_backend(backend: str | None) -> Backend:
    """``backend`` checked against what the installed TransformerLens offers (``None``: the default)."""
    backend = backend or default_backend()
    if backend not in ("hooked", "bridge"):
        raise ValueError(f"backend must be 'hooked' or 'bridge' (or None for the default), got {backend!r}.")
    if backend == "hooked" and HookedTransformer is None:
        raise RuntimeError(require_message("backend='hooked'"))
    if backend == "bridge" and (TransformerBridge is None or TL_VERSION < BRIDGE_MIN_VERSION):
        raise RuntimeError(
            f"backend='bridge' needs TransformerLens >= {'.'.join(map(str, BRIDGE_MIN_VERSION))} "
            f"(installed: {'.'.join(map(str, TL_VERSION))}); install it with "
            "`pip install 'transformer-lens>=4.3'`, or use backend='hooked'."
        )
    return backend


def is_bridge(model: Any) -> bool:
    """Whether ``model`` is a TransformerBridge (TransformerLens >= 4)."""
    return TransformerBridge is not None and isinstance(model, TransformerBridge)


def is_model(obj: Any) -> bool:
    """Whether ``obj`` is a model cpsuper can run (either backend)."""
    return is_bridge(obj) or (HookedTransformer is not None and isinstance(obj, HookedTransformer))


def backend_of(model: Model) -> Backend:
    return "bridge" if is_bridge(model) else "hooked"


def require_message(feature: str) -> str:
    return (
        f"{feature} needs TransformerLens 3.x's HookedTransformer, which TransformerLens "
        f"{'.'.join(map(str, TL_VERSION))} no longer has. Install `transformer-lens>=3.9,<4` for it "
        "(pip install 'cpsuper[hooked]'); the analyses listed in docs/models.md run on both."
    )


def offloaded(model: Model) -> bool:
    """Whether a Hugging Face ``device_map`` left some weights off-device (CPU / disk offload: they
    sit on the meta device until accelerate brings each module in for its own forward)."""
    hf_model = getattr(model, "original_model", model)
    return any(p.device.type == "meta" for p in hf_model.parameters())


def require_resident_weights(feature: str, model: Model) -> None:
    """Raise a clear error when ``feature``, which reads weights directly, meets offloaded weights."""
    if offloaded(model):
        raise ValueError(
            f"{feature} reads the model's weights directly, but device_map offloaded some of them to the "
            "CPU or disk (they are on the meta device outside their module's forward). Load the model with "
            "a device_map that keeps every weight on an accelerator (or on the CPU alone), or run the "
            "hook-only analyses (sweeps, knockouts, scoring, JuICE), which work with offloading."
        )


class _ReachedFinalNorm(Exception):
    """Carries the residual stream out of a bridge forward pass at ``ln_final.hook_in``."""

    def __init__(self, resid: Tensor):
        super().__init__("stopped at ln_final.hook_in")
        self.resid = resid


def final_residual(
    model: Model, tokens: Any, *, positions: Tensor | None = None, **kwargs
) -> Float[Tensor, "batch *pos d_model"]:
    """The residual stream after the last block (before the final norm), ``[batch, pos, d_model]``;
    ``start_at_layer`` and ``attention_mask`` passed through; the unembedding is never computed.

    ``positions`` (one per row): only those, ``[batch, d_model]``. The last block's MLP then runs
    on them alone (:func:`cut_after_last_attention`), which nothing before it in that block reads."""
    if positions is not None:
        rows = torch.arange(len(positions), device=positions.device)
        cut = cut_after_last_attention(model, rows, positions)
        if cut is None:
            return final_residual(model, tokens, **kwargs)[rows, positions]
        with hooked(model, [cut]):
            return final_residual(model, tokens, **kwargs)[:, 0]
    if not is_bridge(model):
        return model(tokens, stop_at_layer=model.cfg.n_layers, **kwargs)

    def stop(resid: Tensor, hook) -> None:
        raise _ReachedFinalNorm(resid)

    kwargs.pop("padding_side", None)  # HookedTransformer's option; the bridge takes the mask as given
    if "past_kv_cache" in kwargs:  # the bridge's key-value cache is Hugging Face's, under its own name
        kwargs["past_key_values"] = kwargs.pop("past_kv_cache")
    try:
        # Resuming at a layer: the blocks before it do no work (the bridge would run and discard them).
        with skipped_blocks(model, kwargs.get("start_at_layer") or 0), hooked(model, [("ln_final.hook_in", stop)]):
            model(tokens, **kwargs)
    except _ReachedFinalNorm as reached:
        return reached.resid
    raise RuntimeError("The bridge's forward pass never reached ln_final.hook_in; cannot read the final residual.")


# The last block's hook points that see its MLP side (a cut at hook_resid_mid changes their shape).
_AFTER_CUT = ("hook_resid_mid", "ln2", "mlp", "hook_mlp_in", "hook_mlp_out", "ln2_post", "hook_resid_post")


def cut_after_last_attention(model: Model, rows: Tensor, positions: Tensor) -> tuple[str, Callable] | None:
    """A hook that keeps only ``positions`` (one per row) of the last block's residual stream after
    its attention, so that its MLP runs on those alone: about 70 % of a Gemma-3 layer's products
    saved for every other position, with the same values up to float rounding (the MLP treats
    positions independently). None where
    that is not safe: a TransformerBridge, a block without a separate MLP step (attention-only,
    or attention and MLP in parallel), or a hook already on the MLP side of the last block,
    which would see a cut tensor."""
    cfg = model.cfg
    if is_bridge(model) or cfg.attn_only or getattr(cfg, "parallel_attn_mlp", False):
        return None
    block = model.blocks[-1]
    for name, module in block.named_modules():
        hooks = module._forward_hooks or module._forward_pre_hooks
        if hooks and (module is block or name.split(".")[0] in _AFTER_CUT):
            return None
    return f"blocks.{cfg.n_layers - 1}.hook_resid_mid", lambda resid, hook: resid[rows, positions][:, None]


def query_head_weights(model: Model, name: Literal["W_V", "W_K"], layer: int | None = None) -> Tensor:
    """``W_V`` or ``W_K`` with one slice per query head ([layer, head, d_model, d_head], or
    [head, d_model, d_head] for one ``layer``), whichever way the backend stores them."""
    weights = getattr(model, name) if layer is None else getattr(model.blocks[layer].attn, name)
    head_axis = weights.ndim - 3
    n_stored, n_heads = weights.shape[head_axis], model.cfg.n_heads
    if n_stored != n_heads:
        weights = torch.repeat_interleave(weights, n_heads // n_stored, dim=head_axis)
    return weights


def is_norm(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a LayerNorm / RMSNorm of either backend (both expose ``hook_scale``)."""
    return hasattr(module, "hook_scale")


def norm_affine(norm: torch.nn.Module) -> tuple[Tensor | None, Tensor | None, bool]:
    """``(gain, bias, centred)`` of a norm: with its scale frozen, ``norm(x) = gain * (x - mean(x)
    if centred else x) / scale + bias`` (``None``: no gain / no bias)."""
    original = getattr(norm, "original_component", None)
    if original is None:  # HookedTransformer's LayerNorm(Pre) / RMSNorm(Pre); the Pre kinds carry no weights
        return getattr(norm, "w", None), getattr(norm, "b", None), type(norm).__name__.startswith("LayerNorm")
    gain = getattr(original, "weight", None)
    if gain is not None and type(original).__name__.startswith("Gemma"):  # Hugging Face Gemma: x * (1 + weight)
        gain = 1 + gain
    return gain, getattr(original, "bias", None), isinstance(original, torch.nn.LayerNorm)


def saving_hooks(
    names: Iterable[str], store: dict, transform: Callable[[Tensor], Any] | None = None
) -> list[tuple[str, Callable]]:
    """Forward hooks that put each activation (or ``transform`` of it) into ``store[name]``, keyed
    by the name asked for."""

    def save(act: Tensor, hook, name: str) -> None:
        store[name] = act if transform is None else transform(act)

    return [(name, lambda act, hook, name=name: save(act, hook, name)) for name in names]
