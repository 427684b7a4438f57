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
import math
from collections import defaultdict
from contextlib import nullcontext
from typing import NamedTuple

import torch

from marft.agents.team import AgentTeam
from marft.algorithms.chunk_budget import budget_source, chunk_token_budget
from marft.algorithms.losses import clipped_policy_loss, normalize_logprobs, rollout_correction_weights
from marft.config import AlgoConfig
from marft.distributed import SINGLE, Distributed
from marft.faults import TrainingStopped
from marft.runner.shared.buffer import RolloutBuffer
from marft.types import TurnBatch

logger = logging.getLogger(__name__)


class Minibatch(NamedTuple):
    """One optimizer step's rows (:meth:`PPOTrainer._minibatches`)."""

    chunks: list[torch.Tensor]
    """Row indices of each gradient-accumulation chunk, in the order they run."""
    units: float
    """The minibatch's loss units summed over processes (each chunk's loss is weighted by its share of them)."""
    budget_cut: bool = False
    """Whether the chunk token budget cut it (its chunks then run their own role headers)."""


def forward_positions(rows: int, header: int, rest: int, reply: int, n_headers: int) -> tuple[int, int]:
    """``(rows', headers')``: the positions a chunk's forward runs for ``rows`` rows laid out as ``[rest][reply]``
    behind ``n_headers`` shared role headers (the longest ``header`` tokens each, run once for all their rows), and
    those of the header forward. Prompts that are only their header run whole rows (nothing would follow a shared
    header): ``rows x (header + reply)``, no header forward."""
    if rest == 0:
        return rows * (header + reply), 0
    return rows * (rest + reply), n_headers * header


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
            adapter: torch.optim.AdamW(team.adapter_parameters(adapter), lr=config.lr, weight_decay=0.0)
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
        """Agents whose policy is updated at ``iteration`` (0-based), as the original MARFT decides it from
        the env steps collected once this iteration's rollout is in: none before ``warmup_steps``, then all
        agents, or agent ``(env_steps // agent_iteration_interval) % n_agents`` alone (the round-robin includes
        an orchestrator, unless ``--train_orchestrator false`` leaves it out; ``--frozen_roles`` are never trained). The env steps are those of the
        iterations before :attr:`schedule_origin` (as collected) plus this run's since."""
        origin_iteration, origin_steps = self.schedule_origin
        env_steps = origin_steps + (iteration - origin_iteration + 1) * self.steps_per_iteration
        if env_steps < self.config.warmup_steps:
            return []
        frozen = {role.strip() for role in (self.config.frozen_roles or "").split(",") if role.strip()}
        trainable = list(range(self.team.n_agents))
        if frozen:
            trainable = [a for a in trainable if self.team.profile[a].role not in frozen]
        if not self.config.train_orchestrator:
            trainable = [a for a in trainable if not self.team.profile[a].orchestrator]
        interval = self.config.agent_iteration_interval
        if interval == 0:
            return trainable
        return [trainable[(env_steps // interval) % len(trainable)]]

    def informative(self, buffer: RolloutBuffer) -> bool:
        """Whether the batch (over all processes) can rank replies: not when its advantages (token advantages at
        the token level) are all zero, nor when every reward is equal and every step ended its episode for good
        (each return is then a sum of equal rewards with nothing bootstrapped, so any advantage is the critic's
        error alone). Equal rewards in a batch where an episode goes on are informative: the bootstrapped value
        of the next state still ranks the replies. A NaN advantage counts as not zero (the update's checks catch it)."""
        advantages = buffer.token_advantages if self.token_level else buffer.advantages
        going_on = buffer.active & ~buffer.terminated  # (T, E): a played step whose episode continues (or was cut)
        nonzero, open_steps = self.dist.sum_floats([float((advantages != 0).sum()), float(going_on.sum())])
        if nonzero == 0:
            return False
        if open_steps > 0:
            return True
        stats = self.dist.mean_std(buffer.agent_rewards.flatten().double())
        return stats is None or float(stats[1]) > 1e-9

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
        """``--rollout_correction`` weights of the minibatch's replies sampled by an inference engine, for a loss
        per reply (``per_token`` False: ``(B,)``) or per token (``(B, L)``, zero at padding): ``truncate`` weighs
        by the reply's probability ratio (its token log-probs combined by ``--normalization_mode``, as the PPO
        ratio is) or each token's, ``mask`` always keeps or drops whole replies. None without an engine. Counts the replies (tokens) truncated or dropped, once per
        PPO epoch that sees them (``counters/rollout_corrected``)."""
        if mb.sampling_logprobs is None:
            return None
        cfg = self.config
        mask = mb.response_mask.float()  # (B, L)
        if not per_token:  # the reply's ratio as the PPO ratio forms it (--normalization_mode)
            old = normalize_logprobs(mb.logprobs, mask, mb.n_words, cfg.normalization_mode)  # (B,)
            sampled = normalize_logprobs(mb.sampling_logprobs, mask, mb.n_words, cfg.normalization_mode)
        else:
            old, sampled = mb.logprobs * mask, mb.sampling_logprobs * mask  # (B, L)
            if cfg.rollout_correction == "mask":
                old, sampled = old.sum(-1), sampled.sum(-1)  # (B,) whole replies
        weights = rollout_correction_weights(old, sampled, cfg.rollout_correction, cfg.rollout_correction_cap)
        if weights is None:
            return None
        real = mask.bool() if weights.dim() == 2 else mask.sum(-1) > 0
        changed = (weights == 0 if cfg.rollout_correction == "mask" else weights < torch.exp(old - sampled)) & real
        self.counters["rollout_corrected"] = self.counters.get("rollout_corrected", 0) + int(changed.sum())
        if per_token:
            weights = (weights if weights.dim() == 2 else weights[:, None]) * mask  # (B, L)
        return weights

    def add_reference_kl(self, token_logp: torch.Tensor, mb: TurnBatch, stats: dict, reply_mode: str | None = None) -> None:
        """The KL term of the loss per real reply token, by ``--kl_estimator`` with ``r = log p_ref - log p``: k3,
        ``exp(r) - r - 1`` (as GRPO papers put it in the loss; on the policy's own samples its gradient is
        ``-E_ref[grad log p]``, that of KL(reference || policy): a pull toward every reply the reference writes), or
        k2, ``r^2 / 2`` (its gradient ``E_p[-r grad log p]`` is that of KL(policy || reference), the regularised
        objective's). The reference is :meth:`reference_logprobs`'s.

        Puts into ``stats`` the chunk's KL summed over its loss units (``kl_sum``, in the graph), which the update
        divides by the loss units of the global minibatch (:meth:`loss_units`), so the KL is weighed against the
        policy loss in that loss's own units, whatever the chunks or the processes: a token's KL beside a token's
        term for the token-level losses; for a loss per reply (``reply_mode``, its ``--normalization_mode``) each
        reply's token KL combined as its log-prob is (summed, per token or per word), so a token's KL keeps the same
        weight against its advantage in every mode. Also its mean over the chunk's tokens (``kl_to_reference``,
        logged). With ``kl_coef`` 0 nothing is added and no reference forward runs. ``token_logp``: ``(B, L)`` of
        the current policy."""
        if self.config.effective_kl_coef <= 0:
            return
        if mb.ref_logprobs is None:
            raise RuntimeError("--kl_coef > 0 needs the reference log-probs of the replies: update_policy sets them "
                               "(reference_logprobs); a policy loss called on its own needs them too, or kl_coef 0")
        mask = mb.response_mask.float()  # (B, L)
        log_ratio = (mb.ref_logprobs - token_logp) * mask  # (B, L)
        k3 = (torch.exp(log_ratio) - log_ratio - 1) * mask  # (B, L): the KL's value, logged whatever the estimator
        term = k3 if self.config.kl_estimator == "k3" else 0.5 * log_ratio.square() * mask  # (B, L) the loss's term
        stats["kl_sum"] = term.sum() if reply_mode is None else normalize_logprobs(term, mask, mb.n_words, reply_mode).sum()
        stats["kl_to_reference"] = k3.sum().detach() / mask.sum().clamp(min=1)

    @torch.no_grad()
    def reference_logprobs(self, samples: TurnBatch, adapter: str | None = None) -> torch.Tensor:
        """``(B, L)`` log-probs of the sampled replies under the reference policy of ``adapter`` (``--kl_reference``):
        its frozen copy from the start of training (``initial``: :meth:`AgentTeam.add_reference_adapters`), or the
        base model (``base``: every adapter off, free with LoRA), in chunks of one gradient-accumulation chunk's
        size; zero at padding."""
        n_samples, L = samples.response_ids.shape
        size = max(1, math.ceil(n_samples / (self.config.num_mini_batch * self.config.gradient_cp_steps)))
        out = torch.zeros(n_samples, L)
        reference = self.team.reference_adapters.get(adapter) if adapter is not None else None
        route = reference or self.team.policy_adapters[0]
        for rows in torch.arange(n_samples).split(size):
            mb = TurnBatch(agent=samples.agent, prompt_ids=samples.prompt_ids, prompt_mask=samples.prompt_mask, response_ids=samples.response_ids,
                           response_mask=samples.response_mask).rows(rows).trimmed(self.team.device)
            with self.team.bank.reference_policy() if reference is None else nullcontext():
                scores = self.team.response_logprobs(
                    route, mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.response_mask, agents=mb.agent
                )
            out[rows, : scores.logprobs.shape[1]] = scores.logprobs.float().cpu()
        return out

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
        """The factor on ``--lr`` and ``--critic_lr`` at ``iteration`` (0-based) under ``--lr_schedule``: 1 for
        ``constant``; ``1 - iteration / total_iterations`` for ``linear`` (1 at the first iteration, ``1 / total``
        at the last); times ``(iteration + 1) / lr_warmup_iterations`` during ``--lr_warmup_iterations``; times
        :attr:`lr_factor` (lowered by each rollback to the best checkpoint)."""
        warmup = self.config.lr_warmup_iterations
        ramp = self.lr_factor * (min(1.0, (iteration + 1) / warmup) if warmup else 1.0)
        if self.config.lr_schedule == "constant" or not self.total_iterations:
            return ramp
        return ramp * max(0.0, 1.0 - iteration / self.total_iterations)

    def set_learning_rates(self, iteration: int) -> None:
        """Every optimizer's learning rate for ``iteration``: its configured rate times :meth:`learning_rate_scale`."""
        scale = self.learning_rate_scale(iteration)
        for optimizers, lr in ((self.policy_optimizers, self.config.lr), (self.critic_optimizers, self.config.critic_lr)):
            for opt in optimizers.values():
                for group in opt.param_groups:
                    group["lr"] = lr * scale

    def update(self, buffer: RolloutBuffer, iteration: int) -> dict[str, float]:
        """The critics' update (:meth:`update_critics`, if any), then one policy update per adapter of the scheduled agents.

        A batch that cannot rank replies (:meth:`informative`: all advantages zero, or equal rewards on episodes
        that all ended) says nothing about which replies are better: its advantages are only the critic's errors
        (or zero, while the entropy and KL terms still pull), and following them (Adam turns any non-zero gradient
        into a full-size step) is a random walk that lowers the policy's entropy. Such a batch trains the critic
        only, and is counted (``counters/constant_reward_batches``), as group-relative methods zero out groups
        without reward variance (``--update_on_constant_rewards true``: the policies are updated anyway, as in the
        original MARFT). Equal rewards in a batch whose episodes go on are not skipped: the bootstrapped values
        of the next states still rank the replies. LoRA dropout (``--lora_dropout``) is active here only."""
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
        """``(offset, total, equal)``: where this process's rows start in the union of all processes' rows (rank 0's
        first), how many rows the union has, and whether every process holds as many (one all-reduce;
        ``(0, n, True)`` with one process)."""
        n_samples = samples.prompt_ids.shape[0]
        counts = self.dist.sum_floats([n_samples if rank == self.dist.rank else 0 for rank in range(self.dist.world_size)])
        return int(sum(counts[: self.dist.rank])), int(sum(counts)), len(set(counts)) == 1

    def headers_of_chunks(self, minibatch: Minibatch):
        """The context a minibatch's chunks run in: each role header runs once for all of them (one forward and
        backward per minibatch, its graph held until the minibatch ends), or, in a minibatch the chunk budget cut,
        once per chunk, so that nothing of one chunk is held while the next runs and the budget bounds the update's
        memory (a critic of n agents would otherwise hold n headers' graphs: their tokens' activations)."""
        return nullcontext() if minibatch.budget_cut else self.team.headers.shared_over_chunks()

    def _minibatches(self, samples: TurnBatch, chunks_per_minibatch: int) -> list[Minibatch]:
        """One epoch: shuffled index minibatches, each split into ``chunks_per_minibatch`` chunks, with the loss
        units of each minibatch summed over processes.

        When every process holds as many rows, each shuffles its own and cuts them into ``num_mini_batch``
        minibatches (so every process runs as many, and seeded runs draw their random numbers as they always did).
        When the shares differ, the permutation is of the union of all processes' rows (drawn by rank 0,
        :meth:`Distributed.permutation`), cut into ``num_mini_batch`` minibatches of ``ceil(total / num_mini_batch)``
        rows; each process keeps its own rows of each, so every process runs as many minibatches (its own part
        possibly empty: no chunk) and the union of the processes' k-th minibatches is the single-process k-th
        minibatch on the union. With several chunks a
        minibatch's rows are sorted by length before it is cut into chunks: each chunk then holds rows of similar
        lengths and pays for less padding (the minibatch's gradient, their sum, is the same). The chunk token budget
        (:attr:`chunk_tokens`) then cuts chunks further; a minibatch it does not cut keeps the chunks (and row order)
        it has without a budget, so a run whose chunks all fit computes exactly what it computes without one."""
        n_samples = samples.prompt_ids.shape[0]
        offset, total, equal = self._row_share(samples)
        if equal:  # every process shuffles its own rows: as many minibatches everywhere, no broadcast
            minibatches = list(torch.randperm(n_samples).split(max(1, math.ceil(n_samples / self.config.num_mini_batch))))
        else:
            size = max(1, math.ceil(total / self.config.num_mini_batch))
            minibatches = [
                indices[(indices >= offset) & (indices < offset + n_samples)] - offset for indices in self.dist.permutation(total).split(size)
            ]
        units = self.dist.sum_floats([self.loss_units(samples, indices) for indices in minibatches])  # one all-reduce
        lengths = samples.prompt_mask.sum(-1)  # (n,) real prompt tokens (and reply tokens, where replies are trained)
        if samples.response_mask is not None:
            lengths = lengths + samples.response_mask.sum(-1)
        budget = self.chunk_tokens
        header_lengths = self._header_lengths(samples) if budget is not None else None
        return [
            Minibatch(chunks, max(u, 1.0), budget_cut)
            for indices, u in zip(minibatches, units)
            for chunks, budget_cut in [self._chunks(samples, indices[lengths[indices].argsort(stable=True)], indices,
                                                    chunks_per_minibatch, budget, header_lengths)]
        ]

    def _chunks(self, samples: TurnBatch, by_length: torch.Tensor, shuffled: torch.Tensor, chunks_per_minibatch: int,
                budget: int | None, header_lengths: torch.Tensor | None) -> tuple[list[torch.Tensor], bool]:
        """``(chunks, budget_cut)``: one minibatch's rows (``by_length``: sorted by length; ``shuffled``: as drawn) as
        gradient-accumulation chunks under ``budget`` (see :meth:`_minibatches`)."""
        chunks = [chunk for chunk in (by_length if chunks_per_minibatch > 1 else shuffled).chunk(chunks_per_minibatch) if len(chunk)]
        if budget is None:
            return chunks, False
        cut = [part for chunk in by_length.chunk(chunks_per_minibatch) if len(chunk)
               for part in self._token_budget_split(samples, chunk, budget, header_lengths)]
        if len(cut) > len(chunks):
            return cut, True
        if header_lengths is not None and len(chunks) > 1:  # headers shared over the chunks are held until the last
            rows, headers = zip(*(self._chunk_positions(samples, chunk, header_lengths) for chunk in chunks))
            if max(rows) + sum(headers) > budget:
                return chunks, True  # each chunk runs its own headers instead
        return chunks, False

    @staticmethod
    def _chunk_positions(samples: TurnBatch, chunk: torch.Tensor, header_lengths: torch.Tensor) -> tuple[int, int]:
        """``(rows, headers)``: the positions ``chunk``'s forward runs behind its shared role headers, and those of
        its header forward (:func:`forward_positions`)."""
        header = header_lengths[chunk]
        rest = samples.prompt_mask[chunk].sum(-1) - header
        reply = samples.response_mask[chunk].sum(-1).max() if samples.response_mask is not None else 0
        return forward_positions(len(chunk), int(header.max()), int(rest.max()), int(reply), len(samples.agent[chunk].unique()))

    def _header_lengths(self, samples: TurnBatch) -> torch.Tensor | None:
        """``(n,)`` each row's role-header tokens when the forward shares the headers (rows of several agents are
        then laid out as ``[longest header][longest rest]``), else None."""
        headers = self.team.headers
        if samples.agent is None or not headers.sharable:
            return None
        lengths = torch.tensor([len(ids) for ids in headers.header_ids])  # (n_agents,)
        return lengths[samples.agent.long()]

    @staticmethod
    def _token_budget_split(
        samples: TurnBatch, chunk: torch.Tensor, budget: int, header_lengths: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """Cut ``chunk`` (row indices, in order) into consecutive parts whose forward positions stay within
        ``budget``; a row longer than the budget on its own is a part by itself. A part's forward runs
        ``rows x (longest prompt + longest reply)`` positions as :meth:`TurnBatch.trimmed` leaves it, or, with
        ``header_lengths (n,)`` (rows behind shared role headers, ``samples.agent`` set), ``rows x (longest rest
        after its header + longest reply)`` for the rows plus ``agents x longest header`` for the header forward: a
        header runs once for all its rows, so its columns are not counted in every row (they would make the budget
        hold fewer real positions for an agent with a long header than for one whose conversation is long, and the
        peak depend on which agent's chunk runs). What a row keeps of the header it attends to, its keys and values,
        is a small part of a position and not counted. The parts' losses keep their weights (each part's units over
        the minibatch's), so the minibatch's gradient is the same."""
        prompt = samples.prompt_mask[chunk].sum(-1).tolist()  # (n,) real prompt tokens per row
        reply = samples.response_mask[chunk].sum(-1).tolist() if samples.response_mask is not None else [0] * len(prompt)
        shared = header_lengths is not None
        header = header_lengths[chunk].tolist() if shared else [0] * len(prompt)
        agent = samples.agent[chunk].tolist() if shared else [0] * len(prompt)

        parts, start, widest, agents = [], 0, (0, 0, 0), set()  # widest: longest header, rest after it, reply
        for i, row in enumerate(zip(header, (p - h for p, h in zip(prompt, header)), reply)):
            wider = tuple(max(a, b) for a, b in zip(widest, row))
            more = agents | {agent[i]}
            if i > start and sum(forward_positions(i - start + 1, *wider, len(more))) > budget:
                parts.append(chunk[start:i])
                start, wider, more = i, row, {agent[i]}
            widest, agents = wider, more
        parts.append(chunk[start:])
        return parts

    def _skip_update(self, name: str) -> dict[str, float]:
        """Count and log an update of ``name`` (an adapter or critic) skipped because no process has a row of it
        (e.g. an agent the orchestrator never called): no optimizer step, so nothing of it moves."""
        key = f"skipped_updates/{name}"
        self.counters[key] = self.counters.get(key, 0) + 1
        if self.dist.is_main:
            logger.info("iteration %d, %s: no turns in this batch on any process, update skipped (%d so far)", self.iteration + 1, name, self.counters[key])
        return {}

    def _step(self, optimizer, params, loss_ok: bool, name: str) -> float:
        """Clip and apply the accumulated gradient of optimizer ``name``; skip (and count) a non-finite one.
        With several processes the gradients are summed over them first, and a non-finite loss on any
        process skips the step on all (so the weights stay identical).

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
                self.iteration + 1, name, "loss" if not loss_ok else "gradient",
                self.consecutive_skips[name], self.counters["skipped_minibatches"],
            )
            limit = self.config.max_consecutive_skips
            if limit and self.consecutive_skips[name] >= limit:
                raise TrainingStopped(
                    f"iteration {self.iteration + 1}: {name} skipped {limit} minibatches in a row for non-finite "
                    f"losses or gradients (NaN/inf in logits, log-probs, values, advantages or losses; "
                    f"--max_consecutive_skips {limit})."
                )
            return float("nan")
        self.consecutive_skips[name] = 0
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.team.bank.mark_changed(name)  # an engine serving the adapter takes it again
        return float(grad_norm)

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
        cfg = self.config
        if cfg.target_entropy is None:
            return
        total, count = self.dist.sum_floats([sum(entropies), len(entropies)])
        if not count:
            return
        step = cfg.entropy_coef_step if total / count < cfg.target_entropy else -cfg.entropy_coef_step
        self.entropy_coefs[adapter] = max(0.0, self.entropy_coefs[adapter] + step)

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
