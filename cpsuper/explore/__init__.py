"""The head explorer: a layer x head heatmap of a head sweep linked to each head's panels (effect
per conflict type and target with bootstrap intervals, source-token DLA by prompt span, attention
on an example, role per conflict type).

- :func:`explore`: the Jupyter version (ipywidgets + plotly ``FigureWidget``; computed lazily).
- :func:`explorer_data` + :func:`write_explorer_page`: every head precomputed and written as one
  static, offline HTML page (:func:`explorer_fragment` for a page that already loads plotly.js).
"""

from .data import SPANS, explorer_data, head_dla, head_effects, span_sources
from .page import explorer_fragment, explorer_html, write_explorer_page
from .widget import HeadExplorer, explore

__all__ = [
    "SPANS",
    "HeadExplorer",
    "explore",
    "explorer_data",
    "explorer_fragment",
    "explorer_html",
    "head_dla",
    "head_effects",
    "span_sources",
    "write_explorer_page",
]
