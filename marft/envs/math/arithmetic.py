"""A generated arithmetic dataset: small sums and differences with disjoint train/test splits.

It exists so that the embedded tiny model has a task it can partly solve after a
short warm start, leaving room for RL to improve it. Every problem with operands
in ``[0, max_operand]`` and an operator from ``operators`` is enumerated once,
shuffled with a fixed seed, and cut into a test split (``test_fraction``) and a
train split, so no test problem is ever seen in training.
"""

from __future__ import annotations

import numpy as np

OPERATORS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b}


def arithmetic_problem(a: int, op: str, b: int) -> dict:
    """One row in the dataset format used by ``MathEnv``: ``{"problem", "answer"}``."""
    return {"problem": f"What is {a} {op} {b}?", "answer": str(OPERATORS[op](a, b))}


def generate_arithmetic(
    split: str = "train",
    max_operand: int = 9,
    operators: str = "+-",
    test_fraction: float = 0.2,
    seed: int = 0,
) -> list[dict]:
    """All problems of one split, in a seeded order.

    Args:
        split: ``"train"`` or ``"test"``; the two never share a problem.
        max_operand: operands are drawn from ``0..max_operand``.
        operators: which of ``+`` and ``-`` to use.
        test_fraction: share of all problems that goes to the test split.
        seed: seed of the shuffle that decides the split and the order.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    for op in operators:
        if op not in OPERATORS:
            raise ValueError(f"unknown operator {op!r}; choose from {sorted(OPERATORS)}")
    triples = [(a, op, b) for op in operators for a in range(max_operand + 1) for b in range(max_operand + 1)]
    order = np.random.default_rng(seed).permutation(len(triples))
    n_test = int(round(test_fraction * len(triples)))
    chosen = order[:n_test] if split == "test" else order[n_test:]
    return [arithmetic_problem(*triples[i]) for i in chosen]
