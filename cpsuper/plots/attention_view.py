"""circuitsvis views of attention patterns (interactive in Jupyter, standalone as HTML)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..attention import attention_patterns
from ..backend import Model

__all__ = ["attention_view", "save_attention_view"]


def attention_view(model: Model, prompt: str, heads: Sequence[tuple[int, int]]):
    """An interactive ``circuitsvis`` view of the chosen heads' attention on one prompt.

    Displays in Jupyter; :func:`save_attention_view` writes it as standalone HTML."""
    import circuitsvis as cv

    patterns, tokens = attention_patterns(model, prompt, heads)
    names = [f"L{int(layer)}H{int(head)}" for layer, head in heads]
    return cv.attention.attention_heads(attention=patterns, tokens=tokens, attention_head_names=names)


def save_attention_view(view, path: str | Path) -> None:
    """Write a ``circuitsvis`` view as one HTML file with its JavaScript inlined (works offline)."""
    html = f"<!DOCTYPE html><html><head><meta charset='utf-8'></head><body>{view.local_src}</body></html>"
    Path(path).write_text(html)
