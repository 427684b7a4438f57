"""What grading a program says: ``TestReport``, and the test specification ``Tests`` it grades against."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Union

STATUSES = ("passed", "failed", "error", "timeout", "memory", "output_limit")
"""Per-test verdicts: right answer; wrong answer; the program raised or exited early; over the
time limit; over the memory limit; over the output/file size limit."""

StdinTest = dict
"""``{"input": "2 3\\n", "output": "5\\n"}``: stdin fed to the program, expected stdout."""
CallTest = dict
"""``{"call": "f(2, 3)", "expected": "5"}``: a Python call expression and the literal it must return."""
Tests = Union[Sequence[dict], str]
"""A list of stdin tests, a list of call tests, or a string of assert-style test code defining
``check(candidate)`` (HumanEval), counted as one test."""


@dataclass(frozen=True)
class TestReport:
    """The verdict on one program."""

    __test__ = False  # not a pytest test class

    passed: int
    """How many tests it passed."""
    total: int
    """How many tests there were."""
    statuses: tuple[str, ...]
    """One of ``STATUSES`` per test, in test order."""
    stderr: str = ""
    """Feedback on the first failed test that has any: a builtin exception's class (``"ZeroDivisionError"``), with the
    program's line only for a failure before any test input (``"SyntaxError at line 3 of the program"``); never the
    program's output or hidden test data."""
    seconds: float = 0.0
    """Wall-clock time of the whole grading."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    """Grader remarks, e.g. ``"the program is not valid Python"`` or ``"restarted after test 3"``."""

    @property
    def fraction(self) -> float:
        """Share of tests passed, in ``[0, 1]`` (0 for no tests)."""
        return self.passed / self.total if self.total else 0.0

    @property
    def all_passed(self) -> bool:
        """Every test passed (and there was at least one)."""
        return self.total > 0 and self.passed == self.total

    def failed_tests(self) -> list[tuple[int, str]]:
        """``(index, status)`` of every test that did not pass."""
        return [(i, s) for i, s in enumerate(self.statuses) if s != "passed"]

    def to_dict(self) -> dict:
        """JSON-safe form (for ``info`` and logs)."""
        return {"passed": self.passed, "total": self.total, "statuses": list(self.statuses), "stderr": self.stderr,
                "seconds": round(self.seconds, 4), "notes": list(self.notes)}
