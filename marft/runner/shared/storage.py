"""The run directory's disk: free space, an early warning, and log writers that fail in one clear line.

A full disk (``ENOSPC``), an exhausted quota (``EDQUOT``) or any other write error while saving a checkpoint
or writing logs ends in one message naming what could not be written, the free space there and the last
complete checkpoint; the runner then stops cleanly (exit code 74) or, with ``--continue_on_save_error``,
warns and trains on.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)


def free_bytes(path: str | Path) -> int | None:
    """Free bytes (for this user) on the file system holding ``path`` or its nearest existing parent; None if unknown."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def human_bytes(n: int | None) -> str:
    if n is None:
        return "unknown"
    for unit in ("bytes", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def describe_write_error(error: BaseException) -> str:
    """``"OSError: [Errno 28] No space left on device"``; torch's opaque full-disk error gets a gloss."""
    text = f"{type(error).__name__}: {error}"
    if "iostream error" in str(error) or "file write failed" in str(error):
        text += " (torch could not write the file: usually a full disk or quota)"
    return text


def expected_checkpoint_bytes(team) -> int:
    """About how many bytes one checkpoint of ``team`` takes: its adapters' and value heads' weights and two
    Adam moments per weight (float32), plus a little for JSON and the manifest."""
    parameters = [p for n, p in team.model.named_parameters() if "lora_" in n]
    parameters += list(team.critic.value_heads.parameters()) if team.critic else []
    weights = sum(p.numel() * p.element_size() for p in parameters)
    moments = sum(2 * p.numel() * 4 for p in parameters)
    return weights + moments + 64 * 1024


def warn_if_low_space(folder: Path, checkpoint_bytes: int, keep: int) -> bool:
    """Log a warning when ``folder``'s disk cannot hold the checkpoints the run will keep at once
    (``keep`` + the one being written; ``keep`` 0 counts as 2); return whether it warned."""
    free = free_bytes(folder)
    at_once = (keep or 2) + 1
    if free is None or free >= at_once * checkpoint_bytes:
        return False
    logger.warning(
        "only %s free on the disk of %s: one checkpoint takes about %s and up to %d exist at once (--keep_checkpoints %d + the one "
        "being written); saves may fail (they would stop training cleanly, or warn with --continue_on_save_error)",
        human_bytes(free), folder, human_bytes(checkpoint_bytes), at_once, keep,
    )
    return True


class GuardedWriter:
    """A TensorBoard ``SummaryWriter`` (or any writer with ``add_scalar``, ``add_text``, ``flush``, ``close``) whose
    write errors, raised by the writer itself or by its background thread on a later call, go to ``on_error(what,
    error)`` instead of escaping as tracebacks. After one error, ``on_error`` decides: raise (stop the run) or
    return (the writer then drops everything, so one warning is all)."""

    def __init__(self, make_writer: Callable[[], object], log_dir: Path, on_error: Callable[[str, BaseException], None]):
        self.log_dir = Path(log_dir)
        self.on_error = on_error
        self.writer = None
        self._call(lambda: setattr(self, "writer", make_writer()))

    def _call(self, fn):
        try:
            return fn()
        except Exception as error:  # noqa: BLE001 - OSError, or the writer thread's error re-raised
            broken, self.writer = self.writer, None
            if broken is not None:
                try:
                    broken.close()
                except Exception:  # noqa: BLE001 - the disk is full: closing may fail the same way
                    pass
            self.on_error(f"TensorBoard logs in {self.log_dir}", error)
            return None

    def add_scalar(self, *args, **kwargs) -> None:
        if self.writer is not None:
            self._call(lambda: self.writer.add_scalar(*args, **kwargs))

    def add_text(self, *args, **kwargs) -> None:
        if self.writer is not None:
            self._call(lambda: self.writer.add_text(*args, **kwargs))

    def flush(self) -> None:
        if self.writer is not None:
            self._call(lambda: self.writer.flush())

    def close(self) -> None:
        if self.writer is not None:
            self._call(lambda: self.writer.close())
            self.writer = None
