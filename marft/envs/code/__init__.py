"""Code environments: agent teams write programs, graded by running hidden tests in a sandbox.

    >>> from marft.envs.code import run_tests
    >>> run_tests("print(sum(map(int, input().split())))", [{"input": "2 3\\n", "output": "5\\n"}]).passed
    1
"""

from marft.envs.code.env import CodeEnv
from marft.envs.code.grading import grade_many, grading_pool, run_tests, submit_tests
from marft.envs.code.report import STATUSES, TestReport
from marft.sandbox import Isolation, SandboxLimits

__all__ = ["CodeEnv", "STATUSES", "Isolation", "SandboxLimits", "TestReport", "grade_many", "grading_pool", "run_tests", "submit_tests"]
