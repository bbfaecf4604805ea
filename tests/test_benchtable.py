"""llama-bench style table (harness.benchtable, `harness bench-table`, report section).

Expected figures are computed here from the raw per-repetition seconds (n_tokens / s per
repetition, then mean and n-1 stdev, as llama-bench's avg_ts / stddev_ts), or designed into
synthetic inputs (seconds chosen so the rates are 100, 200, 400 tok/s).
"""
from __future__ import annotations

import csv
import io
import json
import math
import re
import statistics
from pathlib import Path

import pytest

from harness import benchtable
from harness.jsonio import load_json
from harness.cli import main
from harness.results import SCHEMA, write_json
from reports import render_html

REAL = (Path(__file__).parent.parent / "docs/results"
        / "2026-11-29-h200-qwen2.5-coder-0.5b-q4_k_m-engine-v4.json.gz")  # stored gzipped
EVIL = "<script>alert(1)</script>"


def _synthetic(name="tiny-model", gpu="Test GPU 80GB"):
    # rates: prefill 64 / [0.64, 0.32, 0.16] = 100, 200, 400; decode 32 / 0.1 = 320 (x3)
    rows = [{"backend": "llamacpp", "n_ctx": 512, "n_prompt": 64, "n_decode": 32, "reps": 3,
             "raw": {"prefill_s": [0.64, 0.32, 0.16], "decode_s": [0.1, 0.1, 0.1]}},
            {"backend": "engine", "n_ctx": 2048, "n_prompt": 64, "n_decode": 32, "reps": 3,
             "raw": {"prefill_s": [0.32, 0.32, 0.32], "decode_s": [0.2, 0.1, 0.05]}}]
    return {"schema": SCHEMA,
            "model": {"name": name, "size": 3 * 2**30 // 2, "n_params": 1_500_000},
            "machine": {"gpu": {"name": gpu} if gpu else None},
            "settings": {"run": {"n_gpu_layers": 99}}, "bench": {"rows": rows}}


def _by(rows):
    return {(r["backend"], r["ctx"], r["test"]): r for r in rows}


def test_rows_from_synthetic_result():
    rows = _by(benchtable.rows_from_result(_synthetic()))
    assert set(rows) == {("llamacpp (Test GPU 80GB)", 512, "pp64"),
                         ("llamacpp (Test GPU 80GB)", 512, "tg32"),
                         ("engine (Test GPU 80GB)", 2048, "pp64"),
                         ("engine (Test GPU 80GB)", 2048, "tg32")}
    pp = rows[("llamacpp (Test GPU 80GB)", 512, "pp64")]
    assert pp["samples_ts"] == pytest.approx([100, 200, 400])
    assert pp["avg_ts"] == pytest.approx(700 / 3)
    # n-1 stdev of 100, 200, 400 around 233.33: sqrt((133.3^2 + 33.3^2 + 166.7^2) / 2)
    assert pp["stddev_ts"] == pytest.approx(math.sqrt((46666.67) / 2), rel=1e-6)
    assert (pp["n_prompt"], pp["n_gen"], pp["ngl"]) == (64, 0, 99)
    assert (pp["size"], pp["params"]) == (3 * 2**30 // 2, 1_500_000)
    tg = rows[("engine (Test GPU 80GB)", 2048, "tg32")]
    assert tg["avg_ts"] == pytest.approx((160 + 320 + 640) / 3)
    assert (tg["n_prompt"], tg["n_gen"], tg["n_depth"]) == (0, 32, 64)  # decode follows the prefill
    assert tg["ngl"] is None  # n_gpu_layers is a llama.cpp setting only


def test_identical_samples_have_zero_stdev():
    rows = _by(benchtable.rows_from_result(_synthetic()))
    assert rows[("llamacpp (Test GPU 80GB)", 512, "tg32")]["stddev_ts"] == 0.0
    assert rows[("llamacpp (Test GPU 80GB)", 512, "tg32")]["avg_ts"] == pytest.approx(320)
    assert rows[("engine (Test GPU 80GB)", 2048, "pp64")]["stddev_ts"] == 0.0
    assert benchtable.ts_stats([5.0, 5.0, 5.0, 5.0]) == (5.0, 0.0)
    assert benchtable.ts_stats([7.0]) == (7.0, 0.0)  # one sample: 0, as llama-bench


def test_no_gpu_and_odd_rows_are_tolerated():
    res = _synthetic(gpu=None)
    res["bench"]["rows"] += [{"backend": "engine", "n_ctx": 64, "n_prompt": 8, "n_decode": 4,
                              "raw": {"prefill_s": [0.0], "decode_s": "nan"}}, "junk", {}]
    rows = benchtable.rows_from_result(res)
    assert {r["backend"] for r in rows} == {"llamacpp", "engine"}
    assert len(rows) == 4  # the zero-time and malformed rows add nothing
    assert benchtable.rows_from_result({"schema": SCHEMA}) == []
    assert benchtable.rows_from_result({"bench": {"rows": "x"}, "model": 3}) == []


def test_rows_from_real_result():
    raw = load_json(REAL)
    rows = _by(benchtable.rows_from_result(raw))
    gpu = raw["machine"]["gpu"]["name"]
    for backend in ("engine", "llamacpp"):
        for ctx in (512, 2048):
            tg = rows[(f"{backend} ({gpu})", ctx, "tg128")]
            src = next(b for b in raw["bench"]["rows"]
                       if b["backend"] == backend and b["n_ctx"] == ctx)
            secs = src["raw"]["decode_s"]
            rates = [128 / s for s in secs]
            assert tg["avg_ts"] == pytest.approx(sum(rates) / len(rates), rel=1e-12)
            assert tg["avg_ts"] == pytest.approx(128 / statistics.mean(secs), rel=0.01)
            assert tg["avg_ts"] == pytest.approx(128 / statistics.median(secs), rel=0.03)
            assert tg["stddev_ts"] == pytest.approx(statistics.stdev(rates), rel=1e-9)
            pp = rows[(f"{backend} ({gpu})", ctx, "pp70")]
            pre = [70 / s for s in src["raw"]["prefill_s"]]
            assert pp["avg_ts"] == pytest.approx(sum(pre) / len(pre), rel=1e-12)
            assert tg["size"] == raw["model"]["size"] and tg["params"] is None
    assert all(r["ngl"] == 99 for r in rows.values() if r["backend"].startswith("llamacpp"))


# ---- llama-bench files: fields as tools/llama-bench/llama-bench.cpp writes them ---------------

def _lb_record(**over):
    rec = {"build_commit": "abc1234", "build_number": 7000, "cpu_info": "Xeon",
           "gpu_info": "NVIDIA H200",
           "backends": "CUDA", "model_filename": "m.gguf", "model_type": "qwen2 1B Q4_K - Medium",
           "model_size": 491_400_064, "model_n_params": 494_032_768, "n_batch": 2048,
           "n_ubatch": 512,
           "n_threads": 16, "type_k": "f16", "type_v": "f16", "n_gpu_layers": 99, "flash_attn": 1,
           "n_prompt": 512, "n_gen": 0, "n_depth": 0, "test_time": "2026-11-29T10:00:00Z",
           "avg_ns": 30000000, "stddev_ns": 100000, "avg_ts": 17066.67, "stddev_ts": 56.9,
           "samples_ns": [30100000, 29900000], "samples_ts": [17009.97, 17123.74]}
    rec.update(over)
    return rec


LB = [_lb_record(), _lb_record(n_prompt=0, n_gen=128, avg_ts=899.5, stddev_ts=3.25),
      _lb_record(n_prompt=512, n_gen=128, n_depth=4096, avg_ts=2500.0, stddev_ts=0.0)]


def _check_lb_rows(rows):
    assert [r["test"] for r in rows] == ["pp512", "tg128", "pp512+tg128 @ d4096"]
    assert {r["backend"] for r in rows} == {"llama-bench (CUDA)"}
    assert [r["avg_ts"] for r in rows] == [17066.67, 899.5, 2500.0]
    assert rows[1]["stddev_ts"] == 3.25 and rows[0]["samples_ts"] == [17009.97, 17123.74]
    assert rows[0]["model"] == "qwen2 1B Q4_K - Medium" and rows[0]["ngl"] == 99
    assert rows[0]["ctx"] is None and rows[0]["params"] == 494_032_768


def test_llama_bench_json_import(tmp_path):
    p = tmp_path / "lb.json"
    p.write_text(json.dumps(LB, indent=2))
    _check_lb_rows(benchtable.rows_from_llama_bench(p))


def test_llama_bench_jsonl_import(tmp_path):
    p = tmp_path / "lb.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in LB))
    _check_lb_rows(benchtable.rows_from_llama_bench(p))


def test_llama_bench_older_file_without_depth_or_samples(tmp_path):
    rec = _lb_record()
    del rec["n_depth"], rec["samples_ts"]
    p = tmp_path / "old.json"
    p.write_text(json.dumps([rec]))
    (row,) = benchtable.rows_from_llama_bench(p)
    assert row["test"] == "pp512" and row["n_depth"] == 0 and row["samples_ts"] == []


# ---- CLI ------------------------------------------------------------------------------------

def _cli(capsys, *argv):
    code = main(["bench-table", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def result_json(tmp_path):
    p = tmp_path / "result.json"
    write_json(p, _synthetic())
    return p


@pytest.mark.parametrize("content", [
    "this is not json",
    json.dumps([_lb_record(avg_ts=None)]),                # missing rate
    json.dumps([{k: v for k, v in _lb_record().items() if k != "model_type"}]),
    json.dumps([_lb_record(avg_ts="fast")]),              # wrong type
    json.dumps([_lb_record(stddev_ts=-1.0)]),             # a rate is never negative
    json.dumps([_lb_record(n_prompt=-1)]),
    json.dumps([_lb_record(n_prompt=0, n_gen=0)]),
    json.dumps([_lb_record(n_gpu_layers=True)]),
    json.dumps([_lb_record(samples_ts=["x"])]),
    json.dumps({"avg_ts": 1}) + "\n{",                  # jsonl with a broken line
    json.dumps([1, 2]),
    "[" * 100_000 + "]" * 100_000,                      # nesting deeper than the parser's stack
    json.dumps([_lb_record(avg_ts=float("inf"))]),      # Python writes Infinity, not JSON
    b"\xff\xfe[]",
])
def test_malformed_llama_bench_exits_2(result_json, tmp_path, capsys, content):
    p = tmp_path / "bad.json"
    (p.write_bytes if isinstance(content, bytes) else p.write_text)(content)
    code, out, err = _cli(capsys, result_json, "--llama-bench", p)
    assert code == 2 and out == ""
    assert "error:" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "bad.json" in err


def test_llama_bench_file_bounds(result_json, tmp_path, capsys, monkeypatch):
    p = tmp_path / "lb.jsonl"
    p.write_text("".join(json.dumps(_lb_record()) + "\n" for _ in range(5)))
    monkeypatch.setattr(benchtable, "MAX_RECORDS", 4)
    code, _, err = _cli(capsys, result_json, "--llama-bench", p)
    assert code == 2 and "more than 4 records" in err
    monkeypatch.setattr(benchtable, "MAX_RECORDS", 10)
    monkeypatch.setattr(benchtable, "MAX_FILE_BYTES", p.stat().st_size - 1)
    code, _, err = _cli(capsys, result_json, "--llama-bench", p)
    assert code == 2 and "larger than" in err
    code, _, err = _cli(capsys, result_json, "--llama-bench", tmp_path / "missing.json")
    assert code == 2 and "missing.json" in err


def test_cli_bad_result_and_no_rows(tmp_path, capsys):
    code, _, err = _cli(capsys, tmp_path / "nope.json")
    assert code == 2 and "nope.json" in err and "Traceback" not in err
    p = tmp_path / "r.json"
    write_json(p, {"schema": SCHEMA, "model": {"name": "m"}})
    code, _, err = _cli(capsys, p)
    assert code == 2 and "no bench rows" in err
    k = tmp_path / "kernels.json"  # another result kind: named, not "no bench rows"
    write_json(k, {"schema": "gguf-harness/kernels/1", "rows": []})
    code, _, err = _cli(capsys, k)
    assert code == 2 and "gguf-harness/kernels/1" in err and "no bench rows" not in err


def test_cli_md(result_json, tmp_path, capsys):
    lb = tmp_path / "lb.json"
    lb.write_text(json.dumps([_lb_record(model_type="evil | model\nname")]))
    code, out, _ = _cli(capsys, result_json, "--llama-bench", lb)
    assert code == 0
    lines = out.splitlines()
    cells = [c.strip() for c in lines[0].strip("|").split("|")]
    assert cells == ["model", "size", "params", "backend", "ngl", "ctx", "test", "t/s"]
    assert re.fullmatch(r"\|( -+:? \|)+", lines[1])
    assert len(lines) == 2 + 4 + 1  # header, rule, 4 result rows, 1 imported row
    assert all(line.count(" | ") == 7 for line in lines)  # the pipe in the name is escaped
    row = next(line for line in lines if "llamacpp" in line and "pp64" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells == ["tiny-model", "1.50 GiB", "1.50 M", "llamacpp (Test GPU 80GB)", "99", "512",
                     "pp64", "233.33 ± 152.75"]
    last = lines[-1]
    assert "llama-bench (CUDA)" in last and "17066.67 ± 56.90" in last and "468.64 MiB" in last
    assert "\n" not in last and "evil \\| model\\u000aname" in last


def test_cli_csv_parses_back(result_json, tmp_path, capsys):
    lb = tmp_path / "lb.jsonl"
    lb.write_text(json.dumps(_lb_record(model_type='a "quoted", name')) + "\n")
    code, out, _ = _cli(capsys, result_json, "--format", "csv", "--llama-bench", lb)
    assert code == 0
    recs = list(csv.DictReader(io.StringIO(out)))
    assert len(recs) == 5
    expected = benchtable.rows_from_result(_synthetic()) + benchtable.rows_from_llama_bench(lb)
    for got, want in zip(recs, expected):
        assert got["test"] == want["test"] and got["backend"] == want["backend"]
        assert float(got["avg_ts"]) == want["avg_ts"]  # unformatted: round-trips exactly
        assert float(got["stddev_ts"]) == want["stddev_ts"]
    assert recs[-1]["model"] == 'a "quoted", name' and recs[-1]["ctx"] == ""
    assert recs[0]["size"] == str(3 * 2**30 // 2)


def test_cli_json(result_json, capsys):
    code, out, _ = _cli(capsys, result_json, "--format", "json")
    assert code == 0
    rows = json.loads(out)
    assert [r["test"] for r in rows] == ["pp64", "tg32", "pp64", "tg32"]
    assert rows[0]["samples_ts"] == pytest.approx([100, 200, 400])
    assert rows[2]["ngl"] is None and rows[0]["ngl"] == 99


def test_real_result_through_cli(capsys):
    code, out, _ = _cli(capsys, REAL)
    assert code == 0
    assert sum("tg128" in line for line in out.splitlines()) == 4
    assert sum("pp70" in line for line in out.splitlines()) == 4


# ---- report ---------------------------------------------------------------------------------

def _section(html: str, anchor: str) -> str:
    start = html.index(f'id="{anchor}"')
    return html[start:html.index("</table>", start)]


def test_report_has_table_and_escapes_model_name():
    html = render_html(_synthetic(name=EVIL))
    sec = _section(html, "bench-table")
    assert sec.count("<tr>") == 1 + 4
    assert "<th>t/s</th>" in sec and "<th>ctx</th>" in sec
    assert "233.33 ± 152.75" in sec and "tg32" in sec
    assert "<script>" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in sec
    assert 'id="bench-table"' not in render_html({"schema": SCHEMA, "bench": {"rows": []}})


def test_csv_guards_formula_cells(result_json, tmp_path, capsys):
    """Untrusted model names must not become spreadsheet formulas in the CSV."""
    lb = tmp_path / "lb.jsonl"
    lb.write_text(json.dumps(_lb_record(model_type="=HYPERLINK(\"http://x\",\"y\")")) + "\n"
                  + json.dumps(_lb_record(model_type="@SUM(A1)")) + "\n")
    code, out, _ = _cli(capsys, result_json, "--format", "csv", "--llama-bench", lb)
    assert code == 0
    models = [r["model"] for r in csv.DictReader(io.StringIO(out))]
    assert models[-2:] == ["'=HYPERLINK(\"http://x\",\"y\")", "'@SUM(A1)"]
    assert all(not m.startswith(("=", "@", "+", "-")) for m in models)


def test_md_escapes_inline_html(result_json, tmp_path, capsys):
    lb = tmp_path / "lb.jsonl"
    lb.write_text(json.dumps(_lb_record(model_type="<img src=x onerror=alert(1)> & co")) + "\n")
    code, out, _ = _cli(capsys, result_json, "--format", "md", "--llama-bench", lb)
    assert code == 0
    assert "<img" not in out and "&lt;img src=x onerror=alert(1)&gt; &amp; co" in out
