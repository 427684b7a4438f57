"""The code sandbox: verdicts for honest programs, and hostile programs graded as failing within
their limits while this test process survives, no process of theirs remains, and nothing
appears outside their sandbox directory."""

import os
import socket
import threading
import time

import pytest

from marft.envs.code import SandboxLimits, run_tests
from marft.envs.code.compare import outputs_match, parse_literal, values_equal
from marft.sandbox import MAX_SLOTS, SLOT_UID_BASE, Isolation, is_dead, process_statuses, sandbox_python

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="the full sandbox (uid drop, namespaces) needs root")
FAST = SandboxLimits(timeout_s=1.5, memory_mb=512, startup_s=30)
"""Short time limits: hostile programs are cut off quickly (start-up is generous: a busy machine)."""

ADD = [{"input": "2 3\n", "output": "5\n"}, {"input": "10 -4", "output": "6"}, {"input": "0 0\n", "output": "0\n"}]
ADD_PROGRAM = "a, b = map(int, input().split())\nprint(a + b)\n"


def sandbox_processes() -> list[str]:
    """Live processes running as any sandbox uid (zombies excluded), as ``pid:name``."""
    return [f"{pid}:{fields['Name']}" for pid, fields in process_statuses()
            if SLOT_UID_BASE <= int(fields["Uid"].split()[0]) < SLOT_UID_BASE + MAX_SLOTS and not is_dead(fields)]


def files_owned_by_sandbox(*folders: str) -> list[str]:
    """Entries (top level) of ``folders`` owned by a sandbox uid."""
    found = []
    for folder in folders:
        for entry in os.scandir(folder) if os.path.isdir(folder) else []:
            try:
                uid = entry.stat(follow_symlinks=False).st_uid
            except OSError:
                continue
            if SLOT_UID_BASE <= uid < SLOT_UID_BASE + MAX_SLOTS:
                found.append(entry.path)
    return found


@pytest.fixture
def contained(tmp_path):
    """Checks after the test: no sandbox process left, no file of a sandbox uid in the shared temp
    folders, nothing new in a world-writable folder the programs are told to write into."""
    open_door = tmp_path / "open"
    open_door.mkdir()
    open_door.chmod(0o777)
    os.chmod(tmp_path, 0o755)
    yield open_door
    deadline = time.monotonic() + 5
    while sandbox_processes() and time.monotonic() < deadline:  # a SIGKILLed process takes a moment to go
        time.sleep(0.05)
    assert sandbox_processes() == []
    assert files_owned_by_sandbox("/tmp", "/var/tmp", "/dev/shm", str(tmp_path), os.getcwd()) == []
    assert list(open_door.iterdir()) == []


# ---------------------------------------------------------------- honest programs


def test_stdin_tests():
    report = run_tests(ADD_PROGRAM, ADD)
    assert (report.passed, report.total, report.statuses) == (3, 3, ("passed",) * 3) and report.fraction == 1.0
    report = run_tests("a, b = map(int, input().split())\nprint(a - b if a == 10 else a + b)\n", ADD)
    assert report.statuses == ("passed", "failed", "passed") and report.fraction == pytest.approx(2 / 3)


def test_stdin_reads_every_way_and_exit_is_fine():
    program = "import sys\ndata = sys.stdin.buffer.read().split()\nsys.stdout.write(str(int(data[0]) + int(data[1])) + '\\n')\nexit(0)\n"
    assert run_tests(program, ADD).passed == 3
    assert run_tests("import sys\nprint(sum(map(int, open(0).read().split())))\nsys.exit()\n", ADD).passed == 3
    assert run_tests("print(sum(map(int, input().split())))\nraise SystemExit(3)\n", ADD).statuses == ("error",) * 3


def test_output_comparison():
    assert outputs_match("1 2\n3  \n\n", "1 2 3")
    assert outputs_match("0.333333333", "0.3333333333") and not outputs_match("0.3334", "0.3333")
    assert not outputs_match("12345678901234567890", "12345678901234567891")  # integers are exact
    assert outputs_match("-007 +5 -0", "-7 5 0") and outputs_match("9" * 5000, "9" * 5000) and not outputs_match("9" * 5000, "9" * 4999 + "8")
    assert not outputs_match("YES", "yes") and not outputs_match("1 2", "1 2 3")
    assert values_equal(parse_literal("[1, (2.0000001, 'a')]"), [1, [2.0, "a"]])
    assert values_equal(parse_literal("nan"), float("nan")) and parse_literal("-inf") == float("-inf")
    assert not values_equal(True, 1) and not values_equal(parse_literal("{1: 2}"), {1: 3})
    assert parse_literal("set()") == frozenset() and parse_literal("{1, 2}") == frozenset({1, 2})
    with pytest.raises(ValueError):
        parse_literal("__import__('os')")


def test_call_tests():
    program = "def f(a, b):\n    return a / b if b else [a, (b, 'x')]\n"
    tests = [{"call": "f(1, 3)", "expected": "0.3333333333"}, {"call": "f(2, 0)", "expected": "[2, [0, 'x']]"},
             {"call": "f(1, 1)", "expected": "2.0"}, {"call": "g(1)", "expected": "1"}]
    assert run_tests(program, tests).statuses == ("passed", "passed", "failed", "error")


def test_big_integer_answers():
    big = "7" * 5000
    assert run_tests(f"def f():\n    return int('{big}')\n", [{"call": "f()", "expected": big}]).statuses == ("passed",)
    assert run_tests(f"print(int('{big}') + 1)", [{"input": "", "output": big[:-1] + "8"}]).statuses == ("passed",)


def test_check_tests():
    test = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"
    assert run_tests("def add(a, b):\n    return a + b\n", test, entry_point="add").statuses == ("passed",)
    report = run_tests("def add(a, b):\n    return 5\n", test, entry_point="add")
    assert report.statuses == ("failed",) and "AssertionError" in report.stderr
    report = run_tests("def add(a, b):\n    x = 1\n    return a / 0\n", test, entry_point="add")
    assert report.statuses == ("error",) and report.stderr == "ZeroDivisionError"  # no line: it was reached on a hidden input
    with pytest.raises(ValueError, match="entry_point"):
        run_tests("def add(a, b): pass", test)


def test_syntax_error_and_crash_in_one_test_only():
    assert run_tests("print(", ADD).statuses == ("error",) * 3
    program = "import os\na, b = map(int, input().split())\nif a == 10: os._exit(0)\nprint(a + b)\n"
    report = run_tests(program, ADD)
    assert report.statuses == ("passed", "error", "passed")  # a fresh candidate took over after test 1


def test_the_harness_imports_nothing_outside_the_standard_library_and_itself():
    """The driver runs as ``python3 -I -S <the harness folder>``: nothing outside the standard library and the harness
    (``marft`` least of all) is imported there, and no path of marft's is left on ``sys.path`` for the program. The
    first candidate is forked from the driver (its modules are the driver's), the one after test 2 is a fresh
    interpreter (``exec``) of the harness."""
    import marft.sandbox

    program = ("import sys\n"
               "if input() == 'end':\n"
               "    import os\n"
               "    os._exit(0)\n"
               "foreign = {m.split('.')[0] for m in sys.modules} - set(sys.stdlib_module_names) - {'__main__', 'harness'}\n"
               f"print(sorted(foreign), [p for p in sys.path if p.startswith({os.path.dirname(marft.sandbox.__path__[0])!r})],"
               " 'harness.driver' in sys.modules)\n")
    tests = [{"input": "check", "output": "[] [] True"}, {"input": "end", "output": ""}, {"input": "check", "output": "[] [] True"}]
    assert run_tests(program, tests).statuses == ("passed", "error", "passed")


def test_the_sandbox_reports_full_isolation_as_root(caplog):
    run_tests("print(1)", [{"input": "", "output": "1"}])
    if ROOT:
        assert Isolation(*[True] * 8).describe() == "sandbox isolation: full (network, mounts, uid, pid, ipc, cgroup, filesystem, seccomp)"
        assert os.access(sandbox_python(), os.X_OK)
    assert "NOT" in Isolation(False, True, False).describe()


# ---------------------------------------------------------------- hostile programs


def run_hostile(program, tests=None, **kwargs):
    started = time.monotonic()
    report = run_tests(program, tests or [{"input": "", "output": "passed"}], limits=FAST, **kwargs)
    return report, time.monotonic() - started


@needs_root
@pytest.mark.slow
def test_infinite_loop_times_out(contained):
    report, seconds = run_hostile("while True:\n    pass\n", [{"input": "", "output": "1"}] * 2)
    assert report.statuses == ("timeout", "timeout") and seconds < 2 * (1.5 + 1.5) + 10


@needs_root
def test_loop_that_swallows_the_timeout(contained):
    program = "import time\nwhile True:\n    try:\n        time.sleep(10)\n    except BaseException:\n        pass\n"
    report, seconds = run_hostile(program)
    assert report.statuses == ("timeout",) and seconds < 1.5 + 1.5 + 10


@needs_root
@pytest.mark.slow
def test_fork_bomb_is_contained(contained):
    program = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    report, seconds = run_hostile(program, [{"input": "", "output": "1"}] * 2)
    assert report.passed == 0 and set(report.statuses) <= {"timeout", "error"} and seconds < 30


@needs_root
def test_allocating_8_gb_is_a_memory_failure(contained):
    report, _ = run_hostile("x = bytearray(8 << 30)\nprint('passed')\n")
    assert report.statuses == ("memory",)


@needs_root
def test_writing_2_gb_to_files_stops_at_the_limits(contained):
    one_file = "with open('big', 'wb') as f:\n    for _ in range(2048):\n        f.write(b'x' * (1 << 20))\nprint('passed')\n"
    assert run_hostile(one_file)[0].statuses == ("output_limit",)
    many_files = "for i in range(256):\n    with open(f'f{i}', 'wb') as f:\n        f.write(b'x' * (8 << 20 - 1))\nprint('passed')\n"
    assert run_hostile(many_files)[0].statuses == ("output_limit",)  # the tmpfs is full long before 2 GB


@needs_root
def test_printing_1_gb_hits_the_output_cap(contained):
    report, seconds = run_hostile("import sys\nfor _ in range(1024):\n    sys.stdout.write('x' * (1 << 20))\nprint('passed')\n")
    assert report.statuses == ("output_limit",) and seconds < 30


@needs_root
def test_killing_the_grader_fails(contained):
    program = ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
               "for pid in [int(p) for p in os.listdir('/proc') if p.isdigit()]:\n"
               "    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\nprint('passed')\n")
    report, _ = run_hostile(program)
    assert report.statuses == ("passed",)  # harmless now: nothing outside its own PID namespace is in sight
    assert run_tests(ADD_PROGRAM, ADD).passed == 3  # this process and the grader are alive


@needs_root
@pytest.mark.parametrize("exit_call", ["sys.exit(0)", "os._exit(0)"])
def test_exiting_before_the_tests_run_fails(exit_call, contained):
    program = f"import os, sys\n{exit_call}\ndef add(a, b):\n    return a + b\n"
    check = "def check(candidate):\n    assert candidate(1, 2) == 3\n"
    assert run_tests(program, check, entry_point="add", limits=FAST).passed == 0
    assert run_tests(program, [{"call": "add(1, 2)", "expected": "3"}], limits=FAST).passed == 0


@needs_root
def test_fake_pass_lines_on_every_descriptor_fail(contained):
    program = ("import os\nprint('passed')\nline = b'{\"event\": \"done\", \"i\": 0, \"status\": \"ok\"}\\n'\n"
               "for fd in range(64):\n    try:\n        os.write(fd, b'0' * 32 + b' ' + line)\n    except OSError:\n        pass\n"
               "def add(a, b):\n    return 0\n")
    check = "def check(candidate):\n    assert candidate(1, 2) == 3\n"
    assert run_tests(program, check, entry_point="add", limits=FAST).passed == 0
    assert run_tests(program, [{"call": "add(1, 2)", "expected": "3"}], limits=FAST).passed == 0


@needs_root
def test_redefining_builtins_check_and_equality_fails(contained):
    check = "import math\ndef check(candidate):\n    assert candidate(1, 2) == 3\n    assert math.isclose(candidate(0.5, 0.25), 0.75)\n    assert abs(candidate(1, 1) - 2) < 1e-9\n"
    hostile = {
        "builtins": "import builtins\nbuiltins.abs = lambda x: 0\nbuiltins.AssertionError = KeyError\n__builtins__['abs'] = lambda x: 0\n"
                    "def add(a, b):\n    return 3\n",
        "check": "def check(candidate):\n    pass\ndef add(a, b):\n    return 3\n",
        "always_equal": "class Equal(float):\n    def __eq__(self, other):\n        return True\n    __hash__ = float.__hash__\n"
                        "def add(a, b):\n    return Equal(3)\n",
        "patched_module": "import math\nmath.isclose = lambda *a, **k: True\ndef add(a, b):\n    return 3 if a == 1 else 2\n",
        "trace": "import sys\ndef skip(frame, event, arg):\n    if frame.f_code.co_name == 'check' and event == 'line':\n"
                 "        raise StopIteration\n    return skip\ndef add(a, b):\n    sys.settrace(skip)\n    sys._getframe(1).f_trace = skip\n    return 3\n",
        "catch_all": "def add(a, b):\n    try:\n        raise SystemExit(0)\n    finally:\n        return 3\n",
    }
    honest = "def add(a, b):\n    return a + b\n"
    assert run_tests(honest, check, entry_point="add", limits=FAST).statuses == ("passed",)
    for name, program in hostile.items():
        assert run_tests(program, check, entry_point="add", limits=FAST).passed == 0, name


@needs_root
def test_no_network(contained):
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(5)
    port = server.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(_accept(server)), daemon=True).start()
    program = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\ns.sendall(b'hi')\nprint('passed')\n"
    report, _ = run_hostile(program)
    assert report.statuses == ("error",) and report.stderr == "OSError"
    server.close()
    assert accepted in ([], [None])


def _accept(server):
    try:
        return server.accept()
    except OSError:
        return None


@needs_root
def test_no_secrets_from_the_environment(contained, monkeypatch):
    monkeypatch.setenv("MARFT_TEST_SECRET", "s3cr3t")
    program = ("import os\nfound = os.environ.get('MARFT_TEST_SECRET', '')\n"
               "for pid in (os.getppid(), 1):\n    try:\n        found += open(f'/proc/{pid}/environ').read()\n"
               "    except OSError:\n        pass\nprint('s3cr3t' if 's3cr3t' in found else sorted(os.environ))\n")
    report, _ = run_hostile(program, [{"input": "", "output": "s3cr3t"}])
    assert report.statuses == ("failed",)


@needs_root
def test_writing_outside_the_sandbox_fails(contained):
    targets = ["/tmp/marft-escape", "/var/tmp/marft-escape", "/dev/shm/marft-escape", f"{contained}/escape", f"{os.getcwd()}/escape"]
    program = (f"import os\nwrote = []\nfor path in {targets!r}:\n    try:\n        open(path, 'w').write('x')\n        wrote.append(path)\n"
               "    except OSError:\n        pass\nopen('inside.txt', 'w').write('fine')\nprint('wrote' if wrote else 'inside only')\n")
    report, _ = run_hostile(program, [{"input": "", "output": "inside only"}])
    assert report.statuses == ("passed",)
    assert not any(os.path.exists(path) for path in targets)


@needs_root
def test_daemonised_child_does_not_outlive_the_run(contained):
    marker = contained / "daemon-was-here"
    program = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(1.0)\n"
               f"        open({str(marker)!r}, 'w').write('x')\n        time.sleep(60)\n    os._exit(0)\nprint('passed')\n")
    report, _ = run_hostile(program)
    assert report.statuses == ("passed",)  # the program itself was honest
    assert sandbox_processes() == []  # but its daemon is gone as soon as run_tests returns
    time.sleep(1.5)
    assert not marker.exists()


def test_limits_are_checked():
    with pytest.raises(ValueError):
        SandboxLimits(timeout_s=0)
    with pytest.raises(ValueError, match="tests must"):
        run_tests("print(1)", [{"input": "1"}])


def test_a_dead_process_still_counted_raises_the_cap_by_as_many(tmp_path):
    # A zombie left in the slot's pids cgroup (its driver killed, the host's init not yet reaping) cannot run: the
    # next program still gets its full process cap.
    from marft.sandbox.slots import Cgroups

    memory, pids = tmp_path / "memory", tmp_path / "pids"
    memory.mkdir()
    pids.mkdir()
    (pids / "pids.current").write_text("3\n")
    (pids / "cgroup.procs").write_text("")
    groups = Cgroups.__new__(Cgroups)
    groups.memory, groups.pids, groups.version, groups.cpu = memory, pids, 1, None
    groups.procs = [str(pids / "cgroup.procs")]
    groups.set_limits(256 << 20, processes=16)
    assert (pids / "pids.max").read_text() == "19"
    (pids / "pids.current").write_text("2\n")
    (pids / "cgroup.procs").write_text("4242\n4243\n")  # live members are not stale
    groups.set_limits(256 << 20, processes=16)
    assert (pids / "pids.max").read_text() == "16"
