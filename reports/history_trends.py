"""Trend series over commits and their plots (matplotlib Agg -> PNG bytes).

A series is {label: {commit index: value}}; x is the commit's position in time order
(reports.history_runs.group_commits), so one commit gives a single marker. Several runs
of one commit for the same series are combined: throughput by the median (repeat runs
scatter), errors by the max (the worst case is what a regression shows).
Series keys carry the device (GPU name or CPU): figures from different machines are
never joined into one line.
"""
from __future__ import annotations

import io
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .fmt import no_math
from .history_runs import Commit, RunRecord

Series = dict[str, dict[int, float]]
_MARKERS = "osD^v<>"


def _model_labels(commits: Sequence[Commit]) -> dict[str, str]:
    """model_id -> the names it was run under ("q05 / qwen2.5-coder-0.5b-q4_k_m"): one file
    recorded under two names stays one series."""
    names: dict[str, set[str]] = defaultdict(set)
    for c in commits:
        for r in c.runs:
            names[r.model_id].add(r.model)
    return {k: " / ".join(sorted(v)) for k, v in names.items()}


def _collect(commits: Sequence[Commit],
             points: Callable[[RunRecord, dict[str, str]], Iterable[tuple[str, float | None]]],
             combine: Callable[[list[float]], float]) -> Series:
    """Apply `points(run, model_labels)` -> [(label, value)] to every run; finite values
    of one label within one commit are combined by `combine`."""
    models = _model_labels(commits)
    raw: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for i, c in enumerate(commits):
        for r in c.runs:
            for label, v in points(r, models):
                if v is not None and math.isfinite(v):
                    raw[label][i].append(v)
    return {label: {i: combine(vs) for i, vs in sorted(per.items())}
            for label, per in sorted(raw.items())}


def _median(vs: list[float]) -> float:
    return float(np.median(vs))


def decode_series(commits: Sequence[Commit]) -> Series:
    """Bench decode tok/s per (model, backend, n_ctx, device); median of a commit's runs."""
    return _collect(commits, lambda r, m: (
        (f"{m[r.model_id]} · {b['backend']} c={b['n_ctx']} · {r.device}", b["decode_tok_s"])
        for b in r.bench), _median)


def error_series(commits: Sequence[Commit], key: str) -> Series:
    """Teacher-forced `key` (kl_mean, max_abs) per (model, backend, reference, device): the
    max over contexts and runs of a commit. Only completed runs count; the reference is in
    the label because errors against different references are different quantities."""
    return _collect(commits, lambda r, m: (
        (f"{m[r.model_id]} · {e['backend']} vs {r.reference} · {r.device}", e[key])
        for e in r.errors if e["status"] == "ok"), max)


def _kernel_label(r: RunRecord, k: dict) -> str:
    # engine switches (GGUF_HARNESS_GEMV_KQ=...) select other kernels: never one line
    return " · ".join(x for x in (k["shape"] or "?", r.device, r.variant) if x)


def kernel_series(commits: Sequence[Commit]) -> dict[str, Series]:
    """{format: series of GB/s per (shape, device, engine switches)}, median of a commit's
    runs. Kernel rows come from `harness bench kernels` runs (kernels.json: the cold_b2b
    figure, reports.history_runs.bench_kernel_rows) and from a `kernels` table inside a
    result; a row without GB/s (check failed, not timed) gives no point. Empty when no run
    has a kernel row with GB/s."""
    formats = sorted({k["format"] for c in commits for r in c.runs for k in r.kernels
                      if k["gb_s"] is not None})
    return {f: _collect(commits, lambda r, m, f=f: (
        (_kernel_label(r, k), k["gb_s"]) for k in r.kernels
        if k["format"] == f and k["gb_s"] is not None), _median) for f in formats}


def trend_plot(x_labels: Sequence[str], series: Series, title: str, ylabel: str,
               log: bool = False) -> bytes | None:
    """PNG of each series over the commits (x tick i = x_labels[i]); None if nothing to draw.

    log: log y axis; values <= 0 cannot be drawn there and are counted in the legend."""
    fig = Figure(figsize=(9.0, 3.4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if log:
        ax.set_yscale("log")
    drawn = 0
    for n, (label, pts) in enumerate(series.items()):
        x = np.array(list(pts), dtype=np.float64)
        y = np.array(list(pts.values()), dtype=np.float64)
        ok = y > 0 if log else np.isfinite(y)
        hidden = int((~ok).sum())
        if not ok.any():
            continue
        note = f" ({hidden} ≤ 0 not shown)" if hidden else ""
        # the colour cycle has 10 entries: the marker tells series 1 and 11 apart
        ax.plot(x[ok], y[ok], marker=_MARKERS[n // 10 % len(_MARKERS)], markersize=4,
                linewidth=1, label=no_math(label) + note)
        drawn += 1
    if not drawn:
        return None
    n = len(x_labels)
    step = max(1, math.ceil(n / 40))  # at most ~40 tick labels
    ticks = list(range(0, n, step))
    ax.set_xticks(ticks)
    ax.set_xticklabels([no_math(x_labels[i]) for i in ticks], rotation=30, ha="right",
                       fontsize=7)
    ax.set_xlim(-0.5, n - 0.5)  # one commit: a single marker in the middle
    ax.set_title(no_math(title), fontsize=10)
    ax.set_xlabel("commit (oldest run first)", fontsize=9)
    ax.set_ylabel(ylabel, fontsize=9)
    ax.grid(True, which="major", alpha=0.3)
    ax.tick_params(axis="y", labelsize=8)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    buf = io.BytesIO()
    # bbox_inches="tight" keeps the legend outside the axes in the image
    fig.savefig(buf, format="png", bbox_inches="tight", metadata={"Software": None})
    return buf.getvalue()
