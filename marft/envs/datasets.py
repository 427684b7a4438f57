"""Reading dataset files shared by the math and code environments: JSON or JSONL rows, each converted by the
environment's own row reader; unusable rows are skipped, counted and reported with their line (JSONL) or entry
(JSON) number, or, with ``strict``, raise on the first one."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

logger = logging.getLogger(__name__)

Item = TypeVar("Item")


def raw_rows(path: Path) -> list[tuple[str, object]]:
    """``(location, decoded row or None if undecodable)`` for every row of a JSON or JSONL file.

    ``.jsonl`` files are read line by line; anything else must be one JSON list.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"dataset file {path} is not UTF-8 text (byte {error.start}: {error.reason}); expected JSON or JSONL") from None
    if path.suffix != ".jsonl":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}); expected a list of rows, or name it .jsonl") from None
        if not isinstance(data, list):
            raise ValueError(f"{path} holds a JSON {type(data).__name__}; expected a list of rows")
        return [(f"entry {i + 1}", row) for i, row in enumerate(data)]
    rows: list[tuple[str, object]] = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append((f"line {n}", json.loads(line)))
        except json.JSONDecodeError:
            rows.append((f"line {n}", None))
    return rows


def read_rows(
    path: Path, convert: Callable[[object, str], tuple[Item | None, str]], strict: bool, row_hint: str, empty_hint: str,
) -> tuple[list[Item], list[str]]:
    """``(items, skipped)``: every row of ``path`` through ``convert(row, location) -> (item, "")`` or ``(None, reason)``.

    ``row_hint`` ends the error of an unusable row under ``strict`` (what a row needs); ``empty_hint`` ends the
    error of a file without one usable row.

    Raises:
        ValueError: malformed file, an unusable row under ``strict``, or no usable row.
    """
    items: list[Item] = []
    skipped: list[str] = []
    for where, raw in raw_rows(path):
        item, reason = convert(raw, where) if raw is not None else (None, "invalid JSON")
        if item is None:
            if strict:
                raise ValueError(f"{path}: {where}: {reason}{row_hint}")
            skipped.append(f"{where} ({reason})")
        else:
            items.append(item)
    if skipped:
        shown = ", ".join(skipped[:10]) + (" ..." if len(skipped) > 10 else "")
        logger.warning("%s: skipped %d unusable rows: %s", path, len(skipped), shown)
    if not items:
        raise ValueError(f"dataset {path} has no usable problems ({len(skipped)} rows skipped); {empty_hint}")
    return items, skipped


def resolve_dataset_file(path: str | Path, split: str) -> Path:
    """A file path as is; for a directory, its ``<split>.jsonl`` or ``<split>.json``."""
    path = Path(path)
    if path.is_dir():
        for candidate in (path / f"{split}.jsonl", path / f"{split}.json"):
            if candidate.is_file():
                return candidate
        raise FileNotFoundError(f"dataset folder {path} has no {split}.jsonl or {split}.json; pass the file itself")
    return path
