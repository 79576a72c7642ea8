"""The steps of ``cpsuper reproduce``: each computes one analysis of the paper from a :class:`Run`.

A step returns data only (DataFrames, result objects, JSON values; a JuICE as its ``to_dict()``)
so that :class:`~cpsuper.reproduce.cache.StepCache` can store it without pickling. ``needs``
names the steps whose results it reads; their cache keys are part of its own.
"""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

import cpsuper as cp

from ..explore import explorer_data
from .settings import ANALYSIS_RELATION, Settings

__all__ = ["STEPS", "Run", "Step", "evaluation_datasets"]


@dataclass
class Run:
    """What the steps share: the arguments, the results so far and the model, loaded on first use."""

    model_name: str
    relations: list[str]
    settings: Settings
    seed: int
    device: str | None
    progress: bool
    dtype: str = "float32"
    results: dict = field(default_factory=dict)
    model_loaded: bool = False
    _model: object = None

    @property
    def model(self):
        if self._model is None:
            self._model = cp.load_model(self.model_name, device=self.device, dtype=getattr(torch, self.dtype))
            self.model_loaded = True
        return self._model

    @property
    def facts(self) -> dict:
        return self.results["facts"]

    @property
    def analysis(self) -> cp.ConflictDataset:
        """Facts of the analysis relation for the sweeps, DLA and attention."""
        return self.facts["used"][ANALYSIS_RELATION][: self.settings.n_analysis]

    @property
    def parts(self):
        """Selection / validation / held-out split of the analysis relation's facts."""
        s = self.settings
        parts = cp.split(
            self.facts["used"][ANALYSIS_RELATION], n_select=s.n_select, n_validation=s.n_validation, seed=self.seed
        )
        return parts._replace(test=parts.test[: s.max_test])


@dataclass(frozen=True)
class Step:
    """One cached step: ``fn(run)`` computes its result; ``needs`` lists the steps it reads and
    ``uses`` the helper functions it calls (their source is part of its cache key, as is ``fn``'s)."""

    name: str
    title: str
    fn: Callable[[Run], object]
    needs: tuple[str, ...] = ()
    uses: tuple[Callable, ...] = ()


def facts_step(run: Run) -> dict:
    """Sample facts per relation and keep those the model answers correctly on clean prompts."""
    s = run.settings
    relations = list(dict.fromkeys([ANALYSIS_RELATION, *run.relations]))
    sampled, known, used, rows, short = {}, {}, {}, [], []
    need = {r: (s.n_select + s.n_validation + 1 if r == ANALYSIS_RELATION else 1) for r in relations}
    for relation in relations:
        sampled[relation] = cp.conflict_dataset(relation, n=s.n_examples, seed=run.seed, tokenizer=run.model)
    # Every relation's clean prompts decode in the same batches (cp.filter_known, pooled).
    pooled = cp.ConflictDataset([e for r in relations for e in sampled[r]], "all relations")
    flags = iter(cp.scoring.known_facts(run.model, pooled, batch_size=s.batch_size, progress=run.progress))
    for relation in relations:
        data = sampled[relation]
        keep = [i for i, _ in enumerate(data) if next(flags)]
        kept = data[keep] if keep else None  # None: the model knows none of them
        known_subjects = set() if kept is None else {e.subject for e in kept}
        known[relation] = kept
        if kept is not None and len(kept) >= need[relation]:
            used[relation], status = kept, "known facts"
        else:
            used[relation], status = data, "UNFILTERED (too few known facts)"
            short.append(f"{relation} ({len(known_subjects)} of {len(data)} known, {need[relation]} needed)")
        rows += [
            {
                "relation": relation,
                "subject": e.subject,
                "answer": e.answer,
                "context_answer": e.context_answer,
                "known": e.subject in known_subjects,
                "used": status,
            }
            for e in data
        ]
    notes = []
    if short:
        notes.append(
            "The model knows too few of the sampled facts of " + ", ".join(short) + ". For these relations the "
            "analyses use all sampled facts, unfiltered: their accuracies and effects are not about facts the "
            "model knows (expected for a random test model; with a real model, sample more with --n-examples)."
        )
    return {"sampled": sampled, "known": known, "used": used, "table": pd.DataFrame(rows), "notes": notes}


def knockouts_step(run: Run) -> cp.SweepResult:
    """Figure 3: every module of every layer zeroed in turn."""
    return cp.knockout_sweep(
        run.model, run.analysis, modules=run.settings.modules, batch_size=64, progress=run.progress
    )


def head_sweep_step(run: Run) -> cp.SweepResult:
    """Superposition heatmaps and Table 1: every head scaled in turn."""
    return cp.head_sweep(run.model, run.analysis, alphas=run.settings.alphas, batch_size=64, progress=run.progress)


def combine_step(run: Run) -> dict:
    """Table 2 and Figure 6: heads ranked on the selection split by single-head knockouts under
    coherent conflicts, combined on held-out facts. JuICE stage 1 on the same facts already
    knocked every head out there (its a = -1 rows), so its changes are ranked when it holds them."""
    s, parts = run.settings, run.parts
    stage1 = run.results["juice"].get("identified")
    reuse = stage1 is not None and -1.0 in s.neg_grid and "coherent" in stage1.conflict_types
    try:
        ranking = cp.heads.top_knockout_heads(
            run.model, parts.select, k=s.table2_k, progress=run.progress, identified=stage1 if reuse else None
        )
    except ValueError as err:
        return {"skipped": str(err)}
    ks = [k for k in s.table2_ks if k <= len(ranking)]
    table2 = cp.cumulative_knockout(run.model, parts.test, ranking, ks=ks, progress=run.progress)
    fig6 = cp.run_once_vs_twice(run.model, parts.test, ranking, beta=-1.0, progress=run.progress)
    return {"ranking": ranking, "table2": table2, "fig6": fig6}


def juice_step(run: Run) -> dict:
    """Fit JuICE toward memory on the analysis relation's selection and validation facts; its
    stage 1 (``identified``) is kept for Table 2's ranking."""
    s, parts = run.settings, run.parts
    steer = cp.JuICE(
        run.model,
        direction="parametric",
        k=s.k,
        pos_grid=s.pos_grid,
        neg_grid=s.neg_grid,
        beta_pos_grid=s.beta_pos_grid,
        beta_neg_grid=s.beta_neg_grid,
    )
    table = run.facts["table"]
    unfiltered = (table[table.relation == ANALYSIS_RELATION].used != "known facts").any()
    # the default's clean margin protects recall of facts the model knows; unfiltered facts get the paper's recipe
    recipe = "paper" if unfiltered else cp.tuning.DEFAULT_RECIPE
    try:
        with warnings.catch_warnings(record=True) as caught:  # a fit that does not steer is reported, not printed
            warnings.simplefilter("always", cp.juice.SteeringWarning)
            steer.fit(
                parts.select,
                parts.validation,
                progress=run.progress,
                batch_size=64,
                recipe=recipe,
                clean_margin=s.clean_margin,
            )
    except ValueError as err:
        return {"skipped": str(err)}
    for warning in caught:
        if not issubclass(warning.category, cp.juice.SteeringWarning):
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    with tempfile.TemporaryDirectory() as tmp:  # the file exactly as JuICE.save writes it
        path = Path(tmp) / "juice.json"
        steer.save(path)
        saved = path.read_text()
    return {"config": steer.to_dict(), "json": saved, "tuning": steer.tuning, "identified": steer.identified}


def evaluation_datasets(run: Run, protocol: str = "cpsuper") -> list[cp.ConflictDataset]:
    """Held-out facts per relation; for the analysis relation, never the facts JuICE was fitted on.

    ``"cpsuper"``: facts the model knows (as the analyses use them). ``"paper"``: the sampled facts
    unfiltered, as the JuICE paper scores its test split."""
    if protocol == "cpsuper":
        return [
            run.parts.test if relation == ANALYSIS_RELATION else run.facts["used"][relation][: run.settings.max_test]
            for relation in run.relations
        ]
    fitted = {e.subject for e in run.parts.select} | {e.subject for e in run.parts.validation}
    out = []
    for relation in run.relations:
        facts = run.facts["sampled"][relation]
        if relation == ANALYSIS_RELATION:
            facts = facts[[i for i, e in enumerate(facts) if e.subject not in fitted]]
        out.append(facts[: run.settings.max_test])
    return out


def evaluation_step(run: Run) -> dict:
    """Table 3: greedy accuracy toward memory of every method on held-out facts of every relation."""
    s, parts, model = run.settings, run.parts, run.model
    ph3 = cp.PH3(model, ks=tuple(k for k in s.ph3_ks if k <= model.cfg.n_layers * model.cfg.n_heads))
    ph3.fit(parts.select, parts.validation, progress=run.progress)
    methods = {
        "Original": cp.Original(model),
        "Prompt": cp.PromptInstruction(model, direction="parametric"),
        "CAD": cp.CAD(model, alpha=1.0),
        "PH3": ph3,
    }
    juice = run.results["juice"]
    if "config" in juice:
        methods["JuNe"] = cp.JuICE.from_dict({**juice["config"], "dual_run": False}, model)
        methods["JuICE"] = cp.JuICE.from_dict(juice["config"], model)
    types, skipped, tables = ("clean", "substitution", "coherent"), [], {}
    for protocol in ("cpsuper", "paper"):  # cpsuper's reading on known facts; the paper's on all facts
        datasets = evaluation_datasets(run, protocol)
        options = {"protocol": protocol, "max_new_tokens": s.max_new_tokens if protocol == "cpsuper" else None}
        try:  # every method, relation and conflict type in one call: it decodes shared requests once
            parts_out = [cp.evaluate(methods, datasets, types, progress=run.progress, **options)]
        except ValueError:  # e.g. an instruction-prefixed passage longer than a small model's context
            parts_out = _evaluate_cell_by_cell(methods, datasets, types, options, skipped, run.progress)
        tables[protocol] = pd.concat(parts_out, ignore_index=True)
    ph3_info = {"heads": [list(h) for h in ph3.heads[: ph3.k]], "k": ph3.k}
    return {
        "results": tables["cpsuper"],
        "results_paper": tables["paper"],
        "ph3": ph3_info,
        "ph3_tuning": ph3.tuning,
        "skipped": skipped,
    }


def _evaluate_cell_by_cell(methods, datasets, types, options: dict, skipped: list, progress: bool) -> list:
    """Each method on its own, and where it fails, each (relation, conflict type) cell on its own:
    the cells that fail are named in ``skipped``, the others kept."""
    parts_out = []
    for name in tqdm(methods, desc="evaluate methods", disable=not progress, leave=False):
        try:
            parts_out.append(cp.evaluate({name: methods[name]}, datasets, types, **options))
            continue
        except ValueError:
            pass
        for dataset in datasets:  # find the cells that fail; keep the others
            for conflict_type in types:
                try:
                    parts_out.append(cp.evaluate({name: methods[name]}, dataset, [conflict_type], **options))
                except ValueError as err:
                    skipped.append(f"{name} on {dataset.relations[0]} / {conflict_type} ({options['protocol']}): {err}")
    return parts_out


def attribution_step(run: Run) -> cp.Attribution:
    """Source-token direct logit attribution of every head to true minus context answer."""
    return cp.direct_logit_attribution(
        run.model, run.analysis, directions=("parametric-context",), batch_size=8, progress=run.progress
    )


def attention_step(run: Run) -> dict:
    """Attention from the final token to the subject and to the context."""
    return {
        span: cp.attention_to_span(run.model, run.analysis, span=span, progress=run.progress)
        for span in ("subject", "context")
    }


def explorer_step(run: Run) -> dict:
    """The head explorer's panels for every head, precomputed for the report's static page."""
    return explorer_data(
        run.model,
        run.analysis,
        sweep=run.results["head_sweep"],
        attribution=run.results["attribution"],
        examples=[0, 1],
    )


STEPS: tuple[Step, ...] = (
    Step("facts", "Filter the facts the model knows", facts_step),
    Step("knockouts", "Figure 3: module knockouts", knockouts_step, ("facts",)),
    Step("head_sweep", "Superposition heatmaps and Table 1: head sweep", head_sweep_step, ("facts",)),
    Step("juice", "JuICE: head identification and beta tuning", juice_step, ("facts",)),
    Step("combine", "Table 2 and Figure 6: combining heads", combine_step, ("facts", "juice")),
    Step(
        "evaluation",
        "Table 3: JuICE vs baselines",
        evaluation_step,
        ("facts", "juice"),
        (evaluation_datasets, _evaluate_cell_by_cell),
    ),
    Step("attribution", "Source-token DLA", attribution_step, ("facts",)),
    Step("attention", "Attention to subject and context", attention_step, ("facts",)),
    Step("explorer", "Head explorer page", explorer_step, ("facts", "head_sweep", "attribution")),
)
"""The pipeline, in order; each step may read the results of the steps before it."""
