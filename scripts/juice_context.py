"""JuICE toward the context on the embedded model (the paper's Table 4 direction), on the shipped
sayings: an instruction to end a well-known saying with another word, which the model's memory
of the saying resists.

Heads are identified on 4 sayings (substitution prompts, target = the instructed word), the
betas of JuICE and JuNe and PH3's k are tuned on a validation split, and every method is scored
on the held-out sayings the model knows: greedy accuracy (the instructed word among the first 5
words of an 8-token continuation), how often the instructed word's first token beats the usual
ending's (``context_wins``), and, as a side effect, whether the saying alone (the clean prompt)
still ends the usual way under the same steering. Stages are cached under --out/cache by
cpsuper's step cache, so an interrupted run resumes where it stopped. ``--methods`` rescores only
the named methods and replaces their rows in the saved ``per_example.csv`` (the other methods'
rows, fits and files are kept as they are).

    python scripts/juice_context.py --out docs/results/juice_context
    python scripts/juice_context.py --out docs/results/juice_context --methods Prompt "PH3 (small dev)"
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

import cpsuper as cp
from cpsuper.reproduce import StepCache
from cpsuper.tuning import PAPER_BETA_NEG_GRID, PAPER_BETA_POS_GRID

# The strength grids these results were measured with (JuICE's defaults until 2026-11-27).
PAPER_GRIDS = {"beta_pos_grid": PAPER_BETA_POS_GRID, "beta_neg_grid": PAPER_BETA_NEG_GRID}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="juice_context")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--methods", nargs="+", help="rescore only these methods (names as in table.csv)")
    args = parser.parse_args()
    out = Path(args.out)
    cache = StepCache(out / "cache")
    settings = {"model": "gemma-3-270m", "seed": args.seed}

    def stage(name, compute, *helpers):
        """The cached value of stage ``name``; its key covers the code of ``compute`` and
        ``helpers`` and the stages before it."""
        return cache.get_or_compute(name, compute, key=settings, code=[compute, *helpers], after=list(cache.keys))

    model = cp.load_model()
    known = stage("known", lambda: cp.filter_known(model, cp.data.load_sayings(), progress=False))
    parts = cp.split(known, n_select=4, val_frac=0.15, seed=args.seed)
    select, validation = (d.with_prompts(["substitution"]) for d in (parts.select, parts.validation))
    test = parts.test

    def identified():
        return stage("identified", lambda: cp.identify_heads(model, select, "context", progress=False))

    def fit(dual_run: bool):
        steer = cp.JuICE(model, direction="context", dual_run=dual_run, **PAPER_GRIDS)
        steer.fit(select, validation, progress=False, heads=identified(), recipe="paper")
        return steer.to_dict(), steer.tuning

    def make(stored):
        config, tuning = stored
        steer = cp.JuICE.from_dict(config, model)
        steer.tuning = tuning
        return steer

    def fit_ph3():
        # PH3 patches paths from each saying alone (the clean prompt) into its instruction
        # prompt, so its development set keeps both prompts.
        pruned = cp.PH3(model, direction="context").fit(parts.select, validation, progress=False)
        return pruned.heads, pruned.k, pruned.tuning

    def ph3():
        method = cp.PH3(model, direction="context")
        method.heads, method.k, method.tuning = stage("ph3", fit_ph3)
        return method

    builders = {  # built on demand, so that --methods fits only what it rescores
        "Original": lambda: cp.Original(model, direction="context"),
        "Prompt": lambda: cp.PromptInstruction(model, direction="context"),
        "CAD": lambda: cp.CAD(model, direction="context", alpha=1.0),
        "PH3 (small dev)": ph3,
        "JuNe": lambda: make(stage("june", lambda: fit(False), fit)),
        "JuICE": lambda: make(stage("juice", lambda: fit(True), fit)),
    }
    names = args.methods or list(builders)
    unknown = sorted(set(names) - set(builders))
    if unknown:
        parser.error(f"unknown method(s) {unknown}; choose from {list(builders)}")
    methods = {name: builders[name]() for name in names}

    context_first = [cp.runtime.answer_token(model, e.context_answer, e.prompts["substitution"]) for e in test]
    usual_first = [cp.runtime.answer_token(model, e.answer, e.prompts["substitution"]) for e in test]

    def score(name, method):
        rows = cp.evaluate({name: method}, test, ["substitution"])
        logits = method.logits_for(test, "substitution")
        rows["context_wins"] = [
            float(logits[i, c] > logits[i, u]) for i, (c, u) in enumerate(zip(context_first, usual_first))
        ]
        clean = method.generate_for(test, "clean")
        rows["clean_keeps_saying"] = [float(cp.reading.mentions_answer(t, e.answers, 5)) for t, e in zip(clean, test)]
        return rows

    results = pd.concat(
        [stage(f"eval_{name}", lambda n=name, m=method: score(n, m), score) for name, method in methods.items()],
        ignore_index=True,
    )
    if args.methods:  # splice the rescored methods into the saved rows, in the saved order
        saved = pd.read_csv(out / "per_example.csv")
        order = list(dict.fromkeys([*saved["method"], *results["method"]]))
        results = pd.concat([saved[~saved["method"].isin(names)], results], ignore_index=True)
        results = results.sort_values("method", key=lambda m: m.map(order.index), kind="stable")
    results.to_csv(out / "per_example.csv", index=False)
    table = results.groupby("method", sort=False)[["correct", "context_wins", "clean_keeps_saying"]].mean()
    table.round(3).to_csv(out / "table.csv")
    if args.methods:
        if "PH3 (small dev)" in methods:  # keep summary.json's PH3 entry in step with its rows
            summary = json.loads((out / "summary.json").read_text())
            pruned = methods["PH3 (small dev)"]
            summary["ph3"] = {"k": pruned.k, "heads": pruned.heads[: pruned.k]}
            (out / "summary.json").write_text(json.dumps(summary, indent=1))
        print(table.round(2).to_string())
        return
    juice, june = methods["JuICE"], methods["JuNe"]
    juice.save(out / "juice_context.json")
    ph3 = methods["PH3 (small dev)"]
    juice.tuning.to_csv(out / "beta_grid_juice.csv", index=False)
    june.tuning.to_csv(out / "beta_grid_june.csv", index=False)
    identified().scores.to_csv(out / "head_scores.csv", index=False)
    summary = {
        "known": len(known),
        "select": [e.subject for e in parts.select],
        "n_validation": len(validation),
        "n_test": len(test),
        "juice": repr(juice),
        "june": repr(june),
        "ph3": {"k": ph3.k, "heads": ph3.heads[: ph3.k]},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    timings = {r.name: {"seconds": round(r.seconds, 1), "cpu_seconds": round(r.cpu_seconds, 1)} for r in cache.records}
    (out / "timings.json").write_text(json.dumps(timings, indent=1))
    print(table.round(2).to_string())


if __name__ == "__main__":
    main()
