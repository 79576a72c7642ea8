"""Ablation kinds: what a knocked-out component's output is replaced by.

``"zero"`` sets it to zero (the JuICE paper's knockouts). Zeroing can take the rest of the model
off its usual inputs, so interpretability work often prefers

- ``"mean"``: the component's mean output over a reference set of prompts, one vector per
  component, the same at every position (averaged over every real, non-padding token of every
  reference prompt, the BOS token included, as :func:`cpsuper.interventions.mean_activation`);
  applied by an :class:`~cpsuper.edits.OffsetEdit`;
- ``"resample"``: the component's output on another example's prompt of the same conflict type
  (a random derangement of the examples, by ``seed``), patched in at the positions lined up
  from the prompts' ends (:class:`~cpsuper.edits.PatchEdit`, ``align="end"``). Positions of a
  longer prompt that have no counterpart in the shorter source keep their own value.

A scale ``alpha`` keeps that much of the component: ``alpha * out + (1 - alpha) * replacement``,
so ``alpha = 0`` is the full replacement and ``alpha = 1`` changes nothing.
:func:`cpsuper.knockout_sweep` and :func:`cpsuper.head_sweep` take ``ablation=``, ``reference=``
and ``seed=`` and build their conditions here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from .backend import Model
from .data.examples import ConflictDataset
from .edits import Condition, HeadEdit, ModuleEdit, OffsetEdit, PatchEdit
from .interrupts import run_with_cache
from .metrics import Metric
from .runtime import (
    check_conflict_dataset,
    padded_batches,
    tokenize_prompts,
)
from .sweeps import SweepResult, sweep_dataset

__all__ = [
    "ABLATIONS",
    "check_ablation",
    "derangement",
    "head_ablation",
    "mean_outputs",
    "module_ablation",
    "sweep_ablated",
]

ABLATIONS: tuple[str, ...] = ("zero", "mean", "resample")
"""The ablation kinds: replace a component's output by zero, by its mean over reference prompts,
or by its output on another example's prompt."""

_MODULE_SITES = {"attn": ("attn_out",), "mlp": ("mlp_out",), "layer": ("attn_out", "mlp_out")}


def check_ablation(ablation: str) -> str:
    """``ablation`` if it is one of :data:`ABLATIONS`; a clear error otherwise."""
    if not isinstance(ablation, str) or ablation not in ABLATIONS:
        raise ValueError(f"Unknown ablation {ablation!r}; use one of {ABLATIONS} (default 'zero').")
    return ablation


def mean_outputs(
    model: Model,
    reference: ConflictDataset,
    hook_names: Sequence[str],
    *,
    batch_size: int = 16,
) -> dict[str, Float[Tensor, "*shape"]]:
    """Mean of each hook's activation over every real (non-padding) token of every prompt of
    ``reference`` (all its conflict types), position-independent: ``{hook name: mean}``, where a
    ``hook_z`` mean is ``[n_heads, d_head]`` and a module output's ``[d_model]``. One forward pass
    per prompt batch reads every hook; sums are kept in float64."""
    reference = check_conflict_dataset(reference, "reference")
    if len(reference) == 0:
        raise ValueError(
            "reference has no examples, so no mean can be taken; pass a ConflictDataset with rows "
            "(or reference=None to average over the swept dataset)."
        )
    names = sorted(set(hook_names))
    if not names:
        return {}
    prompts = [p for c in reference.conflict_types for p in reference.prompts(c)]
    token_lists = tokenize_prompts(model, prompts)
    stop = max(int(n.split(".")[1]) for n in names) + 1
    sums: dict[str, Tensor] = {}
    count = 0
    with torch.inference_mode():
        for _, tokens, mask, _ in padded_batches(model, token_lists, batch_size=batch_size):
            tokens, mask = tokens.to(model.cfg.device), mask.to(model.cfg.device)
            _, cache = run_with_cache(model, tokens, names_filter=lambda n: n in names, stop_at_layer=stop)
            for name in names:
                act = cache[name].double()
                weights = mask.double().reshape(*mask.shape, *([1] * (act.ndim - 2)))
                summed = (act * weights).sum(dim=(0, 1))
                sums[name] = summed if name not in sums else sums[name] + summed
            count += int(mask.sum())
    return {name: (total / count).to(model.cfg.dtype) for name, total in sums.items()}


def derangement(n: int, seed: int = 0) -> list[int]:
    """A random permutation of ``range(n)`` with no fixed point (every example gets another's
    prompt), drawn by ``seed``; ``n`` must be at least 2."""
    if n < 2:
        raise ValueError(
            f"ablation='resample' needs at least 2 examples to draw another example's prompt from, got {n}; "
            "sweep more facts or use ablation='mean'."
        )
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(n)
        if not np.any(order == np.arange(n)):
            return [int(i) for i in order]


def module_ablation(layer: int, module: str, ablation: str, means: dict[str, Tensor] | None = None) -> Condition:
    """The edits that replace ``module`` (``"attn"``, ``"mlp"``, ``"layer"``) at ``layer`` by
    zero, its mean (``means`` from :func:`mean_outputs`) or a resampled source's output."""
    if ablation == "zero":
        return [ModuleEdit(layer, module, 0.0)]
    if ablation == "mean":
        offsets = [OffsetEdit(layer, s, means[f"blocks.{layer}.hook_{s}"]) for s in _MODULE_SITES[module]]
        return [ModuleEdit(layer, module, 0.0), *offsets]
    return [PatchEdit(layer, site) for site in _MODULE_SITES[module]]


def head_ablation(
    layer: int, head: int, alpha: float, ablation: str, means: dict[str, Tensor] | None = None
) -> Condition:
    """The edits that keep ``alpha`` of a query head's output and fill the rest with zero, its
    mean, or a resampled source's output: ``alpha * z + (1 - alpha) * replacement``."""
    if ablation == "zero":
        return [HeadEdit(layer, head, scale=alpha)]
    if ablation == "mean":
        mean = means[f"blocks.{layer}.attn.hook_z"][head]
        return [HeadEdit(layer, head, scale=alpha), OffsetEdit(layer, "z", (1.0 - alpha) * mean, head=head)]
    return [PatchEdit(layer, "z", head=head, weight=1.0 - alpha)]


def sweep_ablated(
    model: Model,
    dataset: ConflictDataset,
    conditions: Sequence[Condition],
    *,
    labels: pd.DataFrame,
    ablation: str = "zero",
    seed: int = 0,
    conflict_types: Sequence[str] | None = None,
    targets: Sequence[str] = ("parametric", "context"),
    metric: str | Metric = "probability",
    batch_size: int | str = 64,
    progress: bool = True,
) -> SweepResult:
    """:func:`cpsuper.sweeps.sweep_dataset` with an ``ablation`` column after the labels; for
    ``"resample"`` each example's patches read the prompt of example ``derangement(n, seed)[i]``
    of the same conflict type (``per_example.attrs["sources"]``), aligned from the end."""
    labels = labels.assign(ablation=ablation)
    sources = derangement(len(dataset), seed) if ablation == "resample" else None
    options = {"conflict_types": conflict_types, "targets": targets, "metric": metric, "sources": sources}
    return sweep_dataset(model, dataset, conditions, labels, **options, batch_size=batch_size, progress=progress)
