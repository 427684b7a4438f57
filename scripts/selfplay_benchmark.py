"""Self-play on a two-player game: does each agent end stronger against the random player than it started?

    python scripts/selfplay_benchmark.py --seed 0
    python scripts/selfplay_benchmark.py --seed 0 --invalid_move_penalty 1 --lr_warmup_iterations 10

Runs the self-play recipe of docs/selfplay.md as its commands (each in its own process, exactly as a user types them):

1. ``marft sft``: the warm start on random legal play from each seat's view (``--sft_steps``, ``--n_demonstrations``);
2. ``marft eval --versus_random``: each agent of the warm start against the random-legal-move player (it plays the
   other agent's seat), ``--episodes`` held-out games, both seats;
3. ``marft train``: self-play from the warm start (GRPO with each agent's own reward), with any further flags given
   here (e.g. ``--invalid_move_penalty 1 --lr_warmup_iterations 10``);
4. ``marft eval --versus_random`` of the trained agents, the same games.

Prints the commands, then ONE line of JSON: per agent, its win rate over both seats against the random player before
and after (``before_a``, ``after_a``, ``before_b``, ``after_b``), the share of its games ended by an invalid move
(``before_a_invalid`` ...), each evaluation's ``games`` figures, and the seconds of the whole run. The run's folders stay under ``--output_dir``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from recipe_runs import add_recipe_args, run_recipe

SELF_PLAY_FLAGS = ("--profile_path game_seats --algorithm_name GRPO --credit_assignment per_step --group_size 4 --horizon 10 "
                   "--episode_length 10 --max_new_tokens 4 --context_window 1024 --lora_target_modules all-linear,lm_head")
"""The flags both commands share (docs/selfplay.md's ``$SELF_PLAY`` less ``--env_name``): one agent per seat, GRPO over
groups of 4 games, each agent paid its own seat's reward."""

ROLES = ("Player A", "Player B")
"""The agents of ``game_seats``."""


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env_name", default="textarena:TicTacToe-v0", help="a two-player game whose observations list the legal moves")
    add_recipe_args(p, sft_steps=1500, n_demonstrations=6000, n_rollout_threads=32, num_env_steps=34560,
                    moves="34560: 108 iterations of 32 x 10", episodes=200, runs="selfplay")
    return p.parse_known_args(argv)


def commands(args: argparse.Namespace, train_flags: list[str]) -> dict[str, list[str]]:
    """Each step's command line (``marft`` and its flags), by step name."""
    out = Path(args.output_dir)
    shared = ["--env_name", args.env_name, *shlex.split(SELF_PLAY_FLAGS), "--n_rollout_threads", str(args.n_rollout_threads)]
    device = ["--device", args.device] if args.device else []
    warm_start = out / "sft" / "checkpoints" / "steps_0"

    def evaluations(checkpoint: Path, when: str) -> dict[str, list[str]]:
        """Each agent of ``checkpoint`` against the random player, which plays the other agent's seat."""
        steps = {}
        for role in ROLES:
            name, opponent = f"{when}_{role[-1].lower()}", next(r for r in ROLES if r != role)
            steps[name] = ["eval", "--load_path", str(checkpoint), "--episodes", str(args.episodes), "--versus_random", opponent,
                           *device, "--output_dir", str(out / "eval" / name)]
        return steps

    model = ["--model_name_or_path", args.model_name_or_path] if args.model_name_or_path else []
    return {
        "sft": ["sft", *shared, "--sft_steps", str(args.sft_steps), "--n_demonstrations", str(args.n_demonstrations),
                "--seed", str(args.seed), *device, *model, "--output_dir", str(out / "sft")],
        **evaluations(warm_start, "before"),
        "train": ["train", "--load_path", str(warm_start), "--n_rollout_threads", str(args.n_rollout_threads),
                  "--num_env_steps", str(args.num_env_steps), "--seed", str(args.seed), *device, *train_flags,
                  "--output_dir", str(out / "rl")],
        **evaluations(out / "rl", "after"),
    }


def wins_over_both_seats(games: dict) -> float:
    """The agent's win rate over all its games, both seats together (``games`` of an eval's ``summary.json``)."""
    seats = [games[key] for key in ("seat_0", "seat_1") if key in games]
    played = sum(seat["games"] for seat in seats)
    return sum(seat["win"] * seat["games"] for seat in seats) / played if played else float("nan")


def main(argv=None) -> dict:
    args, train_flags = parse_args(argv)
    args.output_dir = args.output_dir or str(Path("results") / "selfplay" / time.strftime("%Y%m%d-%H%M%S"))
    start = time.perf_counter()
    games = run_recipe(commands(args, train_flags), args.output_dir)
    result = {"bench": "selfplay", "env": args.env_name, "seed": args.seed, "train_flags": shlex.join(train_flags)}
    for name, figures in games.items():
        result[name] = round(wins_over_both_seats(figures), 4)
        result[f"{name}_invalid"] = figures["invalid_move_rate"]
    result.update(games=games, seconds=round(time.perf_counter() - start, 1), run_dir=args.output_dir)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
