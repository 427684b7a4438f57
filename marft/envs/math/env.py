"""``MathEnv``: a team answers a math problem; every agent gets 1.0 when the graded reply is right.

Per team step each agent replies in profile order; the reply of the last agent whose
profile entry has ``with_answer: true`` is graded (its last ``\\boxed{}`` against the
reference). Right: reward 1.0 for every agent, episode terminated. Wrong: reward 0.0;
before the horizon the judge says the answer is incorrect and the team tries again
(as in the MARFT paper); the horizon's last attempt also terminates the episode (the
attempts are part of the task, so nothing is bootstrapped after it; ``truncated`` is
left to outside time limits).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

from marft.envs.base import EpisodeState, MultiAgentTextEnv, StepOutcome
from marft.envs.math.data import ARITHMETIC, load_problem_set
from marft.envs.math.grader import default_grader, last_boxed
from marft.envs.profile import AgentSpec, answer_agent_index, team_profile

logger = logging.getLogger(__name__)

DEFAULT_FEEDBACK = "Your answer is incorrect. Please check the reasoning and try again."


class Grader(Protocol):
    """Anything that grades a reply against a reference (``MathGrader`` does)."""

    def grade(self, response: str, ground_truth: str) -> bool: ...


class MathEnv(MultiAgentTextEnv):
    """Math problems for a team of agents.

    Args:
        dataset_path: JSON/JSONL file, folder with ``<split>.json(l)``, or ``"arithmetic"``.
        split: dataset split (for ``"arithmetic"`` and folders).
        profile: profile path or shipped name, or a list of ``AgentSpec``;
            ``None`` picks the default profile for ``n_agents`` (2 if unset).
        n_agents: expected team size (checked against the profile).
        horizon: team steps per episode; wrong answers get judge feedback until then.
        problems: use these ``{"problem", "answer"}`` rows instead of loading a dataset.
        strict: raise on unusable dataset rows instead of skipping them.
        grader: custom grader; default the process-wide ``MathGrader``.
        feedback: the judge's text after a wrong answer.
        **dataset_kwargs: options for ``"arithmetic"`` (``max_operand``, ...).
    """

    failure_counters = ("reward_failures", "grading_failures")

    def __init__(
        self,
        dataset_path: str | Path = ARITHMETIC,
        split: str = "train",
        profile: str | Path | list[AgentSpec] | None = None,
        n_agents: int | None = None,
        horizon: int = 1,
        problems: list[dict] | None = None,
        strict: bool = False,
        grader: Grader | None = None,
        feedback: str = DEFAULT_FEEDBACK,
        **dataset_kwargs,
    ):
        self.profile = team_profile(profile, n_agents=2 if profile is None and n_agents is None else n_agents)
        super().__init__([spec.role for spec in self.profile], horizon=horizon)
        self.answer_index: int = answer_agent_index(self.profile)
        if problems is not None:
            if not problems:
                raise ValueError("problems is empty; pass at least one {'problem', 'answer'} row")
            self.problems, self.skipped_rows = list(problems), []
        else:
            loaded = load_problem_set(dataset_path, split=split, strict=strict, **dataset_kwargs)
            self.problems, self.skipped_rows = loaded.rows, loaded.skipped
        self.feedback = feedback
        self._grader = grader
        self.grading_failures = 0  # grader calls that raised (graded wrong, logged)

    @property
    def grader(self) -> Grader:
        """The grader in use (the process-wide one unless one was passed)."""
        return self._grader if self._grader is not None else default_grader()

    @property
    def num_tasks(self) -> int:
        """How many problems the env holds (reset option ``task_index`` picks one)."""
        return len(self.problems)

    def sample_task(self, options: dict | None) -> dict:
        """A problem drawn with ``self.np_random``, or ``options["task_index"]``.

        Returns:
            dict: ``problem``, ``answer`` and ``task_index``.
        """
        index = self.choose_task(options)
        row = self.problems[index]
        return {"problem": row["problem"], "answer": row["answer"], "task_index": index}

    def evaluate(self, state: EpisodeState, actions: tuple[str, ...]) -> StepOutcome:
        """Grade the answering agent's reply; the same team reward goes to every agent.

        Returns:
            StepOutcome: rewards ``(1.0,)*n`` if correct else ``(0.0,)*n``; info holds
            ``correct``, ``answer`` (reference), ``predicted`` (last boxed content or None)
            and ``grading_error`` when the grader raised.
        """
        response = actions[self.answer_index]
        info: dict = {"answer": state.answer, "predicted": last_boxed(response)}
        try:
            correct = bool(self.grader.grade(response, state.answer))
        except Exception as e:  # noqa: BLE001 - a broken grader must not end training
            self.grading_failures += 1
            logger.warning("grading failed (reward 0, %d failures so far): %s: %s", self.grading_failures, type(e).__name__, e)
            correct = False
            info["grading_error"] = f"{type(e).__name__}: {e}"
        info["correct"] = correct
        reward = 1.0 if correct else 0.0
        return StepOutcome(rewards=(reward,) * self.n_agents, solved=correct, feedback=self.feedback, info=info)
