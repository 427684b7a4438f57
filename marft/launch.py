"""Training a team, the library: validate every input before the model loads (:func:`validate`, so a wrong path
or agent count costs a second, not a model load), build the team, trainer, envs and runner (:func:`build_runner`),
and train (:func:`train`, ``marft.train``). The command line is :mod:`marft.cli.train` (``marft train``,
``scripts/train_math.sh``, and ``python -m marft.launch`` as before).
"""

from __future__ import annotations

import inspect
import logging
import random
import runpy
import time
from pathlib import Path

import numpy as np
import torch

from marft.agents.team import AgentTeam
from marft.agents.vllm_backend import check_vllm
from marft.algorithms import make_trainer, trainer_class
from marft.config import TrainConfig
from marft.distributed import Distributed, init_distributed, world_size_from_env
from marft.envs import resolve
from marft.envs.profile import load_profile
from marft.envs.vector import TextVectorEnv
from marft.envs.workflows import workflow_for
from marft.models.loading import check_model_path, load_base_model
from marft.runner.shared.checkpoint import find_checkpoint, read_checkpoint_meta, read_trainer_state
from marft.runner.shared.opponent import check_opponent
from marft.runner.shared.runner import Runner
from marft.validation import check_device, check_output_dir

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

        checkpoint = find_checkpoint(config.runner.load_path)
        if checkpoint.parent.name == "checkpoints":
            return checkpoint.parent.parent
    return Path("results") / config.runner.experiment_name / time.strftime("%Y%m%d-%H%M%S")


def _check_env_takes(env_class, argument: str, flag: str, env_name: str) -> None:
    """Refuse ``flag`` for an env class whose signature has no ``argument`` (nor ``**kwargs``): TextArena games' flags."""
    try:
        parameters = inspect.signature(env_class).parameters.values()
    except (TypeError, ValueError):  # a callable without a signature: let it take the argument or fail itself
        return
    if parameters and argument not in {p.name for p in parameters} and not any(p.kind is p.VAR_KEYWORD for p in parameters):
        raise ValueError(f"{flag} is for environments that take it (TextArena games, textarena:<game id>); --env_name {env_name} does not")


def build_env_factories(config: TrainConfig, profile, eval_split: str = "test"):
    """``(make_train_env, make_eval_env)``: every environment, the shipped ones included, is built as
    ``EnvClass(split="train"|"test", profile=<list of AgentSpec>, horizon=--horizon)``, plus ``dataset_path=`` when
    ``--dataset_path`` (or, for evaluation, ``--eval_dataset_path``) is given; ``--env_name`` may be a registered
    name, ``"package.module:Class"`` or an installed entry point (:func:`marft.envs.resolve`). ``eval_split`` names the
    held-out split (e.g. ``test500``: a dataset folder's ``test500.jsonl``)."""

    ec = config.env
    kwargs = dict(profile=profile, horizon=ec.horizon)
    workflow = workflow_for(profile, ec.workflow, ec.max_turns)  # a --workflow the profile does not describe fails here
    # (a workflow holds no state of its own, each env its StepTurns: one instance serves every env)

    def playing(build):
        """``build``, then every team step of the env played by the profile's workflow."""
        def make_env():
            env = build()
            env.unwrapped.set_workflow(workflow)
            return env
        return make_env

    env_class = resolve(ec.env_name)  # an unknown name fails here, before any model loads
    if ec.invalid_move_penalty:
        _check_env_takes(env_class, "invalid_move_penalty", "--invalid_move_penalty", ec.env_name)
        kwargs["invalid_move_penalty"] = ec.invalid_move_penalty
    if ec.game_view != "since_move":
        _check_env_takes(env_class, "view", "--game_view", ec.env_name)
        kwargs["view"] = ec.game_view
    train_data = {} if ec.dataset_path is None else {"dataset_path": ec.dataset_path}
    eval_source = ec.eval_dataset_path or ec.dataset_path
    eval_data = {} if eval_source is None else {"dataset_path": eval_source}
    return playing(lambda: env_class(split="train", **train_data, **kwargs)), playing(lambda: env_class(split=eval_split, **eval_data, **kwargs))


def validate(config: TrainConfig):
    """Check flags across sections, device, output folder, profile, model path, data and resume path; return
    ``(profile, make_train_env, make_eval_env)``. (Each flag alone was checked when the config was built:
    :mod:`marft.validation`.)"""

    config.check()
    check_device(config.model.device)
    check_output_dir(config.runner.output_dir)
    check_fresh_run_dir(config)
    check_processes(config)
    check_generation_backend(config)
    profile = load_profile(config.model.profile_path, n_agents=config.model.n_agents)
    check_model_path(config.model.model_name_or_path)
    make_train_env, make_eval_env = build_env_factories(config, profile)
    for split, make_env in (("train", make_train_env), ("test", make_eval_env)):
        probe_env(make_env, profile, f"--env_name {config.env.env_name} ({split})")
    train_env = make_train_env().unwrapped  # built once for the checks below
    if trainer_class(config.algo.algorithm_name).group_relative and not train_env.num_tasks:
        raise ValueError(
            f"--algorithm_name {config.algo.algorithm_name} resets each group of envs on one task, by reset(options={{'task_index': i}}); "
            f"--env_name {config.env.env_name} sets no num_tasks (see docs/environments.md, 'Tasks by index')"
        )
    competitive = getattr(train_env, "competitive", False)
    check_competitive(config, train_env)
    opponent_role = check_opponent(config, [spec.role for spec in profile], self_play=competitive)
    if opponent_role is not None and opponent_role not in config.algo.frozen:  # recorded in the run's config: a resume keeps it
        config.algo.frozen_roles = ",".join([*config.algo.frozen, opponent_role])
    check_frozen_roles(config, profile, competitive=competitive)
    if config.runner.load_path:
        check_work_left(config)
    return profile, make_train_env, make_eval_env


def check_generation_backend(config: TrainConfig) -> None:
    """``--generation_backend vllm`` needs vLLM importable and a LoRA rank vLLM serves: said before anything loads."""
    if config.model.generation_backend == "vllm":

        check_vllm(config.model)


def check_frozen_roles(config: TrainConfig, profile, competitive: bool = False) -> None:
    """``--frozen_roles`` names roles of the team, leaves one to train, and does not freeze a shared adapter; in a
    self-play or team game (``competitive``) not the profile's first role, whose games (its side winning) the run's
    accuracy, ``--on_collapse`` and ``checkpoints/best`` follow: they would follow the fixed side.

    Raises:
        ValueError: an unknown role, every role frozen, the first role of a competitive game frozen, or
            ``--shared_lora`` (one adapter for all)."""
    frozen = config.algo.frozen
    if not frozen:
        return
    roles = [spec.role for spec in profile]
    unknown = [role for role in frozen if role not in roles]
    if unknown:
        raise ValueError(f"--frozen_roles names {unknown}, not roles of the team {roles}")
    if set(frozen) >= set(roles):
        raise ValueError(f"--frozen_roles freezes every role of the team {roles}: nothing would train")
    if competitive and roles[0] in frozen:
        raise ValueError(f"--frozen_roles freezes {roles[0]!r}, the profile's first role: in a self-play or team game the run's accuracy, "
                         f"--on_collapse and checkpoints/best follow the first role's games, so they would follow the fixed side; "
                         f"put a role that trains first in the profile (a profile of your own: the same agents, a trained role first)")
    if config.model.shared_lora:
        raise ValueError("--frozen_roles with --shared_lora: the roles share one adapter, so none can stay as it is")


def check_competitive(config: TrainConfig, env) -> None:
    """A competitive env (self-play: each agent paid its own side of a zero-sum game) trains only with each agent's
    own reward: GRPO with ``--credit_assignment per_step``, or MARFT-A or MARFT-T (APPO, TPPO) with ``--credit_assignment own_turns``
    (each agent's own chain of turns and critic values). A critic of the team reward (the agents' mean: 0 in a
    zero-sum game), the agent chain across both seats, or any other credit mode would teach the agents nothing, or
    against their own interest.

    Raises:
        ValueError: another trainer or credit mode, naming the flags that work."""

    if not getattr(env, "competitive", False):
        return
    algo = config.algo
    if trainer_class(algo.algorithm_name).group_relative and algo.credit_assignment == "per_step":
        return
    if algo.algorithm_name in ("APPO", "TPPO") and algo.credit_assignment == "own_turns":
        return
    raise ValueError(f"--env_name {config.env.env_name} with a {len(env.roles)}-agent profile is self-play (each agent is "
                     "paid its own side of the game): train it with --algorithm_name APPO (or TPPO) --credit_assignment own_turns "
                     "(--critic_mode per_agent: a critic per seat) or --algorithm_name GRPO --credit_assignment per_step "
                     f"(not {algo.algorithm_name} with --credit_assignment {algo.credit_assignment})")


def check_fresh_run_dir(config: TrainConfig) -> None:
    """A run that does not resume must not write into a folder holding another run's checkpoints (their
    ``steps_<N>`` would mix with its own, and ``--load_path <run dir>`` would pick the newest of either).

    Raises:
        ValueError: ``--output_dir`` holds checkpoints and ``--load_path`` does not point into it."""
    if not config.runner.output_dir:
        return
    checkpoints = Path(config.runner.output_dir) / "checkpoints"
    if not (checkpoints.is_dir() and any(p.name.startswith("steps_") for p in checkpoints.iterdir())):
        return
    load = config.runner.load_path
    if load and Path(config.runner.output_dir).resolve() in (Path(load).resolve(), *Path(load).resolve().parents):
        return  # it continues a run of this folder (its run directory or one of its checkpoints)
    raise ValueError(f"--output_dir {config.runner.output_dir} already holds a run's checkpoints ({checkpoints}): continue it with "
                     f"--load_path {config.runner.output_dir}, or give this run a new --output_dir")


def probe_env(make_env, profile, label: str) -> None:
    """Build one environment, reset it and take one team step of empty replies, so that an env that cannot be
    built, has the wrong team or returns the wrong number of rewards fails now, in one line, before the model
    loads and before a run directory exists.

    Raises:
        ValueError: what went wrong, naming the environment.
    """
    roles = [spec.role for spec in profile]
    try:
        env = make_env()
        first = env.reset(seed=0)
        if not (isinstance(first, tuple) and len(first) == 2):
            raise ValueError(f"reset returned {type(first).__name__}, not (observation, info): a CustomEnv's reset ends "
                             "with return self.start(state)")
        if list(env.unwrapped.roles) != roles:
            raise ValueError(f"its roles are {list(env.unwrapped.roles)}, the profile's are {roles}")
        _, rewards, *_ = env.step(("",) * len(roles))
        if len(rewards) != len(roles):
            raise ValueError(f"step returned {len(rewards)} rewards for {len(roles)} agents")
        env.close()
    except ValueError as error:
        raise ValueError(f"{label}: {error}") from error
    except Exception as error:  # noqa: BLE001 - any failure of user code, reported in one line
        raise ValueError(f"{label} failed its first reset/step: {type(error).__name__}: {error}") from error


def check_processes(config: TrainConfig) -> None:
    """With P processes (``torchrun`` / ``accelerate launch``), each takes ``n_rollout_threads / P`` envs.

    Raises:
        ValueError: P does not divide ``--n_rollout_threads``, or ``--device`` names one GPU for all processes.
    """

    processes, envs = world_size_from_env(), config.runner.n_rollout_threads
    if processes > 1 and envs % processes:
        raise ValueError(
            f"--n_rollout_threads {envs} cannot be split over {processes} processes: each process takes an equal share "
            f"of the environments, so use a multiple of {processes} (e.g. {processes * max(1, envs // processes)})"
        )
    if processes > 1 and config.algo.algorithm_name == "GRPO" and (envs // processes) % config.algo.group_size:
        raise ValueError(
            f"--group_size {config.algo.group_size} must divide each process's {envs // processes} envs "
            f"(--n_rollout_threads {envs} over {processes} processes): a group's episodes stay on one process"
        )
    if processes > 1 and config.model.device.startswith("cuda:"):
        raise ValueError(f"--device {config.model.device} would put all {processes} processes on one GPU: use --device cuda (each process takes its local GPU)")


def check_work_left(config: TrainConfig) -> None:
    """A resumed run must have iterations left to train: never a silent run of 0 steps.

    Raises:
        FileNotFoundError: ``--load_path`` holds no complete checkpoint.
        ValueError: the checkpoint already collected ``--num_env_steps`` (less than one iteration is left).
    """

    checkpoint = find_checkpoint(config.runner.load_path)  # a steps_<N> folder, or a run directory's latest
    state = read_trainer_state(checkpoint)
    done = int(state["iteration"])
    total = config.iterations_after(done, int(state.get("env_steps", done * config.steps_per_iteration)))
    if done >= total:
        rc = config.runner
        per_iteration = rc.episode_length * rc.n_rollout_threads
        raise ValueError(
            f"{checkpoint} has trained {done} iterations, and --num_env_steps {rc.num_env_steps} means {total} in all: "
            f"nothing is left to train. Raise --num_env_steps (one iteration is {per_iteration} env steps; "
            f"e.g. --num_env_steps {(done + 1) * per_iteration} for one more iteration)"
        )


def build_team(config: TrainConfig, profile, dist=None):
    """The base model (loaded once), the agent team on it and its trainer: ``(team, trainer)``.

    The seed is set after loading, since building the embedded model draws random numbers: a first run and
    a cached run start alike. With several processes (``dist``), rank 0 builds the embedded model first,
    every process starts from rank 0's adapters, and each samples with its own seed."""

    dist = dist or Distributed()
    with dist.main_process_first():  # rank 0 builds and caches the embedded model before the others read it
        model, tokenizer = load_base_model(config.model)
    seed_everything(config.runner.seed)
    team = AgentTeam(model, tokenizer, profile, config.model, with_critic=trainer_class(config.algo.algorithm_name).uses_critic)
    trainer = make_trainer(team, config.algo, steps_per_iteration=config.steps_per_iteration, dist=dist, horizon=config.env.horizon)
    if dist.enabled:
        dist.broadcast_parameters((team.critic.trainable_parameters() if team.critic else []) + [p for a in team.policy_adapters for p in team.adapter_parameters(a)])
        seed_everything(config.runner.seed + dist.rank)  # each process samples its own replies
    return team, trainer


def resolve_kl_reference(config: TrainConfig) -> str:
    """What ``--kl_reference`` means for this run: ``base`` or ``initial`` as given; ``auto``: ``initial`` when
    training starts from ``--load_path`` (a checkpoint of ``scripts/sft.py``, whose config says ``auto``), else ``base``.
    A checkpoint whose config names a reference keeps it; one saved before the flag existed by an RL run (iteration
    > 0) trained against the base model, and keeps it."""
    value = config.algo.kl_reference
    if value != "auto":
        return value
    if not config.runner.load_path:
        return "base"

    saved, state = read_checkpoint_meta(find_checkpoint(config.runner.load_path))
    saved_value = saved.get("algo", {}).get("kl_reference")
    if saved_value in ("base", "initial"):
        return saved_value
    if saved_value is None and int(state.get("iteration", 0)) > 0:
        return "base"
    return "initial"


def build_runner(config: TrainConfig, validated=None):
    """The base model, agent team, trainer, training envs and :class:`Runner` that ``config`` describes.

    ``validated`` is the result of :func:`validate` when the caller already checked the inputs.
    """

    profile, make_train_env, make_eval_env = validated or validate(config)
    dist = init_distributed(config.model.device, config.runner.dist_timeout_s)  # one process: no process group
    team, trainer = build_team(config, profile, dist)
    if config.model.critic_init == "policy":
        if not team.has_critic:
            raise ValueError(f"--critic_init policy: --algorithm_name {config.algo.algorithm_name} trains no critic; drop the flag")
        team.critic_policy_sources()  # refuses a critic over several policy adapters before anything is loaded
    config.algo.kl_reference = resolve_kl_reference(config)  # recorded in the run's config: a resume keeps it
    if config.algo.kl_coef is None:  # the algorithm's default, recorded too
        config.algo.kl_coef = config.algo.effective_kl_coef
        if dist.is_main:
            logger.info("--kl_coef %g: %s's default", config.algo.kl_coef, config.algo.algorithm_name)
    if config.algo.effective_kl_coef > 0 and config.algo.kl_reference == "initial":
        team.add_reference_adapters()  # the adapters as they start; a checkpoint's own references replace them on restore
    envs = TextVectorEnv([make_train_env] * (config.runner.n_rollout_threads // dist.world_size))
    run_dir = dist.broadcast_object(default_run_dir(config))  # rank 0's timestamp
    if dist.is_main:
        logger.info("run directory: %s", run_dir)
    return Runner(config, team, trainer, envs, make_eval_env, run_dir, dist=dist)


def train(config: TrainConfig, validated=None) -> dict:
    """Validate ``config`` (unless ``validated`` is :func:`validate`'s result), build everything
    (:func:`build_runner`) and run training; return the run summary (accuracy before/after, iterations,
    run directory, last checkpoint, seconds). This is ``marft.train``, the Python API.

    With ``config.runner.load_path`` it resumes; unlike the command line, no value is taken from the
    checkpoint's config (pass the config you want; :func:`marft.runner.shared.checkpoint.resume_config` merges).

    Raises:
        ValueError / FileNotFoundError: a bad input (profile, model path, data, environment), before the model loads.
    """
    return run_training(build_runner(config, validated))


def run_training(runner) -> dict:
    """``runner.run()``, with the seconds it took in the summary."""
    start = time.perf_counter()
    summary = runner.run()
    summary["seconds"] = time.perf_counter() - start
    return summary


if __name__ == "__main__":  # python -m marft.launch, as before: the command line is marft.cli.train (marft train)
    runpy.run_module("marft.cli.train", run_name="__main__", alter_sys=True)
