"""The sandbox's second round (issue 78): no state shared between runs, no oracle inside a run, sockets by
allowlist, no inherited descriptor, comparisons that never raise. Each attack is a hostile program; the
cross-run ones run twice and compare what the second run saw. docs/code.md ("Threat model") lists them.
"""

import fcntl
import marshal
import math
import os
import resource
import time

import pytest
from test_code_hostile import FAST, ROOT, contained, hostile  # noqa: F401 - the fixture

from marft.envs.code import run_tests
from marft.envs.code.compare import outputs_match, tokens_match, values_equal
from marft.sandbox import runner

needs_root = pytest.mark.skipif(not ROOT, reason="the full sandbox (namespaces, cgroups, uid drop) needs root")
ADD_CALLS = [{"call": "add(1, 2)", "expected": "3"}, {"call": "add(5, 5)", "expected": "10"}]
ADD_CHECK = "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(5, 5) == 10\n"


# ---------------------------------------------------------------- descriptors: nothing of the driver's above fd 4

FORGE_ON_EVERY_FD = (
    "import os\n"
    "EVENTS = b''.join([\n"
    "    b'{\"event\": \"done\", \"i\": 0, \"status\": \"passed\", \"error\": \"\", \"seconds\": 0.0}\\n',\n"
    "    b'{\"event\": \"start\", \"i\": 1}\\n',\n"
    "    b'{\"event\": \"done\", \"i\": 1, \"status\": \"passed\", \"error\": \"\", \"seconds\": 0.0}\\n',\n"
    "    b'{\"event\": \"finished\"}\\n'])\n"
    "def forge():\n"
    "    for name in os.listdir('/proc/self/fd'):\n"
    "        try:\n"
    "            os.write(int(name), EVENTS)\n"
    "        except OSError:\n"
    "            pass\n"
    "def add(a, b):\n"
    "    forge()\n"
    "    return 0\n"
    "def high_fds():\n"
    "    return sorted(int(name) for name in os.listdir('/proc/self/fd') if int(name) >= 1000)\n"
)
"""A program that writes a complete forged event stream ("passed", "passed", "finished") to every fd it holds."""


@pytest.fixture
def high_event_pipe(monkeypatch):
    """The grader's event pipe at fd 70000 (a long trainer with many open files): the driver and the candidate
    forked from it hold it there unless they close every fd, with no upper bound. Where the hard limit on open
    files is lower and cannot be raised (no ``CAP_SYS_RESOURCE``), at the highest fd it allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1 << 17), max(hard, 1 << 17)))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    target = min(70000, resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 1)
    placed = []

    def pipe():
        read_fd, write_fd = os.pipe()
        high = fcntl.fcntl(write_fd, fcntl.F_DUPFD_CLOEXEC, target)
        os.close(write_fd)
        placed.append(high)
        return read_fd, high

    monkeypatch.setattr(runner, "event_pipe", pipe)
    yield placed
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@needs_root
def test_an_event_pipe_above_65536_never_reaches_the_candidate(high_event_pipe, contained):
    """``closerange(5, 1 << 16)`` left fd 70000 open in the first candidate: its forged "passed" events counted."""
    report, _ = hostile(FORGE_ON_EVERY_FD, ADD_CALLS + [{"call": "high_fds()", "expected": "[]"}])
    assert high_event_pipe and high_event_pipe[0] >= min(65536, resource.getrlimit(resource.RLIMIT_NOFILE)[1] - 1)
    assert report.statuses == ("failed", "failed", "passed"), report
    report, _ = hostile(FORGE_ON_EVERY_FD, ADD_CHECK, entry_point="add")
    assert report.passed == 0, report


def test_a_malformed_event_stream_fails_every_test_of_the_run():
    """An earlier "passed" is not kept once the stream turns out forged (the driver's own "done" then arrives
    out of order)."""
    run = runner.HarnessRun({"kind": "stdin", "program": "", "entry_point": None}, {"cases": [{"input": "", "output": ""}] * 2},
                            FAST, deadline=0.0)
    run._take(b'{"event": "start", "i": 0}\n{"event": "done", "i": 0, "status": "passed", "error": "", "seconds": 0.1}\n')
    assert run.result.statuses == {0: "passed"}  # control: a good verdict is taken
    run._take(b'{"event": "done", "i": 0, "status": "failed", "error": "", "seconds": 0.1}\n')
    assert run.result.end == "malformed" and run.result.statuses == {} and run.result.end_status == "error"


# ---------------------------------------------------------------- sockets: AF_INET and AF_INET6 only

SOCKET_ERRNOS = (
    "import ctypes\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "libc.syscall.restype = ctypes.c_long\n"
    "def errnos(nr, family):\n"
    "    seen = set()\n"
    "    for kind in (1, 2, 3, 5):  # SOCK_STREAM, SOCK_DGRAM, SOCK_RAW, SOCK_SEQPACKET\n"
    "        pair = (ctypes.c_int * 2)()\n"
    "        ctypes.set_errno(0)\n"
    "        fd = libc.syscall(ctypes.c_long(nr), ctypes.c_long(family), ctypes.c_long(kind), ctypes.c_long(0), pair)\n"
    "        seen.add(ctypes.get_errno() if fd < 0 else 0)\n"
    "    return sorted(seen)\n"
)
"""A program's helper: the errnos of ``socket``/``socketpair`` (syscall ``nr``) of ``family`` over four socket types
(0 where one was created)."""
DENIED_FAMILIES = {"AF_UNSPEC": 0, "AF_UNIX": 1, "AF_AX25": 3, "AF_IPX": 4, "AF_APPLETALK": 5, "AF_X25": 9, "AF_NETLINK": 16,
                   "AF_PACKET": 17, "AF_RDS": 21, "AF_LLC": 26, "AF_CAN": 29, "AF_TIPC": 30, "AF_BLUETOOTH": 31, "AF_ALG": 38,
                   "AF_VSOCK": 40, "AF_KCM": 41, "AF_QIPCRTR": 42, "AF_SMC": 43, "AF_XDP": 44, "AF_MCTP": 45, "past AF_MAX": 46,
                   "255": 255, "AF_VSOCK with high bits": (1 << 32) | 40}
SYS_SOCKET, SYS_SOCKETPAIR, EPERM = 41, 53, 1


@needs_root
@pytest.mark.parametrize("family", DENIED_FAMILIES)
def test_every_socket_family_but_inet_is_denied(family, contained):
    """The filter named AF_UNIX and AF_NETLINK only: AF_VSOCK (outside the network namespace: the host VM's port
    space), AF_PACKET, AF_ALG and every other family could be created, and each loads kernel code of its own."""
    number = DENIED_FAMILIES[family]
    report, _ = hostile(SOCKET_ERRNOS, [{"call": f"errnos({SYS_SOCKET}, {number})", "expected": f"[{EPERM}]"},
                                        {"call": f"errnos({SYS_SOCKETPAIR}, {number})", "expected": f"[{EPERM}]" if number != 1 else "[0]"}])
    assert report.statuses == ("passed", "passed"), report


@needs_root
def test_inet_sockets_and_unix_socketpairs_still_work(contained):
    """Honest programs keep TCP/UDP sockets (in an empty network namespace: nothing to reach) and ``socketpair``
    (asyncio's event loop makes one)."""
    program = ("import asyncio, socket\n"
               "async def double(x):\n    await asyncio.sleep(0)\n    return 2 * x\n"
               "for family in (socket.AF_INET, socket.AF_INET6):\n"
               "    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):\n"
               "        socket.socket(family, kind).close()\n"
               "print(asyncio.run(double(int(input()))))\n")
    report, _ = hostile(program, [{"input": "21\n", "output": "42"}])
    assert report.statuses == ("passed",), report


# ---------------------------------------------------------------- comparisons: hostile values give a verdict, never an error

def deep(depth, leaf=1.5):
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("actual, expected", [
    (10 ** 400, 1.5), (-10 ** 400, 1.5), (10 ** 400, math.inf), (10 ** 400, math.nan), ([10 ** 400], [1.5]), ({"a": 10 ** 400}, {"a": 0.0}),
    (math.nan, 1.5), (math.inf, 1.5), ((1, 10 ** 400), (1, 2.5)), (deep(5000), deep(5000)), (deep(5000), [1.5]), ([1.5], deep(5000)),
])
def test_hostile_values_compare_unequal_without_raising(actual, expected):
    """``10 ** 400`` where a float is expected raised OverflowError in the driver (the test was an error, not a fail)."""
    assert values_equal(actual, expected) is False


def test_huge_numbers_still_compare_right():
    assert values_equal(10 ** 300, 1e300) and values_equal(2, 2.0) and values_equal(math.inf, math.inf) and values_equal([math.nan], [math.nan])
    assert not values_equal(10 ** 309, math.inf)  # past the float range: no float is that integer


@pytest.mark.parametrize("actual, expected", [("1e400", "1.5"), ("1" * 400, "1.5"), ("1.5", "1e400"), ("-" + "9" * 5000, "2.5"),
                                              ("1e99999999999999999999", "1.0"), ("0x10", "16"), ("nan", "1.5"), ("1_0", "10")])
def test_hostile_tokens_compare_unequal_without_raising(actual, expected):
    assert tokens_match(actual, expected) is False and outputs_match(f"{actual}\n", expected) is False


@needs_root
def test_an_integer_past_the_float_range_fails_the_test_not_errors(contained):
    """Returned for a float: a clean "failed", in call tests and in HumanEval's ``check`` alike."""
    program = "def f(x):\n    return 10 ** 400 if x else float('nan')\n"
    report, _ = hostile(program, [{"call": "f(1)", "expected": "1.5"}, {"call": "f(0)", "expected": "1.5"}])
    assert report.statuses == ("failed", "failed"), report
    report, _ = hostile(program, "def check(candidate):\n    assert abs(candidate(1) - 1.5) < 1e-6\n", entry_point="f")
    assert report.statuses == ("failed",), report


# ---------------------------------------------------------------- no oracle: every test runs, whatever the answers were

class RecordingDriver:
    """A stand-in for the driver's candidate side: records each call ``check`` makes, answers ``answer(args)``."""

    def __init__(self, answer):
        self.answer, self.calls = answer, []
        self.job, self.limits = {"entry_point": "f"}, {"file_bytes": 1 << 20}

    def request(self, message, deadline, cap):
        _, args, _ = marshal.loads(message)
        self.calls.append(args)
        return {"status": "ok", "value": self.answer(args)}

    def summary(self, answer, setup=False):
        return ""

    def close(self):
        pass


CHECK_THREE = ("def check(candidate):\n"
               "    assert candidate(1, 2) == 3, 'never evaluated ' + str(1 / 0)\n"
               "    assert len(candidate(5, 5)) == 10\n"  # raises TypeError on an int answer
               "    for k in range(3):\n"
               "        assert candidate(k, 1) == k + 1\n")


@pytest.mark.parametrize("name, answer, verdict", [
    ("right", lambda args: list(range(10)) if args == (5, 5) else sum(args), ("passed", "")),
    ("all wrong", lambda args: 0, ("failed", "AssertionError in the hidden tests")),
    ("first wrong", lambda args: 0 if args == (1, 2) else sum(args), ("failed", "AssertionError in the hidden tests")),
])
def test_check_calls_the_candidate_alike_whether_its_answers_are_right_or_not(name, answer, verdict):
    """The driver called the candidate again only when the previous assertion had passed: a run learned which of
    its answers were right (a wrong program passed HumanEval/0 on its 4th-5th try). Now every assertion runs, an
    exception in one included, and the calls are the same whatever the answers."""
    from marft.sandbox.harness.driver import run_check

    driver = RecordingDriver(answer)
    outcome = run_check(driver, {"code": CHECK_THREE, "prompt": ""}, time.monotonic() + 30)
    assert outcome == verdict
    assert driver.calls == [(1, 2), (5, 5), (0, 1), (1, 1), (2, 1)], name


@needs_root
def test_test_code_that_raises_on_an_answer_fails_the_test_and_later_asserts_still_run(contained):
    check = ("def check(candidate):\n"
             "    assert len(candidate(1, 2)) == 3\n"  # TypeError on an int: recorded, not raised
             "    assert candidate(5, 5) == 10\n")
    report, _ = hostile("def add(a, b):\n    return a + b\n", check, entry_point="add")
    assert report.statuses == ("failed",), report


def test_every_assert_runs_leaves_other_code_alone():
    from marft.sandbox.harness.driver import every_assert_runs

    recorded = []
    namespace = {"__marft_record__": lambda ok: recorded.append(bool(ok)), "__marft_pass_through__": (KeyboardInterrupt,)}
    exec(every_assert_runs("x = 2\nassert x == 3, 1 / 0\nassert [][0]\nfor i in range(3):\n    assert i < 2\ny = x + 1\n"), namespace)
    assert recorded == [False, False, True, True, False] and namespace["y"] == 3
    with pytest.raises(KeyboardInterrupt):
        exec(every_assert_runs("def boom():\n    raise KeyboardInterrupt\nassert boom()\n"), namespace)


@needs_root
@pytest.mark.parametrize("kind", ["call", "check", "stdin"])
def test_feedback_names_no_line_reached_on_a_hidden_input(kind, contained):
    """The line of an exception raised while a test runs can spell out the hidden input (``if x == 3: raise`` on
    line 3): feedback names the class only. A syntax error or a failing top level, before any input, keeps its line."""
    branches = "".join(f"    if x == {k}:\n        raise ValueError\n" for k in range(10))
    if kind == "stdin":
        report, _ = hostile("x = int(input())\nif True:\n" + branches, [{"input": "7\n", "output": "0"}])
    elif kind == "call":
        report, _ = hostile("def f(x):\n" + branches, [{"call": "f(7)", "expected": "0"}])
    else:
        report, _ = hostile("def f(x):\n" + branches, "def check(candidate):\n    assert candidate(7) == 0\n", entry_point="f")
    assert report.stderr == "ValueError", report
    assert run_tests("x = 1\nprint(\n", [{"input": "7\n", "output": "0"}], limits=FAST).stderr.startswith("SyntaxError at line 2")
    report = run_tests("x = 1\nraise KeyError\ndef f(x):\n    return x\n", [{"call": "f(7)", "expected": "7"}], limits=FAST)
    assert report.stderr == "KeyError at line 2 of the program", report


class ScriptedDriver:
    """A stand-in for the driver's candidate side in ``run_tests``: answers every call with 3, logs the order."""

    def __init__(self, order):
        self.order, self.pid, self.started = order, 1, time.monotonic()
        self.job, self.limits = {"kind": "call"}, {"timeout_s": 1.0, "max_restarts": 8, "file_bytes": 1 << 20}

    def request(self, message, deadline, cap):
        self.order.append("answer")
        return {"status": "ok", "value": 3}

    def close(self):
        self.order.append("close")


def test_answers_are_compared_only_after_the_candidate_has_ended(monkeypatch):
    """Comparing an answer took longer when it was right (a short-circuit at the first wrong element or token: ms
    for a long output), before the next request: a timing oracle inside the run. Verdicts now come after it."""
    from marft.sandbox.harness import driver

    order, events = [], []
    monkeypatch.setattr(driver, "values_equal", lambda actual, expected: order.append("compare") or actual == expected)
    reporter = type("Reporter", (), {"send": lambda self, **event: events.append(event)})()
    cases = [{"call": "f()", "expected": expected, "size": 1} for expected in (3, 4, 3)]
    driver.run_tests(ScriptedDriver(order), {"cases": cases}, reporter)
    assert order == ["answer"] * 3 + ["close"] + ["compare"] * 3
    assert [e["event"] for e in events] == ["alive"] * 3 + ["start", "done"] * 3
    assert [e["status"] for e in events if e["event"] == "done"] == ["passed", "failed", "passed"]


@needs_root
def test_the_driver_stops_before_the_budget_and_still_reports_every_verdict(contained):
    """Verdicts come at the end of the run: the driver starts no test it could not finish within the total
    budget, so the grader's clock never ends a run whose verdicts are all still to be sent."""
    from marft.envs.code import SandboxLimits

    program = "import time\ndef f(x):\n    time.sleep(0.3)\n    return x\n"
    report, seconds = hostile(program, [{"call": f"f({k})", "expected": str(k)} for k in range(40)],
                              limits=SandboxLimits(timeout_s=1.5, memory_mb=512, startup_s=30, max_total_s=8))
    assert report.passed >= 1 and report.statuses[-1] == "timeout" and report.notes == (), report
    assert set(report.statuses) == {"passed", "timeout"} and seconds < 12


# ---------------------------------------------------------------- no state shared between runs: page cache, locks, inotify

PAGE_CACHE = (
    "import ctypes, os\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "libc.mmap.restype = ctypes.c_void_p\n"
    "libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]\n"
    "libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]\n"
    "libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]\n"
    "FOLDER = os.path.join(os.path.dirname(os.__file__), 'email')\n"
    "FILES = sorted(os.path.join(FOLDER, n) for n in os.listdir(FOLDER) if n.endswith('.py'))[:16]\n"
    "def warm():\n"
    "    for path in FILES:\n"
    "        with open(path, 'rb') as f:\n"
    "            f.read()\n"
    "    return 0\n"
    "def mark():  # evict: posix_fadvise(DONTNEED), and madvise(MADV_PAGEOUT) on a mapping\n"
    "    for path in FILES:\n"
    "        fd = os.open(path, os.O_RDONLY)\n"
    "        try:\n"
    "            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)\n"
    "        except OSError:\n"
    "            pass\n"
    "        size = os.fstat(fd).st_size\n"
    "        addr = libc.mmap(None, size, 1, 1, fd, 0)\n"
    "        libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(size), 21)\n"
    "        libc.munmap(addr, size)\n"
    "        os.close(fd)\n"
    "    return 0\n"
    "def bit(k):  # is file k's first page in the page cache? (preadv2(RWF_NOWAIT), else mincore, else -1)\n"
    "    fd = os.open(FILES[k], os.O_RDONLY)\n"
    "    try:\n"
    "        return int(os.preadv(fd, [bytearray(4096)], 0, os.RWF_NOWAIT) > 0)\n"
    "    except BlockingIOError:\n"
    "        return 0\n"
    "    except OSError:\n"
    "        pass\n"
    "    size = os.fstat(fd).st_size  # mincore: the kernel reports a file only its owner could write as all cached\n"
    "    addr = libc.mmap(None, size, 1, 1, fd, 0)\n"
    "    vec = (ctypes.c_ubyte * ((size + 4095) // 4096))()\n"
    "    ok = libc.mincore(ctypes.c_void_p(addr), size, vec) == 0\n"
    "    libc.munmap(addr, size)\n"
    "    return vec[0] & 1 if ok else -1\n"
)
"""A program that warms or evicts 16 standard-library files (shared with every run: host ``/usr`` read-only) and
reads back, one bit per file, whether each is cached."""


@needs_root
def test_a_run_cannot_leave_a_mark_in_the_page_cache_for_the_next(contained):
    """Run 1 warms (or evicts, with fadvise/madvise) 16 shared files; run 2 reads their residency (mincore,
    preadv2 with RWF_NOWAIT) and reports it through its statuses, one test per file. Run 2 must see no difference."""
    observe = [{"call": f"bit({k})", "expected": "1"} for k in range(16)]
    assert hostile(PAGE_CACHE, [{"call": "len(FILES)", "expected": "16"}])[0].statuses == ("passed",)
    hostile(PAGE_CACHE, [{"call": "warm()", "expected": "0"}])
    after_warming = hostile(PAGE_CACHE, observe)[0].statuses
    hostile(PAGE_CACHE, [{"call": "mark()", "expected": "0"}])
    after_evicting = hostile(PAGE_CACHE, observe)[0].statuses
    assert after_warming == after_evicting, (after_warming, after_evicting)


LOCKS = (
    "import fcntl, os, struct, time\n"
    "PATH = os.__file__\n"
    "def hold():  # a lock on a shared read-only file, held for 3 s\n"
    "    f = open(PATH, 'rb')\n"
    "    for attempt in (lambda: fcntl.flock(f, fcntl.LOCK_SH), lambda: fcntl.lockf(f, fcntl.LOCK_SH)):\n"
    "        try:\n"
    "            attempt()\n"
    "        except OSError:\n"
    "            pass\n"
    "    time.sleep(3)\n"
    "    return 0\n"
    "def probe(kind):  # 0: no other run holds a lock; 11 (EAGAIN) or 35: one does; 1: denied\n"
    "    time.sleep(1)\n"
    "    f = open(PATH, 'rb')\n"
    "    try:\n"
    "        if kind == 'flock':\n"
    "            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
    "        else:\n"
    "            lock = fcntl.fcntl(f, fcntl.F_GETLK, struct.pack('hhqqi', fcntl.F_WRLCK, 0, 0, 0, 0))\n"
    "            return 0 if struct.unpack('hhqqi', lock)[0] == fcntl.F_UNLCK else 11\n"
    "        return 0\n"
    "    except OSError as e:\n"
    "        return e.errno\n"
)


@needs_root
def test_a_lock_on_a_shared_file_is_no_channel_between_concurrent_runs(contained):
    """flock/fcntl locks on a file every run can read (the standard library) signal between runs at once."""
    from concurrent.futures import ThreadPoolExecutor

    probes = [{"call": "probe('flock')", "expected": "0"}, {"call": "probe('fcntl')", "expected": "0"}]
    limits = FAST.__class__(timeout_s=5, memory_mb=512, startup_s=30)
    alone = run_tests(LOCKS, probes, limits=limits).statuses
    with ThreadPoolExecutor(2) as pool:
        holder = pool.submit(run_tests, LOCKS, [{"call": "hold()", "expected": "0"}], limits=limits)
        beside = pool.submit(run_tests, LOCKS, probes, limits=limits)
        beside, holder = beside.result().statuses, holder.result().statuses
    assert holder == ("passed",) and alone == beside, (alone, beside)


@needs_root
def test_page_cache_advice_probes_locks_and_inotify_are_denied(contained):
    """Each call the filter denies for issue 78, by number, with arguments that would work (the program returns
    the errnos; 1 is EPERM from the filter, 38 ENOSYS for preadv2/pwritev2)."""
    program = ("import ctypes, os\n"
               "libc = ctypes.CDLL(None, use_errno=True)\n"
               "libc.syscall.restype = ctypes.c_long\n"
               "def err(nr, *args):\n"
               "    ctypes.set_errno(0)\n"
               "    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])\n"
               "    return ctypes.get_errno() if r == -1 else 0\n"
               "def probe():\n"
               "    fd = os.open(os.__file__, os.O_RDONLY)\n"
               "    buf = ctypes.create_string_buffer(4096)\n"
               "    iov = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 4096)\n"
               "    vec = ctypes.create_string_buffer(16)\n"
               "    page = libc.valloc(4096)\n"
               "    out = [err(221, fd, 0, 0, 4), err(187, fd, 0, 4096), err(327, fd, ctypes.addressof(iov), 1, 0, 0, 8),\n"
               "           err(328, fd, ctypes.addressof(iov), 1, 0, 0, 0), err(27, page, 4096, ctypes.addressof(vec)),\n"
               "           err(451, fd, 0, 0, 0), err(73, fd, 1 | 4), err(72, fd, 5, 0), err(72, fd, 6, 0), err(72, fd, 7, 0),\n"
               "           err(72, fd, 36, 0), err(72, fd, 37, 0), err(72, fd, 38, 0), err(72, fd, 1026, 0), err(72, fd, 1024, 0),\n"
               "           err(253), err(294, 0), err(254, 0, 0, 0), err(300, 0, 0), err(28, page, 4096, 3),\n"
               "           err(28, page, 4096, 20), err(28, page, 4096, 21), err(28, page, 4096, 22), err(28, page, 4096, 23),\n"
               "           err(440, 0, 0, 0, 0, 0), err(216, page, 4096, 0, 0, 0)]\n"
               "    return out + [err(28, page, 4096, 4), err(72, fd, 1, 0)]  # MADV_DONTNEED, F_GETFD: allowed\n")
    eperm, enosys = 1, 38
    expected = [eperm, eperm, enosys, enosys] + [eperm] * 22 + [0, 0]
    report, _ = hostile(program, [{"call": "probe()", "expected": repr(expected)}])
    assert report.statuses == ("passed",), report
