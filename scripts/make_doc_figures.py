"""Regenerate the docs' PNG figures (docs/figures/*.png) with cpsuper's paper style.

    python scripts/make_doc_figures.py                 # figures drawn from committed results (no model)
    python scripts/make_doc_figures.py --with-model    # also the attribution figures (runs Gemma-3-270M)

From committed results (docs/results/, no model run):
- juice_transfer_beta_grid_juice.png, juice_transfer_beta_grid_june.png (JuICE / JuNe strengths,
  docs/results/juice_transfer/beta_grid_*.csv);
- juice_context_beta_grid_juice.png, juice_context_beta_grid_june.png (the same toward the context,
  docs/results/juice_context/beta_grid_*.csv);
- superposition_head_roles.png (head roles per conflict type, docs/results/superposition/head_roles.csv).

With ``--with-model`` (the attribution example of docs/attribution.md, a minute or two on a CPU):
attribution_colosseum_sources.png, attribution_colosseum_mechanisms.png,
attribution_capital_sources_substitution.png, attribution_capital_cumulative_dla.png and
attribution_capital_attention_context.png. Needs the export extra: pip install 'cpsuper[export]'.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

import cpsuper as cp
from cpsuper.plots.export import save_figures

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"


def from_results() -> dict[str, object]:
    """Figures drawn from the CSV files committed under docs/results/."""
    figures = {}
    for run in ("juice_transfer", "juice_context"):
        for method in ("juice", "june"):
            path = RESULTS / run / f"beta_grid_{method}.csv"
            if path.exists():
                figures[f"{run}_beta_grid_{method}"] = cp.plots.plot_beta_grid(pd.read_csv(path))
    roles = RESULTS / "superposition" / "head_roles.csv"
    if roles.exists():
        figures["superposition_head_roles"] = cp.plots.plot_head_roles(pd.read_csv(roles))
    return figures


def with_model() -> dict[str, object]:
    """The attribution figures of docs/attribution.md (the same calls as scripts/attribution_example.py)."""
    model = cp.load_model()
    fact = cp.attribution.prompt_example(
        "Fact: The Colosseum is in the country of", subject="Colosseum", answer="Italy", context_answer="France"
    )
    colosseum = cp.direct_logit_attribution(
        model, fact, ["parametric", "context", "parametric-context"], progress=False
    )
    categories = cp.head_categories(colosseum, direction="parametric")
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
    subjects = ["France", "Japan", "Egypt", "Peru", "Canada", "Kenya"]
    data = cp.load_relation("world_capital").dataset(subjects=subjects, tokenizer=model)
    capitals = cp.direct_logit_attribution(model, data, ["parametric", "context", "parametric-context"], progress=False)
    context = cp.attention_to_span(model, data, "context", progress=False)
    return {
        "attribution_colosseum_sources": cp.plots.plot_head_sources(colosseum, direction="parametric", top_k=10),
        "attribution_colosseum_mechanisms": cp.plots.plot_mechanisms(mechanisms),
        "attribution_capital_sources_substitution": cp.plots.plot_head_sources(
            capitals, "substitution", "parametric-context"
        ),
        "attribution_capital_cumulative_dla": cp.plots.plot_cumulative_dla(capitals),
        "attribution_capital_attention_context": cp.plots.plot_attention_heatmap(context),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--with-model", action="store_true", help="also redraw the attribution figures (runs the model)"
    )
    parser.add_argument("--out", default=str(ROOT / "docs" / "figures"), help="folder (default: docs/figures)")
    args = parser.parse_args()
    figures = from_results()
    if args.with_model:
        figures.update(with_model())
    out = Path(args.out)
    written = save_figures({out / f"{name}.png": fig for name, fig in figures.items()}, scale=2.0)
    for path in written:
        print(path)


if __name__ == "__main__":
    main()
