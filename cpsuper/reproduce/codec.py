"""Step results as data files: a JSON tree with every DataFrame in its own Parquet file.

Nothing is pickled, so a cache entry can be read by any tool and never executes code when
loaded. The tree holds JSON scalars, lists and string-keyed dicts, with tagged nodes for what
JSON lacks: ``{"$tuple": [...]}``, ``{"$frame": "frame-0.parquet"}``, ``{"$dataset": ...}`` for a
:class:`cpsuper.ConflictDataset` and ``{"$object": "SweepResult", "fields": {...}}`` for a
dataclass that cpsuper exports by that name (its fields are encoded the same way). A JuICE is
stored as its ``to_dict()`` and rebuilt with ``JuICE.from_dict``; anything else is refused with
a ``TypeError`` when the entry is written, never silently converted.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..additivity import Additivity
from ..attention import AttentionResult
from ..attribution import Attribution
from ..data import ConflictDataset, ConflictExample
from ..identification import IdentifiedHeads
from ..juice import JuICE
from ..roles import Flips
from ..sweeps import SweepResult
from ..truncation import TruncationResult
from ..variance import SelectionVariance

__all__ = ["decode", "encode", "is_plain_file_name"]

_PLAIN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


def is_plain_file_name(name: Any) -> bool:
    """Whether ``name`` names a file inside an entry's folder: letters, digits, ``.``, ``_``, ``-``,
    not starting with a dot. No separator, ``..``, absolute path or drive can pass."""
    return isinstance(name, str) and _PLAIN.fullmatch(name) is not None


def encode(value: Any, directory: Path) -> Any:
    """The JSON tree of ``value``; its DataFrames are written as Parquet files into ``directory``."""
    frames: list[str] = []
    return _encode(value, directory, frames, "value")


def decode(tree: Any, directory: Path) -> Any:
    """Rebuild the value that :func:`encode` wrote into ``directory``."""
    if isinstance(tree, list):
        return [decode(v, directory) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if "$tuple" in tree:
        return tuple(decode(v, directory) for v in tree["$tuple"])
    if "$dict" in tree:
        return {k: decode(v, directory) for k, v in tree["$dict"].items()}
    if "$frame" in tree:
        name = tree["$frame"]
        if not is_plain_file_name(name):
            raise ValueError(f"A cache entry names the frame file {name!r}, which is not a plain file name.")
        return _read_frame(directory / name, tree.get("json_columns", []))
    if "$dataset" in tree:
        data = tree["$dataset"]
        examples = [ConflictExample(**decode(e, directory)) for e in data["examples"]]
        return ConflictDataset(examples, name=data["name"])
    if "$object" in tree:
        cls = _exported_dataclass(tree["$object"])
        return cls(**{k: decode(v, directory) for k, v in tree["fields"].items()})
    raise ValueError(f"Unknown node in a cache entry: {sorted(tree)}")


def _encode(value: Any, directory: Path, frames: list[str], where: str) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float, np.integer, np.floating, np.bool_)):
        return value.item() if isinstance(value, np.generic) else value
    if isinstance(value, tuple):
        return {"$tuple": [_encode(v, directory, frames, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, directory, frames, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):  # read-only mappings (an example's prompts) come back as dicts
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise TypeError(f"Cannot cache {where}: dict keys must be strings, found {bad[:3]}.")
        return {"$dict": {k: _encode(v, directory, frames, f"{where}[{k!r}]") for k, v in value.items()}}
    if isinstance(value, pd.DataFrame):
        return _write_frame(value, directory, frames, where)
    if isinstance(value, ConflictDataset):
        examples = [_fields(e, directory, frames, f"{where}[{i}]") for i, e in enumerate(value)]
        return {"$dataset": {"name": value.name, "examples": examples}}
    if isinstance(value, JuICE):
        raise TypeError(f"Cannot cache {where}: store a JuICE as .to_dict() and rebuild it with JuICE.from_dict.")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        name = type(value).__name__
        _exported_dataclass(name, expected=type(value), where=where)
        return {"$object": name, "fields": _fields(value, directory, frames, where)["$dict"]}
    raise TypeError(
        f"Cannot cache {where} of type {type(value).__name__}: a step must return JSON values, tuples, "
        "DataFrames, ConflictDatasets or cpsuper result objects."
    )


def _fields(obj: Any, directory: Path, frames: list[str], where: str) -> dict:
    values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}
    return _encode(values, directory, frames, where)


CACHEABLE: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        Additivity,
        AttentionResult,
        Attribution,
        Flips,
        IdentifiedHeads,
        SelectionVariance,
        SweepResult,
        TruncationResult,
    )
}
"""The result classes a step may return, by name: only these are rebuilt from a cache entry."""


def _exported_dataclass(name: str, expected: type | None = None, where: str = "") -> type:
    """The registered result class called ``name`` (:data:`CACHEABLE`)."""
    cls = CACHEABLE.get(name)
    if cls is None or (expected is not None and cls is not expected):
        if expected is not None:
            raise TypeError(
                f"Cannot cache {where}: {expected.__qualname__} is not a result class the step cache knows."
            )
        raise ValueError(f"The cache entry holds a {name!r}, which the step cache does not know.")
    return cls


def _write_frame(frame: pd.DataFrame, directory: Path, frames: list[str], where: str) -> dict:
    if not all(isinstance(c, str) for c in frame.columns):
        raise TypeError(f"Cannot cache {where}: DataFrame column names must be strings ({list(frame.columns)[:5]}).")
    frame = frame.copy()
    json_columns = []
    for column in frame.columns:  # lists / tuples in a cell: Parquet would return arrays, so store JSON text
        if frame[column].dtype == object and any(isinstance(x, (list, tuple, dict)) for x in frame[column]):
            frame[column] = [json.dumps(_encode(x, directory, frames, f"{where}.{column}")) for x in frame[column]]
            json_columns.append(column)
    name = f"frame-{len(frames)}.parquet"
    frames.append(name)
    frame.to_parquet(directory / name)
    return {"$frame": name, "json_columns": json_columns}


def _read_frame(path: Path, json_columns: list[str]) -> pd.DataFrame:
    frame = pd.read_parquet(path)
    for column in json_columns:
        frame[column] = pd.Series(
            [decode(json.loads(x), path.parent) for x in frame[column]], index=frame.index, dtype=object
        )
    return frame
