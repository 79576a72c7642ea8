"""JuICE ("Just Run Twice") test-time steering toward parametric memory or the context.

Stage 1 (:func:`identify_heads`): on a few selection facts, add ``a`` times each head's own
output for every ``a`` in a positive and a negative grid and record the change in the target
answer's probability; keep the heads whose mean change is >= 0 under *every* conflict type, rank
them by the summed change, and take the top ``k`` per sign (a head is never in both sets).

Stage 2 (:class:`JuICE`): run the prompt once, clean, recording the chosen heads' outputs
``H*``; run it again adding ``beta_plus H*`` to each enhance head and ``beta_minus H*`` to each
suppress head. ``dual_run=False`` is JuNe, the one-pass ablation ``H <- (1 + beta) H``.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from .backend import Model
from .context_gate import check_context_gate, gate_shut, gated_steering
from .data.examples import TARGETS, ConflictDataset
from .dual_run import DualRunSteering
from .identification import NEG_GRID, POS_GRID, Head, IdentifiedHeads, identify_heads
from .interrupts import run_with_cache
from .reading import mentions_answer, stop_once_settled
from .runtime import (
    answer_token,
    as_prompts,
    check_finite,
    check_grid,
    check_head,
    check_model,
    resolve_conflict_types,
    tokenize_prompts,
)
from .scoring import decode_all, final_logits, greedy_continuations, greedy_groups
from .tuning import (
    BETA_NEG_GRID,
    BETA_POS_GRID,
    DEFAULT_CLEAN_MARGIN,
    DEFAULT_RECIPE,
    fit_steering,
)

# Stage 1 lives in cpsuper.identification; it is re-exported here, where users look for it.
__all__ = [
    "JuICE",
    "SteeringWarning",
]


class SteeringWarning(UserWarning):
    """A fit that ended without steering, or a steering that does nothing."""


@dataclass
class JuICE(DualRunSteering):
    """A steering object: heads plus strengths, applied by a dual run (JuICE) or one pass (JuNe).

    >>> steer = cp.JuICE(model, direction="parametric").fit(parts.select, parts.validation)
    >>> steer.logits(prompts); steer.generate(prompts, max_new_tokens=8)
    """

    model: Model
    direction: str = "parametric"
    k: int = 5
    dual_run: bool = True
    enhance: list[Head] = field(default_factory=list)
    suppress: list[Head] = field(default_factory=list)
    beta_plus: float = 0.0
    beta_minus: float = 0.0
    pos_grid: Sequence[float] = POS_GRID
    neg_grid: Sequence[float] = NEG_GRID
    beta_pos_grid: Sequence[float] = BETA_POS_GRID
    beta_neg_grid: Sequence[float] = BETA_NEG_GRID
    context_gate: float | None = None  # steer only prompts with this much prompt-token mass
    fitted_on: dict = field(default_factory=dict)
    tuning: pd.DataFrame | None = field(default=None, repr=False)
    identified: IdentifiedHeads | None = field(default=None, repr=False)  # stage 1 that chose the heads

    def __post_init__(self):
        check_model(self.model)
        if self.direction not in TARGETS:
            raise ValueError(f"direction must be one of {TARGETS}, got {self.direction!r}.")
        for name in ("enhance", "suppress"):
            heads = []
            for item in getattr(self, name):
                if isinstance(item, (str, bytes)) or not isinstance(item, Sequence) or len(item) != 2:
                    raise ValueError(f"{name} holds {item!r}; each head is a (layer, head) pair, e.g. (10, 0).")
                heads.append(check_head(self.model, *item))
            if len(set(heads)) != len(heads):
                raise ValueError(f"{name} lists a head more than once ({heads}); list each head once.")
            setattr(self, name, heads)
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"k must be a positive integer (heads per sign), got {self.k!r}.")
        self.beta_plus, self.beta_minus = self._checked_strengths()
        self.context_gate = check_context_gate(self.context_gate)
        self.pos_grid = check_grid(self.pos_grid, "pos_grid", "positive")
        self.neg_grid = check_grid(self.neg_grid, "neg_grid", "negative")
        self.beta_pos_grid = check_grid(self.beta_pos_grid, "beta_pos_grid", "non-negative")
        self.beta_neg_grid = check_grid(self.beta_neg_grid, "beta_neg_grid", "non-positive")
        both = set(map(tuple, self.enhance)) & set(map(tuple, self.suppress))
        if both:
            raise ValueError(f"Heads {sorted(both)} are in both the enhance and the suppress set; keep each in one.")
        if not isinstance(self.dual_run, bool):
            raise ValueError(f"dual_run must be True (JuICE) or False (JuNe), got {self.dual_run!r}.")

    def _checked_strengths(self) -> tuple[float, float]:
        """``(beta_plus, beta_minus)`` checked: finite, ``beta_plus >= 0``, ``beta_minus <= 0``.
        Checked where they are used too, as they may be set after construction."""
        return (
            check_finite(self.beta_plus, "beta_plus", "non-negative"),
            check_finite(self.beta_minus, "beta_minus", "non-positive"),
        )

    @property
    def steers(self) -> bool:
        """Whether this object changes the model at all: some head with a non-zero strength."""
        return bool(self.enhance and self.beta_plus != 0) or bool(self.suppress and self.beta_minus != 0)

    def __repr__(self) -> str:
        method = "JuICE (run twice)" if self.dual_run else "JuNe (run once)"
        state = "" if self.steers else " -- NOT STEERING (no head has a non-zero strength)"
        state = (f", prompts with prompt-token mass >= {self.context_gate:g}" if self.context_gate else "") + state
        return (
            f"{method} toward {self.direction} on {self.model.cfg.model_name}: "
            f"enhance {self.enhance} x {self.beta_plus:+g}, suppress {self.suppress} x {self.beta_minus:+g}{state}"
        )

    # -- steering --------------------------------------------------------------------------------

    def coefficients(
        self,
        beta_plus: float | Tensor | None = None,
        beta_minus: float | Tensor | None = None,
        k: Tensor | None = None,
    ) -> dict[Head, float | Tensor]:
        """Each steered head's strength (``beta_plus`` for enhance heads, ``beta_minus`` for
        suppress heads; the fitted ones unless given, a tensor ``[batch]`` for one per row).
        ``k`` (``[batch]``): each row steers only the first ``k`` heads of each set. Heads whose
        strength is zero everywhere are left out."""
        fitted_plus, fitted_minus = self._checked_strengths()
        plus = fitted_plus if beta_plus is None else beta_plus
        minus = fitted_minus if beta_minus is None else beta_minus
        coef = {}
        for heads, strength in ((self.enhance, plus), (self.suppress, minus)):
            for rank, head in enumerate(heads):
                coef[tuple(head)] = strength if k is None else strength * (k > rank)
        return {h: c for h, c in coef.items() if bool(torch.as_tensor(c).any())}

    def logits(
        self, prompts: str | Sequence[str], batch_size: int = 32, progress: bool = False
    ) -> Float[Tensor, "n d_vocab"]:
        """Last-position logits of each prompt under steering."""
        steering = gated_steering(self, as_prompts(prompts)[0], batch_size=batch_size)
        return final_logits(self.model, prompts, batch_size=batch_size, progress=progress, steering=steering)

    def run_with_cache(self, prompt: str, **kwargs):
        """``model.run_with_cache`` under steering (one prompt, gated as in :meth:`logits`)."""
        tokens, steering = self.model.to_tokens(prompt), gated_steering(self, [prompt])
        with steering.hooks(self.model, tokens, None, steering.begin(self.model, [0], cached=False)):
            return run_with_cache(self.model, tokens, **kwargs)

    def generate(
        self, prompts: str | Sequence[str], max_new_tokens: int = 8, batch_size: int = 16, progress: bool = False
    ) -> list[str] | str:
        """Greedy continuations under steering (both passes of the dual run at every step); one
        string for one prompt string."""
        steering = gated_steering(self, as_prompts(prompts)[0], batch_size=batch_size)
        options = {"max_new_tokens": max_new_tokens, "batch_size": batch_size, "progress": progress}
        return greedy_continuations(self.model, prompts, steering=steering, **options)

    def logits_for(self, dataset: ConflictDataset, conflict_type: str) -> Float[Tensor, "n d_vocab"]:
        """:meth:`logits` on one conflict type of a dataset (the interface of the baselines)."""
        return self.logits(dataset.prompts(conflict_type))

    def generate_for(self, dataset: ConflictDataset, conflict_type: str, max_new_tokens: int = 8) -> list[str]:
        """:meth:`generate` on one conflict type of a dataset (the interface of the baselines)."""
        return self.generate(dataset.prompts(conflict_type), max_new_tokens)

    def generate_many(
        self,
        requests: Sequence[tuple[ConflictDataset, str]],
        max_new_tokens: int = 8,
        batch_size: int = 32,
        stop_when: Callable[[int, str], bool] | None = None,
    ) -> list[list[str]]:
        """:meth:`generate_for` of every ``(dataset, conflict_type)`` request, decoded in shared
        batches; ``stop_when(k, text)`` ends prompt ``k``'s continuation (as in :func:`cpsuper.evaluate`)."""
        groups = [dataset.prompts(conflict_type) for dataset, conflict_type in requests]
        steering = gated_steering(self, [p for group in groups for p in group], batch_size=batch_size)
        return greedy_groups(self.model, groups, max_new_tokens, batch_size, steering=steering, stop_when=stop_when)

    # -- fitting ---------------------------------------------------------------------------------

    def accuracy(
        self,
        dataset: ConflictDataset,
        conflict_types: Sequence[str] | None = None,
        max_new_tokens: int = 8,
        n_words: int = 5,
        batch_size: int = 32,
        *,
        full_continuations: bool = False,
    ) -> pd.DataFrame:
        """Greedy accuracy toward ``direction`` per example and conflict type under the current
        steering (``correct``), first-token accuracy (``first_token``: the top next token is the
        target's first token) and that token's probability (``p_target``), in shared batches.
        Clean prompts are scored against the memorised answer (``expected_answers``). Decoding
        stops once ``correct`` is settled (as in :func:`cpsuper.evaluate`) unless ``full_continuations``."""
        types = resolve_conflict_types(dataset, conflict_types)
        prompts = [p for c in types for p in dataset.prompts(c)]
        token_lists = tokenize_prompts(self.model, prompts)
        reads = [ex.expected_answers(self.direction, c) for c in types for ex in dataset]
        settled = None if full_continuations else stop_once_settled(reads, n_words)
        options = {"max_new_tokens": max_new_tokens, "batch_size": batch_size, "stop_when": settled}
        steering = gated_steering(self, prompts, batch_size=batch_size)
        texts, logits = decode_all(self.model, token_lists, steering=steering, progress=False, **options)
        n = len(dataset)
        return pd.concat(
            [
                self.score_continuations(dataset, c, texts[t * n : (t + 1) * n], logits[t * n : (t + 1) * n], n_words)
                for t, c in enumerate(types)
            ],
            ignore_index=True,
        )

    def score_continuations(
        self,
        dataset: ConflictDataset,
        conflict_type: str,
        texts: Sequence[str],
        logits: Float[Tensor, "n d_vocab"],
        n_words: int = 5,
    ) -> pd.DataFrame:
        """:meth:`accuracy`'s rows from given continuations and last-position logits of
        ``dataset``'s ``conflict_type`` prompts (one per example, in order)."""
        prompts = dataset.prompts(conflict_type)
        probs = logits.float().softmax(-1)
        rows = []
        for i, (example, text) in enumerate(zip(dataset, texts)):
            answers = example.expected_answers(self.direction, conflict_type)
            target = answer_token(self.model, answers[0], prompts[i])
            rows.append(
                {
                    "example": i,
                    "subject": example.subject,
                    "conflict_type": conflict_type,
                    "continuation": text,
                    "correct": float(mentions_answer(text, answers, n_words)),
                    "first_token": float(probs[i].argmax().item() == target),
                    "p_target": probs[i, target].item(),
                }
            )
        return pd.DataFrame(rows)

    def fit(
        self,
        selection: ConflictDataset,
        validation: ConflictDataset,
        progress: bool = True,
        batch_size: int = 64,
        heads: IdentifiedHeads | None = None,
        *,
        recipe: str = DEFAULT_RECIPE,
        clean_margin: float = DEFAULT_CLEAN_MARGIN,
    ) -> JuICE:
        """Identify heads on ``selection`` and choose ``beta_plus`` / ``beta_minus`` on
        ``validation`` (the table is kept in ``tuning``) by a recipe (:data:`cpsuper.tuning.FIT_RECIPES`):
        ``"robust-gated"`` (default: heads chosen on the conflict prompts; the steering acts only
        on prompts its context gate opens for, :mod:`cpsuper.context_gate`; the pair with the most
        conflict accuracy among those costing at most ``floor(clean_margin * n)`` of the ``n`` clean
        validation facts), ``"robust-conflict"`` (the same without the gate), ``"robust"`` (heads
        chosen on every prompt type), ``"robust-mild"`` or ``"paper"`` (docs/juice.md).

        A fit that ends without steering warns (:class:`SteeringWarning`, with the reason);
        :attr:`steers` tells afterwards. The object changes only when the fit completes.
        ``heads``: reuse an earlier :func:`identify_heads` result on ``selection`` (its top
        ``self.k`` per sign)."""
        options = {"progress": progress, "batch_size": batch_size, "heads": heads, "recipe": recipe}
        fitted, reason = fit_steering(self, selection, validation, clean_margin=clean_margin, **options)
        # every field at once, so that an interrupted fit never leaves new heads with old strengths
        fields = ("identified", "enhance", "suppress", "tuning", "fitted_on", "beta_plus", "beta_minus", "context_gate")
        for name in fields:
            setattr(self, name, getattr(fitted, name))
        if reason is not None:
            warnings.warn(
                f"JuICE.fit ended without steering: {reason}. The model is left as it is. Try more validation "
                "facts, a larger clean_margin, more or other selection facts, or recipe='paper'; "
                "steer.tuning has every pair's validation accuracy.",
                SteeringWarning,
                stacklevel=2,
            )
        shut = gate_shut(self.context_gate, self.fitted_on.get("gate_open", {}))
        if reason is None and shut:
            warnings.warn(shut, SteeringWarning, stacklevel=2)
        return self

    # -- persistence -----------------------------------------------------------------------------

    def identify(
        self,
        selection: ConflictDataset,
        *,
        batch_size: int = 64,
        progress: bool = True,
        conflict_types: Sequence[str] | None = None,
        metric: str = "probability",
    ) -> IdentifiedHeads:
        """Stage 1 (:func:`identify_heads`) on ``selection`` with this object's direction, grids and K;
        ``metric="answer_logprob"`` ranks heads by the whole answer (for :meth:`fit`'s ``heads``)."""
        return identify_heads(
            self.model,
            selection,
            self.direction,
            pos_grid=self.pos_grid,
            neg_grid=self.neg_grid,
            k=self.k,
            conflict_types=conflict_types,
            metric=metric,
            batch_size=batch_size,
            progress=progress,
        )

    def with_heads(self, heads: IdentifiedHeads, k: int | None = None) -> JuICE:
        """A copy steering the top ``k`` (default: this object's K) heads per sign of ``heads``
        with the same strengths; nothing is refitted."""
        chosen = heads.with_k(self.k if k is None else k)
        heads_chosen = dict(k=chosen.k, enhance=chosen.enhance, suppress=chosen.suppress, identified=chosen)
        return replace(self, **heads_chosen, fitted_on={}, tuning=None)

    def to_dict(self) -> dict:
        return {
            "model": self.model.cfg.model_name,
            "direction": self.direction,
            "k": self.k,
            "dual_run": self.dual_run,
            "enhance": [list(h) for h in self.enhance],
            "suppress": [list(h) for h in self.suppress],
            "beta_plus": self.beta_plus,
            "beta_minus": self.beta_minus,
            "pos_grid": list(self.pos_grid),
            "neg_grid": list(self.neg_grid),
            "beta_pos_grid": list(self.beta_pos_grid),
            "beta_neg_grid": list(self.beta_neg_grid),
            "context_gate": self.context_gate,
            "fitted_on": self.fitted_on,
            "steers": self.steers,
        }

    def save(self, path: str | Path) -> None:
        """Write the steering configuration (not the model) as JSON."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path, model: Model) -> JuICE:
        """Read a configuration written by :meth:`save` and attach it to ``model``; the whole file
        is checked (keys, types, finite strengths with the right signs, heads inside the model)."""
        try:
            raw = Path(path).read_bytes()
        except OSError as err:
            raise ValueError(f"Cannot read the JuICE configuration {str(path)!r}: {err}.") from err
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(
                f"{str(path)!r} is not a JuICE configuration: it is not UTF-8 text (byte {err.start} is "
                f"{raw[err.start : err.start + 1]!r}). Was it written by JuICE.save?"
            ) from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{str(path)!r} is not a JuICE configuration: invalid JSON ({err.msg} at line {err.lineno}). "
                "Was it written by JuICE.save, and completely?"
            ) from err
        except RecursionError:
            raise ValueError(
                f"{str(path)!r} is not a JuICE configuration: its JSON is nested too deeply to read "
                "(a saved configuration is a flat object of settings). Was it written by JuICE.save?"
            ) from None
        return cls.from_dict(data, model, source=repr(str(path)))

    @classmethod
    def from_dict(cls, data: dict, model: Model, source: str = "This configuration") -> JuICE:
        """The inverse of :meth:`to_dict`, attached to ``model`` (which must be the one it was fitted on)."""
        if not isinstance(data, dict):
            raise ValueError(f"{source} must be a JSON object of JuICE settings, got {type(data).__name__}.")
        allowed = set(cls.__dataclass_fields__) - {"model", "tuning", "identified"} | {"model", "steers"}
        missing = [k for k in ("model", "enhance", "suppress", "beta_plus", "beta_minus") if k not in data]
        unknown = sorted(set(data) - allowed)
        if missing or unknown:
            raise ValueError(
                f"{source} is not a valid JuICE configuration: "
                + "; ".join([f"missing keys {missing}"] * bool(missing) + [f"unknown keys {unknown}"] * bool(unknown))
                + f". Expected keys: {sorted(allowed)}."
            )
        if data["model"] != model.cfg.model_name:
            raise ValueError(f"{source} was fitted on {data['model']!r}, not on {model.cfg.model_name!r}.")
        fields = {k: v for k, v in data.items() if k not in ("model", "steers")}
        for name in ("enhance", "suppress"):
            if not isinstance(data[name], list):
                raise ValueError(f"{source}: {name!r} must be a list of [layer, head] pairs, got {data[name]!r}.")
        try:
            steer = cls(model=model, **fields)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{source} is not a valid JuICE configuration: {err}") from err
        if "steers" in data and data["steers"] is not steer.steers:
            raise ValueError(
                f"{source} says steers={data['steers']!r}, but its heads and strengths "
                f"{'do' if steer.steers else 'do not'} steer; the file was edited or is damaged."
            )
        return steer
