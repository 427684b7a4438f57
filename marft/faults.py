"""What can go wrong in a run, as exceptions with messages that say what to do next.

* :class:`CheckpointError`: a checkpoint file is missing, truncated or corrupted, or the
  checkpoint does not fit the current team (the message names the file or flag).
* :class:`TrainingStopped`: training cannot go on (repeated non-finite updates, weights that
  turned non-finite); the runner adds the last good checkpoint to resume from.
* :func:`oom_message`: the text of an out-of-memory error during the update: batch sizes and
  the flags that reduce memory.
"""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint cannot be written or loaded; the message names the file."""


class TrainingStopped(RuntimeError):
    """Training cannot continue; the message says why and where to resume from."""


def oom_message(config, iteration: int, n_agents: int, token_level: bool = False) -> str:
    """Batch sizes of the update that ran out of memory and the flags that shrink them.

    Args:
        config: the run's ``TrainConfig``.
        iteration: the 0-based iteration whose update failed.
        n_agents: team size (the critic trains on every agent's turns).
        token_level: whether the trainer is token level (MARFT-T).
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
        f"To use less memory: raise --gradient_cp_steps (smaller chunks, same update), raise --num_mini_batch, "
        f"lower --max_new_tokens or --context_window, or lower --n_rollout_threads / --episode_length."
    )


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)
