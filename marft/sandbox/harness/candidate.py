"""The candidate (untrusted), standard library only: from the driver's fork to the program's answers.

:func:`start_candidate` (still privileged) joins the slot's cgroups, unshares the namespaces and forks PID 1;
PID 1 runs :func:`serve`, which enters the sandbox (:func:`enter_sandbox`: file system, limits, uid drop,
``no_new_privs``, seccomp) before any program code runs, loads the program and answers the driver's requests
(:func:`answer_requests`) with plain data only.
"""

import builtins
import errno
import fcntl
import io
import marshal
import os
import signal
import sys

from .isolation import (
    CLONE_NEWIPC,
    CLONE_NEWNET,
    CLONE_NEWNS,
    CLONE_NEWPID,
    CLONE_NEWUSER,
    CLONE_NEWUTS,
    LAYERS,
    MS_PRIVATE,
    MS_REC,
    PR_SET_DUMPABLE,
    PR_SET_NO_NEW_PRIVS,
    PR_SET_PDEATHSIG,
    _call,
    _libc,
    _mount,
    join_cgroups,
    minimal_root,
    private_mounts,
    set_limits,
)
from .seccomp import install_seccomp
from .wire import read_frame_blocking, send_frame, to_json

SANDBOX_PATH = "/usr/bin:/bin"

_type, _isinstance = type, isinstance


# ---------------------------------------------------------------- the candidate's start: namespaces, PID 1, its sandbox


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


_ORIGINAL_BUILTINS = dict(vars(builtins))
"""The builtins as the interpreter started, before any program ran: each program namespace gets a copy."""
_ORIGINAL_BUILTINS.setdefault("exit", sys.exit)  # ``site`` (not loaded under -S) would add these
_ORIGINAL_BUILTINS.setdefault("quit", sys.exit)
