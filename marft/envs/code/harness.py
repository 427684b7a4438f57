"""The trusted test driver and the sandboxed candidate it talks to (standard library only).

Started by ``marft.envs.code.sandbox`` as ``python3 -I -S harness.py``. Two processes come of it:

* the **driver** (trusted): reads the job, forks the candidate, then reads the tests (inputs,
  expected outputs, HumanEval's test code and prompt), which therefore never exist in the
  candidate's memory. It sends the candidate one request at a time, enforces each test's wall
  clock, judges every answer itself and reports verdicts to the grader on its own pipe
  (``job["channel_fd"]``, which the candidate never holds). A test passes only when the driver
  compared the answer and found it right, or, for ``check`` code, when ``check`` returned
  normally: the candidate can end, exit, crash or lie, and only ever fails itself.
* the **candidate** (untrusted): the program under test. As root it enters a sandbox before
  any program code runs: cgroups (memory incl. tmpfs and shared memory, process count), new
  PID, IPC, UTS, network and mount namespaces, a minimal root file system (``/usr``, ``/lib*``,
  ``/bin``, ``/sbin`` read-only with every ``site-packages``/``dist-packages`` hidden, a few
  ``/dev`` nodes, its own ``/proc``, a size-limited tmpfs ``/sandbox`` as the working
  directory), resource limits, an unprivileged uid, ``no_new_privs`` and a seccomp filter
  (no namespaces, ptrace, System V IPC, sockets but AF_INET/AF_INET6, mounts, keyrings, bpf, io_uring).
  It is PID 1 of its namespace: when it ends, every process it started ends with it. It
  serves requests and answers with plain data only.

Wire formats: driver → candidate, length-prefixed ``marshal`` (trusted data the candidate
parses); candidate → driver, length-prefixed JSON with tags for tuples, sets, dicts and bytes,
read only up to a size bound and decoded by the C JSON scanner, integers by length-bounded
``int``; driver → grader, one JSON line per event.

Requests (``job["kind"]``): ``stdin`` runs the program afresh with the test's input on fd 0
and returns its stdout; ``call`` evaluates a call expression in the program's namespace;
``check`` calls ``entry_point`` with arguments the driver's ``check`` code passed to its proxy.
Feedback carries only the status and the class of a builtin exception (the program's line only for a setup
failure, before any test input). Verdicts reach the grader only after the candidate has ended.
"""

import builtins
import ctypes
import errno
import fcntl
import io
import marshal
import math
import os
import resource
import select
import signal
import sys
import time

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x02000000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS = 1, 4, 22, 38
SYS_PIVOT_ROOT = 155
WRITABLE_SYSTEM_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
DEV_NODES = ("null", "zero", "full", "random", "urandom")
LAYERS = ("network", "mounts", "uid", "pid", "ipc", "cgroup", "filesystem", "seccomp")
BUILTIN_EXCEPTIONS = frozenset(name for name, value in vars(builtins).items() if isinstance(value, type) and issubclass(value, BaseException))
MAX_INT_DIGITS = 100_000
"""Longest integer the driver decodes from a candidate's answer (``int`` of text is quadratic)."""
INT_DIGITS_COST = 4 * MAX_INT_DIGITS ** 2
"""Budget of one answer's long integers, in squared digits (their decoding cost): four of the longest
(about a quarter of a second), or many shorter ones; integers up to ``SHORT_INT_DIGITS`` are free."""
SHORT_INT_DIGITS = 4300
MAX_HASH_COLLISIONS = 1000
"""Set elements and dict keys of one answer that may share a hash with another of the same set or dict: equal
hashes make building a set quadratic (``k * (2**61 - 1)`` all hash to 0: 20,000 such integers take 1.6 s, 8 MB
of them minutes of the driver's CPU, in C that no alarm interrupts). Honest answers have a handful."""
SANDBOX_PATH = "/usr/bin:/bin"

_type, _len, _isinstance = type, len, isinstance


class HarnessTimeout(BaseException):
    """Raised in the driver when a ``check`` run's time is up."""


class CandidateFailed(BaseException):
    """A proxied call did not return a plain value (the candidate raised, died, timed out, answered badly).
    A ``BaseException``, so that test code's ``except Exception`` cannot turn it into a pass."""

    def __init__(self, status, error):
        super().__init__(status, error)
        self.status, self.error = status, error


# ---------------------------------------------------------------- plain data on the wire

_JSON_ESCAPES = {i: "\\u%04x" % i for i in range(32)}
_JSON_ESCAPES.update({ord("\\"): "\\\\", ord('"'): '\\"', 0x2028: "\\u2028", 0x2029: "\\u2029"})


def _json_str(value):
    return '"' + value.translate(_JSON_ESCAPES) + '"'


def to_json(value, depth=0):
    """JSON text of plain data, tagged where JSON has no such type: ``{"t": [..]}`` tuple, ``{"s": [..]}`` set,
    ``{"d": [[k, v], ..]}`` dict, ``{"b": "hex"}`` bytes, ``{"c": [re, im]}`` complex. Anything else: TypeError."""
    kind = _type(value)
    if depth > 100:
        raise TypeError("nested too deeply")
    if kind is str:
        return _json_str(value)
    if value is None or kind is bool:
        return "null" if value is None else ("true" if value else "false")
    if kind is int:
        return str(value)
    if kind is float:
        if value != value:
            return "NaN"
        if value in (math.inf, -math.inf):
            return "Infinity" if value > 0 else "-Infinity"
        return repr(value)
    if kind is list:
        return "[" + ",".join([to_json(item, depth + 1) for item in value]) + "]"
    if kind is tuple:
        return '{"t":[' + ",".join([to_json(item, depth + 1) for item in value]) + "]}"
    if kind is set or kind is frozenset:
        return '{"s":[' + ",".join([to_json(item, depth + 1) for item in value]) + "]}"
    if kind is dict:
        return '{"d":[' + ",".join(["[" + to_json(k, depth + 1) + "," + to_json(v, depth + 1) + "]" for k, v in value.items()]) + "]}"
    if kind is bytes:
        return '{"b":"' + value.hex() + '"}'
    if kind is complex:
        return '{"c":[' + to_json(value.real) + "," + to_json(value.imag) + "]}"
    raise TypeError("not plain data: %s" % kind.__name__)


def _tagged(pairs):
    """``object_pairs_hook``: the one tagged pair of a ``to_json`` object, else ValueError."""
    if _len(pairs) != 1:
        raise ValueError("not a tagged value")
    tag, body = pairs[0]
    if tag == "t" and _type(body) is list:
        return tuple(body)
    if tag == "s" and _type(body) is list:
        _count_collisions(body)
        return frozenset(body)
    if tag == "d" and _type(body) is list:
        if not all(_type(item) is list and _len(item) == 2 for item in body):
            raise ValueError("bad dict")
        _count_collisions([k for k, _ in body])
        return {k: v for k, v in body}
    if tag == "b" and _type(body) is str:
        return bytes.fromhex(body)
    if tag == "c" and _type(body) is list and _len(body) == 2 and all(_type(x) in (int, float) for x in body):
        return complex(body[0], body[1])
    raise ValueError("unknown tag")


_int_cost = [0]
"""Squared digits of long integers decoded so far in the current answer (``from_json`` resets it)."""


_collisions = [0]
"""Set elements and dict keys of the current answer whose hash another one already had (``from_json`` resets it)."""


def _count_collisions(items):
    """Count repeated hashes before a set or dict is built from ``items`` (hashing is linear; ValueError past the budget)."""
    if _len(items) > 1:
        _collisions[0] += _len(items) - _len({hash(item) for item in items})
        if _collisions[0] > MAX_HASH_COLLISIONS:
            raise ValueError("set elements or dict keys with colliding hashes")


def _bounded_int(text):
    n = _len(text)
    if n > MAX_INT_DIGITS:
        raise ValueError("integer too long")
    if n > SHORT_INT_DIGITS:
        _int_cost[0] += n * n
        if _int_cost[0] > INT_DIGITS_COST:
            raise ValueError("too many long integers")
    return int(text)


class _ScanContext:
    strict, object_hook, object_pairs_hook, memo = True, None, staticmethod(_tagged), {}
    parse_float, parse_int = float, staticmethod(_bounded_int)
    parse_constant = staticmethod({"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}.__getitem__)


_scanner = None


def from_json(data):
    """Decode a candidate's answer (bytes) with the C scanner; ValueError for anything malformed."""
    global _scanner
    if _scanner is None:
        import _json

        _scanner = _json.make_scanner(_ScanContext())
    _int_cost[0] = _collisions[0] = 0
    try:
        text = data.decode("utf-8")
        value, end = _scanner(text, 0)
    except (StopIteration, UnicodeDecodeError, RecursionError, TypeError, OverflowError) as e:
        raise ValueError("malformed answer") from e
    finally:
        _ScanContext.memo.clear()
    if end != _len(text):
        raise ValueError("trailing data")
    return value


def send_frame(fd, data):
    data = _len(data).to_bytes(4, "big") + data
    while data:
        data = data[os.write(fd, data):]


def read_frame_blocking(fd):
    """One frame from a trusted peer (the candidate reading requests); ``None`` at end of file."""
    header = _read_exactly(fd, 4)
    return None if header is None else _read_exactly(fd, int.from_bytes(header, "big"))


def _read_exactly(fd, n):
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= _len(chunk)
    return b"".join(chunks)


# ---------------------------------------------------------------- value comparison (also used by compare.py)

REL_TOL = 1e-6
ABS_TOL = 1e-6


def values_equal(actual, expected, rel_tol=REL_TOL, abs_tol=ABS_TOL):
    """Structural equality of plain values: lists and tuples alike, floats within tolerance, integers exactly
    (an expected integer needs an integer), ``bool`` only equal to ``bool``. Never raises: a value it cannot
    compare (an integer past the float range where a float is expected, nesting past the recursion limit) is
    not equal."""
    try:
        return _values_equal(actual, expected, rel_tol, abs_tol)
    except (RecursionError, OverflowError, ValueError, TypeError, MemoryError):
        return False


def _values_equal(actual, expected, rel_tol, abs_tol):
    if _isinstance(actual, bool) or _isinstance(expected, bool):
        return _type(actual) is _type(expected) and actual == expected
    if _type(expected) is int:
        return _type(actual) is int and actual == expected
    if _type(expected) is float and _type(actual) in (int, float):
        if _type(actual) is int:
            if not -sys.float_info.max <= actual <= sys.float_info.max:  # an exact comparison: no conversion that overflows
                return False
            actual = float(actual)
        if math.isnan(actual) or math.isnan(expected):
            return math.isnan(actual) and math.isnan(expected)
        return math.isclose(actual, expected, rel_tol=rel_tol, abs_tol=abs_tol)
    if _isinstance(actual, (list, tuple)) and _isinstance(expected, (list, tuple)):
        return _len(actual) == _len(expected) and all(_values_equal(a, e, rel_tol, abs_tol) for a, e in zip(actual, expected))
    if _isinstance(actual, dict) and _isinstance(expected, dict):
        got, want = {_typed_key(k): v for k, v in actual.items()}, {_typed_key(k): v for k, v in expected.items()}
        return got.keys() == want.keys() and all(_values_equal(got[k], want[k], rel_tol, abs_tol) for k in got)
    if _isinstance(actual, (set, frozenset)) and _isinstance(expected, (set, frozenset)):
        return {_typed_key(v) for v in actual} == {_typed_key(v) for v in expected}
    return _type(actual) is _type(expected) and actual == expected


def _typed_key(value):
    """A set element or dict key as a hashable value equal only to one of the same kind (``True``, ``1`` and
    ``1.0`` differ, as ``values_equal`` has them; hashing alone makes them one key), lists and tuples alike,
    every NaN alike. Compared exactly: no float tolerance inside sets and keys."""
    kind = _type(value)
    if kind is float and value != value:
        return ("nan",)
    if kind is tuple or kind is list:
        return ("sequence",) + tuple(_typed_key(item) for item in value)
    if kind is frozenset or kind is set:
        return ("set", frozenset(_typed_key(item) for item in value))
    return (kind.__name__, value)


def _is_integer_token(token):
    digits = token[1:] if token[:1] in ("+", "-") else token
    return digits.isdigit() and digits.isascii()


def _is_number_token(token):
    """A decimal number: sign, digits with at most one point, an optional exponent (no ``inf``/``nan``/``_``)."""
    body = token[1:] if token[:1] in ("+", "-") else token
    mantissa, marker, exponent = body.lower().partition("e")
    if marker and not _is_integer_token(exponent):
        return False
    whole, dot, fraction = mantissa.partition(".")
    return (whole + fraction).isdigit() and (whole + fraction).isascii() and "." not in fraction


def _integer_text(token):
    """An integer token in one canonical spelling: no ``+``, no leading zeros, ``-0`` as ``0``."""
    digits = token.lstrip("+-").lstrip("0") or "0"
    return digits if digits == "0" or not token.startswith("-") else "-" + digits


def tokens_match(actual, expected, rel_tol=REL_TOL, abs_tol=ABS_TOL):
    """One stdout token against the expected one: integers exactly (an expected integer needs an integer),
    other numbers within the tolerance, anything else as text. Never raises (a number past the float range
    reads as infinity)."""
    try:
        return _tokens_match(actual, expected, rel_tol, abs_tol)
    except (OverflowError, ValueError, MemoryError):
        return False


def _tokens_match(actual, expected, rel_tol, abs_tol):
    if actual == expected:
        return True
    if _is_integer_token(expected):
        return _is_integer_token(actual) and _integer_text(actual) == _integer_text(expected)
    if _is_number_token(actual) and _is_number_token(expected):
        return math.isclose(float(actual), float(expected), rel_tol=rel_tol, abs_tol=abs_tol)
    return False


def outputs_match(actual, expected, rel_tol=REL_TOL, abs_tol=ABS_TOL):
    """Whether stdout ``actual`` answers a test whose expected stdout is ``expected`` (whitespace only separates tokens)."""
    got, want = actual.split(), expected.split()
    return _len(got) == _len(want) and all(tokens_match(a, b, rel_tol, abs_tol) for a, b in zip(got, want))


# ---------------------------------------------------------------- building the sandbox (candidate side, as root)

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


# seccomp: x86_64 system call numbers the candidate may not make (EPERM)
AUDIT_ARCH_X86_64 = 0xC000003E
SYSCALLS_DENIED = (
    101, 310, 311,  # ptrace, process_vm_readv/writev
    272, 308,  # unshare, setns
    29, 30, 31, 67, 64, 65, 66, 220, 68, 69, 70, 71, 240,  # System V shm/sem/msg, mq_open
    165, 166, 155, 161, 428, 429, 430, 431, 432, 433, 442,  # mount, umount2, pivot_root, chroot, new mount API
    250, 248, 249, 321, 298, 323, 425, 426, 427, 438,  # keyrings, bpf, perf, userfaultfd, io_uring, pidfd_getfd
    246, 320, 175, 313, 176, 304, 303, 163, 167, 168, 169, 170, 171, 172, 173, 179, 312, 135, 212, 153, 103,
    # state shared between runs (issue 78): page-cache advice and residency probes, file locks, file watches
    221, 187, 27, 451, 440, 216,  # fadvise64, readahead, mincore, cachestat, process_madvise, remap_file_pages
    73, 253, 254, 294, 300,  # flock, inotify_init, inotify_add_watch, inotify_init1, fanotify_init
)
SYSCALLS_NOSYS = (327, 328)
"""preadv2, pwritev2 (RWF_NOWAIT tells whether a page is cached): ENOSYS, so that libc falls back to preadv/pwritev."""
SYS_FCNTL, SYS_MADVISE = 72, 28
FCNTL_DENIED = (5, 6, 7, 36, 37, 38, 1024, 1026)
"""fcntl commands denied: F_GETLK, F_SETLK, F_SETLKW, F_OFD_GETLK/SETLK/SETLKW (a lock on a file every run reads is
a signal between runs), F_SETLEASE, F_NOTIFY (a watch on a shared folder sees other runs open files)."""
MADVISE_DENIED = (3, 20, 21, 22, 23)
"""madvise advice denied: MADV_WILLNEED, MADV_COLD, MADV_PAGEOUT, MADV_POPULATE_READ/WRITE (page-cache advice)."""
SYS_CLONE, SYS_CLONE3, SYS_SOCKET, SYS_SOCKETPAIR = 56, 435, 41, 53
NAMESPACE_FLAGS = CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET
AF_UNIX, AF_INET, AF_INET6 = 1, 2, 10
SOCKET_FAMILIES = (AF_INET, AF_INET6)
"""The only families ``socket`` may create (in the candidate's empty network namespace: nothing to reach)."""
SOCKETPAIR_FAMILIES = (AF_UNIX,)
"""The only family ``socketpair`` may create: an unnamed pair, reachable only by the program's own processes
(asyncio's event loop makes one)."""


def seccomp_program():
    """Classic BPF: kill other architectures; EPERM for ``SYSCALLS_DENIED``, namespace flags to ``clone``, a
    ``socket`` of any family but ``SOCKET_FAMILIES``, a ``socketpair`` of any but ``SOCKETPAIR_FAMILIES``, the
    ``FCNTL_DENIED`` commands and ``MADVISE_DENIED`` advice; ENOSYS for ``clone3`` (its flags are out of reach, libc
    falls back to clone) and ``SYSCALLS_NOSYS``."""
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, kill = 0x7FFF0000, 0x80000000
    deny, nosys = 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS
    # (opcode, jump target label when the condition holds, k); a failed condition falls through
    blocks = {
        "start": [(ld, None, 4), (jeq, "syscall", AUDIT_ARCH_X86_64), (ret, None, kill)],
        "syscall": [(ld, None, 0), (jge, "deny", 0x40000000), (jeq, "clone", SYS_CLONE), (jeq, "socket", SYS_SOCKET),
                    (jeq, "socketpair", SYS_SOCKETPAIR), (jeq, "fcntl", SYS_FCNTL), (jeq, "madvise", SYS_MADVISE)]
                   + [(jeq, "nosys", nr) for nr in (SYS_CLONE3,) + SYSCALLS_NOSYS]
                   + [(jeq, "deny", nr) for nr in SYSCALLS_DENIED] + [(ret, None, allow)],
        "clone": [(ld, None, 16), (jset, "deny", NAMESPACE_FLAGS), (ret, None, allow)],  # args[0], low 32 bits
        # args[0] (the family, an int: the kernel reads its low 32 bits, as this does)
        "socket": [(ld, None, 16)] + [(jeq, "allow", family) for family in SOCKET_FAMILIES] + [(ret, None, deny)],
        "socketpair": [(ld, None, 16)] + [(jeq, "allow", family) for family in SOCKETPAIR_FAMILIES] + [(ret, None, deny)],
        "fcntl": [(ld, None, 24)] + [(jeq, "deny", cmd) for cmd in FCNTL_DENIED] + [(ret, None, allow)],  # args[1]
        "madvise": [(ld, None, 32)] + [(jeq, "deny", advice) for advice in MADVISE_DENIED] + [(ret, None, allow)],  # args[2]
        "allow": [(ret, None, allow)],
        "nosys": [(ret, None, nosys)],
        "deny": [(ret, None, deny)],
    }
    labels, at = {}, 0
    for name, block in blocks.items():
        labels[name] = at
        at += _len(block)
    out, index = bytearray(), 0
    for block in blocks.values():
        for op, target, k in block:
            jt = labels[target] - index - 1 if target else 0
            if not 0 <= jt < 256:
                raise ValueError("seccomp jump out of range")
            out += op.to_bytes(2, "little") + bytes((jt, 0)) + k.to_bytes(4, "little")
            index += 1
    return bytes(out), index


def install_seccomp(libc):
    import platform

    if platform.machine() != "x86_64":
        return False
    data, count = seccomp_program()
    buffer = ctypes.create_string_buffer(data)

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = Program(count, ctypes.addressof(buffer))
    return libc.prctl(PR_SET_SECCOMP, 2, ctypes.byref(prog), 0, 0) == 0


def enter_sandbox(job, libc):
    """PID 1 of fresh namespaces: file system, limits, uid drop, no_new_privs, seccomp; returns what holds."""
    done = job["_done"]
    root = os.geteuid() == 0
    if done["mounts"]:
        try:
            _mount(libc, None, "/", None, MS_REC | MS_PRIVATE, None, "make mounts private")
            if root and job.get("binds"):
                try:
                    minimal_root(libc, job)
                    done["filesystem"] = True
                except OSError:
                    private_mounts(libc, job)
            else:
                private_mounts(libc, job)
        except OSError:
            done["mounts"] = False
            os.chdir(job["workdir"])
    else:
        os.chdir(job["workdir"])
    set_limits(job["limits"])
    if root and job["uid"] > 0:
        os.setgroups([])
        os.setgid(job["gid"])
        os.setuid(job["uid"])
        done["uid"] = True
    _call(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    done["seccomp"] = install_seccomp(libc)
    return done


def start_candidate(job, req_fd, resp_fd):
    """In a fresh child of the driver (still privileged): namespaces, then fork PID 1, which runs ``serve``.

    This process stays outside the new PID namespace only to wait for PID 1 and exit with its status
    (``128 + signal`` when it was killed); it dies with the driver, and PID 1 dies with it.
    """
    libc = _libc()
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    log_fd = fcntl.fcntl(2, fcntl.F_DUPFD_CLOEXEC, 10) if job.get("debug") else -1  # the driver's stderr (logged at DEBUG)
    if os.getppid() != job["driver_pid"]:
        os._exit(1)
    done = {name: False for name in LAYERS}
    done["cgroup"] = join_cgroups(job)
    root = os.geteuid() == 0
    if root:
        if libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWPID) == 0:
            done.update(network=True, mounts=True, ipc=True, pid=True)
        elif libc.unshare(CLONE_NEWNET | CLONE_NEWNS) == 0:
            done.update(network=True, mounts=True)
    elif libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
        done["network"] = True
    job["_done"] = done
    pid1 = []  # the SIGTERM of Driver.close kills PID 1 first, so that this process reaps it (see Driver.close)
    signal.signal(signal.SIGTERM, lambda *_: os.kill(pid1[0], signal.SIGKILL) if pid1 else os._exit(128 + signal.SIGTERM))
    pid = os.fork()
    if pid:
        pid1.append(pid)
        _, status = os.waitpid(pid, 0)
        os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    log = [log_fd]  # closed by ``serve`` before any program code runs (the program must not write the grader's log)
    try:
        os.setsid()  # a session and process group of its own: kill(0) reaches nothing outside
        serve(job, req_fd, resp_fd, libc, log)
    except BaseException as e:  # noqa: BLE001 - never return into the driver's code
        log_fd = log[0]
        if log_fd >= 0:
            import traceback

            os.write(log_fd, "".join(traceback.format_exception(e)).encode())
        os._exit(70)
    os._exit(0)


# ---------------------------------------------------------------- the candidate: running the program


def _memfile(name, data=b""):
    """A memory file at fd >= 10 (fds 0-2 may be closed by the program: they must not be reused)."""
    low = os.memfd_create(name, 0)
    fd = fcntl.fcntl(low, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(low)
    if data:
        os.write(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
    return fd


class Capture:
    """Fresh fds 0/1/2 (memory files) and ``sys.std*`` objects for one request."""

    def __init__(self, stdin_data):
        self.fds = [_memfile("stdin", stdin_data), _memfile("stdout"), _memfile("stderr")]
        for target, fd in enumerate(self.fds):
            os.dup2(fd, target)
        self.out = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)), encoding="utf-8", errors="replace")
        self.err = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)), encoding="utf-8", errors="replace", line_buffering=True)
        sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8", errors="replace")
        sys.stdout, sys.stderr = self.out, self.err
        sys.__stdout__, sys.__stderr__, sys.__stdin__ = sys.stdout, sys.stderr, sys.stdin

    def finish(self, limit):
        """``(stdout bytes up to limit, output limit reached)``; closes the memory files."""
        over = False
        for stream in (self.out, self.err):
            try:
                stream.flush()
            except (OSError, ValueError):
                over = True
        fd = self.fds[1]
        over = over or os.fstat(fd).st_size > limit
        stdout = os.pread(fd, limit, 0) if not over else b""
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        return stdout, over


def error_of(error):
    """``{"error": class name, "line": program line}`` of an exception (the innermost frame of the program)."""
    line, tb = None, error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<program>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return {"error": _type(error).__name__, "line": line}


def run_guarded(function, exit_ok):
    """``{"status", "error", "line"}`` of ``function()``; a clean ``SystemExit`` is ``ok`` only when ``exit_ok``."""
    try:
        function()
        return {"status": "ok"}
    except SystemExit as e:
        if exit_ok and e.code in (None, 0):
            return {"status": "ok"}
        return {"status": "error", "error": "SystemExit", "line": error_of(e)["line"]}
    except MemoryError:
        return {"status": "memory"}
    except BaseException as e:  # noqa: BLE001 - whatever the program raises is its failure
        status = "output_limit" if _isinstance(e, OSError) and e.errno in (errno.EFBIG, errno.ENOSPC) else "error"
        return {"status": status, **error_of(e)}


def kill_leftovers(pid1):
    """SIGKILL every other process of the namespace (PID 1 is exempt from ``kill(-1)``) and reap them all."""
    while True:
        if pid1:
            try:
                os.kill(-1, signal.SIGKILL)
            except OSError:
                pass
        try:
            pid, _ = os.waitpid(-1, 0 if pid1 else os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def fresh_namespace(name="__main__"):
    return {"__name__": name, "__builtins__": dict(_ORIGINAL_BUILTINS)}


def serve(job, req_fd, resp_fd, libc, log=None):
    """The candidate: build the sandbox, load the program, answer requests until the driver closes the pipe.
    ``log``: ``[fd]`` of the driver's stderr (DEBUG only, for failures building the sandbox), closed here
    before any program code runs."""
    done = enter_sandbox(job, libc)
    if log and log[0] >= 0:
        os.close(log[0])
        log[0] = -1
    os.environ.clear()
    os.environ.update({"PATH": SANDBOX_PATH, "HOME": os.getcwd(), "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"})
    sys.argv = [""]
    if hasattr(sys, "set_int_max_str_digits"):
        sys.set_int_max_str_digits(0)  # big-integer answers are common in contest problems
    pid1 = os.getpid() == 1
    limit = job["limits"]["file_bytes"]

    def reply(message):
        try:
            data = to_json(message).encode("utf-8", "replace")
        except (TypeError, ValueError, RecursionError, MemoryError) as e:
            data = to_json({"status": "error", "error": _type(e).__name__, "line": None, "note": "not plain data"}).encode()
        send_frame(resp_fd, data)

    send_frame(resp_fd, to_json({"ready": done}).encode())
    try:
        code = compile(job["program"], "<program>", "exec")
    except (SyntaxError, ValueError) as e:
        reply({"status": "error", "error": _type(e).__name__, "line": getattr(e, "lineno", None)})
        return
    namespace = None
    if job["kind"] == "stdin":
        reply({"status": "ok"})  # compiled: the setup answer (its feedback may name a line: no test input was sent yet)
    else:
        namespace = fresh_namespace()
        capture = Capture(b"")
        outcome = run_guarded(lambda: exec(code, namespace), exit_ok=False)
        _, over = capture.finish(limit)
        kill_leftovers(pid1)
        reply({**outcome, "status": "output_limit"} if over else outcome)
        if outcome["status"] != "ok" or over:
            return
    answer_requests(job, code, namespace, req_fd, reply, limit, pid1)


def answer_requests(job, code, namespace, req_fd, reply, limit, pid1):
    """The candidate's request loop (:func:`serve`): run the program on a stdin, evaluate a test expression, or call
    the entry point, each under :func:`run_guarded` with its output captured and capped at ``limit`` bytes; every
    process the program left is killed before the answer goes back through ``reply``. Ends when the driver closes
    the pipe."""
    while True:
        request = read_frame_blocking(req_fd)
        if request is None:
            return
        request = marshal.loads(request)
        result = []
        if request[0] == "run":
            capture = Capture(request[1])
            outcome = run_guarded(lambda: exec(code, fresh_namespace()), exit_ok=True)
        else:
            capture = Capture(b"")
            if request[0] == "eval":
                test = compile(request[1], "<test>", "eval")
                outcome = run_guarded(lambda: result.append(eval(test, namespace)), exit_ok=False)  # noqa: B023 - called at once
            else:
                outcome = run_guarded(lambda: result.append(namespace[job["entry_point"]](*request[1], **request[2])), exit_ok=False)  # noqa: B023
        stdout, over = capture.finish(limit)
        kill_leftovers(pid1)
        if over:
            outcome = {"status": "output_limit"}
        elif request[0] == "run":
            outcome["stdout"] = stdout.decode("utf-8", "replace")
        elif outcome["status"] == "ok":
            outcome["value"] = result[0]
        reply(outcome)


# ---------------------------------------------------------------- the driver (trusted)


class Lost(Exception):
    """The candidate ended, timed out or answered out of bounds; ``status`` is the test's verdict."""

    def __init__(self, status):
        super().__init__(status)
        self.status = status


CLOSE_GRACE_S = 2.0
"""How long :meth:`Driver.close` waits for a candidate's outer process to reap PID 1 before SIGKILLing it."""


class Driver:
    """Starts candidates and exchanges requests and answers with the current one."""

    def __init__(self, job):
        self.job = job
        self.limits = job["limits"]
        self.pid = None
        self.req_fd = self.resp_fd = -1
        self.isolated = None
        self.lines = job["program"].count("\n") + 1
        self.oom_before = 0
        self.started = time.monotonic()

    # -- candidates
    def spawn(self, clean_memory):
        """Start a candidate; with ``clean_memory`` (tests already read) it is a fresh interpreter (``exec``), so
        that nothing of the driver's memory (expected outputs, test code) is copied into it."""
        self.close()
        from_driver, to_child = os.pipe()  # the candidate reads requests from the first, the driver writes the second
        to_driver, from_child = os.pipe()
        job = {**self.job, "driver_pid": os.getpid()}
        pid = os.fork()
        if pid == 0:
            try:
                high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 100) for fd in (from_driver, from_child)]
                for fd, target in zip(high, (3, 4)):
                    os.dup2(fd, target, inheritable=clean_memory)
                close_fds_from(5)
                os.close(0)
                if clean_memory:
                    header = _memfile("job", marshal.dumps(job))
                    os.dup2(header, 0)
                    os.execv(sys.executable, [sys.executable, "-I", "-S", os.path.abspath(__file__), "candidate"])
                start_candidate(job, 3, 4)
            finally:
                os._exit(71)
        os.close(from_driver)
        os.close(from_child)
        os.set_blocking(to_child, False)  # a candidate that stops reading must not hold the driver past its clock
        self.pid, self.req_fd, self.resp_fd = pid, to_child, to_driver
        self.oom_before = self._oom_kills()
        ready = self.answer(time.monotonic() + self.job["startup_s"], 1 << 16)
        layers = ready.get("ready")
        if _type(layers) is not dict:
            self.close()
            raise Lost("error")
        if self.isolated is None:
            self.isolated = {name: layers.get(name) is True for name in LAYERS}

    def close(self):
        """End the candidate. SIGTERM asks its outer process (:func:`start_candidate`) to kill PID 1 and reap it;
        SIGKILL (after ``CLOSE_GRACE_S``) is the fallback. Killing the outer process first would leave PID 1 to the
        host's init, whose reaping can lag by seconds: a zombie meanwhile still counts against the cgroup's
        process cap of the slot's next program (one per program: the next ones failed to start)."""
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGTERM)
                pidfd = os.pidfd_open(self.pid)
                try:
                    if not select.select([pidfd], [], [], CLOSE_GRACE_S)[0]:
                        os.kill(self.pid, signal.SIGKILL)
                finally:
                    os.close(pidfd)
            except ProcessLookupError:
                pass
            self._reap()
        for fd in (self.req_fd, self.resp_fd):
            if fd >= 0:
                os.close(fd)
        self.pid, self.req_fd, self.resp_fd = None, -1, -1

    def _reap(self):
        _, status = os.waitpid(self.pid, 0)
        self.pid = None
        return os.waitstatus_to_exitcode(status)

    def ended(self, deadline):
        """The candidate closed its pipe: wait for it to end (until ``deadline``), then say why it ended."""
        pidfd = os.pidfd_open(self.pid)
        try:
            if not select.select([pidfd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                self.close()
                return "timeout"
        finally:
            os.close(pidfd)
        code = self._reap()
        self.close()
        if code in (128 + signal.SIGXCPU, -signal.SIGXCPU):
            return "timeout"
        if code in (128 + signal.SIGKILL, -signal.SIGKILL) and self._oom_kills() > self.oom_before:
            return "memory"
        return "error"

    def _oom_kills(self):
        path = self.job.get("oom_events")
        if not path:
            return 0
        try:
            with open(path) as f:
                for line in f:
                    if line.startswith("oom_kill "):
                        return int(line.split()[1])
        except (OSError, ValueError):
            pass
        return 0

    # -- one exchange
    def request(self, message, deadline, cap):
        """Send one request, return the decoded answer (a dict), or raise ``Lost``."""
        data = message if _type(message) is bytes else marshal.dumps(message)
        self._write(memoryview(_len(data).to_bytes(4, "big") + data), deadline)
        return self.answer(deadline, cap)

    def _write(self, data, deadline):
        """Write a request before ``deadline`` (the pipe is non-blocking: a candidate that does not read it
        times out like one that does not answer)."""
        poller = select.poll()
        poller.register(self.req_fd, select.POLLOUT)
        while data:
            try:
                data = data[os.write(self.req_fd, data):]
                continue
            except BlockingIOError:
                pass
            except OSError:
                raise Lost(self.ended(deadline)) from None
            wait = deadline - time.monotonic()
            if wait <= 0 or not poller.poll(max(1, int(wait * 1000))):
                if time.monotonic() >= deadline:
                    self.close()
                    raise Lost("timeout")

    def answer(self, deadline, cap):
        """Read one frame of at most ``cap`` bytes before ``deadline`` and decode it."""
        header = self._read(4, deadline)
        size = int.from_bytes(header, "big")
        if size > cap:
            self.close()
            raise Lost("output_limit")
        data = self._read(size, deadline)
        try:
            value = from_json(data)
        except ValueError:
            self.close()
            raise Lost("error") from None
        if _type(value) is not dict:
            self.close()
            raise Lost("error")
        return value

    def _read(self, n, deadline):
        chunks, left = [], n
        poller = select.poll()
        poller.register(self.resp_fd, select.POLLIN)
        while left:
            wait = deadline - time.monotonic()
            if wait <= 0 or not poller.poll(max(1, int(wait * 1000))):
                if time.monotonic() >= deadline:
                    self.close()
                    raise Lost("timeout")
                continue
            chunk = os.read(self.resp_fd, min(left, 1 << 20))
            if not chunk:
                raise Lost(self.ended(deadline))
            chunks.append(chunk)
            left -= _len(chunk)
        return b"".join(chunks)

    def summary(self, answer, setup=False):
        """Feedback from an answer: the class of a builtin exception, nothing else; and the program's line only for
        a ``setup`` answer (compiling the program, its top level), which the candidate sends before it is given
        any test's input: a line reached on a hidden input could spell that input out."""
        error, line = answer.get("error"), answer.get("line")
        if _type(error) is not str:
            return ""
        name = error if error in BUILTIN_EXCEPTIONS else "an exception of the program's own class"
        if setup and _type(line) is int and 1 <= line <= self.lines:
            return "%s at line %d of the program" % (name, line)
        return name


def event_json(value):
    """Plain JSON of the driver's own events (str-keyed objects of scalars)."""
    if _type(value) is dict:
        return "{" + ",".join(_json_str(str(k)) + ":" + event_json(v) for k, v in value.items()) + "}"
    return to_json(value)


class Reporter:
    """Events to the grader: ``<json>`` lines on the driver's own pipe."""

    def __init__(self, fd):
        self.fd = fd

    def send(self, **event):
        data = (event_json(event) + "\n").encode("utf-8", "replace")
        while data:
            data = data[os.write(self.fd, data):]


def answer_status(answer):
    status = answer.get("status")
    return status if status in ("ok", "error", "memory", "output_limit") else "error"


RETAINED_BYTES = 64 << 20
"""Answers' stdout the driver keeps to judge after the run; past it, an answer is judged when it arrives."""
BUDGET_MARGIN_S = 3.0
"""Seconds before the run's total budget (``max_total_s``) at which the driver starts no further test, so that
it can still report every verdict before the grader's clock ends the run."""


def run_tests(driver, tests, reporter):
    """Every test in order, then the verdicts: ``alive`` after each test, and only once the candidate has ended
    ``start``/``done`` with each verdict (answers are compared then, so that no reply, timing included, tells the
    candidate whether an earlier answer was right).

    A candidate that ended, timed out or answered out of bounds is replaced by a fresh one for the next
    test (its top level runs again); after ``max_restarts`` replacements the remaining tests fail alike."""
    job, limits = driver.job, driver.limits
    kind, timeout_s = job["kind"], limits["timeout_s"]
    budget_end = driver.started + limits.get("max_total_s", math.inf) - BUDGET_MARGIN_S
    restarts, given_up, results, retained = 0, None, [], [0]
    for i in range(_len(tests["cases"])):
        started = time.monotonic()
        pending = None
        if given_up is None and started + timeout_s > budget_end:
            given_up = ("timeout", "")
        if given_up is not None:
            status, error = given_up
        else:
            try:
                if driver.pid is None:
                    restarts += 1
                    driver.spawn(clean_memory=True)
                    setup = driver.answer(time.monotonic() + timeout_s, 1 << 16)
                    if answer_status(setup) != "ok":
                        given_up = (answer_status(setup), driver.summary(setup, setup=True))
                        raise Lost(given_up[0])
                status, error, pending = judge(driver, kind, tests, i, timeout_s, retained)
            except Lost as lost:
                status, error = lost.status, given_up[1] if given_up else ""
                driver.close()
            if restarts >= limits["max_restarts"] and driver.pid is None and given_up is None:
                given_up = (status, "")
        results.append((status, error, pending, time.monotonic() - started))
        reporter.send(event="alive")
    driver.close()
    for i, (status, error, pending, seconds) in enumerate(results):
        if pending is not None:
            status = "passed" if pending() else "failed"
        reporter.send(event="start", i=i)
        reporter.send(event="done", i=i, status=status, error=error[:300], seconds=seconds)


def judge(driver, kind, tests, i, timeout_s, retained):
    """``(status, feedback, pending)`` of test ``i``: ``pending`` is None, or the comparison still to make
    (``status`` is then None), kept for after the run while ``retained[0]`` (bytes of stdout kept) allows.
    Raises ``Lost`` when the candidate must be replaced."""
    case = tests["cases"][i]
    deadline = time.monotonic() + timeout_s
    file_bytes = driver.limits["file_bytes"]
    if kind == "stdin":
        answer = driver.request(("run", case["input"].encode("utf-8")), deadline, file_bytes + 4096)
        status = answer_status(answer)
        if status != "ok":
            return status, driver.summary(answer), None
        stdout = answer.get("stdout")
        if _type(stdout) is not str:
            return "failed", "", None
        retained[0] += _len(stdout)
        pending = lambda: outputs_match(stdout, case["output"])  # noqa: E731
        return (None, "", pending) if retained[0] <= RETAINED_BYTES else ("passed" if pending() else "failed", "", None)
    if kind == "call":
        cap = min(file_bytes, 8 * case["size"] + 4096)  # no right answer is that much longer than the expected one
        try:
            answer = driver.request(("eval", case["call"]), deadline, cap)
        except Lost as lost:
            if lost.status == "output_limit":
                return "failed", "", None  # far too long to be right: not even read
            raise
        status = answer_status(answer)
        if status != "ok":
            return status, driver.summary(answer), None
        if "value" not in answer:
            return "error", "", None
        return None, "", lambda: call_answer_right(answer["value"], case["expected"])
    status, error = run_check(driver, tests, deadline)
    return status, error, None


def call_answer_right(actual, expected):
    """Whether a call test's answer equals the expected value (an integer too long for ``ast`` is digits)."""
    if _type(expected) is tuple and _len(expected) == 2 and expected[0] == "__raw__":
        return _type(actual) is int and str(actual) == expected[1]
    return values_equal(actual, expected)  # never raises: deep nesting, huge integers are not equal


RECORD, PASS_THROUGH = "__marft_record__", "__marft_pass_through__"


def every_assert_runs(code):
    """The test code with each ``assert test, message`` turned into ``record(test)`` inside a ``try`` (an exception
    of the test records a failure; the candidate's own failure and the clock pass through): the check goes on
    after a failed assertion, so the candidate is called just as often whether its answers were right or not.
    Messages are never evaluated."""
    import ast

    class Recorder(ast.NodeTransformer):
        def visit_Assert(self, node):
            record = ast.Expr(ast.Call(ast.Name(RECORD, ast.Load()), [node.test], []))
            failed = ast.Expr(ast.Call(ast.Name(RECORD, ast.Load()), [ast.Constant(False)], []))
            handlers = [ast.ExceptHandler(ast.Name(PASS_THROUGH, ast.Load()), None, [ast.Raise(None, None)]),
                        ast.ExceptHandler(ast.Name("BaseException", ast.Load()), None, [failed])]
            return ast.copy_location(ast.Try([record], handlers, [], []), node)

    tree = Recorder().visit(ast.parse(code, "<test>"))
    return compile(ast.fix_missing_locations(tree), "<test>", "exec")


def run_check(driver, tests, deadline):
    """HumanEval's ``check(candidate)`` here, in a fresh namespace built from the prompt and the test code, with a
    proxy that forwards plain-data calls to the candidate. Every assertion runs (:func:`every_assert_runs`); passed
    only when none failed and ``check`` returned normally. Test code that raises on an answer fails the test."""
    failures, asserted = [], []

    def candidate(*args, **kwargs):
        if failures:
            raise failures[0]
        try:
            message = marshal.dumps(("call", args, kwargs))
        except ValueError:
            raise TypeError("the test passed something that is not plain data") from None
        try:
            answer = driver.request(message, deadline, driver.limits["file_bytes"])
        except Lost as lost:
            failures.append(CandidateFailed(lost.status, ""))
            raise failures[-1] from None
        status = answer_status(answer)
        if status != "ok" or "value" not in answer:
            failures.append(CandidateFailed(status, driver.summary(answer)))
            raise failures[-1]
        return answer["value"]

    namespace = {"__name__": "__check__", "__builtins__": builtins, PASS_THROUGH: (HarnessTimeout, CandidateFailed),
                 RECORD: lambda ok: asserted.append(bool(ok))}
    remaining = deadline - time.monotonic()
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, max(remaining, 0.001))
    try:
        if tests.get("prompt"):
            exec(compile(tests["prompt"], "<prompt>", "exec"), namespace)
        namespace[driver.job["entry_point"]] = candidate  # test code may call the function by name (HumanEval/33)
        exec(every_assert_runs(tests["code"]), namespace)
        namespace["check"](candidate)
        outcome = ("passed", "") if all(asserted) else ("failed", "AssertionError in the hidden tests")
    except HarnessTimeout:
        driver.close()
        outcome = ("timeout", "")
    except CandidateFailed as e:
        outcome = (e.status if e.status != "ok" else "error", e.error)
    except BaseException as e:  # noqa: BLE001 - the test code raised (e.g. on a wrong type from the candidate): a wrong answer
        outcome = ("failed", "%s in the hidden tests" % (_type(e).__name__ if _type(e).__name__ in BUILTIN_EXCEPTIONS else "an exception"))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    if failures and outcome[0] in ("passed", "failed"):
        outcome = (failures[0].status if failures[0].status != "ok" else "error", failures[0].error)  # the test swallowed it
    return outcome


def _on_alarm(signum, frame):
    raise HarnessTimeout()


def read_message(fd):
    header = _read_exactly(fd, 8)
    return marshal.loads(_read_exactly(fd, int.from_bytes(header, "big")))


def main():
    if sys.argv[1:] == ["candidate"]:  # a fresh interpreter exec'd by the driver: job on fd 0, pipes on 3 and 4
        job = marshal.loads(_read_all(0))
        os.close(0)
        start_candidate(job, 3, 4)
        os._exit(0)
    job = read_message(0)
    _libc().prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # no /proc/<pid>/mem of the driver for a candidate of the same uid (not root)
    sys.set_int_max_str_digits(0)  # answers' integers are bounded by MAX_INT_DIGITS when decoded
    reporter = Reporter(job["channel_fd"])
    os.set_inheritable(job["channel_fd"], False)
    driver = Driver(job)
    ready_sent = False
    try:
        try:
            driver.spawn(clean_memory=False)  # forked before the tests are read: nothing secret to copy
            tests = read_message(0)
            os.close(0)
            reporter.send(event="ready", isolated=driver.isolated)
            ready_sent = True
            setup = driver.answer(time.monotonic() + job["limits"]["timeout_s"], 1 << 16)
            if answer_status(setup) != "ok":
                reporter.send(event="setup_failed", status=answer_status(setup), error=driver.summary(setup, setup=True)[:300])
                return
        except Lost as lost:
            if driver.isolated is not None and not ready_sent:
                reporter.send(event="ready", isolated=driver.isolated)
            reporter.send(event="setup_failed", status=lost.status, error="")
            return
        run_tests(driver, tests, reporter)
    except Exception:  # noqa: BLE001 - a driver bug: say so instead of dying silently
        import traceback

        reporter.send(event="harness_error", traceback=traceback.format_exc()[-4000:])
        os._exit(1)
    finally:
        driver.close()
    reporter.send(event="finished")


def _read_all(fd):
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


_ORIGINAL_BUILTINS = dict(vars(builtins))
_ORIGINAL_BUILTINS.setdefault("exit", sys.exit)  # ``site`` (not loaded under -S) would add these
_ORIGINAL_BUILTINS.setdefault("quit", sys.exit)

if __name__ == "__main__":
    main()
    os._exit(0)  # skip interpreter shutdown
