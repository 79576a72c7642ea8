"""How sensitive JuICE is to its choices (the paper's Figure 5 and Table 7): the number of
selection facts |D|, the number of heads K, the strengths beta, and the prompt template.

Every function returns a tidy DataFrame of greedy accuracy (an alias of the target answer in the
first words of the continuation) per setting and conflict type; :mod:`cpsuper.plots` draws them
(``plot_robustness``, ``plot_beta_grid``).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Literal

import pandas as pd
from tqdm.auto import tqdm

from .data.examples import ConflictDataset
from .identification import IdentifiedHeads
from .juice import JuICE

__all__ = [
    "beta_grid",
    "draw_templates",
    "k_sweep",
    "paraphrase_sweep",
    "selection_size_sweep",
]


def _accuracy(steer: JuICE, dataset: ConflictDataset, **labels) -> list[dict]:
    acc = steer.accuracy(dataset).groupby("conflict_type")["correct"].mean()
    return [{**labels, "conflict_type": c, "accuracy": float(v)} for c, v in acc.items()]


def k_sweep(
    steer: JuICE,
    identified: IdentifiedHeads,
    dataset: ConflictDataset,
    ks: Sequence[int] = (1, 3, 5, 10, 20, 30),
    progress: bool = True,
) -> pd.DataFrame:
    """Accuracy when the top ``k`` heads per sign of ``identified`` are steered with ``steer``'s
    betas (the head scores are reused: no re-identification)."""
    rows = []
    for k in tqdm(ks, desc="K", disable=not progress):
        rows += _accuracy(steer.with_heads(identified, k), dataset, k=k)
    return pd.DataFrame(rows)


def selection_size_sweep(
    steer: JuICE,
    pool: ConflictDataset,
    dataset: ConflictDataset,
    sizes: Sequence[int] = (1, 2, 4, 6, 8, 10),
    scored: IdentifiedHeads | None = None,
    batch_size: int = 64,
    progress: bool = True,
) -> pd.DataFrame:
    """Accuracy when the heads are identified on the first ``n`` facts of ``pool`` for each ``n``
    in ``sizes`` (``steer``'s K and betas kept).

    Every fact is scored once (on ``pool[:max(sizes)]``) and each size re-aggregates the stored
    per-fact changes (:meth:`IdentifiedHeads.subset`), so the sweep costs one stage 1, not one
    per size. Pass ``scored`` (an identification covering those facts) to skip even that."""
    too_big = [n for n in sizes if not 1 <= n <= len(pool)]
    if too_big or not sizes:
        raise ValueError(
            f"Selection sizes {too_big or '[]'} do not fit a pool of {len(pool)} facts; use 1..{len(pool)}."
        )
    subjects = [e.subject for e in pool]
    if scored is None:
        scored = steer.identify(pool[: max(sizes)], batch_size=batch_size, progress=progress)
    rows = []
    for n in tqdm(sizes, desc="|D|", disable=not progress):
        rows += _accuracy(steer.with_heads(scored.subset(subjects[:n])), dataset, n_selection=n)
    return pd.DataFrame(rows)


def beta_grid(steer: JuICE, dataset: ConflictDataset, progress: bool = True) -> pd.DataFrame:
    """Accuracy for every (beta_plus, beta_minus) of ``steer``'s grids with its heads."""
    rows = []
    pairs = [(bp, bm) for bp in steer.beta_pos_grid for bm in steer.beta_neg_grid]
    for bp, bm in tqdm(pairs, desc="betas", disable=not progress):
        trial = JuICE(
            steer.model,
            steer.direction,
            k=steer.k,
            dual_run=steer.dual_run,
            enhance=steer.enhance,
            suppress=steer.suppress,
            beta_plus=bp,
            beta_minus=bm,
        )
        rows += _accuracy(trial, dataset, beta_plus=bp, beta_minus=bm)
    return pd.DataFrame(rows)


def draw_templates(datasets: Mapping[object, ConflictDataset], *, seed: int = 0) -> ConflictDataset:
    """One dataset in which every fact is written with a template drawn at random (seeded).

    ``datasets`` maps a template label to the same facts (same subjects, same order) written
    with that template; example ``i`` of the result is example ``i`` of the dataset of a label
    drawn uniformly for it, and records the label in ``meta["template"]``. The same seed gives
    the same draws.
    """
    labels = list(datasets)
    if not labels:
        raise ValueError("No templates to draw from: datasets is empty.")
    subjects = [e.subject for e in datasets[labels[0]]]
    for label in labels[1:]:
        other = [e.subject for e in datasets[label]]
        if other != subjects:
            raise ValueError(
                f"Templates {labels[0]!r} and {label!r} hold different facts ({len(subjects)} vs {len(other)} "
                "examples, or another order); build every template's dataset from the same subjects."
            )
    rng = random.Random(f"templates|{seed}")
    drawn = [rng.choice(labels) for _ in subjects]
    examples = [
        replace(datasets[label][i], meta={**datasets[label][i].meta, "template": label})
        for i, label in enumerate(drawn)
    ]
    return ConflictDataset(examples, name=f"{datasets[labels[0]].name}|random templates (seed {seed})")


def paraphrase_sweep(
    methods: Mapping[str, object],
    datasets: Mapping[str, ConflictDataset],
    progress: bool = True,
    *,
    mode: Literal["per_template", "per_example"] = "per_template",
    seeds: Sequence[int] = (0,),
    per_fact: bool = False,
) -> pd.DataFrame:
    """Accuracy of each method on the same facts written with different templates.

    ``datasets`` maps a template label to a dataset, e.g.
    ``{p: relation.dataset(subjects=..., paraphrase=p, tokenizer=model) for p in range(4)}``.
    ``mode="per_template"`` scores each template's dataset (one row set per ``template``);
    ``mode="per_example"`` (the paper's Table 7) draws a template for every fact
    (:func:`draw_templates`) once per seed in ``seeds``: rows have ``template="random"`` and
    ``seed``.

    ``per_fact=True`` returns :func:`cpsuper.evaluate`'s rows instead of accuracies (one per
    method x fact x conflict type, ``correct`` 0 or 1, with the same ``template`` / ``seed``
    labels), for intervals over facts (:func:`cpsuper.baselines.evaluation_intervals`).
    """
    from .baselines import evaluate

    if mode not in ("per_template", "per_example"):
        raise ValueError(f"mode must be 'per_template' or 'per_example', got {mode!r}.")
    if mode == "per_example":
        if not seeds:
            raise ValueError("per_example mode needs at least one seed, e.g. seeds=(0, 1, 2).")
        runs = [({"template": "random", "seed": s}, draw_templates(datasets, seed=s)) for s in seeds]
    else:
        runs = [({"template": label}, data) for label, data in datasets.items()]
    rows = []
    for labels, data in tqdm(runs, desc="templates", disable=not progress):
        results = evaluate(methods, data)
        if per_fact:
            rows.append(results.assign(**labels))
            continue
        acc = results.groupby(["method", "conflict_type"])["correct"].mean()
        rows += [{**labels, "method": m, "conflict_type": c, "accuracy": float(v)} for (m, c), v in acc.items()]
    return pd.concat(rows, ignore_index=True) if per_fact else pd.DataFrame(rows)
