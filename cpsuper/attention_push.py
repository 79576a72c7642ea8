"""Which way one finetuning step pushes the last token's attention: the loss gradient on the
pre-softmax attention scores, split into the subject's tokens, the other prompt tokens and BOS.

Ghosal, Hashimoto and Raghunathan (Theorem 4.5) show for a one-layer model that a QA example
``(s, r) -> a`` raises the subject's attention score against the relation's when its *subject
relevance* ``s_rel`` beats its *relation relevance* ``p_rel``, and lowers it otherwise; the toy
version is :func:`cpsuper.toys.finetuning_salience.relevance_terms`. The step rests on the
softmax identity, which holds in any attention head of any model: with ``a_j`` the last query's
attention weights, ``v_j`` the values it reads and ``g = dL/dz`` the loss gradient on the head's
output at that position,

    -dL/ds_j = a_j (rel_j - sum_k a_k rel_k),    rel_j = -g . v_j,

so the push on a group of keys is its attention mass times its attention-weighted relevance
minus the head's mean relevance. :func:`attention_score_gradients` reads ``-dL/ds`` by autograd
at ``hook_attn_scores`` and the relevance terms from ``hook_v`` and ``hook_z``, per example, layer
and query head (a grouped-query head reads its group's key/value head), and records how far the
two sides of the identity are apart.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from .backend import Model, is_bridge, saving_hooks
from .interrupts import hooked
from .runtime import answer_token, check_layers, check_model, tokenize_prompts

__all__ = ["GROUPS", "attention_score_gradients", "group_of", "sign_agreement"]

GROUPS: tuple[str, ...] = ("subject", "relation", "bos")
"""The key groups of a prompt: the subject's tokens, every other non-BOS token (the relation's
words and the final token itself, which the last query also attends to) and BOS."""


def group_of(label: str) -> str:
    """The group of a token labelled ``label`` (a :data:`cpsuper.spans.SPAN_GROUPS` name):
    ``subject`` and ``bos`` stay, everything else is ``relation``."""
    return label if label in ("subject", "bos") else "relation"


def _wide(x: Tensor) -> Tensor:
    """``x`` in float32, or float64 when it already is (bf16 / fp16 gradients are too coarse)."""
    return x if x.dtype == torch.float64 else x.float()


def _per_head(v: Float[Tensor, "pos kv d_head"], n_heads: int) -> Float[Tensor, "head pos d_head"]:
    """Values per query head: query head ``h`` of a grouped-query layer reads key/value head
    ``h // (n_heads / n_kv)`` (TransformerLens's ``repeat_interleave`` order)."""
    return v.repeat_interleave(n_heads // v.shape[1], dim=1).transpose(0, 1)


def _leaf(x: Tensor, hook) -> Tensor:
    """A fresh leaf that requires grad, so that the graph exists even when the weights are frozen."""
    return x.detach().requires_grad_(True)


def _layer_terms(
    grad_scores: Float[Tensor, "head key"],
    pattern: Float[Tensor, "head key"],
    v: Float[Tensor, "head key d_head"],
    grad_z: Float[Tensor, "head d_head"],
    masks: dict[str, Tensor],
) -> dict[str, np.ndarray]:
    """The identity's terms for one layer's heads at the last query (see the module docstring)."""
    push = -grad_scores
    rel = -(v * grad_z[:, None, :]).sum(-1)  # [head, key]
    mean_rel = (pattern * rel).sum(-1, keepdim=True)
    identity = pattern * (rel - mean_rel)
    # First-order change of each group's attention mass if the scores moved by ``push``.
    step = pattern * (push - (pattern * push).sum(-1, keepdim=True))
    out = {"rel_mean": mean_rel[:, 0], "identity_err": (push - identity).abs().amax(-1)}
    for name, mask in masks.items():
        attn = (pattern * mask).sum(-1)
        out[f"attn_{name}"] = attn
        out[f"push_{name}"] = (push * mask).sum(-1)
        out[f"rel_{name}"] = torch.where(
            mask.any(), (pattern * rel * mask).sum(-1) / attn, torch.full_like(attn, float("nan"))
        )
        out[f"attn_step_{name}"] = (step * mask).sum(-1)
    return {key: value.detach().double().cpu().numpy() for key, value in out.items()}


def attention_score_gradients(
    model: Model,
    prompts: Sequence[str],
    answers: Sequence[str],
    *,
    spans: Sequence[Sequence[str]],
    layers: Sequence[int] | None = None,
) -> pd.DataFrame:
    """Per example x layer x query head: the push of the finetuning loss (cross-entropy of the
    answer's first token at the last position) on the last query's attention scores, per key group.

    ``spans`` gives each prompt's token labels, BOS included (e.g.
    :func:`cpsuper.spans.find_spans`); :func:`group_of` maps them to :data:`GROUPS`. Columns:
    ``example, layer, head, loss``; per group ``g``: ``attn_g`` (attention mass), ``push_g``
    (``-dL/ds`` summed over the group: positive means a gradient step raises the group's scores),
    ``rel_g`` (attention-weighted mean relevance ``-dL/dz . v_j``, the analogue of ``s_rel`` /
    ``p_rel``; NaN for an empty group), ``attn_step_g`` (first-order change of ``attn_g`` if the
    scores moved by the push); ``rel_mean`` (the head's mean relevance) and ``identity_err`` (the
    largest absolute gap between ``-dL/ds_j`` and ``a_j (rel_j - rel_mean)`` over the keys).

    The model's weights are not changed and their ``.grad`` is not touched; hooks are removed
    also when an exception is raised.
    """
    check_model(model)
    if is_bridge(model):  # its hook points hand out copies that the rest of the forward does not use
        raise ValueError(
            "attention_score_gradients needs gradients at hook points, which the TransformerBridge does not give; "
            "load the model with backend='hooked'."
        )
    if not len(prompts) == len(answers) == len(spans):
        raise ValueError(f"Got {len(prompts)} prompts, {len(answers)} answers and {len(spans)} span lists.")
    layers = check_layers(model, layers)
    n_heads = model.cfg.n_heads
    names = [f"blocks.{layer}.attn.hook_{kind}" for layer in layers for kind in ("attn_scores", "pattern", "v", "z")]
    rows = []
    for example, (prompt, answer, labels) in enumerate(zip(prompts, answers, spans, strict=True)):
        tokens = tokenize_prompts(model, [prompt])[0]
        if len(labels) != len(tokens):
            raise ValueError(f"Example {example}: {len(labels)} span labels for {len(tokens)} tokens.")
        target = answer_token(model, answer, prompt)
        store: dict[str, Tensor] = {}
        groups = [group_of(label) for label in labels]
        with torch.enable_grad(), hooked(model, [("hook_embed", _leaf), *saving_hooks(names, store)]):
            logits = model(torch.tensor([tokens], device=model.cfg.device))
            loss = torch.nn.functional.cross_entropy(_wide(logits[0, -1]), torch.tensor(target, device=logits.device))
            wrt = [store[f"blocks.{layer}.attn.hook_{kind}"] for layer in layers for kind in ("attn_scores", "z")]
            grads = torch.autograd.grad(loss, wrt)
        dtype = _wide(grads[0]).dtype
        masks = {g: torch.tensor([x == g for x in groups], device=grads[0].device, dtype=dtype) for g in GROUPS}
        for i, layer in enumerate(layers):
            terms = _layer_terms(
                _wide(grads[2 * i][0, :, -1]),
                _wide(store[f"blocks.{layer}.attn.hook_pattern"][0, :, -1]),
                _per_head(_wide(store[f"blocks.{layer}.attn.hook_v"][0]), n_heads),
                _wide(grads[2 * i + 1][0, -1]),
                masks,
            )
            rows.append(pd.DataFrame({"example": example, "layer": layer, "head": np.arange(n_heads), **terms}))
            rows[-1]["loss"] = loss.item()
    return pd.concat(rows, ignore_index=True)


def sign_agreement(frame: pd.DataFrame, *, predictor: str = "paper") -> pd.Series:
    """Per row of :func:`attention_score_gradients`: whether the sign of the subject's push is
    the sign ``predictor`` gives (rows with an exactly zero push or predictor are NaN).

    ``"paper"``: ``rel_subject - rel_relation``, the theorem's ``s_rel - p_rel`` (exact only when
    nothing but the subject and the relation is attended); ``"exact"``: ``rel_subject - rel_mean``,
    which the identity makes always right (BOS included in the mean).
    """
    other = {"paper": "rel_relation", "exact": "rel_mean"}
    if predictor not in other:
        raise ValueError(f"Unknown predictor {predictor!r}; use one of {sorted(other)}.")
    pred = np.sign(frame["rel_subject"] - frame[other[predictor]])
    push = np.sign(frame["push_subject"])
    agree = (pred == push).astype(float)
    return agree.where((pred != 0) & (push != 0) & pred.notna())
