"""PPO loss terms shared by the trainers. All inputs are 1-D over the minibatch unless noted."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from marft.types import TurnBatch

NORMALIZERS = {
    "sum": lambda total, mask, n_words: total,
    "token": lambda total, mask, n_words: total / mask.sum(-1).clamp(min=1),
    "word": lambda total, mask, n_words: total / n_words.clamp(min=1),
}
"""``--normalization_mode`` (:data:`marft.choices.NORMALIZATION_MODES`) → how a reply's log-prob is formed from
its summed token log-probs: the plain ``sum``, the mean per ``token``, or the sum per ``word`` of the decoded reply."""


def normalize_logprobs(token_logprobs: torch.Tensor, mask: torch.Tensor, n_words: torch.Tensor, mode: str) -> torch.Tensor:
    """An action's log-prob from its tokens' ``(B, L)`` by :data:`NORMALIZERS` ``[mode]``. → (B,)."""
    if mode not in NORMALIZERS:
        raise ValueError(f"unknown normalization mode {mode!r}; known: {', '.join(NORMALIZERS)}")
    return NORMALIZERS[mode]((token_logprobs * mask).sum(-1), mask, n_words)


def rollout_correction_weights(old_logp: torch.Tensor, sampling_logp: torch.Tensor | None, mode: str, cap: float) -> torch.Tensor | None:
    """Importance weights that correct the policy loss for replies an inference engine sampled from a slightly
    different distribution than the trainer's (``--rollout_correction``): with ``r = exp(old_logp − sampling_logp)``
    per reply (shape (B,), the summed tokens) or per token ((B, L)), ``truncate`` gives ``min(r, cap)`` (truncated
    importance sampling), ``mask`` gives 1 where ``1/cap ≤ r ≤ cap`` and 0 elsewhere, ``none`` (or no engine
    log-probs) gives None. Without gradient."""
    if mode == "none" or sampling_logp is None:
        return None
    with torch.no_grad():
        ratio = torch.exp((old_logp - sampling_logp).float().clamp(max=50.0))
        if mode == "truncate":
            return ratio.clamp(max=cap)
        if mode == "mask":
            return ((ratio <= cap) & (ratio >= 1.0 / cap)).float()
    raise ValueError(f"unknown --rollout_correction {mode!r}; known: none, truncate, mask")


def batch_correction_weights(mb: TurnBatch, mode: str, cap: float, normalization_mode: str, per_token: bool) -> tuple[torch.Tensor | None, int]:
    """``(weights, changed)``: ``--rollout_correction`` weights (``mode``, ``cap``) of the minibatch's replies sampled
    by an inference engine, for a loss per reply (``per_token`` False: ``(B,)``) or per token (``(B, L)``, zero at
    padding), and how many replies (tokens) they truncated or dropped. ``truncate`` weighs by the reply's
    probability ratio (its token log-probs combined by ``normalization_mode``, as the PPO ratio is) or each
    token's, ``mask`` always keeps or drops whole replies. ``(None, 0)`` without an engine."""
    if mb.sampling_logprobs is None:
        return None, 0
    mask = mb.response_mask.float()  # (B, L)
    if not per_token:  # the reply's ratio as the PPO ratio forms it (--normalization_mode)
        old = normalize_logprobs(mb.logprobs, mask, mb.n_words, normalization_mode)  # (B,)
        sampled = normalize_logprobs(mb.sampling_logprobs, mask, mb.n_words, normalization_mode)
    else:
        old, sampled = mb.logprobs * mask, mb.sampling_logprobs * mask  # (B, L)
        if mode == "mask":
            old, sampled = old.sum(-1), sampled.sum(-1)  # (B,) whole replies
    weights = rollout_correction_weights(old, sampled, mode, cap)
    if weights is None:
        return None, 0
    real = mask.bool() if weights.dim() == 2 else mask.sum(-1) > 0
    changed = (weights == 0 if mode == "mask" else weights < torch.exp(old - sampled)) & real
    if per_token:
        weights = (weights if weights.dim() == 2 else weights[:, None]) * mask  # (B, L)
    return weights, int(changed.sum())


def clipped_policy_loss(new_logp, old_logp, advantages, clip_param: float, weights=None, clip_param_high: float | None = None,
                        correction=None):
    """PPO's clipped surrogate (to minimise), plus diagnostics.

    Args: ``new_logp, old_logp, advantages`` of shape (B,) (or any common shape);
    ``weights`` (same shape) average only over real entries (e.g. token masks);
    the ratio is clipped to ``[1 - clip_param, 1 + clip_param_high]`` (``clip_param_high`` None: ``clip_param``;
    a larger upper bound is DAPO's clip-higher: an unlikely reply with a positive advantage may gain more
    probability per update, which keeps the policy exploring).
    ``correction`` (broadcast to the same shape, or None): :func:`rollout_correction_weights`, multiplying each
    entry's surrogate (not the average's denominator).
    Returns ``(loss, stats)`` with stats ``approx_kl``, ``clip_frac``, ``ratio``.
    """
    high = clip_param if clip_param_high is None else clip_param_high
    log_ratio = new_logp - old_logp
    ratio = torch.exp(log_ratio)
    surrogate = torch.min(ratio * advantages, torch.clamp(ratio, 1 - clip_param, 1 + high) * advantages)
    if correction is not None:
        surrogate = surrogate * correction
    w = torch.ones_like(ratio) if weights is None else weights
    denom = w.sum().clamp(min=1)
    loss = -(surrogate * w).sum() / denom
    with torch.no_grad():
        clipped = (ratio < 1 - clip_param) | (ratio > 1 + high)
        stats = {
            "approx_kl": (((ratio - 1) - log_ratio) * w).sum() / denom,
            "clip_frac": (clipped.float() * w).sum() / denom,
            "ratio": (ratio * w).sum() / denom,
        }
    return loss, stats


def clipped_value_loss(values, old_values, returns, clip_param: float, use_huber: bool, huber_delta: float, weights=None):
    """Value loss clipped around the rollout values (``clip_param`` 0 disables clipping), squared or Huber."""

    def error(pred):
        if use_huber:
            return F.huber_loss(pred, returns, reduction="none", delta=huber_delta)
        return 0.5 * (pred - returns) ** 2

    loss = error(values)
    if clip_param > 0:
        clipped = old_values + (values - old_values).clamp(-clip_param, clip_param)
        loss = torch.max(loss, error(clipped))
    w = torch.ones_like(loss) if weights is None else weights
    return (loss * w).sum() / w.sum().clamp(min=1)
