"""History pages (`harness report --history`): grouping by commit, time order, trend plots,
escaping, links to run reports, skipped files, and rendering in headless Chromium.

Results are synthetic dicts of the run schema (written with harness.results.write_json into
a tmp OUT/runs/<name>/result.json layout), plus the committed docs/results/*.json.gz files
(stored gzipped; plain *.json as they were before, or as a new result is until compressed) as
realistic input. Expected orders and values are designed into the inputs.
"""
from __future__ import annotations

import base64
import io
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import unquote

import pytest
from rich.console import Console

from harness.cli import main
from harness.jsonio import json_stem
from harness.results import SCHEMA, write_json
from reports.history import build_history
from reports.history_runs import group_commits, load_run, result_files
from reports.history_trends import (
    decode_series,
    error_series,
    kernel_series,
    trend_plot,
)

DOCS = Path(__file__).resolve().parents[1] / "docs" / "results"
EVIL = "<script>alert(1)</script>m"
SHA_A = "a" * 40  # sorts first by name, but its runs are the later ones
SHA_B = "f" * 40
PNG_URI = re.compile(r"data:image/png;base64,([A-Za-z0-9+/=]+)")


def _result(sha, *, created, dirty=False, model="tiny", sha256="11" * 32, decode=(100.0,),
            kl=(1e-3,), verdict="PASS", kernels=None, gpu="NVIDIA H200"):
    """A minimal result: one backend "engine", contexts 512 (+2048 when two values are
    given), bench decode tok/s and teacher-forced KL per context."""
    ctxs = [512, 2048][:len(decode)]
    runs = []
    for n_ctx, k in zip(ctxs, kl):
        summary = {"kl_mean": k, "kl_max": 10 * k, "max_abs": 100 * k, "top1_agreement": 1.0}
        runs.append({"backend": "engine", "mode": "teacher_forced", "n_ctx": n_ctx,
                     "status": "ok", "summary": summary})
        # greedy runs stop being comparable at a divergence: never plotted as errors
        runs.append({"backend": "engine", "mode": "greedy", "n_ctx": n_ctx, "status": "ok",
                     "summary": {**summary, "kl_mean": 5.0, "max_abs": 50.0}})
    res = {"schema": SCHEMA, "created": created,
           "machine": {"git": {"sha": sha, "dirty": dirty},
                       "gpu": {"name": gpu} if gpu else None},
           "model": {"name": model, "path": "/m.gguf", "sha256": sha256, "size": 1},
           "reference": {"backend": "oracle"}, "runs": runs,
           "verdicts": [{"backend": "engine", "n_ctx": c, "verdict": verdict, "reason": "r"}
                        for c in ctxs],
           "bench": {"rows": [{"backend": "engine", "n_ctx": c, "prefill_tok_s": 10 * d,
                               "decode_tok_s": d, "ms_per_token": 1e3 / d, "eff_gb_s": 1.0}
                              for c, d in zip(ctxs, decode)]}}
    if kernels is not None:
        res["kernels"] = kernels
    return res


def _write(out: Path, name: str, result: dict, report: bool = False) -> Path:
    d = out / "runs" / name
    write_json(d / "result.json", result)
    if report:
        (d / "report.html").write_text(f"<html>report of {name}</html>")
    return d


@pytest.fixture()
def history(tmp_path):
    """Two commits (B's runs earlier than A's), a dirty run of A, a malformed result."""
    out = tmp_path / "out"
    _write(out, "r1-b", _result(SHA_B, created="2026-01-01T10:00:00+00:00", decode=(100.0,)),
           report=True)
    _write(out, "r2-a", _result(SHA_A, created="2026-01-02T10:00:00+00:00", model=EVIL,
                                sha256="22" * 32, decode=(120.0,), verdict="FAIL"),
           report=True)
    _write(out, "r3-a-dirty", _result(SHA_A, created="2026-01-03T10:00:00+00:00", dirty=True))
    bad = out / "runs" / "r4-bad" / "result.json"
    bad.parent.mkdir(parents=True)
    bad.write_text('{"schema": "gguf-harness/run/1", "created": ')  # truncated write
    buf = io.StringIO()
    pages = build_history(out, Console(file=buf, width=300))
    return out, pages, buf.getvalue()


def _pngs(html: str) -> list[bytes]:
    return [base64.b64decode(m) for m in PNG_URI.findall(html)]


def test_pages_grouped_by_commit_in_time_order(history):
    out, pages, _ = history
    rep = out / "reports"
    for key in (SHA_B, SHA_A, f"{SHA_A}-dirty"):
        assert (rep / key / "index.html").is_file(), key
    assert pages.index == rep / "index.html" and pages.n_runs == 3
    html = pages.index.read_text()
    pos = [html.index(f'href="{k}/index.html"') for k in (SHA_B, SHA_A, f"{SHA_A}-dirty")]
    assert pos == sorted(pos), "commits not in the order of their earliest run"
    assert f"{SHA_A}+dirty" in html
    # overall verdict per commit: A carries the FAIL
    row_a = html[pos[1]:pos[2]]
    assert "FAIL" in row_a and "PASS" not in row_a


def test_index_embeds_trend_pngs(history):
    _, pages, _ = history
    pngs = _pngs(pages.index.read_text())
    assert len(pngs) >= 2
    assert all(p.startswith(b"\x89PNG\r\n\x1a\n") and len(p) > 1000 for p in pngs)
    assert "<script" not in pages.index.read_text()  # no JavaScript, and the name escaped


def test_untrusted_model_name_escaped(history):
    out, pages, _ = history
    page = (out / "reports" / SHA_A / "index.html").read_text()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;m" in page
    for p in [pages.index, *pages.commit_pages]:
        assert "<script" not in p.read_text(), p


def test_commit_page_links_run_report(history):
    out, _, _ = history
    page = out / "reports" / SHA_B / "index.html"
    hrefs = re.findall(r'href="([^"]+)"', page.read_text())
    reports = [h for h in hrefs if h.endswith("report.html")]
    assert reports == ["../../runs/r1-b/report.html"]
    assert (page.parent / unquote(reports[0])).resolve() == out / "runs" / "r1-b" / "report.html"
    # the run without a report.html says so instead of linking
    dirty = (out / "reports" / f"{SHA_A}-dirty" / "index.html").read_text()
    assert "no report.html" in dirty and "report.html\"" not in dirty


def test_run_reports_untouched_and_rebuild_keeps_pages(history):
    out, _, _ = history
    report = out / "runs" / "r1-b" / "report.html"
    assert report.read_text() == "<html>report of r1-b</html>"
    stale = out / "reports" / "0123abc" / "index.html"
    stale.parent.mkdir()
    stale.write_text("an older page")
    build_history(out)
    assert stale.read_text() == "an older page"  # nothing is deleted
    assert report.read_text() == "<html>report of r1-b</html>"


def test_malformed_result_skipped_with_warning(history):
    out, pages, log = history
    bad = out / "runs" / "r4-bad" / "result.json"
    assert [p for p, _ in pages.skipped] == [bad]
    assert "warning" in log and "r4-bad" in log and "skipped" in log
    assert "r4-bad" in pages.index.read_text()  # listed on the index too


def test_non_hex_sha_never_becomes_a_folder(tmp_path):
    out = tmp_path / "out"
    _write(out, "r1", _result("../../../escape", created="2026-01-01T00:00:00Z"))
    buf = io.StringIO()
    pages = build_history(out, Console(file=buf, width=300))
    assert pages.commit_pages == [out / "reports" / "nogit" / "index.html"]
    assert not (tmp_path / "escape").exists()
    assert "not hex" in buf.getvalue()


def test_series_combine_runs_of_one_commit(tmp_path):
    out = tmp_path / "out"
    t = "2026-01-01T0{}:00:00+00:00"
    # commit B: three runs, decode 100/300/200 at c=512 -> median 200; KL 1e-3 at 512 and
    # 4e-3 at 2048 in one run, 2e-3 in another -> max 4e-3
    _write(out, "b1", _result(SHA_B, created=t.format(1), decode=(100.0, 50.0), kl=(1e-3, 4e-3)))
    _write(out, "b2", _result(SHA_B, created=t.format(2), decode=(300.0,), kl=(2e-3,)))
    _write(out, "b3", _result(SHA_B, created=t.format(3), decode=(200.0,), kl=(2e-3,)))
    # commit A later, on a CPU: its own series, never joined to the GPU one
    _write(out, "a1", _result(SHA_A, created=t.format(5), decode=(7.0,), gpu=None))
    commits = group_commits([load_run(p)[0] for p in sorted(out.glob("runs/*/result.json"))])
    assert [c.key for c in commits] == [SHA_B, SHA_A]
    dec = decode_series(commits)
    assert dec == {"tiny · engine c=512 · NVIDIA H200": {0: 200.0},
                   "tiny · engine c=2048 · NVIDIA H200": {0: 50.0},
                   "tiny · engine c=512 · CPU": {1: 7.0}}
    kl = error_series(commits, "kl_mean")
    assert kl["tiny · engine vs oracle · NVIDIA H200"] == {0: 4e-3}  # greedy 5.0 ignored
    assert error_series(commits, "max_abs")["tiny · engine vs oracle · CPU"] == {1: 0.1}


def test_kernel_table_plots_per_format(tmp_path):
    """A future result["kernels"] list of {format, shape, gb_s} is plotted per format."""
    out = tmp_path / "out"
    k1 = [{"format": "q4_K", "shape": [4096, 4096], "gb_s": 3000.0},
          {"format": "q6_K", "shape": [4096, 4096], "gb_s": 2500.0}]
    k2 = [{"format": "q4_K", "shape": [4096, 4096], "gb_s": 3500.0},
          {"format": "q6_K", "shape": "4096x4096", "gb_s": 2600.0}]
    _write(out, "r1", _result(SHA_B, created="2026-01-01T00:00:00Z", kernels=k1))
    _write(out, "r2", _result(SHA_A, created="2026-01-02T00:00:00Z", kernels=k2))
    pages = build_history(out)
    html = pages.index.read_text()
    assert "kernel GB/s: q4_K" in html and "kernel GB/s: q6_K" in html
    assert len(_pngs(html)) == 5  # decode, KL, max-abs, and one per format
    commits = group_commits([load_run(p)[0] for p in sorted(out.glob("runs/*/result.json"))])
    ks = kernel_series(commits)
    assert ks["q4_K"] == {"4096×4096 · NVIDIA H200": {0: 3000.0, 1: 3500.0}}
    # a list shape and a string shape are different labels: two series for q6_K
    assert sorted(ks["q6_K"]) == ["4096x4096 · NVIDIA H200", "4096×4096 · NVIDIA H200"]
    page = (out / "reports" / SHA_A / "index.html").read_text()
    assert "q4_K" in page and "3500.0" in page


def test_single_commit_still_plots():
    png = trend_plot(["abc1234"], {"s": {0: 5.0}}, "t", "y")
    assert png is not None and png.startswith(b"\x89PNG")
    assert trend_plot(["abc1234"], {"s": {0: 0.0}}, "t", "y", log=True) is None  # nothing drawable
    assert trend_plot(["abc1234"], {}, "t", "y") is None


def test_dollar_in_model_name_is_drawn_as_text(tmp_path):
    """A model named after its file ('m$\\frac$x.gguf' -> m$\\frac$x): '$' would start
    matplotlib mathtext, and a bad formula made the whole history build raise."""
    name = r"m$\frac$x"
    png = trend_plot([f"abc{name}"], {f"{name} · engine c=512 · CPU": {0: 5.0}}, name, "y")
    assert png is not None and png.startswith(b"\x89PNG")
    out = tmp_path / "out"
    _write(out, "r1", _result(SHA_A, created="2026-01-01T10:00:00+00:00", model=name))
    pages = build_history(out, Console(file=io.StringIO()))
    assert len(_pngs(pages.index.read_text())) >= 2


def _docs_out(tmp_path) -> Path:
    """docs/results/*.json.gz (or *.json) laid out as OUT/runs/<name>/result.json.gz (or
    result.json): the history reads either."""
    files = sorted([*DOCS.glob("*.json"), *DOCS.glob("*.json.gz")])
    assert len(files) >= 5, "committed result summaries missing"
    out = tmp_path / "out"
    for f in files:
        d = out / "runs" / json_stem(f)
        d.mkdir(parents=True)
        shutil.copy(f, d / ("result.json.gz" if f.name.endswith(".gz") else "result.json"))
    return out


# git commits of the committed docs/results, in the order of their `created` times
DOCS_COMMITS = ["ad6c779", "5cbbe0737d535c03c0c61d987ad29a3e4ba49f67",
                "7a1f3e0f67e23ba4ccf476456d2d43f30c4e8724+dirty"]


def test_real_results(tmp_path):
    out = _docs_out(tmp_path)
    pages = build_history(out)
    html = pages.index.read_text()
    pos = [html.index(f">{c}</a>") for c in DOCS_COMMITS]
    assert pos == sorted(pos)
    assert len(_pngs(html)) == 3 and not pages.skipped
    # the 1.5B v4 run fails its gate: that commit's verdict
    dirty = (out / "reports" / "7a1f3e0f67e23ba4ccf476456d2d43f30c4e8724-dirty" /
             "index.html").read_text()
    assert "FAIL" in dirty and "591.5" in dirty  # engine decode tok/s at c=512


def test_cli_history_and_single_report(tmp_path, monkeypatch, capsys):
    out = _docs_out(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["report", "--history"]) == 0  # OUT_ROOT defaults to ./out
    assert capsys.readouterr().out.strip() == str(Path("out") / "reports" / "index.html")
    assert (out / "reports" / "index.html").is_file()
    one = result_files(out)[0]
    assert main(["report", str(one)]) == 0  # the single-result form still works
    assert (one.parent / "report.html").is_file()
    assert main(["report"]) == 2
    assert main(["report", str(one), "--history", str(out)]) == 2
    assert main(["report", "--history", str(tmp_path / "nothing")]) == 2
    assert "no run results" in capsys.readouterr().err


def _browser() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    return None


@pytest.mark.parametrize("source", ["synthetic", "docs"])
def test_renders_in_headless_chromium(source, tmp_path, history):
    browser = _browser()
    if browser is None:
        pytest.skip("headless Chromium not installed (Debian: apt install chromium)")
    if source == "docs":
        index = build_history(_docs_out(tmp_path)).index
        shas = DOCS_COMMITS
    else:
        index = history[1].index
        shas = [SHA_B, SHA_A, f"{SHA_A}+dirty"]
    proc = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0",
         "--virtual-time-budget=5000", "--dump-dom", index.as_uri()],
        check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    dom = proc.stdout
    assert "<h1>Run history</h1>" in dom, dom[:500]
    for sha in shas:
        assert sha in dom
    for marker in ("jinja", "Traceback", "UndefinedError", "TemplateSyntaxError", "{{", "{%"):
        assert marker not in dom, marker
    assert "<script" not in dom  # the hostile model name stayed text
    assert len(re.findall(r'<img class="plot"[^>]*src="data:image/png;base64,', dom)) >= 2
    assert "Uncaught" not in proc.stderr
