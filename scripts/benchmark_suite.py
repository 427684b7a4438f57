#!/usr/bin/env python
"""Run one benchmark suite of ``benchmarks/suites.yaml`` and record its results as JSON.

    python scripts/benchmark_suite.py learning            # -> benchmarks/results/learning.json
    python scripts/benchmark_suite.py speed --rows "iteration, APPO"
    python scripts/render_benchmarks.py                   # -> docs/results/benchmarks.md

Every row's command runs as written, from the repository root, one at a time (timings on a small machine are only
comparable with nothing else running). A row's figures come from its command's last line of JSON
(``scripts/benchmark.py``) or from the ``summary.json`` of a training run (``--output_dir`` is added). The record
names the git commit, the machine, the date and, once per run, the machine's speed reading of
``../shared/anchor/calibrate.py`` (``$MARFT_CALIBRATE``) where that file exists (the development workspace's
calibration), else null.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SUITES = ROOT / "benchmarks" / "suites.yaml"
RESULTS = ROOT / "benchmarks" / "results"
CALIBRATE = Path(os.environ.get("MARFT_CALIBRATE", ROOT.parent / "shared" / "anchor" / "calibrate.py"))
"""The development workspace's machine-speed script (``$MARFT_CALIBRATE`` for another path, e.g. from a clone elsewhere)."""
READS = ("last_json_line", "summary_json")


def load_suites(path: Path = SUITES) -> dict:
    suites = yaml.safe_load(path.read_text())
    for name, suite in suites.items():
        if suite.get("reads") not in READS:
            raise ValueError(f"suite {name!r}: reads must be one of {READS}, not {suite.get('reads')!r}")
        for row in suite["rows"]:
            if not {"label", "command"} <= set(row) or not (row.get("figure") or suite.get("figure")):
                raise ValueError(f"suite {name!r}: every row needs a label, a command and a figure: {row}")
    return suites


def git_commit() -> dict:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--", "marft", "scripts"))}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}


def machine() -> dict:
    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "gpu": gpu, "python": platform.python_version(),
            "torch": torch.__version__}


def calibrate() -> float | None:
    """The machine's speed figure (seconds; the reference machine reads 0.8 s), or None outside the workspace."""
    if not CALIBRATE.is_file():
        return None
    out = subprocess.run([sys.executable, str(CALIBRATE)], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["calibrate_s"]


def run_row(row: dict, reads: str) -> dict:
    """Run one row's command; its figures, and the seconds of the whole command."""
    command = row["command"]
    with tempfile.TemporaryDirectory(prefix="marft-suite-") as run_dir:
        argv = shlex.split(command) + (["--output_dir", run_dir] if reads == "summary_json" else [])
        assignments = {}
        while argv and "=" in argv[0] and argv[0].split("=", 1)[0].isidentifier():  # NAME=value before the command, as in a shell
            name, value = argv.pop(0).split("=", 1)
            assignments[name] = os.path.expandvars(value)
        if not argv:
            raise ValueError(f"{command!r}: no command after the environment assignments")
        if argv[0] == "python":
            argv[0] = sys.executable  # the interpreter running the suite (.venv's), as an activated venv would
        path = os.pathsep.join([str(ROOT)] + ([assignments.pop("PYTHONPATH")] if "PYTHONPATH" in assignments else []))
        env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": path, **assignments}  # the repository stays importable
        start = time.perf_counter()
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if done.returncode != 0:
            raise RuntimeError(f"{command!r} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        if reads == "summary_json":
            result = json.loads(Path(run_dir, "summary.json").read_text())
        else:
            result = json.loads(done.stdout.strip().splitlines()[-1])
    return {"label": row["label"], "command": command, "command_seconds": round(seconds, 1), "result": result}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite", help="a suite of benchmarks/suites.yaml")
    parser.add_argument("--rows", nargs="*", help="run only these rows (labels); the others keep their last record")
    parser.add_argument("--results_dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    suites = load_suites()
    if args.suite not in suites:
        parser.error(f"no suite {args.suite!r}; suites: {', '.join(suites)}")
    suite = suites[args.suite]
    rows = [r for r in suite["rows"] if not args.rows or r["label"] in args.rows]
    if args.rows and len(rows) != len(args.rows):
        parser.error(f"unknown rows: {sorted(set(args.rows) - {r['label'] for r in rows})}")
    run = {"date": datetime.date.today().isoformat(), **git_commit(), "machine": machine(), "calibrate_s": calibrate()}
    path = args.results_dir / f"{args.suite}.json"
    recorded = json.loads(path.read_text())["rows"] if path.is_file() else []
    by_label = {r["label"]: r for r in recorded}
    for row in rows:
        print(f"[{args.suite}] {row['command']}", flush=True)
        by_label[row["label"]] = {**run_row(row, suite["reads"]), "run": run}
        ordered = [by_label[r["label"]] for r in suite["rows"] if r["label"] in by_label]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"suite": args.suite, "rows": ordered}, indent=1) + "\n")  # after every row
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
