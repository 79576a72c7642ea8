"""Probes of section 4 of "Understanding Finetuning for Factual Knowledge Extraction" on the
finetuning toy (:mod:`cpsuper.toys.finetuning`).

The paper's one-layer analysis names three quantities, all readable from the toy's weights:

* the *salience* of a fact ``(s, r, a)``: ``S = phi(a)^T W_V phi(s)``, how strongly the subject's
  value vector holds the answer (:func:`fact_salience`); Theorem 4.6 says it grows with the
  number of times ``(s, r)`` was seen in pretraining (:func:`pretraining_counts` replays the
  toy's seeded pretraining stream to count them);
* the *subject relevance* ``s_rel = (phi(a) - f)^T W_V phi(s)`` and the *prompt relevance*
  ``p_rel = (phi(a) - f)^T W_V phi(p_r)`` of a QA example ``(s, p_r) -> a``, where ``f`` is the
  model's output distribution; the gradient of the example's loss moves the score of ``p_r``
  against the score of ``s`` in proportion to ``-(s_rel - p_rel)`` (Theorem 4.5,
  :func:`relevance_terms`);
* the subject attention below which a stored fact is no longer the top answer, given the
  prompt token's value vector (Theorem 4.2's attention imbalance, :func:`erasure_thresholds`).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from ..backend import Model
from .common import last_position, toy_matrices
from .finetuning import FinetuningConfig, FinetuningData, pretraining_batch

__all__ = [
    "erasure_thresholds",
    "fact_salience",
    "imbalance_accuracy",
    "pretraining_counts",
    "relevance_terms",
    "salience_study",
    "spearman",
]


def fact_salience(model: Model, data: FinetuningData) -> Float[Tensor, "subject relation"]:
    """``S(s, r, a) = W_V[a, s]`` for every fact (one-hot embeddings, identity unembedding)."""
    _, w_v = toy_matrices(model)
    subjects = torch.arange(data.n_subjects)[:, None].expand_as(data.answer)
    return w_v[data.answer, subjects].double()


def pretraining_counts(data: FinetuningData, config: FinetuningConfig) -> Int[Tensor, "subject relation"]:
    """How often each ``(s, r)`` was drawn in :meth:`FinetuningToy.pretrain`'s stream (the same
    seeded generator and batches, replayed without training)."""
    gen = torch.Generator().manual_seed(config.seed + 1)
    counts = torch.zeros(data.n_subjects * data.n_relations, dtype=torch.long)
    for _ in range(config.pretrain_steps):
        tokens, _ = pretraining_batch(data, config.pretrain_batch, gen)
        flat = tokens[:, 0] * data.n_relations + (tokens[:, 1] - data.relation_tokens[0])
        counts += torch.bincount(flat, minlength=len(counts))
    return counts.reshape(data.n_subjects, data.n_relations)


def relevance_terms(model: Model, data: FinetuningData, subjects: Tensor) -> pd.DataFrame:
    """Per QA example ``(s, p_r) -> a`` of ``subjects``: ``s_rel``, ``p_rel``, their difference,
    the attention weights, and ``drive = -sigma_s sigma_p (s_rel - p_rel)``, the example's
    contribution to ``-dL/dW_KQ[p_r, p_r]`` (for the summed loss). Positive ``drive`` raises the
    score of ``p_r`` and so lowers attention to *every* subject asked with ``p_r``.

    Columns ``subject, relation, salience, s_rel, p_rel, diff, attn_subject, drive``.
    """
    _, w_v = toy_matrices(model)
    tokens, labels, subj = data.examples(subjects, "qa")
    with torch.no_grad():
        logits, pattern = last_position(model, tokens)
        residual = torch.nn.functional.one_hot(labels, data.vocab_size).to(logits) - logits.softmax(-1)
        v_s, v_p = w_v[:, tokens[:, 0]].T, w_v[:, tokens[:, 1]].T
        s_rel = (residual * v_s).sum(-1)
        p_rel = (residual * v_p).sum(-1)
    att_s, att_p = pattern[:, 0], pattern[:, 1]
    return pd.DataFrame(
        {
            "subject": subj.numpy(),
            "relation": (tokens[:, 1] - data.prompt_tokens[0]).numpy(),
            "salience": w_v[labels, tokens[:, 0]].numpy(),
            "s_rel": s_rel.numpy(),
            "p_rel": p_rel.numpy(),
            "diff": (s_rel - p_rel).numpy(),
            "attn_subject": att_s.numpy(),
            "drive": (-att_s * att_p * (s_rel - p_rel)).numpy(),
        }
    )


def erasure_thresholds(model: Model, data: FinetuningData, subjects: Tensor, reference: float = 0.5) -> pd.DataFrame:
    """For each QA fact of ``subjects``, with ``W_V`` as in ``model``: the range of subject
    attention ``a`` over which the answer is the argmax of ``a W_V phi(s) + (1 - a) W_V phi(p_r)``.

    The logit margin over each rival ``b`` is linear in ``a``, so the range is an interval
    ``(lower, upper)`` (empty when ``lower >= upper``). ``threshold`` is ``lower`` for the facts
    answered correctly at the ``reference`` attention (the paper's ``W_KQ = 0`` gives 1/2), ``NaN``
    for the others: pushing attention to the subject below it (Theorem 4.2's attention imbalance)
    erases the fact although ``W_V`` still holds it.

    Columns ``subject, relation, salience, lower, upper, threshold``.
    """
    _, w_v = toy_matrices(model)
    tokens, labels, subj = data.examples(subjects, "qa")
    v_s, v_p = w_v[:, tokens[:, 0]].T.double(), w_v[:, tokens[:, 1]].T.double()
    rows = torch.arange(len(labels))
    ds = v_s[rows, labels][:, None] - v_s  # the subject's margin over each rival
    dp = v_p[rows, labels][:, None] - v_p  # the prompt token's margin over each rival
    # margin(a) = dp + a (ds - dp) > 0 for every rival b != answer.
    slope = ds - dp
    cross = -dp / torch.where(slope == 0, torch.ones_like(slope), slope)
    rival = torch.ones_like(ds, dtype=torch.bool)
    rival[rows, labels] = False
    inf = torch.full_like(ds, float("inf"))
    lower_b = torch.where(rival & (slope > 0), cross, -inf)
    upper_b = torch.where(rival & (slope < 0), cross, inf)
    never = (rival & (slope == 0) & (dp <= 0)).any(-1)
    lower = lower_b.max(-1).values.clamp(min=0.0)
    upper = upper_b.min(-1).values.clamp(max=1.0)
    lower = torch.where(never, torch.ones_like(lower), lower)
    upper = torch.where(never, torch.zeros_like(upper), upper)
    at_ref = (lower < reference) & (reference < upper)
    return pd.DataFrame(
        {
            "subject": subj.numpy(),
            "relation": (tokens[:, 1] - data.prompt_tokens[0]).numpy(),
            "salience": w_v[labels, tokens[:, 0]].double().numpy(),
            "lower": lower.numpy(),
            "upper": upper.numpy(),
            "threshold": torch.where(at_ref, lower, torch.full_like(lower, float("nan"))).numpy(),
        }
    )


def imbalance_accuracy(
    model: Model, data: FinetuningData, subjects: Tensor, attention: Float[np.ndarray, " k"]
) -> pd.DataFrame:
    """QA accuracy of ``subjects``' facts when attention to the subject is forced to each value in
    ``attention`` (``W_V`` kept as in ``model``; the scores are overridden through the head's
    ``hook_pattern``, so this runs the model itself). Columns ``attention, accuracy``."""
    tokens, labels, _ = data.examples(subjects, "qa")
    out = []
    for a in np.asarray(attention, dtype=float):

        def force(pattern, hook, a=a):
            pattern = pattern.clone()
            pattern[:, :, -1, 0], pattern[:, :, -1, 1] = a, 1 - a
            return pattern

        with torch.no_grad():
            logits = model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_pattern", force)])[:, -1]
        out.append((a, (logits.argmax(-1) == labels).double().mean().item()))
    return pd.DataFrame(out, columns=["attention", "accuracy"])


def spearman(x, y) -> float:
    """Rank correlation of two 1-D arrays (average ranks for ties; Pearson on the ranks)."""
    return float(pd.Series(np.asarray(x)).rank().corr(pd.Series(np.asarray(y)).rank()))


def salience_study(
    toy, steps: tuple[int, ...] = (0, 20, 40, 100, 200), attention: tuple[float, ...] = (1.0, 0.5, 0.2, 0.1, 0.05, 0.0)
) -> dict[str, pd.DataFrame]:
    """The three section-4 probes on a trained :class:`~cpsuper.toys.finetuning.FinetuningToy`
    (with FT-Top and FT-Bottom runs). Returns three tables:

    * ``"frequency"`` (Theorem 4.6): the pretrained facts grouped by how often ``(s, r)`` was
      drawn (quartile bins of the counts): count range, median salience, number of facts, and
      the rank correlation over all facts in ``attrs["spearman"]``;
    * ``"relevance"`` (Theorem 4.5): per run and checkpoint step, over the run's own finetuning
      examples, the share with ``s_rel - p_rel > 0``, the mean ``drive`` (positive: the step pushes
      attention away from every subject), the rank correlation of ``s_rel - p_rel`` with salience,
      and the measured attention to held-out subjects;
    * ``"erasure"`` (Theorem 4.2): per run, with its final ``W_V``, the rank correlation of the
      held-out facts' erasure threshold with their salience (facts correct at attention 1/2), the
      median threshold, the share of facts correct at 1/2, and the held-out QA accuracy when
      attention to the subject is forced to each value in ``attention`` (columns ``acc@a``).
    """
    data, cfg = toy.data, toy.config
    pre = toy.model_at("pretrain", cfg.pretrain_steps)
    sal, counts = fact_salience(pre, data).flatten().numpy(), pretraining_counts(data, cfg).flatten().numpy()
    bins = pd.qcut(pd.Series(counts), 4, duplicates="drop")
    freq = (
        pd.DataFrame({"bin": bins, "count": counts, "salience": sal})
        .groupby("bin", observed=True)
        .agg(
            count_min=("count", "min"),
            count_max=("count", "max"),
            salience=("salience", "median"),
            facts=("salience", "size"),
        )
        .reset_index(drop=True)
    )
    freq.attrs["spearman"] = spearman(sal, counts)
    rel_rows, er_rows = [], []
    for split, run in (("top", "FT-Top"), ("bottom", "FT-Bottom")):
        probes = toy.runs[run].probes
        attn = probes[probes.measure == "attn_subject_eval"].set_index("step")["value"]
        for step in steps:
            t = relevance_terms(toy.model_at(run, step), data, data.splits[split])
            rel_rows.append(
                {
                    "run": run,
                    "step": step,
                    "share_positive": float((t["diff"] > 0).mean()),
                    "mean_drive": float(t["drive"].mean()),
                    "diff_salience_spearman": spearman(t["diff"], t["salience"]),
                    "attn_subject_eval": float(attn.loc[step]),
                }
            )
        final = toy.model_at(run, cfg.finetune_steps)
        th = erasure_thresholds(final, data, data.eval_subjects)
        ok = th.dropna()
        row = {
            "run": run,
            "correct_at_half": len(ok) / len(th),
            "threshold_median": float(ok["threshold"].median()),
            "threshold_salience_spearman": spearman(ok["threshold"], ok["salience"]),
        }
        acc = imbalance_accuracy(final, data, data.eval_subjects, np.asarray(attention))
        row.update({f"acc@{a:g}": v for a, v in zip(acc["attention"], acc["accuracy"])})
        er_rows.append(row)
    return {"frequency": freq, "relevance": pd.DataFrame(rel_rows), "erasure": pd.DataFrame(er_rows)}
