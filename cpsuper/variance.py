"""How much JuICE depends on which few facts it is fitted on (issue 16).

JuICE identifies its heads on a handful of selection facts and tunes its two strengths on a
handful of validation facts; another handful can give another steering. :func:`selection_variance`
measures that spread: it scores stage 1 once on every development fact a draw may pick, then for
each of ``draws`` seeded draws re-aggregates the heads of that draw's selection facts (no model
run), tunes the betas on that draw's validation facts and scores JuICE, JuNe (same heads and
betas, one pass) and the unsteered model on one fixed set of held-out facts, by greedy accuracy
(the answer among the first words of an 8-token continuation) and first-token accuracy (the
steered model's top next token is the answer's first token).

A *recipe* is how a draw turns its facts into a steering:

- ``"paper"``: mean stage-1 score over the selection facts; betas that maximise the summed
  validation accuracy over conflict types (ties: summed target probability), as ``JuICE.fit``;
- ``"robust"``: the same heads; betas chosen by :func:`choose_betas` with the clean-margin rule
  (only pairs that keep validation clean accuracy within ``clean_margin`` of the unsteered
  model's are allowed; among those, the most conflict accuracy, then the weakest intervention);
- ``"robust-median"``: the robust betas on heads ranked by the *median* over selection facts of
  each fact's mean change, so that one unusual fact cannot carry a head into the set;
- ``"robust-k"``: the robust rule over head counts too: the top 3 or the top 5 heads of each set,
  with every beta pair (ties toward fewer heads);
- ``"robust-conflict"``: the robust betas on heads chosen on the conflict prompts alone
  (substitution and coherent): a head need not keep the clean prompt's answer under the large
  stage-1 scales to be chosen, since the clean-margin rule protects clean recall on validation;
- ``"robust-mild"``: the robust betas on heads scored on every prompt at the dual run's own
  strengths (the non-zero values of the beta grids) rather than at stage 1's 1..30 and -1..-5.
- ``"robust-gated"``: ``robust-conflict``'s heads, steering only the prompts its context gate
  opens for (:mod:`cpsuper.context_gate`), in the tuning and on the held-out facts.

The held-out facts may be given as several named test sets (e.g. the same facts in other wording
families, or another relation): every draw's steerings are scored on each, in a ``test`` column.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import pandas as pd
from tqdm.auto import tqdm

from .backend import Model
from .data.examples import CONFLICT_TYPES, TARGETS, ConflictDataset
from .identification import NEG_GRID, POS_GRID, IdentifiedHeads, identify_heads
from .juice import JuICE
from .runtime import check_batch_size, check_grid
from .stats import bootstrap_summary
from .tuning import (
    BETA_NEG_GRID,
    BETA_POS_GRID,
    DEFAULT_CLEAN_MARGIN,
    FIT_RECIPES,
    Recipe,
    beta_tuning,
    choose_betas,
)

__all__ = [
    "METRICS",
    "RECIPES",
    "SelectionVariance",
    "aggregate_heads",
    "selection_variance",
    "summarize_draws",
]

RECIPES = {
    **FIT_RECIPES,
    "robust-median": Recipe("robust", aggregate="median"),
    "robust-k": Recipe("robust", head_counts=(3, 5)),
}
"""The recipes a selection-variance study compares: ``JuICE.fit``'s (:data:`cpsuper.tuning.FIT_RECIPES`)
and two study-only variants (stage-1 scores pooled by the median; the head count tuned too)."""
MILD_RECIPES = tuple(name for name, recipe in RECIPES.items() if recipe.stage1_at_betas)
"""Recipes whose stage 1 is scored at the beta grids' strengths (a second identification)."""
METHODS = ("Original", "JuNe", "JuICE")
METRICS = {"greedy": "accuracy", "first_token": "first_token_accuracy"}
"""Summary ``metric`` -> the ``per_draw`` column it summarises."""


def aggregate_heads(
    scored: IdentifiedHeads,
    subjects: Sequence[str],
    k: int,
    how: str = "mean",
    conflict_types: Sequence[str] | None = None,
) -> IdentifiedHeads:
    """The top ``k`` heads per sign from the stored per-fact changes of ``subjects`` (on the
    prompts of ``conflict_types`` only, if given).

    ``how="mean"`` is :meth:`IdentifiedHeads.subset` (stage 1 on those facts); ``"median"``
    scores each head by the median over the facts of each fact's mean change over the scales."""
    if how == "mean":
        return scored.subset(subjects, conflict_types).with_k(k)
    if how != "median":
        raise ValueError(f"how must be 'mean' or 'median', got {how!r}.")
    per_example = scored.subset(subjects, conflict_types).per_example
    keys = ["layer", "head", "sign", "conflict_type"]
    per_fact = per_example.groupby([*keys, "subject"], sort=False)["delta"].mean()
    scores = per_fact.groupby(level=keys, sort=False).median().rename("score").reset_index()
    heads = IdentifiedHeads(scores, [], [], k, per_example, scored.target).with_k(k)
    if not heads.enhance and not heads.suppress:
        raise ValueError(
            f"No head has a median change >= 0 under every conflict type on the selection facts {list(subjects)}."
        )
    return heads


@dataclass
class SelectionVariance:
    """Result of :func:`selection_variance`.

    ``per_draw``: one row per draw x recipe x method x conflict type with the held-out greedy
    ``accuracy`` and ``first_token_accuracy``, ``n`` (held-out facts), the heads, betas and the
    draw's facts. ``summary``: per ``metric`` (``"greedy"``, ``"first_token"``) x recipe x
    method x conflict type, ``mean`` over draws with a bootstrap interval over draws
    (``ci_low``, ``ci_high``), ``worst`` and ``best`` draw, ``share_meeting`` (share of draws
    with accuracy >= ``threshold``). ``tuning``: every draw's beta grid on its validation facts.
    """

    per_draw: pd.DataFrame
    summary: pd.DataFrame
    tuning: pd.DataFrame = field(repr=False)
    scored: IdentifiedHeads = field(repr=False)
    timings: dict = field(default_factory=dict)
    settings: dict = field(default_factory=dict)


def _heads_text(heads) -> str:
    return " ".join(f"({l}, {h})" for l, h in heads)


def _check_inputs(dataset, test, draws, n_select, n_validation, n_pool, direction, recipes, seed):
    for name, value in (("draws", draws), ("n_select", n_select), ("n_validation", n_validation)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    if direction not in TARGETS:
        raise ValueError(f"direction must be one of {TARGETS}, got {direction!r}.")
    if isinstance(recipes, str):
        recipes = (recipes,)
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown or not recipes:
        raise ValueError(f"Unknown recipes {unknown or '[]'}; choose among {tuple(RECIPES)}.")
    need = n_select + n_validation
    if test is None:
        n_pool = need if n_pool is None else n_pool
        if n_pool < need:
            raise ValueError(f"n_pool={n_pool} cannot hold {n_select} selection and {n_validation} validation facts.")
        if len(dataset) < n_pool + 1:
            raise ValueError(
                f"Dataset {dataset.name!r} has {len(dataset)} facts, too few for a development pool of {n_pool} "
                f"({n_select} selection + {n_validation} validation per draw) and at least 1 held-out test fact: "
                f"{n_pool + 1} are needed. Use more facts or smaller n_select / n_validation / n_pool."
            )
        order = list(range(len(dataset)))
        random.Random(f"variance-pool|{seed}").shuffle(order)
        return dataset[order[:n_pool]], dataset[order[n_pool:]], tuple(recipes)
    if n_pool is not None:
        raise ValueError("n_pool applies only without a test set; with test=..., the whole dataset is the pool.")
    tests = test if isinstance(test, Mapping) else {"test": test}
    if not tests:
        raise ValueError("test is an empty mapping; give at least one held-out test set.")
    if len(dataset) < need:
        raise ValueError(
            f"Dataset {dataset.name!r} has {len(dataset)} development facts, too few for {n_select} selection "
            f"and {n_validation} validation facts per draw: {need} are needed."
        )
    for label, part in tests.items():
        same_relation = set(part.relations) & set(dataset.relations)
        shared = sorted({e.subject for e in dataset} & {e.subject for e in part}) if same_relation else []
        if shared:
            raise ValueError(f"The {label} facts {shared} are also development facts; hold them out of dataset.")
    return dataset, test, tuple(recipes)


def selection_variance(
    model: Model,
    dataset: ConflictDataset,
    *,
    test: ConflictDataset | Mapping[str, ConflictDataset] | None = None,
    draws: int = 10,
    first_draw: int = 0,
    n_select: int = 4,
    n_validation: int = 4,
    n_pool: int | None = None,
    direction: str = "parametric",
    recipes: Sequence[str] = ("paper", "robust-conflict"),
    k: int = 5,
    pos_grid: Sequence[float] = POS_GRID,
    neg_grid: Sequence[float] = NEG_GRID,
    beta_pos_grid: Sequence[float] = BETA_POS_GRID,
    beta_neg_grid: Sequence[float] = BETA_NEG_GRID,
    clean_margin: float = DEFAULT_CLEAN_MARGIN,
    threshold: float | Mapping[str, float] = 0.8,
    scored: IdentifiedHeads | None = None,
    scored_mild: IdentifiedHeads | None = None,
    validation_pool: ConflictDataset | None = None,
    seed: int = 0,
    batch_size: int = 64,
    n_boot: int = 2000,
    progress: bool = True,
    on_draw: Callable[[pd.DataFrame], None] | None = None,
) -> SelectionVariance:
    """JuICE fitted on ``draws`` seeded draws of selection and validation facts, each scored on
    the same held-out facts (see the module docstring).

    ``dataset``: the development facts (known facts: use ``cp.filter_known``). With ``test``
    given (one dataset, or several by name), every fact of ``dataset`` may be drawn and ``test``
    is held out; without it,
    ``dataset`` is shuffled by ``seed`` into a pool of ``n_pool`` facts (default
    ``n_select + n_validation``) and the held-out rest. Stage 1 is scored once on the pool
    (pass ``scored``, an identification covering it, to skip that; ``scored_mild`` likewise for the
    ``robust-mild`` recipe's identification at the beta grids' strengths). ``validation_pool``:
    draw the validation facts from these instead (stage 1 then scores only ``dataset``, the
    selection candidates, which halves its cost). ``threshold``: accuracy a
    draw must reach to count in ``share_meeting`` (one number, or one per conflict type).
    ``on_draw``: called after each draw with the rows so far (e.g. to save partial results).
    ``first_draw``: number of the first draw; draws are seeded by their number, so a study can
    run in parts (``draws=5`` then ``first_draw=5, draws=5``) and the parts concatenated.
    """
    t_start = time.perf_counter()
    if validation_pool is not None:  # selection candidates and validation facts apart
        if len(validation_pool) < n_validation or len(dataset) < n_select:
            raise ValueError(
                f"Need {n_select} selection candidates and {n_validation} validation facts; got "
                f"{len(dataset)} and {len(validation_pool)}."
            )
        shared = sorted({e.subject for e in dataset} & {e.subject for e in validation_pool})
        if shared:
            raise ValueError(f"The facts {shared} are both selection candidates and validation facts.")
    check_n_validation = 0 if validation_pool is not None else n_validation
    pool, test, recipes = _check_inputs(
        dataset, test, draws, n_select, max(check_n_validation, 1), n_pool, direction, recipes, seed
    )
    batch_size = check_batch_size(batch_size)
    pos_grid, neg_grid = check_grid(pos_grid, "pos_grid", "positive"), check_grid(neg_grid, "neg_grid", "negative")
    beta_pos_grid = check_grid(beta_pos_grid, "beta_pos_grid", "non-negative")
    beta_neg_grid = check_grid(beta_neg_grid, "beta_neg_grid", "non-positive")
    thresholds = threshold if isinstance(threshold, Mapping) else dict.fromkeys(CONFLICT_TYPES, float(threshold))
    subjects = [e.subject for e in pool]
    timings: dict[str, float] = {}

    t = time.perf_counter()
    if scored is None and set(recipes) - set(MILD_RECIPES):
        scored = identify_heads(
            model, pool, direction, pos_grid=pos_grid, neg_grid=neg_grid, k=k, batch_size=batch_size, progress=progress
        )
    elif scored is not None:
        missing = sorted(set(subjects) - set(scored.subjects))
        if missing:
            raise ValueError(f"scored does not cover the development facts {missing}; score the whole pool.")
    if scored_mild is None and set(recipes) & set(MILD_RECIPES):
        mild_pos = [b for b in beta_pos_grid if b > 0]
        mild_neg = [b for b in beta_neg_grid if b < 0]
        scored_mild = identify_heads(
            model, pool, direction, pos_grid=mild_pos, neg_grid=mild_neg, k=k, batch_size=batch_size, progress=progress
        )
    timings["stage1_s"] = time.perf_counter() - t
    conflict_types = [c for c in (scored or scored_mild).conflict_types if c != "clean"]
    labelled = isinstance(test, Mapping)  # several named test sets: a "test" column says which
    tests = test if labelled else {"test": test}

    def steering(enhance=(), suppress=(), bp=0.0, bm=0.0, dual_run=True, gate=None):
        return JuICE(
            model,
            direction,
            k=k,
            dual_run=dual_run,
            enhance=list(enhance),
            suppress=list(suppress),
            beta_plus=bp,
            beta_minus=bm,
            beta_pos_grid=beta_pos_grid,
            beta_neg_grid=beta_neg_grid,
            context_gate=gate,
        )

    evaluated: dict[tuple, pd.DataFrame] = {}

    def held_out(key, steer):
        """Greedy and first-token accuracy per test set and conflict type, computed once per
        distinct steering."""
        if key not in evaluated:
            evaluated[key] = pd.concat(
                {
                    label: steer.accuracy(part).groupby("conflict_type")[["correct", "first_token"]].mean()
                    for label, part in tests.items()
                },
                names=["test", "conflict_type"],
            )
        return evaluated[key]

    t = time.perf_counter()
    original = held_out(("Original",), steering())
    timings["evaluation_s"] = time.perf_counter() - t
    timings["tuning_s"] = 0.0
    rows, tunings = [], []
    if first_draw < 0:
        raise ValueError(f"first_draw must be >= 0, got {first_draw}.")
    for draw in tqdm(range(first_draw, first_draw + draws), desc="draws", disable=not progress):
        order = list(range(len(pool)))
        random.Random(f"variance-draw|{seed}|{draw}").shuffle(order)
        select = [subjects[i] for i in order[:n_select]]
        if validation_pool is None:
            validation = pool[order[n_select : n_select + n_validation]]
        else:
            picks = list(range(len(validation_pool)))
            random.Random(f"variance-validation|{seed}|{draw}").shuffle(picks)
            validation = validation_pool[picks[:n_validation]]
        tables: dict[tuple, pd.DataFrame] = {}
        for recipe in recipes:
            spec = RECIPES[recipe]
            how, objective, ks, conflicts_only = spec.aggregate, spec.objective, spec.head_counts, spec.conflicts_only
            source = scored_mild if recipe in MILD_RECIPES else scored
            heads = aggregate_heads(source, select, k, how, conflict_types if conflicts_only else None)
            key, gate = (tuple(heads.enhance), tuple(heads.suppress)), spec.context_gate
            if (*key, gate) not in tables:  # one table per head sets, over every head count any recipe tunes
                full = max(map(len, key))
                tuned = [n for r in recipes for n in (RECIPES[r].head_counts or ())]
                counts = sorted({full} | {n for n in tuned if n <= full})
                t = time.perf_counter()
                tables[(*key, gate)] = beta_tuning(steering(*key, gate=gate), validation, ks=counts)
                timings["tuning_s"] += time.perf_counter() - t
                text = {"enhance": _heads_text(key[0]), "suppress": _heads_text(key[1])}
                tunings.append(tables[(*key, gate)].assign(draw=draw, context_gate=gate, **text))
            table = tables[(*key, gate)]
            if ks is None:  # every head of both sets
                table = table[table.k == table.k.max()].drop(columns="k")
            elif table.k.isin(ks).any():
                table = table[table.k.isin(ks)]
            best = choose_betas(table, objective, clean_margin=clean_margin)
            bp, bm = float(best.beta_plus), float(best.beta_minus)
            if ks is not None:  # the chosen number of heads of each set
                key = (key[0][: int(best.k)], key[1][: int(best.k)])
            t = time.perf_counter()
            accuracy = {
                "Original": original,
                "JuNe": held_out((*key, bp, bm, False, gate), steering(*key, bp, bm, False, gate)),
                "JuICE": held_out((*key, bp, bm, True, gate), steering(*key, bp, bm, True, gate)),
            }
            timings["evaluation_s"] += time.perf_counter() - t
            for method in METHODS:
                for (label, conflict_type), scores in accuracy[method].iterrows():
                    rows.append(
                        {
                            "draw": draw,
                            "recipe": recipe,
                            **({"test": label} if labelled else {}),
                            "method": method,
                            "conflict_type": conflict_type,
                            "accuracy": float(scores.correct),
                            "first_token_accuracy": float(scores.first_token),
                            "n": len(tests[label]),
                            "enhance": _heads_text(key[0]),
                            "suppress": _heads_text(key[1]),
                            "beta_plus": bp,
                            "beta_minus": bm,
                            "selection": "; ".join(select),
                            "validation": "; ".join(e.subject for e in validation),
                        }
                    )
        if on_draw is not None:
            on_draw(pd.DataFrame(rows))
    per_draw = pd.DataFrame(rows)
    timings["total_s"] = time.perf_counter() - t_start
    settings = {
        "draws": draws,
        "first_draw": first_draw,
        "n_select": n_select,
        "n_validation": n_validation,
        "n_pool": len(pool),
    }
    n_test = {label: len(part) for label, part in tests.items()} if labelled else len(test)
    settings |= {"n_test": n_test, "direction": direction, "recipes": list(recipes), "k": k, "seed": seed}
    settings |= {"pos_grid": list(pos_grid), "neg_grid": list(neg_grid), "clean_margin": clean_margin}
    settings |= {"beta_pos_grid": list(beta_pos_grid), "beta_neg_grid": list(beta_neg_grid)}
    held_out = {label: [e.subject for e in part] for label, part in tests.items()}
    settings |= {"pool": subjects, "test": held_out if labelled else held_out["test"]}
    return SelectionVariance(
        per_draw=per_draw,
        summary=summarize_draws(per_draw, thresholds, n_boot=n_boot, seed=seed),
        tuning=pd.concat(tunings, ignore_index=True),
        scored=scored,
        timings={name: round(value, 1) for name, value in timings.items()},
        settings=settings,
    )


def summarize_draws(
    per_draw: pd.DataFrame, threshold: float | Mapping[str, float] = 0.8, *, n_boot: int = 2000, seed: int = 0
) -> pd.DataFrame:
    """Per metric x recipe x method x conflict type: mean over draws with a bootstrap interval over
    draws, the worst and best draw, and the share of draws reaching ``threshold``. A ``metric``
    (:data:`METRICS`) is summarised when ``per_draw`` has its column."""
    keys = ["recipe", *(["test"] if "test" in per_draw else []), "method", "conflict_type"]
    thresholds = threshold if isinstance(threshold, Mapping) else dict.fromkeys(CONFLICT_TYPES, float(threshold))
    parts = []
    for metric, column in METRICS.items():
        if column not in per_draw.columns:
            continue
        summary = bootstrap_summary(per_draw, value=column, by=keys, unit="draw", n_boot=n_boot, seed=seed)
        extra = per_draw.groupby(keys, sort=False)[column].agg(worst="min", best="max").reset_index()
        meets = [a >= thresholds.get(c, float("inf")) - 1e-9 for a, c in zip(per_draw[column], per_draw.conflict_type)]
        extra["share_meeting"] = per_draw.assign(meets=meets).groupby(keys, sort=False)["meets"].mean().values
        extra["threshold"] = [thresholds.get(c) for c in extra.conflict_type]
        parts.append(summary.rename(columns={"n": "draws"}).merge(extra, on=keys).assign(metric=metric))
    if not parts:
        raise ValueError(f"per_draw has none of the accuracy columns {list(METRICS.values())}.")
    summary = pd.concat(parts, ignore_index=True)
    summary = summary[["metric", *[c for c in summary.columns if c != "metric"]]]
    order = {m: i for i, m in enumerate(METHODS)} | {c: i for i, c in enumerate(CONFLICT_TYPES)}
    order |= {m: i for i, m in enumerate(METRICS)}
    return summary.sort_values(
        ["metric", *keys],
        key=lambda col: col.map(order) if col.name not in ("recipe", "test") else col,
        kind="mergesort",
    ).reset_index(drop=True)
