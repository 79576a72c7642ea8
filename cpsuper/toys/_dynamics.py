"""Shared plumbing for the training-dynamics toys (inversion, finetuning): private to them.

Both toys are a single attention head whose last token reads from earlier tokens through a bilinear
key-query matrix ``W_KQ`` and a value matrix ``W_V``, with fixed embeddings and a fixed unembedding.
:func:`attention_toy_model` writes that model as an attention-only ``HookedTransformer`` *exactly*,
so that cpsuper's hooks, caches and interventions work on it:

* the residual stream has ``2 d`` dimensions; tokens are embedded into the first ``d``, the head
  writes into the last ``d`` and the unembedding reads only the last ``d``.  The residual skip
  connection therefore adds nothing to the logits: logits are the head's output alone, as in the
  papers' models (which have no skip connection);
* ``W_Q`` is a frozen identity and ``W_K`` holds ``W_KQ``, so the attention score of key ``y`` for
  query ``x`` is ``phi(y)^T W_KQ phi(x)``, and gradient descent on ``W_K`` *is* gradient descent on
  the full matrix ``W_KQ`` (a factorised ``W_K W_Q^T`` started at zero would never move);
* no attention scaling, no layer norm, zero (frozen) positional embeddings and biases.

:class:`Trajectory` keeps a training run's checkpoints in memory as ``(step, state_dict)`` and
turns them back into models.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor
from transformer_lens import HookedTransformer, HookedTransformerConfig

# Parameter names of the toy model that hold the papers' trainable matrices.
KQ_PARAM = "blocks.0.attn.W_K"
V_PARAM = "blocks.0.attn.W_V"


def attention_toy_model(
    embed: Float[Tensor, "vocab d"],
    unembed: Float[Tensor, "d vocab"],
    W_KQ: Float[Tensor, "d d"],
    W_V: Float[Tensor, "d d"],
    *,
    n_ctx: int,
    train_kq: bool = True,
    train_v: bool = False,
    name: str = "attention-toy",
) -> HookedTransformer:
    """One layer, one head, attention only: ``logits = unembed^T W_V sum_y softmax_y(phi(y)^T W_KQ phi(q)) phi(y)``.

    ``embed[t]`` is token ``t``'s embedding ``phi(t)``; ``W_KQ`` and ``W_V`` act on embeddings as in
    the papers (columns are inputs).  Only ``W_KQ`` (stored in ``W_K``) and, if asked, ``W_V`` are
    trainable; everything else is frozen.
    """
    vocab, d = embed.shape
    if unembed.shape != (d, vocab) or W_KQ.shape != (d, d) or W_V.shape != (d, d):
        raise ValueError(
            f"Shapes do not fit together: embed {tuple(embed.shape)}, unembed {tuple(unembed.shape)}, "
            f"W_KQ {tuple(W_KQ.shape)}, W_V {tuple(W_V.shape)}."
        )
    cfg = HookedTransformerConfig(
        n_layers=1,
        n_heads=1,
        d_model=2 * d,
        d_head=d,
        d_vocab=vocab,
        n_ctx=n_ctx,
        attn_only=True,
        normalization_type=None,
        positional_embedding_type="standard",
        use_attn_scale=False,
        act_fn=None,
        seed=0,
        device="cpu",
        dtype=torch.float32,
        model_name=name,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        model = HookedTransformer(cfg, move_to_device=False)
    eye = torch.eye(d)
    zeros = torch.zeros(d, d)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.embed.W_E.copy_(torch.cat([embed, torch.zeros(vocab, d)], dim=1))
        attn = model.blocks[0].attn
        attn.W_Q[0].copy_(torch.cat([eye, zeros]))
        attn.W_K[0].copy_(torch.cat([W_KQ, zeros]))
        attn.W_V[0].copy_(torch.cat([W_V.T, zeros]))
        attn.W_O[0].copy_(torch.cat([zeros, eye], dim=1))
        model.unembed.W_U.copy_(torch.cat([torch.zeros(d, vocab), unembed]))
    trainable = {KQ_PARAM: train_kq, V_PARAM: train_v}
    for pname, p in model.named_parameters():
        p.requires_grad_(trainable.get(pname, False))
    return model.eval()


def toy_matrices(model: HookedTransformer) -> tuple[Float[Tensor, "d d"], Float[Tensor, "d d"]]:
    """``(W_KQ, W_V)`` of a model built by :func:`attention_toy_model`, in the papers' orientation."""
    attn = model.blocks[0].attn
    d = attn.W_K.shape[-1]
    return attn.W_K[0, :d].detach().clone(), attn.W_V[0, :d].detach().T.clone()


def last_position(model: HookedTransformer, tokens: Tensor) -> tuple[Tensor, Tensor]:
    """Final-position logits ``[batch, vocab]`` and attention pattern ``[batch, key]`` in one pass."""
    store = {}

    def keep(pattern, hook):
        store["pattern"] = pattern[:, 0, -1, :]

    logits = model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_pattern", keep)])
    return logits[:, -1, :], store["pattern"]


class Snapshotter:
    """Copies a model's state dict at a checkpoint, sharing one copy of every frozen tensor."""

    def __init__(self, model: HookedTransformer):
        self.trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        self.frozen = {
            k: v.detach().clone() for k, v in model.state_dict().items() if k not in self.trainable
        }

    def __call__(self, model: HookedTransformer) -> dict[str, Tensor]:
        state = model.state_dict()
        return {k: (state[k].detach().clone() if k in self.trainable else self.frozen[k]) for k in state}


@dataclass
class Trajectory:
    """One training run: in-memory checkpoints ``(step, state_dict)`` and a tidy probe table.

    ``probes`` has one row per checkpoint x measure (columns ``run, step, measure, value``).
    ``build`` returns a fresh model of the right shape; :meth:`model_at` loads a checkpoint into it.
    """

    run: str
    checkpoints: list[tuple[int, dict[str, Tensor]]]
    probes: pd.DataFrame
    build: Callable[[], HookedTransformer] = field(repr=False)

    @property
    def steps(self) -> list[int]:
        return [s for s, _ in self.checkpoints]

    def model_at(self, step: int) -> HookedTransformer:
        """The model as it was at checkpoint ``step`` (a fresh copy, in eval mode)."""
        for s, state in self.checkpoints:
            if s == step:
                model = self.build()
                model.load_state_dict(state, strict=True)
                return model.eval()
        raise KeyError(f"No checkpoint at step {step} in run {self.run!r}; recorded steps: {self.steps}.")

    def model_factories(self) -> list[tuple[int, Callable[[], HookedTransformer]]]:
        """``[(step, make_model), ...]``: one callable per checkpoint, for trajectory tools."""
        return [(s, (lambda s=s: self.model_at(s))) for s in self.steps]

    def to_dict(self) -> dict:
        return {"run": self.run, "checkpoints": self.checkpoints, "probes": self.probes.to_dict("list")}


def measure_checkpoints(
    run: str,
    checkpoints: Iterable[tuple[int, HookedTransformer]],
    measure: Callable[[HookedTransformer], dict[str, float]],
) -> pd.DataFrame:
    """Tidy table of ``measure(model)`` at every ``(step, model)``."""
    rows = [
        {"run": run, "step": step, "measure": k, "value": float(v)}
        for step, model in checkpoints
        for k, v in measure(model).items()
    ]
    return pd.DataFrame(rows, columns=["run", "step", "measure", "value"])


def checkpoint_steps(total: int, every: int) -> list[int]:
    """Steps at which a run of ``total`` steps saves: 0, every, 2 every, ..., and always the last."""
    if every < 1:
        raise ValueError(f"checkpoint_every must be a positive integer, got {every!r}.")
    steps = list(range(0, total + 1, every))
    if steps[-1] != total:
        steps.append(total)
    return steps
