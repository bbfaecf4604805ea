"""harness.pair_trace.handover (CPU): the hand-over figures of two constructed traces whose answers
are known by construction; the CLI's refusals; on the GPU, a real A -> B pair."""
from __future__ import annotations

import numpy as np
import pytest

from harness import pair_trace as pt

US = 1_000  # ns
T0 = 1_800_000_000_123_456_789  # B's earliest PDL wait return: %globaltimer ns are ~1.8e18 (float64 steps of 256 ns)


def _a():
    # A: 4 SMs, one block of 2 warps per SM; SMs 0 and 1 end 3 us before T0, SMs 2 and 3 0.5 us before
    rows = []
    for sm, end in [(0, T0 - 3 * US), (1, T0 - 3 * US), (2, T0 - US // 2), (3, T0 - US // 2)]:
        for w in range(2):
            rows.append((T0 - 30 * US, T0 - 20 * US, T0 - 18 * US, end - w * 100, sm))
    return np.array(rows, dtype=np.uint64)


def _b(early_end_us=10.0, late_end_us=12.0):
    # B: one block of 2 warps per SM; on SMs 0 / 1 it enters 2.5 us before T0, on 2 / 3 0.2 us before
    rows = []
    for sm in range(4):
        early = sm < 2
        entry = T0 - (2500 if early else 200)
        end = T0 + int((early_end_us if early else late_end_us) * US)
        stage = 1500 if early else 2000
        for w in range(2):
            rows.append((entry + w * 10, T0, T0 + stage, end - w * 50, sm))
    return np.array(rows, dtype=np.uint64)


def test_handover_figures():
    h = pt.handover(_a(), 2, _b(), 2)
    assert h["a_done_to_wait_us"] == pytest.approx(0.5)           # A's last warp 0.5 us before T0
    assert h["a_sm_end_us"][0] == pytest.approx(-3.0) and h["a_sm_end_us"][-1] == pytest.approx(-0.5)
    assert h["b_entry_us"][0] == pytest.approx(-2.5) and h["b_entry_us"][-1] == pytest.approx(-0.2)
    # B enters 0.5 us after A frees SMs 0 / 1 and 0.3 us after SMs 2 / 3
    assert h["b_after_a_sm_us"][0] == pytest.approx(0.3) and h["b_after_a_sm_us"][-1] == pytest.approx(0.5)
    assert h["b_entry_a_end_corr"] == pytest.approx(1.0)
    assert h["b_end_entry_corr"] == pytest.approx(1.0)             # early entry, early end here
    assert h["early"]["blocks"] == 2 and h["late"]["blocks"] == 2
    assert h["early"]["stage_us"] == pytest.approx(1.5) and h["late"]["stage_us"] == pytest.approx(2.0)
    assert h["early"]["end_us"] == pytest.approx(10.0) and h["late"]["end_us"] == pytest.approx(12.0)
    assert h["early"]["loop_us"] == pytest.approx(8.5) and h["late"]["loop_us"] == pytest.approx(10.0)
    assert h["b_span_us"] == pytest.approx(12.0)


def test_no_head_start_gives_a_negative_or_zero_correlation():
    h = pt.handover(_a(), 2, _b(early_end_us=12.0, late_end_us=10.0), 2)
    assert h["b_end_entry_corr"] == pytest.approx(-1.0)
    assert h["early"]["end_us"] > h["late"]["end_us"]


def test_a_threshold_with_no_early_block():
    h = pt.handover(_a(), 2, _b(), 2, early_us=5.0)
    assert h["early"] == {"blocks": 0} and h["late"]["blocks"] == 4
    assert "0" in pt.format_handover("A", "B", h)


def test_format_names_every_figure():
    text = pt.format_handover("5120x6144:Q5_K", "2x17408x5120:IQ4_XS", pt.handover(_a(), 2, _b(), 2))
    for k in ("A's last end per SM", "B block entry", "B entry - A's end", "corr(B entry", "before the wait"):
        assert k in text, k


@pytest.mark.parametrize("bad", [np.zeros((3, 5), np.uint64), np.zeros((4, 4), np.uint64)])
def test_bad_shapes_are_refused(bad):
    with pytest.raises(ValueError):
        pt.handover(bad, 2, _b(), 2)


def test_an_unwritten_mark_is_refused():
    a = _a()
    a[3, 2] = 0
    with pytest.raises(ValueError, match="unwritten"):
        pt.handover(a, 2, _b(), 2)


def test_b_before_a_is_refused():
    with pytest.raises(ValueError, match="does not follow"):
        pt.handover(_b(), 2, _a(), 2)


def test_copies_below_two_exit_2(capsys):
    assert pt.main(["5120x6144:Q5_K", "2x17408x5120:IQ4_XS", "--copies", "1"]) == 2
    assert "--copies" in capsys.readouterr().err


def test_a_bad_spec_is_one_line_exit_2(capsys, tmp_path):
    out = tmp_path / "not-made"
    assert pt.main(["5120x6144", "2x17408x5120:IQ4_XS", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pair_trace: shape '5120x6144'") and "Traceback" not in err
    assert not out.exists()


def test_without_a_gpu_it_exits_2(capsys, tmp_path):
    from gpu_util import no_gpu_or_skip
    no_gpu_or_skip()
    assert pt.main(["5120x6144:Q5_K", "2x17408x5120:IQ4_XS", "--out", str(tmp_path / "o")]) == 2
    assert not list((tmp_path / "o" / "runs").iterdir())  # no run folder for a refused run
    assert "CuPy" in capsys.readouterr().err


@pytest.mark.gpu
def test_a_real_pair_is_traced():
    """On the GPU: the c2 [5120x6144] Q5_K node then the IQ4_XS gate/up pair (ssm_out, then its layer's
    gate/up, in the 27B step): both traces fully written, B's blocks follow A's, and the hand-over's
    figures are finite; two shapes of one module are refused."""
    from gpu_util import cupy_or_skip, q16_or_skip
    cupy_or_skip()
    q16_or_skip()
    ka, kb, us, ta, wa, tb, wb = pt.trace_pair("5120x6144:Q5_K", "2x17408x5120:IQ4_XS", copies=2, replays=1)
    assert ka.endswith("_c2") and kb == "gemvkq_swiglu_iq4_xs" and us > 0, (ka, kb, us)
    h = pt.handover(ta, wa, tb, wb)
    assert h["early"]["blocks"] + h["late"]["blocks"] == len(tb) // wb
    assert np.isfinite(h["b_span_us"]) and h["b_span_us"] > 0 and h["a_done_to_wait_us"] >= 0
    with pytest.raises(ValueError, match="one module"):
        pt.trace_pair("4096x4096:Q8_0", "4096x4096:Q4_0", copies=2, replays=1)


def test_main_writes_a_new_result_per_run_with_machine_info(monkeypatch, tmp_path, capsys):
    """main with the GPU part replaced by constructed traces: each run writes a new folder under
    OUT/runs with pair-trace.json (the figures, the kernels, the machine with the engine switches set)
    and the two raw traces; a second run leaves the first run's files as they were."""
    import json
    monkeypatch.setattr(pt, "trace_pair", lambda a, b, copies: ("ka", "kb", 44.5, _a(), 2, _b(), 2))
    monkeypatch.setenv("GGUF_HARNESS_GEMV_KQ_PF0_SB", "4")
    argv = ["5120x6144:Q5_K", "2x17408x5120:IQ4_XS", "--out", str(tmp_path)]
    assert pt.main(argv) == 0
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 1 and sorted(p.name for p in runs[0].iterdir()) == ["a.npy", "b.npy", "pair-trace.json"]
    text = (runs[0] / "pair-trace.json").read_text()
    d = json.loads(text)
    assert d["schema"] == "gguf-harness/pair-trace/1"
    assert d["us_per_pair"] == 44.5 and d["a_kernel"] == "ka" and d["b_kernel"] == "kb"
    assert d["handover"] == json.loads(json.dumps(pt.handover(_a(), 2, _b(), 2)))
    assert d["machine"]["switches"].get("GGUF_HARNESS_GEMV_KQ_PF0_SB") == "4"
    assert (np.load(runs[0] / "a.npy") == _a()).all() and (np.load(runs[0] / "b.npy") == _b()).all()
    assert pt.main(argv) == 0
    assert len(list((tmp_path / "runs").iterdir())) == 2
    assert (runs[0] / "pair-trace.json").read_text() == text
    assert "44.50 us per pair" in capsys.readouterr().out


@pytest.mark.parametrize("out", ["", "a-file"])
def test_a_bad_out_is_refused_before_the_gpu_work(out, monkeypatch, tmp_path, capsys):
    called = []
    monkeypatch.setattr(pt, "trace_pair", lambda *a: called.append(1))
    if out:
        (tmp_path / out).write_text("x")
        out = str(tmp_path / out)
    assert pt.main(["5120x6144:Q5_K", "2x17408x5120:IQ4_XS", "--out", out]) == 2
    assert not called and "--out" in capsys.readouterr().err


def test_times_do_not_depend_on_the_clock_origin():
    """The figures are differences taken in integer ns: moving both traces by one offset (here from
    ~1.8e18 ns to ~1e6 ns) changes none of them, where float64 at 1.8e18 would round to 256 ns."""
    a, b = _a(), _b()
    shift = np.uint64(T0 - 1_000_000)
    h1, h2 = pt.handover(a, 2, b, 2), pt.handover(a - shift, 2, b - shift, 2)
    assert h1 == h2
    assert h1["b_after_a_sm_us"][0] == 0.3  # 300 ns exactly, not a multiple of 0.256


def test_the_same_trace_as_a_and_b_is_refused():
    with pytest.raises(ValueError, match="does not follow"):
        pt.handover(_b(), 2, _b(), 2)


def test_a_b_trace_from_a_later_launch_is_refused():
    with pytest.raises(ValueError, match="does not follow"):
        pt.handover(_a(), 2, _b() + np.uint64(10**9), 2)


def test_a_wrong_warps_per_block_is_refused():
    with pytest.raises(ValueError, match="different SMs"):
        pt.handover(_a(), 4, _b(), 2)  # A's warps 0-3 ran on SMs 0 and 1


def test_marks_out_of_order_are_refused():
    b = _b()
    b[0, 2] = b[0, 1] - 1  # staged before the wait
    with pytest.raises(ValueError, match="out of order"):
        pt.handover(_a(), 2, b, 2)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, "1"])
def test_a_bad_early_threshold_is_refused(bad):
    with pytest.raises(ValueError, match="early_us"):
        pt.handover(_a(), 2, _b(), 2, early_us=bad)


def test_float_traces_and_a_non_integer_wpb_are_refused():
    with pytest.raises(ValueError, match="dtype"):
        pt.handover(_a().astype(np.float64), 2, _b(), 2)
    with pytest.raises(ValueError, match="integer"):
        pt.handover(_a(), 2.0, _b(), 2)


def test_undefined_correlations_are_none_and_said_so():
    a, b = _a()[:4], _b()[:4]  # two blocks each: no correlation is defined
    h = pt.handover(a, 2, b, 2)
    assert h["b_entry_a_end_corr"] is None and h["b_end_entry_corr"] is None
    assert "undefined" in pt.format_handover("A", "B", h)
