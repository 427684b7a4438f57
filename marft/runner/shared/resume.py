"""Continuing a run from a checkpoint: check that it fits this run, load weights, optimizers, trainer state and
RNG, put every environment back into its episode, and say which flags changed. A warm start (``scripts/sft.py``'s
checkpoint: no environment states, iteration 0) starts RL instead of resuming it."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from marft.faults import CheckpointError
from marft.runner.shared.checkpoint import (
    config_changes,
    find_checkpoint,
    load_checkpoint,
    read_checkpoint_meta,
    resume_incompatibilities,
    set_rng_state,
)

logger = logging.getLogger(__name__)


def restore(runner, path: str | Path) -> None:
    """Continue ``runner`` (:class:`~marft.runner.shared.runner.Runner`) from a checkpoint (or a run directory's
    latest): check the config fits, load everything, put every env back into its episode, and log the flags that
    changed.

    Raises:
        CheckpointError: the checkpoint does not fit this run (other roles, an incompatible flag, another number of
            processes).
    """
    dist, config = runner.dist, runner.config
    path = find_checkpoint(path)
    saved_config, saved_state = read_checkpoint_meta(path)
    problems = resume_incompatibilities(saved_config, saved_state.get("roles"), config, runner.roles)
    if problems:
        raise CheckpointError(f"cannot resume from {path}: " + "; ".join(problems))
    warm_start = "envs" not in saved_state and int(saved_state.get("iteration", 0)) == 0  # scripts/sft.py's checkpoint: RL starts here
    if runner.collector.pool is not None and not warm_start:
        runner.collector.pool.check_resume(saved_config, path)
    saved_processes = int(saved_state.get("world_size", 1))
    if saved_processes != dist.world_size:
        raise CheckpointError(
            f"cannot resume from {path}: it was saved by a run of {saved_processes} process(es) and this run has "
            f"{dist.world_size}; each process's RNG and environment states are in the checkpoint, so resume "
            f"with {saved_processes} (e.g. torchrun --nproc_per_node {saved_processes}, or accelerate launch --num_processes {saved_processes})"
        )
    state = load_checkpoint(path, runner.team, runner.trainer)
    if dist.enabled:
        set_rng_state(state["rank_rng"][dist.rank])
    runner.start_iteration = int(state["iteration"])
    runner.env_steps = int(state["env_steps"])
    runner.best.load_state_dict(state.get("best_tracker", {}))
    # The schedule and the iteration count go on from the env steps collected, at this run's rollout size
    # (--n_rollout_threads or --episode_length may have changed).
    runner.trainer.schedule_origin = (runner.start_iteration, runner.env_steps)
    runner.n_iterations = config.iterations_after(runner.start_iteration, runner.env_steps)
    runner.trainer.total_iterations = runner.n_iterations
    runner.last_checkpoint = path
    runner.starts_rl = warm_start
    if dist.is_main:
        log_changed_flags(config_changes(saved_config, config), warm_start)
    restore_envs(runner, state, saved_config.get("env", {}).get("env_name") == config.env.env_name)
    # Later TensorBoard events replace those a crashed run logged after this checkpoint.
    runner.log.reopen(purge_step=runner.start_iteration + 1)
    logger.info("resumed from %s at iteration %d", path, runner.start_iteration)


def log_changed_flags(changes: dict, warm_start: bool) -> None:
    """Say which flags differ from the checkpoint's config (``changes``: name → ``(old, new)``)."""
    for name, (old, new) in changes.items():
        if name == "kl_coef" and old is None:  # the algorithm's default: build_runner said it
            continue
        if name == "kl_reference" and old == "auto":
            logger.info("--kl_reference auto is %r: training starts from a checkpoint", new)
        elif warm_start:
            logger.info("starting from the warm start with --%s %r (%r in its config)", name, new, old)
        else:
            logger.info("resuming with --%s changed: %r in the checkpoint, %r now", name, old, new)


def restore_envs(runner, state: dict, same_envs: bool) -> None:
    """Put this process's share of the checkpoint's environments back into their episodes, with their running
    returns, when the checkpoint holds them for as many envs of the same env; fresh episodes otherwise (said)."""
    E, dist = runner.envs.n_envs, runner.dist  # this process's share
    if "envs" in state and same_envs and len(state["envs"]) == E * dist.world_size:
        share = slice(dist.rank * E, (dist.rank + 1) * E)
        runner.collector.obs = runner.envs.load_state_dict(state["envs"][share])
        runner.collector.episode_returns = np.asarray(state["episode_returns"][share], dtype=np.float64)
    elif "envs" not in state:
        logger.info("the checkpoint holds no environment states (a warm start): training starts on fresh episodes")
    else:
        logger.warning("environment states not restored (--env_name or the number of envs changed): fresh episodes")
