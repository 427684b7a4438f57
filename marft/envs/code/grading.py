"""``run_tests``: grade one program against its tests in the sandbox; ``grade_many``: a batch in parallel.

All of a program's tests run in **one** harness process, one after another (a stdin program is
re-run from scratch for every test, in a fresh namespace with fresh fds 0/1/2). Starting Python
costs ~20 ms and a sandbox a few ms more, against well under a millisecond per test inside a
running harness, so with the tens of tests a DeepCoder problem has, one process per program is
an order of magnitude faster than one per test. Isolation between tests is kept where it
matters: the program's leftover processes are killed after every test, and when a test kills
the harness (``os._exit``, a signal, the wall clock) the remaining tests go on in a fresh one.

Verdicts are decided here, not in the sandbox: the harness reports each test's stdout (or the
``repr`` of a call's plain-data result) and the grader compares it with the expected output,
which the program never sees. Only assert-style test code (HumanEval's ``check``) has to run
next to the program; see ``harness.py`` for how it is shielded.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Sequence

from marft.envs.code.compare import outputs_match, result_matches
from marft.envs.code.report import TestReport, Tests
from marft.envs.code.sandbox import HarnessRun, SandboxLimits

DEFAULT_LIMITS = SandboxLimits()


def _job(program: str, tests: Tests, entry_point: str | None) -> tuple[dict, list]:
    """``(harness job without expected outputs, expected outputs)`` for one program."""
    if isinstance(tests, str):
        if not entry_point:
            raise ValueError("assert-style test code needs entry_point (the function check(candidate) is given)")
        return {"kind": "check", "program": program, "tests": [tests], "entry_point": entry_point}, [None]
    tests = list(tests)
    if not tests:
        raise ValueError("no tests to run")
    if all(isinstance(t, dict) and "input" in t and "output" in t for t in tests):
        return {"kind": "stdin", "program": program, "tests": [str(t["input"]) for t in tests]}, [str(t["output"]) for t in tests]
    if all(isinstance(t, dict) and "call" in t and "expected" in t for t in tests):
        return {"kind": "call", "program": program, "tests": [str(t["call"]) for t in tests]}, [str(t["expected"]) for t in tests]
    raise ValueError("tests must all be {'input', 'output'} pairs, all {'call', 'expected'} cases, or a string of test code")


def _verdict(kind: str, event: dict, expected) -> str:
    status = event.get("status")
    if status != "ok":
        return status if status in ("error", "timeout", "memory", "output_limit") else "error"
    if kind == "stdin":
        return "passed" if outputs_match(str(event.get("stdout", "")), expected) else "failed"
    if kind == "call":
        value = event.get("value")
        return "passed" if isinstance(value, str) and result_matches(value, expected) else "failed"
    return "passed"


def run_tests(
    program: str,
    tests: Tests,
    *,
    entry_point: str | None = None,
    timeout_s: float | None = None,
    memory_mb: int | None = None,
    limits: SandboxLimits | None = None,
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

    Returns:
        TestReport: tests passed, total, one status per test, the first failure's stderr.
    """
    limits = limits or DEFAULT_LIMITS
    if timeout_s is not None or memory_mb is not None:
        limits = replace(limits, timeout_s=timeout_s or limits.timeout_s, memory_mb=memory_mb or limits.memory_mb)
    job, expected = _job(program, tests, entry_point)
    started = time.monotonic()
    statuses, stderr, notes = _run_all(job, expected, limits, deadline=started + limits.max_total_s)
    failures = [i for i, s in enumerate(statuses) if s != "passed"]
    first_failure = next((i for i in failures if stderr.get(i, "").strip()), failures[0] if failures else None)
    return TestReport(
        passed=sum(s == "passed" for s in statuses),
        total=len(statuses),
        statuses=statuses,
        stderr="" if first_failure is None else stderr.get(first_failure, "")[-limits.stderr_bytes:],
        seconds=time.monotonic() - started,
        notes=tuple(notes),
    )


def _run_all(job: dict, expected: list, limits: SandboxLimits, deadline: float) -> tuple[tuple[str, ...], dict[int, str], list[str]]:
    """Run every test, in fresh harnesses after one dies mid-test; ``(statuses, stderr by test, notes)``."""
    statuses: list[str | None] = [None] * len(expected)
    stderr: dict[int, str] = {}
    notes: list[str] = []
    start, restarts = 0, 0
    while start < len(expected):
        result = HarnessRun({**job, "start": start}, limits, deadline).run()
        for i, event in result.done.items():
            statuses[i] = _verdict(job["kind"], event, expected[i])
            stderr[i] = str(event.get("stderr", ""))
        if result.end == "finished":
            break
        first_open = next((i for i in range(start, len(expected)) if statuses[i] is None), len(expected))
        if result.end in ("setup_failed", "budget") or result.in_setup:
            for i in range(first_open, len(expected)):  # the program's top level failed: every test fails alike
                statuses[i], stderr[i] = result.end_status, result.stderr
            notes.append(f"{result.end}: {result.end_status} from test {first_open} on")
            break
        statuses[first_open], stderr[first_open] = result.end_status, result.stderr
        restarts += 1
        notes.append(f"harness ended during test {first_open} ({result.end}, {result.end_status})")
        if restarts > limits.max_restarts:
            for i in range(first_open + 1, len(expected)):
                statuses[i] = result.end_status
            notes.append(f"gave up after {restarts} restarts")
            break
        start = first_open + 1
    return tuple(s or "error" for s in statuses), stderr, notes


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
