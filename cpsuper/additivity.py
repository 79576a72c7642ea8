"""Are mechanisms additive? Ablate classes of components alone, in pairs and all together.

The additive motif says that subject heads, relation heads, mixed heads and MLPs each push the
answer's logit independently. If so, knocking out two classes together costs the sum of
knocking out each alone: the *residual* ``delta(A and B) - delta(A) - delta(B)`` is zero.
A shared nonlinearity downstream (a later MLP or a norm) makes it non-zero.

Components are ablated at the final position only, so only what the last token reads from them
changes: zero ablation sets the output to 0, mean ablation to its mean over the final positions
of every prompt evaluated. Heads are ``(layer, head)`` tuples (their ``hook_z`` slice), a whole
MLP is ``("mlp", layer)`` and a whole attention block ``("attn", layer)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import Literal

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from .backend import Model, final_residual, saving_hooks
from .data.examples import ConflictDataset
from .decoding import unembed_final
from .interrupts import hooked, run_with_cache
from .runtime import (
    answer_token,
    check_batch_size,
    check_dataset,
    check_head,
    check_layer,
    padded_batches,
    require_hook,
    resolve_conflict_types,
    tokenize_prompts,
)
from .stats import bootstrap_summary

__all__ = ["Additivity", "additivity"]

Component = tuple[int, int] | tuple[str, int]
DIRECTIONS = ("parametric-context", "context-parametric", "parametric", "context")


@dataclass
class Additivity:
    """Result of :func:`additivity`.

    ``per_example``: one row per example x conflict type x condition (``kind`` single, pair or
    all; ``classes`` the ablated class names joined by ``" + "``) with the metric clean
    (``p_clean``) and ablated (``p``), ``delta = p - p_clean``, the sum of the
    singles' deltas (``additive``) and ``residual = delta - additive`` (NaN for singles).
    ``summary``: per conflict type x condition, the mean ``delta`` and ``residual`` with
    percentile bootstrap intervals over facts (``delta_low``, ``delta_high``, ...), and ``n``.
    """

    per_example: pd.DataFrame
    summary: pd.DataFrame

    def _repr_html_(self) -> str:
        return self.summary._repr_html_()


def _check_classes(model: Model, classes: Mapping[str, Sequence[Component]]) -> dict[str, list]:
    """Validated classes: at least two, none empty, known components, no head or MLP in two."""
    if len(classes) < 2:
        raise ValueError(f"additivity needs at least two classes to combine, got {list(classes)}.")
    owner: dict[tuple, str] = {}
    out = {}
    for name, members in classes.items():
        members = [tuple(m) if isinstance(m, (tuple, list)) else m for m in members]
        if not members:
            raise ValueError(f"Class {name!r} is empty; give it at least one head (layer, head) or ('mlp', layer).")
        for m in members:
            if not isinstance(m, tuple) or len(m) != 2:
                raise ValueError(
                    f"Class {name!r}: {m!r} is not a component; use (layer, head), ('mlp', L), ('attn', L)."
                )
            if m[0] in ("mlp", "attn"):
                check_layer(model, m[1])
                if m[0] == "mlp" and model.cfg.attn_only:
                    raise ValueError(f"Class {name!r}: the model is attention-only and has no {m!r}.")
                units = [m] if m[0] == "mlp" else [("head", m[1], h) for h in range(model.cfg.n_heads)]
            else:
                check_head(model, *m)
                units = [("head", *m)]
            for unit in units:
                if owner.get(unit, name) != name:
                    raise ValueError(
                        f"Classes {owner[unit]!r} and {name!r} overlap at {unit!r}; classes must be disjoint."
                    )
                owner[unit] = name
        out[name] = members
    return out


def _hook_name(member: Component) -> str:
    if member[0] == "mlp":
        return f"blocks.{member[1]}.hook_mlp_out"
    if member[0] == "attn":
        return f"blocks.{member[1]}.hook_attn_out"
    return f"blocks.{member[0]}.attn.hook_z"


def _layer(member: Component) -> int:
    return int(member[1] if member[0] in ("mlp", "attn") else member[0])


def _ablation_hooks(members: Sequence[Component], last: Tensor, means: dict | None) -> list:
    """Hooks replacing each member's output at the final position of every row."""
    by_hook: dict[str, list] = {}
    for m in members:
        by_hook.setdefault(_hook_name(m), []).append(m)

    def make(name: str, group: list):
        def hook(act, hook):
            act = act.clone()
            rows = torch.arange(act.shape[0], device=act.device)
            for m in group:
                head = None if m[0] in ("mlp", "attn") else m[1]
                value = 0.0 if means is None else means[m].to(act.device, act.dtype)
                if head is None:
                    act[rows, last] = value
                else:
                    act[rows, last, head] = value
            return act

        return (name, hook)

    return [make(name, group) for name, group in by_hook.items()]


@torch.inference_mode()
def _final_means(model, token_lists, members, batch_size) -> dict:
    """Each member's output averaged over the final positions of ``token_lists``."""
    names = sorted({_hook_name(m) for m in members})
    stop = max(_layer(m) for m in members) + 1
    total: dict = {}
    for idx, tokens, _, last in padded_batches(model, token_lists, batch_size=batch_size):
        _, cache = run_with_cache(model, tokens, names_filter=names, stop_at_layer=stop)
        rows = torch.arange(len(idx), device=tokens.device)
        for m in members:
            act = cache[_hook_name(m)][rows, last]
            act = act if m[0] in ("mlp", "attn") else act[:, m[1]]
            total[m] = total.get(m, 0) + act.sum(0)
    return {m: v / len(token_lists) for m, v in total.items()}


def _metric(logits: Float[Tensor, "rows d_vocab"], plus: Tensor, minus: Tensor | None) -> Tensor:
    logits = logits.float()
    rows = torch.arange(len(plus), device=logits.device)
    value = logits[rows, plus]
    return value - logits[rows, minus] if minus is not None else value


def _conditions(names: Sequence[str]) -> list[tuple[str, tuple[str, ...]]]:
    out = [("single", (n,)) for n in names] + [("pair", p) for p in combinations(names, 2)]
    return out + ([("all", tuple(names))] if len(names) > 2 else [])


def additivity(
    model: Model,
    dataset: ConflictDataset,
    classes: Mapping[str, Sequence[Component]],
    *,
    ablation: Literal["zero", "mean"] = "zero",
    direction: str = "parametric-context",
    conflict_types: Sequence[str] | None = None,
    batch_size: int = 16,
    n_boot: int = 2000,
    ci: float = 0.95,
    seed: int = 0,
    progress: bool = True,
) -> Additivity:
    """Change in ``direction``'s logit (difference) at the final position when each class of
    ``classes`` is ablated alone, each pair together and all together, with each combination's
    residual (joint change minus the sum of the singles' changes) and bootstrap intervals.

    ``classes`` maps a name to components (see the module docstring), e.g. from
    :func:`mechanism_classes`. ``direction``: ``"parametric-context"`` (the default),
    ``"context-parametric"``, or the plain logit ``"parametric"`` / ``"context"``.
    """
    if ablation not in ("zero", "mean"):
        raise ValueError(f"ablation must be 'zero' or 'mean', got {ablation!r}.")
    if direction not in DIRECTIONS:
        raise ValueError(f"Unknown direction {direction!r}; use one of {DIRECTIONS}.")
    batch_size = check_batch_size(batch_size)
    classes = _check_classes(model, classes)
    for members in classes.values():
        for m in members:
            require_hook(model, _hook_name(m))
    conflict_types = resolve_conflict_types(dataset, conflict_types)
    check_dataset(model, dataset, conflict_types=conflict_types)
    jobs = [(c, i) for c in conflict_types for i in range(len(dataset))]
    prompts = [dataset[i].prompts[c] for c, i in jobs]
    token_lists = tokenize_prompts(model, prompts)
    first, second = ("answer", "context_answer") if direction.startswith("parametric") else ("context_answer", "answer")
    plus = torch.tensor([answer_token(model, getattr(dataset[i], first), p) for (_, i), p in zip(jobs, prompts)])
    minus = None
    if "-" in direction:
        minus = torch.tensor([answer_token(model, getattr(dataset[i], second), p) for (_, i), p in zip(jobs, prompts)])
    every = [m for members in classes.values() for m in members]
    means = _final_means(model, token_lists, every, batch_size) if ablation == "mean" else None
    conditions = _conditions(list(classes))
    starts = {k: min(_layer(m) for n in names for m in classes[n]) for k, (_, names) in enumerate(conditions)}
    clean = torch.empty(len(jobs))
    ablated = torch.empty(len(jobs), len(conditions))
    bar = tqdm(total=len(jobs), desc="additivity", disable=not progress, leave=False)
    with torch.inference_mode():
        for idx, tokens, _, last in padded_batches(model, token_lists, batch_size=batch_size):
            rows = torch.arange(len(idx), device=tokens.device)
            p_ids = plus[idx].to(tokens.device)
            m_ids = minus[idx].to(tokens.device) if minus is not None else None
            wanted = {f"blocks.{s}.hook_resid_pre" for s in starts.values()}
            cache: dict[str, Tensor] = {}
            with hooked(model, saving_hooks(wanted, cache)):
                resid = final_residual(model, tokens)
            clean[idx] = _metric(unembed_final(model, resid[rows, last]), p_ids, m_ids).cpu()
            for k, (_, names) in enumerate(conditions):
                hooks = _ablation_hooks([m for n in names for m in classes[n]], last, means)
                with hooked(model, hooks):
                    resid = final_residual(model, cache[f"blocks.{starts[k]}.hook_resid_pre"], start_at_layer=starts[k])
                ablated[idx, k] = _metric(unembed_final(model, resid[rows, last]), p_ids, m_ids).cpu()
            bar.update(len(idx))
    bar.close()
    return _tabulate(dataset, jobs, conditions, clean, ablated, n_boot=n_boot, ci=ci, seed=seed, ablation=ablation)


def _tabulate(dataset, jobs, conditions, clean, ablated, *, n_boot, ci, seed, ablation) -> Additivity:
    delta = (ablated - clean[:, None]).numpy()
    single = {names[0]: k for k, (kind, names) in enumerate(conditions) if kind == "single"}
    rows = []
    for j, (conflict_type, i) in enumerate(jobs):
        for k, (kind, names) in enumerate(conditions):
            additive = float(sum(delta[j, single[n]] for n in names)) if kind != "single" else np.nan
            rows.append(
                {
                    "example": i,
                    "subject": dataset[i].subject,
                    "conflict_type": conflict_type,
                    "condition": " + ".join(names),
                    "kind": kind,
                    "n_classes": len(names),
                    "p_clean": float(clean[j]),
                    "p": float(ablated[j, k]),
                    "delta": float(delta[j, k]),
                    "additive": additive,
                    "residual": float(delta[j, k]) - additive,
                }
            )
    per_example = pd.DataFrame(rows)
    per_example.attrs["ablation"] = ablation
    by = ["conflict_type", "kind", "condition"]
    options = {"by": by, "unit": "example", "n_boot": n_boot, "ci": ci, "seed": seed}
    summary = bootstrap_summary(per_example, value="delta", **options)
    summary = summary.rename(columns={"mean": "delta_mean", "ci_low": "delta_low", "ci_high": "delta_high"})
    joint = per_example[per_example.kind != "single"]
    res = bootstrap_summary(joint, value="residual", **options).drop(columns="n")
    res = res.rename(columns={"mean": "residual_mean", "ci_low": "residual_low", "ci_high": "residual_high"})
    summary = summary.merge(res, on=by, how="left")
    order = {name: k for k, name in enumerate([c for c, _ in dict.fromkeys(jobs)])}
    order.update({" + ".join(names): k for k, (_, names) in enumerate(conditions)})
    summary = summary.sort_values(["conflict_type", "condition"], key=lambda column: column.map(order))
    summary.attrs["ablation"] = ablation
    return Additivity(per_example, summary.reset_index(drop=True))
