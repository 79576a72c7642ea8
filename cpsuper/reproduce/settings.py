"""What a ``cpsuper reproduce`` run computes: its grids (``FULL``, ``QUICK``) and argument checks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import cpsuper as cp

from ..models import check_device
from ..tuning import BETA_NEG_GRID, BETA_POS_GRID
from .cache import check_cache_folder

__all__ = ["ANALYSIS_RELATION", "FULL", "METHOD_ORDER", "QUICK", "Settings", "check_arguments"]

ANALYSIS_RELATION = "world_capital"
"""JuICE heads are identified on this relation, and the per-head analyses run on it."""


@dataclass(frozen=True)
class Settings:
    """Sizes and grids of one reproduction run (``FULL`` or ``QUICK``)."""

    n_examples: int  # facts sampled per relation before filtering
    n_analysis: int  # known world-capital facts for the knockout / head sweeps, DLA and attention
    modules: tuple[str, ...]  # module kinds of the Figure 3 knockouts
    alphas: tuple[float, ...]  # head scales of the superposition sweep (0 = knockout)
    n_select: int  # selection facts (JuICE head identification, Table 2 ranking, PH3)
    n_validation: int  # validation facts (beta tuning, PH3's k)
    clean_margin: float  # share of clean validation facts JuICE's strengths may cost
    max_test: int  # at most this many held-out facts per relation in Table 2 / Figure 6 / Table 3
    pos_grid: tuple[float, ...]
    neg_grid: tuple[float, ...]
    k: int  # JuICE heads per sign
    beta_pos_grid: tuple[float, ...]
    beta_neg_grid: tuple[float, ...]
    ph3_ks: tuple[int, ...]
    table2_k: int  # heads ranked for Table 2 / Figure 6
    table2_ks: tuple[int, ...]
    max_new_tokens: int  # greedy tokens per answer in the evaluation (cpsuper's protocol)
    batch_size: int = 32


FULL = Settings(
    n_examples=100,
    n_analysis=16,
    modules=("attn", "mlp", "layer"),
    alphas=(0.0, 2.0),
    n_select=8,
    n_validation=10,
    clean_margin=0.1,
    max_test=30,
    pos_grid=(1.0, 3.0, 5.0, 10.0, 30.0),
    neg_grid=(-1.0, -2.0, -5.0),
    k=5,
    beta_pos_grid=BETA_POS_GRID,
    beta_neg_grid=BETA_NEG_GRID,
    ph3_ks=(1, 3, 5, 7, 9, 15),
    table2_k=10,
    table2_ks=(1, 3, 10),
    max_new_tokens=8,
)
QUICK = Settings(
    n_examples=16,
    n_analysis=4,
    modules=("attn", "mlp"),
    alphas=(0.0,),
    n_select=2,
    n_validation=2,
    clean_margin=0.5,
    max_test=3,
    pos_grid=(1.0, 10.0),
    neg_grid=(-1.0,),
    k=3,
    beta_pos_grid=(0.0, 0.5, 1.0),
    beta_neg_grid=(0.0, -0.5),
    ph3_ks=(1, 3),
    table2_k=5,
    table2_ks=(1, 3, 5),
    max_new_tokens=4,
)

METHOD_ORDER = ("Original", "Prompt", "CAD", "PH3", "JuNe", "JuICE")
"""Row order of Table 3."""


DTYPES = ("float32", "bfloat16", "float16")


def check_arguments(
    model: str,
    relations: Sequence[str] | None,
    n_examples: int | None,
    out: str | Path,
    device: str | None,
    dtype: str = "float32",
) -> list[str]:
    """Validate the arguments before anything slow happens; return the relations to use.

    Raises ``ValueError`` with a message that says what to change.
    """
    if not model or not str(model).strip():
        raise ValueError("--model is empty; give a model name such as gemma-3-270m or tiny-gemma.")
    available = cp.list_relations()
    relations = list(relations) if relations else list(available)
    unknown = [r for r in relations if r not in available]
    if unknown:
        raise ValueError(f"Unknown relation(s) {unknown}; choose from {available}.")
    if len(set(relations)) != len(relations):
        raise ValueError(f"--relations lists a relation twice: {relations}; name each once.")
    if n_examples is not None and n_examples < 1:
        raise ValueError(f"--n-examples must be at least 1 (got {n_examples}); it is the number of facts per relation.")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a directory (it is created if missing).")
    check_cache_folder(out / "cache")  # a folder or link there that cpsuper did not create is refused
    _check_device(device)
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}.")
    return relations


def _check_device(device: str | None) -> None:
    if device is not None:
        try:
            check_device(device)
        except ValueError as err:
            raise ValueError(f"--device {device}: {err}") from None
