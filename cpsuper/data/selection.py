"""Choosing examples: the facts a model knows, and reproducible selection / validation / test splits."""

from __future__ import annotations

import random
from typing import NamedTuple

from transformer_lens import HookedTransformer

from .examples import ConflictDataset

__all__ = ["Split", "filter_known", "split"]


def filter_known(
    model: HookedTransformer,
    dataset: ConflictDataset,
    by: str = "greedy",
    batch_size: int = 32,
    progress: bool = True,
    n_words: int = 5,
) -> ConflictDataset:
    """Keep the facts the model answers correctly on the *clean* prompt.

    ``by="greedy"``: an alias of the answer is among the first ``n_words`` words of the greedy
    continuation (the paper's accuracy). ``by="top1"``: the answer's first token is the most
    likely next token. Raises if the model knows none of them.
    """
    from ..scoring import answer_token, greedy_continuations, iter_final_logits, mentions_answer, tokenize_prompts

    if by not in ("greedy", "top1"):
        raise ValueError(f"by must be 'greedy' or 'top1', got {by!r}.")
    prompts = [e.prompts["clean"] for e in dataset]
    if by == "greedy":
        texts = greedy_continuations(model, prompts, batch_size=batch_size, progress=progress)
        known = [mentions_answer(t, e.answers, n_words) for t, e in zip(texts, dataset)]
    else:
        known = [False] * len(dataset)
        token_lists = tokenize_prompts(model, prompts)
        for idx, logits in iter_final_logits(model, token_lists, batch_size, progress=progress, desc="top1"):
            top = logits.argmax(-1).tolist()
            for row, i in enumerate(idx):
                known[i] = top[row] == answer_token(model, dataset[i].answer, prompts[i])
    keep = [i for i, ok in enumerate(known) if ok]
    if not keep:
        raise ValueError(
            f"The model answers none of the {len(dataset)} clean prompts of {dataset.name!r} correctly "
            f"(by={by!r}); try another relation, clean template (paraphrase=...), or by='top1'."
        )
    return dataset[keep]


class Split(NamedTuple):
    """Head-selection, validation and test parts of a dataset (disjoint)."""

    select: ConflictDataset
    validation: ConflictDataset
    test: ConflictDataset


def split(dataset: ConflictDataset, n_select: int = 4, val_frac: float = 0.15, seed: int = 0) -> Split:
    """Shuffle (by ``seed``) and cut into ``n_select`` selection examples, a validation part of
    ``val_frac`` of the rest (at least one), and the remaining test part (at least one)."""
    if n_select < 1 or not 0 <= val_frac < 1:
        raise ValueError(f"Need n_select >= 1 and 0 <= val_frac < 1; got {n_select} and {val_frac}.")
    n_val = max(1, round(val_frac * (len(dataset) - n_select)))
    if len(dataset) < n_select + n_val + 1:
        raise ValueError(
            f"Dataset {dataset.name!r} has {len(dataset)} examples, too few for {n_select} selection, "
            f"{n_val} validation and at least 1 test example. Use more facts or a smaller n_select."
        )
    order = list(range(len(dataset)))
    random.Random(seed).shuffle(order)
    return Split(
        select=dataset[order[:n_select]],
        validation=dataset[order[n_select : n_select + n_val]],
        test=dataset[order[n_select + n_val :]],
    )
