"""Judging a candidate's answer against the expected one, in the driver (standard library only; the grader's
``marft.envs.code.compare`` re-exports these).

* stdout: whitespace-normalised tokens; an expected integer needs that integer, other numbers match within a
  float tolerance (:func:`outputs_match`, :func:`tokens_match`);
* plain values: structurally, lists and tuples alike, integers exactly, floats within the tolerance, set elements
  and dict keys exactly and by type (:func:`values_equal`).

None of them ever raises: a value it cannot compare is not equal.
"""

import math
import sys

_type, _len, _isinstance = type, len, isinstance


REL_TOL = 1e-6
ABS_TOL = 1e-6


def values_equal(actual, expected, rel_tol=REL_TOL, abs_tol=ABS_TOL):
    """Structural equality of plain values: lists and tuples alike, floats within tolerance, integers exactly
    (an expected integer needs an integer), ``bool`` only equal to ``bool``. Never raises: a value it cannot
    compare (an integer past the float range where a float is expected, nesting past the recursion limit) is
    not equal."""
    try:
        return _values_equal(actual, expected, rel_tol, abs_tol)
    except (RecursionError, OverflowError, ValueError, TypeError, MemoryError):
        return False


def _values_equal(actual, expected, rel_tol, abs_tol):
    if _isinstance(actual, bool) or _isinstance(expected, bool):
        return _type(actual) is _type(expected) and actual == expected
    if _type(expected) is int:
        return _type(actual) is int and actual == expected
    if _type(expected) is float and _type(actual) in (int, float):
        if _type(actual) is int:
            if not -sys.float_info.max <= actual <= sys.float_info.max:  # an exact comparison: no conversion that overflows
                return False
            actual = float(actual)
        if math.isnan(actual) or math.isnan(expected):
            return math.isnan(actual) and math.isnan(expected)
        return math.isclose(actual, expected, rel_tol=rel_tol, abs_tol=abs_tol)
    if _isinstance(actual, (list, tuple)) and _isinstance(expected, (list, tuple)):
        return _len(actual) == _len(expected) and all(_values_equal(a, e, rel_tol, abs_tol) for a, e in zip(actual, expected))
    if _isinstance(actual, dict) and _isinstance(expected, dict):
        got, want = {_typed_key(k): v for k, v in actual.items()}, {_typed_key(k): v for k, v in expected.items()}
        return got.keys() == want.keys() and all(_values_equal(got[k], want[k], rel_tol, abs_tol) for k in got)
    if _isinstance(actual, (set, frozenset)) and _isinstance(expected, (set, frozenset)):
        return {_typed_key(v) for v in actual} == {_typed_key(v) for v in expected}
    return _type(actual) is _type(expected) and actual == expected


def _typed_key(value):
    """A set element or dict key as a hashable value equal only to one of the same kind (``True``, ``1`` and
    ``1.0`` differ, as ``values_equal`` has them; hashing alone makes them one key), lists and tuples alike,
    every NaN alike. Compared exactly: no float tolerance inside sets and keys."""
    kind = _type(value)
    if kind is float and value != value:
        return ("nan",)
    if kind is tuple or kind is list:
        return ("sequence",) + tuple(_typed_key(item) for item in value)
    if kind is frozenset or kind is set:
        return ("set", frozenset(_typed_key(item) for item in value))
    return (kind.__name__, value)


def _is_integer_token(token):
    digits = token[1:] if token[:1] in ("+", "-") else token
    return digits.isdigit() and digits.isascii()


def _is_number_token(token):
    """A decimal number: sign, digits with at most one point, an optional exponent (no ``inf``/``nan``/``_``)."""
    body = token[1:] if token[:1] in ("+", "-") else token
    mantissa, marker, exponent = body.lower().partition("e")
    if marker and not _is_integer_token(exponent):
        return False
    whole, dot, fraction = mantissa.partition(".")
    return (whole + fraction).isdigit() and (whole + fraction).isascii() and "." not in fraction


def _integer_text(token):
    """An integer token in one canonical spelling: no ``+``, no leading zeros, ``-0`` as ``0``."""
    digits = token.lstrip("+-").lstrip("0") or "0"
    return digits if digits == "0" or not token.startswith("-") else "-" + digits


def tokens_match(actual, expected, rel_tol=REL_TOL, abs_tol=ABS_TOL):
    """One stdout token against the expected one: integers exactly (an expected integer needs an integer),
    other numbers within the tolerance, anything else as text. Never raises (a number past the float range
    reads as infinity)."""
    try:
        return _tokens_match(actual, expected, rel_tol, abs_tol)
    except (OverflowError, ValueError, MemoryError):
        return False


def _tokens_match(actual, expected, rel_tol, abs_tol):
    if actual == expected:
        return True
    if _is_integer_token(expected):
        return _is_integer_token(actual) and _integer_text(actual) == _integer_text(expected)
    if _is_number_token(actual) and _is_number_token(expected):
        return math.isclose(float(actual), float(expected), rel_tol=rel_tol, abs_tol=abs_tol)
    return False


def outputs_match(actual, expected, rel_tol=REL_TOL, abs_tol=ABS_TOL):
    """Whether stdout ``actual`` answers a test whose expected stdout is ``expected`` (whitespace only separates tokens)."""
    got, want = actual.split(), expected.split()
    return _len(got) == _len(want) and all(tokens_match(a, b, rel_tol, abs_tol) for a, b in zip(got, want))
