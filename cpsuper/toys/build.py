"""Toy models on either backend, with their weights addressed by TransformerLens's names.

The toys construct their weights by hand (``W_K`` holds a chosen ``W_KQ``, ``W_Q`` is an
identity ...) and train a chosen few of them. Both need to reach the tensor behind a name such
as ``"blocks.0.attn.W_K"``:

- on TransformerLens 3.x that name *is* a parameter of the :class:`HookedTransformer`, stored in
  the layout the name promises (``[head, d_model, d_head]``);
- on TransformerLens >= 4.3 the model is the bridge around a native (Hugging Face free)
  TransformerLens model, ``TransformerBridge.boot_native``: ``W_K`` is a view computed from an
  ``nn.Linear`` weight stored ``[(head d_head), d_model]``, and writing into the view changes
  nothing.

:func:`toy_transformer` builds either one from the same config fields; :func:`write_weights`,
:func:`toy_parameter` and :func:`stored_weights` take weights in TransformerLens's layout and
put them where the model keeps them (TransformerLens's own ``convert_tl_checkpoint`` does the
layout change on the bridge); :func:`hooked_state` reads every weight back by name, the form
the toys' checkpoints take on both backends, and :func:`load_toy_state` loads one, so a run
saved on one backend loads on the other. Reading a weight needs none of this: both
backends expose ``model.W_E``, ``model.blocks[l].attn.W_K`` ... in the same layout. Training
the stored tensor is training the named weight: the layout change is a fixed permutation, so
plain SGD steps are the same numbers.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from ..backend import HookedTransformer, HookedTransformerConfig, Model, check_backend, is_bridge
from ..hub import quiet_deprecation
from ..truncation.hf_weights import parameter_name

__all__ = [
    "hooked_state",
    "load_toy_state",
    "read_weight",
    "set_activation",
    "stored_weights",
    "toy_parameter",
    "toy_transformer",
    "trainable_names",
    "write_weights",
]


def toy_transformer(*, backend: str | None = None, tokenizer: Any = None, **fields: Any) -> Model:
    """A model built from TransformerLens config ``fields`` alone (``n_layers``, ``d_model``,
    ``n_heads``, ``d_head``, ``d_vocab``, ``n_ctx``, ``act_fn``, ``attn_only``,
    ``normalization_type``, ``positional_embedding_type``, ``use_attn_scale``, ``init_weights``,
    ``seed``, ``device``, ``model_name`` ...), float32.

    ``backend``: ``"hooked"`` (a :class:`HookedTransformer`, TransformerLens 3.x), ``"bridge"``
    (``TransformerBridge.boot_native``, TransformerLens >= 4.3) or ``None`` for the one the
    installed TransformerLens has. ``use_attn_scale=False`` means unscaled attention scores on
    both (the native model would otherwise still divide by ``sqrt(d_head)``). ``tokenizer``: a
    Hugging Face tokenizer, for string prompts (the toys feed token ids and need none).
    """
    if check_backend(backend) == "hooked":
        cfg = HookedTransformerConfig(dtype=torch.float32, **fields)
        with quiet_deprecation():
            return HookedTransformer(cfg, tokenizer=tokenizer, move_to_device=False)
    return _native_bridge(tokenizer=tokenizer, **fields)


def _native_bridge(
    *, tokenizer: Any, device: str | torch.device = "cpu", model_name: str = "toy", **fields: Any
) -> Model:
    import transformer_lens.model_bridge.sources.native  # noqa: F401  (registers TransformerBridge.boot_native)
    from transformer_lens.config import TransformerBridgeConfig
    from transformer_lens.model_bridge import TransformerBridge

    with torch.random.fork_rng(devices=[]):  # (nn.Linear's default init would draw from the caller's generator)
        model = TransformerBridge.boot_native(
            TransformerBridgeConfig(**fields),
            tokenizer=tokenizer,
            device=device,
            dtype=torch.float32,
            model_name=model_name,
        )
    if not fields.get("use_attn_scale", True):
        for layer in model.original_model.layers:
            layer.attn.original_component.scale = 1.0
    return model


def read_weight(model: Model, name: str) -> Tensor:
    """TransformerLens weight ``name`` (``"blocks.1.mlp.W_in"`` ...) in its layout, on either backend."""
    return operator.attrgetter(name)(model)


def _bridge_slot(model: Model, name: str, value: Tensor | None = None) -> tuple[str, Tensor]:
    """(state-dict key, value in the stored layout) of TransformerLens weight ``name`` on a bridge."""
    from transformer_lens.utilities.tl_checkpoint_conversion import convert_tl_checkpoint

    value = read_weight(model, name).detach() if value is None else value
    ((key, stored),) = convert_tl_checkpoint({name: value}, model.cfg).items()
    return key, stored


def toy_parameter(model: Model, name: str) -> Tensor:
    """The tensor that stores TransformerLens weight ``name`` (``"blocks.0.attn.W_K"``,
    ``"embed.W_E"`` ...): the parameter itself on a HookedTransformer, the ``nn.Linear`` /
    ``nn.Embedding`` weight behind the view on a bridge. Set its ``requires_grad`` to train it."""
    if not is_bridge(model):
        return model.get_parameter(name)
    key, _ = _bridge_slot(model, name)
    return model.state_dict(keep_vars=True)[key]


def write_weights(model: Model, weights: Mapping[str, Tensor]) -> None:
    """Copy ``weights`` (TransformerLens name -> tensor in TransformerLens's layout) into ``model``."""
    with torch.no_grad():
        if not is_bridge(model):
            for name, value in weights.items():
                model.get_parameter(name).copy_(value)
            return
        state = model.state_dict(keep_vars=True)
        for name, value in weights.items():
            key, stored = _bridge_slot(model, name, value.to(torch.float32))
            state[key].copy_(stored)


def stored_weights(model: Model, weights: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``weights`` (TransformerLens name -> tensor in its layout) as parameter name -> tensor in the
    layout the model stores, for :class:`cpsuper.interrupts.swapped_parameters`."""
    if not is_bridge(model):
        return dict(weights)
    state = model.state_dict(keep_vars=True)
    out = {}
    for name, value in weights.items():
        key, stored = _bridge_slot(model, name, value)
        out[parameter_name(model, state[key])] = stored.contiguous()
    return out


# the native bridge's state-dict names -> TransformerLens's weight names (what convert_tl_checkpoint renames)
_HOOKED_NAMES = {
    "embed.weight": "embed.W_E",
    "pos_embed.weight": "pos_embed.W_pos",
    "unembed.weight": "unembed.W_U",
    "unembed.bias": "unembed.b_U",
    **{f"attn.{m}.weight": f"attn.W_{m.upper()}" for m in "qkvo"},
    **{f"attn.{m}.bias": f"attn.b_{m.upper()}" for m in "qkvo"},
    **{f"mlp.{m}.weight": f"mlp.W_{m}" for m in ("in", "out", "gate")},
    **{f"mlp.{m}.bias": f"mlp.b_{m}" for m in ("in", "out", "gate")},
}


def _hooked_name(key: str) -> str:
    for suffix, name in _HOOKED_NAMES.items():
        if key == suffix or key.endswith("." + suffix):
            return key[: len(key) - len(suffix)] + name
    raise ValueError(f"No TransformerLens weight name for the bridge's {key!r}; the toys have no such weight.")


def hooked_state(model: Model) -> dict[str, Tensor]:
    """The model's weights by TransformerLens name, in TransformerLens's layout: a
    HookedTransformer's state dict, and the same names and tensors for a bridge (a toy's checkpoints
    are kept this way, so a run saved on one backend loads on the other). Detached; not copied."""
    if not is_bridge(model):
        return {k: v.detach() for k, v in model.state_dict().items()}
    names = [_hooked_name(key) for key in model.state_dict()]
    return {name: read_weight(model, name).detach() for name in names}


def trainable_names(model: Model) -> set[str]:
    """The keys of :func:`hooked_state` whose stored tensor requires a gradient."""
    stored = model.state_dict(keep_vars=True)
    if not is_bridge(model):
        return {k for k, t in stored.items() if t.requires_grad}
    return {_hooked_name(k) for k, t in stored.items() if t.requires_grad}


def load_toy_state(model: Model, state: Mapping[str, Tensor]) -> Model:
    """Load a checkpoint (a :func:`hooked_state` from either backend, or a bridge's own state dict)
    into ``model``; returns it."""
    state = dict(state)
    if state and not any(".W_" in key or ".b_" in key for key in state):  # a bridge's own names
        if not is_bridge(model):
            raise ValueError(
                "This checkpoint holds a TransformerBridge's own state dict; a HookedTransformer cannot "
                "read it. Load it with TransformerLens >= 4.3, or save hooked_state(model) instead."
            )
    elif is_bridge(model):
        from transformer_lens.utilities.tl_checkpoint_conversion import convert_tl_checkpoint

        state = convert_tl_checkpoint(state, model.cfg)
    else:  # a bridge's hooked_state lacks HookedTransformer's attention-mask buffers: keep the model's own
        params = {name for name, _ in model.named_parameters()}
        state = {k: v for k, v in model.state_dict().items() if k not in params} | state
    model.load_state_dict(state, strict=True)
    return model


def set_activation(model: Model, layer: int, fn: Callable[[Tensor], Tensor]) -> None:
    """Make block ``layer``'s MLP use activation ``fn``."""
    mlp = model.blocks[layer].mlp
    if is_bridge(model):
        mlp.original_component.act = fn
    else:
        mlp.act_fn = fn
