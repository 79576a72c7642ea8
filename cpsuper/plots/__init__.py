"""Plotly figures (and one styled table) from the analyses' DataFrames and result objects.

Every function takes what an analysis returned and gives back a ``plotly.graph_objects.Figure``;
nothing is shown or written as a side effect (call ``fig.show()`` or ``fig.write_html(...)``).
The analyses themselves import no plotting library: drawing lives only here.

- :mod:`.style`: one colour per conflict type, target, module and method; labels; layout finish.
- :mod:`.heatmap`: the one panelled heatmap (layer x head, layer x rho, beta+ x beta-).
- :mod:`.sweeps`: knockouts, head heatmaps, superposition, run once vs twice, Table 1 styling.
- :mod:`.attribution`: head DLA, source tokens, head categories, mechanisms, cumulative DLA, attention.
- :mod:`.lens`: the logit lens (each layer read through the final norm).
- :mod:`.tracing`: causal tracing heatmaps (layer x position by span).
- :mod:`.head_paths`: head-to-head path patching (senders x receivers per input).
- :mod:`.attribution_patching`: attribution patching heatmaps and its agreement with exact patching.
- :mod:`.truncation`, :mod:`.steering`, :mod:`.trajectories`, :mod:`.toys`: truncation sweeps,
  JuICE robustness, checkpoint trajectories, the toy models' figures.
- :mod:`.toys_juice`, :mod:`.toys_truncation`: the JuICE theory toy; the truncation paper's
  toy variants and Figure 1.
- :mod:`.additivity`, :mod:`.methods`: joint vs summed mechanism ablations; methods with intervals.
- :mod:`.attention_view`: circuitsvis views of attention patterns.
- :mod:`.export`: paper styling and SVG / PDF / PNG export (kaleido).
"""

from .additivity import plot_additivity
from .attention_view import attention_view, save_attention_view
from .attribution import (
    plot_attention_by_layer,
    plot_attention_heatmap,
    plot_cumulative_dla,
    plot_head_categories,
    plot_head_dla,
    plot_head_sources,
    plot_mechanisms,
)
from .attribution_patching import plot_attribution_patching, plot_attribution_vs_exact
from .export import EXPORT_FORMATS, paper_style, save_figure, save_figures
from .head_paths import plot_head_paths
from .lens import plot_logit_lens
from .methods import plot_methods
from .roles import plot_head_roles
from .steering import plot_beta_grid, plot_robustness
from .sweeps import (
    plot_head_heatmap,
    plot_knockouts,
    plot_run_once_vs_twice,
    plot_superposition,
    style_head_table,
)
from .toys import plot_associative_memory, plot_finetuning, plot_inversion, plot_noisy_recall
from .toys_juice import plot_juice_theory
from .toys_truncation import (
    plot_ffn_variants,
    plot_one_step_margins,
    plot_trigger_matching,
    plot_truncation_figure1,
    plot_value_truncation,
)
from .tracing import plot_causal_trace
from .trajectories import plot_trajectory
from .truncation import plot_truncation, plot_truncation_heatmap
from .variance import plot_selection_variance

__all__ = [
    "EXPORT_FORMATS",
    "attention_view",
    "paper_style",
    "plot_additivity",
    "plot_associative_memory",
    "plot_attention_by_layer",
    "plot_attention_heatmap",
    "plot_beta_grid",
    "plot_cumulative_dla",
    "plot_ffn_variants",
    "plot_finetuning",
    "plot_head_categories",
    "plot_head_dla",
    "plot_head_heatmap",
    "plot_head_roles",
    "plot_head_sources",
    "plot_inversion",
    "plot_juice_theory",
    "plot_knockouts",
    "plot_logit_lens",
    "plot_causal_trace",
    "plot_head_paths",
    "plot_attribution_patching",
    "plot_attribution_vs_exact",
    "plot_mechanisms",
    "plot_methods",
    "plot_noisy_recall",
    "plot_one_step_margins",
    "plot_robustness",
    "plot_run_once_vs_twice",
    "plot_selection_variance",
    "plot_superposition",
    "plot_trajectory",
    "plot_trigger_matching",
    "plot_truncation",
    "plot_truncation_figure1",
    "plot_truncation_heatmap",
    "plot_value_truncation",
    "save_attention_view",
    "save_figure",
    "save_figures",
    "style_head_table",
]
