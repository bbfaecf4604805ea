"""History pages over `harness bench kernels` runs (OUT/runs/<name>/kernels.json).

The nightly's bench stage writes kernels.json (schema gguf-harness/kernels/1), not a
result.json: the history must read those files, group them by commit like the run results
and plot the headline GB/s (cold_b2b) per format. Synthetic files follow the real file's
structure (harness/bench_kernels.py: rows with fmt, label, status, check.ok, modes.<mode>.gb_s);
the last tests use the two real H200 kernels.json of session 7's nightlies
(docs/results/nightly-2026-11-29-h200-s7).
"""
from __future__ import annotations

import base64
import copy
import io
import json
import re
import shutil
from pathlib import Path

import pytest
from rich.console import Console

from harness.jsonio import load_json
from harness.results import write_json
from reports.history import build_history
from reports.history_runs import (
    KERNELS_NAME,
    bench_kernel_rows,
    collect_runs,
    group_commits,
    load_run,
)
from reports.history_trends import kernel_series

S7 = Path(__file__).resolve().parents[1] / "docs" / "results" / "nightly-2026-11-29-h200-s7"
SHA_A = "a" * 40
SHA_B = "b" * 40
PNG_URI = re.compile(r'alt="([^"]*)" src="data:image/png;base64,([A-Za-z0-9+/=]+)"')


def _row(name: str, rows: int, K: int, fmt: str, gb_s: float | None = 1000.0, *,
         status: str = "ok", check_ok: bool | None = True, modes=("cold_b2b", "hot"),
         n_mats: int = 1) -> dict:
    """A row shaped like harness.bench_kernels.run_shape's."""
    label = f"{'2x' if n_mats == 2 else ''}[{rows}x{K}] {fmt}"
    row = {"name": name, "spec": f"{rows}x{K}:{fmt}", "label": label, "fmt": fmt,
           "rows": rows, "K": K, "n_mats": n_mats, "status": status,
           "reason": None if status == "ok" else f"{status} reason", "modes": {}}
    if check_ok is not None:
        row["check"] = {"check": "vs exact oracle", "ok": check_ok}
    if status == "ok" and gb_s is not None:
        # cold_b2b is the headline; the hot figure must never be the one plotted
        row["modes"] = {m: {"gb_s": gb_s if m == "cold_b2b" else 10 * gb_s,
                            "pct_copy": 40.0, "pct_roofline": 50.0,
                            "kernel": {"us": 10.0}} for m in modes}
    return row


def _kernels(sha: str | None, created: str, rows: list[dict], *, dirty: bool = False,
             gpu: str = "NVIDIA H200", switches: dict | None = None) -> dict:
    return {"schema": "gguf-harness/kernels/1",
            "settings": {"modes": ["cold_b2b", "cold_single", "hot"], "gemv_kq": "wide"},
            "device": {"copy": {"gb_s": 4000.0}}, "rows": rows, "created": created,
            "machine": {"gpu": {"name": gpu}, "git": {"sha": sha, "dirty": dirty},
                        "switches": switches or {}}}


def _write(out: Path, name: str, doc: dict, file: str = "kernels.json") -> Path:
    path = out / "runs" / name / file
    write_json(path, doc)
    return path


def _plots(html: str) -> dict[str, bytes]:
    return {alt.replace("&#39;", "'"): base64.b64decode(b) for alt, b in PNG_URI.findall(html)}


def _run_result(sha: str, created: str, dirty: bool = False) -> dict:
    """A small verify result of the same commit (decode tok/s and a PASS verdict)."""
    return {"schema": "gguf-harness/run/1", "created": created,
            "machine": {"git": {"sha": sha, "dirty": dirty}, "gpu": {"name": "NVIDIA H200"}},
            "model": {"name": "q05", "sha256": "11" * 32}, "reference": {"backend": "oracle"},
            "runs": [], "verdicts": [{"backend": "engine", "n_ctx": 512, "verdict": "PASS",
                                      "reason": "ok"}],
            "bench": {"rows": [{"backend": "engine", "n_ctx": 512, "decode_tok_s": 1000.0}]}}


# ---- rows -------------------------------------------------------------------------------

def test_rows_headline_figure_and_no_point_without_a_passed_check():
    doc = _kernels(SHA_A, "2026-01-01T00:00:00Z", [
        _row("attn_qkv", 10240, 5120, "Q4_K", 1600.0),
        _row("bad_check", 4096, 4096, "Q4_K", 1500.0, check_ok=False),
        _row("not_timed", 4096, 4096, "Q6_K", status="failed", check_ok=False),
        _row("crashed", 4096, 4096, "Q6_K", status="error", check_ok=None),
        _row("no_kernel", 4096, 4096, "IQ1_S", status="unsupported", check_ok=None),
        _row("hot_only", 4096, 4096, "Q8_0", 900.0, modes=("hot",)),
        _row("gate_up", 17408, 5120, "IQ4_XS", 1850.0, n_mats=2),
    ])
    rows = bench_kernel_rows(doc)
    got = {(r["shape"], r["format"]): (r["gb_s"], r["status"], r["note"]) for r in rows}
    assert got[("attn_qkv [10240x5120]", "Q4_K")] == (1600.0, "ok", "")  # cold_b2b, not hot
    assert got[("gate_up 2x[17408x5120]", "IQ4_XS")][0] == 1850.0
    assert got[("bad_check [4096x4096]", "Q4_K")][0] is None  # a timing of a wrong kernel
    assert "check" in got[("bad_check [4096x4096]", "Q4_K")][2]
    assert got[("not_timed [4096x4096]", "Q6_K")] == (None, "failed", "failed: failed reason")
    assert got[("crashed [4096x4096]", "Q6_K")][:2] == (None, "error")
    assert got[("no_kernel [4096x4096]", "IQ1_S")][:2] == (None, "unsupported")
    assert got[("hot_only [4096x4096]", "Q8_0")] == (None, "ok", "cold_b2b not timed")
    assert rows[0]["pct_copy"] == 40.0 and rows[0]["pct_roofline"] == 50.0


@pytest.mark.parametrize("bad", ["nan", "inf", -5.0, 0.0, "fast", None])
def test_rows_non_positive_or_non_numeric_figure_gives_no_point(bad):
    row = _row("x", 4096, 4096, "Q4_K", 100.0)
    row["modes"]["cold_b2b"]["gb_s"] = bad
    (r,) = bench_kernel_rows(_kernels(SHA_A, "2026-01-01T00:00:00Z", [row]))
    assert r["gb_s"] is None and r["note"]


def test_odd_rows_do_not_break_loading(tmp_path):
    doc = _kernels(SHA_A, "2026-01-01T00:00:00Z", [
        "not a row", {}, {"fmt": None, "status": "ok", "modes": []},
        {"fmt": "Q4_K", "status": "ok", "check": {"ok": True}, "modes": {"cold_b2b": 7}},
    ])
    rec, _ = load_run(_write(tmp_path, "odd", doc))
    assert [r["gb_s"] for r in rec.kernels] == [None, None]
    doc["rows"] = {"not": "a list"}
    rec, _ = load_run(_write(tmp_path, "odd2", doc))
    assert rec.kernels == [] and rec.overall == "—"


# ---- records, grouping, verdicts --------------------------------------------------------

def test_kernels_run_record(tmp_path):
    path = _write(tmp_path, "k1", _kernels(SHA_A, "2026-01-01T10:00:00+00:00",
                                           [_row("q", 4096, 4096, "Q4_K")],
                                           switches={"GGUF_HARNESS_GEMV_KQ": "v9"}))
    rec, notes = load_run(path)
    assert notes == [] and rec.kind == "kernels" and rec.model == KERNELS_NAME
    assert (rec.sha, rec.dirty, rec.key) == (SHA_A, False, SHA_A)
    assert rec.device == "NVIDIA H200" and rec.overall == "PASS"
    assert rec.json_file == path and rec.report is None
    assert rec.variant == "GGUF_HARNESS_GEMV_KQ=v9"
    (path.parent / "kernels.html").write_text("<html></html>")
    assert rec.report == path.parent / "kernels.html"


@pytest.mark.parametrize("statuses,overall", [
    (["ok", "unsupported"], "PASS"), (["ok", "failed"], "FAIL"), (["ok", "error"], "ERROR"),
    (["error", "failed"], "FAIL"), ([], "—"),
])
def test_kernels_run_verdict(tmp_path, statuses, overall):
    rows = [_row(f"s{i}", 4096, 4096, "Q4_K", status=s, check_ok=s == "ok")
            for i, s in enumerate(statuses)]
    rec, _ = load_run(_write(tmp_path, "k", _kernels(SHA_A, "2026-01-01T00:00:00Z", rows)))
    assert rec.overall == overall


def test_grouped_with_the_results_of_the_same_commit(tmp_path):
    out = tmp_path / "out"
    _write(out, "v1", _run_result(SHA_B, "2026-01-01T10:00:00Z"), "result.json")
    _write(out, "k1", _kernels(SHA_B, "2026-01-01T10:05:00Z", [_row("q", 4096, 4096, "Q4_K")]))
    _write(out, "v2", _run_result(SHA_A, "2026-01-02T10:00:00Z", dirty=True), "result.json")
    _write(out, "k2", _kernels(SHA_A, "2026-01-02T10:05:00Z", [_row("q", 4096, 4096, "Q4_K")],
                               dirty=True))
    _write(out, "k3", _kernels(SHA_A, "2026-01-02T11:00:00Z", [_row("q", 4096, 4096, "Q4_K")]))
    records, skipped = collect_runs(out)
    assert not skipped and len(records) == 5
    commits = group_commits(records)
    assert [(c.key, sorted(r.kind for r in c.runs)) for c in commits] == [
        (SHA_B, ["kernels", "verify"]), (f"{SHA_A}-dirty", ["kernels", "verify"]),
        (SHA_A, ["kernels"])]
    pages = build_history(out)
    assert pages.n_runs == 5
    page = (out / "reports" / SHA_B / "index.html").read_text()
    assert page.count('<section class="run"') == 2
    assert 'href="../../runs/k1/kernels.json"' in page and "no kernels.html" in page
    assert 'href="../../runs/v1/result.json"' in page


def test_only_kernels_runs_is_a_history(tmp_path):
    out = tmp_path / "out"
    _write(out, "k1", _kernels(SHA_A, "2026-01-01T00:00:00Z", [_row("q", 4096, 4096, "Q4_K")]))
    pages = build_history(out)
    plots = _plots(pages.index.read_text())
    assert list(plots) == ["kernel GB/s: Q4_K (cold_b2b, median of the commit's runs)"]


def test_malformed_kernels_json_skipped(tmp_path):
    out = tmp_path / "out"
    _write(out, "k1", _kernels(SHA_A, "2026-01-01T00:00:00Z", [_row("q", 4096, 4096, "Q4_K")]))
    bad = out / "runs" / "k2" / "kernels.json"
    bad.parent.mkdir()
    bad.write_text('{"schema": "gguf-harness/kernels/1", "rows": [')
    buf = io.StringIO()
    pages = build_history(out, Console(file=buf, width=300))
    assert [p for p, _ in pages.skipped] == [bad] and "k2" in buf.getvalue()


# ---- trends -----------------------------------------------------------------------------

def test_kernel_trend_per_format_over_commits(tmp_path):
    out = tmp_path / "out"
    t = "2026-01-0{}T00:00:00Z"
    # commit B: two runs, Q4_K 1000 and 1200 -> median 1100; a failed row gives no point
    _write(out, "b1", _kernels(SHA_B, t.format(1), [
        _row("q", 4096, 4096, "Q4_K", 1000.0), _row("h", 8192, 4096, "Q6_K", 2000.0)]))
    _write(out, "b2", _kernels(SHA_B, t.format(2), [
        _row("q", 4096, 4096, "Q4_K", 1200.0),
        _row("h", 8192, 4096, "Q6_K", 9999.0, check_ok=False)]))
    # commit A: the same shapes; an engine switch and another GPU each make their own series
    _write(out, "a1", _kernels(SHA_A, t.format(3), [
        _row("q", 4096, 4096, "Q4_K", 1300.0), _row("h", 8192, 4096, "Q6_K", 2100.0)]))
    _write(out, "a2", _kernels(SHA_A, t.format(4), [_row("q", 4096, 4096, "Q4_K", 1500.0)],
                               switches={"GGUF_HARNESS_GEMV_KQ": "v9"}))
    _write(out, "a3", _kernels(SHA_A, t.format(5), [_row("q", 4096, 4096, "Q4_K", 700.0)],
                               gpu="NVIDIA A100"))
    commits = group_commits(collect_runs(out)[0])
    ks = kernel_series(commits)
    assert sorted(ks) == ["Q4_K", "Q6_K"]
    assert ks["Q4_K"] == {"q [4096x4096] · NVIDIA H200": {0: 1100.0, 1: 1300.0},
                          "q [4096x4096] · NVIDIA H200 · GGUF_HARNESS_GEMV_KQ=v9": {1: 1500.0},
                          "q [4096x4096] · NVIDIA A100": {1: 700.0}}
    assert ks["Q6_K"] == {"h [8192x4096] · NVIDIA H200": {0: 2000.0, 1: 2100.0}}
    html = build_history(out).index.read_text()
    plots = _plots(html)
    assert {t for t in plots if t.startswith("kernel GB/s")} == {
        "kernel GB/s: Q4_K (cold_b2b, median of the commit's runs)",
        "kernel GB/s: Q6_K (cold_b2b, median of the commit's runs)"}
    assert all(p.startswith(b"\x89PNG\r\n\x1a\n") for p in plots.values())
    page = (out / "reports" / SHA_B / "index.html").read_text()
    assert "oracle check not passed: no point" in page and "9999.0" not in page


def test_format_without_any_point_gets_no_plot(tmp_path):
    out = tmp_path / "out"
    _write(out, "k1", _kernels(SHA_A, "2026-01-01T00:00:00Z", [
        _row("q", 4096, 4096, "Q4_K", 1000.0),
        _row("x", 4096, 4096, "IQ3_S", status="failed", check_ok=False)]))
    assert list(kernel_series(group_commits(collect_runs(out)[0]))) == ["Q4_K"]


# ---- the real H200 kernels.json (session 7, two nightlies on the same code) --------------

REAL = [("20261129T204043Z-897e202a6f", "kernels-inv1-897e202.json.gz"),
        ("20261129T204642Z-e783cc3323", "kernels-inv2-e783cc3.json.gz")]


def _real_out(tmp_path: Path) -> Path:
    out = tmp_path / "out"
    for run, name in REAL:
        (out / "runs" / run).mkdir(parents=True)
        shutil.copy(S7 / name, out / "runs" / run / "kernels.json.gz")  # read gzipped as stored
    for run, name in (("20261129T203940Z-897e202a6f", "verify-run1-897e202.json.gz"),
                      ("20261129T204544Z-e783cc3323", "verify-run2-e783cc3.json.gz")):
        (out / "runs" / run).mkdir(parents=True)
        shutil.copy(S7 / name, out / "runs" / run / "result.json.gz")
    return out


@pytest.mark.skipif(not (S7 / REAL[0][1]).is_file(), reason="session 7 records not present")
def test_real_h200_kernels_runs(tmp_path):
    out = _real_out(tmp_path)
    pages = build_history(out)
    assert pages.n_runs == 4 and not pages.skipped
    plots = _plots(pages.index.read_text())
    formats = sorted(t.split(": ")[1].split(" (")[0] for t in plots
                     if t.startswith("kernel GB/s"))
    assert formats == ["IQ3_S", "IQ4_XS", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q8_0"]
    assert len(plots) == 3 + 7  # decode, KL, max-abs, and one per format
    commits = group_commits(collect_runs(out)[0])
    assert [c.label for c in commits] == ["897e202a6f94149012cb0dc8f00aab192f68d80f",
                                          "e783cc33232acb187698b727be297e95ce13d634+dirty"]
    ks = kernel_series(commits)
    assert sorted(ks["Q6_K"]) == ["attn_k [1024x5120] · NVIDIA H200",
                                  "ffn_down_q6 [5120x17408] · NVIDIA H200",
                                  "output [248320x5120] · NVIDIA H200",
                                  "ssm_out [5120x6144] · NVIDIA H200"]
    for i, (_, name) in enumerate(REAL):  # the plotted figure is the file's cold_b2b GB/s
        doc = load_json(S7 / name)
        head = next(r for r in doc["rows"] if r["name"] == "output")
        assert ks["Q6_K"]["output [248320x5120] · NVIDIA H200"][i] == \
            head["modes"]["cold_b2b"]["gb_s"]
    page = (out / "reports" / "897e202a6f94149012cb0dc8f00aab192f68d80f" /
            "index.html").read_text()
    assert "2297.9" in page  # output head, cold_b2b GB/s of the first invocation


@pytest.mark.skipif(not (S7 / REAL[0][1]).is_file(), reason="session 7 records not present")
def test_real_structure_with_a_failed_check_and_an_untimed_row(tmp_path):
    doc = load_json(S7 / REAL[0][1])
    bad = copy.deepcopy(doc)
    by_name = {r["name"]: r for r in bad["rows"]}
    by_name["output"]["check"]["ok"] = False  # a timing of a wrong kernel: no point
    by_name["square_q4"].update(status="failed", reason="oracle check failed: not timed",
                                modes={})
    out = tmp_path / "out"
    _write(out, "good", doc)
    _write(out, "bad", dict(bad, machine=dict(bad["machine"], git={"sha": SHA_A,
                                                                     "dirty": False}),
                            created="2026-11-30T00:00:00+00:00"))
    rec, _ = load_run(out / "runs" / "bad" / "kernels.json")
    assert rec.overall == "FAIL"
    rows = {r["shape"]: r for r in rec.kernels}
    assert rows["output [248320x5120]"]["gb_s"] is None
    assert rows["square_q4 [4096x4096]"]["gb_s"] is None
    assert rows["attn_qkv [10240x5120]"]["gb_s"] == pytest.approx(1602.29, abs=0.01)
    ks = kernel_series(group_commits(collect_runs(out)[0]))
    assert ks["Q6_K"]["output [248320x5120] · NVIDIA H200"] == {
        0: pytest.approx(2297.887, abs=1e-3)}  # no point from the second commit
    assert ks["Q4_0"] == {"square_q4 [4096x4096] · NVIDIA H200": {0: pytest.approx(942.875,
                                                                                  abs=1e-3)}}
    assert len(ks["Q4_K"]["attn_qkv [10240x5120] · NVIDIA H200"]) == 2
