"""Knowledge-conflict datasets: built-in relations, file loaders and splits (no model code)."""

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
