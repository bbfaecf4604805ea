"""harness.kernel_trace.summarize (CPU): the figures of a per-warp timeline from a constructed
trace whose answers are known by construction."""
from __future__ import annotations

import numpy as np
import pytest

from harness import kernel_trace as kt


def _trace():
    # 4 warps on 2 SMs; times in ns; the earliest PDL wait return is at 10_000 ns
    rows = [  # entry, wait, staged, end, sm
        (2_000, 10_000, 12_000, 20_000, 0),
        (3_000, 10_000, 12_000, 22_000, 0),
        (9_000, 10_500, 12_500, 30_000, 1),
        (9_500, 11_000, 13_000, 31_000, 1),
    ]
    return np.array(rows, dtype=np.uint64)


def test_summarize_relative_times_and_quantiles():
    s = kt.summarize(_trace())
    assert s["warps"] == 4 and s["sms"] == 2
    assert s["t0_ns"] == 10_000                       # the earliest PDL wait return
    assert s["span_us"] == pytest.approx(21.0)        # 31_000 - 10_000 ns
    assert s["entry_us"][0] == pytest.approx(-8.0)    # resident 8 us before the wait returned
    assert s["entry_us"][-1] == pytest.approx(-0.5)
    assert s["stage_us"][0] == pytest.approx(2.0) and s["stage_us"][-1] == pytest.approx(2.0)
    assert s["loop_us"][0] == pytest.approx(8.0) and s["loop_us"][-1] == pytest.approx(18.0)
    assert s["end_us"][2] == pytest.approx(np.median([10.0, 12.0, 20.0, 21.0]))
    # per SM first / last end: SM 0 (10, 12), SM 1 (20, 21); medians 15 and 16.5
    assert s["first_last_end_us"] == pytest.approx([15.0, 16.5])


def test_loop_spread_per_sm_and_by_warp_quarter():
    # 8 warps; loops (END - STAGED) known by construction; SM ids 0, 0, 1, 1, 1, 2, 2, 2
    loops = [4.0, 5.0, 6.0, 7.0, 9.0, 8.0, 10.0, 15.0]  # us, warp 0..7
    sm = [0, 0, 1, 1, 1, 2, 2, 2]
    rows = [(1_000, 10_000, 12_000, 12_000 + int(1e3 * v), sm[i]) for i, v in enumerate(loops)]
    a = np.array(rows, dtype=np.uint64)
    s = kt.summarize(a)
    # per SM slowest - fastest: SM 0 1, SM 1 3 (9 - 6), SM 2 7 (15 - 8): the median 3 (mean 3.67, max 7)
    assert s["sm_loop_spread_us"] == pytest.approx(3.0)
    assert "loop_by_warp_quarter_us" not in s
    s = kt.summarize(a, warps_per_block=8)  # one block: quarters (0, 1), (2, 3), (4, 5), (6, 7)
    assert s["loop_by_warp_quarter_us"] == pytest.approx([4.5, 6.5, 8.5, 12.5])
    s = kt.summarize(a, warps_per_block=4)  # two blocks of 4: warps 0 and 4, 1 and 5, ...
    assert s["loop_by_warp_quarter_us"] == pytest.approx([6.5, 6.5, 8.0, 11.0])
    assert "quarter (median us): 6.50 6.50 8.00 11.00" in kt.format_summary("x", "k", 1.0, s)
    for bad in (3, 6, 16):  # not a multiple of 4, or not dividing the 8 warps
        with pytest.raises(ValueError, match="warps_per_block"):
            kt.summarize(a, warps_per_block=bad)


def test_running_share_per_microsecond():
    s = kt.summarize(_trace())
    r = s["running"]
    assert len(r) == 22                      # t = 0 .. 21 us
    assert r[0] == 1.0 and r[9] == 1.0       # nobody ends before 10 us
    assert r[10] == 0.75 and r[12] == 0.5    # strictly after 10 us: 3 left; after 12: 2
    assert r[20] == 0.25 and r[21] == 0.0


@pytest.mark.parametrize("bad", [np.zeros((0, 5)), np.zeros((3, 4)), np.ones(5)])
def test_bad_shapes_are_refused(bad):
    with pytest.raises(ValueError, match="expected \\[warps, 5\\]"):
        kt.summarize(bad)


def test_an_unwritten_mark_is_refused():
    t = _trace()
    t[2, kt.END] = 0  # a warp that never reached its last mark
    with pytest.raises(ValueError, match="unwritten"):
        kt.summarize(t)


def test_format_names_every_phase():
    text = kt.format_summary("2x17408x5120:IQ4_XS", "gemvkq_swiglu_iq4_xs", 36.5, kt.summarize(_trace()))
    for word in ("entry", "stage", "loop", "end", "per SM", "36.50 us per kernel"):
        assert word in text


def test_copies_below_two_exit_2(capsys):
    assert kt.main(["2x17408x5120:IQ4_XS", "--copies", "1"]) == 2
    assert "--copies" in capsys.readouterr().err


def test_a_bad_spec_is_one_line_exit_2(capsys, tmp_path):
    out = tmp_path / "not-made"
    assert kt.main(["17408x5120", "--out", str(out)]) == 2  # no :FORMAT
    err = capsys.readouterr().err
    assert err.startswith("kernel_trace: shape '17408x5120'") and "Traceback" not in err
    assert not out.exists()  # nothing written for a refused run


def test_without_a_gpu_it_exits_2(capsys, tmp_path):
    from gpu_util import no_gpu_or_skip
    no_gpu_or_skip()
    assert kt.main(["4096x4096:Q8_0", "--out", str(tmp_path / "o")]) == 2
    assert not list((tmp_path / "o" / "runs").iterdir())  # no run folder for a refused run
    assert "CuPy" in capsys.readouterr().err


def _rows(durations_us, warps, starts_us=None, t0=10_000):
    """A [rows, 3] per-row trace (start, end ns, warp) with the given durations."""
    starts = starts_us if starts_us is not None else [float(i) for i in range(len(durations_us))]
    return np.array([(t0 + int(1e3 * s), t0 + int(1e3 * (s + d)), w)
                     for s, d, w in zip(starts, durations_us, warps)], dtype=np.uint64)


def test_rows_a_slow_warp_owns_all_the_variance():
    # warp 0's rows all take 5 us, warp 1's all 7 us: the warp explains every difference
    r = _rows([5, 7, 5, 7, 5, 7, 5, 7], [0, 1, 0, 1, 0, 1, 0, 1])
    s = kt.summarize_rows(r, 10_000)
    assert s["rows_marked"] == 8 and s["warp_share"] == pytest.approx(1.0)
    assert s["warp_share_null"] == pytest.approx(1 / 7)  # (2 warps - 1) / (8 rows - 1)
    assert s["row_us"][0] == pytest.approx(5.0) and s["row_us"][-1] == pytest.approx(7.0)
    assert s["row_start_us"][0] == pytest.approx(0.0) and s["row_start_us"][-1] == pytest.approx(7.0)


def test_rows_slow_rows_spread_over_warps_give_no_warp_share():
    # each warp has one 5 us and one 7 us row: equal warp means, so the share between warps is 0
    r = _rows([5, 7, 7, 5], [0, 0, 1, 1])
    assert kt.summarize_rows(r, 10_000)["warp_share"] == pytest.approx(0.0)


def test_rows_by_start_quarter_and_by_index_tenth():
    # 8 rows started at 0..7 us; the later the start, the shorter (fewer warps left beside them)
    d = [8.0, 8.0, 6.0, 6.0, 4.0, 4.0, 2.0, 2.0]
    s = kt.summarize_rows(_rows(d, [0, 1, 2, 3, 4, 5, 6, 7]), 10_000)
    assert s["row_us_by_start"] == pytest.approx([8.0, 6.0, 4.0, 2.0])
    # started out of row order (a permutation that is not its own inverse): quarters by start
    # follow the start times, not the row index; rows 0..7 start at 2, 5, 7, 0, 6, 1, 3, 4 us
    d = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    s = kt.summarize_rows(_rows(d, list(range(8)), starts_us=[2, 5, 7, 0, 6, 1, 3, 4]), 10_000)
    # by start: rows 3, 5 | 0, 6 | 7, 1 | 4, 2 -> durations (4, 6), (1, 7), (8, 2), (5, 3)
    assert s["row_us_by_start"] == pytest.approx([5.0, 4.0, 5.0, 4.0])
    # tenths of 8 rows by index: 10 i // 8 = 0, 1, 2, 3, 5, 6, 7, 8 -> one row each, in row order
    assert s["row_us_by_index"] == pytest.approx(d)


def test_rows_unmarked_rows_are_left_out_and_none_is_said():
    r = _rows([5, 7, 5, 7], [0, 1, 0, 1])
    r[1] = 0  # a row no whole-row loop marked
    s = kt.summarize_rows(r, 10_000)
    assert s["rows_marked"] == 3 and s["row_us"][-1] == pytest.approx(7.0) and s["row_us"][0] == pytest.approx(5.0)
    none = kt.summarize_rows(np.zeros((4, 3), dtype=np.uint64), 10_000)
    assert none == {"rows_marked": 0} and "none marked" in kt.format_rows(none)
    assert "between warps: 1.00 (with no warp effect: ~1.00)" in kt.format_rows(kt.summarize_rows(_rows([5, 7], [0, 1]), 10_000))


@pytest.mark.parametrize("bad", [np.zeros((3, 2)), np.ones(3)])
def test_rows_bad_shapes_are_refused(bad):
    with pytest.raises(ValueError, match="expected \\[rows, 3\\]"):
        kt.summarize_rows(bad, 0)


def test_rows_an_end_before_its_start_is_refused():
    r = _rows([5, 7], [0, 1])
    r[0, kt.ROW_END] = r[0, kt.ROW_START] - 1
    with pytest.raises(ValueError, match="end before its start"):
        kt.summarize_rows(r, 10_000)


@pytest.mark.gpu
@pytest.mark.parametrize("dq", ["", "0"])  # the row queue (the pairs' default) and the static wide rows
def test_the_trace_build_marks_every_row_once_per_warp(dq, monkeypatch):
    """On the GPU: the trace build (kernels/gemv_kq.cu KQ_TRACE) of an IQ4_XS gate/up pair marks every
    row (the queue build and, with GGUF_HARNESS_GEMV_KQ_DQ=0, the static wide build both run whole
    rows per warp); each mark's warp is one of the launch's, its end follows its start, and one
    warp's rows do not overlap in time (a warp runs one row at a time). The warp trace's rows are
    all written too (summarize refuses unwritten ones)."""
    from gpu_util import cupy_or_skip, q16_or_skip
    cupy_or_skip()
    from backends.engine import ops as eops
    q16_or_skip()
    monkeypatch.setattr(eops, "GEMV_KQ_DQ", dq)
    kernel, us, arr, wpb, rows = kt.trace_shape("2x17408x5120:IQ4_XS", copies=2, replays=1)
    assert kernel == "gemvkq_swiglu_iq4_xs" and us > 0 and wpb % 4 == 0, (kernel, us, wpb)
    s = kt.summarize(arr, wpb)
    r = kt.summarize_rows(rows, s["t0_ns"])
    assert r["rows_marked"] == 17408, r["rows_marked"]
    rows = rows.astype(np.int64)
    assert (rows[:, kt.ROW_WARP] < s["warps"]).all() and (rows[:, kt.ROW_END] >= rows[:, kt.ROW_START]).all()
    for w in np.unique(rows[:, kt.ROW_WARP]):
        mine = rows[rows[:, kt.ROW_WARP] == w]
        mine = mine[np.argsort(mine[:, kt.ROW_START])]
        assert (mine[1:, kt.ROW_START] >= mine[:-1, kt.ROW_END]).all(), f"warp {w}'s rows overlap"


def test_main_writes_a_new_result_per_run_with_machine_info(monkeypatch, tmp_path, capsys):
    """main with the GPU part replaced by a constructed trace: each run writes a new folder under
    OUT/runs with kernel-trace.json (schema, machine with the engine switches set, per shape the
    summary) and the raw arrays; a second run leaves the first run's files as they were; a bad --out
    is refused before any tracing."""
    import json
    calls = []

    def fake(spec, copies):
        calls.append(spec)
        return "gemvkq_x", 12.5, _trace(), 4, np.zeros((8, 3), np.uint64)

    monkeypatch.setattr(kt, "trace_shape", fake)
    monkeypatch.setenv("GGUF_HARNESS_GEMV_KQ_PF0_SB", "4")
    argv = ["2x17408x5120:IQ4_XS", "5120x6144:Q5_K", "--out", str(tmp_path)]
    assert kt.main(argv) == 0
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 1 and len(list(runs[0].glob("*.npy"))) == 4
    text = (runs[0] / "kernel-trace.json").read_text()
    d = json.loads(text)
    assert d["schema"] == "gguf-harness/kernel-trace/1" and d["copies"] == 16
    assert list(d["shapes"]) == ["2x17408x5120:IQ4_XS", "5120x6144:Q5_K"]
    assert d["shapes"]["5120x6144:Q5_K"]["span_us"] == pytest.approx(21.0) and d["shapes"]["5120x6144:Q5_K"]["per_kernel_us"] == 12.5
    assert d["machine"]["switches"].get("GGUF_HARNESS_GEMV_KQ_PF0_SB") == "4"
    assert kt.main(argv) == 0
    assert len(list((tmp_path / "runs").iterdir())) == 2 and (runs[0] / "kernel-trace.json").read_text() == text
    calls.clear()
    (tmp_path / "f").write_text("x")
    assert kt.main(["5120x6144:Q5_K", "--out", str(tmp_path / "f")]) == 2
    assert not calls and "--out" in capsys.readouterr().err


def test_trace_build_adds_the_trace_define_and_restores_it():
    from backends.engine import ops
    base = ops.kv9_defines
    with pytest.raises(RuntimeError):
        with kt.trace_build():
            assert ops.kv9_defines() == base() + ("KQ_TRACE=1",)
            raise RuntimeError("a failed case")
    assert ops.kv9_defines is base


def test_replay_median_zeroes_the_arrays_and_keeps_the_median_replay():
    """replay_median with a stand-in for CuPy: each replay's time and array contents differ; the
    median replay's are returned, every array is zeroed before each replay, times are per launch."""
    times = iter([20.0, 10.0, 30.0])  # ms per replay: the median is the first

    class Arr:
        def __init__(self):
            self.v, self.fills = None, 0

        def fill(self, x):
            self.fills += 1
            self.v = x

        def get(self):
            return self.v

    arrays = [Arr(), Arr()]

    class Graph:
        n = 0

        def launch(self, stream):
            Graph.n += 1
            for k, a in enumerate(arrays):
                a.v = (Graph.n, k)  # what this replay "wrote"

    class CP:
        class cuda:
            Event = object

            class Device:
                def synchronize(self):
                    pass

            @staticmethod
            def get_elapsed_time(a, b):
                return next(times)

    class Stream:
        def synchronize(self):
            pass

    CP.cuda.Event = type("E", (), {"record": lambda self, s: None})
    us, got = kt.replay_median(CP, Stream(), Graph(), arrays, replays=3, per=4)
    assert us == pytest.approx(20.0 * 1e3 / 4)       # the median replay (the first), per launch
    assert got == [(1, 0), (1, 1)]                   # its arrays, not the last or the fastest replay's
    assert [a.fills for a in arrays] == [3, 3]
