"""harness.ab_nodes: A/B of two `harness bench nodes` results (CPU only): the decode step by
its replay spread, node groups by the threshold, structural changes as notes/checks, and the
`harness ab` command on two nodes.json (the H200 files of session 9 among them)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from harness import ab_nodes, bench_nodes
from harness.jsonio import load_json
from harness.bench_nodes import SCHEMA, aggregate

SWEEPS = Path(__file__).resolve().parents[1] / "docs" / "results" / "sweeps"  # stored gzipped


def _doc(nodes, step, samples=None, switches=None, sha="m" * 64):
    """A nodes result: nodes = [(name, fmt, us)], the step time and its replay samples."""
    rows = [{"name": n, "kind": "gemv", "fmt": f, "us": us, "bytes": 1000} for n, f, us in nodes]
    body = {"n_ctx": 2048, "n_prompt": 70, "step_us": step, "methods": {"graph": aggregate(rows, step)}}
    if samples is not None:
        body["step_samples_us"] = samples
    return {"schema": SCHEMA, "machine": {"switches": switches or {}}, "model": {"sha256": sha},
            "nodes": body}


BASE = [("blk.0.ffn_down", "Q4_K", 20.0), ("blk.1.ffn_down", "Q4_K", 20.0),
        ("blk.0.ffn_gate_up", "IQ3_S+IQ3_S", 100.0), ("output", "Q6_K", 300.0)]


def _by_label(res):
    return {p.label.rsplit(" x", 1)[0]: p for p in res.perf}


def test_same_step_and_groups_are_same():
    a = _doc(BASE, 500.0, [499.0, 500.0, 501.0])
    res = ab_nodes.compare_nodes(a, copy.deepcopy(a))
    assert {p.verdict for p in res.perf} == {"SAME"} and not res.checks and not res.notes
    assert res.to_dict()["kind"] == "nodes"


def test_group_sums_and_step_spread_decide():
    """Two ffn_down nodes are one group (their sum); the IQ3_S pair 56 % faster is FASTER; a
    4 % slower step is SAME when the replays spread 5 %, SLOWER when they spread 0.4 %."""
    a = _doc(BASE, 500.0, [490.0, 500.0, 515.0])
    fast = [(n, f, 44.0 if "gate_up" in n else us) for n, f, us in BASE]
    b = _doc(fast, 520.0, [510.0, 520.0, 530.0])
    by = _by_label(ab_nodes.compare_nodes(a, b, threshold=0.02))
    assert by["ffn_gate_up [IQ3_S+IQ3_S]"].verdict == "FASTER"
    assert abs(by["ffn_gate_up [IQ3_S+IQ3_S]"].delta + 0.56) < 1e-9
    assert by["ffn_down [Q4_K]"].a_us == 40.0 and by["ffn_down [Q4_K]"].verdict == "SAME"
    step = by["decode step (graph replay)"]
    assert step.noise == (515.0 - 490.0) / 500.0 and step.verdict == "SAME" and step.note == ""
    b2 = _doc(fast, 520.0, [519.0, 520.0, 521.0])
    a2 = _doc(BASE, 500.0, [499.0, 500.0, 501.0])
    assert _by_label(ab_nodes.compare_nodes(a2, b2))["decode step (graph replay)"].verdict == "SLOWER"


def test_without_samples_the_threshold_decides_and_says_so():
    a, b = _doc(BASE, 500.0), _doc(BASE, 515.0)
    step = _by_label(ab_nodes.compare_nodes(a, b, threshold=0.02))["decode step (graph replay)"]
    assert step.noise is None and step.verdict == "SLOWER" and step.note == ab_nodes.NO_SPREAD
    step = _by_label(ab_nodes.compare_nodes(a, b, threshold=0.05))["decode step (graph replay)"]
    assert step.verdict == "SAME"


def _with_samples(doc, spread):
    """The doc with every graph node given 5 replay samples spanning +-spread/2 of its median."""
    for r in doc["nodes"]["methods"]["graph"]["nodes"]:
        u = r["us"]
        r["us_samples"] = [u * (1 - spread / 2), u * (1 - spread / 4), u, u * (1 + spread / 4), u * (1 + spread / 2)]
    return doc


def test_node_replay_samples_give_groups_and_the_sum_a_spread():
    """With per-node replay samples (us_samples) a group's noise is sqrt(sum of the nodes'
    (slowest - fastest)^2) / sum of medians, the max of A's and B's: the IQ3_S pair (one node)
    3 % slower is SAME when its replays spread 5 %, SLOWER when they spread 0.5 %, and no row
    says 'threshold only'; one node without samples (or without a valid median) leaves its
    group (and the sum) to the threshold again."""
    slow = [(n, f, 103.0 if "gate_up" in n else us) for n, f, us in BASE]
    for spread, want in ((0.05, "SAME"), (0.005, "SLOWER")):
        a = _with_samples(_doc(BASE, 500.0, [499.0, 500.0, 501.0]), spread)
        b = _with_samples(_doc(slow, 500.0, [499.0, 500.0, 501.0]), spread)
        by = _by_label(ab_nodes.compare_nodes(a, b, threshold=0.02))
        row = by["ffn_gate_up [IQ3_S+IQ3_S]"]
        assert abs(row.noise - spread) < 1e-12 and row.verdict == want and row.note == ""
        # the sum: ranges 20 s, 20 s, 100 s (103 s in B), 300 s in quadrature over 440 (443) us
        want_sum = max(spread * (20 ** 2 * 2 + u ** 2 + 300 ** 2) ** 0.5 / (340 + u) for u in (100.0, 103.0))
        assert by["sum of nodes"].note == "" and abs(by["sum of nodes"].noise - want_sum) < 1e-12
    # independent ranges add in quadrature: 2 ffn_down nodes of spread s -> group spread s / sqrt(2)
    a = _with_samples(_doc(BASE, 500.0), 0.04)
    g = ab_nodes.groups(a["nodes"]["methods"]["graph"]["nodes"])["ffn_down [Q4_K]"]
    assert abs(g[2] - 0.04 / 2 ** 0.5) < 1e-12
    bad = dict(a["nodes"]["methods"]["graph"]["nodes"][0], us=float("nan"))
    assert ab_nodes.node_range(bad) is None and ab_nodes.group_noise([bad]) is None
    del a["nodes"]["methods"]["graph"]["nodes"][0]["us_samples"]
    b = _with_samples(_doc(BASE, 500.0), 0.04)
    by = _by_label(ab_nodes.compare_nodes(a, b))
    assert by["ffn_down [Q4_K]"].noise is None and by["ffn_down [Q4_K]"].note == ab_nodes.NO_SPREAD
    assert by["sum of nodes"].note == ab_nodes.NO_SPREAD
    assert by["output [Q6_K]"].note == "" and by["output [Q6_K]"].verdict == "SAME"


def test_structure_changes_are_checks_not_failures_and_switches_are_noted():
    a = _doc(BASE, 500.0, switches={"GGUF_HARNESS_GEMV_KQ_IQ3S": "0"})
    nodes_b = [r for r in BASE if r[0] != "output"] + [("blk.2.ffn_down", "Q4_K", 20.0),
                                                      ("blk.0.qkv", "Q4_K", 9.0)]
    res = ab_nodes.compare_nodes(a, _doc(nodes_b, 480.0))
    states = {(c.shape, c.what): c.state for c in res.checks}
    assert states == {("ffn_down [Q4_K]", "node count"): "count", ("output [Q6_K]", "node group"): "missing",
                      ("qkv [Q4_K]", "node group"): "new"}
    assert res.failures == 0
    assert any("GGUF_HARNESS_GEMV_KQ_IQ3S: 0 -> (unset)" in n for n in res.notes)


def _cli(argv):
    from harness.cli import main
    return main(argv)


def test_cli_on_the_h200_iq3s_ab(tmp_path, capsys):
    """The session-9 H200 pair (IQ3_S on gemv.cu vs on v9, same machine session): the step
    and the IQ3_S group FASTER, the IQ4_XS group SAME; ab.json + ab.html written."""
    a = SWEEPS / "2026-11-30-h200-nodes-27b-s9a-DEFAULT-1.json.gz"
    b = SWEEPS / "2026-11-30-h200-nodes-27b-s9a-KQ_IQ3S-1.json.gz"
    code = _cli(["ab", str(a), str(b), "--format", "json", "--out", str(tmp_path)])
    doc = json.loads(capsys.readouterr().out.split("\nwrote ")[0])
    assert code == 0 and doc["schema"] == "gguf-harness/ab-nodes/1" and doc["kind"] == "nodes"
    by = {p["label"].rsplit(" x", 1)[0]: p for p in doc["perf"]}
    assert by["decode step (graph replay)"]["verdict"] == "FASTER"
    assert by["ffn_gate_up [IQ3_S+IQ3_S]"]["verdict"] == "FASTER"
    assert by["ffn_gate_up [IQ4_XS+IQ4_XS]"]["verdict"] == "SAME"
    (folder,) = tmp_path.iterdir()
    page = (folder / "ab.html").read_text()
    assert "Decode-step A/B comparison" in page and "GGUF_HARNESS_GEMV_KQ_IQ3S=1" in page


def test_cli_refuses_other_models_unless_forced_and_escapes_names(tmp_path, capsys):
    evil = [("blk.0.<script>alert(1)</script>", "Q4_K", 10.0)]
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(_doc(evil, 100.0)))
    pb.write_text(json.dumps(_doc(evil, 100.0, sha="n" * 64)))
    assert _cli(["ab", str(pa), str(pb)]) == 2
    assert "different models" in capsys.readouterr().err
    assert _cli(["ab", str(pa), str(pb), "--force", "--out", str(tmp_path / "o")]) == 0
    (folder,) = (tmp_path / "o").iterdir()
    assert any("different models" in n for n in json.loads((folder / "ab.json").read_text())["notes"])
    page = (folder / "ab.html").read_text()
    assert "<script>alert" not in page and "&lt;script&gt;" in page


def test_cli_refuses_nodes_against_a_run_result(tmp_path, capsys):
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(_doc(BASE, 1.0)))
    pb.write_text(json.dumps({"schema": "gguf-harness/run/1"}))
    assert _cli(["ab", str(pa), str(pb)]) == 2
    assert "bench nodes result with a run result" in capsys.readouterr().err


def test_a_diagnostic_side_compares_the_step_only():
    """GGUF_HARNESS_DIAG on either side (machine.switches or the engine's switches_effective): the
    decode step row alone, with a note naming the side; a slower node group of such a build can
    then not trip --fail-on-slower. Without it every group is compared. Switch values in the
    notes are cut to 60 characters ("…", reports.fmt.visible)."""
    slow = [(n, f, us * 2) for n, f, us in BASE]
    for where in ("machine", "engine"):
        b = _doc(slow, 500.0)
        if where == "machine":
            b["machine"]["switches"] = {"GGUF_HARNESS_DIAG": "nowait"}
        else:
            b["nodes"]["engine"] = {"switches_effective": {"GGUF_HARNESS_DIAG": "nostage"}}
        res = ab_nodes.compare_nodes(_doc(BASE, 500.0), b)
        assert [p.label for p in res.perf] == ["decode step (graph replay)"], where
        assert any("diagnostic build" in n and "B GGUF_HARNESS_DIAG=no" in n for n in res.notes), res.notes
    plain = ab_nodes.compare_nodes(_doc(BASE, 500.0), _doc(slow, 500.0))
    assert any(p.verdict == "SLOWER" for p in plain.perf[1:])
    res = ab_nodes.compare_nodes(_doc(BASE, 500.0, switches={"GGUF_HARNESS_X": "y" * 10_000}), _doc(BASE, 500.0))
    assert any(n.startswith("engine switch GGUF_HARNESS_X: " + "y" * 60 + "… ->") for n in res.notes), res.notes
    assert max(len(n) for n in res.notes) < 200


def test_cli_kernels_ab_names_the_switches_of_each_side(capsys):
    """`harness ab` of two kernels results (session 24's PF0 A/B on the H200): B's header carries
    GGUF_HARNESS_GEMV_KQ_PF0=3 and a note names the change; A's header has no such switch."""
    a = SWEEPS / "2026-12-01-h200-kernels-s24-1-default.json.gz"
    b = SWEEPS / "2026-12-01-h200-kernels-s24-2-pf0-3.json.gz"
    assert _cli(["ab", str(a), str(b), "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert "GGUF_HARNESS_GEMV_KQ_PF0=3" in doc["b"]["settings"] and "PF0" not in doc["a"]["settings"]
    assert "engine switch GGUF_HARNESS_GEMV_KQ_PF0: (unset) -> 3" in doc["notes"]


def test_cli_kernels_ab_of_a_diagnostic_build_says_so(tmp_path, capsys):
    """A kernels result of a GGUF_HARNESS_DIAG build (machine.switches): the A/B notes say its rows
    bound a cost and are not a kernel's speed."""
    a = load_json(SWEEPS / "2026-12-01-h200-kernels-s24-1-default.json.gz")
    b = copy.deepcopy(a)
    b["machine"]["switches"] = {"GGUF_HARNESS_DIAG": "nowait"}
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    assert _cli(["ab", str(pa), str(pb), "--format", "json"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert any("diagnostic build (timing only): B GGUF_HARNESS_DIAG=nowait" in n for n in notes), notes


def test_a_switch_set_on_one_side_notes_what_the_unset_side_ran():
    """Session 26's stored pair (start 2: GGUF_HARNESS_GEMV_KQ_PF0_SB unset, which ran 4 then,
    against =8) and a later default run (unset, running 8): the set-variable note says what an
    unset side ran, so neither reads as "no change" once the default is 8."""
    sweep = lambda n: load_json(SWEEPS / f"2026-12-01-h200-nodes-27b-s26-{n}.json.gz")
    a, b, c = sweep("start2-7-default-sb4"), sweep("start2-8-sb8"), sweep("start3-1-default-sb8")
    assert "engine switch GGUF_HARNESS_GEMV_KQ_PF0_SB: (unset) (ran 4) -> 8" in ab_nodes.compare_nodes(a, b).notes
    assert "engine switch GGUF_HARNESS_GEMV_KQ_PF0_SB: 8 -> (unset) (ran 8)" in ab_nodes.compare_nodes(b, c).notes
    d = copy.deepcopy(a)
    d["nodes"]["engine"].pop("switches_effective")  # an older result: no record, no "(ran ...)"
    assert "engine switch GGUF_HARNESS_GEMV_KQ_PF0_SB: (unset) -> 8" in ab_nodes.compare_nodes(d, b).notes


def test_a_changed_default_is_noted_from_the_switches_as_run(tmp_path, capsys):
    """Session 24 (GGUF_HARNESS_GEMV_KQ_PF0 unset: 1 then) against session 25 (unset: 3): the set
    variables are equal, so only the values as run (nodes.engine.switches_effective; a kernels
    result's settings.switches_effective) tell the builds apart, and the A/B notes them once; a
    switch that was also set differently is noted from machine.switches only; a result without
    the record (older kernels results) adds no such note."""
    old = {"GGUF_HARNESS_GEMV_KQ_PF0": "", "GGUF_HARNESS_GEMV_KQ_DQ": "1"}
    new = {"GGUF_HARNESS_GEMV_KQ_PF0": "3", "GGUF_HARNESS_GEMV_KQ_PF0_SB": "4", "GGUF_HARNESS_GEMV_KQ_DQ": "1"}
    a, b = _doc(BASE, 500.0), _doc(BASE, 500.0)
    a["nodes"]["engine"], b["nodes"]["engine"] = {"switches_effective": old}, {"switches_effective": new}
    notes = ab_nodes.compare_nodes(a, b).notes
    assert "engine switch GGUF_HARNESS_GEMV_KQ_PF0 as run: (the default then) -> 3" in notes, notes
    assert "engine switch GGUF_HARNESS_GEMV_KQ_PF0_SB as run: (not recorded) -> 4" in notes, notes
    assert not any("KQ_DQ" in n for n in notes), notes
    b["machine"]["switches"] = {"GGUF_HARNESS_GEMV_KQ_PF0": "3"}
    notes = ab_nodes.compare_nodes(a, b).notes
    assert [n for n in notes if "KQ_PF0:" in n or "KQ_PF0 as run" in n] == [
        "engine switch GGUF_HARNESS_GEMV_KQ_PF0: (unset) -> 3"], notes
    ka = load_json(SWEEPS / "2026-12-01-h200-kernels-s24-1-default.json.gz")
    kb = copy.deepcopy(ka)
    paths = [tmp_path / n for n in ("a.json", "b.json", "c.json")]
    kb["settings"]["switches_effective"] = new
    kc = copy.deepcopy(kb)
    kc["settings"]["switches_effective"] = dict(new, GGUF_HARNESS_GEMV_KQ_PF0="1")
    for p, d in zip(paths, (ka, kb, kc)):
        p.write_text(json.dumps(d))
    assert _cli(["ab", str(paths[0]), str(paths[1]), "--format", "json"]) == 0  # A records none
    assert not any("as run" in n for n in json.loads(capsys.readouterr().out)["notes"])
    assert _cli(["ab", str(paths[2]), str(paths[1]), "--format", "json"]) == 0
    assert "engine switch GGUF_HARNESS_GEMV_KQ_PF0 as run: 1 -> 3" in json.loads(capsys.readouterr().out)["notes"]


def test_malformed_fields_of_either_side_give_no_traceback(tmp_path, capsys):
    """Result files are untrusted: `harness ab` of a nodes or kernels result with a field of the
    wrong JSON type (a string, list or number where a mapping or list belongs: machine,
    machine.switches, settings, settings.switches_effective, rows, model, nodes.engine,
    nodes.methods.graph, step_samples_us) compares what it can with exit 0 or 1, or refuses with
    one error line and exit 2 (a model without its SHA256 is another model), never a traceback (review of session 25: machine.switches as a string crashed the nodes A/B)."""
    k = load_json(SWEEPS / "2026-12-01-h200-kernels-s25-table-run1.json.gz")
    n = load_json(SWEEPS / "2026-12-01-h200-nodes-27b-s25-start2-1-default-pf0-3.json.gz")
    cases = [(k, ("machine",)), (k, ("machine", "switches")), (k, ("settings",)), (k, ("rows",)),
             (k, ("device",)), (n, ("machine", "switches")), (n, ("model",)), (n, ("nodes", "engine")),
             (n, ("nodes", "methods", "graph")), (n, ("nodes", "step_samples_us"))]
    good = tmp_path / "good.json"
    for base, path in cases:
        good.write_text(json.dumps(base))
        for bad in ("text", [1, "x"], 7):
            d = copy.deepcopy(base)
            holder = d
            for key in path[:-1]:
                holder = holder[key]
            holder[path[-1]] = bad
            p = tmp_path / "bad.json"
            p.write_text(json.dumps(d))
            for argv in (["ab", str(good), str(p)], ["ab", str(p), str(good)]):
                try:
                    rc = _cli(argv + ["--format", "json"])
                except Exception as e:  # noqa: BLE001 - the point: nothing may escape
                    raise AssertionError(f"{path} = {bad!r}: {type(e).__name__}: {e}") from e
                err = capsys.readouterr().err
                assert rc in (0, 1) or (rc == 2 and err.startswith("error:")), (path, bad, rc, err)


def _slowed(doc, shares, retakes):
    """shares of the three timed windows, and retaken windows [(us, share)]."""
    doc["nodes"]["step_samples_slowdown"] = shares
    doc["nodes"]["step_retakes"] = [{"us": us, "slowdown": x} for us, x in retakes]
    return doc


def test_unslowed_windows_decide_when_a_side_ran_capped():
    """A power-capped run spreads its step samples (here 3.7 %), so the plain step row calls a
    +0.9 % change SAME; the windows without a slowdown reading (5 each, spread 0.05 %) call it
    SLOWER. The row appears only when a side was slowed and both have unslowed windows; without
    them on one side a note says so."""
    a = _slowed(_doc(BASE, 6243.7, [6032.6, 6262.7, 6243.7]), [0.0, 0.56, 1.0],
                [(6031.6, 0.0), (6033.0, 0.0), (6032.0, 0.0), (6034.0, 0.0)])
    b = _slowed(_doc(BASE, 6271.0, [6087.8, 6271.0, 6281.4]), [0.0, 0.56, 1.0],
                [(6086.9, 0.0), (6089.0, 0.0), (6088.0, 0.0), (6087.0, 0.0)])
    by = _by_label(ab_nodes.compare_nodes(a, b, threshold=0.005))
    assert by["decode step (graph replay)"].verdict == "SAME"
    row = by["decode step, unslowed windows"]
    assert row.verdict == "SLOWER" and row.a_us == 6032.6 and row.b_us == 6087.8 and row.note == "5 / 5 windows"
    assert row.noise == pytest.approx(max((6034.0 - 6031.6) / 6032.6, (6089.0 - 6086.9) / 6087.8))
    calm = _slowed(copy.deepcopy(a), [0.0, 0.0, 0.0], [])
    assert "decode step, unslowed windows" not in _by_label(ab_nodes.compare_nodes(calm, copy.deepcopy(calm)))
    one = _by_label(ab_nodes.compare_nodes(a, _slowed(copy.deepcopy(b), [0.0, 0.5, 1.0], [])))
    assert one["decode step, unslowed windows"].noise is None and "threshold only" in one["decode step, unslowed windows"].note
    # a slowed retake counts as slowed, and its sample is not an unslowed one
    mixed = _slowed(copy.deepcopy(b), [0.0, 0.5, 1.0], [(6300.0, 0.2), (6088.0, 0.0)])
    assert bench_nodes.slowed_windows(mixed["nodes"]) == 3 and bench_nodes.clean_samples(mixed["nodes"]) == [6087.8, 6088.0]
    res = ab_nodes.compare_nodes(a, _slowed(copy.deepcopy(b), [1.0, 1.0, 1.0], []))
    assert "decode step, unslowed windows" not in _by_label(res)
    assert any("no unslowed windows on both sides" in n for n in res.notes)


def test_files_before_session_30_give_their_unslowed_windows_from_the_raw_readings():
    """The H200 A/B of session 30 (CS_BAL=2 against the default, both capped after their first
    window): recorded before bench nodes kept the shares, so ab_nodes derives them from the raw
    GPU-state readings and replay windows; the first windows (6032.6 / 6087.8 us) differ by +0.9 %."""
    a = load_json(SWEEPS / "2026-12-02-h200-nodes-27b-s30-1-default-1.json.gz")
    b = load_json(SWEEPS / "2026-12-02-h200-nodes-27b-s30-2-csbal2-1.json.gz")
    assert bench_nodes.slowed_windows(a["nodes"]) == 2 and bench_nodes.clean_samples(a["nodes"]) == [a["nodes"]["step_samples_us"][0]]
    by = _by_label(ab_nodes.compare_nodes(a, b, threshold=0.005))
    assert by["decode step (graph replay)"].verdict == "SAME"
    row = by["decode step, unslowed windows"]
    assert row.verdict == "SLOWER" and row.delta == pytest.approx(6087.831 / 6032.639 - 1, abs=1e-5)


def test_damaged_window_fields_say_nothing_rather_than_something_wrong():
    """Hand-edited or damaged files (review of session 30): bools and strings are no times or
    shares, shares outside 0..1 are unknown, reasons that are not names are unknown, and lists
    that do not pair up one to one give no unslowed row at all."""
    a = _slowed(_doc(BASE, 6243.7, [6032.6, 6262.7, 6243.7]), [0.0, 0.56, 1.0], [(6031.6, 0.0), (6033.0, 0.0)])
    n = copy.deepcopy(a)["nodes"]
    n["step_samples_us"] = [True, "6000", 6243.7]
    assert bench_nodes.windows(n) == [(6243.7, 1.0), (6031.6, 0.0), (6033.0, 0.0)]
    n = copy.deepcopy(a)["nodes"]
    n["step_samples_slowdown"] = [False, "0.75", 5.0]
    assert bench_nodes.windows(n)[:3] == [(6032.6, None), (6262.7, None), (6243.7, None)]
    assert bench_nodes.slowed_windows(n) == 0 and bench_nodes.clean_samples(n) == [6031.6, 6033.0]
    n = copy.deepcopy(a)["nodes"]
    n["step_samples_slowdown"] = [0.0] * 100000
    assert bench_nodes.windows(n) == [] and bench_nodes.slowed_windows(n) == 0
    # an older file: windows shifted by one against the samples, reasons that are not names
    old = load_json(SWEEPS / "2026-12-02-h200-nodes-27b-s30-1-default-1.json.gz")
    shifted = copy.deepcopy(old)
    shifted["nodes"]["step_windows"] = [[0.0, 1.0]] + shifted["nodes"]["step_windows"]
    assert bench_nodes.windows(shifted["nodes"]) == []
    odd = copy.deepcopy(old)
    for r in odd["nodes"]["gpu_state"]["samples"]:
        r["reasons"] = [r["reasons"]]
    assert [x for _, x in bench_nodes.windows(odd["nodes"])] == [None, None, None]
    assert "decode step, unslowed windows" not in _by_label(ab_nodes.compare_nodes(odd, copy.deepcopy(old)))
