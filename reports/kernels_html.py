"""Self-contained HTML page of a `harness bench kernels` result (schema gguf-harness/kernels/1):
the device and settings, a row per shape (status, oracle check, per mode median / p20-p80 us,
GB/s, % of copy bandwidth, % of roofline) and a bandwidth bar chart per mode with the
roofline. Jinja2 autoescaping is on (shape names may come from the command line, GPU names
from the driver); plots are data URIs."""
from __future__ import annotations

import json
from pathlib import Path

from harness.jsonio import json_stem
from harness.results import read_json, write_atomic

from . import kernel_plots
from .html import _env
from .plots import data_uri

TEMPLATE = "kernels.html.j2"
MODE_TITLES = {"cold_b2b": "cold, back to back (headline): R copies in one CUDA graph",
               "cold_single": "cold, single launch after an L2 flush",
               "hot": "hot: the same weights again, back to back"}


_ROW_KEYS = ("name", "source", "label", "status", "reason", "copies")
_FIG_KEYS = ("gb_s", "pct_copy", "pct_roofline")
_SUM_KEYS = ("us", "us_p20", "us_p80", "noise", "n", "stop")
_GGML_KEYS = ("status", "reason", "backend", "gb_s", "pct_copy", "engine_us", "engine_speedup")


def _d(v) -> dict:
    return v if isinstance(v, dict) else {}


def view_row(r: dict, modes: list[str]) -> dict:
    """A result row with every key the template reads (None where absent or malformed), so
    a partial or hand-edited JSON still renders."""
    out = {k: r.get(k) for k in _ROW_KEYS}
    chk = _d(r.get("check"))
    out["check"] = {k: chk.get(k) for k in ("ok", "max_err_over_bound", "rows_checked",
                                            "rows_total", "subset")} if chk else None
    out["modes"] = {}
    for m in modes:
        f = _d(_d(r.get("modes")).get(m))
        if f:
            out["modes"][m] = dict({k: f.get(k) for k in _FIG_KEYS},
                                   kernel={k: _d(f.get("kernel")).get(k) for k in _SUM_KEYS},
                                   roofline={k: _d(f.get("roofline")).get(k) for k in _SUM_KEYS})
    g = _d(r.get("ggml"))
    out["ggml"] = dict({k: g.get(k) for k in _GGML_KEYS},
                       kernel={k: _d(g.get("kernel")).get(k) for k in _SUM_KEYS},
                       check={k: _d(g.get("check")).get(k) for k in ("ok", "max_err_over_bound",
                                                                    "ratio_vs_rounded_x")}) if g else None
    return out


def render_kernels_html(result: dict) -> str:
    """result: {"created", "machine", "schema", "settings", "device", "rows"} as written by
    `harness bench kernels` (or read back from its JSON)."""
    settings, device = _d(result.get("settings")), _d(result.get("device"))
    modes = [m for m in settings.get("modes") or [] if isinstance(m, str)]
    copy_gbs = _d(device.get("copy")).get("gb_s")
    rows = [r for r in result.get("rows") or [] if isinstance(r, dict)]
    plots = []
    for m in modes:
        title = f"{MODE_TITLES.get(m, m)}: GB/s per shape"
        png = kernel_plots.bandwidth_chart(rows, m, copy_gbs, f"{m}: GB/s per shape")
        plots.append({"mode": m, "title": title, "uri": data_uri(png) if png else None})
    machine = _d(result.get("machine"))
    gpu = _d(machine.get("gpu"))
    return _env().get_template(TEMPLATE).render(
        rows=[view_row(r, modes) for r in rows], modes=modes, copy_gbs=copy_gbs,
        l2_bytes=device.get("l2_bytes"), sm_count=device.get("sm_count"),
        flush_bytes=device.get("flush_bytes"), gemv_impl=settings.get("gemv_impl"),
        pdl=settings.get("pdl"), hot_reps=settings.get("hot_reps"),
        gpu={k: gpu.get(k) for k in ("name", "driver", "cuda_runtime")},
        created=result.get("created", ""), plots=plots,
        settings_text=json.dumps(settings, indent=1, sort_keys=True, default=str),
        machine_text=json.dumps(machine, indent=1, sort_keys=True, default=str))


def render_kernels_report(result: dict, out_path: Path) -> Path:
    """Write the page atomically to out_path; returns out_path."""
    write_atomic(Path(out_path), render_kernels_html(result).encode("utf-8"))
    return Path(out_path)


def render_kernels_report_from_json(path: Path) -> Path:
    """<name>.html beside <name>.json or <name>.json.gz (kernels.html beside kernels.json);
    ValueError, naming the file, if it is a truncated or damaged gzip file, not JSON or not a
    gguf-harness result; OSError if it cannot be read."""
    path = Path(path)
    return render_kernels_report(read_json(path), path.with_name(f"{json_stem(path)}.html"))
