"""Proposition 5.3 of the JuICE paper on the theory toy: does gradient descent find the superposed layer?

The paper argues (Appendix G, Prop. G.5) that with the first layer fixed to a previous-token head,
the second layer's ``W_KQ`` and ``W_OV``, trained from zero by gradient descent on the cross-entropy
of a mix of factual-recall and induction prompts, take the form of eqs. 3-4: one head whose scores
favour the remapped trigger ``phi'(q)`` and the subjects, and whose values map each noise token and
each subject to its answer. :func:`learn_second_layer` runs exactly that on
:class:`~cpsuper.toys.juice_theory.TheoryToy`: layer 0, the embeddings, positions and unembeddings
stay the construction's, layer 1 (softmax attention, one head, ``W_Q = W_O = I``) starts at zero and
takes full-batch gradient steps. Along the way it records the tasks' accuracies, the conflict
behaviour and readouts of the learned matrices in the construction's own coordinates
(:func:`layer_readouts`), and at the end it writes the learned layer into a TheoryToy model so
the steering tools of :mod:`cpsuper.toys.juice_theory` apply to it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd
import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor

from .build import write_weights
from .juice_theory import TheoryConfig, TheoryPrompts, TheoryToy

__all__ = ["LearnedLayer", "layer_forward", "layer_readouts", "learn_second_layer"]

READOUTS = ("c1", "c2", "c3", "c4", "cos_kq", "cos_ov")


@dataclass
class LearnedLayer:
    """Result of :func:`learn_second_layer`: the learned ``W_KQ`` / ``W_OV`` (acting on residual
    vectors as columns), the toy with layer 1 replaced by them, and ``history``, one row per
    recorded step with ``loss`` (training), ``acc_recall``, ``acc_induction`` (held-out prompts),
    ``conflict_parametric``, ``conflict_context`` (share of conflict prompts answered with the fact /
    the induction token), the readouts ``c1 .. c4, cos_kq, cos_ov`` and ``predicted`` (the answer
    Corollary 5.4 gives with the read-out constants)."""

    W_KQ: Float[Tensor, "d d"]
    W_OV: Float[Tensor, "d d"]
    toy: TheoryToy
    history: pd.DataFrame


def _residual(toy: TheoryToy, data: TheoryPrompts) -> Float[Tensor, "n seq d"]:
    """The residual stream entering layer 1 (embeddings, positions and the previous-token head)."""
    with torch.inference_mode():
        _, cache = toy.model.run_with_cache(data.tokens, names_filter=lambda name: name == "blocks.1.hook_resid_pre")
    return cache["blocks.1.hook_resid_pre"].double().clone()


def layer_forward(
    resid: Float[Tensor, "n seq d"], W_KQ: Tensor, W_OV: Tensor, W_U: Float[Tensor, "d vocab"]
) -> Float[Tensor, "n vocab"]:
    """Final-position logits of one softmax head on top of ``resid``: key ``x_i`` scores
    ``x_i^T W_KQ x_T``, the head writes ``W_OV sum_i a_i x_i``, plus the residual itself."""
    query = resid[:, -1]
    scores = torch.einsum("nid,de,ne->ni", resid, W_KQ, query)
    mixed = torch.einsum("ni,nid->nd", scores.softmax(-1), resid)
    return (query + mixed @ W_OV.T) @ W_U


def layer_readouts(toy: TheoryToy, W_KQ: Tensor, W_OV: Tensor) -> dict:
    """The learned layer in the construction's coordinates, read through ``toy``'s embeddings
    ``phi``, positions ``p``, unembeddings ``mu`` and its layer-0 remap ``phi'(q) = W_OV^0 phi(q)``.

    The final query is always ``q`` at the last position, so only ``u = phi(q) + p_T`` is fixed in
    it; ``c1 = phi'(q)^T W_KQ u - s0`` and ``c2 = mean_s phi(s)^T W_KQ u - s0`` are the score of
    the remapped trigger and of a subject above that of a noise token (``s0 = mean_k phi(k)^T W_KQ
    u``); ``c3 = mean_k mu(k)^T W_OV phi(k)``, ``c4 = mean_s mu(G(s))^T W_OV phi(s)``. For the
    construction they return ``c1 .. c4`` exactly. ``cos_kq``: cosine similarity of the key
    direction ``W_KQ u`` with the construction's (``c1 phi'(q) + c2 sum_s phi(s)``); ``cos_ov``:
    of ``W_OV`` with the construction's (Frobenius inner product)."""
    config, model = toy.config, toy.model
    phi, pos = model.W_E.detach().double(), model.W_pos.detach().double()
    mu = model.W_U.detach().double().T
    remapped_q = phi[0] @ model.W_V[0, 0].detach().double() @ model.W_O[0, 0].detach().double()
    F_, V = config.n_facts, config.vocab
    subjects, noise = torch.arange(1, 1 + F_), torch.arange(1 + 2 * F_, V)
    u = W_KQ @ (phi[0] + pos[-1])
    base = (phi[noise] @ u).mean()
    ov = torch.einsum("kd,de,ke->k", mu, W_OV, phi)  # mu(k)^T W_OV phi(k) for every token k
    fact = torch.einsum("sd,de,se->s", mu[subjects + F_], W_OV, phi[subjects])
    key_ref = config.c1 * remapped_q + config.c2 * phi[subjects].sum(0)
    ov_ref = config.c3 * mu[noise].T @ phi[noise] + config.c4 * mu[subjects + F_].T @ phi[subjects]

    def cos(a, b):
        return float((a * b).sum() / (a.norm() * b.norm()).clamp_min(1e-30))

    return {
        "c1": float(remapped_q @ u - base),
        "c2": float((phi[subjects] @ u).mean() - base),
        "c3": float(ov[noise].mean()),
        "c4": float(fact.mean()),
        "cos_kq": cos(u, key_ref),
        "cos_ov": cos(W_OV, ov_ref),
    }


def _prediction(r: dict) -> str:
    """Corollary 5.4 with the read-out constants (``parametric`` iff exp(c1) c3 < exp(c2) c4)."""
    return "parametric" if math.exp(r["c1"]) * r["c3"] < math.exp(r["c2"]) * r["c4"] else "context"


def learn_second_layer(
    config: TheoryConfig | None = None,
    *,
    steps: int = 400,
    lr: float = 50.0,
    n_train: int = 512,
    n_eval: int = 256,
    record_every: int = 20,
    seed: int = 0,
) -> LearnedLayer:
    """Train layer 1 of the superposed theory toy from zero with full-batch gradient descent.

    The training set is ``n_train`` prompts, half ``recall`` (target ``G(s)``) and half
    ``induction`` (target ``b``), drawn with ``seed``; the loss is the mean cross-entropy at the
    final ``q``; each step is ``W <- W - lr * grad`` on ``W_KQ`` and ``W_OV`` only. Accuracies
    are measured on ``n_eval`` held-out prompts per task (seed ``seed + 1``) at step 0, every
    ``record_every`` steps and the last step.
    """
    config = config or TheoryConfig()
    if steps < 1 or lr <= 0 or n_train < 2 or record_every < 1:
        raise ValueError("steps, lr, n_train // 2 and record_every must be positive.")
    toy = TheoryToy.build(config)  # superposition or not, only layer 0 and the embeddings are used
    W_U = toy.model.W_U.detach().double()
    recall, induction = (
        toy.prompts("recall", n_train // 2, seed=seed),
        toy.prompts("induction", n_train // 2, seed=seed),
    )
    train_x = torch.cat([_residual(toy, recall), _residual(toy, induction)])
    train_y = torch.cat([recall.parametric, induction.context])
    evals = {task: toy.prompts(task, n_eval, seed=seed + 1) for task in ("recall", "induction", "conflict")}
    eval_x = {task: _residual(toy, data) for task, data in evals.items()}
    d = train_x.shape[-1]
    W_KQ = torch.zeros(d, d, dtype=torch.float64, requires_grad=True)
    W_OV = torch.zeros(d, d, dtype=torch.float64, requires_grad=True)
    rows = []
    for step in range(steps + 1):
        loss = F.cross_entropy(layer_forward(train_x, W_KQ, W_OV, W_U), train_y)
        if step % record_every == 0 or step == steps:
            with torch.no_grad():
                top = {task: layer_forward(x, W_KQ, W_OV, W_U).argmax(-1) for task, x in eval_x.items()}
                readouts = layer_readouts(toy, W_KQ, W_OV)
            conflict = evals["conflict"]
            rows.append(
                {
                    "step": step,
                    "loss": loss.item(),
                    "acc_recall": float((top["recall"] == evals["recall"].parametric).double().mean()),
                    "acc_induction": float((top["induction"] == evals["induction"].context).double().mean()),
                    "conflict_parametric": float((top["conflict"] == conflict.parametric).double().mean()),
                    "conflict_context": float((top["conflict"] == conflict.context).double().mean()),
                    **readouts,
                    "predicted": _prediction(readouts),
                }
            )
        if step == steps:
            break
        grad_kq, grad_ov = torch.autograd.grad(loss, (W_KQ, W_OV))
        with torch.no_grad():
            W_KQ -= lr * grad_kq
            W_OV -= lr * grad_ov
    W_KQ, W_OV = W_KQ.detach(), W_OV.detach()
    if config.superposition:  # the learned head replaces the constructed layer 1
        write_weights(toy.model, {"blocks.1.attn.W_K": W_KQ.float()[None], "blocks.1.attn.W_V": W_OV.T.float()[None]})
    return LearnedLayer(W_KQ, W_OV, toy, pd.DataFrame(rows))
