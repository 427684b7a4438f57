"""What the ``marft`` subcommands share: a parser whose errors are one line, logging, and turning expected
failures (bad input, a missing checkpoint) into one ``error:`` line and exit code 2."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

from marft.config import OneLineErrorParser
from marft.faults import ExitCode


def parser(prog: str, description: str) -> OneLineErrorParser:
    return OneLineErrorParser(prog=prog, description=description)


def run(job: Callable[[], int]) -> int:
    """``job()``; an ``OSError`` / ``ValueError`` (a missing file, bad input, a bad checkpoint) becomes one line."""
    from marft.faults import CheckpointError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    try:
        return job()
    except (OSError, ValueError, CheckpointError) as error:
        print(f"error: {error}", file=sys.stderr)
        return ExitCode.BAD_INPUT


def int_list(text: str) -> list[int]:
    """``"1,4,8"`` → ``[1, 4, 8]``."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values
