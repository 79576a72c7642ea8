"""Noisy in-context recall: a two-layer transformer that learns a global "trigger -> noise"
association in its second MLP and an induction head in its attention (Chen, Bruna & Bietti,
"How Truncating Weights Improves Reasoning in Language Models", section 4).

Each sequence has its own output token ``ybar``. Whenever the fixed trigger token appears, the
next token is ``ybar`` with probability ``1 - alpha`` and a shared noise token otherwise; all
other transitions follow a bigram chain. The model can only learn ``ybar`` from the context
(an induction head), but the noise is the same for every sequence, so a feed-forward block can
store it as a global association. Dropping or rank-truncating the second-layer MLP on clean
data then removes the noise and leaves the in-context answer.

The model is a plain TransformerLens model (two layers, one head,
ReLU MLPs, no normalization, frozen random embeddings, positions and unembedding), so every
cpsuper hook and intervention applies to it. The task and the model are defined in
:mod:`cpsuper.toys.noisy_recall_task` and re-exported here; this module holds the probes and the
training loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import pandas as pd
import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from ..backend import Model
from ..interventions import Knockout, intervene
from ..truncation import truncation_rank
from .build import load_toy_state
from .common import Snapshotter, ToyRun, checkpoint_steps
from .noisy_recall_task import (
    BigramChain,
    NoisyRecallConfig,
    RecallBatch,
    noisy_recall_model,
    sample_recall_batch,
)
from .noisy_recall_variants import answer_stats, low_rank_weight, value_truncation_stats

__all__ = [
    "NoisyRecallRun",
    "finetune_noisy_recall",
    "layer2_attention_map",
    "recall_probes",
    "train_noisy_recall",
    "trajectory",
]


# ---------------------------------------------------------------------------------------------
# Probes


@torch.no_grad()
def recall_probes(
    model: Model,
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
      the second MLP dropped (``blocks.1.hook_mlp_out`` zeroed, ``rho = 0``), the first MLP
      dropped (``"drop mlp1"``), and the second MLP's input matrix ``W_in`` truncated to rank
      ``floor(rho * d_model)`` for each ``cfg.truncation_fractions``; plus the MLP direct
      logits. Feed-forward variants (``cfg.ffn``): an absent block is not dropped, and ``W_in``
      is truncated only when the second block is an MLP. With ``cfg.value_truncation_fractions``,
      also the first layer's ``W_O`` truncated (``"attn1 W_O rank k"``, Figure 12).

    With several triggers, "correct" is the output of the trigger at each recall position.
    """
    noise = cfg.noise
    device = model.W_E.device
    noisy, clean = noisy.to(device), clean.to(device)
    rows: list[tuple[str, str, float, str, float]] = []

    def add(data, condition, rho, stats):
        rows.extend((data, condition, rho, k, v) for k, v in stats.items())

    names = ("blocks.0.attn.hook_pattern", "blocks.1.attn.hook_pattern", "blocks.1.hook_mlp_out")
    logits, cache = model.run_with_cache(noisy.tokens, names_filter=lambda n: n in names)
    add("noisy", "full", 1.0, answer_stats(logits, noisy, noise))
    add("noisy", "full", 1.0, _mlp2_logits(model, cache["blocks.1.hook_mlp_out"], noisy, noise))
    add("noisy", "full", 1.0, _attention_stats(cache, noisy, noise))

    logits, cache = model.run_with_cache(clean.tokens, names_filter=lambda n: n == "blocks.1.hook_mlp_out")
    add("clean", "full", 1.0, answer_stats(logits, clean, noise))
    add("clean", "full", 1.0, _mlp2_logits(model, cache["blocks.1.hook_mlp_out"], clean, noise))
    for layer in (1, 0):
        if cfg.ffn[layer] != "none":
            with intervene(model, Knockout(layer, "mlp")):
                add("clean", f"drop mlp{layer + 1}", 0.0, answer_stats(model(clean.tokens), clean, noise))
    for rho in cfg.truncation_fractions if cfg.ffn[1] == "mlp" else ():
        rank = truncation_rank(rho, *model.blocks[1].mlp.W_in.shape)
        with low_rank_weight(model, "blocks.1.mlp.W_in", rank):
            stats = answer_stats(model(clean.tokens), clean, noise)
        add("clean", f"mlp2 W_in rank {rank}", float(rho), stats)
    values = value_truncation_stats(model, clean, noise, cfg.value_truncation_fractions)
    rows.extend(
        ("clean", c, r, m, v) for c, r, m, v in values[["condition", "rho", "measure", "value"]].itertuples(False)
    )
    return pd.DataFrame(rows, columns=["data", "condition", "rho", "measure", "value"])


def _mlp2_logits(model, mlp_out: Float[Tensor, "batch pos d_model"], batch: RecallBatch, noise: int) -> dict:
    """Direct logit of the second MLP toward noise and toward ``ybar`` at recall positions, each
    measured against the mean unembedding direction."""
    w_u = model.W_U
    centred = w_u - w_u.mean(-1, keepdim=True)
    out = mlp_out[batch.recall]
    answer = batch.answers[batch.recall]
    return {
        "mlp2_noise_logit": (out @ centred[:, noise]).mean().item(),
        "mlp2_correct_logit": (out * centred[:, answer].T).sum(-1).mean().item(),
    }


def _attention_stats(cache, batch: RecallBatch, noise: int) -> dict:
    """Layer-2 attention from recall positions to earlier positions that follow the same
    trigger and hold its output (``to_correct``) or noise (``to_noise``)."""
    pattern2 = cache["blocks.1.attn.hook_pattern"][:, 0]  # [batch, query, key]
    tokens = batch.tokens
    prev = torch.full_like(tokens, -1)
    prev[:, 1:] = tokens[:, :-1]
    pos = torch.arange(tokens.shape[1], device=tokens.device)
    earlier = pos[None, :] < pos[:, None]  # key before query
    queries = batch.recall[:, :, None] & earlier[None] & (prev[:, None, :] == tokens[:, :, None])
    stats = {}
    for label, keys in (
        ("attn2_to_correct", tokens[:, None, :] == batch.answers[:, :, None]),
        ("attn2_to_noise", (tokens == noise)[:, None, :]),
    ):
        pairs = queries & keys
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

    def model_at(self, step: int | None = None) -> Model:
        """The model as it was at checkpoint ``step`` (the last one when ``None``)."""
        return load_toy_state(noisy_recall_model(self.config), self.state_at(step)).eval()


def train_noisy_recall(
    cfg: NoisyRecallConfig | None = None,
    chain: BigramChain | None = None,
    progress: bool = True,
    init: Mapping[str, Tensor] | None = None,
) -> NoisyRecallRun:
    """Train the toy with SGD (momentum, weight decay on the trained matrices only) on fresh
    batches of noisy sequences; cross-entropy only at recall positions. ``init``: a checkpoint
    (:meth:`NoisyRecallRun.state_at`) to start from instead of the seeded initialisation.

    At step 0, every ``cfg.checkpoint_every`` steps, the last step and ``cfg.extra_checkpoints``
    it keeps a copy of the weights and runs :func:`recall_probes` on fixed noisy and clean test
    batches. The run's probes also carry the last training batch's loss (``data="train"``).
    """
    cfg = cfg or NoisyRecallConfig()
    gen = torch.Generator().manual_seed(cfg.seed)
    if chain is None:
        chain = BigramChain.random(cfg.n_tokens, cfg.triggers, cfg.trigger_rate, cfg.concentration, gen)
    elif chain.n_tokens != cfg.n_tokens:
        raise ValueError(f"The chain has {chain.n_tokens} tokens but the config says n_tokens={cfg.n_tokens}.")
    model = noisy_recall_model(cfg, gen)
    if init is not None:
        load_toy_state(model, init)
    data_gen = torch.Generator().manual_seed(cfg.seed + 1)
    test_gen = torch.Generator().manual_seed(cfg.seed + 2)

    def sample(n, alpha, generator):
        return sample_recall_batch(chain, n, cfg.seq_len, cfg.triggers, alpha, generator, cfg.recall_positions).to(
            cfg.device
        )

    noisy_test = sample(cfg.n_test, cfg.alpha, test_gen)
    clean_test = sample(cfg.n_test, 0.0, test_gen)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    record = set(checkpoint_steps(cfg.steps, cfg.checkpoint_every, cfg.extra_checkpoints))
    snap = Snapshotter(model)
    run = NoisyRecallRun(config=cfg)
    tables, last_loss = [], float("nan")
    bar = tqdm(total=cfg.steps, desc="noisy recall", disable=not progress, unit="step")
    for step in range(cfg.steps + 1):
        if step in record:
            model.eval()
            run.checkpoints.append((step, snap(model)))
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
                f"Training diverged at step {step} (loss {loss.item()}); lower the learning rate (lr={cfg.lr})."
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


def finetune_noisy_recall(
    cfg: NoisyRecallConfig | None = None,
    pretrain_steps: int = 200,
    chain: BigramChain | None = None,
    progress: bool = True,
    *,
    pretrain_lr: float | None = None,
) -> tuple[NoisyRecallRun, NoisyRecallRun]:
    """The paper's Fig. 4 (right): pretrain on clean data (``alpha = 0``) for ``pretrain_steps``,
    then finetune the result on noisy data (``cfg.alpha``) for ``cfg.steps`` steps with a fresh
    optimiser, probing both phases as :func:`train_noisy_recall` does. ``pretrain_lr`` (default
    ``cfg.lr``) is the pretraining learning rate. The finetuning phase draws its batches with seed
    ``cfg.seed + 1000`` so that it does not replay the pretraining data; its test batches are those
    of that seed. Returns ``(pretraining run, finetuning run)``. At the CI size, ``lr = 0.1`` diverges
    on clean data and when finetuning; ``lr = 0.05`` trains both phases."""
    cfg = cfg or NoisyRecallConfig()
    pre = train_noisy_recall(
        replace(cfg, alpha=0.0, steps=pretrain_steps, lr=cfg.lr if pretrain_lr is None else pretrain_lr),
        chain,
        progress,
    )
    fine = train_noisy_recall(replace(cfg, seed=cfg.seed + 1000), pre.chain, progress, init=pre.state_at())
    return pre, fine


@torch.no_grad()
def layer2_attention_map(model: Model, batch: RecallBatch, cfg: NoisyRecallConfig, row: int = 0) -> pd.DataFrame:
    """The second layer's attention pattern on one sequence of ``batch`` (the paper's Fig. 5), as a
    long frame: one row per recall query and every earlier key that directly follows the query's
    own trigger, with ``query``, ``key`` (positions), ``kind`` (``"ybar"`` when the key holds the
    trigger's output, ``"noise"`` when it holds the noise token ``cfg.noise``, else ``"other"``)
    and ``weight``; plus, per query, one ``kind="rest"`` row (``key = -1``) with the weight on all
    other keys, so that each query's weights sum to 1."""
    tokens = batch.tokens[row : row + 1].to(model.W_E.device)
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n == "blocks.1.attn.hook_pattern")
    pattern = cache["blocks.1.attn.hook_pattern"][0, 0].cpu()  # [query, key]
    seq = batch.tokens[row].tolist()
    rows = []
    for query in batch.recall[row].nonzero().flatten().tolist():
        keys = [k for k in range(1, query) if seq[k - 1] == seq[query]]  # after the query's own trigger
        for key in keys:
            kind = "noise" if seq[key] == cfg.noise else "ybar" if seq[key] == batch.answers[row, query] else "other"
            rows.append((query, key, kind, float(pattern[query, key])))
        rows.append((query, -1, "rest", float(1 - pattern[query, keys].sum())))
    frame = pd.DataFrame(rows, columns=["query", "key", "kind", "weight"])
    return frame.astype({"query": "int64", "key": "int64", "kind": str, "weight": "float64"})


def trajectory(run: NoisyRecallRun | pd.DataFrame, data: str, measure: str, condition: str = "full") -> pd.Series:
    """One probe as a Series indexed by step (a convenience for reading runs)."""
    probes = run.probes if isinstance(run, ToyRun) else run
    rows = probes[(probes.data == data) & (probes.measure == measure) & (probes.condition == condition)]
    return rows.set_index("step")["value"].sort_index()
