"""A generated family of small programming tasks with hidden tests (``dataset_path="generated"``).

Each task asks for a one-line function of one integer, ``f(x)``: ``x + k``, ``x - k`` or ``x * k``
with ``k`` in ``0..n_constants-1``::

    Write a Python function f(x) that returns x + 3.      # hidden tests: f(-7) == -4, f(0) == 3, ...

The (operation, k) pairs are split once, with a fixed seed, into disjoint ``train`` and ``test``
sets, so evaluation is on tasks never trained on. Every task has five hidden call tests on
integers in ``-20..20`` drawn with a per-task seed, and a known solution.
"""

from __future__ import annotations

import numpy as np

from marft.envs.code.problem import CodeProblem

GENERATED = "generated"
OPERATIONS = {"add": "+", "sub": "-", "mul": "*"}
"""Operation names and the Python operator each stands for."""


def generated_problem(operation: str, k: int, n_tests: int = 5, seed: int = 0) -> CodeProblem:
    """The task ``f(x) = x <op> k`` with ``n_tests`` hidden call tests."""
    symbol = OPERATIONS[operation]
    rng = np.random.default_rng([seed, list(OPERATIONS).index(operation), k])
    xs = [int(x) for x in rng.choice(np.arange(-20, 21), size=n_tests, replace=False)]
    tests = [{"call": f"f({x})", "expected": repr(eval(f"{x} {symbol} {k}"))} for x in xs]  # noqa: S307 - integer literals only
    return CodeProblem(
        task_id=f"generated/{operation}_{k}",
        text=f"Write a Python function f(x) that returns x {symbol} {k}.",
        tests=tests,
        entry_point="f",
        solution=f"def f(x):\n    return x {symbol} {k}\n",
    )


def generate_tasks(split: str = "train", n_constants: int = 10, test_fraction: float = 0.2, n_tests: int = 5, seed: int = 0) -> list[CodeProblem]:
    """All tasks of one split, in a seeded order; ``train`` and ``test`` never share a task.

    Args:
        split: ``"train"`` or ``"test"``.
        n_constants: ``k`` ranges over ``0..n_constants-1``.
        test_fraction: share of all (operation, k) pairs in the test split.
        n_tests: hidden tests per task.
        seed: seed of the split and of the test inputs.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if n_constants < 1:
        raise ValueError(f"n_constants must be at least 1, got {n_constants}")
    pairs = [(operation, k) for operation in OPERATIONS for k in range(n_constants)]
    order = np.random.default_rng(seed).permutation(len(pairs))
    n_test = int(round(test_fraction * len(pairs)))
    chosen = order[:n_test] if split == "test" else order[n_test:]
    if len(chosen) == 0:
        raise ValueError(f"the {split!r} split is empty; change test_fraction ({test_fraction}) or n_constants ({n_constants})")
    return [generated_problem(*pairs[i], n_tests=n_tests, seed=seed) for i in chosen]
