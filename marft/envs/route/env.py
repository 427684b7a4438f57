"""``RouteEnv``: an orchestration toy task with a known optimum (registered as ``route``).

Two specialists keep boxes on two shelves: the first keeps shelf 1, the second shelf 2 (``Keeper 1`` and
``Keeper 2`` in the shipped profile; their descriptions say so in the orchestrator's prompt). The team is asked
what a box holds; only the specialist who keeps its shelf sees its number, in its private observation. An
orchestrator must call that specialist, then end the step::

    Orchestrator's prompt                          the specialist it called
    <role header: the specialists and which        <Keeper 1's role header>
     shelf each keeps>                             box 7 on shelf 1 holds 42
    Problem: What does box 7 on shelf 1 hold?
    Orchestrator:                                  Problem: What does box 7 on shelf 1 hold?
     -> "It is on shelf 1. <call>Keeper 1</call>"  Orchestrator: It is on shelf 1. <call>Keeper 1</call>
                                                   Host: Now it is Keeper 1's turn.
                                                   Keeper 1: -> "\\boxed{42}"
    ... Orchestrator: -> "<done/>"  graded: the team's latest boxed answer is 42 → 1.0 for every agent

* Optimum: 100 % (call the keeper of the asked shelf, then ``<done/>``).
* Routing at random succeeds at most half the time: the other specialist never sees the number (it holds
  one of 90 two-digit numbers), so only the right call can answer.
* The (shelf, box) tasks are split once, with a fixed seed and stratified by shelf, into ``train`` and
  ``test``; evaluation is on boxes never trained on, so what carries over is the rule (shelf → keeper).
* ``demonstrations(n)`` gives transcripts of the format with routing at random: the orchestrator reasons in one
  sentence that names the asked shelf, then calls a specialist drawn at random (``"It is on shelf 1.
  <call>Keeper 2</call>"``); the keeper answers right, the other says it does not keep that shelf. A warm start
  that knows the protocol but not whom to call: RL must learn the rule "call the keeper of the asked shelf".
* The shipped profile numbers the keepers like the shelves, so a model that can copy the asked shelf's digit
  into its call can learn the rule; the embedded ``marft-tiny-instruct`` copies digits from a problem (its
  arithmetic warm start taught it), which it does not do with words (with red and blue boxes it never learned
  to route, docs/workflows.md says more). A profile with other names works unchanged: the keepers
  are its first two specialists.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from marft.envs.base import EpisodeState, MultiAgentTextEnv, StepOutcome
from marft.envs.math.grader import last_boxed
from marft.envs.profile import AgentSpec, team_profile
from marft.prompting import HOST_ROLE, handover_text

SHELVES = (1, 2)
"""Shelf labels; specialist k (profile order) keeps the boxes on shelf ``SHELVES[k]``."""


@dataclass(frozen=True)
class RouteState(EpisodeState):
    """An ``EpisodeState`` that also holds the asked box and its hidden number."""

    shelf: int = 0
    """Index into ``SHELVES`` of the asked box's shelf (= the index of the specialist who keeps it)."""
    box: int = 0
    """The box number."""
    number: int = 0
    """What the box holds (the answer)."""


def route_problem(shelf: int, box: int, number: int) -> dict:
    """One task: ``problem`` (public text), ``answer`` (``str(number)``), ``shelf`` (index), ``box``, ``number``."""
    return {"problem": f"What does box {box} on shelf {SHELVES[shelf]} hold?", "answer": str(number), "shelf": shelf, "box": box, "number": number}


def asked_shelf(problem: str) -> int:
    """The shelf index a :func:`route_problem` text asks about (``"What does box 7 on shelf 2 hold?"`` → 1)."""
    match = re.search(r"on shelf (\d+) hold\?", problem)
    if match is None or int(match.group(1)) not in SHELVES:
        raise ValueError(f"not a route problem: {problem!r}")
    return SHELVES.index(int(match.group(1)))


def keeper_observation(shelf: int, box: int, number: int) -> str:
    """What only the keeper of the box sees: ``"box <box> on shelf <shelf> holds <number>"``."""
    return f"box {box} on shelf {SHELVES[shelf]} holds {number}"


def route_tasks(split: str = "train", n_boxes: int = 20, test_fraction: float = 0.2, seed: int = 0) -> list[tuple[int, int]]:
    """The ``(shelf, box)`` tasks of one split, in a seeded order; each shelf holds out the same share of its boxes."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    rng = np.random.default_rng(seed)
    n_test = max(1, int(round(test_fraction * n_boxes)))
    tasks = []
    for shelf in range(len(SHELVES)):
        held_out = set(int(b) + 1 for b in rng.permutation(n_boxes)[:n_test])
        tasks += [(shelf, box) for box in range(1, n_boxes + 1) if (box in held_out) == (split == "test")]
    return [tasks[i] for i in rng.permutation(len(tasks))]


class RouteEnv(MultiAgentTextEnv):
    """The orchestrator must call the specialist who keeps the asked box (see the module docstring).

    Args:
        split: ``"train"`` or ``"test"`` (disjoint sets of boxes).
        profile: profile path or shipped name, or a list of ``AgentSpec``; default ``route_orchestrated``:
            two specialists (the keepers of shelves 1 and 2, in that order) and an orchestrator.
        n_agents: expected team size (checked against the profile).
        horizon: attempts per episode.
        n_boxes: boxes per shelf.
        test_fraction: share of each shelf's boxes held out in the ``test`` split.
    """

    def __init__(self, split: str = "train", profile: str | Path | list[AgentSpec] | None = "route_orchestrated",
                 n_agents: int | None = None, horizon: int = 1, n_boxes: int = 20, test_fraction: float = 0.2):
        self.profile = team_profile(profile, n_agents)
        super().__init__([spec.role for spec in self.profile], horizon=horizon)
        self.keepers = [n for n, spec in enumerate(self.profile) if not spec.orchestrator][: len(SHELVES)]
        if len(self.keepers) < len(SHELVES):
            raise ValueError(f"route needs {len(SHELVES)} specialists (the keepers of shelves {' and '.join(map(str, SHELVES))}), the profile has {len(self.keepers)}")
        self.tasks = route_tasks(split, n_boxes, test_fraction)

    @property
    def num_tasks(self) -> int:
        return len(self.tasks)

    def sample_task(self, options: dict | None) -> dict:
        shelf, box = self.tasks[self.choose_task(options)]
        return route_problem(shelf, box, int(self.np_random.integers(10, 100)))

    def initial_state(self, task: dict) -> RouteState:
        base = super().initial_state(task)
        return RouteState(problem=base.problem, answer=base.answer, history=base.history,
                          shelf=int(task["shelf"]), box=int(task["box"]), number=int(task["number"]))

    def private_observations(self) -> list[str]:
        """The keeper of the asked box sees ``"box <k> on shelf <s> holds <number>"``; nobody else sees anything."""
        if self.episode is None:
            raise RuntimeError("call reset() first")
        seen = [""] * self.n_agents
        state = self.episode
        seen[self.keepers[state.shelf]] = keeper_observation(state.shelf, state.box, state.number)
        return seen

    def evaluate(self, state: RouteState, actions: tuple[str, ...]) -> StepOutcome:
        """Exact match of the graded reply's last ``\\boxed{}`` (with an orchestrator: the team's latest answer) with the number."""
        answers = [actions[n] for n, spec in enumerate(self.profile) if spec.with_answer]
        predicted = last_boxed(answers[-1]) if answers else None
        correct = predicted == state.answer
        reward = 1.0 if correct else 0.0
        return StepOutcome(rewards=(reward,) * self.n_agents, solved=correct, feedback="That is not what the box holds.",
                           info={"correct": correct, "answer": state.answer, "predicted": predicted})

    def demonstrations(self, n: int) -> list[dict]:
        """``n`` transcripts of the protocol with routing at random (drawn with ``self.np_random``)."""
        orchestrator = next(n for n, spec in enumerate(self.profile) if spec.orchestrator)
        out = []
        for _ in range(n):
            shelf, box = self.tasks[int(self.np_random.integers(len(self.tasks)))]
            number = int(self.np_random.integers(10, 100))
            called = self.keepers[int(self.np_random.integers(len(SHELVES)))]
            role = self.roles[called]
            reply = f"\\boxed{{{number}}}" if called == self.keepers[shelf] else f"I do not keep shelf {SHELVES[shelf]}."
            out.append({
                "problem": route_problem(shelf, box, number)["problem"],
                "private": {self.roles[self.keepers[shelf]]: keeper_observation(shelf, box, number)},
                "turns": [{"role": self.roles[orchestrator], "text": f"It is on shelf {SHELVES[shelf]}. <call>{role}</call>"},
                          {"role": HOST_ROLE, "text": handover_text(role)},
                          {"role": role, "text": reply},
                          {"role": self.roles[orchestrator], "text": "<done/>"}],
            })
        return out
