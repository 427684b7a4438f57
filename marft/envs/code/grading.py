"""``run_tests``: grade one program against its tests in the sandbox; ``grade_many``: a batch in parallel.

All of a program's tests run in **one** sandboxed candidate process, one after another (a stdin
program is re-run from scratch for every test, in a fresh namespace with fresh fds 0/1/2):
starting Python costs ~20 ms against well under a millisecond per test in a running one. When a
test kills the candidate (``os._exit``, a signal, its time limit) the remaining tests go on in a
fresh one.

Verdicts belong to the trusted **driver** (``marft.sandbox.harness``), a process the program cannot reach:
it holds the expected outputs and HumanEval's test code, sends the candidate one request at a
time, bounds each answer's size before decoding it, compares it (integers exactly) and reports
one verdict per test. Here each verdict is accepted once, in order and type-checked; a malformed
event fails every test of the program. Feedback (``TestReport.stderr``) is only the class of a builtin exception,
with the program's line only for a failure before any test input: never hidden inputs, expected outputs or the
program's own text.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

from marft.envs.code.compare import parse_literal
from marft.envs.code.report import TestReport, Tests
from marft.sandbox import HarnessRun, SandboxLimits

DEFAULT_LIMITS = SandboxLimits()


def _job(program: str, tests: Tests, entry_point: str | None, prompt: str | None) -> tuple[dict, dict]:
    """``(what the candidate gets, what only the trusted driver reads)`` for one program."""
    if isinstance(tests, str):
        if not entry_point:
            raise ValueError("assert-style test code needs entry_point (the function check(candidate) is given)")
        return {"kind": "check", "program": program, "entry_point": entry_point}, {"cases": [None], "code": tests, "prompt": prompt or ""}
    tests = list(tests)
    if not tests:
        raise ValueError("no tests to run")
    if all(isinstance(t, dict) and "input" in t and "output" in t for t in tests):
        cases = [{"input": str(t["input"]), "output": str(t["output"])} for t in tests]
        return {"kind": "stdin", "program": program, "entry_point": None}, {"cases": cases}
    if all(isinstance(t, dict) and "call" in t and "expected" in t for t in tests):
        cases = [{"call": str(t["call"]), "expected": _expected_value(str(t["expected"])), "size": len(str(t["expected"]))} for t in tests]
        return {"kind": "call", "program": program, "entry_point": None}, {"cases": cases}
    raise ValueError("tests must all be {'input', 'output'} pairs, all {'call', 'expected'} cases, or a string of test code")


def _expected_value(text: str):
    """The expected literal as a value for the driver; an integer too long for ``ast`` stays text (``("__raw__", digits)``)."""
    try:
        return parse_literal(text)
    except ValueError:
        stripped = text.strip()
        if stripped.lstrip("-").isdigit():
            return ("__raw__", stripped)
        raise ValueError(f"expected value is not a plain literal: {text[:80]!r}") from None


def run_tests(
    program: str,
    tests: Tests,
    *,
    entry_point: str | None = None,
    timeout_s: float | None = None,
    memory_mb: int | None = None,
    limits: SandboxLimits | None = None,
    prompt: str | None = None,
) -> TestReport:
    """Run ``program`` against ``tests`` in the sandbox and judge every test.

    Args:
        program: Python source.
        tests: ``[{"input", "output"}, ...]`` (stdin/stdout), ``[{"call", "expected"}, ...]``
            (call expressions and Python literals), or assert-style test code defining
            ``check(candidate)`` (one test; needs ``entry_point``).
        entry_point: the function ``check`` is called with.
        timeout_s: wall-clock seconds per test (overrides ``limits``).
        memory_mb: address-space limit in MiB (overrides ``limits``).
        limits: every other limit; default ``SandboxLimits()``.
        prompt: trusted code whose definitions assert-style test code may use (HumanEval's prompt,
            e.g. ``poly`` for ``find_zero``); it runs in the driver, apart from the program.

    Returns:
        TestReport: tests passed, total, one status per test, the first failure's feedback.
    """
    limits = limits or DEFAULT_LIMITS
    if timeout_s is not None or memory_mb is not None:
        limits = replace(limits, timeout_s=timeout_s or limits.timeout_s, memory_mb=memory_mb or limits.memory_mb)
    job, secret = _job(program, tests, entry_point, prompt)
    started = time.monotonic()
    result = HarnessRun(job, secret, limits, deadline=started + limits.max_total_s).run()
    n = len(secret["cases"])
    statuses = tuple(result.statuses.get(i, result.end_status) for i in range(n))
    errors = [result.errors.get(i, result.error) for i in range(n)]
    notes = [] if result.end == "finished" else [f"{result.end}: {result.end_status} from test {len(result.statuses)} on"]
    failures = [i for i, s in enumerate(statuses) if s != "passed"]
    first_failure = next((i for i in failures if errors[i]), failures[0] if failures else None)
    return TestReport(
        passed=sum(s == "passed" for s in statuses),
        total=n,
        statuses=statuses,
        stderr="" if first_failure is None else errors[first_failure],
        seconds=time.monotonic() - started,
        notes=tuple(notes),
    )


# ---------------------------------------------------------------- parallel grading

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def grading_pool() -> ThreadPoolExecutor:
    """The process-wide pool of grading threads, one per core (each waits on a sandbox process)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="marft-grader")
            atexit.register(_pool.shutdown, wait=False, cancel_futures=True)
        return _pool


def submit_tests(program: str, tests: Tests, **kwargs) -> Future:
    """``run_tests`` on the grading pool; the future's result is the ``TestReport``."""
    return grading_pool().submit(run_tests, program, tests, **kwargs)


def grade_many(jobs: Sequence[dict]) -> list[TestReport]:
    """Grade many programs in parallel (one sandbox per core at a time).

    Args:
        jobs: ``{"program", "tests", **run_tests keyword arguments}`` per program.

    Returns:
        list[TestReport]: one report per job, in order.
    """
    futures = [submit_tests(job["program"], job["tests"], **{k: v for k, v in job.items() if k not in ("program", "tests")}) for job in jobs]
    return [future.result() for future in futures]
