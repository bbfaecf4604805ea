"""Stacked bar plot of a decode step's per-layer node times (`harness bench nodes`), PNG bytes
from matplotlib's object API on an Agg canvas (no pyplot state), like reports/plots.py."""
from __future__ import annotations

import io

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def stacked_layers(layers: list[int], ops: list[str], us: list[list[float]], title: str) -> bytes | None:
    """One bar per layer, one stacked segment per op (us[layer][op], microseconds).
    Returns None when there is nothing to draw."""
    m = np.asarray(us, dtype=np.float64).reshape(len(layers), len(ops)) if layers and ops else None
    if m is None or not np.isfinite(m).any():
        return None
    fig = Figure(figsize=(8.0, 3.2), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    bottom = np.zeros(len(layers))
    for j, op in enumerate(ops):
        col = np.nan_to_num(m[:, j])
        ax.bar(layers, col, bottom=bottom, label=op, width=0.8)
        bottom += col
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("layer", fontsize=9)
    ax.set_ylabel("µs", fontsize=9)
    ax.tick_params(labelsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper right", ncol=min(len(ops), 5))
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    return buf.getvalue()
