"""The harness's wire formats (standard library only).

* grader → driver: the job, then the tests, each an 8-byte length and ``marshal`` data (:func:`read_message`);
* driver → candidate: requests, a 4-byte length and ``marshal`` data (trusted data the candidate parses:
  :func:`read_frame_blocking`; a fresh candidate's job is ``marshal`` data on its fd 0, :func:`_read_all`);
* candidate → driver: answers, a 4-byte length and JSON with tags for tuples, sets, dicts, bytes and complex numbers
  (:func:`to_json`), read only up to a size bound and decoded by the C JSON scanner, integers by length-bounded
  ``int``, hashes of set elements and dict keys counted (:func:`from_json`);
* driver → grader: one JSON line per event (:func:`event_json`).
"""

import marshal
import math
import os

MAX_INT_DIGITS = 100_000
"""Longest integer the driver decodes from a candidate's answer (``int`` of text is quadratic)."""
INT_DIGITS_COST = 4 * MAX_INT_DIGITS ** 2
"""Budget of one answer's long integers, in squared digits (their decoding cost): four of the longest
(about a quarter of a second), or many shorter ones; integers up to ``SHORT_INT_DIGITS`` are free."""
SHORT_INT_DIGITS = 4300
MAX_HASH_COLLISIONS = 1000
"""Set elements and dict keys of one answer that may share a hash with another of the same set or dict: equal
hashes make building a set quadratic (``k * (2**61 - 1)`` all hash to 0: 20,000 such integers take 1.6 s, 8 MB
of them minutes of the driver's CPU, in C that no alarm interrupts). Honest answers have a handful."""

_type, _len = type, len


_JSON_ESCAPES = {i: "\\u%04x" % i for i in range(32)}
_JSON_ESCAPES.update({ord("\\"): "\\\\", ord('"'): '\\"', 0x2028: "\\u2028", 0x2029: "\\u2029"})


def _json_str(value):
    return '"' + value.translate(_JSON_ESCAPES) + '"'


def to_json(value, depth=0):
    """JSON text of plain data, tagged where JSON has no such type: ``{"t": [..]}`` tuple, ``{"s": [..]}`` set,
    ``{"d": [[k, v], ..]}`` dict, ``{"b": "hex"}`` bytes, ``{"c": [re, im]}`` complex. Anything else: TypeError."""
    kind = _type(value)
    if depth > 100:
        raise TypeError("nested too deeply")
    if kind is str:
        return _json_str(value)
    if value is None or kind is bool:
        return "null" if value is None else ("true" if value else "false")
    if kind is int:
        return str(value)
    if kind is float:
        if value != value:
            return "NaN"
        if value in (math.inf, -math.inf):
            return "Infinity" if value > 0 else "-Infinity"
        return repr(value)
    if kind is list:
        return "[" + ",".join([to_json(item, depth + 1) for item in value]) + "]"
    if kind is tuple:
        return '{"t":[' + ",".join([to_json(item, depth + 1) for item in value]) + "]}"
    if kind is set or kind is frozenset:
        return '{"s":[' + ",".join([to_json(item, depth + 1) for item in value]) + "]}"
    if kind is dict:
        return '{"d":[' + ",".join(["[" + to_json(k, depth + 1) + "," + to_json(v, depth + 1) + "]" for k, v in value.items()]) + "]}"
    if kind is bytes:
        return '{"b":"' + value.hex() + '"}'
    if kind is complex:
        return '{"c":[' + to_json(value.real) + "," + to_json(value.imag) + "]}"
    raise TypeError("not plain data: %s" % kind.__name__)


def _tagged(pairs):
    """``object_pairs_hook``: the one tagged pair of a ``to_json`` object, else ValueError."""
    if _len(pairs) != 1:
        raise ValueError("not a tagged value")
    tag, body = pairs[0]
    if tag == "t" and _type(body) is list:
        return tuple(body)
    if tag == "s" and _type(body) is list:
        _count_collisions(body)
        return frozenset(body)
    if tag == "d" and _type(body) is list:
        if not all(_type(item) is list and _len(item) == 2 for item in body):
            raise ValueError("bad dict")
        _count_collisions([k for k, _ in body])
        return {k: v for k, v in body}
    if tag == "b" and _type(body) is str:
        return bytes.fromhex(body)
    if tag == "c" and _type(body) is list and _len(body) == 2 and all(_type(x) in (int, float) for x in body):
        return complex(body[0], body[1])
    raise ValueError("unknown tag")


_int_cost = [0]
"""Squared digits of long integers decoded so far in the current answer (``from_json`` resets it)."""


_collisions = [0]
"""Set elements and dict keys of the current answer whose hash another one already had (``from_json`` resets it)."""


def _count_collisions(items):
    """Count repeated hashes before a set or dict is built from ``items`` (hashing is linear; ValueError past the budget)."""
    if _len(items) > 1:
        _collisions[0] += _len(items) - _len({hash(item) for item in items})
        if _collisions[0] > MAX_HASH_COLLISIONS:
            raise ValueError("set elements or dict keys with colliding hashes")


def _bounded_int(text):
    n = _len(text)
    if n > MAX_INT_DIGITS:
        raise ValueError("integer too long")
    if n > SHORT_INT_DIGITS:
        _int_cost[0] += n * n
        if _int_cost[0] > INT_DIGITS_COST:
            raise ValueError("too many long integers")
    return int(text)


class _ScanContext:
    strict, object_hook, object_pairs_hook, memo = True, None, staticmethod(_tagged), {}
    parse_float, parse_int = float, staticmethod(_bounded_int)
    parse_constant = staticmethod({"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}.__getitem__)


_scanner = None


def from_json(data):
    """Decode a candidate's answer (bytes) with the C scanner; ValueError for anything malformed."""
    global _scanner
    if _scanner is None:
        import _json

        _scanner = _json.make_scanner(_ScanContext())
    _int_cost[0] = _collisions[0] = 0
    try:
        text = data.decode("utf-8")
        value, end = _scanner(text, 0)
    except (StopIteration, UnicodeDecodeError, RecursionError, TypeError, OverflowError) as e:
        raise ValueError("malformed answer") from e
    finally:
        _ScanContext.memo.clear()
    if end != _len(text):
        raise ValueError("trailing data")
    return value


def send_frame(fd, data):
    data = _len(data).to_bytes(4, "big") + data
    while data:
        data = data[os.write(fd, data):]


def read_frame_blocking(fd):
    """One frame from a trusted peer (the candidate reading requests); ``None`` at end of file."""
    header = _read_exactly(fd, 4)
    return None if header is None else _read_exactly(fd, int.from_bytes(header, "big"))


def _read_exactly(fd, n):
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= _len(chunk)
    return b"".join(chunks)


def event_json(value):
    """Plain JSON of the driver's own events (str-keyed objects of scalars)."""
    if _type(value) is dict:
        return "{" + ",".join(_json_str(str(k)) + ":" + event_json(v) for k, v in value.items()) + "}"
    return to_json(value)


def read_message(fd):
    header = _read_exactly(fd, 8)
    return marshal.loads(_read_exactly(fd, int.from_bytes(header, "big")))


def _read_all(fd):
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
