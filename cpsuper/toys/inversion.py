"""One-layer toy of context-parametric inversion: context reliance rises, then falls, during finetuning.

The setting is the theory section of "Context-Parametric Inversion: Why Instruction Finetuning Can
Worsen Context Reliance".  Inputs are three tokens ``[c, s, r]``: a context token ``c`` (which is
also the answer it points to), a subject ``s`` and a relation/query token ``r``.  One attention head
reads from ``c`` and ``s`` at the position of ``r``.  Every subject embedding shares a direction
``theta_S`` and every context embedding a direction ``theta_C``, so whatever the head learns about
those shared directions carries over to subjects and contexts it never saw.

Finetuning mixes two kinds of examples, both labelled with the context's answer:

* ``"C"`` (context-critical): the subject tells the pretrained model nothing about the answer;
* ``"C+S"``: the subject is memorized and its memorized answer *agrees* with the context.

Early on the C examples have the larger loss and pull attention toward ``theta_C``; once they are fit,
the C+S examples dominate and pull it back toward ``theta_S`` (the subject alone already predicts
their label).  On counterfactual test prompts, whose memorized subject disagrees with the context,
the context reliance ``M_C = p(ctx) / (p(ctx) + p(param))`` therefore rises and then falls.  Leaving
the C+S examples out (``drop_context_subject=True``, the paper's context-critical filtering) removes
the fall.

The model is an attention-only TransformerLens model (see :mod:`cpsuper.toys.common`) that
reproduces the paper's parametrisation exactly: frozen embeddings with the shared directions, a frozen
value matrix built so that every token's value readout is the paper's pretrained table, a frozen tied
unembedding, and a full trainable ``W_KQ`` started at zero, trained by full-batch gradient descent.
The relation token is masked as a key (the paper's zero self-attention) by a ``-1e4`` entry in
``W_KQ`` that receives exactly zero gradient.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, replace

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from ..backend import Model
from .common import Trajectory, attention_toy_model, checkpoint_steps, last_position, load_config, train_attention_toy

__all__ = [
    "InversionConfig",
    "InversionData",
    "InversionToy",
    "context_reliance_closed_form",
    "inversion_measures",
    "make_inversion_data",
]


_MASK = 1e4  # attention-score penalty that removes the relation token as a key (exp(-1e4) == 0)
KINDS = ("C", "C+S")


@dataclass(frozen=True)
class InversionConfig:
    """Sizes, pretrained readouts and training settings of the inversion toy.

    The defaults (small, seeded) train in about a second on one CPU core and show the rise and
    fall of ``M_C``.  Names follow the paper: ``n_subjects`` = K_S, ``n_answers`` = K_A,
    ``o_c``/``o_r`` the baseline value readouts, ``delta_c`` the probability a context token alone
    gives its own answer, ``delta_m`` the probability a memorized subject alone gives its answer.
    """

    n_subjects: int = 30
    n_answers: int = 60
    n_context_only: int = 10
    n_context_subject: int = 10
    n_test: int = 5
    o_c: float = 1.0
    o_r: float = 0.5
    delta_c: float = 0.1
    delta_m: float = 0.5
    lr: float = 5.0
    steps: int = 40
    checkpoint_every: int = 1
    drop_context_subject: bool = False
    train_value: bool = False
    seed: int = 0

    def __post_init__(self):
        used_subjects = self.n_context_only + self.n_context_subject + self.n_test
        used_answers = self.n_context_only + self.n_context_subject + 2 * self.n_test
        if used_subjects > self.n_subjects or used_answers > self.n_answers:
            raise ValueError(
                f"Not enough tokens: the examples need {used_subjects} subjects and {used_answers} answers, "
                f"the vocabulary has {self.n_subjects} and {self.n_answers}."
            )
        if self.n_test < 1 or self.n_context_only < 0 or self.n_context_subject < 0:
            raise ValueError("Example counts must be non-negative and n_test at least 1.")
        if not (0 < self.delta_c < 1 and 0 < self.delta_m < 1):
            raise ValueError("delta_c and delta_m are probabilities strictly between 0 and 1.")
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}.")
        checkpoint_steps(self.steps, self.checkpoint_every)  # validates checkpoint_every
        broken = []
        if self.n_answers <= self.n_subjects:
            broken.append("K_A > K_S")
        if self.delta_c <= 3 / (self.n_answers - 1):
            broken.append("delta_c > 3/(K_A-1)")
        if self.delta_m <= 2 * self.delta_c:
            broken.append("delta_m > 2 delta_c")
        if self.n_context_only < self.n_context_subject:
            broken.append("|D_C| >= |D_C+S|")
        if broken:
            warnings.warn(
                "This configuration leaves the paper's assumptions (" + ", ".join(broken) + "); "
                "the inversion is not guaranteed.",
                stacklevel=3,
            )

    @classmethod
    def theorem(cls, **overrides) -> InversionConfig:
        """The regime of the paper's Theorem 1: equal numbers of C and C+S points and one large
        full-batch step, after which the next step already lowers ``M_C`` (two steps in all).

        The paper states conditions, not numbers; sizes and readouts here are the defaults.
        """
        return replace(cls(lr=50.0, steps=2, checkpoint_every=1), **overrides)

    def ablated(self) -> InversionConfig:
        """The same run without the C+S examples (context-critical data only)."""
        return replace(self, drop_context_subject=True)


@dataclass(frozen=True, eq=False)
class InversionData:
    """Token sequences of the inversion toy and the pretrained value readouts they imply.

    Token ids: subjects ``0..K_S-1``, answer/context tokens ``K_S..K_S+K_A-1``, relation ``K_S+K_A``.
    ``train_tokens`` rows are ``[c, s, r]`` with label ``c``; ``train_kind`` says C or C+S for each.
    ``test_tokens`` are counterfactual: the subject is memorized with ``test_param_answer``, the
    context says something else.  ``readout[y, x]`` is ``phi(y)^T W_V phi(x)``, the pretrained value
    readout of input token ``x`` for output token ``y``; ``embed[t]`` is ``phi(t)``.
    """

    train_tokens: Int[Tensor, "n 3"]
    train_kind: tuple[str, ...]
    test_tokens: Int[Tensor, "m 3"]
    test_param_answer: Int[Tensor, " m"]
    readout: Float[Tensor, "vocab vocab"]
    embed: Float[Tensor, "vocab d"]
    theta_subject: Float[Tensor, " d"]
    theta_context: Float[Tensor, " d"]
    relation: int

    @property
    def vocab_size(self) -> int:
        return self.embed.shape[0]

    def train_mask(self, kinds: tuple[str, ...] = KINDS) -> Tensor:
        return torch.tensor([k in kinds for k in self.train_kind])


def make_inversion_data(config: InversionConfig = InversionConfig()) -> InversionData:
    """Draw the C, C+S and counterfactual test examples and build the pretrained readout table.

    Each example uses its own subject and context token (so every (subject, answer) pair appears
    once); which tokens play which role is a seeded random draw.
    """
    cfg = config
    k_s, k_a = cfg.n_subjects, cfg.n_answers
    vocab = k_s + k_a + 1
    relation = vocab - 1
    rng = np.random.default_rng(cfg.seed)
    subjects = rng.permutation(k_s)
    answers = k_s + rng.permutation(k_a)
    n_c, n_cs, n_t = cfg.n_context_only, cfg.n_context_subject, cfg.n_test

    # Pretrained value readouts (the paper's Assumption 6): answers read o_c from everything, the
    # relation token o_r, subjects 0; a context token points to itself with probability delta_c;
    # a memorized subject points to its answer with probability delta_m.
    log_z = math.log((k_a - 1) * math.exp(cfg.o_c) + math.exp(cfg.o_r) + k_s)
    v_context = math.log(cfg.delta_c / (1 - cfg.delta_c)) + log_z
    v_memory = math.log(cfg.delta_m / (1 - cfg.delta_m)) + log_z
    readout = torch.zeros(vocab, vocab, dtype=torch.float64)
    readout[k_s : k_s + k_a, :] = cfg.o_c
    readout[relation, :] = cfg.o_r
    idx = torch.arange(k_s, k_s + k_a)
    readout[idx, idx] = v_context

    train, kinds = [], []
    for i in range(n_c + n_cs):
        s, c = int(subjects[i]), int(answers[i])
        train.append([c, s, relation])
        kind = "C" if i < n_c else "C+S"
        kinds.append(kind)
        if kind == "C+S":
            readout[c, s] = v_memory
    test, param = [], []
    for k in range(n_t):
        s = int(subjects[n_c + n_cs + k])
        a = int(answers[n_c + n_cs + 2 * k])
        c = int(answers[n_c + n_cs + 2 * k + 1])
        readout[a, s] = v_memory
        test.append([c, s, relation])
        param.append(a)

    # Embeddings on an orthonormal basis (Assumptions 2-4): phi(s) = (e_s + theta_S)/sqrt 2,
    # phi(c) = (e_c + theta_C)/sqrt 2, phi(r) a basis vector of its own.
    d = vocab + 2
    basis = torch.eye(d, dtype=torch.float64)
    theta_s, theta_c = basis[vocab - 1], basis[vocab]
    embed = torch.zeros(vocab, d, dtype=torch.float64)
    for t in range(k_s):
        embed[t] = (basis[t] + theta_s) / math.sqrt(2)
    for t in range(k_s, k_s + k_a):
        embed[t] = (basis[t] + theta_c) / math.sqrt(2)
    embed[relation] = basis[vocab + 1]
    return InversionData(
        train_tokens=torch.tensor(train, dtype=torch.long).reshape(-1, 3),
        train_kind=tuple(kinds),
        test_tokens=torch.tensor(test, dtype=torch.long),
        test_param_answer=torch.tensor(param, dtype=torch.long),
        readout=readout,
        embed=embed,
        theta_subject=theta_s,
        theta_context=theta_c,
        relation=relation,
    )


def _pretrained_model(data: InversionData, train_value: bool = False) -> Model:
    """The pretrained state: ``W_V`` realises ``data.readout`` exactly, ``W_KQ`` is zero."""
    phi = data.embed.T  # [d, vocab], linearly independent columns
    gram_inv = torch.linalg.inv(phi.T @ phi)
    w_v = phi @ gram_inv @ data.readout @ gram_inv @ phi.T  # phi^T W_V phi == readout
    r = data.embed[data.relation]
    w_kq = -_MASK * torch.outer(r, r)  # relation is never attended to (score -1e4, zero gradient)
    return attention_toy_model(
        data.embed.float(),
        phi.float(),
        w_kq.float(),
        w_v.float(),
        n_ctx=3,
        train_kq=True,
        train_v=train_value,
        name="inversion-toy",
    )


def inversion_measures(model: Model, data: InversionData) -> dict[str, float]:
    """The paper's probes on one model: counterfactual context reliance and attention, train loss.

    * ``M_C``: mean over counterfactual test prompts of ``p(ctx) / (p(ctx) + p(param))``;
    * ``attn_context`` / ``attn_subject``: attention from the final token to ``c`` / ``s`` on those
      prompts (mean);
    * ``loss_C`` / ``loss_C+S``: cross-entropy on each kind of training example (measured for both
      kinds also when a run leaves C+S out);
    * ``attn_context_C`` / ``attn_context_C+S``: attention to context on each kind;
    * ``score_theta_C`` / ``score_theta_S``: ``theta^T W_KQ phi(r)``, the shared-direction part of
      the attention scores, which is all an unseen prompt sees.
    """
    with torch.no_grad():
        logits, pattern = last_position(model, data.test_tokens)
        logp = logits.log_softmax(-1)
        idx = torch.arange(len(data.test_tokens))
        lp_ctx = logp[idx, data.test_tokens[:, 0]]
        lp_par = logp[idx, data.test_param_answer]
        m_c = torch.sigmoid(lp_ctx - lp_par)  # p_c / (p_c + p_a)
        out = {
            "M_C": m_c.mean().item(),
            "attn_context": pattern[:, 0].mean().item(),
            "attn_subject": pattern[:, 1].mean().item(),
        }
        tr_logits, tr_pattern = last_position(model, data.train_tokens)
        losses = F.cross_entropy(tr_logits, data.train_tokens[:, 0], reduction="none")
        for kind in KINDS:
            mask = data.train_mask((kind,))
            if mask.any():
                out[f"loss_{kind}"] = losses[mask].mean().item()
                out[f"attn_context_{kind}"] = tr_pattern[mask, 0].mean().item()
        w_kq = model.blocks[0].attn.W_K[0, : data.embed.shape[1]].double()
        r = data.embed[data.relation]
        out["score_theta_C"] = (data.theta_context @ w_kq @ r).item()
        out["score_theta_S"] = (data.theta_subject @ w_kq @ r).item()
    return out


def context_reliance_closed_form(sigma_c: float, config: InversionConfig = InversionConfig()) -> float:
    """``M_C`` of a counterfactual test prompt whose context gets attention ``sigma_c`` (and its
    subject ``1 - sigma_c``), from the pretrained readouts alone (W_V frozen).

    The context token's own logit is ``sigma_c v_C + (1 - sigma_c) o_c`` and the memorized answer's
    is ``sigma_c o_c + (1 - sigma_c) v_M``; ``M_C`` is the sigmoid of their difference.  It rises
    monotonically with ``sigma_c``, which is why ``M_C`` follows attention to context.
    """
    cfg = config
    log_z = math.log((cfg.n_answers - 1) * math.exp(cfg.o_c) + math.exp(cfg.o_r) + cfg.n_subjects)
    v_c = math.log(cfg.delta_c / (1 - cfg.delta_c)) + log_z
    v_m = math.log(cfg.delta_m / (1 - cfg.delta_m)) + log_z
    z_ctx = sigma_c * v_c + (1 - sigma_c) * cfg.o_c
    z_par = sigma_c * cfg.o_c + (1 - sigma_c) * v_m
    return 1 / (1 + math.exp(z_par - z_ctx))


class InversionToy:
    """Data, pretrained model, training run and probes of the inversion toy.

    >>> toy = InversionToy().train()          # default: CI size, about a second
    >>> toy.probes                            # tidy: run, step, measure, value
    >>> toy.model_at(5)                       # the model at checkpoint 5
    >>> both = pd.concat([toy.probes, InversionToy(toy.config.ablated()).train().probes])
    >>> cpsuper.plots.toys.plot_inversion(both)
    """

    def __init__(self, config: InversionConfig = InversionConfig()):
        self.config = config
        self.data = make_inversion_data(config)
        self.trajectory: Trajectory | None = None

    @property
    def run_name(self) -> str:
        return "C only" if self.config.drop_context_subject else "C + C+S"

    def pretrained_model(self) -> Model:
        """A fresh copy of the model before finetuning."""
        return _pretrained_model(self.data, self.config.train_value)

    def measure(self, model: Model) -> dict[str, float]:
        """:func:`inversion_measures` on this toy's data."""
        return inversion_measures(model, self.data)

    def train(self, progress: bool = False) -> InversionToy:
        """Full-batch gradient descent on the training examples, checkpointing every
        ``checkpoint_every`` steps (step 0 and the last step always)."""
        cfg = self.config
        torch.manual_seed(cfg.seed)
        model = self.pretrained_model().train()
        kinds = ("C",) if cfg.drop_context_subject else KINDS
        mask = self.data.train_mask(kinds)
        tokens, labels = self.data.train_tokens[mask], self.data.train_tokens[mask, 0]
        if len(tokens) == 0:
            raise ValueError("No training examples: every C example was configured away.")
        self.trajectory = train_attention_toy(
            model,
            lambda: (tokens, labels),
            self.measure,
            run=self.run_name,
            steps=cfg.steps,
            every=cfg.checkpoint_every,
            lr=cfg.lr,
            build=self.pretrained_model,
            progress=progress,
        )
        return self

    def _trained(self) -> Trajectory:
        if self.trajectory is None:
            raise RuntimeError("Train the toy first: InversionToy(config).train().")
        return self.trajectory

    @property
    def checkpoints(self) -> list[tuple[int, dict[str, Tensor]]]:
        return self._trained().checkpoints

    @property
    def probes(self) -> pd.DataFrame:
        return self._trained().probes

    def model_at(self, step: int) -> Model:
        """The model at checkpoint ``step``."""
        return self._trained().model_at(step)

    def model_factories(self):
        """``[(step, make_model), ...]`` for every checkpoint."""
        return self._trained().model_factories()

    def save(self, path) -> None:
        """Config, checkpoints and probes in one ``torch.save`` file; :meth:`load` restores them."""
        torch.save({"config": asdict(self.config), **self._trained().to_dict()}, path)

    @classmethod
    def load(cls, path) -> InversionToy:
        """Read a toy written by :meth:`save`."""
        blob = torch.load(path, weights_only=True)
        toy = cls(load_config(InversionConfig, blob["config"]))
        toy.trajectory = Trajectory.from_dict(blob, toy.pretrained_model)
        return toy
