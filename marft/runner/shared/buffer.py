"""Preallocated storage of one rollout batch (action level).

Fields and shapes (T = episode_length, E = n_rollout_threads, N = n_agents,
P = max prompt length, L = max_new_tokens):

* ``prompt_ids, prompt_mask``      (T, E, N, P)  left-padded prompt of each agent turn
* ``response_ids, response_mask``  (T, E, N, L)  right-padded reply (mask through the first EOS)
* ``logprobs``                     (T, E, N, L)  token log-probs at sampling time
* ``values``                       (T + 1, E, N) critic values; ``values[T, :, 0]`` bootstraps
* ``rewards``                      (T, E, N)
* ``terminated``                   (T, E)        the episode ended after step t for good (no bootstrap)
* ``truncated``                    (T, E)        the episode was cut after step t (gymnasium's time limit):
                                                 it bootstraps from ``final_values``
* ``final_values``                 (T, E)        critic value of a truncated episode's final observation
                                                 (the first agent's turn that never came), 0 elsewhere
* ``active``                       (T, E)        the env played step t (GRPO: an env whose episode ended before
                                                 its group's did sits out the rest of the round); inactive
                                                 cells are left out of every sample
* ``n_words``                      (T, E, N)     words in each decoded reply (for ``normalization_mode=word``)
* ``advantages, returns``          (T, E, N)     action level, filled by :meth:`compute_advantages` (or
                                                 :meth:`compute_group_advantages`, critic-free)
* ``token_values``                 (T, E, N, L)  token-level critic values at sampling time (MARFT-T)
* ``token_advantages, token_returns`` (T, E, N, L) token level, filled by :meth:`compute_token_advantages`
"""

from __future__ import annotations

import torch

from marft.agents.team import TurnOutput
from marft.algorithms.advantages import agent_chain_gae, group_relative_advantages, token_chain_gae


class RolloutBuffer:
    def __init__(self, episode_length: int, n_envs: int, n_agents: int, max_prompt_len: int, max_new_tokens: int, pad_id: int):
        T, E, N, P, L = episode_length, n_envs, n_agents, max_prompt_len, max_new_tokens
        self.shape = (T, E, N)
        self.pad_id = pad_id
        self.prompt_ids = torch.full((T, E, N, P), pad_id, dtype=torch.long)
        self.prompt_mask = torch.zeros((T, E, N, P), dtype=torch.long)
        self.response_ids = torch.full((T, E, N, L), pad_id, dtype=torch.long)
        self.response_mask = torch.zeros((T, E, N, L), dtype=torch.long)
        self.logprobs = torch.zeros((T, E, N, L))
        self.values = torch.zeros((T + 1, E, N))
        self.rewards = torch.zeros((T, E, N))
        self.terminated = torch.zeros((T, E), dtype=torch.bool)
        self.truncated = torch.zeros((T, E), dtype=torch.bool)
        self.final_values = torch.zeros((T, E))
        self.active = torch.ones((T, E), dtype=torch.bool)
        self.n_words = torch.zeros((T, E, N))
        self.advantages = torch.zeros((T, E, N))
        self.returns = torch.zeros((T, E, N))
        self.token_values = torch.zeros((T, E, N, L))
        self.token_advantages = torch.zeros((T, E, N, L))
        self.token_returns = torch.zeros((T, E, N, L))

    def insert_turn(self, step: int, agent: int, turn: TurnOutput, envs: torch.Tensor | None = None) -> None:
        """Store one agent's turn for all envs (or for the envs listed in ``envs``, one per row of ``turn``);
        its prompt is right-aligned (left padding kept)."""
        at = slice(None) if envs is None else torch.as_tensor(envs, dtype=torch.long)
        width = turn.prompt_ids.shape[1]
        prompt_ids = torch.full((turn.prompt_ids.shape[0], self.prompt_ids.shape[-1]), self.pad_id, dtype=torch.long)  # (B, P)
        prompt_mask = torch.zeros_like(prompt_ids)
        prompt_ids[:, -width:], prompt_mask[:, -width:] = turn.prompt_ids.cpu(), turn.prompt_mask.cpu()
        self.prompt_ids[step, at, agent] = prompt_ids
        self.prompt_mask[step, at, agent] = prompt_mask
        self.response_ids[step, at, agent] = turn.response_ids.cpu()
        self.response_mask[step, at, agent] = turn.response_mask.cpu()
        self.logprobs[step, at, agent] = turn.logprobs.float().cpu()
        if turn.values is not None:
            self.values[step, at, agent] = turn.values.float().cpu()
        if turn.token_values is not None:
            self.token_values[step, at, agent] = turn.token_values.float().cpu()
        self.n_words[step, at, agent] = torch.tensor([max(len(t.split()), 1) for t in turn.texts], dtype=torch.float)

    def insert_step(self, step: int, rewards, terminated, truncated) -> None:
        """Rewards ``(E, N)`` and the episode ends ``terminated (E,)``, ``truncated (E,)`` after all agents acted at ``step``."""
        self.rewards[step] = torch.as_tensor(rewards, dtype=torch.float)
        self.terminated[step] = torch.as_tensor(terminated, dtype=torch.bool)
        self.truncated[step] = torch.as_tensor(truncated, dtype=torch.bool)

    @property
    def dones(self) -> torch.Tensor:
        """``(T, E)`` the episode ended after step t, terminated or truncated."""
        return self.terminated | self.truncated

    def compute_advantages(self, gamma: float, gae_lambda: float, rewards: torch.Tensor | None = None) -> None:
        """Agent-chain GAE on ``rewards`` (T, E, N) (default: the env's, :attr:`rewards`)."""
        self.advantages, self.returns = agent_chain_gae(
            self.rewards if rewards is None else rewards, self.values, self.terminated, gamma, gae_lambda,
            truncated=self.truncated, final_values=self.final_values,
        )

    def compute_token_advantages(
        self, gamma: float, gae_lambda: float, token_gamma: float, token_gae_lambda: float, rewards: torch.Tensor | None = None
    ) -> None:
        """Token-chain GAE on ``rewards`` (T, E, N) (default: the env's, :attr:`rewards`)."""
        self.token_advantages, self.token_returns = token_chain_gae(
            self.rewards if rewards is None else rewards, self.token_values, self.response_mask, self.values[-1, :, 0], self.terminated,
            gamma, gae_lambda, token_gamma, token_gae_lambda, truncated=self.truncated, final_values=self.final_values,
        )

    def compute_group_advantages(self, round_length: int, group_size: int, scale: bool, credits: torch.Tensor | None = None) -> int:
        """Critic-free: every turn's advantage is its episode's group-relative return
        (:func:`~marft.algorithms.advantages.group_relative_advantages`; with per-turn ``credits`` (T, E, N),
        each agent's return from its own credits); ``returns`` hold the episode returns.
        Returns how many groups had no return variance (their advantages are 0)."""
        self.advantages, self.returns, zero_variance = group_relative_advantages(
            self.rewards if credits is None else credits, self.active, round_length, group_size, scale, per_agent=credits is not None
        )
        return zero_variance

    ACTION_FIELDS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "logprobs", "n_words", "advantages", "returns")
    TOKEN_FIELDS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "logprobs", "token_values", "token_advantages", "token_returns")

    def agent_samples(self, agents: int | list[int], token_level: bool = False) -> dict[str, torch.Tensor]:
        """The turns of one agent, or of several (agents sharing an adapter), flattened over (T, E):
        every tensor gets a leading dim of T·E per agent."""
        agents = [agents] if isinstance(agents, int) else list(agents)
        fields = self.TOKEN_FIELDS if token_level else self.ACTION_FIELDS
        played = self.active.flatten()  # (T·E,) the turns that were played
        samples = {name: torch.cat([getattr(self, name)[:, :, a].flatten(0, 1)[played] for a in agents]) for name in fields}
        if not token_level:
            samples["values"] = torch.cat([self.values[:-1, :, a].flatten(0, 1)[played] for a in agents])
        return samples

    def critic_samples(self, token_level: bool = False, agents: list[int] | None = None) -> dict[str, torch.Tensor]:
        """Every agent turn (or the turns of ``agents``, for a per-agent critic) flattened over (T, E, N):
        prompts with values and returns (token level: also the replies with per-token values and returns)."""
        keep = torch.zeros(self.shape[-1], dtype=torch.bool)
        keep[agents if agents is not None else slice(None)] = True
        played = (self.active.unsqueeze(-1) & keep).flatten()  # (T·E·N,)
        if token_level:
            fields = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "token_values", "token_returns")
            return {name: getattr(self, name).flatten(0, 2)[played] for name in fields}
        return {
            "prompt_ids": self.prompt_ids.flatten(0, 2)[played],
            "prompt_mask": self.prompt_mask.flatten(0, 2)[played],
            "values": self.values[:-1].flatten(0, 2)[played],
            "returns": self.returns.flatten(0, 2)[played],
        }


RESPONSE_FIELDS = ("response_ids", "response_mask", "logprobs", "token_values", "token_advantages", "token_returns", "ref_logprobs")


def trim_batch(samples: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    """Drop all-padding prompt columns (left) and reply columns (right), move to ``device``."""
    out = dict(samples)
    if "prompt_mask" in samples:
        used = samples["prompt_mask"].any(0).nonzero()
        start = int(used[0]) if len(used) else samples["prompt_mask"].shape[1] - 1
        out["prompt_ids"] = samples["prompt_ids"][:, start:]
        out["prompt_mask"] = samples["prompt_mask"][:, start:]
    if "response_mask" in samples:
        used = samples["response_mask"].any(0).nonzero()
        end = int(used[-1]) + 1 if len(used) else 1
        for name in RESPONSE_FIELDS:
            if name in samples:
                out[name] = samples[name][:, :end]
    return {k: v.to(device) for k, v in out.items()}
