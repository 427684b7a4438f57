"""What the ``marft`` subcommands share: a parser whose errors are one line, logging, and turning expected
failures (bad input, a missing checkpoint) into one ``error:`` line and exit code 2."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

from marft.config import OneLineErrorParser
from marft.faults import CheckpointError, ExitCode
from marft.runner.shared.checkpoint import trained_checkpoint


def parser(prog: str, description: str) -> OneLineErrorParser:
    return OneLineErrorParser(prog=prog, description=description)


def run(job: Callable[[], int]) -> int:
    """``job()``; an ``OSError`` / ``ValueError`` (a missing file, bad input, a bad checkpoint) becomes one line."""

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    try:
        return job()
    except (OSError, ValueError, CheckpointError) as error:
        print(f"error: {error}", file=sys.stderr)
        return ExitCode.BAD_INPUT


LOAD_PATH_HELP = ("a checkpoint folder (checkpoints/steps_<N> or checkpoints/best), or a run directory: its checkpoints/best "
                  "(the policy of the run's best moving training accuracy; --checkpoint latest: the newest steps_<N>)")


def add_checkpoint_flags(p: argparse.ArgumentParser, required: bool = True) -> None:
    """``--load_path`` and ``--checkpoint``, as ``marft eval | export | play`` take them."""
    p.add_argument("--load_path", required=required, help=LOAD_PATH_HELP)
    p.add_argument("--checkpoint", choices=("best", "latest"), default="best",
                   help="which checkpoint of a run directory: best (default; the latest when the run has none) or latest")


def chosen_checkpoint(prog: str, load_path: str, which: str) -> str:
    """The checkpoint folder ``prog`` takes from ``--load_path`` / ``--checkpoint``, said on stderr in one line."""

    path, line = trained_checkpoint(load_path, which)
    print(f"{prog}: checkpoint {line}", file=sys.stderr, flush=True)
    return str(path)


def int_list(text: str) -> list[int]:
    """``"1,4,8"`` → ``[1, 4, 8]``."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values
