"""JuICE toward the context at full size: the JuICE paper's Table 4 layout on cpsuper's own
context-direction tasks (docs/context_tasks.md), on the embedded model.

Heads are identified on 4 proverb-ending items the model knows (the paper's identification task
for this direction); the betas of JuICE and JuNe and PH3's k are tuned on a validation split of
the same task. Every method is then scored on the held-out proverb-ending items the model knows
and on every item of the other four tasks (proverb translation, hate-speech-free ending,
history-of-science questions, NQ-Swap format):

- MemoTrap-style tasks, exact class match: the 8-token greedy continuation starts with the
  instructed ending (``class_match``); also ``context_wins``: the instructed ending's first token
  outscores the memorised one's at the prompt's last position;
- NQ-Swap format: the substituted answer (or an alias) among the first 5 words of the 8-token
  greedy continuation;
- on every task, the side effect: ``clean_recall``, whether the same steering still gives the
  memorised answer (among the first 5 words) on the item's clean prompt (the text without its
  instruction or passage).

The validation split keeps its clean prompts, so the default robust recipe refuses strengths that
cost more than 0.05 of that plain recall on validation.

Methods: Original, Prompt, CAD (alpha 1), PH3 with the 4 selection items as development set
(PH3_s) and with selection + validation (PH3_l), JuNe and JuICE with the default robust recipe,
and JuNe and JuICE with the paper's recipe tuned on the instruction prompts alone.
Stages are cached under --out/cache, so an interrupted run resumes where it stopped.
``--gated-only`` fits and scores only JuICE with the context gate (``recipe="robust-gated"``,
JuICE's default strength grids) and splices its rows into the saved ``per_example.csv`` and
tables (the other methods' rows are kept as they were measured).

    python scripts/juice_context_tasks.py --out docs/results/juice_context_tasks
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

import cpsuper as cp
from cpsuper.data.context_tasks_loader import CONTEXT_TASK_KINDS, load_context_tasks
from cpsuper.reproduce import StepCache
from cpsuper.tuning import PAPER_BETA_NEG_GRID, PAPER_BETA_POS_GRID

IDENTIFY_ON = "proverb_ending"


# The strength grids these results were measured with (JuICE's defaults until 2026-11-27).
PAPER_GRIDS = {"beta_pos_grid": PAPER_BETA_POS_GRID, "beta_neg_grid": PAPER_BETA_NEG_GRID}


def class_match(continuation: str, ending: str) -> bool:
    """Exact class match: the continuation's first words are the instructed ending."""
    return cp.reading.mentions_answer(continuation, [ending], n_words=len(ending.split()))


def write_tables(results: pd.DataFrame, methods: list[str], tasks: list[str], out: Path, seed: int) -> pd.DataFrame:
    """per_example.csv, the three interval tables and table.csv (methods x tasks) from the rows."""
    results.to_csv(out / "per_example.csv", index=False)
    measures = {"correct": "table_ci.csv", "context_wins": "context_wins_ci.csv", "clean_recall": "clean_recall_ci.csv"}
    intervals = {
        measure: cp.baselines.evaluation_intervals(results.assign(correct=results[measure]), seed=seed)
        for measure in measures
    }
    for measure, file in measures.items():
        intervals[measure].round(4).to_csv(out / file, index=False)
    ci = intervals["correct"]
    table = ci.assign(cell=cp.stats.ci_strings(ci)).pivot(index="method", columns="relation", values="cell")
    table = table.loc[methods, [*tasks, "average"]]
    table.to_csv(out / "table.csv")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="juice_context_tasks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--val-frac", type=float, default=0.15, help="share of the known proverbs tuned on")
    parser.add_argument("--gated-only", action="store_true", help="score only JuICE (gated), splice its rows in")
    args = parser.parse_args()
    out = Path(args.out)
    cache = StepCache(out / "cache")
    settings = {"model": "gemma-3-270m", "seed": args.seed, "val_frac": args.val_frac}

    def stage(name, compute, *helpers):
        """The cached value of stage ``name``; its key covers the code and the stages before it."""
        return cache.get_or_compute(name, compute, key=settings, code=[compute, *helpers], after=list(cache.keys))

    model = cp.load_model()
    tasks = {kind: load_context_tasks(kind) for kind in CONTEXT_TASK_KINDS}
    known = stage("known", lambda: cp.filter_known(model, tasks[IDENTIFY_ON], progress=False))
    parts = cp.split(known, n_select=4, val_frac=args.val_frac, seed=args.seed)
    select, validation = parts.select, parts.validation  # stage 1 scores only the instructions
    tests = {IDENTIFY_ON: parts.test, **{k: d for k, d in tasks.items() if k != IDENTIFY_ON}}
    identified = stage("identified", lambda: cp.identify_heads(model, select, "context", progress=False))

    def fit(dual_run: bool):
        steer = cp.JuICE(model, direction="context", dual_run=dual_run, **PAPER_GRIDS)
        steer.fit(select, validation, progress=False, heads=identified, recipe="robust")
        return steer.to_dict(), steer.tuning

    def restore(stored):
        config, tuning = stored
        steer = cp.JuICE.from_dict(config, model)
        steer.tuning = tuning
        return steer

    def fit_gated():
        steer = cp.JuICE(model, direction="context")
        steer.fit(select, validation, progress=False, heads=identified, recipe="robust-gated")
        return steer.to_dict(), steer.tuning

    def score(name, method):
        rows = cp.evaluate({name: method}, list(tests.values()), ["substitution"])
        recall = cp.evaluate({name: method}, list(tests.values()), ["clean"])  # memorised answer expected
        rows["clean_recall"] = recall.correct.to_numpy()
        wins = []
        for dataset in tests.values():
            logits = method.logits_for(dataset, "substitution")
            prompts = dataset.prompts("substitution")
            for i, e in enumerate(dataset):
                context, memory = (cp.runtime.answer_token(model, a, prompts[i]) for a in (e.context_answer, e.answer))
                wins.append(float(logits[i, context] > logits[i, memory]))
        rows["context_wins"] = wins
        memotrap = rows.relation != "nq_swap"
        endings = [e.context_answer for d in tests.values() for e in d]
        rows.loc[memotrap, "correct"] = [
            float(class_match(t, a)) for t, a, m in zip(rows.continuation, endings, memotrap) if m
        ]
        return rows

    if args.gated_only:
        gated = restore(stage("juice_gated", fit_gated))
        rows = stage("eval_JuICE (gated)", lambda: score("JuICE (gated)", gated), score, class_match)
        saved = pd.read_csv(out / "per_example.csv")
        results = pd.concat([saved[saved.method != "JuICE (gated)"], rows], ignore_index=True)
        gated.tuning.to_csv(out / "beta_grid_juice_gated.csv", index=False)
        summary = json.loads((out / "summary.json").read_text()) | {"JuICE (gated)": repr(gated)}
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        write_tables(results, list(dict.fromkeys(results.method)), [*tests], out, args.seed)
        return

    juice, june = restore(stage("juice", lambda: fit(True), fit)), restore(stage("june", lambda: fit(False), fit))
    juice.save(out / "juice_context_tasks.json")

    # PH3 ranks heads by path patching from each item's clean prompt (the text without the
    # instruction) to its conflict prompt, so its development sets keep both prompts.
    developments = {
        "PH3_s": parts.select,
        "PH3_l": cp.ConflictDataset([*parts.select, *parts.validation], "proverb_ending_dev"),
    }

    def fit_ph3(name):
        pruned = cp.PH3(model, direction="context").fit(developments[name], validation, progress=False)
        return pruned.heads, pruned.k, pruned.tuning

    ph3 = {}
    for name in developments:
        ph3[name] = cp.PH3(model, direction="context")
        ph3[name].heads, ph3[name].k, ph3[name].tuning = stage(name, lambda n=name: fit_ph3(n), fit_ph3)
    methods = {
        "Original": cp.Original(model, direction="context"),
        "Prompt": cp.PromptInstruction(model, direction="context"),
        "CAD": cp.CAD(model, direction="context", alpha=1.0),
        **ph3,
        "JuNe": june,
        "JuICE": juice,
    }

    results = pd.concat(
        [
            stage(f"eval_{name}", lambda n=name, m=method: score(n, m), score, class_match)
            for name, method in methods.items()
        ],
        ignore_index=True,
    )

    # The paper's protocol for this direction: strengths tuned on the instruction prompts alone by
    # instructed accuracy (MemoTrap has no clean prompts), so nothing protects plain recall.
    def fit_paper(dual_run: bool):
        steer = cp.JuICE(model, direction="context", dual_run=dual_run, **PAPER_GRIDS)
        only_instructions = validation.with_prompts(["substitution"])
        steer.fit(select, only_instructions, progress=False, heads=identified, recipe="paper")
        return steer.to_dict(), steer.tuning

    paper = {
        f"{name} (paper recipe)": restore(stage(f"{name}_paper", lambda d=dual: fit_paper(d), fit_paper))
        for name, dual in (("JuNe", False), ("JuICE", True))
    }
    paper_rows = [
        stage(f"eval_{name}", lambda n=name, m=method: score(n, m), score, class_match)
        for name, method in paper.items()
    ]
    results = pd.concat([results, *paper_rows], ignore_index=True)
    methods |= paper
    table = write_tables(results, list(methods), [*tests], out, args.seed)
    juice.tuning.to_csv(out / "beta_grid_juice.csv", index=False)
    june.tuning.to_csv(out / "beta_grid_june.csv", index=False)
    paper["JuICE (paper recipe)"].tuning.to_csv(out / "beta_grid_juice_paper.csv", index=False)
    paper["JuNe (paper recipe)"].tuning.to_csv(out / "beta_grid_june_paper.csv", index=False)
    identified.scores.to_csv(out / "head_scores.csv", index=False)
    summary = {
        "known_proverbs": len(known),
        "select": [e.subject for e in parts.select],
        "n_validation": len(validation),
        "n_test": {k: len(d) for k, d in tests.items()},
        "juice": repr(juice),
        "june": repr(june),
        **{name: repr(steer) for name, steer in paper.items()},
        **{name: {"k": p.k, "heads": p.heads[: p.k]} for name, p in ph3.items()},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    timings = {r.name: {"seconds": round(r.seconds, 1), "cpu_seconds": round(r.cpu_seconds, 1)} for r in cache.records}
    (out / "timings.json").write_text(json.dumps(timings, indent=1))
    print(table.to_string())


if __name__ == "__main__":
    main()
