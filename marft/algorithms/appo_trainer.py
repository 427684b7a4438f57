"""MARFT-A: action-level multi-agent PPO with a centralized critic.

An agent's whole reply is one action; its log-prob is the (normalised) sum of its token log-probs (the loop and
the policy loss: :class:`~marft.algorithms.ppo.PPOTrainer`). This trainer adds the critic: one shared adapter and
value head over every agent's turns (or one per agent, ``--critic_mode per_agent``), its value loss and optimizer,
and GAE along the agent chain. Each adapter's optimizer holds exactly that adapter's parameters, and
``agent_iteration_interval`` trains one agent at a time.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from marft.agents.critic import CRITIC_ADAPTER
from marft.agents.team import AgentTeam
from marft.algorithms.advantages import buffer_credits, chain_rewards, fill_action_advantages, fill_own_turn_advantages
from marft.algorithms.losses import clipped_value_loss
from marft.algorithms.ppo import PPOTrainer, _nanmean
from marft.algorithms.steps import adamw
from marft.config import AlgoConfig
from marft.distributed import SINGLE, Distributed
from marft.runner.shared.buffer import RolloutBuffer
from marft.types import TurnBatch


class APPOTrainer(PPOTrainer):
    """PPO with a critic (MARFT-A): the critics update before the policies on each batch."""

    uses_critic = True

    def __init__(self, team: AgentTeam, config: AlgoConfig, steps_per_iteration: int, dist: Distributed = SINGLE):
        super().__init__(team, config, steps_per_iteration, dist)
        self.critic_optimizers = {
            critic: adamw(team.critic.trainable_parameters(critic), config.critic_lr)
            for critic in team.critic_adapters
        }
        """Per critic adapter (one shared, or one per agent with ``--critic_mode per_agent``), its optimizer."""
        self.consecutive_skips.update({critic: 0 for critic in self.critic_optimizers})
        self.kept_values: dict[str, tuple[float, list[tuple[torch.Tensor, torch.Tensor]]]] = {}
        """Per critic, the loss units of all its turns and, per agent, its rows and their values (in their graph), from
        :meth:`value_turns`, for this iteration's first critic step."""

    @property
    def critic_optimizer(self):
        """The shared critic's optimizer (None with per-agent critics)."""
        return self.critic_optimizers.get(CRITIC_ADAPTER)

    def can_value_in_update(self, turns: int, turn_positions: int) -> bool:
        """Whether :meth:`value_turns` is exact and holds no more memory than the update may (``--values_in_update``):
        one minibatch per epoch (the first epoch's forward covers every turn before any critic step), no LoRA
        dropout (the rollout's values have none), one process, and ``turns`` (all a rollout can hold) of
        ``turn_positions`` each (prompt, and reply at the token level) within one chunk's budget
        (:attr:`chunk_tokens`; none set: no)."""
        cfg, budget = self.config, self.chunk_tokens
        return (cfg.values_in_update and cfg.num_mini_batch == 1 and self.team.config.lora_dropout == 0
                and not self.dist.enabled and budget is not None and turns * turn_positions <= budget)

    def compute_advantages(self, buffer: RolloutBuffer) -> None:
        """The turns' values first, where the update gives them (:attr:`values_in_update`), then the advantages
        (:meth:`estimate_advantages`)."""
        if self.values_in_update:
            self.value_turns(buffer)
        self.estimate_advantages(buffer)

    def value_turns(self, buffer: RolloutBuffer) -> None:
        """Each critic runs the first update epoch's forward now, with its gradient, over all the turns it values, one
        agent's turns at a time (so each role header runs once, as in the update). The values go into the buffer
        (detached) for the advantages; the forwards are kept, graphs and all, for the first epoch's value loss
        (:meth:`update_critic`). Before any critic step the update's values are the rollout's, so the rollout need
        not run the critic on its turns at all."""
        self.kept_values = {}
        try:
            with self.team.bank.lora_dropout_active():  # the update's forward: gradient checkpointing as the budget counts it
                for critic in self.critic_optimizers:
                    self._value_turns_of(buffer, critic)
        finally:
            self.team.set_active(None)

    def _value_turns_of(self, buffer: RolloutBuffer, critic: str) -> None:
        """:meth:`value_turns` of one critic: its forward, values stored, forward kept in :attr:`kept_values`."""
        agents = self.team.critic.agents_of(critic)
        samples = buffer.critic_samples(self.token_level, agents)
        if len(samples) == 0:
            return
        self.team.set_active(critic, trainable=True)
        (minibatch,) = self._minibatches(samples, 1)  # the first epoch's draw: later draws stay those of the update without this
        chunks = [rows for rows in ((samples.agent == agent).nonzero().squeeze(1) for agent in agents) if len(rows)]
        kept = [(rows, self.critic_values(samples.rows(rows).trimmed(self.team.device), critic)) for rows in chunks]
        values = torch.zeros(samples.response_mask.shape if self.token_level else (len(samples),))  # (B, L) or (B,)
        for rows, chunk_values in kept:
            values[(rows, slice(0, chunk_values.shape[1])) if self.token_level else rows] = chunk_values.detach().float().cpu()
        buffer.set_critic_values(values, self.token_level, agents)
        self.kept_values[critic] = (minibatch.units, kept)

    def estimate_advantages(self, buffer: RolloutBuffer) -> None:
        """Action level: GAE along the agent chain, one advantage per reply (``own_turns``: along each agent's own
        chain of turns, for self-play)."""
        cfg = self.config
        if cfg.credit_assignment == "own_turns":
            return fill_own_turn_advantages(buffer, cfg.gamma, cfg.gae_lambda)
        fill_action_advantages(buffer, cfg.gamma, cfg.gae_lambda, self.chain_rewards(buffer))

    def chain_rewards(self, buffer: RolloutBuffer) -> torch.Tensor | None:
        """The rewards the agent chain's GAE runs on (``--credit_assignment``): the env's as they are (``env``),
        or each turn's credit (:func:`turn_credits`) telescoped so that a turn's return within its team step
        is exactly its credit (:func:`chain_rewards`). None: the buffer's own rewards."""
        cfg = self.config
        if cfg.credit_assignment == "env":
            return None
        credits = buffer_credits(buffer, cfg.credit_assignment, cfg.credit_discount)
        return chain_rewards(credits, cfg.gamma, played=buffer.played, layers=buffer.layer)

    def critic_values(self, mb: TurnBatch, critic: str | None = None) -> torch.Tensor:
        """``critic``'s values (default: the shared one's) of the minibatch's prompts, (B,)."""
        return self.team.critic.values(mb.prompt_ids, mb.prompt_mask, agent=mb.agent, critic=critic)

    def value_loss(self, mb: TurnBatch, critic: str | None = None, values: torch.Tensor | None = None) -> torch.Tensor:
        """Clipped value loss of the prompt ``values`` (default: :meth:`critic_values` under ``critic``)."""
        cfg = self.config
        values = self.critic_values(mb, critic) if values is None else values  # (B,)
        return clipped_value_loss(values, mb.values, mb.returns, cfg.value_clip_param, cfg.use_huber_loss, cfg.huber_delta)

    def update_critics(self, buffer: RolloutBuffer) -> dict[str, float]:
        """The shared critic on every turn, or each agent's critic on its own turns (:meth:`update_critic`); the steps
        on :meth:`value_turns`' kept forwards come first, so no critic's kept graph lives through another's epochs."""
        samples = {critic: buffer.critic_samples(self.token_level, self.team.critic.agents_of(critic)) for critic in self.critic_optimizers}
        stats = {critic: defaultdict(list) for critic in samples}
        first_done = set(self.kept_values)
        for critic, kept in self.kept_values.items():  # every kept forward's step first: none is held over another critic's epochs
            self.team.set_active(critic, trainable=True)
            units, chunks = kept
            loss_ok = self._critic_backward(samples[critic], critic, chunks, units, stats[critic])
            stats[critic]["grad_norm"].append(self._critic_step(critic, loss_ok))
        self.kept_values = {}
        metrics = {}
        for critic in samples:
            metrics.update(self.update_critic(samples[critic], critic, stats[critic], first_epoch_done=critic in first_done))
        return metrics

    def update_critic(self, samples: TurnBatch, critic: str = CRITIC_ADAPTER, stats: dict | None = None, first_epoch_done: bool = False) -> dict[str, float]:
        """Value-loss epochs of ``critic`` over the turns it values (the centralized critic: every agent's).

        A critic of n agents has n times as many turns as one agent; its minibatches are cut into n times as
        many chunks, so a forward/backward chunk holds as many turns as an agent's and peak memory does not
        grow with the team size. Metrics are tagged ``critic/...`` (shared) or ``critic_<role>/...``.
        ``first_epoch_done``: the first epoch's step already ran on :meth:`value_turns`' forward (its figures in ``stats``)."""
        cfg, team = self.config, self.team
        if self._row_share(samples)[1] == 0:
            return self._skip_update(critic)
        team.set_active(critic, trainable=True)
        stats = defaultdict(list) if stats is None else stats
        for _ in range(int(first_epoch_done), cfg.ppo_epoch):
            for minibatch in self._minibatches(samples, cfg.gradient_cp_steps * len(team.critic.agents_of(critic))):
                with self.headers_of_chunks(minibatch):  # left (the headers' backward) before the step
                    loss_ok = self._critic_backward(samples, critic, [(chunk, None) for chunk in minibatch.chunks], minibatch.units, stats)
                stats["grad_norm"].append(self._critic_step(critic, loss_ok))
        if self.token_level:
            real = samples.response_mask.bool()
            returns, values = samples.token_returns[real], samples.token_values[real]
        else:
            returns, values = samples.returns, samples.values
        explained = self._explained_variance(returns, values)
        return {
            f"{critic}/value_loss": _nanmean(stats["value_loss"]),
            f"{critic}/grad_norm": _nanmean(stats["grad_norm"]),
            f"{critic}/explained_variance": float(explained),
        }

    def _critic_backward(self, samples: TurnBatch, critic: str, chunks, units: float, stats) -> bool:
        """The backward of one minibatch of ``samples`` under ``critic`` (active and trainable): per chunk ``(rows,
        values)`` its value loss, weighted by its share of the minibatch's loss ``units`` (``values``: the kept forward of
        :meth:`value_turns`, or None to run the critic); the losses go to ``stats``. False: a loss was not finite
        (the rest is not run, and the step is to be skipped)."""
        for rows, values in chunks:
            value_loss = self.value_loss(samples.rows(rows).trimmed(self.team.device), critic, values)
            loss = self.config.value_loss_coef * value_loss * (self.loss_units(samples, rows) / units)
            if not torch.isfinite(loss):
                return False
            loss.backward()
            stats["value_loss"].append(value_loss.item())
        return True

    def _critic_step(self, critic: str, loss_ok: bool) -> float:
        """``critic``'s optimizer step on its accumulated gradient (skipped unless ``loss_ok``); returns the gradient norm."""
        return self._step(self.critic_optimizers[critic], self.team.critic.trainable_parameters(critic), loss_ok, critic)

    def _explained_variance(self, returns: torch.Tensor, values: torch.Tensor) -> float:
        """``1 - var(returns - values) / var(returns)`` over all processes' entries (1-D each)."""
        if not self.dist.enabled:
            return float(1 - (returns - values).var() / returns.var().clamp(min=1e-8))
        errors, spread = self.dist.mean_std(returns - values), self.dist.mean_std(returns)
        if errors is None:
            return float("nan")
        return float(1 - errors[1] ** 2 / (spread[1] ** 2).clamp(min=1e-8))

    def state_dict(self) -> dict:
        state = super().state_dict()
        if self.critic_optimizer is not None:  # the shared critic: the key every earlier checkpoint has
            state["critic_optimizer"] = self.critic_optimizer.state_dict()
        elif self.critic_optimizers:
            state["critic_optimizers"] = {c: opt.state_dict() for c, opt in self.critic_optimizers.items()}
        return state

    def load_optimizer_states(self, state: dict) -> None:
        """The policies' and the critics' optimizer states; learning rates come from the current config (so
        ``--lr`` / ``--critic_lr`` may change on resume)."""
        super().load_optimizer_states(state)
        saved = {CRITIC_ADAPTER: state["critic_optimizer"]} if "critic_optimizer" in state else state.get("critic_optimizers", {})
        for critic, opt in self.critic_optimizers.items():
            opt.load_state_dict(saved[critic])
            for group in opt.param_groups:
                group["lr"] = self.config.critic_lr
