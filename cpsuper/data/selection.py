"""Reproducible selection / validation / test splits (which facts a model knows is in
:func:`cpsuper.scoring.filter_known`, which runs the model)."""

from __future__ import annotations

import random
from typing import NamedTuple

from .examples import ConflictDataset

__all__ = ["Split", "split"]


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
