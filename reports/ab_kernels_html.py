"""Self-contained HTML page of a kernel A/B comparison (ab.json of schema
gguf-harness/ab-kernels/1, `harness ab KERNELS_A.json KERNELS_B.json --out DIR`): the sides,
a bar chart of the time change per shape and mode over the ±tolerance band, the tables.
Jinja2 autoescaping for every value (names and paths come from the compared files)."""
from __future__ import annotations

from pathlib import Path

from harness.ab_kernels_cmd import CHECK_HEAD, PERF_HEAD, check_cells, perf_cells, summary_line
from harness.results import write_atomic

from .ab_html import COLORS
from .html import _env
from .plots import data_uri

TEMPLATE = "ab_kernels.html.j2"


def change_chart(perf: list[dict]) -> bytes | None:
    """PNG: one bar per (shape, mode) with a delta: the change of the kernel time in % (negative
    = faster), over a grey band of ±tolerance. None when no row has a delta."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    rows = [p for p in perf if p.get("delta") is not None]
    if not rows:
        return None
    fig = Figure(figsize=(8.0, 0.5 + 0.3 * len(rows)), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for y, p in enumerate(rows):
        tol = p.get("tolerance") or 0.0
        ax.barh(y, 200 * tol, left=-100 * tol, height=0.8, color="#e0e0e0", zorder=1)
        ax.barh(y, 100 * p["delta"], height=0.5, color=COLORS.get(p["verdict"], "#9e9e9e"), zorder=2)
    ax.axvline(0, color="#333", linewidth=0.8, zorder=3)
    labels = [f"{p['label']} {p['mode']}".replace("$", r"\$") for p in rows]
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("B vs A: kernel time change [%] (negative = faster; grey: ±max(threshold, noise))",
                  fontsize=9)
    ax.grid(True, axis="x", alpha=0.3)
    import io
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return buf.getvalue()


def render_ab_kernels(doc: dict, path: Path) -> None:
    """Write the page for `doc` atomically to path."""
    png = change_chart(doc["perf"])
    html = _env().get_template(TEMPLATE).render(
        doc=doc, overall="FAIL" if doc["exit_code"] else "PASS",
        chart=data_uri(png) if png else None, perf_head=PERF_HEAD, check_head=CHECK_HEAD,
        perf=[(p, perf_cells(p)) for p in doc["perf"]],
        checks=[(c, check_cells(c)) for c in doc["checks"]], summary=summary_line(doc))
    write_atomic(Path(path), html.encode())
