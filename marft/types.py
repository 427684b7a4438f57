"""Records that cross layers: what an agent produced in one turn, the scores of replies, and a batch of turns.

A leaf below the team, the rollout and the trainers (it imports only torch), so each of them can name these
types without importing the others.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class ReplyScores:
    """The current policy's view of given replies (:meth:`AgentTeam.response_logprobs`)."""

    logprobs: torch.Tensor  # (B, L) log-probs of the reply tokens under the scoring distribution, 0 at padding
    entropy: torch.Tensor | None  # (B, L) entropy of that distribution per position (None unless asked), 0 at padding
    out_of_topk: int = 0  # reply tokens outside the current policy's top-k (0 when top-k is off)
    positions: int = 0  # token positions the forward ran (each shared role header once)
    padding: int = 0  # of them, padding


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
    sampling_logprobs: torch.Tensor | None = None  # (B, L) an inference engine's log-probs of the sampled ids (None: the trainer's own sampled them)


@dataclass
class AgentTurns:
    """One agent's turns to take at one moment of a team step: what :meth:`AgentTeam.act` takes, per row."""

    agent: int
    """The agent that speaks."""
    histories: Sequence[str]
    """Each row's shared observation."""
    earlier_turns: Sequence[list[tuple[str, str]]]
    """Each row's ``(role, reply)`` turns the agent sees from this step so far."""
    private: Sequence[str] | None = None
    """Each row's text only this agent sees (None: nothing private)."""
    heads: Sequence[str] | None = None
    """Each row's head a cut history keeps (e.g. a game's rules)."""
    adapters: Sequence[str] | None = None
    """Each row's adapter, where not the agent's own (an opponent's snapshot); None: the agent's own."""


@dataclass
class TurnBatch:
    """B turns taken out of a rollout buffer for an update (``RolloutBuffer.agent_samples`` / ``critic_samples``):
    one row per turn. Which fields are set depends on the use (None: not part of this batch): a policy batch holds
    the replies with their sampling log-probs and advantages, a critic batch the prompts with values and returns;
    token-level batches (MARFT-T) hold per-token values, advantages and returns instead. P = longest prompt,
    L = longest reply."""

    agent: torch.Tensor | None = None  # (B,) long: whose turn each row is (its prompt starts with that agent's role header)
    prompt_ids: torch.Tensor | None = None  # (B, P) left-padded
    prompt_mask: torch.Tensor | None = None  # (B, P)
    response_ids: torch.Tensor | None = None  # (B, L) right-padded
    response_mask: torch.Tensor | None = None  # (B, L) 1 through the first EOS
    logprobs: torch.Tensor | None = None  # (B, L) token log-probs at sampling time
    n_words: torch.Tensor | None = None  # (B,) words of each decoded reply (normalization_mode=word)
    values: torch.Tensor | None = None  # (B,) critic value of each prompt at sampling time
    advantages: torch.Tensor | None = None  # (B,) action-level advantage of each reply
    returns: torch.Tensor | None = None  # (B,) action-level return
    token_values: torch.Tensor | None = None  # (B, L) critic value before each reply token
    token_advantages: torch.Tensor | None = None  # (B, L)
    token_returns: torch.Tensor | None = None  # (B, L)
    ref_logprobs: torch.Tensor | None = None  # (B, L) token log-probs under the KL reference policy
    sampling_logprobs: torch.Tensor | None = None  # (B, L) the inference engine's log-probs of the sampled ids (vllm; else equal to logprobs)

    RESPONSE_FIELDS = ("response_ids", "response_mask", "logprobs", "token_values", "token_advantages", "token_returns", "ref_logprobs",
                       "sampling_logprobs")
    """The fields with a reply dimension L (trimmed together)."""

    def fields(self) -> dict[str, torch.Tensor]:
        """The set fields by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    def __len__(self) -> int:
        return len(next(iter(self.fields().values())))

    def rows(self, index) -> TurnBatch:
        """The rows ``index`` (indices, a mask or a slice) of every set field."""
        return TurnBatch(**{name: value[index] for name, value in self.fields().items()})

    def replace(self, **changes) -> TurnBatch:
        """A copy with ``changes`` (the tensors themselves are shared)."""
        return dataclasses.replace(self, **changes)

    def trimmed(self, device) -> TurnBatch:
        """All-padding prompt columns (left) and reply columns (right) dropped, moved to ``device``."""
        out = self.fields()
        if self.prompt_mask is not None:
            used = self.prompt_mask.any(0).nonzero()
            start = int(used[0]) if len(used) else self.prompt_mask.shape[1] - 1
            out["prompt_ids"] = self.prompt_ids[:, start:]
            out["prompt_mask"] = self.prompt_mask[:, start:]
        if self.response_mask is not None:
            used = self.response_mask.any(0).nonzero()
            end = int(used[-1]) + 1 if len(used) else 1
            for name in self.RESPONSE_FIELDS:
                if name in out:
                    out[name] = out[name][:, :end]
        return TurnBatch(**{name: value.to(device) for name, value in out.items()})


@dataclass
class EngineGap:
    """The rollout–trainer mismatch of an inference engine's replies: per reply token, ``|engine log-prob − trainer
    log-prob|`` (its sum, count and max) and the largest probability ratio ``exp(trainer − engine)`` of a token and of
    a whole reply, accumulated over a rollout. A growing gap is the known cause of silent PPO collapse with engine
    rollouts (``--rollout_correction`` corrects for it)."""

    abs_sum: float = 0.0
    tokens: int = 0
    abs_max: float = 0.0
    token_ratio_max: float = 0.0
    reply_ratio_max: float = 0.0

    def add(self, trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor) -> None:
        """One batch: ``trainer, engine, mask`` of shape (B, L)."""
        real = mask.bool()
        if not real.any():
            return
        diff = (trainer.float() - engine.float()).cpu()[real.cpu()]  # (n,) real tokens
        self.abs_sum += float(diff.abs().sum())
        self.tokens += int(diff.numel())
        self.abs_max = max(self.abs_max, float(diff.abs().max()))
        self.token_ratio_max = max(self.token_ratio_max, float(diff.max().exp()))
        per_reply = ((trainer.float() - engine.float()) * mask).sum(-1)  # (B,)
        self.reply_ratio_max = max(self.reply_ratio_max, float(per_reply.max().exp()))

    def take(self) -> dict[str, float]:
        """The figures since the last call (empty when no engine sampled), for the logs; then start over."""
        if not self.tokens:
            return {}
        figures = {"rollout/engine_logprob_gap_mean": self.abs_sum / self.tokens, "rollout/engine_logprob_gap_max": self.abs_max,
                   "rollout/engine_token_ratio_max": self.token_ratio_max, "rollout/engine_reply_ratio_max": self.reply_ratio_max}
        self.__init__()
        return figures
