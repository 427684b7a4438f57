"""Generalised advantage estimation along the agent chain, credit assignment, and group-relative advantages.

In MARFT the agents of a step act one after another, so a rollout is one chain of
turns per environment: a turn bootstraps from the next turn of its environment
(whoever speaks it; with the sequential workflow, agent i from agent i+1 and the
last agent from agent 0 of the next step), and an episode end cuts the chain after
the step's last turn. Turns of one parallel graph layer (``layers``: the same id for the turns of one
moment of a step) do not bootstrap from each other: each bootstraps from the state after the whole
layer (the next layer's turns, or the next step), and the turn before the layer bootstraps from the
layer as a whole (the mean of its turns' values and advantages; a one-turn layer is that turn, so a
chain of single turns is plain GAE). Episode ends follow gymnasium: a *terminated* episode has no
future (its last turn bootstraps from nothing); a *truncated* one was cut short from
outside (a time limit), so its last turn bootstraps from the value of the final
observation, ``final_values``.
"""

from __future__ import annotations

import torch

from marft.choices import CREDIT_MODES


def episode_end_values(next_values: torch.Tensor, terminated: torch.Tensor, truncated=None, final_values=None) -> torch.Tensor:
    """What a step's last turn bootstraps from, ``(T, E)`` like every input: the next step's first value
    while the episode goes on, the final observation's value when it was truncated, nothing (0) when it
    terminated (terminated wins over truncated, as in gymnasium)."""
    out = next_values
    if truncated is not None:
        out = torch.where(truncated.bool(), final_values.to(out.dtype), out)
    return torch.where(terminated.bool(), torch.zeros_like(out), out)


def _ended(terminated: torch.Tensor, truncated) -> torch.Tensor:
    """``(T, E)`` bool: the episode ended after step t, either way."""
    return terminated.bool() if truncated is None else terminated.bool() | truncated.bool()


class _LayerWalk:
    """One team step walked backwards, slot by slot, for a batch of envs at once (any batch shape).

    ``after`` holds, per env, what a turn bootstraps from (e.g. a value and an advantage): the state after the
    turn's layer. Stepping back into a new layer makes the layer just walked the state after it, as the mean
    of its turns' items (a one-turn layer: that turn's items, unchanged); :meth:`before` gives the state before
    the step's first layer, which the previous step's last layer bootstraps from."""

    def __init__(self, after: list[torch.Tensor]):
        self.after = list(after)
        self.sums = [torch.zeros_like(a) for a in after]
        self.count = torch.zeros_like(after[0])
        self.current = torch.full(after[0].shape, -1, dtype=torch.long, device=after[0].device)  # the layer being walked
        self.new = torch.zeros(after[0].shape, dtype=torch.bool, device=after[0].device)

    def enter(self, here: torch.Tensor, layer: torch.Tensor) -> list[torch.Tensor]:
        """Step back to a slot (``here``: it holds a turn, ``layer``: its layer id); returns what it bootstraps from."""
        self.new = here & (layer != self.current)
        self.after = self._means(self.new & (self.count > 0))
        self.current = torch.where(here, layer, self.current)
        return self.after

    def add(self, here: torch.Tensor, items: list[torch.Tensor]) -> None:
        """Count the slot's turn (where ``here``) into its layer's sums."""
        self.sums = [torch.where(self.new, x, torch.where(here, total + x, total)) for total, x in zip(self.sums, items)]
        one = torch.ones_like(self.count)
        self.count = torch.where(self.new, one, torch.where(here, self.count + one, self.count))

    def before(self) -> list[torch.Tensor]:
        """What the turn before the step's first layer bootstraps from (``after`` where the step has no turn)."""
        return self._means(self.count > 0)

    def _means(self, where: torch.Tensor) -> list[torch.Tensor]:
        count = self.count.clamp(min=1)
        return [torch.where(where, total / count, after) for total, after in zip(self.sums, self.after)]


def slot_layers(shape: tuple[int, ...], device=None) -> torch.Tensor:
    """``(T, E, S)`` layer ids of a chain: every slot its own layer (the sequential workflow)."""
    return torch.arange(shape[-1], device=device).expand(shape)


def agent_chain_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    terminated: torch.Tensor,
    gamma: float,
    gae_lambda: float,
    truncated: torch.Tensor | None = None,
    final_values: torch.Tensor | None = None,
    played: torch.Tensor | None = None,
    layers: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns of every turn, along each environment's chain of turns.

    Args:
        rewards: ``(T, E, S)`` reward of the turn in slot s of team step t in env e (S: turn slots per step;
            with the sequential workflow slot n is agent n).
        values: ``(T + 1, E, S)`` critic values; ``values[T, :, 0]`` bootstraps the last step.
        terminated: ``(T, E)`` the episode ended after step t for good (its last turn has no successor).
        gamma, gae_lambda: discount and GAE lambda per link of the chain.
        truncated: ``(T, E)`` the episode was cut after step t (None: never).
        final_values: ``(T, E)`` value of a truncated episode's final observation (its last turn's successor).
        played: ``(T, E, S)`` the slot holds a turn (None: all do). A turn bootstraps from the next played turn
            of its env, whoever speaks it; empty slots are skipped (advantage 0).
        layers: ``(T, E, S)`` layer id of each slot (None: every slot its own layer, a chain). Consecutive played
            slots with one id are a parallel layer: each of its turns bootstraps from the state after the layer
            (the next layer, as the mean of its turns' values and advantages, or the next step), not from a sibling.

    Returns:
        ``advantages (T, E, S)`` and ``returns (T, E, S)`` (= advantages + values).

    The only Python loop runs over the T·S links; each handles every env at once.
    """
    T, E, S = rewards.shape
    dtype = values.dtype
    played = torch.ones(T, E, S, dtype=torch.bool, device=values.device) if played is None else played.bool()
    layers = slot_layers((T, E, S), values.device) if layers is None else layers
    ended = _ended(terminated, truncated).to(dtype)  # (T, E)
    advantages = torch.zeros(T, E, S, dtype=dtype, device=values.device)
    next_value = values[T, :, 0].clone()  # (E,) value of the state after the current step
    next_adv = torch.zeros(E, dtype=dtype, device=values.device)  # (E,) its advantage
    for t in range(T - 1, -1, -1):
        next_value = episode_end_values(next_value.unsqueeze(0), terminated[t : t + 1], None if truncated is None else truncated[t : t + 1],
                                        None if final_values is None else final_values[t : t + 1]).squeeze(0)
        next_adv = next_adv * (1.0 - ended[t])  # any episode end cuts the GAE sum
        walk = _LayerWalk([next_value, next_adv])
        for s in range(S - 1, -1, -1):
            here = played[t, :, s]
            after_value, after_adv = walk.enter(here, layers[t, :, s])  # (E,) each: the state after the turn's layer
            delta = rewards[t, :, s] + gamma * after_value - values[t, :, s]  # (E,)
            adv = delta + gamma * gae_lambda * after_adv
            advantages[t, :, s] = torch.where(here, adv, torch.zeros_like(adv))
            walk.add(here, [values[t, :, s], adv])
        next_value, next_adv = walk.before()
    return advantages, advantages + values[:T]


def own_turn_gae(
    agent_rewards: torch.Tensor,
    values: torch.Tensor,
    agents: torch.Tensor,
    played: torch.Tensor,
    terminated: torch.Tensor,
    gamma: float,
    gae_lambda: float,
    truncated: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns of every turn along its own agent's chain of turns (``--credit_assignment
    own_turns``: self-play, where each agent is paid its own side of the game).

    Agent n's turns in an env form one chain: a turn's reward is agent n's rewards from the step of that turn
    until its next turn (the steps in between, its opponent's moves included, and the game's end), and it
    bootstraps from agent n's own next turn, never from the opponent's. Each agent's critic then values its own
    positions: the first mover's edge is in its seat's values, not credited to its policy.

    Args:
        agent_rewards: ``(T, E, N)`` the env's reward of each agent after step t.
        values: ``(T + 1, E, S)`` the critic's value of each turn (its agent's; ``values[T]`` unused).
        agents: ``(T, E, S)`` each turn's agent (-1: empty slot). played: ``(T, E, S)`` the slot holds a turn.
        terminated: ``(T, E)`` the episode ended after step t.
        gamma, gae_lambda: discount and GAE lambda per link of an agent's chain.
        truncated: ``(T, E)`` must not be set: every episode is whole within the rollout (the collector plays rounds
            of whole episodes), so no chain needs a value from beyond the buffer.

    Returns:
        ``advantages (T, E, S)`` and ``returns (T, E, S)``, 0 on empty slots.

    Raises:
        ValueError: an episode was truncated, or a turn's episode does not end within the rollout.
    """
    T, E, S = agents.shape
    N = agent_rewards.shape[-1]
    played = played.bool()
    _check_whole_episodes(played, terminated, truncated)
    dtype, envs = values.dtype, torch.arange(E, device=values.device)
    rewards = own_turn_rewards(agent_rewards.to(dtype), agents, played, terminated)  # (T, E, S) each turn's own pay
    advantages = torch.zeros(T, E, S, dtype=dtype, device=values.device)
    next_value = torch.zeros(E, N, dtype=dtype, device=values.device)  # (E, N) each agent's next own turn: value
    next_adv = torch.zeros(E, N, dtype=dtype, device=values.device)  # (E, N) ... and advantage
    for t in range(T - 1, -1, -1):
        going = (~terminated[t].bool()).to(dtype).unsqueeze(-1)  # (E, 1): an episode that ends at t has no next turns
        next_value, next_adv = next_value * going, next_adv * going
        for s in range(S - 1, -1, -1):
            here, agent = played[t, :, s], agents[t, :, s].clamp(min=0)  # (E,) each
            delta = rewards[t, :, s] + gamma * next_value[envs, agent] - values[t, :, s]  # (E,)
            adv = delta + gamma * gae_lambda * next_adv[envs, agent]
            advantages[t, :, s] = torch.where(here, adv, torch.zeros_like(adv))
            rows, own = envs[here], agent[here]
            next_value[rows, own], next_adv[rows, own] = values[t, here, s], adv[here]
    return advantages, torch.where(played, advantages + values[:T], torch.zeros_like(advantages))


def _check_whole_episodes(played: torch.Tensor, terminated: torch.Tensor, truncated: torch.Tensor | None) -> None:
    """``--credit_assignment own_turns``: every played turn's episode ends within the rollout, none truncated.

    Raises:
        ValueError: an episode was truncated, or a turn's episode does not end within the rollout."""
    if truncated is not None and truncated.any():
        raise ValueError("--credit_assignment own_turns needs episodes that end (terminated); one was truncated, and an "
                         "agent's chain cannot bootstrap from the first speaker's value of its final observation")
    ended_after = torch.flip(torch.cummax(torch.flip(terminated.bool(), [0]).long(), dim=0).values, [0]).bool()  # (T, E): an end at t or later
    if (played.bool() & ~ended_after.unsqueeze(-1)).any():
        raise ValueError("--credit_assignment own_turns needs whole episodes in each rollout (rounds of --horizon steps); "
                         "a turn's episode did not end within it")


def own_turn_rewards(agent_rewards: torch.Tensor, agents: torch.Tensor, played: torch.Tensor, terminated: torch.Tensor) -> torch.Tensor:
    """Each turn's reward along its own agent's chain (what :func:`own_turn_gae` pays it): its agent's rewards from the
    turn's step until that agent's next turn or the episode's end, summed. ``agent_rewards (T, E, N)``, ``agents,
    played (T, E, S)``, ``terminated (T, E)`` → ``(T, E, S)``, 0 on empty slots."""
    T, E, S = agents.shape
    N = agent_rewards.shape[-1]
    played, envs = played.bool(), torch.arange(E, device=agents.device)
    rewards = torch.zeros(T, E, S, dtype=agent_rewards.dtype, device=agents.device)
    pending = torch.zeros(E, N, dtype=agent_rewards.dtype, device=agents.device)  # (E, N) rewards not yet paid to a turn
    for t in range(T - 1, -1, -1):
        pending = pending * (~terminated[t].bool()).to(pending.dtype).unsqueeze(-1) + agent_rewards[t]
        for s in range(S - 1, -1, -1):
            here, agent = played[t, :, s], agents[t, :, s].clamp(min=0)  # (E,) each
            rewards[t, :, s] = torch.where(here, pending[envs, agent], torch.zeros_like(rewards[t, :, s]))
            pending[envs[here], agent[here]] = 0.0
    return rewards


def own_turn_token_gae(
    agent_rewards: torch.Tensor,
    token_values: torch.Tensor,
    response_mask: torch.Tensor,
    agents: torch.Tensor,
    played: torch.Tensor,
    terminated: torch.Tensor,
    gamma: float,
    gae_lambda: float,
    token_gamma: float = 1.0,
    token_gae_lambda: float = 1.0,
    truncated: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level advantages along each agent's own chain of turns (MARFT-T self-play, ``--credit_assignment
    own_turns``): for each agent, :func:`token_chain_gae` over its turns alone (every other turn an empty slot the
    chain passes over), a turn paid :func:`own_turn_rewards` at its last token and bootstrapping from the first token
    of its agent's next turn. With ``token_gamma = token_gae_lambda = 1`` a turn's first token gets :func:`own_turn_gae`'s
    advantage of that turn valued at its first token (a test checks it). An empty turn (no reply token, rare: the end
    token counts) takes no action, as everywhere at the token level: its reward goes to its agent's previous reply in
    the episode (dropped if there is none), where the action-level chain pays the empty turn itself.

    Args: as :func:`own_turn_gae`; ``token_values, response_mask (T, E, S, L)`` as :func:`token_chain_gae`.
    Returns ``advantages (T, E, S, L)`` and ``returns (T, E, S, L)``, 0 at padding and on empty slots.
    Raises: as :func:`own_turn_gae`."""
    T, E, S, L = token_values.shape
    played = played.bool()
    _check_whole_episodes(played, terminated, truncated)
    turn_rewards = own_turn_rewards(agent_rewards, agents, played, terminated).to(token_values.dtype)  # (T, E, S)
    advantages = torch.zeros_like(token_values)
    for agent in range(agent_rewards.shape[-1]):
        mine = played & (agents == agent)  # (T, E, S)
        own, _ = token_chain_gae(turn_rewards * mine, token_values, response_mask * mine.unsqueeze(-1), token_values.new_zeros(E),
                                 terminated, gamma, gae_lambda, token_gamma, token_gae_lambda)
        advantages += own * mine.unsqueeze(-1)
    mask = response_mask.to(token_values.dtype) * played.unsqueeze(-1)
    return advantages * mask, (advantages + token_values) * mask


def discount_matrix(length: int, discount: float, dtype=torch.float32, device=None) -> torch.Tensor:
    """``W[l, k] = discount ** (k - l)`` for ``k >= l``, else 0. Shape (length, length)."""
    idx = torch.arange(length, device=device)
    steps = idx.unsqueeze(0) - idx.unsqueeze(1)  # (L, L): k - l
    return torch.where(steps >= 0, torch.tensor(discount, dtype=dtype, device=device) ** steps.clamp(min=0).to(dtype), torch.zeros((), dtype=dtype, device=device))


# long function: 34 of its 70 lines are the docstring (every tensor's shape and the chain's rules); the code is 36
def token_chain_gae(
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
    layers: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level advantages along the agent chain (MARFT-T).

    Within a reply, token l bootstraps from token l + 1 with no reward, discounted by
    ``token_gamma`` / ``token_gae_lambda``. A reply's last real token receives the agent's
    reward and bootstraps from the first token of the next non-empty reply (the last agent
    from the first agent of the next step), discounted by ``gamma`` / ``gae_lambda``; an
    episode end cuts the chain (a truncated episode's last reply bootstraps from ``final_values``,
    as in :func:`agent_chain_gae`). An empty reply takes no action: its reward goes to the last
    token of the previous reply of the same episode (dropped if there is none). The replies of one parallel
    graph layer (``layers``, as in :func:`agent_chain_gae`) bootstrap from the state after the whole layer:
    the next layer's first tokens (the mean of their values and advantages) or the next step.

    Args:
        rewards: ``(T, E, N)`` reward of each agent turn.
        token_values: ``(T, E, N, L)`` critic value before each reply token.
        response_mask: ``(T, E, N, L)`` 1 for real reply tokens (a prefix of each row).
        bootstrap_value: ``(E,)`` value of the first token after the rollout.
        terminated: ``(T, E)`` the episode ended after step t for good.
        truncated: ``(T, E)`` the episode was cut after step t (None: never).
        final_values: ``(T, E)`` value of a truncated episode's final observation.
        layers: ``(T, E, N)`` layer id of each reply slot (None: every slot its own layer, a chain).

    Returns:
        ``advantages (T, E, N, L)`` and ``returns (T, E, N, L)``, zero at padding.

    The only Python loop runs over the T·N replies of the chain; each iteration handles
    every env and every token of the reply at once (tokens through a discount matrix).
    """
    T, E, N, L = token_values.shape
    dtype, device = token_values.dtype, token_values.device
    mask = response_mask.to(dtype)
    lengths = response_mask.sum(-1).long()  # (T, E, N)
    within = token_gamma * token_gae_lambda
    W = discount_matrix(L, within, dtype, device)  # (L, L)
    advantages = torch.zeros_like(token_values)
    next_value = bootstrap_value.to(dtype).clone()  # (E,) value of the next real token after the current reply
    next_adv = torch.zeros(E, dtype=dtype, device=device)  # (E,) its advantage
    pending = torch.zeros(E, dtype=dtype, device=device)  # (E,) rewards of later empty replies
    ended = _ended(terminated, truncated)  # (T, E)
    layers = slot_layers((T, E, N), device) if layers is None else layers
    for t in range(T - 1, -1, -1):
        alive = 1.0 - ended[t].to(dtype)  # (E,)
        next_value = episode_end_values(next_value.unsqueeze(0), terminated[t : t + 1], None if truncated is None else truncated[t : t + 1],
                                        None if final_values is None else final_values[t : t + 1]).squeeze(0)
        next_adv, pending = next_adv * alive, pending * alive
        walk = _LayerWalk([next_value, next_adv])
        for n in range(N - 1, -1, -1):
            v, m, length = token_values[t, :, n], mask[t, :, n], lengths[t, :, n]  # (E, L), (E, L), (E,)
            real = length > 0
            after_value, after_adv = walk.enter(real, layers[t, :, n])  # (E,) each: the first token after the reply's layer
            adv = _reply_token_advantages(v, m, length, rewards[t, :, n] + pending, after_value, after_adv, W, within, token_gamma, gamma, gae_lambda)
            advantages[t, :, n] = adv
            walk.add(real, [v[:, 0], adv[:, 0]])
            pending = torch.where(real, torch.zeros_like(pending), pending + rewards[t, :, n])
        next_value, next_adv = walk.before()
    return advantages, (advantages + token_values) * mask


def _reply_token_advantages(
    v: torch.Tensor, m: torch.Tensor, length: torch.Tensor, reward: torch.Tensor, after_value: torch.Tensor,
    after_adv: torch.Tensor, W: torch.Tensor, within: float, token_gamma: float, gamma: float, gae_lambda: float,
) -> torch.Tensor:
    """The token advantages ``(E, L)`` of one reply slot of every env (:func:`token_chain_gae`).

    ``v, m (E, L)``: token values and mask; ``length (E,)``: real tokens; ``reward (E,)``: paid on the last real
    token; ``after_value, after_adv (E,)``: the first token after the reply's layer; ``W (L, L)``: the discount matrix of
    ``within`` = token_gamma · token_gae_lambda."""
    dtype, L = v.dtype, v.shape[1]
    pos = torch.arange(L, device=v.device)
    last = (pos.unsqueeze(0) == (length - 1).unsqueeze(1)).to(dtype)  # (E, L) one-hot of the last real token
    v_next = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], dim=1) * (1 - last) + after_value.unsqueeze(1) * last
    discount = token_gamma * (1 - last) + gamma * last
    delta = (reward.unsqueeze(1) * last + discount * v_next - v) * m  # (E, L)
    carry_power = within ** (length.unsqueeze(1) - 1 - pos.unsqueeze(0)).clamp(min=0).to(dtype)  # (E, L)
    return (delta @ W.T + carry_power * gamma * gae_lambda * after_adv.unsqueeze(1)) * m  # (E, L)


def group_relative_advantages(
    rewards: torch.Tensor, active: torch.Tensor, round_length: int, group_size: int, scale: bool = True, eps: float = 1e-4,
    per_agent: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Critic-free, group-relative advantages (GRPO), one per agent turn.

    The T steps are ``T / round_length`` rounds; in each round, envs ``g·G .. g·G + G - 1`` (G = ``group_size``)
    played one episode each on the same task. An episode's team return is the sum over its played steps of
    the mean reward over agents; every turn of the episode gets ``(return - group mean) / (group std + eps)``
    (``scale=False``: ``return - group mean``). The std is the unbiased one (as TRL's GRPO). A group whose
    returns are all equal gets 0. With ``per_agent``, ``rewards`` are per-turn credits and each agent's turns
    are compared by the agent's own return (its credits summed over the episode) within the group.

    Args:
        rewards: ``(T, E, N)``.
        active: ``(T, E)`` bool, the env played step t (cells after its episode ended are not).

    Returns:
        ``advantages (T, E, N)`` (0 at inactive cells), ``returns (T, E, N)`` (the episode's team return at
        every played turn) and the number of groups without return variance.
    """
    T, E, N = rewards.shape
    if T % round_length or E % group_size:
        raise ValueError(f"{T} steps are not whole rounds of {round_length}, or {E} envs not whole groups of {group_size}")
    played = active.to(rewards.dtype).unsqueeze(-1)  # (T, E, 1)
    per_turn = rewards if per_agent else rewards.mean(-1, keepdim=True)  # (T, E, A): A = N per agent, or 1 (the team)
    A = per_turn.shape[-1]
    episode_return = (per_turn * played).reshape(T // round_length, round_length, E, A).sum(1)  # (R, E, A)
    grouped = episode_return.reshape(-1, E // group_size, group_size, A)  # (R, E/G, G, A)
    mean = grouped.mean(2, keepdim=True)
    std = grouped.std(2, keepdim=True) if group_size > 1 else torch.zeros_like(mean)
    flat = std.squeeze(2) < 1e-8  # (R, E/G, A)
    centred = grouped - mean
    group_adv = centred / (std + eps) if scale else centred
    group_adv = torch.where(flat.unsqueeze(2), torch.zeros_like(group_adv), group_adv).reshape(-1, E, A)  # (R, E, A)
    advantages = group_adv.repeat_interleave(round_length, dim=0) * played  # (T, E, A)
    returns = episode_return.repeat_interleave(round_length, dim=0) * played  # (T, E, A)
    return advantages.expand(T, E, N).clone(), returns.expand(T, E, N).clone(), int(flat.all(-1).sum())




def turn_credits(
    rewards: torch.Tensor, mode: str, credit_discount: float = 1.0, team_rewards: torch.Tensor | None = None,
    played: torch.Tensor | None = None, agents: torch.Tensor | None = None, layers: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each turn's credit under ``mode`` (:data:`CREDIT_MODES`). ``rewards (T, E, S)`` → ``(T, E, S)``.

    ``rewards``: each turn's reward from the environment (``env``'s placement, :meth:`RolloutBuffer.insert_step`);
    ``team_rewards (T, E, N)``: the environment's per-agent rewards, whose mean is the team reward R (default:
    ``rewards`` themselves, one turn per agent); ``played (T, E, S)``: the slots holding a turn, filled from slot 0
    (default: all); ``agents (T, E, S)``: each turn's agent (default: slot n is agent n); ``layers (T, E, S)``: each
    turn's layer (default: every turn its own). A turn followed by j more layers of its step is credited with R
    (``equal``) or R x credit_discount^j (``step_discount``); ``per_step`` gives every turn its own agent's reward."""
    if mode not in CREDIT_MODES:
        raise ValueError(f"unknown credit assignment {mode!r}; known: {', '.join(CREDIT_MODES)}")
    if mode == "env":
        return rewards
    if mode == "own_turns":
        raise ValueError("own_turns gives no per-turn credit: each agent's chain is its own (fill_own_turn_advantages)")
    played = torch.ones_like(rewards, dtype=torch.bool) if played is None else played.bool()
    if mode == "per_step":
        if agents is None:
            return rewards
        own = (team_rewards if team_rewards is not None else rewards).gather(-1, agents.clamp(min=0))  # (T, E, S)
        return torch.where(played, own, torch.zeros_like(own))
    team = (rewards if team_rewards is None else team_rewards).mean(-1, keepdim=True)  # (T, E, 1)
    if mode == "equal":
        return team.expand_as(rewards) * played
    layers = slot_layers(rewards.shape, rewards.device) if layers is None else layers
    previous = torch.cat([torch.full_like(layers[..., :1], -1), layers[..., :-1]], dim=-1)  # (T, E, S)
    starts = played & (layers != previous)  # (T, E, S): the slot opens a layer
    index = starts.long().cumsum(-1) - 1  # (T, E, S): the turn's layer, counted from 0
    count = starts.sum(-1, keepdim=True)  # (T, E, 1): layers in the step (K turns in a chain)
    powers = (count - 1 - index).clamp(min=0).to(rewards.dtype)  # (T, E, S): layers after the turn's (K-1-k in a chain)
    return team * credit_discount ** powers * played


def chain_rewards(
    credits: torch.Tensor, gamma: float, played: torch.Tensor | None = None, layers: torch.Tensor | None = None,
    reach: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rewards to put on the agent chain so that, within a team step, each turn's discounted return is
    exactly its credit: ``r_k = c_k - gamma * c_next`` (the step's last layer: ``c_k``), which telescopes to
    ``sum_{j >= k} gamma^(j-k) r_j = c_k``. Later steps still add their discounted returns on top (through
    the bootstrap), as in any MDP. ``credits (T, E, S)`` → ``(T, E, S)``.

    ``c_next`` is what the turn's return bootstraps from within the step: the next layer's credits (``layers``, as
    in :func:`agent_chain_gae`; a parallel layer's mean), each times its ``reach (T, E, S)`` (default 1): with
    token-level GAE, a reply's credit is its return at its last token, and its first token, which the previous
    reply bootstraps from, returns ``token_gamma^(length - 1)`` of it. Slots outside ``played`` (default: all)
    get reward 0 and are skipped."""
    S = credits.shape[-1]
    played = torch.ones_like(credits, dtype=torch.bool) if played is None else played.bool()
    layers = slot_layers(credits.shape, credits.device) if layers is None else layers
    reached = credits if reach is None else credits * reach  # (T, E, S): what each turn's predecessor bootstraps from
    out = torch.zeros_like(credits)
    walk = _LayerWalk([torch.zeros_like(credits[..., 0])])
    for s in range(S - 1, -1, -1):
        here = played[..., s]
        (following,) = walk.enter(here, layers[..., s])  # (T, E): the next layer's credit, 0 after the last
        out[..., s] = torch.where(here, credits[..., s] - gamma * following, torch.zeros_like(following))
        walk.add(here, [reached[..., s]])
    return out


def agent_step_credits(
    credits: torch.Tensor, agents: torch.Tensor, n_agents: int, mode: str, team_rewards: torch.Tensor,
) -> torch.Tensor:
    """GRPO: each agent's credit of each step, ``(T, E, N)``, from the turns' ``credits (T, E, S)`` (``agents (T, E, S)``:
    each turn's agent, -1 for an empty slot): the mean of its turns' credits, so an extra turn adds nothing; an
    agent without a turn in the step gets what the environment gave it (``per_step``: its reward), the team reward
    R (``equal``), or the mean credit of the step's turns (``step_discount``), so not speaking neither wins nor
    loses against speaking."""
    spoke = (agents.unsqueeze(-1) == torch.arange(n_agents, device=agents.device)).to(credits.dtype)  # (T, E, S, N)
    turns = spoke.sum(2)  # (T, E, N): the agent's turns in the step
    total = (credits.unsqueeze(-1) * spoke).sum(2)  # (T, E, N)
    mean = total / turns.clamp(min=1)
    if mode == "per_step":
        absent = team_rewards
    elif mode == "equal":
        absent = team_rewards.mean(-1, keepdim=True).expand_as(mean)
    else:
        played = (agents >= 0).to(credits.dtype)
        absent = ((credits * played).sum(-1, keepdim=True) / played.sum(-1, keepdim=True).clamp(min=1)).expand_as(mean)
    return torch.where(turns > 0, mean, absent)


def fill_action_advantages(buffer, gamma: float, gae_lambda: float, rewards: torch.Tensor | None = None) -> None:
    """A rollout buffer's (:class:`~marft.runner.shared.buffer.RolloutBuffer`) action-level advantages and returns:
    GAE along each env's turns on ``rewards`` (T, E, S) (default: the turns' own, ``buffer.rewards``)."""
    buffer.advantages, buffer.returns = agent_chain_gae(
        buffer.rewards if rewards is None else rewards, buffer.values, buffer.terminated, gamma, gae_lambda,
        truncated=buffer.truncated, final_values=buffer.final_values, played=buffer.played, layers=buffer.layer,
    )


def fill_own_turn_advantages(buffer, gamma: float, gae_lambda: float) -> None:
    """A rollout buffer's action-level advantages and returns along each agent's own chain of turns
    (:func:`own_turn_gae`, ``--credit_assignment own_turns``)."""
    buffer.advantages, buffer.returns = own_turn_gae(
        buffer.agent_rewards, buffer.values, buffer.agent, buffer.played, buffer.terminated, gamma, gae_lambda, truncated=buffer.truncated,
    )


def fill_own_turn_token_advantages(buffer, gamma: float, gae_lambda: float, token_gamma: float, token_gae_lambda: float) -> None:
    """A rollout buffer's token-level advantages and returns along each agent's own chain of turns
    (:func:`own_turn_token_gae`, MARFT-T with ``--credit_assignment own_turns``)."""
    buffer.token_advantages, buffer.token_returns = own_turn_token_gae(
        buffer.agent_rewards, buffer.token_values, buffer.response_mask, buffer.agent, buffer.played, buffer.terminated,
        gamma, gae_lambda, token_gamma, token_gae_lambda, truncated=buffer.truncated,
    )


def fill_token_advantages(
    buffer, gamma: float, gae_lambda: float, token_gamma: float, token_gae_lambda: float, rewards: torch.Tensor | None = None
) -> None:
    """A rollout buffer's token-level advantages and returns: token-chain GAE on ``rewards``
    (T, E, S) (default: the turns' own, ``buffer.rewards``); empty slots have no reply tokens, so the chain passes over them."""
    buffer.token_advantages, buffer.token_returns = token_chain_gae(
        buffer.rewards if rewards is None else rewards, buffer.token_values, buffer.response_mask, buffer.values[-1, :, 0], buffer.terminated,
        gamma, gae_lambda, token_gamma, token_gae_lambda, truncated=buffer.truncated, final_values=buffer.final_values,
        layers=buffer.layer,
    )


def fill_group_advantages(
    buffer, round_length: int, group_size: int, scale: bool, credits: torch.Tensor | None = None, mode: str = "equal",
) -> int:
    """A rollout buffer's critic-free advantages: every turn's advantage is its episode's group-relative return
    (:func:`~marft.algorithms.advantages.group_relative_advantages`; with per-turn ``credits`` (T, E, S) of
    credit mode ``mode``, each agent's return sums its step credits, :func:`~marft.algorithms.advantages.agent_step_credits`:
    the mean of its turns' credits in each step, so the number of turns does not count); ``returns`` hold the
    episode returns. Returns how many groups had no return variance (their advantages are 0)."""
    played = buffer.played
    if credits is None:  # the team's return: one column, on every turn
        advantages, returns, zero_variance = group_relative_advantages(buffer.agent_rewards, buffer.active, round_length, group_size, scale)
        buffer.advantages = advantages[..., :1] * played
        buffer.returns = returns[..., :1] * played
        return zero_variance
    spoke = (buffer.agent.unsqueeze(-1) == torch.arange(buffer.n_agents)).float()  # (T, E, S, N)
    per_agent = agent_step_credits(credits, buffer.agent, buffer.n_agents, mode, buffer.agent_rewards)  # (T, E, N)
    advantages, returns, zero_variance = group_relative_advantages(per_agent, buffer.active, round_length, group_size, scale, per_agent=True)
    buffer.advantages = (spoke * advantages.unsqueeze(2)).sum(-1)  # (T, E, S): the turn's agent's column
    buffer.returns = (spoke * returns.unsqueeze(2)).sum(-1)
    return zero_variance


def buffer_credits(buffer, mode: str, credit_discount: float) -> torch.Tensor:
    """Each turn's credit (:func:`turn_credits`) from a rollout buffer's turns (their agents and layers) and
    per-agent rewards, ``(T, E, S)``."""
    return turn_credits(buffer.rewards, mode, credit_discount, team_rewards=buffer.agent_rewards, played=buffer.played,
                        agents=buffer.agent, layers=buffer.layer)


def batch_ranks_replies(buffer, token_level: bool, dist) -> bool:
    """Whether a rollout ``buffer`` (:class:`~marft.runner.shared.buffer.RolloutBuffer`, over all processes of
    ``dist``) can rank replies: not when its advantages (token advantages at the token level) are all zero, nor
    when every reward is equal and every step ended its episode for good (each return is then a sum of equal
    rewards with nothing bootstrapped, so any advantage is the critic's error alone). Equal rewards in a batch where
    an episode goes on are informative: the bootstrapped value of the next state still ranks the replies. A NaN
    advantage counts as not zero (the update's checks catch it)."""
    advantages = buffer.token_advantages if token_level else buffer.advantages
    going_on = buffer.active & ~buffer.terminated  # (T, E): a played step whose episode continues (or was cut)
    nonzero, open_steps = dist.sum_floats([float((advantages != 0).sum()), float(going_on.sum())])
    if nonzero == 0:
        return False
    if open_steps > 0:
        return True
    stats = dist.mean_std(buffer.agent_rewards.flatten().double())
    return stats is None or float(stats[1]) > 1e-9
