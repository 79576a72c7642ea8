"""Weight truncation (LASER-style rank reduction) and MLP drops, and sweeps over layer x rho.

Chen, Bruna & Bietti (2024) argue that generic, context-free associations ("Madrid is located
in" -> " the") live largely in feed-forward weights, and that cutting those weights down to a
few singular directions can let the in-context or factual answer win. This module makes that a
measurement on any HookedTransformer:

- :func:`truncate` swaps weight matrices for their best rank-``k`` approximation, with
  ``k = floor(rho * min(d_in, d_out))``, inside a ``with`` block, and puts the original tensors
  back on exit (bit for bit, also after an exception);
- :func:`drop_mlp` zeroes whole MLP blocks (``hook_mlp_out``), which differs from ``rho = 0``
  when the MLP has biases;
- :func:`truncation_sweep` reads candidate-answer probabilities at the final position for every
  layer x rho (x example x conflict type), factorizing each matrix once.

Layers are 0-based, as in TransformerLens (the paper's "16-th layer" of a 16-layer Pythia is
layer 15 here).
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import plotly.express as px
import plotly.graph_objects as go
import torch
from jaxtyping import Float
from plotly.subplots import make_subplots
from torch import Tensor
from tqdm.auto import tqdm
from transformer_lens import HookedTransformer

from .data.examples import CONFLICT_TYPES, ConflictDataset
from .interventions import Knockout, check_layer, intervene
from .scoring import (
    _batches,
    answer_token,
    check_dataset,
    pad_tokens,
    tokenize_prompts,
    unembed_final,
)

__all__ = [
    "MATRICES",
    "Truncation",
    "TruncationResult",
    "drop_mlp",
    "low_rank_approx",
    "plot_truncation",
    "plot_truncation_heatmap",
    "truncate",
    "truncation_matrices",
    "truncation_rank",
    "truncation_sweep",
]

MATRICES: dict[str, str] = {
    "mlp_in": "MLP input W_in [d_model, d_mlp] (up_proj on gated MLPs)",
    "mlp_gate": "MLP gate W_gate [d_model, d_mlp] (gated MLPs only, e.g. Gemma)",
    "mlp_out": "MLP output W_out [d_mlp, d_model]",
    "attn_v": "per-head value matrix W_V [d_model, d_head] (per key/value head on grouped-query models)",
    "attn_o": "per-query-head output matrix W_O [d_head, d_model]",
    "attn_ov": "per-query-head OV product W_V W_O [d_model, d_model]; rank is a fraction of d_head",
}
"""The matrices :class:`Truncation` can act on, with what each is."""

_ALIASES = {"W_in": "mlp_in", "W_gate": "mlp_gate", "W_out": "mlp_out", "W_V": "attn_v", "W_O": "attn_o",
            "OV": "attn_ov", "W_OV": "attn_ov"}

DEFAULT_RHOS: tuple[float, ...] = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


# ---------------------------------------------------------------------------------------------
# Ranks and low-rank approximations


def truncation_rank(rho: float, n_rows: int, n_cols: int | None = None) -> int:
    """``floor(rho * min(n_rows, n_cols))``: the rank LASER keeps (``n_cols`` defaults to ``n_rows``).

    The product is rounded to 9 decimals before the floor, so that e.g. ``0.29 * 100`` gives 29
    rather than 28 through float error.
    """
    rho = _check_rho(rho)
    n = n_rows if n_cols is None else min(n_rows, n_cols)
    return math.floor(round(rho * n, 9))


def low_rank_approx(matrix: Float[Tensor, "*batch m n"], rank: int) -> Float[Tensor, "*batch m n"]:
    """The best rank-``rank`` approximation of ``matrix`` (per leading batch index), in its dtype.

    Keeps the top singular triplets of a float64 SVD (Eckart-Young: optimal in Frobenius and
    spectral norm). A rank at or above ``min(m, n)`` returns the matrix itself, unchanged.
    """
    if not isinstance(rank, numbers.Integral) or isinstance(rank, bool) or rank < 0:
        raise ValueError(f"rank must be a non-negative integer, got {rank!r}.")
    if rank >= min(matrix.shape[-2:]):
        return matrix
    u, s, vh = torch.linalg.svd(matrix.detach().double(), full_matrices=False)
    return _reconstruct(u, s, vh, rank).to(matrix.dtype)


def _reconstruct(u: Tensor, s: Tensor, vh: Tensor, rank: int) -> Tensor:
    return (u[..., :rank] * s[..., None, :rank]) @ vh[..., :rank, :]


def _check_rho(rho) -> float:
    if isinstance(rho, bool) or not isinstance(rho, numbers.Real) or not 0.0 <= float(rho) <= 1.0:
        raise ValueError(
            f"rho must be a number in [0, 1] (the fraction of rank kept; 1 = the full matrix), got {rho!r}."
        )
    return float(rho)


# ---------------------------------------------------------------------------------------------
# Which matrices a model has


def truncation_matrices(model: HookedTransformer) -> tuple[str, ...]:
    """The names in :data:`MATRICES` that exist on ``model`` (e.g. no ``mlp_gate`` on GPT-2)."""
    names = []
    block = model.blocks[0]
    mlp = getattr(block, "mlp", None)
    if not model.cfg.attn_only and mlp is not None:
        for name, attr in (("mlp_in", "W_in"), ("mlp_gate", "W_gate"), ("mlp_out", "W_out")):
            if isinstance(getattr(mlp, attr, None), torch.nn.Parameter):
                names.append(name)
    attn = getattr(block, "attn", None)
    if attn is not None and isinstance(getattr(attn, "W_O", None), torch.nn.Parameter):
        if isinstance(getattr(attn, "_W_V", None), torch.nn.Parameter) or isinstance(
            getattr(attn, "W_V", None), torch.nn.Parameter
        ):
            names += ["attn_v", "attn_o", "attn_ov"]
        else:
            names.append("attn_o")
    return tuple(names)


def _canonical_matrix(model: HookedTransformer, matrix: str) -> str:
    name = _ALIASES.get(matrix, matrix)
    available = truncation_matrices(model)
    if name not in MATRICES:
        raise ValueError(f"Unknown matrix {matrix!r}; this model has {', '.join(available)}.")
    if name not in available:
        why = " (its MLP is not gated)" if name == "mlp_gate" else ""
        raise ValueError(
            f"Matrix {matrix!r} does not exist on this model{why}; it has {', '.join(available)}."
        )
    return name


def _gqa(model: HookedTransformer, layer: int) -> bool:
    return isinstance(getattr(model.blocks[layer].attn, "_W_V", None), torch.nn.Parameter)


def _kv_group(model: HookedTransformer, head: int) -> int:
    n_kv = model.cfg.n_key_value_heads or model.cfg.n_heads
    return head // (model.cfg.n_heads // n_kv)


# ---------------------------------------------------------------------------------------------
# The edit spec


@dataclass(frozen=True)
class Truncation:
    """Replace one weight matrix of ``layer`` by its rank-``floor(rho * min(d_in, d_out))`` SVD
    approximation (``rho = 1``: unchanged; ``rho = 0``: zero).

    ``matrix`` is one of :data:`MATRICES` (TransformerLens names ``"W_in"``, ``"W_O"`` ... also
    work). For the per-head attention matrices, ``head`` is ``None`` (every head, each truncated
    on its own) or a query head or tuple of query heads:

    - ``"attn_o"``: each chosen head's ``W_O[h]`` (``d_head x d_model``);
    - ``"attn_v"``: each head's ``W_V``. On grouped-query models several query heads share one
      stored ``W_V`` (Gemma-3: 4 query heads, 1 key/value head), so only ``head=None`` (truncate
      every shared ``W_V``) is well-defined; a single query head is an error;
    - ``"attn_ov"``: the head's OV product ``W_V[h] W_O[h]`` (``d_model x d_model``, rank at most
      ``d_head``, so ``k = floor(rho * d_head)``). The product is written back as two factors:
      ``W_V`` unchanged (it may be shared) and ``W_O[h] <- W_O[h] V_k V_k^T``, with ``V_k`` the
      product's top ``k`` right singular vectors, so that ``W_V W_O'`` is exactly the best rank-``k``
      approximation of ``W_V W_O``. This is well-defined per query head on grouped-query models
      too. The value bias's constant contribution ``b_V[h] W_O[h]`` is kept by moving the change
      into ``b_O``: only the linear map is truncated.
    """

    layer: int
    matrix: str
    rho: float
    head: int | tuple[int, ...] | None = None

    def label(self) -> str:
        head = "" if self.head is None else f" head {self.head}"
        return f"L{self.layer} {self.matrix}{head} rho={self.rho:g}"


EditLike = Truncation | tuple


def _as_truncations(model: HookedTransformer, edits) -> list[Truncation]:
    """Validated :class:`Truncation` list from one spec, a ``(layer, matrix, rho[, head])`` tuple,
    or an iterable of either."""
    if isinstance(edits, Truncation) or (
        isinstance(edits, tuple) and edits and isinstance(edits[0], numbers.Integral)
    ):
        edits = [edits]
    out = []
    for edit in edits:
        if isinstance(edit, tuple):
            if not 3 <= len(edit) <= 4:
                raise ValueError(f"An edit tuple is (layer, matrix, rho) or (layer, matrix, rho, head); got {edit!r}.")
            edit = Truncation(*edit)
        if not isinstance(edit, Truncation):
            raise TypeError(f"Not a truncation: {edit!r}; pass Truncation(layer, matrix, rho) or such a tuple.")
        layer = check_layer(model, edit.layer)
        matrix = _canonical_matrix(model, edit.matrix)
        rho = _check_rho(edit.rho)
        heads = _check_heads(model, layer, matrix, edit.head)
        out.append(Truncation(layer, matrix, rho, heads))
    if not out:
        raise ValueError("No truncations given; pass at least one Truncation(layer, matrix, rho).")
    _check_overlaps(out)
    return out


def _check_heads(model, layer: int, matrix: str, head) -> tuple[int, ...] | None:
    if head is None:
        return None
    if not matrix.startswith("attn_"):
        raise ValueError(f"head= applies to attention matrices only, not {matrix!r}; leave it None.")
    heads = (head,) if isinstance(head, numbers.Integral) else tuple(head)
    n = model.cfg.n_heads
    bad = [h for h in heads if isinstance(h, bool) or not isinstance(h, numbers.Integral) or not 0 <= h < n]
    if bad or not heads:
        raise ValueError(f"Unknown heads {bad or heads!r} in layer {layer}: this model has query heads 0..{n - 1}.")
    heads = tuple(sorted({int(h) for h in heads}))
    if matrix == "attn_v" and _gqa(model, layer) and heads != tuple(range(n)):
        group = _kv_group(model, heads[0])
        sharing = [h for h in range(n) if _kv_group(model, h) == group]
        raise ValueError(
            f"On this grouped-query model query head {heads[0]} shares its W_V with query heads {sharing} "
            f"(key/value head {group}), so its W_V cannot be truncated alone. Use head=None to truncate "
            f"every shared W_V, or matrix='attn_ov' with head={heads[0]} to truncate this head's own OV product."
        )
    return None if heads == tuple(range(n)) else heads


_WRITES = {"mlp_in": {"W_in"}, "mlp_gate": {"W_gate"}, "mlp_out": {"W_out"}, "attn_v": {"W_V"},
           "attn_o": {"W_O"}, "attn_ov": {"W_O", "b_O"}}
_READS = {**_WRITES, "attn_ov": {"W_V", "W_O", "b_V"}}


def _check_overlaps(edits: Sequence[Truncation]) -> None:
    """Two edits of one layer that touch the same weights would depend on their order: refuse."""
    for i, a in enumerate(edits):
        for b in edits[i + 1 :]:
            if a.layer != b.layer:
                continue
            if (_WRITES[a.matrix] & (_READS[b.matrix] | _WRITES[b.matrix])) or (
                _WRITES[b.matrix] & _READS[a.matrix]
            ):
                raise ValueError(
                    f"Edits {a.label()!r} and {b.label()!r} both touch layer {a.layer}'s "
                    f"{sorted((_WRITES[a.matrix] | _READS[a.matrix]) & (_WRITES[b.matrix] | _READS[b.matrix]))}, "
                    "so their result would depend on their order. Give one edit per matrix and layer "
                    "(several heads go in one edit: head=(0, 2)), and do not combine 'attn_ov' with "
                    "'attn_v' or 'attn_o' in one layer."
                )


# ---------------------------------------------------------------------------------------------
# Factorizations and new weights


def _factors(model: HookedTransformer, layer: int, matrix: str, cache: dict | None):
    """SVD factors of the matrix (batched over heads for attention), from ``cache`` if present."""
    key = (layer, matrix)
    if cache is not None and key in cache:
        return cache[key]
    block = model.blocks[layer]
    dtype = block.attn.W_O.dtype
    with torch.no_grad():
        if matrix.startswith("mlp_"):
            weight = getattr(block.mlp, {"mlp_in": "W_in", "mlp_gate": "W_gate", "mlp_out": "W_out"}[matrix])
            u, s, vh = torch.linalg.svd(weight.detach().double(), full_matrices=False)
        elif matrix == "attn_v":
            weight = block.attn._W_V if _gqa(model, layer) else block.attn.W_V
            u, s, vh = torch.linalg.svd(weight.detach().double(), full_matrices=False)
        elif matrix == "attn_o":
            u, s, vh = torch.linalg.svd(block.attn.W_O.detach().double(), full_matrices=False)
        else:  # attn_ov: right singular vectors of W_V W_O per query head, via a QR of W_V
            w_v = block.attn.W_V.detach().double()  # [head, d_model, d_head], expanded on GQA
            q, r = torch.linalg.qr(w_v)
            _, s, vh = torch.linalg.svd(r @ block.attn.W_O.detach().double(), full_matrices=False)
            u = q  # not the product's left vectors; unused for attn_ov
    factors = (u.to(dtype), s.to(dtype), vh.to(dtype)) if matrix != "attn_ov" else (None, s, vh)
    if cache is not None:
        cache[key] = factors
    return factors


def _reference_dim(model: HookedTransformer, matrix: str) -> int:
    """``min(d_in, d_out)`` of the matrix (``d_head`` for the OV product, which cannot exceed it)."""
    cfg = model.cfg
    if matrix.startswith("mlp_"):
        return min(cfg.d_model, cfg.d_mlp)
    return min(cfg.d_model, cfg.d_head)


def _new_weights(model: HookedTransformer, edit: Truncation, cache: dict | None) -> dict[str, Tensor]:
    """Parameter name -> replacement tensor for one edit (empty when the edit changes nothing)."""
    k = truncation_rank(edit.rho, _reference_dim(model, edit.matrix))
    if _is_identity(model, edit):
        return {}  # rho = 1 (or close enough): the exact original weights
    layer, block = edit.layer, model.blocks[edit.layer]
    prefix = f"blocks.{layer}"
    u, s, vh = _factors(model, layer, edit.matrix, cache)
    with torch.no_grad():
        if edit.matrix.startswith("mlp_"):
            attr = {"mlp_in": "W_in", "mlp_gate": "W_gate", "mlp_out": "W_out"}[edit.matrix]
            return {f"{prefix}.mlp.{attr}": _reconstruct(u, s, vh, k).contiguous()}
        if edit.matrix == "attn_v":
            name = f"{prefix}.attn._W_V" if _gqa(model, layer) else f"{prefix}.attn.W_V"
            new = model.get_parameter(name).detach().clone()
            heads = range(new.shape[0]) if edit.head is None else edit.head
            for h in heads:
                new[h] = _reconstruct(u[h], s[h], vh[h], k)
            return {name: new}
        heads = range(model.cfg.n_heads) if edit.head is None else edit.head
        w_o = block.attn.W_O.detach()
        new = w_o.clone()
        if edit.matrix == "attn_o":
            for h in heads:
                new[h] = _reconstruct(u[h], s[h], vh[h], k)
            return {f"{prefix}.attn.W_O": new}
        # attn_ov: project each head's W_O onto the product's top-k right singular directions.
        for h in heads:
            v_k = vh[h, :k].double()
            new[h] = (w_o[h].double() @ v_k.T @ v_k).to(w_o.dtype)
        out = {f"{prefix}.attn.W_O": new}
        b_v = block.attn.b_V.detach()  # [head, d_head], expanded on GQA
        if bool((b_v != 0).any()):
            shift = sum(b_v[h].double() @ (w_o[h].double() - new[h].double()) for h in heads)
            out[f"{prefix}.attn.b_O"] = (block.attn.b_O.detach().double() + shift).to(block.attn.b_O.dtype)
        return out


# ---------------------------------------------------------------------------------------------
# Context managers


@contextlib.contextmanager
def truncate(
    model: HookedTransformer,
    edits: Truncation | tuple | Iterable[Truncation | tuple],
    svd_cache: dict | None = None,
):
    """Apply rank truncations for the duration of a ``with`` block; the weights come back exactly.

    ``edits``: one :class:`Truncation`, a ``(layer, matrix, rho[, head])`` tuple, or a list of
    them (all applied together). The original parameter tensors themselves are put back on exit,
    also when an exception is raised inside the block, so the model is bit-for-bit unchanged.

    ``svd_cache``: a dict to keep factorizations in across calls (key ``(layer, matrix)``), so a
    sweep over rho factorizes each matrix once. It is only valid while the model's weights stay
    as they were when it was filled.

    >>> with truncate(model, [Truncation(16, "mlp_in", 0.01), (16, "mlp_gate", 0.01)]):
    ...     logits = model("Madrid is located in")
    """
    specs = _as_truncations(model, edits)
    replacements: dict[str, Tensor] = {}
    for spec in specs:  # compute everything before touching the model
        replacements.update(_new_weights(model, spec, svd_cache))
    saved: dict[str, Tensor] = {}
    try:
        for name, new in replacements.items():
            param = model.get_parameter(name)
            saved[name] = param.data
            param.data = new.to(device=param.device, dtype=param.dtype)
        yield model
    finally:
        for name, original in saved.items():
            model.get_parameter(name).data = original


@contextlib.contextmanager
def drop_mlp(model: HookedTransformer, layers: int | Iterable[int]):
    """Zero the output of whole MLP blocks (``blocks.{l}.hook_mlp_out``) inside a ``with`` block.

    Unlike ``rho = 0`` on ``mlp_in``, this also removes what the MLP adds through its biases
    (``W_out act(b_in) + b_out``); on a bias-free MLP the two coincide. No weight is touched; the
    hooks are removed on exit.
    """
    layers = [layers] if isinstance(layers, numbers.Integral) else list(layers)
    if not layers:
        raise ValueError("No layers given; pass a layer or a list of layers whose MLP to drop.")
    if "mlp_out" not in truncation_matrices(model):
        raise ValueError("This model has no MLP blocks to drop (attention-only).")
    specs = [Knockout(check_layer(model, layer), "mlp") for layer in layers]
    with intervene(model, specs):
        yield model


# ---------------------------------------------------------------------------------------------
# The sweep


@dataclass
class TruncationResult:
    """What :func:`truncation_sweep` returns.

    - ``per_example``: one row per prompt x setting x candidate: ``example``, (``relation``,
      ``subject``, ``conflict_type`` | ``prompt``), ``edit`` (``"truncate"`` or ``"drop"``),
      ``matrix``, ``layer``, ``rho``, ``rank`` (NaN for drops), ``candidate``, ``token``, ``p``
      (probability under the setting) and ``p_full`` (unedited model);
    - ``summary``: per setting x conflict type x candidate, the mean and spread of ``p`` and the
      mean ``p_full``;
    - ``ratios``: per setting x conflict type, ``p(num) / p(den)`` for the ``ratio`` pair (by
      default correct / generic) as a ratio of means, a mean of ratios, and the mean log ratio,
      each also for the full model (``*_full``). Empty when the pair is not among the candidates.
    """

    per_example: pd.DataFrame
    summary: pd.DataFrame
    ratios: pd.DataFrame

    def _repr_html_(self) -> str:
        return (self.ratios if len(self.ratios) else self.summary)._repr_html_()

    def __repr__(self) -> str:
        shown = self.ratios if len(self.ratios) else self.summary
        return f"TruncationResult({len(self.per_example)} per-example rows)\n{shown!r}"


def _items_from_dataset(model, dataset: ConflictDataset, conflict_types, generic, extra):
    from .scoring import _conflict_types

    conflict_types = _conflict_types(dataset, conflict_types)
    check_dataset(model, dataset, conflict_types)
    prompts, meta, answers = [], [], []
    for conflict_type in conflict_types:
        for i, example in enumerate(dataset):
            prompts.append(example.prompts[conflict_type])
            meta.append({"example": i, "relation": example.relation, "subject": example.subject,
                         "conflict_type": conflict_type})
            roles = {
                "correct": example.answer if conflict_type == "clean" else example.context_answer,
                "parametric": example.answer,
                "context": example.context_answer,
            }
            if generic is not None:
                roles["generic"] = generic
            for label, value in extra.items():
                roles[label] = value if isinstance(value, str) else value[i]
            answers.append(roles)
    return prompts, meta, answers


def _items_from_prompts(prompts: Sequence[str], candidates, generic):
    if not candidates:
        raise ValueError(
            "Plain prompts need candidates: the answers to read, e.g. "
            "candidates={'correct': ' Spain'} (with generic=' the' added) or a per-prompt list of answers."
        )
    if isinstance(candidates, Mapping):
        labelled = dict(candidates)
    elif isinstance(candidates, str):
        labelled = {candidates.strip(): candidates}
    else:
        labelled = {str(c).strip(): c for c in candidates}
    if generic is not None and "generic" not in labelled:
        labelled["generic"] = generic
    for label, value in labelled.items():
        if not isinstance(value, str) and len(value) != len(prompts):
            raise ValueError(
                f"Candidate {label!r} has {len(value)} answers for {len(prompts)} prompts; give one string "
                "(the same answer for every prompt) or one answer per prompt."
            )
    meta = [{"example": i, "prompt": p} for i, p in enumerate(prompts)]
    answers = [{lab: (v if isinstance(v, str) else v[i]) for lab, v in labelled.items()} for i in range(len(prompts))]
    return list(prompts), meta, answers


def _settings(model, layers, rhos, which, drop) -> tuple[list[dict], list]:
    """One dict of labels and one list of edits (or ``"drop"``) per setting."""
    matrices = [which] if isinstance(which, str) else list(which)
    if not matrices:
        raise ValueError(f"which names no matrix; use one or more of {truncation_matrices(model)}.")
    matrices = [_canonical_matrix(model, m) for m in matrices]
    if isinstance(rhos, numbers.Real):
        rhos = [rhos]
    rhos = [_check_rho(r) for r in rhos]
    if not rhos:
        raise ValueError("rhos is empty; give at least one fraction in [0, 1].")
    label = "+".join(matrices)
    labels, conditions = [], []
    for layer in layers:
        for rho in rhos:
            edits = [Truncation(layer, m, rho) for m in matrices]
            _check_overlaps(edits)
            rank = truncation_rank(rho, _reference_dim(model, matrices[0]))
            labels.append({"edit": "truncate", "matrix": label, "layer": layer, "rho": rho, "rank": rank})
            conditions.append(edits)
        if drop:
            labels.append({"edit": "drop", "matrix": "mlp", "layer": layer, "rho": np.nan, "rank": np.nan})
            conditions.append("drop")
    return labels, conditions


def truncation_sweep(
    model: HookedTransformer,
    data: ConflictDataset | str | Sequence[str],
    layers: int | Sequence[int] | None = None,
    rhos: float | Sequence[float] = DEFAULT_RHOS,
    which: str | Sequence[str] = "mlp_in",
    candidates: Mapping[str, str | Sequence[str]] | Sequence[str] | None = None,
    generic: str | None = " the",
    conflict_types: Sequence[str] | None = None,
    drop: bool = True,
    ratio: tuple[str, str] = ("correct", "generic"),
    batch_size: int = 32,
    progress: bool = True,
) -> TruncationResult:
    """Probabilities of candidate answers at the final position, for every layer x rho.

    ``data``: a :class:`~cpsuper.ConflictDataset` (every example x conflict type) or plain
    prompts. Candidates read for a dataset: ``correct`` (the true answer on clean prompts, the
    context's answer on substitution / coherent prompts: the answer the prompt's own context
    supports), ``parametric``, ``context`` and ``generic`` (``" the"``), plus any extra
    ``candidates`` (label -> answer, or per-example answers). For plain prompts, ``candidates``
    is required: a mapping label -> answer string (or one answer per prompt), or a list of
    answer strings (labelled by themselves); ``generic`` is added unless it is ``None``. An
    answer's first token, as it continues the prompt, is what is read.

    ``which``: the matrix to truncate (see :data:`MATRICES`), or several truncated together
    (``("mlp_in", "mlp_gate")``). ``drop`` adds one setting per layer that zeroes the whole MLP
    (:func:`drop_mlp`). ``layers`` default to all.

    Each prompt batch runs once unedited; every setting resumes from its layer's residual stream
    (the layers before it are unchanged), and each matrix is factorized once for all rhos.
    """
    n_layers = model.cfg.n_layers
    if layers is None:
        layers = list(range(n_layers))
    elif isinstance(layers, numbers.Integral):
        layers = [layers]
    layers = [check_layer(model, layer) for layer in layers]
    if not layers:
        raise ValueError(f"layers is empty; give layers in 0..{n_layers - 1} (or None for all).")
    if drop and "mlp_out" not in truncation_matrices(model):
        raise ValueError("drop=True needs MLP blocks, which this model lacks; pass drop=False.")
    labels, conditions = _settings(model, layers, rhos, which, drop)

    if isinstance(data, ConflictDataset):
        extra = {} if candidates is None else dict(candidates) if isinstance(candidates, Mapping) else None
        if extra is None:
            raise ValueError("For a dataset, extra candidates are a mapping label -> answer (or per-example answers).")
        for label, value in extra.items():
            if not isinstance(value, str) and len(value) != len(data):
                raise ValueError(f"Candidate {label!r} has {len(value)} answers for {len(data)} examples.")
        prompts, meta, answers = _items_from_dataset(model, data, conflict_types, generic, extra)
    else:
        if isinstance(data, str):
            data = [data]
        if conflict_types is not None:
            raise ValueError("conflict_types applies to a ConflictDataset, not to plain prompts.")
        prompts, meta, answers = _items_from_prompts(list(data), candidates, generic)
    token_lists = tokenize_prompts(model, prompts)
    cand_labels = list(answers[0])
    ids = torch.tensor([[answer_token(model, a[lab], p) for lab in cand_labels] for a, p in zip(answers, prompts)])

    n_items, n_cand = ids.shape
    p_full = torch.empty((n_items, n_cand))
    p_edit = torch.empty((n_items, len(conditions), n_cand))
    svd_cache: dict = {}
    batches = _batches([len(t) for t in token_lists], batch_size)
    bar = tqdm(total=len(batches) * len(conditions), desc="truncation", disable=not progress, leave=False)
    wanted = {f"blocks.{layer}.hook_resid_pre" for layer in layers}
    for idx in batches:
        tokens, _, last = pad_tokens(model, [token_lists[i] for i in idx], "right")
        rows = torch.arange(len(idx), device=tokens.device)
        batch_ids = ids[idx].to(tokens.device)
        resid_pre: dict[str, Tensor] = {}

        def save(act, hook, store=resid_pre):
            store[hook.name] = act

        # Right padding needs no mask: causal attention keeps padding out of the real positions.
        with torch.inference_mode(), model.hooks(fwd_hooks=[(name, save) for name in wanted]):
            resid = model(tokens, stop_at_layer=n_layers)
            p_full[idx] = _probs(model, resid[rows, last], batch_ids)
        for c, (label, condition) in enumerate(zip(labels, conditions)):
            layer = label["layer"]
            if condition != "drop" and all(_is_identity(model, edit) for edit in condition):
                p_edit[idx, c] = p_full[idx]  # rho = 1: nothing changes, no need to run
                bar.update(1)
                continue
            context = drop_mlp(model, layer) if condition == "drop" else truncate(model, condition, svd_cache)
            with context, torch.inference_mode():
                resid = model(resid_pre[f"blocks.{layer}.hook_resid_pre"], start_at_layer=layer,
                              stop_at_layer=n_layers)
                p_edit[idx, c] = _probs(model, resid[rows, last], batch_ids)
            bar.update(1)
    bar.close()
    return _frames(model, meta, answers, prompts, ids, cand_labels, labels, p_full, p_edit, ratio)


def _is_identity(model: HookedTransformer, edit: Truncation) -> bool:
    dim = _reference_dim(model, edit.matrix)
    return truncation_rank(edit.rho, dim) >= dim


def _probs(model, resid: Float[Tensor, "batch d_model"], ids) -> Tensor:
    logits = unembed_final(model, resid).float()
    return logits.log_softmax(-1).gather(1, ids).exp().cpu()


def _frames(model, meta, answers, prompts, ids, cand_labels, labels, p_full, p_edit, ratio) -> TruncationResult:
    n_items, n_cond, n_cand = p_edit.shape
    item = pd.DataFrame(meta)
    setting = pd.DataFrame(labels)
    setting["rank"] = setting["rank"].astype("Int64")
    grid = pd.DataFrame({
        "item": np.repeat(np.arange(n_items), n_cond * n_cand),
        "setting": np.tile(np.repeat(np.arange(n_cond), n_cand), n_items),
        "cand": np.tile(np.arange(n_cand), n_items * n_cond),
        "p": p_edit.reshape(-1).numpy().astype(float),
    })
    grid["p_full"] = p_full.numpy().astype(float)[grid["item"], grid["cand"]]
    grid["candidate"] = np.array(cand_labels, dtype=object)[grid["cand"]]
    decoded = {t: model.tokenizer.decode([t]) for t in ids.unique().tolist()}
    grid["token"] = [decoded[t] for t in ids.numpy()[grid["item"], grid["cand"]]]
    per = pd.concat(
        [item.iloc[grid["item"]].reset_index(drop=True), setting.iloc[grid["setting"]].reset_index(drop=True),
         grid[["candidate", "token", "p", "p_full"]]],
        axis=1,
    )
    keys = [*setting.columns, *(["conflict_type"] if "conflict_type" in item else [])]
    summary = (
        per.groupby([*keys, "candidate"], sort=False, dropna=False)
        .agg(n=("p", "size"), p_mean=("p", "mean"), p_std=("p", "std"), p_full_mean=("p_full", "mean"))
        .reset_index()
    )
    summary["delta_mean"] = summary["p_mean"] - summary["p_full_mean"]
    ratios = pd.DataFrame()
    if set(ratio) <= set(cand_labels):
        # Back into the sweep's own order (pivoting sorts the settings).
        order = summary[keys].drop_duplicates()
        ratios = order.merge(_ratios(per, keys, ratio), on=keys, how="left")
        ratios.attrs["ratio"] = ratio
    return TruncationResult(per, summary, ratios)


def _ratios(per: pd.DataFrame, keys: list[str], ratio: tuple[str, str]) -> pd.DataFrame:
    num, den = ratio
    index = [c for c in per.columns if c not in ("candidate", "token", "p", "p_full")]
    wide = per.pivot_table(index=index, columns="candidate", values=["p", "p_full"], dropna=False).reset_index()
    wide = wide.dropna(subset=[("p", num)])
    out = []
    for suffix, col in (("", "p"), ("_full", "p_full")):
        a, b = wide[(col, num)].to_numpy(), wide[(col, den)].to_numpy()
        frame = pd.DataFrame({k: wide[(k, "")] for k in keys})
        frame["a"], frame["b"], frame["r"], frame["lr"] = a, b, a / b, np.log(a) - np.log(b)
        agg = frame.groupby(keys, sort=False, dropna=False).agg(
            n=("a", "size"), num=("a", "mean"), den=("b", "mean"), mean_of_ratios=("r", "mean"),
            mean_log_ratio=("lr", "mean"),
        )
        agg["ratio_of_means"] = agg["num"] / agg["den"]
        agg["log_ratio_of_means"] = np.log(agg["ratio_of_means"])
        agg = agg.rename(columns={"num": f"p_{num}", "den": f"p_{den}"})
        if suffix:
            agg = agg.drop(columns="n")
        out.append(agg.add_suffix(suffix))
    result = pd.concat(out, axis=1).reset_index()
    result.attrs["ratio"] = ratio
    return result


# ---------------------------------------------------------------------------------------------
# Figures


def _pick_conflict_type(frame: pd.DataFrame, conflict_type: str | None) -> pd.DataFrame:
    if conflict_type is None or "conflict_type" not in frame:
        return frame
    if conflict_type not in set(frame.conflict_type):
        raise ValueError(f"Conflict type {conflict_type!r} is not in this sweep; it has {sorted(set(frame.conflict_type))}.")
    return frame[frame.conflict_type == conflict_type]


def _types(frame: pd.DataFrame) -> list:
    if "conflict_type" not in frame:
        return [None]
    values = list(dict.fromkeys(frame.conflict_type))
    return [c for c in CONFLICT_TYPES if c in values] + [c for c in values if c not in CONFLICT_TYPES]


def plot_truncation(
    result: TruncationResult,
    conflict_type: str | None = None,
    candidates: Sequence[str] | None = None,
    log_y: bool = False,
    wrap: int = 6,
) -> go.Figure:
    """Mean candidate probability against rho, one line per candidate, one panel per layer.

    Dashed lines: the unedited model; a lone marker at rho = 0 labelled ``drop``: the MLP dropped.
    With several conflict types (and none chosen), one row of panels per conflict type. rho is
    shown as categories, so small fractions are not squeezed against 0.
    """
    summary = _pick_conflict_type(result.summary, conflict_type)
    if candidates is not None:
        missing = sorted(set(candidates) - set(summary.candidate))
        if missing:
            raise ValueError(f"Candidates {missing} are not in this sweep; it has {sorted(set(summary.candidate))}.")
        summary = summary[summary.candidate.isin(candidates)]
    trunc = summary[summary.edit == "truncate"].sort_values("rho")
    rho_text = trunc["rho"].map(lambda r: f"{r:g}")
    order = list(dict.fromkeys(rho_text))
    parts = [
        trunc.assign(x=rho_text, y=trunc.p_mean, model="truncated"),
        trunc.assign(x=rho_text, y=trunc.p_full_mean, model="full model"),
    ]
    dropped = summary[summary.edit == "drop"]
    if len(dropped):
        parts.append(dropped.assign(x=order[0], y=dropped.p_mean, model="MLP dropped"))
    frame = pd.concat(parts, ignore_index=True)
    types = _types(frame)
    facet = {"facet_col": "layer"}
    if len(types) > 1:
        facet["facet_row"] = "conflict_type"
    else:
        facet["facet_col_wrap"] = min(wrap, frame.layer.nunique())
    fig = px.line(
        frame, x="x", y="y", color="candidate", line_dash="model", symbol="model", markers=True,
        category_orders={"x": order, "conflict_type": [t for t in types if t is not None],
                         "model": ["truncated", "full model", "MLP dropped"]},
        log_y=log_y, **facet,
        labels={"x": "rho (fraction of rank kept)", "y": "probability", "layer": "layer"},
        hover_data={"rank": True, "n": True},
    )
    matrix = ", ".join(dict.fromkeys(trunc.matrix)) if len(trunc) else "mlp"
    where = f" ({conflict_type})" if conflict_type else ""
    fig.update_layout(title=f"Candidate probability under rank truncation of {matrix}{where}", height=300 + 220 * (
        len(types) if len(types) > 1 else math.ceil(frame.layer.nunique() / facet.get("facet_col_wrap", 1)) - 1))
    return fig


def plot_truncation_heatmap(
    result: TruncationResult,
    value: str = "log_ratio_of_means",
    relative: bool = False,
) -> go.Figure:
    """Layer x rho heatmap of ``log p(num) / p(den)`` (by default correct vs generic), one panel
    per conflict type. ``value``: ``"log_ratio_of_means"`` or ``"mean_log_ratio"``;
    ``relative=True`` subtracts the unedited model's value, so 0 means no change."""
    ratios = result.ratios
    if ratios is None or len(ratios) == 0:
        raise ValueError("This sweep has no ratio: its candidates lack the ratio pair (by default 'correct' and 'generic').")
    if value not in ("log_ratio_of_means", "mean_log_ratio"):
        raise ValueError(f"value must be 'log_ratio_of_means' or 'mean_log_ratio', got {value!r}.")
    num, den = ratios.attrs.get("ratio", ("correct", "generic"))
    trunc = ratios[ratios.edit == "truncate"].copy()
    trunc["z"] = trunc[value] - (trunc[f"{value}_full"] if relative else 0)
    types = _types(trunc)
    rhos = sorted(trunc.rho.unique())
    layers = sorted(trunc.layer.unique())
    bound = float(np.nanmax(np.abs(trunc.z))) if len(trunc) else 1.0
    fig = make_subplots(rows=1, cols=len(types), shared_yaxes=True, horizontal_spacing=0.03,
                        subplot_titles=[t or "" for t in types])
    for col, conflict_type in enumerate(types, start=1):
        part = trunc if conflict_type is None else trunc[trunc.conflict_type == conflict_type]
        grid = part.pivot_table(index="layer", columns="rho", values="z", dropna=False).reindex(
            index=layers, columns=rhos)
        fig.add_trace(
            go.Heatmap(
                z=grid.to_numpy(), x=[f"{r:g}" for r in rhos], y=layers, zmid=0, zmin=-bound, zmax=bound,
                colorscale="RdBu", showscale=col == 1, colorbar={"title": "change" if relative else "log ratio"},
                hovertemplate="layer %{y}, rho %{x}: %{z:.2f}<extra></extra>",
            ),
            row=1, col=col,
        )
        fig.update_xaxes(title_text="rho", type="category", row=1, col=col)
    fig.update_yaxes(title_text="layer", row=1, col=1)
    what = f"log p({num}) / p({den})" + (" minus the full model's" if relative else "")
    fig.update_layout(title=f"{what} under rank truncation", height=max(300, 22 * len(layers) + 150))
    return fig
