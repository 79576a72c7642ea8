"""Plumbing shared by every toy: checkpoint schedules and snapshots, run records, the one-head
attention model of the training-dynamics toys, and its training loop.

Run records
    :class:`ToyRun` (noisy recall, associative memory) keeps a config, ``(step, state_dict)``
    checkpoints, a tidy probe table and extra tensors, and saves to one ``torch.save`` file
    loadable with ``weights_only=True``. :class:`Trajectory` (inversion, finetuning) keeps one
    named run's checkpoints and probes with a factory that rebuilds the model.

The attention toy
    The inversion and finetuning toys are a single attention head whose last token reads from
    earlier tokens through a bilinear key-query matrix ``W_KQ`` and a value matrix ``W_V``, with
    fixed embeddings and a fixed unembedding. :func:`attention_toy_model` writes that model as an
    attention-only TransformerLens model *exactly* (a ``HookedTransformer`` on TransformerLens 3.x,
    the native bridge on 4.3, see :mod:`cpsuper.toys.build`), so that cpsuper's hooks, caches and
    interventions work on it:

    * the residual stream has ``2 d`` dimensions; tokens are embedded into the first ``d``, the
      head writes into the last ``d`` and the unembedding reads only the last ``d``. The residual
      skip connection therefore adds nothing to the logits: logits are the head's output alone, as
      in the papers' models (which have no skip connection);
    * ``W_Q`` is a frozen identity and ``W_K`` holds ``W_KQ``, so the attention score of key
      ``y`` for query ``x`` is ``phi(y)^T W_KQ phi(x)``, and gradient descent on ``W_K`` *is*
      gradient descent on the full matrix ``W_KQ`` (a factorised ``W_K W_Q^T`` started at zero
      would never move);
    * no attention scaling, no layer norm, zero (frozen) positional embeddings and biases.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd
import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from ..backend import Model
from .build import hooked_state, load_toy_state, toy_parameter, toy_transformer, trainable_names, write_weights

__all__ = [
    "KQ_PARAM",
    "PROBE_COLUMNS",
    "V_PARAM",
    "Snapshotter",
    "ToyRun",
    "Trajectory",
    "attention_toy_model",
    "blank_attention_model",
    "checkpoint_steps",
    "load_config",
    "find_state",
    "last_position",
    "probe_frame",
    "probe_rows",
    "toy_matrices",
    "train_attention_toy",
]

KQ_PARAM = "blocks.0.attn.W_K"
"""Parameter of :func:`attention_toy_model` that holds ``W_KQ``."""
V_PARAM = "blocks.0.attn.W_V"
"""Parameter of :func:`attention_toy_model` that holds ``W_V`` (transposed)."""
PROBE_COLUMNS = ["run", "step", "measure", "value"]
"""Columns of a :class:`Trajectory`'s probe table."""


# ---------------------------------------------------------------------------------------------
# Checkpoints and configs


def checkpoint_steps(steps: int, every: int, extra: Iterable[int] = ()) -> list[int]:
    """Steps at which a run of ``steps`` steps records a checkpoint: 0, every ``every`` steps, the
    last step, plus ``extra`` (early steps, where the fastest dynamics happen), sorted and
    deduplicated. Raises ``ValueError`` on a negative ``steps`` or a non-positive ``every``."""
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}.")
    if every < 1:
        raise ValueError(f"checkpoint_every must be >= 1, got {every}.")
    out = set(range(0, steps + 1, every)) | {steps}
    out |= {int(s) for s in extra if 0 <= int(s) <= steps}
    return sorted(out)


class Snapshotter:
    """Copies a model's weights (:func:`~cpsuper.toys.build.hooked_state`: TransformerLens names
    and layout on either backend) to the CPU at each checkpoint; the frozen tensors are copied once
    and shared by every snapshot (only trained parameters change between checkpoints)."""

    def __init__(self, model: Model):
        self.trainable = trainable_names(model)
        self.frozen = {k: _cpu_copy(v) for k, v in hooked_state(model).items() if k not in self.trainable}

    def __call__(self, model: Model) -> dict[str, Tensor]:
        state = hooked_state(model)
        return {k: _cpu_copy(v) if k in self.trainable else self.frozen[k] for k, v in state.items()}


def _cpu_copy(tensor: Tensor) -> Tensor:
    return tensor.detach().to("cpu", copy=True)


def find_state(checkpoints: list[tuple[int, dict[str, Tensor]]], step: int, *, where: str = "") -> dict[str, Tensor]:
    """The state dict saved at ``step``; ``KeyError`` naming the recorded steps otherwise."""
    for saved, state in checkpoints:
        if saved == step:
            return state
    recorded = [s for s, _ in checkpoints]
    raise KeyError(f"No checkpoint at step {step}{where}; checkpointed steps are {recorded}.")


def load_config(config_cls: type, values: Mapping[str, Any]) -> Any:
    """Rebuild a frozen config dataclass from ``dataclasses.asdict`` output read back from disk:
    lists become tuples again and the config's own warnings (already shown when the run was
    made) are not repeated."""
    fixed = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return config_cls(**fixed)


# ---------------------------------------------------------------------------------------------
# Run records


@dataclass
class ToyRun:
    """The record of one toy training run.

    ``checkpoints`` are ``(step, state_dict)`` pairs in step order; ``probes`` is a tidy
    DataFrame with at least the columns ``step, measure, value``; ``extras`` holds any other
    tensors the run needs to be rebuilt (e.g. the data distribution). Subclasses set
    ``config_cls`` so that :meth:`load` can rebuild the configuration.
    """

    config: Any
    checkpoints: list[tuple[int, dict[str, Tensor]]] = field(default_factory=list)
    probes: pd.DataFrame = field(default_factory=pd.DataFrame)
    extras: dict[str, Tensor] = field(default_factory=dict)

    config_cls: ClassVar[type | None] = None

    @property
    def steps(self) -> list[int]:
        """The checkpointed steps, in order."""
        return [step for step, _ in self.checkpoints]

    def state_at(self, step: int | None = None) -> dict[str, Tensor]:
        """The state dict saved at ``step`` (the last checkpoint when ``None``)."""
        if not self.checkpoints:
            raise ValueError("This run has no checkpoints.")
        return self.checkpoints[-1][1] if step is None else find_state(self.checkpoints, step)

    def save(self, path: str | Path) -> None:
        """Write the run (config, checkpoints, probes) to ``path`` with ``torch.save``."""
        payload = {
            "kind": type(self).__name__,
            "config": dataclasses.asdict(self.config),
            "checkpoints": [(int(step), state) for step, state in self.checkpoints],
            "probes": {"columns": list(self.probes.columns), "data": self.probes.to_dict("list")},
            "extras": dict(self.extras),
        }
        torch.save(payload, Path(path))

    @classmethod
    def load(cls, path: str | Path) -> ToyRun:
        """Read a run written by :meth:`save` (of this same run class)."""
        payload = torch.load(Path(path), map_location="cpu", weights_only=True)
        if payload.get("kind") != cls.__name__:
            raise ValueError(f"{path} holds a {payload.get('kind')!r}, not a {cls.__name__!r}.")
        config = load_config(cls.config_cls, payload["config"]) if cls.config_cls else payload["config"]
        probes = pd.DataFrame(payload["probes"]["data"], columns=payload["probes"]["columns"])
        checkpoints = [(int(step), state) for step, state in payload["checkpoints"]]
        return cls(config=config, checkpoints=checkpoints, probes=probes, extras=payload.get("extras", {}))


@dataclass
class Trajectory:
    """One named training run: in-memory checkpoints ``(step, state_dict)`` and a tidy probe table.

    ``probes`` has one row per checkpoint x measure (columns :data:`PROBE_COLUMNS`).
    ``build`` returns a fresh model of the right shape; :meth:`model_at` loads a checkpoint into it.
    """

    run: str
    checkpoints: list[tuple[int, dict[str, Tensor]]]
    probes: pd.DataFrame
    build: Callable[[], Model] = field(repr=False)

    @property
    def steps(self) -> list[int]:
        """The checkpointed steps, in order."""
        return [s for s, _ in self.checkpoints]

    def model_at(self, step: int) -> Model:
        """The model as it was at checkpoint ``step`` (a fresh copy, in eval mode)."""
        state = find_state(self.checkpoints, step, where=f" in run {self.run!r}")
        return load_toy_state(self.build(), state).eval()

    def model_factories(self) -> list[tuple[int, Callable[[], Model]]]:
        """``[(step, make_model), ...]``: one callable per checkpoint, for trajectory tools."""
        return [(s, (lambda s=s: self.model_at(s))) for s in self.steps]

    def to_dict(self) -> dict:
        """Plain containers of tensors, numbers and strings (for ``torch.save``)."""
        return {"run": self.run, "checkpoints": self.checkpoints, "probes": self.probes.to_dict("list")}

    @classmethod
    def from_dict(cls, blob: Mapping[str, Any], build: Callable[[], Model]) -> Trajectory:
        """The inverse of :meth:`to_dict`, given the model factory."""
        checkpoints = [(int(s), state) for s, state in blob["checkpoints"]]
        return cls(blob["run"], checkpoints, pd.DataFrame(blob["probes"]), build)


def probe_rows(run: str, step: int, measures: Mapping[str, float]) -> list[dict]:
    """``measures`` at ``step`` of ``run`` as rows of a :class:`Trajectory` probe table."""
    return [{"run": run, "step": step, "measure": k, "value": float(v)} for k, v in measures.items()]


def probe_frame(rows: list[dict]) -> pd.DataFrame:
    """A probe table with the :data:`PROBE_COLUMNS` (also when ``rows`` is empty)."""
    return pd.DataFrame(rows, columns=PROBE_COLUMNS)


# ---------------------------------------------------------------------------------------------
# The one-head attention toy


def blank_attention_model(*, seed: int, name: str, backend: str | None = None, **dims: int) -> Model:
    """An attention-only float32 CPU model with learned positions, no norms and unscaled attention
    scores, every parameter zero, for the toys to write their constructed weights into. ``dims``:
    ``n_layers``, ``n_heads``, ``d_model``, ``d_head``, ``d_vocab``, ``n_ctx``; ``backend`` as in
    :func:`~cpsuper.toys.build.toy_transformer`."""
    options = {"normalization_type": None, "positional_embedding_type": "standard", "use_attn_scale": False}
    model = toy_transformer(
        **dims, **options, attn_only=True, act_fn=None, seed=seed, device="cpu", model_name=name, backend=backend
    )
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


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
    backend: str | None = None,
) -> Model:
    """One layer, one head, attention only: ``logits = unembed^T W_V sum_y softmax_y(phi(y)^T W_KQ phi(q)) phi(y)``.

    ``embed[t]`` is token ``t``'s embedding ``phi(t)``; ``W_KQ`` and ``W_V`` act on embeddings as in
    the papers (columns are inputs). Only ``W_KQ`` (stored in ``W_K``) and, if asked, ``W_V`` are
    trainable; everything else is frozen. ``backend``: as in :func:`~cpsuper.toys.build.toy_transformer`.
    """
    vocab, d = embed.shape
    if unembed.shape != (d, vocab) or W_KQ.shape != (d, d) or W_V.shape != (d, d):
        raise ValueError(
            f"Shapes do not fit together: embed {tuple(embed.shape)}, unembed {tuple(unembed.shape)}, "
            f"W_KQ {tuple(W_KQ.shape)}, W_V {tuple(W_V.shape)}."
        )
    model = blank_attention_model(
        n_layers=1, n_heads=1, d_model=2 * d, d_head=d, d_vocab=vocab, n_ctx=n_ctx, seed=0, name=name, backend=backend
    )
    eye = torch.eye(d)
    zeros = torch.zeros(d, d)
    write_weights(
        model,
        {
            "embed.W_E": torch.cat([embed, torch.zeros(vocab, d)], dim=1),
            "blocks.0.attn.W_Q": torch.cat([eye, zeros])[None],
            KQ_PARAM: torch.cat([W_KQ, zeros])[None],
            V_PARAM: torch.cat([W_V.T, zeros])[None],
            "blocks.0.attn.W_O": torch.cat([zeros, eye], dim=1)[None],
            "unembed.W_U": torch.cat([torch.zeros(d, vocab), unembed]),
        },
    )
    for p in model.parameters():
        p.requires_grad_(False)
    toy_parameter(model, KQ_PARAM).requires_grad_(train_kq)
    toy_parameter(model, V_PARAM).requires_grad_(train_v)
    return model.eval()


def toy_matrices(model: Model) -> tuple[Float[Tensor, "d d"], Float[Tensor, "d d"]]:
    """``(W_KQ, W_V)`` of a model built by :func:`attention_toy_model`, in the papers' orientation."""
    attn = model.blocks[0].attn
    d = attn.W_K.shape[-1]
    return attn.W_K[0, :d].detach().clone(), attn.W_V[0, :d].detach().T.clone()


def last_position(
    model: Model, tokens: Int[Tensor, "batch pos"]
) -> tuple[Float[Tensor, "batch vocab"], Float[Tensor, "batch pos"]]:
    """Final-position logits and the head's attention pattern from the final position, in one pass."""
    store = {}

    def keep(pattern, hook):
        store["pattern"] = pattern[:, 0, -1, :]

    logits = model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_pattern", keep)])
    return logits[:, -1, :], store["pattern"]


def train_attention_toy(
    model: Model,
    batch: Callable[[], tuple[Int[Tensor, "batch pos"], Int[Tensor, " batch"]]],
    measure: Callable[[Model], Mapping[str, float]],
    *,
    run: str,
    steps: int,
    every: int,
    lr: float,
    build: Callable[[], Model],
    progress: bool = False,
) -> Trajectory:
    """Plain SGD on the final-position cross-entropy of ``batch()`` (called once per step), with a
    checkpoint and the ``measure(model)`` probes at :func:`checkpoint_steps` ``(steps, every)``.

    Trains ``model`` in place (in train mode) and returns the run's :class:`Trajectory`.
    """
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    save_at = set(checkpoint_steps(steps, every))
    snap, checkpoints, rows = Snapshotter(model), [], []
    for step in tqdm(range(steps + 1), disable=not progress, desc=run, leave=False):
        if step in save_at:
            checkpoints.append((step, snap(model)))
            rows += probe_rows(run, step, measure(model))
        if step == steps:
            break
        tokens, labels = batch()
        opt.zero_grad()
        F.cross_entropy(model(tokens)[:, -1, :], labels).backward()
        opt.step()
    return Trajectory(run, checkpoints, probe_frame(rows), build)
