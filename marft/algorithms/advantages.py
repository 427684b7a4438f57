"""Generalised advantage estimation along the agent chain.

In MARFT the agents of a step act one after another, so a rollout of T steps
with N agents is one chain of T·N decisions per environment: agent i bootstraps
from agent i+1 of the same step, the last agent from agent 0 of the next step,
and an episode end cuts the chain after the last agent.
"""

from __future__ import annotations

import torch


def reverse_discounted_sum(x: torch.Tensor, discount: torch.Tensor) -> torch.Tensor:
    """``out[s] = x[s] + discount[s] * out[s + 1]`` with ``out[S] = 0``, scanned backwards over dim 0.

    Shapes: ``x (S, ...)``, ``discount (S, ...)`` → ``(S, ...)``. Every other dim is processed
    at once, so the only Python loop is over the S chain positions.
    """
    out = torch.empty_like(x)
    running = torch.zeros_like(x[0])
    for s in range(x.shape[0] - 1, -1, -1):
        running = x[s] + discount[s] * running
        out[s] = running
    return out


def agent_chain_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    dones: torch.Tensor,
    gamma: float,
    gae_lambda: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns of every agent turn.

    Args:
        rewards: ``(T, E, N)`` reward of agent n at step t in env e.
        values: ``(T + 1, E, N)`` critic values; ``values[T, :, 0]`` bootstraps the last step.
        dones: ``(T, E)`` the episode ended after step t (its last agent has no successor).
        gamma, gae_lambda: discount and GAE lambda per link of the chain.

    Returns:
        ``advantages (T, E, N)`` and ``returns (T, E, N)`` (= advantages + values).
    """
    T, E, N = rewards.shape
    chain_values = values[:T].permute(0, 2, 1).reshape(T * N, E)  # (T·N, E), link k = (t, n) with k = t·N + n
    next_values = torch.cat([chain_values[1:], values[T, :, 0].unsqueeze(0)], dim=0)  # (T·N, E)
    not_done = torch.ones(T, N, E, dtype=values.dtype, device=values.device)
    not_done[:, N - 1] = 1.0 - dones.to(values.dtype)  # only the last agent's link crosses a step boundary
    not_done = not_done.reshape(T * N, E)
    chain_rewards = rewards.permute(0, 2, 1).reshape(T * N, E)
    deltas = chain_rewards + gamma * not_done * next_values - chain_values  # (T·N, E)
    chain_adv = reverse_discounted_sum(deltas, gamma * gae_lambda * not_done)  # (T·N, E)
    advantages = chain_adv.reshape(T, N, E).permute(0, 2, 1)  # (T, E, N)
    return advantages, advantages + values[:T]
