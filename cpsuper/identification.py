"""JuICE stage 1: which heads move the target answer, consistently across conflict types.

On a few selection facts, :func:`identify_heads` adds ``a`` times each head's own output for every
``a`` in a positive and a negative grid (one :func:`cpsuper.sweeps.sweep_dataset` run, resumed at
each head's layer) and records the change in the target answer's probability. A head is kept for a
sign when its mean change is >= 0 under *every* conflict type; the kept heads are ranked by the
summed change and the top ``k`` per sign are chosen (a head is never in both sets). The per-fact
changes are kept, so scores for any subset or union of facts are formed again without running the
model (:meth:`IdentifiedHeads.subset`, :meth:`IdentifiedHeads.merge`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from .backend import Model
from .data.examples import TARGETS, ConflictDataset
from .edits import HeadEdit
from .runtime import check_conflict_dataset, check_flag, check_grid, check_model, check_positive_int
from .sweeps import sweep_dataset

__all__ = ["NEG_GRID", "POS_GRID", "Head", "IdentifiedHeads", "identify_heads"]

Head = tuple[int, int]
POS_GRID = (1.0, 3.0, 5.0, 10.0, 30.0)
NEG_GRID = (-1.0, -2.0, -5.0)


@dataclass
class IdentifiedHeads:
    """Result of :func:`identify_heads`: per-head scores and the chosen heads.

    ``scores`` has one row per head x sign x conflict type with the mean change in target
    probability (``score``) over the sign's grid and the selection examples. ``per_example`` keeps
    every (fact, head, scale, conflict type) change, so scores for any subset of the facts can be
    formed again without running the model (:meth:`subset`, :meth:`merge`).
    """

    scores: pd.DataFrame
    enhance: list[Head]
    suppress: list[Head]
    k: int = 5
    per_example: pd.DataFrame | None = field(default=None, repr=False)
    target: str | None = None  # the answer whose probability the changes are of (None: not recorded)

    def __repr__(self) -> str:
        return f"IdentifiedHeads(enhance={self.enhance}, suppress={self.suppress})"

    @property
    def subjects(self) -> list[str]:
        """The selection facts the scores come from, in order."""
        return list(dict.fromkeys(self._per_example().subject))

    @property
    def conflict_types(self) -> list[str]:
        """The kinds of prompt the stored changes cover."""
        return list(dict.fromkeys(self._per_example().conflict_type))

    def _per_example(self) -> pd.DataFrame:
        if self.per_example is None:
            raise ValueError("These scores carry no per-example changes; run identify_heads again to get them.")
        return self.per_example

    def with_k(self, k: int) -> IdentifiedHeads:
        """The same scores with the top ``k`` heads per sign (for sweeps over K without re-scoring)."""
        n_heads = self.scores[["layer", "head"]].drop_duplicates().shape[0]
        if not 1 <= k <= n_heads:
            raise ValueError(f"k={k} heads asked for, but the scores cover {n_heads} heads; use 1..{n_heads}.")
        enhance, suppress = _choose(self.scores, k)
        return IdentifiedHeads(self.scores, enhance, suppress, k, self.per_example, self.target)

    def subset(self, subjects: Sequence[str], conflict_types: Sequence[str] | None = None) -> IdentifiedHeads:
        """Identification on just these selection facts (and, given ``conflict_types``, just those
        prompts), from the stored per-example changes: the same result as :func:`identify_heads`
        on them, without running the model."""
        per_example = self._per_example()
        missing = sorted(set(subjects) - set(per_example.subject))
        if missing or not subjects:
            raise ValueError(f"Subjects {missing or '[]'} were not scored; choose among {self.subjects}.")
        keep = per_example.subject.isin(list(subjects))
        if conflict_types is not None:
            scored, unknown = self.conflict_types, sorted(set(conflict_types) - set(self.conflict_types))
            if unknown or not conflict_types:
                raise ValueError(f"Conflict types {unknown or '[]'} were not scored; choose among {scored}.")
            keep &= per_example.conflict_type.isin(list(conflict_types))
        return _identified(per_example[keep], self.k, "the chosen", self.target)

    def on_conflicts(self) -> IdentifiedHeads:
        """The heads re-formed from the conflict prompts' changes alone, clean prompts left out (how
        the ``robust-conflict`` recipe chooses them), without running the model."""
        types = [c for c in self.conflict_types if c != "clean"]
        if not types:
            raise ValueError("These scores cover only clean prompts; score substitution or coherent prompts too.")
        return self.subset(self.subjects, types)

    def merge(self, other: IdentifiedHeads) -> IdentifiedHeads:
        """Pool the facts of two identifications with the same grids (e.g. to grow a selection set)."""
        mine, theirs = self._per_example(), other._per_example()
        if set(mine.subject) & set(theirs.subject):
            raise ValueError(f"Both identifications scored {sorted(set(mine.subject) & set(theirs.subject))}.")
        if set(map(tuple, mine[["sign", "a"]].drop_duplicates().values)) != set(
            map(tuple, theirs[["sign", "a"]].drop_duplicates().values)
        ):
            raise ValueError("The two identifications used different scale grids; score both with the same grids.")
        if self.target != other.target:
            raise ValueError(f"The identifications score different answers ({self.target!r}, {other.target!r}).")
        return _identified(pd.concat([mine, theirs], ignore_index=True), self.k, "the pooled", self.target)

    def knockouts(self, conflict_type: str) -> pd.DataFrame:
        """Each head knocked out alone (its ``a = -1`` rows: the output plus -1 times itself) under
        ``conflict_type``: ``layer, head, delta_mean, delta_std, n`` over the facts, as
        :func:`cpsuper.head_sweep` with ``alphas=(0.0,)`` summarises them, without running the model."""
        rows = self._per_example()
        rows = rows[(rows.a == -1.0) & (rows.conflict_type == conflict_type)]
        if rows.empty:
            raise ValueError(
                f"These scores hold no knockout (a = -1) of {conflict_type!r} prompts; they cover "
                f"{self.conflict_types} with a in {sorted(set(self._per_example().a))}."
            )
        stats = rows.groupby(["layer", "head"], sort=False)["delta"].agg(["mean", "std", "size"])
        return stats.set_axis(["delta_mean", "delta_std", "n"], axis=1).reset_index()


def identify_heads(
    model: Model,
    selection: ConflictDataset,
    target: str = "parametric",
    *,
    pos_grid: Sequence[float] = POS_GRID,
    neg_grid: Sequence[float] = NEG_GRID,
    k: int = 5,
    conflict_types: Sequence[str] | None = None,
    metric: str = "probability",
    batch_size: int = 64,
    progress: bool = True,
) -> IdentifiedHeads:
    """JuICE stage 1 on ``selection`` (the paper uses 4 facts in every conflict type).

    ``conflict_types``: the prompts scored (default: all of ``selection``'s, except ``"clean"``
    toward the context: a clean prompt has no context whose answer a head could raise).
    ``metric``: what a head's added output must raise, the target's first-token probability (the
    paper's) or any sweep metric, e.g. ``"answer_logprob"`` for the whole answer
    (:func:`cpsuper.sweeps.sweep_dataset`)."""
    check_model(model)
    check_conflict_dataset(selection, "selection")
    progress = check_flag(progress, "progress")
    if target not in TARGETS:
        raise ValueError(f"Unknown target {target!r}; use one of {TARGETS}.")
    if conflict_types is None and target == "context":
        conflict_types = [c for c in selection.conflict_types if c != "clean"]
        if not conflict_types:
            raise ValueError(
                f"Selection {selection.name!r} has only clean prompts; steering toward the context needs "
                "conflict prompts (substitution or coherent) to identify heads on."
            )
    check_positive_int(k, "k")
    n_heads_total = model.cfg.n_layers * model.cfg.n_heads
    if k > n_heads_total:
        raise ValueError(f"k={k} heads asked for, but the model has {n_heads_total} heads; use 1..{n_heads_total}.")
    pos_grid, neg_grid = check_grid(pos_grid, "pos_grid"), check_grid(neg_grid, "neg_grid")
    if any(a <= 0 for a in pos_grid) or any(a >= 0 for a in neg_grid):
        raise ValueError(f"pos_grid must be positive and neg_grid negative; got {pos_grid} and {neg_grid}.")
    grid = [
        (l, h, float(a), sign)
        for sign, scales in (("+", pos_grid), ("-", neg_grid))
        for l in range(model.cfg.n_layers)
        for h in range(model.cfg.n_heads)
        for a in scales
    ]
    conditions = [[HeadEdit(l, h, add=a)] for l, h, a, _ in grid]
    labels = pd.DataFrame(grid, columns=["layer", "head", "a", "sign"])
    sweep = sweep_dataset(
        model,
        selection,
        conditions,
        labels,
        conflict_types=conflict_types,
        targets=(target,),
        metric=metric,
        batch_size=batch_size,
        progress=progress,
    )
    per_example = sweep.per_example[["subject", "layer", "head", "a", "sign", "conflict_type", "delta"]]
    return _identified(per_example, k, f"the {len(selection)}", target)


def _identified(per_example: pd.DataFrame, k: int, which: str, target: str | None) -> IdentifiedHeads:
    """Scores (mean change over scales and facts) and the chosen heads from per-example changes."""
    scores = (
        per_example.groupby(["layer", "head", "sign", "conflict_type"], sort=False)["delta"]
        .mean()
        .rename("score")
        .reset_index()
    )
    enhance, suppress = _choose(scores, k)
    if not enhance and not suppress:
        raise ValueError(
            f"No head raises the {target or 'target'} answer's probability under every conflict type on {which} "
            f"selection facts. Use more or other selection facts, or fewer conflict types."
        )
    return IdentifiedHeads(scores, enhance, suppress, k, per_example.reset_index(drop=True), target)


def _choose(scores: pd.DataFrame, k: int) -> tuple[list[Head], list[Head]]:
    """Top ``k`` heads per sign among those with a score >= 0 under every conflict type."""
    table = scores.pivot_table(index=["sign", "layer", "head"], columns="conflict_type", values="score")
    consistent = (table >= 0).all(axis=1)
    total = table.sum(axis=1)
    chosen: dict[str, list[Head]] = {"+": [], "-": []}
    best_sign = {}
    for (sign, layer, head), ok in consistent.items():
        if ok:
            other = "-" if sign == "+" else "+"
            rival = total.get((other, layer, head), -np.inf) if consistent.get((other, layer, head), False) else -np.inf
            if total[(sign, layer, head)] >= rival:  # a head in both sets goes where it helps more
                best_sign[(layer, head)] = sign
    for sign in ("+", "-"):
        ranked = total.loc[[key for key in total.index if key[0] == sign and best_sign.get(key[1:]) == sign]]
        chosen[sign] = [(int(l), int(h)) for (_, l, h) in ranked.sort_values(ascending=False).index[:k]]
    return chosen["+"], chosen["-"]
