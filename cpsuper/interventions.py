"""Interventions as small specifications, applied as TransformerLens hooks.

Each spec knows the hook it needs (:meth:`hook`). :func:`intervene` applies a list of them
inside :class:`cpsuper.runtime.hooked` (``model.hooks(...)``), which removes every hook on exit,
also when an exception is raised or Ctrl-C is pressed.

Heads are addressed through ``blocks.{layer}.attn.hook_z`` (one slice per *query* head), which
is correct for grouped-query attention and needs no ``use_attn_result``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from jaxtyping import Float
from torch import Tensor

from .backend import Model
from .interrupts import hooked, run_with_cache
from .runtime import check_finite, check_head, check_layer, padded_batches, require_hook, tokenize_prompts

__all__ = [
    "AddHeadOutput",
    "AddTwinHeadOutput",
    "Knockout",
    "ScaleHead",
    "intervene",
    "mean_activation",
    "module_hook_names",
]

Module = Literal["attn", "mlp", "layer"]
MODULES: tuple[str, ...] = ("attn", "mlp", "layer")


def _z_hook(model: Model, layer: int, head: int) -> str:
    """The per-query-head output hook of ``layer``, after checking the head exists."""
    check_head(model, layer, head)
    name = f"blocks.{layer}.attn.hook_z"
    require_hook(model, name)
    return name


def _checked_strength(value: float | Tensor, name: str) -> float | Tensor:
    """A finite number, or a tensor ``[batch]`` of per-row strengths, as the engine's ``HeadEdit``
    requires: a NaN or infinite scale would reach the model. A tensor's values are not read here
    (that would wait for the device on every decoding step); its shape is checked."""
    if isinstance(value, Tensor):
        if value.ndim != 1 or value.is_complex() or value.dtype == torch.bool:
            raise ValueError(
                f"{name} must be a number or a tensor [batch] of real numbers, got a {value.dtype} "
                f"tensor of shape {tuple(value.shape)}."
            )
        return value
    return check_finite(value, name)


def _per_row(value: float | Tensor, z: Tensor) -> float | Tensor:
    """A number as it is; a per-row tensor ``[batch]`` shaped to multiply ``z[:, :, head]``."""
    return value.to(z.device, z.dtype)[:, None, None] if isinstance(value, Tensor) else value


def module_hook_names(layer: int, module: Module) -> list[str]:
    """The output hooks a module knockout acts on: attention, MLP, or both (a whole layer)."""
    names = {
        "attn": [f"blocks.{layer}.hook_attn_out"],
        "mlp": [f"blocks.{layer}.hook_mlp_out"],
        "layer": [f"blocks.{layer}.hook_attn_out", f"blocks.{layer}.hook_mlp_out"],
    }
    if module not in names:
        raise ValueError(f"Unknown module {module!r}; use one of {MODULES}.")
    return names[module]


@dataclass(frozen=True)
class ScaleHead:
    """Multiply one query head's output (its ``z``, before ``W_O``) by ``scale`` at every position.

    ``scale=0`` knocks the head out; ``scale=1`` changes nothing; ``1 + a`` is the paper's
    ``H <- H + a H`` within a single pass (JuNe). A tensor ``[batch]`` gives each row its own scale.
    """

    layer: int
    head: int
    scale: float | Float[Tensor, " batch"]

    def hooks(self, model: Model) -> list[tuple[str, callable]]:
        name = _z_hook(model, self.layer, self.head)
        head, scale = self.head, _checked_strength(self.scale, "ScaleHead.scale")

        def hook(z: Float[Tensor, "batch pos head d_head"], hook):
            z = z.clone()
            z[:, :, head] = z[:, :, head] * _per_row(scale, z)
            return z

        return [(name, hook)]


@dataclass(frozen=True, eq=False)
class AddHeadOutput:
    """Add ``coef`` times a *recorded* output of one head (``z`` from an earlier run of the same
    prompts) to the head's current output: the second pass of JuICE's dual run.

    ``recorded`` has shape ``[batch, pos, d_head]`` matching the intervened batch; ``coef`` is a
    number or a tensor ``[batch]`` (one strength per row).
    """

    layer: int
    head: int
    coef: float | Float[Tensor, " batch"]
    recorded: Tensor

    def hooks(self, model: Model) -> list[tuple[str, callable]]:
        name = _z_hook(model, self.layer, self.head)
        head, coef, recorded = self.head, _checked_strength(self.coef, "AddHeadOutput.coef"), self.recorded

        def hook(z: Float[Tensor, "batch pos head d_head"], hook):
            if recorded.shape != z[:, :, head].shape:
                raise ValueError(
                    f"Recorded output of head {self.layer}.{head} has shape {tuple(recorded.shape)}, but "
                    f"the current batch needs {tuple(z[:, :, head].shape)}; record it on the same prompts."
                )
            z = z.clone()
            z[:, :, head] = z[:, :, head] + _per_row(coef, z) * recorded.to(z.device, z.dtype)
            return z

        return [(name, hook)]


@dataclass(frozen=True, eq=False)
class AddTwinHeadOutput:
    """The dual run in one forward pass: the batch holds the same prompts twice, unsteered rows
    first and steered rows second, and each steered row's output of one head gets ``coef`` times
    its unsteered twin's output of that head (at the same layer of the same pass, which the
    unsteered rows reach unchanged, as attention mixes positions, never rows).

    This is what a key-value cache of both passes together needs: one cache for the stacked
    batch. ``coef`` is a number or a tensor ``[batch]`` over the steered rows.
    """

    layer: int
    head: int
    coef: float | Float[Tensor, " batch"]

    def hooks(self, model: Model) -> list[tuple[str, callable]]:
        name = _z_hook(model, self.layer, self.head)
        head, coef = self.head, _checked_strength(self.coef, "AddTwinHeadOutput.coef")

        def hook(z: Float[Tensor, "batch pos head d_head"], hook):
            if z.shape[0] % 2:
                raise ValueError(f"A twin batch holds every prompt twice; got {z.shape[0]} rows.")
            n = z.shape[0] // 2
            z = z.clone()
            z[n:, :, head] = z[n:, :, head] + _per_row(coef, z[n:]) * z[:n, :, head]
            return z

        return [(name, hook)]


@dataclass(frozen=True, eq=False)
class Knockout:
    """Knock out a whole module at ``layer`` at every position: attention, MLP, or both.

    ``mean=None`` zeroes its output (zero-ablation); a tensor ``[d_model]`` (see
    :func:`mean_activation`) replaces it with that mean (mean-ablation; for ``module="layer"``
    pass a dict ``{"attn": ..., "mlp": ...}``).
    """

    layer: int
    module: Module = "layer"
    mean: Tensor | dict | None = None

    def hooks(self, model: Model) -> list[tuple[str, callable]]:
        check_layer(model, self.layer)
        out = []
        for name in module_hook_names(self.layer, self.module):
            require_hook(model, name)
            kind = "attn" if name.endswith("attn_out") else "mlp"
            mean = self.mean[kind] if isinstance(self.mean, dict) else self.mean

            def hook(act: Float[Tensor, "batch pos d_model"], hook, mean=mean):
                if mean is None:
                    return torch.zeros_like(act)
                return mean.to(act.device, act.dtype).expand_as(act).clone()

            out.append((name, hook))
        return out


Intervention = ScaleHead | AddHeadOutput | AddTwinHeadOutput | Knockout


def intervene(model: Model, interventions: Intervention | Iterable[Intervention]) -> hooked:
    """Apply interventions for the duration of a ``with`` block; hooks are always removed, also
    after an exception or Ctrl-C (a context manager object, not a generator, so an interrupt
    cannot leave it suspended with its hooks attached).

    >>> with intervene(model, [ScaleHead(5, 2, 0.0), Knockout(3, "mlp")]):
    ...     logits = model(prompt)
    """
    if isinstance(interventions, (ScaleHead, AddHeadOutput, AddTwinHeadOutput, Knockout)):
        interventions = [interventions]
    return hooked(model, [h for spec in interventions for h in spec.hooks(model)])


def mean_activation(
    model: Model,
    prompts: Sequence[str],
    hook_name: str,
    *,
    batch_size: int = 32,
) -> Float[Tensor, " d_model"]:
    """Mean of a hook's activation over all real (non-padding) positions of ``prompts``."""
    require_hook(model, hook_name)
    token_lists = tokenize_prompts(model, prompts)
    # Run only as far as the hook's block.
    stop = int(hook_name.split(".")[1]) + 1 if hook_name.startswith("blocks.") else None
    total, count = None, 0
    for _, tokens, mask, _ in padded_batches(model, token_lists, batch_size=batch_size):
        with torch.inference_mode():
            _, cache = run_with_cache(model, tokens, names_filter=hook_name, stop_at_layer=stop)
        act = cache[hook_name]
        summed = (act * mask[..., None]).sum(dim=(0, 1))
        total = summed if total is None else total + summed
        count += int(mask.sum())
    return total / count
