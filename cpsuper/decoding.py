"""Running a model over prompts: final-position logits and greedy decoding, optionally steered.

:func:`iter_final_logits` and :func:`iter_greedy` (key-value cached, batches in lockstep:
:func:`greedy_batches`) take an optional :class:`Steering`, so that JuICE, JuNe, PH3's pruning and
the plain model run through the same loops. Only the final position of each prompt is unembedded
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
from .kv_cache import (
    hf_cache,
    keep_hf_rows,
    keep_rows,
    prefill_groups,
    stack_group_caches,
    stack_hf_group_caches,
    warn_uncached_bridge,
)
from .precision import native_on_cpu
from .runtime import check_batch_size, length_batches, pad_tokens, padded_batches

__all__ = [
    "Steering",
    "float32_unembedding",
    "greedy_batch",
    "greedy_batches",
    "iter_final_logits",
    "iter_greedy",
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
    :func:`~cpsuper.weight_layout.fast_weight_layout`'s layout).

    A bf16 / fp16 model multiplies in its own precision, about twice as fast as float32 on a
    CPU with native bf16 and without a float32 copy of ``W_U`` (671 MB for Gemma-3); then each
    row's :data:`EXACT_TOP` largest logits, which decide the argmax and nearly all of the
    softmax, are recomputed from the float32 normed residual, so they equal the float32
    readout's up to float rounding. The other logits keep the product's rounding (8 significant bits
    in bf16). Where the CPU would emulate the low precision, the readout goes through a float32
    copy of ``W_U`` (:func:`float32_unembedding`) instead.
    """
    # Under cp.precision.mixed_precision (torch.autocast) the readout leaves autocast: the final norm and
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
        return hooked_step(
            model, tokens, attention_mask, past_kv_cache, self.hooks(model, tokens, attention_mask, state)
        )

    def takes_hf_cache(self, state: Any) -> bool:
        """Whether bridge decoding may hand :meth:`decoding_residual` Hugging Face's cache (hooks
        around one forward may; a steering running its own passes overrides this)."""
        return state is None and type(self).decoding_residual is Steering.decoding_residual

    def keep_rows(self, state: Any, keep: Int[Tensor, " kept"], n_rows: int) -> Any:
        """The per-batch ``state`` for rows ``keep`` of the ``n_rows`` decoded so far (greedy
        decoding drops rows that have finished). The default, :func:`keep_rows`, slices key-value
        caches and per-row tensors; return ``NotImplemented`` to keep every row instead."""
        return keep_rows(state, keep, n_rows)


_NO_STEERING = Steering()


def hooked_step(model: Model, tokens, attention_mask, past_kv_cache, hooks) -> Float[Tensor, "batch d_model"]:
    """A decoding step's final residual at the last position, inside ``hooks``, on an optional cache."""
    with hooks:
        cached = {} if past_kv_cache is None else {"past_kv_cache": past_kv_cache}
        return final_residual(model, tokens, attention_mask=attention_mask, positions=last_positions(tokens), **cached)


def last_positions(tokens: Int[Tensor, "batch pos"]) -> Int[Tensor, " batch"]:
    """The last position of every row (where a left-padded row's text ends)."""
    return torch.full((tokens.shape[0],), tokens.shape[1] - 1, dtype=torch.long, device=tokens.device)


def iter_final_logits(
    model: Model,
    token_lists: Sequence[Sequence[int]],
    *,
    batch_size: int = 32,
    padding_side: str = "right",
    progress: bool = True,
    desc: str = "forward",
    steering: Steering | None = None,
) -> Iterator[tuple[list[int], Float[Tensor, "batch d_vocab"]]]:
    """Yield ``(indices, final-position logits)`` batch by batch, in length order."""
    steering = steering or _NO_STEERING
    # a few small int tensors
    batches = list(padded_batches(model, token_lists, batch_size=batch_size, padding_side=padding_side))
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


READOUT_ROWS = 128  # rows of final residuals greedy decoding unembeds in one product
FLIGHT_TOKENS = 4096
"""Padded tokens (rows x width) of the batches greedy decoding runs at once: bounds their caches."""


class _Decoding:
    """One left-padded batch in greedy decoding (:func:`greedy_batches`): its tokens, key-value
    cache, steering state and the rows still decoding."""

    def __init__(self, model: Model, idx: list[int], token_lists: Sequence[Sequence[int]], steering: Steering):
        from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache

        self.idx, self.cached = idx, not is_bridge(model)
        self.lengths = [len(token_lists[i]) for i in idx]
        self.tokens, self.mask, _ = pad_tokens(model, [token_lists[i] for i in idx], "left")
        n, self.width = len(idx), self.tokens.shape[1]
        self.kv = TransformerLensKeyValueCache.init_cache(model.cfg, model.cfg.device, n) if self.cached else None
        self.state = steering.begin(model, idx, cached=self.cached)
        # The bridge decodes on Hugging Face's cache where the steering takes one, else uncached.
        if not self.cached and steering.takes_hf_cache(self.state):
            self.kv = hf_cache(model)
        self.incremental = self.kv is not None  # each step feeds only the new token
        self.generated: list[list[int]] = [[] for _ in range(n)]
        self.done = [False] * n
        self.active = list(range(n))  # the batch's rows still in its tensors, in order
        self.can_drop = True
        self.first_logits: Tensor | None = None
        self.steps = 0

    def forward(self, model: Model, steering: Steering) -> Float[Tensor, "active d_model"]:
        """This step's final residuals. A prefill whose rows fall into groups of widths runs each
        group at its own width (:func:`cpsuper.kv_cache.prefill_groups`); only without per-batch
        steering state (hooks that act alike on every row)."""
        groups = prefill_groups(self.lengths) if self.steps == 0 and self.incremental and self.state is None else None
        if groups is None:
            resid = steering.decoding_residual(model, self.tokens, self.mask, self.state, self.kv)
            if not self.cached and self.incremental and self.kv.get_seq_length() != self.mask.shape[1]:
                self._uncached()
            return resid
        from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache

        resid, caches = None, []
        for rows in groups:
            width, rows_t = max(self.lengths[r] for r in rows), torch.as_tensor(rows, device=self.tokens.device)
            if self.cached:
                caches.append(TransformerLensKeyValueCache.init_cache(model.cfg, model.cfg.device, len(rows)))
            else:
                caches.append(hf_cache(model))
            tokens, mask = self.tokens[rows_t, -width:], self.mask[rows_t, -width:]
            part = steering.decoding_residual(model, tokens, mask, None, caches[-1])
            resid = part.new_empty((len(self.idx), part.shape[-1])) if resid is None else resid
            resid[rows_t] = part
        if self.cached:
            stack_group_caches(self.kv, groups, caches, self.mask)
        else:
            self.kv = stack_hf_group_caches(groups, caches, self.width)
            if self.kv is None:
                self._uncached()
        return resid

    def _uncached(self) -> None:
        warn_uncached_bridge()  # the bridge left Hugging Face's cache empty (transformers >= 5.24)
        self.kv, self.incremental = None, False

    @property
    def held_tokens(self) -> int:  # positions its key-value cache holds, or will once the prompts ran
        return len(self.active) * (self.width + self.steps)

    def advance(self, logits: Tensor, steering: Steering, pick, finished, max_new_tokens: int) -> bool:
        """Take one step's logits of the active rows; True once the batch has finished."""
        self.first_logits = logits.clone() if self.first_logits is None else self.first_logits  # no view
        next_tok = (logits.argmax(-1) if pick is None else pick(logits))[:, None]
        for row, token in zip(self.active, next_tok[:, 0].tolist()):
            if not self.done[row]:
                self.generated[row].append(token)
                self.done[row] = finished is not None and finished(self.idx[row], self.generated[row])
        self.steps += 1
        if all(self.done) or self.steps == max_new_tokens:
            return True
        self.tokens = next_tok if self.incremental else torch.cat([self.tokens, next_tok], 1)
        # A TransformerLens cache keeps the past attention mask itself; Hugging Face's takes it whole.
        self.mask = (
            torch.ones_like(self.tokens) if self.cached else torch.cat([self.mask, torch.ones_like(next_tok)], 1)
        )
        if self.can_drop and any(self.done[row] for row in self.active):
            keep = torch.tensor([p for p, row in enumerate(self.active) if not self.done[row]], dtype=torch.long)
            kept_state = steering.keep_rows(self.state, keep, len(self.active))
            if kept_state is NotImplemented:  # a steering whose state cannot follow: keep every row
                self.can_drop = False
                return False
            self.state, on_device = kept_state, keep.to(self.tokens.device)
            self.tokens, self.mask = self.tokens[on_device], self.mask[on_device]
            if self.cached:
                keep_rows(self.kv, keep, len(self.active))
            elif self.kv is not None:
                keep_hf_rows(self.kv, keep, len(self.active))
            self.active = [row for row in self.active if not self.done[row]]
        return False


def greedy_batches(
    model: Model,
    token_lists: Sequence[Sequence[int]],
    batches: Sequence[list[int]],
    *,
    max_new_tokens: int,
    steering: Steering | None = None,
    pick: Callable[[Float[Tensor, "batch d_vocab"]], Int[Tensor, " batch"]] | None = None,
    finished: Callable[[int, list[int]], bool] | None = None,
    readout_rows: int = READOUT_ROWS,
) -> Iterator[tuple[list[int], Float[Tensor, "batch d_vocab"], list[list[int]]]]:
    """Greedy decoding of ``token_lists`` in ``batches`` (lists of indices into it), several at a
    time; yields ``(batch, its prompts' last-position logits, each row's new ids)`` as each finishes.

    Each batch runs its own forward passes (left-padded, with its own key-value cache; the
    TransformerBridge, which takes Hugging Face caches, reruns the prefix every step) and its own
    ``steering.begin`` state. The batches in flight share the read-out: a product with the 262k x
    d_model unembedding streams the whole matrix, so it costs nearly as much for a few rows as for
    a hundred (docs/results/performance.md), and a batch decoded alone ends on read-outs of a few rows.
    Batches join while the rows in flight stay within ``readout_rows`` and their padded prompt
    tokens within :data:`FLIGHT_TOKENS`.

    ``pick`` maps one batch's step logits to its next token per row (default: argmax; CAD pairs
    rows). ``finished(k, ids)``: prompt ``k`` already holds all its caller will read; its row stops
    there and leaves the batch (the steering's state follows through :meth:`Steering.keep_rows`;
    ``pick`` sees the rows still decoding, in batch order, so paired rows must finish together).
    Where a row stops depends only on its own ids, not on which rows share its batch.
    """
    steering = steering or _NO_STEERING
    readout_rows = check_batch_size(readout_rows, "readout_rows")
    max_new_tokens = check_batch_size(max_new_tokens, "max_new_tokens")
    waiting, live = list(batches)[::-1], []

    def fits(batch: list[int]) -> bool:  # another batch in flight stays within both bounds
        rows = sum(len(b.active) for b in live) + len(batch)
        width = max(len(token_lists[k]) for k in batch)
        return rows <= readout_rows and sum(b.held_tokens for b in live) + len(batch) * width <= FLIGHT_TOKENS

    while waiting or live:
        with torch.inference_mode():
            while waiting and (not live or fits(waiting[-1])):
                live.append(_Decoding(model, waiting.pop(), token_lists, steering))
            resid = torch.cat([b.forward(model, steering) for b in live])
            logits = torch.cat([unembed_final(model, part) for part in resid.split(readout_rows)])
            parts = logits.split([len(b.active) for b in live])
            ended = [b for b, part in zip(live, parts) if b.advance(part, steering, pick, finished, max_new_tokens)]
            del resid, logits, parts
        for b in ended:  # yielded outside inference mode (see iter_final_logits)
            live.remove(b)
            yield b.idx, b.first_logits, b.generated


def greedy_batch(
    model: Model,
    token_lists: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    steering: Steering | None = None,
    pick: Callable[[Float[Tensor, "batch d_vocab"]], Int[Tensor, " batch"]] | None = None,
    finished: Callable[[int, list[int]], bool] | None = None,
) -> tuple[Float[Tensor, "batch d_vocab"], list[list[int]]]:
    """Greedy decoding of one batch (:func:`greedy_batches` with a single batch): the prompts'
    last-position logits and each row's new token ids; ``finished(i, ids)`` takes row indices."""
    one = [list(range(len(token_lists)))]
    options = {"steering": steering, "pick": pick, "finished": finished}
    ((_, first_logits, generated),) = greedy_batches(model, token_lists, one, max_new_tokens=max_new_tokens, **options)
    return first_logits, generated


def iter_greedy(
    model: Model,
    token_lists: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 8,
    batch_size: int = 32,
    progress: bool = True,
    steering: Steering | None = None,
    desc: str = "greedy",
    finished: Callable[[int, list[int]], bool] | None = None,
) -> Iterator[tuple[list[int], Float[Tensor, "batch d_vocab"], list[list[int]]]]:
    """Yield ``(indices, last-position logits of the prompts, greedy token ids per row)`` batch by
    batch (:func:`greedy_batches` on batches of similar length, in the order they finish). The
    first step's logits are the prompts' own last-position logits, so scoring can reuse them.
    ``finished(k, ids)``, with ``k`` an index into ``token_lists``, ends a prompt's decoding early."""
    batches = length_batches([len(t) for t in token_lists], batch_size)
    with tqdm(total=len(batches), desc=desc, disable=not progress, leave=False) as bar:
        for done in greedy_batches(
            model, token_lists, batches, max_new_tokens=max_new_tokens, steering=steering, finished=finished
        ):
            bar.update(1)
            yield done
