"""Preallocated storage of one rollout batch: turns, each tagged with the agent that spoke it.

A team step of a workflow (:mod:`marft.envs.workflows`) takes up to S turns per env: S = N with the sequential
workflow or a graph (slot n is then agent n), 2·max_turns + 1 with an orchestrator. Turn k of env e's team
step t sits in slot ``(t, e, k)``, its agent in ``agent[t, e, k]`` (-1: the slot holds no turn). Every
advantage estimator runs along each env's own sequence of played turns.

Fields and shapes (T = episode_length, E = n_rollout_threads, S = turn slots per step, N = n_agents,
P = max prompt length, L = max_new_tokens):

* ``agent``                        (T, E, S)     the agent of each turn, -1 for an empty slot
* ``layer``                        (T, E, S)     the moment of its step each turn was generated at: turns of one
                                                 moment are a parallel graph layer (siblings, which bootstrap from
                                                 the state after the whole layer, not from each other), -1 empty
* ``prompt_ids, prompt_mask``      (T, E, S, P)  left-padded prompt of each turn
* ``response_ids, response_mask``  (T, E, S, L)  right-padded reply (mask through the first EOS)
* ``logprobs``                     (T, E, S, L)  token log-probs at sampling time
* ``sampling_logprobs``            (T, E, S, L)  an inference engine's log-probs of the same tokens (vllm), or None
* ``values``                       (T + 1, E, S) critic values; ``values[T, :, 0]`` bootstraps (the value of
                                                 each env's next turn)
* ``agent_rewards``                (T, E, N)     the env's per-agent rewards of step t
* ``rewards``                      (T, E, S)     each turn's reward (``--credit_assignment env``): an agent's
                                                 reward sits on its last turn of the step, the rewards of agents
                                                 that did not speak on the step's last turn, so the step pays
                                                 every agent's reward once, however many turns it took
* ``terminated``                   (T, E)        the episode ended after step t for good (no bootstrap)
* ``truncated``                    (T, E)        the episode was cut after step t (gymnasium's time limit):
                                                 it bootstraps from ``final_values``
* ``final_values``                 (T, E)        critic value of a truncated episode's final observation
                                                 (the first speaker's turn that never came), 0 elsewhere
* ``n_words``                      (T, E, S)     words in each decoded reply (for ``normalization_mode=word``)
* ``advantages, returns``          (T, E, S)     action level, filled by the trainer
                                                 (:mod:`marft.algorithms.advantages`: ``fill_action_advantages``, or
                                                 ``fill_group_advantages``, critic-free)
* ``token_values``                 (T, E, S, L)  token-level critic values at sampling time (MARFT-T)
* ``token_advantages, token_returns`` (T, E, S, L) token level, filled by ``fill_token_advantages``

``active`` (T, E) says which envs played step t (GRPO: an env whose episode ended before its group's did sits
out the rest of the round); ``played`` (T, E, S) which slots hold a turn. Empty slots are left out of every sample.
"""

from __future__ import annotations

import torch

from marft.types import TurnBatch, TurnOutput


class RolloutBuffer:
    def __init__(
        self, episode_length: int, n_envs: int, n_agents: int, max_prompt_len: int, max_new_tokens: int, pad_id: int,
        slots_per_step: int | None = None,
    ):
        T, E, N, P, L = episode_length, n_envs, n_agents, max_prompt_len, max_new_tokens
        S = n_agents if slots_per_step is None else slots_per_step
        self.shape = (T, E, S)
        self.n_agents = N
        self.pad_id = pad_id
        self.agent = torch.full((T, E, S), -1, dtype=torch.long)
        self.layer = torch.full((T, E, S), -1, dtype=torch.long)
        self.prompt_ids = torch.full((T, E, S, P), pad_id, dtype=torch.long)
        self.prompt_mask = torch.zeros((T, E, S, P), dtype=torch.long)
        self.response_ids = torch.full((T, E, S, L), pad_id, dtype=torch.long)
        self.response_mask = torch.zeros((T, E, S, L), dtype=torch.long)
        self.logprobs = torch.zeros((T, E, S, L))
        self.values = torch.zeros((T + 1, E, S))
        self.agent_rewards = torch.zeros((T, E, N))
        self.rewards = torch.zeros((T, E, S))
        self.terminated = torch.zeros((T, E), dtype=torch.bool)
        self.truncated = torch.zeros((T, E), dtype=torch.bool)
        self.final_values = torch.zeros((T, E))
        self.n_words = torch.zeros((T, E, S))
        self.advantages = torch.zeros((T, E, S))
        self.returns = torch.zeros((T, E, S))
        self.token_values = torch.zeros((T, E, S, L))
        self.token_advantages = torch.zeros((T, E, S, L))
        self.token_returns = torch.zeros((T, E, S, L))
        self.sampling_logprobs: torch.Tensor | None = None
        """(T, E, S, L) an inference engine's log-probs of the sampled tokens (``--generation_backend vllm``); None
        while every turn was sampled by the trainer's own model (then they equal ``logprobs``)."""

    @property
    def played(self) -> torch.Tensor:
        """``(T, E, S)`` the slot holds a turn."""
        return self.agent >= 0

    @property
    def active(self) -> torch.Tensor:
        """``(T, E)`` env e played step t (took at least one turn)."""
        return self.played.any(-1)

    def insert_turn(self, step: int, agent: int, turn: TurnOutput, envs=None, slots=None, layer: int | None = None) -> None:
        """Store one agent's turn for all envs (or for the envs listed in ``envs``, one per row of ``turn``) in
        slot ``slots`` (one per row; default: slot ``agent``, the sequential workflow's), generated at moment
        ``layer`` of the step (default: its slot, a chain of single turns); its prompt is right-aligned (left
        padding kept)."""
        at = slice(None) if envs is None else torch.as_tensor(envs, dtype=torch.long)
        slot = agent if slots is None else torch.as_tensor(slots, dtype=torch.long)
        self.layer[step, at, slot] = slot if layer is None else layer
        width = turn.prompt_ids.shape[1]
        prompt_ids = torch.full((turn.prompt_ids.shape[0], self.prompt_ids.shape[-1]), self.pad_id, dtype=torch.long)  # (B, P)
        prompt_mask = torch.zeros_like(prompt_ids)
        prompt_ids[:, -width:], prompt_mask[:, -width:] = turn.prompt_ids.cpu(), turn.prompt_mask.cpu()
        self.agent[step, at, slot] = agent
        self.prompt_ids[step, at, slot] = prompt_ids
        self.prompt_mask[step, at, slot] = prompt_mask
        self.response_ids[step, at, slot] = turn.response_ids.cpu()
        self.response_mask[step, at, slot] = turn.response_mask.cpu()
        self.logprobs[step, at, slot] = turn.logprobs.float().cpu()
        if turn.sampling_logprobs is not None:
            if self.sampling_logprobs is None:
                self.sampling_logprobs = self.logprobs.clone()
            self.sampling_logprobs[step, at, slot] = turn.sampling_logprobs.float().cpu()
        elif self.sampling_logprobs is not None:
            self.sampling_logprobs[step, at, slot] = self.logprobs[step, at, slot]
        if turn.values is not None:
            self.values[step, at, slot] = turn.values.float().cpu()
        if turn.token_values is not None:
            self.token_values[step, at, slot] = turn.token_values.float().cpu()
        self.n_words[step, at, slot] = torch.tensor([max(len(t.split()), 1) for t in turn.texts], dtype=torch.float)

    def insert_step(self, step: int, rewards, terminated, truncated) -> None:
        """Rewards ``(E, N)`` (one per agent) and the episode ends ``terminated (E,)``, ``truncated (E,)`` after
        the team step ``step``: agent n's reward goes to its last turn of the step, the rewards of agents that did
        not speak to the step's last turn (insert the turns first)."""
        self.agent_rewards[step] = torch.as_tensor(rewards, dtype=torch.float)
        spoke = self.agent[step].unsqueeze(-1) == torch.arange(self.n_agents)  # (E, S, N)
        later = spoke.flip(1).cumsum(1).flip(1) - spoke.long()  # (E, S, N): the agent's turns after slot s
        last = spoke & (later == 0)
        played = self.agent[step] >= 0  # (E, S)
        final = played & (played.flip(1).cumsum(1).flip(1) == 1)  # (E, S): the step's last turn
        silent = ~spoke.any(1)  # (E, N): agents without a turn in the step
        last = last | (final.unsqueeze(-1) & silent.unsqueeze(1))
        self.rewards[step] = (last.float() * self.agent_rewards[step].unsqueeze(1)).sum(-1)
        self.terminated[step] = torch.as_tensor(terminated, dtype=torch.bool)
        self.truncated[step] = torch.as_tensor(truncated, dtype=torch.bool)

    @property
    def dones(self) -> torch.Tensor:
        """``(T, E)`` the episode ended after step t, terminated or truncated."""
        return self.terminated | self.truncated

    ACTION_FIELDS = ("agent", "prompt_ids", "prompt_mask", "response_ids", "response_mask", "logprobs", "n_words", "advantages", "returns")
    TOKEN_FIELDS = ("agent", "prompt_ids", "prompt_mask", "response_ids", "response_mask", "logprobs", "token_values", "token_advantages", "token_returns")

    def agent_samples(self, agents: int | list[int], token_level: bool = False) -> TurnBatch:
        """The turns of one agent, or of several (agents sharing an adapter), agent by agent, each agent's in
        (step, env, slot) order, as one :class:`~marft.types.TurnBatch`; ``agent`` says whose each turn is (the
        update runs each agent's role header once per minibatch chunk)."""
        agents = [agents] if isinstance(agents, int) else list(agents)
        fields = self.TOKEN_FIELDS if token_level else self.ACTION_FIELDS
        rows = [(self.agent == a).flatten() for a in agents]  # per agent, (T·E·S,)
        if self.sampling_logprobs is not None:
            fields = (*fields, "sampling_logprobs")
        samples = {name: torch.cat([getattr(self, name).flatten(0, 2)[mine] for mine in rows]) for name in fields}
        if not token_level:
            samples["values"] = torch.cat([self.values[:-1].flatten(0, 2)[mine] for mine in rows])
        return TurnBatch(**samples)

    def critic_samples(self, token_level: bool = False, agents: list[int] | None = None) -> TurnBatch:
        """Every turn (or the turns of ``agents``, for a per-agent critic) in (step, env, slot) order:
        their agents and prompts with values and returns (token level: also the replies with per-token values and
        returns)."""
        played = self.critic_rows(agents)  # (T·E·S,)
        if token_level:
            fields = ("agent", "prompt_ids", "prompt_mask", "response_ids", "response_mask", "token_values", "token_returns")
            return TurnBatch(**{name: getattr(self, name).flatten(0, 2)[played] for name in fields})
        return TurnBatch(
            agent=self.agent.flatten(0, 2)[played],
            prompt_ids=self.prompt_ids.flatten(0, 2)[played],
            prompt_mask=self.prompt_mask.flatten(0, 2)[played],
            values=self.values[:-1].flatten(0, 2)[played],
            returns=self.returns.flatten(0, 2)[played],
        )

    def critic_rows(self, agents: list[int] | None = None) -> torch.Tensor:
        """``(T·E·S,)`` the flat slots :meth:`critic_samples` takes: every turn, or the turns of ``agents``."""
        keep = self.played if agents is None else torch.isin(self.agent, torch.as_tensor(agents, dtype=torch.long))
        return keep.flatten()

    def set_critic_values(self, values: torch.Tensor, token_level: bool = False, agents: list[int] | None = None) -> None:
        """Store a critic's values of the turns :meth:`critic_samples` returns (same rows, same order): ``(B,)``
        values of the prompts, or token level ``(B, L')`` values before each reply token (L' ≤ L: the replies
        trimmed of the batch's all-padding columns; the rest is 0), the first of which is also the prompt's value (0
        for an empty reply, which takes no action; the token-level advantages read only the token values)."""
        rows = self.critic_rows(agents).nonzero().squeeze(1)  # (B,)
        values = values.detach().float().cpu()
        if token_level:
            flat = self.token_values.view(-1, self.token_values.shape[-1])  # (T·E·S, L), a view
            flat[rows] = 0.0
            flat[rows, : values.shape[1]] = values
            values = values[:, 0]
        self.values[:-1].view(-1)[rows] = values
