"""Command line: ``cpsuper conflicts`` measures the knowledge-conflict effect on a model;
``cpsuper reproduce`` runs the paper's analyses and writes a self-contained HTML report."""

from __future__ import annotations

import argparse
import os
import sys
import time

from .data.examples import CONFLICT_TYPES

__all__ = ["available_cores", "main", "set_threads"]


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

    reproduce = sub.add_parser(
        "reproduce",
        help="run the paper's analyses and JuICE evaluation; write report.html plus CSV/JSON",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Filter the facts the model knows, then run module knockouts (Figure 3), the head sweep\n"
            "(superposition heatmaps, Table 1), joint knockouts (Table 2, Figure 6), JuICE fitted on\n"
            "world_capital and evaluated against Original / Prompt / CAD / PH3 / JuNe on every relation\n"
            "(Table 3), source-token DLA of the JuICE heads and attention to subject and context.\n"
            "Writes OUT/report.html (self-contained, works offline), every result as CSV/JSON, the fitted\n"
            "JuICE as OUT/juice.json and OUT/manifest.json.\n\n"
            "docs/results/reproduce.md gives the measured time of each mode. Finished steps are cached\n"
            "under OUT/cache/: re-running with the same arguments reuses them, and an interrupted run\n"
            "resumes from the last finished step. Each step's wall and CPU time is printed and shown in\n"
            "the report."
        ),
    )
    reproduce.add_argument(
        "--model",
        default="gemma-3-270m",
        help="model name: the embedded gemma-3-270m (default), any TransformerLens name, "
        "or tiny-gemma / tiny-gpt2 (random test models)",
    )
    reproduce.add_argument(
        "--relations",
        nargs="+",
        default=None,
        metavar="RELATION",
        help="built-in relations to evaluate on (default: all six)",
    )
    reproduce.add_argument(
        "--n-examples",
        type=int,
        default=None,
        help="facts sampled per relation before filtering (default: 100; 16 with --quick)",
    )
    reproduce.add_argument("--out", default="cpsuper-report", help="output directory (default: ./cpsuper-report)")
    reproduce.add_argument(
        "--quick", action="store_true", help="few facts and small grids: minutes instead of an hour, for a first look"
    )
    reproduce.add_argument("--device", default=None, help="cpu, cuda, cuda:N or mps (default: cuda if available)")
    reproduce.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="weights' precision (default: float32); bfloat16 about halves the time on a CPU with bf16 "
        "instructions or a GPU, with the top logits read out in float32; its numbers differ slightly "
        "(docs/results/reproduce.md)",
    )
    reproduce.add_argument("--seed", type=int, default=0, help="sampling and split seed (default: 0)")
    reproduce.add_argument("--no-cache", action="store_true", help="recompute every step instead of reusing OUT/cache")
    reproduce.add_argument(
        "--export",
        default=None,
        metavar="FORMATS",
        help="also write every report figure in these formats, comma-separated (svg, pdf, png), in the paper "
        "style under OUT/figures/ (needs: pip install 'cpsuper[export]')",
    )
    for command in (conflicts, reproduce):
        command.add_argument(
            "--threads",
            type=int,
            default=None,
            help="CPU threads for torch (default: the cores this process may use); printed at the start",
        )
    return parser


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the system has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def set_threads(threads: int | None) -> int:
    """Give torch ``threads`` CPU threads, say so on stderr, and return the number. The default is
    ``$OMP_NUM_THREADS`` where it is set (torchrun and pytest-xdist set it per process), else every
    core this process may use."""
    import torch

    if threads is not None and threads < 1:
        raise SystemExit(f"cpsuper: --threads must be at least 1, got {threads}.")
    omp = os.environ.get("OMP_NUM_THREADS", "")
    threads = threads or (int(omp) if omp.isdigit() and int(omp) > 0 else available_cores())
    torch.set_num_threads(threads)
    print(f"cpsuper: torch uses {threads} CPU thread(s) (--threads to change).", file=sys.stderr)
    return threads


def _conflicts(args) -> int:
    from .data import conflict_dataset, list_relations
    from .models import load_model
    from .scoring import filter_known, score_dataset, summarize_scores

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


def _reproduce(args, argv: list[str] | None) -> int:
    import shlex

    from .distributed import is_main_process
    from .plots.export import check_export
    from .reproduce import check_arguments, print_locations, reproduce

    try:
        check_arguments(args.model, args.relations, args.n_examples, args.out, args.device, args.dtype)
        export = check_export(args.export) if args.export is not None else ()
    except (ValueError, ImportError) as err:
        raise SystemExit(f"cpsuper reproduce: {err}") from None
    words = sys.argv[1:] if argv is None else argv
    command = "cpsuper " + " ".join(shlex.quote(w) for w in words)
    try:
        report = reproduce(
            args.model,
            args.relations,
            args.n_examples,
            args.out,
            quick=args.quick,
            device=args.device,
            dtype=args.dtype,
            seed=args.seed,
            use_cache=not args.no_cache,
            command=command,
            export=export,
        )
    except KeyboardInterrupt:
        print(
            f"cpsuper reproduce: interrupted. Finished steps are kept in {args.out}/cache; run the same "
            "command again to resume.",
            file=sys.stderr,
        )
        return 130
    if is_main_process():  # under torchrun only rank 0 wrote the report
        print_locations(report)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    set_threads(args.threads)
    if args.command == "conflicts":
        return _conflicts(args)
    if args.command == "reproduce":
        return _reproduce(args, argv)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
