"""What one sandboxed run holds on the host, and cleaning up after it (the grader's side).

A run holds a **slot** (:class:`Slot`): an unprivileged uid of its own, taken with ``flock`` so that concurrent
graders never share one, the folder its private tmpfs is mounted on, and the slot's cgroups (:class:`Cgroups`:
memory, processes and CPU of the whole program). After the run every process left in the cgroups, or without
cgroups of the uid, is killed (:func:`kill_uid`, :func:`wait_until_gone`).
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

SLOT_UID_BASE = 1_900_000_000
"""Slot ``k`` runs as uid = gid = ``SLOT_UID_BASE + k`` (ids no account uses)."""
MAX_SLOTS = 256
SANDBOX_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
"""The whole environment of a sandboxed process: nothing of the grader's is passed on."""


class Cgroups:
    """A slot's cgroups (v1 ``memory`` + ``pids``, or v2 with both controllers) under ``marft-sandbox``:
    memory (tmpfs and shared memory included, no swap) and processes of one whole program are capped.
    ``available`` is False where they cannot be made (not root, no controllers): then limits are per process."""

    V1 = Path("/sys/fs/cgroup")

    def __init__(self, k: int):
        self.procs: list[str] = []
        self.oom_events: str | None = None
        self.cpu: Path | None = None
        """The cgroup holding the CPU quota (``cpu`` controller), or None where there is none."""
        self._limits: list[tuple[Path, str]] = []
        try:
            if (self.V1 / "memory" / "memory.limit_in_bytes").exists() and (self.V1 / "pids").is_dir():
                memory, pids = self.V1 / "memory" / "marft-sandbox" / str(k), self.V1 / "pids" / "marft-sandbox" / str(k)
                memory.mkdir(parents=True, exist_ok=True)
                pids.mkdir(parents=True, exist_ok=True)
                self.memory, self.pids, self.version = memory, pids, 1
                self.procs = [str(memory / "cgroup.procs"), str(pids / "cgroup.procs")]
                self.oom_events = str(memory / "memory.oom_control")
                if (self.V1 / "cpu" / "cpu.cfs_quota_us").exists():
                    cpu = self.V1 / "cpu" / "marft-sandbox" / str(k)
                    cpu.mkdir(parents=True, exist_ok=True)
                    self.cpu = cpu
                    self.procs.append(str(cpu / "cgroup.procs"))
            elif "memory" in (self.V1 / "cgroup.controllers").read_text().split():
                parent = self.V1 / "marft-sandbox"
                parent.mkdir(exist_ok=True)
                for folder in (self.V1, parent):
                    (folder / "cgroup.subtree_control").write_text("+memory +pids")
                if "cpu" in (self.V1 / "cgroup.controllers").read_text().split():
                    try:
                        for folder in (self.V1, parent):
                            (folder / "cgroup.subtree_control").write_text("+cpu")
                    except OSError:
                        pass
                group = parent / str(k)
                group.mkdir(exist_ok=True)
                self.memory = self.pids = group
                if (group / "cpu.max").exists():
                    self.cpu = group
                self.version = 2
                self.procs = [str(group / "cgroup.procs")]
                self.oom_events = str(group / "memory.events")
        except OSError:
            self.procs = []

    @property
    def available(self) -> bool:
        return bool(self.procs)

    def set_limits(self, memory_bytes: int, processes: int, cpus: float = 1.0) -> None:
        """Caps for the next run (the program's processes and their files in tmpfs together). Called after
        :meth:`empty`: a process still counted then is a zombie of the last run waiting for the host's init (its
        driver was killed, so nobody of ours reaps it); it cannot run, and the cap is raised by as many so that the
        program still gets ``processes`` (a dead one must not fail the next program)."""
        stale = self.stale_processes()
        if stale:
            logger.warning("sandbox cgroup %s still counts %d dead process(es) of the last run; cap raised by as many", self.pids, stale)
        processes += stale
        if self.version == 1:
            files = [(self.memory / "memory.limit_in_bytes", memory_bytes), (self.memory / "memory.memsw.limit_in_bytes", memory_bytes)]
            for _ in range(2):  # memsw must stay >= limit: one order works when growing, the other when shrinking
                try:
                    for path, value in files:
                        if path.exists():
                            path.write_text(str(value))
                    break
                except OSError:
                    files.reverse()
            (self.pids / "pids.max").write_text(str(processes))
            if self.cpu is not None:
                (self.cpu / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
                (self.cpu / "cpu.cfs_quota_us").write_text(str(max(1000, int(cpus * CPU_PERIOD_US))))
        else:
            (self.memory / "memory.max").write_text(str(memory_bytes))
            if (self.memory / "memory.swap.max").exists():
                (self.memory / "memory.swap.max").write_text("0")
            (self.pids / "pids.max").write_text(str(processes))
            if self.cpu is not None:
                (self.cpu / "cpu.max").write_text(f"{max(1000, int(cpus * CPU_PERIOD_US))} {CPU_PERIOD_US}")

    def stale_processes(self) -> int:
        """Processes the pids cgroup counts but does not list (zombies not yet reaped), 0 where unknown."""
        try:
            return max(0, int((self.pids / "pids.current").read_text()) - len(self.members()))
        except (OSError, ValueError):
            return 0

    def members(self) -> list[int]:
        pids = set()
        for path in self.procs:
            try:
                pids.update(int(p) for p in Path(path).read_text().split())
            except OSError:
                pass
        return sorted(pids)

    def empty(self, timeout_s: float = 5.0) -> bool:
        """SIGKILL whatever is still in the cgroups and wait until none is left."""
        deadline = time.monotonic() + timeout_s
        while members := self.members():
            for pid in members:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                logger.warning("processes %s are still in the sandbox cgroup after %.0f s", members, timeout_s)
                return False
            time.sleep(0.005)
        return True


CPU_PERIOD_US = 100_000
"""Period of the cgroup CPU quota: a program gets ``cpus * CPU_PERIOD_US`` microseconds of CPU in each."""

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
        self.uid, self.workdir, self._lock, self.cgroups = -1, None, None, None
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
            self.cgroups = Cgroups(k)
            if self.uid not in _checked_slots:  # first use here: a crashed grader may have left processes and files
                kill_uid(self.uid)
                wait_until_gone(self.uid)
                if self.cgroups.available:
                    self.cgroups.empty()
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

    def __enter__(self) -> Slot:
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
