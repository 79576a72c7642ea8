"""The fast sweep engine: many interventions, one clean run.

A sweep asks: for each prompt and each *condition* (a set of edits to heads or modules), what
is the probability of some answer tokens at the last position? Done naively, that is one full
forward pass per prompt and condition, unembedding every position. The engine instead

1. runs each batch of prompts once, clean, caching the residual stream entering every layer
   (and the head outputs that dual-run edits need);
2. resumes each condition from its first edited layer (``start_at_layer``; earlier ones cannot change);
3. puts many (prompt, condition) rows into the batch dimension of one resumed forward, each row
   with its own head scales and module scales, applied by a single hook per hook point;
4. runs the last block's MLP, and unembeds, at the final position only.

A :class:`PatchEdit` is position-resolved: it puts the value a *source* prompt's clean run had
at the aligned position into the destination's run (causal tracing, activation patching). The
sources run once per prompt batch, caching only the hook points the patches read.

Results equal one ``run_with_hooks`` per condition up to float rounding (checked in the tests).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from functools import partial

import torch
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from . import distributed
from .backend import Model, final_residual, saving_hooks
from .batch_sizes import CHUNK_TOKENS, row_chunks, rows_that_fit
from .decoding import unembed_final
from .edits import (
    ALIGNMENTS,
    Condition,
    HeadEdit,
    ModuleEdit,
    OffsetEdit,
    PatchEdit,
    WeightEdit,
    aligned_positions,
    check_condition,
)
from .interrupts import hooked
from .metrics import Metric, resolve_metric
from .runtime import (
    check_batch_size,
    pad_tokens,
    padded_batches,
)

__all__ = ["GroupedReadout", "answer_probabilities", "run_conditions"]


class GroupedReadout:
    """Final-position residuals waiting for the unembedding, read out ``rows`` at a time into
    ``out[prompt, condition]`` (the sweep engine's results).

    Each product with the 262k x d_model unembedding streams the whole matrix, so a call on a
    dozen rows costs nearly what one on a hundred does (16 ms a row at 12 rows, 7 at 128 on the
    CPU of docs/results/performance.md). Resumed chunks are often that small (a few conditions share a
    start layer), so their residuals wait here and are unembedded together; ``rows`` is the
    sweep's ``batch_size``, so the logits never take more memory than one chunk's would.
    """

    def __init__(self, model: Model, metric: Metric, rows: int, out: Tensor):
        self.model, self.metric, self.rows, self.out = model, metric, rows, out
        self.resid: list[Tensor] = []
        self.ids: list[Tensor] = []
        self.places: list[tuple[int, int]] = []  # (prompt, condition) index into ``out`` per row

    def add(self, resid: Float[Tensor, "rows d_model"], ids: Int[Tensor, "rows n_answers"], places) -> None:
        if len(self.places) + len(places) > self.rows:  # never more than ``rows`` in one read-out
            self.flush()
        self.resid.append(resid)
        self.ids.append(ids)
        self.places += places
        if len(self.places) >= self.rows:
            self.flush()

    def flush(self) -> None:
        if not self.places:
            return
        logits = unembed_final(self.model, torch.cat(self.resid))
        values = self.metric(logits, torch.cat(self.ids)).float().cpu()
        prompts, conditions = zip(*self.places)
        self.out[list(prompts), list(conditions)] = values
        self.resid, self.ids, self.places = [], [], []


def _scale_module(act, hook, *, scale, offset):
    act = act * scale[:, None, None]
    return act if offset is None else act + offset[:, None]


class _RowEdits:
    """Per-row multipliers (and offsets) for one chunk of (prompt, condition) rows, by layer.

    A hook point's edits are applied in one hook: ``scale * act (+ add * clean) + offset``."""

    def __init__(self, model: Model, conditions: Sequence[Condition], rows: int, device):
        n_heads = model.cfg.n_heads
        self.head_scale: dict[int, Tensor] = {}
        self.head_add: dict[int, Tensor] = {}
        self.attn_scale: dict[int, Tensor] = {}
        self.mlp_scale: dict[int, Tensor] = {}
        self.head_offset: dict[int, Tensor] = {}
        self.attn_offset: dict[int, Tensor] = {}
        self.mlp_offset: dict[int, Tensor] = {}

        def ones(*shape):
            return torch.ones(shape, device=device, dtype=model.cfg.dtype)

        def zeros(*shape):
            return torch.zeros(shape, device=device, dtype=model.cfg.dtype)

        for row, condition in enumerate(conditions):
            for edit in condition:
                layer = edit.layer
                if isinstance(edit, PatchEdit):
                    continue
                if isinstance(edit, OffsetEdit):
                    vector = edit.vector.to(device=device, dtype=model.cfg.dtype)
                    if edit.site == "z":
                        shape = (rows, n_heads, model.cfg.d_head)
                        self.head_offset.setdefault(layer, zeros(*shape))[row, edit.head] += vector
                        self.head_scale.setdefault(layer, ones(rows, n_heads))  # one z hook applies both
                    else:
                        kind = "attn" if edit.site == "attn_out" else "mlp"
                        getattr(self, f"{kind}_offset").setdefault(layer, zeros(rows, model.cfg.d_model))[row] += vector
                        getattr(self, f"{kind}_scale").setdefault(layer, ones(rows))
                    continue
                if isinstance(edit, HeadEdit):
                    self.head_scale.setdefault(layer, ones(rows, n_heads))[row, edit.head] *= edit.scale
                    if edit.add:
                        add = self.head_add.setdefault(layer, torch.zeros_like(ones(rows, n_heads)))
                        add[row, edit.head] += edit.add
                elif isinstance(edit, ModuleEdit):
                    if edit.module in ("attn", "layer"):
                        self.attn_scale.setdefault(layer, ones(rows))[row] *= edit.scale
                    if edit.module in ("mlp", "layer"):
                        self.mlp_scale.setdefault(layer, ones(rows))[row] *= edit.scale

    def hooks(self, clean_z: dict[int, Tensor] | None):
        hooks = []
        for layer, scale in self.head_scale.items():
            add = self.head_add.get(layer)
            recorded = clean_z[layer] if add is not None else None

            offset = self.head_offset.get(layer)

            def z_hook(z, hook, scale=scale, add=add, recorded=recorded, offset=offset):
                out = z * scale[:, None, :, None]
                if add is not None:
                    out = out + add[:, None, :, None] * recorded
                if offset is not None:
                    out = out + offset[:, None]
                return out

            hooks.append((f"blocks.{layer}.attn.hook_z", z_hook))
        for kind, scales, offsets in (
            ("attn", self.attn_scale, self.attn_offset),
            ("mlp", self.mlp_scale, self.mlp_offset),
        ):
            for layer, scale in scales.items():
                hook = partial(_scale_module, scale=scale, offset=offsets.get(layer))
                hooks.append((f"blocks.{layer}.hook_{kind}_out", hook))
        return hooks


class _RowPatches:
    """The source values each row of a chunk writes, gathered per hook point, and one hook each.

    ``patches[r]`` lists ``(edit, [(destination, source) positions])`` of row ``r``; ``sources[r]``
    is that row's prompt in the source batch whose activations ``source_cache`` holds."""

    def __init__(self, patches: Sequence[Sequence[tuple[PatchEdit, list]]], sources: Sequence[int], source_cache):
        spots: dict[str, list[tuple[int, int, int, int, int]]] = defaultdict(list)
        weights: dict[str, list[float]] = defaultdict(list)
        for row, (row_patches, source) in enumerate(zip(patches, sources)):
            for edit, pairs in row_patches:
                head = -1 if edit.head is None else edit.head
                spots[edit.hook_name] += [(row, d, source, s, head) for d, s in pairs]
                weights[edit.hook_name] += [float(edit.weight)] * len(pairs)
        self.writes = {}
        for name, items in spots.items():
            recorded = source_cache[name]
            rows, dest, src, src_pos, heads = (torch.tensor(v, device=recorded.device) for v in zip(*items))
            # A weight of 1 everywhere replaces (bit for bit); other weights mix the source value in.
            mix = torch.tensor(weights[name], device=recorded.device, dtype=recorded.dtype)
            mix = None if bool((mix == 1).all()) else mix
            if name.endswith("hook_z"):
                values = recorded[src, src_pos, heads]
                self.writes[name] = ((rows, dest, heads), values, mix)
            else:
                self.writes[name] = ((rows, dest), recorded[src, src_pos], mix)

    def hooks(self):
        return [(n, partial(_patch, where=w, values=v, mix=m)) for n, (w, v, m) in self.writes.items()]


def _patch(act, hook, *, where, values, mix):
    act = act.clone()
    act[where] = values if mix is None else (1 - mix[:, None]) * act[where] + mix[:, None] * values
    return act


def _check_sources(
    token_lists: Sequence[Sequence[int]], source_tokens: Sequence[Sequence[int]] | None, align: str, patched: bool
) -> None:
    if align not in ALIGNMENTS:
        raise ValueError(f"Unknown align {align!r}; use one of {ALIGNMENTS}.")
    if not patched:
        return
    if source_tokens is None:
        raise ValueError("PatchEdit conditions need source_tokens: one tokenized source prompt per destination prompt.")
    if len(source_tokens) != len(token_lists):
        raise ValueError(
            f"source_tokens has {len(source_tokens)} prompts for {len(token_lists)} destination prompts; "
            "give one source per destination prompt."
        )
    if align == "exact":
        for i, (dest, src) in enumerate(zip(token_lists, source_tokens)):
            if len(dest) != len(src):
                raise ValueError(
                    f"align='exact' needs prompts and sources of equal length, but prompt {i} has {len(dest)} "
                    f"tokens and its source {len(src)}. Use align='end' to line up the prompts' last tokens "
                    "(a shared question suffix), align='start' to line up their first, or pair prompts of "
                    "equal length."
                )


def run_conditions(
    model: Model,
    token_lists: Sequence[Sequence[int]],
    answer_ids: Int[Tensor, "n_prompts n_answers"],
    conditions: Sequence[Condition],
    *,
    metric: str | Metric = "probability",
    batch_size: int | str = 64,
    prompt_batch_size: int = 16,
    progress: bool = True,
    desc: str = "sweep",
    source_tokens: Sequence[Sequence[int]] | None = None,
    align: str = "end",
) -> tuple[Float[Tensor, "n_prompts n_answers"], Float[Tensor, "n_prompts n_conditions n_answers"]]:
    """``metric`` of ``answer_ids`` at the last position, clean and under every condition: the
    one engine behind head sweeps, knockouts, JuICE stage 1, PH3 and truncation sweeps.

    ``token_lists`` are tokenized prompts (see :func:`cpsuper.runtime.tokenize_prompts`);
    ``answer_ids[i]`` the token ids to read for prompt ``i``; ``conditions`` lists of
    :class:`HeadEdit` / :class:`ModuleEdit` / :class:`OffsetEdit` / :class:`PatchEdit` applied together (an empty
    list is the clean run), or one :class:`WeightEdit`. ``metric``: ``"probability"`` (first-token probability, the
    default), ``"logprob"``, ``"logit"``, or a callable ``(logits, answer_ids) -> values``, as
    TransformerLens's patching takes a metric. ``batch_size``: (prompt, condition) rows per resumed
    forward (``"auto"``: fitted to free memory, :mod:`cpsuper.batch_sizes`); ``prompt_batch_size``:
    prompts per clean run.

    :class:`PatchEdit` s read ``source_tokens`` (one source prompt per destination prompt, run
    once, clean) at the position ``align`` pairs with the patched one (:data:`ALIGNMENTS`). A
    (prompt, condition) whose patched position does not exist in that prompt, or has no
    counterpart in its source, is NaN; a patch whose position exists in no prompt is an error.
    """
    n_prompts = len(token_lists)
    if n_prompts == 0:
        raise ValueError("No prompts to sweep.")
    if answer_ids.ndim != 2 or answer_ids.shape[0] != n_prompts:
        raise ValueError(f"answer_ids must be [n_prompts={n_prompts}, n_answers], got {tuple(answer_ids.shape)}.")
    longest = max(map(len, token_lists))
    batch_size = rows_that_fit(model, longest) if batch_size == "auto" else check_batch_size(batch_size)
    prompt_batch_size = check_batch_size(prompt_batch_size, "prompt_batch_size")
    metric = resolve_metric(metric)
    for condition in conditions:
        check_condition(model, condition)
    patch_names = sorted({e.hook_name for cond in conditions for e in cond if isinstance(e, PatchEdit)})
    _check_sources(token_lists, source_tokens, align, bool(patch_names))
    patches = _patch_positions(token_lists, source_tokens, conditions, align) if patch_names else {}
    if distributed.sharding():  # under torchrun: this rank's share of the conditions, then gathered
        options = {"metric": metric, "batch_size": batch_size, "prompt_batch_size": prompt_batch_size, "desc": desc}
        options.update(source_tokens=source_tokens, align=align)
        options["progress"] = progress and distributed.is_main_process()
        share = lambda part: run_conditions(model, token_lists, answer_ids, part, **options)  # noqa: E731
        return distributed.run_sharded(share, conditions)
    n_layers = model.cfg.n_layers
    weighted = [c for c, cond in enumerate(conditions) if cond and isinstance(cond[0], WeightEdit)]
    by_start: dict[int, list[int]] = defaultdict(list)
    for c, condition in enumerate(conditions):
        if c not in weighted:
            by_start[min((e.layer for e in condition), default=n_layers)].append(c)
    starts = sorted(s for s in by_start if s < n_layers)
    dual_layers = sorted({e.layer for cond in conditions for e in cond if isinstance(e, HeadEdit) and e.add})
    resume_layers = set(starts) | {conditions[c][0].layer for c in weighted}

    clean = torch.empty((n_prompts, answer_ids.shape[1]))
    out = torch.empty((n_prompts, len(conditions), answer_ids.shape[1]))
    per_prompt = sum(len(by_start[s]) for s in starts) + len(weighted)
    bar = tqdm(total=n_prompts * per_prompt, desc=desc, disable=not progress, unit="row", leave=False)
    wanted = {f"blocks.{s}.hook_resid_pre" for s in resume_layers} | {f"blocks.{l}.attn.hook_z" for l in dual_layers}
    device = model.cfg.device
    chunk_tokens = CHUNK_TOKENS if torch.device(device).type == "cpu" else None
    readout = GroupedReadout(model, metric, batch_size, out)
    with torch.inference_mode():
        for idx, tokens, _, last in padded_batches(model, token_lists, batch_size=prompt_batch_size):
            ids = answer_ids[idx].to(device)
            # 1. One clean run of this prompt batch, caching what the resumed runs need. Right
            #    padding needs no mask: causal attention keeps padding out of the real positions.
            cache = {}
            with hooked(model, saving_hooks(wanted, cache)):
                final = final_residual(model, tokens, positions=last)
            clean[idx] = metric(unembed_final(model, final), ids).float().cpu()
            for c in by_start.get(n_layers, []):  # conditions without edits are the clean run
                out[idx, c] = clean[idx]

            # 1b. One clean run of these prompts' sources, caching only what the patches read.
            source_cache = {}
            if patch_names:
                src_tokens, _, src_last = pad_tokens(model, [source_tokens[i] for i in idx], "right")
                with hooked(model, saving_hooks(patch_names, source_cache)):
                    final_residual(model, src_tokens, positions=src_last)

            # 2. Resume every hook condition from its first edited layer, many rows per forward.
            #    Rows are ordered prompt by prompt (the batch is longest first); each chunk is cut to
            #    its longest prompt, and the cuts keep padding and (on a CPU) chunk size small.
            #    A row whose patch has no position in its prompt or source is NaN and not run.
            for start in starts:
                pairs = []
                for p in range(len(idx)):
                    for c in by_start[start]:
                        if patches.get((idx[p], c), True) is None:
                            out[idx[p], c] = float("nan")
                            bar.update(1)
                        else:
                            pairs.append((p, c))
                widths = [int(last[p]) + 1 for p, _ in pairs]
                for rows in row_chunks(widths, batch_size, chunk_tokens) if pairs else []:
                    chunk = pairs[rows.start : rows.stop]
                    p_rows = torch.tensor([p for p, _ in chunk], device=device)
                    width = widths[rows.start]
                    edits = _RowEdits(model, [conditions[c] for _, c in chunk], len(chunk), device)
                    clean_z = {l: cache[f"blocks.{l}.attn.hook_z"][p_rows, :width] for l in edits.head_add}
                    hooks = edits.hooks(clean_z)
                    if patch_names:
                        row_patches = [patches.get((idx[p], c), []) for p, c in chunk]
                        hooks += _RowPatches(row_patches, [p for p, _ in chunk], source_cache).hooks()
                    with hooked(model, hooks):
                        resume = cache[f"blocks.{start}.hook_resid_pre"][p_rows, :width]
                        final = final_residual(model, resume, positions=last[p_rows], start_at_layer=start)
                    readout.add(final, ids[p_rows], [(int(idx[p]), c) for p, c in chunk])
                    bar.update(len(chunk))

            # 3. Weight edits: the whole prompt batch resumes at the edited layer, edit in place.
            for c in weighted:
                edit = conditions[c][0]
                if edit.identity:
                    out[idx, c] = clean[idx]
                else:
                    with edit.apply(model):
                        resume = cache[f"blocks.{edit.layer}.hook_resid_pre"]
                        final = final_residual(model, resume, positions=last, start_at_layer=edit.layer)
                    out[idx, c] = metric(unembed_final(model, final), ids).float().cpu()
                bar.update(len(idx))
        readout.flush()
    bar.close()
    return clean, out


def _patch_positions(
    token_lists: Sequence[Sequence[int]],
    source_tokens: Sequence[Sequence[int]],
    conditions: Sequence[Condition],
    align: str,
) -> dict[tuple[int, int], list[tuple[PatchEdit, list[tuple[int, int]]]] | None]:
    """For every (prompt, condition) with patches: each patch and its (destination, source)
    positions, or None where some patch has none (that row is NaN). Raises for a patch whose
    position exists in no prompt."""
    out: dict = {}
    for c, condition in enumerate(conditions):
        edits = [e for e in condition if isinstance(e, PatchEdit)]
        if not edits:
            continue
        for p, (dest, src) in enumerate(zip(token_lists, source_tokens)):
            found = [(e, aligned_positions(e.position, len(dest), len(src), align)) for e in edits]
            out[p, c] = None if any(not pairs for _, pairs in found) else found
        if all(out[p, c] is None for p in range(len(token_lists))):
            lengths = sorted({(len(d), len(s)) for d, s in zip(token_lists, source_tokens)})
            raise ValueError(
                f"Condition {c} patches a position that exists in none of the {len(token_lists)} prompts "
                f"with a counterpart in its source (align={align!r}; destination and source lengths "
                f"{lengths[:5]}): {edits}. Use positions inside the prompts, e.g. -1 for the final token."
            )
    return out


def answer_probabilities(
    model: Model,
    token_lists: Sequence[Sequence[int]],
    answer_ids: Int[Tensor, "n_prompts n_answers"],
    conditions: Sequence[Condition],
    *,
    batch_size: int | str = 64,
    prompt_batch_size: int = 16,
    progress: bool = True,
    desc: str = "sweep",
) -> tuple[Float[Tensor, "n_prompts n_answers"], Float[Tensor, "n_prompts n_conditions n_answers"]]:
    """First-token probabilities of ``answer_ids``, clean and under every condition
    (:func:`run_conditions` with its default metric)."""
    return run_conditions(
        model,
        token_lists,
        answer_ids,
        conditions,
        batch_size=batch_size,
        prompt_batch_size=prompt_batch_size,
        progress=progress,
        desc=desc,
    )
