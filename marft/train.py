"""Entry point: ``python -m marft.train [flags]`` (what ``scripts/train_math.sh`` runs).

All inputs are validated before the model is loaded, so a wrong path or agent
count costs a second, not a model load.
"""

from __future__ import annotations

import logging
import os
import random
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from marft.config import TrainConfig, parse_config

logger = logging.getLogger("marft")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def default_run_dir(config: TrainConfig) -> Path:
    """``--output_dir``; else, when resuming, the run directory of the checkpoint; else a new timestamped one."""
    if config.runner.output_dir:
        return Path(config.runner.output_dir)
    if config.runner.load_path:
        from marft.runner.shared.checkpoint import find_checkpoint

        checkpoint = find_checkpoint(config.runner.load_path)
        if checkpoint.parent.name == "checkpoints":
            return checkpoint.parent.parent
    return Path("results") / config.runner.experiment_name / time.strftime("%Y%m%d-%H%M%S")


def build_env_factories(config: TrainConfig, profile):
    """``(make_train_env, make_eval_env)``; loads the datasets once so bad data fails early."""
    from marft.envs import make
    from marft.envs.math import load_problems

    ec = config.env
    kwargs = dict(profile=profile, horizon=ec.horizon)
    if ec.env_name != "math":
        return (lambda: make(ec.env_name, split="train", **kwargs)), (lambda: make(ec.env_name, split="test", **kwargs))
    train_problems = load_problems(ec.dataset_path, split="train")
    eval_source = ec.eval_dataset_path or ec.dataset_path
    eval_problems = load_problems(eval_source, split="test")
    return (
        lambda: make("math", problems=train_problems, **kwargs),
        lambda: make("math", problems=eval_problems, **kwargs),
    )


def validate(config: TrainConfig):
    """Check profile, model path, data and resume path; return ``(profile, make_train_env, make_eval_env)``."""
    from marft.agents.loading import check_model_path
    from marft.envs.profile import load_profile

    config.check()
    check_processes(config)
    profile = load_profile(config.model.profile_path, n_agents=config.model.n_agents)
    check_model_path(config.model.model_name_or_path)
    make_train_env, make_eval_env = build_env_factories(config, profile)
    if config.runner.load_path:
        check_work_left(config)
    return profile, make_train_env, make_eval_env


def check_processes(config: TrainConfig) -> None:
    """With P processes (``torchrun`` / ``accelerate launch``), each takes ``n_rollout_threads / P`` envs.

    Raises:
        ValueError: P does not divide ``--n_rollout_threads``, or ``--device`` names one GPU for all processes.
    """
    from marft.distributed import world_size_from_env

    processes, envs = world_size_from_env(), config.runner.n_rollout_threads
    if processes > 1 and envs % processes:
        raise ValueError(
            f"--n_rollout_threads {envs} cannot be split over {processes} processes: each process takes an equal share "
            f"of the environments, so use a multiple of {processes} (e.g. {processes * max(1, envs // processes)})"
        )
    if processes > 1 and config.model.device.startswith("cuda:"):
        raise ValueError(f"--device {config.model.device} would put all {processes} processes on one GPU: use --device cuda (each process takes its local GPU)")


def check_work_left(config: TrainConfig) -> None:
    """A resumed run must have iterations left to train: never a silent run of 0 steps.

    Raises:
        FileNotFoundError: ``--load_path`` holds no complete checkpoint.
        ValueError: the checkpoint already reached ``config.num_iterations``.
    """
    from marft.runner.shared.checkpoint import find_checkpoint, read_trainer_state

    checkpoint = find_checkpoint(config.runner.load_path)  # a steps_<N> folder, or a run directory's latest
    done, total = int(read_trainer_state(checkpoint)["iteration"]), config.num_iterations
    if done >= total:
        rc = config.runner
        per_iteration = rc.episode_length * rc.n_rollout_threads
        raise ValueError(
            f"{checkpoint} has trained {done} iterations, and --num_env_steps {rc.num_env_steps} means {total} in all: "
            f"nothing is left to train. Raise --num_env_steps (one iteration is {per_iteration} env steps; "
            f"e.g. --num_env_steps {(done + 1) * per_iteration} for one more iteration)"
        )


def build_runner(config: TrainConfig, validated=None):
    """The base model, agent team, trainer, training envs and :class:`Runner` that ``config`` describes.

    ``validated`` is the result of :func:`validate` when the caller already checked the inputs.
    """
    from marft.agents.loading import load_base_model
    from marft.agents.team import AgentTeam
    from marft.algorithms import make_trainer
    from marft.distributed import init_distributed
    from marft.envs.vector import TextVectorEnv
    from marft.runner.shared.runner import Runner

    profile, make_train_env, make_eval_env = validated or validate(config)
    dist = init_distributed(config.model.device, config.runner.dist_timeout_s)  # one process: no process group
    with dist.main_process_first():  # rank 0 builds and caches the embedded model before the others read it
        model, tokenizer = load_base_model(config.model)  # may build the embedded model first, which draws random numbers
    seed_everything(config.runner.seed)  # so seed after loading: a first run and a cached run start alike
    team = AgentTeam(model, tokenizer, profile, config.model)
    trainer = make_trainer(team, config.algo, steps_per_iteration=config.steps_per_iteration, dist=dist)
    if dist.enabled:
        dist.broadcast_parameters(team.critic_parameters() + [p for a in team.policy_adapters for p in team.adapter_parameters(a)])
        seed_everything(config.runner.seed + dist.rank)  # each process samples its own replies
    envs = TextVectorEnv([make_train_env] * (config.runner.n_rollout_threads // dist.world_size))
    run_dir = dist.broadcast_object(default_run_dir(config))  # rank 0's timestamp
    if dist.is_main:
        logger.info("run directory: %s", run_dir)
    return Runner(config, team, trainer, envs, make_eval_env, run_dir, dist=dist)


def train(config: TrainConfig, validated=None) -> dict:
    """Build everything from ``config`` (:func:`build_runner`) and run training; returns the run summary."""
    runner = build_runner(config, validated)
    start = time.perf_counter()
    summary = runner.run()
    summary["seconds"] = time.perf_counter() - start
    return summary


def main(argv: Optional[list[str]] = None) -> int:
    from marft.distributed import world_size_from_env

    rank = int(os.environ.get("RANK", "0")) if world_size_from_env() > 1 else 0
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,  # rank 0 tells the story; the others warn only
        format="%(asctime)s %(levelname)s %(name)s: %(message)s" if rank == 0 else f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    config, given = parse_config(argv)
    try:
        if config.runner.load_path:
            from marft.runner.shared.checkpoint import resume_config

            config = resume_config(config, given)  # flags not given come from the checkpoint
        validated = validate(config)
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from marft.faults import CheckpointError, TrainingStopped

    try:
        summary = train(config, validated)
    except (CheckpointError, TrainingStopped) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if rank != 0:
        return 0
    print(
        f"done in {summary['seconds']:.0f}s: accuracy {summary['accuracy_before']:.3f} -> {summary['accuracy_after']:.3f}; "
        f"run directory {summary['run_dir']}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
