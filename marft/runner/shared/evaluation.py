"""Held-out evaluation: the team plays whole episodes on fresh envs, sampling as in training, turn by turn with
the same :func:`~marft.runner.shared.turns.play_team_step` as the rollout."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from tqdm import tqdm

from marft.agents.team import AgentTeam
from marft.distributed import SINGLE, Distributed
from marft.envs.base import PRIVATE_KEY, TASK_INDEX
from marft.runner.shared.turns import play_team_step

GAME_FIELDS = ("outcome", "seat", "invalid_move", "invalid_attempts", "outcome_by_role", "reward_by_role", "side_by_role", "game_moves",
               "invalid_by", "invalid_roles")
"""Final-step info a game env reports (win / draw / loss, the agent's seat, an invalid move that ended the game, the
invalid moves the game forgave, every move of the game in order, both players' and the forgiven attempts; in
self-play each role's outcome and reward, and the roles whose invalid move cost the game or, in a team game, a
player): kept in transcripts."""


def evaluate_episodes(team: AgentTeam, make_env: Callable, n_episodes: int, seed: int, n_eval_threads: int, diagnostics,
                      dist: Distributed = SINGLE, progress: bool = False) -> tuple[dict[str, float], list[dict]]:
    """Play held-out episodes with the current team (sampling as in training).

    Environments that set ``num_tasks`` are evaluated on tasks ``k % num_tasks``
    for episodes ``k = 0..n-1`` (more episodes than problems revisit them with fresh samples,
    which lowers the variance of the estimate); others on episodes seeded ``seed + 1_000_000 + k``. Returns ``accuracy`` (share of episodes
    whose last step was correct, when the env reports ``correct``) and mean team ``return``.
    With P processes, rank r plays episodes ``k = r, r + P, ...`` and the results are summed over processes.
    Also returns this process's episodes as transcripts (every turn with its speaking role). ``progress``: a
    progress bar over the episodes.
    """
    probe = make_env()
    episodes = list(range(n_episodes))[dist.rank :: dist.world_size]
    envs = [probe] + [make_env() for _ in range(min(n_eval_threads, len(episodes)) - 1)]
    returns, correct, transcripts = [], [], []
    diagnostics.reset("eval")
    bar = tqdm(total=len(episodes), desc="eval", unit="episode", dynamic_ncols=True, disable=not progress or None)
    for first in range(0, len(episodes), len(envs)):
        batch = episodes[first : first + len(envs)]
        obs, infos = zip(*[
            env.reset(seed=seed + 1_000_000 + k, options={TASK_INDEX: k % env.unwrapped.num_tasks} if env.unwrapped.num_tasks else None)
            for env, k in zip(envs, batch)
        ])
        obs = list(obs)
        live = list(range(len(batch)))
        ep_return = np.zeros(len(batch))
        last_correct = np.zeros(len(batch))
        last_game = [{} for _ in batch]  # a game's final outcome, seat and invalid move (TextArena envs)
        private = [info[PRIVATE_KEY] for info in infos]
        turns = [[] for _ in batch]  # per episode, every step's turns with the speaking role
        while live:
            bases = [envs[i].unwrapped for i in live]
            play_team_step(team, bases, [obs[i] for i in live], [private[i] for i in live])
            diagnostics.count_step([base.turns for base in bases], evaluation=True)
            still_live = []
            for base, i in zip(bases, live):
                turns[i].append([{"role": role, "text": text} for role, text in base.spoken_turns()])
                obs[i], rewards, terminated, truncated, info = envs[i].step(base.turn_actions())
                private[i] = info[PRIVATE_KEY]
                ep_return[i] += float(np.mean(rewards))
                last_correct[i] = float(info.get("correct", 0.0))
                last_game[i] = {key: info[key] for key in GAME_FIELDS if key in info}
                if not (terminated or truncated):
                    still_live.append(i)
            live = still_live
        returns.extend(ep_return.tolist())
        correct.extend(last_correct.tolist())
        transcripts.extend(
            {"episode": k, "task": k % envs[i].unwrapped.num_tasks if envs[i].unwrapped.num_tasks else None,
             "problem": envs[i].unwrapped.episode.problem, "steps": turns[i], "return": float(ep_return[i]), "correct": bool(last_correct[i]),
             **last_game[i]}
            for i, k in enumerate(batch)
        )
        bar.update(len(batch))
    bar.close()
    if dist.enabled:
        total_correct, total_return, count = dist.sum_floats([sum(correct), sum(returns), len(returns)])
        return {"accuracy": total_correct / count, "return": total_return / count, "episodes": int(count)}, transcripts
    return {"accuracy": float(np.mean(correct)), "return": float(np.mean(returns)), "episodes": len(returns)}, transcripts
