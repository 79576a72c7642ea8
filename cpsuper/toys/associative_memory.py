"""A linear associative memory trained on labels with a common noise token, where the noise ends
up in a low-rank part of the weights (Chen, Bruna & Bietti, section 5 and appendix C).

Inputs ``i in 0..n-1`` have random unit embeddings ``e_i``; outputs ``j in 0..n`` have random
unit embeddings ``u_j``, output ``n`` being the shared noise token. The label of ``i`` is ``i``
with probability ``1 - alpha`` and the noise token otherwise. The model scores
``f(i, j) = u_j^T W e_i`` with one learned ``d x d`` matrix ``W``, trained by full-batch
gradient descent on cross-entropy. The full ``W`` learns to predict noise with probability
about ``alpha``; truncating ``W`` to rank ``n - 1`` removes the direction holding the noise and
predicts the clean label better. Truncations are only measured, never trained.

Several seeds train at once as a batch of independent ``W`` matrices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from ..truncation import low_rank_approx
from .common import ToyRun, checkpoint_steps

__all__ = [
    "AssocMemoryConfig",
    "AssocMemoryRun",
    "assoc_logits",
    "assoc_targets",
    "expected_loss_gradient",
    "fit_rate",
    "memory_probes",
    "sample_assoc_labels",
    "summarize_memory",
    "theorem2_flow",
    "train_associative_memory",
]


@dataclass(frozen=True)
class AssocMemoryConfig:
    """Settings of the associative-memory toy; the defaults are a CI-size run (seconds).

    ``n_samples=None`` trains on the expected (population) cross-entropy of the noisy label
    distribution; an integer draws that many ``(x, y)`` pairs once per seed and trains on
    their empirical cross-entropy. ``init_std=None`` means ``1/sqrt(d)`` (the paper's
    ``W_ij ~ N(0, 1/d)``). ``ranks`` are the truncation ranks probed at every checkpoint.
    """

    n_inputs: int = 3
    d: int = 12
    alpha: float = 0.03
    steps: int = 1500
    lr: float = 1.0
    n_seeds: int = 20
    ranks: tuple[int, ...] = (1, 2, 3, 4)
    init_std: float | None = None
    n_samples: int | None = None
    checkpoint_every: int = 50
    extra_checkpoints: tuple[int, ...] = (1, 2, 5, 10, 20)
    seed: int = 0

    def __post_init__(self):
        if not 0 <= self.alpha < 1:
            raise ValueError(f"alpha must be in [0, 1), got {self.alpha}.")
        if self.n_inputs < 1 or self.d < 1 or self.n_seeds < 1:
            raise ValueError("n_inputs, d and n_seeds must be positive.")
        if any(not 1 <= k <= self.d for k in self.ranks):
            raise ValueError(f"ranks must lie in 1..d={self.d}, got {self.ranks}.")

    @property
    def noise(self) -> int:
        """Id of the common noise output (after the ``n_inputs`` clean labels)."""
        return self.n_inputs

    @classmethod
    def paper(cls, **overrides) -> AssocMemoryConfig:
        """The paper's Figure 6 setting: n = 3, alpha = 0.03, d = 12 (pass ``d=8`` for the right
        panel), 20 runs, ranks 1-4. The paper gives no learning rate or step count; this uses
        full-batch GD with learning rate 1 for 3000 steps on the expected loss."""
        settings = {
            "n_inputs": 3,
            "d": 12,
            "alpha": 0.03,
            "steps": 3000,
            "lr": 1.0,
            "n_seeds": 20,
            "checkpoint_every": 25,
        }
        settings.update(overrides)
        return cls(**settings)


# ---------------------------------------------------------------------------------------------
# Data and model


def _unit_vectors(shape: tuple[int, ...], generator: torch.Generator) -> Tensor:
    """Uniform on the unit sphere (normalised Gaussians) along the last axis."""
    x = torch.randn(shape, generator=generator, dtype=torch.float64)
    return x / x.norm(dim=-1, keepdim=True)


def assoc_targets(n_inputs: int, alpha: float) -> Float[Tensor, "n_inputs n_outputs"]:
    """The label distribution ``p(y | x)``: ``1 - alpha`` on ``y = x``, ``alpha`` on the noise."""
    p = torch.zeros(n_inputs, n_inputs + 1, dtype=torch.float64)
    p[torch.arange(n_inputs), torch.arange(n_inputs)] = 1 - alpha
    p[:, n_inputs] += alpha
    return p


def sample_assoc_labels(
    n_inputs: int, alpha: float, n_samples: int, generator: torch.Generator | None = None
) -> tuple[Int[Tensor, " n_samples"], Int[Tensor, " n_samples"]]:
    """``n_samples`` pairs ``(x, y)``: ``x`` uniform over the inputs, ``y`` from
    :func:`assoc_targets`."""
    x = torch.randint(n_inputs, (n_samples,), generator=generator)
    noisy = torch.rand(n_samples, generator=generator, dtype=torch.float64) < alpha
    y = torch.where(noisy, torch.full_like(x, n_inputs), x)
    return x, y


def assoc_logits(
    W: Float[Tensor, "*seeds d d"],
    inputs: Float[Tensor, "*seeds n_inputs d"],
    outputs: Float[Tensor, "*seeds n_outputs d"],
) -> Float[Tensor, "*seeds n_inputs n_outputs"]:
    """``f(i, j) = u_j^T W e_i`` for every input ``i`` and output ``j``."""
    return torch.einsum("...ja,...ab,...ib->...ij", outputs, W, inputs)


# ---------------------------------------------------------------------------------------------
# Probes


@torch.no_grad()
def memory_probes(
    W: Float[Tensor, "seeds d d"],
    inputs: Float[Tensor, "seeds n_inputs d"],
    outputs: Float[Tensor, "seeds n_outputs d"],
    alpha: float,
    ranks: tuple[int, ...] = (1, 2, 3, 4),
) -> pd.DataFrame:
    """Per seed, for the full ``W`` and each rank-``k`` truncation: the pure-label loss (cross-
    entropy of the clean label, averaged over inputs), accuracy, mean probability of the noise
    token and of the clean label, and the noisy-label (training) loss; plus ``W``'s singular
    values (``model="full"``, measures ``sv1``, ``sv2``, ...).

    Rows ``(seed, model, rank, measure, value)``; ``rank`` is ``d`` for the full matrix.
    """
    n = inputs.shape[-2]
    d = W.shape[-1]
    targets = assoc_targets(n, alpha).to(W)
    clean = torch.arange(n)
    rows = []
    variants = [("full", d, W)] + [(f"rank {k}", k, low_rank_approx(W, k)) for k in ranks]
    for name, k, Wk in variants:
        logp = assoc_logits(Wk, inputs, outputs).log_softmax(-1)  # [seeds, n, c]
        stats = {
            "pure_loss": -logp[:, clean, clean].mean(-1),
            "accuracy": (logp.argmax(-1) == clean).double().mean(-1),
            "p_noise": logp[..., n].exp().mean(-1),
            "p_correct": logp[:, clean, clean].exp().mean(-1),
            "train_loss": -(targets * logp).sum(-1).mean(-1),
        }
        for measure, values in stats.items():
            rows.extend((seed, name, k, measure, float(v)) for seed, v in enumerate(values.tolist()))
    svals = torch.linalg.svdvals(W)
    for i in range(min(d, max(ranks) + 1)):
        rows.extend((seed, "full", d, f"sv{i + 1}", float(v)) for seed, v in enumerate(svals[:, i].tolist()))
    return pd.DataFrame(rows, columns=["seed", "model", "rank", "measure", "value"])


def summarize_memory(run: AssocMemoryRun | pd.DataFrame, measure: str = "pure_loss") -> pd.DataFrame:
    """Median and 25/75 % quantiles over seeds of one probe, per step and model (the paper's
    Figure 6 statistics). Columns ``step, model, rank, median, q25, q75, n``."""
    probes = run.probes if isinstance(run, ToyRun) else run
    part = probes[probes.measure == measure]
    grouped = part.groupby(["step", "model", "rank"])["value"]
    out = grouped.agg(
        median="median", q25=lambda v: v.quantile(0.25), q75=lambda v: v.quantile(0.75), n="size"
    ).reset_index()
    return out.sort_values(["model", "step"], ignore_index=True)


# ---------------------------------------------------------------------------------------------
# Training


@dataclass
class AssocMemoryRun(ToyRun):
    """An associative-memory run: checkpoints hold ``{"W": [seeds, d, d]}``; the embeddings are
    in ``extras`` (``inputs`` ``[seeds, n, d]``, ``outputs`` ``[seeds, n + 1, d]``)."""

    config_cls = AssocMemoryConfig

    def logits_at(self, step: int | None = None, rank: int | None = None) -> Float[Tensor, "seeds n c"]:
        """All seeds' logits at checkpoint ``step`` (the last when ``None``), for the full ``W``
        or its rank-``rank`` truncation."""
        W = self.state_at(step)["W"]
        if rank is not None:
            W = low_rank_approx(W, rank)
        return assoc_logits(W, self.extras["inputs"], self.extras["outputs"])


def train_associative_memory(cfg: AssocMemoryConfig | None = None, progress: bool = True) -> AssocMemoryRun:
    """Train ``cfg.n_seeds`` independent memories (each with its own embeddings and init) by
    full-batch gradient descent on cross-entropy, in float64.

    At step 0, every ``cfg.checkpoint_every`` steps, the last step and
    ``cfg.extra_checkpoints`` it keeps ``W`` and runs :func:`memory_probes`.
    """
    cfg = cfg or AssocMemoryConfig()
    gen = torch.Generator().manual_seed(cfg.seed)
    s, n, d = cfg.n_seeds, cfg.n_inputs, cfg.d
    inputs = _unit_vectors((s, n, d), gen)
    outputs = _unit_vectors((s, n + 1, d), gen)
    std = cfg.init_std if cfg.init_std is not None else 1 / math.sqrt(d)
    W = (torch.randn((s, d, d), generator=gen, dtype=torch.float64) * std).requires_grad_(True)
    # Weights on (input, output) pairs whose sum is the cross-entropy: the expected loss, or an
    # empirical one from a finite sample per seed.
    if cfg.n_samples is None:
        weights = (assoc_targets(n, cfg.alpha) / n).expand(s, n, n + 1)
    else:
        weights = torch.zeros(s, n, n + 1, dtype=torch.float64)
        for seed in range(s):
            x, y = sample_assoc_labels(n, cfg.alpha, cfg.n_samples, gen)
            weights[seed].index_put_((x, y), torch.ones(len(x), dtype=torch.float64), accumulate=True)
        weights /= cfg.n_samples
    record = set(checkpoint_steps(cfg.steps, cfg.checkpoint_every, cfg.extra_checkpoints))
    run = AssocMemoryRun(config=cfg, extras={"inputs": inputs, "outputs": outputs})
    tables = []
    for step in tqdm(range(cfg.steps + 1), desc="associative memory", disable=not progress, unit="step"):
        if step in record:
            current = W.detach().clone()
            run.checkpoints.append((step, {"W": current}))
            tables.append(memory_probes(current, inputs, outputs, cfg.alpha, cfg.ranks).assign(step=step))
        if step == cfg.steps:
            break
        logp = assoc_logits(W, inputs, outputs).log_softmax(-1)
        loss = -(weights * logp).sum()  # sum over seeds of each seed's loss: independent gradients
        (grad,) = torch.autograd.grad(loss, W)
        with torch.no_grad():
            W -= cfg.lr * grad
    probes = pd.concat(tables, ignore_index=True)
    run.probes = probes[["step", "seed", "model", "rank", "measure", "value"]]
    return run


# ---------------------------------------------------------------------------------------------
# Theorem 2: two inputs, three outputs, orthonormal embeddings, training from zero


def _orthonormal_embeddings(n: int, d: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """``n`` input and ``n + 1`` output embeddings, each set orthonormal (Assumption C.1): rows of
    two random orthogonal ``d x d`` matrices."""
    if d < n + 1:
        raise ValueError(f"Orthonormal embeddings of {n + 1} outputs need d >= {n + 1}, got d={d}.")
    q_in, _ = torch.linalg.qr(torch.randn(d, d, generator=generator, dtype=torch.float64))
    q_out, _ = torch.linalg.qr(torch.randn(d, d, generator=generator, dtype=torch.float64))
    return q_in[:n], q_out[: n + 1]


def expected_loss_gradient(
    W: Float[Tensor, "*batch d d"],
    inputs: Float[Tensor, "*batch n d"],
    outputs: Float[Tensor, "*batch c d"],
    targets: Float[Tensor, "*batch n c"],
) -> Float[Tensor, "*batch d d"]:
    """Gradient in ``W`` of the expected cross-entropy ``-(1/n) sum_i sum_j p(j|i) log softmax_j
    f(i, .)`` (inputs uniform): ``sum_ij ((1/n) softmax_ij - p(j|i)/n) u_j e_i^T``."""
    n = inputs.shape[-2]
    logits = inputs @ W.mT @ outputs.mT  # f(i, j) = u_j^T W e_i, as assoc_logits (matmuls: faster)
    residual = (logits.softmax(-1) - targets) / n
    return outputs.mT @ residual.mT @ inputs


def theorem2_flow(
    alphas: tuple[float, ...] = (0.25, 0.3, 0.35),
    *,
    d: int = 3,
    lr: float = 0.1,
    steps: int = 100_000,
    n_points: int = 41,
    seed: int = 0,
) -> pd.DataFrame:
    """Theorem 2's setting on this toy: ``n = 2`` inputs, ``c = 3`` outputs (two clean labels and
    the common noise token), orthonormal embeddings, ``W = 0`` at the start, one memory per
    ``alpha`` (all trained at once). Gradient flow on the expected loss is stood in for by
    full-batch gradient descent with a small step ``lr``; time is ``t = lr * step``.

    At ``n_points`` log-spaced steps it records, averaged over the two inputs, the full model's
    and the rank-1 truncation's probability of the noise token and of the clean label, and the two
    singular values of ``W``. Rows ``alpha, step, t, model, p_noise, p_clean, sv1, sv2``.
    """
    if any(not 0 < a < 1 for a in alphas):
        raise ValueError(f"Every alpha must lie in (0, 1), got {alphas}.")
    if lr <= 0 or steps < 1:
        raise ValueError(f"lr must be > 0 and steps >= 1, got lr={lr}, steps={steps}.")
    n = 2
    gen = torch.Generator().manual_seed(seed)
    e, u = _orthonormal_embeddings(n, d, gen)
    k = len(alphas)
    inputs, outputs = e.expand(k, n, d), u.expand(k, n + 1, d)
    targets = torch.stack([assoc_targets(n, a) for a in alphas])
    W = torch.zeros(k, d, d, dtype=torch.float64)
    record = set(np.unique(np.geomspace(1, steps, n_points).round().astype(int)).tolist())
    rows = []
    clean = torch.arange(n)
    for step in range(steps + 1):
        if step in record:
            svals = torch.linalg.svdvals(W)
            for model, Wk in (("full", W), ("rank 1", low_rank_approx(W, 1))):
                p = assoc_logits(Wk, inputs, outputs).softmax(-1)
                p_noise, p_clean = p[..., n].mean(-1), p[:, clean, clean].mean(-1)
                for i, a in enumerate(alphas):
                    rows.append(
                        (
                            a,
                            step,
                            lr * step,
                            model,
                            p_noise[i].item(),
                            p_clean[i].item(),
                            svals[i, 0].item(),
                            svals[i, 1].item(),
                        )
                    )
        if step == steps:
            break
        W -= lr * expected_loss_gradient(W, inputs, outputs, targets)
    return pd.DataFrame(rows, columns=["alpha", "step", "t", "model", "p_noise", "p_clean", "sv1", "sv2"])


def fit_rate(
    flow: pd.DataFrame, *, model: str = "rank 1", measure: str = "p_noise", t_min: float = 100.0
) -> pd.DataFrame:
    """Least-squares slope of ``log(measure)`` against ``log t`` for ``t >= t_min``, per alpha, with
    the smallest and largest slope between neighbouring recorded points in that range (how far the
    curve is from a straight line) and ``sqrt(t) * measure`` at the last point.
    Columns ``alpha, slope, local_min, local_max, scaled_last, n_points``."""
    part = flow[(flow.model == model) & (flow.t >= t_min)]
    out = []
    for a, g in part.groupby("alpha"):
        g = g.sort_values("t")
        x, y = np.log(g["t"].to_numpy()), np.log(g[measure].to_numpy())
        if len(x) < 3:
            raise ValueError(f"Only {len(x)} points with t >= {t_min} for alpha={a}; lower t_min or run longer.")
        local = np.diff(y) / np.diff(x)
        last = g.iloc[-1]
        out.append(
            (a, float(np.polyfit(x, y, 1)[0]), local.min(), local.max(), math.sqrt(last.t) * last[measure], len(x))
        )
    return pd.DataFrame(out, columns=["alpha", "slope", "local_min", "local_max", "scaled_last", "n_points"])
