"""Context-parametric inversion next to standard-benchmark stand-ins (the paper's Figs. 2a-c and 3a)
on the embedded model: the ``mlp`` reference run of ``scripts/finetune_inversion_variants.py``
again (the same facts, pairs, seed and settings, read from that run's ``timing.json``), with three
stand-ins for the paper's standard benchmarks measured at every checkpoint. None is trained on:

- ``reading``: a SQuAD stand-in, the held-out facts with a context that states the TRUE answer
  (the substitution and coherent prompts with the context answer replaced by the true one, the way
  ``context_training_pairs`` builds its non-counterfactual pairs); greedy accuracy;
- ``closed_book``: an MMLU-like stand-in, no-context (clean prompt) greedy accuracy on the known
  facts (first-token top-1 at the base model) of three relations that are not in the training data;
- ``lm_loss``: language modelling, the mean next-token cross-entropy over every token of plain
  sentences stating those facts (clean prompt followed by the true answer).

The shared measures of the variants script (``measure``: ``acc``, ``context_wins``,
``context_margin``, ``M_C``, ``attention_context``) are measured anew at ``--shared-steps`` and
compared fact by fact with the saved reference run (a reproducibility check); at the other
checkpoints they are read from the saved run, which the check shows to be the same training run.

Writes, under --out: ``per_item.csv.gz`` (every measure per item and step, with its ``source``),
``reproducibility.csv``, ``summary.csv`` (means with 95 % bootstrap intervals over items),
``paired.csv`` (each step minus step 0, minus the previous checkpoint, and minus the step of the
context-reliance peak, paired over items), ``peak.csv``, ``timing.json`` and ``benchmarks.png``.

    HF_HUB_OFFLINE=1 python scripts/finetune_inversion_benchmarks.py --out docs/results/finetune_inversion/benchmarks
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.express as px
import torch

import cpsuper as cp
from cpsuper.finetune import LoraSettings, context_training_pairs, lora_finetune
from cpsuper.runtime import tokenize_prompts
from cpsuper.stats import bootstrap_summary

_spec = importlib.util.spec_from_file_location(
    "finetune_inversion_variants", Path(__file__).with_name("finetune_inversion_variants.py")
)
variants = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(variants)

BENCH_RELATIONS = ("athlete_sport", "book_author", "company_founder")
CONTEXT_PROMPTS = ("substitution", "coherent")
COLOURS = {"substitution": "#636efa", "coherent": "#ef553b", "clean": "#00a36c"}
REFERENCE_DIR = Path("docs/results/finetune_inversion/variants")
# quantity -> (panel title, higher is better)
SHOWN = {
    "context_margin": ("counterfactual: context margin (logits)", True),
    "context_wins": ("counterfactual: context answer first (accuracy)", True),
    "acc": ("parametric: no-context recall, held-out trained relations", True),
    "reading_acc": ("stand-in: reading comprehension (true context)", True),
    "closed_book_acc": ("stand-in: closed-book recall, untrained relations", True),
    "lm_loss": ("stand-in: LM loss on true sentences (nats/token)", False),
}


def true_context(dataset: cp.ConflictDataset, conflict_types: Sequence[str] = CONTEXT_PROMPTS) -> cp.ConflictDataset:
    """The same facts with each context prompt stating the true answer wherever it named the
    counterfactual one (as ``context_training_pairs`` does for its non-counterfactual pairs)."""
    examples = []
    for e in dataset:
        prompts = {c: e.prompts[c].replace(e.context_answer, e.answer) for c in conflict_types}
        examples.append(replace(e, prompts=prompts))
    return cp.ConflictDataset(examples, f"{dataset.name}-true-context")


def sentence(example) -> str:
    """The clean prompt followed by the true answer, as plain text."""
    prompt = example.prompts["clean"]
    return prompt + example.answer if prompt.endswith((" ", "\n")) else f"{prompt} {example.answer}"


def token_losses(model, texts: Sequence[str]) -> list[np.ndarray]:
    """Per text, the cross-entropy of every token given the tokens before it (BOS prepended, so the
    first word is predicted from BOS alone); one forward pass per text, no padding."""
    out = []
    with torch.no_grad():
        for tokens in tokenize_prompts(model, list(texts)):
            ids = torch.tensor([tokens], device=model.cfg.device)
            logprobs = model(ids)[0, :-1].float().log_softmax(-1)
            out.append(-logprobs.gather(-1, ids[0, 1:, None])[:, 0].cpu().numpy())
    return out


def benchmark_rows(model, reading: cp.ConflictDataset, closed: cp.ConflictDataset, **options) -> pd.DataFrame:
    """One row per item x quantity: ``reading_acc`` (per held-out fact and context prompt),
    ``closed_book_acc`` and ``lm_loss`` (mean over the sentence's tokens) per untrained fact.
    ``options`` go to ``cp.score_dataset`` (``batch_size``)."""
    frames = []
    for data, prompts, quantity in (
        (reading, list(CONTEXT_PROMPTS), "reading_acc"),
        (closed, ["clean"], "closed_book_acc"),
    ):
        scores = cp.score_dataset(model, data, conflict_types=prompts, progress=False, max_new_tokens=6, **options)
        part = scores[scores.measure == "acc_parametric"]
        frames.append(part[["relation", "subject", "conflict_type", "value"]].assign(quantity=quantity))
    losses = [loss.mean() for loss in token_losses(model, [sentence(e) for e in closed])]
    lm = pd.DataFrame({"relation": [e.relation for e in closed], "subject": [e.subject for e in closed]})
    frames.append(lm.assign(conflict_type="clean", value=losses, quantity="lm_loss"))
    out = pd.concat(frames, ignore_index=True)
    out["fact"] = out.relation + ":" + out.subject
    return out.drop(columns="subject")


def closed_book_facts(model, n_candidates: int) -> cp.ConflictDataset:
    """The known facts (first-token top-1 on the clean prompt) among the first ``n_candidates`` of
    each untrained relation."""
    parts = [
        cp.filter_known(model, cp.conflict_dataset(r, tokenizer=model)[:n_candidates], by="top1", progress=False)
        for r in BENCH_RELATIONS
    ]
    return parts[0] + parts[1] + parts[2]


def reproducibility(fresh: pd.DataFrame, saved: pd.DataFrame) -> pd.DataFrame:
    """Per step x prompt x quantity: how many fact rows match between the fresh and saved run, and
    the largest absolute difference (0/1 quantities must agree exactly)."""
    keys = ["step", "fact", "conflict_type", "quantity"]
    joined = fresh.set_index(keys).value.to_frame().join(saved.set_index(keys).value.rename("saved"), how="left")
    joined["diff"] = (joined.value - joined.saved).abs()
    return (
        joined.reset_index()
        .groupby(["step", "conflict_type", "quantity"])
        .agg(n=("value", "size"), n_missing=("saved", lambda s: int(s.isna().sum())), max_abs_diff=("diff", "max"))
        .reset_index()
    )


def reliance_peak(per: pd.DataFrame, quantity: str = "context_margin") -> pd.DataFrame:
    """Per context prompt, the checkpoint with the highest mean ``quantity`` over facts."""
    part = per[(per.quantity == quantity) & per.conflict_type.isin(CONTEXT_PROMPTS)]
    means = part.groupby(["conflict_type", "step"]).value.mean().reset_index()
    best = means.loc[means.groupby("conflict_type").value.idxmax()]
    return best.rename(columns={"step": "peak_step", "value": "peak_mean"}).reset_index(drop=True)


def paired_changes(per: pd.DataFrame, peak_steps: dict[str, int], **boot) -> pd.DataFrame:
    """Every step minus step 0 (``vs="start"``), minus the checkpoint before (``vs="previous"``),
    and each step after a reliance peak minus that peak's step (``vs="peak:<prompt>"``): means with
    95 % bootstrap intervals over facts, per prompt and quantity."""
    wide = per.pivot_table(index=["conflict_type", "quantity", "fact"], columns="step", values="value")
    steps = sorted(wide.columns)
    pairs = [("start", steps[0], s) for s in steps[1:]] + [("previous", a, b) for a, b in zip(steps, steps[1:])]
    pairs += [(f"peak:{c}", p, s) for c, p in peak_steps.items() for s in steps if s > p]
    frames = []
    for vs, a, b in pairs:
        d = (wide[b] - wide[a]).dropna().rename("value").reset_index()
        frames.append(d.assign(vs=vs, from_step=a, to_step=b))
    by = ["vs", "from_step", "to_step", "conflict_type", "quantity"]
    return bootstrap_summary(pd.concat(frames, ignore_index=True), value="value", by=by, unit="fact", **boot)


def figure(summary: pd.DataFrame, steps_per_epoch: float, peak_steps: dict[str, int]):
    """One panel per quantity, x in epochs, one line per prompt, 95 % intervals over items; dotted
    line at one epoch, dashed lines at the reliance peaks."""
    frame = summary[summary.quantity.isin(SHOWN)].copy()
    frame["panel"] = frame.quantity.map(lambda q: SHOWN[q][0])
    frame["epoch"] = frame.step / steps_per_epoch
    frame = frame.assign(err_plus=frame.ci_high - frame["mean"], err_minus=frame["mean"] - frame.ci_low)
    fig = px.line(
        frame.sort_values(["panel", "conflict_type", "step"]),
        x="epoch",
        y="mean",
        color="conflict_type",
        facet_col="panel",
        facet_col_wrap=3,
        facet_row_spacing=0.14,
        category_orders={"panel": [v[0] for v in SHOWN.values()]},
        error_y="err_plus",
        error_y_minus="err_minus",
        markers=True,
        color_discrete_map=COLOURS,
        labels={"mean": "", "epoch": "epochs of finetuning", "conflict_type": "prompt"},
        title="Gemma-3-270M, MLP-LoRA on context QA: reliance, recall and benchmark stand-ins (95 % CIs over items)",
    )
    fig.update_yaxes(matches=None, showticklabels=True)
    fig.update_xaxes(showticklabels=True)
    fig.add_vline(x=1.0, line_dash="dot", line_color="grey")
    for conflict, step in peak_steps.items():
        fig.add_vline(x=step / steps_per_epoch, line_dash="dash", line_color=COLOURS[conflict], opacity=0.6)
    fig.for_each_annotation(lambda a: a.update(text=a.text.split("=", 1)[-1]))
    return fig.update_layout(width=1300, height=720)


def measure_order(step: int, last: int) -> tuple[int, int]:
    """The order checkpoints are measured in, so that a run cut short still spans the run: step 0,
    the reference run's reliance peak (step 40), the last step, then the rest in order."""
    first = {0: 0, 40: 1, last: 2}
    return (first.get(step, 3), step)


def run(args) -> None:
    """Train the reference run again and measure every checkpoint; write ``per_item.csv.gz``."""
    out = Path(args.out)
    torch.set_num_threads(1)
    start, cpu = time.perf_counter(), time.process_time()
    ref_settings = json.loads((Path(args.reference) / "timing.json").read_text())["settings"]
    saved = pd.read_csv(Path(args.reference) / "per_fact.csv.gz")
    saved = saved[saved.run == variants.REFERENCE].drop(columns="run")
    model = cp.load_model()
    train, held = variants.facts(model, ref_settings["n_eval"])
    closed = closed_book_facts(model, args.n_candidates)
    reading = true_context(held)
    targets, relations = variants.RUNS[variants.REFERENCE]
    data = train[relations[0]] + train[relations[1]] + train[relations[2]]
    s = ref_settings
    pairs = context_training_pairs(
        data, counterfactual_share=s["share"], conflict_types=s["train_prompts"], seed=s["seed"]
    )
    settings = LoraSettings(
        s["steps"], s["batch_size"], s["rank"], 2.0 * s["rank"], s["lr"], s["save_every"], s["seed"], targets=targets
    )
    timing = {"pairs": len(pairs), "held_out_facts": len(held), "closed_book_facts": len(closed)}
    timing |= {"closed_book_by_relation": {r: sum(e.relation == r for e in closed) for r in BENCH_RELATIONS}}
    timing |= {"settings": vars(args), "reference_settings": s}
    frames, fresh = [], []
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        checkpoints = lora_finetune(model, pairs, tmp, settings=settings, progress=False)
        timing["train_s"] = round(time.perf_counter() - t0, 1)
        for checkpoint in sorted(checkpoints, key=lambda c: measure_order(c.step, settings.steps)):
            t1, tuned = time.perf_counter(), checkpoint()
            step = checkpoint.step
            frames.append(benchmark_rows(tuned, reading, closed).assign(step=step, source="measured"))
            if step in args.shared_steps:
                shared = variants.measure(tuned, held).assign(step=step)
                fresh.append(shared)
                frames.append(shared.assign(source="measured"))
            else:
                frames.append(saved[saved.step == step].assign(source="reference run"))
            print(f"step {step}: {time.perf_counter() - t1:.0f} s", flush=True)
            del tuned
            # written after every checkpoint, so that a run cut short leaves what it measured
            timing["measure_s"] = round(time.perf_counter() - t0 - timing["train_s"], 1)
            pd.concat(frames, ignore_index=True).to_csv(out / "per_item.csv.gz", index=False, float_format="%.6g")
            if fresh:
                reproducibility(pd.concat(fresh, ignore_index=True), saved).to_csv(
                    out / "reproducibility.csv", index=False, float_format="%.4g"
                )
            timing |= {"wall_s": round(time.perf_counter() - start, 1), "cpu_s": round(time.process_time() - cpu, 1)}
            timing["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
            (out / "timing.json").write_text(json.dumps(timing, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="finetune_inversion_benchmarks")
    parser.add_argument("--reference", default=str(REFERENCE_DIR), help="the variants run to repeat and check")
    parser.add_argument("--shared-steps", type=int, nargs="+", default=[0, 20, 40], help="steps measured anew")
    parser.add_argument("--n-candidates", type=int, default=60, help="facts per untrained relation to filter")
    parser.add_argument("--summarise-only", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.summarise_only:
        run(args)
    per = pd.read_csv(out / "per_item.csv.gz")
    timing = json.loads((out / "timing.json").read_text())
    steps_per_epoch = timing["pairs"] / timing["reference_settings"]["batch_size"]
    summary = bootstrap_summary(per, value="value", by=["step", "conflict_type", "quantity"], unit="fact")
    summary["epoch"] = summary.step / steps_per_epoch
    summary.to_csv(out / "summary.csv", index=False, float_format="%.4g")
    peak = reliance_peak(per).assign(peak_epoch=lambda f: f.peak_step / steps_per_epoch)
    peak.to_csv(out / "peak.csv", index=False, float_format="%.4g")
    peak_steps = dict(zip(peak.conflict_type, peak.peak_step.astype(int)))
    paired = paired_changes(per, peak_steps)
    paired.to_csv(out / "paired.csv", index=False, float_format="%.4g")
    print(pd.read_csv(out / "reproducibility.csv").to_string(index=False))
    print(peak.to_string(index=False))
    for (conflict, quantity), group in summary.groupby(["conflict_type", "quantity"]):
        cells = "  ".join(
            f"{s}: {cp.stats.format_ci(m, lo, hi)}"
            for s, m, lo, hi in group[["step", "mean", "ci_low", "ci_high"]].itertuples(index=False)
        )
        print(f"{conflict} | {quantity} (n={group.n.iloc[0]})\n    {cells}")
    shown = paired[paired.vs.str.startswith("peak") & paired.quantity.isin(SHOWN)]
    print(shown.to_string(index=False))
    try:
        cp.plots.save_figures(
            {out / "benchmarks": figure(summary, steps_per_epoch, peak_steps)}, formats="png", scale=1.0
        )
    except Exception as err:  # figure export needs the export extra and a Chromium
        print(f"figure not written: {err}")


if __name__ == "__main__":
    main()
