"""Agent profiles: who is on the team, in which order they speak, and what each is told.

A profile is a JSON list with one entry per agent, in speaking order::

    [{"role": "Reasoner", "prompt": "You are ...", "with_answer": false},
     {"role": "Actor",    "prompt": "... \\\\boxed{answer}.", "with_answer": true}]

``with_answer`` marks agents whose reply holds an answer; the environment grades
the reply of the *last* such agent. Shipped profiles live in ``marft/envs/profiles``
and can be named without a path (``"reasoner_actor"``); every one has an
``_anonymous`` twin with roles ``"Agent 1"``, ``"Agent 2"``, ... and empty prompts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from marft.prompting import JUDGE_ROLE

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


def parse_profile(entries: object, source: str = "profile") -> list[AgentSpec]:
    """Validate a decoded profile (a JSON list of dicts) and turn it into ``AgentSpec``s.

    Returns:
        list[AgentSpec]: one spec per agent, in speaking order.

    Raises:
        ValueError: a one-line description of the first problem found.
    """
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{source} must be a non-empty JSON list of {{'role', 'prompt', 'with_answer'}} entries")
    specs = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ValueError(f"{source}: entry {i} is not an object; each entry needs 'role', 'prompt', 'with_answer'")
        role = entry.get("role")
        if not isinstance(role, str) or not role.strip():
            raise ValueError(f"{source}: entry {i} has no 'role' (a non-empty string naming the agent)")
        role = role.strip()
        if role == JUDGE_ROLE:
            raise ValueError(f"{source}: entry {i} uses the reserved role {JUDGE_ROLE!r}; pick another name")
        prompt = entry.get("prompt", "")
        if not isinstance(prompt, str):
            raise ValueError(f"{source}: entry {i} ({role}) has a non-string 'prompt'")
        with_answer = entry.get("with_answer", False)
        if not isinstance(with_answer, bool):
            raise ValueError(f"{source}: entry {i} ({role}) has 'with_answer' {with_answer!r}; use true or false")
        specs.append(AgentSpec(role=role, prompt=prompt, with_answer=with_answer))
    roles = [s.role for s in specs]
    duplicates = sorted({r for r in roles if roles.count(r) > 1})
    if duplicates:
        raise ValueError(f"{source}: duplicate roles {duplicates}; every agent needs its own role name")
    if not any(s.with_answer for s in specs):
        raise ValueError(f"{source}: no entry has \"with_answer\": true, so no reply would be graded; mark the answering agent")
    return specs


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
