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
* ``n_words``                      (T, E, N)     words in each decoded reply (for ``normalization_mode=word``)
* ``advantages, returns``          (T, E, N)     action level, filled by :meth:`compute_advantages`
* ``token_values``                 (T, E, N, L)  token-level critic values at sampling time (MARFT-T)
* ``token_advantages, token_returns`` (T, E, N, L) token level, filled by :meth:`compute_token_advantages`
"""

from __future__ import annotations

import torch

from marft.agents.team import TurnOutput
from marft.algorithms.advantages import agent_chain_gae, token_chain_gae


class RolloutBuffer:
    def __init__(self, episode_length: int, n_envs: int, n_agents: int, max_prompt_len: int, max_new_tokens: int, pad_id: int):
        T, E, N, P, L = episode_length, n_envs, n_agents, max_prompt_len, max_new_tokens
        self.shape = (T, E, N)
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
        self.n_words = torch.zeros((T, E, N))
        self.advantages = torch.zeros((T, E, N))
        self.returns = torch.zeros((T, E, N))
        self.token_values = torch.zeros((T, E, N, L))
        self.token_advantages = torch.zeros((T, E, N, L))
        self.token_returns = torch.zeros((T, E, N, L))

    def insert_turn(self, step: int, agent: int, turn: TurnOutput) -> None:
        """Store one agent's turn for all envs; its prompt is right-aligned (left padding kept)."""
        width = turn.prompt_ids.shape[1]
        self.prompt_ids[step, :, agent, -width:] = turn.prompt_ids.cpu()
        self.prompt_mask[step, :, agent, -width:] = turn.prompt_mask.cpu()
        self.prompt_mask[step, :, agent, :-width] = 0
        self.response_ids[step, :, agent] = turn.response_ids.cpu()
        self.response_mask[step, :, agent] = turn.response_mask.cpu()
        self.logprobs[step, :, agent] = turn.logprobs.float().cpu()
        self.values[step, :, agent] = turn.values.float().cpu()
        if turn.token_values is not None:
            self.token_values[step, :, agent] = turn.token_values.float().cpu()
        self.n_words[step, :, agent] = torch.tensor([max(len(t.split()), 1) for t in turn.texts], dtype=torch.float)

    def insert_step(self, step: int, rewards, terminated, truncated) -> None:
        """Rewards ``(E, N)`` and the episode ends ``terminated (E,)``, ``truncated (E,)`` after all agents acted at ``step``."""
        self.rewards[step] = torch.as_tensor(rewards, dtype=torch.float)
        self.terminated[step] = torch.as_tensor(terminated, dtype=torch.bool)
        self.truncated[step] = torch.as_tensor(truncated, dtype=torch.bool)

    @property
    def dones(self) -> torch.Tensor:
        """``(T, E)`` the episode ended after step t, terminated or truncated."""
        return self.terminated | self.truncated

    def compute_advantages(self, gamma: float, gae_lambda: float) -> None:
        self.advantages, self.returns = agent_chain_gae(
            self.rewards, self.values, self.terminated, gamma, gae_lambda, truncated=self.truncated, final_values=self.final_values
        )

    def compute_token_advantages(self, gamma: float, gae_lambda: float, token_gamma: float, token_gae_lambda: float) -> None:
        self.token_advantages, self.token_returns = token_chain_gae(
            self.rewards, self.token_values, self.response_mask, self.values[-1, :, 0], self.terminated,
            gamma, gae_lambda, token_gamma, token_gae_lambda, truncated=self.truncated, final_values=self.final_values,
        )

    ACTION_FIELDS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "logprobs", "n_words", "advantages", "returns")
    TOKEN_FIELDS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "logprobs", "token_values", "token_advantages", "token_returns")

    def agent_samples(self, agents: int | list[int], token_level: bool = False) -> dict[str, torch.Tensor]:
        """The turns of one agent, or of several (agents sharing an adapter), flattened over (T, E):
        every tensor gets a leading dim of T·E per agent."""
        agents = [agents] if isinstance(agents, int) else list(agents)
        fields = self.TOKEN_FIELDS if token_level else self.ACTION_FIELDS
        samples = {name: torch.cat([getattr(self, name)[:, :, a].flatten(0, 1) for a in agents]) for name in fields}
        if not token_level:
            samples["values"] = torch.cat([self.values[:-1, :, a].flatten(0, 1) for a in agents])
        return samples

    def critic_samples(self, token_level: bool = False) -> dict[str, torch.Tensor]:
        """Every agent turn flattened over (T, E, N): prompts with values and returns
        (token level: also the replies with per-token values and returns)."""
        if token_level:
            fields = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "token_values", "token_returns")
            return {name: getattr(self, name).flatten(0, 2) for name in fields}
        return {
            "prompt_ids": self.prompt_ids.flatten(0, 2),
            "prompt_mask": self.prompt_mask.flatten(0, 2),
            "values": self.values[:-1].flatten(0, 2),
            "returns": self.returns.flatten(0, 2),
        }


RESPONSE_FIELDS = ("response_ids", "response_mask", "logprobs", "token_values", "token_advantages", "token_returns")


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
