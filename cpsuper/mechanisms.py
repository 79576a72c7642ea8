"""Mechanisms from a direct logit attribution: which heads read the subject, which read the
relation, and how much each kind of head, the MLPs and the rest add to each candidate's logit.

:func:`head_categories` labels every head by where its positive DLA comes from (subject tokens,
relation tokens, both, elsewhere); :func:`mechanism_contributions` sums the DLA by those labels.
Both only regroup :func:`cpsuper.attribution.direct_logit_attribution`'s exact decomposition, so
each head's pieces add up to its DLA and the mechanisms add up to the direct logit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pandas as pd

from .attribution import Attribution, Direction, direct_logit_attribution
from .backend import Model
from .data.examples import ConflictDataset, ConflictExample

__all__ = ["head_categories", "mechanism_classes", "mechanism_contributions"]


def head_categories(
    attribution: Attribution,
    conflict_type: str | None = None,
    direction: str | None = None,
    threshold: float = 0.6,
    mixed_min: float = 0.25,
    min_dla: float = 0.1,
    subject_groups: Sequence[str] = ("subject",),
    relation_groups: Sequence[str] = ("relation", "end"),
) -> pd.DataFrame:
    """Subject / relation / mixed heads from where each head's positive DLA comes from.

    Per head (mean over examples): the positive part of each source group's DLA, as a share of
    their sum. ``subject`` if the subject share is at least ``threshold``; ``relation`` likewise
    for relation tokens; ``mixed`` if both shares are at least ``mixed_min``; ``other`` when the
    DLA comes mostly from elsewhere (BOS, context, the final token); ``minor`` when the head's
    DLA is below ``min_dla``. The attention to each group is reported beside it as a check.
    Every head's DLA splits exactly as ``subject_dla + relation_dla + other_dla``.

    The final token counts as relation by default: it closes the relation phrase ("... the
    country of") and a head reading it reads the relation, not the subject.
    """
    s = attribution.head_sources(direction)
    if conflict_type is not None:
        s = s[s.conflict_type == conflict_type]
    if s.empty:
        raise ValueError(f"No attribution rows for conflict type {conflict_type!r} and direction {direction!r}.")
    dla = s.pivot_table(index=["direction", "conflict_type", "layer", "head"], columns="group", values="dla")
    att = s.pivot_table(index=["direction", "conflict_type", "layer", "head"], columns="group", values="attention")
    positive = dla.clip(lower=0)
    share = positive.div(positive.sum(axis=1).where(lambda x: x > 0), axis=0).fillna(0.0)

    def total(frame: pd.DataFrame, groups: Sequence[str]) -> pd.Series:
        return frame.reindex(columns=list(groups)).fillna(0.0).sum(axis=1)

    table = pd.DataFrame(
        {
            "dla": dla.sum(axis=1),
            "subject_dla": total(dla, subject_groups),
            "relation_dla": total(dla, relation_groups),
            "other_dla": dla.sum(axis=1) - total(dla, subject_groups) - total(dla, relation_groups),
            "subject_share": total(share, subject_groups),
            "relation_share": total(share, relation_groups),
            "attention_subject": total(att, subject_groups),
            "attention_relation": total(att, relation_groups),
        }
    )

    def category(row) -> str:
        if row.dla < min_dla:
            return "minor"
        if row.subject_share >= threshold:
            return "subject"
        if row.relation_share >= threshold:
            return "relation"
        if row.subject_share >= mixed_min and row.relation_share >= mixed_min:
            return "mixed"
        return "other"

    table["category"] = table.apply(category, axis=1)
    table.attrs["groups"] = {"subject": tuple(subject_groups), "relation": tuple(relation_groups)}
    return table.reset_index().sort_values("dla", ascending=False, kind="stable").reset_index(drop=True)


def mechanism_contributions(
    model: Model,
    dataset: ConflictDataset,
    candidates: dict[str, Callable[[ConflictExample], str]],
    *,
    categories: pd.DataFrame,
    conflict_types: Sequence[str] | None = None,
    batch_size: int = 8,
    progress: bool = True,
) -> pd.DataFrame:
    """Direct logit of each candidate answer split by mechanism: heads by ``category`` (from
    :func:`head_categories`), MLPs, and everything else; plus their ``sum``.

    A mixed head reads both spans, so its DLA is split by source token into ``mixed heads:
    subject``, ``mixed heads: relation`` and ``mixed heads: other`` (the groups
    ``head_categories`` used). Shows whether independent mechanisms add up constructively.
    """
    if not candidates:
        raise ValueError("Give at least one candidate answer, e.g. {'correct': lambda e: e.answer}.")
    directions = [Direction(name, fn) for name, fn in candidates.items()]
    result = direct_logit_attribution(
        model, dataset, directions, conflict_types=conflict_types, batch_size=batch_size, progress=progress
    )
    c = result.components
    cat = categories.drop_duplicates(["layer", "head"]).set_index(["layer", "head"])["category"]
    keys = list(zip(c.layer, c["head"]))
    c = c.assign(
        mechanism=[
            (f"{cat.get((int(lay), int(h)), 'minor')} heads" if k == "head" else "MLPs" if k == "mlp" else "other")
            for (lay, h), k in zip(keys, c.kind)
        ]
    )
    groups = categories.attrs.get("groups", {"subject": ("subject",), "relation": ("relation", "end")})
    s = result.sources
    s = s[[cat.get((int(lay), int(h))) == "mixed" for lay, h in zip(s.layer, s["head"])]]
    part = [
        "subject" if g in groups["subject"] else "relation" if g in groups["relation"] else "other" for g in s.group
    ]
    s = s.assign(mechanism=[f"mixed heads: {p}" for p in part])
    c = pd.concat([c[c.mechanism != "mixed heads"], s], ignore_index=True)
    per_example = c.groupby(["conflict_type", "direction", "example", "mechanism"], as_index=False)["dla"].sum()
    mech = per_example.groupby(["conflict_type", "direction", "mechanism"], as_index=False)["dla"].mean()
    totals = mech.groupby(["conflict_type", "direction"], as_index=False)["dla"].sum().assign(mechanism="sum")
    out = pd.concat([mech, totals], ignore_index=True).rename(columns={"direction": "candidate"})
    return out.sort_values(["conflict_type", "candidate", "mechanism"], kind="stable").reset_index(drop=True)


def mechanism_classes(
    categories: pd.DataFrame,
    *,
    model: Model | None = None,
    categories_used: Sequence[str] = ("subject", "relation", "mixed"),
) -> dict[str, list[tuple]]:
    """Classes for :func:`cpsuper.additivity` from a :func:`head_categories` table: the heads of
    each category in ``categories_used`` (``"subject heads"``, ...), skipping empty ones, plus
    every MLP as ``"MLPs"`` when ``model`` is given and has MLPs."""
    table = categories.drop_duplicates(["layer", "head", "category"])
    clash = table[table.duplicated(["layer", "head"], keep=False)]
    if not clash.empty:
        raise ValueError(
            "The table gives some heads two categories (it holds several conflict types or directions); "
            f"select one first, e.g. head {tuple(clash[['layer', 'head']].iloc[0])}."
        )
    out: dict[str, list[tuple]] = {}
    for category in categories_used:
        heads = table[table.category == category]
        if len(heads):
            out[f"{category} heads"] = [(int(lay), int(h)) for lay, h in zip(heads.layer, heads["head"])]
    if model is not None and not model.cfg.attn_only:
        out["MLPs"] = [("mlp", layer) for layer in range(model.cfg.n_layers)]
    return out
