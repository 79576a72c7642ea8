"""Significance-aware readings of a head sweep: superposed heads and head roles.

A mean effect that changes sign between two conflict types is not evidence of superposition
when one of the two means is within noise of zero. Both functions here therefore bootstrap
each head's effect over facts (:mod:`cpsuper.stats`) and only call an effect positive or
negative when its interval excludes zero and its size reaches a threshold.

- :func:`significant_flips`: heads whose effect on one target is significantly positive in
  one conflict type and significantly negative in the other.
- :func:`head_roles`: per head and conflict type, a role judged from *both* targets (memory
  head, context head, mixed, negligible); :func:`role_transitions` crosstabs roles between
  two conflict types.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from .stats import bootstrap_summary, check_options

__all__ = ["ROLES", "Flips", "head_roles", "role_transitions", "significant_flips"]

ROLES = ("memory", "context", "mixed", "negligible")


def _per_example(sweep) -> pd.DataFrame:
    per = getattr(sweep, "per_example", sweep)
    if not isinstance(per, pd.DataFrame):
        raise TypeError(f"Expected a SweepResult or its per_example frame, got {type(sweep).__name__}.")
    needed = {"example", "layer", "head", "alpha", "conflict_type", "target", "delta"}
    missing = sorted(needed - set(per.columns))
    if missing:
        raise ValueError(f"Not a head sweep's per-example frame: it lacks columns {missing} (run cp.head_sweep).")
    return per


def _select(per: pd.DataFrame, alpha: float, targets: Sequence[str], types: Sequence[str] | None) -> pd.DataFrame:
    rows = per[np.isclose(per["alpha"].to_numpy(dtype=float), alpha)]
    if rows.empty:
        raise ValueError(f"The sweep has no rows for alpha={alpha}; it has alphas {sorted(per['alpha'].unique())}.")
    have_targets = set(rows["target"].unique())
    missing = [t for t in targets if t not in have_targets]
    if missing:
        raise ValueError(f"The sweep lacks targets {missing}; it has {sorted(have_targets)}.")
    if types is not None:
        have_types = set(rows["conflict_type"].unique())
        missing = [t for t in types if t not in have_types]
        if missing:
            raise ValueError(f"The sweep has no conflict types {missing}; it has {sorted(have_types)}.")
        rows = rows[rows["conflict_type"].isin(list(types))]
    return rows[rows["target"].isin(list(targets))]


def _sign(
    mean: pd.Series,
    low: pd.Series,
    high: pd.Series,
    threshold: float,
    significant: bool,
) -> pd.Series:
    """+1 / -1 where the effect is positive / negative beyond ``threshold`` (and, if
    ``significant``, its interval excludes 0); 0 otherwise."""
    pos = (mean >= threshold) & (mean > 0)
    neg = (mean <= -threshold) & (mean < 0)
    if significant:
        pos &= low > 0
        neg &= high < 0
    return pos.astype(int) - neg.astype(int)


def _check_threshold(name: str, value: float) -> None:
    if not np.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative effect size (a change in the sweep's metric), got {value!r}.")


# ---------------------------------------------------------------------------------------------
# Superposition


@dataclass
class Flips:
    """What :func:`significant_flips` returns.

    ``heads``: one row per head with, for each of the two conflict types ``a`` and ``b``,
    ``mean_<t>, ci_low_<t>, ci_high_<t>, sign_<t>`` (``sign`` is +1 / -1 for a significant
    effect, 0 otherwise), then ``sign_change`` (the two means have opposite signs) and
    ``significant_flip``. ``intervals``: the tidy per head x conflict type intervals.
    """

    heads: pd.DataFrame
    intervals: pd.DataFrame
    types: tuple[str, str]
    target: str
    alpha: float

    @property
    def n_sign_changes(self) -> int:
        return int(self.heads["sign_change"].sum())

    @property
    def n_significant(self) -> int:
        return int(self.heads["significant_flip"].sum())

    def counts(self) -> dict[str, int]:
        return {
            "heads": len(self.heads),
            "sign_changes": self.n_sign_changes,
            "significant_flips": self.n_significant,
        }

    def __str__(self) -> str:
        a, b = self.types
        return (
            f"{self.n_sign_changes} of {len(self.heads)} heads change the sign of their mean effect on "
            f"p({self.target}) between {a} and {b} (scale {self.alpha:g}); "
            f"{self.n_significant} of them flip significantly."
        )


def significant_flips(
    sweep,
    *,
    types: tuple[str, str] = ("substitution", "coherent"),
    target: str = "parametric",
    alpha: float = 0.0,
    min_effect: float = 0.0,
    n_boot: int = 2000,
    ci: float = 0.95,
    seed: int = 0,
) -> Flips:
    """Heads whose effect on ``target`` is significantly positive in one conflict type and
    significantly negative in the other (each interval excludes 0 and each ``|mean|`` is at
    least ``min_effect``), next to the plain count of sign changes of the means.

    ``sweep`` is a :func:`cpsuper.heads.head_sweep` result (or its ``per_example`` frame)
    that includes scale ``alpha``, ``target`` and both ``types``. Intervals are percentile
    bootstrap intervals over facts, shared between the two types (same resampled facts).
    """
    check_options(n_boot, ci)
    _check_threshold("min_effect", min_effect)
    types = tuple(types)
    if len(types) != 2 or types[0] == types[1]:
        raise ValueError(f"types must name two different conflict types, got {types!r}.")
    rows = _select(_per_example(sweep), alpha, [target], types)
    intervals = bootstrap_summary(
        rows,
        value="delta",
        by=["layer", "head", "conflict_type"],
        unit="example",
        n_boot=n_boot,
        ci=ci,
        seed=seed,
    )
    intervals["sign"] = _sign(intervals["mean"], intervals["ci_low"], intervals["ci_high"], min_effect, True)
    wide = intervals.pivot(index=["layer", "head"], columns="conflict_type")
    heads = pd.DataFrame(index=wide.index)
    for t in types:
        for col in ("mean", "ci_low", "ci_high", "sign", "n"):
            heads[f"{col}_{t}"] = wide[(col, t)]
    a, b = types
    heads = heads.dropna().reset_index()  # a head missing from one type cannot be compared
    for t in types:
        heads[f"sign_{t}"] = heads[f"sign_{t}"].astype(int)
        heads[f"n_{t}"] = heads[f"n_{t}"].astype(int)
    heads["sign_change"] = np.sign(heads[f"mean_{a}"]) * np.sign(heads[f"mean_{b}"]) < 0
    heads["significant_flip"] = heads[f"sign_{a}"] * heads[f"sign_{b}"] < 0
    strength = np.minimum(heads[f"mean_{a}"].abs(), heads[f"mean_{b}"].abs())
    heads = heads.assign(strength=strength).sort_values(
        ["significant_flip", "sign_change", "strength"], ascending=False
    )
    intervals.insert(2, "alpha", alpha)
    intervals.insert(3, "target", target)
    intervals.attrs.update(rows.attrs)
    return Flips(heads.reset_index(drop=True), intervals, types, target, alpha)


# ---------------------------------------------------------------------------------------------
# Head roles


def head_roles(
    sweep,
    *,
    alpha: float = 0.0,
    threshold: float = 0.0,
    n_boot: int = 2000,
    ci: float = 0.95,
    seed: int = 0,
    types: Sequence[str] | None = None,
    significant: bool = True,
) -> pd.DataFrame:
    """Each head's role per conflict type, judged from the parametric and context targets.

    With a knockout (``alpha < 1``, default 0), call an effect *up* / *down* when its mean is
    at least ``threshold`` in size (in the sweep's metric, a probability change by default) and
    (if ``significant``) its bootstrap interval over facts excludes 0:

    - ``"memory"``: knocking the head out lowers p(parametric) and raises p(context);
    - ``"context"``: it raises p(parametric) and lowers p(context);
    - ``"mixed"``: both targets move the same way (both up or both down);
    - ``"negligible"``: anything else (at least one target unaffected).

    For an amplification (``alpha > 1``) the directions are read the other way round, since
    amplifying a memory head raises p(parametric). Returns a tidy frame with ``layer, head,
    conflict_type, role`` and, for each target, ``<target>_mean, <target>_ci_low,
    <target>_ci_high``, plus ``n`` (facts) and ``alpha``. ``role`` is categorical over
    :data:`ROLES`.
    """
    check_options(n_boot, ci)
    _check_threshold("threshold", threshold)
    if np.isclose(alpha, 1.0):
        raise ValueError(
            "alpha=1 leaves every head unchanged; head roles need a knockout (alpha < 1) "
            "or an amplification (alpha > 1)."
        )
    targets = ("parametric", "context")
    rows = _select(_per_example(sweep), alpha, targets, types)
    intervals = bootstrap_summary(
        rows,
        value="delta",
        by=["layer", "head", "conflict_type", "target"],
        unit="example",
        n_boot=n_boot,
        ci=ci,
        seed=seed,
    )
    wide = intervals.pivot(index=["layer", "head", "conflict_type"], columns="target")
    out = pd.DataFrame(index=wide.index)
    for t in targets:
        for col in ("mean", "ci_low", "ci_high"):
            out[f"{t}_{col}"] = wide[(col, t)]
    out = out.dropna()
    out["n"] = wide.loc[out.index, ("n", "parametric")].astype(int)
    direction = 1 if alpha < 1 else -1  # read amplifications as the opposite of a removal
    sign = {
        t: direction
        * _sign(
            out[f"{t}_mean"],
            out[f"{t}_ci_low"],
            out[f"{t}_ci_high"],
            threshold,
            significant,
        )
        for t in targets
    }
    par, ctx = sign["parametric"], sign["context"]
    role = np.select(
        [(par < 0) & (ctx > 0), (par > 0) & (ctx < 0), (par != 0) & (par == ctx)],
        ["memory", "context", "mixed"],
        default="negligible",
    )
    out.insert(0, "role", pd.Categorical(role, categories=list(ROLES)))
    out["alpha"] = alpha
    out = out.reset_index()
    out.attrs.update(rows.attrs)  # e.g. which metric the effects are changes of
    return out


def role_transitions(roles: pd.DataFrame, from_type: str, to_type: str) -> pd.DataFrame:
    """How heads' roles change between two conflict types: a crosstab with ``from_type`` roles
    as rows and ``to_type`` roles as columns (every role listed, zeros included)."""
    needed = {"layer", "head", "conflict_type", "role"}
    if not needed <= set(roles.columns):
        raise ValueError(f"Expected head_roles output with columns {sorted(needed)}; got {list(roles.columns)}.")
    have = set(roles["conflict_type"].unique())
    missing = [t for t in (from_type, to_type) if t not in have]
    if missing:
        raise ValueError(f"The roles have no conflict types {missing}; they have {sorted(have)}.")
    if from_type == to_type:
        raise ValueError("from_type and to_type must differ.")

    def side(conflict_type: str) -> pd.Series:
        part = roles[roles["conflict_type"] == conflict_type]
        if "alpha" in part.columns and part["alpha"].nunique() > 1:
            raise ValueError("The roles mix several alphas; select one before crosstabbing.")
        return part.set_index(["layer", "head"])["role"].astype(str)

    left, right = side(from_type), side(to_type)
    both = left.index.intersection(right.index)
    categories = list(ROLES)
    return pd.crosstab(
        pd.Categorical(left.loc[both], categories=categories),
        pd.Categorical(right.loc[both], categories=categories),
        rownames=[from_type],
        colnames=[to_type],
        dropna=False,
    )
