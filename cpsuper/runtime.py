"""What every analysis needs to run a model over prompts: the shared runtime.

- prompts: :func:`as_prompts` (one string or a sequence), :func:`tokenize_prompts` (checked
  against the context window), :func:`pad_tokens`, :func:`length_batches`, :func:`padded_batches`;
- answers: :func:`answer_token`, :func:`answer_tokens`, :func:`check_dataset`,
  :func:`resolve_conflict_types`, :func:`check_targets`;
- the model's address space: :func:`check_layer`, :func:`check_head`, :func:`require_hook`;
- argument checks shared by every entry point (:func:`check_batch_size`, :func:`check_finite`,
  :func:`check_grid`, :func:`check_flag`, :func:`check_positive_int`, :func:`check_layers`,
  :func:`check_head_indices`, :func:`check_model`, :func:`check_conflict_dataset`,
  :func:`check_conflict_datasets`);
- changes Ctrl-C cannot leave half-done (from :mod:`cpsuper.interrupts`): :class:`hooked`
  (``model.hooks``), :func:`run_with_cache`, :class:`swapped_parameters`.

Prompts are grouped by length, so that batches carry little padding and batched results equal
one-by-one results. Running the model over them (final-position logits, greedy decoding, steering)
is :mod:`cpsuper.decoding`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from jaxtyping import Int
from torch import Tensor

from .backend import Model, is_model
from .data.examples import TARGETS, ConflictDataset, ConflictExample

__all__ = [
    "answer_token",
    "answer_tokens",
    "as_prompts",
    "check_batch_size",
    "check_conflict_dataset",
    "check_conflict_datasets",
    "check_dataset",
    "check_finite",
    "check_flag",
    "check_grid",
    "check_head",
    "check_head_indices",
    "check_layer",
    "check_layers",
    "check_model",
    "check_positive_int",
    "check_targets",
    "length_batches",
    "pad_tokens",
    "padded_batches",
    "require_hook",
    "resolve_conflict_types",
    "tokenize_prompts",
]


# ---------------------------------------------------------------------------------------------
# Argument checks


def check_batch_size(batch_size: Any, name: str = "batch_size") -> int:
    """A positive integer, or a clear error (a negative size would silently slice batches wrong)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
        raise ValueError(f"{name} must be a positive integer, got {batch_size!r}; pass e.g. {name}=32.")
    return int(batch_size)


def check_finite(value: Any, name: str, sign: str | None = None) -> float:
    """``value`` as a finite float; ``sign`` ``"positive"``, ``"negative"``, ``"non-negative"`` or
    ``"non-positive"`` also checks its sign."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__}).")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}.")
    ok = {
        None: True,
        "positive": value > 0,
        "negative": value < 0,
        "non-negative": value >= 0,
        "non-positive": value <= 0,
    }[sign]
    if not ok:
        raise ValueError(f"{name} must be {sign}, got {value!r}.")
    return value


def check_grid(values: Any, name: str, sign: str | None = None) -> tuple[float, ...]:
    """A non-empty sequence of finite numbers (each with ``sign``, see :func:`check_finite`)."""
    if isinstance(values, numbers.Real):
        values = (values,)
    if isinstance(values, (str, bytes)):
        raise ValueError(f"{name} must be a sequence of numbers, got {values!r}.")
    try:
        values = list(values)
    except TypeError:
        raise ValueError(f"{name} must be a sequence of numbers, got {values!r}.") from None
    if len(values) == 0:
        raise ValueError(f"{name} is empty; give at least one value.")
    return tuple(check_finite(v, f"{name}[{i}]", sign) for i, v in enumerate(values))


def check_flag(value: Any, name: str) -> bool:
    """``value`` if it is a boolean; anything else (``"no"``, ``0``, ``None``) is a TypeError, not
    read as true or false."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(
        f"{name} must be True or False, got {value!r} ({type(value).__name__}); pass {name}=True or {name}=False."
    )


def check_positive_int(value: Any, name: str, at_most: int | None = None, of: str = "") -> int:
    """``value`` as an int ``>= 1`` (and ``<= at_most``, the number of ``of``, where that is known)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}; give a whole number from 1 up.")
    if at_most is not None and value > at_most:
        raise ValueError(f"{name}={value} is more than the {at_most} {of}; use 1..{at_most}.")
    return int(value)


def _selection(values: Any, name: str, what: str, valid: str) -> list:
    """``values`` as a non-empty list (``what``: one item, ``valid``: the valid items, for the message)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise ValueError(f"{name} must be a sequence of {what}s ({valid}), got {values!r}; pass e.g. {name}=[0].")
    values = list(values)
    if not values:
        raise ValueError(f"{name} is empty; give at least one {what} ({valid}), or leave {name} out for all of them.")
    return values


def check_layers(model: Model, layers: Sequence[int] | None, name: str = "layers") -> list[int]:
    """Every layer for ``None``, else the given layers checked: a non-empty sequence of layers of ``model``."""
    n = model.cfg.n_layers
    if layers is None:
        return list(range(n))
    return [
        check_layer(model, layer) for layer in _selection(layers, name, "layer", f"this model has layers 0..{n - 1}")
    ]


def check_head_indices(model: Model, heads: Sequence[int] | None, name: str = "heads") -> list[int]:
    """Every query head index for ``None``, else a non-empty sequence of query head indices of ``model``."""
    n = model.cfg.n_heads
    if heads is None:
        return list(range(n))
    heads = _selection(heads, name, "head", f"this model has query heads 0..{n - 1}")
    for head in heads:
        if isinstance(head, (bool, np.bool_)) or not isinstance(head, numbers.Integral) or not 0 <= head < n:
            raise ValueError(f"Unknown head {head!r} in {name}: this model has query heads 0..{n - 1}.")
    return [int(h) for h in heads]


def check_model(model: Any, name: str = "model") -> Model:
    """``model`` if it is a TransformerLens model (a HookedTransformer or a TransformerBridge)."""
    if not is_model(model):
        raise TypeError(
            f"{name} must be a TransformerLens model (HookedTransformer or TransformerBridge), got "
            f"{type(model).__name__}; load one with cp.load_model(...) (or cp.tiny_model() for tests)."
        )
    return model


def check_conflict_dataset(dataset: Any, name: str = "dataset") -> ConflictDataset:
    """``dataset`` if it is a :class:`~cpsuper.ConflictDataset`; a list of examples is named as such."""
    if isinstance(dataset, ConflictDataset):
        return dataset
    if isinstance(dataset, (list, tuple)) and dataset and all(isinstance(e, ConflictExample) for e in dataset):
        fix = "wrap the examples: cp.ConflictDataset(examples, name=...)"
    else:
        fix = "build one with cp.conflict_dataset(...) or a loader such as cp.load_nqswap(...)"
    raise TypeError(f"{name} must be a ConflictDataset, got {type(dataset).__name__}; {fix}.")


def check_conflict_datasets(datasets: Any, name: str = "datasets") -> list[ConflictDataset]:
    """One ConflictDataset, or a non-empty sequence of them, as a list (each item checked and named)."""
    if isinstance(datasets, ConflictDataset):
        return [datasets]
    if isinstance(datasets, Iterable) and not isinstance(datasets, (str, bytes)):
        items = list(datasets)
        if not items:
            raise ValueError(f"{name} is empty; give at least one ConflictDataset.")
        if any(isinstance(d, ConflictDataset) for d in items):
            return [check_conflict_dataset(d, f"{name}[{i}]") for i, d in enumerate(items)]
        datasets = items  # e.g. a list of examples, which the error names as such
    return [check_conflict_dataset(datasets, name)]  # raises: not a ConflictDataset


def check_targets(targets: str | Sequence[str]) -> tuple[str, ...]:
    """Targets (answer roles) as a tuple, each one of :data:`~cpsuper.data.TARGETS`."""
    if isinstance(targets, str):
        targets = (targets,)
    targets = tuple(targets)
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets:
        raise ValueError(f"Unknown targets {unknown or '()'}; use a non-empty subset of {TARGETS}.")
    return targets


def check_layer(model: Model, layer: int) -> int:
    """``layer`` as an int, or a clear error naming the valid range."""
    n = model.cfg.n_layers
    if not isinstance(layer, numbers.Integral) or isinstance(layer, bool) or not 0 <= layer < n:
        raise ValueError(f"Unknown layer {layer!r}: this model has layers 0..{n - 1}.")
    return int(layer)


def check_head(model: Model, layer: int, head: int) -> tuple[int, int]:
    """``(layer, head)`` checked against the model (query heads, 0-based)."""
    check_layer(model, layer)
    n = model.cfg.n_heads
    if not isinstance(head, numbers.Integral) or isinstance(head, bool) or not 0 <= head < n:
        raise ValueError(f"Unknown head {head!r} in layer {layer}: this model has query heads 0..{n - 1}.")
    return int(layer), int(head)


def require_hook(model: Model, name: str) -> None:
    """Raise a clear error if ``model`` has no hook point ``name``."""
    if name not in model.hook_dict:
        raise ValueError(
            f"The model has no hook {name!r}, which this analysis needs. "
            f"({type(model).__name__} with architecture {model.cfg.original_architecture})"
        )


# ---------------------------------------------------------------------------------------------
# Prompts and answers


def as_prompts(prompts: str | Sequence[str]) -> tuple[list[str], bool]:
    """``(list of prompts, whether one string was given)``; anything else is an error.

    One string is one prompt, never a sequence of characters.
    """
    if isinstance(prompts, str):
        return [prompts], True
    if isinstance(prompts, bytes) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a string or a sequence of strings, got {type(prompts).__name__}.")
    bad = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
    if bad:
        raise TypeError(
            f"prompts must be strings; item {bad[0]} is {type(prompts[bad[0]]).__name__}: {prompts[bad[0]]!r}."
        )
    return list(prompts), False


def tokenize_prompts(model: Model, prompts: str | Sequence[str]) -> list[list[int]]:
    """Token ids of each prompt (BOS prepended as the model expects), checked against ``n_ctx``."""
    prompts, _ = as_prompts(prompts)
    if len(prompts) == 0:
        raise ValueError("No prompts to run; pass at least one.")
    out = []
    for prompt in prompts:
        ids = model.to_tokens(prompt, truncate=False)[0].tolist()
        if len(ids) > model.cfg.n_ctx:
            raise ValueError(
                f"Prompt of {len(ids)} tokens exceeds the model's context window of {model.cfg.n_ctx} "
                f"tokens: {prompt[:80]!r}... Shorten it or use a model with a longer context."
            )
        out.append(ids)
    return out


def answer_tokens(model: Model, answer: str, prompt: str = "") -> list[int]:
    """All tokens of ``answer`` as it would continue ``prompt`` (a prompt that does not end in
    whitespace is continued by ``" " + answer``); empty if the answer tokenizes to nothing."""
    text = answer.strip()
    if prompt and not prompt[-1].isspace():
        text = " " + text
    return model.tokenizer.encode(text, add_special_tokens=False)


def answer_token(model: Model, answer: str, prompt: str = "") -> int:
    """The first token of ``answer`` as it would continue ``prompt``."""
    ids = answer_tokens(model, answer, prompt)
    if not answer.strip() or not ids:
        raise ValueError(f"Answer {answer!r} tokenizes to nothing; give a non-empty answer.")
    return ids[0]


def resolve_conflict_types(dataset: ConflictDataset, conflict_types: str | Sequence[str] | None) -> tuple[str, ...]:
    """The conflict types to run: all of the dataset's (``None``) or the given ones, checked."""
    if len(dataset) == 0:
        raise ValueError("The dataset is empty; give at least one example.")
    if conflict_types is None:
        return dataset.conflict_types
    if isinstance(conflict_types, str):
        conflict_types = (conflict_types,)
    conflict_types = tuple(conflict_types)
    if not conflict_types:
        raise ValueError(f"conflict_types is empty; use some of {dataset.conflict_types} (or None for all).")
    missing = [c for c in conflict_types if c not in dataset.conflict_types]
    if missing:
        raise ValueError(
            f"Conflict types {missing} are not in dataset {dataset.name!r}; it has {dataset.conflict_types}."
        )
    return conflict_types


def check_dataset(
    model: Model,
    dataset: ConflictDataset,
    *,
    conflict_types: Sequence[str] | None = None,
    require_single_token: bool = False,
) -> None:
    """Raise a clear error if ``dataset`` cannot be scored on ``model``.

    Checks: prompt length against the context window; answers that tokenize to nothing; a
    context answer whose first token equals the parametric answer's (the two probabilities
    would be the same number); with ``require_single_token``, multi-token answers.
    """
    conflict_types = resolve_conflict_types(dataset, conflict_types)
    for example in dataset:
        for conflict_type in conflict_types:
            prompt = example.prompts[conflict_type]
            ids = {}
            for role, answer in (("answer", example.answer), ("context answer", example.context_answer)):
                toks = answer_tokens(model, answer, prompt)
                if not toks:
                    raise ValueError(f"The {role} {answer!r} of {example.subject!r} tokenizes to nothing.")
                if require_single_token and len(toks) > 1:
                    pieces = [model.tokenizer.decode([t]) for t in toks]
                    raise ValueError(
                        f"The {role} {answer!r} of {example.subject!r} is {len(toks)} tokens {pieces}, "
                        "but this analysis needs single-token answers. Filter the dataset, e.g. "
                        "dataset.filter(lambda e: ...), or use an analysis that reads the first token."
                    )
                ids[role] = toks[0]
            if ids["answer"] == ids["context answer"]:
                raise ValueError(
                    f"For {example.subject!r}, the answer {example.answer!r} and the context answer "
                    f"{example.context_answer!r} start with the same token "
                    f"{model.tokenizer.decode([ids['answer']])!r}, so their first-token probabilities "
                    "cannot be told apart. Build the dataset with the model's tokenizer "
                    "(conflict_dataset(..., tokenizer=model)) or choose another distractor."
                )
    tokenize_prompts(model, [e.prompts[c] for e in dataset for c in conflict_types])


# ---------------------------------------------------------------------------------------------
# Batches


def length_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices grouped into batches of similar length (longest first), to keep padding small."""
    batch_size = check_batch_size(batch_size)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def pad_tokens(
    model: Model, token_lists: Sequence[Sequence[int]], padding_side: str = "right"
) -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "batch pos"], Int[Tensor, " batch"]]:
    """Pad token lists into a tensor; returns tokens, attention mask and each row's last real index."""
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}.")
    pad_id = model.tokenizer.pad_token_id if model.tokenizer.pad_token_id is not None else 0
    width = max(len(t) for t in token_lists)
    tokens = torch.full((len(token_lists), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(token_lists), width), dtype=torch.long)
    last = torch.empty(len(token_lists), dtype=torch.long)
    for row, ids in enumerate(token_lists):
        start = 0 if padding_side == "right" else width - len(ids)
        tokens[row, start : start + len(ids)] = torch.tensor(ids)
        mask[row, start : start + len(ids)] = 1
        last[row] = start + len(ids) - 1
    return tokens.to(model.cfg.device), mask.to(model.cfg.device), last.to(model.cfg.device)


def padded_batches(
    model: Model, token_lists: Sequence[Sequence[int]], *, batch_size: int, padding_side: str = "right"
) -> Iterator[tuple[list[int], Int[Tensor, "batch pos"], Int[Tensor, "batch pos"], Int[Tensor, " batch"]]]:
    """``(indices, tokens, attention mask, last real index)`` per :func:`length_batches` batch."""
    for idx in length_batches([len(t) for t in token_lists], batch_size):
        yield (idx, *pad_tokens(model, [token_lists[i] for i in idx], padding_side))
