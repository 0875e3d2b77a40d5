"""Prompts from files, streamed (a dataset larger than memory is read as it is used):
JSONL (a string per line, or an object's field), plain text (one prompt per line), a
Parquet or CSV column."""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import InvalidArgument
from .extras import require

# The column / JSON field tried when none is named, in order.
DEFAULT_COLUMNS = ("prompt", "text")
SUFFIXES = (".jsonl", ".ndjson", ".txt", ".parquet", ".csv")


def read_prompts(path: str | os.PathLike[str], column: str | None = None) -> Iterator[str]:
    """Yield the prompts of `path`, chosen by its suffix. `column`: the JSONL field, Parquet
    or CSV column (default: "prompt", else "text"); a text file has none."""
    file = Path(path)
    if not file.exists():
        raise InvalidArgument(f"prompts file {str(file)!r} does not exist", field="prompts")
    suffix = file.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return _jsonl(file, column)
    if suffix == ".txt":
        if column is not None:
            raise InvalidArgument("a .txt prompts file has no columns: one prompt per line", field="column")
        return _text(file)
    if suffix == ".parquet":
        return _parquet(file, column)
    if suffix == ".csv":
        return _csv(file, column)
    raise InvalidArgument(
        f"prompts file {str(file)!r}: unknown kind {suffix!r}; use one of {', '.join(SUFFIXES)}", field="prompts"
    )


def _pick(available: list[str], column: str | None, file: Path) -> str:
    if column is not None:
        if column not in available:
            raise InvalidArgument(f"{file.name} has no column {column!r} (it has {available})", field="column")
        return column
    for name in DEFAULT_COLUMNS:
        if name in available:
            return name
    raise InvalidArgument(
        f"{file.name}: name the prompt column (column=...); none of {list(DEFAULT_COLUMNS)} in {available}",
        field="column",
    )


def _jsonl(file: Path, column: str | None) -> Iterator[str]:
    with file.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record: Any = json.loads(line)
            except json.JSONDecodeError as e:
                raise InvalidArgument(f"{file.name} line {number}: not JSON ({e.msg})", field="prompts") from e
            if isinstance(record, str) and column is None:
                yield record
                continue
            if not isinstance(record, dict):
                raise InvalidArgument(f"{file.name} line {number}: expected a string or an object", field="prompts")
            yield _text_of(record[_pick(list(record), column, file)], f"{file.name} line {number}")


def _text(file: Path) -> Iterator[str]:
    with file.open(encoding="utf-8") as f:
        for line in f:
            prompt = line.rstrip("\r\n")
            if prompt.strip():
                yield prompt


def _csv(file: Path, column: str | None) -> Iterator[str]:
    with file.open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        name = _pick(list(reader.fieldnames or []), column, file)
        for number, row in enumerate(reader, 2):
            yield _text_of(row[name], f"{file.name} row {number}")


def _parquet(file: Path, column: str | None) -> Iterator[str]:
    pq = require("pyarrow.parquet", "collect")
    source = pq.ParquetFile(file)
    name = _pick(list(source.schema_arrow.names), column, file)
    for batch in source.iter_batches(columns=[name], batch_size=1024):
        for value in batch.column(0).to_pylist():
            yield _text_of(value, f"{file.name} column {name!r}")


def _text_of(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(f"{where}: a prompt must be a string, got {type(value).__name__}", field="prompts")
    return value
