"""A frozen copy of the advantage code before issue 30 (commit 28aa38e), docstrings cut: the sequential workflow's
advantages must stay bit-identical to it (tests/algorithms/test_turn_credit.py). Not used by marft."""

from __future__ import annotations

import torch


def old_episode_end_values(next_values: torch.Tensor, terminated: torch.Tensor, truncated=None, final_values=None) -> torch.Tensor:
    out = next_values
    if truncated is not None:
        out = torch.where(truncated.bool(), final_values.to(out.dtype), out)
    return torch.where(terminated.bool(), torch.zeros_like(out), out)


def old_ended(terminated: torch.Tensor, truncated) -> torch.Tensor:
    return terminated.bool() if truncated is None else terminated.bool() | truncated.bool()


def old_agent_chain_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    terminated: torch.Tensor,
    gamma: float,
    gae_lambda: float,
    truncated: torch.Tensor | None = None,
    final_values: torch.Tensor | None = None,
    played: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    T, E, S = rewards.shape
    dtype = values.dtype
    played = torch.ones(T, E, S, dtype=torch.bool, device=values.device) if played is None else played.bool()
    ended = old_ended(terminated, truncated).to(dtype)  # (T, E)
    advantages = torch.zeros(T, E, S, dtype=dtype, device=values.device)
    next_value = values[T, :, 0].clone()  # (E,) value of the next played turn
    next_adv = torch.zeros(E, dtype=dtype, device=values.device)  # (E,) its advantage
    for t in range(T - 1, -1, -1):
        next_value = old_episode_end_values(next_value.unsqueeze(0), terminated[t : t + 1], None if truncated is None else truncated[t : t + 1],
                                        None if final_values is None else final_values[t : t + 1]).squeeze(0)
        next_adv = next_adv * (1.0 - ended[t])  # any episode end cuts the GAE sum
        for s in range(S - 1, -1, -1):
            delta = rewards[t, :, s] + gamma * next_value - values[t, :, s]  # (E,)
            adv = delta + gamma * gae_lambda * next_adv
            here = played[t, :, s]
            advantages[t, :, s] = torch.where(here, adv, torch.zeros_like(adv))
            next_value = torch.where(here, values[t, :, s], next_value)
            next_adv = torch.where(here, adv, next_adv)
    return advantages, advantages + values[:T]


def old_discount_matrix(length: int, discount: float, dtype=torch.float32, device=None) -> torch.Tensor:
    idx = torch.arange(length, device=device)
    steps = idx.unsqueeze(0) - idx.unsqueeze(1)  # (L, L): k - l
    return torch.where(steps >= 0, torch.tensor(discount, dtype=dtype, device=device) ** steps.clamp(min=0).to(dtype), torch.zeros((), dtype=dtype, device=device))


def old_token_chain_gae(
    rewards: torch.Tensor,
    token_values: torch.Tensor,
    response_mask: torch.Tensor,
    bootstrap_value: torch.Tensor,
    terminated: torch.Tensor,
    gamma: float,
    gae_lambda: float,
    token_gamma: float = 1.0,
    token_gae_lambda: float = 1.0,
    truncated: torch.Tensor | None = None,
    final_values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    T, E, N, L = token_values.shape
    dtype, device = token_values.dtype, token_values.device
    mask = response_mask.to(dtype)
    lengths = response_mask.sum(-1).long()  # (T, E, N)
    within = token_gamma * token_gae_lambda
    W = old_discount_matrix(L, within, dtype, device)  # (L, L)
    pos = torch.arange(L, device=device)
    advantages = torch.zeros_like(token_values)
    next_value = bootstrap_value.to(dtype).clone()  # (E,) value of the next real token after the current reply
    next_adv = torch.zeros(E, dtype=dtype, device=device)  # (E,) its advantage
    pending = torch.zeros(E, dtype=dtype, device=device)  # (E,) rewards of later empty replies
    ended = old_ended(terminated, truncated)  # (T, E)
    for t in range(T - 1, -1, -1):
        alive = 1.0 - ended[t].to(dtype)  # (E,)
        next_value = old_episode_end_values(next_value.unsqueeze(0), terminated[t : t + 1], None if truncated is None else truncated[t : t + 1],
                                        None if final_values is None else final_values[t : t + 1]).squeeze(0)
        next_adv, pending = next_adv * alive, pending * alive
        for n in range(N - 1, -1, -1):
            v, m, length = token_values[t, :, n], mask[t, :, n], lengths[t, :, n]  # (E, L), (E, L), (E,)
            last = (pos.unsqueeze(0) == (length - 1).unsqueeze(1)).to(dtype)  # (E, L) one-hot of the last real token
            v_next = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], dim=1) * (1 - last) + next_value.unsqueeze(1) * last
            discount = token_gamma * (1 - last) + gamma * last
            reward = (rewards[t, :, n] + pending).unsqueeze(1) * last
            delta = (reward + discount * v_next - v) * m  # (E, L)
            carry_power = within ** (length.unsqueeze(1) - 1 - pos.unsqueeze(0)).clamp(min=0).to(dtype)  # (E, L)
            adv = (delta @ W.T + carry_power * gamma * gae_lambda * next_adv.unsqueeze(1)) * m  # (E, L)
            advantages[t, :, n] = adv
            real = length > 0
            next_value = torch.where(real, v[:, 0], next_value)
            next_adv = torch.where(real, adv[:, 0], next_adv)
            pending = torch.where(real, torch.zeros_like(pending), pending + rewards[t, :, n])
    return advantages, (advantages + token_values) * mask


def old_turn_credits(
    rewards: torch.Tensor, mode: str, credit_discount: float = 1.0, team_rewards: torch.Tensor | None = None,
    played: torch.Tensor | None = None,
) -> torch.Tensor:
    if mode not in ('env', 'equal', 'step_discount', 'per_step'):
        raise ValueError(f"unknown credit assignment {mode!r}; known: {', '.join(('env', 'equal', 'step_discount', 'per_step'))}")
    if mode in ("env", "per_step"):
        return rewards
    S = rewards.shape[-1]
    team = (rewards if team_rewards is None else team_rewards).mean(-1, keepdim=True)  # (T, E, 1)
    played = torch.ones_like(rewards, dtype=torch.bool) if played is None else played.bool()
    if mode == "equal":
        return team.expand_as(rewards) * played
    turns = played.sum(-1, keepdim=True)  # (T, E, 1): K
    powers = (turns - 1 - torch.arange(S, device=rewards.device)).clamp(min=0).to(rewards.dtype)  # (T, E, S): K-1-k
    return team * credit_discount ** powers * played


def old_chain_rewards(credits: torch.Tensor, gamma: float) -> torch.Tensor:
    later = torch.cat([credits[..., 1:], torch.zeros_like(credits[..., :1])], dim=-1)  # (T, E, N): c_{n+1}, 0 after the last
    return credits - gamma * later


def old_turn_rewards(agent: torch.Tensor, agent_rewards: torch.Tensor, n_agents: int) -> torch.Tensor:
    """The old ``RolloutBuffer.insert_step`` placement, every step at once: agent n's reward on its last turn."""
    spoke = agent.unsqueeze(-1) == torch.arange(n_agents)  # (T, E, S, N)
    later = spoke.flip(2).cumsum(2).flip(2) - spoke.long()
    last = spoke & (later == 0)
    return (last.float() * agent_rewards.unsqueeze(2)).sum(-1)


def old_group_per_agent(credits: torch.Tensor, agent: torch.Tensor, n_agents: int) -> torch.Tensor:
    """The old GRPO per-agent step credits: the sum of the agent's turns' credits."""
    spoke = (agent.unsqueeze(-1) == torch.arange(n_agents)).float()
    return (credits.unsqueeze(-1) * spoke).sum(2)
