"""Dataset-level sweeps: run the engine's conditions on every example and conflict type of a
:class:`~cpsuper.data.ConflictDataset` and return tidy frames (:class:`SweepResult`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from .answers import WHOLE_ANSWER_METRICS, whole_answer_conditions
from .backend import Model
from .edits import Condition
from .engine import run_conditions
from .metrics import Metric
from .runtime import answer_token, answer_tokens, check_dataset, check_targets, resolve_conflict_types, tokenize_prompts
from .stats import sweep_intervals

__all__ = ["SweepResult", "summarize_sweep", "sweep_dataset"]


@dataclass
class SweepResult:
    """What a sweep returns: every value (``per_example``) and the aggregates (``summary``).

    ``summary`` has one row per condition x conflict type x target with ``delta_mean``,
    ``delta_std`` (across examples), ``n``, and the mean clean / intervened probabilities.
    """

    per_example: pd.DataFrame
    summary: pd.DataFrame

    def intervals(self, *, n_boot: int = 2000, ci: float = 0.95, seed: int = 0) -> pd.DataFrame:
        """The summary's groups with the mean ``delta`` and its percentile bootstrap interval over
        facts (``mean, ci_low, ci_high, n``); see :func:`cpsuper.stats.sweep_intervals`."""
        return sweep_intervals(self, n_boot=n_boot, ci=ci, seed=seed)

    def _repr_html_(self) -> str:
        return self.summary._repr_html_()

    def __repr__(self) -> str:
        return f"SweepResult({len(self.per_example)} per-example rows)\n{self.summary!r}"


def sweep_dataset(
    model: Model,
    dataset,
    conditions: Sequence[Condition],
    labels: pd.DataFrame,
    *,
    conflict_types: Sequence[str] | None = None,
    targets: Sequence[str] = ("parametric", "context"),
    metric: str | Metric = "probability",
    sources: Sequence[int] | None = None,
    batch_size: int | str = 64,
    progress: bool = True,
) -> SweepResult:
    """Run ``conditions`` on every example and conflict type; return a :class:`SweepResult`.

    ``sources``: for conditions with :class:`~cpsuper.edits.PatchEdit` s, the example whose prompt
    (of the same conflict type) each example's patches read, aligned from the end
    (``per_example.attrs["sources"]``).

    ``labels`` describes the conditions (one row each, e.g. columns ``layer, head, alpha``);
    its columns become the grouping keys. ``p_clean`` / ``p`` hold the ``metric`` of the target
    answer without / with the condition, and ``delta`` their difference: first-token probability
    by default (or ``"logprob"``, ``"logit"``, a callable; see :func:`run_conditions`), or the whole
    answer's teacher-forced log-probability (``"answer_logprob"``) or probability
    (``"answer_probability"``; :func:`cpsuper.answers.whole_answer_conditions`).
    ``per_example.attrs["metric"]`` names the metric.
    """
    if len(labels) != len(conditions):
        raise ValueError(f"{len(labels)} label rows for {len(conditions)} conditions.")
    targets = check_targets(targets)
    conflict_types = resolve_conflict_types(dataset, conflict_types)
    check_dataset(model, dataset, conflict_types=conflict_types)
    if sources is not None and (len(sources) != len(dataset) or not all(0 <= j < len(dataset) for j in sources)):
        raise ValueError(f"sources needs one example index (0..{len(dataset) - 1}) per example, got {list(sources)}.")
    whole = isinstance(metric, str) and metric in WHOLE_ANSWER_METRICS
    if whole and sources is not None:
        raise ValueError(
            f"metric={metric!r} scores answers after the prompt, which moves the positions patches align; "
            "patch with metric='probability' or 'logprob' (the answers' first tokens)."
        )
    frames = []
    for conflict_type in conflict_types:
        prompts = dataset.prompts(conflict_type)
        tokens = tokenize_prompts(model, prompts)
        if whole:
            answers = [[answer_tokens(model, e.target_answer(t), p) for t in targets] for e, p in zip(dataset, prompts)]
            clean, swept = whole_answer_conditions(
                model,
                tokens,
                answers,
                conditions,
                metric=metric,
                batch_size=batch_size,
                progress=progress,
                desc=conflict_type,
            )
        else:
            ids = torch.tensor(
                [[answer_token(model, e.target_answer(t), p) for t in targets] for e, p in zip(dataset, prompts)]
            )
            patched = {} if sources is None else {"source_tokens": [tokens[j] for j in sources], "align": "end"}
            clean, swept = run_conditions(
                model,
                tokens,
                ids,
                conditions,
                metric=metric,
                batch_size=batch_size,
                progress=progress,
                desc=f"{conflict_type}",
                **patched,
            )
        n, n_cond, n_t = swept.shape
        grid = pd.DataFrame(
            {
                "example": np.repeat(np.arange(n), n_cond * n_t),
                "condition": np.tile(np.repeat(np.arange(n_cond), n_t), n),
                "target": np.tile(np.array(targets), n * n_cond),
                "p_clean": clean[:, None, :].expand(n, n_cond, n_t).reshape(-1).numpy(),
                "p": swept.reshape(-1).numpy(),
            }
        )
        grid["subject"] = [dataset[i].subject for i in grid["example"]]
        grid["conflict_type"] = conflict_type
        frames.append(grid)
    per_example = pd.concat(frames, ignore_index=True)
    per_example["delta"] = per_example["p"] - per_example["p_clean"]
    per_example = labels.reset_index(drop=True).join(per_example.set_index("condition"), how="right")
    per_example = per_example.reset_index(drop=True)
    keys = [*labels.columns, "conflict_type", "target"]
    summary = summarize_sweep(per_example, keys)
    ordered = ["example", "subject", *labels.columns, "conflict_type", "target", "p_clean", "p", "delta"]
    per_example = per_example[ordered]
    per_example.attrs["metric"] = metric if isinstance(metric, str) else getattr(metric, "__name__", "custom")
    # Which model the rows belong to, so a consumer (e.g. the head explorer) can refuse another model's sweep.
    per_example.attrs.update(model=model.cfg.model_name, n_layers=model.cfg.n_layers, n_heads=model.cfg.n_heads)
    if sources is not None:
        per_example.attrs["sources"] = list(sources)
    return SweepResult(per_example, summary)


def summarize_sweep(per_example: pd.DataFrame, keys: Sequence[str]) -> pd.DataFrame:
    """Mean and spread of ``delta`` (and mean probabilities) per group of ``keys``."""
    return (
        per_example.groupby(list(keys), sort=False)
        .agg(
            delta_mean=("delta", "mean"),
            delta_std=("delta", "std"),
            n=("delta", "size"),
            p_clean=("p_clean", "mean"),
            p=("p", "mean"),
        )
        .reset_index()
    )
