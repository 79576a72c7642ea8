"""How JuICE picks its two strengths on validation facts: the tuning table and the objectives.

:func:`beta_tuning` scores every (beta_plus, beta_minus) pair of a steering's grids on the
validation facts (and the unsteered pair (0, 0) when the grids lack it); :func:`choose_betas` picks
one row by an objective:

- ``"paper"``: the JuICE paper's rule, the most summed accuracy over conflict types, ties by summed
  target probability;
- ``"robust"``: no pair may lose more than ``clean_margin`` of clean validation accuracy against
  the unsteered model; among the rest, the most conflict accuracy, ties toward the weaker
  intervention. Chosen on the repository's own world-capital facts (docs/juice.md,
  "Selection-set variance and the robust recipe"), where the paper's rule let a one-pass steering
  (JuNe) buy conflict accuracy with clean recall. ``JuICE.fit``'s default recipe,
  ``"robust-conflict"``, applies it to heads chosen on the conflict prompts alone (:data:`FIT_RECIPES`).

Clean accuracy is plain recall in both directions: on a clean prompt the memorised answer is the
correct one (:meth:`~cpsuper.ConflictExample.expected_answers`), so toward the context the robust
rule keeps the steering from breaking what the model answers without a context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd
import torch
from torch import Tensor

from .backend import Model
from .data.examples import ConflictDataset
from .decoding import Steering
from .interventions import intervene
from .runtime import resolve_conflict_types, tokenize_prompts
from .scoring import decode_all, stop_once_settled

__all__ = [
    "BETA_NEG_GRID",
    "BETA_POS_GRID",
    "FIT_RECIPES",
    "OBJECTIVES",
    "PAPER_BETA_NEG_GRID",
    "PAPER_BETA_POS_GRID",
    "beta_tuning",
    "choose_betas",
    "tune_betas",
]

OBJECTIVES = ("paper", "robust")
FIT_RECIPES = {"paper": ("paper", False), "robust": ("robust", False), "robust-conflict": ("robust", True)}
"""``JuICE.fit``'s recipes -> (strength objective, whether the heads are chosen on the conflict
prompts alone, leaving the clean ones out of stage 1)."""

# The strengths JuICE tunes over by default: half steps where the default recipe's heads act
# (docs/juice.md, "Heads chosen on the conflict prompts"). The JuICE paper's grids are kept too.
BETA_POS_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0)
BETA_NEG_GRID = (0.0, -0.5, -1.0)
PAPER_BETA_POS_GRID = (0.0, 1.0, 2.0, 3.0, 4.0, 5.0)
PAPER_BETA_NEG_GRID = (0.0, -1.0, -2.0, -3.0)


@dataclass
class _StrengthPerRow(Steering):
    """``steer``'s heads with their own (beta_plus, beta_minus) for every input row, so that a
    whole grid of strengths decodes in the same batches (the rows' unsteered passes included)."""

    steer: object  # a JuICE
    beta_plus: Tensor  # [n_rows]
    beta_minus: Tensor
    k: Tensor  # [n_rows]: each row steers the first k heads of each set

    def begin(self, model: Model, rows: Sequence[int], cached: bool):
        index = torch.as_tensor(list(rows), dtype=torch.long)
        coef = self.steer.coefficients(self.beta_plus[index], self.beta_minus[index], self.k[index])
        return coef, self.steer.unsteered_cache(model, len(index), cached, coef)

    def hooks(self, model: Model, tokens, attention_mask, state):
        coef, kv = state
        return intervene(model, self.steer.interventions(tokens, attention_mask, kv, coefficients=coef))

    def decoding_residual(self, model: Model, tokens, attention_mask, state, past_kv_cache=None):
        coef, kv = state
        if kv is None or past_kv_cache is None:
            return super().decoding_residual(model, tokens, attention_mask, state, past_kv_cache)
        return self.steer.resumed_step(model, tokens, attention_mask, coef, kv, past_kv_cache)


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
    ``in_grid`` (False for an added (0, 0)).

    ``ks``: also vary how many heads of each set are steered (the first ``k`` of ``enhance`` and
    of ``suppress``, which are ranked); the table then has a ``k`` column and a row per k x pair.

    Every pair x conflict type x fact is one row of the same greedy decoding, each row with its
    own strengths (the same numbers as one :meth:`JuICE.accuracy` per pair, in a fraction of the
    forward passes)."""
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
    texts, logits = decode_all(
        steer.model,
        block * len(grid),
        max_new_tokens=max_new_tokens,
        steering=_StrengthPerRow(steer, settings[:, 0], settings[:, 1], settings[:, 2]),
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
                **{f"acc_{c}": v for c, v in acc.items()},
            }
        )
    return pd.DataFrame(rows)


def choose_betas(tuning: pd.DataFrame, objective: str = "robust", *, clean_margin: float = 0.05) -> pd.Series:
    """The row of a tuning table (as :func:`beta_tuning` or ``JuICE.fit`` make it) an objective picks.

    ``"paper"``: the most summed accuracy, ties by summed target probability (``JuICE.fit``;
    a (0, 0) row with ``in_grid`` False, added only for the robust rule, is not a candidate).
    ``"robust"``: only pairs whose clean accuracy is at least the unsteered pair's minus
    ``clean_margin`` are allowed (the pair (0, 0) always is; without clean prompts every pair
    is); among them the most summed
    accuracy over the conflict types other than clean, ties toward the weaker intervention
    (smaller ``|beta_plus| + |beta_minus|``, then fewer heads where the table has a ``k``
    column), then the larger summed target probability.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}.")
    if tuning is None or len(tuning) == 0:
        raise ValueError("The tuning table is empty; score at least one (beta_plus, beta_minus) pair.")
    if objective == "paper":  # only the grid's own pairs, as JuICE.fit scores them
        if "in_grid" in tuning:
            tuning = tuning[tuning.in_grid.astype(bool)]
        return tuning.sort_values(["accuracy", "probability"], ascending=False).iloc[0]
    if not 0.0 <= clean_margin <= 1.0:
        raise ValueError(f"clean_margin is a drop in accuracy between 0 and 1 (e.g. 0.05), got {clean_margin!r}.")
    unsteered = tuning[(tuning.beta_plus == 0) & (tuning.beta_minus == 0)]
    if unsteered.empty:
        raise ValueError("The tuning table has no unsteered pair (0, 0), which the robust objective compares against.")
    if "acc_clean" not in tuning:  # no clean prompts (e.g. MemoTrap-style data): no clean recall to protect
        tuning = tuning.assign(acc_clean=0.0)
        unsteered = unsteered.assign(acc_clean=0.0)
    floor = float(unsteered.acc_clean.iloc[0]) - clean_margin
    conflicts = [c for c in tuning.columns if c.startswith("acc_") and c != "acc_clean"]
    table = tuning.assign(
        conflict_accuracy=tuning[conflicts].sum(axis=1) if conflicts else 0.0,
        strength=tuning.beta_plus.abs() + tuning.beta_minus.abs(),
        allowed=(tuning.acc_clean >= floor - 1e-9) | ((tuning.beta_plus == 0) & (tuning.beta_minus == 0)),
    )
    allowed = table[table.allowed]
    order = ["conflict_accuracy", "strength", *(["k"] if "k" in table else []), "probability"]
    ascending = [False, True, *([True] if "k" in table else []), False]
    return allowed.sort_values(order, ascending=ascending, kind="mergesort").iloc[0]


def tune_betas(
    steer,
    validation: ConflictDataset,
    *,
    objective: str = "robust",
    clean_margin: float = 0.05,
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
