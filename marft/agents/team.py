"""The agent team: ONE base causal LM, one LoRA adapter per agent, and a critic.

All agents and the critic share the same frozen base weights; each agent owns a
LoRA adapter (or all share one with ``shared_lora``), and the centralized critic
owns its own LoRA adapter plus a linear value head on the last hidden state.
Memory therefore grows with the number of agents only by their adapters.

The critic values each turn from the acting agent's own prompt (role header, private
observation, history). The role header is the same for a whole batch, so in rollouts the
critic runs it once and shares its keys/values (:meth:`AgentTeam.critic_states`). A
role-free critic view of the global state (``env.state()`` plus the cue) was tried on the
earlier, arithmetic-bound version of ``relay_sum``: its prompts are a third as long and it
explained more of the return's variance (0.7 against 0.3), but learning there was worse
(0.43 against 0.88 success on the training tasks in 512 iterations).

Tensor layout used throughout (B = batch of prompts, P = prompt length,
L = reply length, V = vocabulary):

* prompts are LEFT-padded: ``prompt_ids (B, P)``, ``prompt_mask (B, P)``;
* replies are RIGHT-padded: ``response_ids (B, L)``, ``response_mask (B, L)``;
  a reply's mask covers its tokens up to and including the first EOS.
"""

from __future__ import annotations

import copy
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn
from peft import LoraConfig, get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from marft.config import ModelConfig
from marft.agents.prompts import PromptEncoder, left_pad

CRITIC_ADAPTER = "critic"
SHARED_ADAPTER = "shared"


def adapter_name_for(role: str) -> str:
    """A peft-safe adapter name for a role ("Agent 1" → "agent_1")."""
    name = re.sub(r"[^0-9a-zA-Z_]+", "_", role.strip()).strip("_").lower()
    return name or "agent"


def adapter_of(parameter_name: str) -> str | None:
    """The adapter a peft parameter belongs to: the name segment right after its ``lora_*`` segment
    (``...q_proj.lora_A.<adapter>.weight``, ``...lora_embedding_A.<adapter>``), or None for a base weight.

    Exact segments, not substrings: an adapter named ``model``, ``mlp``, ``layers`` or ``1`` must not
    select every parameter whose path contains that word."""
    parts = parameter_name.split(".")
    for part, following in zip(parts, parts[1:]):
        if part.startswith("lora_"):
            return following
    return None


def position_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Pad-aware positions: the first real token of each row gets position 0. (B, S) → (B, S)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def reply_mask(response_ids: torch.Tensor, eos_id: int, generated: int) -> torch.Tensor:
    """1 for each reply token up to and including the first EOS, within the ``generated`` first columns. (B, L) → (B, L)."""
    is_eos = (response_ids == eos_id).long()
    eos_before = is_eos.cumsum(-1) - is_eos  # EOS tokens strictly before each position
    mask = (eos_before == 0).long()
    mask[:, generated:] = 0
    return mask


class SampledLogprobs(LogitsProcessor):
    """Records, step by step inside ``generate``, the log-prob of each sampled token under the policy's
    scoring distribution (``scoring_logits`` of the very logits that were sampled from), keeping one ``(B, V)`` row.

    It sits before generate's temperature/top-k warpers, so it sees the raw logits, and returns them unchanged.
    """

    def __init__(self, scoring_logits):
        self.scoring_logits = scoring_logits
        self.previous: torch.Tensor | None = None  # (B, V) log-probs of the step being sampled
        self.steps: list[torch.Tensor] = []  # per sampled token: (B,)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.previous is not None:  # input_ids now ends with the token sampled from ``previous``
            self.steps.append(self.previous.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.previous = torch.log_softmax(self.scoring_logits(scores), dim=-1)
        return scores

    def logprobs(self, response: torch.Tensor) -> torch.Tensor:
        """Log-probs of the generated ``response (B, L')`` → ``(B, L')``."""
        steps = self.steps + ([self.previous.gather(-1, response[:, -1:]).squeeze(-1)] if len(self.steps) < response.shape[1] else [])
        return torch.stack(steps, dim=1)


@dataclass
class ReplyScores:
    """The current policy's view of given replies (:meth:`AgentTeam.response_logprobs`)."""

    logprobs: torch.Tensor  # (B, L) log-probs of the reply tokens under the scoring distribution, 0 at padding
    entropy: torch.Tensor | None  # (B, L) entropy of that distribution per position (None unless asked), 0 at padding
    out_of_topk: int = 0  # reply tokens outside the current policy's top-k (0 when top-k is off)


@dataclass
class TurnOutput:
    """What one agent produced for a batch of prompts in one turn."""

    prompt_ids: torch.Tensor  # (B, P) left-padded
    prompt_mask: torch.Tensor  # (B, P)
    response_ids: torch.Tensor  # (B, L) right-padded, L = max_new_tokens
    response_mask: torch.Tensor  # (B, L)
    logprobs: torch.Tensor  # (B, L) token log-probs of the sampled ids under the sampling distribution
    texts: list[str]  # decoded replies, stripped
    values: torch.Tensor | None = None  # (B,) critic value of the prompt (None when not asked for)
    token_values: torch.Tensor | None = None  # (B, L) critic value before each reply token (token-level trainers)


class AgentTeam(nn.Module):
    """Agents acting in profile order on a shared conversation, plus a centralized critic.

    Args:
        base_model: a Hugging Face causal LM (its weights stay frozen).
        tokenizer: its tokenizer; a missing pad token falls back to EOS.
        profile: one ``AgentSpec`` (role, prompt, with_answer) per agent.
        config: the model section of the run config.
    """

    def __init__(self, base_model, tokenizer, profile: Sequence, config: ModelConfig, with_critic: bool = True):
        super().__init__()
        self.has_critic = with_critic
        """Whether the team has a critic (its LoRA adapter and value head); critic-free trainers (GRPO) build none."""
        self.config = config
        self.profile = list(profile)
        self.tokenizer = tokenizer
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.pad_id = tokenizer.pad_token_id
        self.eos_id = tokenizer.eos_token_id
        roles = [adapter_name_for(spec.role) for spec in self.profile]
        if len(set(roles)) != len(roles) or any(r == CRITIC_ADAPTER or r.startswith(CRITIC_ADAPTER + "_") for r in roles):
            roles = [f"agent{i}_{r}" for i, r in enumerate(roles)]
        self.agent_adapters = [SHARED_ADAPTER] * len(roles) if config.shared_lora else roles
        self.policy_adapters = list(dict.fromkeys(self.agent_adapters))
        if not with_critic:
            self.agent_critics: list[str] = []
        elif config.critic_mode == "per_agent":
            self.agent_critics = [f"{CRITIC_ADAPTER}_{r}" for r in roles]
        else:
            self.agent_critics = [CRITIC_ADAPTER] * len(roles)
        """Per agent, the critic adapter that values its turns (``critic``, or ``critic_<role>`` per agent; none without a critic)."""
        self.critic_adapters = list(dict.fromkeys(self.agent_critics))

        target = config.lora_target_modules
        lora = LoraConfig(
            r=config.lora_r,
            lora_alpha=config.lora_alpha,
            lora_dropout=config.lora_dropout,
            target_modules=target if target == "all-linear" else [t.strip() for t in target.split(",")],
            task_type="CAUSAL_LM",
        )
        for p in base_model.parameters():
            p.requires_grad_(False)
        self.model = get_peft_model(base_model, lora, adapter_name=self.policy_adapters[0])
        for name in self.policy_adapters[1:] + self.critic_adapters:
            self.model.add_adapter(name, lora)
        self._lora_layers = [m for m in self.model.modules() if isinstance(m, BaseTunerLayer)]
        self._lora_dropouts = [m for layer in self._lora_layers for m in getattr(layer, "lora_dropout", {}).values()]
        self._checkpointed_layers = []
        if config.gradient_checkpointing:
            from transformers.modeling_layers import GradientCheckpointingLayer

            enable = getattr(base_model, "activation_checkpointing_enable", None)  # the newer name of gradient_checkpointing_enable
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                base_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self._checkpointed_layers = [m for m in base_model.modules() if isinstance(m, GradientCheckpointingLayer)]
        self.model.eval()  # new LoRA modules start in train mode: dropout stays off outside lora_dropout_active()
        self._device = base_model.device
        self.value_heads = nn.ModuleDict()
        """Per critic adapter, its linear value head on the last hidden state."""
        hidden = base_model.config.get_text_config().hidden_size
        for critic in self.critic_adapters:
            head = nn.Linear(hidden, 1, device=base_model.device, dtype=torch.float32)
            nn.init.normal_(head.weight, std=1.0 / hidden)
            nn.init.zeros_(head.bias)
            self.value_heads[critic] = head
        self.generation_config = GenerationConfig(
            do_sample=True,
            temperature=config.temperature,
            top_k=config.top_k,
            top_p=1.0,
            repetition_penalty=1.0,
            max_new_tokens=config.max_new_tokens,
            pad_token_id=self.pad_id,
            eos_token_id=self.eos_id,
        )
        # generate() fills every field left unset from the model's own generation_config.json (min_p, typical_p,
        # repetition_penalty, no_repeat_ngram_size, suppress_tokens, stop strings ... in real checkpoints); the
        # recorded log-probs would then no longer describe what was sampled. An empty one leaves only ours.
        base_model.generation_config = GenerationConfig()
        self.prompts = PromptEncoder(tokenizer, self.profile, config.context_window - config.max_new_tokens)
        self.header_ids = self.prompts.header_ids
        self.max_prompt_len = self.prompts.max_prompt_len
        self._header_memo: dict | None = None  # role-header keys/values per (adapter, agents), inside frozen_adapters()
        self.set_active(None)
        self.logprobs_from_generate = next(base_model.parameters()).dtype == torch.float32
        """Take rollout log-probs from generate's own logits (float32: they equal a scoring forward's to ~1e-6);
        in half precision the cached and uncached forwards differ more, so replies are scored by a forward."""

    # ------------------------------------------------------------------ parameters
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def n_agents(self) -> int:
        return len(self.profile)

    def adapter_parameters(self, adapter: str) -> list[nn.Parameter]:
        """The LoRA parameters of one adapter, selected by the exact adapter segment of their names
        (:func:`adapter_of`; not by ``requires_grad``, not by substring)."""
        return [p for n, p in self.model.named_parameters() if adapter_of(n) == adapter]

    def critic_parameters(self, critic: str | None = None) -> list[nn.Parameter]:
        """One critic's adapter and value head, or every critic's (none in a critic-free team)."""
        return [p for c in ([critic] if critic else self.critic_adapters) for p in self.adapter_parameters(c) + list(self.value_heads[c].parameters())]

    @property
    def value_head(self) -> nn.Linear | None:
        """The shared critic's value head (``--critic_mode shared``), else None."""
        return self.value_heads[CRITIC_ADAPTER] if CRITIC_ADAPTER in self.value_heads else None

    def critic_agents(self, critic: str) -> list[int]:
        """The agents whose turns ``critic`` values."""
        return [agent for agent, c in enumerate(self.agent_critics) if c == critic]

    def _critic_for(self, agent: int | None, critic: str | None) -> str:
        if critic is not None:
            return critic
        if agent is not None:
            return self.agent_critics[agent]
        if len(self.critic_adapters) != 1:
            raise ValueError(f"say which critic values these prompts: the team has {self.critic_adapters}")
        return self.critic_adapters[0]

    @property
    def adapters(self) -> list[str]:
        """Every adapter of the team: the policies', then the critics'."""
        return self.policy_adapters + self.critic_adapters

    def set_active(self, adapter: str | None, trainable: bool = False) -> None:
        """Route forward passes through ``adapter``; only its parameters require grad when ``trainable``.

        Exactly the adapter being trained (and nothing else) receives gradients.
        """
        if trainable and adapter is not None and self._header_memo is not None:
            raise RuntimeError("the adapters are frozen inside frozen_adapters() (a rollout); train outside it")
        if adapter is not None:
            self.route(adapter)
        for name, p in self.model.named_parameters():
            p.requires_grad_(trainable and adapter is not None and adapter_of(name) == adapter)
        for critic, head in self.value_heads.items():
            head.requires_grad_(trainable and adapter == critic)

    def route(self, adapter: str) -> None:
        """Make ``adapter`` the one every LoRA layer applies, leaving ``requires_grad`` alone (see :meth:`set_active`).

        peft's ``set_adapter`` walks every module and flips ``requires_grad`` of every adapter, several
        milliseconds per call; a rollout switches adapters three times per team step, so this sets the
        active adapter of the LoRA layers it found once (a test checks it against ``set_adapter``)."""
        if adapter not in self.model.peft_config:
            raise ValueError(f"no adapter named {adapter!r}; the team has {sorted(self.model.peft_config)}")
        self.model.active_adapter = adapter
        self.model.base_model.active_adapter = adapter
        for layer in self._lora_layers:
            layer._active_adapter = [adapter]

    # ------------------------------------------------------------------ prompts
    def encode_prompts(
        self,
        agent: int,
        histories: Sequence[str],
        earlier_turns: Sequence[list[tuple[str, str]]],
        private: Sequence[str] | None = None,
    ):
        """Agent ``agent``'s prompts (:meth:`PromptEncoder.encode`) on the team's device:
        ``prompt_ids (B, P)`` and ``prompt_mask (B, P)``, left-padded, P ≤ max_prompt_len."""
        ids, mask = self.prompts.encode(agent, histories, earlier_turns, private, pad_id=self.pad_id)
        return ids.to(self.device), mask.to(self.device)

    @contextmanager
    def reference_policy(self):
        """Inside, every forward runs the base model alone (all adapters off): the reference policy of the
        KL penalty, with no second model in memory. Which parameters require grad is kept (peft's
        ``disable_adapter`` resets it on exit)."""
        trainable = {name: p.requires_grad for name, p in self.model.named_parameters()}
        try:
            with self.model.disable_adapter():
                yield
        finally:
            for name, p in self.model.named_parameters():
                p.requires_grad_(trainable[name])

    @contextmanager
    def lora_dropout_active(self):
        """Inside (the update), LoRA dropout (``--lora_dropout``) is active; everywhere else the model is in
        eval mode, so rollouts, critic values and scoring are deterministic functions of the weights.

        With ``--gradient_checkpointing`` the decoder layers are checkpointed inside too: transformers
        checkpoints a layer only while that layer is in training mode, so the layers' own ``training`` flags
        are set (not ``.train()``, which would also turn on the base model's dropout below them)."""
        for module in self._lora_dropouts:
            module.train()
        for layer in self._checkpointed_layers:
            layer.training = True
        try:
            yield
        finally:
            for module in self._lora_dropouts:
                module.eval()
            for layer in self._checkpointed_layers:
                layer.training = False

    # ------------------------------------------------------------------ model calls
    def scoring_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits whose log-softmax is the policy's log-prob (old and new alike): divided by the
        temperature, NOT truncated to the top k. (..., V) → (..., V) float32.

        Top-k only narrows sampling (as in TRL). Scoring on the truncated distribution would give a sampled
        token that leaves the current top k a log-prob of -inf: a ratio of 0 for its whole reply and an
        approximate KL of ~1e8."""
        return logits.float() / self.config.temperature

    def response_logprobs(
        self,
        adapter: str,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        response_ids: torch.Tensor,
        response_mask: torch.Tensor,
        with_entropy: bool = False,
    ) -> ReplyScores:
        """Log-probs (and entropies) of the given reply tokens under ``adapter``'s policy.

        Args: prompt (B, P) left-padded, response (B, L) right-padded.
        Returns :class:`ReplyScores`: ``logprobs (B, L)`` and ``entropy (B, L)`` (or None) of the scoring
        distribution (:meth:`scoring_logits`), zero where the reply is padding, and with ``--top_k`` the
        count of reply tokens outside the top k. Only the L + 1 last positions' logits are materialised.
        """
        self.route(adapter)
        L = response_ids.shape[1]
        input_ids = torch.cat([prompt_ids, response_ids], dim=1)  # (B, P + L)
        mask = torch.cat([prompt_mask, response_mask], dim=1)  # (B, P + L)
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids_from_mask(mask),
            logits_to_keep=L + 1,
            use_cache=False,
        )
        logits = self.scoring_logits(out.logits[:, :-1])  # (B, L, V): position P-1+t predicts response token t
        logp_all = torch.log_softmax(logits, dim=-1)  # (B, L, V)
        taken = logp_all.gather(-1, response_ids.unsqueeze(-1))  # (B, L, 1)
        logprobs = taken.squeeze(-1) * response_mask  # (B, L)
        entropy = None
        if with_entropy:
            entropy = -(logp_all.exp() * logp_all).sum(-1) * response_mask  # (B, L)
        out_of_topk = 0
        if self.config.top_k > 0:
            with torch.no_grad():
                kth = torch.topk(logp_all, min(self.config.top_k, logp_all.shape[-1]), dim=-1).values[..., -1:]  # (B, L, 1)
                out_of_topk = int(((taken < kth).squeeze(-1) & response_mask.bool()).sum())
        return ReplyScores(logprobs, entropy, out_of_topk)

    # ------------------------------------------------------------------ shared role headers
    @contextmanager
    def frozen_adapters(self):
        """A stretch in which no adapter changes (a rollout, an evaluation): each adapter's role-header
        keys/values are computed once and reused by every call inside, instead of once per call."""
        if self._header_memo is not None:
            yield
            return
        self._header_memo = {}
        try:
            yield
        finally:
            self._header_memo = None

    def header_cache(self, agents: Sequence[int]):
        """Run the listed agents' role headers once, through the active adapter, in one forward.

        Every prompt of agent a is ``[pads][header_a][rest]`` (``encode_prompts``); a batch of a's prompts
        can run its header once and share its keys/values instead of computing them in every row.

        Returns ``(cache, header_ids (n, Hmax), header_mask (n, Hmax))``, headers left-padded to the
        longest, or ``(None, ...)`` when no listed agent has a header (anonymous profiles). Inside
        :meth:`frozen_adapters` the result is computed once per adapter and agents.
        """
        agents = tuple(agents)
        memo_key = (str(self.model.active_adapter), agents)
        if self._header_memo is not None and memo_key in self._header_memo:
            cache, header_ids, header_mask = self._header_memo[memo_key]
            return copy.deepcopy(cache), header_ids, header_mask  # forwards extend the cache they are given
        header_ids, header_mask = left_pad([self.header_ids[a] for a in agents], self.pad_id, self.device)
        if header_ids.shape[1] == 0:
            return None, header_ids, header_mask
        decoder = self.model.get_base_model().get_decoder()
        cache = decoder(
            input_ids=header_ids, attention_mask=header_mask, position_ids=position_ids_from_mask(header_mask), use_cache=True,
        ).past_key_values  # header positions 0..h_a-1, as in every row of agent a
        if self._header_memo is not None:
            self._header_memo[memo_key] = (copy.deepcopy(cache), header_ids, header_mask)
        return cache, header_ids, header_mask

    def header_rests(self, agent: int, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What follows agent ``agent``'s role header in each of its left-padded prompts. (B, P) → (B, P - h) ids and mask.

        Row b's rest fills its last len_b - h columns, so dropping the first h columns keeps every rest,
        and the mask of what is left is the prompt mask shifted by h."""
        header = self.header_ids[agent]
        h = len(header)
        if h == 0:
            return prompt_ids, prompt_mask
        starts = prompt_mask.shape[1] - prompt_mask.sum(1, keepdim=True)  # (B, 1) first real column
        columns = starts + torch.arange(h, device=prompt_ids.device)  # (B, h)
        if (columns >= prompt_ids.shape[1]).any() or not torch.equal(
            prompt_ids.gather(1, columns.clamp(max=prompt_ids.shape[1] - 1)), prompt_ids.new_tensor(header).expand(len(prompt_ids), -1)
        ):
            raise ValueError(f"a prompt of agent {agent} does not start with its role header; encode it with encode_prompts")
        return prompt_ids[:, h:], prompt_mask[:, :-h]

    def behind_shared_headers(self, batches: Sequence[tuple[int, torch.Tensor, torch.Tensor]]):
        """Prompt batches of one or more agents, re-packed behind their agent's shared role header.

        Args: ``batches``: ``(agent, prompt_ids (B_n, P_n), prompt_mask (B_n, P_n))`` per agent, as
        ``encode_prompts`` writes them (``[pads][header][rest]``).
        Returns ``(cache, ids (ΣB_n, Hmax + S), mask (ΣB_n, Hmax + S))``, rows in the order given, each
        ``[header][pads][rest]``: the cache holds the Hmax header columns (:meth:`header_cache`, one forward
        for all the agents), and pad-aware positions from ``mask`` equal those of the unshared rows.
        """
        rests = [self.header_rests(agent, ids, mask) for agent, ids, mask in batches]
        width = max(ids.shape[1] for ids, _ in rests)
        rest_ids = torch.cat([nn.functional.pad(ids, (width - ids.shape[1], 0), value=self.pad_id) for ids, _ in rests])  # (ΣB, S)
        rest_mask = torch.cat([nn.functional.pad(mask, (width - mask.shape[1], 0)) for _, mask in rests])  # (ΣB, S)
        rows = torch.cat([torch.full((len(ids),), n, dtype=torch.long, device=ids.device) for n, (_, ids, _) in enumerate(batches)])  # (ΣB,)
        cache, header_ids, header_mask = self.header_cache([agent for agent, _, _ in batches])  # row n: batches[n]'s agent
        if cache is not None:
            cache.batch_select_indices(rows)
        ids = torch.cat([header_ids[rows], rest_ids], dim=1)
        mask = torch.cat([header_mask[rows], rest_mask], dim=1)
        return cache, ids, mask

    # ------------------------------------------------------------------ critic
    def critic_states(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        response_ids: torch.Tensor | None = None,
        response_mask: torch.Tensor | None = None,
        agent: int | None = None,
        critic: str | None = None,
    ) -> torch.Tensor:
        """A critic's last hidden states over a prompt batch (and replies). (B, P)[, (B, L)] → (B, S, H).

        With ``agent``, the prompts are that agent's: its critic runs them (unless ``critic`` names one), its
        role header is run once for the batch and the B prompts cost only what comes after it. S may then be
        shorter than P + L, but the last columns are the same positions either way: index from the end.
        """
        self.route(self._critic_for(agent, critic))
        cache = None
        if agent is not None:
            cache, prompt_ids, prompt_mask = self.behind_shared_headers([(agent, prompt_ids, prompt_mask)])
        if response_ids is not None:
            prompt_ids = torch.cat([prompt_ids, response_ids], dim=1)  # (B, P + L)
            prompt_mask = torch.cat([prompt_mask, response_mask], dim=1)
        return self._decoder_states(cache, prompt_ids, prompt_mask)

    def _decoder_states(self, cache, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Last hidden states of the active adapter's decoder over ``ids (B, S)``, whose first columns
        ``cache`` (or None) already holds. → (B, S - cached, H)."""
        cached = 0 if cache is None else cache.get_seq_length()
        decoder = self.model.get_base_model().get_decoder()
        return decoder(
            input_ids=ids[:, cached:], attention_mask=mask, position_ids=position_ids_from_mask(mask)[:, cached:],
            past_key_values=cache, use_cache=cache is not None,
        ).last_hidden_state

    def values(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, agent: int | None = None, critic: str | None = None) -> torch.Tensor:
        """V(prompt) from the last prompt token's hidden state. (B, P) → (B,).

        ``agent``: the prompts are that agent's (valued by its critic; its role header is run once for the
        batch); ``critic``: the critic to use on prompts of any agents (needed with per-agent critics)."""
        critic = self._critic_for(agent, critic)
        hidden = self.critic_states(prompt_ids, prompt_mask, agent=agent, critic=critic)  # (B, S, H)
        return self.value_heads[critic](hidden[:, -1].float()).squeeze(-1)  # (B,)

    def token_values(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        response_ids: torch.Tensor,
        response_mask: torch.Tensor,
        agent: int | None = None,
        critic: str | None = None,
    ) -> torch.Tensor:
        """Token-level critic: the value before each reply token, from the exact sampled ids.

        ``[:, 0]`` equals :meth:`values` of the prompt. (B, P), (B, L) → (B, L), zero at padding.
        """
        L = response_ids.shape[1]
        critic = self._critic_for(agent, critic)
        hidden = self.critic_states(prompt_ids, prompt_mask, response_ids, response_mask, agent, critic)[:, -L - 1 : -1]  # (B, L, H): before token t
        return self.value_heads[critic](hidden.float()).squeeze(-1) * response_mask  # (B, L)

    @torch.no_grad()
    def generate(self, adapter: str, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, agent: int | None = None):
        """Sample replies. Returns ``response_ids (B, max_new_tokens)``, ``response_mask`` (through the first EOS)
        and ``logprobs (B, max_new_tokens)`` of the sampled tokens as generate sampled them (zero at padding),
        or None unless ``logprobs_from_generate``.

        ``agent``: the prompts are that agent's, so its role header is run once for the batch (:meth:`behind_shared_headers`)."""
        self.route(adapter)
        B = prompt_ids.shape[0]
        scorer = SampledLogprobs(self.scoring_logits) if self.logprobs_from_generate else None
        cache, ids, mask = None, prompt_ids, prompt_mask
        if agent is not None:
            cache, ids, mask = self.behind_shared_headers([(agent, prompt_ids, prompt_mask)])
        sequences = self.model.generate(
            input_ids=ids, attention_mask=mask, past_key_values=cache, generation_config=self.generation_config,
            logits_processor=LogitsProcessorList([scorer] if scorer else []),
        )
        response = sequences[:, ids.shape[1] :]  # (B, L')
        response_ids = torch.full((B, self.config.max_new_tokens), self.pad_id, dtype=torch.long, device=prompt_ids.device)
        response_ids[:, : response.shape[1]] = response
        response_mask = reply_mask(response_ids, self.eos_id, response.shape[1])
        if scorer is None:
            return response_ids, response_mask, None
        logprobs = torch.zeros(response_ids.shape, dtype=torch.float32, device=prompt_ids.device)  # (B, L)
        logprobs[:, : response.shape[1]] = scorer.logprobs(response)
        return response_ids, response_mask, logprobs * response_mask

    @torch.no_grad()
    def act(
        self,
        agent: int,
        histories: Sequence[str],
        earlier_turns: Sequence[list[tuple[str, str]]],
        private: Sequence[str] | None = None,
    ) -> TurnOutput:
        """Agent ``agent`` replies to every history in the batch: prompts encoded, replies sampled and scored
        (no critic values: see :meth:`play_step`)."""
        prompt_ids, prompt_mask = self.encode_prompts(agent, histories, earlier_turns, private)
        adapter = self.agent_adapters[agent]
        response_ids, response_mask, logprobs = self.generate(adapter, prompt_ids, prompt_mask, agent)
        if logprobs is None:
            logprobs = self.response_logprobs(adapter, prompt_ids, prompt_mask, response_ids, response_mask).logprobs
        return TurnOutput(prompt_ids, prompt_mask, response_ids, response_mask, logprobs, self.decode(response_ids, response_mask))

    @torch.no_grad()
    def play_step(
        self,
        histories: Sequence[str],
        private: Sequence[Sequence[str]] | None = None,
        with_values: bool = True,
        token_values: bool = False,
    ) -> list[TurnOutput]:
        """One team step of the sequential workflow on a batch of B conversations: every agent, in profile
        order, replies to each history, seeing the replies of the agents before it. (The runner plays any
        workflow turn by turn with :func:`marft.runner.shared.turns.play_team_step`; this is the plain
        fixed-order loop it is tested against.)

        Args:
            histories: ``(B,)`` shared observations.
            private: ``(B, N)`` text only agent n sees in conversation b (None: nothing private).
            with_values: value every turn (training rollouts with a critic); evaluation and critic-free teams skip it.
            token_values: the critic also values every reply token (token-level trainers).

        Returns one ``TurnOutput`` per agent.
        """
        earlier = [[] for _ in histories]  # (role, reply) of the agents that already spoke, per conversation
        outs = []
        for agent, spec in enumerate(self.profile):
            out = self.act(agent, histories, earlier, None if private is None else [p[agent] for p in private])
            for turns, text in zip(earlier, out.texts):
                turns.append((spec.role, text))
            outs.append(out)
        if with_values and self.has_critic:
            self.value_batches(list(enumerate(outs)), token_values)
        return outs

    @torch.no_grad()
    def value_batches(self, batches: Sequence[tuple[int, TurnOutput]], token_values: bool = False) -> None:
        """Critic values of turn batches, ``(agent, TurnOutput)`` each: fills every batch's ``values (B,)`` and,
        with ``token_values``, ``token_values (B, L)``.

        Per critic, one forward for the role headers of the agents it values and one for all their batches'
        prompts (and replies) behind them: the critic's cost per step does not grow in forward calls with the
        team size (per-agent critics: one such pair per critic, over its agent's batches)."""
        for critic in self.critic_adapters:
            mine = [(agent, turn) for agent, turn in batches if self.agent_critics[agent] == critic]
            if not mine:
                continue
            self.route(critic)
            cache, ids, mask = self.behind_shared_headers([(a, t.prompt_ids, t.prompt_mask) for a, t in mine])  # (ΣB, Hmax + S)
            L = mine[0][1].response_ids.shape[1] if token_values else 0
            if token_values:
                ids = torch.cat([ids, torch.cat([t.response_ids for _, t in mine])], dim=1)  # (ΣB, Hmax + S + L)
                mask = torch.cat([mask, torch.cat([t.response_mask for _, t in mine])], dim=1)
            hidden = self._decoder_states(cache, ids, mask)  # (ΣB, S + L, H)
            values = self.value_heads[critic](hidden[:, hidden.shape[1] - L - 1 :].float()).squeeze(-1)  # (ΣB, L + 1): before each reply token, then after
            for (_, turn), rows in zip(mine, values.split([len(t.prompt_ids) for _, t in mine])):
                turn.values = rows[:, 0]  # the value of the prompt (also for empty replies)
                if token_values:
                    turn.token_values = rows[:, :L] * turn.response_mask  # (B, L)

    def decode(self, response_ids: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
        rows = [ids[m.bool()].tolist() for ids, m in zip(response_ids.cpu(), response_mask.cpu())]
        return [t.strip() for t in self.tokenizer.batch_decode(rows, skip_special_tokens=True)]
