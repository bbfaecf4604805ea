"""Value formatting for the HTML report (registered as Jinja filters).

Result JSON writes non-finite floats as the strings "inf", "-inf", "nan"
(harness.results._clean) and leaves absent figures as None; every formatter here accepts
those and never raises on odd input (a report of a broken run must still render).
"""
from __future__ import annotations

import json
import math
import unicodedata

DASH = "–"
_NONFINITE = {"inf": math.inf, "+inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def step_position(step, n: int) -> int:
    """A step's position: its "i" when that is an int64, else n (its index in the list);
    hand-edited files hold anything there (an object, text, a float beyond range)."""
    i = step.get("i", n) if isinstance(step, dict) else n
    return i if isinstance(i, int) and not isinstance(i, bool) and -2**63 <= i < 2**63 else n


def to_float(v) -> float | None:
    """A JSON number, or one of the non-finite strings, as float; None when absent or not numeric.

    Booleans count as numbers (top1_agree: True -> 1.0)."""
    if v is None:
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        s = v.strip().lower()
        if s in _NONFINITE:
            return _NONFINITE[s]
        try:
            return float(s)
        except ValueError:
            return None
    return None


def _special(x: float | None) -> str | None:
    if x is None:
        return DASH
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return None


def sci(v, digits: int = 3) -> str:
    """Scientific notation with `digits` significant digits: 1.23e-04; 0 -> "0"."""
    x = to_float(v)
    sp = _special(x)
    if sp is not None:
        return sp
    return "0" if x == 0 else f"{x:.{digits - 1}e}"


def num(v, digits: int = 4) -> str:
    """General number with `digits` significant digits."""
    x = to_float(v)
    sp = _special(x)
    return sp if sp is not None else f"{x:.{digits}g}"


def fixed(v, decimals: int = 1) -> str:
    """Fixed-point (tok/s, ms/token)."""
    x = to_float(v)
    sp = _special(x)
    return sp if sp is not None else f"{x:.{decimals}f}"


def pct(v, decimals: int = 1) -> str:
    """A fraction in [0, 1] as a percentage: 0.992 -> "99.2 %"."""
    x = to_float(v)
    sp = _special(x)
    return sp if sp is not None else f"{100 * x:.{decimals}f} %"


def nbytes(v) -> str:
    """Byte count in binary units: 491400032 -> "468.6 MiB"."""
    x = to_float(v)
    sp = _special(x)
    if sp is not None:
        return sp
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or unit == "TiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return DASH  # unreachable; keeps linters quiet


def short(h, n: int = 12) -> str:
    """First n characters of a hash; dash when absent."""
    return DASH if not h else str(h)[:n]


def visible(text, limit: int = 200, spaces: bool = True) -> str:
    """Untrusted text (token pieces, metadata) made visible: spaces as "␣" (when `spaces`),
    control and format characters (newline, tab, bidi overrides, zero-width) as escapes,
    cut at `limit` characters.

    Returns plain text; HTML escaping is left to Jinja's autoescape."""
    if text is None:
        return ""
    out = []
    for ch in str(text)[:limit]:
        if ch == " ":
            out.append("␣" if spaces else " ")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Co", "Zl", "Zp"):
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return "".join(out) + ("…" if len(str(text)) > limit else "")


def plain(v) -> str:
    """Any JSON value as one line of text (dicts and lists compactly as JSON)."""
    if v is None:
        return DASH
    if isinstance(v, float):
        return num(v)
    if isinstance(v, (dict, list, tuple)):
        return json.dumps(v, separators=(",", ":"), default=str)
    return str(v)


def no_math(text) -> str:
    """Text for a matplotlib label drawn as is: a '$' from a file (a model named after its
    file, a backend name in a result) would start mathtext, and a bad formula makes drawing
    raise."""
    return str(text).replace("$", r"\$")


FILTERS = {"sci": sci, "num": num, "fixed": fixed, "pct": pct, "nbytes": nbytes,
           "short": short, "visible": visible, "plain": plain}
