"""Direct logit attribution (DLA) at the final position: per component, per head and per source
token, for a logit direction such as "parametric answer minus context answer".

The final norm's scale is frozen from the clean run, and so, on models with norms after the
attention and MLP blocks (Gemma-2/3), is each post-norm's scale; with the scales frozen every
norm is a linear map (plus a bias for LayerNorm), so the decomposition is exact:

    logit = embed + sum_layers (sum_heads head + attn_bias + mlp) + constant

and each head's DLA splits over source positions as ``pattern[END, src] * v[src] @ W_O[head]``
(in a grouped-query model a query head reads its key/value head's ``v``). Heads are read from
``hook_z``; ``use_attn_result`` is never needed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from .backend import Model, final_residual, norm_affine, require_resident_weights, saving_hooks
from .data.examples import ConflictDataset, ConflictExample
from .interrupts import hooked
from .runtime import (
    answer_token,
    check_batch_size,
    padded_batches,
    resolve_conflict_types,
    tokenize_prompts,
)
from .spans import SPAN_GROUPS, example_spans

__all__ = [
    "Attribution",
    "Direction",
    "direct_logit_attribution",
    "prompt_example",
]


@dataclass(frozen=True)
class Direction:
    """A logit direction: the first token of ``plus(example)`` minus the mean of the first tokens
    of ``minus(example)`` (no ``minus``: the plain logit of ``plus``)."""

    name: str
    plus: Callable[[ConflictExample], str]
    minus: Callable[[ConflictExample], Sequence[str]] | None = None

    def coefficients(self, model: Model, example: ConflictExample, prompt: str) -> dict[int, float]:
        coef: dict[int, float] = {}
        coef[answer_token(model, self.plus(example), prompt)] = 1.0
        if self.minus is not None:
            others = list(self.minus(example))
            if not others:
                raise ValueError(f"Direction {self.name!r} has an empty set to subtract for {example.subject!r}.")
            for text in others:
                tok = answer_token(model, text, prompt)
                coef[tok] = coef.get(tok, 0.0) - 1.0 / len(others)
        return coef


_NAMED = {
    "parametric": Direction("parametric", lambda e: e.answer),
    "context": Direction("context", lambda e: e.context_answer),
    "parametric-context": Direction("parametric-context", lambda e: e.answer, lambda e: [e.context_answer]),
    "context-parametric": Direction("context-parametric", lambda e: e.context_answer, lambda e: [e.answer]),
}


def _direction(spec: str | Direction) -> Direction:
    if isinstance(spec, Direction):
        return spec
    if spec not in _NAMED:
        raise ValueError(f"Unknown direction {spec!r}; use one of {sorted(_NAMED)} or a cp.attribution.Direction.")
    return _NAMED[spec]


def prompt_example(
    prompt: str, subject: str, answer: str, context_answer: str | None = None, context: str | None = None
) -> ConflictDataset:
    """A one-prompt dataset (conflict type ``"prompt"``) for attributing a single hand-written prompt."""
    meta = {"contexts": {"prompt": context}} if context else {}
    example = ConflictExample(
        relation="custom",
        subject=subject,
        answer=answer,
        context_answer=context_answer or answer,
        prompts={"prompt": prompt},
        meta=meta,
    )
    return ConflictDataset([example], name="prompt")


@dataclass
class Attribution:
    """Result of :func:`direct_logit_attribution`.

    ``components``: one row per example x conflict type x direction x component (``kind`` is
    embed / pos_embed / head / attn_bias / mlp / constant), column ``dla``.
    ``sources``: one row per example x conflict type x direction x head x source group, with the
    group's DLA (``dla``) and the attention the final token pays it (``attention``).
    ``modules``: each layer's attention output (``hook_attn_out``) and MLP output read directly
    along the direction, for checking the per-head split.
    ``totals``: the model's logit (difference) and the sum of all components, per example.
    """

    components: pd.DataFrame
    sources: pd.DataFrame
    modules: pd.DataFrame
    totals: pd.DataFrame

    def heads(self, direction: str | None = None) -> pd.DataFrame:
        """Mean head DLA over examples: one row per conflict type x layer x head."""
        c = self.components[self.components.kind == "head"]
        if direction is not None:
            c = c[c.direction == direction]
        return c.groupby(["direction", "conflict_type", "layer", "head"], as_index=False)["dla"].mean()

    def head_sources(self, direction: str | None = None) -> pd.DataFrame:
        """Mean DLA and attention per head and source group over examples."""
        s = self.sources if direction is None else self.sources[self.sources.direction == direction]
        return s.groupby(["direction", "conflict_type", "layer", "head", "group"], as_index=False)[
            ["dla", "attention"]
        ].mean()

    def by_layer(self) -> pd.DataFrame:
        """Mean DLA of each residual-stream writer in layer order (embeddings, then attention and
        MLP of every layer) and its running sum: the cumulative direct effect, drawn by
        ``cp.plots.plot_cumulative_dla`` (the logit lens proper is :func:`cpsuper.lens.logit_lens`)."""
        keys = ["direction", "conflict_type"]
        c = self.components[self.components.kind != "constant"]
        embed = c[c.kind.isin(["embed", "pos_embed"])].groupby([*keys, "example"], as_index=False)["dla"].sum()
        embed = embed.groupby(keys, as_index=False)["dla"].mean().assign(module="embed", layer=-1)
        m = self.modules.groupby([*keys, "layer", "module"], as_index=False)["dla"].mean()
        out = pd.concat([embed, m], ignore_index=True)
        out["order"] = out.layer * 2 + out.module.map({"embed": 0, "attn": 0, "mlp": 1})
        out = out.sort_values([*keys, "order"], kind="stable").drop(columns="order").reset_index(drop=True)
        out["cumulative"] = out.groupby(keys)["dla"].cumsum()
        out["label"] = [m if m == "embed" else f"{m} {layer}" for m, layer in zip(out.module, out.layer)]
        return out


def _pullback(norm, scale: Float[Tensor, "batch 1"], u: Float[Tensor, "batch d_model"]):
    """For a norm with frozen ``scale``: the vector ``v`` with ``norm(x) . u == x . v + const`` and
    that constant (the norm's bias along ``u``)."""
    if norm is None or not hasattr(norm, "hook_scale"):
        return u, torch.zeros(u.shape[0], dtype=u.dtype, device=u.device)
    w, b, centred = norm_affine(norm)
    v = (u * w if w is not None else u) / scale
    if centred:
        v = v - v.mean(-1, keepdim=True)
    const = (u * b).sum(-1) if b is not None else torch.zeros(u.shape[0], dtype=u.dtype, device=u.device)
    return v, const


def _hook_names(model: Model) -> list[str]:
    names = ["blocks.0.hook_resid_pre", f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"]
    if "hook_pos_embed" in model.hook_dict and model.cfg.positional_embedding_type == "standard":
        names.append("hook_pos_embed")
    for layer in range(model.cfg.n_layers):
        block = model.blocks[layer]
        names += [f"blocks.{layer}.attn.{h}" for h in ("hook_z", "hook_pattern", "hook_v")]
        names.append(f"blocks.{layer}.hook_attn_out")
        if not model.cfg.attn_only:
            names.append(f"blocks.{layer}.hook_mlp_out")
        if hasattr(block, "ln1_post") and hasattr(block.ln1_post, "hook_scale"):
            names.append(f"blocks.{layer}.ln1_post.hook_scale")
    missing = [n for n in names if n not in model.hook_dict]
    if missing:
        raise ValueError(f"The model has no hooks {missing}, which direct logit attribution needs.")
    return names


@torch.inference_mode()
def _attribute_batch(model, tokens, last, directions, groups, n_groups):
    """DLA of one right-padded batch for ``directions`` [batch, n_dir, d_vocab-sparse as dense
    d_model vectors] -> dict of tensors. ``groups`` [batch, pos] holds group indices (-1 = pad)."""
    cfg = model.cfg
    rows = torch.arange(tokens.shape[0], device=tokens.device)
    cache: dict[str, Tensor] = {}
    with hooked(model, saving_hooks(_hook_names(model), cache)):
        final_residual(model, tokens)
    cache = {name: t.float() for name, t in cache.items()}  # a bf16 / fp16 model is decomposed in float32
    dir_vec, dir_const = directions  # [b, n_dir, d_model], [b, n_dir]
    b, n_dir, d_model = dir_vec.shape
    flat = dir_vec.reshape(b * n_dir, d_model)

    def rep(t: Tensor) -> Tensor:
        return t.repeat_interleave(n_dir, dim=0)

    resid_final = rep(cache[f"blocks.{cfg.n_layers - 1}.hook_resid_post"][rows, last])
    norm = getattr(model, "ln_final", None) if cfg.normalization_type is not None else None
    final_scale, normed = None, resid_final
    if norm is not None and hasattr(norm, "hook_scale"):
        saved = {}
        with hooked(model, [("ln_final.hook_scale", lambda s, hook: saved.setdefault("s", s))]):
            normed = norm(resid_final[:, None, :])[:, 0, :]
        final_scale = saved["s"][:, 0]
    u, c_final = _pullback(norm if final_scale is not None else None, final_scale, flat)
    out = {"constant": c_final + dir_const.reshape(-1), "logit": (normed * flat).sum(-1) + dir_const.reshape(-1)}
    embed_total = rep(cache["blocks.0.hook_resid_pre"][rows, last])
    if "hook_pos_embed" in cache:
        pos = rep(cache["hook_pos_embed"][rows, last])
        out["pos_embed"] = (pos * u).sum(-1)
        embed_total = embed_total - pos
    out["embed"] = (embed_total * u).sum(-1)
    heads, bias, mlp, attn, src_dla, src_att = [], [], [], [], [], []
    n_heads = cfg.n_heads
    for layer in range(cfg.n_layers):
        attn_block = model.blocks[layer].attn
        post_scale = (
            cache[f"blocks.{layer}.ln1_post.hook_scale"][rows, last]
            if (f"blocks.{layer}.ln1_post.hook_scale" in cache)
            else None
        )
        post = model.blocks[layer].ln1_post if post_scale is not None else None
        u_l, c_post = _pullback(post, rep(post_scale) if post_scale is not None else None, u)
        w = torch.einsum("hdm,rm->rhd", attn_block.W_O.float(), u_l)  # [rows, heads, d_head]
        z = rep(cache[f"blocks.{layer}.attn.hook_z"][rows, last])  # [rows, heads, d_head]
        heads.append((z * w).sum(-1))
        b_O = getattr(attn_block, "b_O", None)  # the bridge leaves an absent bias as None
        bias.append(((b_O * u_l).sum(-1) if b_O is not None else 0.0) + c_post)
        attn.append((rep(cache[f"blocks.{layer}.hook_attn_out"][rows, last]) * u).sum(-1))
        if not cfg.attn_only:
            mlp.append((rep(cache[f"blocks.{layer}.hook_mlp_out"][rows, last]) * u).sum(-1))
        v = cache[f"blocks.{layer}.attn.hook_v"]  # [b, pos, kv_heads, d_head]
        kv = torch.arange(n_heads, device=v.device) // (n_heads // v.shape[2])
        v = v[:, :, kv]  # [b, pos, heads, d_head]
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"][rows, :, last]  # [b, heads, src]
        per_src = torch.einsum("rshd,rhd->rhs", rep(v), w) * rep(pattern)  # [rows, heads, src]
        one_hot = torch.nn.functional.one_hot(groups.clamp(min=0), n_groups).to(per_src.dtype)
        one_hot = one_hot * (groups >= 0)[..., None]
        src_dla.append(torch.einsum("rhs,rsg->rhg", per_src, rep(one_hot)))
        src_att.append(torch.einsum("bhs,bsg->bhg", pattern, one_hot))
    out.update(
        head=torch.stack(heads, 1),
        attn_bias=torch.stack(bias, 1),
        attn=torch.stack(attn, 1),
        source=torch.stack(src_dla, 1),
        attention=torch.stack(src_att, 1),
        n_dir=n_dir,
    )
    if mlp:
        out["mlp"] = torch.stack(mlp, 1)
    return out


SourceLabels = Callable[[ConflictExample, str, Sequence[int]], Sequence[str]]
"""Custom source groups: ``(example, conflict_type, tokens) -> one label per token``."""


def _source_labels(model: Model, example, conflict_type: str, tokens: Sequence[int], sources) -> list[str]:
    """The source group of every token of one prompt: its span, its position, or a custom label."""
    if sources == "spans":
        return example_spans(model, example, conflict_type, tokens=tokens)
    if sources == "tokens":  # each position its own group, counted from the end (-1: final token)
        return [str(p - len(tokens)) for p in range(len(tokens))]
    labels = [str(label) for label in sources(example, conflict_type, tokens)]
    if len(labels) != len(tokens):
        raise ValueError(
            f"sources returned {len(labels)} labels for a prompt of {len(tokens)} tokens "
            f"({example.subject!r}, {conflict_type}); return one label per token, BOS included."
        )
    return labels


def direct_logit_attribution(
    model: Model,
    dataset: ConflictDataset,
    directions: Sequence[str | Direction] = ("parametric-context",),
    *,
    conflict_types: Sequence[str] | None = None,
    sources: str | SourceLabels = "spans",
    batch_size: int = 8,
    progress: bool = True,
) -> Attribution:
    """DLA of every component, head and source group at the final position of each prompt.

    ``directions`` are names ("parametric", "context", "parametric-context",
    "context-parametric") or :class:`Direction` objects; one forward pass serves them all.
    ``sources`` sets the source groups a head's DLA is split over: ``"spans"``
    (:data:`cpsuper.spans.SPAN_GROUPS`, every group listed for every prompt), ``"tokens"`` (each
    source position on its own, ``group`` = its position from the end as text, ``-1`` the final
    token, with ``position`` and ``token`` columns), or a callable giving one label per token
    (:data:`SourceLabels`, e.g. to split the context into sentences). Groups sum to the head's DLA.
    """
    require_resident_weights("cp.direct_logit_attribution", model)
    if not (callable(sources) or sources in ("spans", "tokens")):
        raise ValueError(f"sources must be 'spans', 'tokens' or a callable giving a label per token, got {sources!r}.")
    directions = [_direction(d) for d in directions]
    conflict_types = resolve_conflict_types(dataset, conflict_types)
    batch_size = check_batch_size(batch_size)
    W_U = model.W_U
    b_U = (
        model.b_U
        if getattr(model, "b_U", None) is not None
        else torch.zeros(W_U.shape[1], dtype=W_U.dtype, device=W_U.device)
    )
    comp_rows, src_rows, module_rows, total_rows = [], [], [], []
    jobs = [(c, i) for c in conflict_types for i in range(len(dataset))]
    token_lists = tokenize_prompts(model, [dataset[i].prompts[c] for c, i in jobs])
    bar = tqdm(total=len(jobs), desc="attribution", disable=not progress, leave=False)
    for idx, tokens, _mask, last in padded_batches(model, token_lists, batch_size=batch_size):
        groups = torch.full(tokens.shape, -1, dtype=torch.long, device=tokens.device)
        vecs = torch.zeros(len(idx), len(directions), model.cfg.d_model, device=W_U.device)  # float32
        consts = torch.zeros(len(idx), len(directions), device=W_U.device)
        labels = [_source_labels(model, dataset[jobs[j][1]], jobs[j][0], token_lists[j], sources) for j in idx]
        names = list(SPAN_GROUPS) if sources == "spans" else list(dict.fromkeys(x for row in labels for x in row))
        group_index = {g: n for n, g in enumerate(names)}
        for row, j in enumerate(idx):
            conflict_type, i = jobs[j]
            example = dataset[i]
            groups[row, : len(labels[row])] = torch.tensor([group_index[g] for g in labels[row]])
            for d, direction in enumerate(directions):
                coef = direction.coefficients(model, example, example.prompts[conflict_type])
                ids = torch.tensor(list(coef), device=W_U.device)
                weights = torch.tensor(list(coef.values()), device=W_U.device)
                with torch.inference_mode():
                    vecs[row, d] = W_U[:, ids].float() @ weights
                    consts[row, d] = b_U[ids].float() @ weights
        out = _attribute_batch(model, tokens, last, (vecs, consts), groups, len(names))
        for row, j in enumerate(idx):
            conflict_type, i = jobs[j]
            example = dataset[i]
            key = {"example": i, "subject": example.subject, "conflict_type": conflict_type}
            for d, direction in enumerate(directions):
                r = row * len(directions) + d
                base = {**key, "direction": direction.name}
                comp = [("embed", None, None, out["embed"][r])]
                if "pos_embed" in out:
                    comp.append(("pos_embed", None, None, out["pos_embed"][r]))
                for layer in range(model.cfg.n_layers):
                    comp += [("head", layer, h, out["head"][r, layer, h]) for h in range(model.cfg.n_heads)]
                    comp.append(("attn_bias", layer, None, out["attn_bias"][r, layer]))
                    if "mlp" in out:
                        comp.append(("mlp", layer, None, out["mlp"][r, layer]))
                comp.append(("constant", None, None, out["constant"][r]))
                comp_rows += [{**base, "kind": k, "layer": lay, "head": h, "dla": float(v)} for k, lay, h, v in comp]
                for layer in range(model.cfg.n_layers):
                    module_rows.append({**base, "layer": layer, "module": "attn", "dla": float(out["attn"][r, layer])})
                    if "mlp" in out:
                        module_rows.append(
                            {**base, "layer": layer, "module": "mlp", "dla": float(out["mlp"][r, layer])}
                        )
                total = sum(float(v) for *_, v in comp)
                total_rows.append({**base, "logit": float(out["logit"][r]), "reconstructed": total})
                shown = names if sources == "spans" else list(dict.fromkeys(labels[row]))
                extra = [{}] * len(shown)
                if sources == "tokens":  # shown[p] is position p of this prompt
                    pieces = [model.tokenizer.decode([t]) for t in token_lists[j]]
                    extra = [{"position": p - len(pieces), "token": piece} for p, piece in enumerate(pieces)]
                source, attention = out["source"][r].tolist(), out["attention"][row].tolist()
                for layer in range(model.cfg.n_layers):
                    for h in range(model.cfg.n_heads):
                        for name, more in zip(shown, extra):
                            g = group_index[name]
                            src_rows.append(
                                {
                                    **base,
                                    "layer": layer,
                                    "head": h,
                                    "group": name,
                                    **more,
                                    "dla": source[layer][h][g],
                                    "attention": attention[layer][h][g],
                                }
                            )
        bar.update(len(idx))
    bar.close()
    components = pd.DataFrame(comp_rows).astype({"layer": "Int64", "head": "Int64"})
    order = ["conflict_type", "direction", "example"]
    return Attribution(
        components=components.sort_values(order, kind="stable").reset_index(drop=True),
        sources=pd.DataFrame(src_rows).sort_values(order, kind="stable").reset_index(drop=True),
        modules=pd.DataFrame(module_rows).sort_values(order, kind="stable").reset_index(drop=True),
        totals=pd.DataFrame(total_rows).sort_values(order, kind="stable").reset_index(drop=True),
    )
