"""Path patching from each attention head to the final logits (Jin et al.'s head localisation).

For a conflict example the *base* run is its conflict prompt (substitution, coherent, ...) and
the *source* (the corrupted input) is the same example's clean prompt, the question without the
conflicting context. Only the head's direct path to the logits carries the source output: every
later layer still sees the head's base output, and only the final position is patched, so the
two prompts may differ in length:

    resid'  = resid_final(base) + post_norm((z_source - z_base) @ W_O[l, h])
    effect  = metric(unembed(final_norm(resid'))) - metric(base)

``post_norm`` is the block's norm after attention (Gemma's ``ln1_post``) with its scale frozen at
the base run's value, so it is a linear map; models without one add the difference directly.
The final norm is recomputed on the new residual (:func:`cpsuper.decoding.unembed_final`).

With the default metric, the logit of the parametric answer minus that of the context answer
(first tokens), a positive effect means the head's base output pushed toward the context
answer more than its context-free output does (a *context head*), and a negative effect means
it pushed toward the parametric answer (a *memory head*).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from .backend import Model, norm_affine, require_resident_weights
from .data.examples import ConflictDataset
from .decoding import unembed_final
from .interrupts import run_with_cache
from .runtime import (
    answer_token,
    check_batch_size,
    check_targets,
    length_batches,
    pad_tokens,
    resolve_conflict_types,
    tokenize_prompts,
)

__all__ = ["METRICS", "final_position_cache", "patching_roles", "path_patching"]

METRICS = ("logit_diff", "logprob")


def _post_norm_names(model: Model) -> list[str | None]:
    names = []
    for layer, block in enumerate(model.blocks):
        norm = getattr(block, "ln1_post", None)
        names.append(f"blocks.{layer}.ln1_post.hook_scale" if hasattr(norm, "hook_scale") else None)
    return names


@torch.inference_mode()
def final_position_cache(
    model: Model,
    token_lists: Sequence[Sequence[int]],
    names: Sequence[str],
    *,
    batch_size: int = 32,
    progress: bool = False,
) -> dict[str, Tensor]:
    """The activations ``names`` at each prompt's final position, in prompt order (float32, on
    the model's device): length-grouped, right-padded batches, so batched equals one-by-one."""
    out: dict[str, Tensor] = {}
    for idx in tqdm(length_batches([len(t) for t in token_lists], batch_size), disable=not progress, leave=False):
        tokens, mask, last = pad_tokens(model, [token_lists[i] for i in idx], "right")
        padded = bool((mask == 0).any())
        _, cache = run_with_cache(
            model,
            tokens,
            names_filter=list(names),
            stop_at_layer=model.cfg.n_layers,
            attention_mask=mask if padded else None,
            padding_side="right",
        )
        rows = torch.arange(len(idx), device=tokens.device)
        for name in names:
            act = cache[name][rows, last].float()
            if name not in out:
                out[name] = torch.empty((len(token_lists), *act.shape[1:]), device=act.device)
            out[name][torch.tensor(idx, device=act.device)] = act
    return out


def _head_deltas(model, base: dict, source: dict, post_names) -> Float[Tensor, "n heads d_model"]:
    """Each head's direct-path change of the final residual, ``[n, n_layers * n_heads, d_model]``."""
    deltas = []
    for layer in range(model.cfg.n_layers):
        z_diff = source[f"blocks.{layer}.attn.hook_z"] - base[f"blocks.{layer}.attn.hook_z"]  # [n, heads, d_head]
        d = torch.einsum("nhd,hdm->nhm", z_diff, model.blocks[layer].attn.W_O.float())
        if post_names[layer] is not None:
            norm = model.blocks[layer].ln1_post
            d = d / base[post_names[layer]][:, None, :]  # frozen scale of the base run, [n, 1, 1]
            gain, _, centred = norm_affine(norm)
            if gain is not None:
                d = d * gain.float()
            if centred:
                d = d - d.mean(-1, keepdim=True)
        deltas.append(d)
    return torch.cat(deltas, dim=1)


def _metric(logits: Tensor, plus: Tensor, minus: Tensor, metric: str) -> Tensor:
    logits = logits.float()
    rows = torch.arange(logits.shape[0], device=logits.device)
    if metric == "logit_diff":
        return logits[rows, plus] - logits[rows, minus]
    return logits.log_softmax(-1)[rows, plus]


def path_patching(
    model: Model,
    dataset: ConflictDataset,
    *,
    conflict_types: str | Sequence[str] | None = None,
    metric: str = "logit_diff",
    target: str = "parametric",
    batch_size: int = 32,
    row_chunk: int = 256,
    progress: bool = True,
) -> pd.DataFrame:
    """Effect of patching each query head's direct path to the logits with its output on the
    example's clean prompt, on each conflict prompt (see the module docstring).

    ``metric``: ``"logit_diff"`` (parametric minus context answer, first-token logits; ``target``
    is ignored) or ``"logprob"`` (log-probability of ``target``'s first token). ``conflict_types``
    defaults to every conflict type of the dataset except ``"clean"`` (whose effects are 0 by
    construction). ``row_chunk`` bounds how many patched residuals are unembedded at once.

    Returns a tidy frame: ``example, relation, subject, conflict_type, layer, head, p_clean, delta``
    (``p_clean``: the metric without patching; ``delta``: its change under the patch).
    """
    require_resident_weights("cp.path_patching", model)
    if metric not in METRICS:
        raise ValueError(f"Unknown metric {metric!r}; use one of {METRICS}.")
    (target,) = check_targets(target)
    batch_size = check_batch_size(batch_size)
    row_chunk = check_batch_size(row_chunk, "row_chunk")
    resolve_conflict_types(dataset, ["clean"])
    if conflict_types is None:
        conflict_types = [c for c in dataset.conflict_types if c != "clean"]
        if not conflict_types:
            raise ValueError(f"Dataset {dataset.name!r} has only clean prompts; path patching needs conflict prompts.")
    conflict_types = resolve_conflict_types(dataset, conflict_types)
    cfg = model.cfg
    post_names = _post_norm_names(model)
    z_names = [f"blocks.{layer}.attn.hook_z" for layer in range(cfg.n_layers)]
    base_names = [*z_names, f"blocks.{cfg.n_layers - 1}.hook_resid_post", *[n for n in post_names if n]]

    items = [(i, c) for i in range(len(dataset)) for c in conflict_types]
    prompts = [dataset[i].prompts[c] for i, c in items]
    first = {"parametric": lambda e: e.answer, "context": lambda e: e.context_answer}
    plus_role = "parametric" if metric == "logit_diff" else target
    plus = torch.tensor([answer_token(model, first[plus_role](dataset[i]), p) for (i, _), p in zip(items, prompts)])
    minus = torch.tensor([answer_token(model, dataset[i].context_answer, p) for (i, _), p in zip(items, prompts)])
    base = final_position_cache(model, tokenize_prompts(model, prompts), base_names, batch_size=batch_size)
    clean = final_position_cache(
        model, tokenize_prompts(model, dataset.prompts("clean")), z_names, batch_size=batch_size
    )
    source = {name: clean[name][torch.tensor([i for i, _ in items], device=clean[name].device)] for name in z_names}

    n_heads = cfg.n_layers * cfg.n_heads
    effects = np.empty((len(items), n_heads))
    base_values = np.empty(len(items))
    resid_name = f"blocks.{cfg.n_layers - 1}.hook_resid_post"
    per_chunk = max(1, row_chunk // (n_heads + 1))
    dtype = model.W_U.dtype
    with torch.inference_mode():
        for start in tqdm(range(0, len(items), per_chunk), desc="path patching", disable=not progress, leave=False):
            sl = slice(start, min(start + per_chunk, len(items)))
            part = {k: v[sl] for k, v in base.items()}
            delta = _head_deltas(model, part, {k: v[sl] for k, v in source.items()}, post_names)
            resid = part[resid_name]
            rows = torch.cat([resid[:, None, :], resid[:, None, :] + delta], dim=1)  # [n, 1 + heads, d]
            n = rows.shape[0]
            logits = unembed_final(model, rows.reshape(n * (n_heads + 1), -1).to(dtype))
            plus_ids, minus_ids = (t[sl].to(logits.device).repeat_interleave(n_heads + 1) for t in (plus, minus))
            values = _metric(logits, plus_ids, minus_ids, metric).reshape(n, n_heads + 1).cpu().double()
            base_values[sl] = values[:, 0].numpy()
            effects[sl] = (values[:, 1:] - values[:, :1]).numpy()

    layers, heads = np.divmod(np.arange(n_heads), cfg.n_heads)
    return pd.DataFrame(
        {
            "example": np.repeat([i for i, _ in items], n_heads),
            "relation": np.repeat([dataset[i].relation for i, _ in items], n_heads),
            "subject": np.repeat([dataset[i].subject for i, _ in items], n_heads),
            "conflict_type": np.repeat([c for _, c in items], n_heads),
            "layer": np.tile(layers, len(items)),
            "head": np.tile(heads, len(items)),
            "p_clean": np.repeat(base_values, n_heads),
            "delta": effects.reshape(-1),
        }
    )


def patching_roles(patching: pd.DataFrame) -> pd.DataFrame:
    """Mean path-patching effect per head (over examples and conflict types) with its role for
    the logit-difference metric: ``"context"`` (``delta_mean`` > 0), ``"memory"`` (< 0) or
    ``"none"`` (exactly 0), sorted from the strongest context head to the strongest memory head."""
    table = patching.groupby(["layer", "head"], as_index=False)["delta"].agg(delta_mean="mean", n="count")
    table["role"] = np.select([table.delta_mean > 0, table.delta_mean < 0], ["context", "memory"], "none")
    order = ["delta_mean", "layer", "head"]
    return table.sort_values(order, ascending=[False, True, True], kind="stable").reset_index(drop=True)
