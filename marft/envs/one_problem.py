"""One problem of the user's, played by a team and not graded (``marft play``)."""

from __future__ import annotations

from marft.envs.base import EpisodeState, MultiAgentTextEnv, StepOutcome
from marft.envs.profile import team_profile


class OneProblemEnv(MultiAgentTextEnv):
    """The team's conversation on ``problem``: every episode is that problem, a team step ends it (or, with
    ``horizon`` > 1, each step is followed by the next until the horizon), and no reply is graded (rewards 0)."""

    def __init__(self, problem: str, profile, horizon: int = 1):
        if not isinstance(problem, str) or not problem.strip():
            raise ValueError("the problem is empty: give the team a question")
        self.profile = team_profile(profile)
        super().__init__([spec.role for spec in self.profile], horizon=horizon)
        self.problem = problem.strip()

    @property
    def num_tasks(self) -> int:
        return 1

    def sample_task(self, options: dict | None) -> dict:
        return {"problem": self.problem, "answer": ""}

    def evaluate(self, state: EpisodeState, actions: tuple[str, ...]) -> StepOutcome:
        return StepOutcome(rewards=(0.0,) * self.n_agents, solved=False)
