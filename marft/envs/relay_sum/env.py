"""``RelaySumEnv``: a cooperative toy task with a known optimum (registered as ``relay_sum``).

The team must add a hidden key (one digit) to a public number (a multiple of ten). Only
the first agent (the *keeper*, the Reasoner of ``reasoner_actor``) sees the key, in its
private observation; only the answering agent's (the Actor's) reply is graded. So the
answer can reach the box only if the keeper passes the key on and the answerer uses it::

    Reasoner's prompt                    Actor's prompt
    <Reasoner role header>               <Actor role header>
    x = 7                                Problem: What is x + 50?
                                         Reasoner: 7 + 50 = 57
    Problem: What is x + 50?             Actor:
    Reasoner:                            -> "\\boxed{57}" earns 1.0 for every agent

* Optimum: 100 % (the keeper writes ``<key> + <number> = <key + number>``, the answerer boxes it).
* Without the key, the best an answerer can do is guess it: ``1 / n_keys`` (10 % by default);
  uniformly random numbers in the answer range succeed about 1 % of the time.
* The sum of a digit and a multiple of ten is written by putting the digit after the tens:
  no carrying, nothing to memorise. What the team must learn is the cooperation itself
  (tell the key, use what was told), a rule that holds for every pair, so it carries over
  to pairs never trained on.
* The (key, number) pairs are split once, with a fixed seed, into a ``train`` and a ``test``
  split that never share a pair, so evaluation is on held-out tasks.

Rewards are exact: 1.0 for every agent when the last ``\\boxed{}`` of the answerer's reply is
exactly the sum (e.g. ``12``, not ``12.0``), else 0.0. With ``horizon > 1`` a wrong answer gets
judge feedback and the team tries again.

This file is also the worked example of writing an environment: a task sampler, a grader
(``evaluate``), and ``private_observations`` for what only one agent may see.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from marft.envs.base import EpisodeState, MultiAgentTextEnv, StepOutcome
from marft.envs.math.grader import last_boxed
from marft.envs.profile import AgentSpec, answer_agent_index, team_profile

FEEDBACK = "The answer is incorrect. Please try again."


@dataclass(frozen=True)
class RelayState(EpisodeState):
    """An ``EpisodeState`` that also holds the hidden key (``transition`` keeps it via ``replace``)."""

    key: int = 0
    """The secret number only the keeper sees."""


def relay_problem(key: int, number: int) -> dict:
    """One task: ``problem`` (public text), ``answer`` (``str(key + number)``), ``key``, ``number``."""
    return {"problem": f"What is x + {number}?", "answer": str(key + number), "key": key, "number": number}


def keeper_observation(key: int) -> str:
    """What only the keeper sees: ``"x = <key>"``."""
    return f"x = {key}"


def relay_tasks(split: str = "train", n_keys: int = 10, n_tens: int = 9, test_fraction: float = 0.2, seed: int = 0) -> list[tuple[int, int]]:
    """All ``(key, number)`` pairs of one split, in a seeded order; ``train`` and ``test`` are disjoint.

    The split is stratified by key: each key holds out ``n_test / n_keys`` of its numbers (the remainder
    spread over keys in a seeded order), so every key keeps most of its numbers in training and held-out
    pairs test the rule (relay whatever the key is), not a key the team hardly ever saw. (A plain shuffle
    once put five of the nine pairs of key 1 into the test split: held-out success then stopped near 0.7.)

    Args:
        split: ``"train"`` or ``"test"``.
        n_keys: keys are ``0..n_keys-1`` (at most 10: a key is one digit).
        n_tens: public numbers are ``10, 20, ..., 10 * n_tens``.
        test_fraction: share of all pairs in the test split.
        seed: seed of the shuffle that decides the split.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if not 2 <= n_keys <= 10:
        raise ValueError(f"n_keys must be 2..10 (one key is no secret; a key is one digit), got {n_keys}")
    if n_tens < 1:
        raise ValueError(f"n_tens must be at least 1, got {n_tens}")
    rng = np.random.default_rng(seed)
    n_test = int(round(test_fraction * n_keys * n_tens))
    held_out = set()
    for rank, key in enumerate(rng.permutation(n_keys)):  # keys in a seeded order share out the remainder
        count = n_test // n_keys + (1 if rank < n_test % n_keys else 0)
        held_out.update((int(key), 10 * (int(t) + 1)) for t in rng.permutation(n_tens)[:count])
    pairs = [(key, 10 * tens) for key in range(n_keys) for tens in range(1, n_tens + 1)]
    chosen = [pair for pair in pairs if (pair in held_out) == (split == "test")]
    return [chosen[i] for i in rng.permutation(len(chosen))]


class RelaySumEnv(MultiAgentTextEnv):
    """The keeper (agent 0) must relay a hidden key so that the answerer can box ``key + number``.

    Args:
        split: ``"train"`` or ``"test"`` (disjoint sets of (key, number) pairs).
        profile: profile path or shipped name, or a list of ``AgentSpec``; default ``reasoner_actor``.
            The answering agent (last ``with_answer``) must not be agent 0, who holds the key.
        n_agents: expected team size (checked against the profile).
        horizon: attempts per episode; wrong answers get judge feedback until then.
        n_keys: keys are ``0..n_keys-1`` (2..10); guessing without the key succeeds ``1 / n_keys`` of the time.
        n_tens: public numbers are ``10, 20, ..., 10 * n_tens``.
        test_fraction: share of (key, number) pairs held out in the ``test`` split.
    """

    def __init__(
        self,
        split: str = "train",
        profile: str | Path | list[AgentSpec] | None = "reasoner_actor",
        n_agents: int | None = None,
        horizon: int = 1,
        n_keys: int = 10,
        n_tens: int = 9,
        test_fraction: float = 0.2,
    ):
        self.profile = team_profile(profile, n_agents)
        super().__init__([spec.role for spec in self.profile], horizon=horizon)
        self.answer_index: int = answer_agent_index(self.profile)
        if self.answer_index == 0:
            raise ValueError("relay_sum needs a team where someone other than the first agent (the key keeper) answers")
        self.n_keys = n_keys
        self.tasks: list[tuple[int, int]] = relay_tasks(split, n_keys, n_tens, test_fraction)
        if not self.tasks:
            raise ValueError(f"the {split!r} split is empty; change test_fraction ({test_fraction})")

    # ---- the three hooks a task needs

    @property
    def num_tasks(self) -> int:
        """How many (key, number) pairs the split holds (reset option ``task_index`` picks one)."""
        return len(self.tasks)

    def sample_task(self, options: dict | None) -> dict:
        """A (key, number) pair of this split drawn with ``self.np_random`` (or ``options["task_index"]``).

        Returns:
            dict: ``problem`` (public text), ``answer`` (``str(key + number)``), ``key``, ``number``.
        """
        return relay_problem(*self.tasks[self.choose_task(options)])

    def initial_state(self, task: dict) -> RelayState:
        base = super().initial_state(task)
        return RelayState(problem=base.problem, answer=base.answer, history=base.history, key=int(task["key"]))

    def private_observations(self) -> list[str]:
        """The keeper sees ``x = <key>``; nobody else sees anything private."""
        if self.episode is None:
            raise RuntimeError("call reset() first")
        return [keeper_observation(self.episode.key)] + [""] * (self.n_agents - 1)

    def evaluate(self, state: EpisodeState, actions: tuple[str, ...]) -> StepOutcome:
        """Exact match of the answerer's last ``\\boxed{}`` with the sum; one team reward for all agents.

        Returns:
            StepOutcome: rewards ``(1.0,)*n`` if correct else ``(0.0,)*n``; info holds ``correct``,
            ``answer`` and ``predicted`` (last boxed content or None).
        """
        predicted = last_boxed(actions[self.answer_index])
        correct = predicted == state.answer
        reward = 1.0 if correct else 0.0
        info = {"correct": correct, "answer": state.answer, "predicted": predicted}
        return StepOutcome(rewards=(reward,) * self.n_agents, solved=correct, feedback=FEEDBACK, info=info)

    # ---- the global view

    def state(self) -> str:
        """The critic's global view: the hidden key, then the shared history."""
        history = super().state()
        return f"{keeper_observation(self.episode.key)}\n{history}"
