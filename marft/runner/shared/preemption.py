"""Stops from outside: periodic checkpoints and SIGTERM / SIGINT handled at phase boundaries.

A scheduler preempts a job with SIGTERM (then SIGKILL a little later); a user presses Ctrl-C (SIGINT).
While the training loop runs, :class:`Preemption` records the first such signal instead of dying, and the
runner asks it at its phase boundaries what to do:

* between the team steps of a rollout (:meth:`Preemption.poll_rollout`): a stop abandons the half-done rollout
  (the runner rewinds to the iteration's start with :func:`rewind`; a rollout changes no weights);
* after each iteration's update (:meth:`Preemption.after_iteration`): save now (``--save_interval``,
  ``--save_every_minutes`` or a stop), and stop or not.

On a stop the runner writes one checkpoint and raises :class:`~marft.faults.Preempted` (exit code 75);
``--load_path <run dir>`` continues exactly as if nothing had happened. A second SIGINT (a second or more after
the first, so that ``torchrun`` forwarding the same Ctrl-C does not count twice) exits at once with code 130;
repeated SIGTERMs are ignored. With several processes every decision is one all-reduce (a stop on any process
stops all; the clock of rank 0 times the periodic saves), so all processes stop, and save their part, together.
"""

from __future__ import annotations

import copy
import logging
import os
import signal
import threading
import time

import numpy as np

from marft.faults import ExitCode
from marft.runner.shared.checkpoint import rng_state, set_rng_state

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
SECOND_SIGINT_AFTER_S = 1.0
"""A second SIGINT counts (exits at once) only this long after the first: ``torchrun`` forwards the Ctrl-C its
workers already received from the terminal."""


class RolloutAbandoned(Exception):
    """Raised between the team steps of a rollout when a stop was requested."""


class Preemption:
    """Signal handlers for the duration of a ``with`` block, and the save / stop decisions of the runner.

    Args:
        save_interval: save every this many iterations (0: off).
        save_every_minutes: save after this many minutes since the last save (0: off).
        dist: the process group (decisions are taken together).
    """

    def __init__(self, save_interval: int, save_every_minutes: float, dist):
        self.save_interval = save_interval
        self.save_every_s = 60.0 * save_every_minutes
        self.dist = dist
        self.received: str | None = None
        """The name of the first stop signal this process received (None: none)."""
        self.stop_signal: str | None = None
        """The signal that stopped the run, as agreed by all processes (``"SIGTERM"`` for another process's)."""
        self._received_at = 0.0
        self._last_save = time.monotonic()
        self._previous: dict[int, object] = {}

    # ------------------------------------------------------------------ signal handlers
    def __enter__(self) -> Preemption:
        self._last_save = time.monotonic()
        if threading.current_thread() is not threading.main_thread():
            logger.warning("training runs outside the main thread: SIGTERM/SIGINT are not handled (no checkpoint on a stop)")
            return self
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is None:
            self.received, self._received_at = name, time.monotonic()
            _say(f"\n{name} received: finishing the current phase, then saving a checkpoint and exiting "
                 f"(exit code {int(ExitCode.PREEMPTED)}); press Ctrl-C again to exit at once without saving\n")
        elif signum == signal.SIGINT and time.monotonic() - self._received_at >= SECOND_SIGINT_AFTER_S:
            _say(f"\nsecond SIGINT: exiting at once without saving (exit code {int(ExitCode.INTERRUPTED)}); "
                 f"the earlier checkpoints are intact\n")
            os._exit(ExitCode.INTERRUPTED)

    # ------------------------------------------------------------------ decisions
    def _agree(self, save_due: bool) -> tuple[bool, bool]:
        """``(save, stop)`` on every process: stop if any process received a signal, save by rank 0's clock."""
        stop, due = float(self.received is not None), float(save_due and self.dist.is_main)
        if self.dist.enabled:
            stop, due = self.dist.sum_floats([stop, due])
        if stop and self.stop_signal is None:
            self.stop_signal = self.received or "SIGTERM"
        return due > 0 or stop > 0, stop > 0

    def poll_rollout(self) -> None:
        """Between two team steps of a rollout: raise :class:`RolloutAbandoned` when a stop was requested."""
        if self._agree(False)[1]:
            raise RolloutAbandoned

    def after_iteration(self, iterations_done: int) -> tuple[bool, bool]:
        """``(save, stop)`` once ``iterations_done`` iterations are complete: save on the ``--save_interval``,
        after ``--save_every_minutes`` (rank 0's clock), or on a stop."""
        due = bool(self.save_interval and iterations_done % self.save_interval == 0)
        due = due or bool(self.save_every_s and time.monotonic() - self._last_save >= self.save_every_s)
        save, stop = self._agree(due)
        if save:
            self._last_save = time.monotonic()
        return save, stop


def ignore_stop_signals() -> None:
    """For a command whose work is done (or saved): SIGTERM/SIGINT during the interpreter's shutdown change nothing,
    so they no longer kill it mid-exit (call it only in a process about to exit: it is global)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def _say(text: str) -> None:
    """Write to stderr from a signal handler (no buffered I/O)."""
    try:
        os.write(2, text.encode())
    except OSError:
        pass


# ---------------------------------------------------------------------- abandoning a rollout
def rollout_start(runner) -> dict:
    """What a rollout changes in ``runner`` (observations, env states, running returns, the trainer's counters,
    every RNG), taken before it starts so a half-done rollout can be undone."""

    return {
        "envs": copy.deepcopy(runner.envs.state_dict()),
        "episode_returns": runner.collector.episode_returns.copy(),
        "counters": copy.deepcopy(dict(runner.trainer.counters)),
        "env_steps": runner.env_steps,
        "rng": rng_state(),
    }


def rewind(runner, state: dict) -> None:
    """Put ``runner`` back to :func:`rollout_start`'s ``state``: the checkpoint then written is the one the
    iteration started from, and the continuation replays the abandoned rollout exactly."""

    runner.collector.obs = runner.envs.load_state_dict(state["envs"])
    runner.collector.episode_returns = np.asarray(state["episode_returns"], dtype=np.float64)
    runner.trainer.counters.clear()
    runner.trainer.counters.update(state["counters"])
    runner.env_steps = state["env_steps"]
    set_rng_state(state["rng"])
