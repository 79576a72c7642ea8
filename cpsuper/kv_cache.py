"""TransformerLens key-value caches of left-padded batches: dropping rows, and assembling one batch's
cache from the caches of its row groups, each prefilled at its own width.

Greedy decoding prefills a batch's prompts together, left-padded to the longest, so every row pays
the longest prompt's width in every layer. When the widths fall into groups (context-aware
decoding pairs each prompt, up to ~90 tokens, with its ~12-token context-free twin), each group can
be prefilled at its own width and the caches stacked into the batch's: a row's keys and values
move right by its group's padding, the padding gets zero keys and values, and the batch's
attention mask (zero there) keeps them out of attention, as it keeps out the keys of the
padding tokens a joint prefill would have computed. Rotary positions count from a row's first
real token, so the real positions' keys are the ones a joint prefill computes.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from .batch_sizes import row_chunks

__all__ = [
    "hf_cache",
    "is_kv_cache",
    "keep_hf_rows",
    "keep_rows",
    "prefill_groups",
    "stack_group_caches",
    "stack_hf_group_caches",
    "warn_uncached_bridge",
]


def is_kv_cache(state: Any) -> bool:
    """Whether ``state`` is a TransformerLens key-value cache."""
    return hasattr(state, "entries") and hasattr(state, "previous_attention_mask")


def keep_rows(state: Any, keep: Int[Tensor, " kept"], n_rows: int) -> Any:
    """``state`` restricted to the batch rows ``keep`` (of ``n_rows``), for decoding that drops
    finished rows: key-value caches are sliced in place, tensors with one entry per row are
    indexed, tuples, lists and dicts are walked, anything else is kept as it is."""
    if state is None or isinstance(state, (int, float, str)):
        return state
    if is_kv_cache(state):
        for entry in state.entries:
            entry.past_keys = entry.past_keys[keep.to(entry.past_keys.device)]
            entry.past_values = entry.past_values[keep.to(entry.past_values.device)]
        state.previous_attention_mask = state.previous_attention_mask[keep.to(state.previous_attention_mask.device)]
        return state
    if isinstance(state, Tensor):
        return state[keep.to(state.device)] if state.ndim and state.shape[0] == n_rows else state
    if isinstance(state, (tuple, list)):
        return type(state)(keep_rows(item, keep, n_rows) for item in state)
    if isinstance(state, dict):
        return {key: keep_rows(value, keep, n_rows) for key, value in state.items()}
    return state


def prefill_groups(lengths: Sequence[int]) -> list[list[int]] | None:
    """A left-padded batch's rows (indices) in groups of similar prompt length, cut where that saves
    padded tokens (as the sweep engine cuts its chunks, :func:`cpsuper.batch_sizes.row_chunks`); None
    when one prefill of the whole batch is as cheap."""
    order = sorted(range(len(lengths)), key=lambda r: -lengths[r])
    cuts = row_chunks([lengths[r] for r in order], len(order))
    return [[order[i] for i in cut] for cut in cuts] if len(cuts) > 1 else None


def stack_group_caches(
    cache: Any, groups: Sequence[Sequence[int]], group_caches: Sequence[Any], mask: Int[Tensor, "batch pos"]
) -> Any:
    """Fill the empty cache ``cache`` of a left-padded batch (attention ``mask``) from
    ``group_caches[i]``, the prefill of rows ``groups[i]`` at their own (narrower or equal) width;
    returns ``cache``, as a joint prefill of the batch would have left it, up to the padding's keys."""
    n_rows, width = mask.shape
    for layer, entry in enumerate(cache.entries):
        for name in ("past_keys", "past_values"):
            shape = getattr(group_caches[0].entries[layer], name).shape
            full = torch.zeros((n_rows, width, *shape[2:]), dtype=getattr(entry, name).dtype, device=mask.device)
            for rows, part in zip(groups, group_caches):
                filled = getattr(part.entries[layer], name)
                full[torch.as_tensor(rows, device=full.device), width - filled.shape[1] :] = filled.to(full.device)
            setattr(entry, name, full)
    cache.append_attention_mask(mask)
    return cache


def stack_hf_group_caches(groups: Sequence[Sequence[int]], group_caches: Sequence[Any], width: int) -> Any:
    """One Hugging Face cache of a left-padded batch ``width`` tokens wide, from ``group_caches[i]``,
    the prefill of rows ``groups[i]`` at their own width (as :func:`stack_group_caches` for
    TransformerLens caches). A group's cache may hold its rows in several copies, one block after
    another (a dual run's twin batch); the batch's cache then holds every row's copies likewise.
    None if a group's cache was left empty. The widest group's cache becomes the batch's, so its
    layers keep their kind (sliding-window layers their window) and their count of tokens seen."""
    if any(not cache.get_seq_length() for cache in group_caches):
        return None
    n_rows = sum(len(rows) for rows in groups)
    widest = max(range(len(groups)), key=lambda g: group_caches[g].get_seq_length())
    batch = group_caches[widest]
    if batch.get_seq_length() != width:
        raise ValueError(f"The widest group's cache holds {batch.get_seq_length()} tokens; the batch is {width} wide.")
    for layer, entry in enumerate(batch.layers):
        for name in ("keys", "values"):
            kept = getattr(entry, name)  # [rows, kv heads, positions kept, d_head]
            full = kept.new_zeros((n_rows * (kept.shape[0] // len(groups[widest])), *kept.shape[1:]))
            for rows, part in zip(groups, group_caches):
                filled = getattr(part.layers[layer], name)[:, :, -kept.shape[2] :]
                copies = filled.shape[0] // len(rows)
                at = torch.cat([torch.as_tensor(rows) + copy * n_rows for copy in range(copies)])
                full[at.to(full.device), :, kept.shape[2] - filled.shape[2] :] = filled
            setattr(entry, name, full)
    return batch


@functools.cache
def warn_uncached_bridge() -> None:
    """Say once that a bridge left its key-value cache empty, so decoding runs uncached."""
    warnings.warn(
        "This TransformerBridge does not fill a key-value cache (TransformerLens 4.3 with transformers "
        ">= 5.24), so greedy decoding reruns every prompt at each step: correct, but several times "
        "slower. pip install 'transformers<5.24' restores the cache.",
        stacklevel=4,
    )


def hf_cache(model: Any) -> Any:
    """An empty Hugging Face key-value cache for a bridge's model (sliding-window layers included)."""
    from transformers import DynamicCache

    return DynamicCache(config=model.original_model.config)


def keep_hf_rows(cache: Any, keep: Int[Tensor, " kept"], n_rows: int) -> None:
    """Restrict a Hugging Face cache of ``n_rows`` prompts to the rows ``keep``, in place. A cache
    that holds every prompt in several copies, one block of ``n_rows`` rows after another (the
    dual run's twin batch, :class:`cpsuper.interventions.AddTwinHeadOutput`), keeps ``keep`` in each."""
    if not cache.get_seq_length():  # nothing cached yet
        return
    keys = cache.layers[0].keys
    rows = torch.cat([keep + copy * n_rows for copy in range(keys.shape[0] // n_rows)])
    cache.batch_select_indices(rows.to(keys.device))
