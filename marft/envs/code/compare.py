"""Judging outputs against expected ones, in the grader (expected outputs never enter the sandbox).

* stdin/stdout tests: whitespace-normalised token comparison; two tokens that are both numbers
  with a decimal point or exponent match within a float tolerance, integers match exactly.
* function-call tests: the sandbox reports ``repr`` of a plain-data result; both sides are
  parsed as Python literals (``nan``/``inf`` allowed) and compared structurally, lists and
  tuples alike, floats within the tolerance.
"""

from __future__ import annotations

import ast
import math
import re

INTEGER = re.compile(r"[-+]?\d+")
NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
REL_TOL = 1e-6
ABS_TOL = 1e-6
_SPECIAL_NAMES = {"nan": math.nan, "inf": math.inf, "True": True, "False": False, "None": None}


def _tokens_match(actual: str, expected: str, rel_tol: float, abs_tol: float) -> bool:
    if actual == expected:
        return True
    if INTEGER.fullmatch(actual) and INTEGER.fullmatch(expected):
        return _integer_text(actual) == _integer_text(expected)  # exact, and no int() (4300-digit limit)
    if NUMBER.fullmatch(actual) and NUMBER.fullmatch(expected):
        return math.isclose(float(actual), float(expected), rel_tol=rel_tol, abs_tol=abs_tol)
    return False


def _integer_text(token: str) -> str:
    """An integer token in one canonical spelling: no ``+``, no leading zeros, ``-0`` as ``0``."""
    digits = token.lstrip("+-").lstrip("0") or "0"
    return digits if digits == "0" or not token.startswith("-") else "-" + digits


def outputs_match(actual: str, expected: str, rel_tol: float = REL_TOL, abs_tol: float = ABS_TOL) -> bool:
    """Whether a program's stdout ``actual`` answers a test whose expected stdout is ``expected``.

    Whitespace (spaces, newlines, trailing blanks) only separates tokens; tokens must match one
    by one (numbers as described in the module docstring).
    """
    got, want = actual.split(), expected.split()
    return len(got) == len(want) and all(_tokens_match(a, b, rel_tol, abs_tol) for a, b in zip(got, want))


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


def values_equal(actual, expected, rel_tol: float = REL_TOL, abs_tol: float = ABS_TOL) -> bool:
    """Structural equality of two plain values: lists and tuples alike, floats within tolerance,
    ``bool`` only equal to ``bool``."""
    if isinstance(actual, bool) or isinstance(expected, bool):
        return type(actual) is type(expected) and actual == expected
    if isinstance(actual, (int, float)) and isinstance(expected, (int, float)):
        if isinstance(actual, int) and isinstance(expected, int):
            return actual == expected
        if math.isnan(actual) or math.isnan(expected):
            return math.isnan(actual) and math.isnan(expected)
        return math.isclose(actual, expected, rel_tol=rel_tol, abs_tol=abs_tol)
    if isinstance(actual, (list, tuple)) and isinstance(expected, (list, tuple)):
        return len(actual) == len(expected) and all(values_equal(a, e, rel_tol, abs_tol) for a, e in zip(actual, expected))
    if isinstance(actual, dict) and isinstance(expected, dict):
        return actual.keys() == expected.keys() and all(values_equal(actual[k], expected[k], rel_tol, abs_tol) for k in actual)
    if isinstance(actual, (set, frozenset)) and isinstance(expected, (set, frozenset)):
        return set(actual) == set(expected)
    return type(actual) is type(expected) and actual == expected


def result_matches(reported: str, expected: str) -> bool:
    """Whether the sandbox's ``repr`` of a call's result equals the expected literal."""
    if reported.strip() == expected.strip():
        return True  # also covers literals too big to parse (integers past Python's 4300-digit limit)
    try:
        return values_equal(parse_literal(reported), parse_literal(expected))
    except (ValueError, RecursionError):
        return False
