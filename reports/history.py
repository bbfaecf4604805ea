"""History pages: OUT/reports/<commit>/index.html per commit and OUT/reports/index.html.

`harness report --history [OUT]` reads OUT/runs/*/result.json (harness run/verify) and
OUT/runs/*/kernels.json (harness bench kernels), either also gzipped as .json.gz
(reports.history_runs), groups the runs by git commit (dirty runs apart, as "<sha>-dirty"),
and writes
  OUT/reports/<key>/index.html  that commit's runs: verdicts per backend, bench and error
                                tables, kernel tables, links to each run's own report.html
                                (kernels.html) and JSON,
  OUT/reports/index.html        the commits in time order and trend plots
                                (reports.history_trends): decode tok/s, KL, max-abs, and
                                kernel GB/s (cold_b2b) per format.
Both are derived views, rebuilt (and replaced atomically) on every call; run folders and
their report.html are only read. Pages are self-contained (inline CSS, PNG data URIs, no
JavaScript) and rendered with autoescape on: model names, paths and reasons are untrusted.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import quote

from rich.console import Console
from rich.markup import escape

from harness.errors import ConfigError
from harness.progress import Progress
from harness.results import write_atomic

from . import history_trends as trends
from .history_runs import KERNEL_MODE, Commit, RunRecord, collect_runs, group_commits, run_files
from .html import _env
from .plots import data_uri
from .view import VERDICT_CLASS

INDEX_TEMPLATE = "history_index.html.j2"
COMMIT_TEMPLATE = "history_commit.html.j2"


@dataclass
class HistoryPages:
    """What build_history wrote."""

    index: Path
    commit_pages: list[Path]
    n_runs: int
    skipped: list[tuple[Path, str]]  # (result.json, reason) not readable as a result


def _when(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")


def _href(target: Path, start: Path) -> str:
    """Relative URL from folder `start` to `target` (works from disk and when the whole
    OUT folder is moved); run folder names are percent-encoded."""
    return quote(Path(os.path.relpath(target, start)).as_posix())


def _backend_verdicts(run: RunRecord) -> list[dict]:
    """One row per backend: the worst verdict over its contexts, and each context's."""
    rank = {"FAIL": 3, "ERROR": 2, "PASS": 0}
    rows: dict[str, dict] = {}
    for v in run.verdicts:
        row = rows.setdefault(str(v["backend"]), {"backend": str(v["backend"]),
                                                  "verdict": "PASS", "contexts": [],
                                                  "reasons": []})
        row["contexts"].append((v["n_ctx"], v["verdict"]))
        if v["reason"] and v["reason"] not in row["reasons"]:
            row["reasons"].append(v["reason"])
        if rank.get(v["verdict"], 1) > rank.get(row["verdict"], 1):
            row["verdict"] = v["verdict"]
    for row in rows.values():
        row["cls"] = VERDICT_CLASS.get(row["verdict"], "unknown")
    return list(rows.values())


def _run_context(run: RunRecord, page_dir: Path) -> dict:
    report = run.report
    return {"name": run.name, "model": run.model, "model_sha256": run.model_sha256,
            "created": _when(run.created), "created_ok": run.created_ok,
            "device": run.device, "reference": run.reference, "overall": run.overall,
            "overall_cls": VERDICT_CLASS.get(run.overall, "unknown"),
            "backends": _backend_verdicts(run), "bench": run.bench, "errors": run.errors,
            "kernels": run.kernels, "kind": run.kind, "variant": run.variant,
            "kernel_mode": KERNEL_MODE,
            "report_name": report.name if report else None,
            "report_href": _href(report, page_dir) if report else None,
            "result_name": run.json_file.name,
            "result_href": _href(run.json_file, page_dir)}


def _commit_context(c: Commit, page_dir: Path) -> dict:
    return {"key": c.key, "label": c.label, "dirty": c.dirty, "first": _when(c.first),
            "overall": c.overall, "overall_cls": VERDICT_CLASS.get(c.overall, "unknown"),
            "models": c.models, "runs": [_run_context(r, page_dir) for r in c.runs]}


def _trend_plots(commits: list[Commit]) -> list[dict]:
    """[{title, uri | None, note}] for the index page; a kernel plot per format present."""
    x = [c.short for c in commits]
    specs = [
        (trends.decode_series(commits), "decode tok/s (bench, median of the commit's runs)",
         "tok/s", False, "no run has bench rows (harness run --bench)"),
        (trends.error_series(commits, "kl_mean"),
         "teacher-forced KL(reference ‖ backend), mean over steps (max over contexts)",
         "KL [nats]", True, "no completed teacher-forced run"),
        (trends.error_series(commits, "max_abs"),
         "teacher-forced max |logit − reference logit| (max over contexts)",
         "max-abs", True, "no completed teacher-forced run"),
    ]
    for fmt, series in trends.kernel_series(commits).items():
        specs.append((series, f"kernel GB/s: {fmt} ({KERNEL_MODE}, median of the commit's "
                      "runs)", "GB/s", False, "no values"))
    out = []
    for series, title, ylabel, log, empty in specs:
        png = trends.trend_plot(x, series, title, ylabel, log=log)
        out.append({"title": title, "uri": data_uri(png) if png else None,
                    "note": None if png else empty})
    return out


def build_history(out_root: Path, console: Console | None = None) -> HistoryPages:
    """Read OUT/runs/*/result.json and kernels.json, write the per-commit pages and the index.

    Unreadable or non-result JSON files are skipped with a warning (listed on the index).
    Raises ConfigError when OUT/runs holds neither (wrong folder)."""
    out_root = Path(out_root)
    files = run_files(out_root)
    if not files:
        raise ConfigError(f"no run results under {out_root / 'runs'} (expected "
                          f"{out_root / 'runs' / '<run>' / 'result.json'} or kernels.json)")
    reports = out_root / "reports"
    with (Progress(console) if console is not None else Progress.quiet()) as prog:
        def warn(path: Path, msg: str) -> None:
            prog.log(f"[yellow]warning:[/] {escape(str(path))}: {escape(msg)}")

        records, skipped = collect_runs(out_root, prog.task("reading results", len(files)),
                                        warn)
        commits = group_commits(records)
        prog.log(f"{len(records)} runs of {len(commits)} commits; writing {reports}")
        advance = prog.task("commit pages", len(commits)) if commits else lambda: None
        env = _env()
        pages = []
        for c in commits:
            page = reports / c.key / "index.html"
            html = env.get_template(COMMIT_TEMPLATE).render(
                commit=_commit_context(c, page.parent), index_href="../index.html")
            write_atomic(page, html.encode("utf-8"))
            pages.append(page)
            advance()
        prog.log("trend plots")
        rows = [{"label": c.label, "first": _when(c.first), "n_runs": len(c.runs),
                 "models": c.models, "overall": c.overall,
                 "overall_cls": VERDICT_CLASS.get(c.overall, "unknown"),
                 "href": _href(p, reports)} for c, p in zip(commits, pages)]
        html = env.get_template(INDEX_TEMPLATE).render(
            commits=rows, plots=_trend_plots(commits), n_runs=len(records),
            skipped=[(_href(p, reports), str(p), why) for p, why in skipped],
            generated=_when(datetime.now(UTC)))
        index = reports / "index.html"
        write_atomic(index, html.encode("utf-8"))
    return HistoryPages(index, pages, len(records), skipped)
