"""Weight truncation (LASER-style rank reduction) and MLP drops, and sweeps over layer x rho.

Chen, Bruna & Bietti (2024) argue that generic, context-free associations ("Madrid is located
in" -> " the") live largely in feed-forward weights, and that cutting those weights down to a
few singular directions can let the in-context or factual answer win. This module makes that a
measurement on any HookedTransformer:

- :func:`truncate` swaps weight matrices for their best rank-``k`` approximation, with
  ``k = floor(rho * min(d_in, d_out))``, inside a ``with`` block, and puts the original tensors
  back on exit (bit for bit, also after an exception);
- :func:`drop_mlp` zeroes whole MLP blocks (``hook_mlp_out``), which differs from ``rho = 0``
  when the MLP has biases;
- :func:`truncation_sweep` reads candidate-answer probabilities at the final position for every
  layer x rho (x example x conflict type), factorizing each matrix once.

Layers are 0-based, as in TransformerLens (the paper's "16-th layer" of a 16-layer Pythia is
layer 15 here).
"""

from .edits import (
    DEFAULT_RHOS,
    MATRICES,
    Truncation,
    drop_mlp,
    low_rank_approx,
    truncate,
    truncation_matrices,
    truncation_rank,
)
from .sweep import TruncationResult, truncation_sweep

__all__ = [
    "DEFAULT_RHOS",
    "MATRICES",
    "Truncation",
    "TruncationResult",
    "drop_mlp",
    "low_rank_approx",
    "truncate",
    "truncation_matrices",
    "truncation_rank",
    "truncation_sweep",
]


# ---------------------------------------------------------------------------------------------
# Figures: drawn by cpsuper.plots.truncation; the old spelling here warns for one release
