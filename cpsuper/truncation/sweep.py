"""Truncation sweeps: candidate-answer probabilities for every layer x rho, on the sweep engine."""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from ..backend import Model
from ..batch_sizes import rows_that_fit
from ..data.examples import ConflictDataset
from ..edits import WeightEdit
from ..engine import run_conditions
from ..runtime import answer_token, check_dataset, check_layer, resolve_conflict_types, tokenize_prompts
from ..stats import bootstrap_summary
from .edits import (
    DEFAULT_RHOS,
    Truncation,
    canonical_matrix,
    check_overlaps,
    check_rho,
    drop_mlp,
    is_identity,
    reference_dim,
    truncate,
    truncation_matrices,
    truncation_rank,
)

__all__ = ["TruncationResult", "truncation_sweep"]


# ---------------------------------------------------------------------------------------------
# The sweep


@dataclass
class TruncationResult:
    """What :func:`truncation_sweep` returns.

    - ``per_example``: one row per prompt x setting x candidate: ``example``, (``relation``,
      ``subject``, ``conflict_type`` | ``prompt``), ``edit`` (``"truncate"`` or ``"drop"``),
      ``matrix``, ``layer``, ``rho``, ``rank`` (NaN for drops), ``candidate``, ``token``, ``p``
      (probability under the setting) and ``p_clean`` (unedited model);
    - ``summary``: per setting x conflict type x candidate, the mean and spread of ``p`` and the
      mean ``p_clean``;
    - ``ratios``: per setting x conflict type, ``p(num) / p(den)`` for the ``ratio`` pair (by
      default correct / generic) as a ratio of means, a mean of ratios, and the mean log ratio,
      each also for the unedited model (``*_clean``). Empty when the pair is not among the candidates.
    """

    per_example: pd.DataFrame
    summary: pd.DataFrame
    ratios: pd.DataFrame

    def intervals(self, value: str = "delta", *, n_boot: int = 2000, ci: float = 0.95, seed: int = 0) -> pd.DataFrame:
        """Mean ``value`` per setting x conflict type x candidate with a percentile bootstrap
        interval over examples (``mean, ci_low, ci_high, n``).

        ``value``: ``"p"`` (probability under the setting), ``"p_clean"`` or ``"delta"``
        (``p - p_clean``: each example is its own control, so the interval is a paired one).
        See :func:`cpsuper.stats.bootstrap_summary`.
        """
        if value not in ("p", "p_clean", "delta"):
            raise ValueError(f"value must be 'p', 'p_clean' or 'delta', got {value!r}.")
        per = self.per_example.assign(delta=self.per_example["p"] - self.per_example["p_clean"])
        by = [c for c in self.summary.columns if c in per.columns and c not in ("p", "p_clean")]
        out = bootstrap_summary(per, value=value, by=by, unit="example", n_boot=n_boot, ci=ci, seed=seed)
        # Back into the sweep's own setting order (grouping sorts it).
        order = self.summary[by].drop_duplicates()
        return order.merge(out, on=by, how="left").reset_index(drop=True)

    def _repr_html_(self) -> str:
        return (self.ratios if len(self.ratios) else self.summary)._repr_html_()

    def __repr__(self) -> str:
        shown = self.ratios if len(self.ratios) else self.summary
        return f"TruncationResult({len(self.per_example)} per-example rows)\n{shown!r}"


def _items_from_dataset(model, dataset: ConflictDataset, conflict_types, generic, extra):
    conflict_types = resolve_conflict_types(dataset, conflict_types)
    check_dataset(model, dataset, conflict_types=conflict_types)
    prompts, meta, answers = [], [], []
    for conflict_type in conflict_types:
        for i, example in enumerate(dataset):
            prompts.append(example.prompts[conflict_type])
            meta.append(
                {"example": i, "relation": example.relation, "subject": example.subject, "conflict_type": conflict_type}
            )
            roles = {
                "correct": example.answer if conflict_type == "clean" else example.context_answer,
                "parametric": example.answer,
                "context": example.context_answer,
            }
            if generic is not None:
                roles["generic"] = generic
            for label, value in extra.items():
                roles[label] = value if isinstance(value, str) else value[i]
            answers.append(roles)
    return prompts, meta, answers


def _items_from_prompts(prompts: Sequence[str], candidates, generic):
    if not candidates:
        raise ValueError(
            "Plain prompts need candidates: the answers to read, e.g. "
            "candidates={'correct': ' Spain'} (with generic=' the' added) or a per-prompt list of answers."
        )
    if isinstance(candidates, Mapping):
        labelled = dict(candidates)
    elif isinstance(candidates, str):
        labelled = {candidates.strip(): candidates}
    else:
        labelled = {str(c).strip(): c for c in candidates}
    if generic is not None and "generic" not in labelled:
        labelled["generic"] = generic
    for label, value in labelled.items():
        if not isinstance(value, str) and len(value) != len(prompts):
            raise ValueError(
                f"Candidate {label!r} has {len(value)} answers for {len(prompts)} prompts; give one string "
                "(the same answer for every prompt) or one answer per prompt."
            )
    meta = [{"example": i, "prompt": p} for i, p in enumerate(prompts)]
    answers = [{lab: (v if isinstance(v, str) else v[i]) for lab, v in labelled.items()} for i in range(len(prompts))]
    return list(prompts), meta, answers


def _settings(model, layers, rhos, which, drop) -> tuple[list[dict], list]:
    """One dict of labels and one list of edits (or ``"drop"``) per setting."""
    matrices = [which] if isinstance(which, str) else list(which)
    if not matrices:
        raise ValueError(f"which names no matrix; use one or more of {truncation_matrices(model)}.")
    matrices = [canonical_matrix(model, m) for m in matrices]
    if isinstance(rhos, numbers.Real):
        rhos = [rhos]
    rhos = [check_rho(r) for r in rhos]
    if not rhos:
        raise ValueError("rhos is empty; give at least one fraction in [0, 1].")
    label = "+".join(matrices)
    labels, conditions = [], []
    for layer in layers:
        for rho in rhos:
            edits = [Truncation(layer, m, rho) for m in matrices]
            check_overlaps(edits)
            rank = truncation_rank(rho, reference_dim(model, matrices[0]))
            labels.append({"edit": "truncate", "matrix": label, "layer": layer, "rho": rho, "rank": rank})
            conditions.append(edits)
        if drop:
            labels.append({"edit": "drop", "matrix": "mlp", "layer": layer, "rho": np.nan, "rank": np.nan})
            conditions.append("drop")
    return labels, conditions


def truncation_sweep(
    model: Model,
    dataset: ConflictDataset | str | Sequence[str],
    layers: int | Sequence[int] | None = None,
    *,
    rhos: float | Sequence[float] = DEFAULT_RHOS,
    which: str | Sequence[str] = "mlp_in",
    candidates: Mapping[str, str | Sequence[str]] | Sequence[str] | None = None,
    generic: str | None = " the",
    conflict_types: Sequence[str] | None = None,
    drop: bool = True,
    ratio: tuple[str, str] = ("correct", "generic"),
    batch_size: int | str = 32,
    progress: bool = True,
) -> TruncationResult:
    """Probabilities of candidate answers at the final position, for every layer x rho.

    ``dataset``: a :class:`~cpsuper.ConflictDataset` (every example x conflict type) or plain
    prompts. Candidates read for a dataset: ``correct`` (the true answer on clean prompts, the
    context's answer on substitution / coherent prompts: the answer the prompt's own context
    supports), ``parametric``, ``context`` and ``generic`` (``" the"``), plus any extra
    ``candidates`` (label -> answer, or per-example answers). For plain prompts, ``candidates``
    is required: a mapping label -> answer string (or one answer per prompt), or a list of
    answer strings (labelled by themselves); ``generic`` is added unless it is ``None``. An
    answer's first token, as it continues the prompt, is what is read.

    ``which``: the matrix to truncate (see :data:`MATRICES`), or several truncated together
    (``("mlp_in", "mlp_gate")``). ``drop`` adds one setting per layer that zeroes the whole MLP
    (:func:`drop_mlp`). ``layers`` default to all.

    Each prompt batch runs once unedited; every setting resumes from its layer's residual stream
    (the layers before it are unchanged), and each matrix is factorized once for all rhos.
    """
    n_layers = model.cfg.n_layers
    if layers is None:
        layers = list(range(n_layers))
    elif isinstance(layers, numbers.Integral):
        layers = [layers]
    layers = [check_layer(model, layer) for layer in layers]
    if not layers:
        raise ValueError(f"layers is empty; give layers in 0..{n_layers - 1} (or None for all).")
    if drop and "mlp_out" not in truncation_matrices(model):
        raise ValueError("drop=True needs MLP blocks, which this model lacks; pass drop=False.")
    labels, conditions = _settings(model, layers, rhos, which, drop)

    data = dataset
    if isinstance(data, ConflictDataset):
        extra = {} if candidates is None else dict(candidates) if isinstance(candidates, Mapping) else None
        if extra is None:
            raise ValueError("For a dataset, extra candidates are a mapping label -> answer (or per-example answers).")
        for label, value in extra.items():
            if not isinstance(value, str) and len(value) != len(data):
                raise ValueError(f"Candidate {label!r} has {len(value)} answers for {len(data)} examples.")
        prompts, meta, answers = _items_from_dataset(model, data, conflict_types, generic, extra)
    else:
        if isinstance(data, str):
            data = [data]
        if conflict_types is not None:
            raise ValueError("conflict_types applies to a ConflictDataset, not to plain prompts.")
        prompts, meta, answers = _items_from_prompts(list(data), candidates, generic)
    token_lists = tokenize_prompts(model, prompts)
    cand_labels = list(answers[0])
    ids = torch.tensor([[answer_token(model, a[lab], p) for lab in cand_labels] for a, p in zip(answers, prompts)])

    # Every setting is a weight edit on the one sweep engine: each prompt batch runs once
    # unedited, and every setting resumes from its layer's residual stream. Each matrix is
    # factorized once for all rhos (svd_cache).
    svd_cache: dict = {}
    edits = [
        WeightEdit(label["layer"], lambda m, layer=label["layer"]: drop_mlp(m, layer))
        if condition == "drop"
        else WeightEdit(
            label["layer"],
            lambda m, c=condition: truncate(m, c, svd_cache),
            identity=all(is_identity(model, edit) for edit in condition),
        )
        for label, condition in zip(labels, conditions)
    ]
    p_clean, p_edit = run_conditions(
        model,
        token_lists,
        ids,
        [[e] for e in edits],
        # each weight edit runs whole prompt batches: "auto" fits the prompts per batch to memory
        prompt_batch_size=rows_that_fit(model, max(map(len, token_lists))) if batch_size == "auto" else batch_size,
        progress=progress,
        desc="truncation",
    )
    return _frames(model, meta, answers, prompts, ids, cand_labels, labels, p_clean, p_edit, ratio)


def _frames(model, meta, answers, prompts, ids, cand_labels, labels, p_clean, p_edit, ratio) -> TruncationResult:
    n_items, n_cond, n_cand = p_edit.shape
    item = pd.DataFrame(meta)
    setting = pd.DataFrame(labels)
    setting["rank"] = setting["rank"].astype("Int64")
    grid = pd.DataFrame(
        {
            "item": np.repeat(np.arange(n_items), n_cond * n_cand),
            "setting": np.tile(np.repeat(np.arange(n_cond), n_cand), n_items),
            "cand": np.tile(np.arange(n_cand), n_items * n_cond),
            "p": p_edit.reshape(-1).numpy().astype(float),
        }
    )
    grid["p_clean"] = p_clean.numpy().astype(float)[grid["item"], grid["cand"]]
    grid["candidate"] = np.array(cand_labels, dtype=object)[grid["cand"]]
    decoded = {t: model.tokenizer.decode([t]) for t in ids.unique().tolist()}
    grid["token"] = [decoded[t] for t in ids.numpy()[grid["item"], grid["cand"]]]
    per = pd.concat(
        [
            item.iloc[grid["item"]].reset_index(drop=True),
            setting.iloc[grid["setting"]].reset_index(drop=True),
            grid[["candidate", "token", "p", "p_clean"]],
        ],
        axis=1,
    )
    keys = [*setting.columns, *(["conflict_type"] if "conflict_type" in item else [])]
    summary = (
        per.groupby([*keys, "candidate"], sort=False, dropna=False)
        .agg(n=("p", "size"), p_mean=("p", "mean"), p_std=("p", "std"), p_clean_mean=("p_clean", "mean"))
        .reset_index()
    )
    summary["delta_mean"] = summary["p_mean"] - summary["p_clean_mean"]
    ratios = pd.DataFrame()
    if set(ratio) <= set(cand_labels):
        # Back into the sweep's own order (pivoting sorts the settings).
        order = summary[keys].drop_duplicates()
        ratios = order.merge(_ratios(per, keys, ratio), on=keys, how="left")
        ratios.attrs["ratio"] = ratio
    return TruncationResult(per, summary, ratios)


def _ratios(per: pd.DataFrame, keys: list[str], ratio: tuple[str, str]) -> pd.DataFrame:
    num, den = ratio
    index = [c for c in per.columns if c not in ("candidate", "token", "p", "p_clean")]
    wide = per.pivot_table(index=index, columns="candidate", values=["p", "p_clean"], dropna=False).reset_index()
    wide = wide.dropna(subset=[("p", num)])
    out = []
    for suffix, col in (("", "p"), ("_clean", "p_clean")):
        a, b = wide[(col, num)].to_numpy(), wide[(col, den)].to_numpy()
        frame = pd.DataFrame({k: wide[(k, "")] for k in keys})
        frame["a"], frame["b"], frame["r"], frame["lr"] = a, b, a / b, np.log(a) - np.log(b)
        agg = frame.groupby(keys, sort=False, dropna=False).agg(
            n=("a", "size"),
            num=("a", "mean"),
            den=("b", "mean"),
            mean_of_ratios=("r", "mean"),
            mean_log_ratio=("lr", "mean"),
        )
        agg["ratio_of_means"] = agg["num"] / agg["den"]
        agg["log_ratio_of_means"] = np.log(agg["ratio_of_means"])
        agg = agg.rename(columns={"num": f"p_{num}", "den": f"p_{den}"})
        if suffix:
            agg = agg.drop(columns="n")
        out.append(agg.add_suffix(suffix))
    result = pd.concat(out, axis=1).reset_index()
    result.attrs["ratio"] = ratio
    return result
