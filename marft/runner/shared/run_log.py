"""What a run writes besides its checkpoints: TensorBoard (rank 0 alone), files in the run directory, progress
lines, and the figures of several processes combined into one. A write that fails stops the run cleanly
(:class:`~marft.faults.SaveFailed`) or, with ``--continue_on_save_error``, is warned about and skipped."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
from torch.utils.tensorboard import SummaryWriter

from marft.distributed import Distributed
from marft.faults import SaveFailed
from marft.runner.shared.diagnostics import write_transcripts
from marft.runner.shared.storage import GuardedWriter, describe_write_error, free_bytes, human_bytes

logger = logging.getLogger(__name__)

SUMMED_OVER_PROCESSES = ("charts/rollout_tokens_per_s", "counters/reward_failures")
"""Logged figures that add up over processes; those named ``..._max`` take the largest, the others are averaged
(the trainer's counters, the env steps and the losses of the shared weights are the same on every process)."""


def save_failed_hint(run_dir: Path) -> str:
    """What a user does when the run directory cannot be written."""
    return (f"Training stopped: free some space and continue with --load_path {run_dir}, or pass "
            f"--continue_on_save_error to train on without checkpoints while saving fails")


class RunLog:
    """A run's TensorBoard writer (:attr:`writer`: rank 0's, a writer that drops everything elsewhere), its files
    and progress lines.

    Args:
        run_dir: the run directory (TensorBoard logs go to its ``logs/``).
        dist: the process group (rank 0 writes).
        continue_on_save_error: warn about a failed write and go on, instead of stopping the run.
    """

    def __init__(self, run_dir: Path, dist: Distributed, continue_on_save_error: bool):
        self.run_dir, self.dist, self.continue_on_save_error = Path(run_dir), dist, continue_on_save_error
        self.writer = self._open()

    def _open(self, purge_step: int | None = None):
        if not self.dist.is_main:
            return NullWriter()
        logs = self.run_dir / "logs"
        return GuardedWriter(lambda: SummaryWriter(str(logs), purge_step=purge_step), logs, self.write_failed)

    def reopen(self, purge_step: int) -> None:
        """Close the writer and open a new one whose events from ``purge_step`` on replace those already logged
        (a resumed run replaces what a crashed run logged after its checkpoint)."""
        self.writer.close()
        self.writer = self._open(purge_step=purge_step)

    def write_failed(self, what: str, error: BaseException) -> None:
        """A log or file could not be written: stop cleanly (:class:`SaveFailed`, exit code 74) or, with
        ``--continue_on_save_error``, warn and go on without it."""
        message = f"could not write {what}: {describe_write_error(error)}; {human_bytes(free_bytes(self.run_dir))} free there"
        if self.continue_on_save_error:
            logger.warning("%s; training goes on without it (--continue_on_save_error)", message)
            return
        raise SaveFailed(f"{message}. {save_failed_hint(self.run_dir)}") from error

    def write_file(self, path: Path, text: str) -> None:
        """``text`` into ``path`` (its folders made), a failure handled by :meth:`write_failed`."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        except OSError as error:
            self.write_failed(str(path), error)

    def print(self, text: str) -> None:
        """A progress line on rank 0's standard output."""
        if self.dist.is_main:
            print(text, flush=True)

    def over_processes(self, values: dict[str, float]) -> dict[str, float]:
        """One process: ``values`` as they are. Several: each key summed (:data:`SUMMED_OVER_PROCESSES`) or
        averaged over the processes that have a finite value for it (one gather of every process's dict)."""
        if not self.dist.enabled:
            return values
        shares = self.dist.gather_objects({k: float(v) for k, v in values.items()})
        out = {}
        for key in dict.fromkeys(k for share in shares for k in share):
            finite = [share[key] for share in shares if key in share and np.isfinite(share[key])]
            if finite:
                if key in SUMMED_OVER_PROCESSES:
                    out[key] = float(np.sum(finite))
                elif key.endswith("_max"):  # a largest value (e.g. rollout/engine_logprob_gap_max) is the largest anywhere
                    out[key] = float(np.max(finite))
                else:
                    out[key] = float(np.mean(finite))
        return out

    def evaluation(self, result: dict, step: int, figures: dict[str, float], transcripts: list[dict]) -> None:
        """A held-out evaluation at ``step``: its accuracy and return, the per-role ``figures``, and its
        ``transcripts`` (``transcripts/eval_<step>.jsonl``, and as text in TensorBoard)."""
        self.writer.add_scalar("eval/accuracy", result["accuracy"], step)
        self.writer.add_scalar("eval/return", result["return"], step)
        for key, value in figures.items():
            self.writer.add_scalar(key, value, step)
        if self.dist.is_main and transcripts:
            path = self.run_dir / "transcripts" / f"eval_{step}.jsonl"
            try:
                text = write_transcripts(path, transcripts)
            except OSError as error:
                self.write_failed(str(path), error)
                return
            self.writer.add_text("eval/transcripts", text, step)


class NullWriter:
    """Stands in for TensorBoard's ``SummaryWriter`` on the processes other than rank 0."""

    def add_scalar(self, *args, **kwargs) -> None:
        pass

    def add_text(self, *args, **kwargs) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def loss_tags(metrics: dict[str, float]) -> dict[str, float]:
    """``agent_<role>/policy_loss`` → ``losses/agent_<role>/policy_loss``; NaN entries dropped."""
    return {f"losses/{k}": v for k, v in metrics.items() if v == v}


def markdown_table(config: dict) -> str:
    """A run config (sections of fields) as a two-column markdown table, for TensorBoard's text tab."""
    rows = [f"|{section}.{name}|{value}|" for section, fields in config.items() for name, value in fields.items()]
    return "|param|value|\n|-|-|\n" + "\n".join(rows)
