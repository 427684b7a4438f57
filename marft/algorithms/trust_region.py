"""How far one update may move a policy: ``--max_update_kl`` (issue 74).

PPO's clip bounds the ratio only where a token has already moved within the update: the first step of each epoch
runs at ratio 1 and clips nothing, and the approximate KL that ``--target_kl`` reads is the mean over the epoch's
chunks, most of them measured before the step. A near-deterministic policy (a team that has found its optimum)
can then move far in one Adam step while that approx KL reads little, and the team loses what it learned.

The bound measures what the update did, after its last step: the mean KL, over the batch's real reply tokens,
between the policy that sampled them and the updated policy (k3: ``(r - 1) - log r``, ``r = new / old``). Over
the limit, the step (updated weights minus the weights before the update) is halved, up to :data:`MAX_HALVINGS`
times, until the KL is within it (a backtracking line search, as TRPO's); a step still over the limit at the
smallest scale is undone. The optimizer's moments keep the update's gradients.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from marft.agents.team import AgentTeam
from marft.algorithms import kl
from marft.config import AlgoConfig
from marft.distributed import Distributed
from marft.types import TurnBatch

logger = logging.getLogger(__name__)

MAX_HALVINGS = 6
"""Halvings of an update's step before it is undone: the smallest step kept is 1/64 of the update's."""


@dataclass(frozen=True)
class BoundedUpdate:
    """What the bound kept of one update."""

    kl: float
    """The KL of the kept step on the batch (the last one measured; NaN when the step was undone)."""
    scale: float
    """The fraction of the update's step kept: 1 (all), 1/2, ... 1/2**MAX_HALVINGS, or 0 (undone)."""
    halvings: int
    """How many times the step was halved (line-search forwards beyond the first measure)."""


def token_kl_sum(new_logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """``(sum, count)`` of the k3 KL estimate over real tokens. All ``(B, L)``; ``mask`` 1 on real reply tokens."""
    log_ratio = (new_logprobs - old_logprobs).float()  # (B, L)
    kl = torch.expm1(log_ratio) - log_ratio  # (B, L), >= 0
    mask = mask.float()
    return float((kl * mask).sum()), float(mask.sum())


def bound_update(params: Sequence[torch.nn.Parameter], before: Sequence[torch.Tensor], measure: Callable[[], float],
                 limit: float) -> BoundedUpdate:
    """Keep as much of the step ``params - before`` as keeps ``measure()`` (the batch KL of the current weights)
    within ``limit``; ``params`` are changed in place. ``before``: the weights before the update, one per param."""
    kl = measure()
    if kl <= limit:
        return BoundedUpdate(kl, 1.0, 0)
    with torch.no_grad():
        steps = [param.detach() - start for param, start in zip(params, before)]
        scale, halvings = 1.0, 0
        while kl > limit and halvings < MAX_HALVINGS:
            scale, halvings = scale / 2, halvings + 1
            for param, start, step in zip(params, before, steps):
                param.copy_(start + scale * step)
            kl = measure()
        if kl > limit:
            for param, start in zip(params, before):
                param.copy_(start)
            return BoundedUpdate(float("nan"), 0.0, halvings)
    return BoundedUpdate(kl, scale, halvings)


def batch_update_kl(team: AgentTeam, config: AlgoConfig, samples: TurnBatch, adapter: str, dist: Distributed) -> float:
    """The mean k3 KL, over the real reply tokens of ``samples`` on every process, between the policy that sampled
    them (their ``logprobs``) and ``adapter`` as it is now (:func:`marft.algorithms.kl.reply_logprobs`: one forward
    without gradients or LoRA dropout)."""
    current = kl.reply_logprobs(team, config, samples, adapter)  # (B, L)
    total, count = dist.sum_floats(list(token_kl_sum(current, samples.logprobs, samples.response_mask)))
    return total / count if count else 0.0


def record(bounded: BoundedUpdate, adapter: str, limit: float, stats: dict, counters: dict, iteration: int) -> None:
    """Log one bounded update into the update's ``stats`` (``update_kl``, ``update_step_scale``) and count it:
    ``cut_updates`` (a share of the step kept), ``undone_updates`` (none kept, with a warning)."""
    stats["update_kl"].append(bounded.kl)
    stats["update_step_scale"].append(bounded.scale)
    if bounded.scale == 1:
        return
    key = "cut_updates" if bounded.scale > 0 else "undone_updates"
    counters[key] = counters.get(key, 0) + 1
    if bounded.scale == 0:
        logger.warning("iteration %d, %s: the update's KL stayed above --max_update_kl %g at 1/%d of its step; update "
                       "undone (%d so far): does the sampler score replies as the trainer does?", iteration + 1, adapter,
                       limit, 2 ** bounded.halvings, counters[key])
