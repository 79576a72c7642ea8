"""The documented attribution example on the embedded model (docs/attribution.md).

python scripts/attribution_example.py --out /tmp/attr
"""

from __future__ import annotations

import argparse
from pathlib import Path

import cpsuper as cp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="attribution_example")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = cp.load_model()

    fact = cp.attribution.prompt_example(
        "Fact: The Colosseum is in the country of", subject="Colosseum", answer="Italy", context_answer="France"
    )
    colosseum = cp.direct_logit_attribution(
        model, fact, ["parametric", "context", "parametric-context"], progress=False
    )
    print(colosseum.totals.to_string())
    categories = cp.head_categories(colosseum, direction="parametric")
    print(categories.head(12).round(3).to_string())
    categories.to_csv(out / "colosseum_categories.csv", index=False)
    mechanisms = cp.mechanism_contributions(
        model,
        fact,
        {
            "Italy (correct)": lambda e: "Italy",
            "Rome (subject-related)": lambda e: "Rome",
            "France (same type)": lambda e: "France",
            "Greece (same type)": lambda e: "Greece",
        },
        categories=categories,
        progress=False,
    )
    print(mechanisms.round(3).to_string())
    figures = {
        "colosseum_sources": cp.plots.plot_head_sources(colosseum, direction="parametric", top_k=10),
        "colosseum_categories": cp.plots.plot_head_categories(categories),
        "colosseum_mechanisms": cp.plots.plot_mechanisms(mechanisms),
        "colosseum_dla": cp.plots.plot_head_dla(colosseum, direction="parametric"),
    }

    relation = cp.load_relation("world_capital")
    data = relation.dataset(subjects=["France", "Japan", "Egypt", "Peru", "Canada", "Kenya"], tokenizer=model)
    capitals = cp.direct_logit_attribution(model, data, ["parametric", "context", "parametric-context"], progress=False)
    print(capitals.totals.groupby(["direction", "conflict_type"]).logit.mean().round(2).to_string())
    for conflict_type in ("clean", "substitution", "coherent"):
        table = cp.head_categories(capitals, conflict_type, "parametric-context").head(6)
        print(conflict_type, "\n", table.round(3).to_string())
    shift = capitals.head_sources("parametric-context").pivot_table(
        index=["layer", "head"], columns=["conflict_type", "group"], values="dla"
    )
    shift.round(3).to_csv(out / "capital_head_sources.csv")
    figures["capital_sources_substitution"] = cp.plots.plot_head_sources(capitals, "substitution", "parametric-context")
    figures["capital_sources_clean"] = cp.plots.plot_head_sources(capitals, "clean", "parametric-context")
    figures["capital_cumulative_dla"] = cp.plots.plot_cumulative_dla(capitals)
    attention = cp.attention_to_span(model, data, "subject", progress=False)
    context = cp.attention_to_span(model, data, "context", progress=False)
    print(attention.by_layer().round(3).to_string())
    print(context.by_layer().round(3).to_string())
    figures["capital_attention_subject"] = cp.plots.plot_attention_by_layer(attention)
    figures["capital_attention_context"] = cp.plots.plot_attention_heatmap(context)
    for name, fig in figures.items():
        fig.write_html(out / f"{name}.html", include_plotlyjs="inline")
    view = cp.plots.attention_view(
        model, data[0].prompts["substitution"], categories.head(3)[["layer", "head"]].itertuples(index=False, name=None)
    )
    cp.plots.save_attention_view(view, out / "attention_view.html")


if __name__ == "__main__":
    main()
