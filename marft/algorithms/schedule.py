"""What changes over a run's iterations: which agents train (the agent-by-agent schedule), the learning rates'
factor (``--lr_schedule``, warm-up, rollbacks) and an adapter's entropy bonus weight under ``--target_entropy``.
Pure functions of the config and the run's counts; the trainer (:class:`~marft.algorithms.ppo.PPOTrainer`) keeps
the counts."""

from __future__ import annotations

from marft.config import AlgoConfig


def scheduled_agents(config: AlgoConfig, n_agents: int, profile, env_steps: int) -> list[int]:
    """Agents whose policy is updated once ``env_steps`` environment steps have been collected, as the original
    MARFT decides it: none before ``warmup_steps``, then all ``n_agents`` agents (``profile``: their roles, in order), or
    agent ``(env_steps // agent_iteration_interval) % n_agents`` alone (the round-robin includes an orchestrator,
    unless ``--train_orchestrator false`` leaves it out; ``--frozen_roles`` are never trained)."""
    if env_steps < config.warmup_steps:
        return []
    frozen = set(config.frozen)
    trainable = list(range(n_agents))
    if frozen:
        trainable = [a for a in trainable if profile[a].role not in frozen]
    if not config.train_orchestrator:
        trainable = [a for a in trainable if not profile[a].orchestrator]
    interval = config.agent_iteration_interval
    if interval == 0:
        return trainable
    return [trainable[(env_steps // interval) % len(trainable)]]


def learning_rate_scale(config: AlgoConfig, iteration: int, total_iterations: int, lr_factor: float) -> float:
    """The factor on ``--lr`` and ``--critic_lr`` at ``iteration`` (0-based) under ``--lr_schedule``: 1 for
    ``constant``; ``1 - iteration / total_iterations`` for ``linear`` (1 at the first iteration, ``1 / total``
    at the last; ``total_iterations`` 0: unknown, constant); times ``(iteration + 1) / lr_warmup_iterations``
    during ``--lr_warmup_iterations``; times ``lr_factor`` (lowered by each rollback to the best checkpoint)."""
    warmup = config.lr_warmup_iterations
    ramp = lr_factor * (min(1.0, (iteration + 1) / warmup) if warmup else 1.0)
    if config.lr_schedule == "constant" or not total_iterations:
        return ramp
    return ramp * max(0.0, 1.0 - iteration / total_iterations)


def next_entropy_coef(config: AlgoConfig, coef: float, mean_entropy: float) -> float:
    """With ``--target_entropy``: the entropy bonus weight ``coef`` moved one ``--entropy_coef_step`` towards keeping
    the entropy at the target, from the update's ``mean_entropy``: up when it fell below the target, down (never
    below 0) when above. A policy whose entropy collapses before it found the optimum gets a growing bonus until
    it explores again; one above the target gets none."""
    step = config.entropy_coef_step if mean_entropy < config.target_entropy else -config.entropy_coef_step
    return max(0.0, coef + step)
