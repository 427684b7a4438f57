"""Keep what was learned: the best policy of a run, and a collapse noticed when it happens.

:class:`BestTracker` is fed one figure per iteration (the iteration's training accuracy) and each held-out
evaluation. It keeps a moving mean of the last ``window`` training accuracies; a new best is a moving mean that
beats the best so far by ``min_gain`` (the runner then writes ``checkpoints/best``). A collapse is a full window,
after the best, whose mean lies ``drop`` or more below it: the runner warns, stops or rolls back to the best
checkpoint (``--on_collapse``). After a rollback the window starts empty, so the next judgement waits for
``window`` fresh iterations.

The best is chosen on training accuracy, never on the held-out split, so the held-out figure of the best
checkpoint stays an unbiased estimate (the runner evaluates the best checkpoint once at the end).

The tracker is plain data: :meth:`BestTracker.state_dict` goes into every checkpoint, so a resumed (or
preempted) run judges exactly as an uninterrupted one.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Judgement:
    """What one iteration's figure means for the run."""

    moving_accuracy: float
    """Mean training accuracy over the last ``window`` iterations (fewer at the start of a run or after a rollback)."""
    new_best: bool
    """The moving accuracy beat the best so far (by ``min_gain``): save ``checkpoints/best`` now."""
    collapsed: bool
    """A full window after the best lies ``drop`` or more below it."""


@dataclass
class BestRecord:
    """The best point of a run so far."""

    iteration: int = 0
    """Iterations done when it was reached (0: none yet)."""
    moving_accuracy: float = -math.inf
    """Its moving training accuracy."""
    heldout_accuracy: float | None = None
    """The held-out accuracy of this policy, when it was evaluated (at an --eval_interval point, or at the end)."""


@dataclass
class BestTracker:
    """Moving training accuracy, the best point and collapse detection (module docstring).

    Args:
        window: iterations in the moving mean, and the iterations a collapse must last before it is judged.
        drop: how far (absolute accuracy) a full window's mean must fall below the best to count as a collapse.
        min_gain: how much a moving mean must beat the best to become the new best (fewer, larger saves).
        min_fill: values the window needs before a new best is taken (the runner: a full window, so a run shorter
            than the window keeps no best, and a run extended by a resume judges as one run of that length).
    """

    window: int = 20
    drop: float = 0.15
    min_gain: float = 0.01
    min_fill: int = 20
    recent: deque = field(default_factory=deque)
    """The last ``window`` training accuracies (since the start or the last rollback)."""
    best: BestRecord = field(default_factory=BestRecord)
    collapses: int = 0
    """Collapses judged in this run (each one also warned about)."""
    rollbacks: int = 0
    """Rollbacks to the best checkpoint done in this run."""
    last_heldout: tuple[int, float] | None = None
    """``(iteration, accuracy)`` of the last held-out evaluation."""
    in_collapse: bool = False
    """A collapse was judged and the moving accuracy has not come back within ``drop`` of the best since (one
    collapse is reported once, not every iteration it lasts)."""

    def __post_init__(self):
        self.recent = deque(self.recent, maxlen=self.window)

    @property
    def moving_accuracy(self) -> float:
        return sum(self.recent) / len(self.recent) if self.recent else math.nan

    def observe(self, iteration: int, accuracy: float) -> Judgement:
        """Take the training accuracy of the iteration that made ``iteration`` iterations done. A NaN accuracy
        (an iteration that graded nothing) is left out of the window."""
        if accuracy == accuracy:
            self.recent.append(float(accuracy))
        moving = self.moving_accuracy
        filled = len(self.recent) >= min(self.window, max(1, self.min_fill))
        new_best = filled and moving == moving and moving >= self.best.moving_accuracy + self.min_gain
        if new_best:
            self.best = BestRecord(iteration=iteration, moving_accuracy=moving)
        below = (not new_best and len(self.recent) == self.window and self.best.iteration > 0
                 and iteration - self.best.iteration >= self.window and moving <= self.best.moving_accuracy - self.drop)
        collapsed = below and not self.in_collapse
        self.in_collapse = below
        if collapsed:
            self.collapses += 1
        return Judgement(moving_accuracy=moving, new_best=new_best, collapsed=collapsed)

    def observe_heldout(self, iteration: int, accuracy: float) -> None:
        """Record a held-out evaluation after ``iteration`` iterations (the best's, if it was taken there)."""
        self.last_heldout = (iteration, float(accuracy))
        if iteration == self.best.iteration:
            self.best.heldout_accuracy = float(accuracy)

    def rolled_back(self) -> None:
        """The run went back to the best checkpoint: judge afresh from an empty window."""
        self.rollbacks += 1
        self.recent.clear()
        self.in_collapse = False

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return {
            "recent": list(self.recent), "collapses": self.collapses, "rollbacks": self.rollbacks,
            "best": {"iteration": self.best.iteration, "moving_accuracy": _finite_or_none(self.best.moving_accuracy),
                     "heldout_accuracy": self.best.heldout_accuracy},
            "last_heldout": list(self.last_heldout) if self.last_heldout else None, "in_collapse": self.in_collapse,
        }

    def load_state_dict(self, state: dict) -> None:
        self.recent = deque((float(v) for v in state.get("recent", [])), maxlen=self.window)
        self.collapses = int(state.get("collapses", 0))
        self.rollbacks = int(state.get("rollbacks", 0))
        best = state.get("best") or {}
        moving = best.get("moving_accuracy")
        self.best = BestRecord(int(best.get("iteration", 0)), -math.inf if moving is None else float(moving), best.get("heldout_accuracy"))
        self.last_heldout = tuple(state["last_heldout"]) if state.get("last_heldout") else None
        self.in_collapse = bool(state.get("in_collapse", False))

    def summary(self) -> dict:
        """The figures ``summary.json`` names: the best iteration, its moving and held-out accuracy, the counts."""
        return {
            "best_iteration": self.best.iteration or None,
            "best_moving_train_accuracy": _finite_or_none(self.best.moving_accuracy),
            "best_heldout_accuracy": self.best.heldout_accuracy,
            "final_moving_train_accuracy": _finite_or_none(self.moving_accuracy),
            "collapses": self.collapses,
            "rollbacks": self.rollbacks,
        }


def _finite_or_none(value: float) -> float | None:
    return value if value == value and math.isfinite(value) else None
