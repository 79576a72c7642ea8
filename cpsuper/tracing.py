"""Causal tracing over layers and token positions: where in a conflict prompt an answer is read from.

For each fact, a *destination* prompt (e.g. its substitution prompt) is run with one activation
(the residual stream entering a layer, an attention or MLP output) at one position replaced by
the value a *source* prompt of the same fact (e.g. its clean prompt) had at the aligned position.
How far that moves the answer's probability toward its value on the source says how much of the
difference between the two prompts passes through that (layer, position, site):

    delta    = p - p_destination
    restored = (p - p_destination) / (p_source - p_destination)

Every patch is a :class:`cpsuper.edits.PatchEdit` run by the one sweep engine. Positions count
from the end of the destination prompt (``-1`` is the final token) and are labelled by the span
the destination token belongs to (:func:`cpsuper.spans.example_spans`). Besides the dataset's
conflict types, ``"agreeing"`` names a constructed partner: the other side's context prompt with
the context answer replaced by the memorised one, so the two prompts differ only there.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from .backend import Model
from .data.examples import ConflictDataset, ConflictExample
from .decoding import iter_final_logits
from .edits import ALIGNMENTS, PatchEdit, aligned_positions
from .engine import run_conditions
from .metrics import Metric, resolve_metric
from .runtime import (
    answer_token,
    check_batch_size,
    check_conflict_dataset,
    check_dataset,
    check_finite,
    check_layers,
    check_targets,
    tokenize_prompts,
)
from .spans import SPAN_GROUPS, example_spans, find_spans, occurrences
from .stats import bootstrap_summary

__all__ = ["AGREEING", "TRACE_SITES", "TraceResult", "agreeing_prompt", "causal_trace"]

TRACE_SITES: tuple[str, ...] = ("resid_pre", "attn_out", "mlp_out")
"""Sites :func:`causal_trace` patches (a single head's ``z`` is a :class:`PatchEdit` of its own)."""

AGREEING = "agreeing"
"""The constructed partner: a context prompt whose context states the memorised answer."""

_PAIR_KEYS = ["source", "destination", "target"]


@dataclass
class TraceResult:
    """What :func:`causal_trace` returns.

    ``per_example``: one row per fact, site, layer, position and target (see
    :func:`causal_trace`). ``summary``: means per source, destination, target, site, layer and
    span; ``by_position``: the same per position (with the span and token most facts have there).
    """

    per_example: pd.DataFrame
    summary: pd.DataFrame
    by_position: pd.DataFrame

    @classmethod
    def from_per_example(cls, per_example: pd.DataFrame) -> TraceResult:
        """A result rebuilt from its ``per_example`` frame (e.g. read back from a CSV file)."""
        return cls(per_example, _summary(per_example, "span"), _summary(per_example, "position"))

    def intervals(
        self, value: str = "restored", *, by: str = "span", n_boot: int = 2000, ci: float = 0.95, seed: int = 0
    ) -> pd.DataFrame:
        """Mean ``value`` (``"restored"`` or ``"delta"``) per pair, target, site, layer and ``by``
        (``"span"`` or ``"position"``) with a percentile bootstrap interval over facts
        (:func:`cpsuper.stats.bootstrap_summary`; ``mean, ci_low, ci_high, n``). Rows where
        ``restored`` is undefined are left out. By position, the span and token labels are added."""
        if value not in ("restored", "delta"):
            raise ValueError(f"value must be 'restored' or 'delta', got {value!r}.")
        if by not in ("span", "position"):
            raise ValueError(f"by must be 'span' or 'position', got {by!r}.")
        rows = self.per_example[np.isfinite(self.per_example[value].to_numpy(float))]
        if rows.empty:
            raise ValueError(f"No finite {value!r} values to bootstrap (restored needs p_source != p_destination).")
        keys = [*_PAIR_KEYS, "site", "layer", by]
        out = bootstrap_summary(rows, value=value, by=keys, unit="example", n_boot=n_boot, ci=ci, seed=seed)
        if by == "position":
            labels = self.by_position[[*keys, "span", "token"]]
            out = out.merge(labels, on=keys, how="left")
        out.attrs.update(self.per_example.attrs, value=value)
        return out

    def _repr_html_(self) -> str:
        return self.summary._repr_html_()

    def __repr__(self) -> str:
        return f"TraceResult({len(self.per_example)} per-example rows)\n{self.summary!r}"


def agreeing_prompt(example: ConflictExample, conflict_type: str) -> tuple[str, str | None]:
    """``example``'s ``conflict_type`` prompt with every mention of a context answer inside its
    context replaced by the memorised answer, and the context text so changed (None when the
    dataset did not record it; the whole prompt is searched then)."""
    prompt = example.prompts[conflict_type]
    context = (example.meta.get("contexts") or {}).get(conflict_type)
    start = prompt.rfind(context.strip()) if context else 0
    if start < 0:
        raise ValueError(f"The context {context[:60]!r}... does not occur in the prompt {prompt[:60]!r}...")
    end = start + len(context.strip()) if context else len(prompt)
    hits = sorted({hit for answer in example.context_answers for hit in occurrences(prompt, answer, start, end)})
    if not hits:
        raise ValueError(
            f"The context answer {example.context_answer!r} does not occur in the {conflict_type} prompt of "
            f"{example.subject!r}, so there is nothing to replace for the agreeing partner."
        )
    pieces, at = [], 0
    for a, b in hits:
        if a < at:  # overlapping mentions (an alias inside the answer): keep the first
            continue
        pieces += [prompt[at:a], example.answer]
        at = b
    text = "".join(pieces) + prompt[at:]
    shift = len(text) - len(prompt)
    return text, (text[start : end + shift] if context else None)


def _pairs(dataset: ConflictDataset, source: str, destination: str, pairs) -> list[tuple[str, str]]:
    pairs = [(source, destination)] if pairs is None else [tuple(p) for p in pairs]
    if not pairs:
        raise ValueError("pairs is empty; give at least one (source, destination) pair of conflict types.")
    known = (*dataset.conflict_types, AGREEING)
    for pair in pairs:
        if len(pair) != 2:
            raise ValueError(f"Each pair is (source, destination), got {pair!r}.")
        for role, name in zip(("source", "destination"), pair):
            if name not in known:
                raise ValueError(f"Unknown {role} {name!r}; use one of {known}.")
        if pair[0] == pair[1]:
            raise ValueError(
                f"source and destination are both {pair[0]!r}; patching a prompt into itself does nothing."
            )
        if AGREEING in pair and (pair[0] if pair[1] == AGREEING else pair[1]) == "clean":
            raise ValueError(
                "The agreeing partner is built from a context prompt; pair it with a conflict type that has a "
                f"context (e.g. ('{AGREEING}', 'substitution')), not with 'clean'."
            )
    return pairs


def _check_positions(positions) -> list[int] | None:
    if positions is None:
        return None
    if isinstance(positions, (int, np.integer)):
        positions = [positions]
    positions = list(positions)
    if not positions:
        raise ValueError("positions is empty; give at least one (e.g. [-1]), or None for every position.")
    for p in positions:
        if isinstance(p, bool) or not isinstance(p, (int, np.integer)) or p >= 0:
            raise ValueError(
                f"positions count from the end of the destination prompt (-1 is the final token), got {p!r}; "
                "pass negative integers, e.g. positions=[-1, -2, -3]."
            )
    return sorted({int(p) for p in positions})


def _side(example: ConflictExample, name: str, other: str) -> tuple[str, str | None]:
    """The prompt of one side of a pair and, for the agreeing partner, its context text."""
    if name != AGREEING:
        return example.prompts[name], None
    return agreeing_prompt(example, other)


def causal_trace(
    model: Model,
    dataset: ConflictDataset,
    *,
    source: str = "clean",
    destination: str = "substitution",
    pairs: Sequence[tuple[str, str]] | None = None,
    sites: Sequence[str] = TRACE_SITES,
    layers: Sequence[int] | None = None,
    positions: Sequence[int] | None = None,
    target: str | Sequence[str] = "parametric",
    metric: str | Metric = "probability",
    align: str = "end",
    min_gap: float = 0.0,
    batch_size: int | str = 64,
    progress: bool = True,
) -> TraceResult:
    """Patch each site at each layer and position of the ``destination`` prompt with the
    ``source`` prompt's clean value and read ``metric`` of the ``target`` answer's first token.

    ``source`` / ``destination``: conflict types of ``dataset`` or ``"agreeing"`` (see the module
    docstring; facts whose agreeing prompt has another token count are dropped with a warning).
    ``pairs``: several ``(source, destination)`` pairs at once, instead of the two. ``positions``:
    negative indices from the destination's end (default: every one with a counterpart in some
    source under ``align``, :data:`cpsuper.edits.ALIGNMENTS`); a fact whose prompt or source has
    no such position has no row there. ``min_gap``: ``restored`` is NaN where
    ``|p_source - p_destination| <= min_gap``.

    Returns a :class:`TraceResult`; ``per_example`` columns: ``example, subject, relation, source,
    destination, target, site, layer, position, span, token, source_token, p_destination, p_source,
    p, delta, restored`` (``span`` and ``token``: the destination token's; ``source_token``: the
    source token patched in). Positions whose aligned source token is the source's first (BOS)
    are left out, as are those outside a fact's prompts.
    """
    dataset = check_conflict_dataset(dataset)
    pairs = _pairs(dataset, source, destination, pairs)
    targets = check_targets(target)
    if isinstance(sites, str):
        sites = (sites,)
    sites = list(sites)
    if not sites:
        raise ValueError(f"sites is empty; use some of {TRACE_SITES}.")
    for site in sites:
        if site not in TRACE_SITES:
            fix = " (a head's z: run_conditions with PatchEdit(layer, 'z', position, head=h))" if site == "z" else ""
            raise ValueError(f"Unknown site {site!r}; causal_trace patches {TRACE_SITES}{fix}.")
    layers = check_layers(model, layers)
    positions = _check_positions(positions)
    if align not in ALIGNMENTS:
        raise ValueError(f"Unknown align {align!r}; use one of {ALIGNMENTS}.")
    min_gap = check_finite(min_gap, "min_gap", "non-negative")
    if batch_size != "auto":
        check_batch_size(batch_size)
    resolved = resolve_metric(metric)
    used = sorted({name for pair in pairs for name in pair if name != AGREEING})
    check_dataset(model, dataset, conflict_types=used)
    frames = [
        _trace_pair(
            model, dataset, pair, sites, layers, positions, targets, metric, resolved, align, batch_size, progress
        )
        for pair in pairs
    ]
    per_example = pd.concat(frames, ignore_index=True)
    gap = per_example["p_source"] - per_example["p_destination"]
    per_example["restored"] = np.where(gap.abs() > min_gap, per_example["delta"] / gap.where(gap != 0), np.nan)
    per_example.attrs.update(
        metric=metric if isinstance(metric, str) else getattr(metric, "__name__", "custom"),
        align=align,
        model=model.cfg.model_name,
        n_layers=model.cfg.n_layers,
    )
    return TraceResult.from_per_example(per_example)


def _counterpart(position: int, n_destination: int, n_source: int, align: str) -> int | None:
    """The source index a destination ``position`` reads, or None: outside either prompt, or the
    source's first token (BOS) standing in for a later destination token."""
    pairs = aligned_positions(position, n_destination, n_source, align)
    if not pairs or (pairs[0][1] == 0 and pairs[0][0] != 0):
        return None
    return pairs[0][1]


def _trace_pair(model, dataset, pair, sites, layers, positions, targets, metric, resolved, align, batch_size, progress):
    source, destination = pair
    sides = []
    for i, example in enumerate(dataset):
        src_prompt, _ = _side(example, source, destination)
        dst_prompt, dst_context = _side(example, destination, source)
        sides.append((i, src_prompt, dst_prompt, dst_context))
    tokens = {i: tokenize_prompts(model, [s, d]) for i, s, d, _ in sides}
    if AGREEING in pair:
        kept = [side for side in sides if len(tokens[side[0]][0]) == len(tokens[side[0]][1])]
        dropped = len(sides) - len(kept)
        if dropped:
            warnings.warn(
                f"{dropped} of {len(sides)} facts dropped from the pair {pair}: with the memorised answer in place "
                "of the context answer the prompt has another number of tokens, so positions would not line up.",
                stacklevel=3,
            )
        if not kept:
            raise ValueError(
                f"No fact is left for the pair {pair}: every agreeing prompt differs in token count from its "
                "context prompt (the two answers tokenize to different lengths)."
            )
    else:
        kept = sides
    index = [i for i, *_ in kept]
    src_tokens = [tokens[i][0] for i in index]
    dst_tokens = [tokens[i][1] for i in index]
    lengths = [(len(d), len(s)) for d, s in zip(dst_tokens, src_tokens)]
    if positions is None:
        longest = max(n for n, _ in lengths)
        positions = [p for p in range(-longest, 0) if any(_counterpart(p, d, s, align) is not None for d, s in lengths)]

    def ids(prompts):
        return torch.tensor(
            [[answer_token(model, dataset[i].target_answer(t), p) for t in targets] for i, p in zip(index, prompts)]
        )

    src_prompts, dst_prompts = [k[1] for k in kept], [k[2] for k in kept]
    grid = [(site, layer, position) for site in sites for layer in layers for position in positions]
    conditions = [[PatchEdit(layer, site, position)] for site, layer, position in grid]
    p_dst, patched = run_conditions(
        model,
        dst_tokens,
        ids(dst_prompts),
        conditions,
        metric=resolved,
        batch_size=batch_size,
        source_tokens=src_tokens,
        align=align,
        progress=progress,
        desc=f"{source} -> {destination}",
    )
    p_src = torch.empty((len(index), len(targets)))
    src_ids = ids(src_prompts)
    for rows, logits in iter_final_logits(model, src_tokens, progress=False):
        p_src[rows] = resolved(logits, src_ids[rows].to(logits.device)).float().cpu()

    spans = []
    for (i, _, dst_prompt, dst_context), toks in zip(kept, dst_tokens):
        example = dataset[i]
        if destination == AGREEING:
            answers = example.answers
            spans.append(
                find_spans(
                    model, dst_prompt, example.subject, context_answers=answers, context=dst_context, tokens=toks
                )
            )
        else:
            spans.append(example_spans(model, example, destination, tokens=toks))

    n, n_c, n_t = patched.shape
    e, c, t = (a.reshape(-1) for a in np.meshgrid(np.arange(n), np.arange(n_c), np.arange(n_t), indexing="ij"))
    p = patched.reshape(-1).double().numpy()
    read = [_counterpart(grid[k][2], *lengths[j], align) for j, k in zip(e, c)]
    keep = np.isfinite(p) & np.array([r is not None for r in read])
    e, c, t, p = e[keep], c[keep], t[keep], p[keep]
    read = np.array(read, dtype=object)[keep].astype(int)
    position = np.array([grid[k][2] for k in c], dtype=int)
    at = np.array([len(dst_tokens[k]) for k in e], dtype=int) + position
    frame = pd.DataFrame(
        {
            "example": np.array(index)[e],
            "subject": [dataset[index[k]].subject for k in e],
            "relation": [dataset[index[k]].relation for k in e],
            "source": source,
            "destination": destination,
            "target": np.array(targets)[t],
            "site": [grid[k][0] for k in c],
            "layer": np.array([grid[k][1] for k in c]),
            "position": position,
            "span": [spans[k][a] for k, a in zip(e, at)],
            "token": [model.tokenizer.decode([dst_tokens[k][a]]) for k, a in zip(e, at)],
            "source_token": [model.tokenizer.decode([src_tokens[k][r]]) for k, r in zip(e, read)],
            "p_destination": p_dst.double().numpy()[e, t],
            "p_source": p_src.double().numpy()[e, t],
            "p": p,
        }
    )
    frame["delta"] = frame["p"] - frame["p_destination"]
    return frame


def _summary(per_example: pd.DataFrame, by: str) -> pd.DataFrame:
    """Means per pair, target, site, layer and ``by`` (facts counted once each)."""
    keys = [*_PAIR_KEYS, "site", "layer", by]
    grouped = per_example.groupby(keys, sort=False)
    out = grouped.agg(
        delta_mean=("delta", "mean"),
        delta_std=("delta", "std"),
        restored_mean=("restored", "mean"),
        p_destination=("p_destination", "mean"),
        p_source=("p_source", "mean"),
        p=("p", "mean"),
        n=("example", "nunique"),
    ).reset_index()
    if by == "position":  # the label most facts share at this position
        modal = grouped[["span", "token"]].agg(lambda s: s.value_counts().index[0]).reset_index()
        out = out.merge(modal, on=keys, how="left")
        return out.sort_values([*_PAIR_KEYS, "site", "layer", "position"], kind="stable").reset_index(drop=True)
    order = {name: i for i, name in enumerate(SPAN_GROUPS)}
    out["_order"] = out["span"].map(order)
    out = out.sort_values([*_PAIR_KEYS, "site", "layer", "_order"], kind="stable").drop(columns="_order")
    return out.reset_index(drop=True)
