"""Sandbox throughput: HumanEval's 164 problems graded through ``run_tests``, canonical solutions and wrong bodies.

    python scripts/benchmark_code.py                 # one sandbox per core, 3 timed passes
    python scripts/benchmark_code.py --workers 1     # one at a time (the latency of a single program)
    python scripts/benchmark_code.py --record        # also append the result to benchmarks/results/code_sandbox.json

A pass grades the 164 canonical solutions (all must pass) and then 164 wrong bodies (``return None``: none may
pass). Prints progress and ends with one line of JSON: seconds per pass (best and median), programs graded per
second, how many passed, the worker count and the sandbox's isolation. ``--record`` adds the commit, machine,
date and calibration reading (``scripts/benchmark_suite.py``'s) to that line and appends it to the results file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from marft.envs.code import run_tests  # noqa: E402
from marft.envs.code.data import load_humaneval  # noqa: E402
from marft.envs.code.sandbox import HarnessRun, SandboxLimits, sandbox_python  # noqa: E402

RESULTS_FILE = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "code_sandbox.json"


def wrong_body(problem) -> str:
    return problem.program(f"def {problem.entry_point}(*args, **kwargs):\n    return None\n")


def grade_pass(problems, workers: int) -> tuple[float, int, int]:
    """``(seconds, canonical solutions passed, wrong bodies passed)`` for one pass with ``workers`` sandboxes at a time."""
    def grade(program, p):
        return run_tests(program, p.tests, entry_point=p.entry_point, prompt=p.program_prefix)

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        right = list(pool.map(lambda p: grade(p.solution, p), problems))
        wrong = list(pool.map(lambda p: grade(wrong_body(p), p), problems))
    return time.perf_counter() - started, sum(r.all_passed for r in right), sum(r.passed > 0 for r in wrong)


def isolation() -> dict:
    """What the sandbox isolated on this machine, from a trivial run."""
    result = HarnessRun({"kind": "stdin", "program": "", "entry_point": None}, {"cases": [{"input": "", "output": ""}]},
                        SandboxLimits(), time.monotonic() + 60).run()
    return vars(result.isolation) if result.isolation else {}


def record(result: dict) -> None:
    """Append ``result`` with the commit, machine, date and calibration reading to ``RESULTS_FILE``."""
    from benchmark_suite import calibrate, git_commit, machine

    runs = json.loads(RESULTS_FILE.read_text()) if RESULTS_FILE.exists() else []
    runs.append({"date": datetime.date.today().isoformat(), **git_commit(), "machine": machine(), "calibrate_s": calibrate(),
                 "command": "python scripts/benchmark_code.py " + " ".join(sys.argv[1:]), "result": result})
    RESULTS_FILE.write_text(json.dumps(runs, indent=1) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="sandboxes at a time (default: one per core)")
    parser.add_argument("--repeat", type=int, default=3, help="timed passes over the 164 problems")
    parser.add_argument("--record", action="store_true", help="append the result to benchmarks/results/code_sandbox.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    problems = load_humaneval().problems
    print(f"sandbox python: {sandbox_python()}; warming up ...", flush=True)
    grade_pass(problems[:8], args.workers)
    seconds, passed, wrong_passed = [], 0, 0
    for k in range(args.repeat):
        s, passed, wrong_passed = grade_pass(problems, args.workers)
        seconds.append(s)
        print(f"pass {k + 1}: {2 * len(problems)} programs in {s:.2f} s ({2 * len(problems) / s:.1f} programs/s), "
              f"{passed} canonical and {wrong_passed} wrong passed", flush=True)
    best = min(seconds)
    result = {
        "benchmark": "code_sandbox_humaneval", "programs": 2 * len(problems), "passed": passed, "wrong_passed": wrong_passed,
        "workers": args.workers, "cpu_count": os.cpu_count(), "seconds_best": round(best, 3),
        "seconds_median": round(statistics.median(seconds), 3), "programs_per_s": round(2 * len(problems) / best, 1),
        "isolation": isolation(),
    }
    if args.record:
        record(result)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
