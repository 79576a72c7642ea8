"""Bootstrap confidence intervals over facts, for every effect and accuracy cpsuper reports.

The resampling unit is the *fact* (a sweep's ``example`` column): one fact appears in many
rows (several heads, conflict types, targets), and those rows are not independent, so the
bootstrap draws facts with replacement and keeps all of a drawn fact's rows together.
Intervals are percentile intervals: the ``(1 - ci) / 2`` and ``(1 + ci) / 2`` quantiles of
the resampled statistic.

Grouped versions are vectorised: every group's values are gathered into a groups x units
matrix of sums (and one of row counts), and all resamples are one matrix product with an
``n_boot x units`` matrix of how often each unit was drawn. Groups that hold the same set of
units share the same resamples, so differences between such groups are paired, and a group's
interval equals :func:`bootstrap_ci` of its values taken in unit order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import pandas as pd
from jaxtyping import Float, Int

__all__ = [
    "Interval",
    "bootstrap_ci",
    "bootstrap_summary",
    "ci_strings",
    "format_ci",
    "paired_bootstrap",
    "paired_summary",
    "resample_counts",
    "sweep_intervals",
    "unpaired_difference",
]

STATISTICS = ("mean", "median")


class Interval(NamedTuple):
    """A point estimate with its percentile bootstrap interval and the number of units."""

    mean: float
    ci_low: float
    ci_high: float
    n: int

    def __str__(self) -> str:
        return format_ci(self.mean, self.ci_low, self.ci_high)


def check_options(n_boot: int, ci: float) -> None:
    """Raise a clear error for an unusable number of resamples or confidence level."""
    if isinstance(n_boot, bool) or not isinstance(n_boot, (int, np.integer)) or n_boot < 1:
        raise ValueError(f"n_boot must be a positive integer (e.g. 2000), got {n_boot!r}.")
    if not isinstance(ci, (int, float, np.floating)) or not 0.0 < float(ci) < 1.0:
        raise ValueError(f"ci must lie strictly between 0 and 1 (e.g. 0.95), got {ci!r}.")


def _check_finite(values: np.ndarray, what: str) -> None:
    if values.size == 0:
        raise ValueError(f"No {what} to bootstrap: the data are empty.")
    bad = ~np.isfinite(values)
    if bad.any():
        raise ValueError(
            f"{int(bad.sum())} of the {what} are not finite (NaN or inf), e.g. at position "
            f"{int(np.flatnonzero(bad)[0])}; drop or fix them before bootstrapping."
        )


def _resample_indices(n_units: int, n_boot: int, seed: int) -> Int[np.ndarray, "n_boot n_units"]:
    """Which unit each resample draws at each position; depends only on (n_units, n_boot, seed)."""
    return np.random.default_rng(seed).integers(0, n_units, size=(n_boot, n_units))


def resample_counts(n_units: int, *, n_boot: int = 2000, seed: int = 0) -> Int[np.ndarray, "n_boot n_units"]:
    """How often each of ``n_units`` units is drawn in each of ``n_boot`` resamples (rows sum to
    ``n_units``). The same arguments always give the same matrix."""
    check_options(n_boot, 0.5)
    if n_units < 1:
        raise ValueError("No units to resample.")
    idx = _resample_indices(n_units, n_boot, seed)
    flat = (idx + n_units * np.arange(n_boot)[:, None]).ravel()
    return np.bincount(flat, minlength=n_boot * n_units).reshape(n_boot, n_units)


def _percentiles(boot: Float[np.ndarray, "... n_boot"], ci: float) -> tuple[np.ndarray, np.ndarray]:
    tail = (1.0 - ci) / 2.0
    lo, hi = np.quantile(boot, [tail, 1.0 - tail], axis=-1)
    return lo, hi


def bootstrap_ci(
    values: Sequence[float] | np.ndarray | pd.Series,
    *,
    n_boot: int = 2000,
    ci: float = 0.95,
    seed: int = 0,
    statistic: str = "mean",
) -> Interval:
    """Percentile bootstrap interval of the mean (or median) of 1-D ``values``, one value per unit.

    Returns ``Interval(mean, ci_low, ci_high, n)``; ``mean`` is the statistic on the data
    itself. A constant sample gives a degenerate interval ``(c, c)``.
    """
    check_options(n_boot, ci)
    if statistic not in STATISTICS:
        raise ValueError(f"Unknown statistic {statistic!r}; use one of {STATISTICS}.")
    x = np.asarray(values, dtype=float)
    if x.ndim != 1:
        raise ValueError(f"bootstrap_ci takes 1-D values, got shape {x.shape}; use bootstrap_summary for frames.")
    _check_finite(x, "values")
    n = len(x)
    if statistic == "median":
        boot = np.median(x[_resample_indices(n, n_boot, seed)], axis=1)
        lo, hi = _percentiles(boot, ci)
        return Interval(float(np.median(x)), float(lo), float(hi), n)
    # Centre on the first value so that a constant sample resamples to exactly itself.
    shift = x[0]
    centred = x - shift
    boot = shift + resample_counts(n, n_boot=n_boot, seed=seed) @ centred / n
    lo, hi = _percentiles(boot, ci)
    return Interval(float(shift + centred.mean()), float(lo), float(hi), n)


# ---------------------------------------------------------------------------------------------
# Grouped (tidy-frame) versions


class _Groups:
    """A tidy frame's values as groups x units matrices of (centred) sums and row counts."""

    def __init__(self, frame: pd.DataFrame, value: str, by: Sequence[str], unit: str, units=None):
        missing = [c for c in [value, unit, *by] if c not in frame.columns]
        if missing:
            raise ValueError(f"The frame has no columns {missing}; it has {list(frame.columns)}.")
        if frame.empty:
            raise ValueError("No rows to bootstrap: the frame is empty.")
        values = frame[value].to_numpy(dtype=float)
        _check_finite(values, f"{value!r} values")
        if by:
            grouped = frame.groupby(list(by), sort=True, dropna=False)
            g = grouped.ngroup().to_numpy()
            self.keys = grouped.size().index.to_frame(index=False)
        else:
            g = np.zeros(len(frame), dtype=int)
            self.keys = pd.DataFrame(index=[0])
        if units is None:
            u, units = pd.factorize(frame[unit], sort=True)
        else:
            u = pd.Index(units).get_indexer(frame[unit])
        self.units = pd.Index(units)
        n_groups, n_units = len(self.keys), len(self.units)
        # First value of each group: subtracting it keeps a constant group exactly constant.
        _, first_row = np.unique(g, return_index=True)
        first = values[first_row]
        self.shift = first
        cell = g * n_units + u
        size = n_groups * n_units
        self.sums = np.bincount(cell, weights=values - first[g], minlength=size).reshape(n_groups, n_units)
        self.counts = np.bincount(cell, minlength=size).reshape(n_groups, n_units).astype(float)

    def present(self) -> np.ndarray:
        return self.counts > 0


def _shared_boot(parts: Sequence[_Groups], n_boot: int, seed: int) -> list[Float[np.ndarray, "n_groups n_boot"]]:
    """Bootstrap means of every group of each part; groups (in any part) with the same unit set
    use the same resamples."""
    present = parts[0].present()
    signatures, which = np.unique(present, axis=0, return_inverse=True)
    which = np.asarray(which).reshape(-1)
    out = [np.empty((len(p.keys), n_boot)) for p in parts]
    for s, signature in enumerate(signatures):
        cols = np.flatnonzero(signature)
        rows = np.flatnonzero(which == s)
        weights = resample_counts(len(cols), n_boot=n_boot, seed=seed).T.astype(float)  # units x n_boot
        for part, boot in zip(parts, out):
            sums = part.sums[np.ix_(rows, cols)] @ weights
            counts = part.counts[np.ix_(rows, cols)] @ weights
            boot[rows] = part.shift[rows, None] + sums / counts
    return out


def _point(part: _Groups) -> np.ndarray:
    return part.shift + part.sums.sum(1) / part.counts.sum(1)


def bootstrap_summary(
    frame: pd.DataFrame,
    *,
    value: str = "delta",
    by: Sequence[str] = (),
    unit: str = "example",
    n_boot: int = 2000,
    ci: float = 0.95,
    seed: int = 0,
) -> pd.DataFrame:
    """Mean of ``value`` per group of ``by`` with a percentile bootstrap interval over ``unit``.

    Returns one row per group: the ``by`` columns, ``mean``, ``ci_low``, ``ci_high`` and ``n``
    (the number of units in the group). All rows of a drawn unit enter the resample together,
    so ``mean`` is the plain mean of the group's rows. Groups with the same units share
    resamples (see the module docstring).
    """
    check_options(n_boot, ci)
    by = [by] if isinstance(by, str) else list(by)
    groups = _Groups(frame, value, by, unit)
    (boot,) = _shared_boot([groups], n_boot, seed)
    lo, hi = _percentiles(boot, ci)
    out = groups.keys.copy() if by else pd.DataFrame(index=[0])
    out["mean"], out["ci_low"], out["ci_high"] = _point(groups), lo, hi
    out["n"] = groups.present().sum(1)
    return out.reset_index(drop=True)


def sweep_intervals(sweep, *, n_boot: int = 2000, ci: float = 0.95, seed: int = 0) -> pd.DataFrame:
    """:func:`bootstrap_summary` of a sweep's ``delta`` over facts, grouped like its summary
    (condition labels x conflict type x target). ``sweep`` is a ``SweepResult`` or its
    ``per_example`` frame."""
    per = getattr(sweep, "per_example", sweep)
    fixed = {"example", "subject", "p_clean", "p", "delta"}
    by = [c for c in per.columns if c not in fixed]
    out = bootstrap_summary(per, value="delta", by=by, unit="example", n_boot=n_boot, ci=ci, seed=seed)
    out.attrs.update(per.attrs)  # e.g. which metric ``delta`` is a change of
    return out


# ---------------------------------------------------------------------------------------------
# Paired comparisons (two methods on the same facts)


def paired_bootstrap(
    a: Sequence[float] | np.ndarray | pd.Series,
    b: Sequence[float] | np.ndarray | pd.Series,
    *,
    n_boot: int = 2000,
    ci: float = 0.95,
    seed: int = 0,
) -> Interval:
    """Difference of means ``mean(a) - mean(b)`` of two methods scored on the same facts, with a
    paired percentile bootstrap interval (each resample draws facts, both methods keep them).

    Arrays are paired by position; Series by their index (which must hold the same facts).
    A method against itself gives exactly ``Interval(0, 0, 0, n)``.
    """
    check_options(n_boot, ci)
    if isinstance(a, pd.Series) and isinstance(b, pd.Series):
        if a.index.has_duplicates or b.index.has_duplicates:
            raise ValueError("Paired Series need one value per fact: their index has duplicates.")
        only_a, only_b = a.index.difference(b.index), b.index.difference(a.index)
        if len(only_a) or len(only_b):
            raise ValueError(
                f"The two methods were scored on different facts: {len(only_a)} only in the first "
                f"(e.g. {list(only_a[:3])}), {len(only_b)} only in the second (e.g. {list(only_b[:3])})."
            )
        b = b.reindex(a.index)
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if x.ndim != 1 or y.ndim != 1:
        raise ValueError(f"paired_bootstrap takes 1-D values, got shapes {x.shape} and {y.shape}.")
    if len(x) != len(y):
        raise ValueError(
            f"The two methods were scored on different facts: {len(x)} values vs {len(y)}; "
            "pair them by fact (pass Series indexed by fact, or paired_summary for frames)."
        )
    _check_finite(x, "first method's values")
    _check_finite(y, "second method's values")
    return bootstrap_ci(x - y, n_boot=n_boot, ci=ci, seed=seed)


def unpaired_difference(
    a: Sequence[float] | np.ndarray | pd.Series,
    b: Sequence[float] | np.ndarray | pd.Series,
    *,
    n_boot: int = 2000,
    ci: float = 0.95,
    seed: int = 0,
) -> Interval:
    """``mean(a) - mean(b)`` for two disjoint sets of facts, with a percentile bootstrap interval
    that resamples each set on its own (seeds ``seed`` and ``seed + 1``); ``n`` is ``len(a) + len(b)``."""
    check_options(n_boot, ci)
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if x.ndim != 1 or y.ndim != 1 or not len(x) or not len(y):
        raise ValueError(f"unpaired_difference takes two non-empty 1-D arrays, got shapes {x.shape} and {y.shape}.")
    _check_finite(x, "first set's values")
    _check_finite(y, "second set's values")
    boot = resample_counts(len(x), n_boot=n_boot, seed=seed) @ x / len(x)
    boot = boot - resample_counts(len(y), n_boot=n_boot, seed=seed + 1) @ y / len(y)
    lo, hi = np.quantile(boot, [(1 - ci) / 2, (1 + ci) / 2])
    return Interval(float(x.mean() - y.mean()), float(lo), float(hi), len(x) + len(y))


def paired_summary(
    frame: pd.DataFrame,
    *,
    a: str,
    b: str,
    by: Sequence[str] = (),
    method: str = "method",
    value: str = "delta",
    unit: str = "example",
    n_boot: int = 2000,
    ci: float = 0.95,
    seed: int = 0,
) -> pd.DataFrame:
    """Compare methods ``a`` and ``b`` (values of column ``method``) per group of ``by``.

    Returns the ``by`` columns, ``mean_a``, ``mean_b``, ``diff = mean_a - mean_b``, its interval
    ``ci_low, ci_high`` and ``n`` (facts). Both methods are resampled with the same facts;
    each group must hold the same facts under both methods, else a ``ValueError`` names them.
    """
    check_options(n_boot, ci)
    by = [by] if isinstance(by, str) else list(by)
    if method not in frame.columns:
        raise ValueError(f"The frame has no column {method!r}; it has {list(frame.columns)}.")
    rows = {name: frame[frame[method] == name] for name in (a, b)}
    for name, part in rows.items():
        if part.empty:
            raise ValueError(f"No rows with {method} == {name!r}; it has {sorted(frame[method].unique())}.")
    units = pd.Index(sorted(pd.unique(pd.concat([rows[a][unit], rows[b][unit]]))))
    part_a = _Groups(rows[a], value, by, unit, units)
    part_b = _Groups(rows[b], value, by, unit, units)
    if not part_a.keys.equals(part_b.keys):
        raise ValueError(f"Methods {a!r} and {b!r} cover different groups of {by}.")
    differ = (part_a.present() != part_b.present()).any(1)
    if differ.any():
        key = part_a.keys.iloc[int(np.flatnonzero(differ)[0])].to_dict() if by else {}
        only_a = units[part_a.present()[differ][0] & ~part_b.present()[differ][0]].tolist()
        only_b = units[part_b.present()[differ][0] & ~part_a.present()[differ][0]].tolist()
        raise ValueError(
            f"Methods {a!r} and {b!r} were scored on different facts in {int(differ.sum())} group(s), "
            f"e.g. {key}: only under {a!r}: {only_a[:5]}, only under {b!r}: {only_b[:5]}."
        )
    boot_a, boot_b = _shared_boot([part_a, part_b], n_boot, seed)
    lo, hi = _percentiles(boot_a - boot_b, ci)
    out = part_a.keys.copy() if by else pd.DataFrame(index=[0])
    out["mean_a"], out["mean_b"] = _point(part_a), _point(part_b)
    out["diff"] = out["mean_a"] - out["mean_b"]
    out["ci_low"], out["ci_high"], out["n"] = lo, hi, part_a.present().sum(1)
    return out.reset_index(drop=True)


# ---------------------------------------------------------------------------------------------
# Text


def macro_average_ci(
    frame: pd.DataFrame,
    *,
    value: str,
    stratum: str,
    unit: str = "example",
    n_boot: int = 2000,
    ci: float = 0.95,
    seed: int = 0,
) -> tuple[float, float, float, int]:
    """Mean over strata (e.g. relations) of each stratum's mean ``value``, with a bootstrap that
    resamples units within each stratum, so every stratum keeps its weight (the papers' average
    over relations). Returns ``(mean, ci_low, ci_high, n units)``; one row per unit and stratum."""
    check_options(n_boot, ci)
    means, boots, n = [], [], 0
    for _, part in frame.groupby(stratum, sort=True):
        values = part.sort_values(unit)[value].to_numpy(dtype=float)
        _check_finite(values, value)
        counts = resample_counts(len(values), n_boot=n_boot, seed=seed)
        means.append(values.mean())
        boots.append(counts @ values / len(values))
        n += len(values)
    if not means:
        raise ValueError("No rows to average.")
    lo, hi = _percentiles(np.mean(boots, axis=0), ci)
    return float(np.mean(means)), float(lo), float(hi), n


def format_ci(mean: float, lo: float, hi: float, *, digits: int = 2) -> str:
    """``"0.53 [0.37, 0.70]"``: an estimate and its interval, rounded to ``digits`` decimals."""

    def fmt(x: float) -> str:
        text = f"{x:.{digits}f}"
        return text[1:] if text.startswith("-") and float(text) == 0 else text  # no "-0.00"

    return f"{fmt(mean)} [{fmt(lo)}, {fmt(hi)}]"


def ci_strings(
    frame: pd.DataFrame,
    *,
    mean: str = "mean",
    low: str = "ci_low",
    high: str = "ci_high",
    digits: int = 2,
) -> pd.Series:
    """:func:`format_ci` for every row of a frame (e.g. the output of :func:`bootstrap_summary`)."""
    return pd.Series(
        [format_ci(m, l, h, digits=digits) for m, l, h in zip(frame[mean], frame[low], frame[high])],
        index=frame.index,
        dtype=object,
    )
