"""Head-to-head path patching: how much of a receiver head's effect comes through its query, key
or value input from one sender head (Wang et al.'s path patching, sender -> receiver input).

For one example, the *destination* run is its ``destination`` prompt and the *source* its
``source`` prompt (by default the clean question without the conflicting context). For a sender
head ``(ls, hs)`` and a receiver head ``(lr, hr)`` with ``ls < lr``:

1. The sender's output ``z`` (``blocks.{ls}.attn.hook_z[:, :, hs]``, one query head) is replaced
   by its source value at aligned positions (``align="end"``: counted from the last token;
   ``"start"``: from the first); positions without a counterpart keep their destination value.
2. Only the sender's direct path carries the change: every head and MLP between the two is frozen
   at its destination value, so the receiver layer's residual stream becomes

       resid' = resid_pre_destination[lr] + post_norm((z_source - z_destination) @ W_O[ls, hs])

   where ``post_norm`` is the sender block's norm after attention (Gemma's ``ln1_post``) with its
   scale frozen at the destination run's value (a linear map); models without one add the
   difference directly.
3. ``ln1`` of the receiver layer is recomputed on ``resid'`` and fed to the receiver head's chosen
   input only: ``hook_q`` at its query head, ``hook_k`` / ``hook_v`` at its key-value head
   (``"qkv"``: all three at once). Every other head's q / k / v keeps its destination value.
4. On grouped-query attention a key-value head is shared by several query heads; the patched key
   or value would move all of them. Only the receiver query head's output ``z`` is taken from that
   pass; the forward pass from the receiver layer on then runs with that one head's ``z``
   replaced (everything downstream of the receiver is recomputed, as in path patching's last
   pass).

``effect = metric(patched) - metric(destination)`` at the final position. The effects of q, k
and v do not add up to the ``"qkv"`` effect in general (softmax and the later layers are not
linear); they do to first order for small differences. A sender whose output is the same on both
prompts at every aligned position has effect exactly 0 (it is not run).

Cost: per example, one run of each prompt, then for each receiver layer one pass of that layer
per sender (q / k / v) and per row (z), and the layers from the receiver on per row; rows
(sender x receiver head x input) are batched by ``batch_size``.

The metric is ``"logit_diff"`` (parametric minus context answer, first-token logits) or
``"logprob"`` (log-probability of ``target``'s first token).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from .backend import Model, final_residual, norm_affine, require_resident_weights, saving_hooks
from .data.examples import ConflictDataset
from .decoding import unembed_final
from .interrupts import hooked
from .runtime import answer_token, check_batch_size, check_head, check_targets, resolve_conflict_types, tokenize_prompts
from .stats import bootstrap_summary

__all__ = ["INPUTS", "HeadPathResult", "head_path_patching", "head_path_summary"]

INPUTS = ("q", "k", "v", "qkv")
METRICS = ("logit_diff", "logprob")
ALIGNS = ("end", "start")
HEAD_COLUMNS = ["sender_layer", "sender_head", "receiver_layer", "receiver_head", "input"]


@dataclass
class HeadPathResult:
    """``per_example``: one row per example x sender x receiver x input (``effect``, and
    ``p_clean``: the metric of the destination run); ``summary``: mean effect per sender x
    receiver x input with a 95 % bootstrap interval over facts (``mean, ci_low, ci_high, n``)."""

    per_example: pd.DataFrame
    summary: pd.DataFrame


def head_path_summary(per_example: pd.DataFrame, *, n_boot: int = 2000, ci: float = 0.95, seed: int = 0):
    """Mean ``effect`` per sender x receiver x input with a bootstrap interval over facts, sorted
    by the size of the mean (largest first)."""
    out = bootstrap_summary(
        per_example, value="effect", by=HEAD_COLUMNS, unit="example", n_boot=n_boot, ci=ci, seed=seed
    )
    out = out.iloc[np.argsort(-out["mean"].abs().to_numpy(), kind="stable")].reset_index(drop=True)
    out.attrs.update(per_example.attrs)
    return out


def _heads(model: Model, heads, name: str) -> list[tuple[int, int]]:
    if isinstance(heads, tuple) and len(heads) == 2 and all(isinstance(x, int) for x in heads):
        heads = [heads]
    try:
        heads = [tuple(h) for h in heads]
    except TypeError:
        raise ValueError(f"{name}={heads!r}: pass a list of (layer, head) tuples.") from None
    if not heads or any(len(h) != 2 for h in heads):
        raise ValueError(f"{name}={heads!r}: pass a non-empty list of (layer, head) tuples.")
    out = []
    for layer, head in heads:
        try:
            out.append(check_head(model, layer, head))
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from None
    return list(dict.fromkeys(out))


def _pairs(model, receivers, senders) -> list[tuple[tuple[int, int], list[tuple[int, int]]]]:
    """Each receiver with its senders (every head of an earlier layer where ``senders`` is None)."""
    receivers = _heads(model, receivers, "receivers")
    if senders is None:
        n = model.cfg.n_heads
        pairs = [(r, [(l, h) for l in range(r[0]) for h in range(n)]) for r in receivers]
        empty = [r for r, s in pairs if not s]
        if empty:
            raise ValueError(f"receivers={empty}: a receiver in layer 0 has no earlier sender; pick a later head.")
        return pairs
    senders = _heads(model, senders, "senders")
    for r in receivers:
        late = [s for s in senders if s[0] >= r[0]]
        if late:
            raise ValueError(
                f"senders={late} are not in a layer before receiver {r}: a sender reaches a receiver only "
                "from an earlier layer; drop them, or pass senders=None for every earlier head per receiver."
            )
    return [(r, senders) for r in receivers]


def _sender_delta(model, layer, head, z_src, z_dst, scale, dst_pos, src_pos) -> Float[Tensor, "pos d_model"]:
    """The sender's change of the residual stream through its W_O and frozen post-norm."""
    dz = torch.zeros_like(z_dst[:, head])
    dz[dst_pos] = z_src[src_pos, head] - z_dst[dst_pos, head]
    delta = dz.float() @ model.blocks[layer].attn.W_O[head].float()
    if scale is not None:
        gain, _, centred = norm_affine(model.blocks[layer].ln1_post)
        delta = delta / scale.float()
        if gain is not None:
            delta = delta * gain.float()
        if centred:
            delta = delta - delta.mean(-1, keepdim=True)
    return delta


def _metric(logits: Tensor, plus: int, minus: int, metric: str) -> Tensor:
    logits = logits.float()
    if metric == "logit_diff":
        return logits[:, plus] - logits[:, minus]
    return logits.log_softmax(-1)[:, plus]


def _replace_slots(store: dict, name: str, rows: Tensor, sources: Tensor, slots: Tensor):
    """A hook setting ``act[rows[i], :, slots[i]] = store[name][sources[i], :, slots[i]]``."""

    def hook(act, hook):
        if len(rows):
            act = act.clone()
            act[rows, :, slots] = store[name][sources, :, slots].to(act.dtype)
        return act

    return hook


@torch.inference_mode()
def _example_effects(model, tokens, src_tokens, plus, minus, pairs, inputs, metric, align, batch_size):
    """Effects of one example, ``{(sender, receiver, input): effect}``, and the destination metric."""
    cfg = model.cfg
    group = cfg.n_heads // (getattr(cfg, "n_key_value_heads", None) or cfg.n_heads)
    sender_layers = sorted({s[0] for _, ss in pairs for s in ss})
    receiver_layers = sorted({r[0] for r, _ in pairs})
    has_post = [hasattr(getattr(model.blocks[l], "ln1_post", None), "hook_scale") for l in range(cfg.n_layers)]
    z_names = [f"blocks.{l}.attn.hook_z" for l in sender_layers]
    dst_names = z_names + [f"blocks.{l}.ln1_post.hook_scale" for l in sender_layers if has_post[l]]
    dst_names += [f"blocks.{l}.hook_resid_pre" for l in receiver_layers]
    dst, src = {}, {}
    device = cfg.device
    toks = torch.tensor([tokens], device=device)
    last = torch.tensor([len(tokens) - 1], device=device)
    with hooked(model, saving_hooks(dst_names, dst, lambda a: a[0])):
        base = _metric(unembed_final(model, final_residual(model, toks, positions=last)), plus, minus, metric).item()
    with hooked(model, saving_hooks(z_names, src, lambda a: a[0])):
        final_residual(
            model,
            torch.tensor([src_tokens], device=device),
            positions=torch.tensor([len(src_tokens) - 1], device=device),
        )
    n = min(len(tokens), len(src_tokens))
    dst_pos = torch.arange(len(tokens) - n, len(tokens)) if align == "end" else torch.arange(n)
    src_pos = torch.arange(len(src_tokens) - n, len(src_tokens)) if align == "end" else torch.arange(n)

    effects: dict = {}
    for lr in receiver_layers:
        here = [(r, ss) for r, ss in pairs if r[0] == lr]
        senders = list(dict.fromkeys(s for _, ss in here for s in ss))
        resid = dst[f"blocks.{lr}.hook_resid_pre"]
        deltas = {}
        for ls, hs in senders:
            scale = dst.get(f"blocks.{ls}.ln1_post.hook_scale")
            d = _sender_delta(
                model, ls, hs, src[f"blocks.{ls}.attn.hook_z"], dst[f"blocks.{ls}.attn.hook_z"], scale, dst_pos, src_pos
            )
            if bool(d.any()):
                deltas[(ls, hs)] = d
            else:  # an unchanged sender output changes nothing
                effects.update({((ls, hs), r, i): 0.0 for r, ss in here if (ls, hs) in ss for i in inputs})
        live = list(deltas)
        # Pass 1: the receiver layer's q / k / v on the residual stream with each sender's change added.
        qkv_names = [f"blocks.{lr}.attn.hook_{x}" for x in "qkv"]
        new: dict[str, list[Tensor]] = {name: [] for name in qkv_names}
        for start in range(0, len(live), batch_size):
            part = torch.stack([resid + deltas[s].to(resid.dtype) for s in live[start : start + batch_size]])
            store: dict = {}
            with hooked(model, saving_hooks(qkv_names, store)):
                model(part, start_at_layer=lr, stop_at_layer=lr + 1)
            for name in qkv_names:
                new[name].append(store[name])
        if not live:
            continue
        new = {name: torch.cat(parts) for name, parts in new.items()}
        # Pass 2: each receiver head's z with only its chosen input patched; pass 3: the rest of
        # the model with only that head's z replaced.
        index = {s: i for i, s in enumerate(live)}
        rows = [(s, r, i) for r, ss in here for i in inputs for s in ss if s in index]
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]
            batch = resid[None].repeat(len(chunk), 1, 1)
            sources = torch.tensor([index[s] for s, _, _ in chunk], device=device)
            hooks = []
            for x, name in zip("qkv", qkv_names):
                take = torch.tensor([j for j, (_, _, i) in enumerate(chunk) if x in i], device=device, dtype=torch.long)
                slots = torch.tensor([r[1] if x == "q" else r[1] // group for _, r, _ in chunk], device=device)
                hooks.append((name, _replace_slots(new, name, take, sources[take], slots[take])))
            z_store: dict = {}
            z_name = f"blocks.{lr}.attn.hook_z"
            with hooked(model, hooks + saving_hooks([z_name], z_store)):
                model(batch, start_at_layer=lr, stop_at_layer=lr + 1)
            all_rows = torch.arange(len(chunk), device=device)
            heads = torch.tensor([r[1] for _, r, _ in chunk], device=device)
            with hooked(model, [(z_name, _replace_slots(z_store, z_name, all_rows, all_rows, heads))]):
                final = final_residual(
                    model, batch, positions=torch.full((len(chunk),), len(tokens) - 1, device=device), start_at_layer=lr
                )
            values = _metric(unembed_final(model, final), plus, minus, metric).double().cpu() - base
            effects.update({key: float(v) for key, v in zip(chunk, values)})
    return effects, base


def head_path_patching(
    model: Model,
    dataset: ConflictDataset,
    receivers: Sequence[tuple[int, int]],
    *,
    senders: Sequence[tuple[int, int]] | None = None,
    inputs: str | Sequence[str] = ("q", "k", "v"),
    source: str = "clean",
    destination: str = "substitution",
    metric: str = "logit_diff",
    target: str = "parametric",
    align: str = "end",
    batch_size: int = 64,
    n_boot: int = 2000,
    progress: bool = True,
) -> HeadPathResult:
    """Effect of each sender head's path into each receiver head's q, k or v input (see the
    module docstring for the exact semantics).

    ``receivers``: ``(layer, head)`` query heads. ``senders``: heads in layers before every
    receiver; None (default) takes every head of every earlier layer, per receiver. ``inputs``:
    any of ``"q"``, ``"k"``, ``"v"`` and ``"qkv"`` (all three at once). ``source`` /
    ``destination``: conflict types of ``dataset``. ``batch_size``: patched rows per forward pass.
    Returns a :class:`HeadPathResult` (``per_example`` columns: ``example, subject, relation,
    sender_layer, sender_head, receiver_layer, receiver_head, input, p_clean, effect``).
    """
    require_resident_weights("cp.head_path_patching", model)
    pairs = _pairs(model, receivers, senders)
    inputs = [inputs] if isinstance(inputs, str) else list(inputs)
    unknown = [i for i in inputs if i not in INPUTS]
    if unknown or not inputs:
        raise ValueError(f"inputs={inputs!r}: use a non-empty subset of {INPUTS}.")
    inputs = list(dict.fromkeys(inputs))
    if metric not in METRICS:
        raise ValueError(f"metric={metric!r}: use one of {METRICS}.")
    if align not in ALIGNS:
        raise ValueError(f"align={align!r}: use one of {ALIGNS} (source and destination positions counted from there).")
    (target,) = check_targets(target)
    batch_size = check_batch_size(batch_size)
    source, destination = resolve_conflict_types(dataset, [source, destination])
    for name in ("hook_z", "hook_q", "hook_k", "hook_v"):
        if f"blocks.0.attn.{name}" not in model.hook_dict:
            raise ValueError(f"The model has no hook blocks.0.attn.{name}, which head path patching needs.")

    records = []
    for e in tqdm(range(len(dataset)), desc="head paths", disable=not progress, leave=False):
        example = dataset[e]
        prompt = example.prompts[destination]
        tokens, src_tokens = tokenize_prompts(model, [prompt, example.prompts[source]])
        plus = answer_token(
            model,
            example.answer if metric == "logit_diff" or target == "parametric" else example.context_answer,
            prompt,
        )
        minus = answer_token(model, example.context_answer, prompt)
        effects, base = _example_effects(
            model, tokens, src_tokens, plus, minus, pairs, inputs, metric, align, batch_size
        )
        for r, ss in pairs:
            for i in inputs:
                for s in ss:
                    records.append((e, example.subject, example.relation, *s, *r, i, base, effects[(s, r, i)]))
    columns = ["example", "subject", "relation", *HEAD_COLUMNS, "p_clean", "effect"]
    per = pd.DataFrame.from_records(records, columns=columns)
    per.attrs.update(metric=metric, target=target, source=source, destination=destination, align=align)
    return HeadPathResult(per, head_path_summary(per, n_boot=n_boot))
