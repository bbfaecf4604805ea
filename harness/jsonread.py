"""Reading result JSON defensively: a result may be old, partial or hostile, so a field of
the wrong type is treated as absent instead of raising (reports must still render, A/B and
tables must still say what they can)."""
from __future__ import annotations

import math
import sys


def as_dict(x) -> dict:
    """x when it is a dict, else {}."""
    return x if isinstance(x, dict) else {}


def key_part(x):
    """x when it can be part of a dict key (a scalar), else its JSON text: a hand-edited n_ctx
    that is a list or an object still names a row instead of raising TypeError."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    import json
    try:
        return json.dumps(x, sort_keys=True)[:80]
    except (TypeError, ValueError, RecursionError):
        return repr(type(x))


def as_list(x) -> list:
    """x when it is a list, else []."""
    return x if isinstance(x, list) else []


def json_int(digits: str):
    """json.loads' parse_int: the int, or a signed infinity for one beyond a float's range. Why:
    such an int is valid JSON, and every reader's float() of it would raise OverflowError; as an
    infinity the readers' finiteness checks drop it like any other non-finite value. Digit
    strings too long for int() (Python's 4300-digit limit) are infinities too."""
    neg = digits.startswith("-")
    if len(digits) - neg > 400:
        return -math.inf if neg else math.inf
    n = int(digits)
    if abs(n) > sys.float_info.max:
        return -math.inf if neg else math.inf
    return n


def finite(x) -> float | None:
    """x as float when it is an int or float (not a bool) and finite, else None (an int beyond
    a float's range too, rather than an OverflowError)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    try:
        f = float(x)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def finite_pos(x) -> float | None:
    """finite(x) when it is > 0, else None."""
    f = finite(x)
    return f if f is not None and f > 0 else None


def whole(x) -> int | None:
    """x when it is an int >= 0 (not a bool: JSON's true is no count), else None."""
    return x if isinstance(x, int) and not isinstance(x, bool) and x >= 0 else None
