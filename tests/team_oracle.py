"""A plain reference for the tests: one team step of the sequential workflow, agent after agent."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from marft.types import TurnOutput


@torch.no_grad()
def play_step(
    team,
    histories: Sequence[str],
    private: Sequence[Sequence[str]] | None = None,
    with_values: bool = True,
    token_values: bool = False,
) -> list[TurnOutput]:
    """``team`` plays one step of the sequential workflow on a batch of B conversations: every agent, in profile
    order, replies to each history, seeing the replies of the agents before it. (The runner plays any
    workflow turn by turn with :func:`marft.runner.shared.turns.play_team_step`; this is the plain
    fixed-order loop the tests check it against.)

    Args:
        histories: ``(B,)`` shared observations.
        private: ``(B, N)`` text only agent n sees in conversation b (None: nothing private).
        with_values: value every turn (training rollouts with a critic); evaluation and critic-free teams skip it.
        token_values: the critic also values every reply token (token-level trainers).

    Returns one ``TurnOutput`` per agent.
    """
    earlier = [[] for _ in histories]  # (role, reply) of the agents that already spoke, per conversation
    outs = []
    for agent, spec in enumerate(team.profile):
        out = team.act(agent, histories, earlier, None if private is None else [p[agent] for p in private])
        for turns, text in zip(earlier, out.texts):
            turns.append((spec.role, text))
        outs.append(out)
    if with_values and team.critic is not None:
        team.critic.value_batches(list(enumerate(outs)), token_values)
    return outs
