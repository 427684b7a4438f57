"""``marft train`` / ``scripts/train_math.sh`` / ``python -m marft.launch``: training from the command line.

Parses the flags (or ``--config run.yaml``), takes the flags not given from the checkpoint when resuming, validates
every input before the model loads, trains (:mod:`marft.launch`) and returns an exit code
(:class:`~marft.faults.ExitCode`).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional

from marft import launch
from marft.config import parse_config
from marft.distributed import shutdown_distributed, world_size_from_env
from marft.faults import CheckpointError, ExitCode, Preempted, SaveFailed, TrainingStopped
from marft.runner.shared.checkpoint import resume_config
from marft.runner.shared.preemption import ignore_stop_signals


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m marft.launch [flags]``; returns an :class:`~marft.faults.ExitCode` (0 done, 1 training stopped,
    2 bad input, 74 a checkpoint or log could not be written, 75 stopped by a signal after a checkpoint)."""

    rank = int(os.environ.get("RANK", "0")) if world_size_from_env() > 1 else 0
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,  # rank 0 tells the story; the others warn only
        format="%(asctime)s %(levelname)s %(name)s: %(message)s" if rank == 0 else f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    config, given = parse_config(argv)
    try:
        if config.runner.load_path:
            config = resume_config(config, given)  # flags not given come from the checkpoint
        validated = launch.validate(config)
    except (OSError, ValueError) as error:  # FileNotFoundError, PermissionError, IsADirectoryError ... name their file
        print(f"error: {error}", file=sys.stderr)
        return ExitCode.BAD_INPUT

    try:
        runner = launch.build_runner(config, validated)
    except (OSError, ValueError) as error:  # what only the loaded model can tell (e.g. --lora_target_modules it lacks)
        print(f"error: {error}", file=sys.stderr)
        return ExitCode.BAD_INPUT

    try:
        summary = launch.run_training(runner)
    except Preempted as stop:
        print(f"stopped: {stop}", file=sys.stderr)
        return ExitCode.PREEMPTED
    except SaveFailed as error:
        print(f"error: {error}", file=sys.stderr)
        return ExitCode.SAVE_FAILED
    except (CheckpointError, TrainingStopped) as error:
        print(f"error: {error}", file=sys.stderr)
        return ExitCode.TRAINING_STOPPED
    finally:
        shutdown_distributed()  # every rank, however training ended
    if rank != 0:
        return ExitCode.OK
    print(
        f"done in {summary['seconds']:.0f}s: accuracy {summary['accuracy_before']:.3f} -> {summary['accuracy_after']:.3f}; "
        f"run directory {summary['run_dir']}",
        flush=True,
    )
    return ExitCode.OK


def run_main(argv: Optional[list[str]] = None) -> int:
    """:func:`main`, then stop signals ignored until the process exits (``python -m marft.launch``, ``marft train``)."""

    code = main(argv)
    ignore_stop_signals()  # trained and saved (or stopped and saved): a late SIGTERM must not kill the exit
    return code


if __name__ == "__main__":
    sys.exit(run_main())
