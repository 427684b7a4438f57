"""Evaluate a trained team (or the base model, for the "before" figure) on an environment's held-out split.

Each task of the split is played ``n`` times, sampling as in training; the summary gives, for every ``k`` asked,
pass@k by the unbiased estimator of Chen et al. (2021) (``1 - C(n - c, k) / C(n, k)`` per task with ``c`` of its
``n`` samples correct, averaged over tasks), the mean success of all samples, optionally the greedy success
(``--greedy``: one more pass per task with top-k 1), and per role the reply lengths and the share of empty
replies. Every episode goes to ``transcripts.jsonl``, the figures to ``summary.json``.

``marft eval`` (:mod:`marft.cli.eval`) is this module from the command line; ``marft.evaluate(...)`` from Python.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from marft.config import TrainConfig
from marft.envs.profile import load_profile
from marft.launch import build_env_factories, build_team, check_generation_backend, probe_env
from marft.models.loading import check_model_path
from marft.runner.shared.checkpoint import (
    BEFORE_THE_FLAG,
    find_checkpoint,
    load_checkpoint,
    read_checkpoint_meta,
)
from marft.runner.shared.diagnostics import TeamDiagnostics
from marft.runner.shared.evaluation import evaluate_episodes
from marft.runner.shared.opponent import load_role_adapter, team_differences
from marft.validation import check_device, check_writable_folder

logger = logging.getLogger(__name__)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from ``n`` samples of which ``c`` are correct (Chen et al. 2021):
    ``1 - C(n - c, k) / C(n, k)``, computed as a product so large ``n`` does not overflow.

    Raises:
        ValueError: ``k`` is not in ``1..n`` or ``c`` not in ``0..n``.
    """
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n samples per task (n = {n})")
    if not 0 <= c <= n:
        raise ValueError(f"{c} correct samples out of {n}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def checkpoint_config(load_path: str | Path) -> tuple[TrainConfig, Path]:
    """The run config a checkpoint was trained with (fields it predates keep their defaults), and its
    ``steps_<N>`` folder (a run directory means its latest checkpoint)."""

    path = find_checkpoint(load_path)
    saved, _ = read_checkpoint_meta(path)
    values = TrainConfig().to_dict()
    for section, fields in values.items():
        old = {**BEFORE_THE_FLAG.get(section, {}), **saved.get(section, {})}  # what a flag meant before it existed
        fields.update({k: v for k, v in old.items() if k in fields})
    config = TrainConfig.from_dict(values)
    config.runner.load_path = None
    return config, path


def team_source(load_path: str | Path | None, config: TrainConfig | None) -> tuple[TrainConfig, Path | None]:
    """``(config, checkpoint folder)``: ``config`` (default: the checkpoint's own) and the checkpoint at ``load_path``
    (None without one).

    Raises:
        ValueError: neither a checkpoint nor a config."""
    checkpoint = None
    if load_path is not None:
        saved, checkpoint = checkpoint_config(load_path)
        config = config or saved
    if config is None:
        raise ValueError("no team given: pass --load_path (a checkpoint) or a model config")
    return config, checkpoint


def load_team(config: TrainConfig, checkpoint: Path | None, split: str = "test"):
    """The team ``config`` describes with the adapters of ``checkpoint`` (None: fresh adapters, i.e. the base model's
    own replies, LoRA starting at zero); returns ``(team, profile, make_eval_env)``, the env on ``split``. Only what a trained team needs
    is checked (the profile, the model, the device, the held-out env), not the training data or run folder."""

    config.check()
    check_device(config.model.device)
    check_generation_backend(config)
    profile = load_profile(config.model.profile_path, n_agents=config.model.n_agents)
    check_model_path(config.model.model_name_or_path)
    _, make_eval_env = build_env_factories(config, profile, eval_split=split)
    probe_env(make_eval_env, profile, f"--env_name {config.env.env_name} (split {split})")
    team, trainer = build_team(config, profile)
    if checkpoint is not None:
        load_checkpoint(checkpoint, team, trainer)
    team.eval()
    return team, profile, make_eval_env


def evaluate(
    load_path: str | Path | None = None, config: TrainConfig | None = None, n: int = 1, k: Sequence[int] = (1,),
    episodes: int | None = None, greedy: bool = False, output_dir: str | Path | None = None, seed: int = 0, progress: bool = True,
    base_model: bool = False, split: str = "test", versus_random: str | None = None, versus_checkpoint: str | Path | None = None,
    versus_role: str | None = None,
) -> dict:
    """Evaluate the checkpoint at ``load_path`` (``base_model``: its team with fresh adapters, the "before" figure;
    no checkpoint: ``config``'s base model) on ``config``'s held-out split (default: the checkpoint's own config);
    returns the summary and writes it, with the transcripts, to ``output_dir`` (default
    ``<run dir>/eval/steps_<N>[-base_model]/<split>-n<n>`` (or ``-episodes<E>``; ``-<backend>`` added unless
    ``decode_loop`` samples), or ``results/eval/<time>`` without a checkpoint). ``split``: the env's
    held-out split (a dataset folder's ``<split>.jsonl``, e.g. ``test500``).

    ``versus_random``: a self-play game's role that the random-legal-move player plays instead; ``versus_checkpoint``
    / ``versus_role``: the role that plays with its adapter from another checkpoint of the same team (e.g. the warm
    start: the trained agent against its initial self). The game figures (``games``) are then the other role's.

    ``episodes``: play this many episodes (task ``j % tasks``) instead of ``n`` per task; with the training run's
    ``--eval_episodes`` and ``seed`` it replays the evaluation that training printed.

    ``greedy``: also play once with the most likely token every step (top-k 1), one episode per task the evaluation
    played (``episodes`` fewer than the tasks: tasks ``0 .. episodes - 1``); ``greedy_accuracy`` and (for a game)
    ``greedy_games`` in the summary, the episodes in ``greedy_transcripts.jsonl``.

    Raises:
        ValueError: ``k`` larger than ``n``, an env without held-out tasks for pass@k, a bad config.
        FileNotFoundError: no such checkpoint.
    """

    if episodes is None and any(not 1 <= kk <= n for kk in k):
        raise ValueError(f"every --k must be between 1 and --n {n}, got {', '.join(map(str, k))}")
    config, checkpoint = team_source(load_path, config)
    if output_dir is None and checkpoint is not None:  # one folder per checkpoint, team, split, sample count and sampler
        output_dir = _checkpoint_eval_dir(checkpoint, config, base_model, split, n, episodes, versus_random, versus_checkpoint, versus_role)
    out = Path(output_dir) if output_dir else Path("results") / "eval" / time.strftime("%Y%m%d-%H%M%S")
    check_writable_folder("--output_dir", out)  # before the model loads, not after the evaluation
    team, profile, make_eval_env = load_team(config, None if base_model else checkpoint, split)
    make_eval_env, perspective = opponent(team, config, make_eval_env, versus_random, versus_checkpoint, versus_role)
    tasks = make_eval_env().unwrapped.num_tasks
    total = _episode_count(config, tasks, n, episodes, split)
    start = time.perf_counter()
    diagnostics = TeamDiagnostics([s.role for s in profile])
    result, transcripts = _play(team, make_eval_env, total, seed, config, diagnostics, progress, evaluate_episodes)
    summary = _summary(config, None if base_model else checkpoint, transcripts, result, tasks if episodes is None else None, n, k, seed,
                       [s.role for s in profile], split)
    summary["distinct_tasks"] = min(total, tasks) if tasks else total  # tasks played at least once (episodes without tasks: all distinct)
    summary.update(game_figures(transcripts, [s.role for s in profile], perspective))
    calls = diagnostics.call_distribution()
    if calls:  # an orchestrated team: whom the orchestrator called per step, and the share of invalid replies
        summary["orchestrator_calls"] = calls
    greedy_transcripts = None
    if greedy:
        greedy_figures, greedy_transcripts = _greedy_figures(team, make_eval_env, min(total, tasks) if tasks else total, seed, config,
                                                             profile, perspective, evaluate_episodes)
        summary.update(greedy_figures)
    summary["seconds"] = round(time.perf_counter() - start, 1)
    _write(out, summary, transcripts, greedy_transcripts)
    summary["output_dir"] = str(out)
    return summary


def _episode_count(config: TrainConfig, tasks: int | None, n: int, episodes: int | None, split: str) -> int:
    """The episodes to play: ``episodes``, or ``n`` per task; more episodes than tasks revisit them (warned).

    Raises:
        ValueError: ``n`` per task of an env without held-out tasks.
    """
    if episodes is None and not tasks:
        raise ValueError(f"--env_name {config.env.env_name} sets no num_tasks (no fixed held-out tasks): pass --episodes instead of --n")
    if episodes is not None and tasks and episodes > tasks:
        logger.warning("--episodes %d revisits the %d tasks of the %r split (episode k plays task k %% %d, with fresh samples): "
                       "%d distinct tasks, not %d%s", episodes, tasks, split, tasks, tasks, episodes,
                       "" if split == "train" else "; --split train plays others")
    return episodes if episodes is not None else n * tasks


def _greedy_figures(team, make_env, total: int, seed: int, config: TrainConfig, profile, perspective, evaluate_episodes) -> tuple[dict, list]:
    """``greedy_accuracy`` and, for a game, ``greedy_games`` (a slip the sampler makes now and then, greedy play makes
    always or never), with the greedy episodes' transcripts."""
    result, transcripts = _greedy(team, make_env, total, seed, config, profile, evaluate_episodes)
    figures = {"greedy_accuracy": result["accuracy"]}
    games = game_figures(transcripts, [s.role for s in profile], perspective)
    if games:
        figures["greedy_games"] = games["games"]
    return figures, transcripts


def _checkpoint_eval_dir(checkpoint: Path, config: TrainConfig, base_model: bool, split: str, n: int, episodes: int | None,
                         versus_random: str | None, versus_checkpoint, versus_role: str | None) -> Path:
    """``<run dir>/eval/steps_<N>[-base_model]/<split>-n<n>`` (or ``-episodes<E>``), the opponent and the sampler named."""
    backend = config.model.generation_backend
    return (checkpoint.parent.parent / "eval" / (checkpoint.name + ("-base_model" if base_model else ""))
            / ((f"{split}-n{n}" if episodes is None else f"{split}-episodes{episodes}")
               + (f"-versus-random-{versus_random.lower().replace(' ', '_')}" if versus_random else "")
               + (f"-versus-{Path(versus_checkpoint).name}-{versus_role.lower().replace(' ', '_')}" if versus_checkpoint else "")
               + ("" if backend == "decode_loop" else f"-{backend}")))


def _play(team, make_env, total: int, seed: int, config: TrainConfig, diagnostics: TeamDiagnostics, progress: bool, evaluate_episodes):
    """``total`` episodes as training evaluates them (the same RNG stream: ``seed + 1_000_000``)."""
    torch.manual_seed(seed + 1_000_000)
    with torch.no_grad(), team.headers.frozen():
        return evaluate_episodes(team, make_env, total, seed, config.runner.n_eval_threads, diagnostics, progress=progress)


def _greedy(team, make_env, tasks: int, seed: int, config: TrainConfig, profile, evaluate_episodes) -> tuple[dict, list[dict]]:
    """``(result, transcripts)`` of one greedy pass per task (top-k 1: the most likely token every step)."""
    top_k = team.sampling.top_k
    team.set_top_k(1)
    try:
        return _play(team, make_env, tasks, seed, config, TeamDiagnostics([s.role for s in profile]), False, evaluate_episodes)
    finally:
        team.set_top_k(top_k)


def _summary(config: TrainConfig, checkpoint, transcripts: list[dict], result: dict, tasks: int | None, n: int, k, seed: int, roles,
             split: str) -> dict:
    """The figures of one evaluation: pass@k over tasks (when every task got ``n`` samples), mean success, per-role stats."""
    summary = {
        "checkpoint": None if checkpoint is None else str(checkpoint), "model": config.model.model_name_or_path,
        "env": config.env.env_name, "dataset": config.env.eval_dataset_path or config.env.dataset_path, "split": split,
        "episodes": result["episodes"], "accuracy": result["accuracy"], "return": result["return"], "seed": seed,
        "generation_backend": config.model.generation_backend,
    }
    if tasks:
        correct = np.zeros(tasks, dtype=int)
        for episode in transcripts:
            correct[episode["task"]] += int(episode["correct"])
        summary.update(tasks=tasks, n=n, **{f"pass@{kk}": float(np.mean([pass_at_k(n, int(c), kk) for c in correct])) for kk in k})
    summary["roles"] = role_stats(transcripts, roles)
    return summary


def game_figures(transcripts: list[dict], roles: Sequence[str], perspective: str | None = None) -> dict:
    """A game env's figures (``{"games": ...}``, or {} for other envs): per seat of the agent whose games they are
    (``perspective``, default the first role; in a team game per side of that role, ``side_Village``), its win / draw /
    loss / unfinished rates and mean reward, and the share of games with an invalid move that cost a player the game
    (in a team game: a player eliminated for it), and the invalid moves the game forgave, per game."""
    games = [episode for episode in transcripts if "outcome" in episode]
    if not games:
        return {}
    role = perspective or roles[0]
    agent = list(roles).index(role)

    def outcome(e):
        return e["outcome_by_role"][role] if perspective else e["outcome"]

    def reward(e):  # self-play: the role's own game (a team return would average both seats' rewards)
        return e["reward_by_role"][role] if "reward_by_role" in e else e["return"]

    figures: dict = {"role": role}
    if all("side_by_role" in e for e in games):  # a team game: the game deals the seats; by the role's side instead
        groups = {f"side_{side}": [e for e in games if e["side_by_role"][role] == side] for side in sorted({e["side_by_role"][role] for e in games})}
    else:
        groups = {f"seat_{seat}": [e for e in games if (e["seat"] + agent) % 2 == seat] for seat in (0, 1)}
    for name, mine in groups.items():
        if mine:
            figures[name] = {**{o: float(np.mean([outcome(e) == o for e in mine])) for o in ("win", "draw", "loss", "unfinished")},
                                       "reward": float(np.mean([reward(e) for e in mine])), "games": len(mine)}
    figures["invalid_move_rate"] = float(np.mean([bool(e.get("invalid_move")) for e in games]))
    if all("invalid_attempts" in e for e in games):  # the invalid moves the game forgave (the player tried again)
        figures["forgiven_invalid_moves_per_game"] = float(np.mean([e["invalid_attempts"] for e in games]))
    return {"games": figures}


def versus_random_player(make_env, role: str):
    """``(make_env, the first other role)``: the env of a self-play game with the random-legal-move player moving for
    ``role`` (comma-separated roles: a team game's side, e.g. ``Villager,Doctor,Detective``).

    Raises:
        ValueError: the env is not a self-play game, or ``role`` names none or every one of its roles."""
    probe = make_env().unwrapped
    if not hasattr(probe, "play_randomly"):
        raise ValueError(f"--versus_random is for self-play games (textarena:<id> with a two-agent profile), not {type(probe).__name__}")
    roles = [r.strip() for r in role.split(",") if r.strip()]
    probe.play_randomly(roles)  # checks the roles
    other = next(r for r in probe.roles if r not in roles)

    def make_versus():
        env = make_env()
        env.unwrapped.play_randomly(roles)
        return env

    return make_versus, other


def opponent(team, config: TrainConfig, make_env, versus_random: str | None, versus_checkpoint, versus_role: str | None):
    """``(make_env, perspective)``: the env and the role whose games are reported, with the other side of a self-play
    game played by the random-legal-move player (``versus_random``) or by another checkpoint's adapter
    (``versus_checkpoint``, :func:`load_opponent`); unchanged (None) without either."""
    if versus_random is not None and versus_checkpoint is not None:
        raise ValueError("--versus_random and --versus_checkpoint each pick the other side of the game: give one")
    if versus_random is not None:
        return versus_random_player(make_env, versus_random)
    if versus_checkpoint is not None:
        return make_env, load_opponent(team, config, make_env, versus_checkpoint, versus_role)
    return make_env, None


def load_opponent(team, config: TrainConfig, make_env, checkpoint: str | Path, role: str | None) -> str:
    """``role``'s adapter loaded from ``checkpoint`` (a checkpoint or a run directory of the same team: profile, base
    model and adapter shape), the other roles' kept; returns the first other role, whose games the figures are.
    ``role`` may name several roles comma-separated (a team game's side, e.g. ``Mafia`` or ``Villager,Doctor,Detective``).

    Raises:
        ValueError: not a self-play game, no role, an unknown one or every one, or a checkpoint of another team.
        FileNotFoundError: no such checkpoint.
        CheckpointError: its adapter for a role is missing, unreadable or of another shape."""

    if not hasattr(make_env().unwrapped, "play_randomly"):
        raise ValueError("--versus_checkpoint is for self-play games (textarena:<id> with a two-agent profile)")
    roles = [spec.role for spec in team.profile]
    if config.model.shared_lora:
        raise ValueError("--versus_checkpoint swaps one role's adapter, but with --shared_lora every role speaks through one")
    chosen = [r.strip() for r in (role or "").split(",") if r.strip()]
    if not chosen or any(r not in roles for r in chosen) or len(set(chosen)) == len(roles):
        raise ValueError(f"--versus_role must name one or more of {roles}, not all (the roles that play from --versus_checkpoint, "
                         f"comma-separated), got {role!r}")
    other_config, found = checkpoint_config(checkpoint)
    differs = team_differences(asdict(other_config.model), config.model)
    if differs:
        raise ValueError(f"--versus_checkpoint {found} is of another team ({', '.join(differs)} differ)")
    for name in dict.fromkeys(chosen):
        load_role_adapter(team, name, found)
    return next(r for r in roles if r not in chosen)


def role_stats(transcripts: list[dict], roles: Sequence[str]) -> dict[str, dict[str, float]]:
    """Per role: its turns, their mean length in words and characters, and the share of empty replies."""
    stats = {}
    for role in roles:
        texts = [turn["text"] for episode in transcripts for step in episode["steps"] for turn in step if turn["role"] == role]
        stats[role] = {
            "turns": len(texts),
            "mean_words": float(np.mean([len(t.split()) for t in texts])) if texts else math.nan,
            "mean_chars": float(np.mean([len(t) for t in texts])) if texts else math.nan,
            "empty_share": float(np.mean([not t.strip() for t in texts])) if texts else math.nan,
        }
    return stats


def _write(out: Path, summary: dict, transcripts: list[dict], greedy_transcripts: list[dict] | None = None) -> None:
    """``summary.json``, ``transcripts.jsonl`` and (``--greedy``) ``greedy_transcripts.jsonl`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    for name, episodes in (("transcripts.jsonl", transcripts), ("greedy_transcripts.jsonl", greedy_transcripts)):
        if episodes is None:
            continue
        with (out / name).open("w", encoding="utf-8") as file:
            for episode in episodes:
                file.write(json.dumps(episode) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    logger.info("evaluation written to %s", out)
