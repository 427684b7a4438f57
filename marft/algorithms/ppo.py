"""The PPO update loop every trainer shares: the agent schedule, minibatches and gradient-accumulation chunks,
the clipped surrogate on whole replies, the reference KL, entropy control, non-finite skips, and with several
processes the reductions of :mod:`marft.distributed`. It has no critic: :class:`~marft.algorithms.appo_trainer.APPOTrainer`
(MARFT-A) adds one, :class:`~marft.algorithms.tppo_trainer.TPPOTrainer` (MARFT-T) works per token on it, and
:class:`~marft.algorithms.grpo_trainer.GRPOTrainer` (critic-free) uses this loop as it is. The algorithms override
the hooks: ``compute_advantages``, ``normalized_advantages``, ``policy_loss``, ``loss_units`` (and a critic
trainer ``update_critics``, ``value_loss``).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from contextlib import nullcontext
from functools import partial

import torch

from marft.agents.team import AgentTeam
from marft.algorithms import batching, kl, schedule, trust_region
from marft.algorithms.advantages import batch_ranks_replies
from marft.algorithms.batching import Minibatch
from marft.algorithms.chunk_budget import budget_source, chunk_token_budget
from marft.algorithms.losses import batch_correction_weights, clipped_policy_loss, normalize_logprobs
from marft.algorithms.steps import GuardedSteps, adamw
from marft.config import AlgoConfig
from marft.distributed import SINGLE, Distributed
from marft.runner.shared.buffer import RolloutBuffer
from marft.types import TurnBatch

logger = logging.getLogger(__name__)


class PPOTrainer:
    """Owns the optimizers and runs one PPO update per rollout batch.

    With several processes (``dist``), each holds its share of the rollout batch (shares may differ in size,
    down to none) and step k uses the union of the processes' k-th minibatches, its chunks weighted by that
    union's loss units. Equal shares: each process shuffles its own rows. Unequal shares: rank 0 draws one
    permutation of the union's rows (rank 0's first) per epoch and shares it, the union is split into
    ``num_mini_batch`` minibatches (as many on every process, whatever its share) and each process steps with its
    own rows of minibatch k (possibly none), so every step equals the single-process step on the union.

    An adapter (or critic) with no rows on any process is not updated at all (no optimizer step, so neither its
    weights nor its optimizer state move) and the skip is counted (``counters/skipped_updates/<adapter>``)."""

    def __init__(self, team: AgentTeam, config: AlgoConfig, steps_per_iteration: int, dist: Distributed = SINGLE):
        self.team = team
        self.config = config
        self.dist = dist
        """Process group of a data-parallel run (:data:`~marft.distributed.SINGLE`: one process, no collectives)."""
        self.steps_per_iteration = steps_per_iteration
        """Environment steps one iteration collects: the schedule (``warmup_steps``, ``agent_iteration_interval``) counts env steps."""
        self.policy_optimizers = {
            adapter: adamw(team.adapter_parameters(adapter), config.lr)
            for adapter in team.policy_adapters
        }
        self.critic_optimizers: dict[str, torch.optim.Optimizer] = {}
        """Per critic adapter, its optimizer: none here (a critic trainer, :class:`~marft.algorithms.appo_trainer.APPOTrainer`, adds them)."""
        self.entropy_coefs = {adapter: config.entropy_coef for adapter in team.policy_adapters}
        """Per policy adapter, the weight of its entropy bonus: ``--entropy_coef``, or adapted towards ``--target_entropy``."""
        self.counters = {"kl_early_stops": 0, "skipped_minibatches": 0, "out_of_topk_tokens": 0, "constant_reward_batches": 0}
        self.consecutive_skips = {name: 0 for name in [*self.policy_optimizers, *self.critic_optimizers]}
        """Per optimizer, minibatches skipped in a row (reset by every applied step)."""
        self.iteration = 0
        """The 0-based iteration being updated (for messages)."""
        self.scored_positions = [0, 0]
        """Token positions the policy forwards of the current adapter's update ran, and of them padding (``pad_share``)."""
        budget = self.chunk_tokens
        if dist.is_main:
            logger.info("update chunk budget: %s (%s)", f"{budget} positions" if budget is not None else "none", budget_source(config, team.device))

    @property
    def chunk_tokens(self) -> int | None:
        """Positions one gradient-accumulation chunk's forward may run (``--max_chunk_tokens``, else from
        ``--max_chunk_mib``, :mod:`marft.algorithms.chunk_budget`); None: no budget."""
        return chunk_token_budget(self.config, self.team.bank.model.config, self.team.device, self.team.config.gradient_checkpointing)

    # ------------------------------------------------------------------ schedule
    schedule_origin: tuple[int, int] = (0, 0)
    """``(iteration, env steps collected before it)`` the schedule counts from: a resumed run sets the checkpoint's,
    so a rollout size changed on resume counts only the iterations after it at the new size."""

    def agents_to_train(self, iteration: int) -> list[int]:
        """Agents whose policy is updated at ``iteration`` (0-based): :func:`marft.algorithms.schedule.scheduled_agents`
        of the env steps collected once this iteration's rollout is in, those of the iterations before
        :attr:`schedule_origin` (as collected) plus this run's since."""
        origin_iteration, origin_steps = self.schedule_origin
        env_steps = origin_steps + (iteration - origin_iteration + 1) * self.steps_per_iteration
        return schedule.scheduled_agents(self.config, self.team.n_agents, self.team.profile, env_steps)

    def informative(self, buffer: RolloutBuffer) -> bool:
        """Whether the batch can rank replies (:func:`marft.algorithms.advantages.batch_ranks_replies`)."""
        return batch_ranks_replies(buffer, self.token_level, self.dist)

    def adapter_groups(self, agents: list[int]) -> dict[str, list[int]]:
        """The scheduled ``agents`` grouped by the adapter they act with: one group per agent, or a single
        group with ``--shared_lora``, so a shared adapter gets ONE update on all its agents' turns."""
        groups: dict[str, list[int]] = {}
        for agent in agents:
            groups.setdefault(self.team.agent_adapters[agent], []).append(agent)
        return groups

    # ------------------------------------------------------------------ algorithm hooks
    uses_critic = False
    """Whether the team needs a critic (adapter, value head, values in the rollout, its optimizer and checkpoint files)."""
    group_relative = False
    """Whether the runner plays groups of ``group_size`` whole episodes on one task (critic-free GRPO)."""
    values_in_update = False
    """Whether the update's first critic forward values the rollout's turns (:meth:`APPOTrainer.value_turns`), not the
    rollout: the runner sets it where :meth:`APPOTrainer.can_value_in_update` holds (never without a critic)."""
    token_level = False
    """Whether the rollout must value every reply token (MARFT-T) or only each prompt (MARFT-A)."""

    def compute_advantages(self, buffer: RolloutBuffer) -> None:
        """Fill the buffer's advantages (and returns) by the algorithm's estimator."""
        raise NotImplementedError

    def loss_units(self, samples: TurnBatch, indices: torch.Tensor) -> float:
        """How many units the losses average over in rows ``indices``: replies at the action level. Gradient
        accumulation weights each chunk by its share of the minibatch's units, so the gradient does not
        depend on ``gradient_cp_steps``."""
        return float(len(indices))

    def normalized_advantages(self, samples: TurnBatch) -> TurnBatch:
        """Standardise one adapter's advantages over its batch, all processes' rows together (when ``normalize_advantages``)."""
        advantages = samples.advantages  # (B,)
        stats = self.dist.mean_std(advantages) if self.config.normalize_advantages else None
        if stats is not None:
            mean, std = stats
            advantages = (advantages - mean) / (std + 1e-8)
        return samples.replace(advantages=advantages)

    def policy_loss(self, adapter: str, mb: TurnBatch) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Clipped surrogate on whole-reply log-probs. Returns ``(policy_loss, entropy, stats)``."""
        cfg = self.config
        token_logp, token_entropy = self.score_replies(adapter, mb)  # (B, L), (B, L)
        mask = mb.response_mask.float()
        new_logp = normalize_logprobs(token_logp, mask, mb.n_words, cfg.normalization_mode)  # (B,)
        old_logp = normalize_logprobs(mb.logprobs, mask, mb.n_words, cfg.normalization_mode)  # (B,)
        correction = self.rollout_correction(mb, per_token=False)
        loss, stats = clipped_policy_loss(new_logp, old_logp, mb.advantages, cfg.clip_param, clip_param_high=cfg.clip_param_high,
                                          correction=correction)
        entropy = (token_entropy.sum(-1) / mask.sum(-1).clamp(min=1)).mean()
        self.add_reference_kl(token_logp, mb, stats, reply_mode=cfg.normalization_mode)
        return loss, entropy, stats

    def rollout_correction(self, mb: TurnBatch, per_token: bool) -> torch.Tensor | None:
        """``--rollout_correction`` weights of the minibatch's replies sampled by an inference engine
        (:func:`marft.algorithms.losses.batch_correction_weights`; None without one), per reply or per token; counts the
        replies (tokens) truncated or dropped, once per PPO epoch that sees them (``counters/rollout_corrected``)."""
        cfg = self.config
        weights, changed = batch_correction_weights(mb, cfg.rollout_correction, cfg.rollout_correction_cap, cfg.normalization_mode, per_token)
        if weights is not None:
            self.counters["rollout_corrected"] = self.counters.get("rollout_corrected", 0) + changed
        return weights

    def add_reference_kl(self, token_logp: torch.Tensor, mb: TurnBatch, stats: dict, reply_mode: str | None = None) -> None:
        """Puts the KL term toward the reference (:func:`marft.algorithms.kl.reference_kl`, by ``--kl_estimator``)
        into ``stats``: the chunk's KL summed over its loss units (``kl_sum``, in the graph, which the update divides
        by the global minibatch's loss units) and its mean over the chunk's tokens (``kl_to_reference``, logged).
        With ``kl_coef`` 0 nothing is added and no reference forward runs. ``token_logp``: ``(B, L)`` of the current
        policy; ``reply_mode``: the ``--normalization_mode`` of a loss per reply (None: per token)."""
        if self.config.effective_kl_coef <= 0:
            return
        if mb.ref_logprobs is None:
            raise RuntimeError("--kl_coef > 0 needs the reference log-probs of the replies: update_policy sets them "
                               "(reference_logprobs); a policy loss called on its own needs them too, or kl_coef 0")
        stats["kl_sum"], stats["kl_to_reference"] = kl.reference_kl(self.config, token_logp, mb, reply_mode)

    def reference_logprobs(self, samples: TurnBatch, adapter: str | None = None) -> torch.Tensor:
        """``(B, L)`` log-probs of the sampled replies under ``adapter``'s reference policy (:func:`marft.algorithms.kl.reference_logprobs`)."""
        return kl.reference_logprobs(self.team, self.config, samples, adapter)

    def score_replies(self, adapter: str, mb: TurnBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The current policy's token log-probs and entropies of the minibatch's replies, ``(B, L)`` each;
        sampled tokens outside the current top-k are counted (``out_of_topk_tokens``). Each role header runs
        once per minibatch chunk; the entropy is in the graph only when ``entropy_coef`` weighs it in the loss."""
        scores = self.team.response_logprobs(
            adapter, mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.response_mask, with_entropy=True,
            agents=mb.agent, entropy_grad=self.config.entropy_coef != 0 or self.config.target_entropy is not None,
        )
        self.counters["out_of_topk_tokens"] += scores.out_of_topk
        self.scored_positions[0] += scores.positions
        self.scored_positions[1] += scores.padding
        return scores.logprobs, scores.entropy

    # ------------------------------------------------------------------ update
    lr_factor: float = 1.0
    """A factor on every learning rate for the rest of the run: 1, times ``--rollback_lr_factor`` per rollback to the
    best checkpoint (``--on_collapse rollback``); in checkpoints, so a resumed run keeps it."""
    total_iterations: int = 0
    """Iterations of the whole run, the end of ``--lr_schedule``'s decay (the runner sets it; a resumed run recounts
    it). 0: unknown, the learning rates stay as configured."""

    def learning_rate_scale(self, iteration: int) -> float:
        """The factor on ``--lr`` and ``--critic_lr`` at ``iteration`` (0-based): :func:`marft.algorithms.schedule.learning_rate_scale`
        over :attr:`total_iterations`, times :attr:`lr_factor`."""
        return schedule.learning_rate_scale(self.config, iteration, self.total_iterations, self.lr_factor)

    def set_learning_rates(self, iteration: int) -> None:
        """Every optimizer's learning rate for ``iteration``: its configured rate times :meth:`learning_rate_scale`."""
        scale = self.learning_rate_scale(iteration)
        for optimizers, lr in ((self.policy_optimizers, self.config.lr), (self.critic_optimizers, self.config.critic_lr)):
            for opt in optimizers.values():
                for group in opt.param_groups:
                    group["lr"] = lr * scale

    def update(self, buffer: RolloutBuffer, iteration: int) -> dict[str, float]:
        """The critics' update (:meth:`update_critics`, if any), then one policy update per adapter of the scheduled agents.

        A batch that cannot rank replies (:meth:`informative`) says nothing about which replies are better: its
        advantages are only the critic's errors (or zero, while the entropy and KL terms still pull), and following
        them (Adam turns any non-zero gradient into a full-size step) is a random walk that lowers the policy's
        entropy. Such a batch trains the critic only, and is counted (``counters/constant_reward_batches``), as
        group-relative methods zero out groups without reward variance (``--update_on_constant_rewards true``: the
        policies are updated anyway, as in the original MARFT). LoRA dropout (``--lora_dropout``) is active here only."""
        self.iteration = iteration
        self.set_learning_rates(iteration)
        agents = self.agents_to_train(iteration)
        if agents and not self.config.update_on_constant_rewards and not self.informative(buffer):
            self.counters["constant_reward_batches"] += 1
            agents = []
        summed = ("out_of_topk_tokens", "rollout_corrected")  # counted per process, kept as the sum over processes
        before = {key: self.counters.get(key, 0) for key in summed}
        with self.team.bank.lora_dropout_active():
            metrics = self.update_critics(buffer)
            for adapter, group in self.adapter_groups(agents).items():
                samples = buffer.agent_samples(group, self.token_level)
                label = self.team.profile[group[0]].role if len(group) == 1 else adapter
                for key, value in self.update_policy(adapter, samples).items():
                    metrics[f"agent_{label}/{key}"] = value
        self.team.set_active(None)
        if self.dist.enabled:  # counted over all processes, so every process keeps the same counters
            counted = self.dist.sum_floats([self.counters.get(key, 0) - before[key] for key in summed])
            for key, count in zip(summed, counted):
                if key in self.counters or count:
                    self.counters[key] = before[key] + int(count)
        return metrics

    def update_critics(self, buffer: RolloutBuffer) -> dict[str, float]:
        """Update the critics on the batch before the policies (none here); returns their metrics."""
        return {}

    def _row_share(self, samples: TurnBatch) -> tuple[int, int, bool]:
        """``(offset, total, equal)`` of this process's rows in the union of all processes' (:func:`marft.algorithms.batching.row_share`)."""
        return batching.row_share(samples, self.dist)

    def headers_of_chunks(self, minibatch: Minibatch):
        """The context a minibatch's chunks run in: each role header runs once for all of them (one forward and
        backward per minibatch, its graph held until the minibatch ends), or, in a minibatch the chunk budget cut,
        once per chunk, so that nothing of one chunk is held while the next runs and the budget bounds the update's
        memory (a critic of n agents would otherwise hold n headers' graphs: their tokens' activations)."""
        return nullcontext() if minibatch.budget_cut else self.team.headers.shared_over_chunks()

    def _minibatches(self, samples: TurnBatch, chunks_per_minibatch: int) -> list[Minibatch]:
        """One epoch's minibatches of ``samples`` and their chunks (:func:`marft.algorithms.batching.plan_minibatches`),
        under :attr:`chunk_tokens`."""
        budget = self.chunk_tokens
        header_lengths = batching.header_lengths(samples, self.team.headers) if budget is not None else None
        return batching.plan_minibatches(samples, chunks_per_minibatch, self.config.num_mini_batch, self.dist, self.loss_units,
                                         budget, header_lengths)

    @property
    def steps(self) -> GuardedSteps:
        """The guarded optimizer steps (:mod:`marft.algorithms.steps`) under the current config, counting into :attr:`counters`."""
        return GuardedSteps(self.config, self.dist, self.counters, self.consecutive_skips)

    def _skip_update(self, name: str) -> dict[str, float]:
        """Count and log a skipped update of ``name``: no process has a row of it (:meth:`GuardedSteps.skip_update`)."""
        return self.steps.skip_update(name, self.iteration)

    def _step(self, optimizer, params, loss_ok: bool, name: str) -> float:
        """Apply optimizer ``name``'s accumulated gradient, or skip a non-finite one (:meth:`GuardedSteps.step`);
        an engine serving the adapter takes it again after an applied step."""
        grad_norm = self.steps.step(optimizer, params, loss_ok, name, self.iteration)
        if grad_norm == grad_norm:
            self.team.bank.mark_changed(name)
        return grad_norm

    def update_policy(self, adapter: str, samples: TurnBatch) -> dict[str, float]:
        """PPO epochs of ``adapter`` over its agents' turns. ``samples`` holds tensors with a leading dim of
        T·E per agent that acts with the adapter."""
        cfg, team = self.config, self.team
        optimizer = self.policy_optimizers[adapter]
        params = team.adapter_parameters(adapter)
        if self._row_share(samples)[1] == 0:
            return self._skip_update(adapter)
        team.set_active(adapter, trainable=True)
        samples = self.normalized_advantages(samples)
        if cfg.effective_kl_coef > 0:
            samples.ref_logprobs = self.reference_logprobs(samples, adapter)
        stats = defaultdict(list)
        self.scored_positions = [0, 0]
        before = [param.detach().clone() for param in params] if cfg.max_update_kl is not None else None
        for _ in range(cfg.ppo_epoch):
            epoch_kl = []
            for minibatch in self._minibatches(samples, cfg.gradient_cp_steps):
                loss_ok, units = True, minibatch.units
                with self.headers_of_chunks(minibatch):
                    for chunk in minibatch.chunks:
                        mb = samples.rows(chunk).trimmed(team.device)
                        policy_loss, entropy, pstats = self.policy_loss(adapter, mb)
                        loss = (policy_loss - self.entropy_coefs[adapter] * entropy) * (self.loss_units(samples, chunk) / units)
                        kl_sum = pstats.pop("kl_sum", None)
                        if kl_sum is not None:  # per loss unit of the global minibatch, whatever the chunks
                            loss = loss + cfg.effective_kl_coef * kl_sum / units
                        if not torch.isfinite(loss):
                            loss_ok = False
                            break
                        loss.backward()
                        stats["policy_loss"].append(policy_loss.item())
                        stats["entropy"].append(entropy.item())
                        for key, value in pstats.items():
                            stats[key].append(value.item())
                        epoch_kl.append(pstats["approx_kl"].item())
                stats["grad_norm"].append(self._step(optimizer, params, loss_ok, adapter))
            if cfg.target_kl is None:
                continue
            kl_sum, kl_count = self.dist.sum_floats([sum(epoch_kl), len(epoch_kl)])  # the epoch's chunks on all processes
            if kl_count and kl_sum / kl_count > cfg.target_kl:
                self.counters["kl_early_stops"] += 1
                logger.info("adapter %s: approx KL %.4f > target %.4f, remaining epochs skipped", adapter, kl_sum / kl_count, cfg.target_kl)
                break
        if before is not None:  # --max_update_kl
            measure = partial(trust_region.batch_update_kl, team, cfg, samples, adapter, self.dist)
            bounded = trust_region.bound_update(params, before, measure, cfg.max_update_kl)
            trust_region.record(bounded, adapter, cfg.max_update_kl, stats, self.counters, self.iteration)
        positions, padding = self.scored_positions
        stats["pad_share"].append(padding / positions if positions else float("nan"))
        self.adapt_entropy_coef(adapter, stats["entropy"])
        stats["entropy_coef"].append(self.entropy_coefs[adapter])
        return {key: _nanmean(values) for key, values in stats.items()}

    def adapt_entropy_coef(self, adapter: str, entropies: list[float]) -> None:
        """With ``--target_entropy``: move ``adapter``'s entropy bonus weight one ``--entropy_coef_step`` towards
        keeping its entropy at the target, from the mean entropy of this update's chunks on all processes (so
        every process keeps the same weight). A policy whose entropy collapses before it found the optimum gets
        a growing bonus until it explores again; one above the target gets none."""
        if self.config.target_entropy is None:
            return
        total, count = self.dist.sum_floats([sum(entropies), len(entropies)])
        if count:
            self.entropy_coefs[adapter] = schedule.next_entropy_coef(self.config, self.entropy_coefs[adapter], total / count)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        state = {
            "policy_optimizers": {a: opt.state_dict() for a, opt in self.policy_optimizers.items()},
            "counters": dict(self.counters),
            "consecutive_skips": dict(self.consecutive_skips),
            "entropy_coefs": dict(self.entropy_coefs),
            "lr_factor": self.lr_factor,
        }
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore optimizer states, counters and the rollbacks' learning-rate factor; learning rates come from the
        current config (so ``--lr`` may change on resume)."""
        self.load_optimizer_states(state)
        self.lr_factor = float(state.get("lr_factor", 1.0))
        self.counters.update(state.get("counters", {}))
        self.consecutive_skips.update(state.get("consecutive_skips", {}))
        if self.config.target_entropy is not None:  # adapted weights continue; a fixed --entropy_coef may change on resume
            self.entropy_coefs.update(state.get("entropy_coefs", {}))

    def load_optimizer_states(self, state: dict) -> None:
        """The optimizers' states alone (a rollback to the best checkpoint keeps the run's counters), each at its
        configured learning rate (:meth:`set_learning_rates` sets the iteration's)."""
        for adapter, opt in self.policy_optimizers.items():
            opt.load_state_dict(state["policy_optimizers"][adapter])
            for group in opt.param_groups:
                group["lr"] = self.config.lr


def _nanmean(values: list[float]) -> float:
    finite = [v for v in values if v == v]
    return sum(finite) / len(finite) if finite else float("nan")
