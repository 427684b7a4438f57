"""A team game: does the trained side end stronger than its warm start, against a fixed other side and against random play?

    python scripts/team_game_benchmark.py --seed 0 --invalid_move_penalty 1 --lr_warmup_iterations 5 --kl_coef 0

Runs the team-game recipe of docs/games.md ("Team games") as its commands, each in its own process, exactly as a user
types them (SecretMafia by default: the Village's three roles train, the Mafia stays as its warm start):

1. ``marft sft``: the warm start on random legal play from every player's own view;
2. ``marft eval`` of the warm start, ``--episodes`` held-out games: the trained side against the warm-start other side
   (``vs_frozen``), and against the random-legal-move player moving for the other side (``--versus_random``, ``vs_random``);
3. ``marft train`` from the warm start with the other side frozen (``--frozen_roles``), with any further flags given here;
4. the same two evaluations of the trained team.

``--votes TRANSCRIPTS.jsonl`` (SecretMafia) counts whom the votes of an evaluation's games named: per phase and the
voter's side, a living player of its own side, of the other side, or no living player.

``--random_baseline`` plays random legal moves for every player instead (no model, ``--episodes`` held-out games) and
prints one line of JSON: the reported role's side's win rate, the unfinished share and the mean moves of a game.

Prints the commands, then ONE line of JSON: the trained side's win rate before and after in both evaluations
(``before_vs_frozen``, ``after_vs_frozen``, ``before_vs_random``, ``after_vs_random``), the share of games in which a
player was eliminated for invalid moves (``..._invalid``), the forgiven invalid moves per game, and the seconds of the
whole run. The run's folders stay under ``--output_dir``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from recipe_runs import add_recipe_args, run_recipe

TEAM_FLAGS = ("--algorithm_name APPO --credit_assignment own_turns --critic_mode per_agent --horizon 64 --episode_length 64 "
              "--max_new_tokens 4 --context_window 1024 --lora_target_modules all-linear,lm_head")
"""The flags both commands share (docs/games.md's ``$TEAM`` less ``--env_name``, ``--profile_path`` and
``--n_rollout_threads``): MARFT-A with each agent's own turns and a critic per agent, whole games of up to 64 moves per
rollout."""


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env_name", default="textarena:SecretMafia-v0", help="a team game (marft.envs.textarena.teams)")
    p.add_argument("--profile_path", default="secret_mafia",
                   help="the team (its first role's side is the one reported: put a role of the trained side first)")
    p.add_argument("--frozen_side", default="Mafia", help="the roles (comma-separated) that stay as the warm start")
    add_recipe_args(p, sft_steps=300, n_demonstrations=2000, n_rollout_threads=16, num_env_steps=20480,
                    moves="20480: 20 iterations of 16 x 64", episodes=1000, runs="team_game")
    p.add_argument("--random_baseline", action="store_true", help="random legal play on every side instead (no model)")
    p.add_argument("--votes", metavar="TRANSCRIPTS", help="SecretMafia: count whom the votes of these evaluation games named")
    return p.parse_known_args(argv)


def commands(args: argparse.Namespace, train_flags: list[str]) -> dict[str, list[str]]:
    """Each step's command line (``marft`` and its flags), by step name."""
    out = Path(args.output_dir)
    shared = ["--env_name", args.env_name, "--profile_path", args.profile_path, *shlex.split(TEAM_FLAGS),
              "--n_rollout_threads", str(args.n_rollout_threads)]
    device = ["--device", args.device] if args.device else []
    warm_start = out / "sft" / "checkpoints" / "steps_0"

    def evaluations(checkpoint: Path, when: str) -> dict[str, list[str]]:
        base = ["eval", "--load_path", str(checkpoint), "--episodes", str(args.episodes), *device]
        return {f"{when}_vs_frozen": [*base, "--output_dir", str(out / "eval" / f"{when}_vs_frozen")],
                f"{when}_vs_random": [*base, "--versus_random", args.frozen_side, "--output_dir", str(out / "eval" / f"{when}_vs_random")]}

    model = ["--model_name_or_path", args.model_name_or_path] if args.model_name_or_path else []
    return {
        "sft": ["sft", *shared, "--sft_steps", str(args.sft_steps), "--n_demonstrations", str(args.n_demonstrations),
                "--seed", str(args.seed), *device, *model, "--output_dir", str(out / "sft")],
        **evaluations(warm_start, "before"),
        "train": ["train", "--load_path", str(warm_start), "--frozen_roles", args.frozen_side, "--n_rollout_threads",
                  str(args.n_rollout_threads), "--num_env_steps", str(args.num_env_steps), "--seed", str(args.seed), *device,
                  *train_flags, "--output_dir", str(out / "rl")],
        **evaluations(out / "rl", "after"),
    }


def side_wins(games: dict) -> float:
    """The reported role's win rate over its games (``games`` of an eval's ``summary.json``: per side of that role)."""
    sides = [value for key, value in games.items() if key.startswith("side_")]
    played = sum(side["games"] for side in sides)
    return sum(side["win"] * side["games"] for side in sides) / played if played else float("nan")


def random_baseline(env_name: str, profile_path: str, episodes: int) -> dict:
    """Random legal moves for every player on the first ``episodes`` held-out games (the k-th game's moves drawn from a
    generator seeded by k): the first role's side's win rate, the share of games the horizon cut, the mean moves."""
    import numpy as np

    from marft.envs import make

    env = make(env_name, split="test", profile=profile_path)
    outcomes, moves = [], []
    for task in range(episodes):
        env.reset(options={"task_index": task})
        rng = np.random.default_rng(task)
        while True:
            (agent,) = env.speakers()
            env.take_turn(agent, env.episode.legal[int(rng.integers(len(env.episode.legal)))])
            *_, terminated, truncated, info = env.step(env.turn_actions())
            if terminated or truncated:
                break
        outcomes.append(info["outcome"])
        moves.append(info["moves"])
    return {"bench": "team_game_random", "env": env_name, "profile": profile_path, "role": env.roles[0], "episodes": episodes,
            "win": outcomes.count("win") / episodes, "unfinished": outcomes.count("unfinished") / episodes,
            "mean_moves": float(np.mean(moves))}


def mafia_votes(transcripts: str | Path) -> dict[str, int]:
    """SecretMafia: whom the votes of an evaluation's games named (``transcripts.jsonl`` of ``marft eval`` or a run's
    ``transcripts/eval_<N>.jsonl``, test-split games), replayed move by move and read as the game reads a vote: per
    phase and the voter's side, how many named a living player of the voter's own side, of the other side, or none."""
    from marft.envs import make
    from marft.envs.textarena.env import Game

    env = make("textarena:SecretMafia-v0", split="test", profile="secret_mafia")
    sides = env.team.sides  # role -> side
    counts: dict[str, int] = {}
    for line in Path(transcripts).read_text().splitlines():
        game_row = json.loads(line)
        game = Game(env.game_id, env.seed_offset + game_row["task"], env.n_players)
        roles = game.base.player_roles
        for move in game_row["game_moves"]:
            if game.done:
                break
            phase, side = game.base.phase.value, sides[roles[game.current_player]]
            if phase in ("Night-Mafia", "Day-Voting"):
                named = game.base.voting_pattern.search(move)  # the game's own reading of a vote
                target = int(named.group(1)) if named else None
                if target not in game.base.state.game_state["alive_players"]:
                    verdict = "no_living_player"
                else:
                    verdict = "own_side" if sides[roles[target]] == side else "other_side"
                key = f"{phase}/{side}/{verdict}"
                counts[key] = counts.get(key, 0) + 1
            game.move(move)
    return dict(sorted(counts.items()))


def main(argv=None) -> dict:
    args, train_flags = parse_args(argv)
    if args.votes:
        result = {"bench": "mafia_votes", "transcripts": args.votes, **mafia_votes(args.votes)}
        print(json.dumps(result), flush=True)
        return result
    if args.random_baseline:
        result = random_baseline(args.env_name, args.profile_path, args.episodes)
        print(json.dumps(result), flush=True)
        return result
    args.output_dir = args.output_dir or str(Path("results") / "team_game" / time.strftime("%Y%m%d-%H%M%S"))
    start = time.perf_counter()
    games = run_recipe(commands(args, train_flags), args.output_dir)
    result = {"bench": "team_game", "env": args.env_name, "profile": args.profile_path, "frozen_side": args.frozen_side, "seed": args.seed,
              "train_flags": shlex.join(train_flags)}
    for name, figures in games.items():
        result[name] = round(side_wins(figures), 4)
        result[f"{name}_invalid"] = figures["invalid_move_rate"]
        result[f"{name}_forgiven_per_game"] = figures.get("forgiven_invalid_moves_per_game")
    result.update(games=games, seconds=round(time.perf_counter() - start, 1), run_dir=args.output_dir)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
