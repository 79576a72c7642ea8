"""Plotly figures (and one styled table) from the analyses' DataFrames and result objects.

Every function takes what an analysis returned and gives back a ``plotly.graph_objects.Figure``;
nothing is shown or written as a side effect (call ``fig.show()`` or ``fig.write_html(...)``).
The analyses themselves import no plotting library: drawing lives only here.

- :mod:`.style`: one colour per conflict type, target, module and method; labels; layout finish.
- :mod:`.heatmap`: the one panelled heatmap (layer x head, layer x rho, beta+ x beta-).
- :mod:`.sweeps`: knockouts, head heatmaps, superposition, run once vs twice, Table 1 styling.
- :mod:`.attribution`: head DLA, source tokens, head categories, mechanisms, logit lens, attention.
- :mod:`.truncation`, :mod:`.steering`, :mod:`.trajectories`, :mod:`.toys`: truncation sweeps,
  JuICE robustness, checkpoint trajectories, the toy models' figures.
- :mod:`.attention_view`: circuitsvis views of attention patterns.
"""

from .attention_view import attention_view, save_attention_view
from .attribution import (
    plot_attention_by_layer,
    plot_attention_heatmap,
    plot_head_categories,
    plot_head_dla,
    plot_head_sources,
    plot_logit_lens,
    plot_mechanisms,
)
from .steering import plot_beta_grid, plot_robustness
from .sweeps import (
    plot_head_heatmap,
    plot_knockouts,
    plot_run_once_vs_twice,
    plot_superposition,
    style_head_table,
)
from .toys import plot_associative_memory, plot_finetuning, plot_inversion, plot_noisy_recall
from .trajectories import plot_trajectory
from .truncation import plot_truncation, plot_truncation_heatmap

__all__ = [
    "attention_view",
    "plot_associative_memory",
    "plot_finetuning",
    "plot_inversion",
    "plot_noisy_recall",
    "save_attention_view",
    "plot_attention_by_layer",
    "plot_attention_heatmap",
    "plot_beta_grid",
    "plot_head_categories",
    "plot_head_dla",
    "plot_head_heatmap",
    "plot_head_sources",
    "plot_knockouts",
    "plot_logit_lens",
    "plot_mechanisms",
    "plot_robustness",
    "plot_run_once_vs_twice",
    "plot_superposition",
    "plot_trajectory",
    "plot_truncation",
    "plot_truncation_heatmap",
    "style_head_table",
]
