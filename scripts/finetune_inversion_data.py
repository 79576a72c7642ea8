"""Context-parametric inversion on the embedded model: what the finetuning data holds.

Builds the training pairs of the reference ``mlp`` run of ``scripts/finetune_inversion_variants.py``
(same facts, counterfactual share, context style and seed; its ``facts`` and ``measure`` are
imported from that script) and

1. classifies them by a no-context check: each pair's answer is scored after its fact's clean
   prompt (no context) by the base model (``cpsuper.finetune.no_context_check``); a pair whose
   answer's first token is already the model's top token is not context-critical, the others are.
   The paper's own filter (drop the 25 % with the lowest no-context loss) is listed next to it.
2. ``context-critical``: finetunes on the context-critical pairs only, with the reference run's
   settings, and compares the context margin's rise to step 40 and fall after it with the
   reference run, paired over the held-out facts;
3. ``subject-only``: adds clean-prompt pairs (no context, true answer) of a share of the training
   facts, all known to the model (``context_training_pairs(subject_only_share=...)``), and
   compares the final position's attention to the subject and to the context;
4. ``nq-swap``: adds the NQ-Swap-format counterfactual examples of
   ``cpsuper/data/context_tasks/nq_swap.csv`` (passage, question, substituted answer) and compares
   context reliance and no-context recall.

5. ``--task-specificity`` (the paper's Fig. 5a-b test): splits ``nq_swap.csv`` with the seed into a
   training part (two thirds) and a held-out part, trains the reference pairs plus the training
   part (``nq-swap-split``) and the reference pairs alone (``reference``, the same run as the
   saved one, checked against its saved numbers), and scores the base model and both step-40
   models on the held-out NQ-Swap items (similar task), the MemoTrap-format sayings and
   proverb-ending items (a different kind of conflict) and a reading-comprehension stand-in (the
   held-out facts after a context that states the true answer), with
   ``cp.evaluate``'s greedy reading as ``scripts/juice_context_tasks.py`` scores them. Writes
   under ``--out/tasks``.

``mlp-repeat`` re-runs the reference run for ``--steps`` steps: it checks that the saved
reference data can be reused (same numbers) and adds the attention to the subject, which the
reference run did not measure. Comparisons are paired over the 36 held-out facts; intervals are
95 % bootstrap intervals over facts (over pairs for the shares of item 1).

Writes under --out: ``classification.csv`` (one row per training pair), ``shares.csv``,
``per_fact.csv.gz``, ``summary.csv``, ``paired.csv``, ``peak_fall.csv``, ``reuse_check.json``,
``timing.json`` and ``data.png``.

    HF_HUB_OFFLINE=1 python scripts/finetune_inversion_data.py --out docs/results/finetune_inversion/data
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import random
import resource
import tempfile
import time
from pathlib import Path

import pandas as pd
import plotly.express as px
import torch

import cpsuper as cp
from cpsuper.finetune import LoraSettings, context_training_pairs, lora_finetune, no_context_check
from cpsuper.stats import bootstrap_summary


def _variants():
    path = Path(__file__).parent / "finetune_inversion_variants.py"
    spec = importlib.util.spec_from_file_location("finetune_inversion_variants", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


V = _variants()
RUNS = ("mlp-repeat", "context-critical", "subject-only", "nq-swap")
REFERENCE = "mlp"  # the saved reference run (steps 0-120), with mlp-repeat's subject attention added
SHOWN = (
    ("substitution", "context_margin"),
    ("coherent", "context_margin"),
    ("clean", "acc"),
    ("substitution", "attention_subject"),
    ("substitution", "attention_context"),
    ("coherent", "attention_subject"),
    ("coherent", "attention_context"),
    ("clean", "attention_subject"),
)


def classify(pairs: list, no_context: list, examples: dict, losses, top1, drop_share: float = 0.25) -> pd.DataFrame:
    """One row per training pair: its relation, whether its context is counterfactual, the base
    model's no-context loss and top-1 check, ``critical`` (the answer is not the top token without
    the context) and ``kept_by_loss`` (outside the ``drop_share`` of pairs with the lowest
    no-context loss, the paper's filter)."""
    rows = []
    for (prompt, answer), (clean, _) in zip(pairs, no_context):
        example = examples[clean]
        rows.append(
            {
                "relation": example.relation,
                "subject": example.subject,
                "prompt": prompt,
                "answer": answer,
                "counterfactual": answer != example.answer,
            }
        )
    frame = pd.DataFrame(rows)
    frame["pair"] = range(len(frame))
    frame["no_context_loss"] = [float(x) for x in losses]
    frame["answered_without_context"] = [bool(x) for x in top1]
    frame["critical"] = ~frame.answered_without_context
    cut = frame.no_context_loss.quantile(drop_share)
    frame["kept_by_loss"] = frame.no_context_loss > cut
    return frame


def shares(frame: pd.DataFrame) -> pd.DataFrame:
    """Share of context-critical pairs (and of counterfactual ones, and of those the loss filter
    keeps) per relation and over all, intervals over pairs."""
    both = pd.concat([frame, frame.assign(relation="all")], ignore_index=True)
    long = both.melt(["relation", "pair"], ["critical", "counterfactual", "kept_by_loss"], var_name="quantity")
    long["value"] = long.value.astype(float)
    return bootstrap_summary(long, value="value", by=["relation", "quantity"], unit="pair")


def subject_attention(model, held) -> pd.DataFrame:
    """The final position's attention to the subject's tokens (every occurrence), mean over layers
    and heads, per held-out fact and prompt."""
    att = cp.attention_to_span(
        model, held, "subject", conflict_types=["clean", "substitution", "coherent"], progress=False
    )
    per = att.per_example.groupby(["example", "conflict_type"], as_index=False).attention.mean()
    per = per.rename(columns={"attention": "value"}).assign(quantity="attention_subject")
    per["relation"] = [held[int(i)].relation for i in per.example]
    per["fact"] = per.relation + ":" + [held[int(i)].subject for i in per.example]
    return per.drop(columns="example")


def measure(model, held) -> pd.DataFrame:
    return pd.concat([V.measure(model, held), subject_attention(model, held)], ignore_index=True)


def nq_swap_pairs() -> list[tuple[str, str]]:
    """The NQ-Swap-format counterfactual examples as training pairs: passage and question, the
    passage's (substituted) answer."""
    data = cp.load_context_tasks("nq_swap")
    return [(e.prompts["substitution"], e.context_answer) for e in data]


def run_pairs(name: str, base_pairs: list, critical: list, data, args) -> list:
    if name == "mlp-repeat":
        return base_pairs
    if name == "context-critical":
        return [p for p, c in zip(base_pairs, critical) if c]
    if name == "subject-only":
        return context_training_pairs(
            data,
            counterfactual_share=args.share,
            conflict_types=args.train_prompts,
            seed=args.seed,
            subject_only_share=args.subject_share,
        )
    extra = nq_swap_pairs()
    mixed = base_pairs + extra
    random.Random(args.seed).shuffle(mixed)
    return mixed


def paired(per: pd.DataFrame, against: str = REFERENCE) -> pd.DataFrame:
    """Each run minus ``against``, paired over facts at the steps both measured."""
    index = ["step", "conflict_type", "quantity", "fact"]
    ref = per[per.run == against].set_index(index).value.rename("ref")
    diffs = []
    for run, part in per[~per.run.isin([against, "mlp-repeat"])].groupby("run"):
        joined = part.set_index(index).value.to_frame().join(ref, how="inner")
        diffs.append(joined.assign(run=run, value=joined.value - joined.ref).reset_index())
    keys = ["run", "step", "conflict_type", "quantity"]
    return bootstrap_summary(pd.concat(diffs), value="value", by=keys, unit="fact")


def peak_fall(per: pd.DataFrame, runs=(REFERENCE, "context-critical"), peak: int = 40, last: int = 80) -> pd.DataFrame:
    """Per run: the rise from step 0 to ``peak`` (the reference run's peak, fixed in advance) and
    the change from ``peak`` to ``last``, paired over facts; and the context-critical run's change
    minus the reference run's, paired over facts."""
    rows = []
    for (conflict, quantity), part in per[per.run.isin(runs)].groupby(["conflict_type", "quantity"]):
        wide = part.pivot_table(index="fact", columns=["run", "step"], values="value")
        if not all((r, s) in wide for r in runs for s in (0, peak, last)):
            continue
        changes = {}
        for run in runs:
            changes[run, "rise"] = wide[run, peak] - wide[run, 0]
            changes[run, "fall"] = wide[run, last] - wide[run, peak]
        for change in ("rise", "fall"):
            changes[f"{runs[1]} minus {runs[0]}", change] = changes[runs[1], change] - changes[runs[0], change]
        for (run, change), value in changes.items():
            rows.append(
                pd.DataFrame({"fact": wide.index, "value": value.values}).assign(
                    run=run, conflict_type=conflict, quantity=quantity, change=change
                )
            )
    frame = pd.concat(rows, ignore_index=True)
    return bootstrap_summary(frame, value="value", by=["run", "conflict_type", "quantity", "change"], unit="fact")


def figure(summary: pd.DataFrame):
    keep = pd.Series(list(zip(summary.conflict_type, summary.quantity))).isin(SHOWN).values
    frame = summary[keep & (summary.step <= 80) & (summary.run != "mlp-repeat")].copy()  # the same as mlp
    frame["panel"] = frame.conflict_type + ": " + frame.quantity
    frame = frame.assign(err_plus=frame.ci_high - frame["mean"], err_minus=frame["mean"] - frame.ci_low)
    fig = px.line(
        frame.sort_values(["panel", "run", "step"]),
        x="step",
        y="mean",
        color="run",
        facet_col="panel",
        facet_col_wrap=4,
        facet_col_spacing=0.05,
        error_y="err_plus",
        error_y_minus="err_minus",
        markers=True,
        labels={"mean": "", "step": "finetuning step", "run": "training data"},
        title="Gemma-3-270M, MLP LoRA: 36 held-out facts by finetuning data (95 % intervals over facts)",
    )
    fig.update_yaxes(matches=None, showticklabels=True)
    fig.for_each_annotation(lambda a: a.update(text=a.text.split("=", 1)[-1]))
    return fig.update_layout(width=1400, height=700)


def reuse_check(per: pd.DataFrame) -> dict:
    """Largest difference between mlp-repeat and the saved reference run, per quantity."""
    index = ["step", "conflict_type", "quantity", "fact"]
    mine = per[per.run == "mlp-repeat"].set_index(index).value
    ref = per[per.run == REFERENCE].set_index(index).value
    joined = mine.to_frame("repeat").join(ref.rename("ref"), how="inner")
    diff = (joined.repeat - joined.ref).abs().groupby(level="quantity").max()
    return {"n_compared": len(joined), "max_abs_diff": {k: float(v) for k, v in diff.items()}}


NQ_TRAIN_SHARE = 2 / 3
TASK_RUNS = ("reference", "nq-swap-split")
MEMOTRAP_TASKS = ("sayings", "proverb_ending")


def nq_split(n: int, seed: int, train_share: float = NQ_TRAIN_SHARE) -> tuple[list[int], list[int]]:
    """Indices of a seeded split of ``n`` items into a training part (``round(train_share * n)``
    items) and the held-out rest, both sorted; disjoint and together all ``n``."""
    train = sorted(random.Random(seed).sample(range(n), round(train_share * n)))
    chosen = set(train)
    return train, [i for i in range(n) if i not in chosen]


def true_context(held) -> cp.ConflictDataset:
    """Reading-comprehension stand-in: each held-out fact's one-sentence context with the true
    answer put in place of the counterfactual one (as in the training pairs that are not
    counterfactual), so that following the context and recalling the fact agree; the answer read
    is the true one."""
    examples = [
        dataclasses.replace(
            e,
            prompts={"substitution": e.prompts["substitution"].replace(e.context_answer, e.answer)},
            context_answer=e.answer,
            context_aliases=tuple(e.aliases),
        )
        for e in held
    ]
    return cp.ConflictDataset(examples, "reading")


def class_match(continuation: str, ending: str) -> bool:
    """Exact class match (as in ``scripts/juice_context_tasks.py``): the continuation's first
    words are the instructed ending."""
    return cp.reading.mentions_answer(continuation, [ending], n_words=len(ending.split()))


def task_scores(model, tasks: dict) -> pd.DataFrame:
    """Per item of each task (``{name: ConflictDataset}``, substitution prompts): ``correct``,
    greedy accuracy toward the context as ``cp.evaluate`` reads it (for MemoTrap-format tasks the
    exact class match instead), and ``context_wins``, whether the context answer's first token
    outscores the memorised one's at the last position (not for the reading task, where they are
    the same answer)."""
    method = cp.Original(model, direction="context")
    rows = []
    for name, dataset in tasks.items():
        part = cp.evaluate({"model": method}, dataset, ["substitution"])
        if name in MEMOTRAP_TASKS:
            part["correct"] = [float(class_match(t, e.context_answer)) for t, e in zip(part.continuation, dataset)]
        wins = [float("nan")] * len(dataset)
        if name != "reading":
            logits = method.logits_for(dataset, "substitution")
            prompts = dataset.prompts("substitution")
            for i, e in enumerate(dataset):
                context, memory = (cp.runtime.answer_token(model, a, prompts[i]) for a in (e.context_answer, e.answer))
                wins[i] = float(logits[i, context] > logits[i, memory])
        part["context_wins"] = wins
        rows.append(part.assign(task=name, item=name + ":" + part.example.astype(str)))
    frame = pd.concat(rows, ignore_index=True)
    keep = ["task", "item", "subject", "continuation", "correct", "context_wins"]
    return frame[keep].melt(keep[:4], ["correct", "context_wins"], var_name="quantity").dropna(subset=["value"])


def task_paired(per: pd.DataFrame, final: int) -> pd.DataFrame:
    """Paired over items: each run's change from step 0 to ``final``, and ``nq-swap-split`` minus
    ``reference`` at ``final``."""
    wide = per.pivot_table(index=["task", "quantity", "item"], columns=["run", "step"], values="value")
    changes = {run: wide[run, final] - wide[run, 0] for run in TASK_RUNS}
    changes["nq-swap-split minus reference"] = wide["nq-swap-split", final] - wide["reference", final]
    frames = [v.rename("value").reset_index().assign(comparison=k) for k, v in changes.items()]
    frame = pd.concat(frames, ignore_index=True)
    return bootstrap_summary(frame, value="value", by=["comparison", "task", "quantity"], unit="item")


def task_figure(summary: pd.DataFrame):
    frame = summary.assign(
        panel=summary.task + ": " + summary.quantity,
        err_plus=summary.ci_high - summary["mean"],
        err_minus=summary["mean"] - summary.ci_low,
        at="step " + summary.step.astype(str),
    )
    fig = px.bar(
        frame.sort_values(["panel", "step", "run"], ascending=[True, True, False]),
        x="at",
        y="mean",
        color="run",
        facet_col="panel",
        facet_col_wrap=4,
        facet_col_spacing=0.05,
        error_y="err_plus",
        error_y_minus="err_minus",
        barmode="group",
        labels={"mean": "share of items", "at": "", "run": "training data"},
        title="Gemma-3-270M, MLP LoRA: NQ-Swap augmentation by task (95 % intervals over items)",
    )
    fig.update_yaxes(matches=None, showticklabels=True, range=[0, 1.05])
    fig.update_xaxes(showticklabels=True)
    fig.for_each_annotation(lambda a: a.update(text=a.text.split("=", 1)[-1]))
    return fig.update_layout(width=1400, height=650)


def task_specificity(model, pairs: list, held, args) -> None:
    """The Fig. 5a-b test (module docstring, item 5); writes under ``args.out / "tasks"``."""
    out = Path(args.out) / "tasks"
    out.mkdir(parents=True, exist_ok=True)
    start, cpu = time.perf_counter(), time.process_time()
    nq = cp.load_context_tasks("nq_swap")
    train_idx, held_idx = nq_split(len(nq), args.seed)
    extra = [(nq[i].prompts["substitution"], nq[i].context_answer) for i in train_idx]
    tasks = {
        "nq_swap_held_out": cp.ConflictDataset([nq[i] for i in held_idx], "nq_swap_held_out"),
        "sayings": cp.data.load_sayings().with_prompts(["substitution"]),
        "proverb_ending": cp.load_context_tasks("proverb_ending").with_prompts(["substitution"]),
        "reading": true_context(held),
    }
    timing = {"settings": vars(args), "nq_train": train_idx, "nq_held_out": held_idx}
    parts = [task_scores(model, tasks).assign(run=run, step=0) for run in TASK_RUNS[:1]]
    parts = [parts[0], parts[0].assign(run=TASK_RUNS[1])]
    timing["score_base_s"] = round(time.perf_counter() - start, 1)
    relations = []
    for name in TASK_RUNS:
        run_list = pairs if name == "reference" else pairs + extra
        if name != "reference":
            random.Random(args.seed).shuffle(run_list)
        settings = LoraSettings(
            args.steps, args.batch_size, args.rank, 2.0 * args.rank, args.lr, args.save_every, args.seed
        )
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            last = lora_finetune(model, run_list, tmp, settings=settings)[-1]
            t1 = time.perf_counter()
            tuned = last()
            parts.append(task_scores(tuned, tasks).assign(run=name, step=last.step))
            t2 = time.perf_counter()
            relations.append(V.measure(tuned, held).assign(run=name, step=last.step))
            del tuned
        timing[name] = {
            "pairs": len(run_list),
            "steps": last.step,
            "train_s": round(t1 - t0, 1),
            "score_tasks_s": round(t2 - t1, 1),
            "score_relations_s": round(time.perf_counter() - t2, 1),
        }
        print(name, timing[name], flush=True)
        pd.concat(parts, ignore_index=True).to_csv(out / "per_item.csv.gz", index=False)
        pd.concat(relations, ignore_index=True).to_csv(out / "per_fact.csv.gz", index=False, float_format="%.6g")
        timing["wall_s"] = round(time.perf_counter() - start, 1)
        timing["cpu_s"] = round(time.process_time() - cpu, 1)
        timing["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
        (out / "timing.json").write_text(json.dumps(timing, indent=1) + "\n")


def summarise_tasks(args) -> None:
    """Intervals, paired differences, the reuse check against the saved reference and the figure."""
    out = Path(args.out) / "tasks"
    per = pd.read_csv(out / "per_item.csv.gz")
    final = int(per.step.max())
    summary = bootstrap_summary(per, value="value", by=["run", "step", "task", "quantity"], unit="item")
    summary.to_csv(out / "summary.csv", index=False, float_format="%.4g")
    diffs = task_paired(per, final)
    diffs.to_csv(out / "paired.csv", index=False, float_format="%.4g")
    print(summary.to_string(index=False))
    print(diffs.to_string(index=False))
    rel = pd.read_csv(out / "per_fact.csv.gz")
    saved = pd.read_csv(Path(args.reference) / "per_fact.csv.gz")
    index = ["step", "conflict_type", "quantity", "fact"]
    mine = rel[rel.run == "reference"].set_index(index).value
    ref = saved[saved.run == REFERENCE].set_index(index).value
    joined = mine.to_frame("mine").join(ref.rename("ref"), how="inner")
    check = {"n_compared": len(joined), "max_abs_diff": float((joined["mine"] - joined.ref).abs().max())}
    (out / "reuse_check.json").write_text(json.dumps(check, indent=1) + "\n")
    print(check)
    rel = pd.concat([rel, saved[(saved.run == REFERENCE) & (saved.step == 0)].assign(run="nq-swap-split")])
    rel = pd.concat([rel, saved[(saved.run == REFERENCE) & (saved.step == 0)].assign(run="reference")])
    rel_sum = bootstrap_summary(rel, value="value", by=["run", "step", "conflict_type", "quantity"], unit="fact")
    rel_sum.to_csv(out / "relations_summary.csv", index=False, float_format="%.4g")
    rel_diff = paired(rel.assign(run=rel.run.replace({"reference": REFERENCE})))
    rel_diff.to_csv(out / "relations_paired.csv", index=False, float_format="%.4g")
    print(rel_diff[rel_diff.step == final].to_string(index=False))
    try:
        cp.plots.save_figure(task_figure(summary), out / "tasks", formats="png", scale=1.0)
    except Exception as err:  # figure export needs the export extra and a Chromium
        print(f"figure not written: {err}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="finetune_inversion_data")
    parser.add_argument("--reference", default="docs/results/finetune_inversion/variants")
    parser.add_argument("--runs", nargs="*", choices=RUNS, default=list(RUNS))
    parser.add_argument("--steps", type=int, default=40, help="steps of every run but context-critical")
    parser.add_argument("--critical-steps", type=int, default=80)
    parser.add_argument("--subject-share", type=float, default=0.5, help="share of facts given a subject-only pair")
    parser.add_argument("--append", action="store_true", help="add --runs to the runs already under --out")
    parser.add_argument("--summarise-only", action="store_true")
    parser.add_argument("--task-specificity", action="store_true", help="run only the Fig. 5a-b test (item 5)")
    args = parser.parse_args()
    ref_settings = json.loads((Path(args.reference) / "timing.json").read_text())["settings"]
    for key in ("share", "n_eval", "train_prompts", "save_every", "batch_size", "rank", "lr", "seed"):
        setattr(args, key, ref_settings[key])  # the reference run's settings, exactly
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.task_specificity:
        if not args.summarise_only:
            torch.set_num_threads(1)
            model = cp.load_model()
            train, held = V.facts(model, args.n_eval)
            data = None
            for relation in V.RELATIONS:
                data = train[relation] if data is None else data + train[relation]
            options = {"counterfactual_share": args.share, "conflict_types": args.train_prompts, "seed": args.seed}
            task_specificity(model, context_training_pairs(data, **options), held, args)
        summarise_tasks(args)
        return
    if not args.summarise_only:
        torch.set_num_threads(1)
        start, cpu = time.perf_counter(), time.process_time()
        model = cp.load_model()
        train, held = V.facts(model, args.n_eval)
        data = None
        for relation in V.RELATIONS:
            data = train[relation] if data is None else data + train[relation]
        options = {"counterfactual_share": args.share, "conflict_types": args.train_prompts, "seed": args.seed}
        pairs = context_training_pairs(data, **options)
        no_context = context_training_pairs(data, **options, no_context=True)
        losses, top1 = no_context_check(model, no_context)
        frame = classify(pairs, no_context, {e.prompts["clean"]: e for e in data}, losses, top1)
        frame.to_csv(out / "classification.csv", index=False, float_format="%.4g")
        timing = {"settings": vars(args), "classify_s": round(time.perf_counter() - start, 1)}
        frames = []
        if args.append:
            frames = [pd.read_csv(out / "per_fact.csv.gz")]
            timing = {**json.loads((out / "timing.json").read_text()), "settings_appended": vars(args)}
        base = frames[0][frames[0].step == 0].drop(columns="run").drop_duplicates() if frames else None
        for name in args.runs:
            run_list = run_pairs(name, pairs, list(frame.critical), data, args)
            steps = args.critical_steps if name == "context-critical" else args.steps
            settings = LoraSettings(
                steps, args.batch_size, args.rank, 2.0 * args.rank, args.lr, args.save_every, args.seed
            )
            parts = []
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.perf_counter()
                checkpoints = lora_finetune(model, run_list, tmp, settings=settings)
                t1 = time.perf_counter()
                for checkpoint in checkpoints:
                    if checkpoint.step == 0:
                        base = measure(model, held).assign(step=0) if base is None else base
                        parts.append(base.assign(run=name))
                    else:
                        parts.append(measure(checkpoint(), held).assign(run=name, step=checkpoint.step))
            timing[name] = {
                "pairs": len(run_list),
                "steps": steps,
                "train_s": round(t1 - t0, 1),
                "measure_s": round(time.perf_counter() - t1, 1),
            }
            print(name, timing[name], flush=True)
            frames.append(pd.concat(parts, ignore_index=True))
            pd.concat(frames, ignore_index=True).to_csv(out / "per_fact.csv.gz", index=False, float_format="%.6g")
            timing["wall_s" if not args.append else "appended_wall_s"] = round(time.perf_counter() - start, 1)
            timing["cpu_s" if not args.append else "appended_cpu_s"] = round(time.process_time() - cpu, 1)
            timing["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
            (out / "timing.json").write_text(json.dumps(timing, indent=1) + "\n")
    frame = pd.read_csv(out / "classification.csv")
    table = shares(frame)
    table.to_csv(out / "shares.csv", index=False, float_format="%.4g")
    print(table.to_string(index=False))
    mine = pd.read_csv(out / "per_fact.csv.gz")
    mine["step"] = mine.step.fillna(0).astype(int)  # the base model: step 0
    ref = pd.read_csv(Path(args.reference) / "per_fact.csv.gz")
    ref = ref[ref.run == "mlp"].assign(run=REFERENCE)
    per = pd.concat([mine, ref], ignore_index=True)
    if "mlp-repeat" in set(mine.run):
        check = reuse_check(per)
        (out / "reuse_check.json").write_text(json.dumps(check, indent=1) + "\n")
        print(check)
        extra = mine[(mine.run == "mlp-repeat") & (mine.quantity == "attention_subject")].assign(run=REFERENCE)
        per = pd.concat([per, extra], ignore_index=True)
    summary = bootstrap_summary(per, value="value", by=["run", "step", "conflict_type", "quantity"], unit="fact")
    summary.to_csv(out / "summary.csv", index=False, float_format="%.4g")
    diffs = paired(per)
    diffs.to_csv(out / "paired.csv", index=False, float_format="%.4g")
    if "context-critical" in set(per.run):
        peaks = peak_fall(per)
        peaks.to_csv(out / "peak_fall.csv", index=False, float_format="%.4g")
        print(peaks.to_string(index=False))
    print(diffs[diffs.step.isin([20, 40, 80])].to_string(index=False))
    try:
        cp.plots.save_figure(figure(summary), out / "data", formats="png", scale=1.0)
    except Exception as err:  # figure export needs the export extra and a Chromium
        print(f"figure not written: {err}")


if __name__ == "__main__":
    main()
