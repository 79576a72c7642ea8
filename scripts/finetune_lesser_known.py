"""Finetuning on well-known versus lesser-known facts, on the embedded model: LoRA-finetune
Gemma-3-270M on plain question prompts (no context) of the facts it knows best (highest probability
of the true answer's first token on the clean prompt) or of those it knows least, same number of
facts and steps, and compare greedy accuracy on held-out facts and the final token's attention to
the subject, over several seeds.

Facts: every fact of three relations, ranked by that probability; the top and bottom ``--n-train``
are the two training sets, and ``--n-held`` facts drawn at random (seeded) from the rest are held
out.

Writes, under --out: ``per_example.csv.gz`` (accuracy and subject attention per held-out fact,
seed and condition, with the base model as ``base``), ``summary.csv`` (per condition: mean over
seeds and facts with a 95 % bootstrap interval over facts; per seed as well), ``paired.csv``
(top minus bottom, paired over facts and seeds) and ``timing.json``.

    HF_HUB_OFFLINE=1 python scripts/finetune_lesser_known.py --out docs/results/finetune_lesser_known
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import tempfile
import time
from pathlib import Path

import pandas as pd
from lesser_known_facts import ranked_facts as ranked_by_confidence

import cpsuper as cp
from cpsuper.finetune import LoraSettings, lora_finetune
from cpsuper.stats import bootstrap_summary, paired_summary


def ranked_facts(model):
    """Every fact of RELATIONS (clean prompts only), best known first, and its p(true first token)."""
    data, p = ranked_by_confidence(model)
    return data, p.sort_values(ascending=False).index.tolist(), p


def measure(model, held, condition: str, seed: int) -> pd.DataFrame:
    scores = cp.score_dataset(model, held, progress=False, max_new_tokens=6)
    acc = scores[scores.measure == "acc_parametric"][["example", "relation", "subject", "value"]]
    acc = acc.rename(columns={"value": "accuracy"})
    attention = cp.attention_to_span(model, held, "subject", progress=False).per_example
    subject = (
        attention.groupby("example", as_index=False).attention.mean().rename(columns={"attention": "subject_attention"})
    )
    return acc.merge(subject, on="example").assign(condition=condition, seed=seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="finetune_lesser_known")
    parser.add_argument("--n-train", type=int, default=64)
    parser.add_argument("--n-held", type=int, default=60)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=30)
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
        data, order, p = ranked_facts(model)
        top, bottom = order[: args.n_train], order[-args.n_train :]
        rest = order[args.n_train : -args.n_train]
        held = data[sorted(random.Random(0).sample(rest, args.n_held))]
        frames = [measure(model, held, "base", -1)]
        for seed in args.seeds:
            for condition, chosen in (("top", top), ("bottom", bottom)):
                pairs = [(data[i].prompts["clean"], data[i].answer) for i in chosen]
                settings = LoraSettings(
                    args.steps, args.batch_size, args.rank, 2.0 * args.rank, args.lr, args.steps, seed
                )
                with tempfile.TemporaryDirectory() as tmp:
                    final = lora_finetune(model, pairs, tmp, settings=settings, progress=False)[-1]
                    frames.append(measure(final(), held, condition, seed))
                print(condition, seed, frames[-1].accuracy.mean(), flush=True)
        per = pd.concat(frames, ignore_index=True)
        per.to_csv(out / "per_example.csv.gz", index=False, float_format="%.6g")
        timing = {
            "wall_s": round(time.perf_counter() - start, 1),
            "cpu_s": round(time.process_time() - cpu, 1),
            "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
            "facts": len(data),
            "p_true_top": [round(float(p[top].min()), 4), round(float(p[top].max()), 4)],
            "p_true_bottom": [round(float(p[bottom].min()), 4), round(float(p[bottom].max()), 4)],
            "settings": vars(args),
        }
        (out / "timing.json").write_text(json.dumps(timing, indent=1) + "\n")
    per = pd.read_csv(out / "per_example.csv.gz")
    long = per.melt(
        id_vars=["example", "condition", "seed"], value_vars=["accuracy", "subject_attention"], var_name="measure"
    )
    long["unit"] = long["example"].astype(str)
    pooled = bootstrap_summary(long, value="value", by=["measure", "condition"], unit="unit").assign(seed="all")
    per_seed = bootstrap_summary(long, value="value", by=["measure", "condition", "seed"], unit="unit")
    summary = pd.concat([pooled, per_seed], ignore_index=True)
    summary.to_csv(out / "summary.csv", index=False, float_format="%.4g")
    runs = long[long.condition != "base"]  # resampled by fact, every seed's row of a fact kept together
    paired = paired_summary(runs, a="top", b="bottom", method="condition", value="value", by=["measure"], unit="unit")
    paired.to_csv(out / "paired.csv", index=False, float_format="%.4g")
    print(summary.to_string(index=False))
    print(paired.to_string(index=False))


if __name__ == "__main__":
    main()
