"""Workflows: who speaks when within one team step.

A team step is a sequence of turns on one environment's shared history. A workflow decides, turn by turn,
which agents speak next (the idea of PettingZoo's AEC ``agent_selection``), what each of them sees of the
step so far, and which replies the environment grades. The environment holds one :class:`StepTurns` per
episode step (``env.speakers()``, ``env.visible_turns(agent)``, ``env.take_turn(agent, reply)``), and the
runner, at each moment, groups the environments by the agent that speaks and generates one batch per agent.

* :class:`GraphWorkflow`: a DAG of roles (``AgentSpec.after`` lists a node's parents). The nodes of one layer
  (every parent already spoke) speak in parallel on the same history; their replies are appended in graph
  order. :func:`sequential` is the chain ``0 → 1 → … → N-1``, the fixed speaking order of the original MARFT.
* :class:`OrchestratedWorkflow`: an orchestrator agent reads the conversation and writes its reasoning and
  ``<call>Role</call>`` (that specialist speaks next, after the host's handover line, then hands back) or
  ``<done/>`` (the step ends and the team's answer is graded). ``<done/>`` wins over a call; a reply with
  neither, or a call of an unknown role, ends the step with the team's current answer and is counted
  (``invalid``). At most ``max_turns`` specialist calls per step: the step ends after the last one.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from marft.choices import WORKFLOWS
from marft.prompting import HOST_ROLE, handover_text

CALL_TAG = re.compile(r"<call>\s*(.*?)\s*</call>", re.DOTALL)
DONE_TAG = re.compile(r"<done\s*/>")


@dataclass
class StepTurns:
    """One environment's team step in progress."""

    entries: list[tuple[int, str]] = field(default_factory=list)
    """The step's turns in history order: ``(agent, reply)``, or ``(-1, text)`` for a host line."""
    due: list[int] = field(default_factory=list)
    """The agents that speak now (one, or a graph layer); empty once the step is complete."""
    waiting: dict[int, str] = field(default_factory=dict)
    """Replies of the due agents already taken (a layer is appended once all of it spoke)."""
    layer: int = 0
    """Graph workflows: the index of the due layer."""
    calls: list[int] = field(default_factory=list)
    """Orchestrated: the specialists called, in order."""
    invalid: bool = False
    """Orchestrated: the step ended on an orchestrator reply with no valid tag."""

    @property
    def finished(self) -> bool:
        """Every turn of the step is in: the environment can grade it."""
        return not self.due


def topological_layers(names: Sequence[str], parents: Sequence[Sequence[int]]) -> list[list[int]]:
    """The layers of a DAG over nodes ``0..n-1`` (``parents[n]``: the nodes n comes after): layer k holds, in
    node order, the nodes whose parents all lie in earlier layers (Kahn's algorithm).

    Raises:
        ValueError: the graph has a cycle (naming the nodes on or behind it, by ``names``).
    """
    layers: list[list[int]] = []
    placed: set[int] = set()
    while len(placed) < len(names):
        layer = [n for n in range(len(names)) if n not in placed and all(p in placed for p in parents[n])]
        if not layer:
            raise ValueError(f"the graph has a cycle among {[names[n] for n in range(len(names)) if n not in placed]}; a workflow graph must be acyclic")
        layers.append(layer)
        placed.update(layer)
    return layers


class Workflow:
    """Base class: the roles and the turn-by-turn rules of one team step.

    Args:
        roles: every agent's role, in profile order (the orchestrator too).
        answer_agents: indices of the agents whose replies hold an answer (``with_answer``).
    """

    name = "workflow"

    def __init__(self, roles: Sequence[str], answer_agents: Sequence[int]):
        self.roles = tuple(roles)
        self.n_agents = len(self.roles)
        self.answer_agents = tuple(answer_agents)

    max_turns_per_step: int = 0
    """The most turns one team step can take (the rollout buffer keeps this many slots per step)."""

    @property
    def first_speaker(self) -> int:
        """The agent whose turn opens every team step (a truncated episode's final observation, and the rollout's
        end, are valued as its turn)."""
        return self.start().due[0]

    def start(self) -> StepTurns:
        """A fresh team step."""
        raise NotImplementedError

    def take(self, turns: StepTurns, agent: int, reply: str) -> None:
        """Record ``agent``'s reply; advance who speaks next."""
        raise NotImplementedError

    def speakers(self, turns: StepTurns) -> list[int]:
        """The agents that speak now and have not replied yet."""
        return [a for a in turns.due if a not in turns.waiting]

    def spoken(self, turns: StepTurns) -> list[tuple[str, str]]:
        """``(role, text)`` of the step's turns so far, host lines included: what the history gains."""
        return [(HOST_ROLE if a < 0 else self.roles[a], text) for a, text in turns.entries]

    def visible_turns(self, turns: StepTurns, agent: int) -> list[tuple[str, str]]:
        """What ``agent`` sees of the step so far: every turn spoken (the shared history's continuation)."""
        return self.spoken(turns)

    def actions(self, turns: StepTurns) -> tuple[str, ...]:
        """The replies the environment grades: each agent's last reply of the step ("" if it did not speak)."""
        replies = [""] * self.n_agents
        for agent, text in turns.entries:
            if agent >= 0:
                replies[agent] = text
        return tuple(replies)

    def _check(self, turns: StepTurns, agent: int) -> None:
        if agent not in self.speakers(turns):
            raise ValueError(f"{self.roles[agent] if 0 <= agent < self.n_agents else agent} is not due to speak; due: "
                             f"{[self.roles[a] for a in self.speakers(turns)]}")


class GraphWorkflow(Workflow):
    """A DAG of roles; ``parents[n]`` are the agents node n speaks after. Layer k holds the nodes whose parents
    are all in earlier layers (graph order within a layer)."""

    name = "graph"

    def __init__(self, roles: Sequence[str], answer_agents: Sequence[int], parents: Sequence[Sequence[int]]):
        super().__init__(roles, answer_agents)
        self.layers = topological_layers(self.roles, parents)
        self.max_turns_per_step = self.n_agents

    def start(self) -> StepTurns:
        return StepTurns(due=list(self.layers[0]))

    def take(self, turns: StepTurns, agent: int, reply: str) -> None:
        self._check(turns, agent)
        turns.waiting[agent] = reply
        if len(turns.waiting) < len(turns.due):
            return
        turns.entries += [(a, turns.waiting[a]) for a in turns.due]  # graph order, whoever finished first
        turns.waiting = {}
        turns.layer += 1
        turns.due = list(self.layers[turns.layer]) if turns.layer < len(self.layers) else []


def sequential(roles: Sequence[str], answer_agents: Sequence[int] = ()) -> GraphWorkflow:
    """The chain ``0 → 1 → … → N-1``: every agent once per step, in profile order, each seeing the replies before it."""
    workflow = GraphWorkflow(roles, answer_agents, [[n - 1] if n else [] for n in range(len(roles))])
    workflow.name = "sequential"
    return workflow


class OrchestratedWorkflow(Workflow):
    """The orchestrator (agent ``orchestrator``) calls specialists until ``<done/>``, an invalid reply, or
    ``max_turns`` calls. The graded answer is the latest reply of an answering agent (``with_answer``)."""

    name = "orchestrated"

    def __init__(self, roles: Sequence[str], answer_agents: Sequence[int], orchestrator: int, max_turns: int = 5):
        super().__init__(roles, answer_agents)
        if max_turns < 1:
            raise ValueError(f"--max_turns must be at least 1 (specialist calls per team step), got {max_turns}")
        self.orchestrator = orchestrator
        self.max_turns = max_turns
        self.specialists = {role: n for n, role in enumerate(self.roles) if n != orchestrator}
        self.max_turns_per_step = 2 * max_turns + 1  # orchestrator, specialist, ..., orchestrator

    def start(self) -> StepTurns:
        return StepTurns(due=[self.orchestrator])

    def parse(self, reply: str) -> int | None:
        """What an orchestrator reply asks for: ``-1`` for ``<done/>``, a specialist's index for a valid call, None otherwise."""
        if DONE_TAG.search(reply):
            return -1
        call = CALL_TAG.search(reply)
        return self.specialists.get(call.group(1).strip()) if call else None

    def take(self, turns: StepTurns, agent: int, reply: str) -> None:
        self._check(turns, agent)
        turns.entries.append((agent, reply))
        if agent != self.orchestrator:  # a specialist spoke: back to the orchestrator, unless the calls are spent
            turns.due = [self.orchestrator] if len(turns.calls) < self.max_turns else []
            return
        called = self.parse(reply)
        if called is None:
            turns.invalid = True
        if called is None or called < 0:
            turns.due = []
            return
        turns.calls.append(called)
        turns.entries.append((-1, handover_text(self.roles[called])))
        turns.due = [called]

    def actions(self, turns: StepTurns) -> tuple[str, ...]:
        """Each agent's last reply; the graded slot (the last answering agent's) holds the team's current answer,
        the latest reply of any answering agent ("" if none spoke)."""
        replies = list(super().actions(turns))
        answers = [text for agent, text in turns.entries if agent in self.answer_agents]
        if self.answer_agents:
            replies[max(self.answer_agents)] = answers[-1] if answers else ""
        return tuple(replies)


def workflow_for(profile: Sequence, name: str = "auto", max_turns: int = 5) -> Workflow:
    """The workflow a profile (``AgentSpec`` list) describes, checked against ``--workflow name``.

    Raises:
        ValueError: ``name`` asks for a graph or an orchestrator the profile does not have (or the reverse).
    """
    if name not in WORKFLOWS:
        raise ValueError(f"--workflow must be one of {', '.join(WORKFLOWS)}, got {name!r}")
    roles = [spec.role for spec in profile]
    answers = [n for n, spec in enumerate(profile) if spec.with_answer]
    orchestrators = [n for n, spec in enumerate(profile) if spec.orchestrator]
    has_graph = any(spec.after for spec in profile)
    found = "orchestrated" if orchestrators else "graph" if has_graph else "sequential"
    if name == "graph" and found == "sequential":
        found = "graph"  # a graph without edges: every agent in one parallel layer
    if name not in ("auto", found):
        remedy = {"orchestrated": "give a profile with an orchestrator", "graph": "give a profile with a graph"}.get(name, "use --workflow auto")
        raise ValueError(f"--workflow {name}: the profile describes a {found} workflow; {remedy}")
    if found == "orchestrated":
        if len(orchestrators) > 1:
            raise ValueError(f"the profile has {len(orchestrators)} orchestrators; a team has at most one")
        if len(profile) < 2:
            raise ValueError("an orchestrated team needs at least one specialist besides the orchestrator")
        return OrchestratedWorkflow(roles, answers, orchestrators[0], max_turns)
    if found == "graph":
        index = {role: n for n, role in enumerate(roles)}
        return GraphWorkflow(roles, answers, [[index[p] for p in spec.after] for spec in profile])
    return sequential(roles, answers)
