"""Applying an optimizer's accumulated gradient, guarded: gradients summed over processes, clipped, and a
non-finite loss or gradient skipped and counted instead of applied; a run stops after ``--max_consecutive_skips``
skips in a row of one optimizer. Also the count of whole updates skipped because no process had a row of them."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from marft.config import AlgoConfig
from marft.distributed import Distributed
from marft.faults import TrainingStopped

logger = logging.getLogger(__name__)


def adamw(params, lr: float) -> torch.optim.AdamW:
    """The trainers' optimizer: AdamW without weight decay; on a GPU its fused kernel (one launch for every tensor of the
    adapter instead of several per tensor), elsewhere torch's default implementation. The fused kernel computes the
    same update (torch tests the two against each other); the state it saves is the same, so a checkpoint resumes on
    either device."""
    params = list(params)
    fused = bool(params) and all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=fused or None)


@dataclass
class GuardedSteps:
    """The guarded optimizer steps of one trainer; the counters are the trainer's (shared, saved in its checkpoints)."""

    config: AlgoConfig
    dist: Distributed
    """Process group (gradients are summed over it; a non-finite loss on any process skips the step on all)."""
    counters: dict[str, int]
    """The trainer's counters: ``skipped_minibatches`` and ``skipped_updates/<name>`` are counted here."""
    consecutive_skips: dict[str, int]
    """Per optimizer name, minibatches skipped in a row (reset by every applied step)."""

    def step(self, optimizer: torch.optim.Optimizer, params, loss_ok: bool, name: str, iteration: int) -> float:
        """Clip and apply the accumulated gradient of optimizer ``name``; skip (and count) a non-finite one.
        With several processes the gradients are summed over them first, and a non-finite loss on any
        process skips the step on all (so the weights stay identical). Returns the gradient norm (NaN: skipped).

        Raises:
            TrainingStopped: ``max_consecutive_skips`` minibatches of ``name`` were skipped in a row.
        """
        loss_ok = self.dist.sync_gradients(params, loss_ok)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm)
        if not loss_ok or not torch.isfinite(grad_norm):
            self.counters["skipped_minibatches"] += 1
            self.consecutive_skips[name] += 1
            optimizer.zero_grad(set_to_none=True)
            logger.warning(
                "iteration %d, %s: skipped a minibatch with a non-finite %s (%d in a row, %d in all)",
                iteration + 1, name, "loss" if not loss_ok else "gradient",
                self.consecutive_skips[name], self.counters["skipped_minibatches"],
            )
            limit = self.config.max_consecutive_skips
            if limit and self.consecutive_skips[name] >= limit:
                raise TrainingStopped(
                    f"iteration {iteration + 1}: {name} skipped {limit} minibatches in a row for non-finite "
                    f"losses or gradients (NaN/inf in logits, log-probs, values, advantages or losses; "
                    f"--max_consecutive_skips {limit})."
                )
            return float("nan")
        self.consecutive_skips[name] = 0
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    def skip_update(self, name: str, iteration: int) -> dict[str, float]:
        """Count and log an update of ``name`` (an adapter or critic) skipped because no process has a row of it
        (e.g. an agent the orchestrator never called): no optimizer step, so nothing of it moves."""
        key = f"skipped_updates/{name}"
        self.counters[key] = self.counters.get(key, 0) + 1
        if self.dist.is_main:
            logger.info("iteration %d, %s: no turns in this batch on any process, update skipped (%d so far)", iteration + 1, name, self.counters[key])
        return {}
