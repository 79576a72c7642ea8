"""Proposition 2 of "Context-Parametric Inversion" on the inversion toy: adding memorized
subject-only (S) points ``[s, r] -> a`` to the finetuning data pushes attention toward the subject.

The proposition is about the first gradient step: with S points added, the projection of
``-dL/dW_KQ`` on ``theta_S`` (the direction all subjects share, read at the query ``r``) is larger
than without them, and the projection on ``theta_C`` is unchanged, because an S point has no
context token. :func:`kq_gradient_projections` measures both projections per kind of example;
:func:`train_with_subject_points` trains with them and records whether attention to the subject
on the counterfactual test prompts ends up higher.

Two choices are ours. The paper's S points let ``r`` attend to itself (its proof carries a factor
``sigma_s sigma_r``); the toy masks ``r`` as a key for ``[c, s, r]`` prompts (Assumption 5), so
for the two-token S prompts the ``r``-to-``r`` score is set to 0 instead (attention 1/2 each at
the start). And each S point is added to the summed loss with the weight of one old example
(the loss is divided by the number of C and C+S examples), so adding points never reweights the
old ones, as in the proposition's sum over the dataset.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from jaxtyping import Int
from torch import Tensor

from ..backend import Model
from .inversion import KINDS, InversionConfig, InversionData, InversionToy, inversion_measures, make_inversion_data

__all__ = [
    "SubjectPoints",
    "add_subject_points",
    "kq_gradient_projections",
    "subject_point_logits",
    "train_with_subject_points",
]

SCORES_HOOK = "blocks.0.attn.hook_attn_scores"


@dataclass(frozen=True, eq=False)
class SubjectPoints:
    """The toy's data with ``n`` memorized subject-only points added.

    ``data`` is :func:`make_inversion_data`'s output whose readout also memorizes each S
    subject's answer (at the ``delta_M`` level of the C+S and test subjects); ``tokens`` rows are
    ``[s, r]`` and ``labels`` the memorized answers. Subjects and answers are ones no other
    example uses.
    """

    data: InversionData
    tokens: Int[Tensor, "n 2"]
    labels: Int[Tensor, " n"]


def add_subject_points(config: InversionConfig, n_points: int) -> SubjectPoints:
    """Draw ``n_points`` unused subjects and answers (seeded) and memorize each pair."""
    data = make_inversion_data(config)
    k_s = config.n_subjects
    used_s = set(data.train_tokens[:, 1].tolist()) | set(data.test_tokens[:, 1].tolist())
    used_a = set(data.train_tokens[:, 0].tolist()) | set(data.test_tokens[:, 0].tolist())
    used_a |= set(data.test_param_answer.tolist())
    free_s = [s for s in range(k_s) if s not in used_s]
    free_a = [a for a in range(k_s, k_s + config.n_answers) if a not in used_a]
    if n_points > min(len(free_s), len(free_a)):
        raise ValueError(
            f"Only {len(free_s)} unused subjects and {len(free_a)} unused answers for {n_points} S points; "
            "raise n_subjects / n_answers."
        )
    rng = np.random.default_rng(config.seed + 1)
    subjects = torch.tensor(rng.permutation(free_s)[:n_points], dtype=torch.long)
    answers = torch.tensor(rng.permutation(free_a)[:n_points], dtype=torch.long)
    readout = data.readout.clone()
    # The memorized-subject readout the test subjects already carry (delta_M).
    v_memory = data.readout[data.test_param_answer[0], data.test_tokens[0, 1]]
    readout[answers, subjects] = v_memory
    tokens = torch.stack([subjects, torch.full_like(subjects, data.relation)], dim=1)
    return SubjectPoints(replace(data, readout=readout), tokens.reshape(-1, 2), answers)


def _unmask_self(scores, hook):
    scores = scores.clone()
    scores[:, :, -1, -1] = 0.0  # r attends to itself in an S prompt (score 0, not the -1e4 mask)
    return scores


def subject_point_logits(model: Model, tokens: Tensor) -> tuple[Tensor, Tensor]:
    """Final-position logits and attention pattern of S prompts ``[s, r]`` (``r`` unmasked)."""
    store = {}

    def keep(pattern, hook):
        store["pattern"] = pattern[:, 0, -1, :]

    logits = model.run_with_hooks(tokens, fwd_hooks=[(SCORES_HOOK, _unmask_self), ("blocks.0.attn.hook_pattern", keep)])
    return logits[:, -1, :], store["pattern"]


def _shifted_loss(
    model: Model, data: InversionData, tokens: Tensor, labels: Tensor, eps: Tensor, theta: Tensor, s_points: bool
):
    """Summed loss with ``eps * theta phi(r)^T`` added to ``W_KQ``: the final query's score for key
    ``y`` moves by ``eps * theta . phi(y)`` (``theta . phi(r) = 0``)."""
    shift = (data.embed[tokens] @ theta).float()  # [batch, pos]

    def add(scores, hook):
        scores = scores.clone()
        scores[:, 0, -1, :] = scores[:, 0, -1, :] + eps * shift
        return scores

    hooks = ([(SCORES_HOOK, _unmask_self)] if s_points else []) + [(SCORES_HOOK, add)]
    logits = model.run_with_hooks(tokens, fwd_hooks=hooks)[:, -1, :]
    return F.cross_entropy(logits, labels, reduction="sum")


def kq_gradient_projections(model: Model, points: SubjectPoints) -> pd.DataFrame:
    """``theta^T [-dL/dW_KQ] phi(r)`` for ``theta_S`` and ``theta_C``, with ``L`` the summed loss of
    each kind of example (C, C+S, S), computed exactly as a derivative along ``theta phi(r)^T``.

    Rows ``kind, theta_S, theta_C``; add rows to get a dataset's projection (D_old = C + C+S,
    D_new = D_old + S).
    """
    data = points.data
    groups = {kind: (data.train_tokens[data.train_mask((kind,))], None) for kind in KINDS}
    groups["S"] = (points.tokens, points.labels)
    rows = []
    for kind, (tokens, labels) in groups.items():
        if labels is None:
            labels = tokens[:, 0]
        out = {"kind": kind}
        for name, theta in (("theta_S", data.theta_subject), ("theta_C", data.theta_context)):
            eps = torch.zeros((), requires_grad=True)
            if len(tokens):
                loss = _shifted_loss(model, data, tokens, labels, eps, theta, s_points=kind == "S")
                out[name] = -torch.autograd.grad(loss, eps)[0].item()
            else:
                out[name] = 0.0
        rows.append(out)
    return pd.DataFrame(rows)


def train_with_subject_points(config: InversionConfig, n_points: int, *, steps: int | None = None) -> pd.DataFrame:
    """Full-batch gradient descent on ``W_KQ`` over the C and C+S examples plus ``n_points`` S
    points (learning rate ``config.lr``; loss summed and divided by the number of C and C+S
    examples). With ``n_points=0`` this is :meth:`InversionToy.train`'s run.

    Returns the tidy probes ``run, step, measure, value`` at every step: :func:`inversion_measures`
    (``M_C``, ``attn_subject`` on the counterfactual test prompts, ...) plus ``loss_S`` and
    ``attn_subject_S`` on the S points (when there are any). ``run`` is ``"+{n} S"``.
    """
    points = add_subject_points(config, n_points)
    toy = InversionToy(config)
    toy.data = points.data
    torch.manual_seed(config.seed)
    model = toy.pretrained_model().train()
    kinds = ("C",) if config.drop_context_subject else KINDS
    mask = points.data.train_mask(kinds)
    tokens, labels = points.data.train_tokens[mask], points.data.train_tokens[mask, 0]
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=config.lr)
    run, rows = f"+{n_points} S", []
    for step in range((config.steps if steps is None else steps) + 1):
        measures = inversion_measures(model, points.data)
        if n_points:
            with torch.no_grad():
                s_logits, s_pattern = subject_point_logits(model, points.tokens)
            measures["loss_S"] = F.cross_entropy(s_logits, points.labels).item()
            measures["attn_subject_S"] = s_pattern[:, 0].mean().item()
        rows += [{"run": run, "step": step, "measure": k, "value": v} for k, v in measures.items()]
        if step == (config.steps if steps is None else steps):
            break
        opt.zero_grad()
        loss = F.cross_entropy(model(tokens)[:, -1, :], labels, reduction="sum")
        if n_points:
            loss = loss + F.cross_entropy(subject_point_logits(model, points.tokens)[0], points.labels, reduction="sum")
        (loss / len(tokens)).backward()
        opt.step()
    return pd.DataFrame(rows)
