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
from .runtime import check_batch_size, length_batches, pad_tokens, padded_batches

__all__ = [
    "Steering",
    "float32_unembedding",
    "greedy_batch",
    "iter_final_logits",
    "iter_greedy",
    "unembed_final",
]


_FLOAT32_READOUT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Per low-precision model: a float32 copy of its unembedding, keyed by the weights' identity."""


def float32_unembedding(model: Model) -> tuple[Float[Tensor, "d_model d_vocab"], Tensor | None]:
    """``W_U`` and ``b_U`` in float32. For a bf16 / fp16 model the copy is made once and kept
    until the weights change (another tensor or an in-place edit), so the logits of a
    low-precision model are not rounded to 8 or 11 bits before the softmax."""
    w_u, b_u = model.W_U, model.b_U
    if w_u.dtype == torch.float32:
        return w_u, b_u
    key = (w_u.data_ptr(), w_u._version, None if b_u is None else (b_u.data_ptr(), b_u._version))
    kept = _FLOAT32_READOUT.get(model)
    if kept is None or kept[0] != key:
        kept = (key, w_u.float(), None if b_u is None else b_u.float())
        _FLOAT32_READOUT[model] = kept
    return kept[1], kept[2]


def unembed_final(model: Model, resid: Float[Tensor, "batch d_model"]) -> Float[Tensor, "batch d_vocab"]:
    """Final norm, unembedding and soft-capping of one residual vector per row, in float32.

    Multiplies by ``W_U`` directly: TransformerLens's ``Unembed`` copies the transposed
    262k x d_model matrix on every call, which costs more than the product itself. A bf16 /
    fp16 model is read out through a float32 copy of its unembedding
    (:func:`float32_unembedding`), as under ``cp.mixed_precision``.
    """
    # Under cp.mixed_precision (torch.autocast) the readout leaves autocast: the final norm and
    # the unembedding run in float32 and so do the logits.
    with torch.autocast(resid.device.type, enabled=False):
        resid = resid.float()
        if model.cfg.normalization_type is not None:
            resid = model.ln_final(resid[:, None, :])[:, 0, :]
        w_u, b_u = float32_unembedding(model)
        logits = resid.float() @ w_u
        if b_u is not None:
            logits = logits + b_u
    return apply_softcap(logits, model.cfg.output_logits_soft_cap)


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
    ) -> Float[Tensor, "batch pos d_model"]:
        """The steered residual stream after the last block of one right-padded batch (no key-value
        cache): :meth:`hooks` around a full forward. A steering that can skip work overrides it
        (JuICE's second pass resumes at its first steered layer)."""
        with self.hooks(model, tokens, attention_mask, state):
            return final_residual(model, tokens, attention_mask=attention_mask, padding_side="right")


_NO_STEERING = Steering()


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
            resid = steering.final_residual(model, tokens, mask if padded else None, state)
            rows = torch.arange(len(idx), device=resid.device)
            logits = unembed_final(model, resid[rows, last])
        # Yield outside inference mode: the caller's code runs while the generator is suspended, and
        # grad mode is thread-wide, so a yield inside the block would leave autograd off for the caller
        # (for good, if the caller abandons the generator).
        yield idx, logits


def greedy_batch(
    model: Model,
    token_lists: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    steering: Steering | None = None,
    rows: Sequence[int] | None = None,
    pick: Callable[[Float[Tensor, "batch d_vocab"]], Int[Tensor, " batch"]] | None = None,
) -> tuple[Float[Tensor, "batch d_vocab"], Int[Tensor, "batch new"]]:
    """Greedy decoding of one batch: the prompts' last-position logits and the new token ids.

    Left-padded, with a key-value cache (on the TransformerBridge, which takes Hugging Face
    caches, each step reruns the prefix); only the last position is unembedded. ``pick`` maps a
    step's logits to the next token of every row (default: argmax); context-aware decoding
    passes one that combines paired rows. ``rows`` go to ``steering.begin``.
    """
    from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache

    steering = steering or _NO_STEERING
    cached = not is_bridge(model)
    tokens, mask, _ = pad_tokens(model, token_lists, "left")
    generated, first_logits = [], None
    with torch.inference_mode():
        kv = {"past_kv_cache": TransformerLensKeyValueCache.init_cache(model.cfg, model.cfg.device, len(token_lists))}
        state = steering.begin(model, list(range(len(token_lists))) if rows is None else rows, cached=cached)
        for _ in range(max_new_tokens):
            with steering.hooks(model, tokens, mask, state):
                resid = final_residual(model, tokens, attention_mask=mask, **(kv if cached else {}))
            logits = unembed_final(model, resid[:, -1])
            first_logits = logits if first_logits is None else first_logits
            next_tok = (logits.argmax(-1) if pick is None else pick(logits))[:, None]
            generated.append(next_tok)
            tokens = next_tok if cached else torch.cat([tokens, next_tok], 1)
            mask = torch.ones_like(tokens) if cached else torch.cat([mask, torch.ones_like(next_tok)], 1)
    return first_logits, torch.cat(generated, dim=1).cpu()


def iter_greedy(
    model: Model,
    token_lists: Sequence[Sequence[int]],
    max_new_tokens: int = 8,
    batch_size: int = 32,
    progress: bool = True,
    *,
    steering: Steering | None = None,
    desc: str = "greedy",
) -> Iterator[tuple[list[int], Float[Tensor, "batch d_vocab"], Int[Tensor, "batch new"]]]:
    """Yield ``(indices, last-position logits of the prompts, greedy token ids)`` batch by batch
    (:func:`greedy_batch` on batches of similar length). The first step's logits are the
    prompts' own last-position logits, so scoring can reuse them."""
    max_new_tokens = check_batch_size(max_new_tokens, "max_new_tokens")
    for idx in tqdm(
        length_batches([len(t) for t in token_lists], batch_size), desc=desc, disable=not progress, leave=False
    ):
        first, generated = greedy_batch(
            model, [token_lists[i] for i in idx], max_new_tokens, steering=steering, rows=idx
        )
        yield idx, first, generated
