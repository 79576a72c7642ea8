"""Context-parametric inversion on the embedded model, the longer runs: a longer LoRA finetune of
Gemma-3-270M on context question answering (does context reliance rise and then fall?), the
attention of the final position to the context at every checkpoint, a run whose training facts
leave out every world capital (scored on held-out capitals), and a run that adapts only the
attention's query and key weights (``LoraSettings(targets="qk")``).

Facts: the known facts (first-token top-1 on the clean prompt) of three relations; the last
``--n-eval`` of each relation are held out, the rest are trained on with a substitution-style
context (``--train-prompts``; the long coherent passages would cost three times as much per step),
``--share`` of them counterfactual. Runs (``--runs``):

- ``mlp``: adapters on the MLP matrices, all three relations (the reference run);
- ``mlp-no-capitals``: the same without any world_capital fact in the training pairs;
- ``qk``: low-rank deltas on the query and key weights only, all three relations.

Every run takes the same number of steps and batch size; ``mlp`` is measured every
``--save-every`` steps, the others every ``--compare-every`` steps (a multiple of it); step 0 is
the base model in every run (``lora_finetune``'s adapters start at zero), measured once.
``--append`` adds the named runs to those already under --out, replacing their earlier rows.
Measured on the held-out facts at every checkpoint, per fact: on the clean prompt, greedy accuracy
of the true answer (``acc``); on substitution and coherent prompts, whether the context answer's
first token outranks the true one's (``context_wins``), the first-token logit of the context answer
minus the true one's (``context_margin``, a reliance measure that does not saturate),
``M_C = p(ctx) / (p(ctx) + p(true))``, and the final position's attention to the context
(``attention_context``: mean over layers and heads of the raw weights, context answer included).

Writes, under --out: ``per_fact.csv.gz``, ``summary.csv`` (mean and 95 % bootstrap interval over
facts per run x step x facts x prompt x quantity), ``paired.csv`` (run minus the reference run,
paired over facts, at the steps both measured), ``peak_then_last.csv`` (each run's rise to its peak
and fall to the last checkpoint, all facts and the capitals alone), ``tracking.csv`` (how the
context margin follows attention to the context across checkpoints, Theorem 1), ``timing.json``,
and the figures ``variants.png``, ``capitals.png`` and ``tracking.png``.

    HF_HUB_OFFLINE=1 python scripts/finetune_inversion_variants.py --out docs/results/finetune_inversion/variants
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.express as px
import torch

import cpsuper as cp
from cpsuper.finetune import LoraSettings, context_training_pairs, lora_finetune
from cpsuper.stats import bootstrap_summary

RELATIONS = ("world_capital", "official_language", "company_headquarter")
RUNS = {
    "mlp": ("mlp", RELATIONS),
    "mlp-no-capitals": ("mlp", ("official_language", "company_headquarter")),
    "qk": ("qk", RELATIONS),
}
REFERENCE = "mlp"
SHOWN = ("acc", "context_wins", "context_margin", "attention_context")


def facts(model, n_eval: int) -> tuple[dict, cp.ConflictDataset]:
    """Training facts per relation and the held-out facts of all relations."""
    train, held = {}, None
    for relation in RELATIONS:
        known = cp.filter_known(model, cp.conflict_dataset(relation, tokenizer=model), by="top1", progress=False)
        train[relation] = known[: len(known) - n_eval]
        part = known[len(known) - n_eval :]
        held = part if held is None else held + part
    return train, held


def measure(model, held) -> pd.DataFrame:
    """One row per held-out fact x prompt x quantity."""
    clean = cp.score_dataset(model, held, conflict_types=["clean"], progress=False, max_new_tokens=6)
    clean = clean[clean.measure == "acc_parametric"].assign(quantity="acc")
    conflict = ["substitution", "coherent"]  # first-token measures: one forward pass per prompt
    scores = cp.score_dataset(model, held, conflict_types=conflict, progress=False, greedy=False)
    wide = scores.pivot_table(index=["example", "conflict_type"], columns="measure", values="value").reset_index()
    wide["context_margin"] = -wide.logit_diff  # context minus true answer, first-token logits
    wide["M_C"] = wide.p_context / (wide.p_context + wide.p_parametric)
    rows = wide.melt(["example", "conflict_type"], ["context_wins", "context_margin", "M_C"], var_name="quantity")
    attention = cp.attention_to_span(model, held, "context", conflict_types=conflict, progress=False)
    per = attention.per_example.groupby(["example", "conflict_type"], as_index=False).attention.mean()
    parts = [clean[["example", "conflict_type", "quantity", "value"]], rows]
    parts.append(per.rename(columns={"attention": "value"}).assign(quantity="attention_context"))
    out = pd.concat(parts, ignore_index=True)
    out["relation"] = [held[int(i)].relation for i in out.example]
    out["fact"] = out.relation + ":" + [held[int(i)].subject for i in out.example]
    return out.drop(columns="example")


def summarise(per: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Means with intervals over facts (all held-out facts, and the world capitals alone), and
    each run minus the reference run, paired over facts."""
    both = pd.concat([per.assign(facts="all"), per[per.relation == "world_capital"].assign(facts="world_capital")])
    keys = ["run", "step", "facts", "conflict_type", "quantity"]
    summary = bootstrap_summary(both, value="value", by=keys, unit="fact")
    index = ["step", "facts", "conflict_type", "quantity", "fact"]
    ref = both[both.run == REFERENCE].set_index(index).value
    diffs = []
    for run, part in both[both.run != REFERENCE].groupby("run"):
        joined = part.set_index(index).value.to_frame().join(ref.rename("ref"), how="inner")
        diffs.append(joined.assign(run=run, value=joined.value - joined.ref).reset_index())
    paired = bootstrap_summary(pd.concat(diffs), value="value", by=keys, unit="fact") if diffs else pd.DataFrame()
    return summary, paired


def peak_then_last(per: pd.DataFrame, run: str = REFERENCE, facts: str = "all") -> pd.DataFrame:
    """One run, all facts or the world capitals alone: for each prompt and quantity, the rise from
    step 0 to the checkpoint with the highest mean and the change from there to the last
    checkpoint, paired over facts (the peak is picked from the same data, which biases both away
    from zero; a peak at the last checkpoint gives a fall of exactly 0)."""
    part = per[per.run == run] if facts == "all" else per[(per.run == run) & (per.relation == facts)]
    rows = []
    for (conflict, quantity), group in part.groupby(["conflict_type", "quantity"]):
        means = group.groupby("step").value.mean()
        first, peak, last = means.index.min(), means.idxmax(), means.index.max()
        wide = group.pivot_table(index="fact", columns="step", values="value")
        for change, (a, b) in {"rise": (first, peak), "fall": (peak, last)}.items():
            rows.append(
                pd.DataFrame({"fact": wide.index, "value": wide[b] - wide[a]}).assign(
                    conflict_type=conflict, quantity=quantity, change=change, from_step=a, to_step=b
                )
            )
    frame = pd.concat(rows, ignore_index=True)
    by = ["conflict_type", "quantity", "change", "from_step", "to_step"]
    out = bootstrap_summary(frame, value="value", by=by, unit="fact")
    return out.assign(run=run, facts=facts)[["run", "facts", *out.columns]]


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    x, y = x - x.mean(), y - y.mean()
    denominator = np.sqrt((x * x).sum() * (y * y).sum())
    return float((x * y).sum() / denominator) if denominator > 0 else np.nan


def _row_ranks(x: np.ndarray) -> np.ndarray:
    """Average ranks (ties share their mean rank) along the last axis."""
    return pd.DataFrame(np.atleast_2d(x)).rank(axis=1).to_numpy().reshape(x.shape)


def tracking(
    per: pd.DataFrame,
    *,
    reliance: str = "context_margin",
    attention: str = "attention_context",
    from_step: int = 0,
    n_boot: int = 2000,
    seed: int = 0,
) -> pd.DataFrame:
    """Does context reliance follow attention to the context (Theorem 1)? Per run and prompt, over
    the checkpoints from ``from_step``: ``checkpoint_means`` is the Pearson correlation across
    checkpoints of the mean attention and the mean reliance over facts; ``pooled_rank`` the rank
    correlation over every (fact, checkpoint) pair; ``within_fact_rank`` the mean over facts of each
    fact's rank correlation across checkpoints (facts whose values never change are left out).
    95 % percentile intervals from one bootstrap over facts, the same draws for the three."""
    rows = []
    part = per[(per.step >= from_step) & per.quantity.isin([reliance, attention])]
    for (run, conflict), group in part.groupby(["run", "conflict_type"]):
        wide = group.pivot_table(index="fact", columns=["quantity", "step"], values="value").dropna()
        a, r = wide[attention].to_numpy(), wide[reliance].to_numpy()  # facts x checkpoints
        n_facts, n_steps = a.shape
        a_ranks, r_ranks = _row_ranks(a), _row_ranks(r)
        per_fact = np.array([_pearson(x, y) for x, y in zip(a_ranks, r_ranks)])
        counts = np.vstack([np.ones(n_facts, int), cp.stats.resample_counts(n_facts, n_boot=n_boot, seed=seed)])
        values = {"checkpoint_means": [], "pooled_rank": [], "within_fact_rank": []}
        for w in counts:  # row 0: the data as they are; then the resamples
            values["checkpoint_means"].append(_pearson(w @ a / w.sum(), w @ r / w.sum()))
            drawn = np.repeat(np.arange(n_facts), w)
            values["pooled_rank"].append(_pearson(_row_ranks(a[drawn].ravel()), _row_ranks(r[drawn].ravel())))
            ok = ~np.isnan(per_fact) & (w > 0)
            values["within_fact_rank"].append((w[ok] * per_fact[ok]).sum() / w[ok].sum() if ok.any() else np.nan)
        for statistic, got in values.items():
            got = np.array(got)
            finite = got[1:][~np.isnan(got[1:])]  # a resample with no variation has no correlation
            lo, hi = np.quantile(finite, [0.025, 0.975]) if finite.size else (np.nan, np.nan)
            rows.append(
                dict(run=run, conflict_type=conflict, reliance=reliance, from_step=from_step, statistic=statistic)
                | dict(estimate=got[0], ci_low=lo, ci_high=hi, n_facts=n_facts, n_steps=n_steps)
            )
    return pd.DataFrame(rows)


def figure(summary: pd.DataFrame, facts: str = "all", runs: tuple[str, ...] = tuple(RUNS)):
    """The shown quantities over steps, one panel per prompt x quantity, one line per run."""
    frame = summary[(summary.facts == facts) & summary.quantity.isin(SHOWN) & summary.run.isin(runs)].copy()
    frame["panel"] = frame.conflict_type + ": " + frame.quantity
    frame = frame.assign(err_plus=frame.ci_high - frame["mean"], err_minus=frame["mean"] - frame.ci_low)
    which = "held-out facts" if facts == "all" else f"held-out {facts} facts"
    fig = px.line(
        frame.sort_values(["panel", "run", "step"]),
        x="step",
        y="mean",
        color="run",
        facet_col="panel",
        facet_col_wrap=4,
        error_y="err_plus",
        error_y_minus="err_minus",
        markers=True,
        labels={"mean": "", "step": "finetuning step"},
        title=f"Gemma-3-270M, LoRA on context QA: {which} over finetuning (95 % intervals over facts)",
    )
    fig.update_yaxes(matches=None, showticklabels=True)
    fig.for_each_annotation(lambda a: a.update(text=a.text.split("=", 1)[-1]))
    return fig.update_layout(width=1300, height=650)


def tracking_figure(summary: pd.DataFrame):
    """Mean context margin against mean attention to the context, one point per checkpoint (labelled
    with its step), one line per run, one panel per prompt; 95 % intervals over facts on both axes."""
    keys = ["run", "conflict_type", "step"]
    part = summary[(summary.facts == "all") & (summary.conflict_type != "clean")]
    x = part[part.quantity == "attention_context"].set_index(keys)
    y = part[part.quantity == "context_margin"].set_index(keys)
    frame = x[["mean"]].rename(columns={"mean": "attention"}).join(y[["mean"]].rename(columns={"mean": "margin"}))
    errors = {"ax_plus": x.ci_high - x["mean"], "ax_minus": x["mean"] - x.ci_low}
    errors |= {"my_plus": y.ci_high - y["mean"], "my_minus": y["mean"] - y.ci_low}
    frame = frame.assign(**errors).reset_index()
    fig = px.line(
        frame.sort_values(keys),
        x="attention",
        y="margin",
        color="run",
        facet_col="conflict_type",
        text="step",
        markers=True,
        error_x="ax_plus",
        error_x_minus="ax_minus",
        error_y="my_plus",
        error_y_minus="my_minus",
        labels={"attention": "attention of the last position to the context", "margin": "context margin (logits)"},
        title="Gemma-3-270M: context margin against attention to the context by checkpoint (95 % CIs over facts)",
    )
    fig.update_traces(textposition="top center", textfont_size=9)
    fig.update_xaxes(matches=None, showticklabels=True)
    fig.for_each_annotation(lambda a: a.update(text=a.text.split("=", 1)[-1]))
    return fig.update_layout(width=1300, height=560)


def previous_rows(old: pd.DataFrame, runs: list[str]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """For ``--append``: the earlier rows of every run not named again (a run named again replaces
    its rows) and the base model's rows (step 0, once per fact x prompt x quantity, no run)."""
    base = old[old.step == 0].drop(columns="run").drop_duplicates(["fact", "conflict_type", "quantity"])
    return old[~old.run.isin(runs)], base


def train_and_measure(model, train, held, name: str, args, base_rows=None) -> tuple[pd.DataFrame, dict]:
    targets, relations = RUNS[name]
    data = None
    for relation in relations:
        data = train[relation] if data is None else data + train[relation]
    pairs = context_training_pairs(
        data, counterfactual_share=args.share, conflict_types=args.train_prompts, seed=args.seed
    )
    every = args.save_every if name == REFERENCE else args.compare_every
    settings = LoraSettings(
        args.steps, args.batch_size, args.rank, 2.0 * args.rank, args.lr, every, args.seed, targets=targets
    )
    frames = []
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        checkpoints = lora_finetune(model, pairs, tmp, settings=settings)
        t1 = time.perf_counter()
        for checkpoint in checkpoints:
            if checkpoint.step == 0 and base_rows is not None:  # the base model, measured already
                frames.append(base_rows.assign(run=name))
            else:
                frames.append(measure(checkpoint(), held).assign(run=name, step=checkpoint.step))
    timing = {"pairs": len(pairs), "train_s": round(t1 - t0, 1), "measure_s": round(time.perf_counter() - t1, 1)}
    return pd.concat(frames, ignore_index=True), timing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="finetune_inversion_variants")
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    parser.add_argument("--share", type=float, default=0.25, help="share of counterfactual contexts")
    parser.add_argument("--n-eval", type=int, default=12, help="held-out facts per relation")
    parser.add_argument("--train-prompts", nargs="+", default=["substitution"], help="context styles trained on")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--compare-every", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--append", action="store_true", help="add --runs to the runs already under --out")
    parser.add_argument("--summarise-only", action="store_true")
    args = parser.parse_args()
    if args.compare_every % args.save_every:
        parser.error("--compare-every must be a multiple of --save-every (the paired steps).")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.summarise_only:
        torch.set_num_threads(1)
        start, cpu = time.perf_counter(), time.process_time()
        model = cp.load_model()
        train, held = facts(model, args.n_eval)
        timing = {
            "train_facts": {r: len(d) for r, d in train.items()},
            "held_out_facts": len(held),
            "settings": vars(args),
        }
        frames, base_rows = [], None
        if args.append:  # the same held-out facts (the same --n-eval); step 0 is shared
            kept, base_rows = previous_rows(pd.read_csv(out / "per_fact.csv.gz"), args.runs)
            frames = [kept]
            timing = {**json.loads((out / "timing.json").read_text()), "settings_appended": vars(args)}
        for name in args.runs:  # each run's rows are written as soon as it ends
            run_cpu, run_wall = time.process_time(), time.perf_counter()
            frame, timing[name] = train_and_measure(model, train, held, name, args, base_rows)
            if base_rows is None:
                base_rows = frame[frame.step == 0].drop(columns="run")
            timing[name].update(steps=args.steps, every=args.save_every if name == REFERENCE else args.compare_every)
            timing[name]["cpu_s"] = round(time.process_time() - run_cpu, 1)
            timing[name]["wall_s"] = round(time.perf_counter() - run_wall, 1)
            frames.append(frame)
            print(name, timing[name], flush=True)
            pd.concat(frames, ignore_index=True).to_csv(out / "per_fact.csv.gz", index=False, float_format="%.6g")
            timing["wall_s" if not args.append else "appended_wall_s"] = round(time.perf_counter() - start, 1)
            timing["cpu_s" if not args.append else "appended_cpu_s"] = round(time.process_time() - cpu, 1)
            timing["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
            (out / "timing.json").write_text(json.dumps(timing, indent=1) + "\n")
    per = pd.read_csv(out / "per_fact.csv.gz")
    summary, paired = summarise(per)
    summary.to_csv(out / "summary.csv", index=False, float_format="%.4g")
    paired.to_csv(out / "paired.csv", index=False, float_format="%.4g")
    runs = [run for run in RUNS if per[per.run == run].step.nunique() > 2]  # runs with a middle checkpoint
    peaks = pd.concat([peak_then_last(per, run, facts) for run in runs for facts in ("all", "world_capital")])
    peaks.to_csv(out / "peak_then_last.csv", index=False, float_format="%.4g")
    print(peaks.to_string(index=False))
    # the margin is M_C's log-odds (the softmax normaliser cancels), and M_C is 1.0 in float from step 20
    tracked = pd.concat([tracking(per[per.run.isin(runs)], from_step=s) for s in (0, args.save_every)])
    tracked.to_csv(out / "tracking.csv", index=False, float_format="%.4g")
    print(tracked.to_string(index=False))
    for (run, facts_, conflict, quantity), group in summary.groupby(["run", "facts", "conflict_type", "quantity"]):
        cells = "  ".join(
            f"{s}: {cp.stats.format_ci(m, lo, hi)}"
            for s, m, lo, hi in group[["step", "mean", "ci_low", "ci_high"]].itertuples(index=False)
        )
        print(f"{run} | {facts_} | {conflict} | {quantity}\n    {cells}")
    figures = {
        out / "variants": figure(summary),
        out / "capitals": figure(summary, "world_capital", (REFERENCE, "mlp-no-capitals")),
        out / "tracking": tracking_figure(summary),
    }
    try:
        cp.plots.save_figures(figures, formats="png", scale=1.0)
    except Exception as err:  # figure export needs the export extra and a Chromium
        print(f"figure not written: {err}")


if __name__ == "__main__":
    main()
