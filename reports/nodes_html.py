"""Self-contained HTML page of a `harness bench nodes` result (schema gguf-harness/nodes/1):
tables by kind, by op and the slowest nodes, and a per-layer stacked bar plot per timing
method. Jinja2 autoescaping is on (model names are untrusted), plots are data URIs."""
from __future__ import annotations

import json
from pathlib import Path

from harness.bench_nodes import layer_matrix
from harness.results import write_atomic

from . import node_plots
from .html import _env
from .plots import data_uri

TEMPLATE = "nodes.html.j2"


def render_nodes_html(result: dict) -> str:
    """result: {"created", "machine", "model": {name, sha256, ...}, "nodes": run_nodes output}."""
    res = result["nodes"]
    plots = {}
    for name, m in res["methods"].items():
        png = node_plots.stacked_layers(*layer_matrix(m["nodes"]), f"per-layer node time ({name})")
        plots[name] = data_uri(png) if png else None
    from harness.gpu_state import describe
    gpu = res.get("gpu_state") if isinstance(res.get("gpu_state"), dict) else None
    return _env().get_template(TEMPLATE).render(
        model=result["model"], res=res, created=result.get("created", ""), plots=plots,
        gpu_line=(describe(gpu) + _step_energy(res)) if gpu else None,  # clocks / slowdowns / energy while timed
        chain_line=chain_line(res.get("chain_roofline")),
        machine_text=json.dumps(result.get("machine", {}), indent=1, sort_keys=True))


def _step_energy(res: dict) -> str:
    """"; step <J> J at <W> W (energy counter)" from the result's step_j / step_power_w
    (harness/bench_nodes.py, from session 22), or "" when absent, malformed or not positive."""
    from harness.jsonread import finite_pos
    j, w = finite_pos(res.get("step_j")), finite_pos(res.get("step_power_w"))
    return f"; step {j:.3f} J at {w:.0f} W (energy counter)" if j and w else ""


def chain_line(chain) -> str | None:
    """One line of the step's chain roofline (harness/step_roofline.py) from a result's
    "chain_roofline": "dependent 4321.0 µs (step 1.43x) · ..." per mode with a positive finite
    time, "not run: <why>" when it was skipped, None when absent or malformed (hostile JSON)."""
    from harness.jsonread import finite_pos
    from harness.step_roofline import _us_text
    if not isinstance(chain, dict):
        return None
    if isinstance(chain.get("why"), str) and chain["why"].strip():
        return f"not run: {chain['why'][:300]}"
    modes = chain.get("modes") if isinstance(chain.get("modes"), dict) else {}
    over = chain.get("step_over") if isinstance(chain.get("step_over"), dict) else {}
    parts = []
    for name, v in modes.items():
        us = finite_pos(v.get("us")) if isinstance(v, dict) else None
        if us is None:
            continue
        x = finite_pos(over.get(name))
        parts.append(f"{str(name)[:40]} {_us_text(us)} µs" + (f" (step {x:.3g}x)" if x else ""))
    return " · ".join(parts) or None


def render_nodes_report(result: dict, out_path: Path) -> Path:
    """Write the page atomically to out_path; returns out_path."""
    write_atomic(Path(out_path), render_nodes_html(result).encode("utf-8"))
    return Path(out_path)
