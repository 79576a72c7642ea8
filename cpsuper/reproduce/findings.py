"""What the report says it found: per section, what the paper reports and what this run shows.

Each ``*_findings`` function turns one step's result into :class:`Finding` lines computed from
the numbers (never written by hand): the paper's claim, this run's estimate with its bootstrap
interval over facts and the number of facts, and a verdict. A verdict is ``"agrees"`` when the
run's interval supports the paper's claim, ``"inconclusive"`` when it does not but fewer than
:data:`SMALL_N` facts stand behind it, ``"differs"`` otherwise, and ``"no comparison"`` where
the paper makes no claim to test. :func:`accuracy_table` is Table 3 with intervals.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from cpsuper.baselines import evaluation_intervals
from cpsuper.data.examples import CONFLICT_TYPES
from cpsuper.stats import bootstrap_summary, format_ci, paired_summary

__all__ = [
    "SMALL_N",
    "Finding",
    "accuracy_table",
    "attention_findings",
    "combine_findings",
    "dla_findings",
    "evaluation_findings",
    "knockout_findings",
    "superposition_findings",
    "table1_findings",
]

SMALL_N = 10
"""Fewer facts than this behind a statement and the report shows a small-sample warning."""
N_BOOT = 2000
SEED = 0


@dataclass(frozen=True)
class Finding:
    """One "the paper reports / this run shows" statement about ``n`` facts; ``smallest`` is the
    number of facts in its smallest cell where it pools several (e.g. relations)."""

    paper: str
    run: str
    verdict: str
    n: int
    smallest: int | None = None

    @property
    def small(self) -> bool:
        return min(self.n, self.n if self.smallest is None else self.smallest) < SMALL_N


def _verdict(supported: bool, n: int) -> str:
    """``agrees`` / ``differs``, or ``inconclusive`` when a failed check rests on few facts
    (``partly`` is given where a claim's main part holds and another does not)."""
    if supported:
        return "agrees"
    return "inconclusive" if n < SMALL_N else "differs"


def _ci(row, *, mean: str = "mean", digits: int = 3) -> str:
    return format_ci(row[mean], row["ci_low"], row["ci_high"], digits=digits)


def _signed(mean: float, low: float, high: float, *, digits: int = 3) -> str:
    """``+0.120 [0.010, 0.300]``: an effect with its sign spelled out."""
    text = format_ci(mean, low, high, digits=digits)
    return text if text.startswith("-") else "+" + text


def _signed_ci(row, *, mean: str = "mean", digits: int = 3) -> str:
    return _signed(row[mean], row["ci_low"], row["ci_high"], digits=digits)


def _n_facts(frame: pd.DataFrame) -> int:
    return int(frame["example"].nunique())


def knockout_findings(per_example: pd.DataFrame) -> list[Finding]:
    """Figure 3: the largest gain in the true answer from one module's knockout, per conflict type."""
    rows = per_example[per_example.conflict_type.isin(["substitution", "coherent"])]
    if "target" in rows:
        rows = rows[rows.target == "parametric"]
    n = _n_facts(rows)
    stats = bootstrap_summary(rows, value="delta", by=["conflict_type", "module", "layer"], n_boot=N_BOOT, seed=SEED)
    parts, supported = [], True
    for conflict_type in ("substitution", "coherent"):
        best = stats[stats.conflict_type == conflict_type].sort_values("mean", ascending=False).iloc[0]
        supported &= bool(best.ci_low > 0)
        parts.append(f"{conflict_type}: {best.module} layer {int(best.layer)} {_signed_ci(best)}")
    return [
        Finding(
            "knocking out single attention or MLP modules raises the true answer's probability under substitution "
            "and under coherent conflicts, with effects that differ between the conflict types (on Gemma-2B, 6 "
            "attention modules, 1 MLP and no whole layer of 26 help under all three conflict types).",
            f"the largest gain in p(true answer) from one knockout, mean change [95% interval] over {n} facts: "
            + "; ".join(parts)
            + ". The paper's pattern needs an interval above 0 under both conflict types.",
            _verdict(supported, n),
            n,
        )
    ]


def superposition_findings(superposed: pd.DataFrame, n: int) -> list[Finding]:
    """Superposition: heads whose knockout moves the true answer in opposite directions."""
    flips = superposed[superposed["superposed"].astype(bool)] if "superposed" in superposed else superposed[:0]
    sure = flips[
        ((flips.ci_low_substitution > 0) | (flips.ci_high_substitution < 0))
        & ((flips.ci_low_coherent > 0) | (flips.ci_high_coherent < 0))
    ]
    example = ""
    pool = flips if len(flips) else superposed
    if len(pool):
        top = pool.sort_values("strength", ascending=False).iloc[0]
        effect = {
            ct: _signed(top[f"delta_{ct}"], top[f"ci_low_{ct}"], top[f"ci_high_{ct}"])
            for ct in ("substitution", "coherent")
        }
        example = (
            f" {'Strongest flip' if len(flips) else 'Strongest head (no flip)'}: L{int(top.layer)}H{int(top['head'])}, "
            f"change in p(true answer) substitution {effect['substitution']}, coherent {effect['coherent']}."
        )
    return [
        Finding(
            "memory and context are superposed in the same heads: knocking out one head moves the true answer "
            "in opposite directions under substitution and coherent conflicts (Figure 1).",
            f"{len(flips)} of {len(superposed)} heads flip sign (|effect| > 0.001 under both); for {len(sure)} of "
            f"them both 95% intervals over {n} facts exclude 0.{example}",
            _verdict(len(sure) > 0, n),
            n,
        )
    ]


def table1_findings(
    per_example: pd.DataFrame, heads: Sequence[tuple[int, int]], *, alpha: float = 0.0
) -> list[Finding]:
    """Table 1: whether the top memory heads' effect on the context answer reverses under coherent conflicts."""
    rows = per_example[(per_example.alpha == alpha) & (per_example.target == "context")]
    wanted = set(map(tuple, heads))
    rows = rows[[(int(l), int(h)) in wanted for l, h in zip(rows.layer, rows["head"])]]
    rows = rows[rows.conflict_type.isin(["substitution", "coherent"])]
    n = _n_facts(rows)
    stats = bootstrap_summary(rows, value="delta", by=["layer", "head", "conflict_type"], n_boot=N_BOOT, seed=SEED)
    flips, sure, parts = 0, 0, []
    for layer, head in heads:
        s = stats[(stats.layer == layer) & (stats["head"] == head)].set_index("conflict_type")
        sub, coh = s.loc["substitution"], s.loc["coherent"]
        if np.sign(sub["mean"]) != np.sign(coh["mean"]):
            flips += 1
            sure += bool((sub.ci_low > 0 or sub.ci_high < 0) and (coh.ci_low > 0 or coh.ci_high < 0))
        parts.append(f"L{layer}H{head} {_signed_ci(sub)} / {_signed_ci(coh)}")
    return [
        Finding(
            "some of the top memory heads (knockout raises the context answer under substitution conflicts) "
            "have the opposite effect under coherent conflicts.",
            f"{flips} of {len(heads)} top heads reverse the sign of their context effect ({sure} with both "
            f"intervals excluding 0). Change in p(context answer), substitution / coherent, over {n} facts: "
            + "; ".join(parts)
            + ".",
            _verdict(sure > 0, n),
            n,
        )
    ]


def combine_findings(table2: pd.DataFrame, fig6: pd.DataFrame) -> list[Finding]:
    """Table 2 (do top-k knockouts add up?) and Figure 6 (run twice vs run once at the largest k)."""
    n = _n_facts(table2)
    stats = bootstrap_summary(table2, value="p", by=["k"], n_boot=N_BOOT, seed=SEED).sort_values("k")
    ks = stats[stats.k > 0]
    counteract = len(ks) > 1 and ks["mean"].iloc[-1] < ks["mean"].iloc[:-1].max()
    cells = "; ".join(f"k = {int(r.k)}: {_ci(r)}" for _, r in stats.iterrows())
    findings = [
        Finding(
            "individually helpful knockouts counteract when combined: p(true answer) 0.03 unmodified, 0.12 / "
            "0.24 / 0.14 with the top 1 / 3 / 10 heads knocked out together (Table 2).",
            f"p(true answer) with the top-k heads knocked out on {n} held-out facts: {cells}. "
            + (
                "The largest k is below a smaller k: the gains do not add up."
                if counteract
                else "The largest k is not below the smaller ones."
            ),
            _verdict(bool(counteract), n),
            n,
        )
    ]
    k = int(fig6.k.max())
    pair = paired_summary(fig6[fig6.k == k], a="run twice", b="run once", value="p", n_boot=N_BOOT, seed=SEED).iloc[0]
    findings.append(
        Finding(
            "running the model twice (subtracting the heads' clean outputs) keeps helping as heads are added, "
            "where scaling them in one pass does not (Figure 6).",
            f"at k = {k}, p(true answer) run twice {pair.mean_a:.3f} vs run once {pair.mean_b:.3f}: difference "
            f"{_signed_ci(pair, mean='diff')} over {int(pair.n)} facts.",
            _verdict(bool(pair.ci_low > 0), int(pair.n)),
            int(pair.n),
        )
    )
    return findings


def evaluation_findings(results: pd.DataFrame) -> list[Finding]:
    """Table 3: JuICE against the unmodified model, per conflict type, facts pooled over relations."""
    n = int(results[["relation", "example"]].drop_duplicates().shape[0])
    if "JuICE" not in set(results.method):
        return [
            Finding(
                "JuICE reaches the highest accuracy toward memory under both conflict types.",
                "JuICE could not be fitted in this run, so there is nothing to compare.",
                "no comparison",
                n,
            )
        ]
    units = results.assign(fact=results.relation + ":" + results.example.astype(str))
    pair = paired_summary(
        units, a="JuICE", b="Original", value="correct", by=["conflict_type"], unit="fact", n_boot=N_BOOT, seed=SEED
    ).set_index("conflict_type")
    parts = [
        f"{ct}: JuICE {pair.loc[ct, 'mean_a']:.2f} vs Original {pair.loc[ct, 'mean_b']:.2f}, "
        f"difference {_signed_ci(pair.loc[ct], mean='diff', digits=2)}"
        for ct in CONFLICT_TYPES
        if ct in pair.index
    ]
    conflicts = ("substitution", "coherent")
    gains = all(ct in pair.index and pair.loc[ct, "ci_low"] > 0 for ct in conflicts)
    failed = _table3_shortfalls(units, pair, conflicts)
    verdict = _verdict(gains, n) if not (gains and failed) else "partly"
    run = f"over {n} held-out facts of {results.relation.nunique()} relations (pooled; paired bootstrap over facts): "
    run += "; ".join(parts) + "."
    if gains and failed:
        run += " But " + "; ".join(failed) + "."
    return [
        Finding(
            "JuICE raises greedy accuracy toward memory well above the unmodified model under substitution and "
            "coherent conflicts, on every relation, while keeping clean accuracy, and beats every other method "
            "(Table 3).",
            run,
            verdict,
            n,
            int(results.groupby("relation").example.nunique().min()),
        )
    ]


def _table3_shortfalls(units: pd.DataFrame, pair: pd.DataFrame, conflicts: Sequence[str]) -> list[str]:
    """The parts of Table 3's claim beyond the pooled gain that this run does not show: clean
    accuracy lost (the paired interval lies below 0), a relation where JuICE does not gain on a
    conflict type, another method ahead of JuICE on a conflict type."""
    out = []
    if "clean" in pair.index and pair.loc["clean", "ci_high"] < 0:
        out.append(f"JuICE loses clean accuracy ({_signed_ci(pair.loc['clean'], mean='diff', digits=2)})")
    means = units.groupby(["relation", "conflict_type", "method"]).correct.mean().unstack("method")
    for ct in conflicts:
        rows = means.xs(ct, level="conflict_type") if ct in means.index.get_level_values("conflict_type") else None
        if rows is None:
            continue
        flat = [r for r, row in rows.iterrows() if not row["JuICE"] > row["Original"]]
        if flat:
            out.append(f"no {ct} gain on {', '.join(flat)}")
        pooled = units[units.conflict_type == ct].groupby("method").correct.mean()
        ahead = [f"{m} ({pooled[m]:.2f})" for m in pooled.index if m != "JuICE" and pooled[m] > pooled["JuICE"]]
        if ahead:
            out.append(f"on {ct} prompts {', '.join(ahead)} beat JuICE ({pooled['JuICE']:.2f})")
    return out


def dla_findings(categories: pd.DataFrame, n: int) -> list[Finding]:
    """DLA: which sources the shown heads read the answer from."""
    counts = categories.drop_duplicates(["layer", "head", "conflict_type"]).category.value_counts()
    readers = int(counts.reindex(["subject", "relation", "mixed"]).fillna(0).sum())
    text = ", ".join(f"{c} {int(k)}" for c, k in counts.items()) or "no heads"
    return [
        Finding(
            "(Chughtai et al., additive mechanisms) heads push the answer from the subject, from the relation, or "
            "from both at once (mixed heads).",
            f"categories of the heads shown, over both conflict types and {n} facts: {text} "
            f"({readers} read from the subject or the relation). A count of heads, not an estimate with an interval; "
            "the JuICE paper itself makes no claim here.",
            "no comparison",
            n,
        )
    ]


def attention_findings(per_example: pd.DataFrame) -> list[Finding]:
    """Attention from the final token to the context: substitution vs coherent conflicts, per fact."""
    per_fact = per_example.groupby(["example", "conflict_type"], as_index=False).attention.mean()
    per_fact = per_fact[per_fact.conflict_type.isin(["substitution", "coherent"])]
    n = _n_facts(per_fact)
    pair = paired_summary(
        per_fact, a="substitution", b="coherent", method="conflict_type", value="attention", n_boot=N_BOOT, seed=SEED
    ).iloc[0]
    return [
        Finding(
            "no attention figure in the JuICE paper; shown as a diagnostic of where the final token reads.",
            f"attention mass on the context, mean over layers and heads: substitution {pair.mean_a:.3f}, coherent "
            f"{pair.mean_b:.3f}, difference {_signed_ci(pair, mean='diff')} over {n} facts.",
            "no comparison",
            n,
        )
    ]


def accuracy_table(results: pd.DataFrame, relations: Sequence[str], methods: Sequence[str]) -> pd.DataFrame:
    """Table 3 with intervals: one row per (conflict type, relation), the average over relations
    first, then ``relations`` in order; one column per method in ``methods`` order, each cell
    ``"0.53 [0.37, 0.70]"``; ``facts`` is the number of facts behind the row."""
    stats = evaluation_intervals(results, n_boot=N_BOOT, seed=SEED)
    methods = [m for m in methods if m in set(results.method)]
    rows = []
    for ct in [c for c in CONFLICT_TYPES if c in set(results.conflict_type)]:
        for relation in ["average", *relations]:
            row = {
                "conflict": ct,
                "relation": "average over relations" if relation == "average" else relation,
                "facts": 0,
            }
            cells = stats[(stats.conflict_type == ct) & (stats.relation == relation)].set_index("method")
            for method in methods:
                if method in cells.index:
                    row[method] = _ci(cells.loc[method], digits=2)
                    row["facts"] = max(row["facts"], int(cells.loc[method, "n"]))
            rows.append(row)
    return pd.DataFrame(rows, columns=["conflict", "relation", "facts", *methods]).fillna("")
