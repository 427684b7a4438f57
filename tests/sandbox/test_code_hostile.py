"""Reward hacking: hostile programs that try to be paid without solving the task (issue 31).

One or more programs per class of attack; each must fail within its limits, leave nothing behind
(processes, files, System V IPC objects, cgroup members), and never carry hidden data into feedback.
The threat model in docs/code.md ("Threat model") names which test covers what.
"""

import ast
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from test_code_sandbox import files_owned_by_sandbox, sandbox_processes

from marft.envs.code import SandboxLimits, run_tests
from marft.envs.code import env as code_env

ROOT = os.geteuid() == 0
pytestmark = pytest.mark.skipif(not ROOT, reason="the full sandbox (namespaces, cgroups, uid drop) needs root")
FAST = SandboxLimits(timeout_s=1.5, memory_mb=512, startup_s=30)
"""Short time limits: hostile programs are cut off quickly (start-up is generous: a busy machine)."""

ADD_CHECK = "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\n"
ADD_CALLS = [{"call": "add(1, 2)", "expected": "3"}, {"call": "add(5, 5)", "expected": "10"}]


def sysv_objects() -> set[str]:
    """Every System V shared memory segment, semaphore set and message queue of the host (key and id)."""
    found = set()
    for kind in ("shm", "sem", "msg"):
        path = Path(f"/proc/sysvipc/{kind}")
        if path.exists():
            found |= {f"{kind}:{' '.join(line.split()[:2])}" for line in path.read_text().splitlines()[1:]}
    return found


def cgroup_members() -> list[str]:
    """Processes still in any sandbox slot's cgroup (v1 memory/pids or v2)."""
    found = []
    for procs in Path("/sys/fs/cgroup").glob("**/marft-sandbox/*/cgroup.procs"):
        found += [f"{procs.parent}:{pid}" for pid in procs.read_text().split()]
    return found


@pytest.fixture
def contained():
    """After the test: no sandbox process, no file of a sandbox uid in shared folders, no new SysV object."""
    ipc_before = sysv_objects()
    yield
    deadline = time.monotonic() + 5
    while sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox_processes() == [] and cgroup_members() == []
    assert files_owned_by_sandbox("/tmp", "/var/tmp", "/dev/shm", os.getcwd()) == []
    assert sysv_objects() - ipc_before == set()


@pytest.fixture
def public_dir():
    """A world-readable folder outside the sandbox (as a dataset folder or a service's socket folder is)."""
    folder = Path(tempfile.mkdtemp(prefix="marft-hostile-", dir="/tmp"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def hostile(program, tests, **kwargs):
    started = time.monotonic()
    report = run_tests(program, tests, limits=kwargs.pop("limits", FAST), **kwargs)
    return report, time.monotonic() - started


# ---------------------------------------------------------------- 1. ending the test run cleanly


@pytest.mark.parametrize("body", ["raise SystemExit", "exit()", "quit()", "raise SystemExit(0)", "import sys\n    sys.exit(0)",
                                  "import os\n    os._exit(0)"])
def test_exiting_inside_the_function_under_test_fails(body, contained):
    program = f"def add(a, b):\n    {body}\n"
    report, seconds = hostile(program, ADD_CHECK, entry_point="add")
    assert report.passed == 0 and seconds < 20, report
    report, _ = hostile(program, ADD_CALLS)
    assert report.passed == 0, report


def test_exit_in_a_humaneval_body_fails_everywhere(contained):
    human_eval = pytest.importorskip("marft.envs.code.data")
    try:
        problems = human_eval.load_humaneval().problems[:12]
    except Exception as e:  # noqa: BLE001 - no human-eval package here
        pytest.skip(f"HumanEval not available: {e}")
    for p in problems:
        report = run_tests(p.program(f"def {p.entry_point}(*args, **kwargs):\n    raise SystemExit\n"), p.tests,
                           entry_point=p.entry_point, prompt=p.program_prefix, limits=FAST)
        assert report.passed == 0, p.task_id


# ---------------------------------------------------------------- 2. changing what the test sees


def test_redefining_the_prompts_helpers_fails(contained):
    prompt = "def poly(xs, x):\n    return sum(c * x ** i for i, c in enumerate(xs))\n"
    check = "def check(candidate):\n    assert abs(poly([1, 2], candidate([1, 2]))) < 1e-6\n"
    honest = prompt + "def find_zero(xs):\n    return -xs[0] / xs[1]\n"
    cheat = prompt + "def poly(xs, x):\n    return 0\ndef find_zero(xs):\n    return 0.0\n"
    assert run_tests(honest, check, entry_point="find_zero", prompt=prompt, limits=FAST).statuses == ("passed",)
    assert run_tests(cheat, check, entry_point="find_zero", prompt=prompt, limits=FAST).passed == 0


@pytest.mark.parametrize("patch", [
    # the harness module's report channel: rewrite every verdict to "ok"
    "import __main__\nfor name in dir(__main__):\n    obj = getattr(__main__, name)\n"
    "    if isinstance(obj, type) and hasattr(obj, 'send'):\n        orig = obj.send\n"
    "        def send(self, _orig=orig, **event):\n            if 'status' in event:\n                event['status'] = 'ok'\n"
    "            return _orig(self, **event)\n        obj.send = send\n",
    # the builtins the test code is given
    "import __main__\nfor name in dir(__main__):\n    obj = getattr(__main__, name)\n"
    "    if isinstance(obj, dict) and 'abs' in obj and 'len' in obj:\n        obj['abs'] = lambda x: 0\n"
    "        obj['AssertionError'] = type('Quiet', (Exception,), {})\n",
    # the function the test code calls, and the test itself
    "import __main__\nfor name in dir(__main__):\n    obj = getattr(__main__, name)\n"
    "    if callable(obj) and name in ('run_timed', 'guarded', 'is_plain'):\n        setattr(__main__, name, lambda *a, **k: ('ok', 0.0) if name == 'run_timed' else True)\n",
])
def test_patching_the_harness_through___main___fails(patch, contained):
    check = "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert abs(candidate(1, 1) - 2) < 1e-9\n"
    report, _ = hostile(patch + "def add(a, b):\n    return 0\n", check, entry_point="add")
    assert report.passed == 0, report


# ---------------------------------------------------------------- 3. forging the report

FIND_CHANNEL = (
    "import gc, os, sys, time\n"
    "def channels():\n"
    "    return [o for o in gc.get_objects() if type(o).__name__ in ('Channel', 'Driver', 'Grader')]\n"
)


def test_forged_done_events_fail(contained):
    program = FIND_CHANNEL + (
        "def add(a, b):\n"
        "    for ch in channels():\n"
        "        ch.send(event='done', i=0, status='ok', stdout='', stderr='', seconds=0.0)\n"
        "        ch.send(event='finished', leftovers=False)\n"
        "    os._exit(0)\n"
    )
    report, _ = hostile(program, ADD_CHECK, entry_point="add")
    assert report.passed == 0, report


def test_forged_start_events_do_not_reset_the_clock(contained):
    program = FIND_CHANNEL + (
        "def add(a, b):\n"
        "    started = time.monotonic()\n"
        "    while time.monotonic() - started < 5:\n"
        "        try:\n"
        "            for ch in channels():\n"
        "                ch.send(event='start', i=0)\n"
        "            time.sleep(0.2)\n"
        "        except BaseException:\n"
        "            pass\n"
        "    for ch in channels():\n"
        "        ch.send(event='done', i=0, status='ok', stdout='', stderr='', seconds=0.1)\n"
        "        ch.send(event='finished', leftovers=False)\n"
        "    os._exit(0)\n"
    )
    report, seconds = hostile(program, ADD_CHECK, entry_point="add")
    assert report.statuses == ("timeout",) and seconds < 1.5 + 10, (report, seconds)


@pytest.mark.parametrize("event", ["event='done', i='x', status='ok'", "event='start'", "event='done'", "event='ready', isolated=None",
                                   "event='setup_failed'", "event='done', i=-1, status='ok'", "event='done', i=0, status=[1]"])
def test_malformed_forged_events_fail_the_program_not_the_grader(event, contained):
    program = FIND_CHANNEL + f"def add(a, b):\n    for ch in channels():\n        ch.send({event})\n    return a + b\n"
    report, _ = hostile(program, ADD_CALLS)  # must not raise inside the grader
    assert report.total == 2
    report, _ = hostile(program, ADD_CHECK, entry_point="add")
    assert report.total == 1


# ---------------------------------------------------------------- 4. reading the answers

def test_the_answers_and_other_processes_are_out_of_sight(public_dir, contained):
    answers = public_dir / "answers.jsonl"
    answers.write_text('{"expected": "ANSWER-0451"}\n')
    answers.chmod(0o644)
    # a process (as the trainer is) whose command line names the dataset
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(answers)])
    try:
        candidates = [str(Path(__file__).resolve()), str(Path(sys.prefix) / "lib"), "/work", "/root", "/home", "/etc/passwd"]
        try:
            import human_eval

            candidates.append(str(Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"))
        except ImportError:
            pass
        program = (
            "import os\nfound = []\n"
            "for pid in [p for p in os.listdir('/proc') if p.isdigit()] + [str(os.getppid())]:\n"
            "    try:\n        args = open(f'/proc/{pid}/cmdline', 'rb').read().split(b'\\0')\n    except OSError:\n        continue\n"
            "    for arg in args:\n        if arg.endswith(b'.jsonl'):\n            try:\n"
            "                found.append(open(arg).read())\n            except OSError:\n                pass\n"
            f"for path in {candidates!r}:\n"
            "    if os.path.exists(path):\n        found.append('saw ' + path)\n"
            "others = [p for p in os.listdir('/proc') if p.isdigit() and int(p) > 3]\n"
            "print('ANSWER-0451' if any('ANSWER' in f for f in found) else repr(found) + ' ' + repr(others))\n"
        )
        report, _ = hostile(program, [{"input": "", "output": "[] []"}])
        assert report.statuses == ("passed",), report
    finally:
        holder.kill()
        holder.wait()


# ---------------------------------------------------------------- 5. comparison too lenient


def test_a_float_is_not_an_integer(contained):
    assert run_tests("def f():\n    return 1.23456789e17\n", [{"call": "f()", "expected": "123456789012345678"}], limits=FAST).passed == 0
    assert run_tests("print(1.23456789e17)\n", [{"input": "", "output": "123456789012345678"}], limits=FAST).passed == 0
    assert run_tests("print('123456789000000000.0')\n", [{"input": "", "output": "123456789012345678"}], limits=FAST).passed == 0
    assert run_tests("def f():\n    return 2\n", [{"call": "f()", "expected": "2.0"}], limits=FAST).passed == 1  # an int for a float is fine


# ---------------------------------------------------------------- 6. resources outside the per-process limits

SHM = (
    "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.shmat.restype = ctypes.c_void_p\n"
    "libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]\n"
    "shm = libc.shmget(0x4D415246, 4096, 0o1000 | 0o666)\n"
)


def test_system_v_shared_memory_does_not_survive_the_run(contained):
    writer = SHM + "if shm >= 0:\n    ctypes.memmove(libc.shmat(shm, None, 0), b'secret', 6)\nprint('made' if shm >= 0 else 'denied')\n"
    reader = SHM.replace("0o1000 | ", "") + ("if shm >= 0:\n    print(ctypes.string_at(libc.shmat(shm, None, 0), 6).decode())\n"
                                             "else:\n    print('nothing')\n")
    report, _ = hostile(writer, [{"input": "", "output": "denied"}])
    assert report.statuses == ("passed",), report
    report, _ = hostile(reader, [{"input": "", "output": "nothing"}])
    assert report.statuses == ("passed",), report


def test_memory_is_capped_per_program_not_per_process(contained):
    program = (
        "import os, time\npids = []\n"
        "for _ in range(3):\n    pid = os.fork()\n    if pid == 0:\n        try:\n            block = b'x' * (200 << 20)\n"
        "            time.sleep(1.0)\n            os._exit(0)\n        except MemoryError:\n            os._exit(1)\n    pids.append(pid)\n"
        "ok = all(os.waitpid(pid, 0)[1] == 0 for pid in pids)\nprint('passed' if ok else 'capped')\n"
    )
    limits = SandboxLimits(timeout_s=8, memory_mb=256, startup_s=30)
    report, _ = hostile(program, [{"input": "", "output": "capped"}], limits=limits)
    assert report.statuses != ("failed",), report  # 'capped', or the program itself was killed (memory/error)


def test_processes_are_capped_per_program(contained):
    program = ("import os, time\nn = 0\nfor _ in range(64):\n    try:\n        if os.fork() == 0:\n            time.sleep(2)\n"
               "            os._exit(0)\n        n += 1\n    except OSError:\n        break\nprint('passed' if n >= 40 else 'capped')\n")
    report, _ = hostile(program, [{"input": "", "output": "capped"}], limits=SandboxLimits(timeout_s=5, processes=16, startup_s=30))
    assert report.statuses == ("passed",), report


def slot_pids_counted() -> dict[str, int]:
    """Processes each sandbox slot's pids cgroup counts (zombies included, which ``cgroup.procs`` does not list)."""
    return {str(path.parent): int(path.read_text()) for path in Path("/sys/fs/cgroup").glob("**/marft-sandbox/*/pids.current")}


def test_back_to_back_programs_leave_no_dead_process_counted_against_the_next(contained):
    # Each candidate's PID 1 was orphaned when its outer process was killed first, and waited as a zombie for the
    # host's init (seconds here): counted by the slot's pids cgroup, 4 of them made a correct program fail to start.
    if not slot_pids_counted():
        pytest.skip("no pids cgroup for the sandbox slots on this machine")
    limits = SandboxLimits(timeout_s=5, processes=4, startup_s=30)
    for _ in range(12):
        report, _ = hostile("print(input())\n", [{"input": "ok", "output": "ok"}], limits=limits)
        assert report.statuses == ("passed",), report
        assert set(slot_pids_counted().values()) == {0}
    report, _ = hostile("def add(a, b):\n    raise SystemExit\n", ADD_CALLS, limits=limits, entry_point="add")  # restarts candidates
    assert report.passed == 0 and set(slot_pids_counted().values()) == {0}, report


# ---------------------------------------------------------------- 7. stalling the trainer


def test_a_huge_wrong_result_is_not_parsed_in_the_trainer(contained, monkeypatch):
    parsed = []
    real_parse = ast.parse
    monkeypatch.setattr(ast, "parse", lambda source, *a, **k: parsed.append(len(source)) or real_parse(source, *a, **k))
    started = time.monotonic()
    report = run_tests("def f():\n    return [0] * 2_700_000\n", [{"call": "f()", "expected": "[1, 2, 3]"}] * 2,
                       limits=SandboxLimits(timeout_s=10, startup_s=30))
    assert report.statuses == ("failed", "failed") and time.monotonic() - started < 20, report
    assert max(parsed, default=0) < 10_000  # nothing big was parsed here


# ---------------------------------------------------------------- 8. leaks into feedback

SECRET = "SECRET-INPUT-8675309"


@pytest.mark.parametrize("program", [
    "import sys\ndata = sys.stdin.read()\nsys.stderr.write(data)\nraise ValueError(data)\n",
    "import sys\ndata = sys.stdin.read().strip().replace('-', '_')\nraise type(data, (Exception,), {})()\n",
    "import sys\nprint(sys.stdin.read(), file=sys.stderr)\nprint(1 / 0)\n",
])
def test_hidden_stdin_inputs_never_reach_feedback(program, contained):
    report, _ = hostile(program, [{"input": SECRET + "\n", "output": "42"}])
    assert report.passed == 0 and SECRET not in report.stderr and SECRET.replace("-", "_") not in report.stderr, report
    assert SECRET not in code_env.test_feedback(report) and "8675309" not in code_env.test_feedback(report)


def test_hidden_check_arguments_and_expected_values_never_reach_feedback(contained):
    check = f"def check(candidate):\n    assert candidate('{SECRET}') == 'EXPECTED-4242'\n"
    program = ("import sys\ndef echo(s):\n    frame = sys._getframe()\n    seen = []\n    while frame is not None:\n"
               "        seen.append(repr(frame.f_locals)[:2000])\n        frame = frame.f_back\n"
               "    sys.stderr.write(s + ' '.join(seen))\n    raise RuntimeError(s + ' '.join(seen))\n")
    report, _ = hostile(program, check, entry_point="echo")
    assert report.passed == 0 and SECRET not in report.stderr and "4242" not in report.stderr, report


# ---------------------------------------------------------------- also: user namespaces, UNIX sockets


def test_user_namespaces_cannot_be_created(contained):
    program = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nmade = []\n"
               "for flags in (0x10000000, 0x10000000 | 0x20000000, 0x40000000):\n"
               "    pid = os.fork()\n    if pid == 0:\n        os._exit(0 if libc.unshare(flags) == 0 else 1)\n"
               "    made.append(os.waitpid(pid, 0)[1] == 0)\nprint('passed' if any(made) else 'denied')\n")
    report, _ = hostile(program, [{"input": "", "output": "denied"}])
    assert report.statuses == ("passed",), report


def test_a_unix_socket_of_another_service_is_unreachable(public_dir, contained):
    path = public_dir / "service.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    path.chmod(0o777)
    server.listen(1)
    server.settimeout(0.1)
    try:
        program = (f"import socket\ntry:\n    s = socket.socket(socket.AF_UNIX)\n    s.connect({str(path)!r})\n    print('passed')\n"
                   "except OSError as e:\n    print('refused')\n")
        report, _ = hostile(program, [{"input": "", "output": "refused"}])
        assert report.statuses == ("passed",), report
        with pytest.raises(OSError):
            server.accept()
    finally:
        server.close()


def test_tracing_another_process_is_denied(contained):
    program = ("import ctypes, os, time\nlibc = ctypes.CDLL(None, use_errno=True)\npid = os.fork()\n"
               "if pid == 0:\n    time.sleep(5)\n    os._exit(0)\n"
               "ok = libc.ptrace(16, pid, None, None) == 0\nos.kill(pid, 9)\nprint('passed' if ok else 'denied')\n")
    report, _ = hostile(program, [{"input": "", "output": "denied"}])
    assert report.statuses == ("passed",), report


def test_the_grader_takes_each_verdict_once_in_order_and_type_checked():
    """Events reach the grader only from the driver; still, anything out of order or mistyped fails the program."""
    from marft.sandbox import HarnessRun

    def feed(*lines):
        run = HarnessRun({"kind": "stdin", "program": "", "entry_point": None}, {"cases": [{"input": "", "output": ""}] * 2},
                         FAST, deadline=time.monotonic() + 60)
        run._take(b"".join(line + b"\n" for line in lines))
        return run.result

    good = [b'{"event": "start", "i": 0}', b'{"event": "done", "i": 0, "status": "passed", "error": "", "seconds": 0.1}']
    assert feed(*good).statuses == {0: "passed"} and feed(*good).end == "finished"
    for bad in ([b'{"event": "done", "i": 0, "status": "passed"}'],  # done before start
                good + [b'{"event": "done", "i": 0, "status": "passed"}'],  # twice
                [b'{"event": "start", "i": 1}'],  # out of order
                [good[0], b'{"event": "done", "i": 0, "status": "ok"}'],  # not a verdict
                [good[0], b'{"event": "done", "i": "0", "status": "passed"}'],
                [good[0], b'{"event": "done", "i": 0, "status": "passed", "error": 5}'],
                [b'{"event": "ready", "isolated": null}'], [b'[1, 2]'], [b'not json'], [b'{"event": "start"}']):
        assert feed(*bad).end == "malformed", bad  # run_tests then fails every test without a verdict


def test_honest_programs_keep_threads_subprocesses_forks_and_temp_files(contained):
    """The sandbox denies only what no honest solution needs."""
    programs = {
        "thread": "import threading, sys\nthreading.stack_size(1 << 26)\nsys.setrecursionlimit(10 ** 6)\nr = []\n"
                  "t = threading.Thread(target=lambda: r.append(int(input()) * 2))\nt.start()\nt.join()\nprint(r[0])\n",
        "subprocess": "import subprocess\nprint(int(subprocess.run(['echo', input()], capture_output=True, text=True).stdout) * 2)\n",
        "fork": "import os\nx = int(input())\npid = os.fork()\nif pid == 0:\n    os._exit(3)\n"
                "print(x * 2 if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 3 else -1)\n",
        "tempfile": "import tempfile\nwith tempfile.TemporaryFile() as f:\n    f.write(input().encode())\n    f.seek(0)\n    print(int(f.read()) * 2)\n",
        "socketpair": "import socket\na, b = socket.socketpair()\na.send(input().encode())\nprint(int(b.recv(10)) * 2)\n",
    }
    for name, program in programs.items():
        assert run_tests(program, [{"input": "21\n", "output": "42"}], limits=FAST).statuses == ("passed",), name


MEMORY_SCAN = (
    "import ctypes, os, re\n"
    "def scan():\n"
    "    prefix = b'EXPECTED' + b'-'\n"
    "    for line in open('/proc/self/maps'):\n"
    "        parts = line.split()\n"
    "        if 'r' not in parts[1] or (len(parts) > 5 and parts[5] in ('[vvar]', '[vsyscall]', '[vvar_vclock]')):\n"
    "            continue\n"
    "        start, end = (int(x, 16) for x in parts[0].split('-'))\n"
    "        try:\n"
    "            data = ctypes.string_at(start, end - start)\n"
    "        except Exception:\n"
    "            continue\n"
    "        for m in re.finditer(re.escape(prefix) + rb'(\\d{5})', data):\n"
    "            return 'EXPECTED-' + m.group(1).decode()\n"
    "    return 'nothing'\n"
)


def test_expected_outputs_are_nowhere_in_the_programs_memory_even_after_a_restart(contained):
    """The candidate is forked before the driver reads the tests, and replaced by a fresh interpreter after a
    crash: no copy of an expected output (or of HumanEval's test code) ever exists in its address space."""
    stdin_program = MEMORY_SCAN + "x = input()\nif x == 'crash':\n    os._exit(1)\nprint(scan())\n"
    control = run_tests(stdin_program, [{"input": "EXPECTED-55555\n", "output": "EXPECTED-55555"}], limits=FAST)
    assert control.statuses == ("passed",)  # the scan does find what is in its memory (here, its own input)
    stdin_tests = [{"input": "scan\n", "output": "EXPECTED-31337"}, {"input": "crash\n", "output": "EXPECTED-31337"},
                   {"input": "scan\n", "output": "EXPECTED-31337"}]
    report, _ = hostile(stdin_program, stdin_tests)
    assert report.passed == 0 and report.statuses[1] == "error", report
    call_program = MEMORY_SCAN + "def f(x):\n    if x == 'crash':\n        os._exit(1)\n    return scan()\n"
    call_tests = [{"call": f"f({x!r})", "expected": "'EXPECTED-31337'"} for x in ("scan", "crash", "scan")]
    report, _ = hostile(call_program, call_tests)
    assert report.passed == 0 and report.statuses[1] == "error", report
    check = "def check(candidate):\n    assert candidate('scan') == 'EXPECTED-31337'\n"
    report, _ = hostile(call_program, check, entry_point="f")
    assert report.passed == 0, report
