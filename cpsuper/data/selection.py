"""Reproducible selection / validation / test splits (which facts a model knows is in
:func:`cpsuper.scoring.filter_known`, which runs the model)."""

from __future__ import annotations

import random
from typing import NamedTuple

from .examples import ConflictDataset

__all__ = ["MIN_VALIDATION", "N_SELECT", "Split", "split"]

N_SELECT = 8
"""Selection facts per split by default (JuICE's stage 1 is steadier on 8 facts than on the paper's 4)."""

MIN_VALIDATION = 10
"""The fewest validation facts a default split holds: with JuICE's default clean margin (0.1) the
strength rule can accept a one-fact clean loss from 10 validation facts on."""


class Split(NamedTuple):
    """Head-selection, validation and test parts of a dataset (disjoint)."""

    select: ConflictDataset
    validation: ConflictDataset
    test: ConflictDataset


def split(
    dataset: ConflictDataset,
    n_select: int = N_SELECT,
    val_frac: float = 0.25,
    seed: int = 0,
    *,
    n_validation: int | None = None,
) -> Split:
    """Shuffle (by ``seed``) and cut into ``n_select`` selection examples, a validation part and
    the remaining test part (at least one).

    The validation part holds ``n_validation`` examples, or by default ``val_frac`` of the rest
    but at least :data:`MIN_VALIDATION` (10), the fewest with which JuICE's default strength rule
    can accept losing one clean fact."""
    for name, value in (("n_select", n_select), ("n_validation", n_validation)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    if isinstance(val_frac, bool) or not isinstance(val_frac, (int, float)) or not 0 <= val_frac < 1:
        raise ValueError(f"val_frac must be a share in [0, 1), got {val_frac!r}.")
    n_val = n_validation or max(MIN_VALIDATION, round(val_frac * (len(dataset) - n_select)))
    if len(dataset) < n_select + n_val + 1:
        raise ValueError(
            f"Dataset {dataset.name!r} has {len(dataset)} examples, too few for {n_select} selection, "
            f"{n_val} validation and at least 1 test example. Use more facts, or a smaller n_select or "
            "n_validation (JuICE.fit then needs a clean_margin of at least 1 / n_validation to accept "
            "any clean loss)."
        )
    order = list(range(len(dataset)))
    random.Random(seed).shuffle(order)
    return Split(
        select=dataset[order[:n_select]],
        validation=dataset[order[n_select : n_select + n_val]],
        test=dataset[order[n_select + n_val :]],
    )
