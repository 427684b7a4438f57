"""One team step on a batch of environments, turn by turn (the runner's rollout and evaluation share it).

At each moment every environment says who speaks now (``env.speakers()``: one agent, or a graph layer);
the environments are grouped by that agent and each agent speaks in ONE batch for all the environments
where it speaks, seeing what its environment's step shows it (``env.visible_turns(agent)``); the agents of one
moment (two seats of a self-play game, a team game's roles) share one generation batch where the team can
(:meth:`AgentTeam.act_together`). The replies
are recorded (``env.take_turn``) once the moment's batches are all sampled, so agents of one graph layer
speak in parallel on the same history. The step ends when no environment has a speaker left.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from marft.agents.team import AgentTeam
from marft.types import AgentTurns, TurnOutput


@dataclass
class PlayedBatch:
    """One agent's generation batch at one moment of a team step."""

    agent: int
    """The agent that spoke."""
    rows: list[int]
    """The environments (positions in the list given to :func:`play_team_step`) of the batch's rows, in order."""
    out: TurnOutput
    """The batch's prompts, replies, log-probs (and values)."""
    moment: int = 0
    """The moment of the team step it was generated at (0, 1, ...): an env's turns of one moment are a parallel layer."""


def play_team_step(
    team: AgentTeam,
    envs: Sequence,
    histories: Sequence[str],
    private: Sequence[Sequence[str]],
    with_values: bool = False,
    token_values: bool = False,
    adapters: dict[int, Sequence[str]] | None = None,
) -> list[PlayedBatch]:
    """Play one team step on every env in ``envs`` (unwrapped ``MultiAgentTextEnv``s, each at the start of a step),
    leaving each ready for ``step(env.turn_actions())``.

    Args:
        histories: ``(B,)`` each env's current observation.
        private: ``(B, N)`` what each agent alone sees in each env.
        with_values: value every turn with the critic (training rollouts of trainers with a critic).
        token_values: the critic also values every reply token (token-level trainers).
        adapters: per agent that does not play with its own adapter, the adapter of each env (by position in
            ``envs``): an opponent's snapshot per game (``--opponent pool:K``).

    Returns the batches in the order they were generated.
    """
    played: list[PlayedBatch] = []
    n_moments = 0
    while True:
        due: dict[int, list[int]] = {}
        for row, env in enumerate(envs):
            for agent in env.speakers():
                due.setdefault(agent, []).append(row)
        if not due:
            break
        agents = sorted(due)
        turns = [  # every agent's prompts are built before anyone's reply is recorded
            AgentTurns(agent, [histories[r] for r in due[agent]], [envs[r].visible_turns(agent) for r in due[agent]],
                       [private[r][agent] for r in due[agent]], [envs[r].kept_heads()[agent] for r in due[agent]],
                       adapters=[adapters[agent][r] for r in due[agent]] if adapters and agent in adapters else None)
            for agent in agents
        ]
        outs = team.act_together(turns)  # the moment's agents in one batch where the team can, else one batch each
        moment = [PlayedBatch(agent, due[agent], out, moment=n_moments) for agent, out in zip(agents, outs)]
        for batch in moment:
            for row, text in zip(batch.rows, batch.out.texts):
                envs[row].take_turn(batch.agent, text)
        played += moment
        n_moments += 1
    if with_values and team.has_critic and played:
        team.critic.value_batches([(batch.agent, batch.out) for batch in played], token_values)
    return played
