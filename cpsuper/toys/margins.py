"""Theorem 1 of the truncation paper: after one gradient step from zero, the feed-forward block
already predicts the noise token with margin ``eta_f * alpha``, while the attention value block
reaches only ``(eta_v / N) * alpha_hat`` and is much noisier unless the sample is large.

The setting (section 4.1 and appendix D of Chen, Bruna & Bietti):

* tokens ``0..N-1`` and the noise token ``N``; a sequence starts uniformly, moves uniformly
  after an ordinary token, and after the trigger ``q`` emits the sequence's own output ``ybar``
  (uniform over ``[N]``) with probability ``1 - alpha`` or noise with probability ``alpha``;
  after noise it moves uniformly; the last input is forced to ``z_T = q`` and the label ``y``
  is drawn after it like every other trigger's successor;
* orthonormal (one-hot) embeddings and unembedding, ``d = N + 1``, no positions;
* ``xi = W_U phi(x_T, x_{1:T}) + W_U W_F x_T`` with ``phi = sum_t softmax_t(x_T^T W_KQ x_t) W_V x_t``;
* ``W_KQ = W_F = W_V = 0``; one full-batch gradient step of the cross-entropy on ``m`` samples
  with step sizes ``eta_f`` (``W_F``) and ``eta_v`` (``W_V``); the gradient on ``W_KQ`` is zero.

:func:`one_step_margins` takes that step with autograd (not from the theorem's formulas) and
measures the noise margin ``Delta(xi) = xi_N - max_{j < N} xi_j`` of each block on fresh test
sequences, against the theorem's prediction, for each sample size ``m`` (the quantity the
theorem's bounds depend on).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

__all__ = ["MARGIN_COLUMNS", "one_step_margins", "sample_theorem_sequences", "theorem_bounds"]

MARGIN_COLUMNS = [
    "m",
    "seed",
    "block",
    "margin",
    "margin_std",
    "predicted",
    "scaled_margin",
    "scaled_predicted",
    "bound",
    "kq_grad_norm",
]
"""Columns of :func:`one_step_margins`' frame."""


def sample_theorem_sequences(
    n: int, n_tokens: int, seq_len: int, alpha: float, trigger: int, generator: torch.Generator
) -> tuple[Int[Tensor, "n seq"], Int[Tensor, " n"]]:
    """``n`` sequences ``z_{1:T}`` (ending in the trigger) and their labels ``y``, as above."""
    noise = n_tokens
    ybar = torch.randint(n_tokens, (n,), generator=generator)
    z = torch.empty(n, seq_len + 1, dtype=torch.long)
    z[:, 0] = torch.randint(n_tokens, (n,), generator=generator)
    for t in range(seq_len):
        uniform = torch.randint(n_tokens, (n,), generator=generator)
        forced = torch.where(torch.rand(n, generator=generator) < alpha, torch.full_like(ybar, noise), ybar)
        if t == seq_len - 2:
            z[:, t + 1] = trigger  # z_T = q
        else:
            z[:, t + 1] = torch.where(z[:, t] == trigger, forced, uniform)
    return z[:, :seq_len], z[:, seq_len]


def _logits(
    z: Int[Tensor, "n seq"], w_kq: Tensor, w_v: Tensor, w_f: Tensor
) -> tuple[Float[Tensor, "n vocab"], Float[Tensor, "n vocab"]]:
    """``(xi_attn, xi_ff)`` with one-hot embeddings (``x_t = e_{z_t}``) and ``W_U = I``."""
    query = z[:, -1]
    scores = w_kq[query].gather(1, z)  # x_T^T W_KQ x_t
    attn = scores.softmax(-1)
    mixed = torch.zeros(z.shape[0], w_v.shape[0], dtype=w_v.dtype).scatter_add(1, z, attn)
    return mixed @ w_v.T, w_f.T[query]


def _margin(xi: Float[Tensor, "n vocab"]) -> Float[Tensor, " n"]:
    return xi[:, -1] - xi[:, :-1].max(-1).values


def theorem_bounds(m: int, n_tokens: int, seq_len: int, eta_f: float, eta_v: float, delta: float = 0.05) -> dict:
    """The right-hand sides of Theorem 1 with the ``O(.)`` constant set to 1, at confidence
    ``1 - delta``: ``{"feed_forward": ..., "value": ...}``."""
    log_term = math.log(2 * (n_tokens + 1) / delta)
    spread = (1 / (seq_len * n_tokens) + 1 / n_tokens**2) * log_term / m
    return {
        "feed_forward": eta_f * math.sqrt(log_term / m),
        "value": eta_v * (math.sqrt(spread) + log_term / m),
    }


def one_step_margins(
    sample_sizes: Iterable[int] = (16, 64, 256, 1024, 4096),
    *,
    n_tokens: int = 50,
    seq_len: int = 50,
    alpha: float = 0.5,
    eta_f: float = 1.0,
    eta_v: float = 1.0,
    trigger: int = 0,
    n_test: int = 256,
    seeds: Iterable[int] = (0, 1, 2),
    delta: float = 0.05,
) -> pd.DataFrame:
    """Empirical and predicted one-step noise margins of the feed-forward and value blocks.

    For each sample size ``m`` and seed: ``m`` training sequences, one gradient step from zero
    (``eta_v = eta_f = 1`` by default, the theorem's remark i; ``eta_v = n_tokens`` is its remark
    ii), then the margin of each block on ``n_test`` fresh test sequences. Rows (columns :data:`MARGIN_COLUMNS`):
    ``block`` is ``"feed_forward"`` or ``"value"``; ``margin`` / ``margin_std`` are the mean and
    spread over test sequences; ``predicted`` is ``eta_f * alpha`` or the mean over test
    sequences of ``(eta_v / N) * (alpha^2 q_hat + alpha (1 - q_hat))`` (``q_hat`` = the test
    sequence's share of noise tokens); ``scaled_*`` divide by ``eta_f`` or ``eta_v / N`` (both
    predictions then read about ``alpha``); ``bound`` is :func:`theorem_bounds`; and
    ``kq_grad_norm`` the norm of the ``W_KQ`` gradient (zero, as the theorem notes).
    """
    sizes = [int(m) for m in sample_sizes]
    if not sizes or min(sizes) < 1:
        raise ValueError(f"sample_sizes must be positive integers, got {sizes}.")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}.")
    if n_tokens < 2 or seq_len < 2 or not 0 <= trigger < n_tokens:
        raise ValueError(
            f"need n_tokens >= 2, seq_len >= 2, trigger in 0..n_tokens-1; got {n_tokens}, {seq_len}, {trigger}."
        )
    if eta_f <= 0 or eta_v <= 0:
        raise ValueError(f"step sizes must be > 0, got eta_f={eta_f}, eta_v={eta_v}.")
    vocab = n_tokens + 1
    rows = []
    for seed in seeds:
        gen = torch.Generator().manual_seed(int(seed))
        test, _ = sample_theorem_sequences(n_test, n_tokens, seq_len, alpha, trigger, gen)
        q_hat = (test == n_tokens).double().mean(-1)
        alpha_hat = (alpha**2 * q_hat + alpha * (1 - q_hat)).mean().item()
        for m in sizes:
            z, y = sample_theorem_sequences(m, n_tokens, seq_len, alpha, trigger, gen)
            params = [torch.zeros(vocab, vocab, dtype=torch.float64, requires_grad=True) for _ in range(3)]
            w_kq, w_v, w_f = params
            xi_attn, xi_ff = _logits(z, w_kq, w_v, w_f)
            F.cross_entropy(xi_attn + xi_ff, y).backward()
            with torch.no_grad():
                stepped = (w_kq.detach(), -eta_v * w_v.grad, -eta_f * w_f.grad)  # W_KQ's gradient is zero
                test_attn, test_ff = _logits(test, *stepped)
            bounds = theorem_bounds(m, n_tokens, seq_len, eta_f, eta_v, delta)
            for block, margins, predicted, scale in (
                ("feed_forward", _margin(test_ff), eta_f * alpha, eta_f),
                ("value", _margin(test_attn), eta_v / n_tokens * alpha_hat, eta_v / n_tokens),
            ):
                mean = margins.mean().item()
                rows.append(
                    (m, int(seed), block, mean, margins.std().item(), predicted, mean / scale, predicted / scale)
                    + (bounds[block], w_kq.grad.norm().item())
                )
    frame = pd.DataFrame(rows, columns=MARGIN_COLUMNS)
    frame["error"] = frame["margin"] - frame["predicted"]
    frame["within_bound"] = np.abs(frame["error"]) <= frame["bound"]
    return frame
