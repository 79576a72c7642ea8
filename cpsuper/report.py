"""``cpsuper reproduce``: the JuICE paper's analyses on one model, as a self-contained HTML report.

The pipeline is a fixed list of steps (filter known facts, module knockouts, head sweep, joint
knockouts, JuICE fitting, evaluation against the baselines, source-token attribution, attention
to spans). Each step's result is pickled under ``OUT/cache/<key>/`` as soon as it finishes, with
``<key>`` a hash of the arguments that change results, so a re-run with the same arguments
reuses them and an interrupted run resumes from the last finished step. The model is loaded
only when some step actually has to run.

Figures and tables are rebuilt from the cached results every time and written to
``OUT/report.html`` (plotly's JavaScript inlined once; works offline), with every result as
CSV / JSON beside it and the fitted JuICE as ``juice.json``.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import html
import json
import os
import pickle
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

__all__ = ["FULL", "QUICK", "Settings", "check_arguments", "reproduce"]

ANALYSIS_RELATION = "world_capital"
"""JuICE heads are identified on this relation, and the per-head analyses run on it."""


@dataclass(frozen=True)
class Settings:
    """Sizes and grids of one reproduction run (``FULL`` or ``QUICK``)."""

    n_examples: int  # facts sampled per relation before filtering
    n_analysis: int  # known world-capital facts for the knockout / head sweeps, DLA and attention
    modules: tuple[str, ...]  # module kinds of the Figure 3 knockouts
    alphas: tuple[float, ...]  # head scales of the superposition sweep (0 = knockout)
    n_select: int  # selection facts (JuICE head identification, Table 2 ranking, PH3)
    val_frac: float
    max_val: int  # at most this many validation facts (beta tuning, PH3's k)
    max_test: int  # at most this many held-out facts per relation in Table 2 / Figure 6 / Table 3
    pos_grid: tuple[float, ...]
    neg_grid: tuple[float, ...]
    k: int  # JuICE heads per sign
    beta_pos_grid: tuple[float, ...]
    beta_neg_grid: tuple[float, ...]
    ph3_ks: tuple[int, ...]
    table2_k: int  # heads ranked for Table 2 / Figure 6
    table2_ks: tuple[int, ...]
    max_new_tokens: int  # greedy tokens per answer in the evaluation
    batch_size: int = 32


FULL = Settings(
    n_examples=100, n_analysis=16, modules=("attn", "mlp", "layer"), alphas=(0.0, 2.0), n_select=4,
    val_frac=0.15, max_val=8, max_test=30, pos_grid=(1.0, 3.0, 5.0, 10.0, 30.0), neg_grid=(-1.0, -2.0, -5.0),
    k=5, beta_pos_grid=(0.0, 1.0, 2.0, 3.0, 4.0, 5.0), beta_neg_grid=(0.0, -1.0, -2.0, -3.0),
    ph3_ks=(1, 3, 5, 7, 9, 15), table2_k=10, table2_ks=(1, 3, 10), max_new_tokens=8,
)
QUICK = Settings(
    n_examples=16, n_analysis=4, modules=("attn", "mlp"), alphas=(0.0,), n_select=2, val_frac=0.15, max_val=2,
    max_test=3, pos_grid=(1.0, 10.0), neg_grid=(-1.0,), k=3, beta_pos_grid=(0.0, 1.0, 2.0),
    beta_neg_grid=(0.0, -1.0), ph3_ks=(1, 3), table2_k=5, table2_ks=(1, 3, 5), max_new_tokens=4,
)

METHOD_ORDER = ("Original", "Prompt", "CAD", "PH3", "JuNe", "JuICE")


# ---------------------------------------------------------------------------------------------
# Arguments


def check_arguments(
    model: str, relations: Sequence[str] | None, n_examples: int | None, out: str | Path, device: str | None
) -> list[str]:
    """Validate the arguments before anything slow happens; return the relations to use.

    Raises ``ValueError`` with a message that says what to change.
    """
    from .data import list_relations

    if not model or not str(model).strip():
        raise ValueError("--model is empty; give a model name such as gemma-3-270m or tiny-gemma.")
    available = list_relations()
    relations = list(relations) if relations else list(available)
    unknown = [r for r in relations if r not in available]
    if unknown:
        raise ValueError(f"Unknown relation(s) {unknown}; choose from {available}.")
    if len(set(relations)) != len(relations):
        raise ValueError(f"--relations lists a relation twice: {relations}; name each once.")
    if n_examples is not None and n_examples < 1:
        raise ValueError(f"--n-examples must be at least 1 (got {n_examples}); it is the number of facts per relation.")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a directory (it is created if missing).")
    _check_device(device)
    return relations


def _check_device(device: str | None) -> None:
    if device is None:
        return
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"Unknown device {device!r}; use cpu, cuda, cuda:N or mps.") from err
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: no CUDA GPU is usable here; use --device cpu.")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s).")
    elif dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"--device {device}: MPS is not available here; use --device cpu.")
    elif dev.type != "cpu":
        raise ValueError(f"Device {device!r} is not supported; use cpu, cuda, cuda:N or mps.")


# ---------------------------------------------------------------------------------------------
# The run: lazy model, cached steps


@dataclass
class _Run:
    model_name: str
    relations: list[str]
    settings: Settings
    seed: int
    device: str | None
    cache: Path | None
    progress: bool
    results: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    model_loaded: bool = False
    _model: object = None

    @property
    def model(self):
        if self._model is None:
            from .models import load_model

            self._model = load_model(self.model_name, device=self.device)
            self.model_loaded = True
        return self._model

    # Data shared by several steps, derived deterministically from the "facts" step.

    @property
    def facts(self) -> dict:
        return self.results["facts"]

    @property
    def analysis(self):
        """Facts of the analysis relation for the sweeps, DLA and attention."""
        return self.facts["used"][ANALYSIS_RELATION][: self.settings.n_analysis]

    @property
    def parts(self):
        """Selection / validation / held-out split of the analysis relation's facts."""
        from .data import split

        s = self.settings
        parts = split(self.facts["used"][ANALYSIS_RELATION], n_select=s.n_select, val_frac=s.val_frac, seed=self.seed)
        return parts._replace(validation=parts.validation[: s.max_val], test=parts.test[: s.max_test])


@dataclass(frozen=True)
class _Step:
    name: str
    title: str
    run: Callable[[_Run], object]


def _step_facts(run: _Run) -> dict:
    """Sample facts per relation and keep those the model answers correctly on clean prompts."""
    from .data import conflict_dataset, filter_known

    s = run.settings
    relations = list(dict.fromkeys([ANALYSIS_RELATION, *run.relations]))
    sampled, known, used, rows, short = {}, {}, {}, [], []
    need = {r: (s.n_select + 2 if r == ANALYSIS_RELATION else 1) for r in relations}
    for relation in tqdm(relations, desc="filter known facts", disable=not run.progress, leave=False):
        data = conflict_dataset(relation, n=s.n_examples, seed=run.seed, tokenizer=run.model)
        try:
            kept = filter_known(run.model, data, batch_size=s.batch_size, progress=run.progress)
        except ValueError:  # the model knows none of them
            kept = None
        known_subjects = set() if kept is None else {e.subject for e in kept}
        sampled[relation], known[relation] = data, kept
        if kept is not None and len(kept) >= need[relation]:
            used[relation], status = kept, "known facts"
        else:
            used[relation], status = data, "UNFILTERED (too few known facts)"
            short.append(f"{relation} ({len(known_subjects)} of {len(data)} known, {need[relation]} needed)")
        rows += [{"relation": relation, "subject": e.subject, "answer": e.answer, "context_answer": e.context_answer,
                  "known": e.subject in known_subjects, "used": status} for e in data]
    notes = []
    if short:
        notes.append(
            "The model knows too few of the sampled facts of " + ", ".join(short) + ". For these relations the "
            "analyses use all sampled facts, unfiltered: their accuracies and effects are not about facts the "
            "model knows (expected for a random test model; with a real model, sample more with --n-examples)."
        )
    return {"sampled": sampled, "known": known, "used": used, "table": pd.DataFrame(rows), "notes": notes}


def _step_knockouts(run: _Run):
    from .knockouts import knockout_sweep

    return knockout_sweep(run.model, run.analysis, modules=run.settings.modules, batch_size=64, progress=run.progress)


def _step_head_sweep(run: _Run):
    from .heads import head_sweep

    return head_sweep(run.model, run.analysis, alphas=run.settings.alphas, batch_size=64, progress=run.progress)


def _step_combine(run: _Run) -> dict:
    """Table 2 and Figure 6: heads ranked on the selection split, combined on held-out facts."""
    from .heads import cumulative_knockout, run_once_vs_twice, top_knockout_heads

    s, parts = run.settings, run.parts
    try:
        ranking = top_knockout_heads(run.model, parts.select, k=s.table2_k, progress=run.progress)
    except ValueError as err:
        return {"skipped": str(err)}
    ks = [k for k in s.table2_ks if k <= len(ranking)]
    table2 = cumulative_knockout(run.model, parts.test, ranking, ks=ks, progress=run.progress)
    fig6 = run_once_vs_twice(run.model, parts.test, ranking, beta=-1.0, progress=run.progress)
    return {"ranking": ranking, "table2": table2, "fig6": fig6}


def _step_juice(run: _Run) -> dict:
    """Fit JuICE toward memory on the analysis relation's selection and validation facts."""
    from .juice import JuICE

    s, parts = run.settings, run.parts
    steer = JuICE(run.model, direction="parametric", k=s.k, pos_grid=s.pos_grid, neg_grid=s.neg_grid,
                  beta_pos_grid=s.beta_pos_grid, beta_neg_grid=s.beta_neg_grid)
    try:
        steer.fit(parts.select, parts.validation, progress=run.progress, batch_size=64)
    except ValueError as err:
        return {"skipped": str(err)}
    path = run.cache / "juice.json" if run.cache else Path(os.devnull)
    if run.cache:
        steer.save(path)
        saved = path.read_text()
    else:
        saved = json.dumps(steer.to_dict(), indent=1)
    return {"config": steer.to_dict(), "json": saved, "tuning": steer.tuning}


def _eval_datasets(run: _Run) -> list:
    s = run.settings
    out = []
    for relation in run.relations:
        if relation == ANALYSIS_RELATION:
            out.append(run.parts.test)  # never the facts JuICE was fitted on
        else:
            out.append(run.facts["used"][relation][: s.max_test])
    return out


def _step_evaluation(run: _Run) -> dict:
    """Table 3: greedy accuracy toward memory of every method on held-out facts of every relation."""
    from .baselines import CAD, PH3, Original, PromptInstruction, evaluate
    from .juice import JuICE

    s, parts, model = run.settings, run.parts, run.model
    ph3 = PH3(model, ks=tuple(k for k in s.ph3_ks if k <= model.cfg.n_layers * model.cfg.n_heads))
    ph3.fit(parts.select, parts.validation, progress=run.progress)
    methods = {"Original": Original(model), "Prompt": PromptInstruction(model, direction="parametric"),
               "CAD": CAD(model, alpha=1.0), "PH3": ph3}
    juice = run.results["juice"]
    if "config" in juice:
        config = {k: v for k, v in juice["config"].items() if k != "model"}
        config["enhance"] = [tuple(h) for h in config["enhance"]]
        config["suppress"] = [tuple(h) for h in config["suppress"]]
        methods["JuNe"] = JuICE(model, **{**config, "dual_run": False})
        methods["JuICE"] = JuICE(model, **config)
    datasets = _eval_datasets(run)
    cells = [(name, d, c) for name in methods for d in datasets for c in ("clean", "substitution", "coherent")]
    parts_out, skipped = [], []
    for name, dataset, conflict_type in tqdm(cells, desc="evaluate methods", disable=not run.progress, leave=False):
        try:
            parts_out.append(evaluate({name: methods[name]}, dataset, [conflict_type], s.max_new_tokens))
        except ValueError as err:  # e.g. an instruction-prefixed passage longer than a small model's context
            skipped.append(f"{name} on {dataset.relations[0]} / {conflict_type}: {err}")
    ph3_info = {"heads": [list(h) for h in ph3.heads[: ph3.k]], "k": ph3.k}
    return {"results": pd.concat(parts_out, ignore_index=True), "ph3": ph3_info, "ph3_tuning": ph3.tuning,
            "skipped": skipped}


def _step_attribution(run: _Run):
    from .attribution import direct_logit_attribution

    return direct_logit_attribution(run.model, run.analysis, directions=("parametric-context",),
                                    batch_size=8, progress=run.progress)


def _step_attention(run: _Run) -> dict:
    from .attention import attention_to_span

    return {span: attention_to_span(run.model, run.analysis, span=span, progress=run.progress)
            for span in ("subject", "context")}


STEPS: tuple[_Step, ...] = (
    _Step("facts", "Filter the facts the model knows", _step_facts),
    _Step("knockouts", "Figure 3: module knockouts", _step_knockouts),
    _Step("head_sweep", "Superposition heatmaps and Table 1: head sweep", _step_head_sweep),
    _Step("combine", "Table 2 and Figure 6: combining heads", _step_combine),
    _Step("juice", "JuICE: head identification and beta tuning", _step_juice),
    _Step("evaluation", "Table 3: JuICE vs baselines", _step_evaluation),
    _Step("attribution", "Source-token DLA", _step_attribution),
    _Step("attention", "Attention to subject and context", _step_attention),
)


def _cache_key(model: str, relations: Sequence[str], settings: Settings, seed: int) -> str:
    from . import __version__

    payload = {"model": model, "relations": list(relations), "settings": dataclasses.asdict(settings),
               "seed": seed, "cpsuper": __version__}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def _load(path: Path):
    try:
        with path.open("rb") as f:
            return pickle.load(f)
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError, ValueError):
        # a torn file, or one pickled by an incompatible version: recompute the step
        return None


def _store(path: Path, value) -> None:
    tmp = path.with_suffix(".tmp")
    with tmp.open("wb") as f:
        pickle.dump(value, f)
    tmp.replace(path)  # atomic: an interrupted run never leaves a half-written step


# ---------------------------------------------------------------------------------------------
# Entry point


def reproduce(
    model: str = "gemma-3-270m",
    relations: Sequence[str] | None = None,
    n_examples: int | None = None,
    out: str | Path = "cpsuper-report",
    quick: bool = False,
    device: str | None = None,
    seed: int = 0,
    use_cache: bool = True,
    progress: bool = True,
    command: str | None = None,
) -> Path:
    """Run the pipeline (reusing cached steps) and write ``report.html`` plus CSV / JSON to ``out``.

    Returns the path of ``report.html``. Arguments are checked before the model is loaded.
    """
    relations = check_arguments(model, relations, n_examples, out, device)
    settings = QUICK if quick else FULL
    if n_examples is not None:
        settings = dataclasses.replace(settings, n_examples=n_examples)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    key = _cache_key(model, relations, settings, seed)
    cache = out / "cache" / key
    cache.mkdir(parents=True, exist_ok=True)
    run = _Run(model, relations, settings, seed, device, cache, progress)
    torch.manual_seed(seed)
    timings = []
    start = time.perf_counter()
    bar = tqdm(STEPS, desc="cpsuper reproduce", disable=not progress, unit="step")
    for step in bar:
        bar.set_postfix_str(step.title)
        path = cache / f"{step.name}.pkl"
        stored = _load(path) if use_cache and path.exists() else None
        if stored is not None:
            run.results[step.name] = stored["result"]
            timings.append({"step": step.name, "title": step.title, "status": "cached",
                            "seconds": stored["seconds"], "seconds_this_run": 0.0})
            continue
        t0 = time.perf_counter()
        result = step.run(run)
        seconds = time.perf_counter() - t0
        run.results[step.name] = result
        _store(path, {"result": result, "seconds": seconds})
        timings.append({"step": step.name, "title": step.title, "status": "computed",
                        "seconds": seconds, "seconds_this_run": seconds})
    bar.close()
    meta = {
        "command": command or f"cpsuper reproduce --model {model}" + (" --quick" if quick else ""),
        "model": model, "relations": relations, "n_examples": settings.n_examples, "quick": quick,
        "device": str(run.model.cfg.device) if run.model_loaded else _previous_device(out, key, device),
        "seed": seed, "cache_key": key, "use_cache": use_cache, "model_loaded": run.model_loaded,
        "settings": dataclasses.asdict(settings), "versions": _versions(),
        "created": _dt.datetime.now().isoformat(timespec="seconds"),
        "total_seconds_this_run": time.perf_counter() - start, "steps": timings,
    }
    report = _write_outputs(run, meta, out)
    return report


def _previous_device(out: Path, key: str, device: str | None) -> str:
    """The device of the run that computed the cached steps (this run loaded no model)."""
    try:
        previous = json.loads((out / "manifest.json").read_text())
    except (OSError, ValueError):
        previous = {}
    if previous.get("cache_key") == key and previous.get("device"):
        return previous["device"]
    return device or "unknown (every step came from the cache)"


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for package in ("cpsuper", "torch", "transformer-lens", "transformers", "plotly", "pandas"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = "not installed"
    return out


# ---------------------------------------------------------------------------------------------
# Outputs


def _table_html(frame: pd.DataFrame, index: bool = False, floatfmt: str = "{:.3f}") -> str:
    table = frame.to_html(index=index, border=0, classes="tbl", float_format=floatfmt.format, na_rep="")
    return f'<div class="scroll">{table}</div>'  # wide tables (Table 3) scroll instead of overflowing


def _heads_str(heads) -> str:
    return ", ".join(f"L{l}H{h}" for l, h in heads) or "none"


class _Html:
    """Collects report sections; figures are embedded without their own copy of plotly.js."""

    def __init__(self):
        self.parts: list[str] = []
        self.n_figures = 0

    def h2(self, text: str) -> None:
        anchor = "s" + str(len(self.parts))
        self.parts.append(f'<h2 id="{anchor}">{html.escape(text)}</h2>')

    def p(self, text: str, cls: str = "") -> None:
        self.parts.append(f'<p class="{cls}">{text}</p>')

    def raw(self, text: str) -> None:
        self.parts.append(text)

    def note(self, text: str) -> None:
        self.parts.append(f'<p class="note">{html.escape(text)}</p>')

    def figure(self, fig, caption: str = "") -> None:
        height = fig.layout.height or 460
        self.n_figures += 1
        div = fig.to_html(full_html=False, include_plotlyjs=False, default_height=f"{height}px",
                          default_width="100%", div_id=f"figure-{self.n_figures}")
        cap = f"<figcaption>{html.escape(caption)}</figcaption>" if caption else ""
        self.parts.append(f'<figure class="figure">{div}{cap}</figure>')


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1250px;margin:24px auto;
padding:0 18px;color:#222;line-height:1.45}
h1{font-size:1.6em;margin-bottom:.2em}h2{border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:2em}
pre{background:#f4f4f4;padding:8px 10px;overflow-x:auto;border-radius:4px}
table.tbl,table{border-collapse:collapse;font-size:.88em;margin:.6em 0}
.tbl th,.tbl td,table th,table td{border:1px solid #ddd;padding:3px 8px;text-align:right}
.tbl th{background:#f0f0f0}.note{background:#fff4e0;border-left:4px solid #f0a030;padding:6px 10px}
.skip{background:#fde8e8;border-left:4px solid #d04040;padding:6px 10px}
figure{margin:1em 0}figcaption{color:#555;font-size:.9em}
.meta td:first-child{text-align:left;font-weight:600}.meta td{text-align:left}
nav a{margin-right:12px}.scroll{overflow-x:auto;max-width:100%}
"""


def _write_outputs(run: _Run, meta: dict, out: Path) -> Path:
    """Write every result as CSV / JSON, the JuICE configuration and the HTML report."""
    from . import plots
    from .attribution import head_categories
    from .baselines import evaluation_table
    from .heads import rank_heads, superposition_heads
    from .knockouts import consistent_gains

    r, files = run.results, []
    notes = list(r["facts"]["notes"])

    def save_csv(frame: pd.DataFrame, name: str) -> None:
        frame.to_csv(out / name, index=False)
        files.append(name)

    page = _Html()

    # Facts
    facts = r["facts"]
    save_csv(facts["table"], "facts.csv")
    counts = facts["table"].groupby("relation", sort=False).agg(
        sampled=("subject", "size"), known=("known", "sum"), used=("used", "first")).reset_index()
    counts["used facts"] = [len(facts["used"][rel]) for rel in counts.relation]
    page.h2("1. Facts the model knows")
    page.p(f"{meta['n_examples']} facts sampled per relation (seed {meta['seed']}); a fact is known when an alias "
           "of its answer is among the first five words of the greedy continuation of its clean prompt. "
           f"Per-head analyses, DLA and attention use the first {run.settings.n_analysis} used "
           f"{ANALYSIS_RELATION} facts.")
    page.raw(_table_html(counts))

    # Figure 3
    ko = r["knockouts"]
    save_csv(ko.summary, "figure3_knockouts.csv")
    save_csv(ko.per_example, "figure3_knockouts_per_example.csv")
    page.h2("2. Figure 3: module knockouts by conflict type")
    page.figure(plots.plot_knockouts(ko), "Change in the true answer's first-token probability when a module is "
                "zeroed, per layer (mean over facts; band: one standard deviation).")
    gains = consistent_gains(ko)
    save_csv(gains, "figure3_consistent_gains.csv")
    page.p("Modules whose knockout raises the true answer's probability under every conflict type:")
    page.raw(_table_html(gains))

    # Heatmaps, Table 1
    hs = r["head_sweep"]
    save_csv(hs.summary, "head_sweep.csv")
    save_csv(hs.per_example, "head_sweep_per_example.csv")
    page.h2("3. Superposition heatmaps")
    heatmap = plots.plot_head_heatmap(hs, alpha=0.0)
    heatmap.update_layout(height=2 * max(270, 16 * hs.summary.layer.nunique() + 70))
    page.figure(heatmap, "Change in each answer's probability when one head is knocked out, per conflict type "
                "and target.")
    sup = superposition_heads(hs, alpha=0.0, target="parametric", min_effect=1e-3)
    save_csv(sup, "superposition_heads.csv")
    n_sup = int(sup["superposed"].sum()) if "superposed" in sup else 0
    page.p(f"{n_sup} of {len(sup)} heads move the true answer in opposite directions under substitution and "
           "coherent conflicts (|effect| > 0.001 under both).")
    page.figure(plots.plot_superposition(sup), "Each head's knockout effect on the true answer: substitution vs "
                "coherent conflicts. Heads off the diagonal quadrants are superposed.")
    table1 = rank_heads(hs, k=4)
    flat1 = table1.copy()
    flat1.columns = ["_".join(map(str, c)).strip("_") if isinstance(c, tuple) else c for c in flat1.columns]
    save_csv(flat1, "table1_memory_heads.csv")
    page.h2("4. Table 1: memory heads that flip")
    page.p("Top heads by the gain in the context answer's probability when knocked out under substitution "
           "conflicts. Green: the desired change (context up, memory down); red: the opposite.")
    page.raw(plots.style_head_table(table1).to_html())

    # Table 2, Figure 6
    comb = r["combine"]
    page.h2("5. Table 2 and Figure 6: combining heads")
    if "skipped" in comb:
        notes.append(f"Table 2 / Figure 6 skipped: {comb['skipped']}")
        page.p(html.escape(f"Skipped: {comb['skipped']}"), "skip")
    else:
        save_csv(comb["ranking"], "table2_ranking.csv")
        t2 = comb["table2"].summary
        save_csv(t2, "table2_cumulative_knockout.csv")
        save_csv(comb["fig6"].summary, "figure6_run_once_vs_twice.csv")
        page.p(f"Heads ranked by the true-answer gain when knocked out alone under coherent conflicts on "
               f"{len(run.parts.select)} selection facts; knocked out together on {len(run.parts.test)} held-out "
               "facts (k = 0: the unmodified model).")
        view = t2[["k", "heads", "p", "delta_mean", "n"]].rename(
            columns={"p": "p(true answer)", "delta_mean": "change", "n": "facts"})
        page.raw(_table_html(view))
        page.figure(plots.plot_run_once_vs_twice(comb["fig6"]), "Figure 6: the top-k heads scaled in one pass "
                    "(run once, beta = -1: joint knockout) vs their clean outputs subtracted in a second pass "
                    "(run twice).")

    # JuICE and Table 3
    juice, ev = r["juice"], r["evaluation"]
    page.h2("6. JuICE and Table 3: steering toward memory")
    if "skipped" in juice:
        notes.append(f"JuICE could not be fitted: {juice['skipped']} JuICE and JuNe are missing from Table 3.")
        page.p(html.escape(f"JuICE not fitted: {juice['skipped']}"), "skip")
    else:
        (out / "juice.json").write_text(juice["json"])
        files.append("juice.json")
        save_csv(juice["tuning"], "juice_beta_tuning.csv")
        c = juice["config"]
        page.p(f"Fitted on {ANALYSIS_RELATION}: {len(c['fitted_on'].get('selection', []))} selection facts, "
               f"{len(c['fitted_on'].get('validation', []))} validation facts. Enhance "
               f"<b>{_heads_str(c['enhance'])}</b> x {c['beta_plus']:+g}; suppress "
               f"<b>{_heads_str(c['suppress'])}</b> x {c['beta_minus']:+g} (K = {c['k']}, scale grids "
               f"{c['pos_grid']} / {c['neg_grid']}). Saved as juice.json (load with cpsuper.JuICE.load).")
    results = ev["results"]
    notes += [f"Table 3 cell left empty: {msg}" for msg in ev.get("skipped", [])]
    save_csv(results, "table3_per_example.csv")
    (out / "ph3.json").write_text(json.dumps(ev["ph3"], indent=1))
    files.append("ph3.json")
    table3 = evaluation_table(results)
    table3 = table3.reindex([m for m in METHOD_ORDER if m in table3.index])
    flat3 = table3.copy()
    flat3.columns = [f"{a}_{b}" for a, b in flat3.columns]
    save_csv(flat3.reset_index(), "table3_evaluation.csv")
    sizes = results.groupby("relation").example.nunique()
    page.p("Greedy accuracy (%) toward memory: an alias of the true answer among the first five words of a "
           f"{run.settings.max_new_tokens}-token greedy continuation. Held-out facts per relation: "
           + ", ".join(f"{rel} {n}" for rel, n in sizes.items())
           + f" ({ANALYSIS_RELATION}: facts not used to fit JuICE). CAD uses alpha = 1 (it favours the context); "
           f"PH3 prunes {_heads_str(ev['ph3']['heads'])} (k chosen on validation).")
    page.raw(_table_html(table3 * 100, index=True, floatfmt="{:.1f}"))

    # DLA
    att = r["attribution"]
    save_csv(att.head_sources(), "dla_head_sources.csv")
    save_csv(att.components, "dla_components.csv")
    page.h2("7. Where the JuICE heads read from: source-token DLA")
    heads = [] if "skipped" in juice else [tuple(h) for h in juice["config"]["enhance"] + juice["config"]["suppress"]]
    if heads:
        mask = [(l, h) in set(heads) for l, h in zip(att.sources.layer, att.sources["head"])]
        shown, top_k = dataclasses.replace(att, sources=att.sources[mask]), len(heads)
        page.p(f"Direct logit attribution of the JuICE heads ({_heads_str(heads)}) to the logit difference "
               "true answer minus context answer, split by the source tokens each head attends to.")
    else:
        shown, top_k = att, 10
        page.p("JuICE was not fitted, so the ten heads with the largest |DLA| are shown instead.", "note")
    for conflict_type in ("substitution", "coherent"):
        page.figure(plots.plot_head_sources(shown, conflict_type=conflict_type, direction="parametric-context",
                                            top_k=top_k))
    cats = pd.concat([head_categories(att, conflict_type=ct) for ct in ("substitution", "coherent")],
                     ignore_index=True)
    save_csv(cats, "head_categories.csv")
    if heads:
        cats = cats[[(l, h) in set(heads) for l, h in zip(cats.layer, cats["head"])]]
    page.p("Head categories (subject / relation / mixed / other / minor) from the sources of each head's "
           "positive DLA:")
    page.raw(_table_html(cats.drop(columns=["direction"])))

    # Attention
    page.h2("8. Attention from the final token to the subject and to the context")
    for span, result in r["attention"].items():
        save_csv(result.by_layer(), f"attention_{span}_by_layer.csv")
        save_csv(result.by_head(), f"attention_{span}_by_head.csv")
        page.figure(plots.plot_attention_by_layer(result), f"Attention mass from the last prompt token to the "
                    f"{span} tokens, mean over heads and facts (error bars: standard error over facts).")

    notes += [n for n in run.notes if n not in notes]
    meta["notes"] = notes
    meta["files"] = sorted([*files, "report.html", "manifest.json"])
    meta["n_figures"] = page.n_figures
    (out / "manifest.json").write_text(json.dumps(meta, indent=1, default=str))
    (out / "report.html").write_text(_page(meta, page), encoding="utf-8")
    return out / "report.html"


def _page(meta: dict, body: _Html) -> str:
    from plotly.offline import get_plotlyjs

    v = meta["versions"]
    rows = [("command", f"<code>{html.escape(meta['command'])}</code>"), ("model", meta["model"]),
            ("relations", ", ".join(meta["relations"])), ("facts per relation", meta["n_examples"]),
            ("mode", "quick (reduced grids and facts)" if meta["quick"] else "full"), ("seed", meta["seed"]),
            ("device", meta["device"]),
            ("versions", ", ".join(f"{k} {val}" for k, val in v.items())),
            ("created", meta["created"]), ("cache", f"key {meta['cache_key']}" + ("" if meta["use_cache"] else
                                                                                  " (--no-cache)"))]
    meta_html = "<table class='meta'>" + "".join(
        f"<tr><td>{html.escape(str(k))}</td><td>{val if k in ('command',) else html.escape(str(val))}</td></tr>"
        for k, val in rows) + "</table>"
    steps = pd.DataFrame(meta["steps"])[["title", "status", "seconds"]].rename(
        columns={"title": "step", "seconds": "seconds (when computed)"})
    total = sum(s["seconds"] for s in meta["steps"])
    notes = "".join(f'<p class="note">{html.escape(n)}</p>' for n in meta["notes"])
    sections = [p for p in body.parts if p.startswith("<h2")]
    nav = " ".join(f'<a href="#{p.split(chr(34))[1]}">{p.split(">")[1].split("<")[0]}</a>' for p in sections)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>cpsuper reproduce: {html.escape(meta['model'])}</title>
<style>{_CSS}</style>
<script type="text/javascript">{get_plotlyjs()}</script>
</head><body>
<h1>Knowledge conflicts and JuICE on {html.escape(meta['model'])}</h1>
<p>Reproduction of the analyses of "Taming Knowledge Conflicts in Language Models" (Li, Chen, Tong) with
cpsuper. Probabilities are first-token probabilities of an answer at the last prompt position; every
number below comes from the run described here.</p>
{meta_html}
<p>Step timings (total {total:.0f} s of computation; this invocation took
{meta['total_seconds_this_run']:.0f} s):</p>
{_table_html(steps, floatfmt="{:.1f}")}
{notes}
<nav>{nav}</nav>
{''.join(body.parts)}
<h2>Files</h2>
<p>{', '.join(html.escape(f) for f in meta['files'])}</p>
</body></html>
"""


def main_print(report: Path, stream=None) -> None:
    """Tell the user where the outputs are."""
    stream = stream or sys.stdout
    print(f"Report: {report.resolve()}", file=stream)
    print(f"Results (CSV / JSON, juice.json, manifest.json): {report.parent.resolve()}", file=stream)
