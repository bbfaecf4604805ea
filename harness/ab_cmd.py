"""`harness ab A.json B.json`: compare result B against result A (harness.ab).

    harness ab PREV.json NEW.json [--threshold 0.02] [--fail-on-slower [BACKENDS]] [--force]
               [--format table|md|json] [--out DIR]

Two `harness bench kernels` results (kernels.json) are compared per shape and timing mode
instead (harness/ab_kernels.py), two `harness bench nodes` results (nodes.json) by decode step
and node group (harness/ab_nodes.py). Prints the comparison to stdout (a rich table by default;
Markdown or JSON on request);
with --out writes ab.json + ab.html into a new folder under DIR (never an existing one).
A and B may be plain .json or gzipped .json.gz files (as docs/results/ stores them; read by
harness.results.read_json -> harness.jsonio.load_json).
Exit code: 0 without correctness failures (with --fail-on-slower: and without SLOWER
verdicts of the gated backends: every backend when bare or `all`, else the comma-separated
list, e.g. `--fail-on-slower engine`; rule and reason in harness/ab.py), 1 otherwise, 2 for
bad input (unreadable or non-result files, results of different models/prompts without
--force, an unknown backend name).
"""
from __future__ import annotations

import argparse
import html
import json
import sys
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from . import ab, results
from .errors import ConfigError
from .results import SCHEMA

DASH = "–"
METRIC_LABEL = {"decode_tok_s": "decode tok/s", "prefill_tok_s": "prefill tok/s"}
VERDICT_STYLE = {"FASTER": "bold green", "SLOWER": "bold red", "SAME": "", "UNKNOWN": "yellow"}
PERF_HEAD = ("metric", "backend", "n_ctx", "A median", "B median", "Δ", "noise", "n A/B",
             "verdict", "note")
CHECK_HEAD = ("check", "backend", "mode", "n_ctx", "A", "B", "state", "")


def add_ab_parser(sub) -> None:
    p = sub.add_parser("ab", help="compare two results: speed verdicts within noise, "
                       "correctness changes as failures")
    p.add_argument("a", type=Path, help="result.json A (before; .json or .json.gz)")
    p.add_argument("b", type=Path, help="result.json B (after; .json or .json.gz)")
    p.add_argument("--threshold", type=float, default=ab.DEFAULT_THRESHOLD,
                   help="smallest relative tok/s change that counts when the runs' spread is "
                   f"smaller (default {ab.DEFAULT_THRESHOLD})")
    p.add_argument("--fail-on-slower", nargs="?", const=(ab.ALL_BACKENDS,), default=None,
                   type=_slower_arg, metavar="BACKENDS",
                   help="exit 1 also when a metric is SLOWER: of any backend (bare, or "
                   "'all'), or only of these comma-separated backends (e.g. 'engine'); "
                   "SLOWER rows of other backends are shown, not gated")
    p.add_argument("--force", action="store_true",
                   help="compare results of different models/prompts (SHAs not compared)")
    p.add_argument("--format", choices=["table", "md", "json"], default="table",
                   help="stdout format (default table)")
    p.add_argument("--out", default=None,
                   help="also write ab.json + ab.html into a new folder under this one")


def _slower_arg(text: str) -> tuple[str, ...]:
    """argparse type of --fail-on-slower BACKENDS (harness.ab.parse_slower_backends)."""
    try:
        return ab.parse_slower_backends(text)
    except ConfigError as e:
        looks_like_file = text.endswith((".json", ".json.gz")) or "/" in text
        hint = (" (a result file? put --fail-on-slower after A and B, or write "
                "--fail-on-slower=all)" if looks_like_file else "")
        raise argparse.ArgumentTypeError(f"{e}{hint}") from None


def slower_label(doc: dict) -> str:
    """"--fail-on-slower engine" (or bare for every backend), "" when not given."""
    gated = doc.get("fail_on_slower_backends")
    if not doc.get("fail_on_slower"):
        return ""
    if not gated or ab.ALL_BACKENDS in gated:
        return "--fail-on-slower"
    return "--fail-on-slower " + ",".join(gated)


def _pct(x: float | None, sign: bool = True) -> str:
    return DASH if x is None else f"{100 * x:+.2f} %" if sign else f"±{100 * x:.2f} %"


def _val(x: float | None) -> str:
    return DASH if x is None else f"{x:.1f}"


def _short(s: str | None) -> str:
    return DASH if s is None else s[:12] if len(s) == 64 else s


def perf_cells(p: dict) -> list[str]:
    """Text cells of one performance row (a PerfRow as dict); a SLOWER row that does not set
    the exit code under --fail-on-slower BACKENDS (p["gating"] False) says "not gated"."""
    note = p["note"]
    if p.get("gating") is False:
        note = "; ".join(x for x in (note, "not gated") if x)
    return [METRIC_LABEL.get(p["metric"], p["metric"]), str(p["backend"]), str(p["n_ctx"]),
            _val(p["a_median"]), _val(p["b_median"]), _pct(p["delta"]),
            _pct(p["noise"], sign=False), f"{p['a_n']}/{p['b_n']}", p["verdict"], note]


def check_cells(c: dict) -> list[str]:
    """Text cells of one correctness row (a CheckRow as dict); SHAs cut to 12 hex."""
    return [c["check"], str(c["backend"]), str(c["mode"] or DASH), str(c["n_ctx"]),
            _short(c["a"]), _short(c["b"]), c["state"], "FAILURE" if c["failure"] else ""]


def summary_line(doc: dict) -> str:
    """One line: failure count, verdict counts (SLOWER: how many gate), threshold, the
    --fail-on-slower setting and the exit code."""
    n = doc["counts"]
    flag = slower_label(doc)
    gating = sum(bool(p.get("gating")) for p in doc.get("perf") or [])
    slower = f"{n['SLOWER']} SLOWER" + (f" ({gating} gating)" if flag and n["SLOWER"] else "")
    return (f"correctness failures: {doc['failures']}; performance: {n['FASTER']} FASTER, "
            f"{slower}, {n['SAME']} SAME, {n['UNKNOWN']} UNKNOWN "
            f"(threshold {doc['threshold']:g}{', ' + flag if flag else ''}); "
            f"exit {doc.get('exit_code')}")


def _switches(s: dict) -> str:
    sw = s.get("switches") or {}
    return ", switches " + " ".join(f"{k}={v}" for k, v in sorted(sw.items())) if sw else ""


def _sides(doc: dict) -> list[str]:
    lines = [f"{k}: {s['path']}  model {s['model']} ({str(s['model_sha256'])[:12]}), "
             f"git {s['git']}{' dirty' if s['dirty'] else ''}"
             f"{', source ' + str(s['source'])[:12] if s.get('source') else ''}, created {s['created']}{_switches(s)}"
             for k, s in (("A", doc["a"]), ("B", doc["b"]))]
    sa, sb = doc["a"].get("source"), doc["b"].get("source")
    if sa and sb and sa != sb and doc["a"].get("git") == doc["b"].get("git"):
        lines.append("note: A and B record the same git commit but ran different source code (source digests differ)")
    if (doc["a"].get("switches") or {}) != (doc["b"].get("switches") or {}):
        lines.append("note: A and B ran with different engine switches (GGUF_HARNESS_*)")
    return lines


# in place of an empty performance table (a CPU `harness run` times no bench by default)
NO_PERF = ("performance: not compared, no bench rows in A or B (harness run/verify --bench; "
           "on by default with a GPU)")


def print_table(doc: dict, out: Console) -> None:
    """Rich tables on `out`; every cell is a Text (no markup: values come from the files)."""
    for line in _sides(doc) + [f"not comparable: {m}" for m in doc["mismatches"]]:
        out.print(Text(line))
    t = Table(title="performance (B vs A)", title_justify="left")
    for h in PERF_HEAD:
        t.add_column(h, justify="right" if h in ("A median", "B median", "Δ", "noise") else "left")
    for p in doc["perf"]:
        style = VERDICT_STYLE.get(p["verdict"], "")
        t.add_row(*[Text(c, style=style if h == "verdict" else "")
                    for h, c in zip(PERF_HEAD, perf_cells(p))])
    out.print(t if doc["perf"] else Text(NO_PERF))
    t = Table(title="correctness", title_justify="left")
    for h in CHECK_HEAD:
        t.add_column(h)
    for c in doc["checks"]:
        t.add_row(*[Text(x, style="bold red" if c["failure"] else "") for x in check_cells(c)])
    out.print(t)
    out.print(Text(summary_line(doc), style="bold red" if doc["exit_code"] else "bold green"))


def _md_text(text: str) -> str:
    """One Markdown line of file-provided text: inline HTML escaped (Markdown passes it through),
    pipes escaped and newlines flattened so a table or list item stays one row."""
    return html.escape(str(text), quote=False).replace("|", "\\|").replace("\r", " ").replace("\n", " ")


def _md_row(cells: list[str]) -> str:
    return "| " + " | ".join(_md_text(c) for c in cells) + " |"


def markdown(doc: dict) -> str:
    """The comparison as Markdown (two pipe tables and a summary line)."""
    lines = ["# A/B comparison", ""] + [f"- {_md_text(s)}" for s in _sides(doc)]
    lines += [f"- not comparable: {_md_text(m)}" for m in doc["mismatches"]]
    lines += ["", "## Performance", ""]
    if doc["perf"]:
        lines += [_md_row(list(PERF_HEAD)), _md_row(["---"] * len(PERF_HEAD))]
        lines += [_md_row(perf_cells(p)) for p in doc["perf"]]
    else:
        lines.append(NO_PERF)
    lines += ["", "## Correctness", "", _md_row(list(CHECK_HEAD)),
              _md_row(["---"] * len(CHECK_HEAD))]
    lines += [_md_row(check_cells(c)) for c in doc["checks"]]
    return "\n".join(lines + ["", summary_line(doc), ""])


def build_doc(args) -> tuple[dict, int]:
    """(ab.json document, exit code) for the parsed arguments; ConfigError on bad input."""
    a, b = ab.load_result(args.a), ab.load_result(args.b)
    res = ab.compare(a, b, threshold=args.threshold, force=args.force)
    slower = args.fail_on_slower  # None, or backend names / ("all",)
    code = ab.exit_code(res, fail_on_slower=slower or False)
    doc = {**res.to_dict(), "created": datetime.now(UTC).isoformat(timespec="seconds"),
           "fail_on_slower": slower is not None,
           "fail_on_slower_backends": list(slower) if slower is not None else None,
           "exit_code": code, "a": ab.side_info(a, args.a), "b": ab.side_info(b, args.b)}
    for row, p in zip(res.perf, doc["perf"]):
        # True: this SLOWER row sets the exit code; False: SLOWER, backend not gated
        p["gating"] = (ab.gates(row, slower) if slower is not None and row.verdict == "SLOWER"
                       else None)
    return doc, code


def new_folder(root: Path) -> Path:
    """A new folder under root (harness.results.new_run_dir naming); ConfigError when root
    cannot hold one."""
    from .machine import git_info
    from .results import new_run_dir
    try:
        return new_run_dir(root, git_info().get("sha"))
    except (OSError, RuntimeError) as e:  # root is a file, not writable, 1000 folders taken
        raise ConfigError(f"cannot create a folder under {root}: {e}") from None


def write_out(doc: dict, root: Path) -> Path:
    """ab.json + ab.html in a new folder under root (harness.results.new_run_dir naming);
    both written atomically. Raises ConfigError when root cannot hold a new folder."""
    from reports.ab_html import render_ab

    from .results import write_json
    folder = new_folder(root)
    write_json(folder / "ab.json", doc)
    render_ab(doc, folder / "ab.html")
    return folder


def _peek(path: Path) -> dict:
    """The JSON document at path, .json or .json.gz (ConfigError, one line naming the file,
    when it is missing, unreadable, a truncated gzip, not JSON or not a harness result): its
    schema picks the comparison."""
    from .results import read_json
    try:
        return read_json(Path(path))
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read result {path}: {e}") from None


def run_ab(args, console: Console) -> int:
    """The `harness ab` command; returns the exit code (ConfigError for bad input). Two
    `harness bench kernels` or two `harness bench nodes` results go to harness/ab_kernels_cmd.py."""
    from . import ab_kernels, ab_nodes
    if args.out is not None:  # before any work: the whole comparison was printed before this error
        args.out = results.check_out_root(args.out, sub=None)
    kinds = [_peek(p) for p in (args.a, args.b)]
    for name, is_kind, files in (("bench kernels", ab_kernels.is_kernels_result, "kernels.json"),
                                 ("bench nodes", ab_nodes.is_nodes_result, "nodes.json")):
        if all(is_kind(k) for k in kinds):
            from . import ab_kernels_cmd
            return ab_kernels_cmd.run(args, kinds[0], kinds[1], console)
        if any(is_kind(k) for k in kinds):
            other = next(k for k in kinds if not is_kind(k)).get("schema")
            what = "a run result" if other == SCHEMA else f"a {other} document"
            raise ConfigError(f"cannot compare a {name} result with {what}: give two "
                              f"{files} or two result.json files")
    doc, code = build_doc(args)
    if args.format == "json":
        print(json.dumps(doc, indent=1))
    elif args.format == "md":
        print(markdown(doc), end="")
    else:
        width = None if sys.stdout.isatty() else 160  # wide tables in files and CI logs
        print_table(doc, Console(file=sys.stdout, width=width))
    if args.out is not None:
        folder = write_out(doc, args.out)
        console.print(Text(f"wrote {folder / 'ab.json'} and {folder / 'ab.html'}"))
    return code
