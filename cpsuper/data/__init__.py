"""Knowledge-conflict datasets: built-in relations, file loaders, filtering and splits."""

from .examples import CONFLICT_TYPES, TARGETS, ConflictDataset, ConflictExample
from .loaders import load_memotrap, load_nqswap, load_paraconflict, load_sayings
from .relations import Fact, Relation, conflict_dataset, list_relations, load_relation
from .selection import Split, filter_known, split

__all__ = [
    "CONFLICT_TYPES",
    "TARGETS",
    "ConflictDataset",
    "ConflictExample",
    "Fact",
    "Relation",
    "Split",
    "conflict_dataset",
    "filter_known",
    "list_relations",
    "load_memotrap",
    "load_nqswap",
    "load_paraconflict",
    "load_relation",
    "load_sayings",
    "split",
]
