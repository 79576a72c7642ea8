"""Weight truncation (LASER-style rank reduction) and MLP drops, restored exactly on exit."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor

from ..backend import Model, is_bridge, norm_affine, query_head_weights, require_resident_weights
from ..interrupts import hooked, swapped_parameters
from ..interventions import Knockout, intervene
from ..runtime import check_layer
from .hf_weights import hf_matrices, hf_replacements

__all__ = [
    "DEFAULT_RHOS",
    "MATRICES",
    "Truncation",
    "canonical_matrix",
    "check_overlaps",
    "check_rho",
    "drop_mlp",
    "is_identity",
    "low_rank_approx",
    "reference_dim",
    "truncate",
    "truncation_matrices",
    "truncation_rank",
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

_ALIASES = {
    "W_in": "mlp_in",
    "W_gate": "mlp_gate",
    "W_out": "mlp_out",
    "W_V": "attn_v",
    "W_O": "attn_o",
    "OV": "attn_ov",
    "W_OV": "attn_ov",
}

DEFAULT_RHOS: tuple[float, ...] = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


# ---------------------------------------------------------------------------------------------
# Ranks and low-rank approximations


def truncation_rank(rho: float, n_rows: int, n_cols: int | None = None) -> int:
    """``floor(rho * min(n_rows, n_cols))``: the rank LASER keeps (``n_cols`` defaults to ``n_rows``).

    The product is rounded to 9 decimals before the floor, so that e.g. ``0.29 * 100`` gives 29
    rather than 28 through float error.
    """
    rho = check_rho(rho)
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


def check_rho(rho) -> float:
    if isinstance(rho, bool) or not isinstance(rho, numbers.Real) or not 0.0 <= float(rho) <= 1.0:
        raise ValueError(
            f"rho must be a number in [0, 1] (the fraction of rank kept; 1 = the full matrix), got {rho!r}."
        )
    return float(rho)


# ---------------------------------------------------------------------------------------------
# Which matrices a model has


def truncation_matrices(model: Model) -> tuple[str, ...]:
    """The names in :data:`MATRICES` that exist on ``model`` (e.g. no ``mlp_gate`` on GPT-2)."""
    if is_bridge(model):
        return tuple(n for n in hf_matrices(model) if not (model.cfg.attn_only and n.startswith("mlp_")))
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


def canonical_matrix(model: Model, matrix: str) -> str:
    name = _ALIASES.get(matrix, matrix)
    available = truncation_matrices(model)
    if name not in MATRICES:
        raise ValueError(f"Unknown matrix {matrix!r}; this model has {', '.join(available)}.")
    if name not in available:
        why = " (its MLP is not gated)" if name == "mlp_gate" else ""
        raise ValueError(f"Matrix {matrix!r} does not exist on this model{why}; it has {', '.join(available)}.")
    return name


def _gqa(model: Model, layer: int) -> bool:
    if is_bridge(model):
        return (model.cfg.n_key_value_heads or model.cfg.n_heads) < model.cfg.n_heads
    return isinstance(getattr(model.blocks[layer].attn, "_W_V", None), torch.nn.Parameter)


def _stored_w_v(model: Model, layer: int) -> Tensor:
    """``W_V`` as stored: one slice per key/value head ([kv_head, d_model, d_head])."""
    attn = model.blocks[layer].attn
    return attn._W_V if _gqa(model, layer) and not is_bridge(model) else attn.W_V


def _named(model: Model, layer: int, matrix: str, new: Tensor) -> dict[str, Tensor]:
    """Parameter name -> new tensor, for either backend (``matrix``: a MATRICES name or "b_O")."""
    if is_bridge(model):
        return hf_replacements(model, layer, matrix, new)
    attr = {"mlp_in": "mlp.W_in", "mlp_gate": "mlp.W_gate", "mlp_out": "mlp.W_out", "attn_o": "attn.W_O"}
    attr.update(b_O="attn.b_O", attn_v="attn._W_V" if _gqa(model, layer) else "attn.W_V")
    return {f"blocks.{layer}.{attr[matrix]}": new}


def _kv_group(model: Model, head: int) -> int:
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


def _as_truncations(model: Model, edits) -> list[Truncation]:
    """Validated :class:`Truncation` list from one spec, a ``(layer, matrix, rho[, head])`` tuple,
    or an iterable of either."""
    require_resident_weights("Truncation (a weight edit)", model)
    if isinstance(edits, Truncation) or (isinstance(edits, tuple) and edits and isinstance(edits[0], numbers.Integral)):
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
        matrix = canonical_matrix(model, edit.matrix)
        rho = check_rho(edit.rho)
        heads = _check_heads(model, layer, matrix, edit.head)
        out.append(Truncation(layer, matrix, rho, heads))
    if not out:
        raise ValueError("No truncations given; pass at least one Truncation(layer, matrix, rho).")
    check_overlaps(out)
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


_WRITES = {
    "mlp_in": {"W_in"},
    "mlp_gate": {"W_gate"},
    "mlp_out": {"W_out"},
    "attn_v": {"W_V"},
    "attn_o": {"W_O"},
    "attn_ov": {"W_O", "b_O"},
}
_READS = {**_WRITES, "attn_ov": {"W_V", "W_O", "b_V"}}


def check_overlaps(edits: Sequence[Truncation]) -> None:
    """Two edits of one layer that touch the same weights would depend on their order: refuse."""
    for i, a in enumerate(edits):
        for b in edits[i + 1 :]:
            if a.layer != b.layer:
                continue
            if (_WRITES[a.matrix] & (_READS[b.matrix] | _WRITES[b.matrix])) or (_WRITES[b.matrix] & _READS[a.matrix]):
                raise ValueError(
                    f"Edits {a.label()!r} and {b.label()!r} both touch layer {a.layer}'s "
                    f"{sorted((_WRITES[a.matrix] | _READS[a.matrix]) & (_WRITES[b.matrix] | _READS[b.matrix]))}, "
                    "so their result would depend on their order. Give one edit per matrix and layer "
                    "(several heads go in one edit: head=(0, 2)), and do not combine 'attn_ov' with "
                    "'attn_v' or 'attn_o' in one layer."
                )


# ---------------------------------------------------------------------------------------------
# Factorizations and new weights


def _input_gain(model: Model, layer: int, matrix: str) -> Tensor | None:
    """The gain ``[d_model, 1]`` of the norm before ``matrix`` where the weights do not hold it
    (None where folded in or absent): truncation acts on the matrix times the normalised input,
    gain included, as on a processed model, so a rank keeps the same directions either way."""
    if matrix not in ("mlp_in", "mlp_gate", "attn_v", "attn_ov"):
        return None
    gain, _, _ = norm_affine(model.blocks[layer].ln2 if matrix.startswith("mlp_") else model.blocks[layer].ln1)
    return None if gain is None else gain.detach().double()[:, None]


def _factors(model: Model, layer: int, matrix: str, cache: dict | None):
    """SVD factors of the matrix (batched over heads for attention), from ``cache`` if present.

    Weights are read detached, so no autograd context is needed here or in :func:`_new_weights`
    (a ``torch.no_grad()`` block cut short by Ctrl-C would leave autograd off for the session)."""
    key = (layer, matrix)
    if cache is not None and key in cache:
        return cache[key]
    block = model.blocks[layer]
    dtype = block.attn.W_O.dtype
    gain = _input_gain(model, layer, matrix)
    gain = 1.0 if gain is None else gain
    if matrix.startswith("mlp_"):
        weight = getattr(block.mlp, {"mlp_in": "W_in", "mlp_gate": "W_gate", "mlp_out": "W_out"}[matrix])
        u, s, vh = torch.linalg.svd(gain * weight.detach().double(), full_matrices=False)
    elif matrix == "attn_v":
        weight = _stored_w_v(model, layer)
        u, s, vh = torch.linalg.svd(gain * weight.detach().double(), full_matrices=False)
    elif matrix == "attn_o":
        u, s, vh = torch.linalg.svd(block.attn.W_O.detach().double(), full_matrices=False)
    else:  # attn_ov: right singular vectors of W_V W_O per query head, via a QR of W_V
        w_v = gain * query_head_weights(model, "W_V", layer).detach().double()  # [head, d_model, d_head]
        q, r = torch.linalg.qr(w_v)
        _, s, vh = torch.linalg.svd(r @ block.attn.W_O.detach().double(), full_matrices=False)
        u = q  # not the product's left vectors; unused for attn_ov
    factors = (u.to(dtype), s.to(dtype), vh.to(dtype)) if matrix != "attn_ov" else (None, s, vh)
    if cache is not None:
        cache[key] = factors
    return factors


def reference_dim(model: Model, matrix: str) -> int:
    """``min(d_in, d_out)`` of the matrix (``d_head`` for the OV product, which cannot exceed it)."""
    cfg = model.cfg
    if matrix.startswith("mlp_"):
        return min(cfg.d_model, cfg.d_mlp)
    return min(cfg.d_model, cfg.d_head)


def is_identity(model: Model, edit: Truncation) -> bool:
    """Whether ``edit`` keeps the full rank, i.e. changes nothing."""
    dim = reference_dim(model, edit.matrix)
    return truncation_rank(edit.rho, dim) >= dim


def _new_weights(model: Model, edit: Truncation, cache: dict | None) -> dict[str, Tensor]:
    """Parameter name -> replacement tensor for one edit (empty when the edit changes nothing)."""
    k = truncation_rank(edit.rho, reference_dim(model, edit.matrix))
    if is_identity(model, edit):
        return {}  # rho = 1 (or close enough): the exact original weights
    layer, block = edit.layer, model.blocks[edit.layer]
    u, s, vh = _factors(model, layer, edit.matrix, cache)
    gain = _input_gain(model, layer, edit.matrix)

    def unfolded(matrix: Tensor) -> Tensor:  # gain taken out again; a 0-gain input's row stays 0
        return matrix if gain is None else (matrix.double() / torch.where(gain == 0, 1.0, gain)).to(matrix.dtype)

    if edit.matrix.startswith("mlp_"):
        return _named(model, layer, edit.matrix, unfolded(_reconstruct(u, s, vh, k)).contiguous())
    if edit.matrix == "attn_v":
        new = _stored_w_v(model, layer).detach().clone()
        heads = range(new.shape[0]) if edit.head is None else edit.head
        for h in heads:
            new[h] = unfolded(_reconstruct(u[h], s[h], vh[h], k))
        return _named(model, layer, "attn_v", new)
    heads = range(model.cfg.n_heads) if edit.head is None else edit.head
    w_o = block.attn.W_O.detach()
    new = w_o.clone()
    if edit.matrix == "attn_o":
        for h in heads:
            new[h] = _reconstruct(u[h], s[h], vh[h], k)
        return _named(model, layer, "attn_o", new)
    # attn_ov: project each head's W_O onto the product's top-k right singular directions.
    for h in heads:
        v_k = vh[h, :k].double()
        new[h] = (w_o[h].double() @ v_k.T @ v_k).to(w_o.dtype)
    out = _named(model, layer, "attn_o", new)
    b_v = getattr(block.attn, "b_V", None)  # [head, d_head], expanded on GQA; None: no value bias
    if b_v is not None and bool((b_v != 0).any()):
        b_v, b_o = b_v.detach(), block.attn.b_O.detach()
        shift = sum(b_v[h].double() @ (w_o[h].double() - new[h].double()) for h in heads)
        out.update(_named(model, layer, "b_O", (b_o.double() + shift).to(b_o.dtype)))
    return out


# ---------------------------------------------------------------------------------------------
# Context managers


def truncate(
    model: Model,
    edits: Truncation | tuple | Iterable[Truncation | tuple],
    svd_cache: dict | None = None,
) -> swapped_parameters:
    """Apply rank truncations for the duration of a ``with`` block; the weights come back exactly.

    ``edits``: one :class:`Truncation`, a ``(layer, matrix, rho[, head])`` tuple, or a list of
    them (all applied together). The original parameter tensors themselves are put back on exit,
    also when an exception is raised or Ctrl-C is pressed, so the model is bit-for-bit unchanged
    (:class:`cpsuper.runtime.swapped_parameters`). The new weights are computed by this call.

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
    return swapped_parameters(model, replacements)


def drop_mlp(model: Model, layers: int | Iterable[int]) -> hooked:
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
    return intervene(model, [Knockout(check_layer(model, layer), "mlp") for layer in layers])
