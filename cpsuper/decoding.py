"""Running a model over prompts: final-position logits and greedy decoding, optionally steered.

:func:`iter_final_logits` and :func:`iter_greedy` (key-value cached, :func:`greedy_batch` per
batch) take an optional :class:`Steering`, so that JuICE, JuNe, PH3's pruning and the plain model
run through the same loops. Only the final position of each prompt is unembedded
(:func:`unembed_final`), always in float32: on a 262k-token vocabulary, unembedding every position
costs more than the rest of the forward pass on short prompts.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm
from transformer_lens.utilities.activation_functions import apply_softcap

from .backend import Model, final_residual, is_bridge
from .metrics import Metric
from .precision import native_on_cpu
from .runtime import check_batch_size, length_batches, pad_tokens, padded_batches

__all__ = [
    "GroupedReadout",
    "Steering",
    "float32_unembedding",
    "greedy_batch",
    "iter_final_logits",
    "iter_greedy",
    "keep_rows",
    "stop_on_text",
    "unembed_final",
]


_FLOAT32_READOUT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Per low-precision model: a float32 copy of its unembedding, keyed by the weights' identity."""


def float32_unembedding(model: Model) -> tuple[Float[Tensor, "d_model d_vocab"], Tensor | None]:
    """``W_U`` and ``b_U`` in float32. For a bf16 / fp16 model the copy is made once and kept
    until the weights change (another tensor or an in-place edit): the readout of a CPU that
    would emulate the model's precision (:func:`unembed_final`)."""
    w_u, b_u = model.W_U, model.b_U
    if w_u.dtype == torch.float32:
        return w_u, b_u
    key = (w_u.data_ptr(), w_u._version, None if b_u is None else (b_u.data_ptr(), b_u._version))
    kept = _FLOAT32_READOUT.get(model)
    if kept is None or kept[0] != key:
        kept = (key, w_u.float(), None if b_u is None else b_u.float())
        _FLOAT32_READOUT[model] = kept
    return kept[1], kept[2]


EXACT_TOP = 32
"""Logits per row that a bf16 / fp16 readout recomputes in float32 (:func:`unembed_final`)."""
_VOCAB_SLICE = 16384


def unembed_final(model: Model, resid: Float[Tensor, "batch d_model"]) -> Float[Tensor, "batch d_vocab"]:
    """Final norm, unembedding and soft-capping of one residual vector per row, in float32.

    The product is the one TransformerLens's ``Unembed`` computes (``F.linear`` with ``W_U.T``),
    without its copy of ``W_U.T`` on every call (free for a model in
    :func:`~cpsuper.fast_weight_layout`'s layout).

    A bf16 / fp16 model multiplies in its own precision, about twice as fast as float32 on a
    CPU with native bf16 and without a float32 copy of ``W_U`` (671 MB for Gemma-3); then each
    row's :data:`EXACT_TOP` largest logits, which decide the argmax and nearly all of the
    softmax, are recomputed from the float32 normed residual, so they equal the float32
    readout's up to float rounding. The other logits keep the product's rounding (8 significant bits
    in bf16). Where the CPU would emulate the low precision, the readout goes through a float32
    copy of ``W_U`` (:func:`float32_unembedding`) instead.
    """
    # Under cp.mixed_precision (torch.autocast) the readout leaves autocast: the final norm and
    # the unembedding run in float32 and so do the logits.
    with torch.autocast(resid.device.type, enabled=False):
        resid = resid.float()
        if model.cfg.normalization_type is not None:
            resid = model.ln_final(resid[:, None, :])[:, 0, :]
        resid = resid.float()
        w_u, b_u = model.W_U, model.b_U
        if w_u.dtype == torch.float32 or not _native(w_u):
            w_u, b_u = float32_unembedding(model)
            logits = torch.nn.functional.linear(resid, w_u.T, b_u)
        else:  # in slices of the vocabulary, each converted to float32 while it is in cache
            low, vocab = resid.to(w_u.dtype), w_u.T
            logits = torch.empty(len(resid), vocab.shape[0], device=resid.device)
            for start in range(0, vocab.shape[0], _VOCAB_SLICE):
                part = slice(start, start + _VOCAB_SLICE)
                logits[:, part] = torch.nn.functional.linear(low, vocab[part], None if b_u is None else b_u[part])
            top = logits.topk(min(EXACT_TOP, logits.shape[-1]), dim=-1).indices
            exact = torch.einsum("bd,bkd->bk", resid, w_u.T[top].float())
            logits.scatter_(1, top, exact if b_u is None else exact + b_u[top].float())
    return apply_softcap(logits, model.cfg.output_logits_soft_cap)


def _native(weights: Tensor) -> bool:
    """Whether products in the weights' precision run natively on their device."""
    return weights.device.type != "cpu" or native_on_cpu(weights.dtype)


# ---------------------------------------------------------------------------------------------
# Running: final-position logits and greedy decoding, optionally steered


class Steering:
    """Hooks applied to every forward pass of :func:`iter_final_logits` and :func:`iter_greedy`.

    The default steers nothing. Subclasses (JuICE, JuNe, PH3's pruning) override
    :meth:`hooks`; one that needs state per batch (JuICE's unsteered run keeps its own key-value
    cache during decoding) overrides :meth:`begin`, whose result comes back as ``state``.
    """

    def begin(self, model: Model, rows: Sequence[int], cached: bool) -> Any:
        """Per-batch state, made before the batch's first forward pass: ``rows`` are the
        batch's indices into the caller's prompt list (a steering whose strength differs by row
        picks its rows here); ``cached``: decoding with a key-value cache."""
        return None

    def hooks(
        self,
        model: Model,
        tokens: Int[Tensor, "batch pos"],
        attention_mask: Int[Tensor, "batch pos"] | None,
        state: Any,
    ) -> AbstractContextManager:
        """A context manager that holds the steering hooks for one forward pass on ``tokens``."""
        return contextlib.nullcontext()

    def final_residual(
        self,
        model: Model,
        tokens: Int[Tensor, "batch pos"],
        attention_mask: Int[Tensor, "batch pos"] | None,
        state: Any,
        positions: Int[Tensor, " batch"] | None = None,
    ) -> Float[Tensor, "batch *pos d_model"]:
        """The steered residual stream after the last block of one right-padded batch (no key-value
        cache), at ``positions`` (one per row; see :func:`cpsuper.backend.final_residual`) when
        given: :meth:`hooks` around a full forward. A steering that can skip work overrides it
        (JuICE's second pass resumes at its first steered layer)."""
        with self.hooks(model, tokens, attention_mask, state):
            return final_residual(
                model, tokens, attention_mask=attention_mask, padding_side="right", positions=positions
            )

    def decoding_residual(
        self,
        model: Model,
        tokens: Int[Tensor, "batch pos"],
        attention_mask: Int[Tensor, "batch pos"] | None,
        state: Any,
        past_kv_cache: Any = None,
    ) -> Float[Tensor, "batch d_model"]:
        """The steered residual stream after the last block, at the last position, for one step of
        greedy decoding on a left-padded batch (every row's text ends there), with the batch's
        key-value cache where the backend takes one: :meth:`hooks` around a forward. A steering
        that can skip work overrides it (JuICE's second pass resumes at its first steered layer,
        with the first pass's cache for the layers before it)."""
        cached = {} if past_kv_cache is None else {"past_kv_cache": past_kv_cache}
        with self.hooks(model, tokens, attention_mask, state):
            return final_residual(
                model, tokens, attention_mask=attention_mask, positions=last_positions(tokens), **cached
            )

    def keep_rows(self, state: Any, keep: Int[Tensor, " kept"], n_rows: int) -> Any:
        """The per-batch ``state`` for rows ``keep`` of the ``n_rows`` decoded so far (greedy
        decoding drops rows that have finished). The default, :func:`keep_rows`, slices key-value
        caches and per-row tensors; return ``NotImplemented`` to keep every row instead."""
        return keep_rows(state, keep, n_rows)


_NO_STEERING = Steering()


def last_positions(tokens: Int[Tensor, "batch pos"]) -> Int[Tensor, " batch"]:
    """The last position of every row (where a left-padded row's text ends)."""
    return torch.full((tokens.shape[0],), tokens.shape[1] - 1, dtype=torch.long, device=tokens.device)


class GroupedReadout:
    """Final-position residuals waiting for the unembedding, read out ``rows`` at a time into
    ``out[prompt, condition]`` (the sweep engine's results).

    Each product with the 262k x d_model unembedding streams the whole matrix, so a call on a
    dozen rows costs nearly what one on a hundred does (16 ms a row at 12 rows, 7 at 128 on the
    CPU of docs/performance.md). Resumed chunks are often that small (a few conditions share a
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


def iter_final_logits(
    model: Model,
    token_lists: Sequence[Sequence[int]],
    batch_size: int = 32,
    padding_side: str = "right",
    progress: bool = True,
    desc: str = "forward",
    *,
    steering: Steering | None = None,
) -> Iterator[tuple[list[int], Float[Tensor, "batch d_vocab"]]]:
    """Yield ``(indices, final-position logits)`` batch by batch, in length order."""
    steering = steering or _NO_STEERING
    batches = list(padded_batches(model, token_lists, batch_size, padding_side))  # a few small int tensors
    for idx, tokens, mask, last in tqdm(batches, desc=desc, disable=not progress, leave=False):
        padded = bool((mask == 0).any())
        with torch.inference_mode():
            state = steering.begin(model, idx, cached=False)
            final = steering.final_residual(model, tokens, mask if padded else None, state, positions=last)
            logits = unembed_final(model, final)
        # Yield outside inference mode: the caller's code runs while the generator is suspended, and
        # grad mode is thread-wide, so a yield inside the block would leave autograd off for the caller
        # (for good, if the caller abandons the generator).
        yield idx, logits


def keep_rows(state: Any, keep: Int[Tensor, " kept"], n_rows: int) -> Any:
    """``state`` restricted to the batch rows ``keep`` (of ``n_rows``), for decoding that drops
    finished rows: key-value caches are sliced in place, tensors with one entry per row are
    indexed, tuples, lists and dicts are walked, anything else is kept as it is."""
    if state is None or isinstance(state, (int, float, str)):
        return state
    if hasattr(state, "entries") and hasattr(state, "previous_attention_mask"):  # a TL key-value cache
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


def stop_on_text(model: Model, stop_when: Callable[[int, str], bool] | None) -> Callable[[int, list[int]], bool] | None:
    """``stop_when(k, text)``, a test on decoded text, as the ``finished(k, ids)`` of
    :func:`greedy_batch` / :func:`iter_greedy`. None (decode in full) for a tokenizer that cleans
    up spaces, since its decoding can rewrite text already decoded (``" n't"`` -> ``"n't"``)."""
    if stop_when is None or getattr(model.tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return lambda k, ids: stop_when(k, model.tokenizer.decode(ids, skip_special_tokens=True))


def greedy_batch(
    model: Model,
    token_lists: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    steering: Steering | None = None,
    rows: Sequence[int] | None = None,
    pick: Callable[[Float[Tensor, "batch d_vocab"]], Int[Tensor, " batch"]] | None = None,
    finished: Callable[[int, list[int]], bool] | None = None,
) -> tuple[Float[Tensor, "batch d_vocab"], list[list[int]]]:
    """Greedy decoding of one batch: the prompts' last-position logits and each row's new token ids.

    Left-padded, with a key-value cache (on the TransformerBridge, which takes Hugging Face
    caches, each step reruns the prefix); only the last position is unembedded. ``pick`` maps a
    step's logits to the next token of every row (default: argmax); context-aware decoding
    passes one that combines paired rows. ``rows`` go to ``steering.begin``.

    ``finished(i, ids)`` says whether row ``i`` (an index into ``token_lists``) already holds
    everything its caller will read, given its new ids so far: the row stops growing there, and
    decoding stops once every row has finished. Finished rows also leave the batch, so later
    steps run on fewer rows (the steering's per-batch state follows through
    :meth:`Steering.keep_rows`, and ``pick`` sees only the rows still decoding, in input order:
    a ``pick`` that pairs rows must have each pair finish together). Where a row stops depends
    only on its own ids, not on which rows share its batch.
    """
    from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache

    steering = steering or _NO_STEERING
    cached = not is_bridge(model)
    tokens, mask, _ = pad_tokens(model, token_lists, "left")
    n = len(token_lists)
    generated: list[list[int]] = [[] for _ in range(n)]
    done = [False] * n
    active = list(range(n))  # the input rows still in the batch, in batch order
    can_drop = True
    first_logits = None
    with torch.inference_mode():
        kv = TransformerLensKeyValueCache.init_cache(model.cfg, model.cfg.device, n) if cached else None
        state = steering.begin(model, list(range(n)) if rows is None else rows, cached=cached)
        for _ in range(max_new_tokens):
            logits = unembed_final(model, steering.decoding_residual(model, tokens, mask, state, kv))
            first_logits = logits if first_logits is None else first_logits
            next_tok = (logits.argmax(-1) if pick is None else pick(logits))[:, None]
            for i, token in zip(active, next_tok[:, 0].tolist()):
                if not done[i]:
                    generated[i].append(token)
                    done[i] = finished is not None and finished(i, generated[i])
            if all(done):
                break
            tokens = next_tok if cached else torch.cat([tokens, next_tok], 1)
            mask = torch.ones_like(tokens) if cached else torch.cat([mask, torch.ones_like(next_tok)], 1)
            if can_drop and any(done[i] for i in active):
                keep = torch.tensor([p for p, i in enumerate(active) if not done[i]], dtype=torch.long)
                kept_state = steering.keep_rows(state, keep, len(active))
                if kept_state is NotImplemented:  # a steering whose state cannot follow: keep every row
                    can_drop = False
                    continue
                state, on_device = kept_state, keep.to(tokens.device)
                tokens, mask = tokens[on_device], mask[on_device]
                if kv is not None:
                    keep_rows(kv, keep, len(active))
                active = [i for i in active if not done[i]]
    return first_logits, generated


def iter_greedy(
    model: Model,
    token_lists: Sequence[Sequence[int]],
    max_new_tokens: int = 8,
    batch_size: int = 32,
    progress: bool = True,
    *,
    steering: Steering | None = None,
    desc: str = "greedy",
    finished: Callable[[int, list[int]], bool] | None = None,
) -> Iterator[tuple[list[int], Float[Tensor, "batch d_vocab"], list[list[int]]]]:
    """Yield ``(indices, last-position logits of the prompts, greedy token ids per row)`` batch by
    batch (:func:`greedy_batch` on batches of similar length). The first step's logits are the
    prompts' own last-position logits, so scoring can reuse them. ``finished(k, ids)``, with
    ``k`` an index into ``token_lists``, ends a prompt's decoding early (see :func:`greedy_batch`)."""
    max_new_tokens = check_batch_size(max_new_tokens, "max_new_tokens")
    for idx in tqdm(
        length_batches([len(t) for t in token_lists], batch_size), desc=desc, disable=not progress, leave=False
    ):
        row_finished = None if finished is None else (lambda i, ids, idx=idx: finished(idx[i], ids))
        first, generated = greedy_batch(
            model, [token_lists[i] for i in idx], max_new_tokens, steering=steering, rows=idx, finished=row_finished
        )
        yield idx, first, generated
