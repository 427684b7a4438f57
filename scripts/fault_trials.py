"""Random SIGTERM / SIGKILL trials on a small default-like run; prints JSON: how many continued exactly.

    python scripts/fault_trials.py --trials 50 --seed 0

First the run goes through in one go (the reference). Each trial then starts the same run, sends SIGTERM
or SIGKILL (chosen at random) after a random delay within the reference's wall time, and continues it with
``--load_path <run dir>`` (after a SIGKILL before any checkpoint: from scratch), until it finishes. The delay
counts from the moment the run directory's ``config.json`` appears (the model is loaded and the runner starts),
so every signal lands in training: the first evaluation, a rollout, an update, a save or the last evaluation. A trial
*continued exactly* when its final checkpoint equals the reference's bit for bit (every adapter and value-head
weight; iteration, env steps, counters, env states, running returns, RNG states). Also counted: SIGTERMs that
exited with 75 and a checkpoint, tracebacks on stderr (there should be none), runs that ended before the
signal, whether the newest checkpoint left by a SIGKILL passed its manifest check, and partial ``.steps_*``
folders still there after the continuation (a killed save's are removed when the run starts again).

The run: ``scripts/train_math.py`` with the defaults (the embedded tiny model, the Reasoner -> Actor team,
generated arithmetic, APPO) shrunk to be quick: ``--n_rollout_threads 4 --episode_length 2`` for 12 iterations,
4 evaluation episodes, periodic saves every second or so (``--save_every_minutes 0.02``) and the default
``--keep_checkpoints 2``. Extra flags after ``--`` replace these.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RUN_FLAGS = ["--n_rollout_threads", "4", "--episode_length", "2", "--num_env_steps", "96", "--eval_episodes", "4",
             "--n_eval_threads", "4", "--save_every_minutes", "0.02"]
STATE_KEYS = ("iteration", "env_steps", "next_agents", "counters", "episode_returns", "envs", "rng")


def fingerprint(checkpoint: Path) -> dict:
    """SHA-256 of every safetensors file's tensors and the trainer state's exact-resume fields."""
    from safetensors.torch import load_file

    digest = hashlib.sha256()
    for file in sorted(checkpoint.rglob("*.safetensors")):
        for name, tensor in sorted(load_file(file).items()):
            digest.update(f"{file.relative_to(checkpoint)}/{name}".encode())
            digest.update(tensor.float().numpy().tobytes())
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    return {"weights": digest.hexdigest(), "state": hashlib.sha256(json.dumps({k: state.get(k) for k in STATE_KEYS}, sort_keys=True).encode()).hexdigest()}


def start(flags: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, str(ROOT / "scripts" / "train_math.py"), *flags], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def finish(flags: list[str], timeout: float) -> tuple[int, str]:
    child = start(flags)
    _, err = child.communicate(timeout=timeout)
    return child.returncode, err


def latest(run: Path):
    from marft.runner.shared.checkpoint import find_checkpoint

    try:
        return find_checkpoint(run)
    except FileNotFoundError:
        return None


def wait_for_start(child: subprocess.Popen, run: Path, timeout: float) -> float:
    """Seconds until ``run/config.json`` exists (the runner has started) or the child ended."""
    began = time.perf_counter()
    while not (run / "config.json").exists() and child.poll() is None:
        if time.perf_counter() - began > timeout:
            raise TimeoutError(f"{run} never started")
        time.sleep(0.05)
    return time.perf_counter() - began


def trial(index: int, rng: random.Random, flags: list[str], reference: dict, duration: float, root: Path, timeout: float) -> dict:
    from marft.runner.shared.checkpoint import read_checkpoint_meta

    kind = rng.choice(["SIGTERM", "SIGKILL"])
    delay = rng.uniform(0.0, duration)
    run = root / f"trial{index}"
    child = start([*flags, "--output_dir", str(run)])
    wait_for_start(child, run, timeout)
    time.sleep(delay)
    finished_before = child.poll() is not None
    if not finished_before:
        child.send_signal(getattr(signal, kind))
    _, err = child.communicate(timeout=timeout)
    result = {"trial": index, "signal": kind, "delay_s": round(delay, 2), "exit_code": child.returncode,
              "finished_before_signal": finished_before, "traceback": "Traceback" in err}
    checkpoint = latest(run)
    result["checkpoint"] = checkpoint.name if checkpoint else None
    if checkpoint is not None:
        try:
            read_checkpoint_meta(checkpoint)  # every file against the manifest
            result["checkpoint_intact"] = True
        except Exception as error:  # noqa: BLE001 - reported, not raised
            result["checkpoint_intact"] = False
            result["checkpoint_error"] = str(error)
    if result["exit_code"] != 0:
        resume = [*flags, "--output_dir", str(run)] + (["--load_path", str(run)] if checkpoint is not None else [])
        code, err = finish(resume, timeout)
        result["resume_exit_code"] = code
        result["traceback"] = result["traceback"] or "Traceback" in err
    result["partial_folders_left"] = len([p for p in (run / "checkpoints").glob(".steps_*")]) if (run / "checkpoints").is_dir() else 0
    final = run / "checkpoints" / f"steps_{reference['iterations']}"
    result["continued_exactly"] = final.is_dir() and fingerprint(final) == reference["fingerprint"]
    shutil.rmtree(run, ignore_errors=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=50, help="number of random trials")
    parser.add_argument("--seed", type=int, default=0, help="seed of the signal kinds and delays")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one run may take")
    parser.add_argument("--keep", action="store_true", help="keep the working folder")
    parser.add_argument("flags", nargs="*", help="training flags (after --) replacing the defaults")
    args = parser.parse_args()
    flags = RUN_FLAGS + args.flags
    root = Path(tempfile.mkdtemp(prefix="fault_trials_"))
    began = time.perf_counter()
    reference_run = root / "reference"
    child = start([*flags, "--output_dir", str(reference_run)])
    wait_for_start(child, reference_run, args.timeout)
    t0 = time.perf_counter()
    _, err = child.communicate(timeout=args.timeout)
    code, duration = child.returncode, time.perf_counter() - t0  # from the runner's start to the end
    if code != 0:
        print(err[-3000:], file=sys.stderr)
        return 1
    summary = json.loads((reference_run / "summary.json").read_text())
    reference = {"iterations": summary["iterations"], "fingerprint": fingerprint(Path(summary["checkpoint"]))}
    rng = random.Random(args.seed)
    results = []
    for index in range(args.trials):
        results.append(trial(index, rng, flags, reference, duration, root, args.timeout))
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)

    def count(kind: str) -> dict:
        rows = [r for r in results if r["signal"] == kind]
        signalled = [r for r in rows if not r["finished_before_signal"]]
        out = {"trials": len(rows), "finished_before_signal": len(rows) - len(signalled),
               "continued_exactly": sum(r["continued_exactly"] for r in rows),
               "left_a_checkpoint": sum(r["checkpoint"] is not None for r in signalled),
               "checkpoint_intact": sum(r.get("checkpoint_intact", False) for r in signalled)}
        if kind == "SIGTERM":
            out["exit_code_75"] = sum(r["exit_code"] == 75 for r in signalled)
        return out

    print(json.dumps({
        "trials": len(results), "seed": args.seed, "flags": flags, "reference_training_seconds": round(duration, 1),
        "continued_exactly": sum(r["continued_exactly"] for r in results), "tracebacks": sum(r["traceback"] for r in results),
        "partial_folders_left": sum(r["partial_folders_left"] for r in results),
        "SIGTERM": count("SIGTERM"), "SIGKILL": count("SIGKILL"),
        "failures": [r for r in results if not r["continued_exactly"] or r["traceback"] or r["partial_folders_left"]],
        "seconds": round(time.perf_counter() - began, 1),
    }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
