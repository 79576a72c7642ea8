"""Conflict examples and datasets: one fact, its true (parametric) answer, a distractor (context)
answer, and one prompt per conflict type."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import overload

import pandas as pd

__all__ = ["CONFLICT_TYPES", "TARGETS", "ConflictDataset", "ConflictExample"]

CONFLICT_TYPES: tuple[str, ...] = ("clean", "substitution", "coherent")
"""No conflict; a sentence stating the context answer; a persuasive paragraph stating it."""

TARGETS: tuple[str, ...] = ("parametric", "context")
"""The answer a measurement is about: the model's memory or the context's claim."""


@dataclass(frozen=True)
class ConflictExample:
    """One fact under knowledge conflict.

    ``answer`` is the parametric (true) answer and ``context_answer`` the distractor the context
    asserts. Answers are stored without a leading space; the answer token scored is the first
    token of the answer as it continues the prompt (``" " + answer`` after a prompt that ends
    without whitespace).
    """

    relation: str
    subject: str
    answer: str
    context_answer: str
    prompts: Mapping[str, str]
    aliases: tuple[str, ...] = ()
    context_aliases: tuple[str, ...] = ()
    meta: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self):
        if not self.prompts:
            raise ValueError(f"Example {self.subject!r} has no prompts; give at least one conflict type.")
        for name, value in (("answer", self.answer), ("context_answer", self.context_answer)):
            if not str(value).strip():
                raise ValueError(f"Example {self.subject!r} has an empty {name}.")

    @property
    def answers(self) -> tuple[str, ...]:
        """The parametric answer and its aliases (all count as correct)."""
        return (self.answer, *self.aliases)

    @property
    def context_answers(self) -> tuple[str, ...]:
        """The context answer and its aliases."""
        return (self.context_answer, *self.context_aliases)

    def target_answer(self, target: str) -> str:
        """The answer string for ``target`` ("parametric" or "context")."""
        if target == "parametric":
            return self.answer
        if target == "context":
            return self.context_answer
        raise ValueError(f"Unknown target {target!r}; use one of {TARGETS}.")

    def expected_answers(self, direction: str, conflict_type: str) -> tuple[str, ...]:
        """What counts as correct when steering toward ``direction`` on the ``conflict_type``
        prompt: a clean prompt has no context to follow, so the memorised answer is expected
        there in both directions (steering toward the context should not break plain recall);
        on a conflict prompt, the ``direction``'s answer and its aliases."""
        if direction not in TARGETS:
            raise ValueError(f"Unknown direction {direction!r}; use one of {TARGETS}.")
        return self.answers if direction == "parametric" or conflict_type == "clean" else self.context_answers


class ConflictDataset(Sequence[ConflictExample]):
    """An ordered, non-empty collection of :class:`ConflictExample` (indexable, sliceable)."""

    def __init__(self, examples: Iterable[ConflictExample], name: str = "dataset"):
        self.examples: list[ConflictExample] = list(examples)
        self.name = name
        if not self.examples:
            raise ValueError(
                f"Dataset {name!r} is empty. Check the filter that produced it (e.g. filter_known "
                "keeps only facts the model answers correctly) or pass more examples."
            )

    @overload
    def __getitem__(self, index: int) -> ConflictExample: ...
    @overload
    def __getitem__(self, index: slice | Sequence[int]) -> ConflictDataset: ...

    def __getitem__(self, index):
        if isinstance(index, slice):
            return ConflictDataset(self.examples[index], self.name)
        if isinstance(index, Sequence) and not isinstance(index, str):
            return ConflictDataset([self.examples[i] for i in index], self.name)
        return self.examples[index]

    def __len__(self) -> int:
        return len(self.examples)

    def __iter__(self) -> Iterator[ConflictExample]:
        return iter(self.examples)

    def __add__(self, other: ConflictDataset) -> ConflictDataset:
        return ConflictDataset(self.examples + list(other), f"{self.name}+{other.name}")

    def __repr__(self) -> str:
        return f"ConflictDataset({self.name!r}, {len(self)} examples, conflict types {self.conflict_types})"

    @property
    def conflict_types(self) -> tuple[str, ...]:
        """Conflict types that every example has a prompt for, in canonical order."""
        common = set.intersection(*(set(e.prompts) for e in self.examples))
        ordered = [c for c in CONFLICT_TYPES if c in common]
        return tuple(ordered + sorted(common - set(CONFLICT_TYPES)))

    @property
    def relations(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(e.relation for e in self.examples))

    def filter(self, keep) -> ConflictDataset:
        """The examples for which ``keep(example)`` is true (raises if none are left)."""
        return ConflictDataset([e for e in self.examples if keep(e)], self.name)

    def with_prompts(self, conflict_types: Sequence[str]) -> ConflictDataset:
        """The same examples restricted to the given conflict types."""
        missing = [c for c in conflict_types if c not in self.conflict_types]
        if missing:
            raise ValueError(
                f"Conflict types {missing} are not available in {self.name!r}; it has {self.conflict_types}."
            )
        return ConflictDataset(
            [replace(e, prompts={c: e.prompts[c] for c in conflict_types}) for e in self.examples], self.name
        )

    def prompts(self, conflict_type: str) -> list[str]:
        """All prompts of one conflict type, in example order."""
        if conflict_type not in self.conflict_types:
            raise ValueError(
                f"Conflict type {conflict_type!r} is not available in {self.name!r}; use one of {self.conflict_types}."
            )
        return [e.prompts[conflict_type] for e in self.examples]

    def to_frame(self) -> pd.DataFrame:
        """One row per example x conflict type, with the prompt and both answers."""
        rows = [
            {
                "example": i,
                "relation": e.relation,
                "subject": e.subject,
                "conflict_type": c,
                "prompt": p,
                "answer": e.answer,
                "context_answer": e.context_answer,
            }
            for i, e in enumerate(self.examples)
            for c, p in e.prompts.items()
        ]
        return pd.DataFrame(rows)
