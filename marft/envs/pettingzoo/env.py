"""Every marft environment as a PettingZoo environment, for multi-agent RL code that speaks PettingZoo's API.

    >>> from marft.envs.pettingzoo.env import aec_env
    >>> env = aec_env("relay_sum", split="test")          # a registered name, an import path, or an env instance
    >>> env.reset(seed=0)
    >>> for agent in env.agent_iter():
    ...     observation, reward, terminated, truncated, info = env.last()
    ...     env.step(None if terminated or truncated else "\\\\boxed{7}")

* **AEC** (:class:`TextAECEnv`, any workflow): ``agent_selection`` is the agent that speaks now (``env.speakers()``:
  in profile order, a DAG's layers one node after another, or whom the orchestrator called); each agent observes
  its own view — its private observation, then the shared history and this step's turns it may see — and acts with
  one reply. When the team step is complete the env judges it and every agent gets its own reward; the episode's
  end terminates (or truncates) every agent.
* **Parallel** (:class:`TextParallelEnv`): for workflows where every agent acts at once (a graph of one layer:
  nodes without edges), ``step({agent: reply})`` is one team step.

Agents are named by their roles. Observations are ``numpy.str_`` (a ``str`` subclass: every string operation
works) in a :class:`TextSpace`, a gymnasium ``Text`` space whose dtype is "unicode of any length", so PettingZoo's
``api_test`` can check observations against their space. Actions are plain strings.

PettingZoo is optional: ``pip install "marft[games]"``.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from gymnasium import spaces

from marft.envs import make
from marft.envs.base import WIDE_CHARSET, CustomEnv
from marft.envs.workflows import workflow_for
from marft.prompting import format_conversation, format_private

PETTINGZOO_MISSING = 'PettingZoo is not installed: pip install "marft[games]" (or pip install pettingzoo==1.27.0)'


def _pettingzoo():
    try:
        import pettingzoo
    except ImportError as error:
        raise ImportError(PETTINGZOO_MISSING) from error
    return pettingzoo


class UnicodeDType:
    """The dtype of a space of texts of any length: equal to every NumPy unicode dtype (``<U1``, ``<U300`` ...)."""

    kind = "U"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, UnicodeDType):
            return True
        try:
            return np.dtype(other).kind == "U"  # type: ignore[arg-type]
        except TypeError:
            return False

    def __hash__(self) -> int:
        return hash("U")

    def __repr__(self) -> str:
        return "UnicodeDType()"


class TextSpace(spaces.Text):
    """A gymnasium ``Text`` space over marft's wide character set whose ``dtype`` matches ``numpy.str_`` texts."""

    def __init__(self, max_length: int):
        super().__init__(max_length=max_length, min_length=0, charset=WIDE_CHARSET)

    @property
    def dtype(self):
        return UnicodeDType()

    @dtype.setter
    def dtype(self, value) -> None:  # gymnasium's Space.__init__ assigns one; texts of any length are one dtype
        pass


def _as_env(env: CustomEnv | str, workflow: str | None, default_workflow: str, kwargs: dict) -> CustomEnv:
    """The env (built from its name with ``kwargs``), playing ``workflow`` (:func:`workflow_for` of its profile).

    An env built from a name plays ``workflow or default_workflow``; an instance keeps the workflow it has unless
    ``workflow`` is given. Envs without a ``profile`` attribute (a list of ``AgentSpec``) keep their own."""
    if isinstance(env, CustomEnv):
        if kwargs:
            raise ValueError("keyword arguments build an env from its name; pass either an env instance or a name")
    else:
        env, workflow = make(env, **kwargs), workflow or default_workflow
    if workflow is not None and getattr(env, "profile", None):
        env.set_workflow(workflow_for(env.profile, workflow))
    return env


def agent_view(env: CustomEnv, agent: int, private: tuple[str, ...]) -> np.str_:
    """What ``agent`` sees now: its private observation, the shared history and this step's turns visible to it."""
    return np.str_(format_private(private[agent]) + format_conversation(env.episode.history, env.visible_turns(agent)))


class _RoleAgents:
    """What the AEC and the parallel env share: agents named by the env's roles, a text space per agent."""

    def _init_agents(self, env: CustomEnv, max_reply_chars: int | None) -> None:
        if len(set(env.roles)) != len(env.roles):
            raise ValueError(f"PettingZoo names agents by role: the roles {list(env.roles)} must be distinct")
        self.possible_agents = list(env.roles)
        self.observation_spaces = {a: TextSpace(env.max_observation_length) for a in self.possible_agents}
        self.action_spaces = {a: TextSpace(max_reply_chars or env.max_action_length) for a in self.possible_agents}
        self._private: tuple[str, ...] = ("",) * env.n_agents
        self.agents: list[str] = []

    def observation_space(self, agent: str) -> spaces.Space:
        return self.observation_spaces[agent]

    def action_space(self, agent: str) -> spaces.Space:
        return self.action_spaces[agent]

    def state(self) -> np.str_:
        """The global view a centralized critic gets (the env's ``state()``)."""
        return np.str_(self.env.state())

    def render(self) -> None:
        return None

    def close(self) -> None:
        self.env.close()


# long function: the class is defined on first use, so that PettingZoo is imported only then
@functools.cache
def _aec_class():
    """:class:`TextAECEnv`'s class, built on first use (PettingZoo is imported only then)."""
    AECEnv = _pettingzoo().AECEnv

    class TextAECEnv(_RoleAgents, AECEnv):
        """A marft environment as a PettingZoo AEC environment (see the module's docstring).

        Args:
            env: a :class:`CustomEnv` or a name / import path for :func:`marft.envs.make`.
            workflow: ``auto``, ``sequential``, ``graph`` or ``orchestrated`` (as ``--workflow``); default: ``auto``
                for an env built from its name, the workflow an env instance has.
            max_reply_chars: the declared length bound of an action (default: the env's ``max_action_length``).
            **kwargs: passed to :func:`marft.envs.make` when ``env`` is a name.
        """

        metadata = {"name": "marft_text_v0", "render_modes": [], "is_parallelizable": False}

        def __init__(self, env: CustomEnv | str, workflow: str | None = None, max_reply_chars: int | None = None,
                     **kwargs):
            super().__init__()
            self.env = _as_env(env, workflow, "auto", kwargs)
            self._init_agents(self.env, max_reply_chars)

        def reset(self, seed: int | None = None, options: dict | None = None) -> None:
            _, info = self.env.reset(seed=seed, options=options)
            self._private = tuple(info["private_observations"])
            self.agents = list(self.possible_agents)
            self.rewards = {a: 0.0 for a in self.agents}
            self._cumulative_rewards = {a: 0.0 for a in self.agents}
            self.terminations = {a: False for a in self.agents}
            self.truncations = {a: False for a in self.agents}
            self.infos = {a: {} for a in self.agents}
            self.agent_selection = self.env.roles[self.env.speakers()[0]]

        def observe(self, agent: str) -> np.str_:
            return agent_view(self.env, self.env.roles.index(agent), self._private)

        def step(self, action: str | None) -> None:
            if not self.agents:
                raise RuntimeError("the episode is over and every agent has left: call reset()")
            agent = self.agent_selection
            if self.terminations[agent] or self.truncations[agent]:
                self._was_dead_step(action)
                return
            if not isinstance(action, str):
                raise TypeError(f"{agent}'s action must be its reply (a str), got {type(action).__name__}")
            self._cumulative_rewards[agent] = 0.0
            self._clear_rewards()
            self.env.take_turn(self.env.roles.index(agent), action)
            if self.env.speakers():
                self.agent_selection = self.env.roles[self.env.speakers()[0]]
                return
            _, rewards, terminated, truncated, info = self.env.step(self.env.turn_actions())
            self._private = tuple(info["private_observations"])
            step_info = {k: v for k, v in info.items() if k != "private_observations"}
            for i, name in enumerate(self.possible_agents):
                self.rewards[name] = float(rewards[i])
                self.terminations[name] = bool(terminated)
                self.truncations[name] = bool(truncated) and not terminated
                self.infos[name] = dict(step_info)
            self._accumulate_rewards()
            self.agent_selection = self.agents[0] if (terminated or truncated) else self.env.roles[self.env.speakers()[0]]

    return TextAECEnv


# long function: the class is defined on first use, as _aec_class's
@functools.cache
def _parallel_class():
    """:class:`TextParallelEnv`'s class, built on first use."""
    ParallelEnv = _pettingzoo().ParallelEnv

    class TextParallelEnv(_RoleAgents, ParallelEnv):
        """A marft environment whose workflow lets every agent act at once, as a PettingZoo parallel environment.

        Args:
            env, max_reply_chars, **kwargs: as for the AEC env.
            workflow: as for the AEC env; default ``graph`` for an env built from its name (a profile without edges
                is one layer: every agent at once).

        Raises:
            ValueError: the env's workflow has agents speak one after another (use :func:`aec_env`).
        """

        metadata = {"name": "marft_text_parallel_v0", "render_modes": []}

        def __init__(self, env: CustomEnv | str, workflow: str | None = None, max_reply_chars: int | None = None,
                     **kwargs):
            self.env = _as_env(env, workflow, "graph", kwargs)
            self.env.reset(seed=0)
            if sorted(self.env.speakers()) != list(range(self.env.n_agents)):
                raise ValueError(f"the workflow of {type(self.env).__name__} has its agents speak one after another "
                                 f"(first {[self.env.roles[a] for a in self.env.speakers()]}): use the AEC API, aec_env()")
            self._init_agents(self.env, max_reply_chars)

        def _observations(self) -> dict[str, np.str_]:
            return {a: agent_view(self.env, i, self._private) for i, a in enumerate(self.possible_agents)}

        def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
            _, info = self.env.reset(seed=seed, options=options)
            self._private = tuple(info["private_observations"])
            self.agents = list(self.possible_agents)
            return self._observations(), {a: {} for a in self.agents}

        def step(self, actions: dict[str, str]) -> tuple[dict, dict, dict, dict, dict]:
            if set(actions) != set(self.agents):
                raise ValueError(f"step() needs one reply from each of {self.agents}, got {sorted(actions)}")
            for agent in list(self.env.speakers()):
                self.env.take_turn(agent, str(actions[self.env.roles[agent]]))
            _, rewards, terminated, truncated, info = self.env.step(self.env.turn_actions())
            self._private = tuple(info["private_observations"])
            step_info = {k: v for k, v in info.items() if k != "private_observations"}
            observations = self._observations()
            out: tuple[dict[str, Any], ...] = (
                observations,
                {a: float(rewards[i]) for i, a in enumerate(self.possible_agents)},
                {a: bool(terminated) for a in self.agents},
                {a: bool(truncated) and not terminated for a in self.agents},
                {a: dict(step_info) for a in self.agents},
            )
            if terminated or truncated:
                self.agents = []
            return out

    return TextParallelEnv


def aec_env(env: CustomEnv | str, workflow: str | None = None, max_reply_chars: int | None = None, **kwargs):
    """A marft environment (an instance, or a name / import path with ``kwargs`` for :func:`marft.envs.make`) as a
    PettingZoo AEC environment. Raises ``ImportError`` with the install line when PettingZoo is missing."""
    return _aec_class()(env, workflow=workflow, max_reply_chars=max_reply_chars, **kwargs)


def parallel_env(env: CustomEnv | str, workflow: str | None = None, max_reply_chars: int | None = None, **kwargs):
    """A marft environment whose agents all act at once as a PettingZoo parallel environment (see :func:`aec_env`)."""
    return _parallel_class()(env, workflow=workflow, max_reply_chars=max_reply_chars, **kwargs)
