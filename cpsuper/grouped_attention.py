"""Grouped-query attention that reads each key and value head once, without repeating it.

TransformerLens 3.x computes a grouped-query attention (Gemma-3: 4 query heads share 1 key/value
head) by first repeating every key and value head for each query head of its group
(``torch.repeat_interleave``), then multiplying per query head through transposed views that
``bmm`` copies again. In a decoding step with a key-value cache, one query position meets the
whole cache, so these copies of the cache are most of the step: about 3/4 of it for 32 rows with
80 cached positions on the embedded model (docs/results/performance.md).

:func:`grouped_attention` swaps the class of each such attention module for
:class:`KVGroupedAttention`, which multiplies each query head with its group's key and value
head where they lie. Each product has the shapes of TransformerLens's own per-head product,
the scores are divided and soft-capped in its order, and ``hook_attn_scores``, ``hook_pattern``
and ``hook_z`` see tensors of the same shape and values. Its rotary embedding skips TransformerLens's
copies too (:meth:`KVGroupedAttention.apply_rotary`). Tested against TransformerLens's class;
bit-for-bit equal on the embedded model in bf16, and in float32 for forward passes without a
cache (a float32 cached step can differ in the last bits: BLAS may order a one-row product's sum
differently when its operand is laid out differently).
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor
from transformer_lens.utilities.activation_functions import apply_softcap
from transformer_lens.utilities.tensors import get_offset_position_ids

from .backend import Model, is_bridge

try:  # TransformerLens 3.x; 4.x has no HookedTransformer components (a bridge keeps Hugging Face's attention)
    from transformer_lens.components.grouped_query_attention import GroupedQueryAttention
except ImportError:
    GroupedQueryAttention = object  # nothing to regroup: grouped_attention returns bridges as they are

__all__ = ["KVGroupedAttention", "grouped_attention"]


class KVGroupedAttention(GroupedQueryAttention):
    """TransformerLens's grouped-query attention, with scores and head outputs computed per query
    head against its group's key / value head in place (no repeated copy of keys and values)."""

    def calculate_attention_scores(
        self,
        q: Float[Tensor, "batch query_pos head_index d_head"],
        k: Float[Tensor, "batch key_pos kv_head_index d_head"],
    ) -> Float[Tensor, "batch head_index query_pos key_pos"]:
        batch, query_pos, n_heads, d_head = q.shape
        groups = q.view(batch, query_pos, k.shape[2], n_heads // k.shape[2], d_head)
        keys = k.permute(0, 2, 3, 1)  # [batch, kv_head, d_head, key_pos], a view
        # query head h = kv_head * group_size + g, as repeat_interleave orders them
        scores = torch.stack([groups[:, :, :, g].transpose(1, 2) @ keys for g in range(groups.shape[3])], 2)
        scores = scores.view(batch, n_heads, query_pos, -1) / self.attn_scale
        return apply_softcap(scores, self.cfg.attn_scores_soft_cap)

    def calculate_z_scores(
        self,
        v: Float[Tensor, "batch key_pos kv_head_index d_head"],
        pattern: Float[Tensor, "batch head_index query_pos key_pos"],
    ) -> Float[Tensor, "batch query_pos head_index d_head"]:
        batch, n_heads, query_pos, key_pos = pattern.shape
        groups = pattern.view(batch, v.shape[2], n_heads // v.shape[2], query_pos, key_pos)
        values = v.permute(0, 2, 1, 3)  # [batch, kv_head, key_pos, d_head], a view
        z = torch.stack([groups[:, :, g] @ values for g in range(groups.shape[2])], 2)
        return self.hook_z(z.view(batch, n_heads, query_pos, -1).transpose(1, 2))

    def apply_rotary(
        self,
        x: Float[Tensor, "batch pos head_index d_head"],
        past_kv_pos_offset: int = 0,
        attention_mask: Tensor | None = None,
    ) -> Float[Tensor, "batch pos head_index d_head"]:
        """TransformerLens's rotary embedding (``x * cos + rotate_half(x) * sin``, each product and
        the sum rounded as it rounds them) without its copies: no rotated clone of ``x`` and no
        concatenation with an empty unrotated part. Decoding re-rotates every cached key at every
        step; skipping the copies saved about 5 % of a step or a resumed chunk (docs/results/performance.md),
        the per-layer position lookups remain. Other rotary variants (adjacent
        pairs, a partial rotary dimension, NTK scaling, positions past the tables) go to
        TransformerLens's own method."""
        cfg, cos_table = self.cfg, self.rotary_cos
        plain = not cfg.rotary_adjacent_pairs and not getattr(cfg, "use_dynamic_ntk_rope", False)
        fits = x.device == cos_table.device and past_kv_pos_offset + x.size(1) <= cos_table.shape[0]
        if not (plain and fits and cfg.rotary_dim == x.size(-1)):
            return super().apply_rotary(x, past_kv_pos_offset, attention_mask)
        if attention_mask is None:
            where = slice(past_kv_pos_offset, past_kv_pos_offset + x.size(1))
            cos, sin = cos_table[None, where, None, :], self.rotary_sin[None, where, None, :]
        else:
            positions = get_offset_position_ids(past_kv_pos_offset, attention_mask).to(cos_table.device)
            cos, sin = cos_table[positions, None, :], self.rotary_sin[positions, None, :]
        half = x.size(-1) // 2
        out = x * cos
        out[..., :half] -= x[..., half:] * sin[..., :half]  # rotate_half's first half is -x[half:]
        out[..., half:] += x[..., :half] * sin[..., half:]
        return out


def grouped_attention(model: Model) -> Model:
    """Give every grouped-query attention module of a HookedTransformer the copy-free
    :class:`KVGroupedAttention` computation; returns ``model``. Parameters, hooks and outputs are
    unchanged (see the module docstring). Idempotent; a TransformerBridge, a model without grouped
    heads and one with ``ungroup_grouped_query_attention`` are left as they are."""
    if is_bridge(model) or getattr(model.cfg, "ungroup_grouped_query_attention", False):
        return model
    for module in model.modules():
        if type(module) is GroupedQueryAttention and module.repeat_kv_heads > 1:
            module.__class__ = KVGroupedAttention
    return model
