"""The candidate's sandbox, layer by layer (standard library only): the kernel's numbers, libc, closing inherited fds,
resource limits, joining the slot's cgroups, and the file system (a minimal read-only root, or private mounts).

:func:`marft.sandbox.harness.candidate.enter_sandbox` applies these in order; the seccomp filter is
:mod:`.seccomp`.
"""

import ctypes
import os
import resource
import signal

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x02000000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS = 1, 4, 22, 38
SYS_PIVOT_ROOT = 155
WRITABLE_SYSTEM_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
DEV_NODES = ("null", "zero", "full", "random", "urandom")
LAYERS = ("network", "mounts", "uid", "pid", "ipc", "cgroup", "filesystem", "seccomp")

SYS_CLOSE_RANGE = 436


def close_fds_from(lowest):
    """Close every fd from ``lowest`` up, with no upper bound (the grader's pipes may sit at any number):
    ``close_range(lowest, ~0U, 0)``, or where the kernel lacks it each fd that ``/proc/self/fd`` lists."""
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    if libc.syscall(ctypes.c_long(SYS_CLOSE_RANGE), ctypes.c_uint(lowest), ctypes.c_uint(0xFFFFFFFF), ctypes.c_uint(0)) == 0:
        return
    listing = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
    try:
        fds = [int(name) for name in os.listdir(listing)]
    finally:
        os.close(listing)
    for fd in fds:
        if fd >= lowest and fd != listing:
            try:
                os.close(fd)
            except OSError:
                pass


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _call(result, what):
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, "%s: %s" % (what, os.strerror(code)))


def set_limits(limits):
    """Resource limits of the candidate and everything it starts."""
    pairs = {
        resource.RLIMIT_CPU: limits["cpu_s"],
        resource.RLIMIT_AS: limits["memory_mb"] << 20,
        resource.RLIMIT_FSIZE: limits["file_bytes"],
        resource.RLIMIT_NOFILE: limits["open_files"],
        resource.RLIMIT_CORE: 0,
        resource.RLIMIT_NPROC: limits["processes"],
    }
    for which, value in pairs.items():
        hard = value + 1 if which == resource.RLIMIT_CPU else value  # SIGXCPU at soft, SIGKILL at hard
        resource.setrlimit(which, (value, hard))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the file limit fails with EFBIG instead


def join_cgroups(job):
    """Move this process into the program's cgroups (memory and process caps for all of it); whether all worked."""
    paths = job.get("cgroups") or []
    try:
        for path in paths:
            with open(path, "w") as f:
                f.write(str(os.getpid()))
    except OSError:
        return False
    return bool(paths)


def _mount(libc, source, target, fstype, flags, options, what):
    _call(libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(), flags, options and options.encode()), what)


def minimal_root(libc, job):
    """pivot_root into a fresh tmpfs holding only what Python needs, read-only; ``/sandbox`` the working directory."""
    root = job["workdir"]
    _mount(libc, "tmpfs", root, "tmpfs", MS_NOSUID, "size=1m,mode=0755", "root tmpfs")
    for path in job["binds"]:
        target = root + path
        if os.path.islink(path):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.symlink(os.readlink(path), target)
        elif os.path.isdir(path):
            os.makedirs(target, exist_ok=True)
            _mount(libc, path, target, None, MS_BIND | MS_REC, None, "bind " + path)
            _mount(libc, None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, None, "read-only " + path)
    for path in job["hidden"]:
        if os.path.isdir(root + path):
            _mount(libc, "tmpfs", root + path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=0755", "hide " + path)
    os.mkdir(root + "/dev")
    for name in DEV_NODES:
        open(root + "/dev/" + name, "w").close()
        _mount(libc, "/dev/" + name, root + "/dev/" + name, None, MS_BIND, None, "bind /dev/" + name)
    os.mkdir(root + "/proc")
    _mount(libc, "proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None, "proc")
    os.mkdir(root + "/sandbox")
    options = "size=%dk,mode=0700,uid=%d,gid=%d" % (job["limits"]["disk_bytes"] >> 10, max(job["uid"], 0), max(job["gid"], 0))
    _mount(libc, "tmpfs", root + "/sandbox", "tmpfs", MS_NOSUID | MS_NODEV, options, "working tmpfs")
    os.chdir(root)
    _call(libc.syscall(SYS_PIVOT_ROOT, b".", b"."), "pivot_root")
    _call(libc.umount2(b".", MNT_DETACH), "detach the old root")
    os.chdir("/")
    _mount(libc, None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID, None, "read-only root")
    os.chdir("/sandbox")


def private_mounts(libc, job):
    """Fallback when no minimal root can be built: tmpfs on the working directory, shared temp folders read-only."""
    options = "size=%dk,mode=0700,uid=%d,gid=%d" % (job["limits"]["disk_bytes"] >> 10, job["uid"], job["gid"])
    _mount(libc, "tmpfs", job["workdir"], "tmpfs", MS_NOSUID | MS_NODEV, options, "mount tmpfs")
    for path in WRITABLE_SYSTEM_DIRS:
        if os.path.isdir(path) and not os.path.islink(path):
            _mount(libc, path, path, None, MS_BIND | MS_REC, None, "bind " + path)
            _mount(libc, None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, None, "read-only " + path)
    os.chdir(job["workdir"])
