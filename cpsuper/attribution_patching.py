"""Attribution patching: a first-order estimate of every activation-patching effect at once.

Patching activation ``a`` of a *destination* prompt with its value on a *source* prompt changes a metric ``m`` by
about ``(a_source - a_destination) . dm/da`` (gradient on the destination run), so one source forward and one
destination forward and backward pass estimate every query head and every (layer, position) of ``resid_pre``,
``attn_out`` and ``mlp_out``. Exact where ``m`` is linear in ``a``; off where the model bends between ``a`` and the
logits and the patch is large. Screen with it; check its picks with :func:`exact_head_patching`,
:func:`exact_position_patching` and :func:`patching_agreement`.

Positions pair up from the end (``align="end"``): the last ``n`` tokens of both prompts, ``n`` the
shorter length, less its BOS when the lengths differ (a BOS has no counterpart inside the longer
prompt). Other positions get no estimate; a head's estimate sums over the aligned positions.
``position`` counts from the end (``-1``: final token). The metric, at the destination's final
position: ``"logit_diff"`` (first-token logit of ``target`` minus the other answer's),
``"logprob"`` or ``"probability"`` of the target's first token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from .backend import Model, final_residual, is_bridge, saving_hooks
from .data.examples import ConflictDataset
from .decoding import unembed_final
from .edits import PATCH_SITES, PatchEdit
from .engine import run_conditions
from .interrupts import hooked
from .metrics import first_token_logprob
from .runtime import (
    answer_token,
    check_batch_size,
    check_conflict_dataset,
    check_dataset,
    check_model,
    check_targets,
    length_batches,
    pad_tokens,
    require_hook,
    resolve_conflict_types,
    tokenize_prompts,
)
from .spans import example_spans
from .stats import Interval, bootstrap_ci, bootstrap_summary, check_options, resample_counts

__all__ = [
    "AttributionPatchingResult",
    "attribution_patching",
    "exact_head_patching",
    "exact_position_patching",
    "patching_agreement",
]

METRICS = ("logit_diff", "logprob", "probability")
COMPONENTS = ("resid_pre", "attn_out", "mlp_out")


@dataclass
class _Pairs:
    """Everything both the estimate and the exact patching need about the prompt pairs."""

    model: Model
    dataset: ConflictDataset
    source: str
    destination: str
    target: str
    metric: str
    align: str
    src: list[list[int]]
    dst: list[list[int]]
    n_aligned: list[int]
    ids: Int[Tensor, "n 2"]  # (target, other) first tokens as they continue the destination prompt

    def positions(self, i: int) -> tuple[list[int], list[int]]:
        """Aligned (source, destination) token indices of pair ``i``, in prompt order."""
        n = self.n_aligned[i]
        ls, ld = len(self.src[i]), len(self.dst[i])
        return list(range(ls - n, ls)), list(range(ld - n, ld))

    def meta(self, i: int) -> tuple:
        return (i, self.dataset[i].subject, self.dataset[i].relation, self.source, self.destination, self.target)


def _check_differentiable(model: Model) -> None:
    """Raise where autograd cannot give (float32-exact) gradients of ``model``."""
    if torch.is_inference_mode_enabled():
        raise ValueError("attribution patching needs gradients: call it outside torch.inference_mode().")
    if is_bridge(model):  # its hook points hand out copies that the rest of the forward does not use
        raise ValueError("the TransformerBridge gives no gradients at hook points; load it with backend='hooked'.")
    params = list(model.parameters())
    if low := sorted({str(p.dtype) for p in params if p.dtype in (torch.float16, torch.bfloat16)}):
        raise ValueError(f"model has {'/'.join(low)} weights, too coarse for gradients; load it in float32.")
    if any(p.is_inference() for p in params):
        raise ValueError("model's weights were made under torch.inference_mode(); load it outside inference mode.")


def _prepare(model, dataset, source, destination, target, metric, align, *, grads: bool) -> _Pairs:
    check_model(model)
    check_conflict_dataset(dataset)
    if metric not in METRICS:
        raise ValueError(f"Unknown metric {metric!r}; use one of {METRICS}.")
    (target,) = check_targets(target)
    if align not in ("end", "exact"):
        raise ValueError(f"Unknown align {align!r}; use 'end' (pair positions from the end) or 'exact'.")
    resolve_conflict_types(dataset, [source, destination])  # empty dataset, unknown conflict type
    if source == destination:
        msg = "every patch would change nothing; pick two, e.g. source='clean', destination='substitution'"
        raise ValueError(f"source and destination are both {source!r}: {msg}.")
    if grads:
        _check_differentiable(model)
    check_dataset(model, dataset, conflict_types=[source, destination])
    src = tokenize_prompts(model, dataset.prompts(source))
    dst = tokenize_prompts(model, dataset.prompts(destination))
    bos = model.tokenizer.bos_token_id
    n_aligned = []
    for i, (s, d) in enumerate(zip(src, dst)):
        if align == "exact" and len(s) != len(d):
            raise ValueError(
                f"align='exact' needs prompts of equal length, but example {i} ({dataset[i].subject!r}) has "
                f"{len(s)} {source} tokens and {len(d)} {destination} tokens; use align='end' to pair "
                "positions from the end (the shared question)."
            )
        n = min(len(s), len(d))
        if len(s) != len(d) and bos is not None and s[0] == bos and d[0] == bos:
            n -= 1  # the shorter prompt's BOS has no counterpart inside the longer prompt
        n_aligned.append(n)
    order = 1 if target == "parametric" else -1  # (target, other answer), first tokens after the destination
    ids = [[answer_token(model, a, e.prompts[destination]) for a in (e.answer, e.context_answer)] for e in dataset]
    ids = torch.tensor([pair[::order] for pair in ids])
    return _Pairs(model, dataset, source, destination, target, metric, align, src, dst, n_aligned, ids)


def _forward(model: Model, tokens, mask, last=None, ids=None, metric: str = "") -> Float[Tensor, " rows"] | None:
    """A right-padded forward pass to the final residual; with ``last``, the metric of each row
    read at its last position (the other positions are never unembedded)."""
    padded = bool((mask == 0).any())
    resid = final_residual(model, tokens, attention_mask=mask if padded else None, padding_side="right")
    if last is None:
        return None
    rows, ids = torch.arange(len(last), device=resid.device), ids.to(resid.device)
    logits = unembed_final(model, resid[rows, last])
    if metric == "logit_diff":
        pair = logits.gather(1, ids)
        return pair[:, 0] - pair[:, 1]
    logprob = first_token_logprob(logits, ids[:, :1])[:, 0]
    return logprob if metric == "logprob" else logprob.exp()


def _hook_names(model: Model, sites: Sequence[str]) -> list[str]:
    """The hook point of each site (``"z"`` or a component) and layer, site-major, checked."""
    names = [PATCH_SITES[site].format(layer=layer) for site in sites for layer in range(model.cfg.n_layers)]
    for name in names:
        require_hook(model, name)
    return names


def _components(model: Model, components: Sequence[str] | None) -> list[str]:
    """The components asked for (``None``: all the model has; an attention-only model has no MLP)."""
    has = [c for c in COMPONENTS if not (c == "mlp_out" and model.cfg.attn_only)]
    if components is None:
        return has
    components = [components] if isinstance(components, str) else list(components)
    bad = [c for c in components if c not in has]
    if bad or not components:
        raise ValueError(f"Unknown components {bad or '()'}; use a non-empty subset of {tuple(has)} for this model.")
    return components


@dataclass(repr=False)
class AttributionPatchingResult:
    """Attribution-patching estimates per head (``heads``) and per component, layer and
    position (``positions``), with their means over facts and 95% bootstrap intervals
    (``summary`` for heads, ``position_summary``)."""

    heads: pd.DataFrame
    positions: pd.DataFrame
    summary: pd.DataFrame
    position_summary: pd.DataFrame
    metric: str
    source: str
    destination: str
    target: str


def attribution_patching(
    model: Model,
    dataset: ConflictDataset,
    *,
    source: str = "clean",
    destination: str = "substitution",
    target: str = "parametric",
    metric: str = "logit_diff",
    align: str = "end",
    components: Sequence[str] | None = None,
    batch_size: int = 8,
    progress: bool = True,
) -> AttributionPatchingResult:
    """Gradient estimates of patching each query head (``blocks.{l}.attn.hook_z[:, :, head]``, all aligned positions)
    and each ``components`` activation (default: all the model has) at each aligned position from ``source``
    into ``destination`` prompts (see the module docstring). Needs a float32 HookedTransformer outside inference
    mode; parameters get no ``.grad``. ``estimate`` approximates the ``delta`` of :func:`exact_head_patching` /
    :func:`exact_position_patching`; ``p_clean`` is the destination's metric."""
    pairs = _prepare(model, dataset, source, destination, target, metric, align, grads=True)
    batch_size = check_batch_size(batch_size)
    components = _components(model, components)
    names = (z_names := _hook_names(model, ["z"])) + (points := _hook_names(model, components))
    base, head_values, position_values = ([None] * len(pairs.dst) for _ in range(3))
    batches = length_batches([len(t) for t in pairs.dst], batch_size)
    for idx in tqdm(batches, desc="attribution patching", disable=not progress, leave=False):
        src: dict[str, Tensor] = {}  # the sources: a forward pass caching only the patched hook points
        with torch.no_grad(), hooked(model, saving_hooks(names, src, lambda a: a.detach().float())):
            _forward(model, *pad_tokens(model, [pairs.src[i] for i in idx], "right")[:2])
        tokens, mask, last = pad_tokens(model, [pairs.dst[i] for i in idx], "right")
        acts: dict[str, Tensor] = {}
        # the first hook point starts a graph to differentiate, also where no weight requires grad
        root = ("blocks.0.hook_resid_pre", lambda a, hook: a if a.requires_grad else a.detach().requires_grad_())
        with torch.enable_grad(), hooked(model, [root, *saving_hooks(names, acts)]):
            values = _forward(model, tokens, mask, last, pairs.ids[idx], metric)
            grads = dict(zip(names, torch.autograd.grad(values.sum(), [acts[n] for n in names])))
        with torch.no_grad():
            for row, i in enumerate(idx):
                s_pos, d_pos = pairs.positions(i)
                prod = {  # (source - destination) . gradient, per aligned position
                    n: ((src[n][row, s_pos] - acts[n][row, d_pos].float()) * grads[n][row, d_pos].float()).sum(-1)
                    for n in names
                }
                base[i] = float(values[row])
                head_values[i] = torch.stack([prod[n].sum(0) for n in z_names]).numpy()
                position_values[i] = torch.stack([prod[n] for n in points]).numpy()
    heads = _head_frame(pairs, head_values, base, "estimate")
    positions = _position_frame(pairs, components, position_values, base, "estimate")
    summary = bootstrap_summary(heads, value="estimate", by=["layer", "head"])
    keys = ["component", "layer", "position"]
    spans = positions.groupby(keys, as_index=False)["span"].agg(lambda s: s.value_counts().index[0])
    by_position = bootstrap_summary(positions, value="estimate", by=keys).merge(spans, on=keys, how="left")
    return AttributionPatchingResult(heads, positions, summary, by_position, metric, source, destination, target)


_META = ["example", "subject", "relation", "source", "destination", "target"]


def _head_frame(pairs: _Pairs, values: list, base: list, column: str) -> pd.DataFrame:
    """One row per pair, layer and head; ``values[i]``: ``[n_layers, n_heads]``."""
    rows = [(*pairs.meta(i), *lh, base[i], float(v[lh])) for i, v in enumerate(values) for lh in np.ndindex(v.shape)]
    return _with_patched(pd.DataFrame(rows, columns=[*_META, "layer", "head", "p_clean", column]), column)


def _position_frame(pairs: _Pairs, components: list[str], values: list, base: list, column: str) -> pd.DataFrame:
    """One row per pair, component, layer and aligned position; ``values[i]``:
    ``[components * n_layers, n_aligned]`` (component-major)."""
    rows = []
    for i, v in enumerate(values):
        _, d_pos = pairs.positions(i)
        spans = example_spans(pairs.model, pairs.dataset[i], pairs.destination, tokens=pairs.dst[i])
        n_layers, n_dst = v.shape[0] // len(components), len(pairs.dst[i])
        for j, k in np.ndindex(v.shape):
            where = (components[j // n_layers], j % n_layers, d_pos[k] - n_dst, spans[d_pos[k]])
            rows.append((*pairs.meta(i), *where, base[i], float(v[j, k])))
    columns = [*_META, "component", "layer", "position", "span", "p_clean", column]
    return _with_patched(pd.DataFrame(rows, columns=columns), column)


def _with_patched(frame: pd.DataFrame, column: str) -> pd.DataFrame:
    """Exact effects get ``p = p_clean + delta`` before ``delta``, as in every sweep frame."""
    return (
        frame.assign(p=frame.p_clean + frame.delta)[[*frame.columns[:-1], "p", "delta"]] if column == "delta" else frame
    )


def _exact(model: Model, pairs: _Pairs, conditions: Callable[[int], list], batch_size: int, progress: bool):
    """``(metric of each destination, its change under each condition)`` from the sweep engine, a
    pair at a time (its aligned positions are its own); rows resume at the patched layer."""
    read = (lambda v: v[..., 0] - v[..., 1]) if pairs.metric == "logit_diff" else (lambda v: v[..., 0])
    metric = "logit" if pairs.metric == "logit_diff" else pairs.metric
    base, effects = [], []
    for i in tqdm(range(len(pairs.dst)), desc="exact patching", disable=not progress, leave=False):
        options = {"metric": metric, "batch_size": batch_size, "source_tokens": [pairs.src[i]], "align": pairs.align}
        clean, out = run_conditions(model, [pairs.dst[i]], pairs.ids[[i]], conditions(i), progress=False, **options)
        base.append(float(read(clean)[0]))
        effects.append(read(out)[0].double().numpy() - base[-1])
    return base, effects


def exact_head_patching(
    model: Model,
    dataset: ConflictDataset,
    *,
    source: str = "clean",
    destination: str = "substitution",
    target: str = "parametric",
    metric: str = "logit_diff",
    align: str = "end",
    batch_size: int = 32,
    progress: bool = True,
) -> pd.DataFrame:
    """The true effect of patching each query head (``hook_z[:, :, head]``, all aligned positions)
    from source into destination, with the engine's ``PatchEdit``: :func:`attribution_patching`'s
    ``heads`` columns with ``p`` (patched metric) and ``delta = p - p_clean`` for ``estimate``."""
    pairs = _prepare(model, dataset, source, destination, target, metric, align, grads=False)
    batch_size = check_batch_size(batch_size)
    _hook_names(model, ["z"])
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads

    def conditions(i: int) -> list:
        ends = [d - len(pairs.dst[i]) for d in pairs.positions(i)[1]]
        return [[PatchEdit(l, "z", p, head=h) for p in ends] for l in range(n_layers) for h in range(n_heads)]

    base, effects = _exact(model, pairs, conditions, batch_size, progress)
    return _head_frame(pairs, [e.reshape(n_layers, n_heads) for e in effects], base, "delta")


def exact_position_patching(
    model: Model,
    dataset: ConflictDataset,
    *,
    source: str = "clean",
    destination: str = "substitution",
    target: str = "parametric",
    metric: str = "logit_diff",
    align: str = "end",
    components: Sequence[str] = ("resid_pre",),
    batch_size: int = 32,
    progress: bool = True,
) -> pd.DataFrame:
    """The true effect of patching each ``components`` activation at each layer and aligned
    position (``PatchEdit``): :func:`attribution_patching`'s ``positions`` columns with ``p`` and
    ``delta = p - p_clean`` for ``estimate``."""
    pairs = _prepare(model, dataset, source, destination, target, metric, align, grads=False)
    batch_size = check_batch_size(batch_size)
    components = _components(model, components)
    _hook_names(model, components)
    n_layers = model.cfg.n_layers

    def conditions(i: int) -> list:
        ends = [d - len(pairs.dst[i]) for d in pairs.positions(i)[1]]
        return [[PatchEdit(l, c, p)] for c in components for l in range(n_layers) for p in ends]

    base, effects = _exact(model, pairs, conditions, batch_size, progress)
    values = [e.reshape(len(components) * n_layers, pairs.n_aligned[i]) for i, e in enumerate(effects)]
    return _position_frame(pairs, components, values, base, "delta")


def _spearman(a: Float[np.ndarray, "rows n"], b: Float[np.ndarray, "rows n"]) -> Float[np.ndarray, " rows"]:
    """Spearman rank correlation of each row of ``a`` with the same row of ``b`` (average ranks for ties)."""
    ra, rb = (pd.DataFrame(x).rank(axis=1).to_numpy() for x in (a, b))
    ra, rb = ra - ra.mean(1, keepdims=True), rb - rb.mean(1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (ra * rb).sum(1) / np.sqrt((ra**2).sum(1) * (rb**2).sum(1))


def _top_overlap(a: Float[np.ndarray, "rows n"], b: Float[np.ndarray, "rows n"], k: int) -> Float[np.ndarray, " rows"]:
    """Share of the ``k`` largest ``|a|`` that are among the ``k`` largest ``|b|``, per row."""
    top_a, top_b = (np.argsort(-np.abs(x), axis=1, kind="stable")[:, :k] for x in (a, b))
    return np.array([len(set(x) & set(y)) / k for x, y in zip(top_a, top_b)])


def _interval(point: float, boot: np.ndarray, ci: float, n: int) -> Interval:
    boot = boot[np.isfinite(boot)]
    lo, hi = np.quantile(boot, [(1 - ci) / 2, (1 + ci) / 2]) if len(boot) else (np.nan, np.nan)
    return Interval(float(point), float(lo), float(hi), n)


def patching_agreement(
    estimates: AttributionPatchingResult | pd.DataFrame,
    exact: pd.DataFrame,
    *,
    top_k: int = 10,
    n_boot: int = 2000,
    ci: float = 0.95,
    seed: int = 0,
) -> pd.DataFrame:
    """How well estimates rank components as exact patching does, with bootstrap intervals over
    facts: ``spearman`` (rank correlation over components of the mean estimate and the mean exact
    effect), ``top_k_overlap`` (share of the ``top_k`` by ``|mean exact effect|`` also in the
    ``top_k`` by ``|mean estimate|``) and ``spearman_per_fact`` (each fact's correlation, averaged).

    ``exact`` is :func:`exact_head_patching`'s frame (against ``estimates.heads``) or
    :func:`exact_position_patching`'s (against ``estimates.positions``, on the cells every fact has).
    Columns: ``statistic, value, ci_low, ci_high, n`` (facts), ``n_components``, ``top_k``."""
    check_options(n_boot, ci)
    by_head = "head" in exact.columns
    if isinstance(estimates, AttributionPatchingResult):
        estimates = estimates.heads if by_head else estimates.positions
    keys = ["layer", "head"] if by_head else ["component", "layer", "position"]
    for name, frame, value in (("estimates", estimates, "estimate"), ("exact", exact, "delta")):
        if missing := [c for c in ["example", *keys, value] if c not in frame.columns]:
            raise ValueError(f"{name} has no columns {missing}; it has {list(frame.columns)}.")
    merged = estimates[["example", *keys, "estimate"]].merge(exact[["example", *keys, "delta"]], on=["example", *keys])
    if merged.empty:
        raise ValueError("estimates and exact share no (example, component) rows; compute both on the same facts.")
    facts = np.sort(merged["example"].unique())
    counts = merged.groupby(keys)["example"].transform("nunique")
    merged = merged[counts == len(facts)]
    est = merged.pivot_table(index="example", columns=keys, values="estimate").loc[facts].to_numpy()
    exa = merged.pivot_table(index="example", columns=keys, values="delta").loc[facts].to_numpy()
    n, m = est.shape
    k = min(int(top_k), m)
    if k < 1:
        raise ValueError(f"top_k must be a positive integer, got {top_k!r}.")
    draws = resample_counts(n, n_boot=n_boot, seed=seed)
    boot_est, boot_exa = draws @ est / n, draws @ exa / n
    mean_est, mean_exa = est.mean(0, keepdims=True), exa.mean(0, keepdims=True)
    per_fact = _spearman(est, exa)
    rows = {
        "spearman": _interval(_spearman(mean_est, mean_exa)[0], _spearman(boot_est, boot_exa), ci, n),
        "top_k_overlap": _interval(_top_overlap(mean_exa, mean_est, k)[0], _top_overlap(boot_exa, boot_est, k), ci, n),
    }
    finite = per_fact[np.isfinite(per_fact)]
    rows["spearman_per_fact"] = bootstrap_ci(finite, n_boot=n_boot, ci=ci, seed=seed)
    out = pd.DataFrame([(s, *r) for s, r in rows.items()], columns=["statistic", "value", "ci_low", "ci_high", "n"])
    return out.assign(n_components=m, top_k=k)
