"""Attention imbalance against the subject, forced at inference on the embedded model: does a
stored fact stop being the top-1 answer when the last prompt token attends less to the subject,
and do better-known facts survive more imbalance (Theorem 4.2 of the finetuning paper)?

Facts: the clean prompts of three relations; those whose true answer's first token is the
model's top-1 next token (``known_facts(by="top1")``'s rule) are known, and ``--n-facts`` of them
are drawn at random (seeded). Their base probability of that token (the popularity proxy the
project uses, as no public popularity signal ships with the relation files) comes from the
same pass.

For every factor in ``--factors``, each fact's prompt runs with the last position's attention
rows rewritten in every head (``cpsuper.attention.rescaled_attention``), in one of three ways:

- ``subject``: the weight on the subject's tokens times the factor, each row renormalised (the
  removed mass spreads over the other tokens in proportion, mostly onto BOS);
- ``subject_to_prompt``: the same mass taken off the subject but given only to the prompt's
  other text tokens (the relation words and the last token), the paper's shift towards the
  relation token;
- ``control``: the subject untouched; the same mass (what ``subject`` would remove from that
  row) moved from the prompt's other text tokens to BOS, so as much attention moves, between
  non-subject tokens only (capped at what those tokens hold; the shortfall is recorded);
- ``control_from_bos``: the same mass moved the other way, from BOS to the other text tokens
  (BOS holds enough in nearly every row, so the mass is matched).

These run in all layers; ``subject`` also runs in three bands of layers (thirds of the model)
at ``--band-factors``. Per fact: whether the true first token stays top-1, its probability and
its logit margin over the best other token. A fact's erasure threshold (per condition) is the
largest factor at which it is first no longer top-1 as the factor shrinks from 1 (0 when it
survives every factor; it then counts as never erased).

Writes, under --out: ``facts.csv`` (every fact, its base probability and whether it is known),
``per_fact.csv.gz`` (fact x condition x layers x factor), ``thresholds.csv`` (fact x condition),
``timing.json`` (``--append`` reuses ``facts.csv``, runs only ``--conditions`` and replaces
their rows; its cost goes to ``timing_append.json``); the summaries ``accuracy.csv``
(accuracy per condition, layers and factor), ``paired.csv`` (subject minus each other
condition), ``moved.csv`` (attention mass asked and moved), ``correlation.csv`` (rank
correlation of the base probability, and of the base logit margin, with the threshold: all facts
or the erased ones, pooled and per relation), ``erased.csv``, ``survival_by_tercile.csv``,
``survivors.csv``, ``threshold_counts.csv`` (95 % percentile bootstrap intervals over facts); figures
``accuracy.png`` and ``thresholds.png``. ``--summarise-only`` redoes the summaries and
figures from the saved files; ``--tiny`` is a fast smoke run on a random tiny model.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python scripts/attention_imbalance.py --out docs/results/attention_imbalance
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import time
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.express as px
import torch

import cpsuper as cp
from cpsuper.attention import rescaled_attention
from cpsuper.backend import final_residual
from cpsuper.decoding import unembed_final
from cpsuper.plots.export import save_figure
from cpsuper.runtime import answer_token, length_batches, pad_tokens, tokenize_prompts
from cpsuper.spans import example_spans
from cpsuper.stats import bootstrap_summary, paired_summary

RELATIONS = ("world_capital", "official_language", "company_headquarter")
FACTORS = (1.0, 0.5, 0.3, 0.2, 0.1, 0.05, 0.02, 0.01, 0.003, 0.001, 0.0)
BAND_FACTORS = (0.1, 0.01, 0.0)
CONDITIONS = ("subject", "subject_to_prompt", "control", "control_from_bos")
LABELS = {
    "subject": "subject",
    "subject_to_prompt": "subject to prompt",
    "control": "control: text to BOS",
    "control_from_bos": "control: BOS to text",
}
TEXT_GROUPS = ("relation", "end", "prefix")  # the prompt's tokens that are neither BOS nor subject


def load_facts(model) -> tuple[cp.ConflictDataset, pd.DataFrame]:
    """The clean prompts of RELATIONS and one row per fact (relation, subject, answer)."""
    data = None
    for relation in RELATIONS:
        part = cp.conflict_dataset(relation, tokenizer=model).with_prompts(["clean"])
        data = part if data is None else data + part
    frame = pd.DataFrame(
        {"fact": range(len(data)), "relation": [e.relation for e in data], "subject": [e.subject for e in data]}
    )
    return data, frame.assign(answer=[e.answer for e in data])


def token_masks(model, data, ids: list[int]) -> tuple[list[list[int]], list[np.ndarray], list[int]]:
    """Tokens, span group per token (``cpsuper.spans.example_spans``) and the true first token."""
    prompts = [data[i].prompts["clean"] for i in ids]
    tokens = tokenize_prompts(model, prompts)
    groups = [np.array(example_spans(model, data[i], "clean", tokens=t)) for i, t in zip(ids, tokens, strict=True)]
    answers = [answer_token(model, data[i].answer, p) for i, p in zip(ids, prompts, strict=True)]
    return tokens, groups, answers


def padded_masks(groups: list[np.ndarray], width: int) -> dict[str, torch.Tensor]:
    """``[batch, width]`` masks of the subject, the other text tokens and BOS (right padding)."""
    out = {name: torch.zeros(len(groups), width, dtype=torch.bool) for name in ("subject", "text", "bos")}
    for row, g in enumerate(groups):
        n = len(g)
        out["subject"][row, :n] = torch.from_numpy(g == "subject")
        out["text"][row, :n] = torch.from_numpy(np.isin(g, TEXT_GROUPS))
        out["bos"][row, :n] = torch.from_numpy(g == "bos")
    return out


def condition_masks(masks: dict[str, torch.Tensor], condition: str) -> dict[str, torch.Tensor]:
    """The ``move_from`` / ``move_to`` of :func:`rescaled_attention` for a condition."""
    if condition == "subject":
        return {}
    if condition == "subject_to_prompt":
        return {"move_from": masks["subject"], "move_to": masks["text"]}
    if condition == "control":
        return {"move_from": masks["text"], "move_to": masks["bos"]}
    if condition == "control_from_bos":
        return {"move_from": masks["bos"], "move_to": masks["text"]}
    raise ValueError(f"Unknown condition {condition!r}; use one of {CONDITIONS}.")


def score(
    model, tokens: list, groups: list, answers: list, *, factor: float, condition: str, layers, batch_size: int
) -> pd.DataFrame:
    """Per prompt (in input order): top1, p_true, margin (true minus best other logit) and the
    attention mass asked and moved at the last position (mean over hooked layers and heads)."""
    out = {}
    for idx in length_batches([len(t) for t in tokens], batch_size):
        ids, mask, last = pad_tokens(model, [tokens[j] for j in idx], "right")
        masks = padded_masks([groups[j] for j in idx], ids.shape[1])
        record: list = []
        padded = bool((mask == 0).any())
        with (
            torch.inference_mode(),
            rescaled_attention(
                model,
                masks["subject"],
                factor,
                query=last,
                layers=layers,
                record=record,
                **condition_masks(masks, condition),
            ),
        ):
            final = final_residual(
                model, ids, attention_mask=mask if padded else None, padding_side="right", positions=last
            )
            logits = unembed_final(model, final).float()
        truth = torch.tensor([answers[j] for j in idx])
        rows = torch.arange(len(idx))
        true_logit = logits[rows, truth]
        others = logits.clone()
        others[rows, truth] = -torch.inf
        probs = logits.softmax(-1)[rows, truth]
        asked = torch.stack([a for _, a, _ in record]).mean((0, 2)) if record else torch.zeros(len(idx))
        moved = torch.stack([m for _, _, m in record]).mean((0, 2)) if record else torch.zeros(len(idx))
        for row, j in enumerate(idx):
            out[j] = {
                "top1": bool(logits[row].argmax() == truth[row]),
                "p_true": float(probs[row]),
                "margin": float(true_logit[row] - others[row].max()),
                "asked": float(asked[row]),
                "moved": float(moved[row]),
            }
    return pd.DataFrame([out[j] for j in range(len(tokens))])


def bands(n_layers: int) -> dict[str, list[int]]:
    """All layers and the model's thirds (earlier thirds take the remainder)."""
    cuts = np.array_split(np.arange(n_layers), 3)
    names = ("early", "middle", "late")
    return {"all": list(range(n_layers))} | {
        f"{name} ({c[0]}-{c[-1]})": c.tolist() for name, c in zip(names, cuts, strict=True)
    }


def erasure_thresholds(per_fact: pd.DataFrame) -> pd.DataFrame:
    """Per fact and condition (layers ``all``): the largest factor at which the fact is first no
    longer top-1 as the factor falls (``threshold``; 0 and ``erased`` False when it never is),
    the factor above it (``kept_at``) and whether it is top-1 again at a smaller factor."""
    rows = []
    frame = per_fact[per_fact.layers == "all"]
    for (fact, condition), part in frame.groupby(["fact", "condition"], sort=True):
        part = part.sort_values("factor", ascending=False)
        top1 = part.top1.to_numpy(dtype=bool)
        factors = part.factor.to_numpy(dtype=float)
        lost = np.flatnonzero(~top1)
        first = int(lost[0]) if len(lost) else None
        rows.append(
            {
                "fact": fact,
                "condition": condition,
                "erased": first is not None,
                "threshold": factors[first] if first is not None else 0.0,
                "kept_at": factors[-1] if first is None else (factors[first - 1] if first > 0 else np.nan),
                "recovers": bool(first is not None and top1[first:].any()),
            }
        )
    return pd.DataFrame(rows)


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Rank correlation (average ranks for ties)."""
    return float(pd.Series(x).rank().corr(pd.Series(y).rank()))


def spearman_interval(x, y, *, n_boot: int = 2000, seed: int = 0) -> dict[str, float]:
    """Spearman's rho with a 95 % percentile bootstrap interval over facts (pairs resampled)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(x), size=(n_boot, len(x)))
    boot = np.array([spearman(x[d], y[d]) for d in draws])
    boot = boot[np.isfinite(boot)]
    lo, hi = np.percentile(boot, [2.5, 97.5]) if len(boot) else (np.nan, np.nan)
    return {"rho": spearman(x, y), "ci_low": float(lo), "ci_high": float(hi), "n": len(x)}


def run(args, out: Path) -> None:
    start_wall, start_cpu = time.perf_counter(), time.process_time()
    torch.manual_seed(0)
    model = cp.tiny_model("gemma", seed=0) if args.tiny else cp.load_model()
    data, facts = load_facts(model)
    if args.append:
        saved = pd.read_csv(out / "facts.csv")
        chosen = saved[saved.chosen].fact.tolist()
        tokens, groups, answers = token_masks(model, data, chosen)
        parts = [run_jobs(args, model, (tokens, groups, answers), chosen)]
        old = pd.read_csv(out / "per_fact.csv.gz")
        per_fact = pd.concat([old[~old.condition.isin(args.conditions)], *parts], ignore_index=True)
        per_fact.to_csv(out / "per_fact.csv.gz", index=False)
        write_timing(out / "timing_append.json", start_wall, start_cpu, {"conditions": args.conditions})
        return
    if args.tiny:
        facts = facts.groupby("relation", sort=False).head(6)
    all_ids = facts.fact.tolist()
    tokens, groups, answers = token_masks(model, data, all_ids)
    base = score(
        model, tokens, groups, answers, factor=1.0, condition="subject", layers=None, batch_size=args.batch_size
    )
    facts = facts.assign(p_true=base.p_true.to_numpy(), margin=base.margin.to_numpy(), known=base.top1.to_numpy())
    known = facts[facts.known].fact.tolist()
    if args.tiny and not known:  # a random model knows nothing: keep the pipeline running
        known = all_ids[:6]
    chosen = sorted(random.Random(args.seed).sample(known, min(args.n_facts, len(known))))
    facts["chosen"] = facts.fact.isin(chosen)
    facts.to_csv(out / "facts.csv", index=False)
    where = {f: k for k, f in enumerate(all_ids)}
    pick = [where[f] for f in chosen]
    sub = ([tokens[k] for k in pick], [groups[k] for k in pick], [answers[k] for k in pick])
    per_fact = run_jobs(args, model, sub, chosen)
    per_fact.to_csv(out / "per_fact.csv.gz", index=False)
    info = {"n_facts": len(chosen), "n_known": int(facts.known.sum()), "n_all": len(all_ids), "tiny": bool(args.tiny)}
    write_timing(out / "timing.json", start_wall, start_cpu, info)


def run_jobs(args, model, sub: tuple, chosen: list[int]) -> pd.DataFrame:
    """Every condition of ``args.conditions`` at every factor in all layers, and ``subject`` in
    each band of layers at the band factors (when ``subject`` is asked for)."""
    jobs = [(c, "all", f) for c in args.conditions for f in args.factors]
    layer_sets = bands(model.cfg.n_layers)
    if "subject" in args.conditions:
        jobs += [("subject", name, f) for name in list(layer_sets)[1:] for f in args.band_factors]
    parts = []
    for condition, band, factor in jobs:
        frame = score(
            model, *sub, factor=factor, condition=condition, layers=layer_sets[band], batch_size=args.batch_size
        )
        parts.append(frame.assign(fact=chosen, condition=condition, layers=band, factor=factor))
        print(condition, band, factor, f"accuracy {frame.top1.mean():.3f}", flush=True)
    return pd.concat(parts, ignore_index=True)


def write_timing(path: Path, start_wall: float, start_cpu: float, info: dict) -> None:
    timing = {
        "wall_s": round(time.perf_counter() - start_wall, 1),
        "cpu_s": round(time.process_time() - start_cpu, 1),
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2),
    } | info
    path.write_text(json.dumps(timing, indent=1))
    print(timing, flush=True)


def summarise(out: Path) -> None:
    facts = pd.read_csv(out / "facts.csv")
    per_fact = pd.read_csv(out / "per_fact.csv.gz")
    per_fact["top1"] = per_fact.top1.astype(float)
    accuracy = bootstrap_summary(per_fact, value="top1", by=["condition", "layers", "factor"], unit="fact")
    accuracy.sort_values(["layers", "condition", "factor"], ascending=[True, True, False]).to_csv(
        out / "accuracy.csv", index=False
    )
    main = per_fact[per_fact.layers == "all"].rename(columns={"condition": "method"})
    paired = pd.concat(
        [
            paired_summary(main, a="subject", b=other, by=["factor"], value="top1", unit="fact").assign(
                a="subject", b=other
            )
            for other in sorted(set(main.method) - {"subject"})
        ]
    )
    paired.sort_values(["b", "factor"], ascending=[True, False]).to_csv(out / "paired.csv", index=False)
    moved = per_fact.groupby(["condition", "layers", "factor"])[["asked", "moved"]].mean().reset_index()
    moved["fraction_moved"] = moved.moved / moved.asked.where(moved.asked > 0)
    moved.to_csv(out / "moved.csv", index=False)

    thresholds = erasure_thresholds(per_fact).merge(facts[["fact", "relation", "p_true", "margin"]], on="fact")
    thresholds.to_csv(out / "thresholds.csv", index=False)
    rows = []
    # All facts (never erased: threshold 0), and the facts some factor erases (the theorem's
    # erasable set: those never erased keep an answer the prompt gives without the subject).
    for facts_used, frame in (("all", thresholds), ("erased", thresholds[thresholds.erased])):
        for (condition, relation), part in [
            *((k, g) for k, g in frame.assign(relation="pooled").groupby(["condition", "relation"])),
            *((k, g) for k, g in frame.groupby(["condition", "relation"])),
        ]:
            for proxy in ("p_true", "margin"):
                rows.append(
                    {"facts": facts_used, "condition": condition, "relation": relation, "proxy": proxy}
                    | (spearman_interval(part[proxy], part.threshold) if len(part) > 2 else {"n": len(part)})
                )
    pd.DataFrame(rows).to_csv(out / "correlation.csv", index=False)
    counts = thresholds.groupby(["condition", "threshold"]).size().rename("n_facts").reset_index()
    counts.sort_values(["condition", "threshold"], ascending=[True, False]).to_csv(
        out / "threshold_counts.csv", index=False
    )
    summary = bootstrap_summary(
        thresholds.assign(erased=thresholds.erased.astype(float), recovers=thresholds.recovers.astype(float)),
        value="erased",
        by=["condition"],
        unit="fact",
    )
    summary.to_csv(out / "erased.csv", index=False)
    # Survival of strong imbalances by tercile of the base probability.
    tercile = pd.qcut(facts.set_index("fact").p_true.loc[main.fact.unique()], 3, labels=["low", "middle", "high"])
    strong = main[main.factor.isin([0.1, 0.01, main.factor.min()])]
    survival = bootstrap_summary(
        strong.assign(tercile=strong.fact.map(tercile).astype(str)),
        value="top1",
        by=["method", "factor", "tercile"],
        unit="fact",
    )
    survival.to_csv(out / "survival_by_tercile.csv", index=False)
    # Which answers survive the strongest imbalance against the subject.
    last = main[(main.method == "subject") & (main.factor == main.factor.min())]
    answers = last.merge(facts[["fact", "relation", "answer"]], on="fact")
    survivors = answers.groupby(["relation", "answer"]).top1.agg(n_facts="size", n_top1="sum").reset_index()
    survivors.sort_values(["relation", "n_top1", "n_facts"], ascending=[True, False, False]).to_csv(
        out / "survivors.csv", index=False
    )
    figures(out, accuracy, thresholds)


def figures(out: Path, accuracy: pd.DataFrame, thresholds: pd.DataFrame) -> None:
    frame = accuracy.assign(
        err_plus=accuracy.ci_high - accuracy["mean"],
        err_minus=accuracy["mean"] - accuracy.ci_low,
        curve=np.where(
            accuracy.layers == "all",
            accuracy.condition.map(LABELS),
            accuracy.condition.map(LABELS) + ", layers " + accuracy.layers,
        ),
        x=accuracy.factor.where(accuracy.factor > 0, 3e-4),
    )
    line = px.line(
        frame.sort_values(["curve", "factor"]),
        x="x",
        y="mean",
        color="curve",
        error_y="err_plus",
        error_y_minus="err_minus",
        markers=True,
        log_x=True,
        labels={
            "x": "factor on the subject's attention (controls: that mass moved elsewhere; 0 drawn at 3e-4)",
            "mean": "top-1 accuracy",
            "curve": "",
        },
        title="Known facts still top-1 as the last token's attention to the subject shrinks",
    )
    line.update_yaxes(range=[-0.02, 1.02])
    points = thresholds[thresholds.condition == "subject"].assign(
        threshold_x=lambda f: (
            f.threshold.where(f.threshold > 0, 3e-4) * np.exp(np.random.default_rng(0).uniform(-0.15, 0.15, len(f)))
        )
    )
    scatter = px.scatter(
        points,
        x="p_true",
        y="threshold_x",
        color="relation",
        log_y=True,
        labels={
            "p_true": "base probability of the true first token",
            "threshold_x": "erasure threshold (factor; 3e-4 = never erased; jittered)",
        },
        title="Per fact: the factor at which the answer stops being top-1 (subject, all layers)",
    )
    for name, fig in {"accuracy": line, "thresholds": scatter}.items():
        try:
            save_figure(fig, out / name, formats="png")
        except (ImportError, RuntimeError, ValueError) as error:  # no kaleido / browser: the HTML stays
            fig.write_html(out / f"{name}.html", include_plotlyjs="cdn")
            print(f"{name}: PNG not written ({error}); wrote HTML")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="attention_imbalance")
    parser.add_argument("--n-facts", type=int, default=150)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--factors", type=float, nargs="+", default=list(FACTORS))
    parser.add_argument("--band-factors", type=float, nargs="+", default=list(BAND_FACTORS))
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--conditions", nargs="+", choices=CONDITIONS, default=list(CONDITIONS))
    parser.add_argument("--append", action="store_true", help="add --conditions to a finished run's data")
    parser.add_argument("--tiny", action="store_true", help="smoke run on a random tiny model")
    parser.add_argument("--summarise-only", action="store_true")
    args = parser.parse_args()
    if 1.0 not in args.factors:
        parser.error("--factors must include 1 (the unchanged model)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.summarise_only:
        run(args, out)
    summarise(out)


if __name__ == "__main__":
    main()
