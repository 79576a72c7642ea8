"""Readers for knowledge-conflict files researchers already have.

- ParaConflict-style JSON (the JuICE paper's format): a list of objects with ``Subject``,
  ``Answer`` (string or list), optional ``Answer_ns``, ``Distracted Token``, ``Clean Prompt``,
  ``Substitution Conflict``, ``Coherent Conflict``.
- MemoTrap CSV: ``prompt``, ``classes`` (a stringified list of endings), ``answer_index``.
- NQ-Swap rows: ``question``, ``sub_context``, ``sub_answer``, ``org_answer``.

Shipped with cpsuper: ``sayings.csv``, 100 well-known English sayings in the MemoTrap format, for
steering toward the context on a model of any size (:func:`load_sayings`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import pandas as pd

from .examples import ConflictDataset, ConflictExample
from .files import (
    DataFileError,
    answer_list,
    read_csv_rows,
    read_json_records,
    text_field,
)

__all__ = ["load_memotrap", "load_nqswap", "load_paraconflict", "load_sayings"]

SAYINGS_CSV = Path(__file__).parent / "sayings.csv"


def _unique(items: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(i for i in items if i))


_PARACONFLICT_KEYS = ("Subject", "Distracted Token", "Clean Prompt", "Substitution Conflict", "Coherent Conflict")


def load_paraconflict(path: str | Path, relation: str | None = None) -> ConflictDataset:
    """Read a ParaConflict-style JSON file (a list of records, or a JSON-lines file).

    ``Answer`` may be a string or a list (the first is the answer, the rest aliases);
    ``Answer_ns`` adds more aliases. A missing, empty or non-text field is an error naming the
    file, the record (counted from 1) and the field.

    A file whose records carry a ``Category`` (the paper's relation, e.g. "country capital")
    gives one relation per category, and then every record needs a non-empty one; without it,
    every example's relation is the file name. An explicit ``relation`` overrides both.
    """
    path = Path(path)
    records = read_json_records(
        path, what="ParaConflict", expected="a list of objects with Subject, Answer, Distracted Token and prompts"
    )
    by_category = relation is None and any("Category" in row for row in records)
    name = relation or path.stem
    examples = []
    for number, row in enumerate(records, start=1):
        fields = {key: text_field(row, key, source=path, number=number) for key in _PARACONFLICT_KEYS}
        category = text_field(row, "Category", source=path, number=number) if by_category else name
        answers = _unique(
            answer_list(row, "Answer", source=path, number=number)
            + answer_list(row, "Answer_ns", source=path, number=number, optional=True)
        )
        examples.append(
            ConflictExample(
                relation=category,
                subject=fields["Subject"],
                answer=answers[0],
                aliases=answers[1:],
                context_answer=fields["Distracted Token"],
                prompts={
                    "clean": row["Clean Prompt"].rstrip(),
                    "substitution": row["Substitution Conflict"].rstrip(),
                    "coherent": row["Coherent Conflict"].rstrip(),
                },
            )
        )
    return ConflictDataset(examples, name=name)


_MEMOTRAP_INSTRUCTION = re.compile(r"^(?P<instruction>.*?[:\n])\s*(?P<text>[^:\n]+)$", re.DOTALL)


def load_memotrap(path: str | Path, relation: str = "memotrap") -> ConflictDataset:
    """Read a MemoTrap CSV (instructions to end a well-known phrase with an unusual word).

    The instructed ending ``classes[answer_index]`` is the *context* answer; the other class
    (the memorised ending) is the *parametric* answer. The prompt is the ``substitution``
    conflict (the instruction states the context answer); when the prompt is an instruction
    followed by ``:`` and the phrase, the phrase alone is the ``clean`` prompt. ``relation``
    names the examples' relation and the dataset. Empty cells, a ``classes`` cell that is not
    a list of two endings and an ``answer_index`` other than 0 or 1 are errors naming the row.
    """
    path = Path(path)
    examples = []
    for number, line, row in read_csv_rows(path, what="MemoTrap", required=("prompt", "classes", "answer_index")):
        where = {"source": path, "number": number, "line": line}
        text_field(row, "prompt", **where)  # non-empty; kept as written but for trailing space
        prompt = row["prompt"].rstrip()
        classes = answer_list(row, "classes", **where)
        if len(classes) != 2:
            raise DataFileError(
                path, f"{classes} has {len(classes)} endings; expected two.", row=number, line=line, field="classes"
            )
        raw_index = text_field(row, "answer_index", **where)
        try:
            index = int(raw_index)
        except ValueError:
            raise DataFileError(
                path, f"{raw_index!r} is not an integer; expected 0 or 1.", row=number, line=line, field="answer_index"
            ) from None
        if index not in (0, 1):
            raise DataFileError(
                path,
                f"{index} is out of range for the two classes {classes}; expected 0 or 1.",
                row=number,
                line=line,
                field="answer_index",
            )
        prompts = {"substitution": prompt}
        match = _MEMOTRAP_INSTRUCTION.match(prompt)
        if match:
            prompts = {"clean": match["text"].strip(), "substitution": prompt}
        examples.append(
            ConflictExample(
                relation=relation,
                subject=prompts.get("clean", prompt),
                answer=classes[1 - index],
                context_answer=classes[index],
                prompts=prompts,
            )
        )
    return ConflictDataset(examples, name=relation)


def load_sayings() -> ConflictDataset:
    """100 well-known sayings, each with an instruction to end it with another word: ``End the
    saying with the word "early": Better late than``. The instructed word is the context answer,
    the usual ending the parametric one; ``clean`` is the saying alone. For the context direction
    (the paper evaluates it on MemoTrap); keep the sayings a model knows with
    :func:`~cpsuper.filter_known`."""
    return load_memotrap(SAYINGS_CSV, relation="sayings")


_NQSWAP_KEYS = ("question", "sub_context", "sub_answer", "org_answer")


def _nqswap_rows(rows) -> tuple[object, list[tuple[int, int | None, Mapping]]]:
    """``(source name, [(row number, line number or None, row)])`` from any accepted input."""
    if isinstance(rows, (str, Path)):
        path = Path(rows)
        if path.suffix == ".csv":
            return path, read_csv_rows(path, what="NQ-Swap", required=_NQSWAP_KEYS)
        if path.suffix not in (".json", ".jsonl", ".ndjson"):
            raise ValueError(f"NQ-Swap file {path} has suffix {path.suffix!r}; use .csv, .json, .jsonl or .ndjson.")
        records = read_json_records(path, what="NQ-Swap", expected="objects with " + ", ".join(_NQSWAP_KEYS))
        return path, [(n, None, r) for n, r in enumerate(records, start=1)]
    if isinstance(rows, pd.DataFrame):
        rows = rows.to_dict("records")
    if isinstance(rows, Mapping) or not isinstance(rows, Iterable):
        raise TypeError(
            f"load_nqswap takes a file path, a DataFrame or an iterable of dicts, got {type(rows).__name__}."
        )
    out = []
    for number, row in enumerate(rows, start=1):
        if not isinstance(row, Mapping):
            raise DataFileError("NQ-Swap rows", f"a {type(row).__name__} where a dict was expected.", row=number)
        out.append((number, None, row))
    if not out:
        raise DataFileError("NQ-Swap rows", "no rows given.")
    return "NQ-Swap rows", out


def load_nqswap(rows: str | Path | pd.DataFrame | Iterable[Mapping]) -> ConflictDataset:
    """Read NQ-Swap rows (a CSV / JSON / JSON-lines path, a DataFrame, or dicts).

    The original answer is the parametric answer and the substituted one the context answer.
    ``clean`` asks the question alone; ``substitution`` puts the substituted passage first.
    ``question`` and ``sub_context`` must be non-empty text; ``sub_answer`` and ``org_answer`` a
    string or a list of strings. Anything else is an error naming the source, row and field.
    """
    source, numbered = _nqswap_rows(rows)
    examples = []
    for number, line, row in numbered:
        where = {"source": source, "number": number, "line": line}
        missing = [k for k in _NQSWAP_KEYS if k not in row]
        if missing:
            raise DataFileError(
                source, f"lacks the fields {missing}; it has {sorted(map(str, row))}.", row=number, line=line
            )
        question = text_field(row, "question", **where).rstrip("?") + "?"
        passage = text_field(row, "sub_context", **where)
        parametric = answer_list(row, "org_answer", **where)
        context = answer_list(row, "sub_answer", **where)
        examples.append(
            ConflictExample(
                relation="nq_swap",
                subject=question,
                answer=parametric[0],
                aliases=tuple(parametric[1:]),
                context_answer=context[0],
                context_aliases=tuple(context[1:]),
                prompts={
                    "clean": f"Question: {question}\nAnswer:",
                    "substitution": f"Context: {passage}\nQuestion: {question}\nAnswer:",
                },
            )
        )
    return ConflictDataset(examples, name="nq_swap")
