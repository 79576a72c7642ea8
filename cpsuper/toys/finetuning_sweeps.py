"""Sweeps of the finetuning toy (:mod:`cpsuper.toys.finetuning`) over the pretraining
distribution and length: section 3 of "Understanding Finetuning for Factual Knowledge
Extraction" says the FT-Top minus FT-Bottom gap widens as the Zipf law of subject popularity
gets steeper and narrows with longer pretraining.

:func:`gap_run` trains one toy (FT-Top and FT-Bottom from one pretrained model) and reads the
gap two ways: at each run's best checkpoint (early stopping on held-out accuracy, as the
existing measurements do) and at the last checkpoint, where it also keeps each held-out
subject's accuracy for a paired interval over subjects. It also records how the pretrained
facts' salience follows their pretraining counts (Theorem 4.6). :func:`gap_sweep` repeats it
over values of one config field and seeds; :func:`gap_summary` gives intervals, and
:func:`percentile_gap` the final accuracies on the most popular held-out subjects (the paper's
accuracy-by-popularity figure).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from ..stats import bootstrap_ci, paired_bootstrap
from .common import last_position
from .finetuning import FinetuningConfig, FinetuningData, FinetuningToy
from .finetuning_salience import fact_salience, pretraining_counts, spearman

__all__ = ["gap_run", "gap_summary", "gap_sweep", "percentile_gap", "subject_accuracy"]


def subject_accuracy(model, data: FinetuningData) -> pd.Series:
    """Held-out QA accuracy per subject (mean over its relations), indexed by subject id."""
    tokens, labels, subj = data.examples(data.eval_subjects, "qa")
    with torch.no_grad():
        correct = (last_position(model, tokens)[0].argmax(-1) == labels).double()
    return pd.Series(correct.numpy()).groupby(subj.numpy()).mean()


def gap_run(config: FinetuningConfig | None = None) -> tuple[dict[str, float], pd.DataFrame]:
    """Train one toy with FT-Top and FT-Bottom; return ``(summary, per_subject)``.

    ``summary``: best and final held-out accuracy of each run (``top_best``, ``bottom_best``,
    ``top_final``, ``bottom_final``), the gaps ``gap_best`` / ``gap_final`` (Top minus Bottom),
    ``stored`` (share of all facts top-1 in ``(s, r)`` form after pretraining), and salience
    statistics of the pretrained model: ``salience_count_spearman`` (rank correlation of
    ``S(s, r, a)`` with the number of pretraining draws of ``(s, r)``, over all facts) and the
    median salience of the FT-Top and FT-Bottom facts. ``per_subject``: columns ``subject,
    top, bottom`` (final held-out accuracy of each subject under each run).
    """
    cfg = replace(config or FinetuningConfig(), splits=("top", "bottom"))
    toy = FinetuningToy(cfg).train()
    probes = toy.probes
    acc = probes[probes.measure == "acc_eval"]
    out: dict[str, float] = {}
    for split, run in (("top", "FT-Top"), ("bottom", "FT-Bottom")):
        series = acc[acc.run == run].set_index("step")["value"].sort_index()
        out[f"{split}_best"] = float(series.max())
        out[f"{split}_final"] = float(series.iloc[-1])
    out["gap_best"] = out["top_best"] - out["bottom_best"]
    out["gap_final"] = out["top_final"] - out["bottom_final"]
    stored = probes[(probes.run == "pretrain") & (probes.measure == "stored_all")]
    out["stored"] = float(stored.sort_values("step")["value"].iloc[-1])
    pretrained = toy.model_at("pretrain", cfg.pretrain_steps)
    salience = fact_salience(pretrained, toy.data)
    counts = pretraining_counts(toy.data, cfg)
    out["salience_count_spearman"] = spearman(salience.flatten().numpy(), counts.flatten().numpy())
    for split in ("top", "bottom"):
        out[f"salience_{split}_median"] = float(salience[toy.data.splits[split]].median())
    per_subject = pd.DataFrame(
        {
            split: subject_accuracy(toy.model_at(run, cfg.finetune_steps), toy.data)
            for split, run in (("top", "FT-Top"), ("bottom", "FT-Bottom"))
        }
    )
    return out, per_subject.rename_axis("subject").reset_index()


def gap_sweep(
    base: FinetuningConfig, field: str, values, seeds=(0, 1, 2), progress: bool = False
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """:func:`gap_run` for ``replace(base, **{field: value}, seed=seed)`` over every value and seed.

    Returns ``(runs, subjects)``: one row per (value, seed) with the summary columns, and one row
    per (value, seed, held-out subject) with its final accuracy under FT-Top and FT-Bottom.
    """
    if field not in FinetuningConfig.__dataclass_fields__:
        raise ValueError(f"{field!r} is not a FinetuningConfig field.")
    runs, subjects = [], []
    grid = [(v, s) for v in values for s in seeds]
    for value, seed in tqdm(grid, disable=not progress, desc=f"sweep {field}"):
        summary, per_subject = gap_run(replace(base, **{field: value}, seed=seed))
        runs.append({field: value, "seed": seed, **summary})
        subjects.append(per_subject.assign(**{field: value, "seed": seed}))
    return pd.DataFrame(runs), pd.concat(subjects, ignore_index=True)


def gap_summary(runs: pd.DataFrame, subjects: pd.DataFrame, field: str, *, n_boot: int = 2000) -> pd.DataFrame:
    """Per value of ``field``: the best-checkpoint gap (mean over seeds, bootstrap interval over
    seeds, and the smallest and largest seed), the final-checkpoint gap with a paired bootstrap
    interval over (seed, held-out subject) units, and the mean of the other summary columns."""
    rows = []
    for value, part in runs.groupby(field, sort=True):
        best = bootstrap_ci(part["gap_best"].to_numpy(), n_boot=n_boot)
        subs = subjects[subjects[field] == value]
        final = paired_bootstrap(subs["top"].to_numpy(), subs["bottom"].to_numpy(), n_boot=n_boot)
        row = {
            field: value,
            "n_seeds": len(part),
            "gap_best": best.mean,
            "gap_best_lo": best.ci_low,
            "gap_best_hi": best.ci_high,
            "gap_best_min": part["gap_best"].min(),
            "gap_best_max": part["gap_best"].max(),
            "gap_final": final.mean,
            "gap_final_lo": final.ci_low,
            "gap_final_hi": final.ci_high,
            "n_subjects": final.n,
        }
        for col in ("top_best", "bottom_best", "stored", "salience_count_spearman"):
            row[col] = part[col].mean()
        row["salience_ratio"] = (part["salience_top_median"] / part["salience_bottom_median"]).mean()
        rows.append(row)
    return pd.DataFrame(rows)


def percentile_gap(subjects: pd.DataFrame, fractions=(0.1, 0.25, 0.5, 1.0), *, n_boot: int = 2000) -> pd.DataFrame:
    """Final held-out accuracy of FT-Top and FT-Bottom on the most popular ``fraction`` of the
    held-out subjects, from :func:`gap_sweep`'s ``subjects`` frame. Subject ids are in popularity
    order, so within each run (each config value and seed) the ``ceil(fraction * n)`` smallest ids
    are its most popular held-out subjects. One row per fraction (and config value): the mean of
    each split, and the gap with a paired bootstrap interval over (seed, subject) units."""
    runs = [c for c in subjects.columns if c not in ("subject", "top", "bottom")]
    rows = []
    for fraction in fractions:
        if not 0 < fraction <= 1:
            raise ValueError(f"fractions must lie in (0, 1], got {fraction!r}.")
        rank = subjects.groupby(runs)["subject"].rank(method="first")
        size = subjects.groupby(runs)["subject"].transform("size")
        chosen = subjects[rank <= np.ceil(fraction * size)]
        keys = [c for c in runs if c != "seed"]
        for key, part in chosen.groupby(keys) if keys else [((), chosen)]:
            gap = paired_bootstrap(part["top"].to_numpy(), part["bottom"].to_numpy(), n_boot=n_boot)
            labels = dict(zip(keys, key if isinstance(key, tuple) else (key,)))
            rows.append(
                {
                    **labels,
                    "fraction": fraction,
                    "top": part["top"].mean(),
                    "bottom": part["bottom"].mean(),
                    "gap": gap.mean,
                    "gap_lo": gap.ci_low,
                    "gap_hi": gap.ci_high,
                    "n_units": gap.n,
                }
            )
    return pd.DataFrame(rows)
