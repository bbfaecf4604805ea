"""The nodes page from a stored result (`harness report NODES.json`): checked fields, clear errors
for hostile or damaged files, escaping (CPU)."""
from __future__ import annotations

import copy
import json

import pytest

from harness import cli
from reports.nodes_html import MAX_ROWS, clean_nodes_result, render_nodes_html


def _result():
    rows = [{"name": "blk.0.ffn_down", "kind": "gemv", "fmt": "Q4_K", "us": 20.0, "bytes": 61_000_000},
            {"name": "blk.1.ffn_down", "kind": "gemv", "fmt": "Q4_K", "us": 30.0, "bytes": 61_000_000},
            {"name": "output", "kind": "gemv", "fmt": "Q6_K", "us": 50.0, "bytes": 1_000_000_000}]
    return {"schema": "gguf-harness/nodes/1", "created": "2026-12-01", "machine": {"gpu": "x"},
            "model": {"name": "m", "sha256": "ab" * 32},
            "nodes": {"schema": "gguf-harness/nodes/1", "n_ctx": 2048, "n_prompt": 70, "step_us": 110.0,
                      "engine": {"nodes_per_step": 3, "bytes_per_step": 1_122_000_000},
                      "methods": {"graph": {"nodes": rows}}}}


def test_clean_result_reaggregates_the_rows():
    """The sums, shares and gap come from the rows themselves (independent arithmetic here)."""
    m = clean_nodes_result(_result())["nodes"]["methods"]["graph"]
    assert m["sum_us"] == 100.0 and m["gap_us"] == 10.0
    assert [r["pct"] for r in m["nodes"]] == [20.0, 30.0, 50.0]
    assert m["nodes"][2]["gb_s"] == pytest.approx(1e9 / 50e-6 / 1e9)
    assert m["by_op"][0] == {"name": "ffn_down", "n": 2, "us": 50.0, "pct": 50.0}


@pytest.mark.parametrize("edit,says", [
    (lambda d: d.pop("nodes"), "no 'nodes' section"),
    (lambda d: d["nodes"].update(step_us="fast"), "step_us"),
    (lambda d: d["nodes"].update(step_us=float("inf")), "step_us"),
    (lambda d: d["nodes"].update(methods=[]), "no timing method"),
    (lambda d: d["nodes"]["methods"].update(graph={"nodes": []}), "node rows"),
    (lambda d: d["nodes"]["methods"]["graph"]["nodes"].__setitem__(1, "row"), "row 1: us"),
    (lambda d: d["nodes"]["methods"]["graph"]["nodes"][0].update(us=float("nan")), "row 0: us"),
    (lambda d: d["nodes"]["methods"]["graph"]["nodes"][0].update(us=-1.0), "row 0: us"),
    (lambda d: d["nodes"]["methods"]["graph"]["nodes"][0].update(us=True), "row 0: us"),
    (lambda d: d["nodes"]["methods"]["graph"]["nodes"][2].update(bytes="1e9"), "row 2: bytes"),
    (lambda d: d["nodes"]["methods"]["graph"]["nodes"][2].update(bytes=1.5), "row 2: bytes"),
    (lambda d: d["nodes"]["methods"]["graph"].update(nodes=[{"us": 1.0, "bytes": 1}] * (MAX_ROWS + 1)), "node rows"),
])
def test_damaged_results_fail_with_the_field_named(edit, says):
    d = _result()
    edit(d)
    with pytest.raises(ValueError, match=says):
        render_nodes_html(d)


def test_missing_optional_fields_render_as_unknown_and_strings_are_escaped():
    d = _result()
    del d["model"], d["created"], d["nodes"]["engine"], d["nodes"]["n_ctx"]
    d["nodes"]["n_prompt"] = "<i>70</i>"
    d["nodes"]["methods"]["graph"]["nodes"][0]["name"] = "blk.0.<script>alert(1)</script>"
    d["nodes"]["methods"]["graph"]["nodes"][1]["fmt"] = ["Q4_K"]
    html = render_nodes_html(d)
    assert "<script>alert" not in html and "&lt;script&gt;" in html
    assert "n_ctx ?" in html and "prompt ? tokens" in html and "bytes per step 1,122,000,000" in html
    assert "<i>70</i>" not in html


def test_harness_report_renders_a_nodes_json_beside_it(tmp_path, capsys):
    src = tmp_path / "nodes.json"
    src.write_text(json.dumps(_result()))
    assert cli.main(["report", str(src)]) == 0
    page = tmp_path / "nodes.html"
    assert capsys.readouterr().out.strip() == str(page) and "per-layer" in page.read_text()
    other = tmp_path / "sweep-1.json"
    other.write_text(json.dumps(_result()))
    assert cli.main(["report", str(other)]) == 0
    assert (tmp_path / "sweep-1.nodes.html").exists()
    bad = copy.deepcopy(_result())
    bad["nodes"]["step_us"] = None
    other.write_text(json.dumps(bad))
    assert cli.main(["report", str(other)]) == 2
    err = capsys.readouterr().err
    assert "step_us" in err and err.count("\n") == 1


def test_whole_accepts_only_counts():
    """harness.jsonread.whole, the count check of the nodes page and the chain's layout."""
    from harness.jsonread import whole
    assert [whole(v) for v in (0, 3, 2 ** 70)] == [0, 3, 2 ** 70]
    assert all(whole(v) is None for v in (True, False, -1, 1.0, "3", None, float("inf"), [1]))


@pytest.mark.parametrize("switches,shown", [({"GGUF_HARNESS_DIAG": "nowait"}, True), ({"GGUF_HARNESS_DIAG": ""}, False),
                                            ({}, False), ("nowait", False), ({"GGUF_HARNESS_DIAG": ["nowait"]}, False),
                                            ({"GGUF_HARNESS_DIAG": "<b>x</b>"}, True)])
def test_a_diagnostic_build_is_flagged_on_the_page(switches, shown):
    """A result of a timing-only build (GGUF_HARNESS_DIAG, backends/engine/module.py) says so above
    its figures; an unset, empty or malformed switch record shows nothing; the value is escaped."""
    d = _result()
    d["nodes"]["engine"]["switches_effective"] = switches
    html = render_nodes_html(d)
    assert ("Diagnostic build GGUF_HARNESS_DIAG=" in html) == shown
    assert ("(diagnostic build)</title>" in html) == shown
    assert "<b>x</b>" not in html
    if shown and switches["GGUF_HARNESS_DIAG"] == "nowait":
        assert "GGUF_HARNESS_DIAG=nowait: timing only" in html


def test_the_diagnostic_banner_is_bounded_and_falls_back_to_the_switches_set():
    """Without the engine's record of the switch (older results) machine.switches (what was set)
    decides; with it, the engine's record does (it says what ran); a long value is cut to 40
    characters with "…", control and format characters shown as escapes (reports.fmt.visible)."""
    d = _result()
    d["nodes"]["engine"]["switches_effective"] = {"GGUF_HARNESS_GEMV": "q16"}
    d["machine"] = {"switches": {"GGUF_HARNESS_DIAG": "nowait"}}
    assert "GGUF_HARNESS_DIAG=nowait: timing only" in render_nodes_html(d)
    d["nodes"]["engine"]["switches_effective"] = {"GGUF_HARNESS_DIAG": ""}
    assert "Diagnostic build" not in render_nodes_html(d)
    d["nodes"]["engine"]["switches_effective"] = {"GGUF_HARNESS_DIAG": "n\x00o\u202e" + "w" * 100}
    html = render_nodes_html(d)
    assert "GGUF_HARNESS_DIAG=n\\u0000o\\u202e" + "w" * 36 + "…:" in html
    assert "\x00" not in html and "\u202e" not in html


def test_the_page_gives_the_unslowed_windows_of_a_capped_step():
    """A step whose later replay windows ran power-capped (the H200 file of session 30, whose
    shares come from its raw GPU-state readings) gets a line with the unslowed windows' median;
    an uncapped one (session 27, start 2) none; nor one whose windows cannot be judged."""
    from pathlib import Path

    from harness.jsonio import load_json
    sweeps = Path(__file__).resolve().parents[1] / "docs" / "results" / "sweeps"
    capped = load_json(sweeps / "2026-12-02-h200-nodes-27b-s30-1-default-1.json.gz")
    html = render_nodes_html(capped)
    assert "2 of the step&#39;s 3 replay windows ran slowed (power / thermal limit); the 1 unslowed: median 6032.6" in html
    calm = load_json(sweeps / "2026-12-02-h200-nodes-27b-s27-start2-1-default-early1.json.gz")
    assert "replay windows ran slowed" not in render_nodes_html(calm)
    capped["nodes"]["step_samples_slowdown"] = [1.0, 1.0, 1.0]
    capped["nodes"]["step_retakes"] = [{"us": 6050.0, "slowdown": 0.0}, {"us": 6070.0, "slowdown": 0.5}]
    assert ("4 of the step&#39;s 5 replay windows ran slowed (power / thermal limit; 2 of the 5 taken after a "
            "cool-down); the 1 unslowed: median 6050.0") in render_nodes_html(capped)
    capped["nodes"]["step_retakes"] = []
    assert "3 of the step&#39;s 3 replay windows ran slowed (power / thermal limit); none ran unslowed" in render_nodes_html(capped)
    capped["nodes"]["step_samples_slowdown"] = "junk"
    assert "replay windows ran slowed" not in render_nodes_html(capped)
