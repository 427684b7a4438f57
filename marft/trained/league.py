"""``marft eval --league``: a round robin of a self-play team's checkpoints (and the random player), rated (issue 76).

Every pair of members plays ``episodes`` held-out games per pairing of roles: member ``a``'s first role against
member ``b``'s second, and ``a``'s second against ``b``'s first (each through
:func:`marft.trained.evaluate.evaluate` with ``versus_checkpoint``; against the random player, ``versus_random``).
Seats rotate over the games (task ``i`` plays seat ``i % 2``), so both members play both seats. In a team game
(:mod:`marft.envs.textarena.teams`) the pairings are of sides: ``a``'s Village roles against ``b``'s Mafia, and the
reverse; the game deals the seats. The games rate every member with openskill's Plackett-Luce model (a draw or an
unfinished game is a tie), replayed in a fixed order, so the same games give the same ratings. Written to the output
folder: ``league.json`` (members, the win / draw / loss counts of every ordered pair, each member's share of games
ended by its invalid move or, in a team game, in which one of its side's players was eliminated for one, the
ratings) and ``league.png`` (each run's checkpoints: rating against training iteration).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from marft.envs.profile import load_profile
from marft.launch import build_env_factories
from marft.runner.shared.checkpoint import find_checkpoint
from marft.trained.evaluate import checkpoint_config, evaluate

RANDOM = "random"
"""The member name of the random-legal-move player."""


@dataclass
class Record:
    """One ordered pair's games, from the first member's side."""

    wins: int = 0
    draws: int = 0
    losses: int = 0
    invalid: int = 0
    """Games the first member lost by its own invalid move (a team game: in which one of its players was eliminated for one)."""

    @property
    def games(self) -> int:
        return self.wins + self.draws + self.losses


def league_members(paths: list[str]) -> list[tuple[str, Path | None]]:
    """``(name, checkpoint)`` per member: ``random`` (no checkpoint), a checkpoint folder, or a run directory (every
    ``checkpoints/steps_<N>`` of it, in training order). Names are ``<run>/steps_<N>``.

    Raises:
        ValueError: fewer than two members, or one named twice."""
    members: list[tuple[str, Path | None]] = []
    for path in paths:
        if path == RANDOM:
            members.append((RANDOM, None))
            continue
        root = Path(path)
        steps = sorted((root / "checkpoints").glob("steps_*"), key=iteration_of) if (root / "checkpoints").is_dir() else []
        for checkpoint in [s for s in steps if (s / "trainer_state.json").is_file()] or [find_checkpoint(root)]:
            members.append((f"{checkpoint.parent.parent.name}/{checkpoint.name}", checkpoint))
    names = [name for name, _ in members]
    if len(set(names)) != len(names):
        raise ValueError(f"--league names a member twice: {names}")
    if len(members) < 2:
        raise ValueError(f"--league needs at least two members (checkpoints, run directories or 'random'), got {names}")
    return members


def iteration_of(checkpoint: Path) -> int:
    """The training iteration of ``.../steps_<N>`` (-1 for another name)."""
    found = re.fullmatch(r"steps_(\d+)", checkpoint.name)
    return int(found.group(1)) if found else -1


def play_pair(a: Path, b: Path | None, pairings: list[list[str]], episodes: int, seed: int, out: Path) -> tuple[Record, Record]:
    """``a``'s and ``b``'s records against each other (``b``: a checkpoint, or None: the random player), ``episodes``
    games per pairing: ``b`` plays each pairing's roles (one seat's, or a team game's side), ``a`` the others."""
    mine, theirs = Record(), Record()
    for index, opponent_roles in enumerate(pairings):
        where, versus = out / f"{index}", ",".join(opponent_roles)
        if b is None:
            evaluate(a, episodes=episodes, seed=seed, output_dir=where, progress=False, versus_random=versus)
        else:
            evaluate(a, episodes=episodes, seed=seed, output_dir=where, progress=False, versus_checkpoint=b, versus_role=versus)
        transcripts = [json.loads(line) for line in (where / "transcripts.jsonl").read_text().splitlines() if line.strip()]
        tally(transcripts, [role for roles in pairings for role in roles if role not in opponent_roles], mine)  # a's roles
        tally(transcripts, opponent_roles, theirs)
    return mine, theirs


def tally(games: list[dict], roles: list[str], record: Record) -> None:
    """Add the outcomes of the side that plays ``roles`` in self-play ``games`` (transcripts) to ``record`` (its first
    role's outcome: a team's roles share theirs): a draw or a game the horizon cut counts as a draw; ``invalid``: the
    games in which one of ``roles`` made an invalid move that cost it the game (a team game: a player)."""
    for game in games:
        outcome = game["outcome_by_role"][roles[0]]
        record.wins += outcome == "win"
        record.losses += outcome == "loss"
        record.draws += outcome not in ("win", "loss")
        record.invalid += any(role in game["invalid_roles"] for role in roles)


def pairings_of(config) -> list[list[str]]:
    """The roles the second member of a pair plays in each pairing: each role of a two-role self-play team (seats), or
    each side's roles of a team game (``side_by_role`` of its env, sides in sorted order).

    Raises:
        ValueError: a team of more roles that does not play a team game."""
    profile = load_profile(config.model.profile_path, n_agents=config.model.n_agents)
    roles = [spec.role for spec in profile]
    if len(roles) == 2:
        return [[role] for role in roles]
    _, make_env = build_env_factories(config, profile, eval_split="test")
    env = make_env().unwrapped
    if getattr(env, "team", None) is None:
        raise ValueError(f"--league rates self-play teams (one agent per seat) and team games; {config.env.env_name} with roles {roles} is neither")
    sides = env.side_by_role()
    return [[role for role in roles if sides[role] == side] for side in sorted(set(sides.values()))]


def rate(names: list[str], records: dict[tuple[str, str], Record]) -> dict[str, dict[str, float]]:
    """Each member's openskill rating (Plackett-Luce: mu, sigma and ordinal = mu - 3 sigma) from every pair's games,
    replayed round by round (one game of each pair per round, pairs in order; each pair's outcomes
    :func:`interleaved`), so no pair's games, nor one kind of outcome, all come last."""
    from openskill.models import PlackettLuce  # optional: marft[games]

    model = PlackettLuce()
    ratings = {name: model.rating(name=name) for name in names}
    queues = {pair: interleaved({"win": r.wins, "draw": r.draws, "loss": r.losses}) for pair, r in records.items()}
    for round_games in range(max((len(q) for q in queues.values()), default=0)):
        for (a, b), queue in queues.items():
            if round_games >= len(queue):
                continue
            ranks = {"win": [0, 1], "draw": [0, 0], "loss": [1, 0]}[queue[round_games]]
            [[ratings[a]], [ratings[b]]] = model.rate([[ratings[a]], [ratings[b]]], ranks=ranks)
    return {name: {"mu": r.mu, "sigma": r.sigma, "ordinal": r.ordinal()} for name, r in ratings.items()}


def interleaved(counts: dict[str, int]) -> list[str]:
    """The outcomes spread evenly over the games (the k-th of n of a kind at (k + 1/2) / n), so that a pair's
    rating does not depend on which of its games were played last: 2 wins and 2 losses are win, loss, win, loss."""
    placed = [((k + 0.5) / n, order, kind) for order, (kind, n) in enumerate(counts.items()) for k in range(n)]
    return [kind for _, _, kind in sorted(placed)]


def plot_ratings(members: list[tuple[str, Path | None]], ratings: dict, path: Path) -> None:
    """Rating (mu, +- sigma) against training iteration, one line per run; the random player as a flat line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    runs: dict[str, list[tuple[int, str]]] = {}
    for name, checkpoint in members:
        if checkpoint is not None:
            runs.setdefault(name.split("/")[0], []).append((iteration_of(checkpoint), name))
    for run, points in runs.items():
        points.sort()
        x = [it for it, _ in points]
        mu = [ratings[name]["mu"] for _, name in points]
        sigma = [ratings[name]["sigma"] for _, name in points]
        ax.errorbar(x, mu, yerr=sigma, marker="o", capsize=3, label=run)
    if RANDOM in ratings:
        ax.axhline(ratings[RANDOM]["mu"], color="grey", linestyle=":", label="random player")
    ax.set(xlabel="training iteration", ylabel="rating (openskill mu ± sigma)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def league(paths: list[str], episodes: int, seed: int, output_dir: str | Path) -> dict:
    """Play the round robin of ``paths`` (see the module's docstring) and write ``league.json`` and ``league.png``
    to ``output_dir``; returns the league.

    Raises:
        ValueError: fewer than two members, only the random player, or members of different teams or games (the
            evaluation refuses another team's checkpoint, and a non-self-play one)."""
    members = league_members(paths)
    checkpoints = [c for _, c in members if c is not None]
    if not checkpoints:
        raise ValueError("--league needs at least one checkpoint besides the random player")
    configs = [checkpoint_config(checkpoint)[0] for checkpoint in checkpoints]
    config, env = configs[0], configs[0].env.env_name
    for checkpoint, other in zip(checkpoints[1:], configs[1:]):
        if other.env.env_name != env:
            raise ValueError(f"--league: {checkpoint} plays {other.env.env_name}, not {env}")
    pairings = pairings_of(config)
    out = Path(output_dir)
    records: dict[tuple[str, str], Record] = {}
    names = [name for name, _ in members]
    for i, first in enumerate(members):
        for j, second in enumerate(members[i + 1:], start=i + 1):
            (a_name, a), (b_name, b) = (second, first) if first[1] is None else (first, second)  # the random player never loads a team
            records[(a_name, b_name)], records[(b_name, a_name)] = play_pair(a, b, pairings, episodes, seed, out / "pairs" / f"{i}-{j}")
    ratings = rate(names, {pair: r for pair, r in records.items() if names.index(pair[0]) < names.index(pair[1])})
    games = {name: sum(r.games for (a, _), r in records.items() if a == name) for name in names}
    invalid = {name: sum(r.invalid for (a, _), r in records.items() if a == name) for name in names}
    result = {
        "env": env, "episodes_per_pairing": episodes, "seed": seed, "members": names,
        "ratings": ratings,
        "matrix": {f"{a} vs {b}": asdict(r) for (a, b), r in records.items()},
        "invalid_move_rate": {name: invalid[name] / games[name] if games[name] and name != RANDOM else None for name in names},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "league.json").write_text(json.dumps(result, indent=2) + "\n")
    plot_ratings(members, ratings, out / "league.png")
    result["output_dir"] = str(out)
    return result
