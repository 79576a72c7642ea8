"""How JuICE picks its two strengths on validation facts: the tuning table and the objectives.

:func:`beta_tuning` scores every (beta_plus, beta_minus) pair of a steering's grids on the
validation facts (and the unsteered pair (0, 0) when the grids lack it); :func:`choose_betas` picks
one row by an objective:

- ``"paper"``: the JuICE paper's rule, the most summed accuracy over conflict types, ties by summed
  target probability;
- ``"robust"``: a pair may cost at most ``floor(clean_margin * n)`` of the ``n`` clean validation
  facts (net, against the unsteered pair); among the allowed pairs, the most conflict accuracy,
  ties toward the weaker intervention. With ``clean_margin > 0`` the rule can accept a one-fact
  loss only from ``ceil(1 / clean_margin)`` validation facts on (:func:`min_validation`); a
  smaller validation set is refused rather than silently forbidding every loss.

Clean accuracy is plain recall in both directions: on a clean prompt the memorised answer is the
correct one (:meth:`~cpsuper.ConflictExample.expected_answers`), so toward the context the robust
rule keeps the steering from breaking what the model answers without a context.

When the chosen pair is the unsteered one, :func:`unsteered_reason` says why in words.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import pandas as pd
import torch

from .context_gate import DEFAULT_CONTEXT_GATE, context_gate_open
from .data.examples import ConflictDataset
from .dual_run import StrengthPerRow
from .reading import stop_once_settled
from .runtime import check_batch_size, check_grid, resolve_conflict_types, tokenize_prompts
from .scoring import decode_all, known_facts

__all__ = [
    "DEFAULT_RECIPE",
    "BETA_NEG_GRID",
    "BETA_POS_GRID",
    "DEFAULT_CLEAN_MARGIN",
    "FIT_RECIPES",
    "OBJECTIVES",
    "PAPER_BETA_NEG_GRID",
    "PAPER_BETA_POS_GRID",
    "Recipe",
    "beta_tuning",
    "check_clean_margin",
    "choose_betas",
    "clean_facts_lost",
    "fit_steering",
    "min_validation",
    "tune_betas",
    "unsteered_reason",
]

OBJECTIVES = ("paper", "robust")

DEFAULT_CLEAN_MARGIN = 0.1
"""The share of clean validation facts a steering may cost by default (one fact in ten)."""


@dataclass(frozen=True)
class Recipe:
    """How ``JuICE.fit`` turns selection and validation facts into a steering.

    ``objective``: the strength rule (:func:`choose_betas`). ``conflicts_only``: stage 1 scores the
    conflict prompts alone (clean ones left out). ``stage1_at_betas``: stage 1 adds each head's
    output at the strengths the dual run will use (the non-zero values of the steering's beta
    grids) instead of its own ``pos_grid`` / ``neg_grid``, so that a head that hurts clean recall
    at those strengths is not chosen. ``aggregate``: how stage-1 scores are pooled over the
    selection facts (``"mean"`` or ``"median"``). ``head_counts``: numbers of heads per set tuned
    together with the strengths (``None``: all K of each set); the study-only recipes of
    :mod:`cpsuper.variance` use these two. ``context_gate``: the fitted steering acts only on
    prompts with at least this prompt-token mass (:mod:`cpsuper.context_gate`), and its strengths
    are tuned so gated (a steering that already has a gate keeps its own)."""

    objective: str
    conflicts_only: bool = False
    stage1_at_betas: bool = False
    aggregate: str = "mean"
    head_counts: tuple[int, ...] | None = None
    context_gate: float | None = None


FIT_RECIPES = {
    "paper": Recipe("paper"),
    "robust": Recipe("robust"),
    "robust-conflict": Recipe("robust", conflicts_only=True),
    "robust-mild": Recipe("robust", stage1_at_betas=True),
    "robust-gated": Recipe("robust", conflicts_only=True, context_gate=DEFAULT_CONTEXT_GATE),
}
"""``JuICE.fit``'s recipes by name (see docs/juice.md for how the default was chosen)."""

DEFAULT_RECIPE = "robust-gated"
"""``JuICE.fit``'s recipe unless told otherwise: chosen by its worst clean accuracy when fitted on
one wording and scored on others (docs/results/juice_shift.md)."""

# The strengths JuICE tunes over by default: half steps where the default recipe's heads act
# (docs/juice.md, "Heads chosen on the conflict prompts"). The JuICE paper's grids are kept too.
BETA_POS_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0)
BETA_NEG_GRID = (0.0, -0.5, -1.0)
PAPER_BETA_POS_GRID = (0.0, 1.0, 2.0, 3.0, 4.0, 5.0)
PAPER_BETA_NEG_GRID = (0.0, -1.0, -2.0, -3.0)


def beta_tuning(
    steer,
    validation: ConflictDataset,
    *,
    ks: Sequence[int] | None = None,
    max_new_tokens: int = 8,
    batch_size: int = 64,
    progress: bool = False,
) -> pd.DataFrame:
    """Validation accuracy of ``steer``'s heads for every (beta_plus, beta_minus) of its grids,
    plus the unsteered pair (0, 0) if the grids lack it. One row per pair: ``accuracy`` (summed
    over conflict types), ``probability`` (summed target probability), ``acc_<conflict type>``,
    ``in_grid`` (False for an added (0, 0)), ``n`` (validation facts).

    ``ks``: also vary how many heads of each set are steered (the first ``k`` of ``enhance`` and
    of ``suppress``, which are ranked); the table then has a ``k`` column and a row per k x pair.

    Every pair x conflict type x fact is one row of the same greedy decoding, each row with its
    own strengths (the same numbers as one :meth:`JuICE.accuracy` per pair, in a fraction of the
    forward passes). A steering with a ``context_gate`` steers only the rows its gate opens for;
    ``gate_<conflict type>`` columns give the share of each type's prompts it opens for."""
    if len(validation) == 0:
        raise ValueError("The validation split is empty; give at least one validation fact.")
    n_heads = max(len(steer.enhance), len(steer.suppress))
    if ks is not None:
        ks = sorted({int(k) for k in ks})
        if not ks or ks[0] < 1 or ks[-1] > n_heads:
            raise ValueError(f"ks must hold head counts between 1 and {n_heads} (the steering's sets), got {ks}.")
    pairs = [(float(bp), float(bm)) for bp in steer.beta_pos_grid for bm in steer.beta_neg_grid]
    in_grid = [True] * len(pairs)
    if (0.0, 0.0) not in pairs:
        pairs.insert(0, (0.0, 0.0))
        in_grid.insert(0, False)
    grid = [(k, *pair, listed) for k in (ks or [n_heads]) for pair, listed in zip(pairs, in_grid)]
    types = resolve_conflict_types(validation, None)
    per_type = [tokenize_prompts(steer.model, validation.prompts(c)) for c in types]
    block = [t for tokens in per_type for t in tokens]  # one setting's rows: every type, every fact
    reads = [ex.expected_answers(steer.direction, c) for c in types for ex in validation]
    settings = torch.tensor([(bp, bm, k) for k, bp, bm, _ in grid for _ in block], dtype=torch.float32)
    gate_open = {}
    if steer.context_gate is not None:  # the gate depends on the unsteered model alone: once per prompt
        opened = context_gate_open(steer.model, [p for c in types for p in validation.prompts(c)], steer.context_gate)
        settings[:, :2] *= opened.float().repeat(len(grid))[:, None]
        n = len(validation)
        gate_open = {f"gate_{c}": opened[t * n : (t + 1) * n].float().mean().item() for t, c in enumerate(types)}
    texts, logits = decode_all(
        steer.model,
        block * len(grid),
        max_new_tokens=max_new_tokens,
        steering=StrengthPerRow(steer, settings[:, 0], settings[:, 1], settings[:, 2]),
        batch_size=batch_size,
        progress=progress,
        stop_when=stop_once_settled(reads * len(grid)),
    )
    n, rows = len(validation), []
    for p, (k, bp, bm, listed) in enumerate(grid):
        offset = p * len(block)
        scored = pd.concat(
            [
                steer.score_continuations(
                    validation,
                    c,
                    texts[offset + t * n : offset + (t + 1) * n],
                    logits[offset + t * n : offset + (t + 1) * n],
                )
                for t, c in enumerate(types)
            ]
        )
        acc = scored.groupby("conflict_type")["correct"].mean()
        rows.append(
            {
                **({"k": k} if ks is not None else {}),
                "beta_plus": bp,
                "beta_minus": bm,
                "accuracy": acc.sum(),
                "probability": scored["p_target"].sum(),
                "in_grid": listed,
                "n": n,
                **{f"acc_{c}": v for c, v in acc.items()},
                **gate_open,
            }
        )
    return pd.DataFrame(rows)


def check_clean_margin(clean_margin: float) -> float:
    """``clean_margin`` as a float in [0, 1], or a ValueError saying what it means."""
    if isinstance(clean_margin, bool) or not isinstance(clean_margin, (int, float)) or not 0 <= clean_margin <= 1:
        raise ValueError(
            f"clean_margin is the share of clean validation facts a steering may cost, between 0 and 1 "
            f"(e.g. 0.1: one fact in ten), got {clean_margin!r}."
        )
    return float(clean_margin)


def min_validation(clean_margin: float) -> int:
    """The fewest validation facts with which the robust rule can accept a one-fact clean loss:
    ``ceil(1 / clean_margin)`` (1 for a margin of 0, which accepts no loss at any size)."""
    clean_margin = check_clean_margin(clean_margin)
    return 1 if clean_margin == 0 else math.ceil(1 / clean_margin - 1e-9)


def clean_facts_lost(tuning: pd.DataFrame) -> pd.Series:
    """Per row of a tuning table, how many clean validation facts the pair answers wrong that the
    unsteered pair answers right, net (0 where the table has no clean prompts)."""
    if "acc_clean" not in tuning or "n" not in tuning:
        return pd.Series(0, index=tuning.index)
    unsteered = tuning[(tuning.beta_plus == 0) & (tuning.beta_minus == 0)]
    if unsteered.empty:
        raise ValueError("The tuning table has no unsteered pair (0, 0), which clean losses are counted against.")
    base = float(unsteered.acc_clean.iloc[0])
    return ((base - tuning.acc_clean) * tuning.n).round().astype(int)


def choose_betas(
    tuning: pd.DataFrame, objective: str = "robust", *, clean_margin: float = DEFAULT_CLEAN_MARGIN
) -> pd.Series:
    """The row of a tuning table (as :func:`beta_tuning` or ``JuICE.fit`` make it) an objective picks.

    ``"paper"``: the most summed accuracy, ties by summed target probability (``JuICE.fit``;
    a (0, 0) row with ``in_grid`` False, added only for the robust rule, is not a candidate).
    ``"robust"``: a pair may cost at most ``floor(clean_margin * n)`` of the ``n`` clean validation
    facts, net, against the unsteered pair (which is always allowed; without clean prompts every
    pair is); among the allowed pairs the most summed accuracy over the conflict types other than
    clean, ties toward the weaker intervention (smaller ``|beta_plus| + |beta_minus|``, then fewer
    heads where the table has a ``k`` column), then the larger summed target probability.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}.")
    if tuning is None or len(tuning) == 0:
        raise ValueError("The tuning table is empty; score at least one (beta_plus, beta_minus) pair.")
    if objective == "paper":  # only the grid's own pairs, as JuICE.fit scores them
        if "in_grid" in tuning:
            tuning = tuning[tuning.in_grid.astype(bool)]
        return tuning.sort_values(["accuracy", "probability"], ascending=False).iloc[0]
    clean_margin = check_clean_margin(clean_margin)
    unsteered = (tuning.beta_plus == 0) & (tuning.beta_minus == 0)
    if not unsteered.any():
        raise ValueError("The tuning table has no unsteered pair (0, 0), which the robust objective compares against.")
    if "n" in tuning:  # in facts: at most floor(margin * n) of the n clean validation facts
        within = clean_facts_lost(tuning) <= math.floor(clean_margin * tuning.n.iloc[0] + 1e-9)
    elif "acc_clean" in tuning:  # a hand-made table without n: the same rule as a share of accuracy
        within = tuning.acc_clean >= float(tuning[unsteered].acc_clean.iloc[0]) - clean_margin - 1e-9
    else:
        within = pd.Series(True, index=tuning.index)
    conflicts = [c for c in tuning.columns if c.startswith("acc_") and c != "acc_clean"]
    table = tuning.assign(
        conflict_accuracy=tuning[conflicts].sum(axis=1) if conflicts else 0.0,
        strength=tuning.beta_plus.abs() + tuning.beta_minus.abs(),
        allowed=within | unsteered,
    )
    allowed = table[table.allowed]
    order = ["conflict_accuracy", "strength", *(["k"] if "k" in table else []), "probability"]
    ascending = [False, True, *([True] if "k" in table else []), False]
    return allowed.sort_values(order, ascending=ascending, kind="mergesort").iloc[0]


def unsteered_reason(tuning: pd.DataFrame, objective: str, clean_margin: float) -> str:
    """Why ``objective`` chose the unsteered pair (0, 0) from ``tuning``, in one sentence."""
    steered = tuning[(tuning.beta_plus != 0) | (tuning.beta_minus != 0)]
    if steered.empty:
        return "the strength grids hold no non-zero pair"
    n = int(tuning.n.iloc[0]) if "n" in tuning else None
    if objective == "robust":
        lost = clean_facts_lost(tuning).loc[steered.index]
        allowed = math.floor(clean_margin * n + 1e-9) if n else 0
        if (lost > allowed).all():
            return (
                f"every steered pair cost at least {int(lost.min())} of {n} clean validation facts; "
                f"clean_margin={clean_margin:g} allows {allowed}"
                + (f" (a one-fact loss needs at least {min_validation(clean_margin)} facts)" if allowed == 0 else "")
            )
        conflicts = [c for c in tuning.columns if c.startswith("acc_") and c != "acc_clean"]
        return (
            "no pair within the clean margin answered more conflict prompts than the unsteered model "
            f"({', '.join(conflicts) or 'no conflict prompts'})"
        )
    return "the unsteered pair had the most summed validation accuracy"


def fit_steering(
    steer,
    selection: ConflictDataset,
    validation: ConflictDataset,
    *,
    progress: bool = True,
    batch_size: int = 64,
    heads=None,
    recipe: str = DEFAULT_RECIPE,
    clean_margin: float = DEFAULT_CLEAN_MARGIN,
):
    """``JuICE.fit``'s work, on a copy: ``(fitted copy of steer, reason it does not steer or None)``.
    ``steer`` itself is not changed (so an error or interrupt midway leaves it as it was)."""
    if len(validation) == 0:
        raise ValueError("The validation split is empty; give at least one validation fact.")
    if recipe not in FIT_RECIPES:
        raise ValueError(f"recipe must be one of {tuple(FIT_RECIPES)}, got {recipe!r}.")
    plan = FIT_RECIPES[recipe]
    clean_margin = check_clean_margin(clean_margin)
    batch_size = check_batch_size(batch_size)
    beta_pos_grid = check_grid(steer.beta_pos_grid, "beta_pos_grid", "non-negative")  # may be set
    beta_neg_grid = check_grid(steer.beta_neg_grid, "beta_neg_grid", "non-positive")  # after init
    if plan.objective == "robust" and "clean" in validation.conflict_types:
        if len(validation) < min_validation(clean_margin):
            raise ValueError(
                f"clean_margin={clean_margin:g} lets a steering cost one clean fact only from "
                f"{min_validation(clean_margin)} validation facts on, and this validation set has "
                f"{len(validation)}: every steering that costs a fact would be refused. Give at least "
                f"{min_validation(clean_margin)} validation facts (cp.split(..., n_validation=...)), "
                "or pass clean_margin=0 to forbid any clean loss."
            )
        if not any(known_facts(steer.model, validation, progress=False)):
            raise ValueError(  # no clean recall to protect
                f"The model answers none of the {len(validation)} validation facts' clean prompts, so the "
                f"{recipe} recipe has no clean recall to protect; validate on facts the model knows "
                "(cp.filter_known before cp.split), or pass recipe='paper'."
            )
    types = [c for c in selection.conflict_types if c != "clean"] if plan.conflicts_only else None
    if types == []:
        raise ValueError(f"The {recipe} recipe picks heads on conflict prompts; the selection has only clean ones.")
    gate = steer.context_gate if steer.context_gate is not None else plan.context_gate
    grids = {"beta_pos_grid": beta_pos_grid, "beta_neg_grid": beta_neg_grid}
    trial = replace(steer, **grids, context_gate=gate, fitted_on={}, tuning=None)
    if plan.stage1_at_betas:
        pos, neg = [b for b in beta_pos_grid if b > 0], [b for b in beta_neg_grid if b < 0]
        if not pos or not neg:
            raise ValueError(f"The {recipe} recipe scores heads at the non-zero strengths of both beta grids.")
        trial = replace(trial, pos_grid=tuple(pos), neg_grid=tuple(neg))
    if heads is None:
        heads = trial.identify(selection, batch_size=batch_size, progress=progress, conflict_types=types)
    elif plan.conflicts_only:  # re-formed from the stored changes, no model run
        heads = heads.on_conflicts()
    heads = heads.with_k(steer.k)
    trial = replace(trial, enhance=heads.enhance, suppress=heads.suppress, identified=heads)
    tuning = beta_tuning(trial, validation, progress=progress, batch_size=batch_size)
    best = choose_betas(tuning, plan.objective, clean_margin=clean_margin)
    fitted_on = {
        "selection": [e.subject for e in selection],
        "validation": [e.subject for e in validation],
        "relations": list(selection.relations),
        "recipe": recipe,
        "clean_margin": clean_margin,
        "stage1_grids": [list(trial.pos_grid), list(trial.neg_grid)],
        "context_gate": gate,
    }
    if gate is not None:  # how much of the validation set the gate let the steering act on
        fitted_on["gate_open"] = {c[5:]: float(tuning[c].iloc[0]) for c in tuning.columns if c.startswith("gate_")}
    fitted = replace(
        trial,
        pos_grid=steer.pos_grid,
        neg_grid=steer.neg_grid,
        beta_plus=float(best.beta_plus),
        beta_minus=float(best.beta_minus),
        tuning=tuning,
        fitted_on=fitted_on,
    )
    reason = None if fitted.steers else unsteered_reason(tuning, plan.objective, clean_margin)
    if reason is not None:
        fitted.fitted_on["not_steering"] = reason
    return fitted, reason


def tune_betas(
    steer,
    validation: ConflictDataset,
    *,
    objective: str = "robust",
    clean_margin: float = DEFAULT_CLEAN_MARGIN,
    progress: bool = False,
) -> pd.DataFrame:
    """Tune ``steer``'s strengths on ``validation`` by ``objective`` (see :func:`choose_betas`):
    sets ``steer.beta_plus``, ``steer.beta_minus`` and ``steer.tuning``, and returns the tuning
    table with ``chosen`` marking the picked pair. ``steer`` must already have its heads."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}.")
    if not steer.enhance and not steer.suppress:
        raise ValueError("This JuICE has no heads to tune; identify them first (cp.identify_heads).")
    tuning = beta_tuning(steer, validation, progress=progress)
    best = choose_betas(tuning, objective, clean_margin=clean_margin)
    steer.beta_plus, steer.beta_minus = float(best.beta_plus), float(best.beta_minus)
    tuning = tuning.assign(chosen=(tuning.beta_plus == best.beta_plus) & (tuning.beta_minus == best.beta_minus))
    steer.tuning = tuning
    return tuning
