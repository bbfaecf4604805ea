"""Reading result JSON defensively: a result may be old, partial or hostile, so a field of
the wrong type is treated as absent instead of raising (reports must still render, A/B and
tables must still say what they can)."""
from __future__ import annotations


def as_dict(x) -> dict:
    """x when it is a dict, else {}."""
    return x if isinstance(x, dict) else {}


def as_list(x) -> list:
    """x when it is a list, else []."""
    return x if isinstance(x, list) else []
