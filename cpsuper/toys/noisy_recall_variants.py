"""The noisy-recall toy's variants from the truncation paper's appendix A, and their probes.

- **Several triggers** (Figure 8): each trigger has its own output token; the second layer's
  key-query matrix should match a key whose *previous* token is trigger ``q`` to a query that is
  ``q``, and nothing else. :func:`trigger_matching` reads the matrix
  ``<W_V^1 W_E(i), W_KQ^2 W_E(j)>`` for every pair of tokens.
- **Feed-forward variants** (Figures 10-11): each layer's block is a two-layer ReLU MLP, one
  linear map, or absent (``NoisyRecallConfig.ffn``); the probes drop either block on clean data
  and :func:`ffn_variant_table` lines the runs up.
- **Attention-only value truncation** (Figure 12): with no feed-forward blocks the noise can only
  live in attention; the first layer's ``W_O`` (the paper's re-parametrised value ``W_O W_V``) is
  truncated to rank ``floor(rho * d_model)``, ``rho`` in (0, 1] (:func:`value_truncation_stats`).

This module sits below :mod:`cpsuper.toys.noisy_recall_task` (which imports its helpers), so it
reads configs and batches by attribute only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from ..backend import Model
from ..interrupts import swapped_parameters
from ..truncation import low_rank_approx, truncation_rank
from .build import read_weight, set_activation, stored_weights, write_weights

__all__ = [
    "FEED_FORWARD_KINDS",
    "FeedForward",
    "answer_stats",
    "check_fractions",
    "ffn_variant_table",
    "frozen_feed_forward_names",
    "low_rank_weight",
    "set_feed_forward",
    "trigger_matching",
    "trigger_matching_summary",
    "value_truncation_stats",
    "variant_configs",
]

FeedForward = Literal["mlp", "linear", "none"]
FEED_FORWARD_KINDS = ("mlp", "linear", "none")


def check_fractions(rhos: Iterable[float], name: str = "rhos") -> tuple[float, ...]:
    """``rhos`` as floats, each a preserved-rank fraction in (0, 1]; ``ValueError`` otherwise.

    The paper's parametrisation keeps rank ``floor(rho * d)``; where ``rho = 0`` would remove a
    block rather than truncate it, the removal is a separate condition (a drop)."""
    out = tuple(float(r) for r in rhos)
    bad = [r for r in out if not 0 < r <= 1]
    if bad:
        raise ValueError(f"{name} must lie in (0, 1] (the fraction of rank kept), got {bad}; use a drop for rho = 0.")
    return out


# ---------------------------------------------------------------------------------------------
# Feed-forward variants


def frozen_feed_forward_names(ffn: tuple[str, str]) -> set[str]:
    """MLP parameters that a variant keeps fixed: ``W_in`` of a ``"linear"`` layer, both
    matrices of a ``"none"`` layer."""
    frozen = set()
    for layer, kind in enumerate(ffn):
        if kind in ("linear", "none"):
            frozen.add(f"blocks.{layer}.mlp.W_in")
        if kind == "none":
            frozen.add(f"blocks.{layer}.mlp.W_out")
    return frozen


def _identity(x: Tensor) -> Tensor:
    return x


def set_feed_forward(model: Model, layer: int, kind: str, generator: torch.Generator) -> None:
    """Turn block ``layer``'s MLP into a ``"linear"`` map (identity activation, ``W_in = [I 0]``
    fixed, so the block computes ``x -> W_out[:d]^T x``, one ``d x d`` matrix) or ``"none"``
    (both matrices zero: the block adds nothing). ``"mlp"`` leaves it as it is."""
    if kind not in FEED_FORWARD_KINDS:
        raise ValueError(f"kind must be one of {FEED_FORWARD_KINDS}, got {kind!r}.")
    d, d_mlp = model.cfg.d_model, model.cfg.d_mlp
    w_in, w_out = torch.zeros(d, d_mlp), torch.zeros(d_mlp, d)
    if kind == "linear":
        set_activation(model, layer, _identity)
        w_in[:, :d] = torch.eye(d)
        w_out[:d] = (torch.rand(d, d, generator=generator) * 2 - 1) / math.sqrt(d)
    if kind != "mlp":
        write_weights(model, {f"blocks.{layer}.mlp.W_in": w_in, f"blocks.{layer}.mlp.W_out": w_out})


# ---------------------------------------------------------------------------------------------
# Answer statistics and truncation


def answer_stats(logits: Float[Tensor, "batch pos vocab"], batch: Any, noise: int) -> dict[str, float]:
    """Probability of the right output and of noise, losses and argmax rates at the recall
    positions of ``batch`` (a :class:`~cpsuper.toys.noisy_recall_task.RecallBatch`)."""
    mask = batch.recall
    logp = logits[mask].float().log_softmax(-1)
    answer = batch.answers[mask]
    target = batch.targets[mask]
    rows = torch.arange(len(answer))
    return {
        "p_correct": logp[rows, answer].exp().mean().item(),
        "p_noise": logp[:, noise].exp().mean().item(),
        "loss": -logp[rows, target].mean().item(),
        "clean_loss": -logp[rows, answer].mean().item(),
        "accuracy": (logp.argmax(-1) == answer).float().mean().item(),
        "argmax_noise": (logp.argmax(-1) == noise).float().mean().item(),
    }


def low_rank_weight(model: Model, name: str, rank: int) -> swapped_parameters:
    """Replace TransformerLens weight ``name`` (``"blocks.1.mlp.W_in"``; its last two dimensions)
    by its best rank-``rank`` approximation for the ``with`` block; the original tensor comes back
    exactly, also after an exception or Ctrl-C."""
    approx = low_rank_approx(read_weight(model, name).detach(), rank)
    return swapped_parameters(model, stored_weights(model, {name: approx}))


@torch.no_grad()
def value_truncation_stats(
    model: Model, batch: Any, noise: int, rhos: Iterable[float], *, layer: int = 0
) -> pd.DataFrame:
    """Answer statistics on ``batch`` with layer ``layer``'s attention output matrix ``W_O``
    (the paper's value re-parametrisation ``W_O W_V``) truncated to rank ``floor(rho * d_model)``.

    Rows ``(condition, rho, rank, measure, value)``; ``rho = 1`` is the full model. Raises
    ``ValueError`` for ``rho`` outside (0, 1] (the paper's Figure 12 sweeps ``rho > 0``)."""
    rhos = check_fractions(rhos)
    name = f"blocks.{layer}.attn.W_O"
    rows = []
    for rho in rhos:
        rank = truncation_rank(rho, *read_weight(model, name).shape[-2:])
        with low_rank_weight(model, name, rank):
            stats = answer_stats(model(batch.tokens), batch, noise)
        condition = "full" if rho == 1 else f"attn{layer + 1} W_O rank {rank}"
        rows += [(condition, rho, rank, k, v) for k, v in stats.items()]
    return pd.DataFrame(rows, columns=["condition", "rho", "rank", "measure", "value"])


# ---------------------------------------------------------------------------------------------
# Trigger matching (Figure 8)


@torch.no_grad()
def trigger_matching(model: Model, triggers: Iterable[int]) -> pd.DataFrame:
    """The second layer's attention score between a key that holds what the first layer's value
    wrote for token ``i`` and a query that is token ``j``: ``<W_V^1 W_E(i), W_KQ^2 W_E(j)>``.

    In TransformerLens terms ``(W_E[i] W_V^0 W_O^0 W_K^1) . (W_E[j] W_Q^1) / sqrt(d_head)``
    (layers 0-based), for every pair of tokens (noise included). Rows ``(key_token,
    query_token, score, key_is_trigger, query_is_trigger, match)``, where ``match`` marks
    ``i == j`` in the trigger set: the paper's Figure 8 finds large scores there only."""
    triggers = {int(t) for t in triggers}
    w_e = model.W_E
    a0, a1 = model.blocks[0].attn, model.blocks[1].attn
    keys = (w_e @ a0.W_V[0] @ a0.W_O[0] + a0.b_O) @ a1.W_K[0]
    queries = w_e @ a1.W_Q[0]
    scores = (queries @ keys.T).T / math.sqrt(model.cfg.d_head)  # [key token i, query token j]
    vocab = w_e.shape[0]
    i = torch.arange(vocab).repeat_interleave(vocab)
    j = torch.arange(vocab).repeat(vocab)
    frame = pd.DataFrame({"key_token": i.numpy(), "query_token": j.numpy(), "score": scores.flatten().cpu().numpy()})
    frame["key_is_trigger"] = frame.key_token.isin(triggers)
    frame["query_is_trigger"] = frame.query_token.isin(triggers)
    frame["match"] = frame.key_is_trigger & (frame.key_token == frame.query_token)
    return frame


def trigger_matching_summary(matching: pd.DataFrame) -> pd.Series:
    """How much the matching pairs stand out: the mean score of ``i == j`` trigger pairs, of the
    other pairs with a trigger query, and of all other pairs; ``gap`` is the smallest matching
    score minus the largest non-matching score in the trigger queries' columns (> 0 when every
    trigger attends to its own successor positions first)."""
    trig_q = matching[matching.query_is_trigger]
    return pd.Series(
        {
            "match_mean": matching.loc[matching.match, "score"].mean(),
            "trigger_query_other_mean": trig_q.loc[~trig_q.match, "score"].mean(),
            "rest_mean": matching.loc[~matching.query_is_trigger, "score"].mean(),
            "gap": matching.loc[matching.match, "score"].min() - trig_q.loc[~trig_q.match, "score"].max(),
        }
    )


# ---------------------------------------------------------------------------------------------
# Lining variants up (Figures 10-12)


def ffn_variant_table(runs: Mapping[str, Any], *, data: str = "clean", step: int | None = None) -> pd.DataFrame:
    """The probes of several :class:`~cpsuper.toys.noisy_recall.NoisyRecallRun` side by side:
    rows ``(variant, ffn, condition, rho, measure, value)`` at ``step`` (the last when
    ``None``) on ``data`` (``"clean"``: the test set without noise, the paper's Figures 10-12)."""
    frames = []
    for name, run in runs.items():
        probes = run.probes[run.probes.data == data]
        at = probes.step.max() if step is None else step
        part = probes[probes.step == at].drop(columns=["step", "data"])
        frames.append(part.assign(variant=name, ffn="/".join(run.config.ffn)))
    table = pd.concat(frames, ignore_index=True)
    return table[["variant", "ffn", "condition", "rho", "measure", "value"]]


def variant_configs(config_cls: type, *, paper: bool = False, **overrides) -> dict[str, Any]:
    """Configs of the appendix-A runs, keyed by name: ``one_trigger`` and ``five_triggers``
    (Figure 8), ``mlp_linear`` (Figure 10), ``linear_mlp`` (Figure 11) and ``attention_only``
    (Figure 12, with ``W_O`` truncation probes at rho 0.01, 0.05, 0.1, 0.2). ``config_cls`` is
    :class:`~cpsuper.toys.noisy_recall.NoisyRecallConfig`; ``paper=True`` starts from its
    :meth:`paper` settings (five triggers: the paper's ids 1, 39, 43, 53, 58), else from the CI
    defaults (five triggers: 0-4, with the trigger rate raised so each still repeats)."""
    base = config_cls.paper if paper else config_cls
    extra = (39, 43, 53, 58) if paper else (1, 2, 3, 4)
    first = 1 if paper else 0
    many = {} if paper else {"trigger_rate": 0.3, "seq_len": 64}
    return {
        "one_trigger": base(trigger=first, **overrides),
        "five_triggers": base(trigger=first, extra_triggers=extra, **{**many, **overrides}),
        "mlp_linear": base(ffn=("mlp", "linear"), **overrides),
        "linear_mlp": base(ffn=("linear", "mlp"), **overrides),
        "attention_only": base(ffn=("none", "none"), value_truncation_fractions=(0.01, 0.05, 0.1, 0.2), **overrides),
    }
