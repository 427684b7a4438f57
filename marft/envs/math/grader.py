"""Grading a reply against a reference answer with math-verify, under a hard time limit.

Only the content of the reply's LAST ``\\boxed{...}`` (or ``\\fbox{...}``, or
``\\boxed 5``) counts; a reply without a box is wrong, whatever numbers it mentions.
The reference may be bare (``17``, ``\\frac{1}{2}``, ``(3, \\frac{\\pi}{2})``) or boxed.

Both sides are parsed by math-verify as ``$\\boxed{<content>}$`` and compared with
``math_verify.verify``. Parsing and comparing run in a persistent worker
subprocess (``python`` running this file's ``_serve``), because math-verify's own
timeouts use SIGALRM and fail off the main thread: each check has a deadline in
the parent, and a worker that misses it is killed and restarted (the check
counts as wrong and as a timeout). Identical strings are accepted without asking
the worker.

Use ``grade_answer`` / ``grade_answers`` (a process-wide ``MathGrader``) and read
its counters with ``grader_stats()``.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import select
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass

logger = logging.getLogger(__name__)

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``/``\\fbox{...}`` in ``text`` (nested braces kept).

    ``\\boxed 5`` (no braces) yields the token after the space, up to whitespace or ``$``.

    Returns:
        str | None: the stripped content, or ``None`` if there is no complete box
        (no box at all, or its braces are unbalanced).
    """
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    cmd = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    rest = text[start + len(cmd) :]
    if rest.startswith("{"):
        depth = 0
        for i, ch in enumerate(rest):
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    return rest[1:i].strip()
        return None
    spaced = re.match(r"\s+([^\s$]+)", rest)
    return spaced.group(1) if spaced else None


def normalize_reference(ground_truth: str) -> str:
    """The reference answer as bare LaTeX: the last box's content if boxed, else without ``$`` delimiters."""
    text = str(ground_truth).strip()
    boxed = last_boxed(text) if any(cmd in text for cmd in _BOX_COMMANDS) else None
    if boxed is not None:
        return boxed
    while len(text) >= 2 and text.startswith("$") and text.endswith("$"):
        text = text[1:-1].strip()
    return text


# --------------------------------------------------------------------------- worker side


def _math_verify_check(prediction: str, reference: str) -> bool:
    """Is the boxed ``prediction`` equivalent to ``reference``? (runs in the worker)"""
    from math_verify import LatexExtractionConfig, parse, verify

    config = [LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)]
    gold = parse(f"$\\boxed{{{reference}}}$", config, parsing_timeout=None)
    pred = parse(f"$\\boxed{{{prediction}}}$", config, parsing_timeout=None)
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=None))


def _serve(check=_math_verify_check) -> None:
    """Worker loop: read ``{"pairs": [[pred, ref], ...]}`` lines, write ``[ok, error]`` per pair.

    Writes ``"ready"`` once imports are done. Exits when stdin closes, and quietly when the trainer is gone
    (killed while this worker was answering: a broken pipe).
    """
    try:
        _answer(check)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # nothing to flush to at exit either


def _answer(check) -> None:
    if check is _math_verify_check:
        import math_verify.grader
        import math_verify.parser

        # We enforce time limits ourselves; silence math-verify's "timeout is disabled" warning.
        math_verify.parser.TIMEOUT_WARNING_SHOWN = True
        math_verify.grader.TIMEOUT_WARNING_SHOWN = True
    out = sys.stdout
    sys.stdout = sys.stderr  # stray prints from libraries must not corrupt the protocol
    check("1", "1")  # warm up sympy / the parser caches before saying ready
    out.write('"ready"\n')
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        for prediction, reference in request["pairs"]:
            try:
                result = [bool(check(prediction, reference)), None]
            except Exception as e:  # noqa: BLE001 - any failure is a wrong answer, reported upward
                result = [False, f"{type(e).__name__}: {e}"]
            out.write(json.dumps(result) + "\n")
            out.flush()


# Loads this file as a standalone module (no marft package import, nothing shadowed on sys.path).
_BOOTSTRAP = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('marft_grader_worker', sys.argv[1])\n"
    "module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(module)\n"
    "module._serve()\n"
)


def default_worker_command() -> list[str]:
    """The command that starts a grading worker."""
    return [sys.executable, "-c", _BOOTSTRAP, os.path.abspath(__file__)]


# --------------------------------------------------------------------------- parent side


@dataclass
class GraderStats:
    """Counters of a ``MathGrader``, for a runner to log (``asdict(stats)``)."""

    checks: int = 0
    """Replies graded, including ones decided without the worker."""
    shortcuts: int = 0
    """Checks decided without the worker (no box, or identical strings)."""
    timeouts: int = 0
    """Checks that hit the time limit (graded wrong; the worker was restarted)."""
    errors: int = 0
    """Checks where parsing/verifying raised or the worker died (graded wrong)."""
    restarts: int = 0
    """Worker processes started after the first one."""


class GraderWorkerError(RuntimeError):
    """The grading worker could not be started."""


class MathGrader:
    """Grades replies in a worker subprocess with a per-check deadline. Thread-safe.

    Args:
        timeout_s: hard limit for one check (parse both sides + compare).
        startup_timeout_s: limit for the worker to import math-verify and say ready.
        worker_command: argv that starts a worker (tests pass a fake one).
        shortcut: accept identical strings without asking the worker.
    """

    def __init__(
        self,
        timeout_s: float = 5.0,
        startup_timeout_s: float = 120.0,
        worker_command: list[str] | None = None,
        shortcut: bool = True,
    ):
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.worker_command = worker_command or default_worker_command()
        self.shortcut = shortcut
        self.stats = GraderStats()
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._pid = os.getpid()
        self._buffer = b""
        self._ended = False
        """Whether the last :meth:`_read_line` that gave no line met the end of the worker's output (not its deadline)."""
        self._started = 0

    # ---- public API

    def grade(self, response: str, ground_truth: str) -> bool:
        """Is the last boxed answer of ``response`` equivalent to ``ground_truth``?"""
        return self.grade_many([response], [ground_truth])[0]

    def grade_many(self, responses: list[str], ground_truths: list[str]) -> list[bool]:
        """Grade many pairs in one round trip to the worker.

        Returns:
            list[bool]: one verdict per pair; a timeout or error counts as ``False``.
        """
        if len(responses) != len(ground_truths):
            raise ValueError(f"got {len(responses)} responses but {len(ground_truths)} ground truths")
        with self._lock:
            verdicts: list[bool] = [False] * len(responses)
            todo: list[tuple[int, str, str]] = []
            for i, (response, truth) in enumerate(zip(responses, ground_truths)):
                self.stats.checks += 1
                prediction = last_boxed(response or "")
                reference = normalize_reference(truth)
                if prediction is None or not prediction or not reference:
                    self.stats.shortcuts += 1
                elif self.shortcut and prediction == reference:
                    self.stats.shortcuts += 1
                    verdicts[i] = True
                else:
                    todo.append((i, prediction, reference))
            while todo:
                todo = self._run_batch(todo, verdicts)
            return verdicts

    def close(self) -> None:
        """Stop the worker (a later check starts a new one)."""
        with self._lock:
            self._kill()

    # ---- worker management

    def _ensure_worker(self) -> subprocess.Popen:
        if self._pid != os.getpid():  # we were forked: the pipes belong to the parent process
            self._proc, self._buffer, self._pid = None, b"", os.getpid()
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        if self._proc is not None:
            self._kill()
        if self._started:
            self.stats.restarts += 1
        self._started += 1
        self._proc = subprocess.Popen(  # its own session: a Ctrl-C meant for the trainer (which stops at a phase
            # boundary, still grading) does not kill it; it exits when the trainer closes its stdin or dies
            self.worker_command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, bufsize=0, start_new_session=True
        )
        self._buffer = b""
        line = self._read_line(self.startup_timeout_s)
        if line != '"ready"':
            self._kill()
            raise GraderWorkerError(
                f"grading worker did not start (got {line!r}); check that math-verify is installed: "
                f"{' '.join(self.worker_command[:2])} ..."
            )
        return self._proc

    def _kill(self) -> None:
        if self._proc is not None:
            try:
                self._proc.kill()
                self._proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
            for stream in (self._proc.stdin, self._proc.stdout):
                try:
                    stream.close()
                except OSError:
                    pass
        self._proc, self._buffer = None, b""

    def _read_line(self, timeout_s: float) -> str | None:
        """Next line from the worker, or ``None`` on timeout or end of stream (``self._ended`` says which)."""
        deadline = time.monotonic() + timeout_s
        fd = self._proc.stdout.fileno()
        self._ended = False
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self._ended = True  # the worker closed its output: it died (its exit may not be reaped yet)
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode("utf-8")

    def _run_batch(self, todo: list[tuple[int, str, str]], verdicts: list[bool]) -> list[tuple[int, str, str]]:
        """Send ``todo`` to the worker and fill ``verdicts``; return what is left after a hang or crash."""
        proc = self._ensure_worker()
        request = json.dumps({"pairs": [[p, r] for _, p, r in todo]}) + "\n"
        try:
            proc.stdin.write(request.encode("utf-8"))
            proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the read below sees end of stream and handles it as a crash
        for k, (i, prediction, reference) in enumerate(todo):
            line = self._read_line(self.timeout_s)
            if line is None:
                timed_out = not self._ended  # not proc.poll(): a process that closed its output may not have exited yet
                if timed_out:
                    self.stats.timeouts += 1
                else:
                    self.stats.errors += 1
                logger.warning(
                    "grading %s (graded wrong, worker restarted): prediction %r vs reference %r",
                    f"timed out after {self.timeout_s:.1f}s" if timed_out else "worker died",
                    prediction[:200],
                    reference[:200],
                )
                self._kill()
                return todo[k + 1 :]
            try:
                ok, error = json.loads(line)
            except ValueError:
                self.stats.errors += 1
                logger.warning("grading worker sent %r (graded wrong, worker restarted)", line[:200])
                self._kill()
                return todo[k + 1 :]
            if error is not None:
                self.stats.errors += 1
                logger.warning("grading error (graded wrong): %s; prediction %r vs reference %r", error, prediction[:200], reference[:200])
            verdicts[i] = bool(ok)
        return []


_default_grader: MathGrader | None = None
_default_lock = threading.Lock()


def default_grader() -> MathGrader:
    """The process-wide grader used by ``grade_answer`` and ``MathEnv``."""
    global _default_grader
    with _default_lock:
        if _default_grader is None:
            _default_grader = MathGrader()
            atexit.register(_default_grader.close)
        return _default_grader


def grade_answer(response: str, ground_truth: str) -> bool:
    """Is the last ``\\boxed{}`` of ``response`` equivalent to ``ground_truth``?

    Returns:
        bool: ``False`` when there is no box, the answers differ, or the check timed out / failed.
    """
    return default_grader().grade(response, ground_truth)


def grade_answers(responses: list[str], ground_truths: list[str]) -> list[bool]:
    """``grade_answer`` for many pairs in one round trip to the worker.

    Returns:
        list[bool]: one verdict per pair.
    """
    return default_grader().grade_many(responses, ground_truths)


def grader_stats() -> dict[str, int]:
    """Counters of the process-wide grader (checks, shortcuts, timeouts, errors, restarts)."""
    return asdict(default_grader().stats)
