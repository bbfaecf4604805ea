"""`harness ab`: noise-aware speed verdicts and correctness failures between two results.

Results are small synthetic dicts of schema gguf-harness/run/1 (helpers below) whose bench
times are chosen so the expected verdict follows from the documented rule by hand:
rate = tokens / seconds, delta = median(B) / median(A) - 1, noise = the larger
(max - min) / median, SAME when |delta| <= max(threshold, noise). The last tests run on the
two committed H200 results of the 0.5B model (engine v3 and v4).
"""
from __future__ import annotations

import copy
import hashlib
import json
import struct
from datetime import UTC, datetime
from html.parser import HTMLParser
from pathlib import Path

import pytest

import harness.machine
import harness.results
from harness import ab
from harness.cli import main
from harness.errors import ConfigError

MODEL_SHA = "ab" * 32
EVIL = "<script>alert(1)</script>"
RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
V3 = RESULTS / "2026-11-29-h200-qwen2.5-coder-0.5b-q4_k_m-engine-v3.json.gz"  # stored gzipped
V4 = RESULTS / "2026-11-29-h200-qwen2.5-coder-0.5b-q4_k_m-engine-v4.json.gz"


# ---- synthetic results ------------------------------------------------------------------

def bench_row(backend: str, n_ctx: int, decode_s: list[float],
              prefill_s: list[float] | None = None) -> dict:
    """A bench row as bench_e2e writes it (128 decode steps, 70 prompt tokens)."""
    prefill_s = prefill_s if prefill_s is not None else [0.01, 0.01, 0.01]
    return {"backend": backend, "n_ctx": n_ctx, "n_prompt": 70, "n_decode": 128,
            "reps": len(decode_s), "raw": {"decode_s": decode_s, "prefill_s": prefill_s}}


def run(backend: str, mode: str, n_ctx: int, ids_sha: str = "11" * 32,
        logits_sha: str = "22" * 32, status: str = "ok") -> dict:
    return {"backend": backend, "mode": mode, "n_ctx": n_ctx, "status": status,
            "error": None if status == "ok" else "RuntimeError: boom", "ids": [1, 2, 3],
            "summary": {"ids_sha256": ids_sha, "final_logits_sha256": logits_sha}}


def result(decode_s: list[float] | None = None, name: str = "tiny") -> dict:
    """One engine run pair at c=512, a PASS verdict and (optionally) one bench row."""
    return {
        "schema": "gguf-harness/run/1", "created": "2026-01-01T00:00:00+00:00",
        "machine": {"git": {"sha": "deadbeef", "dirty": False}, "gpu": None},
        "model": {"name": name, "sha256": MODEL_SHA},
        "settings": {"n_predict": 3, "reference": "oracle"},
        "prompt": {"ids": [5, 6, 7], "text": "hi"},
        "reference": {"backend": "oracle", "mode": "greedy", "n_ctx": 512, "status": "ok",
                      "ids": [1, 2, 3], "ids_sha256": "11" * 32,
                      "final_logits_sha256": "33" * 32},
        "runs": [run("engine", "greedy", 512), run("engine", "teacher_forced", 512)],
        "verdicts": [{"backend": "engine", "n_ctx": 512, "verdict": "PASS", "reason": "ok"}],
        "bench": {"rows": [bench_row("engine", 512, decode_s)] if decode_s else [],
                  "errors": []},
    }


def perf(res: ab.ABResult, metric: str = "decode_tok_s") -> ab.PerfRow:
    (row,) = [p for p in res.perf if p.metric == metric]
    return row


def failures(res: ab.ABResult) -> list[tuple[str, str]]:
    return [(c.check, c.state) for c in res.checks if c.failure]


TIGHT = [0.200, 0.2001, 0.2002]  # rate spread ~0.1 %


# ---- performance verdicts ---------------------------------------------------------------

def test_faster():
    res = ab.compare(result(TIGHT), result([0.100, 0.1001, 0.1002]))
    p = perf(res)
    assert p.verdict == "FASTER"
    assert p.delta == pytest.approx(0.2001 / 0.1001 - 1)  # rates 128/t: ratio of median times
    assert p.a_median == pytest.approx(128 / 0.2001)
    assert failures(res) == [] and ab.exit_code(res, fail_on_slower=True) == 0


def test_slower_and_fail_on_slower():
    res = ab.compare(result(TIGHT), result([0.250, 0.2501, 0.2502]))
    p = perf(res)
    assert p.verdict == "SLOWER" and p.delta == pytest.approx(0.2001 / 0.2501 - 1)
    assert ab.exit_code(res) == 0  # slower is not a correctness failure ...
    assert ab.exit_code(res, fail_on_slower=True) == 1  # ... unless asked


def test_same_within_noise():
    # A's rates 640, 581.8, 533.3: spread (640 - 533.3) / 581.8 = 18.3 %; B 5 % faster
    noisy = [0.20, 0.22, 0.24]
    faster5 = [t / 1.05 for t in noisy]
    p = perf(ab.compare(result(noisy), result(faster5)))
    assert p.delta == pytest.approx(0.05)
    assert p.noise == pytest.approx((640 - 128 / 0.24) / (128 / 0.22))
    assert p.verdict == "SAME"
    # the same 5 % with tight samples is a real change
    tight5 = [t / 1.05 for t in TIGHT]
    assert perf(ab.compare(result(TIGHT), result(tight5))).verdict == "FASTER"


def test_threshold():
    b = result([t / 1.03 for t in TIGHT])  # 3 % faster, noise ~0.1 %
    assert perf(ab.compare(result(TIGHT), b)).verdict == "FASTER"  # default 2 %
    p = perf(ab.compare(result(TIGHT), b, threshold=0.05))
    assert p.verdict == "SAME" and p.tolerance == pytest.approx(0.05)


def test_unknown_with_too_few_samples():
    p = perf(ab.compare(result(TIGHT), result([0.1, 0.1])))
    assert p.verdict == "UNKNOWN" and p.b_n == 2
    assert p.delta == pytest.approx(0.2001 / 0.1 - 1)  # still reported, not judged


def test_unknown_with_non_finite_noise():
    p = perf(ab.compare(result(TIGHT), result([0.1, 0.0, 0.1])))  # a zero time: no rate
    assert p.verdict == "UNKNOWN"


def test_prefill_rates_from_prompt_tokens():
    a, b = result(TIGHT), result(TIGHT)
    b["bench"]["rows"][0]["raw"]["prefill_s"] = [0.005, 0.005, 0.005]
    p = perf(ab.compare(a, b), "prefill_tok_s")
    assert p.a_median == pytest.approx(70 / 0.01) and p.b_median == pytest.approx(70 / 0.005)
    assert p.verdict == "FASTER"


def test_bench_row_missing_or_crashed_in_b():
    b = result(None)
    p = perf(ab.compare(result(TIGHT), b))
    assert p.verdict == "UNKNOWN" and p.note == "missing in B"
    b["bench"]["errors"] = [{"backend": "engine", "n_ctx": 512, "error": "BackendCrash: died"}]
    res = ab.compare(result(TIGHT), b)
    assert ("bench", "failed") in failures(res) and ab.exit_code(res) == 1


# ---- correctness ------------------------------------------------------------------------

def test_identical_results_have_no_failure():
    res = ab.compare(result(TIGHT), result(TIGHT))
    assert failures(res) == [] and ab.exit_code(res) == 0
    states = {(c.check, c.backend, c.mode) for c in res.checks if c.state == "same"}
    assert ("ids_sha256", "oracle", "greedy") in states
    assert ("final_logits_sha256", "engine", "teacher_forced") in states


def test_ids_sha_change_is_failure():
    b = result(TIGHT)
    b["runs"][0]["summary"]["ids_sha256"] = "99" * 32
    res = ab.compare(result(TIGHT), b)
    (row,) = [c for c in res.checks if c.failure]
    assert (row.check, row.backend, row.mode, row.state) == ("ids_sha256", "engine", "greedy",
                                                             "changed")
    assert ab.exit_code(res) == 1


def test_logits_sha_change_is_failure():
    b = result(TIGHT)
    b["reference"]["final_logits_sha256"] = "44" * 32
    assert failures(ab.compare(result(TIGHT), b)) == [("final_logits_sha256", "changed")]


def test_speculative_reference_logits_sha_is_not_comparable_but_its_ids_are():
    """A reference verified in batched passes (harness.speculative) sums in another float64
    order than the sequential one: its float32 logits SHA may differ, its ids may not."""
    b = result(TIGHT)
    b["reference"]["speculative"] = {"used": True, "draft": "llamacpp", "passes": 2,
                                     "fed_tokens": 199, "drafted": 130, "accepted": 127}
    b["reference"]["final_logits_sha256"] = "44" * 32
    res = ab.compare(result(TIGHT), b)
    assert failures(res) == []
    assert [c.state for c in res.checks if c.check == "final_logits_sha256"
            and c.backend == "oracle"] == ["not comparable"]
    a = copy.deepcopy(b)  # the same passes on both sides: same order, SHAs must match
    a["reference"]["final_logits_sha256"] = "33" * 32
    assert failures(ab.compare(a, b)) == [("final_logits_sha256", "changed")]
    b["reference"]["ids_sha256"] = "99" * 32
    assert ("ids_sha256", "changed") in failures(ab.compare(result(TIGHT), b))


def test_fail_verdict_in_b():
    b = result(TIGHT)
    b["verdicts"][0]["verdict"] = "FAIL"
    res = ab.compare(result(TIGHT), b)
    assert failures(res) == [("verdict", "failed")] and ab.exit_code(res) == 1


def test_errored_run_in_b():
    b = result(TIGHT)
    b["runs"][1] = run("engine", "teacher_forced", 512, status="error")
    del b["runs"][1]["summary"]
    fails = failures(ab.compare(result(TIGHT), b))
    assert ("status", "failed") in fails and ("final_logits_sha256", "missing in B") in fails


def test_missing_run_in_b():
    b = result(TIGHT)
    del b["runs"][1]
    res = ab.compare(result(TIGHT), b)
    assert failures(res) == [("run", "missing in B")]
    assert [(c.backend, c.mode, c.n_ctx) for c in res.checks if c.failure] == [
        ("engine", "teacher_forced", 512)]


def test_new_run_in_b_is_not_a_failure():
    b = result(TIGHT)
    b["runs"].append(run("llamacpp", "greedy", 512))
    res = ab.compare(result(TIGHT), b)
    assert failures(res) == [] and any(c.state == "new in B" for c in res.checks)


def test_ids_sha_computed_from_ids_when_not_stored():
    ids = [3, 1, 4, 1, 5]
    expected = hashlib.sha256(struct.pack("<5q", *ids)).hexdigest()  # int64 little-endian
    assert ab.run_sha({"ids": ids}, "ids_sha256") == expected
    a, b = result(TIGHT), result(TIGHT)
    for r in (a, b):
        del r["runs"][0]["summary"]["ids_sha256"]
    b["runs"][0]["ids"] = [1, 2, 4]
    assert failures(ab.compare(a, b)) == [("ids_sha256", "changed")]


def test_different_model_refused_unless_forced():
    b = result(TIGHT)
    b["model"]["sha256"] = "cd" * 32
    b["runs"][0]["summary"]["ids_sha256"] = "99" * 32
    with pytest.raises(ConfigError, match="model SHA256"):
        ab.compare(result(TIGHT), b)
    res = ab.compare(result(TIGHT), b, force=True)
    assert not res.comparable and failures(res) == []
    assert [c.state for c in res.checks if c.check == "ids_sha256" and c.mode == "greedy"
            and c.backend == "engine"] == ["not comparable"]


def test_different_prompt_refused():
    b = result(TIGHT)
    b["prompt"]["ids"] = [5, 6, 8]
    with pytest.raises(ConfigError, match="prompt"):
        ab.compare(result(TIGHT), b)


def test_different_reference_backend_refused():
    b = result(TIGHT)
    b["settings"]["reference"] = "llamacpp"
    with pytest.raises(ConfigError, match="reference backend"):
        ab.compare(result(TIGHT), b)


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf")])
def test_bad_threshold(bad):
    with pytest.raises(ConfigError, match="threshold"):
        ab.compare(result(TIGHT), result(TIGHT), threshold=bad)


# ---- command line -----------------------------------------------------------------------

def _write(tmp_path: Path, name: str, obj) -> Path:
    path = tmp_path / name
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return path


def _cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(["ab", *map(str, argv)])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def test_cli_exit_codes(tmp_path, capsys):
    a = _write(tmp_path, "a.json", result(TIGHT))
    same = _write(tmp_path, "same.json", result([0.2001, 0.2, 0.2002]))
    slower = _write(tmp_path, "slower.json", result([0.3, 0.3001, 0.3002]))
    changed = result(TIGHT)
    changed["runs"][0]["summary"]["ids_sha256"] = "99" * 32
    changed = _write(tmp_path, "changed.json", changed)
    assert _cli(capsys, a, same)[0] == 0
    code, out, _ = _cli(capsys, a, slower)
    assert code == 0 and "SLOWER" in out
    assert _cli(capsys, a, slower, "--threshold", "0.05", "--fail-on-slower")[0] == 1
    code, out, _ = _cli(capsys, a, changed)
    assert code == 1 and "FAILURE" in out


def test_cli_bad_input_exit_2(tmp_path, capsys):
    a = _write(tmp_path, "a.json", result(TIGHT))
    other = copy.deepcopy(result(TIGHT))
    other["schema"] = "gguf-harness/sweep/1"
    other_model = result(TIGHT)
    other_model["model"]["sha256"] = "cd" * 32
    cases = [tmp_path / "missing.json", _write(tmp_path, "x.json", "{not json"),
             _write(tmp_path, "list.json", [1, 2]), _write(tmp_path, "o.json", other),
             _write(tmp_path, "m.json", other_model)]
    for b in cases:
        code, _, err = _cli(capsys, a, b)
        assert code == 2, b
        assert err.startswith("error:") and "Traceback" not in err
        assert len(err.strip().splitlines()) == 1, err
    assert _cli(capsys, a, tmp_path / "m.json", "--force")[0] == 0


def test_cli_formats(tmp_path, capsys):
    a = _write(tmp_path, "a.json", result(TIGHT))
    b = _write(tmp_path, "b.json", result([0.1, 0.1001, 0.1002]))
    code, out, _ = _cli(capsys, a, b, "--format", "json")
    doc = json.loads(out)
    assert code == 0 and doc["schema"] == "gguf-harness/ab/1" and doc["counts"]["FASTER"] == 1
    assert doc["a"]["path"] == str(a) and doc["exit_code"] == 0
    code, out, _ = _cli(capsys, a, b, "--format", "md")
    assert "| decode tok/s | engine | 512 |" in out and "FASTER" in out


def test_cli_says_why_there_is_no_performance_table(tmp_path, capsys):
    """Two results without bench rows (a CPU `harness run`): a line saying speed was not
    compared, not an empty table."""
    a = _write(tmp_path, "a.json", result())
    b = _write(tmp_path, "b.json", result())
    for fmt in ("table", "md"):
        code, out, _ = _cli(capsys, a, b, "--format", fmt)
        assert code == 0 and "no bench rows" in out, fmt
        assert "metric" not in out, fmt  # no header of an empty performance table


class _Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.srcs = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.srcs += [v for k, v in attrs if k in ("src", "href")]


def test_html_escapes_model_name(tmp_path, capsys):
    a = _write(tmp_path, "a.json", result(TIGHT, name=EVIL))
    b = _write(tmp_path, "b.json", result([0.1, 0.1001, 0.1002], name=EVIL))
    assert _cli(capsys, a, b, "--out", tmp_path / "ab")[0] == 0
    (folder,) = (tmp_path / "ab").iterdir()
    html = (folder / "ab.html").read_text()
    assert EVIL not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    p = _Tags()
    p.feed(html)
    assert "script" not in p.tags and "img" in p.tags  # the chart
    assert p.srcs and all(s.startswith("data:image/png;base64,") for s in p.srcs)
    doc = json.loads((folder / "ab.json").read_text())
    assert doc["a"]["model"] == EVIL and doc["counts"]["FASTER"] == 1


def test_out_never_overwrites(tmp_path, capsys, monkeypatch):
    class Frozen(datetime):  # every folder name gets the same time stamp
        @classmethod
        def now(cls, tz=None):
            return datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    monkeypatch.setattr(harness.results, "datetime", Frozen)
    monkeypatch.setattr(harness.machine, "git_info", lambda: {"sha": "0123456789abc"})
    root = tmp_path / "ab"
    taken = root / "20260102T030405Z-0123456789"
    taken.mkdir(parents=True)
    (taken / "ab.json").write_text("earlier")
    a = _write(tmp_path, "a.json", result(TIGHT))
    for _ in range(2):
        assert _cli(capsys, a, a, "--out", root)[0] == 0
    assert (taken / "ab.json").read_text() == "earlier"
    assert not (taken / "ab.html").exists()
    new = sorted(p.name for p in root.iterdir() if p != taken)
    assert new == [taken.name + "-1", taken.name + "-2"]
    for name in new:
        assert json.loads((root / name / "ab.json").read_text())["failures"] == 0
        assert (root / name / "ab.html").read_text().startswith("<!DOCTYPE html>")


def test_out_is_a_file(tmp_path, capsys):
    a = _write(tmp_path, "a.json", result(TIGHT))
    code, _, err = _cli(capsys, a, a, "--out", a)
    assert code == 2 and f"--out {a} exists and is not a folder" in err  # results.check_out_root


# ---- the committed H200 results of the 0.5B model (engine v3 -> v4) ---------------------

def test_real_results_v3_vs_v4():
    res = ab.compare(ab.load_result(V3), ab.load_result(V4))
    decode = {p.n_ctx: p for p in res.perf if p.backend == "engine" and p.metric == "decode_tok_s"}
    assert set(decode) == {512, 2048}
    for p in decode.values():
        assert p.verdict == "FASTER" and p.delta > 0.5  # v4 decodes ~1.7x as fast as v3
    ids = [c for c in res.checks if c.backend == "llamacpp" and c.check == "ids_sha256"]
    assert len(ids) == 4  # greedy and teacher-forced at 512 and 2048
    assert all(c.state == "same" and not c.failure for c in ids)


def test_md_rows_escape_inline_html_and_pipes():
    from harness.ab_cmd import _md_row
    row = _md_row(["<script>alert(1)</script>", "a|b", "x\ny"])
    assert row == "| &lt;script&gt;alert(1)&lt;/script&gt; | a\\|b | x y |"


def test_md_side_lines_keep_a_model_name_on_one_line():
    """The A/B side lines quote the model name from the file: a newline, a pipe or HTML in it must
    not break the Markdown list (found by a new-user pass, session 14)."""
    from harness.ab_cmd import markdown
    side = {"path": "a.json", "model": "evil\n# heading | <b>x</b>", "model_sha256": "0" * 64,
            "git": "abc", "dirty": False, "created": "now", "switches": {}}
    doc = {"a": side, "b": dict(side), "mismatches": ["model\nname"], "perf": [], "checks": [],
           "exit_code": 0, "failures": 0, "threshold": 0.02, "fail_on_slower": False,
           "counts": {"FASTER": 0, "SLOWER": 0, "SAME": 0, "UNKNOWN": 0}}
    lines = markdown(doc).splitlines()
    assert not any(line.startswith("# heading") for line in lines)
    side_lines = [line for line in lines if line.startswith("- A:") or line.startswith("- B:")]
    assert len(side_lines) == 2 and all("evil # heading \\| &lt;b&gt;x&lt;/b&gt;" in line for line in side_lines)
    assert "- not comparable: model name" in lines


def test_engine_switches_are_shown_and_a_difference_noted():
    from harness.ab_cmd import _sides
    side = {"path": "a.json", "model": "m", "model_sha256": "0" * 64, "git": "abc", "dirty": False,
            "created": "now", "switches": {}}
    same = _sides({"a": side, "b": dict(side)})
    assert not any("different engine switches" in s for s in same)
    diff = _sides({"a": side, "b": dict(side, switches={"GGUF_HARNESS_GEMV": "q8_1"})})
    assert "GGUF_HARNESS_GEMV=q8_1" in diff[1] and any("different engine switches" in s for s in diff)


def test_machine_records_engine_switches_only(monkeypatch):
    from harness import machine
    monkeypatch.setenv("GGUF_HARNESS_GEMV", "q8_1")
    monkeypatch.setenv("GGUF_HARNESS_CACHE", "/some/path")  # a path, not a switch
    monkeypatch.setenv("GGUF_HARNESS_GEMVV", "typo")
    assert machine.machine_info()["switches"] == {"GGUF_HARNESS_GEMV": "q8_1"}


# ---- --fail-on-slower BACKENDS: which backends' SLOWER sets the exit code -----------------

def two_backends(engine_s: list[float], llamacpp_s: list[float]) -> dict:
    """result() with a llama.cpp run pair, PASS verdict and bench row next to the engine's."""
    res = result(engine_s)
    res["runs"] += [run("llamacpp", "greedy", 512, ids_sha="55" * 32),
                    run("llamacpp", "teacher_forced", 512, ids_sha="55" * 32)]
    res["verdicts"].append({"backend": "llamacpp", "n_ctx": 512, "verdict": "PASS",
                            "reason": "ok"})
    res["bench"]["rows"].append(bench_row("llamacpp", 512, llamacpp_s))
    return res


SLOW = [0.250, 0.2501, 0.2502]  # 20 % slower than TIGHT, noise ~0.1 %


def test_fail_on_slower_per_backend():
    res = ab.compare(two_backends(TIGHT, TIGHT), two_backends(TIGHT, SLOW), threshold=0.05)
    v = {p.backend: p.verdict for p in res.perf if p.metric == "decode_tok_s"}
    assert v == {"engine": "SAME", "llamacpp": "SLOWER"} and res.failures == 0
    assert ab.exit_code(res) == 0
    assert ab.exit_code(res, fail_on_slower=True) == 1           # bare: any backend
    assert ab.exit_code(res, fail_on_slower="all") == 1
    assert ab.exit_code(res, fail_on_slower=("all",)) == 1
    assert ab.exit_code(res, fail_on_slower=["engine"]) == 0     # the reference's SLOWER: shown only
    assert ab.exit_code(res, fail_on_slower="engine") == 0
    assert ab.exit_code(res, fail_on_slower="engine,llamacpp") == 1
    assert ab.exit_code(res, fail_on_slower=["oracle", "llamacpp"]) == 1
    assert ab.exit_code(res, fail_on_slower=()) == 0 and ab.exit_code(res, None) == 0
    assert res.count("SLOWER") == 1  # still counted
    res = ab.compare(two_backends(TIGHT, TIGHT), two_backends(SLOW, TIGHT), threshold=0.05)
    assert ab.exit_code(res, fail_on_slower=["engine"]) == 1     # the code under test: gates
    assert ab.exit_code(res, fail_on_slower=["llamacpp"]) == 0


def test_reference_correctness_fails_whatever_the_speed_gate():
    b = two_backends(TIGHT, TIGHT)
    b["runs"][2]["summary"]["ids_sha256"] = "99" * 32  # llama.cpp's greedy ids changed
    res = ab.compare(two_backends(TIGHT, TIGHT), b)
    assert failures(res) == [("ids_sha256", "changed")]
    assert ab.exit_code(res, fail_on_slower=["engine"]) == 1 and ab.exit_code(res) == 1
    b = two_backends(TIGHT, TIGHT)
    b["verdicts"][1]["verdict"] = "FAIL"
    assert ab.exit_code(ab.compare(two_backends(TIGHT, TIGHT), b), ["engine"]) == 1
    b = two_backends(TIGHT, TIGHT)
    b["bench"]["rows"].pop()  # llama.cpp crashed while timed
    b["bench"]["errors"] = [{"backend": "llamacpp", "n_ctx": 512, "error": "BackendCrash"}]
    assert ab.exit_code(ab.compare(two_backends(TIGHT, TIGHT), b), ["engine"]) == 1


@pytest.mark.parametrize("text,want", [
    ("engine", ("engine",)), ("engine,llamacpp", ("engine", "llamacpp")),
    (" llamacpp , engine,llamacpp", ("llamacpp", "engine")), ("all", ("all",)),
    ("oracle", ("oracle",)),
])
def test_parse_slower_backends(text, want):
    assert ab.parse_slower_backends(text) == want


@pytest.mark.parametrize("text,msg", [
    ("engnie", "unknown backend 'engnie'"), ("", "empty"), ("engine,", "empty"),
    ("all,engine", "stands alone"), ("a.json", "unknown backend"),
])
def test_parse_slower_backends_refuses(text, msg):
    with pytest.raises(ConfigError, match=msg):
        ab.parse_slower_backends(text)


def test_cli_fail_on_slower_backends(tmp_path, capsys):
    a = _write(tmp_path, "a.json", two_backends(TIGHT, TIGHT))
    b = _write(tmp_path, "b.json", two_backends(TIGHT, SLOW))
    code, out, _ = _cli(capsys, a, b, "--threshold", "0.05", "--fail-on-slower", "engine")
    assert code == 0 and "not gated" in out
    assert "1 SLOWER (0 gating)" in out and "--fail-on-slower engine); exit 0" in out
    code, out, _ = _cli(capsys, a, b, "--threshold", "0.05", "--fail-on-slower")
    assert code == 1 and "not gated" not in out and "1 SLOWER (1 gating)" in out
    assert "--fail-on-slower); exit 1" in out
    assert _cli(capsys, a, b, "--fail-on-slower=all")[0] == 1
    assert _cli(capsys, a, b, "--fail-on-slower=engine,llamacpp")[0] == 1
    assert _cli(capsys, a, b, "--fail-on-slower", "llamacpp", "--threshold", "0.05")[0] == 1
    code, out, _ = _cli(capsys, a, b, "--fail-on-slower", "engine", "--format", "json")
    doc = json.loads(out)
    assert code == 0 and doc["fail_on_slower"] is True
    assert doc["fail_on_slower_backends"] == ["engine"] and doc["counts"]["SLOWER"] == 1
    gating = {(p["backend"], p["metric"]): p["gating"] for p in doc["perf"]}
    assert gating[("llamacpp", "decode_tok_s")] is False
    assert gating[("engine", "decode_tok_s")] is None  # not SLOWER
    doc = json.loads(_cli(capsys, a, b, "--format", "json")[1])
    assert doc["fail_on_slower"] is False and doc["fail_on_slower_backends"] is None
    assert all(p["gating"] is None for p in doc["perf"])
    code, out, _ = _cli(capsys, a, b, "--fail-on-slower", "engine", "--format", "md")
    assert code == 0 and "| SLOWER | not gated |" in out


def test_cli_fail_on_slower_bad_names(tmp_path, capsys):
    a = _write(tmp_path, "a.json", two_backends(TIGHT, TIGHT))
    with pytest.raises(SystemExit) as e:
        main(["ab", str(a), str(a), "--fail-on-slower", "engnie"])
    assert e.value.code == 2 and "unknown backend 'engnie'" in capsys.readouterr().err
    # the option before the two files would swallow A as its value: refused with a hint
    with pytest.raises(SystemExit) as e:
        main(["ab", "--fail-on-slower", str(a), str(a)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "put --fail-on-slower after A and B" in err


def test_html_names_the_gated_backends(tmp_path, capsys):
    a = _write(tmp_path, "a.json", two_backends(TIGHT, TIGHT))
    b = _write(tmp_path, "b.json", two_backends(TIGHT, SLOW))
    assert _cli(capsys, a, b, "--threshold", "0.05", "--fail-on-slower", "engine",
                "--out", tmp_path / "ab")[0] == 0
    (folder,) = (tmp_path / "ab").iterdir()
    html = (folder / "ab.html").read_text()
    assert "only SLOWER verdicts of engine fail the comparison" in html
    assert "not gated" in html and 'class="badge PASS"' in html


def test_source_digest_names_the_code_not_the_git_metadata(tmp_path):
    """machine.source_digest: the same tree gives the same digest, an edit of any engine or
    harness source file (or a renamed one) another, and caches, other suffixes and other folders
    none; machine info records it beside the git sha, and `harness ab` notes two results of one
    commit that ran different code (a remote copy of the tree recorded a stale commit as clean)."""
    from harness import machine
    from harness.ab_cmd import _sides
    assert machine.source_digest(tmp_path) is None  # no source file at all
    (tmp_path / "backends" / "engine" / "kernels").mkdir(parents=True)
    (tmp_path / "harness").mkdir()
    (tmp_path / "harness" / "cli.py").write_text("print(1)\n")
    (tmp_path / "backends" / "engine" / "kernels" / "k.cu").write_text("// a kernel\n")
    d0 = machine.source_digest(tmp_path)
    assert d0 and len(d0) == 64 and machine.source_digest(tmp_path) == d0
    (tmp_path / "harness" / "__pycache__").mkdir()
    (tmp_path / "harness" / "__pycache__" / "cli.py").write_text("cached")
    (tmp_path / "harness" / "notes.md").write_text("not code")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "x.py").write_text("elsewhere")
    assert machine.source_digest(tmp_path) == d0
    (tmp_path / "backends" / "engine" / "kernels" / "k.cu").write_text("// a kernel, edited\n")
    d1 = machine.source_digest(tmp_path)
    assert d1 != d0
    (tmp_path / "backends" / "engine" / "kernels" / "k.cu").rename(tmp_path / "backends" / "engine" / "kernels" / "k2.cu")
    assert machine.source_digest(tmp_path) not in (d0, d1)
    info = machine.git_info(tmp_path)  # not a git checkout: no sha, the digest all the same
    assert info["source_sha256"] == machine.source_digest(tmp_path) and info["sha"] is None
    assert machine.machine_info()["git"]["source_sha256"] == machine.source_digest()
    side = {"path": "a.json", "model": "m", "model_sha256": "0" * 64, "git": "abc", "dirty": False,
            "created": "now", "switches": {}, "source": d0}
    assert not any("different source code" in s for s in _sides({"a": side, "b": dict(side)}))
    lines = _sides({"a": side, "b": dict(side, source=d1)})
    assert f"source {d1[:12]}" in lines[1] and any("different source code" in s for s in lines)
    # older results carry no digest: nothing is claimed
    assert not any("different source code" in s for s in _sides({"a": dict(side, source=None), "b": side}))
