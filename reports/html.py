"""Self-contained HTML report of one verification result (schema gguf-harness/run/1).

One file, no external CSS, JavaScript or images: styles are inline and plots are base64
PNG data URIs, so the report can be mailed or archived as is. Jinja2 autoescaping is on for
every value: model names, metadata, chat templates and token texts are untrusted.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import jinja2

from harness.benchtable import report_table
from harness.jsonio import json_stem, plain_name
from harness.results import read_run_result, write_atomic

from . import plots
from .fmt import FILTERS
from .view import build_context, plot_series

TEMPLATE = "report.html.j2"
PLOTS = (  # (step key, title, y label)
    ("kl", "KL(reference ‖ backend) per step", "KL [nats]"),
    ("max_abs", "max |logit − reference logit| per step", "max-abs"),
    ("nmse", "NMSE of the logits per step", "NMSE"),
)


@lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
        autoescape=True,  # on for every template, whatever its file extension
        undefined=jinja2.StrictUndefined,  # a typo in the template fails loudly in tests
        trim_blocks=True, lstrip_blocks=True)
    env.filters.update(FILTERS)
    return env


def _plots(result: dict) -> list[dict]:
    """[{title, uri | None, note}] for KL, max-abs and NMSE per step (log y axis)."""
    series = plot_series(result)
    out = []
    for key, title, ylabel in PLOTS:
        png = plots.step_plot(series, key, title, ylabel) if series else None
        out.append({"title": title, "uri": plots.data_uri(png) if png else None,
                    "note": None if png else "no values to plot (no completed compared run)"})
    return out


def render_html(result: dict) -> str:
    """The report as an HTML string. result: a dict as written by harness.run.verify_model
    (optionally round-tripped through JSON, with "inf"/"nan" strings for non-finite floats)."""
    ctx = build_context(result)
    ctx["plots"] = _plots(result)
    ctx["bench_table"] = report_table(result)  # llama-bench style pp/tg rows, or None
    ctx["gpu_states"] = gpu_states(result)
    return _env().get_template(TEMPLATE).render(**ctx)


def gpu_states(result: dict) -> list[dict]:
    """[{"label": "<backend> c=<n_ctx>", "text": harness.gpu_state.describe(...)}] of the bench
    rows that recorded a GPU state (results from before session 21 have none: []), the text
    followed by the decode's energy per token and power where the row has them (bench_e2e
    decode_energy; from session 22)."""
    from harness.gpu_state import describe
    from harness.jsonread import as_dict, as_list, finite_pos

    def energy(r):  # positive finite figures only (a hand-edited or hostile result may hold anything)
        j, w = finite_pos(r.get("decode_j_per_token")), finite_pos(r.get("decode_power_w"))
        return f"; decode {j:.2f} J/token at {w:.0f} W (energy counter)" if j and w else ""
    return [{"label": f"{r.get('backend')} c={r.get('n_ctx')}", "text": describe(r["gpu_state"]) + energy(r)}
            for r in as_list(as_dict(result.get("bench")).get("rows"))
            if isinstance(r, dict) and isinstance(r.get("gpu_state"), dict)]


def render_report(result: dict, out_path: Path) -> Path:
    """Render `result` to `out_path` (written atomically, UTF-8); returns out_path."""
    out_path = Path(out_path)
    write_atomic(out_path, render_html(result).encode("utf-8"))
    return out_path


def render_report_from_json(json_path: Path) -> Path:
    """Render the run result JSON at json_path (.json or gzipped .json.gz) into the same folder:
    report.html for a run folder's result.json(.gz), <name>.report.html for any other file
    <name>.json(.gz) (results kept side by side, as under docs/results/, do not overwrite each
    other's reports).

    Raises ValueError, naming the file, if it is a truncated or damaged gzip file, not JSON, or
    not a gguf-harness run result (harness.results.read_run_result; a kernels, nodes, layerdiff
    or ab result has its own schema and is refused by name); OSError if it cannot be read."""
    json_path = Path(json_path)
    result = read_run_result(json_path, "harness report")
    name = ("report.html" if plain_name(json_path) == "result.json"
            else f"{json_stem(json_path)}.report.html")
    return render_report(result, json_path.parent / name)
