"""What an intervention is: the edits a sweep condition is made of, and their checks.

A condition is a list of edits applied together: :class:`HeadEdit` (scale a query head's output,
or add its clean output back, as JuICE's second pass does), :class:`ModuleEdit` (scale a whole
attention or MLP output), :class:`PatchEdit` (put a source prompt's activation in at one position
or all, or mix it in), :class:`OffsetEdit` (add a fixed vector at every position, e.g. a mean
ablation's replacement) and :class:`WeightEdit` (edit weights in place, e.g. a truncation). The sweep engine,
:func:`cpsuper.engine.run_conditions`, runs many conditions at once.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor

from .backend import Model
from .runtime import check_finite, check_head, check_layer, require_hook

__all__ = [
    "ALIGNMENTS",
    "PATCH_SITES",
    "Condition",
    "Edit",
    "HeadEdit",
    "ModuleEdit",
    "OFFSET_SITES",
    "OffsetEdit",
    "PatchEdit",
    "WeightEdit",
    "aligned_positions",
    "check_condition",
]


@dataclass(frozen=True)
class HeadEdit:
    """Edit one query head's output at every position: ``z <- scale * z + add * z_clean``.

    ``z_clean`` is the head's output recorded in the clean run of the same prompt, so
    ``HeadEdit(l, h, add=beta)`` is JuICE's second pass and ``HeadEdit(l, h, scale=1 + beta)``
    is JuNe's single pass. For a single edited head the two coincide.
    """

    layer: int
    head: int
    scale: float = 1.0
    add: float = 0.0


@dataclass(frozen=True)
class ModuleEdit:
    """Scale a module's output at every position (``scale=0`` knocks it out).

    ``module`` is ``"attn"``, ``"mlp"`` or ``"layer"`` (both).
    """

    layer: int
    module: str
    scale: float = 0.0


@dataclass(frozen=True)
class WeightEdit:
    """Edit weights of ``layer`` (or later layers) for every row at once, e.g. a truncation.

    ``apply(model)`` returns a context manager that edits the weights and restores them on exit.
    A condition holding a weight edit holds nothing else; its rows resume from ``layer`` with
    the edit in place. ``identity=True`` marks an edit that changes nothing (reuses the clean run).
    """

    layer: int
    apply: Callable[[Model], AbstractContextManager]
    identity: bool = False


PATCH_SITES: dict[str, str] = {
    "resid_pre": "blocks.{layer}.hook_resid_pre",
    "attn_out": "blocks.{layer}.hook_attn_out",
    "mlp_out": "blocks.{layer}.hook_mlp_out",
    "z": "blocks.{layer}.attn.hook_z",
}
"""Where a :class:`PatchEdit` can patch, and the hook point of each (``z``: one query head)."""

ALIGNMENTS: tuple[str, ...] = ("end", "start", "exact")
"""How a destination position finds its source position: counted from each prompt's last token
(``"end"``: a shared question suffix lines up), from the first (``"start"``), or the same index
in prompts of equal length (``"exact"``, an error otherwise)."""


@dataclass(frozen=True)
class PatchEdit:
    """Replace the activation at ``site`` of ``layer`` with the source prompt's clean value.

    ``position``: the destination token index patched (negative counts from the end, ``-1`` is
    the final token), or ``None`` for every destination position that has a source counterpart;
    the source position is the aligned one (:data:`ALIGNMENTS`, :func:`aligned_positions`).
    ``site`` is one of :data:`PATCH_SITES`; ``"z"`` patches one query head (``head``).
    ``weight``: how much of the source value goes in, ``act <- (1 - weight) * act + weight *
    source`` at the patched positions (``1``, the default, replaces; a resample ablation that
    keeps ``alpha`` of a head passes ``weight = 1 - alpha``).
    Needs ``source_tokens`` in :func:`run_conditions`.
    """

    layer: int
    site: str
    position: int | None = None
    head: int | None = None
    weight: float = 1.0

    @property
    def hook_name(self) -> str:
        return PATCH_SITES[self.site].format(layer=self.layer)


OFFSET_SITES: tuple[str, ...] = ("z", "attn_out", "mlp_out")
"""Where an :class:`OffsetEdit` can add its vector (the hook points of :data:`PATCH_SITES`)."""


@dataclass(frozen=True, eq=False)
class OffsetEdit:
    """Add a fixed ``vector`` to the activation at ``site`` of ``layer``, at every position.

    ``site`` is ``"z"`` (one query head, ``head``; ``vector`` is ``[d_head]``), ``"attn_out"`` or
    ``"mlp_out"`` (``[d_model]``). The engine adds it after the condition's scales in the same
    hook, so ``[HeadEdit(l, h, scale=a), OffsetEdit(l, "z", (1 - a) * m, head=h)]`` is
    ``a * z + (1 - a) * m``: a mean ablation of the knocked-out part (``a = 0`` replaces the head's
    output by ``m``). Two offset edits are equal only if they are the same object.
    """

    layer: int
    site: str
    vector: Float[Tensor, " d"]
    head: int | None = None

    @property
    def hook_name(self) -> str:
        return PATCH_SITES[self.site].format(layer=self.layer)


Edit = HeadEdit | ModuleEdit | WeightEdit | PatchEdit | OffsetEdit
Condition = Sequence[Edit]


def aligned_positions(
    position: int | None, n_destination: int, n_source: int, align: str = "end"
) -> list[tuple[int, int]]:
    """The ``(destination, source)`` token index pairs a patch at ``position`` touches in a
    destination of ``n_destination`` tokens with a source of ``n_source``; empty where the
    position does not exist in the destination or has no counterpart in the source."""
    if position is None:
        wanted = range(n_destination)
    else:
        index = position + n_destination if position < 0 else position
        wanted = [index] if 0 <= index < n_destination else []
    shift = n_source - n_destination if align == "end" else 0
    return [(d, d + shift) for d in wanted if 0 <= d + shift < n_source]


def _check_site(model: Model, edit: PatchEdit | OffsetEdit, sites) -> None:
    """The layer, the site among ``sites`` and, for ``"z"`` alone, the query head of a patch or offset."""
    kind = type(edit).__name__
    check_layer(model, edit.layer)
    if edit.site not in sites:
        raise ValueError(f"Unknown {kind} site {edit.site!r}; use one of {tuple(sites)}.")
    if edit.site == "z":
        if edit.head is None:
            raise ValueError(
                f"{kind}(site='z') at layer {edit.layer} needs a query head: pass head=0..{model.cfg.n_heads - 1}."
            )
        check_head(model, edit.layer, edit.head)
    elif edit.head is not None:
        raise ValueError(f"{kind}.head is only for site='z'; site {edit.site!r} is the whole activation.")


def _check_patch(model: Model, edit: PatchEdit) -> None:
    _check_site(model, edit, PATCH_SITES)
    check_finite(edit.weight, "PatchEdit.weight")
    if edit.position is not None and (
        isinstance(edit.position, bool) or not isinstance(edit.position, numbers.Integral)
    ):
        raise ValueError(
            f"PatchEdit.position must be a token index (negative from the end) or None, got {edit.position!r}."
        )
    require_hook(model, edit.hook_name)


def _check_offset(model: Model, edit: OffsetEdit) -> None:
    _check_site(model, edit, OFFSET_SITES)
    size = model.cfg.d_head if edit.site == "z" else model.cfg.d_model
    if not isinstance(edit.vector, Tensor) or tuple(edit.vector.shape) != (size,):
        shape = tuple(edit.vector.shape) if isinstance(edit.vector, Tensor) else type(edit.vector).__name__
        raise ValueError(f"OffsetEdit.vector at site {edit.site!r} must be a tensor of shape ({size},), got {shape}.")
    if not bool(torch.isfinite(edit.vector).all()):
        raise ValueError(f"OffsetEdit.vector at layer {edit.layer}, site {edit.site!r} has non-finite values.")
    require_hook(model, edit.hook_name)


def check_condition(model: Model, condition: Condition) -> None:
    """Raise a clear error for a condition that is not a list of valid edits for ``model``."""
    if isinstance(condition, (HeadEdit, ModuleEdit, WeightEdit, PatchEdit, OffsetEdit)):
        raise TypeError(f"A condition is a list of edits; wrap {condition!r} in a list.")
    for edit in condition:
        if isinstance(edit, HeadEdit):
            check_head(model, edit.layer, edit.head)
            check_finite(edit.scale, "HeadEdit.scale")
            check_finite(edit.add, "HeadEdit.add")
            require_hook(model, f"blocks.{edit.layer}.attn.hook_z")
        elif isinstance(edit, ModuleEdit):
            check_layer(model, edit.layer)
            check_finite(edit.scale, "ModuleEdit.scale")
            if edit.module not in ("attn", "mlp", "layer"):
                raise ValueError(f"Unknown module {edit.module!r}; use 'attn', 'mlp' or 'layer'.")
            for kind in ("attn", "mlp") if edit.module == "layer" else (edit.module,):
                require_hook(model, f"blocks.{edit.layer}.hook_{kind}_out")
        elif isinstance(edit, WeightEdit):
            check_layer(model, edit.layer)
            if len(condition) != 1:
                raise ValueError("A condition with a WeightEdit holds only that edit.")
        elif isinstance(edit, PatchEdit):
            _check_patch(model, edit)
        elif isinstance(edit, OffsetEdit):
            _check_offset(model, edit)
        else:
            raise TypeError(f"Not an edit: {edit!r}; use HeadEdit, ModuleEdit, PatchEdit, OffsetEdit or WeightEdit.")
