"""Self-contained HTML page of a `harness bench nodes` result (schema gguf-harness/nodes/1):
tables by kind, by op and the slowest nodes, and a per-layer stacked bar plot per timing
method. Jinja2 autoescaping is on (model names are untrusted), plots are data URIs."""
from __future__ import annotations

import json
from pathlib import Path

from harness.bench_nodes import diag_build, layer_matrix
from harness.results import write_atomic

from . import node_plots
from .html import _env
from .plots import data_uri

TEMPLATE = "nodes.html.j2"


MAX_ROWS = 20_000  # node rows a method may have (the 27B step has 388): a bound for hostile files


def clean_nodes_result(result) -> dict:
    """The parts of a nodes result (schema gguf-harness/nodes/1) the page shows, checked and
    rebuilt, so a file read back (`harness report NODES.json`; untrusted, maybe hand-edited)
    renders or fails with a clear error: each method's node rows (name, kind, fmt as text;
    us a finite time >= 0; bytes a whole number >= 0) re-aggregated with
    harness.bench_nodes.aggregate, the step time, and model / engine / n_ctx / n_prompt /
    created as text or numbers ("?" where missing). Other keys (gpu_state, chain_roofline,
    step_j) pass through: their lines check their own values. Raises ValueError naming the
    first bad field."""
    from harness.bench_nodes import aggregate
    from harness.jsonread import finite, finite_pos, whole
    if not isinstance(result, dict) or not isinstance(result.get("nodes"), dict):
        raise ValueError("not a nodes result: no 'nodes' section")
    res = dict(result["nodes"])
    step = finite_pos(res.get("step_us"))
    if step is None:
        raise ValueError(f"nodes.step_us {res.get('step_us')!r} is not a positive time")
    methods = res.get("methods")
    if not isinstance(methods, dict) or not methods:
        raise ValueError("nodes.methods: no timing method")
    clean = {}
    for name, m in methods.items():
        rows = m.get("nodes") if isinstance(m, dict) else None
        if not isinstance(rows, list) or not rows or len(rows) > MAX_ROWS:
            raise ValueError(f"nodes.methods.{str(name)[:40]}: expected 1..{MAX_ROWS} node rows")
        out = []
        for i, r in enumerate(rows):
            us = r.get("us") if isinstance(r, dict) else None
            b = r.get("bytes") if isinstance(r, dict) else None
            if finite(us) is None or us < 0:
                raise ValueError(f"nodes.methods.{str(name)[:40]} row {i}: us {us!r} is not a finite time >= 0")
            if whole(b) is None:
                raise ValueError(f"nodes.methods.{str(name)[:40]} row {i}: bytes {b!r} is not a whole number >= 0")
            out.append({"name": str(r.get("name", "?"))[:200], "kind": str(r.get("kind", "?"))[:40],
                        "fmt": str(r.get("fmt", ""))[:80], "us": finite(us), "bytes": b})
        clean[str(name)[:40]] = aggregate(out, step)
    engine = res.get("engine") if isinstance(res.get("engine"), dict) else {}
    first = next(iter(clean.values()))["nodes"]
    nps, bps = engine.get("nodes_per_step"), engine.get("bytes_per_step")
    res.update(step_us=step, methods=clean,
               engine=dict(engine, nodes_per_step=nps if whole(nps) is not None else len(first),
                           bytes_per_step=bps if whole(bps) is not None else sum(r["bytes"] for r in first)))
    for k in ("n_ctx", "n_prompt"):
        if whole(res.get(k)) is None:
            res[k] = "?"
    model = result.get("model") if isinstance(result.get("model"), dict) else {}
    return {"created": str(result.get("created", ""))[:64], "machine": result.get("machine", {}),
            "model": {"name": str(model.get("name", "?"))[:200], "sha256": str(model.get("sha256", "?"))[:64]},
            "nodes": res}


def render_nodes_html(result: dict) -> str:
    """result: {"created", "machine", "model": {name, sha256, ...}, "nodes": run_nodes output},
    checked first (clean_nodes_result: ValueError on a field the page cannot show)."""
    result = clean_nodes_result(result)
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
        unslowed_line=unslowed_line(res),
        chain_line=chain_line(res.get("chain_roofline")),
        diag=diag_build(result),
        machine_text=json.dumps(result.get("machine", {}), indent=1, sort_keys=True))


def unslowed_line(res: dict) -> str | None:
    """"<k> of the step's <n> replay windows ran slowed (power / thermal limit; <r> of the n taken
    after a cool-down); the <m> unslowed: median <us> µs/token" (harness/bench_nodes.py windows,
    which also reads older files' raw readings), or None when no window was slowed."""
    import statistics

    from harness.bench_nodes import clean_samples, slowed_windows, windows
    from harness.jsonread import as_list
    k = slowed_windows(res)
    if not k:
        return None
    ws, clean = windows(res), clean_samples(res)
    retaken = len(as_list(res.get("step_retakes"))) if "step_samples_slowdown" in res else 0
    tail = (f"the {len(clean)} unslowed: median {statistics.median(clean):.1f} µs/token" if clean
            else "none ran unslowed")
    again = f"; {retaken} of the {len(ws)} taken after a cool-down" if retaken else ""
    return f"{k} of the step's {len(ws)} replay windows ran slowed (power / thermal limit{again}); {tail}"


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
    """Write the page atomically to out_path; returns out_path. ValueError as render_nodes_html."""
    write_atomic(Path(out_path), render_nodes_html(result).encode("utf-8"))
    return Path(out_path)


def render_nodes_report_from_json(json_path: Path) -> Path:
    """`harness report NODES.json`: render a stored nodes result (.json or gzipped .json.gz)
    beside it, nodes.html for a run folder's nodes.json(.gz), <name>.nodes.html for any other
    <name>.json(.gz) (as docs/results/sweeps/ keeps them side by side). ValueError, naming the
    file, if it is a truncated or damaged gzip file, not JSON, not a nodes result, or a field
    cannot be shown; OSError if it cannot be read."""
    from harness.ab_nodes import NODES_SCHEMA
    from harness.jsonio import json_stem, plain_name
    from harness.results import read_json
    json_path = Path(json_path)
    result = read_json(json_path)
    if result.get("schema") != NODES_SCHEMA:
        raise ValueError(f"{json_path} is not a {NODES_SCHEMA} result")
    name = ("nodes.html" if plain_name(json_path) == "nodes.json"
            else f"{json_stem(json_path)}.nodes.html")
    return render_nodes_report(result, json_path.parent / name)
