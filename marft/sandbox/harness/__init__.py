"""The trusted test driver and the sandboxed candidate it talks to: a program of its own, standard library only.

Started by :mod:`marft.sandbox.runner` as ``python3 -I -S <this folder>`` (``__main__.py`` says how its modules import
in isolated mode; nothing outside the standard library and this folder is imported). Two processes come of it:

* the **driver** (trusted, :mod:`.driver`): reads the job, forks the candidate, then reads the tests (inputs,
  expected outputs, HumanEval's test code and prompt), which therefore never exist in the
  candidate's memory. It sends the candidate one request at a time, enforces each test's wall
  clock, judges every answer itself (:mod:`.compare`) and reports verdicts to the grader on its own pipe
  (``job["channel_fd"]``, which the candidate never holds). A test passes only when the driver
  compared the answer and found it right, or, for ``check`` code, when ``check`` returned
  normally: the candidate can end, exit, crash or lie, and only ever fails itself.
* the **candidate** (untrusted, :mod:`.candidate`): the program under test. As root it enters a sandbox before
  any program code runs (:mod:`.isolation`): cgroups (memory incl. tmpfs and shared memory, process count), new
  PID, IPC, UTS, network and mount namespaces, a minimal root file system (``/usr``, ``/lib*``,
  ``/bin``, ``/sbin`` read-only with every ``site-packages``/``dist-packages`` hidden, a few
  ``/dev`` nodes, its own ``/proc``, a size-limited tmpfs ``/sandbox`` as the working
  directory), resource limits, an unprivileged uid, ``no_new_privs`` and a seccomp filter (:mod:`.seccomp`:
  no namespaces, ptrace, System V IPC, sockets but AF_INET/AF_INET6, mounts, keyrings, bpf, io_uring).
  It is PID 1 of its namespace: when it ends, every process it started ends with it. It
  serves requests and answers with plain data only.

Wire formats (:mod:`.wire`): driver → candidate, length-prefixed ``marshal`` (trusted data the candidate
parses); candidate → driver, length-prefixed JSON with tags for tuples, sets, dicts and bytes,
read only up to a size bound and decoded by the C JSON scanner, integers by length-bounded
``int``; driver → grader, one JSON line per event.

Requests (``job["kind"]``): ``stdin`` runs the program afresh with the test's input on fd 0
and returns its stdout; ``call`` evaluates a call expression in the program's namespace;
``check`` calls ``entry_point`` with arguments the driver's ``check`` code passed to its proxy.
Feedback carries only the status and the class of a builtin exception (the program's line only for a setup
failure, before any test input). Verdicts reach the grader only after the candidate has ended.

The modules, each importing only those above it: :mod:`.wire`, :mod:`.compare`, :mod:`.isolation`,
:mod:`.seccomp`, :mod:`.candidate`, :mod:`.driver`. The package's namespace is the union of theirs, the names of
the one module this was until it was split (``marft/envs/code/harness.py``), which its old import path keeps until
the next release.
"""

# the old module's names (see above); new code imports from the modules
from .candidate import *  # noqa: F403
from .compare import *  # noqa: F403
from .driver import *  # noqa: F403
from .isolation import *  # noqa: F403
from .seccomp import *  # noqa: F403
from .wire import *  # noqa: F403
