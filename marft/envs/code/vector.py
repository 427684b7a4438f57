"""``CodeVectorEnv``: a ``TextVectorEnv`` that grades all of its envs' programs at once.

``TextVectorEnv.step`` steps its envs one after another, so each env's ``evaluate`` would wait
for its own sandbox before the next one starts. This subclass first hands every env's program
to the grading pool (``CodeEnv.pregrade``: one sandbox per core) and then steps as usual; each
``evaluate`` collects its finished report. Envs that are not ``CodeEnv``s are stepped unchanged.
"""

from __future__ import annotations

from typing import Sequence

from marft.envs.vector import TextVectorEnv


class CodeVectorEnv(TextVectorEnv):
    """``TextVectorEnv`` with parallel grading of the step's programs."""

    def step(self, actions: Sequence[Sequence[str]]):
        """As ``TextVectorEnv.step`` (same arguments and return values); every env's program is graded
        in parallel first."""
        if len(actions) == len(self.envs):  # otherwise TextVectorEnv.step raises its own error
            for env, team_actions in zip(self.envs, actions):
                pregrade = getattr(getattr(env, "unwrapped", env), "pregrade", None)
                if pregrade is not None:
                    pregrade(tuple(team_actions))
        return super().step(actions)
