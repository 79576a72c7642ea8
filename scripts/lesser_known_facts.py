"""Finetuning on well-known versus lesser-known facts, the extended study on the embedded model:
accuracy by popularity percentile, per-layer subject attention with the maximum-over-tokens
statistic, per-example attention maps, and a small learning-rate search with early stopping.

Facts: every fact of three relations, ranked by the base model's probability of the true answer's
first token on the clean prompt (its own confidence: the popularity proxy here, as no public
popularity signal ships with cpsuper's relation files). FT-Top trains on the top ``--n-train``,
FT-Bottom on the bottom ``--n-train``; from the facts in between, ``--n-test`` test facts and
``--n-val`` validation facts are drawn at random (seeded, disjoint).

Runs, all LoRA rank ``--rank`` on the MLP matrices, batch ``--batch-size``:

- the grid: each condition x learning rate in ``--lrs``, seed 0, ``--grid-steps`` steps with a
  checkpoint every ``--every`` steps, each checkpoint scored on the validation facts (greedy
  accuracy); early stopping picks, per condition, the (learning rate, step) with the best
  validation accuracy (ties: fewer steps, then the smaller learning rate), which is then scored
  on the test facts;
- the main runs: each condition at ``--main-lr`` for ``--main-steps`` steps, seeds ``--seeds``
  (seed 0 is the grid's checkpoint at that step: the same run), scored on the test facts for
  greedy accuracy and the last token's attention to the subject per layer, reduced over the
  subject's tokens by their maximum (then averaged over heads) and by their sum;
- the attention maps: for the first test fact of each relation, the last token's attention to
  every earlier token per layer (mean over heads), base model and both seed-0 main runs.

Writes, under --out: ``facts.csv`` (every fact used, its role and base probability),
``per_example.csv.gz`` (test accuracy per fact and model), ``validation.csv.gz`` (validation
accuracy per fact and grid checkpoint), ``layer_attention.csv.gz`` (per test fact, model, layer
and statistic), ``attention_maps.csv.gz``, ``timing.json``; then the summaries
``percentiles.csv``, ``percentiles_paired.csv``, ``by_relation.csv``, ``attention_by_layer.csv``,
``attention_paired.csv``, ``validation_grid.csv``, ``early_stopping.csv`` (95 % bootstrap
intervals over facts, seeds of a fact resampled together) and the figures
``attention_by_layer.png`` and ``attention_map_<relation>.png``. ``--summarise-only`` redoes the
summaries and figures from the saved files; ``--tiny`` is a fast smoke run on a random tiny model.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python scripts/lesser_known_facts.py --out docs/results/lesser_known_facts
"""

from __future__ import annotations

import argparse
import json
import math
import random
import resource
import tempfile
import time
from pathlib import Path

import pandas as pd
import plotly.express as px
import torch

import cpsuper as cp
from cpsuper.attention import attention_patterns, layer_attention
from cpsuper.finetune import LoraSettings, lora_finetune
from cpsuper.plots.export import save_figure
from cpsuper.plots.heatmap import facet_heatmap
from cpsuper.stats import bootstrap_summary, paired_summary

RELATIONS = ("world_capital", "official_language", "company_headquarter")
PERCENTILES = (10, 25, 50, 75, 100)
CONDITIONS = ("base", "top", "bottom")


class Clock:
    """Wall and CPU seconds per stage."""

    def __init__(self) -> None:
        self.stages: dict[str, dict[str, float]] = {}
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def lap(self, name: str) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        stage = self.stages.setdefault(name, {"wall_s": 0.0, "cpu_s": 0.0})
        stage["wall_s"] = round(stage["wall_s"] + wall - self.wall, 1)
        stage["cpu_s"] = round(stage["cpu_s"] + cpu - self.cpu, 1)
        self.wall, self.cpu = wall, cpu
        print(name, stage, flush=True)


def ranked_facts(model):
    """Every fact of RELATIONS (clean prompts only) and its base p(true first token)."""
    data = None
    for relation in RELATIONS:
        part = cp.conflict_dataset(relation, tokenizer=model).with_prompts(["clean"])
        data = part if data is None else data + part
    scores = cp.score_dataset(model, data, greedy=False, progress=False)
    p = scores[scores.measure == "p_parametric"].set_index("example").value.sort_index()
    return data, p


def split(p: pd.Series, n_train: int, n_test: int, n_val: int) -> dict[str, list[int]]:
    """Top / bottom training facts by p; test and validation facts drawn from the rest."""
    order = p.sort_values(ascending=False, kind="stable").index.tolist()
    rest = order[n_train:-n_train]
    drawn = random.Random(0).sample(rest, n_test + n_val)
    return {
        "top": order[:n_train],
        "bottom": order[-n_train:],
        "test": sorted(drawn[:n_test]),
        "val": sorted(drawn[n_test:]),
    }


def accuracy(model, data, ids: list[int]) -> pd.DataFrame:
    """Greedy accuracy and p(true first token) per fact, indexed by the facts' global ids."""
    scores = cp.score_dataset(model, data[ids], progress=False, max_new_tokens=6)
    wide = scores.pivot_table(index="example", columns="measure", values="value")
    return pd.DataFrame(
        {
            "fact": [ids[i] for i in wide.index],
            "accuracy": wide["acc_parametric"].to_numpy(),
            "p_true": wide["p_parametric"].to_numpy(),
        }
    )


def layer_frames(model, data, ids: list[int]) -> pd.DataFrame:
    """Per test fact and layer, the subject attention reduced by max and by sum (heads averaged)."""
    parts = []
    for reduce in ("max", "sum"):
        frame = layer_attention(model, data[ids], "subject", reduce=reduce, progress=False)
        parts.append(frame.assign(fact=[ids[i] for i in frame.example]))
    columns = ["fact", "layer", "reduce", "attention", "attention_no_bos", "n_span_tokens"]
    return pd.concat(parts, ignore_index=True)[columns]


def attention_map(model, prompt: str) -> pd.DataFrame:
    """The last token's attention to every token, per layer, averaged over the layer's heads."""
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    heads = [(layer, head) for layer in range(n_layers) for head in range(n_heads)]
    patterns, tokens = attention_patterns(model, prompt, heads)
    last = patterns[:, -1, :].reshape(n_layers, n_heads, -1).mean(1)  # [layer, src]
    rows = [
        {"layer": layer, "position": pos, "token": tokens[pos], "attention": float(last[layer, pos])}
        for layer in range(n_layers)
        for pos in range(len(tokens))
    ]
    return pd.DataFrame(rows)


def evaluate(model, data, facts, label: dict, maps: list[int] | None, store: dict) -> None:
    """Test accuracy, per-layer attention and (for ``maps``) attention maps of one model."""
    store["test"].append(accuracy(model, data, facts["test"]).assign(**label))
    store["layers"].append(layer_frames(model, data, facts["test"]).assign(**label))
    for fact in maps or []:
        frame = attention_map(model, data[fact].prompts["clean"])
        store["maps"].append(frame.assign(fact=fact, relation=data[fact].relation, condition=label["condition"]))
    print(label, "test accuracy", round(store["test"][-1].accuracy.mean(), 4), flush=True)


def write(out: Path, store: dict, clock: Clock, facts: dict, p: pd.Series, info: dict) -> None:
    """Write what has been measured so far (called after every stage, so a stopped run keeps it)."""
    for key, name in (("test", "per_example"), ("val", "validation"), ("layers", "layer_attention")):
        pd.concat(store[key]).to_csv(out / f"{name}.csv.gz", index=False, float_format="%.6g")
    pd.concat(store["maps"]).to_csv(out / "attention_maps.csv.gz", index=False, float_format="%.6g")

    def span(role: str) -> list[float]:
        return [round(float(p[facts[role]].min()), 4), round(float(p[facts[role]].max()), 4)]

    timing = {
        "wall_s": round(sum(s["wall_s"] for s in clock.stages.values()), 1),
        "cpu_s": round(sum(s["cpu_s"] for s in clock.stages.values()), 1),
        "stages": clock.stages,
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "facts": len(p),
        **{f"p_true_{role}": span(role) for role in ("top", "bottom", "test", "val")},
        **info,
    }
    (out / "timing.json").write_text(json.dumps(timing, indent=1) + "\n")


def run(args, out: Path) -> None:
    torch.set_num_threads(1)
    clock = Clock()
    model = cp.tiny_model("gemma", seed=0) if args.tiny else cp.load_model()
    data, p = ranked_facts(model)
    facts = split(p, args.n_train, args.n_test, args.n_val)
    roles = pd.DataFrame([{"fact": i, "role": role} for role, ids in facts.items() for i in ids])
    roles = roles.assign(
        relation=[data[i].relation for i in roles.fact],
        subject=[data[i].subject for i in roles.fact],
        answer=[data[i].answer for i in roles.fact],
        p_true=[float(p[i]) for i in roles.fact],
    )
    roles.to_csv(out / "facts.csv", index=False, float_format="%.6g")
    first = roles[roles.role == "test"].groupby("relation", sort=False).fact.first().tolist()
    clock.lap("rank")
    store: dict[str, list[pd.DataFrame]] = {"test": [], "layers": [], "maps": [], "val": []}
    base_label = {"condition": "base", "seed": -1, "lr": 0.0, "step": 0, "run": "base"}
    evaluate(model, data, facts, base_label, first, store)
    store["val"].append(accuracy(model, data, facts["val"]).assign(**base_label))
    clock.lap("base")
    chosen: list[dict] = []
    info = {"early_stopped": chosen, "settings": {k: v for k, v in vars(args).items() if k != "summarise_only"}}
    write(out, store, clock, facts, p, info)

    def settings(steps: int, every: int, lr: float, seed: int) -> LoraSettings:
        return LoraSettings(
            steps=steps,
            batch_size=args.batch_size,
            rank=args.rank,
            alpha=2.0 * args.rank,
            lr=lr,
            save_every=every,
            seed=seed,
        )

    for condition in ("top", "bottom"):
        pairs = [(data[i].prompts["clean"], data[i].answer) for i in facts[condition]]
        with tempfile.TemporaryDirectory() as tmp:
            checkpoints = {}
            for lr in args.lrs:
                trained = lora_finetune(
                    model,
                    pairs,
                    Path(tmp) / f"lr{lr}",
                    settings=settings(args.grid_steps, args.every, lr, 0),
                    progress=False,
                )
                clock.lap("grid training")
                for ckpt in trained[1:]:
                    label = {"condition": condition, "seed": 0, "lr": lr, "step": ckpt.step, "run": "grid"}
                    tuned = ckpt()
                    store["val"].append(accuracy(tuned, data, facts["val"]).assign(**label))
                    checkpoints[lr, ckpt.step] = ckpt
                    if lr == args.main_lr and ckpt.step == args.main_steps:
                        evaluate(tuned, data, facts, {**label, "run": "main"}, first, store)
                    del tuned
                clock.lap("grid scoring")
                write(out, store, clock, facts, p, info)
            val = pd.concat(store["val"])
            val = val[(val.condition == condition) & (val.run == "grid")]
            means = val.groupby(["lr", "step"]).accuracy.mean().reset_index()
            best = means.sort_values(["accuracy", "step", "lr"], ascending=[False, True, True]).iloc[0]
            lr, step = float(best.lr), int(best.step)
            label = {"condition": condition, "seed": 0, "lr": lr, "step": step, "run": "early_stopped"}
            tuned = checkpoints[lr, step]()
            store["test"].append(accuracy(tuned, data, facts["test"]).assign(**label))
            chosen.append(label)
            del tuned
            clock.lap("early stopping")
            write(out, store, clock, facts, p, info)
    for seed in [s for s in args.seeds if s != 0]:
        for condition in ("top", "bottom"):
            pairs = [(data[i].prompts["clean"], data[i].answer) for i in facts[condition]]
            with tempfile.TemporaryDirectory() as tmp:
                every = args.main_steps
                final = lora_finetune(
                    model, pairs, tmp, settings=settings(args.main_steps, every, args.main_lr, seed), progress=False
                )
                clock.lap("main training")
                label = {"condition": condition, "seed": seed, "lr": args.main_lr, "step": args.main_steps}
                evaluate(final[-1](), data, facts, {**label, "run": "main"}, None, store)
                clock.lap("main scoring")
                write(out, store, clock, facts, p, info)


def percentile_subsets(test: pd.DataFrame) -> pd.DataFrame:
    """The rows of the most popular test facts (base p_true) for each percentile, stacked."""
    popularity = test[test.condition == "base"].set_index("fact").p_true.sort_values(ascending=False)
    parts = []
    for pct in PERCENTILES:
        keep = popularity.index[: math.ceil(pct / 100 * len(popularity))]
        parts.append(test[test.fact.isin(keep)].assign(percentile=pct))
    return pd.concat(parts, ignore_index=True)


def summarise(out: Path) -> None:
    per = pd.read_csv(out / "per_example.csv.gz")
    main = per[per.run.isin(["base", "main"])]
    stacked = percentile_subsets(main)
    pct = bootstrap_summary(stacked, value="accuracy", by=["percentile", "condition"], unit="fact")
    pct.to_csv(out / "percentiles.csv", index=False, float_format="%.4g")
    pairs = [("top", "bottom"), ("top", "base"), ("bottom", "base")]
    paired = pd.concat(
        [
            paired_summary(
                stacked, a=a, b=b, method="condition", value="accuracy", by=["percentile"], unit="fact"
            ).assign(a=a, b=b)
            for a, b in pairs
        ],
        ignore_index=True,
    )
    paired.to_csv(out / "percentiles_paired.csv", index=False, float_format="%.4g")
    relation = pd.read_csv(out / "facts.csv").set_index("fact").relation
    main = main.assign(relation=main.fact.map(relation))
    by_relation = bootstrap_summary(main, value="accuracy", by=["relation", "condition"], unit="fact")
    by_relation.to_csv(out / "by_relation.csv", index=False, float_format="%.4g")

    layers = pd.read_csv(out / "layer_attention.csv.gz")
    overall = layers.groupby(["fact", "condition", "seed", "reduce"], as_index=False).attention.mean()
    by_layer = pd.concat(
        [
            bootstrap_summary(layers, value="attention", by=["reduce", "condition", "layer"], unit="fact"),
            bootstrap_summary(overall, value="attention", by=["reduce", "condition"], unit="fact").assign(layer="all"),
        ],
        ignore_index=True,
    )
    by_layer.to_csv(out / "attention_by_layer.csv", index=False, float_format="%.4g")
    att_pairs = []
    for a, b in pairs:
        for frame, layer in ((layers, None), (overall, "all")):
            by = ["reduce", "layer"] if layer is None else ["reduce"]
            part = paired_summary(frame, a=a, b=b, method="condition", value="attention", by=by, unit="fact")
            att_pairs.append(part.assign(a=a, b=b) if layer is None else part.assign(a=a, b=b, layer=layer))
    pd.concat(att_pairs, ignore_index=True).to_csv(out / "attention_paired.csv", index=False, float_format="%.4g")

    val = pd.read_csv(out / "validation.csv.gz")
    grid = bootstrap_summary(val, value="accuracy", by=["condition", "lr", "step"], unit="fact")
    grid.to_csv(out / "validation_grid.csv", index=False, float_format="%.4g")
    stopped = per[per.run == "early_stopped"]
    rows = []
    for _, pick in stopped[["condition", "lr", "step"]].drop_duplicates().iterrows():
        test = bootstrap_summary(stopped[stopped.condition == pick.condition], value="accuracy", unit="fact")
        at = grid[(grid.condition == pick.condition) & (grid.lr == pick.lr) & (grid.step == pick.step)].iloc[0]
        rows.append(
            {
                "condition": pick.condition,
                "lr": pick.lr,
                "step": pick.step,
                "val_mean": at["mean"],
                "val_ci_low": at.ci_low,
                "val_ci_high": at.ci_high,
                "test_mean": test["mean"].item(),
                "test_ci_low": test.ci_low.item(),
                "test_ci_high": test.ci_high.item(),
                "n_test": test.n.item(),
            }
        )
    early = pd.DataFrame(rows)
    if len(early) == 2:
        diff = paired_summary(stopped, a="top", b="bottom", method="condition", value="accuracy", unit="fact")
        early["top_minus_bottom"] = diff["diff"].item()
        early["diff_ci_low"], early["diff_ci_high"] = diff.ci_low.item(), diff.ci_high.item()
    early.to_csv(out / "early_stopping.csv", index=False, float_format="%.4g")
    print(pct.to_string(index=False), paired.to_string(index=False), early.to_string(index=False), sep="\n\n")
    figures(out, by_layer, pd.read_csv(out / "attention_maps.csv.gz"))


def figures(out: Path, by_layer: pd.DataFrame, maps: pd.DataFrame) -> None:
    frame = by_layer[by_layer.layer != "all"].assign(layer=lambda f: f.layer.astype(int))
    frame = frame.assign(
        statistic=frame["reduce"].map({"max": "max over subject tokens", "sum": "sum over subject tokens"}),
        err_plus=frame.ci_high - frame["mean"],
        err_minus=frame["mean"] - frame.ci_low,
        model=frame.condition.map({"base": "base", "top": "FT-Top", "bottom": "FT-Bottom"}),
    )
    line = px.line(
        frame,
        x="layer",
        y="mean",
        color="model",
        facet_col="statistic",
        category_orders={"model": ["base", "FT-Top", "FT-Bottom"]},
        error_y="err_plus",
        error_y_minus="err_minus",
        markers=True,
        labels={"mean": "attention (mean over heads)"},
    )
    line.update_yaxes(matches=None, showticklabels=True)
    line.for_each_annotation(lambda a: a.update(text=a.text.split("=")[-1]))
    written = {"attention_by_layer": line}
    for relation, part in maps.groupby("relation", sort=False):
        part = part[part.position > 0]  # the BOS column (most of the attention) is left out
        names = {pos: f"{pos}:{tok.strip() or '_'}" for pos, tok in zip(part.position, part.token, strict=True)}
        part = part.assign(
            token_at=part.position.map(names),
            model=part.condition.map({"base": "base", "top": "FT-Top", "bottom": "FT-Bottom"}),
        )
        written[f"attention_map_{relation}"] = facet_heatmap(
            part,
            "attention",
            x="token_at",
            y="layer",
            x_values=[names[k] for k in sorted(names)],
            col="model",
            col_values=["base", "FT-Top", "FT-Bottom"],
            panel_title=lambda r, c: c,
            diverging=False,
            zmin=0.0,
            categorical_x=True,
            labels={"token_at": "source token", "layer": "layer"},
            cell=(34, 18),
            title=f"Last token's attention (mean over heads), {relation}",
        )
    save_pngs(written, out)


def save_pngs(figures: dict, out: Path) -> None:
    """Each ``{name: figure}`` as ``out/name.png``; where PNG export is not available (no kaleido
    or browser), as ``out/name.html`` instead, saying so."""
    for name, fig in figures.items():
        try:
            save_figure(fig, out / name, formats="png")
        except (ImportError, RuntimeError, ValueError) as error:
            fig.write_html(out / f"{name}.html", include_plotlyjs="cdn")
            print(f"{name}: PNG not written ({error}); wrote HTML")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="lesser_known_facts")
    parser.add_argument("--n-train", type=int, default=64)
    parser.add_argument("--n-test", type=int, default=120)
    parser.add_argument("--n-val", type=int, default=40)
    parser.add_argument("--lrs", type=float, nargs="+", default=[3e-4, 1e-3, 3e-3])
    parser.add_argument("--grid-steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--main-lr", type=float, default=1e-3)
    parser.add_argument("--main-steps", type=int, default=30)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--tiny", action="store_true", help="smoke run on a random tiny model")
    parser.add_argument("--summarise-only", action="store_true")
    args = parser.parse_args()
    if args.main_lr not in args.lrs or args.main_steps % args.every or args.main_steps > args.grid_steps:
        parser.error("--main-lr must be in --lrs and --main-steps a checkpoint of the grid runs")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.summarise_only:
        run(args, out)
    summarise(out)


if __name__ == "__main__":
    main()
