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
from .engine import HeadEdit, ModuleEdit, SweepResult, answer_probabilities, sweep_dataset
from .heads import (
    cumulative_knockout,
    head_sweep,
    rank_heads,
    run_once_vs_twice,
    superposition_heads,
    top_knockout_heads,
)
from .interventions import AddHeadOutput, Knockout, ScaleHead, intervene, mean_activation
from .juice import IdentifiedHeads, JuICE, identify_heads
from .knockouts import consistent_gains, knockout_sweep
from .models import DEFAULT_MODEL, ModelUnavailableError, from_hf_model, load_model, tiny_model
from .plots import (
    plot_head_heatmap,
    plot_knockouts,
    plot_run_once_vs_twice,
    plot_superposition,
    style_head_table,
)
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
