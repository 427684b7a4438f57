"""The driver (trusted), standard library only: it starts candidates, sends them one request at a time, enforces
each test's wall clock, judges every answer itself and reports verdicts to the grader.

:class:`Driver` is the exchange with the current candidate; :func:`run_tests` runs every test and reports the
verdicts only once the candidate has ended; :func:`run_check` runs HumanEval's ``check`` here with a proxy for the
candidate; :func:`main` is the program (``python3 -I -S <the harness folder>``, see ``__main__.py``).
"""

import builtins
import fcntl
import marshal
import math
import os
import select
import signal
import sys
import time

from .candidate import _memfile, start_candidate
from .compare import outputs_match, values_equal
from .isolation import LAYERS, PR_SET_DUMPABLE, _libc, close_fds_from
from .wire import _read_all, event_json, from_json, read_message

BUILTIN_EXCEPTIONS = frozenset(name for name, value in vars(builtins).items() if isinstance(value, type) and issubclass(value, BaseException))

_type, _len = type, len


# ---------------------------------------------------------------- the exchange with a candidate


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
                    os.execv(sys.executable, [sys.executable, "-I", "-S", os.path.dirname(os.path.abspath(__file__)), "candidate"])  # the harness folder
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


# ---------------------------------------------------------------- the tests and their verdicts


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


# ---------------------------------------------------------------- HumanEval's check, run here


class HarnessTimeout(BaseException):
    """Raised in the driver when a ``check`` run's time is up."""


class CandidateFailed(BaseException):
    """A proxied call did not return a plain value (the candidate raised, died, timed out, answered badly).
    A ``BaseException``, so that test code's ``except Exception`` cannot turn it into a pass."""

    def __init__(self, status, error):
        super().__init__(status, error)
        self.status, self.error = status, error


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


# ---------------------------------------------------------------- the program


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
