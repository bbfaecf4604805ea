"""`harness ab A.json B.json` when both files are `harness bench kernels` results (schema
gguf-harness/kernels/1) or both `harness bench nodes` results (gguf-harness/nodes/1): the
table, Markdown or JSON of harness.ab_kernels' / harness.ab_nodes' comparison, and with --out
ab.json + ab.html (reports/ab_kernels_html.py) in a new folder. Called by harness/ab_cmd.py,
which owns the arguments; exit code as there (1 on a correctness failure, or with
--fail-on-slower on a SLOWER row: these results have no backends to choose from, so any
backend list means "every row")."""
from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from . import ab_kernels as abk
from . import ab_nodes
from .bench_nodes import diag_sides
from .jsonread import as_dict

DASH = "–"
PERF_HEAD = ("shape", "mode", "A us", "B us", "Δ", "noise", "verdict", "note")
CHECK_HEAD = ("shape", "check", "A", "B", "state")
NODES_PERF_HEAD = ("node group", "method", "A us", "B us", "Δ", "noise", "verdict", "note")
NODES_CHECK_HEAD = ("node group", "check", "A", "B", "state")
TITLES = {"kernels": ("Kernel A/B comparison", "kernels (B vs A, time per kernel)"),
          "nodes": ("Decode-step A/B comparison", "decode step and node groups (B vs A, us per step)")}


def heads(doc: dict) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(perf, check) column heads of a comparison document of either kind."""
    return (NODES_PERF_HEAD, NODES_CHECK_HEAD) if doc.get("kind") == "nodes" else (PERF_HEAD, CHECK_HEAD)
VERDICT_STYLE = {"FASTER": "bold green", "SLOWER": "bold red", "SAME": "", "UNKNOWN": "yellow"}


def _pct(x, sign=True) -> str:
    return DASH if x is None else (f"{100 * x:+.2f} %" if sign else f"±{100 * x:.2f} %")


def _us(x) -> str:
    return DASH if x is None else f"{x:.2f}"


def perf_cells(p: dict) -> list[str]:
    return [str(p["label"]), str(p["mode"]), _us(p["a_us"]), _us(p["b_us"]), _pct(p["delta"]),
            _pct(p["noise"], sign=False), p["verdict"], str(p["note"])]


def check_cells(c: dict) -> list[str]:
    return [str(c["shape"]), str(c["what"]), str(c["a"]), str(c["b"]), str(c["state"])]


def summary_line(doc: dict) -> str:
    n = doc["counts"]
    return (f"correctness failures: {doc['failures']}; {doc.get('kind', 'kernels')} rows: {n['FASTER']} FASTER, "
            f"{n['SLOWER']} SLOWER, {n['SAME']} SAME, {n['UNKNOWN']} UNKNOWN "
            f"(threshold {doc['threshold']:g}{', --fail-on-slower' if doc['fail_on_slower'] else ''}); "
            f"exit {doc['exit_code']}")


def _side(path: Path, d: dict) -> dict:
    m = as_dict(d.get("machine"))
    git = as_dict(m.get("git"))
    gpu = m.get("gpu") or {}
    sw = " ".join(f"{k}={v}" for k, v in list(ab_nodes.set_switches(d).items())[:40])
    if ab_nodes.is_nodes_result(d):  # the engine switches the step was taken with
        settings = sw or "(default switches)"
    else:  # a kernels result: its GEMV settings, and any A/B switch of the engine's builds
        settings = " ".join(f"{k}={as_dict(d.get('settings')).get(k)}"
                            for k in ("gemv_impl", "gemv_args", "gemv_kq", "pdl")) + (f" {sw}" if sw else "")
    return {"path": str(path), "created": d.get("created"), "git": git.get("sha"),
            "dirty": git.get("dirty"), "source": git.get("source_sha256"),
            "gpu": gpu.get("name") if isinstance(gpu, dict) else None, "settings": settings}


def _source(s: dict) -> str:
    """", source <12 hex>" for a side whose result records its source digest, else ""."""
    return f", source {str(s['source'])[:12]}" if s.get("source") else ""


def build_doc(args, a: dict, b: dict) -> tuple[dict, int]:
    nodes = ab_nodes.is_nodes_result(a)
    res = (ab_nodes.compare_nodes(a, b, threshold=args.threshold, force=args.force) if nodes
           else abk.compare_kernels(a, b, threshold=args.threshold))
    slower = args.fail_on_slower is not None
    code = abk.exit_code(res, fail_on_slower=slower)
    doc = {**res.to_dict(), "schema": "gguf-harness/ab-nodes/1" if nodes else "gguf-harness/ab-kernels/1",
           "created": datetime.now(UTC).isoformat(timespec="seconds"),
           "threshold": args.threshold, "fail_on_slower": slower, "exit_code": code,
           "a": _side(args.a, a), "b": _side(args.b, b)}
    if not nodes:  # (compare_nodes notes the nodes results' switch changes itself)
        doc["notes"] = list(doc["notes"]) + ab_nodes.switch_notes(a, b)
        if diag := diag_sides(a, b):  # nowait overlaps the back-to-back copies: rows no decode step has
            doc["notes"].append(f"diagnostic build (timing only): {diag}; its rows bound a cost, "
                                f"they are not a kernel's speed")
    sa, sb = doc["a"]["source"], doc["b"]["source"]
    if sa and sb and sa != sb and doc["a"]["git"] == doc["b"]["git"]:  # a device copy's stale git metadata
        doc["notes"] = list(doc["notes"]) + [
            "A and B record the same git commit but ran different source code (source digests differ)"]
    return doc, code


def print_table(doc: dict, out: Console) -> None:
    """Rich tables; every cell a Text (values come from the files: no markup)."""
    for k in ("a", "b"):
        s = doc[k]
        out.print(Text(f"{k.upper()}: {s['path']}  git {s['git']}{' dirty' if s['dirty'] else ''}{_source(s)}, "
                       f"{s['gpu']}, created {s['created']}, {s['settings']}"))
    for n in doc["notes"]:
        out.print(Text(f"note: {n}"))
    perf_head, check_head = heads(doc)
    t = Table(title=TITLES[doc.get("kind", "kernels")][1], title_justify="left")
    for h in perf_head:
        t.add_column(h, justify="right" if h in ("A us", "B us", "Δ", "noise") else "left")
    for p in doc["perf"]:
        style = VERDICT_STYLE.get(p["verdict"], "")
        t.add_row(*[Text(c, style=style if h == "verdict" else "") for h, c in zip(perf_head, perf_cells(p))])
    out.print(t)
    t = Table(title="correctness" if doc.get("kind") != "nodes" else "structure", title_justify="left")
    for h in check_head:
        t.add_column(h)
    for c in doc["checks"]:
        t.add_row(*[Text(x, style="bold red" if c["state"] == "FAILURE" else "") for x in check_cells(c)])
    out.print(t)
    out.print(Text(summary_line(doc), style="bold red" if doc["exit_code"] else "bold green"))


def markdown(doc: dict) -> str:
    from .ab_cmd import _md_row, _md_text
    perf_head, check_head = heads(doc)
    lines = [f"# {TITLES[doc.get('kind', 'kernels')][0]}", ""]
    lines += [_md_text(f"- {k.upper()}: {doc[k]['path']} (git {doc[k]['git']}{_source(doc[k])}, {doc[k]['gpu']}, "
                       f"{doc[k]['settings']})") for k in ("a", "b")]
    lines += [f"- note: {_md_text(n)}" for n in doc["notes"]]
    lines += ["", _md_row(list(perf_head)), _md_row(["---"] * len(perf_head))]
    lines += [_md_row(perf_cells(p)) for p in doc["perf"]]
    lines += ["", _md_row(list(check_head)), _md_row(["---"] * len(check_head))]
    lines += [_md_row(check_cells(c)) for c in doc["checks"]]
    return "\n".join(lines + ["", summary_line(doc), ""])


def run(args, a: dict, b: dict, console: Console) -> int:
    doc, code = build_doc(args, a, b)
    if args.format == "json":
        print(json.dumps(doc, indent=1))
    elif args.format == "md":
        print(markdown(doc), end="")
    else:
        print_table(doc, Console(file=sys.stdout, width=None if sys.stdout.isatty() else 160))
    if args.out is not None:
        from reports.ab_kernels_html import render_ab_kernels

        from .ab_cmd import new_folder
        from .results import write_json
        folder = new_folder(args.out)
        write_json(folder / "ab.json", doc)
        render_ab_kernels(doc, folder / "ab.html")
        console.print(Text(f"wrote {folder / 'ab.json'} and {folder / 'ab.html'}"))
    return code
