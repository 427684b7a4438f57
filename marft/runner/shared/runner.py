"""The shared runner: rollout → buffer → advantages → update → logs → evaluation → checkpoints.

"Shared" as in on-policy's MAPPO: one runner drives the whole team over a batch of
parallel environments; agents act in profile order on each environment's shared history.

With several processes (:mod:`marft.distributed`) every process runs this loop on its own share of the
environments; rank 0 alone writes the run directory (config, TensorBoard, progress bar, summary,
checkpoints), with metrics averaged over the processes, and every process resumes from the checkpoint.

Stops from outside (:mod:`marft.runner.shared.preemption`): SIGTERM/SIGINT end the run at the next phase
boundary with one checkpoint (a half-done rollout is rewound), and checkpoints are also saved by time.
Write errors (:mod:`marft.runner.shared.storage`) stop the run cleanly or, if asked, only warn.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from marft.agents.team import AgentTeam
from marft.config import TrainConfig
from marft.distributed import SINGLE, Distributed
from marft.envs.workflows import OrchestratedWorkflow
from marft.faults import CheckpointError, CheckpointWriteError, Preempted, SaveFailed, TrainingStopped, oom_message
from marft.runner.shared.best import BestTracker
from marft.runner.shared.buffer import RolloutBuffer
from marft.runner.shared.checkpoint import (
    BEST,
    cleanup_partial_checkpoints,
    config_changes,
    find_checkpoint,
    load_checkpoint,
    load_value_head_state,
    read_checkpoint_meta,
    resume_incompatibilities,
    rng_state,
    save_checkpoint,
    set_rng_state,
    value_head_state,
)
from marft.runner.shared.collector import RolloutCollector, RolloutNeeds
from marft.runner.shared.diagnostics import TeamDiagnostics, write_transcripts
from marft.runner.shared.evaluation import evaluate_episodes
from marft.runner.shared.preemption import Preemption, RolloutAbandoned, rewind, rollout_start
from marft.runner.shared.storage import GuardedWriter, expected_checkpoint_bytes, warn_if_low_space

ORCHESTRATOR_INVALID = "orchestrator_invalid"
"""The trainer counter of orchestrator replies (training rollouts) with neither a known call nor ``<done/>``."""

logger = logging.getLogger(__name__)


class Runner:
    """Trains ``team`` with ``trainer`` on ``envs`` and evaluates on environments from ``make_eval_env``.

    Args:
        config: the resolved run config.
        team: the agent team (one base model, adapters, critic).
        trainer: an algorithm object with ``update(buffer, iteration) -> metrics``,
            ``agents_to_train(iteration)``, ``counters``, ``state_dict`` and ``load_state_dict``.
        envs: a ``TextVectorEnv`` of this process's ``n_rollout_threads / P`` training environments.
        make_eval_env: builds one held-out environment.
        run_dir: where config, TensorBoard logs and checkpoints go (the same on every process).
        dist: the process group of a data-parallel run (default: one process).
    """

    def __init__(self, config: TrainConfig, team: AgentTeam, trainer, envs, make_eval_env: Callable, run_dir: Path, dist: Distributed = SINGLE):
        self.config = config
        self.team = team
        self.trainer = trainer
        self.envs = envs
        self.make_eval_env = make_eval_env
        self.dist = dist
        self.run_dir = Path(run_dir)
        self.checkpoint_dir = self.run_dir / "checkpoints"
        self.last_checkpoint: Path | None = None  # the newest checkpoint saved or resumed from (to point to on a stop)
        self.preemption = Preemption(config.runner.save_interval, config.runner.save_every_minutes, dist)
        """SIGTERM/SIGINT handling and the periodic-save clock (:mod:`marft.runner.shared.preemption`)."""
        self.writer = self._open_writer()
        if dist.is_main:
            self._write_file(self.run_dir / "config.json", config.to_json())
            self._write_file(self.run_dir / "config.yaml", config.to_yaml())  # the resolved run config: --config reads it
            cleanup_partial_checkpoints(self.checkpoint_dir)
            warn_if_low_space(self.run_dir, expected_checkpoint_bytes(team), config.runner.keep_checkpoints)
            self.writer.add_text("config", _markdown_table(config.to_dict()))
        self.roles = [spec.role for spec in team.profile]
        self.diagnostics = TeamDiagnostics(self.roles)
        """Per-role figures (turns, reply lengths, advantages, the orchestrator's calls) for TensorBoard."""
        self.last_transcripts: list[dict] = []
        """The last evaluation's episodes, every turn with its speaking role (written to ``transcripts/`` on rank 0)."""
        self.start_iteration = 0
        self.starts_rl = True
        """Whether this run starts RL (no --load_path, or a warm start's checkpoint) rather than resuming it."""
        self.env_steps = 0  # all processes together
        self.n_iterations = config.num_iterations
        """Iterations in all, the resumed ones included (a resume recounts them from the env steps left)."""
        trainer.total_iterations = self.n_iterations  # where --lr_schedule's decay ends
        needs = RolloutNeeds(values=trainer.uses_critic, token_values=trainer.token_level, group_rounds=trainer.group_relative)
        self.collector = RolloutCollector(team, envs, config, needs, self.diagnostics, self.preemption.poll_rollout, dist)
        """Plays the training envs into rollout buffers; holds each env's observation and running return."""
        if isinstance(envs.bases[0].workflow, OrchestratedWorkflow):
            trainer.counters.setdefault(ORCHESTRATOR_INVALID, 0)
        self.best = BestTracker(window=config.runner.collapse_window, drop=config.runner.collapse_drop, min_fill=config.runner.collapse_window)
        """The moving training accuracy, the best point (``checkpoints/best``) and collapse detection; checkpointed."""
        self.stopped_by_collapse = False
        """``--on_collapse stop`` ended the run before its last iteration."""
        self.seconds = {"iterations": 0.0, "keep_best": 0.0}
        """This process's wall seconds in its iterations (all phases) and in the keep_best phase among them (the
        best's saves, rollbacks): what keeping the best costs, in ``summary.json`` (``seconds``)."""

    def _open_writer(self, purge_step: int | None = None):
        """TensorBoard on rank 0; a writer that drops everything on the other processes."""
        if not self.dist.is_main:
            return _NullWriter()
        logs = self.run_dir / "logs"
        return GuardedWriter(lambda: SummaryWriter(str(logs), purge_step=purge_step), logs, self._write_failed)

    def _write_failed(self, what: str, error: BaseException) -> None:
        """A log or file could not be written: stop cleanly (:class:`SaveFailed`, exit code 74) or, with
        ``--continue_on_save_error``, warn and go on without it."""
        from marft.runner.shared.storage import describe_write_error, free_bytes, human_bytes

        message = f"could not write {what}: {describe_write_error(error)}; {human_bytes(free_bytes(self.run_dir))} free there"
        if self.config.runner.continue_on_save_error:
            logger.warning("%s; training goes on without it (--continue_on_save_error)", message)
            return
        raise SaveFailed(f"{message}. {self._save_failed_hint()}") from error

    def _write_file(self, path: Path, text: str) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        except OSError as error:
            self._write_failed(str(path), error)

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, n_episodes: int | None = None, make_env: Callable | None = None) -> dict[str, float]:
        """Held-out evaluation (:func:`~marft.runner.shared.evaluation.evaluate_episodes`) on its own RNG stream, so
        evaluating never changes what training samples; keeps the episodes in :attr:`last_transcripts`.

        ``make_env`` builds the environments to evaluate on (default: the held-out ``make_eval_env``)."""
        rc = self.config.runner
        devices = [self.team.device] if self.team.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(rc.seed + 1_000_000 + self.dist.rank)
            with self.team.headers.frozen():
                result, self.last_transcripts = evaluate_episodes(
                    self.team, make_env or self.make_eval_env, n_episodes or rc.eval_episodes, rc.seed, rc.n_eval_threads,
                    self.diagnostics, self.dist,
                )
        return result

    # ------------------------------------------------------------------ checkpoints
    def save(self, iteration: int, name: str | None = None) -> Path:
        """Checkpoint after ``iteration`` iterations: weights, optimizers, trainer state, RNG, env states,
        the running episode returns (the data position) and the best tracker. Non-finite weights stop training
        instead. ``name``: a named checkpoint (``best``) instead of ``steps_<iteration>``; it is not the one a
        stop points to.

        With P processes, rank 0 writes one checkpoint holding every process's envs and running returns
        (in rank order, as one run's ``n_rollout_threads`` envs) and every process's RNG states
        (``rank_rng``); the weights and optimizer states are the same on all processes."""
        state = {
            "iteration": iteration,
            "env_steps": self.env_steps,
            "roles": self.roles,
            "next_agents": self.trainer.agents_to_train(iteration),  # position in the agent schedule
            "counters": dict(self.trainer.counters),
            "episode_returns": self.collector.episode_returns.tolist(),
            "envs": self.envs.state_dict(),
            "world_size": self.dist.world_size,
            "best_tracker": self.best.state_dict(),
        }
        if self.dist.enabled:
            shares = self.dist.gather_objects({"episode_returns": state["episode_returns"], "envs": state["envs"], "rng": rng_state()})
            state["episode_returns"] = [r for share in shares for r in share["episode_returns"]]
            state["envs"] = [env for share in shares for env in share["envs"]]
            state["rank_rng"] = [share["rng"] for share in shares]
        path, error = None, None
        if self.dist.is_main:
            try:
                path = save_checkpoint(
                    self.checkpoint_dir, iteration, self.team, self.trainer, state, self.config.to_json(), keep=self.config.runner.keep_checkpoints,
                    name=name,
                )
            except CheckpointError as failure:
                error = failure
        if self.dist.enabled:  # every process learns where the checkpoint is, or stops alike
            path, message, write_error = self.dist.broadcast_object(
                (path, None if error is None else str(error), isinstance(error, CheckpointWriteError)))
            error = error or (None if message is None else (CheckpointWriteError if write_error else CheckpointError)(message))
        if isinstance(error, CheckpointWriteError):  # disk full, quota, I/O: nothing partial is left
            if self.config.runner.continue_on_save_error:
                logger.warning("%s; training goes on (--continue_on_save_error)", error)
                return None
            raise SaveFailed(f"{error}. {self._save_failed_hint()}") from error
        if error is not None:
            raise TrainingStopped(f"{error}. {self._resume_hint()}") from error
        if name is None:
            self.last_checkpoint = path
        return path

    def _save_failed_hint(self) -> str:
        return (f"Training stopped: free some space and continue with --load_path {self.run_dir}, or pass "
                f"--continue_on_save_error to train on without checkpoints while saving fails")

    def _preempted(self, iteration: int) -> None:
        """A stop signal: write one checkpoint after ``iteration`` iterations (unless it is the last one
        written or resumed from) and raise :class:`Preempted`."""
        target = self.checkpoint_dir / f"steps_{iteration}"
        if self.last_checkpoint is None or Path(self.last_checkpoint).resolve() != target.resolve():
            self.save(iteration)
        checkpoint = self.last_checkpoint
        self.writer.close()
        where = f"checkpoint {checkpoint}; continue with --load_path {self.run_dir}" if checkpoint else "no checkpoint could be written"
        raise Preempted(
            f"{self.preemption.stop_signal}: stopped after iteration {iteration} of {self.config.num_iterations}, {where}", checkpoint
        )

    def restore(self, path: str | Path) -> None:
        """Continue from a checkpoint (or a run directory's latest): check the config fits, load
        everything, put every env back into its episode, and log the flags that changed."""
        path = find_checkpoint(path)
        saved_config, saved_state = read_checkpoint_meta(path)
        problems = resume_incompatibilities(saved_config, saved_state.get("roles"), self.config, self.roles)
        if problems:
            raise CheckpointError(f"cannot resume from {path}: " + "; ".join(problems))
        saved_processes = int(saved_state.get("world_size", 1))
        if saved_processes != self.dist.world_size:
            raise CheckpointError(
                f"cannot resume from {path}: it was saved by a run of {saved_processes} process(es) and this run has "
                f"{self.dist.world_size}; each process's RNG and environment states are in the checkpoint, so resume "
                f"with {saved_processes} (e.g. torchrun --nproc_per_node {saved_processes}, or accelerate launch --num_processes {saved_processes})"
            )
        state = load_checkpoint(path, self.team, self.trainer)
        if self.dist.enabled:
            set_rng_state(state["rank_rng"][self.dist.rank])
        self.start_iteration = int(state["iteration"])
        self.env_steps = int(state["env_steps"])
        self.best.load_state_dict(state.get("best_tracker", {}))
        # The schedule and the iteration count go on from the env steps collected, at this run's rollout size
        # (--n_rollout_threads or --episode_length may have changed).
        self.trainer.schedule_origin = (self.start_iteration, self.env_steps)
        self.n_iterations = self.config.iterations_after(self.start_iteration, self.env_steps)
        self.trainer.total_iterations = self.n_iterations
        self.last_checkpoint = path
        warm_start = "envs" not in state and self.start_iteration == 0  # scripts/sft.py's checkpoint: RL starts here
        self.starts_rl = warm_start
        for name, (old, new) in config_changes(saved_config, self.config).items():
            if not self.dist.is_main or (name == "kl_coef" and old is None):  # the algorithm's default: build_runner said it
                continue
            if name == "kl_reference" and old == "auto":
                logger.info("--kl_reference auto is %r: training starts from a checkpoint", new)
            elif warm_start:
                logger.info("starting from the warm start with --%s %r (%r in its config)", name, new, old)
            else:
                logger.info("resuming with --%s changed: %r in the checkpoint, %r now", name, old, new)
        same_envs = saved_config.get("env", {}).get("env_name") == self.config.env.env_name
        E = self.envs.n_envs  # this process's share
        if "envs" in state and same_envs and len(state["envs"]) == E * self.dist.world_size:
            share = slice(self.dist.rank * E, (self.dist.rank + 1) * E)
            self.collector.obs = self.envs.load_state_dict(state["envs"][share])
            self.collector.episode_returns = np.asarray(state["episode_returns"][share], dtype=np.float64)
        elif "envs" not in state:
            logger.info("the checkpoint holds no environment states (a warm start): training starts on fresh episodes")
        else:
            logger.warning("environment states not restored (--env_name or the number of envs changed): fresh episodes")
        # Later TensorBoard events replace those a crashed run logged after this checkpoint.
        self.writer.close()
        self.writer = self._open_writer(purge_step=self.start_iteration + 1)
        logger.info("resumed from %s at iteration %d", path, self.start_iteration)

    def init_critics(self) -> None:
        """``--critic_init policy``, when this run starts RL: each critic adapter becomes a copy of the policy adapter
        whose turns it values (after :meth:`restore`, so from the warm start's policies). A resumed RL run keeps the
        critic its checkpoint holds."""
        if self.config.model.critic_init != "policy" or not self.starts_rl or not self.team.has_critic:
            return
        sources = self.team.init_critics_from_policies()
        if self.dist.is_main:
            logger.info("--critic_init policy: %s", ", ".join(f"{critic} starts as a copy of {policy}" for critic, policy in sources.items()))

    def _resume_hint(self) -> str:
        if self.last_checkpoint is None:
            return "No checkpoint was saved in this run yet (--save_interval saves along the way)."
        return f"The last good checkpoint is {self.last_checkpoint}: resume with --load_path {self.last_checkpoint} (perhaps with a lower --lr)."

    def _update(self, buffer: RolloutBuffer, iteration: int) -> dict[str, float]:
        """``trainer.update``, with a stop pointing to the last good checkpoint and OOM errors that say what to change."""
        try:
            return self.trainer.update(buffer, iteration)
        except TrainingStopped as error:
            self.writer.add_scalar("counters/skipped_minibatches", self.trainer.counters["skipped_minibatches"], iteration + 1)
            self.writer.flush()
            raise TrainingStopped(f"Training stopped: {error} {self._resume_hint()}") from error
        except torch.OutOfMemoryError as error:
            raise torch.OutOfMemoryError(oom_message(self.config, iteration, self.team.n_agents, self.trainer.token_level, self.trainer.chunk_tokens) + f" ({error})") from error

    # ------------------------------------------------------------------ main loop
    def run(self) -> dict:
        """Evaluate, train ``num_iterations`` iterations, evaluate again, save; return the summary.

        Raises:
            Preempted: SIGTERM or SIGINT stopped training at a phase boundary, after one checkpoint.
            SaveFailed: a checkpoint or log could not be written (without ``--continue_on_save_error``)."""
        with self.preemption:  # SIGTERM/SIGINT: finish the phase, save, raise Preempted
            return self._run()

    PHASES = ("collect", "advantages", "update", "log", "keep_best", "checkpoint", "evaluate")
    """One iteration's phases, in order (:meth:`_iteration`): the first three are timed in the logs
    (``charts/rollout_seconds``, ``charts/advantages_seconds``, ``charts/update_seconds``), and a stop signal is
    answered between phases (during the rollout, by rewinding it)."""

    def _run(self) -> dict:
        if self.config.runner.load_path:
            self.restore(self.config.runner.load_path)
        self.init_critics()
        before, calls_before = self._evaluate_and_log(self.start_iteration)  # calls: whom an orchestrator called
        self._print(f"held-out accuracy before training: {before['accuracy']:.3f} ({before['episodes']} episodes)")
        bar = tqdm(range(self.start_iteration, self.n_iterations), desc="train", dynamic_ncols=True, disable=None if self.dist.is_main else True)
        every = max(1, (self.n_iterations - self.start_iteration) // 20)  # without a terminal (no bar): about 20 progress lines
        for iteration in bar:
            stats = self._iteration(iteration)
            if self.stopped_by_collapse:
                self.n_iterations = iteration + 1
                break
            bar.set_postfix(ret=f"{stats.get('charts/episode_return', float('nan')):.2f}", acc=f"{stats.get('charts/accuracy', float('nan')):.2f}")
            if bar.disable and (iteration + 1 - self.start_iteration) % every == 0:
                self._print(f"iteration {iteration + 1}/{self.n_iterations}: training accuracy {stats.get('charts/accuracy', float('nan')):.3f}, "
                            f"return {stats.get('charts/episode_return', float('nan')):.3f}, {stats['charts/iteration_seconds']:.1f} s")
        return self._finish(before, calls_before)

    def _iteration(self, iteration: int) -> dict[str, float]:
        """One training iteration, phase by phase (:attr:`PHASES`); returns its logged figures."""
        rc, start = self.config.runner, time.perf_counter()
        # 1. collect: the team plays episode_length steps on every env (a stop signal rewinds and saves)
        before_rollout = rollout_start(self)
        try:
            buffer, stats = self.collector.collect(iteration)
        except RolloutAbandoned:
            rewind(self, before_rollout)
            self._preempted(iteration)
        self.env_steps += self.config.runner.episode_length * self.config.runner.n_rollout_threads  # all processes' envs
        invalid = stats.pop("invalid_orchestrator_replies")
        if ORCHESTRATOR_INVALID in self.trainer.counters:  # a counter the trainer checkpoints, so it survives a resume
            self.trainer.counters[ORCHESTRATOR_INVALID] += invalid
        # 2. advantages: credit per turn, the estimators of the trainer's algorithm
        phase = time.perf_counter()
        self.trainer.compute_advantages(buffer)
        stats.update(self.diagnostics.rollout_stats(buffer, self.trainer.token_level))
        stats["charts/advantages_seconds"] = time.perf_counter() - phase
        # 3. update: the scheduled adapters (and the critic) take their PPO epochs
        phase = time.perf_counter()
        metrics = self._update(buffer, iteration)
        stats["charts/update_seconds"] = time.perf_counter() - phase
        stats["charts/learning_rate"] = self.config.algo.lr * self.trainer.learning_rate_scale(iteration)  # --lr_schedule
        stats["charts/iteration_seconds"] = time.perf_counter() - start
        # 4. log: figures averaged (or summed) over processes, to TensorBoard on rank 0
        self._log_iteration(iteration, stats, metrics)
        # 4b. keep_best: the moving training accuracy; a new best is saved as checkpoints/best, a collapse handled
        phase = time.perf_counter()
        self._keep_best(iteration, stats.get("charts/accuracy", float("nan")))
        self.seconds["keep_best"] += time.perf_counter() - phase
        # 5. checkpoint: --save_interval, --save_every_minutes, or a stop signal (which ends the run here)
        save_now, stop = self.preemption.after_iteration(iteration + 1)
        if save_now:
            self.save(iteration + 1)
        if stop:
            self._preempted(iteration + 1)
        # 6. evaluate: held-out episodes every --eval_interval iterations (the last one is evaluated by _finish)
        if rc.eval_interval and (iteration + 1) % rc.eval_interval == 0 and iteration + 1 < self.n_iterations:
            self._evaluate_and_log(iteration + 1)
        self.seconds["iterations"] += time.perf_counter() - start
        return stats

    def _keep_best(self, iteration: int, accuracy: float) -> None:
        """Feed the iteration's training accuracy (the mean over processes) to the best tracker: write
        ``checkpoints/best`` at a new best, and at a collapse warn, stop or roll back (``--on_collapse``)."""
        accuracy = self._over_processes({"accuracy": accuracy}).get("accuracy", float("nan"))
        judgement = self.best.observe(iteration + 1, accuracy)
        if judgement.moving_accuracy == judgement.moving_accuracy:
            self.writer.add_scalar("charts/moving_accuracy", judgement.moving_accuracy, iteration + 1)
        if judgement.new_best:
            self.save(iteration + 1, name=BEST)
            self.writer.add_scalar("charts/best_moving_accuracy", self.best.best.moving_accuracy, iteration + 1)
        if not judgement.collapsed:
            return
        rc, best = self.config.runner, self.best.best
        self.writer.add_scalar("counters/collapses", self.best.collapses, iteration + 1)
        message = (f"collapse after iteration {iteration + 1}: the moving training accuracy ({rc.collapse_window} iterations) is "
                   f"{judgement.moving_accuracy:.3f}, {best.moving_accuracy - judgement.moving_accuracy:.3f} below its best "
                   f"{best.moving_accuracy:.3f} at iteration {best.iteration}, kept in {self.checkpoint_dir / BEST}")
        if rc.on_collapse == "warn":
            logger.warning("%s; training goes on (--on_collapse warn)", message)
        elif rc.on_collapse == "stop":
            logger.warning("%s; the run stops here (--on_collapse stop)", message)
            self.stopped_by_collapse = True
        else:
            self._roll_back(iteration, message)

    def _roll_back(self, iteration: int, message: str) -> None:
        """``--on_collapse rollback``: the best checkpoint's adapters, critic and optimizer states come back, each
        KL reference becomes the policy adapter as it is now (a fresh reference: the run is not pulled back to where
        it started), and every learning rate is scaled by ``--rollback_lr_factor`` for the rest of the run. The
        envs, RNG streams and counters go on; the rollback is counted (``counters/rollbacks``)."""
        factor = self.config.runner.rollback_lr_factor
        load_checkpoint(self.checkpoint_dir / BEST, self.team, self.trainer, rollback=True)
        for adapter, reference in self.team.reference_adapters.items():
            self.team.bank.copy_weights(adapter, reference)
        self.trainer.lr_factor *= factor
        self.trainer.counters["rollbacks"] = self.trainer.counters.get("rollbacks", 0) + 1
        self.best.rolled_back()
        self.writer.add_scalar("counters/rollbacks", self.trainer.counters["rollbacks"], iteration + 1)
        reference = "each KL reference is now the best policy" if self.team.reference_adapters else "the KL reference stays the base model"
        logger.warning("%s; rolled back to it (--on_collapse rollback): %s, learning rates x%.3g from here", message, reference, self.trainer.lr_factor)

    def _log_iteration(self, iteration: int, stats: dict[str, float], metrics: dict[str, float]) -> None:
        """The iteration's rollout figures, counters and losses to TensorBoard (every ``--log_interval``)."""
        stats["charts/env_steps"] = self.env_steps
        for key, value in self.trainer.counters.items():
            stats[f"counters/{key}"] = value
        stats["counters/reward_failures"] = self.envs.failures()
        log_interval = self.config.runner.log_interval
        if log_interval and (iteration + 1) % log_interval == 0:
            for key, value in self._over_processes({**stats, **_loss_tags(metrics)}).items():
                self.writer.add_scalar(key, value, iteration + 1)

    def _evaluate_and_log(self, step: int) -> tuple[dict[str, float], dict[str, float]]:
        """Evaluate on held-out episodes and log the result (and the transcripts) at ``step``. Returns the result
        and, per role, the orchestrator's calls per step in this evaluation (empty without an orchestrator)."""
        result = self.evaluate()
        calls = self.diagnostics.call_distribution()  # before logging, which starts the next count
        self._log_eval(result, step)
        self.best.observe_heldout(step, result["accuracy"])
        return result, calls

    def _finish(self, before: dict[str, float], calls_before: dict[str, float]) -> dict:
        """After the last iteration: evaluate, save the final checkpoint (unless it exists), write the summary."""
        n_iterations = self.n_iterations
        after, calls_after = self._evaluate_and_log(n_iterations)
        checkpoint = self.checkpoint_dir / f"steps_{n_iterations}"
        if n_iterations > self.start_iteration and not self.dist.broadcast_object(checkpoint.exists()):  # rank 0's view
            self.save(n_iterations)
        best = self._evaluate_best()
        self.writer.close()
        summary = {
            "accuracy_before": before["accuracy"],
            "accuracy_after": after["accuracy"],
            "return_before": before["return"],
            "return_after": after["return"],
            "iterations": n_iterations,
            "env_steps": self.env_steps,
            "run_dir": str(self.run_dir),
            "checkpoint": str(checkpoint) if checkpoint.exists() else None,
            **best,
            "seconds": {key: round(value, 3) for key, value in self.seconds.items()},
        }
        if calls_before or calls_after:  # an orchestrated team: whom the orchestrator called in the evaluations
            summary.update(orchestrator_calls_before=calls_before, orchestrator_calls_after=calls_after)
        self._print(f"held-out accuracy after training: {after['accuracy']:.3f} ({after['episodes']} episodes)")
        if best["best_checkpoint"]:
            heldout = best["best_heldout_accuracy"]
            self._print(f"best: iteration {best['best_iteration']} (moving training accuracy {best['best_moving_train_accuracy']:.3f}"
                        + (f", held-out {heldout:.3f}" if heldout is not None else "") + f"), kept in {best['best_checkpoint']}"
                        + (f"; {best['rollbacks']} rollback(s)" if best["rollbacks"] else ""))
        if self.dist.is_main:
            self._write_file(self.run_dir / "summary.json", json.dumps(summary, indent=2))
        return summary

    def _evaluate_best(self) -> dict:
        """The best tracker's figures for the summary. The best checkpoint's held-out accuracy, when no evaluation
        measured it yet, is measured now on the evaluation's episodes; the team then gets its final weights back."""
        best_dir = self.checkpoint_dir / BEST
        has_best = self.best.best.iteration > 0 and self.dist.broadcast_object(best_dir.exists())
        if has_best and self.best.best.heldout_accuracy is None:
            final = self._trainable_weights()
            load_checkpoint(best_dir, self.team, self.trainer, rollback=True, load_optimizers=False)
            result = self.evaluate()
            self._set_weights(final)  # the team leaves the run with its final policy
            self.best.best.heldout_accuracy = result["accuracy"]
            self.writer.add_scalar("eval/best_accuracy", result["accuracy"], self.best.best.iteration)
        return {**self.best.summary(), "best_checkpoint": str(best_dir) if has_best else None,
                "stopped_by_collapse": self.stopped_by_collapse}

    def _trainable_weights(self) -> dict[str, torch.Tensor]:
        """Copies of every adapter weight and the value head (what a rollback or the best's evaluation replaces)."""
        weights = {f"model.{name}": p.detach().clone() for name, p in self.team.model.named_parameters() if "lora_" in name}
        if self.team.has_critic:
            weights.update({f"value_head.{k}": v.detach().clone() for k, v in value_head_state(self.team).items()})
        return weights

    def _set_weights(self, weights: dict[str, torch.Tensor]) -> None:
        params = dict(self.team.model.named_parameters())
        with torch.no_grad():
            for name, tensor in weights.items():
                if name.startswith("model."):
                    params[name[len("model."):]].copy_(tensor)
        if self.team.has_critic:
            load_value_head_state(self.team, {k[len("value_head."):]: v for k, v in weights.items() if k.startswith("value_head.")})

    def _print(self, text: str) -> None:
        if self.dist.is_main:
            print(text, flush=True)

    SUMMED_OVER_PROCESSES = ("charts/rollout_tokens_per_s", "counters/reward_failures")
    """Logged figures that add up over processes; those named ``..._max`` take the largest, the others are averaged
    (the trainer's counters, the env steps and the losses of the shared weights are the same on every process)."""

    def _over_processes(self, values: dict[str, float]) -> dict[str, float]:
        """One process: ``values`` as they are. Several: each key summed (:attr:`SUMMED_OVER_PROCESSES`) or
        averaged over the processes that have a finite value for it (one gather of every process's dict)."""
        if not self.dist.enabled:
            return values
        shares = self.dist.gather_objects({k: float(v) for k, v in values.items()})
        out = {}
        for key in dict.fromkeys(k for share in shares for k in share):
            finite = [share[key] for share in shares if key in share and np.isfinite(share[key])]
            if finite:
                if key in self.SUMMED_OVER_PROCESSES:
                    out[key] = float(np.sum(finite))
                elif key.endswith("_max"):  # a largest value (e.g. rollout/engine_logprob_gap_max) is the largest anywhere
                    out[key] = float(np.max(finite))
                else:
                    out[key] = float(np.mean(finite))
        return out

    def _log_eval(self, result: dict, step: int) -> None:
        self.writer.add_scalar("eval/accuracy", result["accuracy"], step)
        self.writer.add_scalar("eval/return", result["return"], step)
        for key, value in self.diagnostics.evaluation_stats().items():
            self.writer.add_scalar(key, value, step)
        if self.dist.is_main and self.last_transcripts:
            path = self.run_dir / "transcripts" / f"eval_{step}.jsonl"
            try:
                text = write_transcripts(path, self.last_transcripts)
            except OSError as error:
                self._write_failed(str(path), error)
                return
            self.writer.add_text("eval/transcripts", text, step)


class _NullWriter:
    """Stands in for TensorBoard's ``SummaryWriter`` on the processes other than rank 0."""

    def add_scalar(self, *args, **kwargs) -> None:
        pass

    def add_text(self, *args, **kwargs) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def _loss_tags(metrics: dict[str, float]) -> dict[str, float]:
    """``agent_<role>/policy_loss`` → ``losses/agent_<role>/policy_loss``; NaN entries dropped."""
    return {f"losses/{k}": v for k, v in metrics.items() if v == v}


def _markdown_table(config: dict) -> str:
    rows = [f"|{section}.{name}|{value}|" for section, fields in config.items() for name, value in fields.items()]
    return "|param|value|\n|-|-|\n" + "\n".join(rows)
