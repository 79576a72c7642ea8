"""Per-head analyses of the JuICE paper: superposition heatmaps, Table 1 (memory heads that
flip), Table 2 (counteracting joint knockouts) and Figure 6 (run once vs run twice).

All of them run on the sweep engine (:mod:`cpsuper.engine`), so every head x scale x prompt
combination shares one clean forward pass per prompt batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import pandas as pd

from .ablation import check_ablation, head_ablation, mean_outputs, sweep_ablated
from .backend import Model
from .data.examples import ConflictDataset
from .edits import HeadEdit
from .identification import IdentifiedHeads
from .metrics import Metric
from .roles import significant_flips
from .runtime import (
    check_conflict_dataset,
    check_finite,
    check_flag,
    check_grid,
    check_head,
    check_head_indices,
    check_layers,
    check_model,
    check_positive_int,
)
from .sweeps import SweepResult, sweep_dataset

__all__ = [
    "cumulative_knockout",
    "head_sweep",
    "rank_heads",
    "run_once_vs_twice",
    "superposition_heads",
    "top_knockout_heads",
]

Head = tuple[int, int]


def _heads(model: Model, layers: Sequence[int] | None, heads: Sequence[int] | None) -> list[Head]:
    """Every (layer, head) of the selection; ``None`` selects all, an empty selection is an error."""
    layers, heads = check_layers(model, layers), check_head_indices(model, heads)
    return [check_head(model, l, h) for l in layers for h in heads]


def head_sweep(
    model: Model,
    dataset: ConflictDataset,
    alphas: Sequence[float] = (0.0, 2.0),
    *,
    conflict_types: Sequence[str] | None = None,
    targets: Sequence[str] = ("parametric", "context"),
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    metric: str | Metric = "probability",
    batch_size: int = 64,
    progress: bool = True,
    ablation: str = "zero",
    reference: ConflictDataset | None = None,
    seed: int = 0,
) -> SweepResult:
    """Scale each query head's output by each ``alpha`` (0 = knockout) and measure the change
    in the first-token probability of each target answer, per conflict type.

    The paper's effect ``E[P(y | do(H = alpha H)) - P(y)]``; its ``summary`` has columns
    ``layer, head, alpha, ablation, conflict_type, target, delta_mean, delta_std, n, p_clean, p``.

    ``ablation`` says what fills the part a scale takes away: ``H <- alpha H + (1 - alpha) R``
    with ``R`` zero (``"zero"``, the paper's scaling), the head's mean output over every token
    of ``reference``'s prompts (``"mean"``; default reference: the swept dataset, all its
    conflict types), or its output on another example's prompt of the same conflict type,
    aligned from the end (``"resample"``, a derangement drawn by ``seed``); ``alpha = 0`` is the
    full replacement. See :mod:`cpsuper.ablation`.
    """
    check_model(model)
    check_conflict_dataset(dataset)
    progress = check_flag(progress, "progress")
    alphas = check_grid(alphas, "alphas")
    ablation = check_ablation(ablation)
    grid = [(l, h, float(a)) for l, h in _heads(model, layers, heads) for a in alphas]
    means = None
    if ablation == "mean":
        names = sorted({f"blocks.{l}.attn.hook_z" for l, _, _ in grid})
        means = mean_outputs(model, dataset if reference is None else reference, names)
    conditions = [head_ablation(l, h, a, ablation, means) for l, h, a in grid]
    labels = pd.DataFrame(grid, columns=["layer", "head", "alpha"])
    options = {"conflict_types": conflict_types, "targets": targets, "metric": metric, "seed": seed}
    options |= {"ablation": ablation, "batch_size": batch_size, "progress": progress}
    return sweep_ablated(model, dataset, conditions, labels=labels, **options)


def _one_ablation(summary: pd.DataFrame) -> pd.DataFrame:
    """``summary`` if it holds one ablation kind; averaging several into one table is an error."""
    if "ablation" in summary and summary.ablation.nunique() > 1:
        raise ValueError(
            f"The sweep mixes ablations {sorted(summary.ablation.unique())}; pass one, e.g. "
            "summary[summary.ablation == 'mean']."
        )
    return summary


def _effects(result: SweepResult | pd.DataFrame, alpha: float, target: str) -> pd.DataFrame:
    """Mean delta per head (rows) and conflict type (columns) at one alpha and target."""
    summary = _one_ablation(result.summary if isinstance(result, SweepResult) else result)
    rows = summary[np.isclose(summary.alpha, alpha) & (summary.target == target)]
    if rows.empty:
        raise ValueError(
            f"The sweep has no rows for alpha={alpha} and target={target!r}; "
            f"it has alphas {sorted(summary.alpha.unique())} and targets {sorted(summary.target.unique())}."
        )
    return rows.pivot_table(index=["layer", "head"], columns="conflict_type", values="delta_mean", sort=False)


def superposition_heads(
    result: SweepResult | pd.DataFrame,
    alpha: float = 0.0,
    target: str = "parametric",
    between: tuple[str, str] = ("substitution", "coherent"),
    min_effect: float = 0.0,
    *,
    n_boot: int = 2000,
    ci: float = 0.95,
    seed: int = 0,
) -> pd.DataFrame:
    """Heads whose effect on the target changes sign between two conflict types.

    One row per head with ``delta_<type>`` (mean effect) for both types, ``sign_change`` (the
    two means have opposite signs and both exceed ``min_effect`` in size) and ``superposed``.

    Given a :class:`SweepResult` (per-fact changes available), ``superposed`` is significance
    aware: the effect is significantly positive in one type and significantly negative in the
    other (percentile bootstrap intervals over facts, ``ci_low_<type>`` / ``ci_high_<type>``,
    exclude 0; see :func:`cpsuper.roles.significant_flips`). A sign change of a near-zero mean
    is not superposition. Given only a summary frame, no interval can be formed and
    ``superposed`` is the plain sign change. ``attrs["counts"]`` holds both counts. Sorted by
    ``superposed`` and then by the smaller of the two effect sizes, largest first.
    """
    effects = _effects(result, alpha, target)
    missing = [c for c in between if c not in effects.columns]
    if missing:
        raise ValueError(f"The sweep has no conflict types {missing}; it has {list(effects.columns)}.")
    a, b = between
    out = pd.DataFrame({f"delta_{a}": effects[a], f"delta_{b}": effects[b]}, index=effects.index).reset_index()
    size = np.minimum(out[f"delta_{a}"].abs(), out[f"delta_{b}"].abs())
    out["sign_change"] = (np.sign(out[f"delta_{a}"]) * np.sign(out[f"delta_{b}"]) < 0) & (size > min_effect)
    out["superposed"] = out["sign_change"]
    if isinstance(result, SweepResult):
        flips = significant_flips(
            result, alpha=alpha, target=target, types=between, n_boot=n_boot, ci=ci, min_effect=min_effect, seed=seed
        ).heads
        cols = [f"{c}_{t}" for t in between for c in ("ci_low", "ci_high")]
        out = out.merge(flips[["layer", "head", *cols, "significant_flip"]], on=["layer", "head"], how="left")
        out["superposed"] = out["significant_flip"].fillna(False).astype(bool) & out["sign_change"]
        out = out.drop(columns="significant_flip")
    out["strength"] = size
    out["alpha"], out["target"] = alpha, target
    out = out.sort_values(["superposed", "sign_change", "strength"], ascending=False).reset_index(drop=True)
    out.attrs["counts"] = {
        "heads": len(out),
        "sign_changes": int(out["sign_change"].sum()),
        "superposed": int(out["superposed"].sum()),
    }
    return out


def rank_heads(
    result: SweepResult | pd.DataFrame,
    k: int = 4,
    alpha: float = 0.0,
    rank_by: tuple[str, str] = ("substitution", "context"),
    compare: Sequence[str] = ("substitution", "coherent"),
) -> pd.DataFrame:
    """Table 1: the top-``k`` heads by the mean gain in ``rank_by = (conflict type, target)``
    when scaled by ``alpha`` (default: knocked out; context gain in substitution conflicts, the
    "memory heads"), with their mean changes in context and parametric probability under each
    conflict type of ``compare``.

    Columns: ``layer, head`` and ``(conflict_type, target)`` pairs. See
    :func:`cpsuper.plots.style_head_table` for the coloured view.
    """
    summary = _one_ablation(result.summary if isinstance(result, SweepResult) else result)
    check_positive_int(k, "k")
    rows = summary[np.isclose(summary.alpha, alpha)]
    table = rows.pivot_table(index=["layer", "head"], columns=["conflict_type", "target"], values="delta_mean")
    needed = [rank_by, *[(c, t) for c in compare for t in ("context", "parametric")]]
    missing = [col for col in needed if col not in table.columns]
    if missing:
        raise ValueError(f"The sweep lacks {missing}: run head_sweep with those conflict types and both targets.")
    check_positive_int(k, "k", at_most=len(table), of="heads in the sweep")
    table = table.sort_values(rank_by, ascending=False).head(k)[needed[1:]]
    table.columns = pd.MultiIndex.from_tuples(table.columns, names=["conflict_type", "target"])
    return table.reset_index()


def top_knockout_heads(
    model: Model,
    dataset: ConflictDataset,
    *,
    conflict_type: str = "coherent",
    target: str = "parametric",
    k: int = 10,
    batch_size: int = 64,
    progress: bool = True,
    identified: IdentifiedHeads | None = None,
    metric: str | Metric = "probability",
) -> pd.DataFrame:
    """Heads ranked by the mean gain in ``target`` probability when each is knocked out alone
    under ``conflict_type`` conflicts (top ``k`` with a positive gain).

    ``identified``: JuICE stage 1 (:func:`cpsuper.identify_heads`) toward ``target`` on the same
    facts, with -1 in its negative grid; adding -1 times a head's output is knocking it out, so its
    stored changes are ranked (:meth:`IdentifiedHeads.knockouts`) instead of running the sweep again.
    ``metric``: what the gain is measured in (a sweep metric; ``"answer_logprob"`` for whole answers)."""
    check_model(model)
    check_conflict_dataset(dataset)
    check_positive_int(k, "k", at_most=model.cfg.n_layers * model.cfg.n_heads, of="heads of the model")
    if identified is None:
        summary = head_sweep(
            model,
            dataset,
            (0.0,),
            conflict_types=[conflict_type],
            targets=(target,),
            metric=metric,
            batch_size=batch_size,
            progress=progress,
        ).summary
    else:
        scored_in = identified.per_example.attrs.get("metric", "probability")
        if scored_in != (metric if isinstance(metric, str) else getattr(metric, "__name__", "custom")):
            raise ValueError(
                f"identified was scored with metric={scored_in!r}, not {metric!r}; pass stage 1 scored with "
                "the same metric, or none."
            )
        if identified.target != target:
            raise ValueError(
                f"identified holds changes of the {identified.target!r} answer, but {target!r} is ranked "
                f"here; pass stage 1 toward {target!r}, or none."
            )
        if set(identified.subjects) != {e.subject for e in dataset}:
            raise ValueError(
                f"identified was scored on {identified.subjects}, not on {dataset.name!r}'s facts "
                f"{[e.subject for e in dataset]}; pass stage 1 of the same facts, or none."
            )
        summary = identified.knockouts(conflict_type)
    ranked = summary.sort_values("delta_mean", ascending=False)
    ranked = ranked[ranked.delta_mean > 0].head(k)
    if ranked.empty:
        raise ValueError(
            f"No single head raises the {target} probability when knocked out under {conflict_type} "
            f"conflicts on {dataset.name!r}; nothing to combine."
        )
    return ranked[["layer", "head", "delta_mean", "delta_std", "n"]].reset_index(drop=True)


def _as_heads(ranking: pd.DataFrame | Sequence[Head]) -> list[Head]:
    if isinstance(ranking, pd.DataFrame):
        return [(int(l), int(h)) for l, h in zip(ranking["layer"], ranking["head"])]
    return [(int(l), int(h)) for l, h in ranking]


def cumulative_knockout(
    model: Model,
    dataset: ConflictDataset,
    ranking: pd.DataFrame | Sequence[Head],
    *,
    ks: Sequence[int] | None = None,
    conflict_type: str = "coherent",
    target: str = "parametric",
    metric: str | Metric = "probability",
    batch_size: int = 64,
    progress: bool = True,
) -> SweepResult:
    """Table 2: knock out the top-1..top-k ranked heads *together* (ranked on a separate
    selection split with :func:`top_knockout_heads`) and read the target probability on
    ``dataset`` (a held-out split). ``k = 0`` is the unmodified model.

    Individually helpful knockouts need not add up: the summary's ``p`` column often peaks
    before the largest ``k``.
    """
    heads = _as_heads(ranking)
    if ks is None:
        ks = list(range(len(heads) + 1))
    else:
        if isinstance(ks, (str, bytes)) or not isinstance(ks, Iterable):
            raise ValueError(f"ks must be a sequence of positive integers, got {ks!r}; pass e.g. ks=[1, 3, 5].")
        ks = list(ks)
        if not ks:
            raise ValueError("ks is empty; give at least one number of heads (k = 0, no knockout, is always included).")
        ks = [check_positive_int(k, f"ks[{i}]") for i, k in enumerate(ks)]
        if max(ks) > len(heads):
            raise ValueError(f"Asked for the top {max(ks)} heads but the ranking has only {len(heads)}.")
        ks = sorted({0, *ks})
    conditions = [[HeadEdit(l, h, scale=0.0) for l, h in heads[:k]] for k in ks]
    labels = pd.DataFrame({"k": ks, "heads": [str(heads[:k]) for k in ks]})
    options = {"conflict_types": [conflict_type], "targets": (target,), "metric": metric}
    return sweep_dataset(model, dataset, conditions, labels, **options, batch_size=batch_size, progress=progress)


def run_once_vs_twice(
    model: Model,
    dataset: ConflictDataset,
    ranking: pd.DataFrame | Sequence[Head],
    *,
    beta: float = -1.0,
    conflict_type: str = "coherent",
    target: str = "parametric",
    metric: str | Metric = "probability",
    batch_size: int = 64,
    progress: bool = True,
) -> SweepResult:
    """Figure 6: combine the top-1..top-K ranked heads with strength ``beta`` in two ways.

    - ``"run once"`` (JuNe): one pass, each head scaled, ``H <- (1 + beta) H``;
    - ``"run twice"`` (JuICE): a clean first pass records the heads' outputs ``H*``, the second
      pass adds ``beta H*`` to each head.

    With the default ``beta = -1`` "run once" is the joint knockout of Table 2, while "run
    twice" removes what each head wrote in the clean run, however earlier edits changed its
    input.
    """
    heads = _as_heads(ranking)
    beta = check_finite(beta, "beta")
    conditions, labels = [], []
    for k in range(1, len(heads) + 1):
        conditions.append([HeadEdit(l, h, scale=1.0 + beta) for l, h in heads[:k]])
        conditions.append([HeadEdit(l, h, add=beta) for l, h in heads[:k]])
        labels += [(k, "run once", str(heads[:k])), (k, "run twice", str(heads[:k]))]
    labels = pd.DataFrame(labels, columns=["k", "method", "heads"])
    options = {"conflict_types": [conflict_type], "targets": (target,), "metric": metric}
    return sweep_dataset(model, dataset, conditions, labels, **options, batch_size=batch_size, progress=progress)
