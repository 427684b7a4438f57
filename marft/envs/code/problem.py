"""``CodeProblem``: one programming task with hidden tests, and how an agent's reply becomes a program."""

from __future__ import annotations

import re
from dataclasses import dataclass

from marft.envs.code.report import Tests

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)```", re.IGNORECASE | re.DOTALL)


def last_python_block(reply: str) -> str | None:
    """The code of the last fenced ```` ```python ```` (or ```` ```py ````) block of ``reply``, else ``None``."""
    blocks = _FENCE.findall(reply)
    return blocks[-1] if blocks else None


@dataclass(frozen=True)
class CodeProblem:
    """A programming task: what the agents see, and the hidden tests the program is graded on."""

    task_id: str
    """A stable name (``HumanEval/0``, ``generated/add_3``, the row's id or location)."""
    text: str
    """The problem statement shown to the agents (with starter code, if any)."""
    tests: Tests
    """Hidden tests in ``run_tests`` form (stdin pairs, call cases, or ``check`` code)."""
    entry_point: str | None = None
    """The function ``check(candidate)`` tests (assert-style tests only)."""
    starter_code: str = ""
    """Code the statement starts the solution with (a signature, ``class Solution``)."""
    program_prefix: str = ""
    """Code run before the agent's code (HumanEval: the prompt with its helpers and imports)."""
    solution: str | None = None
    """A known correct program, when the dataset has one (used by tests and benchmarks)."""

    @property
    def n_tests(self) -> int:
        """How many tests the report counts (assert-style test code is one)."""
        return 1 if isinstance(self.tests, str) else len(self.tests)

    def program(self, code: str) -> str:
        """The program to run for the agent's ``code``: ``program_prefix`` then ``code``."""
        return f"{self.program_prefix.rstrip()}\n\n{code}" if self.program_prefix.strip() else code
