"""Critic-free, group-relative team training (``--algorithm_name GRPO``), as MAGRPO and AT-GRPO train LLM teams.

The runner plays groups: ``--group_size`` G environments reset on the same task play one whole episode
each (:meth:`~marft.runner.shared.collector.RolloutCollector.collect`). Every turn of an episode gets the episode's
team return minus its group's mean, divided by the group's standard deviation
(:func:`~marft.algorithms.advantages.group_relative_advantages`; ``--grpo_scale_rewards false``: centred
only). A group whose returns are all equal teaches nothing; its advantages are 0 and it is counted
(``counters/zero_variance_groups``).

No critic exists: the team is built without a critic adapter or value head (``uses_critic = False``),
the rollout computes no values, the update has no value loss, and checkpoints hold no critic.

The policy loss is PPO's clipped surrogate with these advantages: one ratio per reply (action level) with
``--normalization_mode sum`` or ``word``; with ``token`` one ratio per reply token, the reply's advantage
broadcast to its tokens and the loss averaged over real tokens (the token-level GRPO loss). Schedule,
shared adapters, minibatches, gradient accumulation, skips and the reference KL (``--kl_coef``) are
the shared PPO loop's (:class:`~marft.algorithms.ppo.PPOTrainer`); GRPO is not a critic trainer's child.
"""

from __future__ import annotations

import torch

from marft.algorithms.advantages import buffer_credits, fill_group_advantages
from marft.algorithms.losses import clipped_policy_loss
from marft.algorithms.ppo import PPOTrainer
from marft.runner.shared.buffer import RolloutBuffer
from marft.types import TurnBatch


class GRPOTrainer(PPOTrainer):
    group_relative = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.counters["zero_variance_groups"] = 0
        self.round_length = 1
        """Team steps per group round (the env's horizon; :func:`~marft.algorithms.make_trainer` sets it)."""

    @property
    def per_token(self) -> bool:
        """One ratio per reply token (``--normalization_mode token``) instead of one per reply."""
        return self.config.normalization_mode == "token"

    def compute_advantages(self, buffer: RolloutBuffer) -> None:
        """Group-relative advantages of the episodes' team returns (``--credit_assignment env``), or of each
        agent's own return from its turns' credits (the other modes; per step, the mean of its turns' credits, so
        an episode's number of turns does not count)."""
        cfg = self.config
        credits = None if cfg.credit_assignment == "env" else buffer_credits(buffer, cfg.credit_assignment, cfg.credit_discount)
        self.counters["zero_variance_groups"] += fill_group_advantages(
            buffer, self.round_length, cfg.group_size, cfg.grpo_scale_rewards, credits, mode=cfg.credit_assignment
        )

    def normalized_advantages(self, samples: TurnBatch) -> TurnBatch:
        """Group-relative advantages are already normalised (per group): used as they are."""
        return samples

    def loss_units(self, samples: TurnBatch, indices: torch.Tensor) -> float:
        """Replies, or real reply tokens for the per-token loss."""
        if self.per_token:
            return float(samples.response_mask[indices].sum())
        return float(len(indices))

    def policy_loss(self, adapter: str, mb: TurnBatch) -> tuple[torch.Tensor, torch.Tensor, dict]:
        if not self.per_token:
            return super().policy_loss(adapter, mb)
        token_logp, token_entropy = self.score_replies(adapter, mb)  # (B, L), (B, L)
        mask = mb.response_mask.float()
        advantages = mb.advantages.unsqueeze(-1).expand_as(token_logp)  # (B, L): the reply's advantage on each token
        loss, stats = clipped_policy_loss(token_logp, mb.logprobs, advantages, self.config.clip_param, weights=mask, clip_param_high=self.config.clip_param_high,
                                          correction=self.rollout_correction(mb, per_token=True))
        entropy = (token_entropy * mask).sum() / mask.sum().clamp(min=1)
        self.add_reference_kl(token_logp, mb, stats)
        return loss, entropy, stats
