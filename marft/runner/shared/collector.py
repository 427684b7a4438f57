"""The rollout: the team plays this process's training envs for ``episode_length`` steps into a fresh
:class:`~marft.runner.shared.buffer.RolloutBuffer`, turn by turn (:func:`~marft.runner.shared.turns.play_team_step`), and
keeps where each env stands between rollouts (its observation, the running team return).

What the algorithm needs from the rollout (critic values, per-token values, rounds of group episodes) comes in
one :class:`RolloutNeeds`; the collector knows nothing else of the trainer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from marft.agents.team import AgentTeam
from marft.config import TrainConfig
from marft.distributed import SINGLE, Distributed
from marft.envs.base import PRIVATE_KEY, TASK_INDEX
from marft.runner.shared.buffer import RolloutBuffer
from marft.runner.shared.turns import play_team_step

FINISHED_CHARTS = {"correct": "accuracy", "invalid_move": "invalid_move_rate", "invalid_attempts": "forgiven_invalid_moves"}
"""Final-step info key of a finished episode -> the chart of its mean over the iteration's finished episodes (game
envs: ``invalid_move``, a game ended by one; ``invalid_attempts``, the invalid moves the game forgave)."""


@dataclass(frozen=True)
class RolloutNeeds:
    """What the algorithm needs the rollout to record."""

    values: bool
    """The critic values every turn (and bootstraps unfinished episodes)."""
    token_values: bool
    """The critic also values every reply token (token-level trainers)."""
    group_rounds: bool
    """Envs play rounds of whole episodes (``--horizon`` steps), each group of ``group_size`` envs on one task (GRPO;
    ``--credit_assignment own_turns``: groups of one)."""
    group_size: int = 1
    """Envs per task in a round of whole episodes."""
    turn_values: bool = True
    """With ``values``: the critic values every turn as it is played (False: the trainer values them after the
    rollout, :attr:`~marft.algorithms.appo_trainer.APPOTrainer.values_in_update`; the rollout only bootstraps)."""


class RolloutCollector:
    """Plays ``team`` on ``envs`` (this process's ``n_rollout_threads / P`` training envs, a ``TextVectorEnv``).

    Args:
        diagnostics: counts each team step's turns per role (``TeamDiagnostics``).
        poll: called before every step; it raises to abandon the rollout (a stop signal).
    """

    def __init__(self, team: AgentTeam, envs, config: TrainConfig, needs: RolloutNeeds, diagnostics, poll: Callable[[], None],
                 dist: Distributed = SINGLE):
        self.team, self.envs, self.config, self.needs, self.diagnostics, self.poll, self.dist = team, envs, config, needs, diagnostics, poll, dist
        self.obs, _ = envs.reset(seed=config.runner.seed + dist.rank * envs.n_envs)  # rank r's env k: seed + r * E/P + k
        """Each env's current observation."""
        self.episode_returns = np.zeros(envs.n_envs)
        """Each env's running team return in its current episode."""
        self.pool = None
        """``--opponent pool:K``: the :class:`~marft.runner.shared.opponent.OpponentPool` an opponent plays each game from
        (set by the runner); None: every agent plays with its own adapter."""
        self.pool_picks: list[str] | None = None
        """Per env, the snapshot its opponent plays in the current round (:meth:`start_group_round`)."""

    def collect(self, iteration: int = 0) -> tuple[RolloutBuffer, dict]:
        """Run every agent of the team for ``episode_length`` steps on all envs into a fresh buffer; returns it with
        the rollout's figures (``charts/...``; ``invalid_orchestrator_replies``: orchestrator replies with neither a
        known call nor ``<done/>``)."""
        with self.team.headers.frozen(), self.team.rollout():  # role headers run once per rollout; an engine wakes for it
            buffer, stats = self._collect(iteration)
        stats.update(self.team.rollout_figures())  # an inference engine's log-prob gap and adapter syncs (vllm)
        return buffer, stats

    def start_group_round(self, iteration: int, round_index: int) -> None:
        """Reset every env for a round of whole episodes (GRPO's groups; own_turns' games): envs ``g·G .. g·G + G - 1``
        get one task (``G``: :attr:`RolloutNeeds.group_size`), different groups different tasks (while there are enough),
        drawn from ``(seed, rank, iteration, round)`` alone, so a resumed run draws the same tasks."""
        G, E = self.needs.group_size, self.envs.n_envs
        rng = np.random.default_rng([self.config.runner.seed, self.dist.rank, iteration, round_index])
        n_tasks = self.envs.num_tasks
        tasks = rng.choice(n_tasks, size=E // G, replace=E // G > n_tasks).repeat(G)  # (E,)
        self.obs, _ = self.envs.reset(options=[{TASK_INDEX: int(task)} for task in tasks])
        self.episode_returns[:] = 0.0
        if self.pool is not None:  # each game's opponent: a snapshot drawn for it
            self.pool_picks = self.pool.draw(self.config.runner.seed, self.dist.rank, iteration, round_index, E, G)

    def opponent_adapters(self, rows) -> dict[int, list[str]] | None:
        """``--opponent pool:K``: the opponent agent's adapter in each of the envs ``rows`` (their games' snapshots);
        None without a pool."""
        return None if self.pool is None else {self.pool.opponent: [self.pool_picks[e] for e in rows]}

    def _collect(self, iteration: int) -> tuple[RolloutBuffer, dict]:
        rc, team, needs = self.config.runner, self.team, self.needs
        T, E, N, bases = rc.episode_length, self.envs.n_envs, team.n_agents, self.envs.bases  # this process's envs
        buffer = RolloutBuffer(T, E, N, team.prompts.max_prompt_len, self.config.model.max_new_tokens, team.pad_id,
                               slots_per_step=bases[0].workflow.max_turns_per_step)
        finished_returns, tokens, invalid_replies = [], 0, 0
        finished = {key: [] for key in FINISHED_CHARTS}  # final-info key -> its value in each finished episode
        horizon = self.config.env.horizon
        live = np.ones(E, dtype=bool)  # group rounds: the env's episode is still going
        start = time.perf_counter()
        for step in range(T):
            self.poll()  # a stop abandons the rollout here (the runner rewinds to the iteration's start)
            if needs.group_rounds and step % horizon == 0:  # a new round: every group starts one episode
                self.start_group_round(iteration, step // horizon)
                live[:] = True
            if not live.any():
                continue
            rows = np.flatnonzero(live)  # every env, except in a round whose episodes ended early
            # 1. the team plays one step on every env, turn by turn (the critic, if any, values each turn)
            played = play_team_step(
                team, [bases[e] for e in rows], [self.obs[e] for e in rows], [self.envs.private_observations[e] for e in rows],
                with_values=needs.values and needs.turn_values, token_values=needs.token_values, adapters=self.opponent_adapters(rows),
            )
            next_slot = np.zeros(len(rows), dtype=np.int64)  # per env, its next turn slot of this step
            for batch in played:
                buffer.insert_turn(step, batch.agent, batch.out, envs=rows[batch.rows], slots=next_slot[batch.rows], layer=batch.moment)
                next_slot[batch.rows] += 1
                tokens += int(batch.out.response_mask.sum())
            invalid_replies += self.diagnostics.count_step([bases[e].turns for e in rows])
            # 2. the envs grade the step's replies (through step(actions), so wrappers see them); finished episodes
            # restart in the same call
            actions = [bases[e].turn_actions() if live[e] else None for e in range(E)]
            self.obs, rewards, terminated, truncated, infos = self.envs.step(actions, active=None if live.all() else live)
            buffer.insert_step(step, rewards, terminated, truncated)
            if truncated.any() and needs.values:  # a truncated episode bootstraps from its final observation's value
                buffer.final_values[step] = self.final_values(infos, truncated)
            if needs.group_rounds:  # an env whose episode ended sits out the rest of its round
                live &= ~(terminated | truncated)
            self.episode_returns += np.asarray(rewards, dtype=np.float64).mean(-1)
            for e in np.flatnonzero(terminated | truncated):
                finished_returns.append(self.episode_returns[e])
                final_info = infos["final_info"]
                for key, values in finished.items():
                    if key in final_info and final_info[f"_{key}"][e]:
                        values.append(float(final_info[key][e]))
                self.episode_returns[e] = 0.0
        if needs.values and not buffer.dones[T - 1].all():  # the value of each env's next turn bootstraps unfinished episodes
            with torch.no_grad():
                buffer.values[T, :, 0] = self.first_turn_values(self.obs, self.envs.private_observations,
                                                                [base.kept_heads() for base in self.envs.bases])
        seconds = time.perf_counter() - start
        stats = {"charts/rollout_tokens_per_s": tokens / max(seconds, 1e-9), "charts/rollout_seconds": seconds}
        if finished_returns:
            stats["charts/episode_return"] = float(np.mean(finished_returns))
        stats.update({f"charts/{name}": float(np.mean(finished[key])) for key, name in FINISHED_CHARTS.items() if finished[key]})
        stats["charts/step_reward"] = float(buffer.agent_rewards.mean())
        stats["charts/truncated_episodes"] = float(buffer.truncated.sum())
        stats["invalid_orchestrator_replies"] = invalid_replies
        return buffer, stats

    @torch.no_grad()
    def first_turn_values(self, observations, private, heads=None) -> torch.Tensor:
        """``(B,)`` the critic's value of each observation as the first turn of a team step (its workflow's first
        speaker: agent 0 in profile order, the orchestrator when there is one); ``heads``: per env, its
        ``kept_heads()`` (None: none, for final observations, whose env has moved on)."""
        first = self.envs.bases[0].workflow.first_speaker
        prompt_ids, prompt_mask = self.team.encode_prompts(first, list(observations), [[] for _ in observations], [texts[first] for texts in private],
                                                           None if heads is None else [texts[first] for texts in heads])
        return self.team.critic.values(prompt_ids, prompt_mask, agent=first).float().cpu()

    @torch.no_grad()
    def final_values(self, infos: dict, truncated: np.ndarray) -> torch.Tensor:
        """``(E,)`` the critic's value of each truncated episode's final observation (as the first turn that never
        came), 0 for the other envs."""
        rows = np.flatnonzero(truncated)
        values = torch.zeros(len(truncated))
        values[torch.as_tensor(rows)] = self.first_turn_values(
            [infos["final_obs"][e] for e in rows], [infos["final_info"][PRIVATE_KEY][e] for e in rows]
        )
        return values
