"""Theorem 4.5 of Ghosal, Hashimoto and Raghunathan on the embedded model, before any training:
which way the first finetuning step pushes the last token's attention, toward the subject or
away from it, for the FT-Top and FT-Bottom training facts of scripts/lesser_known_facts.py.

Facts and split are that script's (``ranked_facts`` and ``split``, imported from it by path): all
facts of three relations ranked by the base model's probability of the true answer's first token;
FT-Top are the ``--n-train`` best known, FT-Bottom the ``--n-train`` least known. For each training
example (clean prompt, the answer's first token), ``cpsuper.attention_push.attention_score_gradients``
takes the gradient of the finetuning loss on the last query's pre-softmax attention scores in every
layer and query head, sums ``-dL/ds`` over the subject's tokens (the push toward the subject), the
other non-BOS tokens and BOS, and reads each group's relevance ``-dL/dz . v`` (the analogue of
``s_rel`` and ``p_rel``); the softmax identity linking the two is checked numerically.

``--with-test`` adds the script's 120 test facts (probabilities in between), used only for the rank
correlation of the push with the base probability within each relation.

Writes under --out: ``per_head.csv.gz`` (every example x layer x head), ``facts.csv``,
``timing.json``; the summaries ``push_by_layer.csv`` (heads summed, 95 % bootstrap intervals over
facts, FT-Top minus FT-Bottom unpaired), ``push_total.csv``, ``sign_agreement.csv``,
``by_relation.csv``, ``rank_correlations.csv``, ``identity.json``; and the figure
``push_by_layer.png``. ``--summarise-only`` redoes the summaries from the saved files; ``--tiny``
is a smoke run on a random tiny model.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python scripts/attention_push.py --with-test --out docs/results/attention_push
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import time
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.express as px
import torch

import cpsuper as cp
from cpsuper.attention_push import attention_score_gradients, sign_agreement
from cpsuper.plots.export import save_figure
from cpsuper.spans import example_spans
from cpsuper.stats import bootstrap_summary, unpaired_difference

ROLES = {"top": "FT-Top", "bottom": "FT-Bottom"}


def lesser_known_facts():
    """scripts/lesser_known_facts.py as a module (its ``ranked_facts`` and ``split``)."""
    path = Path(__file__).parent / "lesser_known_facts.py"
    spec = importlib.util.spec_from_file_location("lesser_known_facts", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def per_fact(heads: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Heads summed: per fact and layer, and per fact over every layer. The totals also carry the
    net direction ``push_subject / sum |push_subject|`` over heads (in [-1, 1], free of the loss's
    scale), the share of heads whose push on the subject is positive, the share with
    ``s_rel > p_rel``, and the agreement of the two signs (plain and weighted by ``|push|``)."""
    keys = ["fact", "role", "relation"]
    cols = ["push_subject", "push_relation", "push_bos", "attn_step_subject"]
    layers = heads.groupby([*keys, "layer"], as_index=False)[cols].sum()
    heads = heads.assign(
        agree=sign_agreement(heads),
        abs_push=heads.push_subject.abs(),
        positive=(heads.push_subject > 0).astype(float),
        s_above_p=(heads.rel_subject > heads.rel_relation).astype(float),
    )
    heads = heads.assign(weighted=heads.agree.fillna(0.0) * heads.abs_push)
    g = heads.groupby(keys)
    total = g[cols].sum()
    total["net_direction"] = total.push_subject / g.abs_push.sum()
    total["share_positive"] = g.positive.mean()
    total["share_s_above_p"] = g.s_above_p.mean()
    total["agreement"] = g.agree.mean()
    total["agreement_weighted"] = g.weighted.sum() / g.abs_push.sum()
    total["subject_minus_relation"] = total.push_subject - total.push_relation
    total["loss"] = g.loss.first()
    return layers, total.reset_index()


def rank_correlation(x, y, *, n_boot: int = 2000, seed: int = 0) -> cp.stats.Interval:
    """Spearman rank correlation of paired values with a percentile bootstrap interval over pairs."""
    frame = pd.DataFrame({"x": np.asarray(x, dtype=float), "y": np.asarray(y, dtype=float)})
    point = frame.x.rank().corr(frame.y.rank())
    rng = np.random.default_rng(seed)
    boot = []
    for _ in range(n_boot):
        part = frame.iloc[rng.integers(0, len(frame), len(frame))]
        boot.append(part.x.rank().corr(part.y.rank()))
    lo, hi = np.nanquantile(boot, [0.025, 0.975])
    return cp.stats.Interval(float(point), float(lo), float(hi), len(frame))


def rank_correlations(total: pd.DataFrame) -> pd.DataFrame:
    """Per relation and over all measured facts: the rank correlation of the base model's
    probability of the answer with the push toward the subject and with the net direction (the
    theorem predicts positive: better-known facts push toward the subject)."""
    rows = []
    for relation, part in [*total.groupby("relation"), ("all", total)]:
        for value in ("push_subject", "net_direction"):
            r = rank_correlation(part.p_true, part[value])
            rows.append({"relation": relation, "value": value, "rho": r.mean, "ci_low": r.ci_low, "ci_high": r.ci_high})
            rows[-1]["n"] = r.n
    return pd.DataFrame(rows)


def interval_rows(frame: pd.DataFrame, value: str, by: list[str]) -> pd.DataFrame:
    """Per group of ``by``: FT-Top and FT-Bottom means with 95 % intervals over facts, and the
    unpaired FT-Top minus FT-Bottom difference."""
    means = bootstrap_summary(frame, value=value, by=[*by, "role"], unit="fact")
    rows = []
    for key, part in frame.groupby(by) if by else [((), frame)]:
        key = key if isinstance(key, tuple) else (key,)
        diff = unpaired_difference(part[part.role == "top"][value], part[part.role == "bottom"][value])
        keys = dict(zip(by, key, strict=True))
        row = dict(keys)
        for role in ROLES:
            sel = means[means.role == role]
            for k, v in keys.items():
                sel = sel[sel[k] == v]
            m = sel.iloc[0]
            row |= {f"{role}_mean": m["mean"], f"{role}_ci_low": m.ci_low, f"{role}_ci_high": m.ci_high}
        rows.append(row | {"diff": diff.mean, "diff_ci_low": diff.ci_low, "diff_ci_high": diff.ci_high})
    return pd.DataFrame(rows).assign(value=value)


def measure(args, out: Path) -> None:
    torch.set_num_threads(1)
    wall, cpu = time.perf_counter(), time.process_time()
    model = cp.tiny_model("gemma", seed=0) if args.tiny else cp.load_model()
    lkf = lesser_known_facts()
    data, p = lkf.ranked_facts(model)
    facts = lkf.split(p, args.n_train, args.n_test, args.n_val)
    ranked = {"wall_s": round(time.perf_counter() - wall, 1), "cpu_s": round(time.process_time() - cpu, 1)}
    print("ranked", ranked, flush=True)
    ids = facts["top"] + facts["bottom"] + (facts["test"] if args.with_test else [])
    spans = [example_spans(model, data[i], "clean") for i in ids]
    heads = attention_score_gradients(
        model, [data[i].prompts["clean"] for i in ids], [data[i].answer for i in ids], spans=spans
    )
    info = pd.DataFrame(
        {
            "fact": ids,
            "role": [role for role in ("top", "bottom", "test") for _ in facts[role]][: len(ids)],
            "relation": [data[i].relation for i in ids],
            "subject": [data[i].subject for i in ids],
            "answer": [data[i].answer for i in ids],
            "p_true": [float(p[i]) for i in ids],
            "n_subject_tokens": [s.count("subject") for s in spans],
        }
    )
    info.to_csv(out / "facts.csv", index=False, float_format="%.6g")
    heads = heads.assign(fact=heads.example.map(dict(enumerate(ids)))).drop(columns="example")
    heads.to_csv(out / "per_head.csv.gz", index=False, float_format="%.6g")
    timing = {
        "wall_s": round(time.perf_counter() - wall, 1),
        "cpu_s": round(time.process_time() - cpu, 1),
        "ranking": ranked,
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "examples": len(ids),
        "settings": {k: v for k, v in vars(args).items() if k != "summarise_only"},
    }
    (out / "timing.json").write_text(json.dumps(timing, indent=1) + "\n")
    print(timing, flush=True)


def summarise(out: Path) -> None:
    info = pd.read_csv(out / "facts.csv")
    heads = pd.read_csv(out / "per_head.csv.gz").merge(info[["fact", "role", "relation"]], on="fact")
    scale = heads[["push_subject", "push_relation", "push_bos"]].abs().to_numpy().max()
    identity = {
        "max_identity_err": float(heads.identity_err.max()),
        "max_abs_push": float(scale),
        "max_abs_sum_of_pushes": float((heads.push_subject + heads.push_relation + heads.push_bos).abs().max()),
        "rows": len(heads),
    }
    (out / "identity.json").write_text(json.dumps(identity, indent=1) + "\n")
    layers, total = per_fact(heads)
    correlations = rank_correlations(total.merge(info[["fact", "p_true"]], on="fact"))
    correlations.to_csv(out / "rank_correlations.csv", index=False, float_format="%.4g")
    layers, total = layers[layers.role.isin(list(ROLES))], total[total.role.isin(list(ROLES))]
    by_layer = pd.concat(
        [interval_rows(layers, v, ["layer"]) for v in ("push_subject", "push_relation", "push_bos")], ignore_index=True
    )
    by_layer.to_csv(out / "push_by_layer.csv", index=False, float_format="%.4g")
    values = ["push_subject", "push_relation", "push_bos", "subject_minus_relation", "attn_step_subject"]
    values += ["net_direction", "share_positive", "share_s_above_p", "loss"]
    totals = pd.concat([interval_rows(total, v, []) for v in values], ignore_index=True)
    totals.to_csv(out / "push_total.csv", index=False, float_format="%.4g")
    agree = []
    for value in ("agreement", "agreement_weighted"):
        pooled = bootstrap_summary(total, value=value, unit="fact").assign(role="both")
        agree.append(pd.concat([bootstrap_summary(total, value=value, by=["role"], unit="fact"), pooled]))
        agree[-1]["value"] = value
    exact = sign_agreement(heads, predictor="exact")
    agreement = pd.concat(agree, ignore_index=True)
    agreement.attrs["exact"] = float(exact.mean())
    agreement.to_csv(out / "sign_agreement.csv", index=False, float_format="%.4g")
    by_relation = pd.concat(
        [bootstrap_summary(total, value=v, by=["role", "relation"], unit="fact").assign(value=v) for v in values[:1]]
        + [bootstrap_summary(total, value="net_direction", by=["role", "relation"], unit="fact").assign(value="net")],
        ignore_index=True,
    )
    by_relation.to_csv(out / "by_relation.csv", index=False, float_format="%.4g")
    print(json.dumps(identity), f"exact-predictor agreement {exact.mean():.4f}", sep="\n")
    print(
        correlations.to_string(index=False),
        totals.to_string(index=False),
        agreement.to_string(index=False),
        by_relation.to_string(index=False),
        sep="\n\n",
    )
    figure(out, layers)


def figure(out: Path, layers: pd.DataFrame) -> None:
    parts = []
    for value, name in (("push_subject", "subject"), ("push_relation", "relation + final token"), ("push_bos", "BOS")):
        summary = bootstrap_summary(layers, value=value, by=["role", "layer"], unit="fact")
        parts.append(summary.assign(group=name))
    frame = pd.concat(parts, ignore_index=True)
    frame = frame.assign(
        split=frame.role.map(ROLES), err_plus=frame.ci_high - frame["mean"], err_minus=frame["mean"] - frame.ci_low
    )
    fig = px.line(
        frame,
        x="layer",
        y="mean",
        color="split",
        facet_col="group",
        error_y="err_plus",
        error_y_minus="err_minus",
        markers=True,
        facet_col_spacing=0.07,
        category_orders={"split": list(ROLES.values())},
        labels={"mean": "-dL/d(score), summed over the group's keys and the heads", "layer": "layer"},
        title="First-step push on the last token's attention scores (mean over facts, 95 % CI)",
    )
    fig.update_yaxes(matches=None, showticklabels=True)
    fig.update_xaxes(dtick=2 if layers.layer.max() > 4 else 1)
    fig.for_each_annotation(lambda a: a.update(text=a.text.split("=")[-1]))
    fig.add_hline(y=0, line_color="grey", line_width=1)
    try:
        save_figure(fig, out / "push_by_layer", formats="png")
    except (ImportError, RuntimeError, ValueError) as error:
        fig.write_html(out / "push_by_layer.html", include_plotlyjs="cdn")
        print(f"push_by_layer: PNG not written ({error}); wrote HTML")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="attention_push")
    parser.add_argument("--n-train", type=int, default=64)
    parser.add_argument("--n-test", type=int, default=120, help="as in lesser_known_facts.py (same split)")
    parser.add_argument("--n-val", type=int, default=40, help="as in lesser_known_facts.py (same split)")
    parser.add_argument("--with-test", action="store_true", help="also the test facts (for the rank correlations)")
    parser.add_argument("--tiny", action="store_true", help="smoke run on a random tiny model")
    parser.add_argument("--summarise-only", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.summarise_only:
        measure(args, out)
    summarise(out)


if __name__ == "__main__":
    main()
