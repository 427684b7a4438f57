"""The agent team: ONE base causal LM, one LoRA adapter per agent, and a critic.

All agents and the critic share the same frozen base weights; each agent owns a LoRA adapter (or all
share one with ``shared_lora``), and the centralized critic owns its own LoRA adapter plus a linear
value head. Memory therefore grows with the number of agents only by their adapters.

The team is put together from parts with one job each:

* :class:`~marft.agents.adapters.AdapterBank` (``team.bank``): the peft model and its adapters: create,
  route forward passes, select each adapter's parameters;
* :class:`~marft.agents.prompts.PromptEncoder` (``team.prompts``): an agent's prompt as token ids;
* :class:`~marft.agents.headers.RoleHeaderCache` (``team.headers``): each role header run once per batch;
* a :class:`~marft.agents.generation.GenerationBackend` (``team.backend``): samples replies
  (transformers' ``generate`` today);
* :class:`~marft.agents.critic.Critic` (``team.critic``, None in critic-free teams): value heads and values.

What stays here is what makes them a team of agents: which adapter each agent speaks through, a turn
(prompts → replies → scores), a whole sequential team step, and the policy's log-probs of given replies.

Tensor layout used throughout (B = batch of prompts, P = prompt length,
L = reply length, V = vocabulary):

* prompts are LEFT-padded: ``prompt_ids (B, P)``, ``prompt_mask (B, P)``;
* replies are RIGHT-padded: ``response_ids (B, L)``, ``response_mask (B, L)``;
  a reply's mask covers its tokens up to and including the first EOS.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from contextlib import contextmanager

import torch
import torch.nn as nn

from marft.agents.adapters import AdapterBank, adapter_name_for
from marft.agents.backends import make_backend
from marft.agents.critic import CRITIC_ADAPTER, Critic
from marft.agents.generation import GenerationBackend, SampledReplies, SamplingSettings
from marft.agents.headers import RoleHeaderCache, joined_batches, position_ids_from_mask
from marft.agents.prompts import PromptEncoder
from marft.agents.reply_scores import chunked_token_scores, score_tokens
from marft.agents.unpadded import RowAdapters, logits_from_last_states
from marft.config import ModelConfig
from marft.types import AgentTurns, EngineGap, ReplyScores, TurnOutput

SHARED_ADAPTER = "shared"
REFERENCE_PREFIX = "ref_"
"""A policy adapter's frozen KL reference is the adapter ``ref_<adapter>`` (:meth:`AgentTeam.add_reference_adapters`)."""


def agent_adapter_names(profile: Sequence, config: ModelConfig, with_critic: bool) -> tuple[list[str], list[str]]:
    """Per agent, its policy adapter's name and its critic adapter's name (an empty list without a critic).

    Role names become adapter names (``adapter_name_for``); clashing or critic-like names get an index prefix."""
    roles = [adapter_name_for(spec.role) for spec in profile]
    if len(set(roles)) != len(roles) or any(r == CRITIC_ADAPTER or r.startswith(CRITIC_ADAPTER + "_") for r in roles):
        roles = [f"agent{i}_{r}" for i, r in enumerate(roles)]
    policies = [SHARED_ADAPTER] * len(roles) if config.shared_lora else roles
    if not with_critic:
        return policies, []
    if config.critic_mode == "per_agent":
        return policies, [f"{CRITIC_ADAPTER}_{r}" for r in roles]
    return policies, [CRITIC_ADAPTER] * len(roles)


def forward_positions(mask: torch.Tensor, cached: int, unpadded: bool, header_lengths: Sequence[int]) -> tuple[int, int]:
    """``(positions, padding)``: the token positions a scoring forward runs through its matrix products, and how many of
    them are padding. ``mask (B, cached + S)``; ``unpadded``: the rows' pads never reach a matrix product;
    ``header_lengths``: the distinct role headers the rows sit behind, each run once, left-padded to the longest
    (``cached`` columns; none: no shared headers)."""
    positions, padding = mask[:, cached:].numel(), int((mask[:, cached:] == 0).sum())
    if unpadded:
        positions, padding = positions - padding, 0
    return positions + cached * len(header_lengths), padding + sum(cached - h for h in header_lengths)


def distinct_header_lengths(agents: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, cached: int) -> list[int]:
    """The real tokens of each distinct header that rows sit behind: the first ``cached`` columns of ``ids (B, W)``
    and ``mask (B, W)``, told apart by their ids and each row's agent (``agents (B,)``)."""
    keys = torch.cat([agents[:, None].to(ids.device), ids[:, :cached], mask[:, :cached].to(ids.dtype)], dim=1)  # (B, 1 + 2 cached)
    return torch.unique(keys, dim=0)[:, 1 + cached:].sum(1).tolist()


class AgentTeam(nn.Module):
    """Agents acting on a shared conversation, each through its own adapter, plus a centralized critic.

    Args:
        base_model: a Hugging Face causal LM (its weights stay frozen).
        tokenizer: its tokenizer; a missing pad token falls back to EOS.
        profile: one ``AgentSpec`` (role, prompt, with_answer) per agent.
        config: the model section of the run config.
        with_critic: build the critic (critic-free trainers such as GRPO build none).
    """

    def __init__(self, base_model, tokenizer, profile: Sequence, config: ModelConfig, with_critic: bool = True):
        super().__init__()
        self.config = config
        self.profile = list(profile)
        self.tokenizer = tokenizer
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.pad_id = tokenizer.pad_token_id
        self.eos_id = tokenizer.eos_token_id
        self.agent_adapters, agent_critics = agent_adapter_names(self.profile, config, with_critic)
        """Per agent, the policy adapter it speaks through (``shared`` for all with ``--shared_lora``)."""
        self.policy_adapters = list(dict.fromkeys(self.agent_adapters))
        self.bank = AdapterBank(base_model, config, self.policy_adapters + list(dict.fromkeys(agent_critics)))
        self.model = self.bank.model  # registered here, so the team's state_dict holds the adapters
        self._device = base_model.device
        self.prompts = PromptEncoder(tokenizer, self.profile, config.context_window - config.max_new_tokens, config.chat_template)
        self.headers = RoleHeaderCache(self.bank, self.prompts.header_ids, self.pad_id, self._device, config.unpadded_forward,
                                       config.share_prompt_openings)
        self.sampling = SamplingSettings(config.temperature, config.top_k, config.max_new_tokens, self.eos_id, self.pad_id)
        self.backend: GenerationBackend = make_backend(
            config.generation_backend, self.headers, self.sampling, logprobs_from_generate=next(base_model.parameters()).dtype == torch.float32,
            config=config,
        )
        self.logits_from_states = logits_from_last_states(base_model)
        """Whether the model's logits are its output layer on the decoder's states (the Llama family), so that
        :meth:`response_logprobs` forms them a few rows at a time."""
        self.engine_gap = EngineGap()
        """The rollout–trainer log-prob gap of an inference engine's replies since the last :meth:`EngineGap.take`."""
        hidden = base_model.config.get_text_config().hidden_size
        self.critic = Critic(self.headers, agent_critics, hidden, self._device, config.merge_lora_in_rollout) if with_critic else None
        self.pool_adapters: list[str] = []
        """Frozen snapshots an opponent plays from (``--opponent pool:K``, :class:`~marft.runner.shared.opponent.OpponentPool`);
        saved and restored with the checkpoints."""
        self.reference_adapters: dict[str, str] = {}
        """Per policy adapter, its frozen copy kept as the KL reference (``--kl_reference initial``,
        :meth:`add_reference_adapters`); empty: the reference is the base model."""
        self.mix_adapters: bool = True
        """Whether :meth:`act` samples rows of several adapters (an opponent pool's snapshots) in one batch, each row
        through its own adapter, where the backend and the adapters can (:meth:`mixes_adapter_rows`), rather than one
        batch per adapter folded into the base weights: a decode step then runs the base weights' products once for
        every row, not once per adapter (``python scripts/benchmark.py adapters`` compares the two)."""
        self.set_active(None)

    # ------------------------------------------------------------------ adapters
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def n_agents(self) -> int:
        return len(self.profile)

    @property
    def has_critic(self) -> bool:
        """Whether the team has a critic (its LoRA adapter(s) and value head(s)); critic-free trainers (GRPO) build none."""
        return self.critic is not None

    @property
    def critic_adapters(self) -> list[str]:
        """The critic adapters (none in a critic-free team)."""
        return self.critic.adapters if self.critic else []

    @property
    def adapters(self) -> list[str]:
        """Every adapter of the team: the policies', then the critics'."""
        return self.policy_adapters + self.critic_adapters

    def add_reference_adapters(self) -> dict[str, str]:
        """Keep each policy adapter's current weights as its KL reference: a frozen adapter ``ref_<adapter>``
        (a copy of the adapter, not of the model), never trained. Returns ``{adapter: reference}``."""
        names = {adapter: f"{REFERENCE_PREFIX}{adapter}" for adapter in self.policy_adapters}
        self.bank.add_frozen_copies(names)
        self.reference_adapters = names
        self.set_active(None)
        return names

    def critic_policy_sources(self) -> dict[str, str]:
        """Per critic adapter, the one policy adapter whose turns it values (``--critic_init policy``'s source).

        Raises:
            ValueError: a critic values the turns of several policy adapters (a shared critic over a team with
                an adapter per agent), so no one of them is its source."""
        sources: dict[str, set[str]] = {}
        for policy, critic in zip(self.agent_adapters, self.critic.agent_critics if self.critic else ()):
            sources.setdefault(critic, set()).add(policy)
        ambiguous = {critic: sorted(policies) for critic, policies in sources.items() if len(policies) > 1}
        if ambiguous:
            critic, policies = next(iter(ambiguous.items()))
            raise ValueError(
                f"--critic_init policy: the critic adapter {critic!r} values the turns of {len(policies)} policy adapters "
                f"({', '.join(policies)}), so none of them is its starting point; use --critic_mode per_agent (one critic "
                "per agent) or --shared_lora (one policy adapter), or --critic_init fresh"
            )
        return {critic: policies.pop() for critic, policies in sources.items()}

    def init_critics_from_policies(self) -> dict[str, str]:
        """Set each critic adapter's LoRA weights to a copy of its policy adapter's (:meth:`critic_policy_sources`);
        the value heads are left as they are. Returns ``{critic: policy}``."""
        sources = self.critic_policy_sources()
        for critic, policy in sources.items():
            self.bank.copy_weights(policy, critic)
            self.bank.mark_changed(critic)
        return sources

    def adapter_parameters(self, adapter: str) -> list[nn.Parameter]:
        """The LoRA parameters of one adapter (by the exact adapter segment of their names)."""
        return self.bank.parameters(adapter)

    def set_active(self, adapter: str | None, trainable: bool = False) -> None:
        """Route forward passes through ``adapter``; only its parameters (and a critic's value head)
        require grad when ``trainable``: exactly the adapter being trained, and nothing else, receives gradients."""
        if trainable and adapter is not None and self.headers.memo is not None:
            raise RuntimeError("the adapters are frozen inside headers.frozen() (a rollout); train outside it")
        if adapter is not None:
            self.bank.route(adapter)
        self.bank.train_only(adapter if trainable else None)
        for critic, head in (self.critic.value_heads.items() if self.critic else ()):
            head.requires_grad_(trainable and adapter == critic)

    # ------------------------------------------------------------------ turns
    def encode_prompts(
        self,
        agent: int,
        histories: Sequence[str],
        earlier_turns: Sequence[list[tuple[str, str]]],
        private: Sequence[str] | None = None,
        heads: Sequence[str] | None = None,
    ):
        """Agent ``agent``'s prompts (:meth:`PromptEncoder.encode`; ``heads``: what a cut keeps, per prompt) on the
        team's device: ``prompt_ids (B, P)`` and ``prompt_mask (B, P)``, left-padded, P ≤ max_prompt_len."""
        ids, mask = self.prompts.encode(agent, histories, earlier_turns, private, pad_id=self.pad_id, heads=heads)
        return ids.to(self.device), mask.to(self.device)

    def response_logprobs(
        self,
        adapter: str,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        response_ids: torch.Tensor,
        response_mask: torch.Tensor,
        with_entropy: bool = False,
        agents: torch.Tensor | None = None,
        entropy_grad: bool = True,
    ) -> ReplyScores:
        """Log-probs (and entropies) of the given reply tokens under ``adapter``'s policy.

        Args: prompt (B, P) left-padded, response (B, L) right-padded; ``agents (B,)``: each row's agent (its
        prompt starts with that agent's role header): each header then runs once for the batch, its gradient
        summed over its rows (:meth:`RoleHeaderCache.rows_behind_headers`), instead of once in every row;
        ``entropy_grad``: False computes the entropy outside the autograd graph (when it is only logged).
        Returns :class:`ReplyScores`: ``logprobs (B, L)`` and ``entropy (B, L)`` (or None) of the scoring
        distribution (``SamplingSettings.scoring_logits``), zero where the reply is padding, with ``--top_k``
        the count of reply tokens outside the top k, and how many positions the forward's matrix products ran
        and were padding (with ``--unpadded_forward`` only the role headers' padding is left).
        Only the L + 1 last positions' logits are materialised; for the Llama family a few rows at a time
        within ``--max_logits_mib`` (:mod:`marft.agents.reply_scores`), other models' all at once.
        """
        self.bank.route(adapter)
        L = response_ids.shape[1]
        cache = None
        if agents is not None:
            cache, prompt_ids, prompt_mask = self.headers.rows_behind_headers(
                agents, prompt_ids, prompt_mask, by_layer=self.headers.reads_by_layer)  # (B, Hmax + S)
        input_ids = torch.cat([prompt_ids, response_ids], dim=1)  # (B, P + L), or behind the cached headers
        mask = torch.cat([prompt_mask, response_mask], dim=1)
        cached = 0 if cache is None else cache.get_seq_length()
        unpadded = self.headers.reads_by_layer  # the matrix products skip the rows' pads
        headers = distinct_header_lengths(agents, input_ids, mask, cached) if cache is not None else []
        positions, padding = forward_positions(mask, cached, unpadded, headers)
        if unpadded or self.logits_from_states:  # the Llama family (the real-token forward reads states anyway)
            hidden = self.headers.decoder_states(cache, input_ids, mask, tail=L + 1)  # (B, L + 1, H)
            scores = chunked_token_scores(hidden, self.model.get_output_embeddings(), self.sampling.scoring_logits, response_ids,
                                          response_mask, with_entropy, entropy_grad, self.config.top_k, self.config.max_logits_mib)
        else:
            out_logits = self.model(
                input_ids=input_ids[:, cached:],
                attention_mask=mask,
                position_ids=position_ids_from_mask(mask)[:, cached:],
                past_key_values=cache,
                logits_to_keep=L + 1,
                use_cache=cache is not None,
            ).logits  # (B, L + 1, V): the position before reply token t predicts it
            scores = score_tokens(self.sampling.scoring_logits(out_logits[:, :-1]), response_ids, response_mask, with_entropy,
                                  entropy_grad, self.config.top_k)
        return dataclasses.replace(scores, positions=positions, padding=padding)

    @torch.no_grad()
    def sample(self, adapter: str, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, agent: int | None = None,
               agents: torch.Tensor | None = None) -> SampledReplies:
        """Replies sampled by the generation backend through ``adapter`` (``agent``: the prompts are that agent's,
        so a backend may run its role header once for the batch; ``agents (B,)``: each row's agent, prompts of several
        agents in one batch, :meth:`DecodeLoop.sample_rows`); with ``--merge_lora_in_rollout`` (float32) the adapter
        is folded into the base weights meanwhile (:meth:`AdapterBank.merged`)."""
        self.bank.route(adapter)
        fold = self.config.merge_lora_in_rollout and getattr(self.backend, "uses_team_forward", True)
        with self.bank.merged_if(adapter, fold):
            if agents is not None:
                return self.backend.sample_rows(prompt_ids, prompt_mask, agents)
            return self.backend.sample(prompt_ids, prompt_mask, agent)

    @torch.no_grad()
    def act(
        self,
        agent: int,
        histories: Sequence[str],
        earlier_turns: Sequence[list[tuple[str, str]]],
        private: Sequence[str] | None = None,
        heads: Sequence[str] | None = None,
        adapters: Sequence[str] | None = None,
    ) -> TurnOutput:
        """Agent ``agent`` replies to every history in the batch: prompts encoded, replies sampled and scored
        (no critic values: :func:`marft.runner.shared.turns.play_team_step` adds them). ``adapters``: per row, the
        adapter that samples it (an opponent's snapshot, ``--opponent pool:K``) instead of the agent's own; the rows
        are sampled in one batch where the backend mixes adapters (:attr:`DecodeLoop.mixes_adapters`), else as one
        batch per adapter, and the replies come back in the rows' order."""
        names = [self.agent_adapters[agent]] * len(histories) if adapters is None else list(adapters)
        if len(names) != len(histories):
            raise ValueError(f"{len(names)} adapters for {len(histories)} rows")
        groups = {name: [row for row, n in enumerate(names) if n == name] for name in dict.fromkeys(names)}
        if len(groups) > 1 and self.mixes_adapter_rows(groups):
            return self.act_together([AgentTurns(agent, histories, earlier_turns, private, heads, names)])[0]
        prompt_ids, prompt_mask = self.encode_prompts(agent, histories, earlier_turns, private, heads)
        if len(groups) == 1:
            response_ids, response_mask, logprobs, engine = self._replies(names[0], prompt_ids, prompt_mask, agent)
        else:
            parts = [self._replies(name, prompt_ids[rows], prompt_mask[rows], agent) for name, rows in groups.items()]
            back = torch.argsort(torch.tensor([row for rows in groups.values() for row in rows], device=prompt_ids.device))

            def joined(k: int) -> torch.Tensor | None:  # the groups' k-th tensors (B_g, L) → (B, L), rows back in their order
                pieces = [part[k] for part in parts]
                return None if any(piece is None for piece in pieces) else torch.cat(pieces)[back]

            response_ids, response_mask, logprobs, engine = (joined(k) for k in range(4))
        return TurnOutput(prompt_ids, prompt_mask, response_ids, response_mask, logprobs, self.decode(response_ids, response_mask),
                          sampling_logprobs=engine)

    @torch.no_grad()
    def act_together(self, turns: Sequence[AgentTurns]) -> list[TurnOutput]:
        """Several agents' :meth:`act` (each :class:`AgentTurns` one agent's rows) sampled as ONE batch, each row
        behind its agent's role header and through its adapter, where :meth:`mixes_adapter_rows`; else one
        :meth:`act` per agent. Returns one :class:`TurnOutput` per item, as :meth:`act` gives it."""
        names = [list(t.adapters) if t.adapters is not None else [self.agent_adapters[t.agent]] * len(t.histories) for t in turns]
        order = list(dict.fromkeys(n for rows in names for n in rows))
        if not self.mixes_adapter_rows(order) or (len(turns) == 1 and len(order) == 1):
            return [self.act(t.agent, t.histories, t.earlier_turns, t.private, t.heads, t.adapters) for t in turns]
        encoded = [self.encode_prompts(t.agent, t.histories, t.earlier_turns, t.private, t.heads) for t in turns]
        for (ids, _), rows in zip(encoded, names):
            if len(rows) != len(ids):
                raise ValueError(f"{len(rows)} adapters for {len(ids)} rows")
        prompt_ids, prompt_mask, agents = joined_batches([(t.agent, ids, mask) for t, (ids, mask) in zip(turns, encoded)], self.pad_id)
        if len(order) == 1:  # one adapter (--shared_lora): folded into the base weights, as act samples
            replies = self.sample(order[0], prompt_ids, prompt_mask, agents=agents)
        else:
            code = torch.tensor([order.index(n) for rows in names for n in rows], device=self.device)
            replies = self.backend.sample_rows(prompt_ids, prompt_mask, agents, RowAdapters(order, code), merge=self.config.merge_lora_in_rollout)
        outs, start = [], 0
        for t, (ids, mask), rows in zip(turns, encoded, names):
            picked = slice(start, start + len(ids))
            start += len(ids)
            response_ids, response_mask = replies.response_ids[picked], replies.response_mask[picked]
            logprobs = replies.logprobs[picked] if replies.logprobs is not None else self._scored(t.agent, rows, ids, mask, response_ids, response_mask)
            outs.append(TurnOutput(ids, mask, response_ids, response_mask, logprobs, self.decode(response_ids, response_mask)))
        return outs

    def _scored(self, agent: int, names: list[str], prompt_ids, prompt_mask, response_ids, response_mask) -> torch.Tensor:
        """Log-probs of agent ``agent``'s replies, each row's under its adapter ``names[row]``. (B, L)"""
        logprobs = torch.zeros(response_ids.shape, dtype=torch.float32, device=self.device)  # (B, L)
        for name in dict.fromkeys(names):
            rows = [r for r, n in enumerate(names) if n == name]
            logprobs[rows] = self.response_logprobs(name, prompt_ids[rows], prompt_mask[rows], response_ids[rows], response_mask[rows],
                                                    agents=torch.full((len(rows),), agent)).logprobs
        return logprobs

    def mixes_adapter_rows(self, adapters=None) -> bool:
        """Whether :meth:`act` samples rows of several ``adapters`` (default: every policy adapter) in one batch: the
        backend can (:attr:`DecodeLoop.mixes_adapters`), the adapters can (:meth:`AdapterBank.can_mix`), and
        :attr:`mix_adapters` says so."""
        names = list(adapters) if adapters is not None else self.policy_adapters
        return self.mix_adapters and getattr(self.backend, "mixes_adapters", False) and self.bank.can_mix(names)

    def _replies(self, adapter: str, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, agent: int):
        """``(response_ids, response_mask, logprobs, engine_logprobs or None)`` of ``adapter``'s replies to agent
        ``agent``'s prompts, log-probs scored with a forward where the backend gives none."""
        replies = self.sample(adapter, prompt_ids, prompt_mask, agent)
        logprobs = replies.logprobs
        if logprobs is None:
            logprobs = self.response_logprobs(
                adapter, prompt_ids, prompt_mask, replies.response_ids, replies.response_mask, agents=torch.full((len(prompt_ids),), agent)
            ).logprobs
        if replies.engine_logprobs is not None:
            self.engine_gap.add(logprobs, replies.engine_logprobs, replies.response_mask)
        return replies.response_ids, replies.response_mask, logprobs, replies.engine_logprobs

    def set_top_k(self, top_k: int) -> None:
        """Sample among the ``top_k`` most likely tokens from now on (1: greedy replies, for an evaluation)."""
        self.sampling = dataclasses.replace(self.sampling, top_k=top_k)
        self.backend = make_backend(self.config.generation_backend, self.headers, self.sampling, self.backend.logprobs_from_generate,
                                    config=self.config, previous=self.backend)

    @contextmanager
    def rollout(self):
        """Around a rollout: an engine backend takes its memory back before it and frees it after (``--vllm_sleep``);
        the engine's figures start over (:meth:`rollout_figures`)."""
        started, ended = getattr(self.backend, "rollout_started", None), getattr(self.backend, "rollout_ended", None)
        self.rollout_figures()
        if started:
            started()
        try:
            yield
        finally:
            if ended:
                ended()

    def rollout_figures(self) -> dict[str, float]:
        """An inference engine's figures since the last call (:class:`~marft.types.EngineGap`, adapter syncs); empty
        for the backends that sample with the team's own model."""
        figures = self.engine_gap.take()
        take = getattr(self.backend, "take_figures", None)
        return {**figures, **(take() if take else {})}

    def decode(self, response_ids: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
        rows = [ids[m.bool()].tolist() for ids, m in zip(response_ids.cpu(), response_mask.cpu())]
        return [t.strip() for t in self.tokenizer.batch_decode(rows, skip_special_tokens=True)]
