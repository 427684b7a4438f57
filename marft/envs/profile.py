"""Agent profiles: who is on the team, in which order they speak, and what each is told.

A profile is a JSON list with one entry per agent, in speaking order::

    [{"role": "Reasoner", "prompt": "You are ...", "with_answer": false},
     {"role": "Actor",    "prompt": "... \\\\boxed{answer}.", "with_answer": true}]

or an object that also describes the workflow (:mod:`marft.envs.workflows`): a graph of roles, where a node
speaks after its parents and nodes without an edge between them speak in parallel on the same history::

    {"agents": [...], "graph": {"nodes": ["Solver A", "Solver B", "Verifier"],
                                "edges": [["Solver A", "Verifier"], ["Solver B", "Verifier"]]}}

or an orchestrator, one more agent that calls the specialists (the agents, each with a ``description``)
by writing ``<call>Role</call>``, or ends the team step with ``<done/>``; ``{specialists}`` in its prompt
becomes one ``- Role: description`` line per specialist::

    {"agents": [...], "orchestrator": {"role": "Orchestrator", "prompt": "... {specialists} ..."}}

``with_answer`` marks agents whose reply holds an answer; the environment grades
the reply of the *last* such agent. Shipped profiles live in ``marft/envs/profiles``
and can be named without a path (``"reasoner_actor"``); every one has an
``_anonymous`` twin with roles ``"Agent 1"``, ``"Agent 2"``, ... and empty prompts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from marft.envs.workflows import topological_layers
from marft.prompting import HOST_ROLE, JUDGE_ROLE

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"

DEFAULT_PROFILES = {2: "reasoner_actor", 3: "planner_solver_verifier", 4: "planner_solver_reflector_verifier"}
"""The shipped profile used for each team size when no profile is named."""


@dataclass(frozen=True)
class AgentSpec:
    """One agent of a team."""

    role: str
    """Name shown in the shared history (``"<role>: <reply>"``); unique within a team."""
    prompt: str = ""
    """The agent's system prompt ("" for anonymous teams)."""
    with_answer: bool = False
    """Whether this agent's reply contains an answer; the last such agent is graded."""
    description: str = ""
    """What this agent does, in a line (an orchestrator's prompt lists the specialists with it)."""
    after: tuple[str, ...] = ()
    """The roles this agent speaks after in a graph workflow (its parents; empty: a root, or no graph)."""
    orchestrator: bool = False
    """This agent is the orchestrator: it calls the others (``<call>Role</call>``) and ends the step (``<done/>``)."""


def list_profiles() -> list[str]:
    """Names of the shipped profiles, sorted."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def resolve_profile_path(path_or_name: str | Path) -> Path:
    """The file behind ``path_or_name``: an existing path, else a shipped profile of that name.

    Raises:
        ValueError: neither a file nor a shipped profile.
    """
    path = Path(path_or_name)
    if path.is_file():
        return path
    shipped = PROFILE_DIR / f"{path.stem if path.suffix == '.json' else path.name}.json"
    if shipped.is_file() and path.parent == Path("."):
        return shipped
    raise ValueError(
        f"profile {str(path_or_name)!r} not found; pass a JSON file path or one of: {', '.join(list_profiles())}"
    )


RESERVED_ROLES = (JUDGE_ROLE, HOST_ROLE)
"""Roles the shared history uses for the judge's feedback and the orchestrator's handover lines."""

SPECIALISTS_PLACEHOLDER = "{specialists}"
"""In an orchestrator's prompt, replaced by one ``- Role: description`` line per specialist."""


def parse_profile(entries: object, source: str = "profile") -> list[AgentSpec]:
    """Validate a decoded profile (a JSON list of dicts, or an object with ``agents`` and a ``graph`` or an
    ``orchestrator``) and turn it into ``AgentSpec``s.

    Returns:
        list[AgentSpec]: one spec per agent, in speaking order (graph order for a graph; the orchestrator last).

    Raises:
        ValueError: a one-line description of the first problem found (also: a graph with a cycle, an edge
            naming an unknown role, an orchestrator prompt that names no specialist).
    """
    if isinstance(entries, dict) and "agents" in entries:
        return _parse_workflow_profile(entries, source)
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{source} must be a non-empty JSON list of {{'role', 'prompt', 'with_answer'}} entries "
                         "(or an object with 'agents' and a 'graph' or an 'orchestrator')")
    specs = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ValueError(f"{source}: entry {i} is not an object; each entry needs 'role', 'prompt', 'with_answer'")
        role = entry.get("role")
        if not isinstance(role, str) or not role.strip():
            raise ValueError(f"{source}: entry {i} has no 'role' (a non-empty string naming the agent)")
        role = role.strip()
        if role in RESERVED_ROLES:
            raise ValueError(f"{source}: entry {i} uses the reserved role {role!r}; pick another name")
        prompt = entry.get("prompt", "")
        if not isinstance(prompt, str):
            raise ValueError(f"{source}: entry {i} ({role}) has a non-string 'prompt'")
        with_answer = entry.get("with_answer", False)
        if not isinstance(with_answer, bool):
            raise ValueError(f"{source}: entry {i} ({role}) has 'with_answer' {with_answer!r}; use true or false")
        description = entry.get("description", "")
        if not isinstance(description, str):
            raise ValueError(f"{source}: entry {i} ({role}) has a non-string 'description'")
        specs.append(AgentSpec(role=role, prompt=prompt, with_answer=with_answer, description=description.strip()))
    roles = [s.role for s in specs]
    duplicates = sorted({r for r in roles if roles.count(r) > 1})
    if duplicates:
        raise ValueError(f"{source}: duplicate roles {duplicates}; every agent needs its own role name")
    if not any(s.with_answer for s in specs):
        raise ValueError(f"{source}: no entry has \"with_answer\": true, so no reply would be graded; mark the answering agent")
    return specs


def _parse_workflow_profile(data: dict, source: str) -> list[AgentSpec]:
    """The object form: ``agents`` plus a ``graph`` or an ``orchestrator`` (see the module docstring)."""
    unknown = sorted(set(data) - {"agents", "graph", "orchestrator"})
    if unknown:
        raise ValueError(f"{source}: unknown keys {unknown}; a profile object has 'agents' and a 'graph' or an 'orchestrator'")
    specs = parse_profile(data.get("agents"), source)
    if "graph" in data and "orchestrator" in data:
        raise ValueError(f"{source}: give a 'graph' or an 'orchestrator', not both")
    if "graph" in data:
        return _with_graph(specs, data["graph"], source)
    if "orchestrator" in data:
        return specs + [_orchestrator_spec(specs, data["orchestrator"], source)]
    return specs


def _with_graph(specs: list[AgentSpec], graph: object, source: str) -> list[AgentSpec]:
    """``specs`` in the graph's node order, each with its parents (``after``); checks the graph is a DAG."""
    if not isinstance(graph, dict) or not isinstance(graph.get("edges", []), list):
        raise ValueError(f"{source}: 'graph' must be an object with 'nodes' (roles) and 'edges' ([from, to] pairs)")
    by_role = {s.role: s for s in specs}
    nodes = graph.get("nodes", list(by_role))
    if not isinstance(nodes, list) or sorted(map(str, nodes)) != sorted(by_role):
        raise ValueError(f"{source}: graph nodes {nodes} must list every agent's role once: {sorted(by_role)}")
    parents: dict[str, list[str]] = {role: [] for role in nodes}
    for edge in graph.get("edges", []):
        if not (isinstance(edge, list) and len(edge) == 2):
            raise ValueError(f"{source}: graph edge {edge!r} is not a [from, to] pair")
        src, dst = edge
        for role in (src, dst):
            if role not in by_role:
                raise ValueError(f"{source}: graph edge {edge} names an unknown role {role!r}; roles: {sorted(by_role)}")
        if src == dst:
            raise ValueError(f"{source}: graph edge {edge} is a loop; a role cannot speak after itself")
        if src not in parents[dst]:
            parents[dst].append(src)
    try:
        topological_layers(nodes, [[nodes.index(p) for p in parents[r]] for r in nodes])
    except ValueError as error:
        raise ValueError(f"{source}: {error}") from None
    return [AgentSpec(**{**by_role[r].__dict__, "after": tuple(parents[r])}) for r in nodes]


def _orchestrator_spec(specs: list[AgentSpec], entry: object, source: str) -> AgentSpec:
    """The orchestrator's ``AgentSpec``, its prompt with ``{specialists}`` filled in; it must name a specialist."""
    if not isinstance(entry, dict):
        raise ValueError(f"{source}: 'orchestrator' must be an object with 'role' and 'prompt'")
    (spec,) = parse_profile([{**entry, "with_answer": True}], f"{source} orchestrator")  # (its replies are not graded)
    if spec.role in {s.role for s in specs}:
        raise ValueError(f"{source}: the orchestrator's role {spec.role!r} is also a specialist's")
    listing = "\n".join(f"- {s.role}: {s.description}" if s.description else f"- {s.role}" for s in specs)
    prompt = spec.prompt.replace(SPECIALISTS_PLACEHOLDER, listing)
    if not any(s.role in prompt for s in specs):
        raise ValueError(
            f"{source}: the orchestrator's prompt names no specialist ({', '.join(s.role for s in specs)}); "
            f"put {SPECIALISTS_PLACEHOLDER} in it or name them"
        )
    return AgentSpec(role=spec.role, prompt=prompt, with_answer=False, description=spec.description, orchestrator=True)


def load_profile(path_or_name: str | Path | None = None, n_agents: int | None = None) -> list[AgentSpec]:
    """Load and validate a profile.

    Args:
        path_or_name: a JSON file, or the name of a shipped profile (``"reasoner_actor"``);
            ``None`` picks ``DEFAULT_PROFILES[n_agents]``.
        n_agents: if given, the profile must have exactly this many agents.

    Returns:
        list[AgentSpec]: one spec per agent, in speaking order.

    Raises:
        ValueError: missing file, malformed content, or a team size other than ``n_agents``.
    """
    if path_or_name is None:
        if n_agents not in DEFAULT_PROFILES:
            raise ValueError(
                f"no default profile for n_agents={n_agents}; pass a profile (defaults exist for {sorted(DEFAULT_PROFILES)} agents)"
            )
        path_or_name = DEFAULT_PROFILES[n_agents]
    path = resolve_profile_path(path_or_name)
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"profile {path} is not valid JSON ({e.msg} at line {e.lineno})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"profile {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    specs = parse_profile(entries, source=f"profile {path_or_name}")
    if n_agents is not None and len(specs) != n_agents:
        raise ValueError(
            f"profile {path_or_name} has {len(specs)} agents but --n_agents is {n_agents}; "
            f"pass a profile with {n_agents} agents or set --n_agents {len(specs)}"
        )
    return specs


def answer_agent_index(profile: list[AgentSpec]) -> int:
    """Index of the agent whose reply is graded: the last one with ``with_answer``."""
    return max(i for i, spec in enumerate(profile) if spec.with_answer)


def team_profile(profile, n_agents: int | None = None) -> list[AgentSpec]:
    """The team an environment is built for: ``profile`` as a list of ``AgentSpec`` (kept), a file path or a
    shipped name (loaded; None picks the default profile for ``n_agents``).

    Raises:
        ValueError: the team size differs from ``n_agents``.
    """
    team = list(profile) if isinstance(profile, list) else load_profile(profile, n_agents=n_agents)
    if n_agents is not None and len(team) != n_agents:
        raise ValueError(f"profile has {len(team)} agents but --n_agents is {n_agents}")
    return team
