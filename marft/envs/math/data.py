"""Loading math problems as ``{"problem", "answer"}`` rows.

Accepted files: a JSON list of objects, or JSONL (one object per line). Each row
needs a ``problem`` and an answer, taken from the first usable of
``final_answer``, ``answer``, or the last ``\\boxed{}`` of ``solution``. Rows
without one are skipped, counted and reported with their line (JSONL) or entry
(JSON) numbers; ``strict=True`` raises on the first such row instead.

The name ``"arithmetic"`` generates the arithmetic dataset instead of reading a file.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

from marft.envs.datasets import read_rows, resolve_dataset_file
from marft.envs.math.arithmetic import generate_arithmetic
from marft.envs.math.grader import last_boxed

ARITHMETIC = "arithmetic"


@dataclass
class ProblemSet:
    """The usable rows of a dataset and what was left out."""

    rows: list[dict] = field(default_factory=list)
    """``{"problem": str, "answer": str}`` per usable row, in file order."""
    skipped: list[str] = field(default_factory=list)
    """Where each skipped row was, e.g. ``"line 7 (no answer)"``."""
    source: str = ""
    """The file (or generator name) the rows came from."""


def row_answer(row: dict) -> str | None:
    """The reference answer of a raw row, or ``None`` when it has none."""
    for key in ("final_answer", "answer"):
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        if isinstance(value, str) and value.strip():
            return value.strip()
    solution = row.get("solution")
    if isinstance(solution, str):
        boxed = last_boxed(solution)
        if boxed:
            return boxed
    return None


def _clean_row(row: object) -> tuple[dict | None, str]:
    """``({"problem", "answer"}, "")`` for a usable row, else ``(None, reason)``."""
    if not isinstance(row, dict):
        return None, "not an object"
    problem = row.get("problem")
    if not isinstance(problem, str) or not problem.strip():
        return None, "no problem"
    answer = row_answer(row)
    if answer is None:
        return None, "no answer"
    return {"problem": problem.strip(), "answer": answer}, ""


def read_problem_file(path: str | Path, strict: bool = False) -> ProblemSet:
    """Read a JSON/JSONL dataset, keeping usable rows and recording skipped ones.

    Args:
        path: the file.
        strict: raise on the first unusable row instead of skipping it.

    Returns:
        ProblemSet: the rows, the skipped locations and the source path.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: malformed file, an unusable row under ``strict``, or no usable row.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"dataset file {path} not found; pass a JSON/JSONL file with 'problem' and 'answer' fields, or '{ARITHMETIC}'"
        )
    rows, skipped = read_rows(
        path, lambda row, where: _clean_row(row), strict, "; each row needs 'problem' and 'final_answer'/'answer'/'solution'",
        "each row needs 'problem' and 'final_answer', 'answer', or a 'solution' with \\boxed{}",
    )
    return ProblemSet(rows=rows, skipped=skipped, source=str(path))


def load_problem_set(path_or_name: str | Path, split: str = "train", strict: bool = False, **arithmetic_kwargs) -> ProblemSet:
    """Like ``load_problems`` but also reports skipped rows (see ``ProblemSet``).

    Returns:
        ProblemSet: the usable rows, the skipped locations and the source.
    """
    if str(path_or_name) == ARITHMETIC:
        return ProblemSet(rows=generate_arithmetic(split, **arithmetic_kwargs), source=ARITHMETIC)
    if arithmetic_kwargs:
        raise TypeError(f"unexpected arguments for a dataset file: {sorted(arithmetic_kwargs)}")
    path = resolve_dataset_file(path_or_name, split)
    if not path.is_file():
        return read_problem_file(path, strict=strict)  # its error names the missing file
    stat = path.stat()
    loaded = _read_problem_file_once(str(path.resolve()), stat.st_mtime_ns, stat.st_size, strict)
    return ProblemSet(rows=list(loaded.rows), skipped=list(loaded.skipped), source=str(path))


@functools.lru_cache(maxsize=8)
def _read_problem_file_once(path: str, mtime_ns: int, size: int, strict: bool) -> ProblemSet:
    """A dataset file read once per process (every env of a run holds the same rows); a changed file
    (another modification time or size) is read again."""
    return read_problem_file(path, strict=strict)


def load_problems(path_or_name: str | Path, split: str = "train", strict: bool = False, **arithmetic_kwargs) -> list[dict]:
    """Problems of a dataset as ``[{"problem": str, "answer": str}, ...]``.

    Args:
        path_or_name: a JSON/JSONL file, a folder holding ``<split>.jsonl``/``<split>.json``,
            or ``"arithmetic"``.
        split: which split; used for ``"arithmetic"`` and folders (a file is its own split).
        strict: raise on the first unusable row (naming its line) instead of skipping it.
        **arithmetic_kwargs: ``max_operand``, ``operators``, ``test_fraction``, ``seed``
            for ``"arithmetic"``.

    Returns:
        list[dict]: the usable rows in file order.
    """
    return load_problem_set(path_or_name, split=split, strict=strict, **arithmetic_kwargs).rows
