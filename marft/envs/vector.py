"""``TextVectorEnv``: several text environments stepped together in one process.

gymnasium's ``AsyncVectorEnv`` returns stale strings for ``Text`` observations in shared
memory, and its default autoreset ignores the action after ``done``; generation dominates
the cost anyway, so a plain list of envs is enough. A finished env is reset inside the
same ``step`` call (same-step autoreset).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from marft.envs.base import MultiAgentTextEnv


class TextVectorEnv:
    """``n_envs`` copies of a ``MultiAgentTextEnv`` with the same team.

    Args:
        env_fns: one constructor per environment.
    """

    def __init__(self, env_fns: Sequence[Callable[[], MultiAgentTextEnv]]):
        if not env_fns:
            raise ValueError("TextVectorEnv needs at least one environment")
        self.envs: list[MultiAgentTextEnv] = [fn() for fn in env_fns]
        self.n_envs: int = len(self.envs)
        self.n_agents: int = self.envs[0].n_agents
        self.roles: tuple[str, ...] = self.envs[0].roles
        for env in self.envs:
            if env.roles != self.roles:
                raise ValueError(f"all envs need the same roles; got {env.roles} and {self.roles}")
        self.terminated = np.zeros(self.n_envs, dtype=bool)
        """``(n_envs,)`` terminated flags of the last ``step``."""
        self.truncated = np.zeros(self.n_envs, dtype=bool)
        """``(n_envs,)`` truncated flags of the last ``step``."""

    def reset(self, seed: int | None = None) -> tuple[list[str], list[dict]]:
        """Reset every env; env ``k`` gets ``seed + k`` (or ``None``).

        Returns:
            obs (list[str]): ``n_envs`` first observations.
            infos (list[dict]): ``n_envs`` reset infos.
        """
        results = [env.reset(seed=None if seed is None else seed + k) for k, env in enumerate(self.envs)]
        return [obs for obs, _ in results], [info for _, info in results]

    def step(self, actions: Sequence[Sequence[str]]) -> tuple[list[str], np.ndarray, np.ndarray, list[dict]]:
        """Step every env with its team's replies; reset the ones that finish.

        Args:
            actions: shape ``(n_envs, n_agents)``: ``actions[k][i]`` is agent ``i``'s reply in env ``k``.

        Returns:
            obs (list[str]): ``n_envs`` observations; for a finished env, the first
                observation of its new episode.
            rewards (np.ndarray): float32 ``(n_envs, n_agents)``.
            dones (np.ndarray): bool ``(n_envs,)``, terminated or truncated.
            infos (list[dict]): per env the step info plus ``terminated`` and ``truncated``;
                a finished env's info also has ``final_observation``, ``final_info`` (the
                step's) and ``reset_info`` (the new episode's).
        """
        if len(actions) != self.n_envs:
            raise ValueError(f"expected actions for {self.n_envs} envs, got {len(actions)}")
        observations, infos = [], []
        rewards = np.zeros((self.n_envs, self.n_agents), dtype=np.float32)  # (n_envs, n_agents)
        for k, (env, team_actions) in enumerate(zip(self.envs, actions)):
            obs, reward, terminated, truncated, info = env.step(tuple(team_actions))
            rewards[k] = reward
            self.terminated[k], self.truncated[k] = terminated, truncated
            info = {**info, "terminated": terminated, "truncated": truncated}
            if terminated or truncated:
                final_obs, final_info = obs, dict(info)
                obs, reset_info = env.reset()
                info.update(final_observation=final_obs, final_info=final_info, reset_info=reset_info)
            observations.append(obs)
            infos.append(info)
        dones = self.terminated | self.truncated  # (n_envs,)
        return observations, rewards, dones, infos

    def state_dict(self) -> list[dict]:
        """Per env, its :meth:`MultiAgentTextEnv.state_dict` (RNG, current episode, counters)."""
        return [env.state_dict() for env in self.envs]

    def load_state_dict(self, states: list[dict]) -> list[str]:
        """Restore every env from :meth:`state_dict`; return the ``n_envs`` current observations."""
        if len(states) != self.n_envs:
            raise ValueError(f"saved states of {len(states)} envs, but there are {self.n_envs}")
        for env, state in zip(self.envs, states):
            env.load_state_dict(state)
        return [env.episode.history for env in self.envs]

    def failures(self) -> int:
        """Steps, over all envs, whose reward could not be computed (graded 0)."""
        return sum(int(getattr(env, name, 0)) for env in self.envs for name in env.failure_counters)

    def close(self) -> None:
        """Close every env."""
        for env in self.envs:
            env.close()
