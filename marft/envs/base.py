"""The base classes of marft environments: a team of text agents taking turns on one task.

* :class:`CustomEnv` — the class the specification names: subclass it and write ``__init__``, ``reset``,
  ``transition`` (and ``step`` only to add to it), for an env with state of its own (a multi-turn game, a tool).
* :class:`MultiAgentTextEnv` — a :class:`CustomEnv` with ``reset`` and ``transition`` written: subclass it and write
  two hooks instead, for "draw a task, grade the replies".

One *team step* takes one reply from every agent (in profile order, or as the env's workflow says: a graph,
an orchestrator, see :mod:`marft.envs.workflows`). The observation is the shared history as text (see ``marft.prompting``)::

    Problem: <problem>
    <Role 1>: <reply>          # step 1
    <Role 2>: <reply>
    Judge: <feedback>          # only when the episode goes on
    <Role 1>: <reply>          # step 2
    ...

Subclasses implement two hooks:

* ``sample_task(options) -> {"problem": str, "answer": str, ...}`` drawing with ``self.np_random``
  (an env with a finite task list also sets ``num_tasks`` and honours ``options["task_index"]``
  through :meth:`MultiAgentTextEnv.choose_task`: evaluation walks through the tasks that way, and
  group-relative training resets a group of envs on one task);
* ``evaluate(state, actions) -> StepOutcome``: per-agent rewards, whether the task is solved,
  and the judge feedback to show if the episode continues.

``transition(state, actions)`` is a pure function of an immutable ``EpisodeState`` and the
replies; ``step`` only stores its result. ``state()`` is the global view for a centralized critic.

What only one agent may see (``private_observations()``) travels in every ``info`` under
``"private_observations"`` (one text per agent), so gymnasium wrappers and vector envs pass it on.

Turn by turn: ``speakers()`` says who speaks now, ``visible_turns(agent)`` what that agent sees of the step
so far, ``take_turn(agent, reply)`` records a reply; once ``speakers()`` is empty, ``step(turn_actions())``
grades the step (its history then holds the turns as they were taken). ``step(actions)`` with a whole team's
replies at once is the sequential workflow's step, as before.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from marft.envs.workflows import StepTurns, Workflow, sequential
from marft.prompting import JUDGE_ROLE, format_problem, format_turn

logger = logging.getLogger(__name__)

TASK_INDEX = "task_index"
"""The one ``reset`` option that picks a task: ``env.reset(options={"task_index": i})``, 0 <= i < ``env.num_tasks``."""

PRIVATE_KEY = "private_observations"
"""The ``info`` key under which every reset and step returns what each agent alone sees (a tuple of texts)."""

WIDE_CHARSET = "".join(chr(c) for c in range(0x10000) if not 0xD800 <= c < 0xE000)
"""Every character of the Unicode Basic Multilingual Plane except surrogates: ASCII with spaces,
newlines, backslashes and braces, accented/Greek/Cyrillic/CJK letters, math symbols.
(Characters beyond U+FFFF, e.g. emoji, are outside the declared space; nothing enforces it.)"""


@functools.cache
def _text_space_template(max_length: int) -> spaces.Text:
    return spaces.Text(max_length=max_length, min_length=0, charset=WIDE_CHARSET)


def text_space(max_length: int) -> spaces.Text:
    """A ``Text`` space over ``WIDE_CHARSET`` with lengths ``0..max_length``.

    Building one takes ~0.1 s, so a cached template is shallow-copied (its character
    tables are shared, read-only) and given its own random generator.
    """
    space = copy.copy(_text_space_template(max_length))
    space.seed()
    return space


@dataclass(frozen=True)
class StepOutcome:
    """What ``evaluate`` says about one team step."""

    rewards: tuple[float, ...]
    """One reward per agent, in profile order."""
    solved: bool
    """The task is done; the episode terminates."""
    feedback: str = ""
    """Judge text appended to the history when the episode goes on ("" for none)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Extra entries for the step's ``info`` (e.g. ``correct``)."""


@dataclass(frozen=True)
class EpisodeState:
    """Where an episode stands; immutable, so ``transition`` cannot change its input."""

    problem: str
    """The task text."""
    answer: str
    """The hidden reference answer (never shown to the agents)."""
    history: str
    """The observation: problem line plus all finished turns."""
    step: int = 0
    """Team steps taken so far."""
    terminated: bool = False
    """The episode is over: the last step solved the task or used the last of ``horizon`` attempts."""
    truncated: bool = False
    """The episode was cut short from outside the task (never set by the base class; see ``step``)."""
    outcome: StepOutcome | None = None
    """``evaluate``'s verdict on the last step (``None`` right after reset)."""

    @property
    def done(self) -> bool:
        """The episode is over (terminated or truncated)."""
        return self.terminated or self.truncated


class CustomEnv(gym.Env):
    """The env users subclass, as the specification says: ``__init__``, ``reset``, ``step`` and ``transition``.

    Its action is a tuple of ``n_agents`` replies and its observation the shared history as text. Write:

    * ``__init__(...)``: call ``super().__init__(roles, horizon)`` first.
    * ``reset(*, seed=None, options=None)``: call ``super().reset(seed=seed)`` (it seeds ``self.np_random``), draw
      the episode's start with ``self.np_random`` and ``return self.start(state)``. ``state`` is an
      :class:`EpisodeState`, or a frozen dataclass subclass of it holding the env's own fields.
    * ``transition(state, actions, turns=None)``: pure (``state`` is immutable; draw nothing random): the next
      state. Judge ``actions`` (one reply per agent), then ``return self.advance(state, actions, outcome, turns,
      **your_fields)``: it writes the turns into the history, counts the step and ends the episode when the outcome
      solved it or the horizon is used up.
    * ``step(actions)`` is written: it applies ``transition`` to the current state (after a workflow's turns) and
      returns gymnasium's five values. Override it only to add to it, through ``super().step(actions)``.

    ``private_observations``, ``kept_heads`` and ``num_tasks`` are optional, as in :class:`MultiAgentTextEnv`,
    and ``state_dict`` checkpoints the episode exactly when its fields are JSON-safe.

    Args:
        roles: the agents' role names, in speaking order.
        horizon: team steps (attempts) per episode; the episode terminates after the last one.
    """

    metadata = {"render_modes": []}
    max_observation_length = 1 << 22
    """Declared bound on the history length (characters)."""
    max_action_length = 1 << 17
    """Declared bound on one reply's length (characters)."""
    failure_counters: tuple[str, ...] = ("reward_failures",)
    """Attributes counting replies whose reward could not be computed (given reward 0); the runner logs their sum."""

    def __init__(self, roles: Sequence[str], horizon: int = 1):
        if not roles:
            raise ValueError("an environment needs at least one agent role")
        if horizon < 1:
            raise ValueError(f"horizon must be >= 1, got {horizon}")
        self.roles: tuple[str, ...] = tuple(roles)
        self.n_agents: int = len(self.roles)
        self.horizon: int = int(horizon)
        self.observation_space = text_space(self.max_observation_length)
        action_text = text_space(self.max_action_length)
        self.action_space = spaces.Tuple([action_text] * self.n_agents)
        self.episode: EpisodeState | None = None
        self.reward_failures = 0  # steps whose ``evaluate`` raised (reward 0, logged)
        self.workflow: Workflow = sequential(self.roles)
        """Who speaks when within a team step (:mod:`marft.envs.workflows`); the runner sets the profile's (:meth:`set_workflow`)."""
        self.turns: StepTurns = self.workflow.start()
        """The team step in progress, turn by turn."""

    num_tasks: int | None = None
    """How many tasks the env holds (a subclass with a task list sets it, e.g. as a property); None: tasks
    are generated without a list, and the ``task_index`` option is not supported."""

    def choose_task(self, options: dict | None) -> int:
        """The index of the task to play: ``options["task_index"]`` when given, else one drawn with ``self.np_random``.

        Raises:
            IndexError: the given index is not in ``range(num_tasks)``.
        """
        n = self.num_tasks
        if n is None:
            raise TypeError(f"{type(self).__name__} sets no num_tasks, so it cannot choose a task by index")
        if options and TASK_INDEX in options:
            index = int(options[TASK_INDEX])
            if not 0 <= index < n:
                raise IndexError(f"{TASK_INDEX} {index} out of range for {n} tasks")
            return index
        return int(self.np_random.integers(n))

    def private_observations(self) -> list[str]:
        """What each agent alone sees in the current state, one text per agent ("" = nothing).

        The team puts agent i's text right after its role header. Override it for partially
        observable tasks (e.g. a key only the first agent knows); the default shares everything.
        """
        return [""] * self.n_agents

    def kept_heads(self) -> list[str]:
        """Per agent, the text its prompt's observation opens with (its private observation when it has one, else
        the shared history) that a prompt cut to the context window keeps whole, e.g. a game's rules: the oldest
        text after it goes first. "" (the default): the oldest text goes first, the problem's opening included.
        A head longer than half of the prompt's room is cut like the rest. (The critic's value of the last
        observation of an episode cut short by ``truncated`` cuts it plainly: the env has moved on by then.)"""
        return [""] * self.n_agents

    # ---- the episode

    def advance(self, state: EpisodeState, actions: Sequence[str], outcome: StepOutcome,
                turns: Sequence[tuple[str, str]] | None = None, **changes) -> EpisodeState:
        """The state after a team step that ``outcome`` judged: ``state`` with every agent's turn appended to the
        history (``turns``, as a workflow took them, host lines included; None: ``actions`` in profile order), the
        judge's feedback when the episode goes on, ``step + 1``, terminated when the outcome solved the task or the
        last of ``horizon`` steps was taken, the outcome, and ``changes`` (an env's own fields). Pure.

        Raises:
            ValueError: the outcome has not one reward per agent.
        """
        if len(outcome.rewards) != self.n_agents:
            raise ValueError(f"{type(self).__name__} returned {len(outcome.rewards)} rewards for {self.n_agents} agents "
                             "(evaluate's or transition's outcome needs one per agent)")
        spoken = zip(self.roles, actions) if turns is None else turns
        history = state.history + "".join(format_turn(role, text) for role, text in spoken)
        step = state.step + 1
        # The horizon is part of the task (the team gets ``horizon`` attempts), so running out of
        # attempts terminates the episode; ``truncated`` is left for outside time limits.
        terminated = bool(outcome.solved) or step >= self.horizon
        truncated = False
        if not (terminated or truncated) and outcome.feedback:
            history += format_turn(JUDGE_ROLE, outcome.feedback)
        return replace(state, history=history, step=step, terminated=terminated, truncated=truncated, outcome=outcome,
                       **changes)

    def start(self, state: EpisodeState, info: dict | None = None) -> tuple[str, dict]:
        """Begin an episode at ``state`` (``reset``'s last line): a fresh team step. Returns ``reset``'s values:
        the history, and ``info`` with ``step`` 0 and ``private_observations`` added."""
        self.episode = state
        self.turns = self.workflow.start()
        return self.episode.history, {"step": 0, **(info or {}), PRIVATE_KEY: tuple(self.private_observations())}

    def transition(self, state: EpisodeState, actions: Sequence[str], turns: Sequence[tuple[str, str]] | None = None) -> EpisodeState:
        """The state after the team replies ``actions`` in ``state`` (pure; see the class). Write it."""
        raise NotImplementedError(f"{type(self).__name__} must write transition(state, actions, turns=None)")

    # ---- gymnasium API

    def step(self, actions: Sequence[str]) -> tuple[str, np.ndarray, bool, bool, dict]:
        """Take one team step: every agent's reply, in profile order.

        Returns:
            obs (str): the history including this step's turns (and judge feedback if not done).
            rewards (np.ndarray): float32, shape ``(n_agents,)``, one reward per agent.
            terminated (bool): the task was solved or the last of ``horizon`` attempts was used.
            truncated (bool): always False here (a time limit from outside, e.g. gymnasium's ``TimeLimit``, sets it).
            info (dict): ``step`` (team steps taken), the outcome's info and ``private_observations`` of the new state.
        """
        if self.episode is None or self.episode.done:
            raise RuntimeError("call reset() before step() (the episode is over or never started)")
        turns = None
        if self.turns.entries or self.turns.waiting:  # the replies came turn by turn
            if not self.turns.finished:
                raise RuntimeError(f"the team step is not complete: {[self.roles[a] for a in self.speakers()]} still to speak")
            if tuple(actions) != self.turn_actions():
                raise ValueError("step(actions) after take_turn(): pass turn_actions(), the replies the turns recorded")
            turns = self.workflow.spoken(self.turns)
        self.episode = self.transition(self.episode, self._check_actions(actions), turns)
        self.turns = self.workflow.start()
        outcome = self.episode.outcome
        if "reward_error" in outcome.info:
            self.reward_failures += 1
            logger.warning("reward failed (reward 0, %d failures so far): %s", self.reward_failures, outcome.info["reward_error"])
        rewards = np.asarray(outcome.rewards, dtype=np.float32)  # (n_agents,)
        info = {"step": self.episode.step, **outcome.info, PRIVATE_KEY: tuple(self.private_observations())}
        return self.episode.history, rewards, self.episode.terminated, self.episode.truncated, info

    def state(self) -> str:
        """The global view for a centralized critic: the full shared history."""
        if self.episode is None:
            raise RuntimeError("call reset() first")
        return self.episode.history

    # ---- turn by turn

    def set_workflow(self, workflow: Workflow) -> None:
        """Play team steps by ``workflow`` (its roles must be the env's); starts a fresh team step."""
        if tuple(workflow.roles) != self.roles:
            raise ValueError(f"the workflow's roles {list(workflow.roles)} are not the env's {list(self.roles)}")
        self.workflow = workflow
        self.turns = workflow.start()

    def speakers(self) -> list[int]:
        """The agents that speak now in the current team step (several: a graph layer, in parallel); empty once
        the step is complete and ready for ``step(turn_actions())``."""
        return self.workflow.speakers(self.turns)

    def visible_turns(self, agent: int) -> list[tuple[str, str]]:
        """``(role, text)`` of this team step's turns so far, as ``agent`` sees them after the history."""
        return self.workflow.visible_turns(self.turns, agent)

    def take_turn(self, agent: int, reply: str) -> None:
        """Record ``agent``'s reply in the current team step.

        Raises:
            ValueError: ``agent`` is not due to speak.
        """
        if not isinstance(reply, str):
            raise TypeError(f"reply of {self.roles[agent]} must be a str, got {type(reply).__name__}")
        self.workflow.take(self.turns, agent, reply)

    def spoken_turns(self) -> list[tuple[str, str]]:
        """``(role, text)`` of every turn of this team step so far (host lines included), as the history will hold them."""
        return self.workflow.spoken(self.turns)

    def turn_actions(self) -> tuple[str, ...]:
        """The replies to grade for the turns taken (one per agent; see :meth:`Workflow.actions`)."""
        return self.workflow.actions(self.turns)

    # ---- checkpoints

    def state_dict(self) -> dict:
        """Everything needed to continue exactly where the env stands, in JSON-safe form:
        ``np_random`` (bit-generator state), ``episode`` (the ``EpisodeState`` fields, class name
        under ``type``) and the failure counters."""
        return {
            "np_random": self.np_random.bit_generator.state,
            "episode": None if self.episode is None else _episode_to_dict(self.episode),
            "counters": {name: int(getattr(self, name)) for name in self.failure_counters},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned (the env must be of the same class; after ``reset``,
        the episode is rebuilt with the class of the current one)."""
        rng_state = state["np_random"]
        rng = np.random.Generator(getattr(np.random, rng_state["bit_generator"])())
        rng.bit_generator.state = rng_state
        self.np_random = rng
        episode = state["episode"]
        if episode is not None:
            cls = type(self.episode) if self.episode is not None else EpisodeState
            if episode["type"] != cls.__qualname__:
                raise ValueError(f"saved episode state is a {episode['type']}, this environment uses {cls.__qualname__}")
            self.episode = _episode_from_dict(cls, episode)
        for name, value in state.get("counters", {}).items():
            setattr(self, name, int(value))
        self.turns = self.workflow.start()  # checkpoints are taken between team steps

    # ---- helpers

    def _check_actions(self, actions: Sequence[str]) -> tuple[str, ...]:
        if isinstance(actions, str) or not isinstance(actions, (tuple, list)):
            raise TypeError(f"actions must be a tuple/list of {self.n_agents} strings, got {type(actions).__name__}")
        if len(actions) != self.n_agents:
            raise ValueError(f"expected {self.n_agents} replies (one per agent {list(self.roles)}), got {len(actions)}")
        for i, text in enumerate(actions):
            if not isinstance(text, str):
                raise TypeError(f"reply {i} ({self.roles[i]}) must be a str, got {type(text).__name__}")
        return tuple(actions)


class MultiAgentTextEnv(CustomEnv):
    """A :class:`CustomEnv` whose ``reset`` draws a task (``sample_task``) and whose ``transition`` grades the
    team's replies (``evaluate``): write those two hooks.

    Args:
        roles: the agents' role names, in speaking order.
        horizon: team steps (attempts) per episode; the episode terminates after the last one.
    """

    # ---- hooks for subclasses

    def sample_task(self, options: dict | None) -> dict:
        """Pick a task with ``self.np_random`` (or as ``options`` says).

        Returns:
            dict: ``{"problem": str, "answer": str}``; other keys go into the reset ``info``.
        """
        raise NotImplementedError

    def evaluate(self, state: EpisodeState, actions: tuple[str, ...]) -> StepOutcome:
        """Judge the team's replies ``actions`` to ``state`` (must not modify ``state``).

        Returns:
            StepOutcome: per-agent rewards, whether the task is solved, the judge feedback.
        """
        raise NotImplementedError

    # ---- pure state functions

    def initial_state(self, task: dict) -> EpisodeState:
        """The state at the start of an episode on ``task``."""
        problem = str(task["problem"])
        return EpisodeState(problem=problem, answer=str(task["answer"]), history=format_problem(problem))

    def transition(self, state: EpisodeState, actions: Sequence[str], turns: Sequence[tuple[str, str]] | None = None) -> EpisodeState:
        """The state after the team replies ``actions`` in ``state``.

        Pure: ``state`` is immutable, and nothing random is drawn. ``turns``: the step's ``(role, text)`` turns as
        they were taken (a workflow's order, host lines included) to append to the history; None: every agent's
        reply in profile order.

        Returns:
            EpisodeState: history extended by every agent's turn (and judge feedback when the
            episode goes on), ``step + 1``, the terminated/truncated flags and the outcome.
        """
        actions = self._check_actions(actions)
        try:
            outcome = self.evaluate(state, actions)
        except Exception as error:  # noqa: BLE001 - a broken reward function must not end training
            info = {"correct": False, "reward_error": f"{type(error).__name__}: {error}"}
            outcome = StepOutcome(rewards=(0.0,) * self.n_agents, solved=False, info=info)
        return self.advance(state, actions, outcome, turns)

    # ---- gymnasium API

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        """Start an episode.

        Returns:
            obs (str): the history so far, i.e. the problem line.
            info (dict): ``step`` (0), ``answer``, the task's extra keys and ``private_observations``
                (one text per agent, see :meth:`private_observations`).
        """
        super().reset(seed=seed)
        task = self.sample_task(options)
        return self.start(self.initial_state(task), {k: v for k, v in task.items() if k != "problem"})


def _episode_to_dict(episode: EpisodeState) -> dict:
    data = {f.name: getattr(episode, f.name) for f in dataclasses.fields(episode)}
    if episode.outcome is not None:
        data["outcome"] = {f.name: getattr(episode.outcome, f.name) for f in dataclasses.fields(episode.outcome)}
        data["outcome"]["rewards"] = [float(r) for r in episode.outcome.rewards]
        data["outcome"]["info"] = {k: _json_value(v) for k, v in episode.outcome.info.items()}
    return {"type": type(episode).__qualname__, **data}


def _episode_from_dict(cls: type, data: dict) -> EpisodeState:
    data = {k: _as_tuples(v) for k, v in data.items() if k not in ("type", "outcome")} | {"outcome": data.get("outcome")}
    if data.get("outcome") is not None:
        outcome = dict(data["outcome"])
        outcome["rewards"] = tuple(outcome["rewards"])
        data["outcome"] = StepOutcome(**outcome)
    return cls(**data)


def _as_tuples(value):
    """JSON's lists back as the tuples an immutable state held (nested too)."""
    return tuple(_as_tuples(v) for v in value) if isinstance(value, list) else value


def _json_value(value):
    """numpy scalars and arrays as plain Python values; anything else unchanged."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value
