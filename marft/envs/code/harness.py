"""The process that runs one program's tests inside the sandbox (standard library only).

Started by ``marft.envs.code.sandbox`` as ``python3 -I -S harness.py`` with:

* fd 0: the job, one ``marshal``-ed dict from the grader (program, tests *without* their expected
  outputs, limits, nonce); ``marshal`` and the small JSON writer below spare the ~8 ms that
  importing ``json`` and ``traceback`` would add to every run;
* fd ``job["channel_fd"]``: the report channel, a pipe back to the grader; one line per event,
  ``<nonce> <json>``.

It starts as root (when the grader is root) only to build the sandbox, in this order: resource
limits, new network and mount namespaces, a size-limited tmpfs as the working directory,
``/tmp``, ``/var/tmp`` and ``/dev/shm`` read-only, then it drops to the slot's unprivileged
uid/gid with ``no_new_privs`` set, and only then compiles and runs the program. Every test is
announced (``start``) and reported (``done``); the grader enforces the per-test wall clock and
compares outputs itself: expected outputs never enter the sandbox, so nothing the program
prints or returns can pass a test unless it is the right answer.

Test kinds (``job["kind"]``):

* ``stdin``: the program runs once per test, as ``__main__`` in a fresh namespace, with fd 0
  holding the input and fds 1/2 fresh memory files; ``done`` carries the captured stdout.
* ``call``: the program runs once; each test evaluates a call expression such as ``f(2, 3)``
  in its namespace; ``done`` carries ``repr`` of the result if it is plain data.
* ``check``: the program runs once; the test code runs in its own namespace whose builtins are
  the originals captured before the program ran, and its ``check(candidate)`` is called with a
  guarded candidate (plain-data results only, tracing switched off after every call).
"""

import ctypes
import errno
import fcntl
import io
import marshal
import os
import resource
import signal
import sys
import time

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 36, 38
WRITABLE_SYSTEM_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
PLAIN_TYPES = (int, float, complex, str, bytes, bool, type(None), list, tuple, dict, set, frozenset)

_ORIGINAL_BUILTINS = dict(__builtins__.__dict__ if hasattr(__builtins__, "__dict__") else __builtins__)
_ORIGINAL_BUILTINS.setdefault("exit", sys.exit)  # ``site`` (not loaded under -S) would add these
_ORIGINAL_BUILTINS.setdefault("quit", sys.exit)
_type, _id, _len, _repr, _isinstance = type, id, len, repr, isinstance
_settrace, _setprofile, _getframe = sys.settrace, sys.setprofile, sys._getframe


class HarnessTimeout(BaseException):
    """Raised into the program when a test's time is up."""


_JSON_ESCAPES = {i: "\\u%04x" % i for i in range(32)}
_JSON_ESCAPES.update({ord("\\"): "\\\\", ord('"'): '\\"', 0x2028: "\\u2028", 0x2029: "\\u2029"})


def to_json(value):
    """JSON text of the harness's own events (str, int, float, bool, None, lists, str-keyed dicts)."""
    kind = _type(value)
    if kind is str:
        return '"' + value.translate(_JSON_ESCAPES) + '"'
    if value is None or kind is bool:
        return {None: "null", True: "true", False: "false"}[value]
    if kind is int:
        return str(value)
    if kind is float:
        return repr(value) if value == value and value not in (float("inf"), float("-inf")) else "null"
    if kind in (list, tuple):
        return "[" + ", ".join(to_json(item) for item in value) + "]"
    if kind is dict:
        return "{" + ", ".join(to_json(str(k)) + ": " + to_json(v) for k, v in value.items()) + "}"
    raise TypeError("cannot write %s as JSON" % kind.__name__)


class Channel:
    """Writes ``<nonce> <json>`` lines to the grader; never from a forked child of the program."""

    def __init__(self, fd, nonce):
        self.fd, self.nonce, self.pid = fd, nonce, os.getpid()

    def send(self, **event):
        if os.getpid() != self.pid:  # a fork of the program returned into harness code
            os._exit(1)
        data = (self.nonce + " " + to_json(event) + "\n").encode("utf-8", "replace")
        while data:
            data = data[os.write(self.fd, data):]


# ---------------------------------------------------------------- building the sandbox


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _call(result, what):
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, "%s: %s" % (what, os.strerror(errno)))


def set_limits(limits):
    """Resource limits of the harness and everything it starts."""
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


def private_mounts(libc, job):
    """In the new mount namespace: a size-limited tmpfs on the working directory, shared temp folders read-only."""
    _call(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "make mounts private")
    options = "size=%dk,mode=0700,uid=%d,gid=%d" % (job["limits"]["disk_bytes"] >> 10, job["uid"], job["gid"])
    _call(libc.mount(b"tmpfs", job["workdir"].encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options.encode()), "mount tmpfs")
    for path in WRITABLE_SYSTEM_DIRS:
        if os.path.isdir(path) and not os.path.islink(path):
            target = path.encode()
            _call(libc.mount(target, target, None, MS_BIND | MS_REC, None), "bind " + path)
            _call(libc.mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, None), "read-only " + path)


def isolate(job):
    """Namespaces, the private working directory and the uid drop; returns what was isolated."""
    libc, root = _libc(), os.geteuid() == 0
    done = {"network": False, "mounts": False, "uid": False}
    flags = CLONE_NEWNET | CLONE_NEWNS
    if libc.unshare(flags if root else flags | CLONE_NEWUSER) == 0:
        done["network"] = True
        done["mounts"] = root
    elif not root and libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
        done["network"] = True
    workdir = job["workdir"].encode()
    if done["mounts"]:
        try:
            private_mounts(libc, job)
        except OSError:
            done["mounts"] = False  # e.g. a container without mount rights: permissions protect the rest
    os.chdir(workdir)
    if root and job["uid"] > 0:
        os.setgroups([])
        os.setgid(job["gid"])
        os.setuid(job["uid"])
        done["uid"] = True
        UID_DROPPED.append(True)
    _call(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # /proc/self readable by the program itself
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the grader dies: so does the harness
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphaned descendants become the harness's children
    if os.getppid() != job["grader_pid"]:
        os._exit(1)
    return done


def clean_environment():
    """A minimal ``os.environ``; the process was started with the same one."""
    os.environ.clear()
    os.environ.update({"PATH": "/usr/bin:/bin", "HOME": os.getcwd(), "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"})


# ---------------------------------------------------------------- running code


def _memfile(name, data=b""):
    """A memory file at fd >= 10 (fds 0-2 may be closed by the program: they must not be reused)."""
    low = os.memfd_create(name, 0) if hasattr(os, "memfd_create") else os.open(".", os.O_TMPFILE | os.O_RDWR, 0o600)
    fd = fcntl.fcntl(low, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(low)
    if data:
        os.write(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _read_capped(fd, limit):
    os.lseek(fd, 0, os.SEEK_SET)
    chunks, size = [], 0
    while size < limit:
        chunk = os.read(fd, min(1 << 16, limit - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += _len(chunk)
    return b"".join(chunks)


class Capture:
    """Fresh fds 0/1/2 (memory files) and ``sys.std*`` objects for one test."""

    def __init__(self, stdin_data, job):
        self.job = job
        self.fds = [_memfile("stdin", stdin_data), _memfile("stdout"), _memfile("stderr")]
        for target, fd in enumerate(self.fds):
            os.dup2(fd, target)
        self.out = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)), encoding="utf-8", errors="replace")
        self.err = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)), encoding="utf-8", errors="replace", line_buffering=True)
        sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8", errors="replace")
        sys.stdout, sys.stderr = self.out, self.err
        sys.__stdout__, sys.__stderr__, sys.__stdin__ = sys.stdout, sys.stderr, sys.stdin

    def finish(self):
        """``(stdout text, stderr tail, output limit reached)``; closes the memory files."""
        over = False
        for stream in (self.out, self.err):
            try:
                stream.flush()
            except (OSError, ValueError):
                over = True
        limit = self.job["limits"]["file_bytes"]
        stdout = _read_capped(self.fds[1], limit)
        over = over or os.fstat(self.fds[1]).st_size >= limit
        err_size = os.fstat(self.fds[2]).st_size
        keep = self.job["stderr_bytes"]
        os.lseek(self.fds[2], max(0, err_size - keep), os.SEEK_SET)
        stderr = os.read(self.fds[2], keep)
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        return stdout.decode("utf-8", "replace"), stderr.decode("utf-8", "replace"), over


def _on_alarm(signum, frame):
    raise HarnessTimeout()


SOURCES = {}
"""Source lines of the program and the test code, for tracebacks."""


def short_traceback(error):
    """A traceback without the harness's frames (cheaper than ``traceback``, which parses with ``ast``)."""
    lines = ["Traceback (most recent call last):"]
    tb = error.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_filename in SOURCES:
            lines.append('  File "%s", line %d, in %s' % (code.co_filename, tb.tb_lineno, code.co_name))
            source = SOURCES[code.co_filename]
            if 0 < tb.tb_lineno <= _len(source):
                lines.append("    " + source[tb.tb_lineno - 1].strip())
        tb = tb.tb_next
    try:
        message = str(error)
    except BaseException:  # noqa: BLE001 - the program's own __str__ may fail
        message = ""
    lines.append(_type(error).__name__ + (": " + message if message else ""))
    return "\n".join(lines) + "\n"


def run_timed(function, timeout_s):
    """``(status, seconds)`` of ``function()``: ok, error, timeout or memory (a traceback goes to fd 2)."""
    start = time.monotonic()
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    status = "ok"
    try:
        function()
    except HarnessTimeout:
        status = "timeout"
    except SystemExit as e:
        status = "ok" if e.code in (None, 0) else "error"
    except MemoryError:
        status = "memory"
    except BaseException as e:  # noqa: BLE001 - whatever the program raises is its failure
        status = "output_limit" if _isinstance(e, OSError) and e.errno in (errno.EFBIG, errno.ENOSPC) else "error"
        try:
            os.write(2, short_traceback(e).encode("utf-8", "replace"))
        except BaseException:  # noqa: BLE001
            pass
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        if os.getpid() != _HARNESS_PID:  # a forked child of the program: never run harness code
            os._exit(1)
    _settrace(None)
    _setprofile(None)
    seconds = time.monotonic() - start
    if seconds > timeout_s and status in ("ok", "error"):
        status = "timeout"  # the program caught the timeout and went on
    return status, seconds


LEFTOVERS = []
"""Set (non-empty) once a test left processes behind."""


UID_DROPPED = []
"""Set (non-empty) once the harness runs as the slot's own uid: only then may it kill by uid."""


def kill_leftovers():
    """SIGKILL every other process of the slot's uid (the program's children); never the harness itself.

    The harness is a child subreaper, so every descendant, however it detached, is reaped here:
    waiting until none is left both confirms they are gone and frees their ``RLIMIT_NPROC`` slots.
    Without a uid of its own (the grader is not root) ``kill(-1)`` would hit the grader: then only
    the harness's own descendants are reaped.
    """
    while True:
        if UID_DROPPED:
            try:
                os.kill(-1, signal.SIGKILL)
            except OSError:
                pass
        try:
            pid, _ = os.waitpid(-1, 0 if UID_DROPPED else os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        LEFTOVERS.append(pid)


def fresh_namespace(name="__main__"):
    return {"__name__": name, "__builtins__": dict(_ORIGINAL_BUILTINS)}


def is_plain(value, depth=0):
    """Whether ``value`` is built only of exact builtin data types (no subclass can fake ``==``)."""
    kind = _type(value)
    if depth > 100 or kind not in PLAIN_TYPES:
        return False
    if kind in (list, tuple, set, frozenset):
        return all(is_plain(item, depth + 1) for item in value)
    if kind is dict:
        return all(is_plain(k, depth + 1) and is_plain(v, depth + 1) for k, v in value.items())
    return True


# ---------------------------------------------------------------- the three kinds of tests


def run_stdin_tests(job, code, channel):
    for i in range(job["start"], _len(job["tests"])):
        channel.send(event="start", i=i)
        capture = Capture(job["tests"][i].encode("utf-8"), job)
        status, seconds = run_timed(lambda: exec(code, fresh_namespace()), job["timeout_s"])
        stdout, stderr, over = capture.finish()
        kill_leftovers()
        if over:
            status = "output_limit"
        channel.send(event="done", i=i, status=status, stdout=stdout, stderr=stderr, seconds=seconds)


def load_program(job, code, channel, namespace):
    """Run the program's top level once; on failure report every remaining test with its status."""
    channel.send(event="start", i=job["start"], setup=True)
    capture = Capture(b"", job)
    status, _ = run_timed(lambda: exec(code, namespace), job["timeout_s"])
    _, stderr, over = capture.finish()
    kill_leftovers()
    if over:
        status = "output_limit"
    if status != "ok":
        channel.send(event="setup_failed", status=status, stderr=stderr, leftovers=bool(LEFTOVERS))
    return status == "ok"


def run_call_tests(job, code, channel):
    namespace = fresh_namespace()
    if not load_program(job, code, channel, namespace):
        return
    for i in range(job["start"], _len(job["tests"])):
        channel.send(event="start", i=i)
        capture = Capture(b"", job)
        result = []
        call = compile(job["tests"][i], "<test>", "eval")
        status, seconds = run_timed(lambda: result.append(eval(call, namespace)), job["timeout_s"])
        _, stderr, over = capture.finish()
        kill_leftovers()
        value = None
        if status == "ok":
            if is_plain(result[0]):
                try:
                    value = _repr(result[0])
                except (ValueError, RecursionError, MemoryError) as e:
                    status, stderr = "error", stderr + "\nthe result cannot be written out (%s)" % _type(e).__name__
            else:
                status, stderr = "error", stderr + "\nthe result is not plain data (%s)" % _type(result[0]).__name__
        if over or (value is not None and _len(value) > job["limits"]["file_bytes"]):
            status, value = "output_limit", None
        channel.send(event="done", i=i, status=status, value=value, stderr=stderr, seconds=seconds)


def guarded(candidate):
    """``candidate`` as the test code sees it: results must be plain data, tracing is reset."""

    def call(*args, **kwargs):
        try:
            result = candidate(*args, **kwargs)
        finally:
            _settrace(None)
            _setprofile(None)
            frame = _getframe(0)
            while frame is not None:
                frame.f_trace = None
                frame = frame.f_back
        if not is_plain(result):
            raise TypeError("candidate returned %s, not plain data" % _type(result).__name__)
        return result

    return call


def restore_modules():
    """Undo the program's monkey-patching of modules loaded before it ran (``sys`` aside), and
    forget modules it imported, so that the test code imports fresh, unpatched ones."""
    for name, saved in _MODULES_BEFORE.items():
        module = sys.modules.get(name)
        if module is None or name == "sys":
            continue
        current = module.__dict__
        for key, value in saved.items():
            if current.get(key) is not value:
                current[key] = value
    for name in [m for m in sys.modules if m not in _MODULES_BEFORE]:
        del sys.modules[name]


def run_check_test(job, code, channel):
    program = fresh_namespace()
    if not load_program(job, code, channel, program):
        return
    channel.send(event="start", i=0)
    capture = Capture(b"", job)
    SOURCES["<test>"] = job["tests"][0].splitlines()
    test_code = compile(job["tests"][0], "<test>", "exec")
    entry_point = job["entry_point"]

    def run_check():
        namespace = dict(program)  # the prompt's helpers (e.g. ``poly``) are visible to the test
        namespace.update(fresh_namespace("__check__"))
        restore_modules()
        exec(test_code, namespace)
        check = namespace["check"]  # defined by the test code, after the program
        check(guarded(program[entry_point]))

    status, seconds = run_timed(run_check, job["timeout_s"])
    _, stderr, over = capture.finish()
    kill_leftovers()
    if over:
        status = "output_limit"
    channel.send(event="done", i=0, status=status, stderr=stderr, seconds=seconds)


RUNNERS = {"stdin": run_stdin_tests, "call": run_call_tests, "check": run_check_test}


def main():
    job = marshal.loads(sys.stdin.buffer.read())
    channel = Channel(job["channel_fd"], job["nonce"])
    os.set_inheritable(job["channel_fd"], False)
    set_limits(job["limits"])
    isolated = isolate(job)
    clean_environment()
    sys.argv = [""]
    if hasattr(sys, "set_int_max_str_digits"):
        sys.set_int_max_str_digits(0)  # big-integer answers are common in contest problems
    try:
        SOURCES["<program>"] = job["program"].splitlines()
        code = compile(job["program"], "<program>", "exec")
    except (SyntaxError, ValueError) as e:
        channel.send(event="ready", isolated=isolated)
        channel.send(event="setup_failed", status="error", stderr="%s: %s" % (_type(e).__name__, e))
        return
    channel.send(event="ready", isolated=isolated)
    try:
        RUNNERS[job["kind"]](job, code, channel)
    except Exception:  # noqa: BLE001 - a harness bug: say so instead of dying silently
        import traceback

        channel.send(event="harness_error", traceback=traceback.format_exc()[-4000:])
        os._exit(1)
    channel.send(event="finished", leftovers=bool(LEFTOVERS))


_HARNESS_PID = os.getpid()
_MODULES_BEFORE = {name: dict(vars(module)) for name, module in list(sys.modules.items()) if module is not None}

if __name__ == "__main__":
    main()
    os._exit(0)  # skip interpreter shutdown: nothing the program registered (atexit, __del__) runs
