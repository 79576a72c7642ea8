"""Measurements across training checkpoints: how context reliance, parametric accuracy and
attention to the context / subject move as a model trains.

A checkpoint is anything that yields a model: a model name for :func:`cpsuper.load_model`, a
TransformerLens checkpoint index of a base model (e.g. Pythia's training checkpoints, for users
with network access), a callable returning a model (e.g. a toy's saved states), or a model.
Models are loaded one at a time, so a long trajectory never holds two in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import pandas as pd
from tqdm.auto import tqdm

__all__ = ["CONFLICT_MEASURES", "checkpoint_trajectory"]

Measure = Callable[[object, object], Mapping[str, float]]


def _scores(model, dataset) -> pd.DataFrame:
    from .scoring import score_dataset

    return score_dataset(model, dataset, progress=False)


def context_reliance(model, dataset) -> dict[str, float]:
    """On conflict prompts: how often the context answer is produced (greedy, first 5 words) and
    ``M_C``, the mean of ``p(ctx) / (p(ctx) + p(param))`` over first-token probabilities."""
    scores = _scores(model, dataset)
    wide = scores[scores.conflict_type != "clean"].pivot_table(
        index=["example", "conflict_type"], columns="measure", values="value"
    )
    if wide.empty:
        raise ValueError("context_reliance needs conflict prompts (substitution / coherent) in the dataset.")
    m_c = wide.p_context / (wide.p_context + wide.p_parametric)
    return {"context_accuracy": float(wide.acc_context.mean()), "M_C": float(m_c.mean())}


def parametric_accuracy(model, dataset) -> dict[str, float]:
    """Greedy accuracy of the true answer on the clean prompts (does the model know the facts)."""
    scores = _scores(model, dataset.with_prompts(["clean"]))
    return {"parametric_accuracy": float(scores[scores.measure == "acc_parametric"].value.mean())}


def attention_to_context_and_subject(model, dataset) -> dict[str, float]:
    """Attention mass from the final token to the context and to the subject, mean over layers,
    heads, examples and conflict prompts."""
    from .attention import attention_to_span

    context = attention_to_span(model, dataset, "context", progress=False).per_example
    subject = attention_to_span(model, dataset, "subject", progress=False).per_example
    return {"attention_context": float(context.attention.mean()), "attention_subject": float(subject.attention.mean())}


CONFLICT_MEASURES: dict[str, Measure] = {
    "context_reliance": context_reliance,
    "parametric_accuracy": parametric_accuracy,
    "attention": attention_to_context_and_subject,
}
"""Built-in measures for a HookedTransformer on a :class:`cpsuper.ConflictDataset`."""


def _load(checkpoint, base: str | None, device):
    from .backend import is_model
    from .models import load_model

    if callable(checkpoint) and not is_model(checkpoint):
        return checkpoint()
    if isinstance(checkpoint, int) and not isinstance(checkpoint, bool):
        if base is None:
            raise ValueError(
                f"Checkpoint {checkpoint} is an index; pass base='model-name' (e.g. 'EleutherAI/pythia-160m')."
            )
        # Both backends take the index (HookedTransformer.from_pretrained and, from TransformerLens
        # 4.3, TransformerBridge.boot_transformers, which turns it into the Hugging Face revision).
        return load_model(base, device=device, checkpoint_index=checkpoint)
    if isinstance(checkpoint, str):
        return load_model(checkpoint, device=device)
    if hasattr(checkpoint, "forward"):
        return checkpoint
    raise TypeError(
        f"Cannot make a model from checkpoint {checkpoint!r}: give a model name, a checkpoint index with "
        "base=..., a callable returning a model, or a model."
    )


def checkpoint_trajectory(
    checkpoints: Sequence,
    dataset,
    measures: Mapping[str, Measure] | Sequence[str] | None = None,
    labels: Sequence | None = None,
    base: str | None = None,
    device=None,
    progress: bool = True,
) -> pd.DataFrame:
    """Run every measure on every checkpoint; one row per checkpoint x measured quantity.

    ``measures`` maps names to functions ``(model, dataset) -> {quantity: value}``; strings pick
    from :data:`CONFLICT_MEASURES` (the default uses all of them, for conflict datasets). A toy's
    probes work the same way, with the toy's data as ``dataset``. ``labels`` name the checkpoints
    on the x axis (default: the index, or the checkpoint itself when it is a number or a name).
    """
    if len(checkpoints) == 0:
        raise ValueError("No checkpoints given; pass a list of model names, indices, callables or models.")
    if labels is not None and len(labels) != len(checkpoints):
        raise ValueError(f"{len(labels)} labels for {len(checkpoints)} checkpoints; give one label per checkpoint.")
    if measures is None:
        measures = dict(CONFLICT_MEASURES)
    elif not isinstance(measures, Mapping):
        unknown = [m for m in measures if m not in CONFLICT_MEASURES]
        if unknown:
            raise ValueError(f"Unknown measures {unknown}; use {sorted(CONFLICT_MEASURES)} or pass functions.")
        measures = {m: CONFLICT_MEASURES[m] for m in measures}
    rows = []
    for i, checkpoint in enumerate(tqdm(checkpoints, desc="checkpoints", disable=not progress)):
        label = labels[i] if labels is not None else (checkpoint if isinstance(checkpoint, (int, str)) else i)
        model = _load(checkpoint, base, device)
        for name, measure in measures.items():
            for quantity, value in dict(measure(model, dataset)).items():
                rows.append(
                    {"checkpoint": label, "order": i, "measure": name, "quantity": quantity, "value": float(value)}
                )
        del model
    return pd.DataFrame(rows)
