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
from .engine import run_conditions
from .interrupts import run_with_cache
from .metrics import Metric
from .runtime import (
    answer_token,
    check_conflict_dataset,
    check_dataset,
    check_targets,
    padded_batches,
    resolve_conflict_types,
    tokenize_prompts,
)
from .sweeps import SweepResult, summarize_sweep, sweep_dataset

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
    options = {"conflict_types": conflict_types, "targets": targets, "metric": metric}
    if ablation != "resample":
        return sweep_dataset(model, dataset, conditions, labels, **options, batch_size=batch_size, progress=progress)
    sources = derangement(len(dataset), seed)
    if len(labels) != len(conditions):
        raise ValueError(f"{len(labels)} label rows for {len(conditions)} conditions.")
    targets = check_targets(targets)
    conflict_types = resolve_conflict_types(dataset, conflict_types)
    check_dataset(model, dataset, conflict_types=conflict_types)
    frames = []
    for conflict_type in conflict_types:
        prompts = dataset.prompts(conflict_type)
        tokens = tokenize_prompts(model, prompts)
        ids = torch.tensor(
            [[answer_token(model, e.target_answer(t), p) for t in targets] for e, p in zip(dataset, prompts)]
        )
        clean, swept = run_conditions(
            model,
            tokens,
            ids,
            conditions,
            metric=metric,
            batch_size=batch_size,
            progress=progress,
            desc=f"{conflict_type} (resample)",
            source_tokens=[tokens[j] for j in sources],
            align="end",
        )
        n, n_cond, n_t = swept.shape
        frame = pd.DataFrame(
            {
                "example": np.repeat(np.arange(n), n_cond * n_t),
                "condition": np.tile(np.repeat(np.arange(n_cond), n_t), n),
                "target": np.tile(np.array(targets), n * n_cond),
                "p_clean": clean[:, None, :].expand(n, n_cond, n_t).reshape(-1).numpy(),
                "p": swept.reshape(-1).numpy(),
            }
        )
        frame["subject"] = [dataset[i].subject for i in frame["example"]]
        frame["conflict_type"] = conflict_type
        frames.append(frame)
    per_example = pd.concat(frames, ignore_index=True)
    per_example["delta"] = per_example["p"] - per_example["p_clean"]
    per_example = labels.reset_index(drop=True).join(per_example.set_index("condition"), how="right")
    per_example = per_example.reset_index(drop=True)
    summary = summarize_sweep(per_example, [*labels.columns, "conflict_type", "target"])
    ordered = ["example", "subject", *labels.columns, "conflict_type", "target", "p_clean", "p", "delta"]
    per_example = per_example[ordered]
    per_example.attrs["metric"] = metric if isinstance(metric, str) else getattr(metric, "__name__", "custom")
    per_example.attrs.update(model=model.cfg.model_name, n_layers=model.cfg.n_layers, n_heads=model.cfg.n_heads)
    per_example.attrs["sources"] = sources
    return SweepResult(per_example, summary)
