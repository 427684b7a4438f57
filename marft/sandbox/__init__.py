"""Running untrusted programs: the code grader's isolation, on its own (standard library only, nothing else of marft).

* :mod:`marft.sandbox.runner` (the grader's side): one sandboxed run of a program (:class:`HarnessRun`) under
  :class:`SandboxLimits`: starts the harness, follows its verdicts, and says what this machine isolates
  (:class:`Isolation`);
* :mod:`marft.sandbox.slots`: what a run holds on the host (a uid, cgroups, a folder) and cleaning up after it;
* :mod:`marft.sandbox.harness`: the trusted driver and the sandboxed candidate, a program of its own run as
  ``python3 -I -S`` that imports nothing but the standard library and itself.

The code env (:mod:`marft.envs.code`) grades with it. The names below are the grader side's, which its old path
``marft.envs.code.sandbox`` keeps until the next release.
"""

from marft.sandbox.runner import (
    HARNESS,
    LAYERS,
    NOT_PROTECTED,
    STATUSES,
    HarnessRun,
    Isolation,
    RunResult,
    SandboxLimits,
    event_pipe,
    filesystem_view,
    sandbox_python,
)
from marft.sandbox.slots import (
    CPU_PERIOD_US,
    MAX_SLOTS,
    SANDBOX_ENV,
    SLOT_UID_BASE,
    Cgroups,
    Slot,
    is_dead,
    kill_uid,
    process_statuses,
    processes_of_uid,
    wait_until_gone,
)

__all__ = ["CPU_PERIOD_US", "HARNESS", "LAYERS", "MAX_SLOTS", "NOT_PROTECTED", "SANDBOX_ENV", "SLOT_UID_BASE", "STATUSES",
           "Cgroups", "HarnessRun", "Isolation", "RunResult", "SandboxLimits", "Slot", "event_pipe", "filesystem_view",
           "is_dead", "kill_uid", "process_statuses", "processes_of_uid", "sandbox_python", "wait_until_gone"]
