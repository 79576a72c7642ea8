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

import ast
import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import pandas as pd

from .examples import ConflictDataset, ConflictExample

__all__ = ["load_memotrap", "load_nqswap", "load_paraconflict", "load_sayings"]

SAYINGS_CSV = Path(__file__).parent / "sayings.csv"


def _as_list(value) -> list[str]:
    if value is None or (isinstance(value, float) and pd.isna(value)):
        return []
    if isinstance(value, str):
        value = value.strip()
        if value.startswith("["):
            value = ast.literal_eval(value)
        else:
            return [value]
    return [str(v).strip() for v in value if str(v).strip()]


def _unique(items: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(i for i in items if i))


def _require(row: Mapping, keys: Iterable[str], source: str, index: int) -> None:
    missing = [k for k in keys if k not in row or row[k] is None]
    if missing:
        raise ValueError(f"{source}: record {index} lacks fields {missing}; it has {sorted(row)}.")


def load_paraconflict(path: str | Path, relation: str | None = None) -> ConflictDataset:
    """Read a ParaConflict-style JSON file (a list of records, or a JSON-lines file).

    ``Answer`` may be a string or a list (the first is the answer, the rest aliases);
    ``Answer_ns`` adds more aliases.
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    try:
        records = json.loads(text)
    except json.JSONDecodeError:
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
    if isinstance(records, dict):
        records = records.get("data", [records])
    relation = relation or path.stem
    keys = ("Subject", "Answer", "Distracted Token", "Clean Prompt", "Substitution Conflict", "Coherent Conflict")
    examples = []
    for i, row in enumerate(records):
        _require(row, keys, str(path), i)
        answers = _unique(_as_list(row["Answer"]) + _as_list(row.get("Answer_ns")))
        if not answers:
            raise ValueError(f"{path}: record {i} ({row['Subject']!r}) has an empty Answer.")
        examples.append(
            ConflictExample(
                relation=relation,
                subject=str(row["Subject"]).strip(),
                answer=answers[0],
                aliases=answers[1:],
                context_answer=str(row["Distracted Token"]).strip(),
                prompts={
                    "clean": row["Clean Prompt"].rstrip(),
                    "substitution": row["Substitution Conflict"].rstrip(),
                    "coherent": row["Coherent Conflict"].rstrip(),
                },
            )
        )
    return ConflictDataset(examples, name=relation)


_MEMOTRAP_INSTRUCTION = re.compile(r"^(?P<instruction>.*?[:\n])\s*(?P<text>[^:\n]+)$", re.DOTALL)


def load_memotrap(path: str | Path, relation: str = "memotrap") -> ConflictDataset:
    """Read a MemoTrap CSV (instructions to end a well-known phrase with an unusual word).

    The instructed ending ``classes[answer_index]`` is the *context* answer; the other class
    (the memorised ending) is the *parametric* answer. The prompt is the ``substitution``
    conflict (the instruction states the context answer); when the prompt is an instruction
    followed by ``:`` and the phrase, the phrase alone is the ``clean`` prompt. ``relation``
    names the examples' relation and the dataset.
    """
    path = Path(path)
    frame = pd.read_csv(path)
    missing = {"prompt", "classes", "answer_index"} - set(frame.columns)
    if missing:
        raise ValueError(f"{path} lacks columns {sorted(missing)}; expected prompt, classes, answer_index.")
    examples = []
    for i, row in frame.iterrows():
        classes = _as_list(row["classes"])
        index = int(row["answer_index"])
        if len(classes) != 2 or index not in (0, 1):
            raise ValueError(
                f"{path}: row {i} has classes {classes} and answer_index {index}; "
                "expected two classes and an index of 0 or 1."
            )
        prompt = str(row["prompt"]).rstrip()
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


def load_nqswap(rows: str | Path | pd.DataFrame | Iterable[Mapping]) -> ConflictDataset:
    """Read NQ-Swap rows (a CSV / JSON / JSON-lines path, a DataFrame, or dicts).

    The original answer is the parametric answer and the substituted one the context answer.
    ``clean`` asks the question alone; ``substitution`` puts the substituted passage first.
    """
    if isinstance(rows, (str, Path)):
        path = Path(rows)
        if path.suffix == ".csv":
            rows = pd.read_csv(path)
        else:
            rows = pd.read_json(path, lines=path.suffix in (".jsonl", ".ndjson"))
    if isinstance(rows, pd.DataFrame):
        rows = rows.to_dict("records")
    examples = []
    for i, row in enumerate(rows):
        _require(row, ("question", "sub_context", "sub_answer", "org_answer"), "NQ-Swap", i)
        parametric, context = _as_list(row["org_answer"]), _as_list(row["sub_answer"])
        if not parametric or not context:
            raise ValueError(f"NQ-Swap row {i} ({row['question']!r}) has an empty org_answer or sub_answer.")
        question = str(row["question"]).strip().rstrip("?") + "?"
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
                    "substitution": f"Context: {str(row['sub_context']).strip()}\nQuestion: {question}\nAnswer:",
                },
            )
        )
    return ConflictDataset(examples, name="nq_swap")
