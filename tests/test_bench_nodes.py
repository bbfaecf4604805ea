"""`harness bench nodes`: aggregation, per-layer matrix, HTML page and CLI errors on the CPU;
the timing itself on a GPU (marker gpu)."""
from __future__ import annotations

import pytest

from harness import cli
from harness.bench_nodes import aggregate, layer_matrix, split_name

ROWS = [  # a 2-layer step: made-up times, bytes chosen so GB/s is easy to check by hand
    {"name": "token_embd", "kind": "embed", "fmt": "Q5_0", "us": 1.0, "bytes": 1000},
    {"name": "blk.0.qkv", "kind": "gemv", "fmt": "Q5_0+Q8_0", "us": 4.0, "bytes": 8_000_000},
    {"name": "blk.0.attn", "kind": "attention", "fmt": "", "us": 6.0, "bytes": 0},
    {"name": "blk.1.qkv", "kind": "gemv", "fmt": "Q5_0+Q8_0", "us": 5.0, "bytes": 8_000_000},
    {"name": "blk.1.attn", "kind": "attention", "fmt": "", "us": 4.0, "bytes": 0},
    {"name": "output", "kind": "gemv", "fmt": "Q8_0", "us": 20.0, "bytes": 40_000_000},
]


def test_split_name():
    assert split_name("blk.12.ffn_down") == (12, "ffn_down")
    assert split_name("blk.3.attn.merge") == (3, "attn.merge")
    assert split_name("output") == (None, "output")
    assert split_name("blk.x.qkv") == (None, "blk.x.qkv")


def test_aggregate_totals_groups_and_gap():
    a = aggregate(ROWS, step_us=50.0)
    assert a["sum_us"] == pytest.approx(40.0)
    assert a["gap_us"] == pytest.approx(10.0)
    kinds = {g["name"]: g for g in a["by_kind"]}
    assert kinds["gemv"]["us"] == pytest.approx(29.0) and kinds["gemv"]["n"] == 3
    assert kinds["attention"]["pct"] == pytest.approx(25.0)
    assert [g["name"] for g in a["by_kind"]] == ["gemv", "attention", "embed"]  # largest first
    ops = {g["name"]: g for g in a["by_op"]}
    assert ops["qkv"]["us"] == pytest.approx(9.0) and ops["qkv"]["n"] == 2
    assert a["top"][0]["name"] == "output"
    out = next(r for r in a["nodes"] if r["name"] == "output")
    assert out["gb_s"] == pytest.approx(2000.0)  # 40 MB in 20 us
    assert sum(r["pct"] for r in a["nodes"]) == pytest.approx(100.0)
    assert aggregate(ROWS, None)["gap_us"] is None


def test_aggregate_rejects_empty_and_negative():
    with pytest.raises(ValueError):
        aggregate([], 1.0)
    with pytest.raises(ValueError):
        aggregate([dict(ROWS[0], us=-1.0)], 1.0)


def test_layer_matrix():
    layers, ops, m = layer_matrix(ROWS)
    assert layers == [0, 1] and ops == ["qkv", "attn"]
    assert m == [[4.0, 6.0], [5.0, 4.0]]


def test_nodes_html_escapes_and_embeds_plot():
    from reports.nodes_html import render_nodes_html
    res = {"schema": "gguf-harness/nodes/1", "n_ctx": 512, "n_prompt": 70, "step_us": 50.0,
           "engine": {"nodes_per_step": 6, "bytes_per_step": 56_001_000},
           "methods": {"graph": aggregate(ROWS, 50.0)}}
    html = render_nodes_html({"created": "now", "machine": {"cpu": "x"},
                              "model": {"name": "<script>alert(1)</script>", "sha256": "ab"},
                              "nodes": res})
    assert "<script>alert(1)</script>" not in html and "&lt;script&gt;" in html
    assert "data:image/png;base64," in html
    assert "blk.1.qkv" in html and "50.0" in html
    assert "GPU while the step was timed" not in html  # a result without GPU state (before session 21)
    res["gpu_state"] = {"available": True, "n": 4, "sm_mhz": [1755, 1900, 1980], "mem_mhz": [3201] * 3,
                        "power_w": [500.0, 600.0, 700.0], "power_limit_w": 700.0, "temp_c": [60, 65, 70],
                        "reasons": {"SwPowerCap": 2}, "slowdown": 2}
    html = render_nodes_html({"created": "now", "machine": {}, "model": {"name": "m", "sha256": "ab"}, "nodes": res})
    assert "GPU while the step was timed: SM 1755-1980 MHz (median 1900)" in html
    assert "slowdown in 2 of 4 samples (SwPowerCap 2)" in html


@pytest.mark.parametrize("argv,says", [(["--method", "wall"], "--method"),
                                       (["--method", ""], "--method"),
                                       (["--ctx", "4"], "--ctx"),
                                       (["--prompt-ids", "1,x"], "--prompt-ids"),
                                       (["--prompt-ids", "3,-1"], "--prompt-ids"),
                                       (["--clean-samples", "-1"], "--clean-samples"),
                                       (["--clean-samples", "21"], "--clean-samples")])
def test_cli_bad_arguments_exit_2_before_touching_the_model(argv, says, tmp_path, capsys):
    missing = tmp_path / "missing.gguf"  # never opened: the arguments are checked first
    assert cli.main(["bench", "nodes", *argv, "--model", str(missing), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert says in err and "missing.gguf" not in err
    assert not (tmp_path / "runs").exists()


def test_prompt_ids_replace_the_tokeniser_and_are_checked_against_the_vocabulary(tiny_qwen2_q, tmp_path,
                                                                                  capsys, monkeypatch):
    """--prompt-ids: no llama.cpp tokenising (it would fail here), the ids go to run_nodes as given;
    an id beyond the model's vocabulary (512) is an error before the engine loads (fakes: no GPU)."""
    from harness import bench_cmd, bench_nodes, main_job
    monkeypatch.setattr(bench_cmd, "require_engine", lambda cmd: None)
    monkeypatch.setattr(main_job, "tokenize_prompt", lambda *a: pytest.fail("tokenised"))
    seen = {}

    def fake_run_nodes(model, n_ctx, ids, methods, steps, log, chain, clean):
        seen["ids"], seen["clean"] = ids, clean
        raise bench_cmd.ConfigError("stop here")
    monkeypatch.setattr(bench_nodes, "run_nodes", fake_run_nodes)
    base = ["bench", "nodes", "--model", str(tiny_qwen2_q), "--out", str(tmp_path), "--ctx", "64"]
    assert cli.main(base + ["--prompt-ids", "5, 7,511"]) == 2
    assert seen["ids"] == [5, 7, 511] and seen["clean"] == 4 and "stop here" in capsys.readouterr().err
    seen.clear()
    assert cli.main(base + ["--prompt-ids", "5,512"]) == 2
    assert not seen and "token id 512 is outside the model's vocabulary [0, 512)" in capsys.readouterr().err


@pytest.mark.gpu
def test_run_nodes_on_a_tiny_model(tiny_qwen2_q):
    from gpu_util import cupy_or_skip
    cupy_or_skip()
    from harness.bench_nodes import run_nodes
    from harness.config import ModelRef
    res = run_nodes(ModelRef(tiny_qwen2_q.stem, tiny_qwen2_q), 128, [3, 17, 42, 101], steps=8,
                    log=lambda m: None)
    assert res["step_us"] > 0
    # the chain roofline: one streaming read per step node, every mode timed, cold and chained
    ch = res["chain_roofline"]
    assert ch["n_nodes"] == res["engine"]["nodes_per_step"] and ch["bytes"] >= res["engine"]["bytes_per_step"]
    assert set(ch["modes"]) == {"independent", "dependent", "prefetch", "staged", "staged_prefetch", "staged_bulk",
                              "staged_codes"}
    assert all(v["us"] > 0 and len(v["samples_us"]) == 5 for v in ch["modes"].values())
    assert ch["step_over"]["dependent"] == pytest.approx(res["step_us"] / ch["modes"]["dependent"]["us"])
    for m in ("graph", "eager"):
        a = res["methods"][m]
        assert all(r["us"] > 0 for r in a["nodes"]), m
        assert len(a["nodes"]) == res["engine"]["nodes_per_step"]
        layers, ops, _ = layer_matrix(a["nodes"])
        assert layers and "ffn_down" in ops
        # replay samples (harness/ab_nodes.py judges groups by their spread): the graph method's
        # median of 5, the eager method's single time
        for r in a["nodes"]:
            xs = r["us_samples"]
            assert (len(xs) == 5 and r["us"] == sorted(xs)[2]) if m == "graph" else xs == [r["us"]], (m, r)


def _reading(mono, reasons=(), power=100.0, limit=700.0):
    return {"mono": mono, "reasons": None if reasons is None else list(reasons), "power_w": power, "power_limit_w": limit}


def test_cooled_needs_no_slowdown_and_power_under_half_the_limit():
    from harness.bench_nodes import COOL_POWER, cooled
    assert COOL_POWER == 0.5
    assert cooled(_reading(0, power=350.0)) and not cooled(_reading(0, power=351.0))
    assert not cooled(_reading(0, ["SwPowerCap"], power=100.0))
    assert cooled(_reading(0, ["GpuIdle"], power=100.0))  # idle is no slowdown
    assert not cooled(None) and not cooled({"reasons": None, "power_w": 1.0, "power_limit_w": 700.0})
    assert not cooled(_reading(0, power=None)) and not cooled(_reading(0, limit=0.0))


def test_retake_slowed_only_after_a_slowed_window_and_a_cool_down():
    """bench_nodes.retake_slowed: nothing when no window was slowed or none can be judged; after a
    slowed one, n windows, each started once the latest reading is cooled (polled every 0.1 s of
    a fake clock) or after cool_s seconds of waiting."""
    from harness.bench_nodes import retake_slowed
    clock = [100.0]
    calls = []

    def now():
        return clock[0]

    def sleep(dt):
        clock[0] += dt

    def bench_once():
        calls.append(clock[0])
        clock[0] += 0.5
        return {"decode_s": [0.4], "decode_window": [[clock[0] - 0.4, clock[0]]]}
    windows = [[1.0, 1.4], [2.0, 2.4], [3.0, 3.4]]
    clean = [_reading(1.2), _reading(2.2), _reading(3.2)]
    assert retake_slowed(lambda: clean, bench_once, windows, 4, sleep=sleep, now=now) == [] and not calls
    unknown = [dict(x, reasons=None) for x in clean]
    assert retake_slowed(lambda: unknown, bench_once, windows, 4, sleep=sleep, now=now) == [] and not calls
    hot = [_reading(1.2), _reading(2.2, ["SwPowerCap"], 700.0), _reading(3.2, ["SwPowerCap"], 700.0)]
    assert retake_slowed(lambda: hot, bench_once, windows, 0, sleep=sleep, now=now) == [] and not calls
    # the latest reading cools 1 s after the first poll
    t_cool = clock[0] + 1.0
    readings = lambda: hot + [_reading(clock[0], power=100.0 if clock[0] >= t_cool else 690.0)]
    got = retake_slowed(readings, bench_once, windows, 3, cool_s=5.0, sleep=sleep, now=now)
    assert len(got) == 3 and len(calls) == 3
    assert calls[0] == pytest.approx(t_cool, abs=0.11) and got[0][2] == pytest.approx(1.0, abs=0.11)
    assert got[1][2] == 0.0  # already cool: no wait (the window's own run is not waiting)
    assert all(d == 0.4 and w[1] - w[0] == pytest.approx(0.4) for d, w, _ in got)
    # never cooled: each waits cool_s, then times anyway
    calls.clear()
    never = lambda: hot + [_reading(clock[0], ["SwPowerCap"], 700.0)]
    got = retake_slowed(never, bench_once, windows, 2, cool_s=2.0, sleep=sleep, now=now)
    assert len(got) == 2 and all(t == pytest.approx(2.0, abs=0.11) for _, _, t in got)


def test_windows_pair_each_sample_with_its_windows_slowdown_share():
    """bench_nodes.windows on a file that keeps only raw readings and windows: each sample gets
    the share of slowdown readings inside its window (none inside, or unknown reasons: None), and
    clean_samples keeps those with a share of 0."""
    from harness.bench_nodes import clean_samples, slowed_windows, windows
    readings = [_reading(1.2), _reading(2.2, ["SwPowerCap"]), _reading(2.3), _reading(4.2, None)]
    body = {"step_samples_us": [10.0, 11.0, 12.0, 13.0], "gpu_state": {"samples": readings},
            "step_windows": [[1.0, 1.4], [2.0, 2.4], [3.0, 3.4], [4.0, 4.4]]}
    assert windows(body) == [(10.0, 0.0), (11.0, 0.5), (12.0, None), (13.0, None)]
    assert clean_samples(body) == [10.0] and slowed_windows(body) == 1
