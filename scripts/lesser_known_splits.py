"""More training splits and finetuning dynamics for the lesser-known-facts study on the embedded
model (the follow-up of scripts/lesser_known_facts.py, whose facts, ranking and test split it
reuses): FT-Random and FT-Whole next to FT-Top and FT-Bottom, held-out accuracy and per-layer
subject attention over finetuning steps, more per-example attention maps, and a controlled split
in which FT-Top and FT-Bottom hold the same relations and the same answers.

Facts are ranked by the base model's probability of the true answer's first token (the popularity
proxy of the first script) and split as there: FT-Top / FT-Bottom are the top / bottom
``--n-train`` facts, the 120 test and 40 validation facts are drawn from the rest (the same facts).
The pool is every fact outside the test and validation facts.

- FT-Top and FT-Bottom: LoRA at ``--lr`` for ``--steps`` steps, a checkpoint every ``--every``
  steps, seeds ``--seeds``; each checkpoint is scored on the test facts (greedy accuracy and the
  last token's attention to the subject per layer, maximum over the subject's tokens, mean over
  heads). The base model is step 0.
- FT-Random: ``--n-train`` facts drawn at random from the pool (a new draw per seed);
  FT-Whole: the whole pool. Same steps, batch and learning rate; scored at the last step.
- Controlled: in each relation whose answers repeat, the most frequent answers in turn; the facts
  of each answer are sorted by probability, the upper half goes to FT-Top, the lower half to
  FT-Bottom, until each half holds ``--n-train / 2`` facts of that relation. Both halves then
  hold the same answers, each as often. Tested on the test facts whose answer is none of them.
- Attention maps: the last token's attention to every token per layer (mean over heads) for the
  first ``--n-maps`` test facts of each relation, base model and the seed-0 FT-Top / FT-Bottom
  models at the last step.

Writes under --out ``facts.csv`` (the facts of every training set), ``per_example.csv.gz``,
``layer_attention.csv.gz``, ``attention_maps.csv.gz`` and ``timing.json``, then summaries with
95 % bootstrap intervals over facts (a fact's seeds resampled together) and figures.
``--summarise-only`` redoes those from the saved files; ``--tiny`` is a smoke run on a random tiny
model.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python scripts/lesser_known_splits.py --out docs/results/lesser_known_splits
"""

from __future__ import annotations

import argparse
import json
import math
import random
import resource
import sys
import tempfile
from pathlib import Path

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

sys.path.insert(0, str(Path(__file__).parent))
import lesser_known_facts as lkf  # noqa: E402

import cpsuper as cp  # noqa: E402
from cpsuper.attention import layer_attention  # noqa: E402
from cpsuper.finetune import LoraSettings, lora_finetune  # noqa: E402
from cpsuper.stats import bootstrap_summary, paired_summary  # noqa: E402

COLOURS = {
    "base": "#7f7f7f",
    "FT-Top": "#1f77b4",
    "FT-Random": "#2ca02c",
    "FT-Whole": "#9467bd",
    "FT-Bottom": "#d62728",
}
FIG7 = ("base", "top", "random", "whole", "bottom")
NAMES = {
    "base": "base",
    "top": "FT-Top",
    "random": "FT-Random",
    "whole": "FT-Whole",
    "bottom": "FT-Bottom",
    "ctrl_top": "controlled FT-Top",
    "ctrl_bottom": "controlled FT-Bottom",
}


def pool(p: pd.Series, facts: dict[str, list[int]]) -> list[int]:
    """Every fact outside the test and validation facts, in id order (FT-Whole's training set)."""
    held_out = set(facts["test"]) | set(facts["val"])
    return sorted(i for i in p.index if i not in held_out)


def random_split(candidates: list[int], n: int, seed: int) -> list[int]:
    """``n`` facts drawn without replacement from ``candidates`` (seeded; FT-Random's set)."""
    return sorted(random.Random(1000 + seed).sample(sorted(candidates), n))


def controlled_split(facts: pd.DataFrame, n_per_relation: int) -> dict[str, list[int]]:
    """FT-Top and FT-Bottom with the same relations and answers: per relation whose answers repeat,
    answers in order of frequency (then name); each answer's facts sorted by ``p_true``, the upper
    ``m`` to top and the lower ``m`` to bottom (``m`` half the answer's facts, the last answer cut
    so each half holds ``n_per_relation`` facts of the relation, or all there are).

    ``facts``: one row per candidate fact with ``fact``, ``relation``, ``answer``, ``p_true``."""
    top: list[int] = []
    bottom: list[int] = []
    for _, part in facts.groupby("relation", sort=True):
        sizes = part.answer.value_counts()
        answers = sorted(sizes.index[sizes >= 2], key=lambda a: (-sizes[a], a))
        room = n_per_relation
        for answer in answers:
            if room == 0:
                break
            group = part[part.answer == answer].sort_values(["p_true", "fact"], ascending=[False, True])
            m = min(len(group) // 2, room)
            top += group.fact.iloc[:m].tolist()
            bottom += group.fact.iloc[len(group) - m :].tolist()
            room -= m
    return {"ctrl_top": sorted(top), "ctrl_bottom": sorted(bottom)}


def score(model, data, ids: list[int], label: dict, store: dict, attention: bool) -> None:
    """Greedy test accuracy and, with ``attention``, the per-layer subject attention (max)."""
    store["test"].append(lkf.accuracy(model, data, ids).assign(**label))
    if attention:
        frame = layer_attention(model, data[ids], "subject", reduce="max", progress=False)
        frame = frame.assign(fact=[ids[i] for i in frame.example], **label)
        store["layers"].append(frame[["fact", "layer", "attention", *label]])
    print(label, "accuracy", round(store["test"][-1].accuracy.mean(), 4), flush=True)


def write(out: Path, store: dict, clock: lkf.Clock, info: dict) -> None:
    """Save what has been measured so far (after every stage: a stopped run keeps it)."""
    for key, name in (("test", "per_example"), ("layers", "layer_attention"), ("maps", "attention_maps")):
        if store[key]:
            pd.concat(store[key]).to_csv(out / f"{name}.csv.gz", index=False, float_format="%.6g")
    timing = {
        "wall_s": round(sum(s["wall_s"] for s in clock.stages.values()), 1),
        "cpu_s": round(sum(s["cpu_s"] for s in clock.stages.values()), 1),
        "stages": clock.stages,
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        **info,
    }
    (out / "timing.json").write_text(json.dumps(timing, indent=1) + "\n")


def run(args, out: Path) -> None:
    torch.set_num_threads(1)
    clock = lkf.Clock()
    model = cp.tiny_model("gemma", seed=0) if args.tiny else cp.load_model()
    if args.resume:
        resume(args, out, model, clock)
        return
    data, p = lkf.ranked_facts(model)
    facts = lkf.split(p, args.n_train, args.n_test, args.n_val)
    everything = pd.DataFrame(
        {
            "fact": p.index,
            "relation": [data[i].relation for i in p.index],
            "subject": [data[i].subject for i in p.index],
            "answer": [data[i].answer for i in p.index],
            "p_true": p.to_numpy(),
        }
    )
    candidates = pool(p, facts)
    sets = {**facts, "whole": candidates}
    for seed in args.seeds:
        sets[f"random_s{seed}"] = random_split(candidates, args.n_train, seed)
    sets.update(controlled_split(everything[everything.fact.isin(candidates)], args.n_train // 2))
    roles = pd.DataFrame([{"fact": i, "role": role} for role, ids in sets.items() for i in ids])
    roles = roles.merge(everything, on="fact")
    roles.to_csv(out / "facts.csv", index=False, float_format="%.6g")
    clock.lap("rank")
    test = facts["test"]
    maps = roles[roles.role == "test"].groupby("relation", sort=False).fact.apply(lambda f: list(f)[: args.n_maps])
    map_facts = [i for ids in maps for i in ids]
    store: dict[str, list[pd.DataFrame]] = {"test": [], "layers": [], "maps": []}
    info = {"settings": {k: v for k, v in vars(args).items() if k != "summarise_only"}}

    def draw_maps(tuned, condition: str) -> None:
        for fact in map_facts:
            frame = lkf.attention_map(tuned, data[fact].prompts["clean"])
            store["maps"].append(frame.assign(fact=fact, relation=data[fact].relation, condition=condition))

    score(model, data, test, {"condition": "base", "seed": -1, "step": 0}, store, attention=True)
    draw_maps(model, "base")
    clock.lap("base")
    write(out, store, clock, info)
    train_all(args, out, model, data, sets, test, store, clock, info, draw_maps)


def resume(args, out: Path, model, clock: lkf.Clock) -> None:
    """Add runs to a finished output: its facts and measurements are read back (no new ranking,
    no base model), ``--reuse`` adds FT-Top / FT-Bottom main runs of scripts/lesser_known_facts.py
    (same facts and settings) for seeds not trained here."""
    roles = pd.read_csv(out / "facts.csv")
    data = None
    for relation in lkf.RELATIONS:  # the same dataset, in the same order, as ranked_facts builds
        part = cp.conflict_dataset(relation, tokenizer=model).with_prompts(["clean"])
        data = part if data is None else data + part
    assert all(data[i].answer == a for i, a in zip(roles.fact, roles.answer, strict=True))
    sets = {role: part.fact.tolist() for role, part in roles.groupby("role", sort=False)}
    for seed in args.seeds:
        sets.setdefault(f"random_s{seed}", random_split(sets["whole"], args.n_train, seed))
    store = {
        key: [pd.read_csv(out / f"{name}.csv.gz")]
        for key, name in (("test", "per_example"), ("layers", "layer_attention"), ("maps", "attention_maps"))
    }
    previous = json.loads((out / "timing.json").read_text())
    clock.stages = previous["stages"]
    info = {k: v for k, v in previous.items() if k not in ("wall_s", "cpu_s", "stages", "peak_rss_gb")}
    info.setdefault("resumed", []).append({k: v for k, v in vars(args).items() if k != "summarise_only"})
    if args.reuse:
        prior = pd.read_csv(Path(args.reuse) / "per_example.csv.gz")
        here = store["test"][0]
        prior = prior[(prior.run == "main") & prior.condition.isin(["top", "bottom"]) & (prior.step == args.steps)]
        prior = prior[~prior.seed.isin(here[here.condition == "top"].seed)]
        store["test"].append(prior[["fact", "accuracy", "p_true", "condition", "seed", "step"]])
        info["reused"] = sorted({int(s) for s in prior.seed})
    train_all(args, out, model, data, sets, sets["test"], store, clock, info, None)


def train_all(
    args, out: Path, model, data, sets: dict, test: list[int], store: dict, clock, info: dict, draw_maps
) -> None:
    """Train and score every condition of ``--conditions`` for every seed (one seed of everything
    first, so a stopped run has every item)."""
    settings = {
        "batch_size": args.batch_size,
        "rank": args.rank,
        "alpha": 2.0 * args.rank,
        "lr": args.lr,
        "steps": args.steps,
    }
    for seed in args.seeds:
        runs = [("top", True), ("bottom", True), ("random", False), ("whole", False)]
        runs += [("ctrl_top", False), ("ctrl_bottom", False)]
        for condition, dynamics in [r for r in runs if r[0] in args.conditions]:
            ids = sets[f"random_s{seed}" if condition == "random" else condition]
            pairs = [(data[i].prompts["clean"], data[i].answer) for i in ids]
            every = args.every if dynamics else args.steps
            with tempfile.TemporaryDirectory() as tmp:
                trained = lora_finetune(
                    model, pairs, tmp, settings=LoraSettings(save_every=every, seed=seed, **settings), progress=False
                )
                clock.lap("training")
                for ckpt in trained[1:]:
                    tuned = ckpt()
                    label = {"condition": condition, "seed": seed, "step": ckpt.step}
                    score(tuned, data, test, label, store, attention=dynamics)
                    if (
                        draw_maps
                        and seed == args.seeds[0]
                        and condition in ("top", "bottom")
                        and ckpt.step == args.steps
                    ):
                        draw_maps(tuned, condition)
                    del tuned
                clock.lap("scoring")
            write(out, store, clock, info)


def controlled_test(roles: pd.DataFrame) -> list[int]:
    """The test facts whose answer is none of the controlled training answers (as the paper tests
    on answers not seen in finetuning)."""
    seen = set(roles[roles.role.isin(["ctrl_top", "ctrl_bottom"])].answer)
    test = roles[roles.role == "test"]
    return sorted(test.fact[~test.answer.isin(seen)])


def with_base_steps(frame: pd.DataFrame, conditions: tuple[str, ...]) -> pd.DataFrame:
    """The rows of ``conditions`` plus the base model's rows copied as step 0 of each of them
    (the LoRA adapters start at zero, so step 0 is the base model)."""
    base = frame[frame.condition == "base"]
    parts = [frame[frame.condition.isin(conditions)]]
    parts += [base.assign(condition=c, step=0) for c in conditions]
    return pd.concat(parts, ignore_index=True)


def popular_subsets(frame: pd.DataFrame, popularity: pd.Series, percentiles: tuple[int, ...]) -> pd.DataFrame:
    """The rows of the most popular ``pct`` % of facts (``popularity``: fact -> base p) per
    percentile, stacked with a ``percentile`` column."""
    order = popularity.sort_values(ascending=False, kind="stable").index
    parts = []
    for pct in percentiles:
        keep = order[: math.ceil(pct / 100 * len(order))]
        parts.append(frame[frame.fact.isin(keep)].assign(percentile=pct))
    return pd.concat(parts, ignore_index=True)


def step_summaries(frame: pd.DataFrame, value: str, by: list[str]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per ``by`` + condition + step, the mean of ``value`` with its interval over facts, and
    FT-Top minus FT-Bottom per ``by`` + step, paired over facts."""
    summary = bootstrap_summary(frame, value=value, by=[*by, "condition", "step"], unit="fact")
    paired = paired_summary(frame, a="top", b="bottom", method="condition", value=value, by=[*by, "step"], unit="fact")
    return summary, paired


def map_fact_table(per: pd.DataFrame, layers: pd.DataFrame, maps: pd.DataFrame, steps: int) -> pd.DataFrame:
    """For each fact with an attention map: accuracy and the subject attention averaged over the
    layers, for the base model and the seed-0 FT-Top / FT-Bottom models at the last step."""
    keep = lambda f: f[f.fact.isin(maps.fact) & ((f.step == steps) & (f.seed == 0) | (f.condition == "base"))]  # noqa: E731
    attention = keep(layers).groupby(["fact", "condition"]).attention.mean()
    accuracy = keep(per).drop_duplicates(["fact", "condition"]).set_index(["fact", "condition"]).accuracy
    table = pd.DataFrame({"attention": attention, "accuracy": accuracy}).reset_index()
    table = table[table.condition.isin(["base", "top", "bottom"])]
    wide = table.pivot(index="fact", columns="condition", values=["accuracy", "attention"])
    wide.columns = [f"{value}_{condition}" for value, condition in wide.columns]
    return wide.reset_index().merge(maps[["fact", "relation"]].drop_duplicates(), on="fact")


def summarise(out: Path) -> None:
    per = pd.read_csv(out / "per_example.csv.gz")
    roles = pd.read_csv(out / "facts.csv")
    steps = int(per.step.max())
    popularity = per[per.condition == "base"].set_index("fact").p_true
    tables: dict[str, pd.DataFrame] = {}

    last = per[(per.condition == "base") | ((per.step == steps) & per.condition.isin(FIG7))]
    stacked = popular_subsets(last, popularity, lkf.PERCENTILES)
    tables["fig7_percentiles"] = bootstrap_summary(
        stacked, value="accuracy", by=["percentile", "condition"], unit="fact"
    )
    pairs = [("random", "top"), ("whole", "top"), ("bottom", "top"), ("random", "bottom"), ("whole", "bottom")]
    tables["fig7_paired"] = pd.concat(
        [
            paired_summary(
                stacked, a=a, b=b, method="condition", value="accuracy", by=["percentile"], unit="fact"
            ).assign(a=a, b=b)
            for a, b in pairs
            if {a, b} <= set(stacked.condition)
        ],
        ignore_index=True,
    )

    ckpt_seeds = set(per[(per.condition == "top") & (per.step < steps)].seed)  # runs with every checkpoint
    dynamics = with_base_steps(per[per.seed.isin(ckpt_seeds | {-1})], ("top", "bottom"))
    dynamics = popular_subsets(dynamics, popularity, (10, 25, 100))
    tables["accuracy_over_steps"], tables["accuracy_over_steps_paired"] = step_summaries(
        dynamics, "accuracy", ["percentile"]
    )
    layers = with_base_steps(pd.read_csv(out / "layer_attention.csv.gz"), ("top", "bottom"))
    mean = layers.groupby(["fact", "condition", "seed", "step"], as_index=False).attention.mean().assign(layer="all")
    both = pd.concat([layers.assign(layer=layers.layer.astype(str)), mean], ignore_index=True)
    tables["attention_over_steps"], tables["attention_over_steps_paired"] = step_summaries(both, "attention", ["layer"])

    maps = pd.read_csv(out / "attention_maps.csv.gz")
    tables["map_facts"] = map_fact_table(per, pd.read_csv(out / "layer_attention.csv.gz"), maps, steps)

    test = controlled_test(roles)
    ctrl = per[per.fact.isin(test) & ((per.condition == "base") | per.condition.isin(["ctrl_top", "ctrl_bottom"]))]
    ctrl = ctrl[ctrl.step.isin([0, steps])].merge(roles[roles.role == "test"][["fact", "relation"]], on="fact")
    trained = set(roles[roles.role == "ctrl_top"].relation)
    scopes = pd.concat(
        [ctrl.assign(scope="all"), ctrl[ctrl.relation.isin(trained)].assign(scope="trained relations")]
        + [ctrl[ctrl.relation == r].assign(scope=r) for r in sorted(ctrl.relation.unique())],
        ignore_index=True,
    )
    tables["controlled"] = bootstrap_summary(scopes, value="accuracy", by=["scope", "condition"], unit="fact")
    ctrl_pairs = [("ctrl_top", "ctrl_bottom"), ("ctrl_top", "base"), ("ctrl_bottom", "base")]
    tables["controlled_paired"] = pd.concat(
        [
            paired_summary(scopes, a=a, b=b, method="condition", value="accuracy", by=["scope"], unit="fact").assign(
                a=a, b=b
            )
            for a, b in ctrl_pairs
            if {a, b} <= set(scopes.condition)
        ]
        or [pd.DataFrame()],  # before the controlled runs
        ignore_index=True,
    )
    ctrl_pct = popular_subsets(scopes[scopes.scope == "all"], popularity[test], lkf.PERCENTILES)
    tables["controlled_percentiles_paired"] = (
        paired_summary(
            ctrl_pct,
            a="ctrl_top",
            b="ctrl_bottom",
            method="condition",
            value="accuracy",
            by=["percentile"],
            unit="fact",
        )
        if {"ctrl_top", "ctrl_bottom"} <= set(ctrl_pct.condition)
        else pd.DataFrame()
    )
    for name, table in tables.items():
        table.to_csv(out / f"{name}.csv", index=False, float_format="%.4g")
        print(name, table.to_string(index=False), sep="\n", end="\n\n")
    if "subject" not in roles:  # facts.csv written without subjects: the same facts, rebuilt
        examples = [e for r in lkf.RELATIONS for e in cp.conflict_dataset(r)]
        assert all(examples[i].answer == a for i, a in zip(roles.fact, roles.answer, strict=True))
        roles = roles.assign(subject=[examples[i].subject for i in roles.fact])
    subjects = roles.drop_duplicates("fact").set_index("fact").subject.to_dict()
    figures(out, tables, maps, subjects)


def _errors(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.assign(err_plus=frame.ci_high - frame["mean"], err_minus=frame["mean"] - frame.ci_low)


def map_figure(maps: pd.DataFrame, relation: str, subjects: dict[int, str] | None = None) -> go.Figure:
    """One row per fact, one column per model: the last token's attention to each earlier token
    (BOS left out) by layer, on one colour scale."""
    part = maps[(maps.relation == relation) & (maps.position > 0)]
    fact_ids = list(dict.fromkeys(part.fact))
    models = [c for c in ("base", "top", "bottom") if c in set(part.condition)]
    fig = make_subplots(
        rows=len(fact_ids),
        cols=len(models),
        shared_yaxes=True,
        horizontal_spacing=0.02,
        vertical_spacing=0.09,
        subplot_titles=[f"{NAMES[c]}" if r == 0 else "" for r in range(len(fact_ids)) for c in models],
    )
    zmax = float(part.attention.max())
    for r, fact in enumerate(fact_ids):
        for c, condition in enumerate(models):
            cell = part[(part.fact == fact) & (part.condition == condition)]
            grid = cell.pivot_table(index="layer", columns="position", values="attention")
            names = cell.drop_duplicates("position").set_index("position").token
            labels = [f"{pos}:{str(names[pos]).strip() or '_'}" for pos in grid.columns]
            fig.add_trace(
                go.Heatmap(
                    z=grid.to_numpy(),
                    x=labels,
                    y=list(grid.index),
                    coloraxis="coloraxis",
                ),
                row=r + 1,
                col=c + 1,
            )
            fig.update_xaxes(type="category", tickangle=-60, tickfont={"size": 9}, row=r + 1, col=c + 1)
        name = (subjects or {}).get(fact, f"fact {fact}")
        fig.update_yaxes(title_text=f"{name}<br>layer", row=r + 1, col=1)
    fig.update_layout(
        coloraxis={"colorscale": "Viridis", "cmin": 0.0, "cmax": zmax, "colorbar": {"title": "attention"}},
        height=260 * len(fact_ids) + 80,
        width=330 * len(models) + 120,
        title=f"Last token's attention (mean over heads), {relation}, seed-0 models at the last step",
    )
    return fig


def figures(out: Path, tables: dict[str, pd.DataFrame], maps: pd.DataFrame, subjects: dict[int, str]) -> None:
    fig7 = _errors(tables["fig7_percentiles"]).assign(model=lambda f: f.condition.map(NAMES))
    written = {
        "fig7_percentiles": px.line(
            fig7,
            x="percentile",
            y="mean",
            color="model",
            error_y="err_plus",
            error_y_minus="err_minus",
            markers=True,
            color_discrete_map=COLOURS,
            category_orders={"model": [NAMES[c] for c in FIG7]},
            labels={"mean": "test accuracy", "percentile": "most popular test facts (%)"},
            title="Test accuracy on the most popular test facts (2 seeds pooled)",
        )
    }
    acc = _errors(tables["accuracy_over_steps"]).assign(
        model=lambda f: f.condition.map(NAMES),
        subset=lambda f: f.percentile.map(lambda p: "all test facts" if p == 100 else f"most popular {p} %"),
    )
    written["accuracy_over_steps"] = px.line(
        acc,
        x="step",
        y="mean",
        color="model",
        facet_col="subset",
        error_y="err_plus",
        error_y_minus="err_minus",
        markers=True,
        color_discrete_map=COLOURS,
        labels={"mean": "test accuracy", "step": "finetuning step"},
        title="Held-out accuracy over finetuning (step 0: the base model)",
    )
    att = _errors(tables["attention_over_steps"])
    att = (
        att[att.layer != "all"]
        .assign(
            layer=lambda f: f.layer.astype(int),
            model=lambda f: f.condition.map(NAMES),
            at=lambda f: f.step.map(lambda s: "step 0 (base model)" if s == 0 else f"step {s}"),
        )
        .sort_values(["condition", "step", "layer"])
    )
    written["attention_over_steps"] = px.line(
        att,
        x="layer",
        y="mean",
        color="model",
        facet_col="at",
        error_y="err_plus",
        error_y_minus="err_minus",
        markers=True,
        color_discrete_map=COLOURS,
        labels={"mean": "subject attention (max over tokens, mean over heads)"},
        title="Last token's attention to the subject per layer over finetuning",
    )
    for fig in written.values():
        fig.for_each_annotation(lambda a: a.update(text=a.text.split("=")[-1]))
    for relation in maps.relation.unique():
        written[f"attention_maps_{relation}"] = map_figure(maps, relation, subjects)
    lkf.save_pngs(written, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="lesser_known_splits")
    parser.add_argument("--n-train", type=int, default=64)
    parser.add_argument("--n-test", type=int, default=120)
    parser.add_argument("--n-val", type=int, default=40)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--n-maps", type=int, default=4, help="attention maps per relation")
    parser.add_argument(
        "--conditions", nargs="+", default=["top", "bottom", "random", "whole", "ctrl_top", "ctrl_bottom"]
    )
    parser.add_argument("--resume", action="store_true", help="add runs to the saved output in --out")
    parser.add_argument("--reuse", help="with --resume: lesser_known_facts.py output whose main runs to add")
    parser.add_argument("--tiny", action="store_true", help="smoke run on a random tiny model")
    parser.add_argument("--summarise-only", action="store_true")
    args = parser.parse_args()
    if args.steps % args.every:
        parser.error("--steps must be a multiple of --every")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.summarise_only:
        run(args, out)
    summarise(out)


if __name__ == "__main__":
    main()
