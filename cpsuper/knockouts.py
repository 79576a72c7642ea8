"""Module knockouts by conflict type (the JuICE paper's Figure 3).

Zero-ablating a whole attention module, MLP, or layer and reading the change in the target
answer's probability shows that the same module can help the parametric answer under one
conflict type and hurt it under another. Mean and resample ablations (:mod:`cpsuper.ablation`)
replace the module's output by something closer to what it usually writes.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from .ablation import check_ablation, mean_outputs, module_ablation, sweep_ablated
from .backend import Model
from .data.examples import CONFLICT_TYPES, ConflictDataset
from .interventions import MODULES
from .metrics import Metric
from .runtime import check_conflict_dataset, check_flag, check_layers, check_model, check_targets
from .sweeps import SweepResult

__all__ = ["consistent_gains", "knockout_sweep"]


def knockout_sweep(
    model: Model,
    dataset: ConflictDataset,
    modules: Sequence[str] = MODULES,
    *,
    conflict_types: Sequence[str] | None = None,
    targets: str | Sequence[str] = "parametric",
    layers: Sequence[int] | None = None,
    metric: str | Metric = "probability",
    batch_size: int = 64,
    progress: bool = True,
    ablation: str = "zero",
    reference: ConflictDataset | None = None,
    seed: int = 0,
) -> SweepResult:
    """Ablate each module (``"attn"``, ``"mlp"``, ``"layer"`` = both) at each layer, at all
    positions, and measure the change in the target answer's first-token probability.

    ``ablation``: replace the module's output by zero (``"zero"``, the paper's knockout), by its
    mean over every token of ``reference``'s prompts (``"mean"``; default reference: the swept
    dataset, all its conflict types), or by its output on another example's prompt of the same
    conflict type (``"resample"``, a derangement drawn by ``seed``, positions aligned from the
    end); see :mod:`cpsuper.ablation`.

    Returns a :class:`~cpsuper.sweeps.SweepResult`; its ``summary`` has columns ``layer, module,
    ablation, conflict_type, target, delta_mean, delta_std, n, p_clean, p``.
    """
    check_model(model)
    check_conflict_dataset(dataset)
    progress = check_flag(progress, "progress")
    layers = check_layers(model, layers)
    bad = [m for m in modules if m not in MODULES]
    if bad or not modules:
        raise ValueError(f"Unknown modules {bad}; use a subset of {MODULES}.")
    targets = check_targets(targets)
    ablation = check_ablation(ablation)
    means = None
    if ablation == "mean":
        sites = {s for m in modules for s in (("attn", "mlp") if m == "layer" else (m,))}
        names = [f"blocks.{layer}.hook_{s}_out" for layer in layers for s in sites]
        means = mean_outputs(model, dataset if reference is None else reference, names)
    conditions = [module_ablation(layer, module, ablation, means) for layer in layers for module in modules]
    labels = pd.DataFrame([(layer, module) for layer in layers for module in modules], columns=["layer", "module"])
    options = {"conflict_types": conflict_types, "targets": targets, "metric": metric, "seed": seed}
    options |= {"ablation": ablation, "batch_size": batch_size, "progress": progress}
    return sweep_ablated(model, dataset, conditions, labels=labels, **options)


def consistent_gains(result: SweepResult | pd.DataFrame, target: str = "parametric") -> pd.DataFrame:
    """Per module kind, the layers whose knockout raises the target's mean probability under
    *every* conflict type in the sweep (the paper counts 0 layers, 1 MLP, 6 attention modules
    of 26 on Gemma-2B)."""
    summary = result.summary if isinstance(result, SweepResult) else result
    if "ablation" in summary and summary.ablation.nunique() > 1:
        raise ValueError(
            f"The sweep mixes ablations {sorted(summary.ablation.unique())}; pass one, e.g. "
            "summary[summary.ablation == 'mean']."
        )
    summary = summary[summary.target == target]
    n_types = summary.conflict_type.nunique()
    gains = (
        summary.assign(gain=summary.delta_mean > 0)
        .groupby(["module", "layer"])["gain"]
        .agg(["sum", "size"])
        .reset_index()
    )
    consistent = gains[(gains["sum"] == n_types) & (gains["size"] == n_types)]
    rows = []
    for module in summary.module.unique():
        layers = sorted(consistent.loc[consistent.module == module, "layer"].tolist())
        rows.append(
            {
                "module": module,
                "n_consistent": len(layers),
                "n_layers": summary.loc[summary.module == module, "layer"].nunique(),
                "layers": layers,
                "conflict_types": [c for c in CONFLICT_TYPES if c in set(summary.conflict_type)],
            }
        )
    return pd.DataFrame(rows)
