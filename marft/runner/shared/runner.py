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

import torch
from tqdm import tqdm

from marft.agents.team import AgentTeam
from marft.config import TrainConfig
from marft.distributed import SINGLE, Distributed
from marft.envs.workflows import OrchestratedWorkflow
from marft.faults import CheckpointError, CheckpointWriteError, Preempted, SaveFailed, TrainingStopped, oom_message
from marft.runner.shared import keep_best, opponent, resume
from marft.runner.shared.best import BestTracker
from marft.runner.shared.buffer import RolloutBuffer
from marft.runner.shared.checkpoint import cleanup_partial_checkpoints, rng_state, save_checkpoint
from marft.runner.shared.collector import RolloutCollector, RolloutNeeds
from marft.runner.shared.diagnostics import TeamDiagnostics
from marft.runner.shared.evaluation import evaluate_episodes
from marft.runner.shared.preemption import Preemption, RolloutAbandoned, rewind, rollout_start
from marft.runner.shared.run_log import RunLog, loss_tags, markdown_table, save_failed_hint
from marft.runner.shared.storage import expected_checkpoint_bytes, warn_if_low_space

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
        self.log = RunLog(self.run_dir, dist, config.runner.continue_on_save_error)
        """TensorBoard (rank 0), the run directory's files, progress lines (:mod:`marft.runner.shared.run_log`)."""
        if dist.is_main:
            self.log.write_file(self.run_dir / "config.json", config.to_json())
            self.log.write_file(self.run_dir / "config.yaml", config.to_yaml())  # the resolved run config: --config reads it
            cleanup_partial_checkpoints(self.checkpoint_dir)
            warn_if_low_space(self.run_dir, expected_checkpoint_bytes(team), config.runner.keep_checkpoints)
            self.writer.add_text("config", markdown_table(config.to_dict()))
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
        whole_episodes = trainer.group_relative or config.algo.credit_assignment == "own_turns"
        if trainer.uses_critic:
            choose_values_in_update(trainer, config, envs, dist)
        needs = RolloutNeeds(values=trainer.uses_critic, token_values=trainer.token_level, group_rounds=whole_episodes,
                             group_size=config.algo.group_size if trainer.group_relative else 1,
                             turn_values=not trainer.values_in_update)
        self.collector = RolloutCollector(team, envs, config, needs, self.diagnostics, self.preemption.poll_rollout, dist)
        """Plays the training envs into rollout buffers; holds each env's observation and running return."""
        pool_size = opponent.pool_size(config.algo.opponent)
        if pool_size:  # before any restore: a checkpoint holds the snapshots (self-play rolls out rounds of whole games)
            self.collector.pool = opponent.OpponentPool(team, pool_size, config.algo.opponent_refresh,
                                                        self.roles.index(opponent.opponent_role(config, self.roles)))
        if isinstance(envs.bases[0].workflow, OrchestratedWorkflow):
            trainer.counters.setdefault(ORCHESTRATOR_INVALID, 0)
        self.best = BestTracker(window=config.runner.collapse_window, drop=config.runner.collapse_drop, min_fill=config.runner.collapse_window)
        """The moving training accuracy, the best point (``checkpoints/best``) and collapse detection; checkpointed."""
        self.stopped_by_collapse = False
        """``--on_collapse stop`` ended the run before its last iteration."""
        self.seconds = {"iterations": 0.0, "keep_best": 0.0}
        """This process's wall seconds in its iterations (all phases) and in the keep_best phase among them (the
        best's saves, rollbacks): what keeping the best costs, in ``summary.json`` (``seconds``)."""

    @property
    def writer(self):
        """The run's TensorBoard writer (:attr:`RunLog.writer`)."""
        return self.log.writer

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
            raise SaveFailed(f"{error}. {save_failed_hint(self.run_dir)}") from error
        if error is not None:
            raise TrainingStopped(f"{error}. {self._resume_hint()}") from error
        if name is None:
            self.last_checkpoint = path
        return path

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
        """Continue from a checkpoint or a run directory's latest (:func:`marft.runner.shared.resume.restore`)."""
        resume.restore(self, path)

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

    def _advantages(self, buffer: RolloutBuffer, iteration: int) -> None:
        """``trainer.compute_advantages``, with an OOM error that names ``--values_in_update`` when its forward ran there."""
        try:
            self.trainer.compute_advantages(buffer)
        except torch.OutOfMemoryError as error:
            if not self.trainer.values_in_update:
                raise
            raise torch.OutOfMemoryError(f"out of memory in iteration {iteration + 1} while the update's first critic forward valued the "
                                         "rollout's turns: run with --values_in_update false, or a smaller --max_chunk_mib / "
                                         f"--max_chunk_tokens (it applies where all turns fit one chunk) ({error})") from error

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

    PHASES = ("pool", "collect", "advantages", "update", "log", "keep_best", "checkpoint", "evaluate")
    """One iteration's phases, in order (:meth:`_iteration`; ``pool`` only with ``--opponent pool:K``): collect, advantages and update are timed in the logs
    (``charts/rollout_seconds``, ``charts/advantages_seconds``, ``charts/update_seconds``), and a stop signal is
    answered between phases (during the rollout, by rewinding it)."""

    def _run(self) -> dict:
        if self.config.runner.load_path:
            self.restore(self.config.runner.load_path)
        played_from = opponent.load_opponent(self.team, self.config) if self.starts_rl else None  # replaces a warm start's
        if played_from is not None:
            self.log.print(f"{played_from} plays from --opponent {self.config.algo.opponent} (never trained)")
        pool = self.collector.pool
        if pool is not None:
            if self.starts_rl:
                pool.start()  # snapshot 0: the trained role as training starts
            self.log.print(f"{self.roles[pool.opponent]} plays each game from a pool of the {pool.size} latest snapshots of "
                           f"{self.roles[1 - pool.opponent]} (one every {pool.refresh} iterations; never trained)")
        self.init_critics()
        before, calls_before = self._evaluate_and_log(self.start_iteration)  # calls: whom an orchestrator called
        self.log.print(f"held-out accuracy before training: {before['accuracy']:.3f} ({before['episodes']} episodes)")
        bar = tqdm(range(self.start_iteration, self.n_iterations), desc="train", dynamic_ncols=True, disable=None if self.dist.is_main else True)
        every = max(1, (self.n_iterations - self.start_iteration) // 20)  # without a terminal (no bar): about 20 progress lines
        for iteration in bar:
            stats = self._iteration(iteration)
            if self.stopped_by_collapse:
                self.n_iterations = iteration + 1
                break
            bar.set_postfix(ret=f"{stats.get('charts/episode_return', float('nan')):.2f}", acc=f"{stats.get('charts/accuracy', float('nan')):.2f}")
            if bar.disable and (iteration + 1 - self.start_iteration) % every == 0:
                self.log.print(f"iteration {iteration + 1}/{self.n_iterations}: training accuracy {stats.get('charts/accuracy', float('nan')):.3f}, "
                            f"return {stats.get('charts/episode_return', float('nan')):.3f}, {stats['charts/iteration_seconds']:.1f} s")
        return self._finish(before, calls_before)

    def _iteration(self, iteration: int) -> dict[str, float]:
        """One training iteration, phase by phase (:attr:`PHASES`); returns its logged figures."""
        rc, start = self.config.runner, time.perf_counter()
        # 0. pool: at its iterations, a snapshot of the trained role joins the opponent pool (--opponent pool:K)
        if self.collector.pool is not None:
            self.collector.pool.before_iteration(iteration)
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
        self._advantages(buffer, iteration)
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
        keep_best.keep_best(self, iteration, stats.get("charts/accuracy", float("nan")))
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

    def roll_back(self, iteration: int, message: str) -> None:
        """``--on_collapse rollback`` to ``checkpoints/best`` (:func:`marft.runner.shared.keep_best.roll_back`)."""
        keep_best.roll_back(self, iteration, message)

    def _log_iteration(self, iteration: int, stats: dict[str, float], metrics: dict[str, float]) -> None:
        """The iteration's rollout figures, counters and losses to TensorBoard (every ``--log_interval``)."""
        stats["charts/env_steps"] = self.env_steps
        for key, value in self.trainer.counters.items():
            stats[f"counters/{key}"] = value
        stats["counters/reward_failures"] = self.envs.failures()
        log_interval = self.config.runner.log_interval
        if log_interval and (iteration + 1) % log_interval == 0:
            for key, value in self.log.over_processes({**stats, **loss_tags(metrics)}).items():
                self.writer.add_scalar(key, value, iteration + 1)

    def _evaluate_and_log(self, step: int) -> tuple[dict[str, float], dict[str, float]]:
        """Evaluate on held-out episodes and log the result (and the transcripts) at ``step``. Returns the result
        and, per role, the orchestrator's calls per step in this evaluation (empty without an orchestrator)."""
        result = self.evaluate()
        calls = self.diagnostics.call_distribution()  # before logging, which starts the next count
        self.log.evaluation(result, step, self.diagnostics.evaluation_stats(), self.last_transcripts)
        self.best.observe_heldout(step, result["accuracy"])
        return result, calls

    def _finish(self, before: dict[str, float], calls_before: dict[str, float]) -> dict:
        """After the last iteration: evaluate, save the final checkpoint (unless it exists), write the summary."""
        n_iterations = self.n_iterations
        after, calls_after = self._evaluate_and_log(n_iterations)
        checkpoint = self.checkpoint_dir / f"steps_{n_iterations}"
        if n_iterations > self.start_iteration and not self.dist.broadcast_object(checkpoint.exists()):  # rank 0's view
            self.save(n_iterations)
        best = keep_best.evaluate_best(self)
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
        self.log.print(f"held-out accuracy after training: {after['accuracy']:.3f} ({after['episodes']} episodes)")
        if best["best_checkpoint"]:
            heldout = best["best_heldout_accuracy"]
            self.log.print(f"best: iteration {best['best_iteration']} (moving training accuracy {best['best_moving_train_accuracy']:.3f}"
                        + (f", held-out {heldout:.3f}" if heldout is not None else "") + f"), kept in {best['best_checkpoint']}"
                        + (f"; {best['rollbacks']} rollback(s)" if best["rollbacks"] else ""))
        if self.dist.is_main:
            self.log.write_file(self.run_dir / "summary.json", json.dumps(summary, indent=2))
        return summary


def choose_values_in_update(trainer, config: TrainConfig, envs, dist: Distributed) -> None:
    """Whether the update's first critic forward values the rollout's turns (``--values_in_update``): where it holds
    every turn a rollout can (``episode_length x envs x turn slots``, each of the longest prompt and, at the token
    level, reply) within one chunk's budget (:meth:`~marft.algorithms.appo_trainer.APPOTrainer.can_value_in_update`).
    Logged either way."""
    team = trainer.team
    positions = team.prompts.max_prompt_len + (config.model.max_new_tokens if trainer.token_level else 0)
    turns = config.runner.episode_length * envs.n_envs * envs.bases[0].workflow.max_turns_per_step
    trainer.values_in_update = trainer.can_value_in_update(turns, positions)
    if dist.is_main:
        logger.info("the turns' values come from %s", "the update's first critic forward (--values_in_update)" if trainer.values_in_update
                    else "the rollout (--values_in_update is off or does not apply: see --help)")
