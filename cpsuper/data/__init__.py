"""Knowledge-conflict datasets: built-in relations, file loaders and splits (no model code)."""

import warnings

from .context_tasks_loader import CONTEXT_TASK_KINDS, load_context_tasks
from .examples import CONFLICT_TYPES, TARGETS, ConflictDataset, ConflictExample
from .loaders import load_memotrap, load_nqswap, load_paraconflict, load_sayings
from .relations import Fact, Relation, Wording, conflict_dataset, list_relations, load_relation
from .selection import Split, split

__all__ = [
    "CONFLICT_TYPES",
    "CONTEXT_TASK_KINDS",
    "TARGETS",
    "ConflictDataset",
    "ConflictExample",
    "Fact",
    "Relation",
    "Split",
    "Wording",
    "conflict_dataset",
    "list_relations",
    "load_context_tasks",
    "load_memotrap",
    "load_nqswap",
    "load_paraconflict",
    "load_relation",
    "load_sayings",
    "split",
]


def __getattr__(name: str):
    # Deprecated spelling kept for one release: filter_known runs the model, so it lives in scoring.
    if name == "filter_known":
        warnings.warn(
            "cpsuper.data.filter_known moved to cpsuper.filter_known (cpsuper.scoring).",
            DeprecationWarning,
            stacklevel=2,
        )
        from ..scoring import filter_known

        return filter_known
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
