"""Command line: ``cpsuper conflicts`` measures the knowledge-conflict effect on a model."""

from __future__ import annotations

import argparse
import sys
import time

from .data.examples import CONFLICT_TYPES

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cpsuper", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    conflicts = sub.add_parser(
        "conflicts",
        help="filter the facts a model knows, then score clean / substitution / coherent prompts",
        description=(
            "Load a model, keep the facts it answers correctly on clean prompts, and print the "
            "accuracy and mean answer probabilities under each conflict type."
        ),
    )
    conflicts.add_argument("--model", default="gemma-3-270m", help="model name (default: the embedded Gemma-3-270M)")
    conflicts.add_argument("--relation", nargs="+", default=["world_capital"], help="built-in relation(s)")
    conflicts.add_argument("--n-examples", type=int, default=None, help="facts sampled per relation (default: all)")
    conflicts.add_argument("--paraphrase", type=int, default=0, help="template index (0 = default)")
    conflicts.add_argument("--seed", type=int, default=0)
    conflicts.add_argument("--batch-size", type=int, default=32)
    conflicts.add_argument("--device", default=None)
    conflicts.add_argument("--csv", default=None, help="also write the per-example scores to this CSV file")
    return parser


def _conflicts(args) -> int:
    from .data import conflict_dataset, filter_known, list_relations
    from .models import load_model
    from .scoring import score_dataset, summarize_scores

    unknown = [r for r in args.relation if r not in list_relations()]
    if unknown:
        raise SystemExit(f"cpsuper: unknown relation(s) {unknown}; choose from {list_relations()}.")
    if args.n_examples is not None and args.n_examples < 1:
        raise SystemExit("cpsuper: --n-examples must be at least 1.")

    start = time.perf_counter()
    print(f"Loading {args.model} ...", file=sys.stderr)
    model = load_model(args.model, device=args.device)
    dataset = conflict_dataset(
        args.relation, n=args.n_examples, seed=args.seed, tokenizer=model, paraphrase=args.paraphrase
    )
    known = filter_known(model, dataset, batch_size=args.batch_size)
    print(f"The model knows {len(known)} of {len(dataset)} facts (greedy answer on the clean prompt).")
    scores = score_dataset(model, known, batch_size=args.batch_size)
    table = summarize_scores(scores).pivot_table(
        index=["relation", "conflict_type"], columns="measure", values="mean", sort=False
    )
    columns = ["acc_parametric", "acc_context", "p_parametric", "p_context", "context_wins"]
    table = table[columns].reindex(CONFLICT_TYPES, level="conflict_type")
    print(table.round(3).to_string())
    print(
        "\nacc_*: greedy continuation names that answer; p_*: first-token probability; "
        "context_wins: share where the context answer's first token outranks the true answer's."
    )
    if args.csv:
        scores.to_csv(args.csv, index=False)
        print(f"Per-example scores written to {args.csv}")
    print(f"Done in {time.perf_counter() - start:.0f} s.", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "conflicts":
        return _conflicts(args)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
