"""harness.ab_kernels: A/B of two `harness bench kernels` results (CPU only)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from harness import ab_kernels as abk
from harness.jsonio import load_json

SWEEPS = Path(__file__).resolve().parents[1] / "docs" / "results" / "sweeps"  # stored gzipped


def _row(name, us, noise=0.005, n=40, ok=True, spec=None):
    return {"name": name, "spec": spec or f"{name}:Q4_K", "label": name, "status": "ok",
            "check": {"ok": ok}, "same_after_timing": True, "roofline_check": True,
            "modes": {"cold_b2b": {"kernel": {"us": us, "noise": noise, "n": n}},
                      "hot": {"kernel": {"us": us * 0.9, "noise": noise, "n": n}}}}


def _doc(rows, **settings):
    return {"schema": abk.KERNELS_SCHEMA, "settings": {"gemv_kq": "wide", **settings},
            "device": {"sm_count": 132}, "rows": rows}


def test_verdicts_follow_threshold_and_noise():
    a = _doc([_row("a", 10.0), _row("b", 10.0), _row("c", 10.0, noise=0.08), _row("d", 10.0)])
    b = _doc([_row("a", 10.1), _row("b", 9.0), _row("c", 10.6, noise=0.01), _row("d", 11.0)])
    res = abk.compare_kernels(a, b, threshold=0.02)
    v = {(p.shape, p.mode): p.verdict for p in res.perf}
    assert v[("a", "cold_b2b")] == "SAME"          # +1 % < 2 %
    assert v[("b", "cold_b2b")] == "FASTER"        # -10 %
    assert v[("c", "cold_b2b")] == "SAME"          # +6 % inside A's 8 % noise
    assert v[("d", "cold_b2b")] == "SLOWER"        # +10 %
    assert res.failures == 0
    assert abk.exit_code(res) == 0 and abk.exit_code(res, fail_on_slower=True) == 1


def test_correctness_changes_fail_whatever_the_speed():
    a = _doc([_row("a", 10.0), _row("b", 10.0), _row("c", 10.0)])
    b = _doc([_row("a", 5.0, ok=False), _row("c", 10.0)])
    b["rows"][1]["same_after_timing"] = False
    b["rows"].append(_row("new", 1.0))
    res = abk.compare_kernels(a, b)
    states = {(c.shape, c.what): c.state for c in res.checks}
    assert states[("a", "oracle check")] == "FAILURE"
    assert states[("b", "shape")] == "FAILURE"                       # missing in B
    assert states[("c", "output after timing = checked")] == "FAILURE"
    assert states[("new", "shape")] == "new"
    assert res.failures == 3 and abk.exit_code(res) == 1
    # a check fixed in B is not a failure
    res2 = abk.compare_kernels(b, a)
    assert {(c.shape, c.what): c.state for c in res2.checks}[("a", "oracle check")] == "fixed"


def test_unknown_on_few_samples_or_a_changed_spec():
    a = _doc([_row("a", 10.0, n=2), _row("b", 10.0)])
    b = _doc([_row("a", 10.0), _row("b", 10.0, spec="b:Q6_K")])
    res = abk.compare_kernels(a, b)
    assert {p.verdict for p in res.perf} == {"UNKNOWN"}


def test_a_mode_timed_in_one_run_only_is_an_unknown_row():
    """A mode in A's row but not B's (another --modes, say) is listed as UNKNOWN with a note, not
    dropped from the table (found by a new-user pass, session 14)."""
    a, b = _doc([_row("a", 10.0)]), _doc([_row("a", 10.0)])
    del b["rows"][0]["modes"]["hot"]
    res = abk.compare_kernels(a, b)
    got = {p.mode: (p.verdict, p.note) for p in res.perf}
    assert got["cold_b2b"][0] == "SAME"
    assert got["hot"] == ("UNKNOWN", "timed in A only")
    assert {p.mode: p.note for p in abk.compare_kernels(b, a).perf}["hot"] == "timed in B only"


def test_settings_difference_is_noted_not_refused():
    res = abk.compare_kernels(_doc([_row("a", 10.0)]), _doc([_row("a", 8.0)], gemv_kq="v9"))
    assert any("gemv_kq" in n for n in res.notes) and res.perf[0].verdict == "FASTER"
    with pytest.raises(ValueError):
        abk.compare_kernels({"schema": "gguf-harness/run/1"}, _doc([]))


def test_h200_same_code_runs_are_same_and_the_prefetch_ab_is_seen():
    """Real results (docs/results/sweeps, H200, session 7): two runs of the same code (PF_AHEAD 2,
    before and after the PF 1 / PF 0 runs) compare SAME on every row; PF 0 against PF 2 is
    FASTER on the output head (454.5 -> 369.2 us) and SLOWER on Q4_K [10240x5120] (18.5 -> 19.9)."""
    load = lambda n: load_json(SWEEPS / f"2026-11-29-h200-kernels-v8-{n}.json.gz")
    same = abk.compare_kernels(load("pf2-a"), load("pf2-b"))
    assert same.perf and {p.verdict for p in same.perf} == {"SAME"} and same.failures == 0
    pf0 = abk.compare_kernels(load("pf2-a"), load("pf0"))
    v = {p.shape: p.verdict for p in pf0.perf}
    assert v["output"] == "FASTER" and v["attn_qkv"] == "SLOWER" and pf0.failures == 0


def test_input_not_modified():
    a = _doc([_row("a", 10.0)])
    a0 = copy.deepcopy(a)
    abk.compare_kernels(a, copy.deepcopy(a))
    assert a == a0


RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results" / "nightly-2026-11-29-h200-s7"


def _cli(argv):
    from harness.cli import main
    return main(argv)


def test_cli_on_two_h200_nightly_bench_runs_is_same_everywhere(tmp_path, capsys):
    """`harness ab` on the kernels.json of the two H200 nightly invocations (same code, all
    10 shapes x 3 modes): every row SAME, exit 0, ab.json + a self-contained ab.html written."""
    a, b = RESULTS / "kernels-inv1-897e202.json.gz", RESULTS / "kernels-inv2-e783cc3.json.gz"
    code = _cli(["ab", str(a), str(b), "--format", "json", "--out", str(tmp_path)])
    doc = json.loads(capsys.readouterr().out.split("\nwrote ")[0])
    assert code == 0 and doc["counts"] == {"FASTER": 0, "SLOWER": 0, "SAME": 30, "UNKNOWN": 0}
    (folder,) = tmp_path.iterdir()
    assert json.loads((folder / "ab.json").read_text())["exit_code"] == 0
    page = (folder / "ab.html").read_text()
    assert "data:image/png;base64," in page and "PASS" in page


def test_cli_escapes_file_strings_and_fails_on_a_broken_check(tmp_path, capsys):
    a = _doc([_row("<script>alert(1)</script>", 10.0)])
    b = _doc([_row("<script>alert(1)</script>", 10.0, ok=False)])
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    assert _cli(["ab", str(pa), str(pb), "--out", str(tmp_path / "o")]) == 1
    (folder,) = (tmp_path / "o").iterdir()
    page = (folder / "ab.html").read_text()
    assert "<script>alert" not in page and "&lt;script&gt;" in page and "FAIL" in page


def test_cli_refuses_a_kernels_result_against_a_run_result(tmp_path, capsys):
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(_doc([_row("a", 1.0)])))
    pb.write_text(json.dumps({"schema": "gguf-harness/run/1"}))
    assert _cli(["ab", str(pa), str(pb)]) == 2
    assert "bench kernels result with a run result" in capsys.readouterr().err


def test_cli_names_the_other_kind_of_document(tmp_path, capsys):
    """A kernels.json against a `harness bench nodes` result (or any other gguf-harness
    document): the message names what the other file is, not "a run result"."""
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(_doc([_row("a", 1.0)])))
    pb.write_text(json.dumps({"schema": "gguf-harness/nodes/1"}))
    assert _cli(["ab", str(pa), str(pb)]) == 2
    err = capsys.readouterr().err
    assert "gguf-harness/nodes/1" in err and "run result" not in err


def test_cli_headers_carry_the_source_digest_and_note_a_stale_git(tmp_path, capsys):
    """Kernel results record machine.git.source_sha256: the headers (table and markdown) show its
    first 12 hex digits, and A and B with one git commit but two digests get a note (the device
    copies of session 18-19 carried a stale commit while other code ran); equal digests, none."""
    def doc(src):
        return {**_doc([_row("q4", 10.0)]),
                "machine": {"git": {"sha": "0364c82", "dirty": True, "source_sha256": src}}}
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(doc("ab" * 32)))
    pb.write_text(json.dumps(doc("cd" * 32)))
    assert _cli(["ab", str(pa), str(pb), "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "source abababababab" in out and "source cdcdcdcdcdcd" in out
    assert "ran different source code" in out
    assert _cli(["ab", str(pa), str(pb), "--format", "md", "--out", str(tmp_path / "o2")]) == 0
    md = capsys.readouterr().out
    assert "source abababababab" in md and "ran different source code" in md
    pb.write_text(json.dumps(doc("ab" * 32)))
    assert _cli(["ab", str(pa), str(pb), "--out", str(tmp_path / "o3")]) == 0
    assert "ran different source code" not in capsys.readouterr().out
