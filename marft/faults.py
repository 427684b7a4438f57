"""What can go wrong in a run, as exceptions with messages that say what to do next.

* :class:`CheckpointError`: a checkpoint file is missing, truncated or corrupted, or the
  checkpoint does not fit the current team (the message names the file or flag).
* :class:`TrainingStopped`: training cannot go on (repeated non-finite updates, weights that
  turned non-finite); the runner adds the last good checkpoint to resume from.
* :class:`CheckpointWriteError`: a checkpoint could not be written (disk full, quota, any write error);
  the partial folder is gone and the message names the checkpoint, the free space and the last complete one.
* :class:`SaveFailed`: training stopped because a checkpoint or a log could not be written.
* :class:`Preempted`: a stop signal (SIGTERM, SIGINT) ended training after one checkpoint was written.
* :func:`oom_message`: the text of an out-of-memory error during the update: batch sizes and
  the flags that reduce memory.
* :class:`ExitCode`: what ``python -m marft.launch`` (``train_math.sh``, ``sft.py``) returns for each.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """Exit codes of the training commands (documented in docs/runs.md)."""

    OK = 0
    """Training finished."""
    TRAINING_STOPPED = 1
    """Training cannot go on (repeated non-finite updates, non-finite weights); the message names the last good checkpoint."""
    BAD_INPUT = 2
    """A flag, file or checkpoint is wrong: one line on stderr, before the model loads."""
    SAVE_FAILED = 74
    """A checkpoint or log could not be written (EX_IOERR): disk full, quota, permissions; nothing partial is left."""
    PREEMPTED = 75
    """Stopped by SIGTERM or SIGINT after writing a checkpoint (EX_TEMPFAIL): resume with ``--load_path <run dir>``."""
    INTERRUPTED = 130
    """A second Ctrl-C: stopped at once, without writing a checkpoint (the previous ones are intact)."""


class CheckpointError(ValueError):
    """A checkpoint cannot be written or loaded; the message names the file."""


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint failed (ENOSPC, EDQUOT, any I/O error); its partial folder was removed."""


class TrainingStopped(RuntimeError):
    """Training cannot continue; the message says why and where to resume from."""


class SaveFailed(TrainingStopped):
    """Training stopped because a checkpoint or a log file could not be written (:attr:`ExitCode.SAVE_FAILED`)."""


class Preempted(Exception):
    """A stop signal ended training at a phase boundary, after one checkpoint (:attr:`ExitCode.PREEMPTED`)."""

    def __init__(self, message: str, checkpoint=None):
        super().__init__(message)
        self.checkpoint = checkpoint
        """The checkpoint to continue from (None when none could be written)."""


def oom_message(config, iteration: int, n_agents: int, token_level: bool = False, chunk_tokens: int | None = None) -> str:
    """Batch sizes of the update that ran out of memory and the flags that shrink them.

    Args:
        config: the run's ``TrainConfig``.
        iteration: the 0-based iteration whose update failed.
        n_agents: team size (the critic trains on every agent's turns).
        token_level: whether the trainer is token level (MARFT-T).
        chunk_tokens: the chunk token budget the update ran with (None: none).
    """
    mc, ac, rc = config.model, config.algo, config.runner
    per_agent = rc.episode_length * rc.n_rollout_threads  # turns per agent in one rollout batch
    critic = per_agent * n_agents
    minibatch = _ceil_div(per_agent, ac.num_mini_batch)
    chunk = _ceil_div(minibatch, ac.gradient_cp_steps)
    critic_chunk = _ceil_div(_ceil_div(critic, ac.num_mini_batch), ac.gradient_cp_steps * n_agents)
    return (
        f"out of memory during the update of iteration {iteration + 1} "
        f"({'token' if token_level else 'action'} level). Batch sizes: {per_agent} turns per agent "
        f"(--episode_length {rc.episode_length} x --n_rollout_threads {rc.n_rollout_threads}), {critic} for the critic; "
        f"minibatch {minibatch} (--num_mini_batch {ac.num_mini_batch}), forward/backward chunk {chunk} "
        f"(critic {critic_chunk}; --gradient_cp_steps {ac.gradient_cp_steps}), sequences up to "
        f"{mc.context_window} tokens with replies of --max_new_tokens {mc.max_new_tokens}. "
        f"To use less memory: raise --gradient_cp_steps (smaller chunks, same update), lower --max_chunk_mib or set "
        f"--max_chunk_tokens (chunks cut to a budget of positions: long prompts of later agents no longer make the "
        f"peak; same update; currently {chunk_tokens if chunk_tokens is not None else 'no'} positions a chunk, from "
        f"--max_chunk_mib {'default' if ac.max_chunk_mib is None else ac.max_chunk_mib} and --max_chunk_tokens "
        f"{ac.max_chunk_tokens}), lower --max_logits_mib (the vocabulary's logits formed fewer rows at a time; currently "
        f"{mc.max_logits_mib}), raise --num_mini_batch, "
        f"lower --max_new_tokens or --context_window, or lower --n_rollout_threads / --episode_length."
    )


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)
