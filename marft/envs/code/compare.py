"""Judging outputs against expected ones, in the grader (expected outputs never enter the sandbox).

* stdin/stdout tests: whitespace-normalised token comparison; an expected integer needs the same
  integer (no float within a tolerance), other numbers match within a float tolerance.
* function-call tests: the expected literal is parsed here (``nan``/``inf`` allowed) and compared in
  the driver with the plain value the program returned: structurally, lists and tuples alike,
  integers exactly, floats within the tolerance.

The comparisons themselves live in ``marft.sandbox.harness.compare`` (standard library only), where the driver uses them.
"""

from __future__ import annotations

import ast
import math

from marft.sandbox.harness.compare import ABS_TOL, REL_TOL, outputs_match, tokens_match, values_equal  # noqa: F401 - the driver's comparisons

_SPECIAL_NAMES = {"nan": math.nan, "inf": math.inf, "True": True, "False": False, "None": None}


def _literal(node: ast.AST):
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name) and node.id in _SPECIAL_NAMES:
        return _SPECIAL_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, (int, float, complex)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):  # complex numbers: 1+2j
        left, right = _literal(node.left), _literal(node.right)
        if isinstance(left, (int, float)) and isinstance(right, complex):
            return left + right if isinstance(node.op, ast.Add) else left - right
    if isinstance(node, ast.List):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Tuple):
        return tuple(_literal(item) for item in node.elts)
    if isinstance(node, ast.Set):
        return frozenset(_literal(item) for item in node.elts)
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("set", "frozenset", "float") and not node.keywords:
        args = [_literal(arg) for arg in node.args]
        if node.func.id == "float" and len(args) == 1 and isinstance(args[0], str):
            return float(args[0])
        if node.func.id != "float" and len(args) <= 1:
            return frozenset(args[0] if args else ())
    raise ValueError(f"not a plain literal: {ast.dump(node)[:80]}")


def parse_literal(text: str):
    """A Python literal such as ``[1, (2.5, 'a')]``, ``{1: None}``, ``set()``, ``nan`` or ``-inf``.

    Sets are returned as frozensets (hashable inside other sets and dicts).

    Raises:
        ValueError: ``text`` is not a plain literal.
    """
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not a Python literal: {text[:80]!r}") from e
    return _literal(tree.body)


def result_matches(reported: str, expected: str) -> bool:
    """Whether the ``repr`` text of a result equals the expected literal (both parsed here: for trusted
    text only; the sandbox's answers are compared in its driver, never parsed in the trainer)."""
    if reported.strip() == expected.strip():
        return True  # also covers literals too big to parse (integers past Python's 4300-digit limit)
    try:
        return values_equal(parse_literal(reported), parse_literal(expected))
    except (ValueError, RecursionError):
        return False
