"""cpsuper: knowledge conflicts and context-parametric superposition in TransformerLens models."""

from .data import (
    CONFLICT_TYPES,
    TARGETS,
    ConflictDataset,
    ConflictExample,
    Fact,
    Relation,
    Split,
    conflict_dataset,
    filter_known,
    list_relations,
    load_memotrap,
    load_nqswap,
    load_paraconflict,
    load_relation,
    split,
)
from .models import DEFAULT_MODEL, ModelUnavailableError, from_hf_model, load_model, tiny_model
from .scoring import (
    answer_token,
    check_dataset,
    final_logits,
    greedy_continuations,
    mentions_answer,
    score_dataset,
    summarize_scores,
)

__version__ = "0.1.0"
