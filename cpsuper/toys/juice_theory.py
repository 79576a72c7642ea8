"""The JuICE paper's theory toy: under superposition, steering heads twice beats scaling them once.

Section 5 / Appendix G of "Taming Knowledge Conflicts in Language Models": a two-layer attention-only
transformer, one head per layer, solves factual recall (subject ``s`` in noise, then trigger ``q``;
answer ``G(s)``) and induction (``... q b ... q``; answer ``b``) with the *same* layer-1 head. Layer 0
is a previous-token head; layer 1, at the final ``q``, scores a key by ``c1 <x, phi'(q)> + c2 sum_s
<x, phi(s)>`` and writes ``c3 mu(k)`` for noise ``k``, ``c4 mu(G(s))`` for a subject (eqs. 2-4). On a
prompt with both cues the shared softmax answers ``b`` when ``exp(c1) c3 > exp(c2) c4`` (Cor. 5.4).

Prop. 5.5: both heads are context heads. Removing both in one pass (PH3; JuNe at ``beta = -1``)
silences layer 1, so every token ties. JuICE's second pass adds ``beta`` times the *clean run's*
head outputs: without the previous-token head layer 1 recalls the fact, and subtracting its clean
(induction) output leaves the fact on top. Here the construction is an exact TransformerLens model
(``superposition=False``: separate induction and recall heads, the control), steered by cpsuper's
:class:`~cpsuper.interventions.ScaleHead` (``1 + beta``, run once) and
:class:`~cpsuper.interventions.AddHeadOutput` (``beta`` x clean ``z``, run twice);
:func:`closed_form_logits` is the paper's algebra, independent of the model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from ..backend import Model
from ..interventions import AddHeadOutput, ScaleHead, intervene
from .build import write_weights
from .common import blank_attention_model

__all__ = [
    "METHODS",
    "STEER_COLUMNS",
    "TASKS",
    "TheoryConfig",
    "TheoryPrompts",
    "TheoryToy",
    "closed_form_logits",
    "conflict_switch",
    "identify_heads",
    "steer",
    "steering_logits",
    "theory_study",
]

TASKS = ("recall", "induction", "conflict")
METHODS = ("run_once", "run_twice")
STEER_COLUMNS = [
    "model", "method", "beta", "task", "target", "p_clean", "p", "delta", "accuracy_clean", "accuracy", "n"
]  # fmt: skip
DEFAULT_BETAS = tuple(np.round(np.linspace(0.0, -2.0, 21), 2).tolist())
Head = tuple[int, int]


@dataclass(frozen=True)
class TheoryConfig:
    """Sizes and constants of the construction (names follow the paper).

    ``c1`` / ``c2``: attention scores of the induction cue and of a subject; ``c3`` / ``c4``: value
    strengths of the induction answer and of the fact; ``prev_token_score`` is the paper's large
    ``C``. ``orthogonal=True`` draws exactly orthonormal embeddings (Assumption G.2); ``False``
    draws i.i.d. unit vectors, near-orthogonal for large ``d_model`` (Assumption G.1).
    ``superposition=False`` splits layer 1 into an induction head and a recall head.
    """

    n_facts: int = 8
    n_noise: int = 24
    seq_len: int = 8
    d_model: int = 160
    orthogonal: bool = True
    prev_token_score: float = 30.0
    c1: float = 8.0
    c2: float = 5.0
    c3: float = 10.0
    c4: float = 10.0
    seed: int = 0
    superposition: bool = True

    def __post_init__(self):
        if self.seq_len < 5:
            raise ValueError(
                f"seq_len must be >= 5 (a conflict prompt needs q, b, s, noise and q), got {self.seq_len}."
            )
        if self.n_facts < 1:
            raise ValueError(f"n_facts must be >= 1, got {self.n_facts}.")
        if self.n_noise < self.seq_len:
            raise ValueError(f"n_noise must be >= seq_len={self.seq_len} (noise is drawn without replacement).")
        if self.orthogonal and self.d_model < self.n_vectors:
            raise ValueError(f"orthogonal=True needs d_model >= {self.n_vectors}, got {self.d_model}.")

    @property
    def vocab(self) -> int:
        """``q``, the subjects, their answers and the noise tokens."""
        return 1 + 2 * self.n_facts + self.n_noise

    @property
    def n_vectors(self) -> int:
        """Embeddings ``phi``, remapped ``phi'``, unembeddings ``mu`` and positions ``p``, ``p'``."""
        return 3 * self.vocab + 2 * self.seq_len

    @property
    def label(self) -> str:
        return "superposed" if self.superposition else "separate"


@dataclass
class TheoryPrompts:
    """Prompts of one task; a missing answer (no fact in an induction prompt, ...) is ``-1``."""

    task: str
    tokens: Int[Tensor, "n seq"]
    parametric: Int[Tensor, " n"]
    context: Int[Tensor, " n"]


@dataclass
class TheoryToy:
    """The constructed model and its vocabulary: token 0 is ``q``, then subjects, answers, noise."""

    config: TheoryConfig
    model: Model

    @classmethod
    def build(cls, config: TheoryConfig | None = None) -> TheoryToy:
        """The construction of Proposition 5.2 (or its no-superposition control) as a model."""
        config = config or TheoryConfig()
        return cls(config, _build_model(config))

    @property
    def subjects(self) -> np.ndarray:
        return np.arange(1, 1 + self.config.n_facts)  # answer of subject s: s + n_facts

    @property
    def noise(self) -> np.ndarray:
        return np.arange(1 + 2 * self.config.n_facts, self.config.vocab)

    @property
    def context_heads(self) -> list[Head]:
        """The previous-token head and the layer-1 head that does induction."""
        return [(0, 0), (1, 0)]

    def prompts(self, task: str, n: int = 256, *, seed: int = 0) -> TheoryPrompts:
        """``n`` prompts of ``task`` drawn as in Section 5 (0-based positions; the last is ``q``).

        recall: a subject at a random position, noise elsewhere; induction: ``q`` at
        ``j in [1, T-3]`` followed by noise ``b``, distinct noise elsewhere; conflict: both.
        """
        if task not in TASKS:
            raise ValueError(f"Unknown task {task!r}; use one of {TASKS}.")
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}.")
        rng = np.random.default_rng(seed)
        T = self.config.seq_len
        tokens = np.zeros((n, T), dtype=np.int64)
        parametric = np.full(n, -1)
        context = np.full(n, -1)
        for row in range(n):
            free = list(range(T - 1))
            noise = list(rng.permutation(self.noise))
            if task != "recall":
                j = int(rng.integers(1, T - 2))
                tokens[row, j], tokens[row, j + 1] = 0, noise.pop()
                context[row] = tokens[row, j + 1]
                free = [t for t in free if t not in (j, j + 1)]
            if task != "induction":
                i = free.pop(int(rng.integers(len(free))))
                s = int(rng.choice(self.subjects))
                tokens[row, i], parametric[row] = s, s + self.config.n_facts
            for t in free:
                tokens[row, t] = noise.pop()
        return TheoryPrompts(task, torch.from_numpy(tokens), torch.from_numpy(parametric), torch.from_numpy(context))


def _vectors(config: TheoryConfig) -> Float[Tensor, "n_vectors d"]:
    gen = torch.Generator().manual_seed(config.seed)
    raw = torch.randn(config.d_model, config.n_vectors, generator=gen, dtype=torch.float64)
    if config.orthogonal:
        return torch.linalg.qr(raw).Q.T.contiguous()
    return (raw / raw.norm(dim=0, keepdim=True)).T.contiguous()


def _build_model(config: TheoryConfig) -> Model:
    V, T, d, F = config.vocab, config.seq_len, config.d_model, config.n_facts
    vec = _vectors(config)
    phi, phi2, mu = vec[:V], vec[V : 2 * V], vec[2 * V : 3 * V]
    pos, pos2 = vec[3 * V : 3 * V + T], vec[3 * V + T :]
    subjects = range(1, 1 + F)
    noise = range(1 + 2 * F, V)

    kq0 = config.prev_token_score * sum(torch.outer(pos[t], pos[t + 1]) for t in range(T - 1))
    ov0 = phi2.T @ phi + pos2.T @ pos  # phi(v) -> phi'(v), p_t -> p'_t
    kq_ind = config.c1 * torch.outer(phi2[0], phi[0])
    kq_fact = config.c2 * sum(torch.outer(phi[s], phi[0]) for s in subjects)
    ov_ind = config.c3 * sum(torch.outer(mu[k], phi[k]) for k in noise)
    ov_fact = config.c4 * sum(torch.outer(mu[s + F], phi[s]) for s in subjects)
    if config.superposition:
        heads = [[(kq0, ov0)], [(kq_ind + kq_fact, ov_ind + ov_fact)]]
    else:
        zero = torch.zeros(d, d, dtype=torch.float64)
        heads = [[(kq0, ov0), (zero, zero)], [(kq_ind, ov_ind), (kq_fact, ov_fact)]]
    model = blank_attention_model(
        n_layers=2,
        n_heads=len(heads[1]),
        d_model=d,
        d_head=d,
        d_vocab=V,
        n_ctx=T,
        seed=config.seed,
        name=f"juice-theory-{config.label}",
    )
    eye = torch.eye(d)
    weights = {"embed.W_E": phi, "pos_embed.W_pos": pos, "unembed.W_U": mu.T}
    for layer, layer_heads in enumerate(heads):
        # score(key x_i, query x_T) = x_T W_Q W_K^T x_i = x_i^T W_KQ x_T; value = W_OV x_i.
        kq, ov = (torch.stack([m.float() for m in mats]) for mats in zip(*layer_heads))
        attn = {"W_Q": eye.expand_as(kq), "W_K": kq, "W_V": ov.transpose(1, 2), "W_O": eye.expand_as(kq)}
        weights |= {f"blocks.{layer}.attn.{name}": value for name, value in attn.items()}
    write_weights(model, weights)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def steering_logits(
    model: Model, tokens: Int[Tensor, "n seq"], heads: Sequence[Head], beta: float, method: str
) -> Float[Tensor, "n vocab"]:
    """Final-position logits with every head in ``heads`` steered by ``beta``.

    ``run_once``: each head's ``z`` times ``1 + beta`` in one pass (:class:`ScaleHead`; JuNe, and
    PH3 at ``beta = -1``). ``run_twice``: a clean pass records ``z``, a second pass adds ``beta``
    times it (:class:`AddHeadOutput`; JuICE).
    """
    if method not in METHODS:
        raise ValueError(f"Unknown method {method!r}; use one of {METHODS}.")
    with torch.inference_mode():
        if method == "run_once":
            edits = [ScaleHead(layer, head, 1.0 + beta) for layer, head in heads]
        else:
            names = {f"blocks.{layer}.attn.hook_z" for layer, _ in heads}
            _, cache = model.run_with_cache(tokens, names_filter=lambda name: name in names)
            edits = [
                AddHeadOutput(layer, head, beta, cache[f"blocks.{layer}.attn.hook_z"][:, :, head])
                for layer, head in heads
            ]
        with intervene(model, edits):
            return model(tokens)[:, -1, :].float()


TIE = 1e-4  # margin to count as answered: a silenced layer 1 ties every logit up to rounding


def _scores(logits: Tensor, answer: Tensor) -> tuple[float, float]:
    """Mean probability of ``answer`` and the share of rows where it is the argmax by > :data:`TIE`."""
    rows = torch.arange(len(answer))
    probs = logits.softmax(-1)[rows, answer]
    others = logits.scatter(1, answer[:, None], -torch.inf)
    top = logits[rows, answer] > others.max(-1).values + TIE
    return float(probs.mean()), float(top.float().mean())


def steer(
    toy: TheoryToy,
    betas: Sequence[float] = DEFAULT_BETAS,
    *,
    heads: Sequence[Head] | None = None,
    tasks: Sequence[str] = TASKS,
    n_prompts: int = 256,
    seed: int = 0,
) -> pd.DataFrame:
    """Run-once and run-twice steering of ``heads`` (the toy's context heads by default) at each
    strength ``beta``, on every task; one row per model x method x beta x task x target with
    ``p_clean, p, delta`` (mean probability of the target) and ``accuracy_clean, accuracy``
    (share of prompts where the target is the argmax by more than :data:`TIE`)."""
    heads = list(toy.context_heads if heads is None else heads)
    rows = []
    for task in tasks:
        data = toy.prompts(task, n_prompts, seed=seed)
        with torch.inference_mode():
            clean = toy.model(data.tokens)[:, -1, :].float()
        for method in METHODS:
            for beta in betas:
                logits = steering_logits(toy.model, data.tokens, heads, float(beta), method)
                for target, answer in (("parametric", data.parametric), ("context", data.context)):
                    if bool((answer < 0).any()):
                        continue
                    p_clean, acc_clean = _scores(clean, answer)
                    p, acc = _scores(logits, answer)
                    row = (toy.config.label, method, float(beta), task, target, p_clean, p, p - p_clean)
                    rows.append((*row, acc_clean, acc, len(answer)))
    return pd.DataFrame(rows, columns=STEER_COLUMNS)


def identify_heads(toy: TheoryToy, *, n_prompts: int = 256, seed: int = 0, threshold: float = 0.1) -> pd.DataFrame:
    """Knock out each head alone (:class:`ScaleHead`, scale 0) on conflict prompts: the change in
    the context and parametric answers' probabilities, and a ``role``: ``"context"`` when the
    context answer falls by more than ``threshold``, ``"parametric"`` when the fact does, else
    ``"neither"`` (stage 1 of a steering method, in miniature)."""
    data = toy.prompts("conflict", n_prompts, seed=seed)
    with torch.inference_mode():
        clean = toy.model(data.tokens)[:, -1, :].float()
    rows = []
    for layer in range(toy.model.cfg.n_layers):
        for head in range(toy.model.cfg.n_heads):
            logits = steering_logits(toy.model, data.tokens, [(layer, head)], -1.0, "run_once")
            d_ctx = _scores(logits, data.context)[0] - _scores(clean, data.context)[0]
            d_par = _scores(logits, data.parametric)[0] - _scores(clean, data.parametric)[0]
            role = "context" if d_ctx < -threshold else "parametric" if d_par < -threshold else "neither"
            rows.append({"layer": layer, "head": head, "delta_context": d_ctx, "delta_parametric": d_par, "role": role})
    return pd.DataFrame(rows)


def theory_study(
    config: TheoryConfig | None = None, betas: Sequence[float] = DEFAULT_BETAS, *, n_prompts: int = 256, seed: int = 0
) -> pd.DataFrame:
    """:func:`steer` on the superposed model and on its no-superposition control, each steering
    the heads that :func:`identify_heads` marks ``"context"``; the frames stacked."""
    config = config or TheoryConfig()
    frames = []
    for superposition in (True, False):
        toy = TheoryToy.build(replace(config, superposition=superposition))
        roles = identify_heads(toy, n_prompts=n_prompts, seed=seed)
        heads = [(int(r.layer), int(r.head)) for r in roles.itertuples() if r.role == "context"]
        frame = steer(toy, betas, heads=heads, n_prompts=n_prompts, seed=seed)
        frame["heads"] = " ".join(f"{layer}.{head}" for layer, head in heads)
        frames.append(frame)
    return pd.concat(frames, ignore_index=True)


def closed_form_logits(config: TheoryConfig, task: str, method: str | None = None, beta: float = 0.0) -> dict:
    """Logits of the parametric and the context answer at the final ``q`` (``nan`` when the task
    has no such answer), from the paper's attention algebra (Corollary 5.4, eqs. 37-38): clean
    (``method=None``) or with both context heads steered by ``beta``. Exact for orthonormal
    embeddings up to the previous-token head's ``exp(-C)`` leak."""
    if task not in TASKS:
        raise ValueError(f"Unknown task {task!r}; use one of {TASKS}.")
    if method not in (None, *METHODS):
        raise ValueError(f"Unknown method {method!r}; use None or one of {METHODS}.")
    c1, c2, c3, c4, T = config.c1, config.c2, config.c3, config.c4, config.seq_len
    has_ind, has_fact = task != "recall", task != "induction"
    a = 1.0 if method is None else 1.0 + beta  # factor on the previous-token head (both methods)

    def parts(factor: float) -> tuple[float, float]:
        """(fact, induction) logits of layer 1 when the induction cue's key carries ``factor``."""
        e_ind, e_fact = math.exp(factor * c1), math.exp(c2)
        if config.superposition:
            z = has_ind * e_ind + has_fact * e_fact + (T - has_ind - has_fact)
            return c4 * e_fact / z, c3 * e_ind / z
        return c4 * e_fact / (e_fact + T - 1), c3 * e_ind / (e_ind + T - 1)

    fact_now, ind_now = parts(a)
    fact_clean, ind_clean = parts(1.0)
    if method is None:
        fact, ind = fact_clean, ind_clean
    elif method == "run_once":  # layer 1's steered head is scaled as well
        fact = a * fact_now if config.superposition else fact_now
        ind = a * ind_now
    else:  # second pass plus beta times the clean pass's output of the steered layer-1 head
        fact = fact_now + beta * fact_clean if config.superposition else fact_now
        ind = ind_now + beta * ind_clean
    return {"parametric": fact if has_fact else math.nan, "context": ind if has_ind else math.nan}


def conflict_switch(
    config: TheoryConfig | None = None, c1_values: Sequence[float] = (3, 4, 4.5, 5.5, 6, 8), *, n_prompts: int = 128
) -> pd.DataFrame:
    """Corollary 5.4 on the model: for each induction score ``c1``, the share of conflict prompts
    answered with the fact / the induction token, next to the paper's rule (``parametric`` iff
    ``exp(c1) c3 < exp(c2) c4``)."""
    config = config or TheoryConfig()
    rows = []
    for c1 in c1_values:
        toy = TheoryToy.build(replace(config, c1=float(c1)))
        data = toy.prompts("conflict", n_prompts, seed=config.seed)
        with torch.inference_mode():
            logits = toy.model(data.tokens)[:, -1, :].float()
        rule = math.exp(c1) * config.c3 < math.exp(config.c2) * config.c4
        shares = _scores(logits, data.parametric)[1], _scores(logits, data.context)[1]
        rows.append((config.label, float(c1), "parametric" if rule else "context", *shares))
    return pd.DataFrame(rows, columns=["model", "c1", "predicted", "share_parametric", "share_context"])
