"""Five short training runs and a digest of the weights each ends with: the check that a change which only moves
code (a module to another package, a class split in two) changes no computation.

Run it before the change with ``--record FILE``, and after it with ``--compare FILE``: the second run exits 1 and
names the runs whose weights differ. The runs cover MARFT-A, MARFT-T and GRPO on ``relay_sum``, the code env (its
sandboxed grader) and a TextArena game against the random player, each a few iterations of the embedded
``marft-tiny`` in its own process with one thread (the same float operations in the same order; compare digests
only on the same machine and torch build).

    python scripts/same_weights.py --output_dir /tmp/before --record /tmp/before.json
    ... the change ...
    python scripts/same_weights.py --output_dir /tmp/after --compare /tmp/before.json

Prints one JSON object: run name -> sha256 over the final checkpoint's tensors (every adapter's LoRA weights
and the value head, by name), and ``"same": true | false`` with ``--compare``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file

COMMON = ["--n_rollout_threads", "4", "--episode_length", "1", "--max_new_tokens", "6", "--context_window", "160",
          "--eval_episodes", "4", "--n_eval_threads", "2", "--num_env_steps", "12", "--seed", "3"]
"""Three iterations of four envs, a short held-out evaluation, a fixed seed."""

RUNS: dict[str, list[str]] = {
    "appo_relay_sum": ["--env_name", "relay_sum"],
    "tppo_relay_sum": ["--env_name", "relay_sum", "--algorithm_name", "TPPO"],
    "grpo_relay_sum": ["--env_name", "relay_sum", "--algorithm_name", "GRPO", "--group_size", "2"],
    "appo_code": ["--env_name", "code", "--max_new_tokens", "8"],
    "appo_tictactoe": ["--env_name", "textarena:TicTacToe-v0", "--profile_path", "game_player", "--game_view", "board",
                       "--episode_length", "4", "--max_new_tokens", "4", "--num_env_steps", "32"],
}
"""Each run's flags beyond :data:`COMMON` (later flags win)."""


def digest(checkpoint: Path) -> str:
    """sha256 over every tensor of the checkpoint's ``*.safetensors`` files, by file and tensor name."""
    sha = hashlib.sha256()
    for path in sorted(checkpoint.rglob("*.safetensors")):
        tensors = load_file(path)
        for name in sorted(tensors):
            sha.update(f"{path.relative_to(checkpoint)}:{name}:{tuple(tensors[name].shape)}:{tensors[name].dtype}".encode())
            sha.update(tensors[name].contiguous().numpy().tobytes())
    return sha.hexdigest()


def train(name: str, flags: list[str], run_dir: Path) -> str:
    """One run in its own process (one thread); the digest of its final checkpoint."""
    shutil.rmtree(run_dir, ignore_errors=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    command = [sys.executable, "-m", "marft", "train", *COMMON, *flags, "--output_dir", str(run_dir)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed ({done.returncode}): {' '.join(command)}\n{done.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return digest(Path(summary["checkpoint"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", required=True, help="a folder for the five runs (replaced)")
    parser.add_argument("--record", help="write the digests to this JSON file")
    parser.add_argument("--compare", help="a JSON file --record wrote: exit 1 if any run's weights differ")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"a comma-separated subset of {', '.join(RUNS)}")
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.runs.split(",") if name.strip()]
    unknown = [name for name in names if name not in RUNS]
    if unknown:
        parser.error(f"unknown runs {unknown}; choose from {', '.join(RUNS)}")
    digests = {name: train(name, RUNS[name], Path(args.output_dir) / name) for name in names}
    result: dict = dict(digests)
    code = 0
    if args.compare:
        expected = json.loads(Path(args.compare).read_text())
        differ = [name for name in names if expected.get(name) != digests[name]]
        result["same"] = not differ
        if differ:
            result["differ"] = differ
            code = 1
    if args.record:
        Path(args.record).write_text(json.dumps(digests, indent=2) + "\n")
    print(json.dumps(result))
    return code


if __name__ == "__main__":
    sys.exit(main())
