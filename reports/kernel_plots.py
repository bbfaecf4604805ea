"""Bandwidth bar chart of a `harness bench kernels` result, one per timing mode: a bar per
timed shape (GB/s), grouped and coloured by GGML format, the stream-read roofline of the same
bytes as a black tick on each bar, the device copy bandwidth as a dashed line. PNG bytes from
matplotlib's object API on an Agg canvas (no pyplot state), like reports/plots.py."""
from __future__ import annotations

import io
import math

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .fmt import to_float


def _plain(s) -> str:
    """Text drawn as is: '$' would start matplotlib mathtext (and can make drawing raise)."""
    return str(s).replace("$", r"\$")


def _cut(s: str, n: int = 24) -> str:
    return s if len(s) <= n else s[:n - 1] + "…"


def bars(rows: list[dict], mode: str) -> list[dict]:
    """[{name, fmt, gb_s, roof_gb_s}] of the rows timed in `mode` with a positive finite
    GB/s, sorted by format then table order. Values come from JSON (numbers, "nan", None)."""
    out = []
    for i, r in enumerate(rows):
        f = (r.get("modes") or {}).get(mode) if isinstance(r, dict) else None
        g = to_float(f.get("gb_s")) if isinstance(f, dict) else None
        if g is None or not (math.isfinite(g) and g > 0):
            continue
        rg = to_float(f.get("roof_gb_s"))
        out.append({"i": i, "name": str(r.get("name", "")), "fmt": str(r.get("fmt", "")),
                    "gb_s": g, "roof_gb_s": rg if rg is not None and math.isfinite(rg) else None})
    fmt_order = {f: n for n, f in enumerate(dict.fromkeys(b["fmt"] for b in out))}
    return sorted(out, key=lambda b: (fmt_order[b["fmt"]], b["i"]))


def bandwidth_chart(rows: list[dict], mode: str, copy_gb_s, title: str) -> bytes | None:
    """PNG of the mode's bars (see module docstring); None when no row was timed in it."""
    data = bars(rows, mode)
    if not data:
        return None
    fig = Figure(figsize=(max(6.0, 0.7 * len(data) + 2), 3.6), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    colours: dict[str, str] = {}
    labelled: set[str] = set()  # one legend entry per format and for the roofline

    def once(key: str, text: str) -> str | None:
        if key in labelled:
            return None
        labelled.add(key)
        return text
    for x, b in enumerate(data):
        c = colours.setdefault(b["fmt"], f"C{len(colours) % 10}")
        ax.bar(x, b["gb_s"], color=c, width=0.7, label=once("f:" + b["fmt"], _plain(b["fmt"])))
        if b["roof_gb_s"] is not None:
            ax.plot([x - 0.4, x + 0.4], [b["roof_gb_s"]] * 2, color="black", lw=2,
                    label=once("roof", "stream-read roofline (same bytes)"))
    cb = to_float(copy_gb_s)
    if cb is not None and cb > 0:
        ax.axhline(cb, color="grey", ls="--", lw=1, label=f"copy bandwidth {cb:.0f} GB/s")
    ax.set_xticks(range(len(data)), [_plain(_cut(b["name"])) for b in data], rotation=30,
                  ha="right", fontsize=8)
    ax.set_ylabel("GB/s", fontsize=9)
    ax.set_title(_plain(title), fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    return buf.getvalue()
