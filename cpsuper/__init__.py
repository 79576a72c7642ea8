"""cpsuper: knowledge conflicts and context-parametric superposition in TransformerLens models.

``import cpsuper as cp`` gives the notebook workflow at the top level: load a model, build or
load conflict data, split and filter it, score it, run the sweeps and tables, identify heads,
steer (JuICE and the baselines), evaluate, and the attribution, attention, patching, additivity,
role, tracing, logit-lens, truncation and trajectory analyses with their result classes. Everything else lives in
one namespace each: ``cp.plots`` (figures), ``cp.data`` (datasets and relations), ``cp.stats``
(intervals), ``cp.edits`` (what an intervention is), ``cp.engine`` (batched interventions),
``cp.sweeps`` (sweeps over a dataset), ``cp.decoding``, ``cp.scoring``,
``cp.reading``, ``cp.runtime`` (input checks), ``cp.interrupts`` (hooks that always come off),
``cp.models``, ``cp.truncation``, ``cp.finetune``, ``cp.robustness``, ``cp.toys`` and the other
modules named in ARCHITECTURE.md.
"""

from . import (
    ablation,
    answers,
    attribution,
    baselines,
    context_gate,
    data,
    decoding,
    distributed,
    edits,
    engine,
    finetune,
    head_paths,
    heads,
    hub,
    interrupts,
    interventions,
    knockouts,
    metrics,
    models,
    plots,
    precision,
    reading,
    robustness,
    roles,
    runtime,
    scoring,
    spans,
    stats,
    sweeps,
    toys,
    trajectories,
    truncation,
    tuning,
    weight_layout,
)
from .additivity import Additivity, additivity
from .attention import AttentionResult, attention_patterns, attention_to_span
from .attribution import Attribution, direct_logit_attribution
from .attribution_patching import attribution_patching
from .baselines import CAD, PH3, KnockoutPruning, Original, PromptInstruction, evaluate, evaluation_table
from .data import (
    CONFLICT_TYPES,
    ConflictDataset,
    ConflictExample,
    Relation,
    conflict_dataset,
    list_relations,
    load_context_tasks,
    load_memotrap,
    load_nqswap,
    load_paraconflict,
    load_relation,
    split,
)
from .explore import explore, write_explorer_page
from .finetune import lora_finetune
from .heads import cumulative_knockout, head_sweep, rank_heads, run_once_vs_twice, superposition_heads
from .identification import IdentifiedHeads, identify_heads
from .interventions import Knockout, ScaleHead, intervene
from .juice import JuICE
from .knockouts import knockout_sweep
from .lens import logit_lens
from .mechanisms import head_categories, mechanism_contributions
from .models import load_model
from .path_patching import path_patching
from .roles import head_roles, role_transitions
from .scoring import filter_known, score_dataset, summarize_scores
from .sweeps import SweepResult
from .tiny import tiny_model
from .tracing import causal_trace
from .trajectories import checkpoint_trajectory
from .truncation import TruncationResult, truncation_sweep
from .variance import SelectionVariance, selection_variance

__version__ = "0.1.0"

__all__ = [
    # models
    "load_model",
    "tiny_model",
    # data
    "CONFLICT_TYPES",
    "ConflictDataset",
    "ConflictExample",
    "Relation",
    "conflict_dataset",
    "list_relations",
    "load_context_tasks",
    "load_memotrap",
    "load_nqswap",
    "load_paraconflict",
    "load_relation",
    "split",
    "filter_known",
    # scoring and evaluation
    "score_dataset",
    "summarize_scores",
    "evaluate",
    "evaluation_table",
    # sweeps and tables
    "SweepResult",
    "knockout_sweep",
    "head_sweep",
    "rank_heads",
    "cumulative_knockout",
    "superposition_heads",
    "run_once_vs_twice",
    # identification and steering
    "IdentifiedHeads",
    "identify_heads",
    "JuICE",
    "Original",
    "CAD",
    "PH3",
    "KnockoutPruning",
    "PromptInstruction",
    "SelectionVariance",
    "selection_variance",
    # interventions
    "intervene",
    "ScaleHead",
    "Knockout",
    # attribution, attention, patching, additivity
    "Attribution",
    "direct_logit_attribution",
    "head_categories",
    "mechanism_contributions",
    "AttentionResult",
    "attention_patterns",
    "attention_to_span",
    "path_patching",
    "causal_trace",
    "attribution_patching",
    "logit_lens",
    "Additivity",
    "additivity",
    # roles across conflict types
    "head_roles",
    "role_transitions",
    # memory in the weights, training dynamics, finetuning
    "TruncationResult",
    "truncation_sweep",
    "checkpoint_trajectory",
    "lora_finetune",
    # the explorer
    "explore",
    "write_explorer_page",
]
