"""One sandboxed run of ``harness.py``: limits, a uid of its own, launch, events, clean-up.

A run is one fresh ``python3 -I -S harness.py`` process in its own session, started with an
empty environment apart from ``PATH``/``LANG``. As root (the normal case in containers) the
harness builds the sandbox before any program code runs:

==================  ===========================================================================
resource limits     CPU seconds, address space, processes, file size, open files, no core files
network             a new, empty network namespace (no interface is up: every connect fails)
file system         a new mount namespace; the working directory is a size-limited tmpfs over a
                    fresh ``mkdtemp()`` folder; ``/tmp``, ``/var/tmp``, ``/dev/shm``, ``/run/lock``
                    are read-only; everything else is protected by file permissions
user                an unprivileged uid/gid of its own per concurrent run (a *slot*, held with
                    ``flock`` so concurrent graders never share one), ``no_new_privs`` set
processes           ``RLIMIT_NPROC`` counts per uid and root is exempt from it, so the uid drop
                    is what makes the limit real; after the run every process of the slot's uid
                    is killed (``kill -KILL -1`` run as that uid), wherever it moved (new
                    session, double fork); the wall clock kills the process group
==================  ===========================================================================

Not root: no uid drop, so ``RLIMIT_NPROC`` counts the grader's own processes and the program
can signal processes of the grader's uid; a user namespace (where the kernel allows one)
still gives an empty network namespace. The first run logs what was isolated
(``Isolation``).
"""

from __future__ import annotations

import fcntl
import json
import logging
import marshal
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

logger = logging.getLogger(__name__)

HARNESS = Path(__file__).resolve().parent / "harness.py"
SLOT_UID_BASE = 1_900_000_000
"""Slot ``k`` runs as uid = gid = ``SLOT_UID_BASE + k`` (ids no account uses)."""
MAX_SLOTS = 256
SANDBOX_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
"""The whole environment of a sandboxed process: nothing of the grader's is passed on."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed program run (all of its tests)."""

    timeout_s: float = 4.0
    """Wall-clock seconds per test (and for a function program's top level)."""
    memory_mb: int = 1024
    """Address-space limit (``RLIMIT_AS``) in MiB."""
    processes: int = 32
    """Processes and threads the program's uid may have at once (``RLIMIT_NPROC``)."""
    file_bytes: int = 8 << 20
    """Largest file the program may write, and the cap on one test's captured stdout."""
    disk_bytes: int = 32 << 20
    """Size of the tmpfs working directory (all files together)."""
    open_files: int = 64
    """Open file descriptors (``RLIMIT_NOFILE``)."""
    stderr_bytes: int = 2000
    """How much of a test's stderr (its end) is kept."""
    startup_s: float = 20.0
    """Wall-clock seconds the harness may take to start and build the sandbox."""
    max_total_s: float = 120.0
    """Wall-clock budget for all tests of one program; tests not reached by then time out."""
    max_restarts: int = 8
    """Fresh harness processes after one died mid-test (``os._exit``, a kill), before giving up."""

    def __post_init__(self):
        if self.timeout_s <= 0 or self.memory_mb < 64 or self.processes < 1 or self.file_bytes < 1024:
            raise ValueError(f"unusable sandbox limits: {self}")

    def cpu_seconds(self, n_tests: int) -> int:
        """``RLIMIT_CPU`` for a run of ``n_tests`` tests (their time limits plus start-up)."""
        return int(self.timeout_s * (n_tests + 1)) + 2


@dataclass(frozen=True)
class Isolation:
    """What the sandbox isolates on this machine (reported by the harness of the first run)."""

    network: bool
    """A new, empty network namespace."""
    mounts: bool
    """A mount namespace: tmpfs working directory, shared temp folders read-only."""
    uid: bool
    """An unprivileged uid of its own (so the process limit holds and nothing of the grader's can be signalled)."""

    def describe(self) -> str:
        """One line naming what is and is not isolated."""
        missing = {
            "network": "network NOT isolated (no network namespace): programs can open sockets",
            "mounts": "file system NOT private (no mount namespace): programs may write to /tmp and files their uid can write",
            "uid": "uid NOT dropped (grader is not root): RLIMIT_NPROC counts the grader's processes, programs can signal them",
        }
        parts = [missing[name] for name in ("network", "mounts", "uid") if not getattr(self, name)]
        return "sandbox isolation: " + ("full (network, mounts, uid)" if not parts else "; ".join(parts))


_isolation_logged = threading.Event()


@lru_cache(maxsize=1)
def sandbox_python() -> str:
    """The interpreter for sandboxed programs.

    ``$MARFT_SANDBOX_PYTHON`` if set; else this interpreter when the unprivileged sandbox uid can
    read its standard library; else the first such system ``python3``. (A pyenv or conda Python
    under ``/root`` cannot import anything once the uid is dropped.)
    """
    if os.environ.get("MARFT_SANDBOX_PYTHON"):
        return os.environ["MARFT_SANDBOX_PYTHON"]
    candidates = [sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"]
    if os.geteuid() != 0:
        return sys.executable
    for candidate in candidates:
        if os.path.isfile(candidate) and _world_readable(candidate) and _stdlib_world_readable(candidate):
            return candidate
    logger.warning("no python3 whose standard library other users can read; programs may fail to import modules")
    return sys.executable


def _world_readable(path: str) -> bool:
    """Every folder on the way is world-searchable and the target world-readable."""
    real = Path(os.path.realpath(path))
    for folder in real.parents:
        if not os.stat(folder).st_mode & 0o001:
            return False
    return bool(os.stat(real).st_mode & 0o004)


def _stdlib_world_readable(python: str) -> bool:
    try:
        out = subprocess.run([python, "-I", "-S", "-c", "import os; print(os.__file__)"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and _world_readable(out.stdout.strip())


_checked_slots: set[int] = set()
"""Slot uids this process has already cleaned up once (later runs clean up after themselves)."""


class Slot:
    """An unprivileged uid held exclusively (``flock``) while one program runs, and the folder its
    private tmpfs is mounted on; ``uid == -1`` and no folder when not root.

    The folder is the slot's for good (``<tmp>/marft-sandbox-slots/<k>.d``): it stays empty on the
    host, as each run mounts a fresh tmpfs on it inside its own mount namespace. (Removing a folder
    that was a mount point in another namespace waits for an RCU grace period, ~30 ms per run.)
    """

    def __init__(self):
        self.uid, self.workdir, self._lock = -1, None, None
        if os.geteuid() != 0:
            return
        folder = Path(tempfile.gettempdir()) / "marft-sandbox-slots"
        folder.mkdir(mode=0o711, exist_ok=True)  # searchable, so a program can resolve its cwd's absolute path
        for k in range(MAX_SLOTS):
            fd = os.open(folder / f"{k}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.uid, self._lock = SLOT_UID_BASE + k, fd
            self.workdir = folder / f"{k}.d"
            if self.uid not in _checked_slots:  # first use here: a crashed grader may have left processes and files
                kill_uid(self.uid)
                wait_until_gone(self.uid)
                shutil.rmtree(self.workdir, ignore_errors=True)
                self.workdir.mkdir(mode=0o700)
                os.chown(self.workdir, self.uid, self.uid)
                _checked_slots.add(self.uid)
            return
        raise RuntimeError(f"all {MAX_SLOTS} sandbox slots are busy")

    def release(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def __enter__(self) -> "Slot":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid`` (``kill -KILL -1`` run as ``uid`` reaches them all, and only them)."""
    if uid <= 0:
        return
    subprocess.run(["kill", "-KILL", "-1"], user=uid, group=uid, extra_groups=[], env=SANDBOX_ENV,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)


def wait_until_gone(uid: int, timeout_s: float = 5.0) -> bool:
    """Wait until no process of ``uid`` is left, zombies included (they count against ``RLIMIT_NPROC``
    until reaped); kill again meanwhile. Returns whether they all went."""
    deadline = time.monotonic() + timeout_s
    while processes_of_uid(uid, zombies=True):
        if time.monotonic() > deadline:
            logger.warning("processes of sandbox uid %d are still there after %.0f s", uid, timeout_s)
            return False
        kill_uid(uid)
        time.sleep(0.01)
    return True


def process_statuses():
    """``(pid, {field: value})`` of every process in ``/proc/<pid>/status`` (processes that vanish are skipped)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        yield int(entry), {k: v.strip() for k, v in (line.split(":", 1) for line in status.splitlines() if ":" in line)}


def is_dead(fields: dict) -> bool:
    """A zombie or dead process (its ``State`` is Z or X)."""
    return fields.get("State", "").startswith(("Z", "X"))


def processes_of_uid(uid: int, zombies: bool = False) -> list[int]:
    """Processes whose real uid is ``uid``, read from ``/proc`` (zombies only when asked)."""
    return [pid for pid, fields in process_statuses()
            if int(fields.get("Uid", "-1 0").split()[0]) == uid and (zombies or not is_dead(fields))]


@dataclass
class RunResult:
    """What one harness process reported before it ended."""

    done: dict[int, dict] = field(default_factory=dict)
    """``done`` events by test index."""
    current: int | None = None
    """The test started but not reported when the process ended (``None``: none)."""
    in_setup: bool = False
    """It ended while running a function program's top level (before any test)."""
    end: str = "finished"
    """How it ended: ``finished``, ``setup_failed``, ``timeout`` (killed by the wall clock),
    ``budget`` (total budget spent), ``died`` (exited or was killed without finishing)."""
    end_status: str = "error"
    """The status the unreported test gets (e.g. ``timeout`` for SIGXCPU)."""
    stderr: str = ""
    """stderr of the setup failure, or of the harness itself when it died."""
    isolation: Isolation | None = None
    clean: bool = False
    """It finished or failed its setup without leaving processes behind (no need to wait for any to go)."""


class HarnessRun:
    """Launch one harness for ``job`` and follow its events until it ends (see ``RunResult``).

    Args:
        job: the harness job without the sandbox fields (program, kind, tests, start, ...).
        limits: the run's limits.
        deadline: ``time.monotonic()`` value after which nothing more may run.
    """

    def __init__(self, job: dict, limits: SandboxLimits, deadline: float):
        self.job, self.limits, self.deadline = job, limits, deadline
        self.result = RunResult()
        self._nonce = secrets.token_hex(16).encode()
        self._buffer = bytearray()

    def run(self) -> RunResult:
        with Slot() as slot:
            workdir = str(slot.workdir) if slot.workdir else tempfile.mkdtemp(prefix="marft-sandbox-")
            read_fd, write_fd = os.pipe()
            err_fd = os.memfd_create("harness-stderr")
            proc = None
            try:
                job = {**self.job, "nonce": self._nonce.decode(), "channel_fd": write_fd, "workdir": workdir,
                       "uid": slot.uid, "gid": slot.uid, "grader_pid": os.getpid(), "stderr_bytes": self.limits.stderr_bytes, "timeout_s": self.limits.timeout_s,
                       "limits": {"cpu_s": self.limits.cpu_seconds(len(self.job["tests"])), "memory_mb": self.limits.memory_mb,
                                  "file_bytes": self.limits.file_bytes, "disk_bytes": self.limits.disk_bytes,
                                  "open_files": self.limits.open_files, "processes": self.limits.processes}}
                proc = subprocess.Popen([sandbox_python(), "-I", "-S", str(HARNESS)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                        stderr=err_fd, pass_fds=(write_fd,), env=SANDBOX_ENV, cwd="/", start_new_session=True)
                os.close(write_fd)
                write_fd = -1
                self._send_job(proc, marshal.dumps(job))
                self._follow(proc, read_fd)
                if self.result.end == "died":
                    self.result.stderr = _tail(err_fd, self.limits.stderr_bytes)
            finally:
                if proc is not None:
                    _kill_group(proc)
                kill_uid(slot.uid)
                if not self.result.clean:
                    wait_until_gone(slot.uid)
                for fd in (read_fd, write_fd, err_fd):
                    if fd >= 0:
                        os.close(fd)
                _clean_workdir(workdir, keep=slot.workdir is not None)
        return self.result

    @staticmethod
    def _send_job(proc: subprocess.Popen, data: bytes) -> None:
        try:
            proc.stdin.write(data)
            proc.stdin.close()
        except BrokenPipeError:  # it died before reading its job; _follow reports it
            pass

    def _follow(self, proc: subprocess.Popen, read_fd: int) -> None:
        """Read events until the process ends; kill it at the per-test or total deadline."""
        pidfd = os.pidfd_open(proc.pid)
        poller = select.poll()
        poller.register(read_fd, select.POLLIN)
        poller.register(pidfd, select.POLLIN)
        test_deadline = time.monotonic() + self.limits.startup_s
        grace = max(1.0, 0.5 * self.limits.timeout_s)
        try:
            while True:
                now = time.monotonic()
                limit = min(test_deadline, self.deadline)
                if now >= limit:
                    _kill_group(proc)
                    self.result.end = "timeout" if limit == test_deadline else "budget"
                    self.result.end_status = "timeout"
                    return
                for fd, _ in poller.poll(max(1, int((limit - now) * 1000))):
                    if fd == read_fd:
                        data = os.read(read_fd, 1 << 16)
                        if not data:
                            poller.unregister(read_fd)
                        elif self._take(data):
                            test_deadline = time.monotonic() + self.limits.timeout_s + grace
                    elif fd == pidfd:
                        proc.wait()
                        os.set_blocking(read_fd, False)
                        self._drain(read_fd)
                        self._ended(proc.returncode)
                        return
        finally:
            os.close(pidfd)

    def _drain(self, read_fd: int) -> None:
        while True:
            try:
                data = os.read(read_fd, 1 << 16)
            except BlockingIOError:
                return
            if not data:
                return
            self._take(data)

    def _take(self, data: bytes) -> bool:
        """Parse complete event lines; returns whether a test started or ended (the clock restarts)."""
        self._buffer += data
        restarted = False
        while b"\n" in self._buffer:
            line, _, rest = bytes(self._buffer).partition(b"\n")
            self._buffer = bytearray(rest)
            restarted |= self._event(line)
        if len(self._buffer) > 4 * self.limits.file_bytes + (1 << 20):
            self._buffer.clear()  # an endless line: not the harness's
        return restarted

    def _event(self, line: bytes) -> bool:
        nonce, _, payload = line.partition(b" ")
        if nonce != self._nonce or self.result.end != "finished":
            return False
        try:
            event = json.loads(payload)
        except ValueError:
            return False
        kind, result = event.get("event"), self.result
        if kind == "ready" and result.isolation is None:
            result.isolation = Isolation(**{k: bool(event["isolated"][k]) for k in ("network", "mounts", "uid")})
            if not _isolation_logged.is_set():
                _isolation_logged.set()
                (logger.info if all(vars(result.isolation).values()) else logger.warning)(result.isolation.describe())
        elif kind == "start":
            result.current, result.in_setup = int(event["i"]), bool(event.get("setup"))
            return True
        elif kind == "done":
            result.done[int(event["i"])] = event
            result.current, result.in_setup = None, False
            return True
        elif kind == "setup_failed":
            result.end, result.end_status, result.stderr = "setup_failed", str(event["status"]), str(event.get("stderr", ""))
            result.clean = not event.get("leftovers", True)
        elif kind == "harness_error":
            logger.error("sandbox harness failed: %s", event.get("traceback", ""))
            result.stderr = "harness error: " + str(event.get("traceback", ""))[-self.limits.stderr_bytes:]
        elif kind == "finished":
            result.current = None
            result.clean = not event.get("leftovers", True)
        return False

    def _ended(self, returncode: int) -> None:
        result = self.result
        if result.end == "setup_failed":
            return
        if returncode == 0 and result.current is None and len(result.done) + self.job["start"] >= len(self.job["tests"]):
            return
        result.end = "died"
        result.end_status = {-signal.SIGXCPU: "timeout", -signal.SIGXFSZ: "output_limit"}.get(returncode, "error")


def _clean_workdir(workdir: str, keep: bool) -> None:
    """Remove the run's folder, or only what is in it when it is a slot's (it is already empty when
    the run had its own tmpfs on it)."""
    if not keep:
        shutil.rmtree(workdir, ignore_errors=True)
        return
    with os.scandir(workdir) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                os.unlink(entry.path)


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _tail(fd: int, n: int) -> str:
    size = os.fstat(fd).st_size
    return os.pread(fd, n, max(0, size - n)).decode("utf-8", "replace")
