"""Self-contained HTML page of an A/B comparison (ab.json, schema gguf-harness/ab/1,
written by `harness ab --out`).

Same rules as the run report (reports/html.py): one file, inline CSS, the chart as a base64
PNG data URI, Jinja2 autoescaping for every value (model names, paths and notes come from
the compared files).
"""
from __future__ import annotations

import io
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from harness.ab_cmd import CHECK_HEAD, PERF_HEAD, check_cells, perf_cells, summary_line
from harness.results import write_atomic

from .fmt import no_math
from .html import _env
from .plots import data_uri

TEMPLATE = "ab.html.j2"
COLORS = {"FASTER": "#2e7d32", "SLOWER": "#c62828", "SAME": "#1565c0", "UNKNOWN": "#9e9e9e"}
METRIC_LABEL = {"decode_tok_s": "decode", "prefill_tok_s": "prefill"}


def _label(p: dict) -> str:
    return f"{p.get('backend')} {METRIC_LABEL.get(p.get('metric'), p.get('metric'))} c={p.get('n_ctx')}"


def delta_bars(rows: list[dict], labels: list[str], xlabel: str) -> bytes:
    """PNG: one horizontal bar per row, its relative change row["delta"] in %, over a shaded band
    of ±row["tolerance"] (max(threshold, noise): inside it the verdict is SAME), coloured by
    row["verdict"]; labels drawn as text (a "$" in a name is no mathtext). Shared by the run and
    the kernel A/B pages."""
    fig = Figure(figsize=(8.0, 0.5 + 0.35 * len(rows)), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for y, p in enumerate(rows):
        tol = p.get("tolerance")
        if tol is not None:
            ax.barh(y, 200 * tol, left=-100 * tol, height=0.8, color="#e0e0e0", zorder=1)
        ax.barh(y, 100 * p["delta"], height=0.5, color=COLORS.get(p.get("verdict"), "#9e9e9e"),
                zorder=2)
    ax.axvline(0, color="#333", linewidth=0.8, zorder=3)
    seen = dict.fromkeys(p.get("verdict") for p in rows)
    ax.legend(handles=[Patch(color=COLORS.get(v, "#9e9e9e"), label=str(v)) for v in seen],
              fontsize=7, loc="best")
    ax.set_yticks(range(len(rows)), [no_math(x) for x in labels], fontsize=8)
    ax.invert_yaxis()  # first row at the top, as in the table
    ax.set_xlabel(xlabel, fontsize=9)
    ax.grid(True, axis="x", alpha=0.3)
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})  # no version: stable bytes
    return buf.getvalue()


def change_chart(perf: list[dict]) -> bytes | None:
    """PNG: delta_bars of the performance rows with a delta (median tok/s change); None when
    no row has one."""
    rows = [p for p in perf if isinstance(p, dict) and p.get("delta") is not None]
    if not rows:
        return None
    return delta_bars(rows, [_label(p) for p in rows],
                      "B vs A: median tok/s change [%]   (grey: ±max(threshold, noise))")


def render_ab_html(doc: dict) -> str:
    """The page as an HTML string. doc: the ab.json document (harness.ab_cmd.build_doc)."""
    perf, checks = doc.get("perf") or [], doc.get("checks") or []
    png = change_chart(perf)
    failures = [c for c in checks if c.get("failure")]
    code = doc.get("exit_code", 1 if failures else 0)
    return _env().get_template(TEMPLATE).render(
        doc=doc, chart=data_uri(png) if png else None, failures=failures,
        overall="FAIL" if code else "PASS", summary=summary_line(doc),
        perf_head=PERF_HEAD, check_head=CHECK_HEAD,
        perf=[{"cells": perf_cells(p), "verdict": p.get("verdict")} for p in perf],
        checks=[{"cells": check_cells(c), "failure": c.get("failure"), "note": c.get("note"),
                 "full": (c.get("a"), c.get("b"))} for c in checks])


def render_ab(doc: dict, out_path: Path) -> Path:
    """Render `doc` to `out_path` (written atomically, UTF-8); returns out_path."""
    out_path = Path(out_path)
    write_atomic(out_path, render_ab_html(doc).encode("utf-8"))
    return out_path
