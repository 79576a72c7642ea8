"""How much the final prompt token attends to a span (the subject, the context, the context
answer, ...), per layer and head and conflict type.

Small models park most attention on BOS, so every value comes twice: as the raw attention
weight and renormalized over the non-BOS tokens (``attention_no_bos``). Splitting by whether the
model knows the fact shows the "attention imbalance" the fine-tuning papers describe;
:func:`rescaled_attention` forces such an imbalance at inference, to see what it erases.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from .backend import Model, final_residual, saving_hooks
from .data.examples import ConflictDataset, ConflictExample
from .interrupts import hooked, run_with_cache
from .runtime import (
    check_finite,
    check_head,
    check_head_indices,
    check_layers,
    length_batches,
    pad_tokens,
    resolve_conflict_types,
    tokenize_prompts,
)
from .scoring import known_facts
from .spans import SPAN_GROUPS, example_spans, occurrences, token_offsets
from .stats import bootstrap_summary

__all__ = [
    "AttentionResult",
    "attention_patterns",
    "attention_to_span",
    "layer_attention",
    "rescale_span_attention",
    "rescaled_attention",
]

SpanSpec = str | Sequence[str] | Callable[[ConflictExample, str], str]
_ALIASES = {"context": ("context", "context_answer")}
_REDUCE = {"sum": np.sum, "mean": np.mean, "max": np.max}


@dataclass
class AttentionResult:
    """Result of :func:`attention_to_span`: ``per_example`` has one row per example x conflict
    type x layer x head (``attention``, ``attention_no_bos``, ``n_span_tokens``, and ``known``
    when asked); :meth:`by_head` and :meth:`by_layer` average it, :meth:`per_layer` averages
    each example's heads within a layer."""

    per_example: pd.DataFrame
    span: str
    reduce: str

    def _keys(self) -> list[str]:
        return ["conflict_type"] + (["known"] if "known" in self.per_example else [])

    def by_head(self) -> pd.DataFrame:
        """Mean and standard error over examples, per conflict type x layer x head."""
        g = self.per_example.groupby([*self._keys(), "layer", "head"])
        out = g[["attention", "attention_no_bos"]].mean()
        out["sem"] = g["attention"].sem()
        out["n"] = g.size()
        return out.reset_index()

    def per_layer(self) -> pd.DataFrame:
        """One row per example x conflict type x layer: the per-head values averaged over the
        layer's heads (``attention``, ``attention_no_bos``), with ``n_heads`` and ``reduce``."""
        keys = [*self._keys(), "example", "subject", "layer"]
        g = self.per_example.groupby(keys, sort=True)
        out = g[["attention", "attention_no_bos"]].mean()
        out["n_span_tokens"] = g["n_span_tokens"].first()
        out["n_heads"] = g.size()
        return out.reset_index().assign(reduce=self.reduce)

    def by_layer(self, *, n_boot: int = 2000, ci: float = 0.95, seed: int = 0) -> pd.DataFrame:
        """Mean over heads and examples, per conflict type x layer, with the percentile bootstrap
        interval over facts of the attention (``ci_low``, ``ci_high``: the interval every figure
        uses) and the standard error over facts (``sem``)."""
        keys = [*self._keys(), "layer"]
        out = self.per_example.groupby(keys)[["attention", "attention_no_bos"]].mean()
        per_fact = self.per_example.groupby([*keys, "example"], as_index=False)["attention"].mean()
        out["sem"] = per_fact.groupby(keys)["attention"].sem()
        bands = bootstrap_summary(per_fact, value="attention", by=keys, unit="example", n_boot=n_boot, ci=ci, seed=seed)
        return out.reset_index().merge(bands[[*keys, "ci_low", "ci_high"]], on=keys, how="left")


def _span_mask(model, example: ConflictExample, conflict_type: str, tokens: list[int], span: SpanSpec) -> np.ndarray:
    if callable(span):
        text = span(example, conflict_type)
        prompt = example.prompts[conflict_type]
        hits = occurrences(prompt, text)
        offsets = token_offsets(model, prompt, tokens)
        return np.array([any(a < e and b > s for s, e in hits) and a < b for a, b in offsets])
    names = _ALIASES.get(span, (span,)) if isinstance(span, str) else tuple(span)
    unknown = [n for n in names if n not in SPAN_GROUPS]
    if unknown:
        raise ValueError(f"Unknown span {unknown}; use one of {SPAN_GROUPS}, a tuple of them, or a callable.")
    groups = example_spans(model, example, conflict_type, tokens=tokens)
    return np.array([g in names for g in groups])


def attention_to_span(
    model: Model,
    dataset: ConflictDataset,
    span: SpanSpec = "subject",
    *,
    reduce: str = "sum",
    conflict_types: Sequence[str] | None = None,
    known: Sequence[bool] | str | None = None,
    batch_size: int = 16,
    padding_side: str = "right",
    progress: bool = True,
) -> AttentionResult:
    """Attention from the last prompt token to ``span`` for every layer and head.

    ``span`` is a group of :data:`cpsuper.spans.SPAN_GROUPS` (``"context"`` includes the context
    answer's tokens), a tuple of groups, or a callable ``(example, conflict_type) -> text`` whose
    every occurrence in the prompt is the span. ``reduce`` combines the span's tokens: ``sum``
    (attention mass), ``mean`` or ``max``. ``known``: a bool per example, or ``"auto"`` to
    score the clean prompts first; adds a ``known`` column. Examples whose prompt has no such
    span are left out of that conflict type. Both padding sides give the same values.
    """
    if reduce not in _REDUCE:
        raise ValueError(f"reduce must be one of {sorted(_REDUCE)}, got {reduce!r}.")
    conflict_types = resolve_conflict_types(dataset, conflict_types)
    if isinstance(known, str):
        if known != "auto":
            raise ValueError(f"known must be 'auto', a list of bools or None, got {known!r}.")
        known = known_facts(model, dataset, progress=progress)
    if known is not None and len(known) != len(dataset):
        raise ValueError(f"known has {len(known)} values but the dataset has {len(dataset)} examples.")
    if "blocks.0.attn.hook_pattern" not in model.hook_dict:
        raise ValueError("The model has no hook 'blocks.0.attn.hook_pattern' to read attention from.")
    jobs = [(c, i) for c in conflict_types for i in range(len(dataset))]
    token_lists = tokenize_prompts(model, [dataset[i].prompts[c] for c, i in jobs])
    masks = [_span_mask(model, dataset[i], c, token_lists[j], span) for j, (c, i) in enumerate(jobs)]
    bos_id = model.tokenizer.bos_token_id
    names = [f"blocks.{layer}.attn.hook_pattern" for layer in range(model.cfg.n_layers)]
    reducer, rows = _REDUCE[reduce], []
    for idx in tqdm(
        length_batches([len(t) for t in token_lists], batch_size), desc="attention", disable=not progress, leave=False
    ):
        tokens, attention_mask, last = pad_tokens(model, [token_lists[j] for j in idx], padding_side)
        saved = {}
        at = (torch.arange(len(last), device=last.device), slice(None), last)  # each row's last query position
        keep_last_row = saving_hooks(names, saved, lambda pattern, at=at: pattern[at].float().cpu().numpy())

        with torch.inference_mode(), hooked(model, keep_last_row):
            padded = bool((attention_mask == 0).any())
            # Tokens are padded already; the explicit mask (not TransformerLens's guess) marks the pads.
            final_residual(
                model,
                tokens,
                attention_mask=attention_mask if padded else None,
                padding_side="right",
            )
        for row, j in enumerate(idx):
            conflict_type, i = jobs[j]
            mask, n = masks[j], len(token_lists[j])
            start = int(last[row]) + 1 - n  # first real token (left padding shifts it)
            if not mask.any():
                continue
            has_bos = token_lists[j][0] == bos_id
            for layer, name in enumerate(names):
                pattern = saved[name][row, :, start : start + n]  # [head, src]
                rest = 1.0 - pattern[:, 0] if has_bos else np.ones(pattern.shape[0])
                for head in range(pattern.shape[0]):
                    value = float(reducer(pattern[head, mask]))
                    no_bos = value / rest[head] if rest[head] > 0 else float("nan")
                    rows.append(
                        {
                            "example": i,
                            "subject": dataset[i].subject,
                            "conflict_type": conflict_type,
                            "layer": layer,
                            "head": head,
                            "attention": value,
                            "attention_no_bos": no_bos,
                            "n_span_tokens": int(mask.sum()),
                            **({"known": bool(known[i])} if known is not None else {}),
                        }
                    )
    if not rows:
        raise ValueError(f"No prompt of {dataset.name!r} contains the span {span!r}.")
    frame = pd.DataFrame(rows).sort_values(["conflict_type", "example", "layer", "head"], kind="stable")
    label = span if isinstance(span, str) else ("+".join(span) if not callable(span) else "custom")
    return AttentionResult(frame.reset_index(drop=True), label, reduce)


def attention_patterns(
    model: Model, prompt: str, heads: Sequence[tuple[int, int]]
) -> tuple[Float[Tensor, "n_heads query key"], list[str]]:
    """The chosen query heads' attention patterns on one prompt, and its tokens as strings
    (what :func:`cpsuper.plots.attention_view` draws)."""
    heads = [tuple(int(x) for x in h) for h in heads]
    if not heads:
        raise ValueError("Pick at least one (layer, head) to show.")
    for layer, head in heads:
        check_head(model, layer, head)
    tokens = tokenize_prompts(model, [prompt])[0]
    names = {f"blocks.{layer}.attn.hook_pattern" for layer, _ in heads}
    # The run stops after the last layer shown: the later layers and the full-sequence
    # unembedding (262k logits per position) are not needed for a pattern.
    stop = max(layer for layer, _ in heads) + 1
    with torch.inference_mode():
        _, cache = run_with_cache(
            model, torch.tensor([tokens], device=model.cfg.device), names_filter=list(names), stop_at_layer=stop
        )
    patterns = torch.stack([cache[f"blocks.{layer}.attn.hook_pattern"][0, head] for layer, head in heads])
    return patterns.float().cpu(), [model.tokenizer.decode([t]) for t in tokens]


def layer_attention(
    model: Model,
    dataset: ConflictDataset,
    span: SpanSpec = "subject",
    *,
    reduce: str = "max",
    conflict_types: Sequence[str] | None = None,
    batch_size: int = 16,
    padding_side: str = "right",
    progress: bool = True,
) -> pd.DataFrame:
    """The last prompt token's attention to ``span``, one value per example x conflict type x
    layer: within each head the span's tokens are combined by ``reduce`` (by default their
    maximum, the per-layer statistic of the attention-satisfiability probe that the study of
    finetuning on lesser-known facts plots), then the layer's heads are averaged.

    A tidy frame with ``conflict_type, example, subject, layer, attention, attention_no_bos,
    n_span_tokens, n_heads, reduce`` (see :meth:`AttentionResult.per_layer`); the arguments are
    those of :func:`attention_to_span`.
    """
    result = attention_to_span(
        model,
        dataset,
        span,
        reduce=reduce,
        conflict_types=conflict_types,
        batch_size=batch_size,
        padding_side=padding_side,
        progress=progress,
    )
    return result.per_layer()


def rescale_span_attention(
    rows: Float[Tensor, "batch head key"],
    span: Bool[Tensor, "batch key"],
    factor: float,
    *,
    move_from: Bool[Tensor, "batch key"] | None = None,
    move_to: Bool[Tensor, "batch key"] | None = None,
) -> tuple[Float[Tensor, "batch head key"], Float[Tensor, "batch head"], Float[Tensor, "batch head"]]:
    """Attention rows with the weight on ``span`` multiplied by ``factor`` and each row
    renormalised, as a forced attention imbalance against the span (what Theorem 4.2 of the
    finetuning paper varies); returns ``(rows, asked, moved)``, per row and head the mass the
    rescaling takes off the span and the mass actually moved.

    With ``move_from`` and ``move_to`` (disjoint masks) the span is left alone and the same mass
    (the rescaling's, computed on these rows) moves from ``move_from`` to ``move_to`` instead,
    each side scaled in proportion: a control that moves as much attention elsewhere. It is
    capped at what ``move_from`` holds; a row with no weight on ``move_to`` (or, without them, on
    the span's complement) is left unchanged.
    """
    if (move_from is None) != (move_to is None):
        raise ValueError("Give both move_from and move_to, or neither.")
    dtype, p = rows.dtype, rows.float()
    on_span = p * span[:, None, :]
    held = on_span.sum(-1)
    rest = p.sum(-1) - held
    kept = factor * held / (rest + factor * held).clamp_min(torch.finfo(p.dtype).tiny)
    asked = torch.where(rest > 0, held - kept, torch.zeros_like(held))
    if move_from is None:
        weights = torch.where(span[:, None, :], factor, 1.0)
        scaled = p * weights
        total = scaled.sum(-1, keepdim=True)
        out = torch.where(rest[..., None] > 0, scaled / total.clamp_min(torch.finfo(p.dtype).tiny), p)
        return out.to(dtype), asked, asked
    if (move_from & move_to).any():
        raise ValueError("move_from and move_to must not share a token.")
    source = (p * move_from[:, None, :]).sum(-1)
    target = (p * move_to[:, None, :]).sum(-1)
    moved = torch.where(target > 0, torch.minimum(asked, source), torch.zeros_like(asked))
    tiny = torch.finfo(p.dtype).tiny
    shrink = torch.where(source > 0, (source - moved) / source.clamp_min(tiny), torch.ones_like(source))
    grow = torch.where(target > 0, (target + moved) / target.clamp_min(tiny), torch.ones_like(target))
    scale = torch.where(move_from[:, None, :], shrink[..., None], 1.0) * torch.where(
        move_to[:, None, :], grow[..., None], 1.0
    )
    return (p * scale).to(dtype), asked, moved


def rescaled_attention(
    model: Model,
    span: Bool[Tensor, "batch pos"],
    factor: float,
    *,
    query: Int[Tensor, " batch"],
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    move_from: Bool[Tensor, "batch pos"] | None = None,
    move_to: Bool[Tensor, "batch pos"] | None = None,
    record: list | None = None,
) -> hooked:
    """A context in which each row's ``query`` position attends to ``span`` with its weight
    multiplied by ``factor`` and renormalised (:func:`rescale_span_attention`; with
    ``move_from`` / ``move_to``, the matched control), in ``layers`` (default all) and query
    ``heads`` (default all; ``hook_pattern`` is indexed per query head, so grouped-query models
    work), for batches laid out like ``span`` (``[batch, pos]``, padding included).

    The hooks come off when the block ends, an exception included. ``record``: a list that
    gets ``(layer, asked, moved)`` per hooked layer and pass (``[batch, head]`` tensors).
    ``factor == 1`` without a control changes nothing, bit for bit.
    """
    factor = check_finite(factor, "factor", "non-negative")
    layers = check_layers(model, layers)
    chosen = check_head_indices(model, heads)
    span = torch.as_tensor(span, dtype=torch.bool)
    masks = [m if m is None else torch.as_tensor(m, dtype=torch.bool) for m in (move_from, move_to)]
    for mask in (span, *masks):
        if mask is not None and mask.shape != span.shape:
            raise ValueError(
                f"Masks must share the shape [batch, pos]; got {tuple(mask.shape)} and {tuple(span.shape)}."
            )
    query = torch.as_tensor(query, dtype=torch.long)
    if query.shape != (span.shape[0],):
        raise ValueError(f"query needs one position per row ({span.shape[0]}), got shape {tuple(query.shape)}.")

    def rescale(pattern: Tensor, hook, layer: int) -> Tensor:
        if factor == 1.0 and masks[0] is None:
            return pattern
        if pattern.shape[0] != span.shape[0] or pattern.shape[-1] != span.shape[1]:
            raise ValueError(
                f"The batch {tuple(pattern.shape)} is not laid out like the span mask {tuple(span.shape)}."
            )
        device = pattern.device
        rows_at = (torch.arange(pattern.shape[0], device=device), slice(None), query.to(device))
        new, asked, moved = rescale_span_attention(
            pattern[rows_at],
            span.to(device),
            factor,
            move_from=None if masks[0] is None else masks[0].to(device),
            move_to=None if masks[1] is None else masks[1].to(device),
        )
        keep = torch.zeros(pattern.shape[1], dtype=torch.bool, device=device)
        keep[chosen] = True
        out = pattern.clone()
        out[rows_at] = torch.where(keep[None, :, None], new, out[rows_at])
        if record is not None:
            record.append((layer, asked[:, keep].cpu(), moved[:, keep].cpu()))
        return out

    return hooked(model, [(f"blocks.{layer}.attn.hook_pattern", partial(rescale, layer=layer)) for layer in layers])
