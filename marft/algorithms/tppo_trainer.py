"""MARFT-T: token-level multi-agent PPO (``--algorithm_name TPPO``).

Every reply token is an action. The critic values the state before each token
(same critic adapter and value head as MARFT-A, read at every reply position),
advantages come from :func:`token_chain_gae`, and the PPO and value losses are
averaged over real tokens only (so gradient accumulation weights chunks by
their token counts, :meth:`TPPOTrainer.loss_units`). Everything else —
the critic's optimizers from :class:`APPOTrainer`, the schedule, minibatches and skips from :class:`~marft.algorithms.ppo.PPOTrainer`.
"""

from __future__ import annotations

import torch

from marft.algorithms.advantages import buffer_credits, chain_rewards, fill_own_turn_token_advantages, fill_token_advantages
from marft.algorithms.appo_trainer import APPOTrainer
from marft.algorithms.losses import clipped_policy_loss, clipped_value_loss
from marft.runner.shared.buffer import RolloutBuffer
from marft.types import TurnBatch


class TPPOTrainer(APPOTrainer):
    token_level = True

    def estimate_advantages(self, buffer: RolloutBuffer) -> None:
        """Token level: GAE along the agent chain's tokens (``own_turns``: along each agent's own chain of turns, for
        self-play)."""
        cfg = self.config
        if cfg.credit_assignment == "own_turns":
            return fill_own_turn_token_advantages(buffer, cfg.gamma, cfg.gae_lambda, cfg.token_gamma, cfg.token_gae_lambda)
        fill_token_advantages(buffer, cfg.gamma, cfg.gae_lambda, cfg.token_gamma, cfg.token_gae_lambda, self.chain_rewards(buffer))

    def chain_rewards(self, buffer: RolloutBuffer) -> torch.Tensor | None:
        """As :meth:`APPOTrainer.chain_rewards`, on the token chain: a reply's credit is its return at its last
        token, which it reaches from the next reply's first token through ``token_gamma^(length - 1)``, so
        the telescoping discounts by that too (with ``--token_gamma 1``, the action-level rewards); empty
        replies take no action and get no credit."""
        cfg = self.config
        if cfg.credit_assignment == "env":
            return None
        credits = buffer_credits(buffer, cfg.credit_assignment, cfg.credit_discount)
        lengths = buffer.response_mask.sum(-1)  # (T, E, S)
        reach = cfg.token_gamma ** (lengths - 1).clamp(min=0).to(credits.dtype)  # (T, E, S)
        return chain_rewards(credits, cfg.gamma, played=buffer.played & (lengths > 0), layers=buffer.layer, reach=reach)

    def loss_units(self, samples: TurnBatch, indices: torch.Tensor) -> float:
        """The token-level losses average over real reply tokens: chunks are weighted by their token count."""
        return float(samples.response_mask[indices].sum())

    def normalized_advantages(self, samples: TurnBatch) -> TurnBatch:
        """Standardise token advantages over the real tokens of one agent's batch (all processes' tokens together)."""
        advantages, mask = samples.token_advantages, samples.response_mask.bool()  # (B, L)
        stats = self.dist.mean_std(advantages[mask]) if self.config.normalize_advantages else None
        if stats is not None:
            mean, std = stats
            advantages = torch.where(mask, (advantages - mean) / (std + 1e-8), torch.zeros_like(advantages))
        return samples.replace(token_advantages=advantages)

    def policy_loss(self, adapter: str, mb: TurnBatch) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Per-token clipped surrogate and entropy, averaged over real tokens. ``mb`` tensors are (B, L)."""
        token_logp, token_entropy = self.score_replies(adapter, mb)  # (B, L), (B, L)
        mask = mb.response_mask.float()
        loss, stats = clipped_policy_loss(token_logp, mb.logprobs, mb.token_advantages, self.config.clip_param, weights=mask, clip_param_high=self.config.clip_param_high,
                                          correction=self.rollout_correction(mb, per_token=True))
        entropy = (token_entropy * mask).sum() / mask.sum().clamp(min=1)
        self.add_reference_kl(token_logp, mb, stats)
        return loss, entropy, stats

    def critic_values(self, mb: TurnBatch, critic: str | None = None) -> torch.Tensor:
        """``critic``'s value (default: the shared one's) before every reply token of the minibatch, (B, L), 0 at padding."""
        return self.team.critic.token_values(mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.response_mask, agent=mb.agent, critic=critic)

    def value_loss(self, mb: TurnBatch, critic: str | None = None, values: torch.Tensor | None = None) -> torch.Tensor:
        """Clipped value loss of every real reply token's ``values`` (default: :meth:`critic_values` under ``critic``)."""
        cfg = self.config
        values = self.critic_values(mb, critic) if values is None else values  # (B, L)
        return clipped_value_loss(
            values, mb.token_values, mb.token_returns, cfg.value_clip_param, cfg.use_huber_loss, cfg.huber_delta,
            weights=mb.response_mask.float(),
        )
