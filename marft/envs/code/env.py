"""``CodeEnv``: a team writes a program; every agent gets the share of hidden tests it passes.

Per team step each agent replies in profile order; the last fenced ```` ```python ```` block of
the graded agent's reply (the last one with ``with_answer: true``) is the program. It runs
against the problem's hidden tests in the sandbox (``marft.envs.code.run_tests``); the team
reward is ``passed / total`` for every agent, and the task is solved when all tests pass.
A reply without a code block gets reward 0 and is counted (``missing_code_blocks``).

With ``horizon > 1`` an unsolved step gets judge feedback naming the tests that did not pass
and the first failure's exception class (its line only for a failure before any test input; never the hidden
inputs, expected outputs or anything the program printed), and the team tries again::

    Judge: Passed 3 of 5 tests. Not passed: test 2 (wrong answer), test 4 (time limit).
    stderr (end): ZeroDivisionError
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from marft.envs.base import EpisodeState, MultiAgentTextEnv, StepOutcome
from marft.envs.code.data import load_code_problems
from marft.envs.code.generated import GENERATED
from marft.envs.code.grading import run_tests, submit_tests
from marft.envs.code.problem import CodeProblem, last_python_block
from marft.envs.code.report import TestReport
from marft.envs.profile import AgentSpec, answer_agent_index, team_profile
from marft.sandbox import SandboxLimits

logger = logging.getLogger(__name__)

NO_CODE_FEEDBACK = "No program found. Write the whole program in one ```python code block."
STATUS_WORDS = {"failed": "wrong answer", "error": "runtime error", "timeout": "time limit", "memory": "memory limit",
                "output_limit": "output limit"}
FEEDBACK_STDERR_CHARS = 300


@dataclass(frozen=True)
class CodeState(EpisodeState):
    """An ``EpisodeState`` that also knows which problem is being solved."""

    problem_index: int = 0
    """Index into the env's ``problems``."""


def test_feedback(report: TestReport, stderr_chars: int = FEEDBACK_STDERR_CHARS) -> str:
    """The judge's words on an unsolved attempt: tests passed, which did not and why, stderr's end."""
    if not report.failed_tests():
        return f"Passed all {report.total} tests."
    failed = ", ".join(f"test {i + 1} ({STATUS_WORDS.get(status, status)})" for i, status in report.failed_tests()[:10])
    more = " ..." if len(report.failed_tests()) > 10 else ""
    text = f"Passed {report.passed} of {report.total} tests. Not passed: {failed}{more}."
    stderr = report.stderr.strip()
    if stderr:
        text += f"\nstderr (end): {stderr[-stderr_chars:]}"
    return text


class CodeEnv(MultiAgentTextEnv):
    """Programming problems for a team of agents, graded by hidden tests in the sandbox.

    Args:
        dataset_path: ``"generated"`` (the small generated task family), ``"humaneval"``, or a
            DeepCoder/LiveCodeBench JSON/JSONL file or folder with ``<split>.json(l)``.
        split: ``"train"`` or ``"test"`` (generated tasks and folders; a file is its own split).
        profile: profile path or shipped name, or a list of ``AgentSpec``; default ``reasoner_actor``.
        n_agents: expected team size (checked against the profile).
        horizon: attempts per episode; unsolved attempts get test feedback until then.
        problems: use these ``CodeProblem``s instead of loading a dataset.
        strict: raise on unusable dataset rows instead of skipping them.
        limits: sandbox limits (time per test, memory, ...); default ``SandboxLimits()``.
        **generator_kwargs: options of the generated family (``n_constants``, ``test_fraction``, ...).
    """

    failure_counters = ("reward_failures", "grading_failures")

    def __init__(
        self,
        dataset_path: str | Path = GENERATED,
        split: str = "train",
        profile: str | Path | list[AgentSpec] | None = "reasoner_actor",
        n_agents: int | None = None,
        horizon: int = 1,
        problems: list[CodeProblem] | None = None,
        strict: bool = False,
        limits: SandboxLimits | None = None,
        **generator_kwargs,
    ):
        self.profile = team_profile(profile, n_agents)
        super().__init__([spec.role for spec in self.profile], horizon=horizon)
        self.answer_index: int = answer_agent_index(self.profile)
        if problems is not None:
            if not problems:
                raise ValueError("problems is empty; pass at least one CodeProblem")
            self.problems, self.skipped_rows = list(problems), []
        else:
            loaded = load_code_problems(dataset_path, split=split, strict=strict, **generator_kwargs)
            self.problems, self.skipped_rows = loaded.problems, loaded.skipped
        self.limits = limits or SandboxLimits()
        self.grading_failures = 0  # sandbox errors (reward 0, logged)
        self.missing_code_blocks = 0  # graded replies without a ```python block (reward 0)
        self._pending: dict[str, Future] = {}

    @property
    def num_tasks(self) -> int:
        """How many problems the env holds (reset option ``task_index`` picks one)."""
        return len(self.problems)

    def sample_task(self, options: dict | None) -> dict:
        """A problem drawn with ``self.np_random``, or ``options["task_index"]``.

        Returns:
            dict: ``problem`` (the statement), ``answer`` (the task id; the tests stay hidden),
            ``task_index`` and ``n_tests``.
        """
        index = self.choose_task(options)
        problem = self.problems[index]
        return {"problem": problem.text, "answer": problem.task_id, "task_index": index, "n_tests": problem.n_tests}

    def initial_state(self, task: dict) -> CodeState:
        base = super().initial_state(task)
        return CodeState(problem=base.problem, answer=base.answer, history=base.history, problem_index=int(task["task_index"]))

    # ---- grading

    def program_for(self, state: CodeState, actions: tuple[str, ...]) -> str | None:
        """The program the graded reply of ``actions`` stands for, or ``None`` without a code block."""
        code = last_python_block(actions[self.answer_index])
        return None if code is None else self.problems[state.problem_index].program(code)

    def pregrade(self, actions: tuple[str, ...]) -> None:
        """Start grading the current episode's ``actions`` on the grading pool; ``evaluate`` picks the
        result up. Lets a vector env grade all its envs' programs at once (``TextVectorEnv.step`` calls it for every env first)."""
        if self.episode is None:
            return
        program = self.program_for(self.episode, tuple(actions))
        if program is not None and program not in self._pending:
            problem = self.problems[self.episode.problem_index]
            self._pending[program] = submit_tests(program, problem.tests, entry_point=problem.entry_point, limits=self.limits,
                                                  prompt=problem.program_prefix or None)

    def _report(self, program: str, problem: CodeProblem) -> TestReport:
        future = self._pending.pop(program, None)
        self._pending.clear()  # results for other replies of this step are never used
        if future is not None:
            return future.result()
        return run_tests(program, problem.tests, entry_point=problem.entry_point, limits=self.limits, prompt=problem.program_prefix or None)

    def evaluate(self, state: CodeState, actions: tuple[str, ...]) -> StepOutcome:
        """Run the graded reply's program on the hidden tests; the same team reward goes to every agent.

        Returns:
            StepOutcome: rewards ``(passed / total,) * n``; solved when every test passed; info holds
            ``correct``, ``passed``, ``total``, ``statuses`` (one per test), ``missing_code`` and
            ``grading_error`` when the sandbox itself failed.
        """
        problem = self.problems[state.problem_index]
        program = self.program_for(state, actions)
        info: dict = {"correct": False, "passed": 0, "total": problem.n_tests, "statuses": [], "missing_code": program is None}
        if program is None:
            self.missing_code_blocks += 1
            return StepOutcome(rewards=(0.0,) * self.n_agents, solved=False, feedback=NO_CODE_FEEDBACK, info=info)
        try:
            report = self._report(program, problem)
        except Exception as e:  # noqa: BLE001 - a broken sandbox must not end training
            self.grading_failures += 1
            logger.warning("grading failed (reward 0, %d failures so far): %s: %s", self.grading_failures, type(e).__name__, e)
            info["grading_error"] = f"{type(e).__name__}: {e}"
            return StepOutcome(rewards=(0.0,) * self.n_agents, solved=False, feedback="", info=info)
        info.update(correct=report.all_passed, passed=report.passed, total=report.total, statuses=list(report.statuses))
        reward = float(report.fraction)
        return StepOutcome(rewards=(reward,) * self.n_agents, solved=report.all_passed, feedback=test_feedback(report), info=info)

    # ---- checkpoints

    def state_dict(self) -> dict:
        """The base class's state plus the ``missing_code_blocks`` counter."""
        state = super().state_dict()
        state["counters"]["missing_code_blocks"] = int(self.missing_code_blocks)
        return state
