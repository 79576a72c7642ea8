"""Reading data files strictly: every problem is reported with the file, the row and the field.

Shared by the dataset loaders and :meth:`~cpsuper.Relation.from_files`. Cells are read as
written (never through pandas' NaN conversion, which turns an empty cell into the string
``'nan'``); a missing, empty or mistyped value is an error, not a silent default.
"""

from __future__ import annotations

import ast
import csv
import io
import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path

__all__ = ["DataFileError", "answer_list", "read_csv_rows", "read_json_records", "read_text", "text_field"]


class DataFileError(ValueError):
    """A data file, row or field is missing, empty or malformed. The message names all three."""

    def __init__(
        self, source: object, problem: str, *, row: int | None = None, line: int | None = None, field: str | None = None
    ):
        where = str(source)
        if row is not None:
            where += f", row {row}" + (f" (line {line})" if line is not None else "")
        if field is not None:
            where += f", field {field!r}"
        super().__init__(f"{where}: {problem}")
        self.source, self.row, self.field = str(source), row, field


def read_text(path: str | Path, *, what: str, expected: str) -> str:
    """The UTF-8 text of ``path``; clear errors for a missing, unreadable or empty file.
    ``what`` names the kind of file, ``expected`` describes its content for the empty-file error."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"The {what} file {path} does not exist.")
    if path.is_dir():
        raise IsADirectoryError(f"The {what} path {path} is a folder; give the file inside it.")
    try:
        text = path.read_text(encoding="utf-8-sig")  # tolerate the BOM some spreadsheet tools write
    except UnicodeDecodeError as err:
        raise DataFileError(path, f"not UTF-8 text ({err}); save the {what} file as UTF-8.") from err
    except OSError as err:
        raise type(err)(f"The {what} file {path} cannot be read: {err.strerror or err}.") from err
    if not text.strip():
        raise DataFileError(path, f"the file is empty; expected {expected}.")
    return text


def read_csv_rows(path: str | Path, *, what: str, required: Iterable[str]) -> list[tuple[int, int, dict]]:
    """Rows of a CSV file with a header, as ``(row number, line number, {column: text})``.

    Row numbers count data rows from 1; every ``required`` column must be in the header and every
    row must have exactly as many cells as the header."""
    path = Path(path)
    required = list(required)
    text = read_text(path, what=what, expected=f"a header row ({','.join(required)}) and one row per example")
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = [h.strip() for h in next(reader)]
        missing = [c for c in required if c not in header]
        if missing:
            raise DataFileError(path, f"the header {header} lacks the columns {missing}; expected {required}.")
        rows = []
        for cells in reader:
            if not cells or (len(cells) == 1 and not cells[0].strip()):
                continue  # a blank line (a row of empty cells is checked like any other)
            number = len(rows) + 1
            if len(cells) != len(header):
                raise DataFileError(
                    path,
                    f"{len(cells)} cells for {len(header)} columns {header}; quote cells that contain commas.",
                    row=number,
                    line=reader.line_num,
                )
            rows.append((number, reader.line_num, dict(zip(header, cells))))
    except csv.Error as err:
        raise DataFileError(path, f"malformed CSV near line {reader.line_num}: {err}") from err
    if not rows:
        raise DataFileError(path, "the file has a header but no rows.")
    return rows


def read_json_records(path: str | Path, *, what: str, expected: str) -> list[Mapping]:
    """Records (JSON objects) of a JSON file - a list, ``{"data": [...]}`` or one object - or of a
    JSON-lines file. Each record must be an object."""
    path = Path(path)
    text = read_text(path, what=what, expected=expected)
    try:
        records = json.loads(text)
    except json.JSONDecodeError as whole_err:
        records = []
        for line_no, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                problem = f"neither JSON ({whole_err}) nor JSON lines (line {line_no}: {err})"
                raise DataFileError(path, problem + f"; expected {expected}.") from None
    if isinstance(records, dict):
        records = records.get("data", [records])
    if not isinstance(records, list):
        raise DataFileError(path, f"the file holds a {type(records).__name__}; expected {expected}.")
    if not records:
        raise DataFileError(path, f"the file holds no records; expected {expected}.")
    for number, record in enumerate(records, start=1):
        if not isinstance(record, Mapping):
            raise DataFileError(path, f"a {type(record).__name__} where a JSON object was expected.", row=number)
    return records


def _is_missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def text_field(row: Mapping, key: str, *, source: object, number: int, line: int | None = None) -> str:
    """``row[key]`` as a non-empty string (surrounding whitespace removed)."""
    if key not in row or _is_missing(row[key]):
        raise DataFileError(source, "missing; every row needs it.", row=number, line=line, field=key)
    value = row[key]
    if not isinstance(value, str):
        raise DataFileError(
            source, f"expected text, got {type(value).__name__} {value!r}; quote it.", row=number, line=line, field=key
        )
    if not value.strip():
        raise DataFileError(source, "empty; every row needs a value here.", row=number, line=line, field=key)
    return value.strip()


def answer_list(
    row: Mapping, key: str, *, source: object, number: int, line: int | None = None, optional: bool = False
) -> list[str]:
    """``row[key]`` as a list of non-empty answer strings. Accepts one string, a list of strings
    or a string holding a Python/JSON list (``"['Paris', 'Paris, France']"``)."""

    def fail(problem: str):
        return DataFileError(source, problem, row=number, line=line, field=key)

    value = row.get(key)
    if _is_missing(value):
        if optional:
            return []
        raise fail("missing; every row needs at least one answer.")
    if isinstance(value, str) and value.strip().startswith("["):
        try:
            value = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError) as err:
            raise fail(f"{value!r} is not a valid list of strings ({err}).") from None
    if isinstance(value, str):
        value = [value]
    elif hasattr(value, "tolist") and not isinstance(value, (list, tuple)):
        value = value.tolist()  # numpy arrays from a DataFrame
    if not isinstance(value, (list, tuple)):
        raise fail(f"expected a string or a list of strings, got {type(value).__name__} {value!r}.")
    answers = []
    for item in value:
        if not isinstance(item, str):
            raise fail(f"expected strings, got {type(item).__name__} {item!r} in {value!r}; quote it.")
        if item.strip():
            answers.append(item.strip())
    if not answers and not optional:
        raise fail("empty; every row needs at least one answer.")
    return answers
