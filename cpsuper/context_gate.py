"""A context gate: steer only the prompts that hold a context the model could copy from.

A steering toward memory costs clean recall when it acts on prompts without a context: there is
nothing to resist, and the added head outputs only disturb a fact the model already recalls.
Toward the context, a prompt without one has nothing to follow. The gate tells the prompts apart
from the unsteered model alone, with no label from the caller: at a prompt's last position, the
next-token probability the model puts on tokens that occur in the prompt (its *prompt-token
mass*, special tokens left out). A context that offers an answer makes that answer a prompt token
the model weighs; a plain question rarely puts much mass on its own words. A gated steering
decodes the prompts whose mass reaches the threshold steered and the rest with the plain model;
the decision is made once per prompt, before the first new token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from .backend import Model
from .decoding import Steering, iter_final_logits
from .dual_run import StrengthPerRow
from .runtime import check_batch_size, tokenize_prompts

__all__ = [
    "DEFAULT_CONTEXT_GATE",
    "check_context_gate",
    "context_gate_open",
    "gate_shut",
    "gated_steering",
    "prompt_token_mass",
]

DEFAULT_CONTEXT_GATE = 0.3
"""The prompt-token mass from which a gated steering acts (docs/juice.md: how it was chosen)."""


def check_context_gate(gate: float | None) -> float | None:
    """``gate`` as a float in (0, 1], None for no gate, or a ValueError saying what it means."""
    if gate is None:
        return None
    if isinstance(gate, bool) or not isinstance(gate, (int, float)) or not 0 < gate <= 1:
        raise ValueError(
            "context_gate is the prompt-token mass (a probability, in (0, 1]) from which a prompt is "
            f"steered, e.g. {DEFAULT_CONTEXT_GATE}; None steers every prompt. Got {gate!r}."
        )
    return float(gate)


def prompt_token_mass(
    model: Model, prompts: str | Sequence[str], *, batch_size: int = 32, progress: bool = False
) -> Float[Tensor, " n"]:
    """Per prompt, the unsteered next-token probability at its last position summed over the
    distinct tokens that occur in the prompt (special tokens such as BOS left out). Read batch by
    batch: only one number per prompt is kept, not its vocabulary-wide logits."""
    token_lists = tokenize_prompts(model, prompts)
    special = set(getattr(model.tokenizer, "all_special_ids", None) or [])
    mass = torch.zeros(len(token_lists))
    batches = iter_final_logits(
        model, token_lists, batch_size=check_batch_size(batch_size), progress=progress, desc="context gate"
    )
    for idx, logits in batches:
        probs = logits.float().softmax(-1)
        for row, i in enumerate(idx):
            own = sorted(set(token_lists[i]) - special)
            if own:
                mass[i] = probs[row, own].sum().item()
    return mass


def context_gate_open(
    model: Model, prompts: str | Sequence[str], gate: float, *, batch_size: int = 32
) -> Bool[Tensor, " n"]:
    """Which prompts a steering with context gate ``gate`` steers: prompt-token mass >= ``gate``."""
    gate = check_context_gate(gate)
    if gate is None:
        raise ValueError("context_gate_open needs a gate threshold in (0, 1], got None.")
    return prompt_token_mass(model, prompts, batch_size=batch_size) >= gate


def gated_steering(steer, prompts: Sequence[str], *, batch_size: int = 32) -> Steering:
    """``steer`` (a :class:`cpsuper.JuICE`) as it applies to ``prompts``: itself without a gate,
    or its strengths on the prompts its context gate opens for and none elsewhere."""
    if steer.context_gate is None or not steer.steers or not len(prompts):
        return steer
    open_ = context_gate_open(steer.model, prompts, steer.context_gate, batch_size=batch_size).float()
    return StrengthPerRow(steer, steer.beta_plus * open_, steer.beta_minus * open_)


def gate_shut(gate: float | None, shares: dict[str, float]) -> str | None:
    """A warning when a fitted gate opened for under half of some conflict type's validation
    prompts (``shares``: the share opened per prompt type, as ``JuICE.fitted_on["gate_open"]``
    holds it): the steering then leaves most such prompts unsteered. None otherwise."""
    shut = {c: share for c, share in shares.items() if c != "clean" and share < 0.5}
    if gate is None or not shut:
        return None
    return (
        f"JuICE.fit: the context gate ({gate:g}) opened for only "
        + ", ".join(f"{share:.0%} of the {c} prompts" for c, share in shut.items())
        + " on validation, and the model runs unsteered on the rest. Lower context_gate, or pass "
        "recipe='robust-conflict' to steer every prompt."
    )
