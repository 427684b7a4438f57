"""Generation backends: what samples the agents' replies.

A backend takes left-padded prompt ids and returns the sampled reply ids, the log-probs of the sampled
tokens under the sampling distribution, and the settings it sampled with (:class:`GenerationBackend`).
The forward pass goes through whichever adapter the team routed to. The default backend is marft's own
sampling loop on the KV cache (:class:`DecodeLoop`); transformers' ``generate`` behind the shared role-header
cache (:class:`TransformersGenerate`) is the reference and fallback; another (an inference server) only has
to satisfy the same small interface.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessor, LogitsProcessorList

from marft.agents.headers import position_ids_from_mask
from marft.agents.unpadded import RowAdapters, StaticKVDecoder, linear, unpadded_decoder_states

if TYPE_CHECKING:
    from marft.agents.headers import RoleHeaderCache


@dataclass(frozen=True)
class SamplingSettings:
    """How replies are sampled, and so how they are scored."""

    temperature: float
    """Softmax temperature of sampling and scoring."""
    top_k: int
    """Sample among the k most likely tokens (0: the whole vocabulary). Scoring is NOT truncated."""
    max_new_tokens: int
    """Reply budget L in tokens."""
    eos_id: int
    """A reply ends at its first EOS (kept in the reply)."""
    pad_id: int
    """Fills a reply after its end."""

    def scoring_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits whose log-softmax is the policy's log-prob (old and new alike): divided by the
        temperature, NOT truncated to the top k. (..., V) → (..., V) float32.

        Top-k only narrows sampling (as in TRL). Scoring on the truncated distribution would give a sampled
        token that leaves the current top k a log-prob of -inf: a ratio of 0 for its whole reply and an
        approximate KL of ~1e8."""
        return logits.float() / self.temperature

    def generation_config(self) -> GenerationConfig:
        """These settings as transformers' ``GenerationConfig`` (multinomial sampling, nothing else)."""
        return GenerationConfig(
            do_sample=True,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=1.0,
            repetition_penalty=1.0,
            max_new_tokens=self.max_new_tokens,
            pad_token_id=self.pad_id,
            eos_token_id=self.eos_id,
        )


@dataclass
class SampledReplies:
    """A backend's answer for a batch of B prompts."""

    response_ids: torch.Tensor  # (B, L) right-padded with pad_id, L = max_new_tokens
    response_mask: torch.Tensor  # (B, L) 1 on each reply token up to and including the first EOS
    logprobs: torch.Tensor | None  # (B, L) log-probs of the sampled ids under the sampling distribution, 0 at padding; None: score them with a forward
    settings: SamplingSettings  # what they were sampled with
    engine_logprobs: torch.Tensor | None = None  # (B, L) an inference engine's own log-probs of the sampled ids, 0 at padding (vllm only)


class GenerationBackend(Protocol):
    """What the team needs from a generation backend."""

    settings: SamplingSettings

    def sample(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, agent: int | None = None) -> SampledReplies:
        """Sample one reply per prompt through the active adapter. ``prompt_ids (B, P)`` left-padded;
        ``agent``: the prompts are that agent's (a backend may share their role header)."""
        ...


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


class TransformersGenerate:
    """transformers' ``model.generate`` (multinomial sampling with temperature and top-k), each agent's role
    header run once per batch (:class:`RoleHeaderCache`).

    Args:
        headers: the role-header cache (and, through it, the peft model).
        settings: the sampling settings.
        logprobs_from_generate: take the log-probs from generate's own logits (float32: they equal a scoring
            forward's to ~1e-6); in half precision the cached and uncached forwards differ more, so
            :meth:`sample` returns None and the team scores replies with a forward.
    """

    def __init__(self, headers: RoleHeaderCache, settings: SamplingSettings, logprobs_from_generate: bool = True):
        self.headers = headers
        self.settings = settings
        self.logprobs_from_generate = logprobs_from_generate
        self.generation_config = settings.generation_config()
        # generate() fills every field left unset from the model's own generation_config.json (min_p, typical_p,
        # repetition_penalty, no_repeat_ngram_size, suppress_tokens, stop strings ... in real checkpoints); the
        # recorded log-probs would then no longer describe what was sampled. An empty one leaves only ours.
        headers.bank.model.get_base_model().generation_config = GenerationConfig()

    @torch.no_grad()
    def sample(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, agent: int | None = None) -> SampledReplies:
        s = self.settings
        B = prompt_ids.shape[0]
        scorer = SampledLogprobs(s.scoring_logits) if self.logprobs_from_generate else None
        cache, ids, mask = None, prompt_ids, prompt_mask
        if agent is not None:
            cache, ids, mask = self.headers.behind_headers([(agent, prompt_ids, prompt_mask)])
        sequences = self.headers.bank.model.generate(
            input_ids=ids, attention_mask=mask, past_key_values=cache, generation_config=self.generation_config,
            logits_processor=LogitsProcessorList([scorer] if scorer else []),
        )
        response = sequences[:, ids.shape[1] :]  # (B, L')
        response_ids = torch.full((B, s.max_new_tokens), s.pad_id, dtype=torch.long, device=prompt_ids.device)  # (B, L)
        response_ids[:, : response.shape[1]] = response
        response_mask = reply_mask(response_ids, s.eos_id, response.shape[1])
        if scorer is None:
            return SampledReplies(response_ids, response_mask, None, s)
        logprobs = torch.zeros(response_ids.shape, dtype=torch.float32, device=prompt_ids.device)  # (B, L)
        logprobs[:, : response.shape[1]] = scorer.logprobs(response)
        return SampledReplies(response_ids, response_mask, logprobs * response_mask, s)


class DecodeLoop:
    """A lean sampling loop of our own: one forward per new token on the KV cache, the same sampling ops as
    transformers' ``generate`` (temperature, then top-k, softmax, one ``torch.multinomial`` per step, finished rows
    padded) without its per-step machinery (logits processors, stopping criteria, input preparation). On CPU it
    samples the same ids as :class:`TransformersGenerate` for the same seed (a test checks it); the log-probs come
    from the very logits sampled from. Stops when every row has ended.

    With ``--unpadded_forward`` on a Llama-family model the prompt runs on its real tokens only and each step on a
    preallocated KV cache (:class:`~marft.agents.unpadded.StaticKVDecoder`), without transformers' per-step cache
    concatenation and mask building; otherwise each step is a forward of the transformers model on its cache.

    Whether every row has ended is asked every :attr:`stop_check_every` steps: on a GPU each question waits for the
    device (a host synchronisation per token otherwise); the steps in between give ended rows pads and masked
    log-probs, so the replies are the same, only the random numbers drawn after them differ.

    Rows of several adapters (both seats of a self-play game, an opponent's snapshots) are sampled in one batch
    (``adapters``, :class:`RowAdapters`): each adapter's prompts run as a batch of their own, through that adapter, and
    then every row decodes on one static cache, each step running the base weights' products once for all rows and
    each row's LoRA product with its own adapter's factors.

    Args: as :class:`TransformersGenerate` (without ``logprobs_from_generate`` the team scores the replies with a forward).
    """

    stop_check_every: int | None = None
    """Steps between the checks whether every row has ended; None: every step on CPU, every 8 on another device."""

    def __init__(self, headers: RoleHeaderCache, settings: SamplingSettings, logprobs_from_generate: bool = True):
        self.headers = headers
        self.settings = settings
        self.logprobs_from_generate = logprobs_from_generate

    def _stop_check_every(self, device: torch.device) -> int:
        return self.stop_check_every or (1 if device.type == "cpu" else 8)

    @property
    def mixes_adapters(self) -> bool:
        """Whether :meth:`sample_rows` takes rows of several adapters in one batch (the real-token forward does)."""
        return self.headers.unpadded_forward

    def _prefill(self, model, cache, step_ids: torch.Tensor, mask: torch.Tensor, step_positions: torch.Tensor):
        """The prompt ``step_ids (B, S)`` behind ``cache`` on its real tokens: ``(logits (B, V) after it, per layer
        (keys, values) (B, kv, W, d))``, or None where the padded transformers forward must do (not asked for,
        unsupported model, or a row whose prompt lies wholly in the cache: its last state is not among the new ones)."""
        if not self.headers.unpadded_forward or not (mask[:, mask.shape[1] - step_ids.shape[1]:] == 1).any(1).all():
            return None
        hidden, _, keys_values = unpadded_decoder_states(model.get_decoder(), cache if cache.get_seq_length() else None, step_ids, mask,
                                                         step_positions, tail=1, keep_keys_values=True)  # (B, 1, H): prompts end in the last column
        return linear(model.get_output_embeddings(), hidden[:, -1]).float(), keys_values

    def _static_cache_steps(self, model, cache, step_ids: torch.Tensor, mask: torch.Tensor, step_positions: torch.Tensor):
        """:meth:`_prefill`, then steps on a preallocated cache: ``(logits (B, V) after the prompt, next_logits(t, ids
        (B, 1), positions (B, 1)))``, or None as :meth:`_prefill`."""
        prefilled = self._prefill(model, cache, step_ids, mask, step_positions)
        if prefilled is None:
            return None
        static, lm_head = StaticKVDecoder(model.get_decoder(), prefilled[1], mask, self.settings.max_new_tokens), model.get_output_embeddings()
        return prefilled[0], lambda t, ids, positions: linear(lm_head, static.step(ids[:, 0], positions[:, 0])).float()

    def _mixed_steps(self, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, agents: torch.Tensor | None,
                     adapters: RowAdapters, merge: bool):
        """As :meth:`_static_cache_steps` for rows of several ``adapters``: each adapter's prompts (behind their role
        headers) run as a batch of their own through that adapter (folded into the base weights with ``merge``, as
        one agent's batch runs), their keys and values then join one static cache (left-padded to the longest), and
        every step runs all rows, each through its adapter (:class:`RowAdapters`). Rows stay in their order; an adapter
        whose prompts are only their role header runs them whole (nothing would follow a shared header)."""
        bank, B, parts, active = self.headers.bank, len(prompt_ids), [], self.headers.bank.active
        try:
            for name, rows in adapters.rows.items():
                if len(rows):
                    bank.route(name)
                    with bank.merged_if(name, merge):
                        whole = (DynamicCache(config=model.config), prompt_ids[rows], prompt_mask[rows])
                        cache, ids, mask = self.headers.rows_behind_headers(agents[rows.cpu()], *whole[1:]) if agents is not None else whole
                        prefilled = self._prefill(model, *self._behind(model, cache, ids, mask))
                        if prefilled is None:  # a prompt that is only its header
                            cache, ids, mask = whole
                            prefilled = self._prefill(model, *self._behind(model, cache, ids, mask))
                        parts.append((rows, mask, *prefilled))
        finally:
            bank.route(active)
        width = max(mask.shape[1] for _, mask, _, _ in parts)
        logits = parts[0][2].new_empty(B, parts[0][2].shape[1])  # (B, V)
        joined_mask = prompt_mask.new_zeros(B, width)  # (B, W)
        joined = [(k.new_zeros(B, k.shape[1], width, k.shape[3]), v.new_zeros(B, v.shape[1], width, v.shape[3])) for k, v in parts[0][3]]
        for rows, mask, part_logits, keys_values in parts:
            logits[rows], joined_mask[rows, width - mask.shape[1]:] = part_logits, mask
            for (keys, values), (k, v) in zip(joined, keys_values):
                keys[rows, :, width - k.shape[2]:], values[rows, :, width - v.shape[2]:] = k, v
        static, lm_head = StaticKVDecoder(model.get_decoder(), joined, joined_mask, self.settings.max_new_tokens, adapters), model.get_output_embeddings()
        return logits, lambda t, ids, positions: linear(lm_head, static.step(ids[:, 0], positions[:, 0]), adapters).float()

    @staticmethod
    def _behind(model, cache, ids: torch.Tensor, mask: torch.Tensor):
        """``(cache, step_ids, mask, step_positions)``: the columns of ``ids (B, W)`` that ``cache`` (None: an empty one)
        does not hold yet, with their pad-aware positions."""
        cache = cache if cache is not None else DynamicCache(config=model.config)
        cached = cache.get_seq_length()
        return cache, ids[:, cached:], mask, position_ids_from_mask(mask)[:, cached:]

    def _transformers_steps(self, model, cache, step_ids: torch.Tensor, mask: torch.Tensor, step_positions: torch.Tensor):
        """Each step a forward of the transformers model on its growing cache: as :meth:`_static_cache_steps`."""
        W, L = mask.shape[1], self.settings.max_new_tokens
        full_mask = torch.cat([mask, mask.new_ones((len(mask), L))], dim=1)  # (B, W + L): step t attends to the first W + t columns

        def next_logits(t: int, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return model(input_ids=ids, attention_mask=full_mask[:, : W + t], position_ids=positions, past_key_values=cache,
                         use_cache=True, logits_to_keep=1).logits[:, -1].float()  # (B, V)

        return next_logits(0, step_ids, step_positions), next_logits

    @torch.no_grad()
    def sample(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, agent: int | None = None,
               adapters: RowAdapters | None = None, merge: bool = False) -> SampledReplies:
        """As :meth:`GenerationBackend.sample`; ``adapters``, ``merge``: as :meth:`sample_rows`."""
        agents = None if agent is None else torch.full((len(prompt_ids),), agent, dtype=torch.long)
        return self.sample_rows(prompt_ids, prompt_mask, agents, adapters, merge)

    @torch.no_grad()
    def sample_rows(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, agents: torch.Tensor | None,
                    adapters: RowAdapters | None = None, merge: bool = False) -> SampledReplies:
        """:meth:`sample` of prompts of several agents in one batch: ``agents (B,)`` each row's agent (its prompt starts
        with that agent's role header; None: no shared headers), ``adapters`` each row's adapter (None: the active one;
        ``merge``: fold each into the base weights for its prompts' forward, :meth:`_mixed_steps`)."""
        s = self.settings
        model = self.headers.bank.model.get_base_model()  # the LoRA layers are in it; skips peft's wrapper forward per step
        B, L = prompt_ids.shape[0], s.max_new_tokens
        cache, ids, mask = None, prompt_ids, prompt_mask
        if adapters is not None and not self.mixes_adapters:
            raise ValueError("rows of several adapters in one batch need the real-token forward (--unpadded_forward, a Llama-family model)")
        if agents is not None and adapters is None:
            cache, ids, mask = self.headers.rows_behind_headers(agents, prompt_ids, prompt_mask)
        cache, step_ids, mask, step_positions = self._behind(model, cache, ids, mask)  # prefill: what the cache does not hold yet
        next_position = position_ids_from_mask(mask)[:, -1:] + 1  # (B, 1)
        response_ids = torch.full((B, L), s.pad_id, dtype=torch.long, device=prompt_ids.device)  # (B, L)
        logprobs = torch.zeros((B, L), dtype=torch.float32, device=prompt_ids.device)  # (B, L)
        unfinished = torch.ones(B, dtype=torch.bool, device=prompt_ids.device)  # (B,)
        if adapters is not None:
            steps = self._mixed_steps(model, prompt_ids, prompt_mask, agents, adapters, merge)
        else:
            steps = self._static_cache_steps(model, cache, step_ids, mask, step_positions)
        logits, next_logits = steps or self._transformers_steps(model, cache, step_ids, mask, step_positions)  # (B, V) after the prompt
        generated, check_every = 0, self._stop_check_every(prompt_ids.device)
        for t in range(L):
            if t > 0:
                logits = next_logits(t, step_ids, step_positions)  # (B, V)
            scores = s.scoring_logits(logits)  # (B, V) tempered, as generate's temperature warper (x / 1.0 is x)
            sampled_from = scores
            if s.top_k > 0:
                kth = torch.topk(scores, min(s.top_k, scores.shape[-1]))[0][..., -1, None]  # (B, 1)
                sampled_from = scores.masked_fill(scores < kth, -float("inf"))
            token = torch.multinomial(torch.softmax(sampled_from, dim=-1), num_samples=1).squeeze(1)  # (B,)
            token = torch.where(unfinished, token, torch.full_like(token, s.pad_id))
            response_ids[:, t] = token
            if self.logprobs_from_generate:
                logprobs[:, t] = torch.log_softmax(scores, dim=-1).gather(-1, token[:, None]).squeeze(1)
            generated = t + 1
            unfinished &= token != s.eos_id
            if (t + 1) % check_every == 0 and not unfinished.any():  # asks the device (a synchronisation)
                break
            step_ids, step_positions = token[:, None], next_position
            next_position = next_position + 1
        response_mask = reply_mask(response_ids, s.eos_id, generated)
        return SampledReplies(response_ids, response_mask, logprobs * response_mask if self.logprobs_from_generate else None, s)
