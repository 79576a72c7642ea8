"""The dual run: JuICE's two passes, each skipping work the other has already done.

Pass 1 runs the model unsteered and records the steered heads' outputs (``hook_z``); pass 2 adds
each recorded output, times its head's strength, to the same head's output. The layers before the
first steered head are the same computation in both passes, so pass 2 starts there from pass 1's
residual stream, and pass 1 stops after the last steered layer. While decoding, each pass keeps
its own key-value cache (pass 1 for the layers up to the last steered one, pass 2 from the first
steered one on), so pass 1 is at every step exactly the unsteered model on the text so far.
:class:`DualRunSteering` holds these mechanics for a steering that knows its heads' strengths;
:class:`cpsuper.JuICE` is one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from jaxtyping import Int
from torch import Tensor

from .backend import Model, final_residual, saving_hooks
from .decoding import Steering, hooked_step, last_positions
from .interrupts import hooked
from .interventions import AddHeadOutput, AddTwinHeadOutput, ScaleHead, intervene
from .kv_cache import is_kv_cache

__all__ = ["DualRunSteering", "StrengthPerRow", "unsteered_pass"]


class DualRunSteering(Steering):
    """Hooks and resumed passes of a dual run (``dual_run=True``) or of its one-pass ablation, which
    scales each head by ``1 + strength`` (JuNe). Subclasses set ``model`` and ``dual_run`` and give
    :meth:`coefficients`."""

    model: Model
    dual_run: bool

    def coefficients(self) -> dict:
        """``{(layer, head): strength}`` of every steered head (a float, or a tensor ``[batch]``)."""
        raise NotImplementedError

    def _added_outputs(self, coef: dict, recorded: dict) -> list[AddHeadOutput]:
        """The second pass's specs: each head's recorded output (``hook_z``) times its strength."""
        return [AddHeadOutput(l, h, c, recorded[f"blocks.{l}.attn.hook_z"][:, :, h]) for (l, h), c in coef.items()]

    def interventions(self, tokens, attention_mask=None, past_kv_cache=None, coefficients=None) -> list:
        """Specs for the steered pass (``coefficients`` as :meth:`coefficients` returns them; the
        fitted ones by default); for a dual run, the unsteered pass happens here."""
        coef = self.coefficients() if coefficients is None else coefficients
        if not coef:
            return []
        if not self.dual_run:
            return [ScaleHead(l, h, 1.0 + c) for (l, h), c in coef.items()]
        names = {f"blocks.{l}.attn.hook_z" for l, _ in coef}
        recorded = unsteered_pass(self.model, tokens, attention_mask, max(l for l, _ in coef) + 1, names, past_kv_cache)
        return self._added_outputs(coef, recorded)

    def begin(self, model: Model, rows: Sequence[int], cached: bool):
        """A dual run's unsteered pass keeps its own key-value cache: the unsteered model on the text so far."""
        return self.unsteered_cache(model, len(rows), cached, self.coefficients())

    def unsteered_cache(self, model: Model, n_rows: int, cached: bool, coef: dict):
        """The key-value cache of a dual run's unsteered pass (None when nothing needs one)."""
        if cached and self.dual_run and coef:
            from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache

            return TransformerLensKeyValueCache.init_cache(model.cfg, model.cfg.device, n_rows)
        return None

    def hooks(self, model: Model, tokens, attention_mask, state):
        """The steering hooks for one forward pass (runs the unsteered pass first if dual)."""
        return intervene(model, self.interventions(tokens, attention_mask, state))

    def takes_hf_cache(self, state) -> bool:
        """On a bridge a dual run decodes on Hugging Face's cache as a twin batch (:meth:`twin_step`)."""
        return state is None

    def decoding_residual(self, model: Model, tokens, attention_mask, state, past_kv_cache=None):
        """One decoding step of a dual run (``state``: the unsteered pass's TransformerLens
        key-value cache; or, on a bridge, ``past_kv_cache`` is Hugging Face's cache of both passes)."""
        return self.cached_step(model, tokens, attention_mask, self.coefficients(), state, past_kv_cache)

    def cached_step(self, model: Model, tokens, attention_mask, coef: dict, unsteered_kv, past_kv_cache):
        """A decoding step with strengths ``coef``: resumed passes on TransformerLens caches, a
        twin batch on a Hugging Face cache, hooks around one forward otherwise."""
        if unsteered_kv is not None and past_kv_cache is not None:
            return self.resumed_step(model, tokens, attention_mask, coef, unsteered_kv, past_kv_cache)
        if past_kv_cache is not None and not is_kv_cache(past_kv_cache) and self.dual_run and coef:
            return self.twin_step(model, tokens, attention_mask, coef, past_kv_cache)
        hooks = intervene(model, self.interventions(tokens, attention_mask, unsteered_kv, coefficients=coef))
        return hooked_step(model, tokens, attention_mask, past_kv_cache, hooks)

    def twin_step(self, model: Model, tokens, attention_mask, coef: dict, past_kv_cache):
        """A decoding step of the dual run on one Hugging Face key-value cache (a TransformerBridge's):
        both passes in one forward over the batch stacked twice, unsteered rows first
        (:class:`cpsuper.interventions.AddTwinHeadOutput`); the cache holds both copies."""
        twins = torch.cat([tokens, tokens])
        mask = None if attention_mask is None else torch.cat([attention_mask, attention_mask])
        with intervene(model, [AddTwinHeadOutput(l, h, c) for (l, h), c in coef.items()]):
            resid = final_residual(
                model, twins, attention_mask=mask, positions=last_positions(twins), past_kv_cache=past_kv_cache
            )
        return resid[tokens.shape[0] :]

    def resumed_step(self, model: Model, tokens, attention_mask, coef: dict, unsteered_kv, past_kv_cache):
        """A cached decoding step of the dual run, read at the last position (left padding):
        pass 1 with its own cache ``unsteered_kv``, pass 2 with ``past_kv_cache``, filled from the
        first steered layer on."""
        return self._passes(model, tokens, attention_mask, coef, last_positions(tokens), unsteered_kv, past_kv_cache)

    def final_residual(self, model: Model, tokens, attention_mask, state, positions=None):
        """A dual run of one right-padded batch without a key-value cache."""
        coef = self.coefficients()
        if state is not None or not self.dual_run or not coef:
            return super().final_residual(model, tokens, attention_mask, state, positions)
        return self._passes(model, tokens, attention_mask, coef, positions)

    def _passes(
        self, model: Model, tokens, attention_mask, coef: dict, positions, unsteered_kv=None, past_kv_cache=None
    ):
        """Pass 1 up to the last steered layer, recording the steered heads and the residual stream
        entering the first one; pass 2 from there with the recorded outputs added."""
        first, last = min(l for l, _ in coef), max(l for l, _ in coef)
        resume = f"blocks.{first}.hook_resid_pre"
        names = {resume} | {f"blocks.{l}.attn.hook_z" for l, _ in coef}
        recorded = unsteered_pass(model, tokens, attention_mask, last + 1, names, unsteered_kv)
        # Without a cache the batch is right padded, and causal attention keeps the padding out of
        # the real positions; while decoding, pass 2 takes the mask of the text so far as pass 1
        # extended it.
        resumed = {} if unsteered_kv is None else {"attention_mask": unsteered_kv.previous_attention_mask}
        if past_kv_cache is not None:
            resumed["past_kv_cache"] = past_kv_cache
        with intervene(model, self._added_outputs(coef, recorded)):
            return final_residual(model, recorded[resume], start_at_layer=first, positions=positions, **resumed)


@dataclass
class StrengthPerRow(Steering):
    """``steer``'s heads with their own (beta_plus, beta_minus) for every input row: a whole grid
    of strengths decodes in the same batches (strength tuning), and a context gate leaves some
    rows unsteered (:mod:`cpsuper.context_gate`). The rows' unsteered passes are included."""

    steer: DualRunSteering  # a JuICE
    beta_plus: Tensor  # [n_rows]
    beta_minus: Tensor
    k: Tensor | None = None  # [n_rows]: each row steers the first k heads of each set (None: all)

    def begin(self, model: Model, rows: Sequence[int], cached: bool):
        index = torch.as_tensor(list(rows), dtype=torch.long)
        k = None if self.k is None else self.k[index]
        coef = self.steer.coefficients(self.beta_plus[index], self.beta_minus[index], k)
        return coef, self.steer.unsteered_cache(model, len(index), cached, coef)

    def hooks(self, model: Model, tokens, attention_mask, state):
        coef, kv = state
        return intervene(model, self.steer.interventions(tokens, attention_mask, kv, coefficients=coef))

    def takes_hf_cache(self, state) -> bool:
        return state[1] is None

    def decoding_residual(self, model: Model, tokens, attention_mask, state, past_kv_cache=None):
        coef, kv = state
        return self.steer.cached_step(model, tokens, attention_mask, coef, kv, past_kv_cache)


def unsteered_pass(
    model: Model,
    tokens: Int[Tensor, "batch pos"],
    attention_mask: Int[Tensor, "batch pos"] | None,
    stop: int,
    names: set[str],
    past_kv_cache=None,
    share: bool = True,
) -> dict[str, Tensor]:
    """A dual run's pass 1: the unsteered model up to block ``stop``, recording the activations
    ``names`` (and filling ``past_kv_cache``'s first ``stop`` layers, when given).

    Rows that repeat another row's tokens and mask run once when nothing is cached yet (a prompt's
    prefill, or a run without a cache): the pass is unsteered, so they share its result. Strength
    tuning decodes every prompt once per strength pair, so its prefills' pass 1 runs once per
    prompt instead of once per pair. Past the prefill, rows that share a prompt can hold different
    text, so every row runs. ``share=False`` runs every row always (the benchmark's baseline)."""
    fresh = past_kv_cache is None or past_kv_cache.previous_attention_mask.shape[1] == 0
    inverse = None
    if share and fresh:
        key = tokens if attention_mask is None else torch.cat([tokens, attention_mask.to(tokens)], 1)
        unique, inverse = torch.unique(key, dim=0, return_inverse=True)
        inverse = inverse if unique.shape[0] < key.shape[0] else None  # no repeated row: nothing to share
    run_tokens, run_mask, run_cache = tokens, attention_mask, past_kv_cache
    if inverse is not None:  # one row per distinct prompt: the first of its copies
        rows = torch.arange(len(inverse), device=inverse.device)
        first = torch.full((unique.shape[0],), len(inverse), device=inverse.device)
        first.scatter_reduce_(0, inverse, rows, "amin")
        run_tokens, run_mask = tokens[first], None if attention_mask is None else attention_mask[first]
        if past_kv_cache is not None:
            from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache

            run_cache = TransformerLensKeyValueCache.init_cache(model.cfg, model.cfg.device, len(first))
    recorded: dict[str, Tensor] = {}
    cached = {} if run_cache is None else {"past_kv_cache": run_cache}
    with hooked(model, saving_hooks(names, recorded)):
        model(run_tokens, stop_at_layer=stop, attention_mask=run_mask, **cached)
    if inverse is None:
        return recorded
    if past_kv_cache is not None:  # every row's cache is its prompt's
        for entry, filled in zip(past_kv_cache.entries, run_cache.entries):
            entry.past_keys, entry.past_values = filled.past_keys[inverse], filled.past_values[inverse]
        past_kv_cache.previous_attention_mask = run_cache.previous_attention_mask[inverse]
    return {name: act[inverse] for name, act in recorded.items()}
