"""From step results to files: every result as CSV / JSON, the fitted JuICE and ``report.html``.

Each ``*_section`` function writes its section's files and returns what the template's macro
of the same name shows; prose lives in the template, numbers and tables come from here.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pandas as pd
from markupsafe import Markup

import cpsuper as cp

from . import findings as found
from .render import Figures, heads_text, render_report, table_html
from .settings import ANALYSIS_RELATION, METHOD_ORDER
from .steps import Run

__all__ = ["SECTIONS", "write_outputs"]

SECTIONS = (
    ("facts", "1. Facts the model knows"),
    ("knockouts", "2. Figure 3: module knockouts by conflict type"),
    ("heatmaps", "3. Superposition heatmaps"),
    ("table1", "4. Table 1: memory heads that flip"),
    ("combine", "5. Table 2 and Figure 6: combining heads"),
    ("juice", "6. JuICE and Table 3: steering toward memory"),
    ("dla", "7. Where the JuICE heads read from: source-token DLA"),
    ("attention", "8. Attention from the final token to the subject and to the context"),
    ("explorer", "9. Head explorer"),
)
"""Anchor and heading of each report section, in page order."""


class _Files:
    """Writes result files into the output folder and remembers their names."""

    def __init__(self, out: Path):
        self.out, self.names = out, []

    def csv(self, frame: pd.DataFrame, name: str) -> None:
        frame.to_csv(self.out / name, index=False)
        self.names.append(name)

    def text(self, text: str, name: str) -> None:
        (self.out / name).write_text(text)
        self.names.append(name)


def facts_section(run: Run, files: _Files, figure: Figures) -> dict:
    facts = run.results["facts"]
    files.csv(facts["table"], "facts.csv")
    counts = (
        facts["table"]
        .groupby("relation", sort=False)
        .agg(sampled=("subject", "size"), known=("known", "sum"), used=("used", "first"))
        .reset_index()
    )
    counts["used facts"] = [len(facts["used"][rel]) for rel in counts.relation]
    n = len(run.analysis)
    finding = found.Finding(
        "its analyses on facts the model knows: the greedy answer to the clean prompt is right.",
        f"the model knows {int(counts.known.sum())} of {int(counts.sampled.sum())} sampled facts; the per-head "
        f"analyses use {n} {ANALYSIS_RELATION} facts.",
        "no comparison",
        n,
    )
    return {
        "table": table_html(counts),
        "n_analysis": run.settings.n_analysis,
        "relation": ANALYSIS_RELATION,
        "findings": [finding],
    }


def knockouts_section(run: Run, files: _Files, figure: Figures) -> dict:
    ko = run.results["knockouts"]
    files.csv(ko.summary, "figure3_knockouts.csv")
    files.csv(ko.per_example, "figure3_knockouts_per_example.csv")
    gains = cp.knockouts.consistent_gains(ko)
    files.csv(gains, "figure3_consistent_gains.csv")
    return {
        "figure": figure(cp.plots.plot_knockouts(ko), "knockouts"),
        "gains": table_html(gains),
        "n": int(ko.per_example.example.nunique()),
        "findings": found.knockout_findings(ko.per_example),
    }


def heatmaps_section(run: Run, files: _Files, figure: Figures) -> dict:
    hs = run.results["head_sweep"]
    files.csv(hs.summary, "head_sweep.csv")
    files.csv(hs.per_example, "head_sweep_per_example.csv")
    heatmap = cp.plots.plot_head_heatmap(hs, alpha=0.0)
    heatmap.update_layout(height=2 * max(270, 16 * hs.summary.layer.nunique() + 70))
    heatmap = figure(heatmap, "head_heatmap")
    sup = cp.superposition_heads(hs, alpha=0.0, target="parametric", min_effect=1e-3)
    files.csv(sup, "superposition_heads.csv")
    n_superposed = int(sup["superposed"].sum()) if "superposed" in sup else 0
    n = int(hs.per_example.example.nunique())
    return {
        "heatmap": heatmap,
        "n_superposed": n_superposed,
        "n_heads": len(sup),
        "scatter": figure(cp.plots.plot_superposition(sup), "superposition"),
        "n": n,
        "findings": found.superposition_findings(sup, n),
    }


def table1_section(run: Run, files: _Files, figure: Figures) -> dict:
    hs = run.results["head_sweep"]
    table1 = cp.rank_heads(hs, k=4)
    flat = table1.copy()
    flat.columns = ["_".join(map(str, c)).strip("_") if isinstance(c, tuple) else c for c in flat.columns]
    files.csv(flat, "table1_memory_heads.csv")
    heads = [(int(l), int(h)) for l, h in zip(table1.layer, table1["head"])]
    return {
        "table": Markup(cp.plots.style_head_table(table1).set_uuid("table1").to_html()),  # stable ids
        "n": int(hs.per_example.example.nunique()),
        "findings": found.table1_findings(hs.per_example, heads),
    }


def combine_section(run: Run, files: _Files, figure: Figures) -> dict:
    comb = run.results["combine"]
    if "skipped" in comb:
        return {"skipped": comb["skipped"]}
    files.csv(comb["ranking"], "table2_ranking.csv")
    t2 = comb["table2"].summary
    files.csv(t2, "table2_cumulative_knockout.csv")
    files.csv(comb["fig6"].summary, "figure6_run_once_vs_twice.csv")
    view = t2[["k", "heads", "p", "delta_mean", "n"]].rename(
        columns={"p": "p(true answer)", "delta_mean": "change", "n": "facts"}
    )
    return {
        "skipped": None,
        "n_select": len(run.parts.select),
        "n_test": len(run.parts.test),
        "table": table_html(view),
        "figure": figure(cp.plots.plot_run_once_vs_twice(comb["fig6"]), "run_once_vs_twice"),
        "n": int(comb["fig6"].per_example.example.nunique()),
        "findings": found.combine_findings(comb["table2"].per_example, comb["fig6"].per_example),
    }


def juice_section(run: Run, files: _Files, figure: Figures) -> dict:
    juice, ev = run.results["juice"], run.results["evaluation"]
    out: dict = {"skipped": juice.get("skipped"), "relation": ANALYSIS_RELATION}
    if "skipped" not in juice:
        files.text(juice["json"], "juice.json")
        files.csv(juice["tuning"], "juice_beta_tuning.csv")
        c = juice["config"]
        out.update(
            n_select=len(c["fitted_on"].get("selection", [])),
            n_validation=len(c["fitted_on"].get("validation", [])),
            recipe=c["fitted_on"].get("recipe", "paper"),
            enhance=heads_text(c["enhance"]),
            suppress=heads_text(c["suppress"]),
            beta_plus=f"{c['beta_plus']:+g}",
            beta_minus=f"{c['beta_minus']:+g}",
            k=c["k"],
            pos_grid=c["pos_grid"],
            neg_grid=c["neg_grid"],
            steers=c.get("steers", True),
            context_gate=c.get("context_gate"),
            not_steering=c["fitted_on"].get("not_steering"),
        )
    results = ev["results"]
    files.csv(results, "table3_per_example.csv")
    files.text(json.dumps(ev["ph3"], indent=1), "ph3.json")
    table3 = cp.evaluation_table(results)
    table3 = table3.reindex([m for m in METHOD_ORDER if m in table3.index])
    flat = table3.copy()
    flat.columns = [f"{a}_{b}" for a, b in flat.columns]
    files.csv(flat.reset_index(), "table3_evaluation.csv")
    relations = [r for r in dict.fromkeys([ANALYSIS_RELATION, *run.relations]) if r in set(results.relation)]
    intervals = found.accuracy_table(results, relations, METHOD_ORDER)
    files.csv(intervals, "table3_intervals.csv")
    paper = ev.get("results_paper")
    if paper is not None and len(paper):
        files.csv(paper, "table3_paper_protocol_per_example.csv")
        paper_intervals = found.accuracy_table(paper, relations, METHOD_ORDER)
        files.csv(paper_intervals, "table3_paper_protocol_intervals.csv")
        paper_sizes = paper.groupby("relation").example.nunique()
        out.update(
            paper_table=table_html(paper_intervals),
            paper_sizes=", ".join(f"{rel} {paper_sizes[rel]}" for rel in relations if rel in paper_sizes),
        )
    sizes = results.groupby("relation").example.nunique()
    out.update(
        sizes=", ".join(f"{rel} {sizes[rel]}" for rel in relations),
        max_new_tokens=run.settings.max_new_tokens,
        ph3_heads=heads_text(ev["ph3"]["heads"]),
        table=table_html(intervals),
        n=int(results[["relation", "example"]].drop_duplicates().shape[0]),
        findings=found.evaluation_findings(results),
    )
    return out


def dla_section(run: Run, files: _Files, figure: Figures) -> dict:
    att, juice = run.results["attribution"], run.results["juice"]
    files.csv(att.head_sources(), "dla_head_sources.csv")
    files.csv(att.components, "dla_components.csv")
    heads = [] if "skipped" in juice else [tuple(h) for h in juice["config"]["enhance"] + juice["config"]["suppress"]]
    if heads:
        mask = [(l, h) in set(heads) for l, h in zip(att.sources.layer, att.sources["head"])]
        shown, top_k = dataclasses.replace(att, sources=att.sources[mask]), len(heads)
    else:
        shown, top_k = att, 10
    figures = [
        figure(
            cp.plots.plot_head_sources(shown, conflict_type=ct, direction="parametric-context", top_k=top_k),
            f"dla_{ct}",
        )
        for ct in ("substitution", "coherent")
    ]
    cats = pd.concat(
        [cp.head_categories(att, conflict_type=ct) for ct in ("substitution", "coherent")], ignore_index=True
    )
    files.csv(cats, "head_categories.csv")
    if heads:
        cats = cats[[(l, h) in set(heads) for l, h in zip(cats.layer, cats["head"])]]
    n = len(run.analysis)
    return {
        "heads": heads_text(heads) if heads else None,
        "figures": figures,
        "categories": table_html(cats.drop(columns=["direction"])),
        "n": n,
        "findings": found.dla_findings(cats, n),
    }


def attention_section(run: Run, files: _Files, figure: Figures) -> dict:
    shown = []
    attention = run.results["attention"]
    for span, result in attention.items():
        files.csv(result.by_layer(), f"attention_{span}_by_layer.csv")
        files.csv(result.by_head(), f"attention_{span}_by_head.csv")
        shown.append({"span": span, "figure": figure(cp.plots.plot_attention_by_layer(result), f"attention_{span}")})
    per_example = attention["context"].per_example
    return {
        "spans": shown,
        "n": int(per_example.example.nunique()),
        "findings": found.attention_findings(per_example),
    }


def explorer_section(run: Run, files: _Files, figure: Figures) -> dict:
    """``explorer.html``: the linked head explorer as one offline page (plotly.js inlined)."""
    cp.write_explorer_page(
        files.out / "explorer.html", run.results["explorer"], title=f"Head explorer: {run.model_name}"
    )
    files.names.append("explorer.html")
    data = run.results["explorer"]
    return {"file": "explorer.html", "n_facts": data["n_facts"], "alphas": data["alphas"]}


_BUILDERS = {
    "facts": facts_section,
    "knockouts": knockouts_section,
    "heatmaps": heatmaps_section,
    "table1": table1_section,
    "combine": combine_section,
    "juice": juice_section,
    "dla": dla_section,
    "attention": attention_section,
    "explorer": explorer_section,
}


def _notes(run: Run) -> list[str]:
    """Highlighted at the top of the report: fallbacks, skipped analyses, empty Table 3 cells."""
    r = run.results
    notes = list(r["facts"]["notes"])
    if "skipped" in r["combine"]:
        notes.append(f"Table 2 / Figure 6 skipped: {r['combine']['skipped']}")
    if "skipped" in r["juice"]:
        notes.append(f"JuICE could not be fitted: {r['juice']['skipped']} JuICE and JuNe are missing from Table 3.")
    notes += [f"Table 3 cell left empty: {msg}" for msg in r["evaluation"].get("skipped", [])]
    return notes


def write_outputs(run: Run, meta: dict, out: Path, *, export: tuple[str, ...] = ()) -> Path:
    """Write every result file, ``manifest.json`` and ``report.html``; return the report's path.

    ``export``: formats (``svg``, ``pdf``, ``png``) in which every figure of the report is also
    written, in the paper style, as ``OUT/figures/NN_name.FORMAT``."""
    files, figure = _Files(out), Figures()
    sections = {name: _BUILDERS[name](run, files, figure) for name, _ in SECTIONS}
    exported = {out / "figures" / stem: fig for stem, fig in figure.kept.items()} if export else {}
    figure_files = [f"figures/{path.name}.{fmt}" for path in exported for fmt in export]
    meta["notes"] = _notes(run)
    meta["files"] = sorted([*files.names, *figure_files, "report.html", "manifest.json"])
    meta["export"] = list(export)
    meta["n_figures"] = figure.count
    (out / "manifest.json").write_text(json.dumps(meta, indent=1, default=str))
    steps = pd.DataFrame(meta["steps"])[["title", "status", "seconds", "cpu_seconds"]].rename(
        columns={"title": "step", "seconds": "wall s", "cpu_seconds": "CPU s"}
    )
    page = render_report(
        meta=meta,
        steps=table_html(steps, floatfmt="{:.1f}"),
        sections=SECTIONS,
        small_n=found.SMALL_N,
        total_wall=sum(s["seconds"] for s in meta["steps"]),
        total_cpu=sum(s["cpu_seconds"] for s in meta["steps"]),
        **sections,
    )
    (out / "report.html").write_text(page, encoding="utf-8")
    if exported:
        from cpsuper.plots.export import save_figures

        save_figures(exported, formats=export)
    return out / "report.html"
