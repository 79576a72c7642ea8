"""What the head explorer shows, read from the analyses' own results: checks that a sweep and an
attribution belong to the model and dataset, per-head slices (effects with bootstrap intervals,
DLA by prompt span, roles), and :func:`explorer_data`, every head's panels as one JSON-ready dict.

Both front ends read these functions, so the Jupyter widget and the static page show the same
numbers, and those numbers are the analyses' numbers (``sweep_intervals``, ``head_sources``,
``head_roles``), only sliced and regrouped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch

from ..attention import attention_patterns
from ..attribution import Attribution
from ..backend import Model
from ..data.examples import ConflictDataset
from ..roles import head_roles
from ..runtime import answer_token, check_head, tokenize_prompts
from ..spans import example_spans
from ..stats import sweep_intervals

__all__ = [
    "SPANS",
    "attention_rows",
    "check_attribution",
    "check_sweep",
    "explorer_data",
    "alpha_key",
    "explorer_head",
    "head_dla",
    "head_effects",
    "head_position_effects",
    "span_sources",
    "sweep_roles",
]

SPANS: dict[str, tuple[str, ...]] = {
    "subject": ("subject",),
    "relation": ("relation", "end"),
    "context answer": ("context_answer",),
    "other": ("bos", "prefix", "context"),
}
"""The explorer's four prompt spans as unions of :data:`cpsuper.spans.SPAN_GROUPS`. The final
token counts as relation, as in :func:`cpsuper.mechanisms.head_categories`."""

_NEEDED = ("example", "layer", "head", "alpha", "conflict_type", "target", "delta")


def explorer_head(model: Model, layer, head) -> tuple[int, int]:
    """``(layer, head)`` checked against ``model``: a clear ValueError for a head outside it."""
    try:
        return check_head(model, layer, head)
    except ValueError as err:
        raise ValueError(
            f"Cannot explore head ({layer!r}, {head!r}): {err} "
            f"({model.cfg.n_layers} layers x {model.cfg.n_heads} query heads)"
        ) from None


def check_sweep(model: Model, dataset: ConflictDataset, sweep) -> pd.DataFrame:
    """The per-example frame of a head sweep, checked to come from ``model`` and ``dataset``.

    Raises ValueError when the frame lacks a head sweep's columns, names another model in its
    attrs (``model`` / ``n_layers`` / ``n_heads``), addresses layers or heads the model does not
    have, or indexes examples whose subjects differ from ``dataset``'s.
    """
    per = getattr(sweep, "per_example", sweep)
    if not isinstance(per, pd.DataFrame):
        raise TypeError(f"sweep must be a cp.head_sweep result or its per_example frame, got {type(sweep).__name__}.")
    missing = [c for c in _NEEDED if c not in per.columns]
    if missing:
        raise ValueError(
            f"sweep is not a head sweep's per-example frame: it lacks columns {missing} (run cp.head_sweep)."
        )
    if per.empty:
        raise ValueError("sweep has no rows.")
    cfg = model.cfg
    recorded = {k: per.attrs.get(k) for k in ("model", "model_name", "n_layers", "n_heads")}
    name = recorded["model"] or recorded["model_name"]
    if name is not None and str(name) != str(cfg.model_name):
        raise ValueError(f"The sweep was run on model {name!r}, but the model passed is {cfg.model_name!r}.")
    for key, have in (("n_layers", cfg.n_layers), ("n_heads", cfg.n_heads)):
        if recorded[key] is not None and int(recorded[key]) != have:
            raise ValueError(
                f"The sweep was run on a model with {key}={recorded[key]}, but the model passed has {key}={have}."
            )
    top_layer, top_head = int(per["layer"].max()), int(per["head"].max())
    if top_layer >= cfg.n_layers or top_head >= cfg.n_heads or min(per["layer"].min(), per["head"].min()) < 0:
        raise ValueError(
            f"The sweep addresses heads up to layer {top_layer}, head {top_head}, but the model passed "
            f"({cfg.model_name}) has {cfg.n_layers} layers x {cfg.n_heads} heads: the sweep comes from another "
            "model. Pass the model it was run on."
        )
    pairs = per[["example", "subject"]].drop_duplicates() if "subject" in per.columns else None
    if int(per["example"].max()) >= len(dataset):
        raise ValueError(
            f"The sweep has example {int(per['example'].max())} but the dataset has {len(dataset)} examples: "
            "pass the dataset the sweep was run on."
        )
    if pairs is not None:
        wrong = [(int(i), s) for i, s in zip(pairs["example"], pairs["subject"]) if dataset[int(i)].subject != s]
        if wrong:
            i, s = wrong[0]
            raise ValueError(
                f"The sweep's example {i} is about {s!r} but the dataset's is about {dataset[i].subject!r}: "
                "pass the dataset the sweep was run on."
            )
    return per


def check_attribution(model: Model, attribution: Attribution) -> Attribution:
    """``attribution`` checked to cover exactly ``model``'s heads (DLA always covers all)."""
    if not isinstance(attribution, Attribution):
        raise TypeError(f"attribution must be a cp.direct_logit_attribution result, got {type(attribution).__name__}.")
    s = attribution.sources
    cfg = model.cfg
    n_layers, n_heads = int(s["layer"].max()) + 1, int(s["head"].max()) + 1
    if (n_layers, n_heads) != (cfg.n_layers, cfg.n_heads):
        raise ValueError(
            f"The attribution covers {n_layers} layers x {n_heads} heads, but the model passed "
            f"({cfg.model_name}) has {cfg.n_layers} x {cfg.n_heads}: it comes from another model."
        )
    return attribution


def head_effects(intervals: pd.DataFrame, layer: int, head: int, alpha: float) -> pd.DataFrame:
    """One head's mean effect with its interval per conflict type and target at scale ``alpha``
    (rows of :func:`cpsuper.stats.sweep_intervals`)."""
    rows = intervals[(intervals["layer"] == layer) & (intervals["head"] == head)]
    rows = rows[np.isclose(rows["alpha"].to_numpy(dtype=float), alpha)]
    return rows[["conflict_type", "target", "mean", "ci_low", "ci_high", "n"]].reset_index(drop=True)


def head_position_effects(
    model: Model, dataset: ConflictDataset, head: tuple[int, int], *, example: int, conflict_type: str, target: str
) -> pd.DataFrame:
    """Where in the prompt a head ``(layer, head)`` carries the conflict: its output at one position at a time of
    ``example``'s ``conflict_type`` prompt is patched from the *agreeing* prompt (the same text
    with the memorised answer wherever the context states its own; :func:`cpsuper.tracing.agreeing_prompt`),
    and the target answer's first-token probability read at the end. Where the agreeing prompt
    tokenizes to another length the clean prompt is the source, aligned from the end, and
    positions in the context have no counterpart (NaN).

    One row per position: ``position`` (from the end), ``token``, ``span``, ``source``
    (``"agreeing"`` or ``"clean"``), ``p_destination`` (unpatched), ``p`` and ``delta = p -
    p_destination``. A clean prompt has no context to patch out: a ValueError says to pick a
    conflict type."""
    from ..edits import PatchEdit
    from ..engine import run_conditions
    from ..tracing import agreeing_prompt

    layer, head = explorer_head(model, *head)
    if conflict_type == "clean":
        raise ValueError("A clean prompt has no context whose effect a head could carry; pick a conflict type.")
    fact = dataset[example]
    prompt = fact.prompts[conflict_type]
    agreeing, _ = agreeing_prompt(fact, conflict_type)
    dst, src = tokenize_prompts(model, [prompt, agreeing])
    source = "agreeing"
    if len(src) != len(dst):
        source, src = "clean", tokenize_prompts(model, [fact.prompts["clean"]])[0]
    ids = torch.tensor([[answer_token(model, fact.target_answer(target), prompt)]])
    positions = range(-len(dst), 0)
    patched = range(-min(len(dst), len(src)), 0)  # those with a counterpart in the source
    clean, values = run_conditions(
        model,
        [dst],
        ids,
        [[PatchEdit(layer, "z", p, head)] for p in patched],
        source_tokens=[src],
        align="exact" if source == "agreeing" else "end",
        progress=False,
    )
    p = np.full(len(dst), np.nan)
    p[len(dst) - len(patched) :] = values[0, :, 0].double().numpy()
    frame = pd.DataFrame(
        {
            "position": list(positions),
            "token": [model.tokenizer.decode([t]) for t in dst],
            "span": example_spans(model, fact, conflict_type, tokens=dst),
            "source": source,
            "p_destination": float(clean[0, 0]),
            "p": p,
        }
    )
    frame["delta"] = frame["p"] - frame["p_destination"]
    return frame


def span_sources(attribution: Attribution, *, direction: str | None = None) -> pd.DataFrame:
    """Mean source-token DLA (and the attention the final token pays) per conflict type, head
    and prompt span of :data:`SPANS`: :meth:`Attribution.head_sources` summed over each span's
    groups. ``direction`` defaults to "parametric-context" when the attribution has it, else to
    the first of its directions in sorted order."""
    have = sorted(attribution.sources["direction"].unique())
    direction = direction or ("parametric-context" if "parametric-context" in have else have[0])
    s = attribution.head_sources(direction)
    if s.empty:
        raise ValueError(
            f"The attribution has no direction {direction!r}; it has {sorted(attribution.sources.direction.unique())}."
        )
    span_of = {g: span for span, groups in SPANS.items() for g in groups}
    s = s.assign(span=pd.Categorical(s["group"].map(span_of), categories=list(SPANS)))
    keys = ["conflict_type", "layer", "head", "span"]
    out = s.groupby(keys, as_index=False, observed=True, sort=True)[["dla", "attention"]].sum()
    out.attrs["direction"] = direction
    return out


def head_dla(spans: pd.DataFrame, layer: int, head: int) -> pd.DataFrame:
    """One head's rows of :func:`span_sources`: DLA and attention per conflict type and span."""
    rows = spans[(spans["layer"] == layer) & (spans["head"] == head)]
    return rows[["conflict_type", "span", "dla", "attention"]].reset_index(drop=True)


def sweep_roles(sweep, alpha: float, *, n_boot: int, ci: float, seed: int) -> tuple[pd.DataFrame | None, str]:
    """:func:`cpsuper.roles.head_roles` at ``alpha``, or ``None`` and the reason it cannot be
    computed (scale 1, or a sweep without both targets)."""
    try:
        return head_roles(sweep, alpha=alpha, n_boot=n_boot, ci=ci, seed=seed), ""
    except ValueError as err:
        return None, str(err)


def attention_rows(model: Model, prompt: str, *, rows: int = 6) -> dict:
    """Every head's attention from the last ``rows`` query positions of ``prompt`` (the final
    one is where the answer is read): tokens, query indices and a layers x heads x rows x
    keys nested list."""
    cfg = model.cfg
    heads = [(layer, head) for layer in range(cfg.n_layers) for head in range(cfg.n_heads)]
    patterns, tokens = attention_patterns(model, prompt, heads)
    queries = list(range(max(0, len(tokens) - rows), len(tokens)))
    picked = patterns[:, queries].reshape(cfg.n_layers, cfg.n_heads, len(queries), len(tokens))
    return {"tokens": tokens, "queries": queries, "attention": _rounded(picked.numpy(), 4)}


def _rounded(values, digits: int = 6):
    """Nested lists of floats rounded to ``digits`` significant digits, NaN as None (JSON null)."""
    array = np.asarray(values, dtype=float)
    if array.ndim == 0:
        x = float(array)
        return None if not math.isfinite(x) else float(f"{x:.{digits}g}")
    return [_rounded(v, digits) for v in array]


def _grid(frame: pd.DataFrame, column: str, n_layers: int, n_heads: int) -> np.ndarray:
    grid = np.full((n_layers, n_heads), np.nan)
    grid[frame["layer"].to_numpy(int), frame["head"].to_numpy(int)] = frame[column].to_numpy(float)
    return grid


def alpha_key(alpha: float) -> str:
    """The JSON key of a scale (``"0"``, ``"2"``, ``"0.5"``)."""
    return f"{float(alpha):g}"


def explorer_data(
    model: Model,
    dataset: ConflictDataset,
    *,
    sweep,
    attribution: Attribution | None = None,
    direction: str | None = None,
    examples: Sequence[int] | None = None,
    attention_rows_shown: int = 6,
    n_boot: int = 1000,
    ci: float = 0.95,
    seed: int = 0,
) -> dict:
    """Every head's explorer panels, precomputed and JSON-ready (for the static page).

    Keys: ``model`` (name, n_layers, n_heads), ``dataset``, ``metric``, ``n_facts``, ``ci``, ``alphas``
    (keys of :func:`alpha_key`), ``targets``, ``conflict_types``; ``effects[alpha][target]
    [conflict_type]`` with ``mean, low, high, n`` as layers x heads grids (bootstrap intervals
    of :func:`cpsuper.stats.sweep_intervals`); ``direction``, ``spans`` and ``dla[conflict_type]``
    with ``dla`` and ``attention`` as layers x heads x spans grids (``None`` without an
    attribution); ``roles[alpha][conflict_type]`` as layers x heads grids of role names (``None``
    where :func:`cpsuper.roles.head_roles` does not apply, with ``roles_note`` saying why);
    ``examples``: for each chosen example (default the first four) its subject and, per
    conflict type, :func:`attention_rows` of its prompt.
    """
    per = check_sweep(model, dataset, sweep)
    cfg = model.cfg
    L, H = cfg.n_layers, cfg.n_heads
    intervals = sweep_intervals(per, n_boot=n_boot, ci=ci, seed=seed)
    alphas = sorted(float(a) for a in per["alpha"].unique())
    targets = list(dict.fromkeys(per["target"]))
    types = list(dict.fromkeys(per["conflict_type"]))
    effects, roles, notes = {}, {}, []
    for alpha in alphas:
        at = intervals[np.isclose(intervals["alpha"].to_numpy(dtype=float), alpha)]
        effects[alpha_key(alpha)] = {
            t: {
                c: {
                    key: _rounded(_grid(at[(at.target == t) & (at.conflict_type == c)], col, L, H))
                    for key, col in (("mean", "mean"), ("low", "ci_low"), ("high", "ci_high"), ("n", "n"))
                }
                for c in types
            }
            for t in targets
        }
        table, note = sweep_roles(per, alpha, n_boot=n_boot, ci=ci, seed=seed)
        if table is None:
            roles[alpha_key(alpha)] = None
            notes.append(f"scale {alpha:g}: {note}")
            continue
        roles[alpha_key(alpha)] = {}
        for c in types:
            part = table[table["conflict_type"] == c]
            grid = np.full((L, H), None, dtype=object)
            grid[part["layer"].to_numpy(int), part["head"].to_numpy(int)] = part["role"].astype(str).to_numpy()
            roles[alpha_key(alpha)][c] = grid.tolist()
    dla = None
    if attribution is not None:
        check_attribution(model, attribution)
        spans = span_sources(attribution, direction=direction)
        direction = spans.attrs["direction"]
        dla = {}
        for c, part in spans.groupby("conflict_type", sort=False):
            full = part.set_index(["layer", "head", "span"]).reindex(
                pd.MultiIndex.from_product([range(L), range(H), list(SPANS)])
            )
            dla[c] = {k: _rounded(full[k].to_numpy().reshape(L, H, len(SPANS))) for k in ("dla", "attention")}
    chosen = list(range(min(4, len(dataset)))) if examples is None else [int(i) for i in examples]
    shown = []
    for i in chosen:
        if not 0 <= i < len(dataset):
            raise ValueError(f"Example {i} is outside the dataset ({len(dataset)} examples).")
        e = dataset[i]
        prompts = {c: attention_rows(model, e.prompts[c], rows=attention_rows_shown) for c in types if c in e.prompts}
        shown.append({"index": i, "subject": e.subject, "prompts": prompts})
    return {
        "model": {"name": str(cfg.model_name), "n_layers": L, "n_heads": H},
        "dataset": str(getattr(dataset, "name", "")),
        "metric": str(per.attrs.get("metric", "probability")),
        "n_facts": int(per["example"].nunique()),
        "ci": ci,
        "alphas": [alpha_key(a) for a in alphas],
        "targets": targets,
        "conflict_types": types,
        "effects": effects,
        "direction": direction if attribution is not None else None,
        "spans": list(SPANS),
        "dla": dla,
        "roles": roles,
        "roles_note": "; ".join(notes),
        "examples": shown,
    }
