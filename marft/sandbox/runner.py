"""One sandboxed run of a program: a uid and cgroups of its own, the driver process, its verdicts, clean-up.

A run is one fresh ``python3 -I -S <the harness folder>`` process (the trusted **driver**), started with an
empty environment apart from ``PATH``/``LANG``; it forks the **candidate** that runs the program
(see :mod:`marft.sandbox.harness`). As root (the normal case in containers) the candidate is sandboxed before
any program code runs:

==================  ===========================================================================
resource limits     CPU seconds, address space, processes, file size, open files, no core files
cgroup              memory (tmpfs and shared memory included, no swap), process count and CPU
                    cores (``SandboxLimits.cpus``, where the cpu controller is) of the whole program, per slot (``/sys/fs/cgroup/{memory,pids}/marft-sandbox/<k>``
                    on cgroup v1, ``/sys/fs/cgroup/marft-sandbox/<k>`` on v2)
namespaces          PID (the candidate is PID 1: its processes end with it), IPC, UTS, network
                    (no interface up), mount
file system         a minimal read-only root (system folders without site-packages, ``/dev``
                    nodes, its own ``/proc``) and a size-limited tmpfs ``/sandbox``
user                an unprivileged uid/gid of its own per concurrent run (a *slot*, held with
                    ``flock`` so concurrent graders never share one), ``no_new_privs``
seccomp             no namespaces, ptrace, System V IPC, sockets but AF_INET/AF_INET6, mounts, bpf,
                    io_uring, page-cache probes and advice, file locks, inotify
==================  ===========================================================================

After the run every process left in the slot's cgroups (or, without cgroups, of its uid) is killed.
Where a layer is unavailable (not root, no cgroup controllers, another architecture) the first
run logs a warning naming what is then not protected (``Isolation.describe``).
"""

from __future__ import annotations

import json
import logging
import marshal
import os
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

from marft.sandbox.slots import SANDBOX_ENV, Slot, kill_uid, wait_until_gone

logger = logging.getLogger(__name__)

HARNESS = Path(__file__).resolve().parent / "harness"
"""The harness: a folder Python runs by its ``__main__.py`` (standard library only)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed program run (all of its tests)."""

    timeout_s: float = 4.0
    """Wall-clock seconds per test (and for a function program's top level)."""
    memory_mb: int = 1024
    """Memory in MiB: the address space of each process (``RLIMIT_AS``) and, where cgroups are available,
    of the whole program (its processes, tmpfs files and shared memory together)."""
    processes: int = 32
    """Processes and threads the program may have at once (``RLIMIT_NPROC`` of its uid, and its pids cgroup)."""
    file_bytes: int = 8 << 20
    """Largest file the program may write, and the cap on one test's captured stdout."""
    disk_bytes: int = 32 << 20
    """Size of the tmpfs working directory (all files together)."""
    open_files: int = 64
    """Open file descriptors (``RLIMIT_NOFILE``)."""
    stderr_bytes: int = 2000
    """The longest feedback kept per test (an exception class and a line: never the program's own output)."""
    startup_s: float = 20.0
    """Wall-clock seconds the harness may take to start and build the sandbox."""
    max_total_s: float = 120.0
    """Wall-clock budget for all tests of one program; tests not reached by then time out."""
    max_restarts: int = 8
    """Fresh candidate processes after one died or timed out mid-test, before the remaining tests fail alike."""
    cpus: float = 1.0
    """CPU cores the whole program may use at once, its processes together (a cgroup CPU quota where available;
    ``RLIMIT_CPU`` and the wall clock hold per process and per test, so 32 processes could otherwise take 32 cores)."""

    def __post_init__(self):
        if self.timeout_s <= 0 or self.memory_mb < 64 or self.processes < 1 or self.file_bytes < 1024 or self.cpus < 0.01:
            raise ValueError(f"unusable sandbox limits: {self}")

    def cpu_seconds(self, n_tests: int) -> int:
        """``RLIMIT_CPU`` for a run of ``n_tests`` tests (their time limits plus start-up)."""
        return int(self.timeout_s * (n_tests + 1)) + 2


LAYERS = ("network", "mounts", "uid", "pid", "ipc", "cgroup", "filesystem", "seccomp")
NOT_PROTECTED = {
    "network": "network NOT isolated (no network namespace): programs can open sockets",
    "mounts": "file system NOT private (no mount namespace): programs may write to /tmp and files their uid can write",
    "uid": "uid NOT dropped (grader is not root): RLIMIT_NPROC counts the grader's processes, programs can signal them",
    "pid": "no PID namespace: programs see every process (/proc/<pid>/cmdline names datasets) and stray processes are found by uid only",
    "ipc": "no IPC namespace: System V shared memory outlives a run and is shared between programs",
    "cgroup": "no cgroup: memory and process limits hold per process, not per program",
    "filesystem": "no minimal root: everything the sandbox uid can read (datasets, venvs, the repository, host sockets) is readable",
    "seccomp": "no seccomp filter: programs may create user namespaces, ptrace, use SysV IPC and connect to UNIX sockets",
}


@dataclass(frozen=True)
class Isolation:
    """What the sandbox isolates on this machine (reported by the driver of the first run)."""

    network: bool
    """A new, empty network namespace."""
    mounts: bool
    """A mount namespace: a private tmpfs working directory."""
    uid: bool
    """An unprivileged uid of its own (so the process limit holds and nothing of the grader's can be signalled)."""
    pid: bool = False
    """A PID namespace: the program sees only its own processes, and they all end with it."""
    ipc: bool = False
    """An IPC namespace: System V and POSIX IPC objects are private and go with the run."""
    cgroup: bool = False
    """A cgroup capping memory (tmpfs and shared memory included) and processes of the whole program (and its
    CPU cores where the cpu controller is there: ``Cgroups.cpu``)."""
    filesystem: bool = False
    """A minimal read-only root: system folders without site-packages, its own /proc, a tmpfs /sandbox."""
    seccomp: bool = False
    """A seccomp filter denying namespaces, ptrace, SysV IPC, sockets but AF_INET/AF_INET6, mounts, bpf, io_uring,
    page-cache probes and advice, file locks and inotify."""

    def describe(self) -> str:
        """One line naming what is and is not isolated."""
        parts = [NOT_PROTECTED[name] for name in LAYERS if not getattr(self, name)]
        return "sandbox isolation: " + ("full (" + ", ".join(LAYERS) + ")" if not parts else "; ".join(parts))


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


@lru_cache(maxsize=1)
def filesystem_view() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(folders bound read-only into the minimal root, folders hidden under them)``.

    The system folders Python and its extension modules need, plus the sandbox interpreter's prefix
    when it lives elsewhere; every ``site-packages``/``dist-packages`` is hidden (installed data such as
    HumanEval's canonical solutions must not be readable; ``-I -S`` never imports from them anyway).
    """
    binds = [p for p in ("/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin") if os.path.lexists(p)]
    try:
        out = subprocess.run([sandbox_python(), "-I", "-S", "-c", "import sys; print(sys.base_prefix); print(sys.base_exec_prefix)"],
                             capture_output=True, text=True, timeout=30, env=SANDBOX_ENV)
        prefixes = {os.path.realpath(line) for line in out.stdout.split()} if out.returncode == 0 else set()
    except (OSError, subprocess.TimeoutExpired):
        prefixes = set()
    for prefix in sorted(prefixes):
        if not any(prefix == b or prefix.startswith(b + "/") for b in binds) and os.path.isdir(prefix):
            binds.append(prefix)
    hidden = set()
    for base in binds:
        if os.path.isdir(base) and not os.path.islink(base):
            for pattern in ("lib/python3*/site-packages", "lib/python3*/dist-packages", "lib/python3/dist-packages",
                            "local/lib/python3*/site-packages", "local/lib/python3*/dist-packages"):
                hidden.update(str(p) for p in Path(base).glob(pattern) if p.is_dir())
    return tuple(binds), tuple(sorted(hidden))


STATUSES = ("passed", "failed", "error", "timeout", "memory", "output_limit")


@dataclass
class RunResult:
    """What one driver reported before it ended (each test's verdict at most once, in order)."""

    statuses: dict[int, str] = field(default_factory=dict)
    """Verdict by test index (one of ``STATUSES``)."""
    errors: dict[int, str] = field(default_factory=dict)
    """Feedback by test index: the class of a builtin exception and the program's line, or ""."""
    end: str = "finished"
    """How it ended: ``finished``, ``setup_failed`` (the program's top level failed), ``timeout`` (killed by
    the backstop clock), ``budget`` (total budget spent), ``died`` (the driver ended without finishing),
    ``malformed`` (an event out of order or of the wrong type)."""
    end_status: str = "error"
    """The status every test without a verdict gets."""
    error: str = ""
    """Feedback for those tests (a setup failure's)."""
    isolation: Isolation | None = None


class HarnessRun:
    """Launch one driver for a program and follow its verdicts until it ends (see ``RunResult``).

    Args:
        job: ``{"kind", "program", "entry_point"}``: what the candidate process gets.
        tests: ``{"cases", "prompt", "code"}``: what only the trusted driver reads (inputs, expected outputs).
        limits: the run's limits.
        deadline: ``time.monotonic()`` value after which nothing more may run.
    """

    def __init__(self, job: dict, tests: dict, limits: SandboxLimits, deadline: float):
        self.job, self.tests, self.limits, self.deadline = job, tests, limits, deadline
        self.result = RunResult()
        self._buffer = bytearray()
        self._started: int | None = None
        self._next = 0

    def run(self) -> RunResult:
        with Slot() as slot:
            workdir = str(slot.workdir) if slot.workdir else tempfile.mkdtemp(prefix="marft-sandbox-")
            cgroups = slot.cgroups if slot.cgroups is not None and slot.cgroups.available else None
            if cgroups is not None:
                cgroups.set_limits(self.limits.memory_mb << 20, self.limits.processes, self.limits.cpus)
            binds, hidden = filesystem_view() if slot.uid > 0 else ((), ())
            read_fd, write_fd = event_pipe()
            err_fd = os.memfd_create("harness-stderr")
            proc = None
            try:
                header = {**self.job, "channel_fd": write_fd, "debug": logger.isEnabledFor(logging.DEBUG), "workdir": workdir, "uid": slot.uid, "gid": slot.uid,
                          "startup_s": self.limits.startup_s, "binds": list(binds), "hidden": list(hidden),
                          "cgroups": cgroups.procs if cgroups else [], "oom_events": cgroups.oom_events if cgroups else None,
                          "limits": {"cpu_s": self.limits.cpu_seconds(len(self.tests["cases"])), "memory_mb": self.limits.memory_mb,
                                     "file_bytes": self.limits.file_bytes, "disk_bytes": self.limits.disk_bytes,
                                     "open_files": self.limits.open_files, "processes": self.limits.processes,
                                     "timeout_s": self.limits.timeout_s, "max_restarts": self.limits.max_restarts,
                                     "max_total_s": max(0.0, self.deadline - time.monotonic())}}
                proc = subprocess.Popen([sandbox_python(), "-I", "-S", str(HARNESS)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                        stderr=err_fd, pass_fds=(write_fd,), env=SANDBOX_ENV, cwd="/", start_new_session=True)
                os.close(write_fd)
                write_fd = -1
                self._send_job(proc, _message(header) + _message(self.tests))
                self._follow(proc, read_fd)
                if logger.isEnabledFor(logging.DEBUG):
                    logger.debug("sandbox driver died: %s", _tail(err_fd, self.limits.stderr_bytes))
            finally:
                if proc is not None:
                    _kill_group(proc)
                if cgroups is not None:
                    cgroups.empty()
                else:
                    kill_uid(slot.uid)
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
        """Read events until the driver ends; kill it at the backstop clock or the total deadline."""
        pidfd = os.pidfd_open(proc.pid)
        poller = select.poll()
        poller.register(read_fd, select.POLLIN)
        poller.register(pidfd, select.POLLIN)
        backstop = self.limits.startup_s + 2 * self.limits.timeout_s + 2.0  # a fresh candidate, its top level, the test: the driver enforces each
        event_deadline = time.monotonic() + backstop
        try:
            while self.result.end == "finished":
                now = time.monotonic()
                limit = min(event_deadline, self.deadline)
                if now >= limit:
                    _kill_group(proc)
                    self.result.end = "timeout" if limit == event_deadline else "budget"
                    self.result.end_status = "timeout"
                    return
                for fd, _ in poller.poll(max(1, int((limit - now) * 1000))):
                    if fd == read_fd:
                        data = os.read(read_fd, 1 << 16)
                        if not data:
                            poller.unregister(read_fd)
                        elif self._take(data):
                            event_deadline = time.monotonic() + backstop
                    elif fd == pidfd:
                        proc.wait()
                        os.set_blocking(read_fd, False)
                        self._drain(read_fd)
                        if self.result.end == "finished" and (self._started is not None or self._next < len(self.tests["cases"])):
                            self.result.end = "died"
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
        """Take complete event lines; returns whether one arrived (the backstop clock restarts)."""
        self._buffer += data
        if len(self._buffer) > 1 << 20:  # no event of the driver is that long
            self._malformed("an event longer than 1 MiB")
            return False
        took = False
        while b"\n" in self._buffer and self.result.end == "finished":
            line, _, rest = bytes(self._buffer).partition(b"\n")
            self._buffer = bytearray(rest)
            try:
                event = json.loads(line)
                self._event(event)
            except Exception as e:  # noqa: BLE001 - whatever is wrong with an event fails the program, never the grader
                self._malformed(f"{type(e).__name__}: {e}")
            took = True
        return took

    def _malformed(self, why: str) -> None:
        """A malformed or forged stream fails every test of the run: verdicts taken before it are dropped too
        (a forged "passed" comes first, the driver's own event after it is the one out of order)."""
        logger.error("sandbox driver sent a malformed event (%s); the program fails", why)
        self.result.end, self.result.end_status = "malformed", "error"
        self.result.statuses.clear()
        self.result.errors.clear()

    def _event(self, event: dict) -> None:
        """One event, type-checked and in order: ready, ``alive`` after each test ran (its answer is judged after
        the run), then per test start/done with the verdict, then finished."""
        if type(event) is not dict or type(event.get("event")) is not str:
            raise ValueError("not an event")
        kind, result, n = event["event"], self.result, len(self.tests["cases"])
        if kind == "ready" and result.isolation is None and self._next == 0:
            layers = event["isolated"]
            if type(layers) is not dict or not all(type(layers.get(name)) is bool for name in LAYERS):
                raise ValueError("bad isolation")
            result.isolation = Isolation(**{name: layers[name] for name in LAYERS})
            if not _isolation_logged.is_set():
                _isolation_logged.set()
                (logger.info if all(vars(result.isolation).values()) else logger.warning)(result.isolation.describe())
        elif kind == "start" and self._started is None and event["i"] == self._next and type(event["i"]) is int and self._next < n:
            self._started = self._next
        elif kind == "done" and self._started is not None and event["i"] == self._started and type(event["i"]) is int:
            status, error, seconds = event["status"], event.get("error", ""), event.get("seconds", 0.0)
            if status not in STATUSES or type(error) is not str or type(seconds) not in (int, float):
                raise ValueError("bad verdict")
            result.statuses[self._started], result.errors[self._started] = status, error[:self.limits.stderr_bytes]
            self._started, self._next = None, self._next + 1
        elif kind == "setup_failed" and self._started is None and self._next == 0:
            status, error = event["status"], event.get("error", "")
            if status not in STATUSES[1:] or type(error) is not str:
                raise ValueError("bad setup failure")
            result.end, result.end_status, result.error = "setup_failed", status, error[:self.limits.stderr_bytes]
        elif kind == "harness_error":
            logger.error("sandbox driver failed: %s", str(event.get("traceback", ""))[-4000:])
            result.end, result.end_status = "died", "error"
        elif kind == "finished" and self._started is None and self._next == n:
            pass
        elif kind == "alive" and self._started is None and len(event) == 1:
            pass  # a test ran: the backstop clock restarts
        else:
            raise ValueError(f"unexpected event {kind!r}")


def event_pipe() -> tuple[int, int]:
    """``(read end, write end)`` of a run's event pipe (a function of its own so that tests can place it at a high fd)."""
    return os.pipe()


def _message(value) -> bytes:
    data = marshal.dumps(value)
    return len(data).to_bytes(8, "big") + data


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
