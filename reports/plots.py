"""Per-step error plots (matplotlib, Agg canvas) returned as PNG bytes for embedding.

Uses matplotlib's object API with an explicit Agg canvas instead of pyplot, so no global
backend or figure state is touched (safe next to other code that uses pyplot).
Values come straight from result JSON: numbers, the strings "inf"/"-inf"/"nan"
(harness.results._clean) or None / a missing key.
"""
from __future__ import annotations

import base64
import io
import math
from typing import Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from matplotlib.transforms import blended_transform_factory

from .fmt import no_math, step_position, to_float

# y positions (axes fraction) of the markers for values a log axis cannot show
_TOP, _BOTTOM = 0.97, 0.03


def step_values(steps: Sequence[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(positions [n] int64, values [n] float64) of `key` over the steps; missing -> nan.

    A step's position is its "i" field when it is an integer, else its index in the list."""
    pos = np.array([step_position(s, n) for n, s in enumerate(steps)], dtype=np.int64)
    vals = [to_float(s.get(key)) if isinstance(s, dict) else None for s in steps]
    return pos, np.array([math.nan if v is None else v for v in vals], dtype=np.float64)


def _draw_series(ax, label: str, x: np.ndarray, y: np.ndarray) -> tuple[bool, bool]:
    """One line on a log axis; +inf marked at the top, <= 0 at the bottom.

    Returns (anything drawn, any positive finite value drawn)."""
    ok = np.isfinite(y) & (y > 0)
    inf = np.isposinf(y)
    low = np.isfinite(y) & (y <= 0)
    if not (ok.any() or inf.any() or low.any()):
        return False, False
    notes = [f"{int(inf.sum())} inf"] * bool(inf.any()) + [f"{int(low.sum())} ≤ 0"] * bool(low.any())
    full = no_math(label) + (f" ({', '.join(notes)})" if notes else "")
    yy = np.where(ok, y, np.nan)  # gaps where the value cannot be shown
    (line,) = ax.plot(x, yy, marker=".", markersize=3, linewidth=1, label=full)
    tr = blended_transform_factory(ax.transData, ax.transAxes)
    if inf.any():
        ax.plot(x[inf], np.full(inf.sum(), _TOP), "x", color=line.get_color(), transform=tr,
                clip_on=False)
    if low.any():
        ax.plot(x[low], np.full(low.sum(), _BOTTOM), "v", color=line.get_color(), transform=tr,
                clip_on=False)
    return True, bool(ok.any())


def step_plot(series: Sequence[tuple[str, Sequence[dict]]], key: str, title: str,
              ylabel: str) -> bytes | None:
    """PNG of `key` per generated position for each (label, steps); log y axis.

    Returns None when no series has any value for `key` (nothing to draw)."""
    fig = Figure(figsize=(8.0, 3.0), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_yscale("log")
    drawn = [_draw_series(ax, label, *step_values(steps, key)) for label, steps in series]
    if not any(d for d, _ in drawn):
        return None
    if not any(p for _, p in drawn):
        ax.set_ylim(1e-12, 1.0)  # only markers: give the log axis a sane range
    ax.set_title(no_math(title), fontsize=10)
    ax.set_xlabel("generated token position", fontsize=9)
    ax.set_ylabel(ylabel, fontsize=9)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # positions are token indices
    ax.grid(True, which="major", alpha=0.3)
    ax.tick_params(labelsize=8)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})  # no version: stable bytes
    return buf.getvalue()


def data_uri(png: bytes) -> str:
    """PNG bytes as a data: URI for an <img src=...> (keeps the report one file)."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")
