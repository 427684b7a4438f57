"""Sandbox throughput: HumanEval's 164 canonical solutions graded through ``run_tests``.

    python scripts/benchmark_code.py                 # one sandbox per core, 3 timed passes
    python scripts/benchmark_code.py --workers 1     # one at a time (the latency of a single program)

Prints progress and ends with one line of JSON: seconds per pass (best and median), programs
graded per second, how many passed, the worker count and the sandbox's isolation.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from marft.envs.code import run_tests  # noqa: E402
from marft.envs.code.data import load_humaneval  # noqa: E402
from marft.envs.code.sandbox import HarnessRun, SandboxLimits, sandbox_python  # noqa: E402


def grade_pass(problems, workers: int) -> tuple[float, int]:
    """``(seconds, programs passed)`` for one pass over ``problems`` with ``workers`` sandboxes at a time."""
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        reports = list(pool.map(lambda p: run_tests(p.solution, p.tests, entry_point=p.entry_point, prompt=p.program_prefix), problems))
    return time.perf_counter() - started, sum(r.all_passed for r in reports)


def isolation() -> dict:
    """What the sandbox isolated on this machine, from a trivial run."""
    result = HarnessRun({"kind": "stdin", "program": "", "entry_point": None}, {"cases": [{"input": "", "output": ""}]},
                        SandboxLimits(), time.monotonic() + 60).run()
    return vars(result.isolation) if result.isolation else {}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="sandboxes at a time (default: one per core)")
    parser.add_argument("--repeat", type=int, default=3, help="timed passes over the 164 problems")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    problems = load_humaneval().problems
    print(f"sandbox python: {sandbox_python()}; warming up ...", flush=True)
    grade_pass(problems[:8], args.workers)
    seconds, passed = [], 0
    for k in range(args.repeat):
        s, passed = grade_pass(problems, args.workers)
        seconds.append(s)
        print(f"pass {k + 1}: {len(problems)} programs in {s:.2f} s ({len(problems) / s:.1f} programs/s), {passed} passed", flush=True)
    best = min(seconds)
    print(json.dumps({
        "benchmark": "code_sandbox_humaneval", "programs": len(problems), "passed": passed, "workers": args.workers,
        "cpu_count": os.cpu_count(), "seconds_best": round(best, 3), "seconds_median": round(statistics.median(seconds), 3),
        "programs_per_s": round(len(problems) / best, 1), "isolation": isolation(),
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
