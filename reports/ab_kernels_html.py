"""Self-contained HTML page of a kernel A/B comparison (ab.json of schema
gguf-harness/ab-kernels/1, `harness ab KERNELS_A.json KERNELS_B.json --out DIR`) or of a
decode-step nodes one (gguf-harness/ab-nodes/1, two nodes.json): the sides, a bar chart of the
time change per row over the ±tolerance band, the tables.
Jinja2 autoescaping for every value (names and paths come from the compared files)."""
from __future__ import annotations

from pathlib import Path

from harness.ab_kernels_cmd import TITLES, check_cells, heads, perf_cells, summary_line
from harness.results import write_atomic

from .ab_html import delta_bars
from .html import _env
from .plots import data_uri

TEMPLATE = "ab_kernels.html.j2"


def change_chart(perf: list[dict]) -> bytes | None:
    """PNG (ab_html.delta_bars): the change of the kernel time per shape and mode in %
    (negative = faster) over its ±tolerance band; None when no row has a delta."""
    rows = [p for p in perf if p.get("delta") is not None]
    if not rows:
        return None
    return delta_bars(rows, [f"{p['label']} {p['mode']}" for p in rows],
                      "B vs A: time change [%] (negative = faster; grey: ±max(threshold, noise))")


def render_ab_kernels(doc: dict, path: Path) -> None:
    """Write the page for `doc` atomically to path."""
    png = change_chart(doc["perf"])
    perf_head, check_head = heads(doc)
    title, table_title = TITLES[doc.get("kind", "kernels")]
    html = _env().get_template(TEMPLATE).render(
        doc=doc, overall="FAIL" if doc["exit_code"] else "PASS", title=title,
        table_title=table_title[0].upper() + table_title[1:],
        chart=data_uri(png) if png else None, perf_head=perf_head, check_head=check_head,
        perf=[(p, perf_cells(p)) for p in doc["perf"]],
        checks=[(c, check_cells(c)) for c in doc["checks"]], summary=summary_line(doc))
    write_atomic(Path(path), html.encode())
