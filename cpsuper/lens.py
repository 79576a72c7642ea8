"""The logit lens: each layer's residual stream read out as if it were the last.

At the final position of every prompt, the residual stream entering block ``L`` (``L = 0`` is the
embedding, ``L = n_layers`` the stream after the last block) goes through the model's own final
norm, recomputed on that residual (Gemma's RMSNorm with its gain, GPT-2's LayerNorm with its
centring), and the unembedding, in float32 (:func:`cpsuper.decoding.unembed_final`). The answers'
logit, log-probability, probability and rank among the whole vocabulary are read from that
distribution. At ``L = n_layers`` this is exactly the model's output.

This differs from the cumulative direct logit attribution of
:meth:`cpsuper.attribution.Attribution.by_layer`, which freezes the final norm's scale at its
value on the last layer and adds up each writer's linear contribution: there, partial sums are
never normalised on their own, and no distribution over the vocabulary is formed.

One forward pass per prompt batch caches ``blocks.{L}.hook_resid_pre`` at the last positions of
every wanted layer; the layers are never run one at a time.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from .backend import Model, final_residual, saving_hooks
from .data.examples import ConflictDataset
from .decoding import READOUT_ROWS, unembed_final
from .interrupts import hooked
from .runtime import (
    answer_token,
    check_batch_size,
    check_conflict_dataset,
    check_dataset,
    check_flag,
    check_model,
    check_targets,
    padded_batches,
    require_hook,
    resolve_conflict_types,
    tokenize_prompts,
)
from .stats import bootstrap_ci, bootstrap_summary, check_options

__all__ = ["LogitLens", "logit_lens"]

_KEYS = ["conflict_type", "target", "layer"]


@dataclass
class LogitLens:
    """Result of :func:`logit_lens`.

    ``per_example``: one row per example x conflict type x target x layer with the answer's
    first-token ``logit``, ``logprob``, ``probability`` and ``rank`` (1 = the top token of the
    whole vocabulary) when the residual stream entering ``layer`` is read through the final norm
    and the unembedding (``layer == n_layers``: the model's own output).
    ``summary``: per conflict type x target x layer, the mean probability, mean log-probability,
    median rank and share of facts at rank 1, each with a 95 % percentile bootstrap interval over
    facts (``*_low`` / ``*_high``), and ``n`` facts. ``n_layers`` is the model's block count.
    """

    per_example: pd.DataFrame
    summary: pd.DataFrame
    n_layers: int

    def intervals(self, *, n_boot: int = 2000, ci: float = 0.95, seed: int = 0) -> pd.DataFrame:
        """The summary recomputed with other bootstrap settings (``summary`` uses the defaults)."""
        return lens_summary(self.per_example, n_boot=n_boot, ci=ci, seed=seed)

    def wide(self, value: str = "probability") -> pd.DataFrame:
        """One row per example x conflict type x layer, one column per target holding ``value``
        (``"probability"``, ``"logprob"``, ``"logit"`` or ``"rank"``): the memorised and the
        context answer side by side."""
        if value not in ("probability", "logprob", "logit", "rank"):
            raise ValueError(f"value must be 'probability', 'logprob', 'logit' or 'rank', got {value!r}.")
        keys = ["example", "subject", "relation", "conflict_type", "layer"]
        out = self.per_example.pivot(index=keys, columns="target", values=value).reset_index()
        out.columns.name = None
        return out[[*keys, *dict.fromkeys(self.per_example.target)]]

    def _repr_html_(self) -> str:
        return self.summary._repr_html_()

    def __repr__(self) -> str:
        return f"LogitLens({len(self.per_example)} per-example rows, layers 0..{self.n_layers})\n{self.summary!r}"


def check_lens_layers(model: Model, layers: Sequence[int] | None) -> list[int]:
    """Residual streams to read: every one (``None``) or the given ones, each in ``0..n_layers``
    (``n_layers``: after the last block), sorted and without repeats."""
    n = model.cfg.n_layers
    valid = f"this model has residual streams 0..{n} (layer L enters block L; {n} is after the last block)"
    if layers is None:
        return list(range(n + 1))
    if isinstance(layers, numbers.Integral) and not isinstance(layers, bool):
        layers = [layers]
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
        raise ValueError(f"layers must be a sequence of layers ({valid}), got {layers!r}; pass e.g. layers=[0, {n}].")
    if len(layers) == 0:
        raise ValueError(f"layers is empty; give at least one layer ({valid}), or leave layers out for all of them.")
    for layer in layers:
        if isinstance(layer, (bool, np.bool_)) or not isinstance(layer, numbers.Integral) or not 0 <= layer <= n:
            raise ValueError(f"Unknown layer {layer!r} in layers: {valid}.")
    return sorted({int(layer) for layer in layers})


def _answer_stats(
    logits: Float[Tensor, "rows d_vocab"], ids: Int[Tensor, "rows n_answers"]
) -> tuple[Tensor, Tensor, Tensor]:
    """Logit, log-probability and rank (1 = top; ties counted in the answer's favour) of each
    row's answers."""
    logits = logits.float()
    picked = logits.gather(1, ids)
    logprob = picked - logits.logsumexp(-1, keepdim=True)
    rank = (logits[:, None, :] > picked[:, :, None]).sum(-1) + 1
    return picked, logprob, rank


@torch.inference_mode()
def _lens_batch(
    model: Model,
    tokens: Int[Tensor, "batch pos"],
    mask: Int[Tensor, "batch pos"],
    last: Int[Tensor, " batch"],
    ids: Int[Tensor, "batch n_answers"],
    layers: list[int],
) -> tuple[Tensor, Tensor, Tensor]:
    """``(logit, logprob, rank)``, each ``[batch, n_layers_read, n_answers]``, for one batch."""
    n = model.cfg.n_layers
    rows = torch.arange(tokens.shape[0], device=tokens.device)
    names = [f"blocks.{layer}.hook_resid_pre" for layer in layers if layer < n]
    store: dict[str, Tensor] = {}
    padded = bool((mask == 0).any())
    with hooked(model, saving_hooks(names, store, transform=lambda act: act[rows, last])):
        final = final_residual(
            model, tokens, attention_mask=mask if padded else None, padding_side="right", positions=last
        )
    resid = torch.stack([store[name] if layer < n else final for layer, name in zip(layers, [*names, None])], 1)
    flat = resid.reshape(-1, resid.shape[-1])  # row-major: prompt, then layer
    flat_ids = ids.to(flat.device).repeat_interleave(len(layers), 0)
    parts = [
        _answer_stats(unembed_final(model, flat[s : s + READOUT_ROWS]), flat_ids[s : s + READOUT_ROWS])
        for s in range(0, len(flat), READOUT_ROWS)
    ]
    shape = (len(rows), len(layers), ids.shape[1])
    return tuple(torch.cat([p[k] for p in parts]).reshape(shape).cpu() for k in range(3))


def logit_lens(
    model: Model,
    dataset: ConflictDataset,
    *,
    conflict_types: Sequence[str] | None = None,
    targets: str | Sequence[str] = ("parametric", "context"),
    layers: Sequence[int] | None = None,
    batch_size: int = 16,
    n_boot: int = 2000,
    seed: int = 0,
    progress: bool = True,
) -> LogitLens:
    """The answers' first-token logit, log-probability, probability and rank when the residual
    stream entering each of ``layers`` (default: ``0..n_layers``, where ``n_layers`` is the output
    of the last block) at the last position is read through the final norm and the unembedding.

    ``targets``: ``"parametric"`` (the memorised answer) and / or ``"context"`` (the answer the
    context asserts). Returns a :class:`LogitLens` (``summary`` with bootstrap intervals over
    facts, ``n_boot`` resamples seeded with ``seed``).
    """
    model = check_model(model)
    if isinstance(dataset, (list, tuple)) and not dataset:
        raise ValueError("dataset is empty; give a ConflictDataset with at least one example.")
    dataset = check_conflict_dataset(dataset)
    progress = check_flag(progress, "progress")
    batch_size = check_batch_size(batch_size)
    check_options(n_boot, 0.95)
    targets = check_targets(targets)
    layers = check_lens_layers(model, layers)
    for layer in layers:
        if layer < model.cfg.n_layers:
            require_hook(model, f"blocks.{layer}.hook_resid_pre")
    conflict_types = resolve_conflict_types(dataset, conflict_types)
    check_dataset(model, dataset, conflict_types=conflict_types)

    jobs = [(c, i) for c in conflict_types for i in range(len(dataset))]
    prompts = [dataset[i].prompts[c] for c, i in jobs]
    token_lists = tokenize_prompts(model, prompts)
    ids = torch.tensor(
        [[answer_token(model, dataset[i].target_answer(t), p) for t in targets] for (_, i), p in zip(jobs, prompts)]
    )
    shape = (len(jobs), len(layers), len(targets))
    logit, logprob, rank = torch.empty(shape), torch.empty(shape), torch.empty(shape, dtype=torch.long)
    bar = tqdm(total=len(jobs), desc="logit lens", disable=not progress, leave=False)
    for idx, tokens, mask, last in padded_batches(model, token_lists, batch_size=batch_size):
        logit[idx], logprob[idx], rank[idx] = _lens_batch(model, tokens, mask, last, ids[idx], layers)
        bar.update(len(idx))
    bar.close()

    # One row per job x layer x target, in that order.
    n_rows = len(jobs) * len(layers) * len(targets)
    job = np.repeat(np.arange(len(jobs)), len(layers) * len(targets))
    examples = np.array([i for _, i in jobs])[job]
    per_example = pd.DataFrame(
        {
            "example": examples,
            "subject": [dataset[i].subject for i in examples],
            "relation": [dataset[i].relation for i in examples],
            "conflict_type": np.array([c for c, _ in jobs], dtype=object)[job],
            "target": np.tile(np.array(targets, dtype=object), n_rows // len(targets)),
            "layer": np.tile(np.repeat(np.array(layers), len(targets)), len(jobs)),
            "logit": logit.reshape(-1).numpy(),
            "logprob": logprob.reshape(-1).numpy(),
            "probability": logprob.reshape(-1).exp().numpy(),
            "rank": rank.reshape(-1).numpy(),
        }
    )
    return LogitLens(per_example, lens_summary(per_example, n_boot=n_boot, seed=seed), model.cfg.n_layers)


def lens_summary(per_example: pd.DataFrame, *, n_boot: int = 2000, ci: float = 0.95, seed: int = 0) -> pd.DataFrame:
    """Per conflict type x target x layer: mean ``probability`` and ``logprob``, median ``rank``
    and the share at rank 1 (``top1``), each with percentile bootstrap bounds over facts."""
    check_options(n_boot, ci)
    options = {"by": _KEYS, "unit": "example", "n_boot": n_boot, "ci": ci, "seed": seed}
    frame = per_example.assign(top1=(per_example["rank"] == 1).astype(float))
    summary = None
    for value in ("probability", "logprob", "top1"):
        part = bootstrap_summary(frame, value=value, **options)
        part = part.rename(columns={"mean": value, "ci_low": f"{value}_low", "ci_high": f"{value}_high"})
        summary = part if summary is None else summary.merge(part.drop(columns="n"), on=_KEYS)
    medians = []
    for key, group in frame.sort_values("example", kind="stable").groupby(_KEYS, sort=True):
        interval = bootstrap_ci(group["rank"], n_boot=n_boot, ci=ci, seed=seed, statistic="median")
        medians.append((*key, interval.mean, interval.ci_low, interval.ci_high))
    ranks = pd.DataFrame(medians, columns=[*_KEYS, "rank", "rank_low", "rank_high"])
    summary = summary.merge(ranks, on=_KEYS)
    order = {
        "conflict_type": {c: k for k, c in enumerate(dict.fromkeys(per_example.conflict_type))},
        "target": {t: k for k, t in enumerate(dict.fromkeys(per_example.target))},
    }
    summary = summary.sort_values(_KEYS, key=lambda col: col.map(order[col.name]) if col.name in order else col)
    columns = [*_KEYS, "probability", "probability_low", "probability_high", "logprob", "logprob_low"]
    columns += ["logprob_high", "rank", "rank_low", "rank_high", "top1", "top1_low", "top1_high", "n"]
    return summary[columns].reset_index(drop=True)
