"""`harness bench kernels` on the CPU: shape table and selection, R, the stopping rule on
synthetic sample streams, GB/s and % figures, the oracle verdicts, the roofline's XOR
reference, JSON/HTML/console rendering of a fake result (escaped hostile names), rows of
unsupported formats, CLI errors; the whole command on one small shape on a GPU (marker gpu).
"""
from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as QT

from harness import bench_stats as bs
from harness import cli
from harness.bench_kernels import (
    KernelsConfig,
    base_row,
    mode_figures,
    run_shape,
    unsupported_row,
)
from harness.errors import ConfigError
from harness.kernel_shapes import (
    COLD_BYTES,
    SHAPES,
    check_rows,
    copies_for,
    parse_spec,
    select,
    table,
)
from oracles import actquant
from oracles.gemv_check import check_store, check_swiglu

HOSTILE = "<script>alert(1)</script>[bold]x$\\alpha$"


# -- shape table -----------------------------------------------------------------------------
def test_table_has_the_declared_shapes_with_source_sizes():
    by = {s.name: s for s in table()}
    assert len(by) == len(SHAPES) == 10
    head = by["output"]
    # docs/sources.md §1: output [248320 x 5120] Q6_K = 1,042,944,000 bytes
    assert (head.rows, head.K, head.type_id) == (248320, 5120, int(QT.Q6_K))
    assert head.matrix_bytes == 1_042_944_000
    pair = by["ffn_gate_up"]
    assert pair.n_mats == 2 and pair.mode == "swiglu" and pair.type_id == int(QT.IQ4_XS)
    assert pair.bytes()["weights"] == 2 * 17408 * (5120 // 256) * 136  # block_iq4_xs: 136 B
    down = by["ffn_down"]  # [rows x K]: 5120 outputs of a 17408-long input
    assert (down.rows, down.K, down.fmt) == (5120, 17408, "Q5_K")
    assert {s.fmt for s in by.values()} == {"Q4_K", "Q5_K", "IQ4_XS", "Q6_K", "IQ3_S", "Q8_0", "Q4_0"}
    assert by["attn_k"].rows == 1024 and all(s.source for s in by.values())


def test_bytes_count_weights_input_and_output_once():
    s = parse_spec("64x512:Q8_0")
    b = s.bytes()
    assert b["weights"] == 64 * (512 // 32) * 34      # block_q8_0: fp16 d + 32 int8
    assert b["act"] == 4 * 512 and b["out"] == 4 * 64
    assert b["total"] == b["weights"] + b["act"] + b["out"]
    assert parse_spec("2x64x512:q8_0").bytes()["out"] == 4 * 64  # a pair writes one vector


@pytest.mark.parametrize("spec", ["64x512", "64x512:", "x512:Q4_K", "3x64x512:Q4_K",
                                  "64x512:NOPE", "64x500:Q4_K", "0x512:Q4_K", "64x512:Q4_K;rm",
                                  "1099511627776x1099511627776:Q4_K", "64x2097152:Q4_K"])
def test_bad_specs_are_config_errors(spec):
    with pytest.raises(ConfigError):
        parse_spec(spec)


def test_select_patterns_formats_specs_and_errors():
    assert [s.name for s in select(None)] == [n for n, _, _ in SHAPES]
    assert [s.name for s in select("ffn_down*")] == ["ffn_down", "ffn_down_iq3", "ffn_down_q6"]
    assert [s.name for s in select("ffn_down*", "q6_k")] == ["ffn_down_q6"]
    assert [s.name for s in select("output,output,attn_k")] == ["output", "attn_k"]
    assert [s.name for s in select("64x512:Q4_K, 64x512:Q4_K")] == ["64x512:Q4_K"]  # once: ab keys rows by name
    assert {s.fmt for s in select(None, "Q6_K")} == {"Q6_K"}
    lit = select("attn_k, 2x32x256:Q4_K")
    assert lit[1].n_mats == 2 and lit[1].name == "2x32x256:Q4_K"
    for bad in (dict(shapes_csv="nosuch"), dict(formats_csv="Q9_Z"),
                dict(shapes_csv="square_q8", formats_csv="Q6_K")):
        with pytest.raises(ConfigError):
            select(**bad)


def test_unsupported_rows_follow_the_engine_type_table():
    from backends.engine.formats import ENGINE_TYPES
    pair = next(s for s in table() if s.name == "ffn_gate_up")
    row = unsupported_row(pair, {12: "Q4_K"})
    assert row["status"] == "unsupported" and "IQ4_XS" in row["reason"] and not row["modes"]
    assert unsupported_row(pair, {int(QT.IQ4_XS): "IQ4_XS"}) is None
    for s in table():  # read at run time: whatever the engine has now decides
        assert (unsupported_row(s, ENGINE_TYPES) is None) == (s.type_id in ENGINE_TYPES)


def test_run_shape_reports_unsupported_without_touching_a_gpu(monkeypatch):
    from backends.engine import formats
    monkeypatch.setattr(formats, "ENGINE_TYPES", {0: "F32"})
    row = run_shape(parse_spec("2x64x256:IQ3_S"), KernelsConfig(), None, None, None)
    assert row["status"] == "unsupported" and "IQ3_S" in row["reason"]


# -- R and the oracle subset -------------------------------------------------------------------
@pytest.mark.parametrize("nbytes", [1, 4_325_376, 47_360_000, 999_999_999, 1_000_000_000,
                                    1_042_944_000, 3_000_000_000])
def test_copies_reach_the_cold_target_with_the_fewest_copies(nbytes):
    r = copies_for(nbytes, COLD_BYTES, max_copies=10**12)
    assert r >= 2 and r * nbytes >= COLD_BYTES
    assert r == 2 or (r - 1) * nbytes < COLD_BYTES
    capped = copies_for(nbytes)
    assert 2 <= capped <= 1024 and capped == min(r, 1024)


def test_copies_rejects_empty():
    with pytest.raises(ValueError):
        copies_for(0)


def test_check_rows_all_or_a_subset_with_both_ends():
    rng = np.random.default_rng(0)
    assert check_rows(100, 64, rng, max_values=100 * 64) == list(range(100))
    sub = check_rows(248320, 5120, rng, max_values=1000 * 5120)
    assert len(sub) == len(set(sub)) == 1000 and sub == sorted(sub)
    assert sub[0] == 0 and sub[-1] == 248319


# -- stopping rule and figures -----------------------------------------------------------------
class FakeClock:
    """Wall clock advanced by each sample (dt seconds) so caps are deterministic."""

    def __init__(self, dt: float):
        self.t, self.dt = 0.0, dt

    def __call__(self) -> float:
        return self.t

    def sampler(self, values):
        it = iter(values)

        def sample():
            self.t += self.dt
            return next(it)
        return sample


def test_stop_rule_stops_on_low_noise_after_minimums():
    rule = bs.StopRule(min_samples=10, min_time_s=1e-3, max_noise=0.02, max_time_s=100)
    vals = [1e-4 * (1 + 0.001 * (i % 3)) for i in range(1000)]  # 0.2 % spread
    clock = FakeClock(1e-3)
    samples, verdict = bs.collect(clock.sampler(vals), rule, clock)
    assert verdict == bs.CONVERGED
    assert len(samples) == 10  # 10 x 1e-4 s = 1e-3 s: both minimums met together


def test_stop_rule_waits_for_min_time():
    rule = bs.StopRule(min_samples=2, min_time_s=5e-3, max_noise=0.5, max_time_s=100)
    clock = FakeClock(1e-3)
    samples, verdict = bs.collect(clock.sampler([1e-3] * 100), rule, clock)
    assert verdict == bs.CONVERGED and len(samples) == 5


def test_stop_rule_continues_on_high_noise_then_caps_on_wall_time():
    rule = bs.StopRule(min_samples=5, min_time_s=0, max_noise=0.02, max_time_s=0.5)
    noisy = [1e-4 * (1 + (i % 2)) for i in range(10_000)]  # two values 2x apart
    clock = FakeClock(1e-2)
    samples, verdict = bs.collect(clock.sampler(noisy), rule, clock)
    assert verdict == bs.CAPPED
    assert len(samples) == 50 and bs.noise(samples) > 0.02  # 50 x 10 ms of wall time


def test_stop_rule_caps_on_samples_and_validates():
    rule = bs.StopRule(min_samples=3, min_time_s=0, max_noise=0.01, max_time_s=1e9, max_samples=7)
    clock = FakeClock(0.0)
    samples, verdict = bs.collect(clock.sampler([1.0, 3.0] * 10), rule, clock)
    assert len(samples) == 7 and verdict == bs.CAPPED
    for bad in (dict(min_samples=0), dict(max_noise=0), dict(max_time_s=0), dict(min_time_s=-1)):
        with pytest.raises(ConfigError):
            bs.StopRule(**bad)
    # the message names the flag and the value given (harness bench kernels --max-noise -1)
    with pytest.raises(ConfigError, match=r"--max-noise > 0.*got 0\.05, -1 and 3"):
        bs.StopRule(max_noise=-1)
    for bad in (dict(max_noise=math.nan), dict(min_time_s=math.nan), dict(max_time_s=math.inf)):
        with pytest.raises(ConfigError):  # nan passed every comparison; no stop rule then
            bs.StopRule(**bad)


def test_summarize_percentiles_and_per_launch_division():
    samples = [float(v) * 1e-6 for v in range(1, 12)]  # 1..11 us: p20 3, median 6, p80 9
    s = bs.summarize(samples, bs.CONVERGED, per=1)
    assert (s["us"], s["us_p20"], s["us_p80"]) == pytest.approx((6.0, 3.0, 9.0))
    assert s["noise"] == pytest.approx(1.0) and s["n"] == 11 and s["stop"] == "converged"
    assert bs.summarize(samples, bs.CAPPED, per=3)["us"] == pytest.approx(2.0)
    with pytest.raises(ValueError):
        bs.summarize([], bs.CAPPED)


def test_gb_s_and_percentages():
    assert bs.gb_s(2_000_000_000, 500.0) == pytest.approx(4000.0)  # 2 GB in 0.5 ms
    assert bs.gb_s(1, 0.0) is None and bs.pct(None, 4000.0) is None and bs.pct(1.0, 0) is None
    k = bs.summarize([10e-6] * 5, bs.CONVERGED)
    r = bs.summarize([8e-6] * 5, bs.CONVERGED)
    f = mode_figures(40_000_000, k, r, copy_gbs=4000.0)
    assert f["gb_s"] == pytest.approx(4000.0) and f["roof_gb_s"] == pytest.approx(5000.0)
    assert f["pct_copy"] == pytest.approx(100.0) and f["pct_roofline"] == pytest.approx(80.0)
    assert mode_figures(40, k, r, None)["pct_copy"] is None


def test_config_validation():
    from types import SimpleNamespace

    from harness.bench_kernels_cmd import config_from_args
    args = SimpleNamespace(shapes="attn_k", formats=None, modes="hot", min_samples=5, min_time=0.1,
                           max_noise=0.02, max_time=1.0, cold_bytes=None, max_copies=64, seed=-1)
    with pytest.raises(ConfigError, match="--seed"):
        config_from_args(args)
    with pytest.raises(ConfigError):
        KernelsConfig(modes=("cold_b2b", "warm"))
    with pytest.raises(ConfigError):
        KernelsConfig(max_copies=1)
    assert KernelsConfig().to_json()["rule"]["max_noise"] == bs.StopRule().max_noise


# -- oracle verdicts ---------------------------------------------------------------------------
def _case(rows=40, K=256, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(0, 0.02, (rows, K)), rng.normal(size=K).astype(np.float32)


def test_check_store_passes_float32_kernel_results_and_catches_errors():
    w, x = _case()
    y = (w @ actquant.round_q16(x)).astype(np.float32)  # what a correct q16 kernel returns
    assert check_store(y, w, x)["ok"]
    bad = y.copy()
    bad[17] += 0.01 * np.abs(w[17]).sum()  # one wrong block's worth
    v = check_store(bad, w, x, row_ids=np.arange(100, 140))
    assert not v["ok"] and v["worst_row"] == 117 and v["max_err_over_bound"] > 1
    nan = y.copy()
    nan[3] = np.nan
    assert not check_store(nan, w, x)["ok"]
    unrounded = (w @ x.astype(np.float64)).astype(np.float32)
    assert check_store(unrounded, w, x, impl="f32")["ok"]


def test_check_swiglu():
    wg, x = _case(seed=1)
    wu, _ = _case(seed=2)
    xs = actquant.round_q16(x)
    g, u = wg @ xs, wu @ xs
    y = (g / (1 + np.exp(-g)) * u).astype(np.float32)
    assert check_swiglu(y, wg, wu, x)["ok"]
    y2 = y.copy()
    y2[5] = -y2[5] + 1e-3
    assert not check_swiglu(y2, wg, wu, x)["ok"]


# -- roofline reference --------------------------------------------------------------------------
def test_xor_words_matches_a_plain_loop_and_pad16():
    from harness.roofline import pad16, xor_words
    raw = np.random.default_rng(3).integers(0, 256, 4096, dtype=np.uint8)
    acc = 0
    for (w,) in struct.iter_unpack("<I", raw.tobytes()):
        acc ^= w
    assert xor_words(raw) == acc and xor_words(raw[:0]) == 0
    with pytest.raises(ValueError):
        xor_words(raw[:6])
    assert [pad16(n) for n in (1, 16, 17, 32)] == [16, 16, 32, 32]


# -- rendering ---------------------------------------------------------------------------------
def _fake_result():
    rows = []
    for i, s in enumerate(select("attn_k,square_q8,ffn_gate_up")):
        if s.name == "ffn_gate_up":
            rows.append(unsupported_row(s, {}))
            continue
        r = dict(base_row(s), status="ok", copies=copies_for(s.matrix_bytes), reason=None,
                 check={"ok": True, "max_err_over_bound": 0.05, "rows_checked": s.rows,
                        "rows_total": s.rows, "subset": False})
        k = bs.summarize([(5 + i) * 1e-6] * 10, bs.CONVERGED)
        rf = bs.summarize([4e-6] * 10, bs.CONVERGED)
        r["modes"] = {m: mode_figures(s.bytes()["total"], k, rf, 4000.0) for m in ("cold_b2b", "hot")}
        rows.append(r)
    rows[0]["name"] = HOSTILE
    rows.append(dict(base_row(parse_spec("64x256:Q4_K")), status="failed", reason=HOSTILE))
    return {"schema": "gguf-harness/kernels/1", "created": "now",
            "settings": {"modes": ["cold_b2b", "cold_single", "hot"], "pdl": True, "hot_reps": 20},
            "device": {"copy": {"gb_s": 4000.0}, "l2_bytes": 60 << 20, "flush_bytes": 120 << 20},
            "machine": {"gpu": {"name": HOSTILE}}, "rows": rows}


def test_html_escapes_names_embeds_plots_and_shows_every_status(tmp_path):
    from harness import results
    from reports.kernels_html import (
        render_kernels_html,
        render_kernels_report_from_json,
    )
    res = _fake_result()
    html = render_kernels_html(res)
    assert "<script>alert(1)</script>" not in html and "&lt;script&gt;" in html
    assert html.count("data:image/png;base64,") == 2  # cold_b2b and hot timed, single not
    assert "unsupported" in html and "IQ4_XS" in html and "failed" in html
    assert "square_q8" in html and "[4096x4096] Q8_0" in html
    results.write_json(tmp_path / "kernels.json", res)
    page = render_kernels_report_from_json(tmp_path / "kernels.json")
    assert page.name == "kernels.html" and "&lt;script&gt;" in page.read_text()


def test_html_survives_a_partial_result():
    from reports.kernels_html import render_kernels_html
    html = render_kernels_html({"schema": "gguf-harness/kernels/1",
                                "rows": [{"name": "x", "modes": {"cold_b2b": {"gb_s": "nan"}}}],
                                "settings": {"modes": ["cold_b2b"]}})
    assert "x" in html and "nothing timed" in html


def test_chart_bars_skip_untimed_and_nonfinite_rows():
    from reports.kernel_plots import bandwidth_chart, bars
    res = _fake_result()
    b = bars(res["rows"], "cold_b2b")
    assert [x["fmt"] for x in b] == ["Q6_K", "Q8_0"] and all(x["roof_gb_s"] for x in b)
    assert bars(res["rows"], "cold_single") == []
    png = bandwidth_chart(res["rows"], "cold_b2b", 4000.0, HOSTILE)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_console_table_escapes_markup_and_json_roundtrip(tmp_path):
    from rich.console import Console

    from harness import results
    from harness.bench_kernels_cmd import table as console_table
    res = _fake_result()
    con = Console(record=True, width=400)
    con.print(console_table(res))
    text = con.export_text()
    assert "[bold]x" in text and "unsupported" in text
    results.write_json(tmp_path / "k.json", res)
    back = json.loads((tmp_path / "k.json").read_text())
    assert back["rows"][0]["modes"]["cold_b2b"]["pct_roofline"] == pytest.approx(
        100 * 4.0 / 5.0)


# -- CLI ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv,says", [(["--shapes", "nosuch"], "nosuch"),
                                       (["--modes", "warm"], "modes"),
                                       (["--max-noise", "0"], "noise"),
                                       (["--formats", "Q9"], "Q9")])
def test_cli_bad_arguments_exit_2(argv, says, tmp_path, capsys):
    assert cli.main(["bench", "kernels", *argv, "--out", str(tmp_path)]) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_cli_without_a_gpu_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    from harness import gpu
    from harness.errors import UnsupportedError

    def no_gpu():
        raise UnsupportedError("needs CuPy and a GPU (test)")
    monkeypatch.setattr(gpu, "require_cupy", no_gpu)
    assert cli.main(["bench", "kernels", "--shapes", "attn_k", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "needs a GPU" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


@pytest.mark.gpu
def test_bench_kernels_end_to_end_on_one_small_shape(tmp_path):
    from gpu_util import cupy_or_skip
    cupy_or_skip()
    rc = cli.main(["bench", "kernels", "--shapes", "attn_k", "--cold-bytes", "200000000",
                   "--max-time", "1", "--out", str(tmp_path)])
    assert rc == 0
    (run,) = (tmp_path / "runs").iterdir()
    res = json.loads((run / "kernels.json").read_text())
    (row,) = res["rows"]
    assert row["status"] == "ok" and row["check"]["ok"] and row["roofline_check"]
    assert row["copies"] * row["bytes"]["weights"] >= 200_000_000 and row["same_after_timing"]
    assert res["device"]["copy"]["gb_s"] > 0 and res["device"]["l2_bytes"] > 0
    for m in ("cold_b2b", "cold_single", "hot"):
        f = row["modes"][m]
        assert 0 < f["kernel"]["us_p20"] <= f["kernel"]["us"] <= f["kernel"]["us_p80"]
        assert f["roofline"]["us"] > 0 and f["gb_s"] > 0
    assert (run / "kernels.html").stat().st_size > 1000


# -- the mode logic with a fake device ---------------------------------------------------------
class _Stream:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Node:
    """A launch that costs `us` of fake GPU time on the timer it belongs to."""

    def __init__(self, timer, us: float, name: str):
        self.timer, self.us, self.name = timer, us, name
        self.kernel, self.grid, self.block, self.smem, self.bytes = self, (4,), (256,), 0, 1

    def launch(self, pdl_ok: bool = True):
        self.timer.pending += self.us * 1e-6


class _Timer:
    def __init__(self):
        self.stream, self.pending, self.flushes, self.samples = _Stream(), 0.0, 0, 0

    def time(self, work, before=None):
        if before is not None:
            before()
        self.pending = 0.0
        work()
        self.samples += 1
        return self.pending


class _Case:
    GEMV_US, ROOF_US = 2.0, 1.0

    def __init__(self, shape, copies, seed=0, stream=None, timer=None):
        self.shape, self.copies, self.stream = shape, copies, stream
        self.nodes = [_Node(timer, self.GEMV_US, f"g{i}") for i in range(copies)]
        self.roof = [_Node(timer, self.ROOF_US, f"r{i}") for i in range(copies)]
        self.closed = False

    def check(self, rng, max_values):
        return {"ok": True, "rows_checked": 1}

    def check_roofline(self):
        return True

    def same_as_checked(self):
        return True

    def close(self):
        self.closed = True


class _Graph:
    def __init__(self, launches):
        self.launches = launches

    def launch(self, stream=None):
        for f in self.launches:
            f()


def test_run_shape_modes_with_a_fake_device(monkeypatch):
    from backends.engine import formats
    from harness import gpu_timing, kernel_case
    timer = _Timer()
    monkeypatch.setattr(formats, "ENGINE_TYPES", {int(QT.Q4_K): "Q4_K"})
    monkeypatch.setattr(kernel_case, "GemvCase", lambda *a, **k: _Case(*a, timer=timer, **k))
    monkeypatch.setattr(gpu_timing, "capture", lambda stream, launches: _Graph(list(launches)))

    def flush():
        timer.flushes += 1
    cfg = KernelsConfig(rule=bs.StopRule(min_samples=3, min_time_s=0, max_time_s=60),
                        cold_bytes=10 * 64 * 144, hot_reps=5)
    row = run_shape(parse_spec("64x256:Q4_K"), cfg, timer, flush, copy_gbs=100.0, log=lambda m: None)
    assert row["status"] == "ok" and row["copies"] == 10 and row["same_after_timing"]
    nbytes = row["bytes"]["total"]
    for m in ("cold_b2b", "cold_single", "hot"):  # per launch, whatever the graph length
        f = row["modes"][m]
        assert f["kernel"]["us"] == pytest.approx(_Case.GEMV_US)
        assert f["roofline"]["us"] == pytest.approx(_Case.ROOF_US)
        assert f["pct_roofline"] == pytest.approx(50.0)
        assert f["gb_s"] == pytest.approx(nbytes / _Case.GEMV_US / 1e3)
        assert f["pct_copy"] == pytest.approx(100 * f["gb_s"] / 100.0)
    single = row["modes"]["cold_single"]
    # the flush runs before every cold_single sample (kernel and roofline) and nowhere else
    assert timer.flushes == single["kernel"]["n"] + single["roofline"]["n"]


def test_run_shape_does_not_time_a_failing_kernel(monkeypatch):
    from backends.engine import formats
    from harness import kernel_case
    timer = _Timer()
    case = {}

    class Failing(_Case):
        def check(self, rng, max_values):
            return {"ok": False, "max_err_over_bound": 12.0}

    def make(*a, **k):
        case["c"] = Failing(*a, timer=timer, **k)
        return case["c"]
    monkeypatch.setattr(formats, "ENGINE_TYPES", {int(QT.Q8_0): "Q8_0"})
    monkeypatch.setattr(kernel_case, "GemvCase", make)
    row = run_shape(parse_spec("32x64:Q8_0"), KernelsConfig(), timer, None, 100.0, log=lambda m: None)
    assert row["status"] == "failed" and "not timed" in row["reason"] and not row["modes"]
    assert timer.samples == 0 and case["c"].closed


def test_run_shape_records_an_exception_as_an_error_row(monkeypatch):
    from backends.engine import formats
    from harness import kernel_case

    def boom(*a, **k):
        raise RuntimeError("CUDA_ERROR_ILLEGAL_ADDRESS <b>")
    monkeypatch.setattr(formats, "ENGINE_TYPES", {int(QT.Q8_0): "Q8_0"})
    monkeypatch.setattr(kernel_case, "GemvCase", boom)
    row = run_shape(parse_spec("32x64:Q8_0"), KernelsConfig(), _Timer(), None, 100.0)
    assert row["status"] == "error" and "ILLEGAL_ADDRESS" in row["reason"]
