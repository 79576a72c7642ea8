"""The task and the model of the noisy in-context recall toy (see :mod:`cpsuper.toys.noisy_recall`
for the probes and the training loop): settings, the bigram chain and its noisy sequences, and the
two-layer TransformerLens model.

Each sequence has its own output token ``ybar``. Whenever the fixed trigger token appears, the
next token is ``ybar`` with probability ``1 - alpha`` and a shared noise token otherwise; all
other transitions follow a bigram chain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..backend import Model
from .build import toy_parameter, toy_transformer, write_weights
from .noisy_recall_variants import (
    FEED_FORWARD_KINDS,
    FeedForward,
    check_fractions,
    frozen_feed_forward_names,
    set_feed_forward,
)

__all__ = [
    "BigramChain",
    "NoisyRecallConfig",
    "RecallBatch",
    "RecallPositions",
    "noisy_recall_model",
    "position_answers",
    "recall_mask",
    "sample_recall_batch",
    "trainable_parameter_names",
    "weight_shapes",
]

RecallPositions = Literal["seen", "repeat"]


@dataclass(frozen=True)
class NoisyRecallConfig:
    """Data, model and optimiser settings of the noisy in-context recall toy.

    The defaults are a small CPU configuration (trains in seconds, fixed seed);
    :meth:`paper` gives the paper's. Token ids ``0..n_tokens-1`` are ordinary tokens and
    ``n_tokens`` is the noise token (the paper's ``N + 1``).

    ``recall_positions`` chooses where the loss is taken and the probes read: ``"seen"`` (the
    trigger positions at which ``ybar`` has already followed an earlier trigger, i.e. where
    recall from context is possible) or ``"repeat"`` (every second-or-later trigger occurrence,
    as in the paper's released code). ``trigger_rate`` and ``concentration`` shape the
    synthetic bigram chain (see :meth:`BigramChain.random`); they are unused when a chain is
    passed to :func:`train_noisy_recall`.

    Variants of the paper's appendix A: ``extra_triggers`` adds trigger tokens, each with its
    own output token (Figure 8 uses five); ``ffn`` picks each layer's feed-forward block,
    ``"mlp"`` (two-layer ReLU), ``"linear"`` (one ``d x d`` matrix) or ``"none"`` (Figures
    10-12); ``value_truncation_fractions`` adds probes with the first layer's ``W_O`` truncated
    to rank ``floor(rho * d_model)``, ``rho`` in (0, 1] (Figure 12).
    """

    n_tokens: int = 24
    seq_len: int = 48
    alpha: float = 0.5
    trigger: int = 0
    trigger_rate: float = 0.12
    concentration: float = 0.5
    d_model: int = 64
    mlp_mult: int = 4
    batch_size: int = 64
    steps: int = 200
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 1e-4
    recall_positions: RecallPositions = "seen"
    checkpoint_every: int = 20
    extra_checkpoints: tuple[int, ...] = (1, 2, 3, 5, 10, 15)
    n_test: int = 128
    truncation_fractions: tuple[float, ...] = (0.1, 0.25)
    extra_triggers: tuple[int, ...] = ()
    ffn: tuple[FeedForward, FeedForward] = ("mlp", "mlp")
    value_truncation_fractions: tuple[float, ...] = ()
    seed: int = 0
    device: str = "cpu"

    def __post_init__(self):
        if not 0 <= self.alpha < 1:
            raise ValueError(f"alpha must be in [0, 1), got {self.alpha}.")
        if not 0 <= self.trigger < self.n_tokens:
            raise ValueError(f"trigger must be an ordinary token id in 0..{self.n_tokens - 1}, got {self.trigger}.")
        if self.n_tokens < 3:
            raise ValueError("n_tokens must be at least 3 (a trigger and at least two possible outputs).")
        if self.recall_positions not in ("seen", "repeat"):
            raise ValueError(f"recall_positions must be 'seen' or 'repeat', got {self.recall_positions!r}.")
        if any(not 0 < f < 1 for f in self.truncation_fractions):
            raise ValueError(f"truncation_fractions must lie in (0, 1), got {self.truncation_fractions}.")
        triggers = self.triggers
        if len(set(triggers)) != len(triggers) or any(not 0 <= t < self.n_tokens for t in triggers):
            raise ValueError(
                f"extra_triggers must be distinct ordinary token ids in 0..{self.n_tokens - 1} other than "
                f"trigger={self.trigger}, got {self.extra_triggers}."
            )
        if self.n_tokens - len(triggers) < 2:
            raise ValueError(f"{len(triggers)} triggers leave fewer than two possible outputs; raise n_tokens.")
        if len(self.ffn) != 2 or any(kind not in FEED_FORWARD_KINDS for kind in self.ffn):
            raise ValueError(f"ffn must be two of {FEED_FORWARD_KINDS} (one per layer), got {self.ffn!r}.")
        check_fractions(self.value_truncation_fractions, "value_truncation_fractions")

    @property
    def noise(self) -> int:
        """Id of the noise token (one past the ordinary tokens)."""
        return self.n_tokens

    @property
    def d_vocab(self) -> int:
        return self.n_tokens + 1

    @property
    def triggers(self) -> tuple[int, ...]:
        """Every trigger token: ``trigger`` first, then ``extra_triggers``."""
        return (self.trigger, *self.extra_triggers)

    @classmethod
    def paper(cls, **overrides) -> NoisyRecallConfig:
        """The paper's setting: N = 65, d = 256, T = 256, batch 512, alpha = 0.5, SGD with
        learning rate 0.03, momentum 0.9 and weight decay 1e-4, 2000 steps, 512 test sequences.

        The paper estimates the chain from tiny Shakespeare (not available offline); here the
        chain is synthetic unless one from :meth:`BigramChain.from_text` is passed, with a
        trigger rate near the frequency of the space character in English text.
        """
        settings = {
            "n_tokens": 65,
            "seq_len": 256,
            "alpha": 0.5,
            "trigger_rate": 0.15,
            "d_model": 256,
            "batch_size": 512,
            "steps": 2000,
            "lr": 0.03,
            "checkpoint_every": 100,
            "extra_checkpoints": (1, 2, 3, 5, 10, 20, 50),
            "n_test": 512,
            "truncation_fractions": (0.1, 0.2),
        }
        settings.update(overrides)
        return cls(**settings)


# ---------------------------------------------------------------------------------------------
# Data


@dataclass(frozen=True)
class BigramChain:
    """A first-order Markov chain over the ordinary tokens: ``unigram`` for the first token and
    ``bigram[i]`` for the token after ``i``. After the noise token the chain restarts from
    ``unigram`` (the paper leaves this transition unspecified)."""

    unigram: Float[Tensor, " n_tokens"]
    bigram: Float[Tensor, "n_tokens n_tokens"]

    @property
    def n_tokens(self) -> int:
        return self.unigram.shape[0]

    @classmethod
    def random(
        cls,
        n_tokens: int,
        trigger: int | tuple[int, ...],
        trigger_rate: float = 0.12,
        concentration: float = 0.5,
        generator: torch.Generator | None = None,
    ) -> BigramChain:
        """Rows drawn from a symmetric Dirichlet(``concentration``), then mixed with a point mass
        on the trigger so that about a ``trigger_rate`` share of transitions lead to it (the
        trigger must be frequent for recall to be learnable at short context lengths). Several
        triggers share ``trigger_rate`` equally. The first token follows the chain's stationary
        distribution."""
        if not 0 <= trigger_rate < 1:
            raise ValueError(f"trigger_rate must be in [0, 1), got {trigger_rate}.")
        conc = torch.full((n_tokens, n_tokens), float(concentration))
        rows = torch._standard_gamma(conc, generator=generator)
        rows = rows / rows.sum(-1, keepdim=True)
        rows = (1 - trigger_rate) * rows
        triggers = [trigger] if isinstance(trigger, int) else list(trigger)
        rows[:, triggers] += trigger_rate / len(triggers)
        return cls(unigram=_stationary(rows), bigram=rows)

    @classmethod
    def from_text(cls, text: str, smoothing: float = 0.0) -> tuple[BigramChain, list[str]]:
        """Character unigram and bigram statistics of ``text`` (the paper uses tiny Shakespeare).

        Returns the chain and the sorted characters (token ``i`` is ``chars[i]``). Characters
        never followed by anything get the unigram as their row. A config for this chain needs
        ``n_tokens=len(chars)`` and, as in the paper, the most frequent character as trigger:
        ``int(chain.unigram.argmax())``.
        """
        chars = sorted(set(text))
        if len(chars) < 3:
            raise ValueError("The text needs at least 3 distinct characters.")
        index = {c: i for i, c in enumerate(chars)}
        ids = torch.tensor([index[c] for c in text])
        n = len(chars)
        unigram = torch.bincount(ids, minlength=n).double() + smoothing
        counts = torch.bincount(ids[:-1] * n + ids[1:], minlength=n * n).double().view(n, n) + smoothing
        unigram = unigram / unigram.sum()
        totals = counts.sum(-1, keepdim=True)
        bigram = torch.where(totals > 0, counts / totals.clamp_min(1e-12), unigram.expand(n, n))
        return cls(unigram=unigram.float(), bigram=bigram.float()), chars


def _stationary(rows: Float[Tensor, "n n"], iters: int = 500) -> Float[Tensor, " n"]:
    p = torch.full((rows.shape[0],), 1.0 / rows.shape[0], dtype=torch.float64)
    rows = rows.double()
    for _ in range(iters):
        p = p @ rows
    return (p / p.sum()).float()


@dataclass(frozen=True)
class RecallBatch:
    """A batch of noisy-recall sequences: model inputs, next-token targets, each sequence's
    output token (``[batch]``; ``[batch, n_triggers]`` with several triggers), the positions
    where in-context recall is scored, and at each position the output its trigger calls for
    (``answers``; the first trigger's output at positions that hold no trigger)."""

    tokens: Int[Tensor, "batch pos"]
    targets: Int[Tensor, "batch pos"]
    ybar: Int[Tensor, " batch"] | Int[Tensor, "batch n_triggers"]
    recall: Bool[Tensor, "batch pos"]
    answers: Int[Tensor, "batch pos"]

    def to(self, device) -> RecallBatch:
        return RecallBatch(*(t.to(device) for t in (self.tokens, self.targets, self.ybar, self.recall, self.answers)))


def _as_triggers(trigger: int | tuple[int, ...] | list[int]) -> list[int]:
    return [int(trigger)] if isinstance(trigger, int) else [int(t) for t in trigger]


def _slots(tokens: Tensor, triggers: list[int], vocab: int) -> Tensor:
    """Index of each token among ``triggers`` (-1 for other tokens)."""
    slot = torch.full((vocab,), -1, dtype=torch.long, device=tokens.device)
    slot[triggers] = torch.arange(len(triggers), device=tokens.device)
    return slot[tokens]


def position_answers(tokens: Int[Tensor, "batch pos"], ybar: Tensor, trigger) -> Int[Tensor, "batch pos"]:
    """At each position, the output token of the trigger found there (``ybar[:, 0]`` elsewhere)."""
    triggers = _as_triggers(trigger)
    table = ybar[:, None] if ybar.dim() == 1 else ybar
    slot = _slots(tokens, triggers, int(max(tokens.max().item(), *triggers)) + 1)
    return table.gather(1, slot.clamp_min(0))


def sample_recall_batch(
    chain: BigramChain,
    n_seqs: int,
    seq_len: int,
    trigger: int | tuple[int, ...],
    alpha: float,
    generator: torch.Generator | None = None,
    recall_positions: RecallPositions = "seen",
) -> RecallBatch:
    """Sample ``n_seqs`` sequences of ``seq_len`` tokens (plus one more for the last target).

    ``ybar`` is uniform over the ordinary tokens other than the trigger (a trigger as its own
    output would chain triggers together). After every trigger the next token is the noise
    token (id ``chain.n_tokens``) with probability ``alpha``, ``ybar`` otherwise. With several
    triggers (a tuple) each has its own output, drawn independently.
    """
    n = chain.n_tokens
    noise = n
    triggers = _as_triggers(trigger)
    # Cumulative rows, with one extra row for "after the noise token" (= the unigram).
    cum = torch.cat([chain.bigram, chain.unigram[None]]).cumsum(-1)
    cum[:, -1] = 1.0 + 1e-6  # guard against rounding in the last bin
    others = torch.tensor([t for t in range(n) if t not in triggers])
    ybar = others[torch.randint(len(others), (n_seqs, len(triggers)), generator=generator)]
    z = torch.empty(n_seqs, seq_len + 1, dtype=torch.long)
    first = torch.rand(n_seqs, 1, generator=generator)
    z[:, 0] = torch.searchsorted(chain.unigram.cumsum(-1)[None].expand(n_seqs, n).contiguous(), first)[:, 0]
    z[:, 0] = z[:, 0].clamp_max(n - 1)
    for t in range(seq_len):
        prev = z[:, t]
        u = torch.rand(n_seqs, 1, generator=generator)
        nxt = torch.searchsorted(cum[prev], u)[:, 0].clamp_max(n - 1)
        is_noise = torch.rand(n_seqs, generator=generator) < alpha
        slot = _slots(prev, triggers, n + 1)
        answer = ybar.gather(1, slot.clamp_min(0)[:, None])[:, 0]
        forced = torch.where(is_noise, torch.full_like(answer, noise), answer)
        z[:, t + 1] = torch.where(slot >= 0, forced, nxt)
    tokens, targets = z[:, :-1].contiguous(), z[:, 1:].contiguous()
    if len(triggers) == 1:
        ybar = ybar[:, 0]
    recall = recall_mask(tokens, ybar, trigger, recall_positions)
    return RecallBatch(tokens, targets, ybar, recall, position_answers(tokens, ybar, trigger))


def recall_mask(
    tokens: Int[Tensor, "batch pos"],
    ybar: Int[Tensor, " batch"] | Int[Tensor, "batch n_triggers"],
    trigger: int | tuple[int, ...],
    recall_positions: RecallPositions = "seen",
) -> Bool[Tensor, "batch pos"]:
    """Trigger positions where recall is scored: ``"seen"`` = the trigger's output already
    followed an earlier occurrence of the same trigger; ``"repeat"`` = the trigger's second or
    later occurrence. With several triggers, each is scored on its own."""
    table = ybar[:, None] if ybar.dim() == 1 else ybar
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    for k, q in enumerate(_as_triggers(trigger)):
        is_trigger = tokens == q
        if recall_positions == "repeat":
            mask |= is_trigger & (is_trigger.long().cumsum(-1) >= 2)
            continue
        after_trigger = torch.zeros_like(is_trigger)
        after_trigger[:, 1:] = is_trigger[:, :-1]
        shown = after_trigger & (tokens == table[:, k : k + 1])
        mask |= is_trigger & (shown.long().cumsum(-1) > 0)
    return mask


# ---------------------------------------------------------------------------------------------
# Model

_TRAINABLE = ("attn.W_O", "attn.W_K", "attn.W_V", "mlp.W_in", "mlp.W_out")


def trainable_parameter_names(model: Model, ffn: tuple[str, str] = ("mlp", "mlp")) -> list[str]:
    """The weights the toy trains (TransformerLens names): key, value and output matrices and both
    MLP matrices of each block. Embeddings, positions, unembedding, ``W_Q`` (the identity, so that
    ``W_K`` is the paper's ``W_KQ``) and all biases (zero) stay fixed. With ``ffn`` variants, a
    ``"linear"`` layer trains only ``W_out`` (its ``W_in`` is a fixed identity) and a ``"none"``
    layer trains neither MLP matrix."""
    frozen = frozen_feed_forward_names(ffn)
    names = [f"blocks.{layer}.{weight}" for layer in range(model.cfg.n_layers) for weight in _TRAINABLE]
    return [name for name in names if name not in frozen]


def weight_shapes(cfg: NoisyRecallConfig) -> dict[str, tuple[int, ...]]:
    """TransformerLens name -> shape of every weight of the toy, in the order HookedTransformer
    registers them (the order the initialisation draws its random numbers in)."""
    d, mlp = cfg.d_model, cfg.mlp_mult * cfg.d_model
    shapes: dict[str, tuple[int, ...]] = {"embed.W_E": (cfg.d_vocab, d), "pos_embed.W_pos": (cfg.seq_len, d)}
    for layer in range(2):
        attn = {"W_Q": (1, d, d), "W_O": (1, d, d), "b_Q": (1, d), "b_O": (d,)}
        attn |= {"W_K": (1, d, d), "W_V": (1, d, d), "b_K": (1, d), "b_V": (1, d)}
        mlp_shapes = {"W_in": (d, mlp), "b_in": (mlp,), "W_out": (mlp, d), "b_out": (d,)}
        shapes |= {f"blocks.{layer}.attn.{name}": shape for name, shape in attn.items()}
        shapes |= {f"blocks.{layer}.mlp.{name}": shape for name, shape in mlp_shapes.items()}
    return shapes | {"unembed.W_U": (d, cfg.d_vocab), "unembed.b_U": (cfg.d_vocab,)}


def noisy_recall_model(
    cfg: NoisyRecallConfig, generator: torch.Generator | None = None, backend: str | None = None
) -> Model:
    """The paper's two-layer model: one head per layer (``d_head = d_model``, scores scaled by
    ``1/sqrt(d_model)``), ReLU MLPs of width ``mlp_mult * d_model`` (or the ``cfg.ffn``
    variants), no normalization, no biases.

    Embeddings and positions are N(0, 1) and the unembedding uniform in +-1/sqrt(d), all
    frozen; the trained matrices start uniform in +-1/sqrt(fan_in) (PyTorch's ``Linear``
    default). ``generator`` defaults to one seeded with ``cfg.seed``; the same seed gives the same
    weights on either ``backend`` (see :func:`~cpsuper.toys.build.toy_transformer`).
    """
    d = cfg.d_model
    model = toy_transformer(
        n_layers=2,
        d_model=d,
        n_heads=1,
        d_head=d,
        d_mlp=cfg.mlp_mult * d,
        d_vocab=cfg.d_vocab,
        n_ctx=cfg.seq_len,
        act_fn="relu",
        normalization_type=None,
        positional_embedding_type="standard",
        init_weights=False,
        default_prepend_bos=False,
        model_name="noisy-recall-toy",
        device=cfg.device,
        backend=backend,
    )
    gen = generator if generator is not None else torch.Generator().manual_seed(cfg.seed)

    weights = {}
    for name, shape in weight_shapes(cfg).items():
        kind = name.rsplit(".", 1)[-1]
        if kind in ("W_E", "W_pos"):
            weights[name] = torch.randn(shape, generator=gen)
        elif kind == "W_Q":
            weights[name] = torch.eye(d)[None]
        elif kind.startswith("W_"):  # W_O, W_K, W_V, W_in, W_out, W_U
            fan_in = cfg.mlp_mult * d if kind == "W_out" else d
            weights[name] = (torch.rand(shape, generator=gen) * 2 - 1) / math.sqrt(fan_in)
        else:  # biases
            weights[name] = torch.zeros(shape)
    write_weights(model, weights)
    for layer, kind in enumerate(cfg.ffn):
        if kind != "mlp":
            set_feed_forward(model, layer, kind, gen)
    for param in model.parameters():
        param.requires_grad_(False)
    for name in trainable_parameter_names(model, cfg.ffn):
        toy_parameter(model, name).requires_grad_(True)
    if str(cfg.device) != "cpu":  # (HookedTransformer.to would print a notice; cfg.device is already set)
        torch.nn.Module.to(model, cfg.device)
    return model
