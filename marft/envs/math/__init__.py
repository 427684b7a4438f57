"""Math problems for agent teams: the environment, the answer grader and the dataset loader."""

from marft.envs.math.data import load_problems
from marft.envs.math.env import MathEnv
from marft.envs.math.grader import grade_answer, grade_answers, grader_stats

__all__ = ["MathEnv", "grade_answer", "grade_answers", "grader_stats", "load_problems"]
