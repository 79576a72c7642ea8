"""Noisy in-context recall: a two-layer transformer that learns a global "trigger -> noise"
association in its second MLP and an induction head in its attention (Chen, Bruna & Bietti,
"How Truncating Weights Improves Reasoning in Language Models", section 4).

Each sequence has its own output token ``ybar``. Whenever the fixed trigger token appears, the
next token is ``ybar`` with probability ``1 - alpha`` and a shared noise token otherwise; all
other transitions follow a bigram chain. The model can only learn ``ybar`` from the context
(an induction head), but the noise is the same for every sequence, so a feed-forward block can
store it as a global association. Dropping or rank-truncating the second-layer MLP on clean
data then removes the noise and leaves the in-context answer.

The model is a plain :class:`~transformer_lens.HookedTransformer` (two layers, one head,
ReLU MLPs, no normalization, frozen random embeddings, positions and unembedding), so every
cpsuper hook and intervention applies to it.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Literal

import pandas as pd
import plotly.graph_objects as go
import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from plotly.subplots import make_subplots
from torch import Tensor
from tqdm.auto import tqdm
from transformer_lens import HookedTransformer, HookedTransformerConfig

from ..interventions import Knockout, intervene
from ..models import _quiet_deprecation
from ._training import ToyRun, checkpoint_steps, snapshot

__all__ = [
    "BigramChain",
    "NoisyRecallConfig",
    "NoisyRecallRun",
    "RecallBatch",
    "noisy_recall_model",
    "plot_noisy_recall",
    "recall_mask",
    "recall_probes",
    "sample_recall_batch",
    "train_noisy_recall",
    "trainable_parameter_names",
    "trajectory",
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
    seed: int = 0
    device: str = "cpu"

    def __post_init__(self):
        if not 0 <= self.alpha < 1:
            raise ValueError(f"alpha must be in [0, 1), got {self.alpha}.")
        if not 0 <= self.trigger < self.n_tokens:
            raise ValueError(
                f"trigger must be an ordinary token id in 0..{self.n_tokens - 1}, got {self.trigger}."
            )
        if self.n_tokens < 3:
            raise ValueError("n_tokens must be at least 3 (a trigger and at least two possible outputs).")
        if self.recall_positions not in ("seen", "repeat"):
            raise ValueError(f"recall_positions must be 'seen' or 'repeat', got {self.recall_positions!r}.")
        if any(not 0 < f < 1 for f in self.truncation_fractions):
            raise ValueError(f"truncation_fractions must lie in (0, 1), got {self.truncation_fractions}.")

    @property
    def noise(self) -> int:
        """Id of the noise token (one past the ordinary tokens)."""
        return self.n_tokens

    @property
    def d_vocab(self) -> int:
        return self.n_tokens + 1

    @classmethod
    def paper(cls, **overrides) -> NoisyRecallConfig:
        """The paper's setting: N = 65, d = 256, T = 256, batch 512, alpha = 0.5, SGD with
        learning rate 0.03, momentum 0.9 and weight decay 1e-4, 2000 steps, 512 test sequences.

        The paper estimates the chain from tiny Shakespeare (not available offline); here the
        chain is synthetic unless one from :meth:`BigramChain.from_text` is passed, with a
        trigger rate near the frequency of the space character in English text.
        """
        settings = {
            "n_tokens": 65, "seq_len": 256, "alpha": 0.5, "trigger_rate": 0.15, "d_model": 256,
            "batch_size": 512,
            "steps": 2000, "lr": 0.03, "checkpoint_every": 100, "extra_checkpoints": (1, 2, 3, 5, 10, 20, 50),
            "n_test": 512, "truncation_fractions": (0.1, 0.2),
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
        trigger: int,
        trigger_rate: float = 0.12,
        concentration: float = 0.5,
        generator: torch.Generator | None = None,
    ) -> BigramChain:
        """Rows drawn from a symmetric Dirichlet(``concentration``), then mixed with a point mass
        on the trigger so that about a ``trigger_rate`` share of transitions lead to it (the
        trigger must be frequent for recall to be learnable at short context lengths). The
        first token follows the chain's stationary distribution."""
        if not 0 <= trigger_rate < 1:
            raise ValueError(f"trigger_rate must be in [0, 1), got {trigger_rate}.")
        conc = torch.full((n_tokens, n_tokens), float(concentration))
        rows = torch._standard_gamma(conc, generator=generator)
        rows = rows / rows.sum(-1, keepdim=True)
        rows = (1 - trigger_rate) * rows
        rows[:, trigger] += trigger_rate
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
    output token and the positions where in-context recall is scored."""

    tokens: Int[Tensor, "batch pos"]
    targets: Int[Tensor, "batch pos"]
    ybar: Int[Tensor, " batch"]
    recall: Bool[Tensor, "batch pos"]

    def to(self, device) -> RecallBatch:
        return RecallBatch(*(t.to(device) for t in (self.tokens, self.targets, self.ybar, self.recall)))


def sample_recall_batch(
    chain: BigramChain,
    n_seqs: int,
    seq_len: int,
    trigger: int,
    alpha: float,
    generator: torch.Generator | None = None,
    recall_positions: RecallPositions = "seen",
) -> RecallBatch:
    """Sample ``n_seqs`` sequences of ``seq_len`` tokens (plus one more for the last target).

    ``ybar`` is uniform over the ordinary tokens other than the trigger (a trigger as its own
    output would chain triggers together). After every trigger the next token is the noise
    token (id ``chain.n_tokens``) with probability ``alpha``, ``ybar`` otherwise.
    """
    n = chain.n_tokens
    noise = n
    # Cumulative rows, with one extra row for "after the noise token" (= the unigram).
    cum = torch.cat([chain.bigram, chain.unigram[None]]).cumsum(-1)
    cum[:, -1] = 1.0 + 1e-6  # guard against rounding in the last bin
    others = torch.tensor([t for t in range(n) if t != trigger])
    ybar = others[torch.randint(len(others), (n_seqs,), generator=generator)]
    z = torch.empty(n_seqs, seq_len + 1, dtype=torch.long)
    first = torch.rand(n_seqs, 1, generator=generator)
    z[:, 0] = torch.searchsorted(chain.unigram.cumsum(-1)[None].expand(n_seqs, n).contiguous(), first)[:, 0]
    z[:, 0] = z[:, 0].clamp_max(n - 1)
    for t in range(seq_len):
        prev = z[:, t]
        u = torch.rand(n_seqs, 1, generator=generator)
        nxt = torch.searchsorted(cum[prev], u)[:, 0].clamp_max(n - 1)
        is_noise = torch.rand(n_seqs, generator=generator) < alpha
        forced = torch.where(is_noise, torch.full_like(ybar, noise), ybar)
        z[:, t + 1] = torch.where(prev == trigger, forced, nxt)
    tokens, targets = z[:, :-1].contiguous(), z[:, 1:].contiguous()
    return RecallBatch(tokens, targets, ybar, recall_mask(tokens, ybar, trigger, recall_positions))


def recall_mask(
    tokens: Int[Tensor, "batch pos"],
    ybar: Int[Tensor, " batch"],
    trigger: int,
    recall_positions: RecallPositions = "seen",
) -> Bool[Tensor, "batch pos"]:
    """Trigger positions where recall is scored: ``"seen"`` = ``ybar`` already followed an
    earlier trigger; ``"repeat"`` = the trigger's second or later occurrence."""
    is_trigger = tokens == trigger
    if recall_positions == "repeat":
        return is_trigger & (is_trigger.long().cumsum(-1) >= 2)
    after_trigger = torch.zeros_like(is_trigger)
    after_trigger[:, 1:] = is_trigger[:, :-1]
    shown = after_trigger & (tokens == ybar[:, None])
    return is_trigger & (shown.long().cumsum(-1) > 0)


# ---------------------------------------------------------------------------------------------
# Model

_TRAINABLE = ("attn.W_K", "attn.W_V", "attn.W_O", "mlp.W_in", "mlp.W_out")


def trainable_parameter_names(model: HookedTransformer) -> list[str]:
    """The parameters the toy trains: key, value and output matrices and both MLP matrices of
    each block. Embeddings, positions, unembedding, ``W_Q`` (the identity, so that ``W_K`` is
    the paper's ``W_KQ``) and all biases (zero) stay fixed."""
    return [name for name, _ in model.named_parameters() if name.endswith(_TRAINABLE)]


def noisy_recall_model(cfg: NoisyRecallConfig, generator: torch.Generator | None = None) -> HookedTransformer:
    """The paper's two-layer model as a ``HookedTransformer``: one head per layer (``d_head =
    d_model``, scores scaled by ``1/sqrt(d_model)``), ReLU MLPs of width ``mlp_mult * d_model``,
    no normalization, no biases.

    Embeddings and positions are N(0, 1) and the unembedding uniform in +-1/sqrt(d), all
    frozen; the trained matrices start uniform in +-1/sqrt(fan_in) (PyTorch's ``Linear``
    default). ``generator`` defaults to one seeded with ``cfg.seed``.
    """
    d, v = cfg.d_model, cfg.d_vocab
    tl_cfg = HookedTransformerConfig(
        n_layers=2, d_model=d, n_heads=1, d_head=d, d_mlp=cfg.mlp_mult * d, d_vocab=v, n_ctx=cfg.seq_len,
        act_fn="relu", normalization_type=None, positional_embedding_type="standard",
        init_weights=False, default_prepend_bos=False, model_name="noisy-recall-toy", device=cfg.device,
    )
    with _quiet_deprecation():
        model = HookedTransformer(tl_cfg, move_to_device=False)
    gen = generator if generator is not None else torch.Generator().manual_seed(cfg.seed)

    def uniform(shape, fan_in):
        bound = 1 / math.sqrt(fan_in)
        return (torch.rand(shape, generator=gen) * 2 - 1) * bound

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name == "embed.W_E" or name == "pos_embed.W_pos":
                param.copy_(torch.randn(param.shape, generator=gen))
            elif name == "unembed.W_U":
                param.copy_(uniform(param.shape, d))
            elif name.endswith("attn.W_Q"):
                param.copy_(torch.eye(d)[None])
            elif name.endswith(("attn.W_K", "attn.W_V", "attn.W_O", "mlp.W_in")):
                param.copy_(uniform(param.shape, d))
            elif name.endswith("mlp.W_out"):
                param.copy_(uniform(param.shape, cfg.mlp_mult * d))
            else:  # biases
                param.zero_()
    trainable = set(trainable_parameter_names(model))
    for name, param in model.named_parameters():
        param.requires_grad_(name in trainable)
    if str(cfg.device) != "cpu":  # (HookedTransformer.to would print a notice; cfg.device is already set)
        torch.nn.Module.to(model, cfg.device)
    return model


@contextlib.contextmanager
def _low_rank(param: torch.nn.Parameter, rank: int):
    """Replace a weight by its best rank-``rank`` approximation for the ``with`` block, then
    restore it exactly."""
    original = param.detach().clone()
    u, s, vh = torch.linalg.svd(original.float(), full_matrices=False)
    with torch.no_grad():
        param.copy_((u[:, :rank] * s[:rank]) @ vh[:rank])
    try:
        yield
    finally:
        with torch.no_grad():
            param.copy_(original)


# ---------------------------------------------------------------------------------------------
# Probes


def _answer_stats(logits, batch: RecallBatch, noise: int) -> dict[str, float]:
    mask = batch.recall
    logp = logits[mask].float().log_softmax(-1)
    ybar = batch.ybar[:, None].expand_as(mask)[mask]
    target = batch.targets[mask]
    rows = torch.arange(len(ybar))
    return {
        "p_correct": logp[rows, ybar].exp().mean().item(),
        "p_noise": logp[:, noise].exp().mean().item(),
        "loss": -logp[rows, target].mean().item(),
        "clean_loss": -logp[rows, ybar].mean().item(),
        "accuracy": (logp.argmax(-1) == ybar).float().mean().item(),
        "argmax_noise": (logp.argmax(-1) == noise).float().mean().item(),
    }


@torch.no_grad()
def recall_probes(
    model: HookedTransformer,
    noisy: RecallBatch,
    clean: RecallBatch,
    cfg: NoisyRecallConfig,
) -> pd.DataFrame:
    """The paper's probes on one model, at the recall positions of two test batches.

    Rows ``(data, condition, rho, measure, value)``:

    * ``noisy`` data, full model: ``p_noise``, ``p_correct`` (probability of ``ybar``), ``loss``
      (cross-entropy of the sampled next token), ``argmax_noise``, ``accuracy``; the second MLP's
      direct logit for noise, ``mlp2_noise_logit`` (its output projected on ``W_U[:, noise]``
      minus the mean unembedding column) and likewise ``mlp2_correct_logit`` for ``ybar``;
      layer-2 attention from a recall position to an earlier output position that holds
      ``ybar`` (``attn2_to_correct``) or noise (``attn2_to_noise``), averaged over such pairs;
      layer-1 attention to the previous token (``attn1_prev``, over all positions).
    * ``clean`` data (``alpha = 0``): the answer measures for the full model (``rho = 1``),
      the second MLP dropped (``blocks.1.hook_mlp_out`` zeroed, ``rho = 0``) and its input
      matrix ``W_in`` truncated to rank ``floor(rho * d_model)`` for each
      ``cfg.truncation_fractions``; plus the MLP direct logits.
    """
    noise = cfg.noise
    device = model.W_E.device
    noisy, clean = noisy.to(device), clean.to(device)
    rows: list[tuple[str, str, float, str, float]] = []

    def add(data, condition, rho, stats):
        rows.extend((data, condition, rho, k, v) for k, v in stats.items())

    names = ("blocks.0.attn.hook_pattern", "blocks.1.attn.hook_pattern", "blocks.1.hook_mlp_out")
    logits, cache = model.run_with_cache(noisy.tokens, names_filter=lambda n: n in names)
    add("noisy", "full", 1.0, _answer_stats(logits, noisy, noise))
    add("noisy", "full", 1.0, _mlp2_logits(model, cache["blocks.1.hook_mlp_out"], noisy, noise))
    add("noisy", "full", 1.0, _attention_stats(cache, noisy, cfg.trigger, noise))

    logits, cache = model.run_with_cache(clean.tokens, names_filter=lambda n: n == "blocks.1.hook_mlp_out")
    add("clean", "full", 1.0, _answer_stats(logits, clean, noise))
    add("clean", "full", 1.0, _mlp2_logits(model, cache["blocks.1.hook_mlp_out"], clean, noise))
    with intervene(model, Knockout(1, "mlp")):
        add("clean", "drop mlp2", 0.0, _answer_stats(model(clean.tokens), clean, noise))
    w_in = model.blocks[1].mlp.W_in
    for rho in cfg.truncation_fractions:
        rank = math.floor(rho * min(w_in.shape))
        with _low_rank(w_in, rank):
            stats = _answer_stats(model(clean.tokens), clean, noise)
        add("clean", f"mlp2 W_in rank {rank}", float(rho), stats)
    return pd.DataFrame(rows, columns=["data", "condition", "rho", "measure", "value"])


def _mlp2_logits(model, mlp_out: Float[Tensor, "batch pos d_model"], batch: RecallBatch, noise: int) -> dict:
    """Direct logit of the second MLP toward noise and toward ``ybar`` at recall positions, each
    measured against the mean unembedding direction."""
    w_u = model.W_U
    centred = w_u - w_u.mean(-1, keepdim=True)
    out = mlp_out[batch.recall]
    ybar = batch.ybar[:, None].expand_as(batch.recall)[batch.recall]
    return {
        "mlp2_noise_logit": (out @ centred[:, noise]).mean().item(),
        "mlp2_correct_logit": (out * centred[:, ybar].T).sum(-1).mean().item(),
    }


def _attention_stats(cache, batch: RecallBatch, trigger: int, noise: int) -> dict:
    pattern2 = cache["blocks.1.attn.hook_pattern"][:, 0]  # [batch, query, key]
    tokens = batch.tokens
    out_pos = torch.zeros_like(batch.recall)
    out_pos[:, 1:] = tokens[:, :-1] == trigger
    pos = torch.arange(tokens.shape[1], device=tokens.device)
    earlier = pos[None, :] < pos[:, None]  # key before query
    queries = batch.recall[:, :, None] & earlier[None]
    stats = {}
    for label, keys in (
        ("attn2_to_correct", out_pos & (tokens == batch.ybar[:, None])),
        ("attn2_to_noise", out_pos & (tokens == noise)),
    ):
        pairs = queries & keys[:, None, :]
        n = pairs.sum().item()
        stats[label] = (pattern2[pairs].sum().item() / n) if n else float("nan")
    pattern1 = cache["blocks.0.attn.hook_pattern"][:, 0]
    stats["attn1_prev"] = pattern1.diagonal(offset=-1, dim1=-2, dim2=-1).mean().item()
    return stats


# ---------------------------------------------------------------------------------------------
# Training


@dataclass
class NoisyRecallRun(ToyRun):
    """A noisy-recall training run: checkpoints, probes (:func:`recall_probes` columns plus
    ``step``) and the chain that generated the data."""

    config_cls = NoisyRecallConfig

    @property
    def chain(self) -> BigramChain:
        """The bigram chain the run's data came from."""
        return BigramChain(unigram=self.extras["unigram"], bigram=self.extras["bigram"])

    def model_at(self, step: int | None = None) -> HookedTransformer:
        """The model as it was at checkpoint ``step`` (the last one when ``None``)."""
        model = noisy_recall_model(self.config)
        model.load_state_dict(self.state_at(step))
        return model.eval()


def train_noisy_recall(
    cfg: NoisyRecallConfig | None = None,
    chain: BigramChain | None = None,
    progress: bool = True,
) -> NoisyRecallRun:
    """Train the toy with SGD (momentum, weight decay on the trained matrices only) on fresh
    batches of noisy sequences; cross-entropy only at recall positions.

    At step 0, every ``cfg.checkpoint_every`` steps, the last step and ``cfg.extra_checkpoints``
    it keeps a copy of the weights and runs :func:`recall_probes` on fixed noisy and clean test
    batches. The run's probes also carry the last training batch's loss (``data="train"``).
    """
    cfg = cfg or NoisyRecallConfig()
    gen = torch.Generator().manual_seed(cfg.seed)
    if chain is None:
        chain = BigramChain.random(cfg.n_tokens, cfg.trigger, cfg.trigger_rate, cfg.concentration, gen)
    elif chain.n_tokens != cfg.n_tokens:
        raise ValueError(
            f"The chain has {chain.n_tokens} tokens but the config says n_tokens={cfg.n_tokens}."
        )
    model = noisy_recall_model(cfg, gen)
    data_gen = torch.Generator().manual_seed(cfg.seed + 1)
    test_gen = torch.Generator().manual_seed(cfg.seed + 2)

    def sample(n, alpha, generator):
        return sample_recall_batch(
            chain, n, cfg.seq_len, cfg.trigger, alpha, generator, cfg.recall_positions
        ).to(cfg.device)

    noisy_test = sample(cfg.n_test, cfg.alpha, test_gen)
    clean_test = sample(cfg.n_test, 0.0, test_gen)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    record = set(checkpoint_steps(cfg.steps, cfg.checkpoint_every, cfg.extra_checkpoints))
    run = NoisyRecallRun(config=cfg)
    tables, last_loss = [], float("nan")
    bar = tqdm(total=cfg.steps, desc="noisy recall", disable=not progress, unit="step")
    for step in range(cfg.steps + 1):
        if step in record:
            model.eval()
            run.checkpoints.append((step, snapshot(model)))
            table = recall_probes(model, noisy_test, clean_test, cfg)
            table.loc[len(table)] = ("train", "full", 1.0, "loss", last_loss)
            tables.append(table.assign(step=step))
            model.train()
        if step == cfg.steps:
            break
        batch = sample(cfg.batch_size, cfg.alpha, data_gen)
        logits = model(batch.tokens)
        loss = F.cross_entropy(logits[batch.recall], batch.targets[batch.recall])
        if not torch.isfinite(loss):
            bar.close()
            raise FloatingPointError(
                f"Training diverged at step {step} (loss {loss.item()}); "
                f"lower the learning rate (lr={cfg.lr})."
            )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        last_loss = loss.item()
        bar.update()
        bar.set_postfix(loss=f"{last_loss:.3f}", refresh=False)
    bar.close()
    model.eval()
    probes = pd.concat(tables, ignore_index=True)
    run.probes = probes[["step", "data", "condition", "rho", "measure", "value"]]
    run.extras = {"unigram": chain.unigram.clone(), "bigram": chain.bigram.clone()}
    return run


def trajectory(
    run: NoisyRecallRun | pd.DataFrame, data: str, measure: str, condition: str = "full"
) -> pd.Series:
    """One probe as a Series indexed by step (a convenience for reading runs)."""
    probes = run.probes if isinstance(run, ToyRun) else run
    rows = probes[(probes.data == data) & (probes.measure == measure) & (probes.condition == condition)]
    return rows.set_index("step")["value"].sort_index()


# ---------------------------------------------------------------------------------------------
# Figure

_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"]


def plot_noisy_recall(run: NoisyRecallRun | pd.DataFrame, log_x: bool = True) -> go.Figure:
    """Trajectory of a noisy-recall run in four panels: p(noise) and p(ybar) on noisy test data;
    p(ybar) (solid) and p(noise) (dotted) on clean data for the full model, the dropped MLP
    and each truncation; layer-2 attention to earlier correct vs noise outputs and layer-1
    previous-token attention; the second MLP's direct logit toward noise and toward ``ybar``.

    With ``log_x`` the step axis is logarithmic (step 0 is then not drawn), which shows the
    early noise phase and the later induction phase on one axis.
    """
    probes = run.probes if isinstance(run, ToyRun) else run
    fig = make_subplots(
        rows=2, cols=2, horizontal_spacing=0.08, vertical_spacing=0.14,
        subplot_titles=[
            "noisy test data, full model", "clean test data: full vs layer-2 MLP dropped / truncated",
            "attention", "layer-2 MLP direct logit (recall positions, clean data)",
        ],
    )

    def line(data, measure, condition, name, color, row, col, dash=None, legend=True):
        s = trajectory(probes, data, measure, condition)
        fig.add_trace(
            go.Scatter(
                x=s.index, y=s.values, mode="lines+markers", name=name, legendgroup=name,
                line={"color": color, "dash": dash}, marker={"size": 4}, showlegend=legend,
                hovertemplate=f"{name}<br>step %{{x}}<br>%{{y:.4f}}<extra></extra>",
            ),
            row=row, col=col,
        )

    line("noisy", "p_noise", "full", "p(noise), noisy data", _COLORS[1], 1, 1)
    line("noisy", "p_correct", "full", "p(ybar), noisy data", _COLORS[0], 1, 1)
    clean = probes[probes.data == "clean"]
    conditions = clean.sort_values("rho", ascending=False).condition.unique()
    for i, condition in enumerate(conditions):
        color = _COLORS[(i + 2) % len(_COLORS)] if condition != "full" else "#000000"
        line("clean", "p_correct", condition, f"p(ybar), clean, {condition}", color, 1, 2)
        line("clean", "p_noise", condition, f"p(noise), clean, {condition}", color, 1, 2, dash="dot")
    line("noisy", "attn2_to_correct", "full", "layer-2 attn to earlier ybar", _COLORS[0], 2, 1)
    line("noisy", "attn2_to_noise", "full", "layer-2 attn to earlier noise", _COLORS[1], 2, 1)
    line("noisy", "attn1_prev", "full", "layer-1 attn to previous token", "#7f7f7f", 2, 1, dash="dash")
    line("clean", "mlp2_noise_logit", "full", "MLP2 logit: noise", _COLORS[1], 2, 2)
    line("clean", "mlp2_correct_logit", "full", "MLP2 logit: ybar", _COLORS[0], 2, 2)
    for row in (1, 2):
        for col in (1, 2):
            fig.update_xaxes(title_text="training step", type="log" if log_x else "linear", row=row, col=col)
    fig.update_yaxes(title_text="probability", row=1, col=1)
    fig.update_yaxes(title_text="probability", row=1, col=2)
    fig.update_yaxes(title_text="mean attention weight", row=2, col=1)
    fig.update_yaxes(title_text="logit (vs mean direction)", row=2, col=2)
    alpha = run.config.alpha if isinstance(run, ToyRun) else None
    if alpha is not None:
        fig.add_hline(y=alpha, line={"color": "gray", "dash": "dot", "width": 1}, row=1, col=1)
    fig.update_layout(height=700, width=1150, title="Noisy in-context recall: training trajectory")
    return fig
