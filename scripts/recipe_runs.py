"""What the game-recipe benchmarks share (``selfplay_benchmark.py``, ``team_game_benchmark.py``): their common flags,
and running a recipe's ``marft`` commands one after another, each in its own process, exactly as a user types them."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path


def add_recipe_args(p: argparse.ArgumentParser, *, sft_steps: int, n_demonstrations: int, n_rollout_threads: int,
                    num_env_steps: int, moves: str, episodes: int, runs: str) -> None:
    """The flags every recipe benchmark takes, with its own defaults (``moves``: what ``num_env_steps`` means in
    iterations; ``runs``: the default folder under ``results/``)."""
    p.add_argument("--seed", type=int, default=0, help="--seed of the warm start and of the training run")
    p.add_argument("--sft_steps", type=int, default=sft_steps, help="warm-start steps")
    p.add_argument("--n_demonstrations", type=int, default=n_demonstrations, help="random-legal-play demonstrations of the warm start")
    p.add_argument("--n_rollout_threads", type=int, default=n_rollout_threads, help="games played at once (warm start and training)")
    p.add_argument("--num_env_steps", type=int, default=num_env_steps, help=f"training length: moves in all ({moves})")
    p.add_argument("--episodes", type=int, default=episodes, help="held-out games per evaluation")
    p.add_argument("--model_name_or_path", default=None, help="the base model of the warm start (default: the embedded marft-tiny)")
    p.add_argument("--device", default=None, help="cpu, cuda or auto for every command (default: theirs)")
    p.add_argument("--output_dir", default=None, help=f"where the runs go (default results/{runs}/<time>)")


def run_recipe(steps: dict[str, list[str]], output_dir: str | Path) -> dict[str, dict]:
    """Run each step's ``marft`` command in order (printing it first; a failing step raises), then return the
    ``games`` figures of every evaluation step (named ``before_*`` / ``after_*``) from its ``summary.json`` under
    ``output_dir/eval/<step>``."""
    for name, argv in steps.items():
        print(f"[{name}] marft {shlex.join(argv)}", flush=True)
        subprocess.run([sys.executable, "-m", "marft", *argv], check=True, stdout=subprocess.DEVNULL)
    return {name: json.loads((Path(output_dir) / "eval" / name / "summary.json").read_text())["games"]
            for name in steps if name.startswith(("before_", "after_"))}
