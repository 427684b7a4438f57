"""``TextVectorEnv``: several text environments stepped together in one process, as a gymnasium ``VectorEnv``.

It follows gymnasium's vector API with same-step autoreset (``AutoresetMode.SAME_STEP``):
``step`` returns ``(obs, rewards, terminated, truncated, infos)``; an env that finishes is reset in
the same call, its last observation and info go to ``infos["final_obs"]`` and ``infos["final_info"]``,
and infos are gymnasium's dict of per-env arrays with ``_key`` masks. Rewards have one column per agent.

gymnasium's own ``SyncVectorEnv`` cannot hold per-agent rewards (it stores one float per env), and
``AsyncVectorEnv`` returns stale strings for ``Text`` observations in shared memory; generation
dominates the cost anyway, so the envs are stepped one after another in this process.
Each env may be wrapped (e.g. ``gymnasium.wrappers.TimeLimit``): what the team needs from an env
(its roles, what each agent alone sees) comes through the wrapper's attributes and ``info``.
An env whose grading is slow may define ``pregrade(replies)``: ``step`` hands every env its replies
that way first (``CodeEnv`` starts its sandboxes in a pool), then steps them one by one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, VectorEnv

from marft.envs.base import PRIVATE_KEY, MultiAgentTextEnv


def batch_text_space(space: spaces.Space, n: int) -> spaces.Space:
    """gymnasium's ``batch_space`` layout for Text spaces and Tuples of them (a Tuple of per-space Tuples of ``n``),
    with every env's entry the one space object: ``batch_space`` deep-copies a Text space per env (its charset
    makes that about a second per copy), and these spaces are only described, never sampled."""
    if isinstance(space, spaces.Tuple):
        return spaces.Tuple([batch_text_space(sub, n) for sub in space.spaces])
    return spaces.Tuple([space] * n)


class TextVectorEnv(VectorEnv):
    """``num_envs`` copies of a ``MultiAgentTextEnv`` (possibly wrapped) with the same team.

    Args:
        env_fns: one constructor per environment.
    """

    metadata = {"autoreset_mode": AutoresetMode.SAME_STEP}

    def __init__(self, env_fns: Sequence[Callable[[], gym.Env]]):
        if not env_fns:
            raise ValueError("TextVectorEnv needs at least one environment")
        self.envs: list[gym.Env] = [fn() for fn in env_fns]
        self.num_envs: int = len(self.envs)
        self.roles: tuple[str, ...] = self.envs[0].unwrapped.roles
        self.n_agents: int = len(self.roles)
        for env in self.envs:
            if env.unwrapped.roles != self.roles:
                raise ValueError(f"all envs need the same roles; got {env.unwrapped.roles} and {self.roles}")
        self.single_observation_space = self.envs[0].observation_space
        self.single_action_space = self.envs[0].action_space
        self.observation_space = batch_text_space(self.single_observation_space, self.num_envs)
        self.action_space = batch_text_space(self.single_action_space, self.num_envs)
        self.private_observations: list[tuple[str, ...]] = [("",) * self.n_agents] * self.num_envs
        """``(num_envs, n_agents)`` what each agent alone sees in each env's current state (from the last infos)."""

    @property
    def n_envs(self) -> int:
        """Alias of ``num_envs`` (the runner's name for it)."""
        return self.num_envs

    @property
    def num_tasks(self) -> int | None:
        """The envs' ``num_tasks`` (how many tasks the reset option ``task_index`` chooses from; None: no task list)."""
        return self.envs[0].unwrapped.num_tasks

    def reset(self, *, seed: int | list[int | None] | None = None, options: dict | list[dict | None] | None = None) -> tuple[tuple[str, ...], dict]:
        """Reset every env; with an int ``seed``, env ``k`` gets ``seed + k``; ``options`` go to every env, or,
        as a list, ``options[k]`` to env ``k`` (e.g. one ``task_index`` per env).

        Returns:
            obs (tuple[str, ...]): ``num_envs`` first observations.
            infos (dict): gymnasium's vector infos of the reset infos (``private_observations`` among them).
        """
        seeds = [None if seed is None else seed + k for k in range(self.num_envs)] if not isinstance(seed, list) else seed
        per_env = options if isinstance(options, list) else [options] * self.num_envs
        if len(per_env) != self.num_envs:
            raise ValueError(f"expected options for {self.num_envs} envs, got {len(per_env)}")
        observations, infos = [], {}
        for k, (env, env_seed) in enumerate(zip(self.envs, seeds)):
            obs, info = env.reset(seed=env_seed, options=per_env[k])
            observations.append(obs)
            infos = self._add_info(infos, info, k)
        self._remember_private(infos)
        return tuple(observations), infos

    def step(
        self, actions: Sequence[Sequence[str] | None], active: np.ndarray | None = None
    ) -> tuple[tuple[str, ...], np.ndarray, np.ndarray, np.ndarray, dict]:
        """Step every env with its team's replies; reset the ones that finish (same-step autoreset).

        Args:
            actions: shape ``(num_envs, n_agents)``: ``actions[k][i]`` is agent ``i``'s reply in env ``k``; None for
                an env whose replies came turn by turn (``take_turn``): it grades its ``turn_actions()``.
            active: ``(num_envs,)`` bool, the envs to step (None: all); the others are left as they are
                (their action is ignored, reward 0, neither terminated nor truncated, the same observation).

        Returns:
            obs (tuple[str, ...]): ``num_envs`` observations; for a finished env, the first observation of its new episode.
            rewards (np.ndarray): float32 ``(num_envs, n_agents)``.
            terminated (np.ndarray): bool ``(num_envs,)``, the episode ended for good.
            truncated (np.ndarray): bool ``(num_envs,)``, the episode was cut short (bootstrap from ``final_obs``).
            infos (dict): gymnasium vector infos: each step info key as a per-env array with a ``_key`` mask;
                for finished envs ``final_obs`` and ``final_info`` (the last step's info), and the new
                episode's reset info in place of the step info.
        """
        if len(actions) != self.num_envs:
            raise ValueError(f"expected actions for {self.num_envs} envs, got {len(actions)}")
        stepped = np.ones(self.num_envs, dtype=bool) if active is None else np.asarray(active, dtype=bool)
        actions = [env.unwrapped.turn_actions() if team_actions is None and go else team_actions
                   for env, team_actions, go in zip(self.envs, actions, stepped)]
        for env, team_actions, go in zip(self.envs, actions, stepped):  # start every env's slow grading at once (e.g. sandboxes)
            pregrade = getattr(env.unwrapped, "pregrade", None)
            if pregrade is not None and go:
                pregrade(tuple(team_actions))
        observations, infos = [], {}
        rewards = np.zeros((self.num_envs, self.n_agents), dtype=np.float32)  # (num_envs, n_agents)
        terminated = np.zeros(self.num_envs, dtype=bool)
        truncated = np.zeros(self.num_envs, dtype=bool)
        for k, (env, team_actions) in enumerate(zip(self.envs, actions)):
            if not stepped[k]:
                observations.append(env.unwrapped.episode.history)
                continue
            obs, reward, terminated[k], truncated[k], info = env.step(tuple(team_actions))
            rewards[k] = reward
            if terminated[k] or truncated[k]:
                infos = self._add_info(infos, {"final_obs": obs, "final_info": info}, k)
                obs, info = env.reset()
            infos = self._add_info(infos, info, k)
            observations.append(obs)
        self._remember_private(infos)
        return tuple(observations), rewards, terminated, truncated, infos

    @property
    def bases(self) -> list[MultiAgentTextEnv]:
        """The unwrapped envs (where the turn-by-turn methods live: ``speakers``, ``take_turn``, ...)."""
        return [env.unwrapped for env in self.envs]

    def set_workflow(self, workflow) -> None:
        """Every env plays team steps by ``workflow`` (:meth:`MultiAgentTextEnv.set_workflow`)."""
        for env in self.bases:
            env.set_workflow(workflow)

    def _remember_private(self, infos: dict) -> None:
        given = infos.get(f"_{PRIVATE_KEY}", np.zeros(self.num_envs, dtype=bool))
        for k, text in enumerate(infos.get(PRIVATE_KEY, [None] * self.num_envs)):
            if given[k] or PRIVATE_KEY not in infos:  # envs left out of this step keep what they had
                self.private_observations[k] = tuple(text) if text is not None else ("",) * self.n_agents

    def state_dict(self) -> list[dict]:
        """Per env, its :meth:`MultiAgentTextEnv.state_dict` (RNG, current episode, counters)."""
        return [env.unwrapped.state_dict() for env in self.envs]

    def load_state_dict(self, states: list[dict]) -> tuple[str, ...]:
        """Restore every env from :meth:`state_dict`; return the ``num_envs`` current observations."""
        if len(states) != self.num_envs:
            raise ValueError(f"saved states of {len(states)} envs, but there are {self.num_envs}")
        for k, (env, state) in enumerate(zip(self.envs, states)):
            base: MultiAgentTextEnv = env.unwrapped
            base.load_state_dict(state)
            self.private_observations[k] = tuple(base.private_observations())
        return tuple(env.unwrapped.episode.history for env in self.envs)

    def failures(self) -> int:
        """Steps, over all envs, whose reward could not be computed (graded 0)."""
        return sum(int(getattr(env.unwrapped, name, 0)) for env in self.envs for name in env.unwrapped.failure_counters)

    def close_extras(self, **kwargs) -> None:
        """Close every env (gymnasium's ``close`` calls this once)."""
        for env in self.envs:
            env.close()
