"""Context-parametric inversion on the embedded model: LoRA-finetune Gemma-3-270M on
question-answering prompts whose context gives the answer, where most contexts agree with what the
model knows and a share are counterfactual, and measure at every checkpoint how often the model
follows a conflicting context and how well it still recalls facts without one.

Facts: the known facts (first-token top-1 on the clean prompt) of three relations; the last
``--n-eval`` of each relation are held out for measuring, the rest are trained on (substitution-
and coherent-style contexts). One run per ``--shares`` value (the share of counterfactual
contexts: small as in real instruction data, larger as the paper's remedy).

Writes, under --out: ``per_example.csv.gz`` (every score of every checkpoint), ``summary.csv``
(mean and 95 % bootstrap interval over held-out facts per run x step x conflict type x measure),
``timing.json``, and ``finetune_inversion.png`` when figure export works.

    HF_HUB_OFFLINE=1 python scripts/finetune_inversion.py --out docs/results/finetune_inversion
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

import pandas as pd
import plotly.express as px

import cpsuper as cp
from cpsuper.finetune import LoraSettings, context_training_pairs, lora_finetune
from cpsuper.stats import bootstrap_summary

RELATIONS = ("world_capital", "official_language", "company_headquarter")
MEASURES = {
    ("clean", "acc_parametric"): "clean: true answer (greedy)",
    ("substitution", "acc_context"): "substitution: context answer (greedy)",
    ("coherent", "acc_context"): "coherent: context answer (greedy)",
    ("substitution", "context_wins"): "substitution: context first token ahead",
    ("coherent", "context_wins"): "coherent: context first token ahead",
}


def facts(model, n_eval: int):
    train, held = None, None
    for relation in RELATIONS:
        known = cp.filter_known(model, cp.conflict_dataset(relation, tokenizer=model), by="top1", progress=False)
        a, b = known[: len(known) - n_eval], known[len(known) - n_eval :]
        train, held = (a, b) if train is None else (train + a, held + b)
    return train, held


def score(model, held, run: str, step: int) -> pd.DataFrame:
    frame = cp.score_dataset(model, held, progress=False, max_new_tokens=6)
    frame["example"] = frame["relation"] + ":" + frame["subject"]
    return frame.assign(run=run, step=step)


def summarise(per: pd.DataFrame) -> pd.DataFrame:
    keep = pd.Series(list(zip(per.conflict_type, per.measure))).isin(list(MEASURES)).to_numpy()
    part = per[keep]
    out = bootstrap_summary(part, value="value", by=["run", "step", "conflict_type", "measure"], unit="example")
    out["label"] = [MEASURES[(c, m)] for c, m in zip(out.conflict_type, out.measure)]
    return out


def figure(summary: pd.DataFrame):
    """Greedy accuracies (the first-token measures look the same) against the step, one panel each."""
    frame = summary[summary.measure.str.startswith("acc_")]
    frame = frame.assign(err_plus=frame.ci_high - frame["mean"], err_minus=frame["mean"] - frame.ci_low)
    fig = px.line(
        frame,
        x="step",
        y="mean",
        color="run",
        facet_col="label",
        facet_col_wrap=3,
        error_y="err_plus",
        error_y_minus="err_minus",
        markers=True,
        labels={"mean": "accuracy / share", "step": "finetuning step"},
        title="LoRA finetuning of Gemma-3-270M with contexts: following the context vs recalling facts",
    )
    fig.for_each_annotation(lambda a: a.update(text=a.text.split("=", 1)[-1].split(" (")[0].replace(" answer", "")))
    return fig.update_layout(width=1100, height=420)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="finetune_inversion")
    parser.add_argument("--shares", type=float, nargs="+", default=[0.1, 0.5])
    parser.add_argument("--n-eval", type=int, default=10, help="held-out facts per relation")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--summarise-only", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.summarise_only:
        start, cpu = time.perf_counter(), time.process_time()
        model = cp.load_model()
        train, held = facts(model, args.n_eval)
        settings = LoraSettings(args.steps, args.batch_size, args.rank, 2.0 * args.rank, args.lr, args.save_every)
        frames, timing = [], {"train_facts": len(train), "held_out_facts": len(held), "settings": vars(args)}
        for share in args.shares:
            run = f"counterfactual share {share:g}"
            pairs = context_training_pairs(train, counterfactual_share=share)
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.perf_counter()
                checkpoints = lora_finetune(model, pairs, tmp, settings=settings)
                t1 = time.perf_counter()
                for checkpoint in checkpoints:
                    frames.append(score(checkpoint(), held, run, checkpoint.step))
            timing[run] = {
                "pairs": len(pairs),
                "train_s": round(t1 - t0, 1),
                "score_s": round(time.perf_counter() - t1, 1),
            }
            print(run, timing[run], flush=True)
        per = pd.concat(frames, ignore_index=True)
        per.to_csv(out / "per_example.csv.gz", index=False, float_format="%.6g")
        timing["wall_s"] = round(time.perf_counter() - start, 1)
        timing["cpu_s"] = round(time.process_time() - cpu, 1)
        timing["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
        (out / "timing.json").write_text(json.dumps(timing, indent=1) + "\n")
    summary = summarise(pd.read_csv(out / "per_example.csv.gz"))
    summary.to_csv(out / "summary.csv", index=False, float_format="%.4g")
    for (run, label), group in summary.groupby(["run", "label"], sort=False):
        cells = "  ".join(
            f"{s}: {cp.stats.format_ci(m, lo, hi)}"
            for s, m, lo, hi in group[["step", "mean", "ci_low", "ci_high"]].itertuples(index=False)
        )
        print(f"{run} | {label}\n    {cells}")
    try:
        cp.plots.save_figure(figure(summary), out / "finetune_inversion", formats="png", scale=1.0)
    except Exception as err:  # figure export needs the export extra and a Chromium
        print(f"figure not written: {err}")


if __name__ == "__main__":
    main()
