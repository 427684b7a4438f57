"""Red team of the issue-31 sandbox: attacks that got through (each test failed before its fix), and the
most valuable of those that did not (regressions). Hostile programs forge frames on the candidate's own
answer pipe (fd 4: plain data the driver must treat as untrusted), stall the driver, lie through types.
"""

import json
import os
import sys
import time

import pytest
from test_code_hostile import FAST, ROOT, contained, hostile  # noqa: F401 - the fixture

from marft.envs.code import SandboxLimits
from marft.envs.code.compare import values_equal
from marft.sandbox.harness.wire import MAX_INT_DIGITS, from_json

needs_root = pytest.mark.skipif(not ROOT, reason="the full sandbox (namespaces, cgroups, uid drop) needs root")

ADD_CHECK_CODE = "def check(candidate):\n    assert candidate(1, 2) == 3\n"
FRAME = ("import os\n"
         "def frame(text):\n"
         "    data = text.encode()\n"
         "    os.write(4, len(data).to_bytes(4, 'big') + data)\n")
"""A program's helper: write one answer frame of its own on the candidate's answer pipe (fd 4)."""


# ---------------------------------------------------------------- comparison: bool/int/float through hashing


@pytest.mark.parametrize("returned, expected", [
    ("{True, 2}", "{1, 2}"), ("{1.0, 2}", "{1, 2}"), ("{(True, 0)}", "{(1, 0)}"), ("{frozenset({False})}", "{frozenset({0})}"),
    ("{True: 'a'}", "{1: 'a'}"), ("{1.0: 'a'}", "{1: 'a'}"), ("{(0, True): 1}", "{(0, 1): 1}"),
])
def test_a_bool_or_float_is_not_an_integer_inside_sets_and_dict_keys(returned, expected):
    """Set elements and dict keys were compared by hash and ``==``, where ``True == 1 == 1.0``: a wrong type passed."""
    assert not values_equal(eval(returned), eval(expected))
    assert values_equal(eval(expected), eval(expected))


def test_sets_and_dict_keys_still_compare_as_values():
    assert values_equal(frozenset({1, 2, (3, "a")}), {2, 1, (3, "a")}) and values_equal({(1, 2): [1.0]}, {(1, 2): (1.0000000001,)})
    assert values_equal({True, 0}, {0, True}) and not values_equal({1, 2}, {1, 2, 3}) and not values_equal({1: 2}, {2: 1})
    nan = float("nan")
    assert values_equal({nan}, {float("nan")}) and values_equal({1.5: nan}, {1.5: float("nan")})


@needs_root
def test_a_set_of_bools_is_not_paid_for_a_set_of_integers(contained):
    report, _ = hostile("def f():\n    return {True, 2}\n", [{"call": "f()", "expected": "{1, 2}"}])
    assert report.passed == 0, report


# ---------------------------------------------------------------- the driver's own time: writes and decoding


@needs_root
def test_a_candidate_that_stops_reading_requests_times_out_within_its_limit(contained):
    """The program answers test 0 itself and never returns to the request loop: the driver's write of test 1's
    large input (more than a pipe holds) blocked with no clock, until the grader's backstop (~35 s here)."""
    program = FRAME + ("import sys, time\n"
                       "sys.stdin.read()\n"
                       "frame('{\"d\":[[\"status\",\"ok\"],[\"stdout\",\"1\"]]}')\n"
                       "time.sleep(1000)\n")
    tests = [{"input": "1\n" * 200_000, "output": "1"}] * 3
    report, seconds = hostile(program, tests)
    assert report.statuses == ("passed", "timeout", "passed"), report  # its own answers (a fresh candidate for test 2)
    assert seconds < 3 * FAST.timeout_s + 5, seconds


def test_huge_integers_in_an_answer_are_bounded_in_total_not_only_each():
    """``int`` of decimal text is quadratic: 80 integers of 100,000 digits (8 MB, under the answer cap) took the
    driver ~5 s of CPU, past every clock (a C call is not interrupted by the alarm)."""
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)  # as in the driver
    try:
        _check_integer_budget()
    finally:
        sys.set_int_max_str_digits(limit)


def _check_integer_budget():
    one = "9" * MAX_INT_DIGITS
    assert from_json(("[" + ",".join([one] * 2) + "]").encode()) == [int(one)] * 2  # what a big-integer answer needs
    started = time.process_time()
    with pytest.raises(ValueError):
        from_json(("[" + ",".join([one] * 80) + "]").encode())
    assert time.process_time() - started < 1.0
    assert from_json(("[" + ",".join(["12345678901234567890"] * 100_000) + "]").encode())[-1] == 12345678901234567890  # short ones: no budget


# ---------------------------------------------------------------- regressions: attacks that did not work


@needs_root
@pytest.mark.parametrize("kind", ["call", "check", "stdin"])
def test_forged_answer_frames_fail_safely(kind, contained):
    """Frames the program writes itself: nested too deeply, an untagged object, twice, a header with no body,
    a length past every cap. Each fails the program (never the driver, never a pass)."""
    frames = ["'{\"d\":[[\"status\",\"ok\"],[\"value\",' + '[' * 990 + ']' * 990 + ']]}'",
              "'{\"status\":\"ok\",\"value\":3}'", "'{\"d\":[[\"status\",\"ok\"],[\"value\",0]]}' * 2"]
    for forged in frames + ["RAW:(2**32 - 1).to_bytes(4, 'big')", "RAW:(100).to_bytes(4, 'big')"]:
        write = ("    os.write(4, %s)\n" % forged[4:]) if forged.startswith("RAW:") else ("    frame(%s)\n" % forged)
        if kind == "stdin":
            program = FRAME + "if True:\n" + write + "print(0)\n"
            report, seconds = hostile(program, [{"input": "2 3\n", "output": "5"}])
        elif kind == "call":
            report, seconds = hostile(FRAME + "def add(a, b):\n" + write + "    return 0\n", [{"call": "add(1, 2)", "expected": "3"}])
        else:
            report, seconds = hostile(FRAME + "def add(a, b):\n" + write + "    return 0\n",
                                      "def check(candidate):\n    assert candidate(1, 2) == [[]] or candidate(1, 2) == 3\n", entry_point="add")
        assert report.passed == 0 and not any(note.startswith("died") for note in report.notes), (forged, report)
        assert seconds < FAST.timeout_s * 2 + 5


@needs_root
def test_seccomp_holds_against_other_abis_and_numbers(contained):
    """x32 numbers (``__X32_SYSCALL_BIT``), ``clone3``, high bits in ``unshare``/``clone`` flags, and the
    calls the filter names: each is refused (the program returns the errnos; the test compares them)."""
    program = ("import ctypes\n"
               "libc = ctypes.CDLL(None, use_errno=True)\n"
               "libc.syscall.restype = ctypes.c_long\n"
               "def err(nr, *args):\n"
               "    ctypes.set_errno(0)\n"
               "    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])\n"
               "    return ctypes.get_errno() if r == -1 else 0\n"
               "def probe():\n"
               "    X32, NEWUSER = 0x40000000, 0x10000000\n"
               "    return [err(X32 | 272, NEWUSER), err(X32 | 521, 0, 0), err(435, 0, 0), err(272, NEWUSER | (1 << 40)),\n"
               "            err(56, NEWUSER | (1 << 40), 0, 0, 0, 0), err(304, 0, 0, 0), err(310, 1, 0, 0, 0, 0, 0), err(250, 0, 0),\n"
               "            err(298, 0, 0, -1, -1, 0), err(323, 0), err(101, 0), err(308, 0, 0), err(41, 1, 1, 0), err(438, 0, 0, 0)]\n")
    eperm, enosys = 1, 38
    expected = [eperm, eperm, enosys] + [eperm] * 11
    report, _ = hostile(program, [{"call": "probe()", "expected": repr(expected)}])
    assert report.statuses == ("passed",), report


# ---------------------------------------------------------------- CPU: a program's processes together


@needs_root
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores to use two at once")
def test_a_program_uses_one_core_however_many_processes_it_starts(contained):
    """Three processes spinning for 1 s of wall time took ~2 CPU-seconds on 2 cores (every core of the host,
    the grading pool's and the trainer's included): ``RLIMIT_CPU`` is per process, the wall clock per test."""
    program = ("import os, time\n"
               "pids = []\n"
               "for _ in range(3):\n"
               "    pid = os.fork()\n"
               "    if pid == 0:\n"
               "        end = time.monotonic() + 1.0\n"
               "        while time.monotonic() < end:\n"
               "            pass\n"
               "        os._exit(0)\n"
               "    pids.append(pid)\n"
               "started = time.monotonic()\n"
               "for pid in pids:\n"
               "    os.waitpid(pid, 0)\n"
               "used = os.times().children_user + os.times().children_system\n"
               "print('one core' if used < 1.3 * (time.monotonic() - started) else 'more: %.2f' % used)\n")
    report, _ = hostile(program, [{"input": "", "output": "one core"}], limits=SandboxLimits(timeout_s=5, startup_s=30))
    assert report.statuses == ("passed",), report


@needs_root
def test_the_cpu_quota_is_set_on_the_slots_cgroup():
    """Where the cgroup cpu controller exists, a slot's cgroups carry ``SandboxLimits.cpus`` as a quota."""
    from marft.sandbox.slots import CPU_PERIOD_US, Slot

    with Slot() as slot:
        if slot.cgroups is None or not slot.cgroups.available:
            pytest.skip("no cgroups here")
        if slot.cgroups.cpu is None:
            pytest.skip("no cgroup cpu controller here")
        slot.cgroups.set_limits(512 << 20, 16, cpus=0.5)
        cpu = slot.cgroups.cpu
        if slot.cgroups.version == 1:
            quota = int((cpu / "cpu.cfs_quota_us").read_text()), int((cpu / "cpu.cfs_period_us").read_text())
        else:
            quota = tuple(int(x) for x in (cpu / "cpu.max").read_text().split())
        assert quota == (CPU_PERIOD_US // 2, CPU_PERIOD_US)
        assert str(cpu / "cgroup.procs") in slot.cgroups.procs  # the candidate joins it, the clean-up empties it


# ---------------------------------------------------------------- regressions: answers that lie about what they are

LIARS = {
    "int_subclass": "class L(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\nLIAR = L(0)\n",
    "list_subclass": "class L(list):\n    def __eq__(self, other):\n        return True\nLIAR = L()\n",
    "str_subclass": "class S(str):\n    def __eq__(self, other):\n        return True\n    __hash__ = str.__hash__\nLIAR = S('x')\n",
    "reduce": "class R:\n    def __reduce__(self):\n        return (int, (3,))\nLIAR = R()\n",
    "raising": "class X:\n    def __eq__(self, o):\n        raise AssertionError\n    __bool__ = __repr__ = __eq__\nLIAR = X()\n",
    "generator": "LIAR = (x for x in [3])\n",
    "recursive": "LIAR = []\nLIAR.append(LIAR)\n",
    "deep": "LIAR = 3\nfor _ in range(200):\n    LIAR = [LIAR]\n",
    "true": "LIAR = True\n",
    "float": "LIAR = 3.0\n",
    "minus_zero": "LIAR = -0.0\n",
    "complex": "LIAR = 3 + 0j\n",
    "huge": "LIAR = 10 ** 200_000\n",
}


@needs_root
def test_lying_answers_to_call_tests_are_not_paid(contained):
    """Subclasses with ``__eq__`` always true, ``__reduce__``, exceptions in ``__eq__``/``__bool__``/``__repr__``,
    generators, recursive and deep lists, ``True``/``3.0``/``3+0j`` for ``3``, ``-0.0`` for ``0``: every one fails."""
    program = "".join(code.replace("LIAR", name.upper()) for name, code in LIARS.items()) + "def give(name):\n    return globals()[name]\n"
    tests = [{"call": f"give({name.upper()!r})", "expected": "0" if name == "minus_zero" else "3"} for name in LIARS]
    report, seconds = hostile(program, tests)
    assert report.passed == 0, list(zip(LIARS, report.statuses))
    assert seconds < 2 * FAST.timeout_s + 5


@needs_root
@pytest.mark.parametrize("name", ["int_subclass", "list_subclass", "reduce", "raising", "generator", "recursive", "huge"])
def test_lying_answers_never_reach_check(name, contained):
    """HumanEval's ``check`` sees only plain values: a liar fails (``True``/``3.0`` pass ``==`` there, as in
    HumanEval's own harness: that is the test's Python, not the sandbox)."""
    program = LIARS[name] + "def add(a, b):\n    return LIAR\n"
    report, _ = hostile(program, "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert not (candidate(1, 2) != 3)\n", entry_point="add")
    assert report.statuses != ("passed",), report


INT80 = ("import ctypes, mmap\n"
         "def int80(nr):\n"
         "    code = b'\\xb8' + nr.to_bytes(4, 'little') + b'\\xcd\\x80\\xc3'  # mov eax, nr; int 0x80; ret\n"
         "    m = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)\n"
         "    m.write(code)\n"
         "    return ctypes.CFUNCTYPE(ctypes.c_long)(ctypes.addressof(ctypes.c_char.from_buffer(m)))()\n")


@needs_root
@pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86_64 machine code")
def test_the_32_bit_system_call_abi_kills_the_program(contained):
    """``int 0x80`` from a 64-bit process (i386 numbers: 20 is ``getpid``, 310 ``unshare`` is not even checked
    there) reaches the filter as another architecture: the program is killed, the test fails."""
    namespace = {}
    exec(INT80, namespace)
    assert namespace["int80"](20) == os.getpid()  # control: the machine code works outside the sandbox
    report, _ = hostile(INT80, [{"call": "int80(20)", "expected": "1"}])
    assert report.statuses == ("error",), report


COLLIDING = ("M = 2 ** 61 - 1  # k * M all hash to 0\n"
             "def add(a, b):\n"
             "    frame('{\"d\":[[\"status\",\"ok\"],[\"value\",{\"s\":[' + ','.join(str(k * M) for k in range(1, 300_000)) + ']}]]}')\n"
             "    return 3\n")


def test_sets_of_colliding_hashes_are_refused_before_they_are_built():
    M = 2 ** 61 - 1
    colliding = ('{"s":[' + ",".join(str(k * M) for k in range(1, 20_001)) + "]}").encode()
    started = time.process_time()
    with pytest.raises(ValueError):
        from_json(colliding)
    with pytest.raises(ValueError):
        from_json(('{"d":[' + ",".join(f"[{k * M},0]" for k in range(1, 20_001)) + "]}").encode())
    assert time.process_time() - started < 1.5  # refusing both: ~0.7 s on a slow 2-core machine; building them: 1.6 s each on a fast one (minutes for 8 MB)
    honest = list(range(200_000)) + [-1, -2, 1.5, "a", (1, 2)]  # -1 and -2 share a hash: a few collisions are fine
    assert from_json(('{"s":[' + ",".join(json.dumps(x) if not isinstance(x, tuple) else '{"t":[1,2]}' for x in honest) + "]}").encode()) == frozenset(honest)


@needs_root
def test_an_answer_of_colliding_hashes_does_not_hold_the_driver(contained):
    """8 MB of integers hashing alike, as ``check``'s answer: the driver spent minutes of CPU building the set
    (no alarm interrupts C code) until the grader's backstop killed it."""
    report, seconds = hostile(FRAME + COLLIDING, ADD_CHECK_CODE, entry_point="add")
    assert report.passed == 0 and seconds < 2 * FAST.timeout_s + 5, (report, seconds)


@needs_root
def test_with_debug_logging_the_program_cannot_write_into_the_graders_log(contained, caplog):
    """With DEBUG logging the candidate kept a copy of the driver's stderr (the grader's memory file, logged
    after the run) open at fd 10 while the program ran: program text reached the trainer's log."""
    import logging

    caplog.set_level(logging.DEBUG, logger="marft.sandbox.runner")
    program = ("import os\n"
               "for fd in range(5, 64):\n"
               "    try:\n"
               "        os.write(fd, b'INJECTED-BY-THE-PROGRAM\\n')\n"
               "    except OSError:\n"
               "        pass\n"
               "def add(a, b):\n"
               "    return 0\n")
    report, _ = hostile(program, [{"call": "add(1, 2)", "expected": "3"}])
    assert report.passed == 0 and "INJECTED" not in caplog.text, caplog.text[-500:]
