"""llama.cpp's own GEMV kernels through libggml (harness.ggml_gemv, `bench kernels --ggml`).

CPU: the ctypes struct and prototypes, the context / graph sizes, the error paths of a
missing or unloadable library, the oracle bound of oracles.ggml_gemv_check, the whole
ctypes path on ggml's CPU backend (libggml-cpu of the installed llama-cpp-python; skipped
without it), the --ggml flag and the ggml column in the JSON, console table and HTML
(GgmlGemv mocked). GPU (marker gpu): the CUDA backend on small shapes, skipped unless
libggml-cuda loads.
"""
from __future__ import annotations

import ctypes
import json
import typing

import numpy as np
import pytest

from harness import bench_stats as bs
from harness import cli, ggml_gemv
from harness.bench_kernels import KernelsConfig, base_row, mode_figures
from harness.errors import UnsupportedError
from harness.ggml_gemv import (
    BASE_PROTOTYPES,
    GgmlGemv,
    GgmlInitParams,
    graph_mem,
    graph_size,
    n_tensors,
)
from harness.kernel_case import case_data
from harness.kernel_shapes import parse_spec
from oracles import actquant, ops
from oracles.dequant import dequantize
from oracles.ggml_gemv_check import check_store, check_swiglu, q8_error_bound

# max_time_s: a cap, not a target (max_noise 1.0 stops at 3 samples); 0.2 s gave 2 samples of a
# 40 ms CPU graph on a loaded 2-core machine and failed the n >= 3 check below
FAST = bs.StopRule(min_samples=3, min_time_s=0.0, max_noise=1.0, max_time_s=5.0)


def _cpu_lib_or_skip():
    try:
        return ggml_gemv.load("cpu")
    except UnsupportedError as e:
        pytest.skip(f"no loadable libggml-cpu: {e}")


# -- ctypes declarations -----------------------------------------------------------------------
@pytest.mark.skipif(ctypes.sizeof(ctypes.c_void_p) != 8, reason="LP64 layout")
def test_init_params_layout_is_the_c_struct_on_lp64():
    assert ctypes.sizeof(GgmlInitParams) == 24 and ctypes.alignment(GgmlInitParams) == 8
    assert (GgmlInitParams.mem_size.offset, GgmlInitParams.mem_buffer.offset,
            GgmlInitParams.no_alloc.offset) == (0, 8, 16)
    p = GgmlInitParams(1 << 20, None, True)
    raw = bytes(p)
    assert int.from_bytes(raw[:8], "little") == 1 << 20 and raw[8:16] == b"\0" * 8 and raw[16] == 1


def test_every_pointer_returning_prototype_is_c_void_p():
    ptr_fns = {"ggml_init", "ggml_new_tensor_2d", "ggml_set_name", "ggml_mul_mat",
               "ggml_swiglu_split", "ggml_new_graph_custom", "ggml_backend_alloc_ctx_tensors"}
    for name in ptr_fns:
        assert BASE_PROTOTYPES[name][0] is ctypes.c_void_p, name
    assert BASE_PROTOTYPES["ggml_init"][1] == [GgmlInitParams]  # by value
    assert BASE_PROTOTYPES["ggml_new_tensor_2d"][1] == [ctypes.c_void_p, ctypes.c_int,
                                                       ctypes.c_int64, ctypes.c_int64]
    assert BASE_PROTOTYPES["ggml_backend_graph_compute"][0] is ctypes.c_int  # enum ggml_status
    for name, (res, args) in ggml_gemv.BACKEND_PROTOTYPES["cuda"].items():
        assert (res, args) in ((ctypes.c_void_p, [ctypes.c_int]), (ctypes.c_int, [])), name


def test_prototype_argument_counts_match_the_vendored_header():
    import importlib.util
    import re
    from pathlib import Path
    spec = importlib.util.find_spec("llama_cpp")
    inc = Path(next(iter(spec.submodule_search_locations))).parent / "include" if spec else None
    if inc is None or not (inc / "ggml.h").is_file():
        pytest.skip("llama-cpp-python's include/ not installed")
    text = " ".join((inc / h).read_text() for h in ("ggml.h", "ggml-backend.h", "ggml-alloc.h",
                                                     "ggml-cuda.h", "ggml-cpu.h"))
    protos = dict(BASE_PROTOTYPES, **ggml_gemv.BACKEND_PROTOTYPES["cuda"],
                  **ggml_gemv.BACKEND_PROTOTYPES["cpu"])
    for name, (_, args) in protos.items():
        m = re.search(rf"\b{name}\s*\(([^)]*)\)", text)
        assert m, name
        params = [p for p in m.group(1).split(",") if p.strip() and p.strip() != "void"]
        assert len(params) == len(args), (name, params)


# -- sizes -------------------------------------------------------------------------------------
def test_graph_arithmetic():
    assert n_tensors(1, 1) == 3 and n_tensors(3, 1) == 7
    assert n_tensors(3, 2) == 1 + 3 * 5  # x; per copy 2 weights, 2 mul_mats, 1 swiglu
    assert graph_size(1000, 2) == n_tensors(1000, 2) > 2048  # past ggml_new_graph's cap
    calls = []
    mem = graph_mem(10, 1, 400, lambda n: calls.append(n) or 7 * n)
    assert calls == [graph_size(10, 1)]
    assert mem == n_tensors(10, 1) * 400 + 7 * graph_size(10, 1) + ggml_gemv.CTX_SLACK


# -- library errors ----------------------------------------------------------------------------
def test_missing_library_is_unsupported_and_remembered(tmp_path):
    bogus = tmp_path / "nolib"
    with pytest.raises(UnsupportedError, match="unavailable: no libggml-base"):
        ggml_gemv.load("cuda", bogus)
    with pytest.raises(UnsupportedError, match="unavailable"):  # cached, raised again
        ggml_gemv.load("cuda", bogus)
    with pytest.raises(UnsupportedError, match="unavailable"):
        GgmlGemv(parse_spec("32x256:Q4_0"), 2, backend="cuda", path=bogus)
    with pytest.raises(UnsupportedError, match="backend"):
        ggml_gemv.GgmlLib("metal", bogus)


def test_unloadable_library_is_unsupported(tmp_path):
    (tmp_path / "libggml-base.so").write_bytes(b"not an ELF file")
    (tmp_path / "libggml-cuda.so").write_bytes(b"not an ELF file")
    with pytest.raises(UnsupportedError, match="cannot load"):
        ggml_gemv.GgmlLib("cuda", tmp_path)


def test_base_without_a_cuda_backend_library_is_unsupported(tmp_path):
    lib = _cpu_lib_or_skip()
    d = tmp_path / "lib"
    d.mkdir()
    (d / "libggml-base.so").symlink_to(lib.paths["base"])
    with pytest.raises(UnsupportedError, match="no libggml-cuda"):
        ggml_gemv.GgmlLib("cuda", d)


# -- the oracle bound --------------------------------------------------------------------------
def _rows(spec: str, n: int = 32):
    s = parse_spec(spec)
    host, x = case_data(s, 0)
    w = [dequantize(h[:n].reshape(-1), s.type_id, (n, s.K)).astype(np.float64) for h in host]
    return s, w, x


def test_q8_error_bound_covers_the_rounding():
    x = np.random.default_rng(3).normal(size=1024).astype(np.float32)
    err = np.abs(actquant.round_q8_0(x) - x)
    assert (err <= q8_error_bound(x) + 1e-12).all() and err.max() > 0.5 * q8_error_bound(x).max() / 2
    assert (np.abs(actquant.round_q8_k(x) - x) <= q8_error_bound(x, 256) + 1e-12).all()
    assert q8_error_bound(np.zeros(64)).max() == 0


@pytest.mark.parametrize("spec", ["64x2048:Q4_K", "64x1024:Q8_0", "64x2048:IQ4_XS"])
def test_store_check_passes_q8_rounded_x_and_catches_errors(spec):
    s, (w,), x = _rows(spec)
    y = (w @ actquant.round_q8_0(x)).astype(np.float32)  # what ggml-cuda computes
    v = check_store(y, w, x, None, s.type_id)
    assert v["ok"] and v["max_err_over_bound"] < 0.3 and v["ratio_vs_rounded_x"] < 0.1
    assert not check_store(y * 1.2, w, x, None, s.type_id)["ok"]
    assert not check_store(y[::-1].copy(), w, x, None, s.type_id)["ok"]  # wrong rows
    bad = y.copy()
    bad[5] = np.nan
    assert not check_store(bad, w, x, None, s.type_id)["ok"]


def test_swiglu_check_passes_and_catches_swapped_operands():
    s, (wg, wu), x = _rows("2x64x1024:Q6_K")
    xr = actquant.round_q8_0(x)
    y = ops.swiglu(wg @ xr, wu @ xr).astype(np.float32)
    assert check_swiglu(y, wg, wu, x, None, s.type_id)["ok"]
    assert not check_swiglu(ops.swiglu(wu @ xr, wg @ xr), wg, wu, x, None, s.type_id)["ok"]


def test_case_data_is_seeded_and_shaped():
    s = parse_spec("2x16x512:Q5_K")
    (g, u), x = case_data(s, 7)
    (g2, u2), x2 = case_data(s, 7)
    assert g.shape == (16, s.row_bytes) and u.shape == g.shape and x.shape == (512,)
    assert np.array_equal(g, g2) and np.array_equal(u, u2) and np.array_equal(x, x2)
    assert not np.array_equal(g, u)


# -- the real ctypes path on ggml's CPU backend ------------------------------------------------
@pytest.mark.parametrize("spec", ["64x512:Q4_K", "2x32x512:IQ4_XS", "96x256:Q8_0"])
def test_cpu_backend_graph_checks_and_times(spec):
    _cpu_lib_or_skip()
    s = parse_spec(spec)
    with GgmlGemv(s, 3, seed=0, backend="cpu", n_threads=2) as g:
        assert g.backend_name == "CPU"
        assert g.n_nodes == 3 * (s.n_mats + (s.n_mats == 2))
        v = g.check(np.random.default_rng(1))
        assert v["ok"] and v["copies_agree"] and v["unwritten"] == 0, v
        # ggml multiplies the rounded x: float32 accumulation is all that is left
        assert v["ratio_vs_rounded_x"] < 0.1 and v["max_err_over_bound"] < 0.5
        t = g.time(FAST)
        assert t["us"] > 0 and t["n"] >= 3 and g.same_as_checked()
    assert g.ctx is None and g.backend is None
    g.close()  # idempotent


def test_cpu_backend_graph_past_ggml_new_graph_cap():
    _cpu_lib_or_skip()
    s = parse_spec("2x32x256:Q4_0")
    with GgmlGemv(s, 800, backend="cpu", n_threads=2) as g:  # 2400 nodes > 2048
        assert g.n_nodes == 2400
        assert g.check(np.random.default_rng(0))["ok"]


# -- the bench column --------------------------------------------------------------------------
class _FakeGemv:
    US = 4.0
    made: typing.ClassVar[list] = []

    def __init__(self, shape, copies, seed=0, backend="cuda", path=None):
        self.shape, self.copies, self.backend_name, self.n_nodes = shape, copies, "CUDA0", copies
        _FakeGemv.made.append(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def check(self, rng, max_values):
        return {"ok": True, "max_err_over_bound": 0.1, "ratio_vs_rounded_x": 0.01}

    def time(self, rule):
        return bs.summarize([self.US * 1e-6 * self.copies] * 5, bs.CONVERGED, self.copies)

    def same_as_checked(self):
        return True


def _engine_row(shape, us=2.0):
    k = bs.summarize([us * 1e-6] * 5, bs.CONVERGED)
    return dict(base_row(shape), status="ok", copies=5,
                modes={"cold_b2b": mode_figures(shape.bytes()["total"], k, k, 4000.0)})


def test_ggml_row_keys_and_ratio_with_a_mocked_kernel(monkeypatch):
    from harness.bench_kernels_ggml import add_ggml
    monkeypatch.setattr(ggml_gemv, "GgmlGemv", _FakeGemv)
    s = parse_spec("4096x4096:Q8_0")
    row, logs = _engine_row(s), []
    add_ggml(row, s, KernelsConfig(), 4000.0, logs.append)
    g = row["ggml"]
    assert set(g) >= {"status", "reason", "copies", "backend", "n_nodes", "check", "kernel",
                      "gb_s", "pct_copy", "same_after_timing", "engine_us", "engine_speedup"}
    assert g["status"] == "ok" and g["copies"] == 5 and _FakeGemv.made[-1].copies == 5
    assert g["kernel"]["us"] == pytest.approx(4.0) and g["engine_us"] == pytest.approx(2.0)
    assert g["engine_speedup"] == pytest.approx(2.0)
    assert g["gb_s"] == pytest.approx(s.bytes()["total"] / 4.0 / 1e3)
    assert "engine 2.00x faster" in logs[-1]


def test_ggml_row_records_unavailable_failed_and_errors(monkeypatch):
    from harness.bench_kernels_ggml import ggml_row
    s = parse_spec("64x256:Q4_0")
    eng = dict(base_row(s), status="unsupported")
    cfg = KernelsConfig()

    class Gone(_FakeGemv):
        def __init__(self, *a, **k):
            raise UnsupportedError("llama.cpp kernels unavailable: test")

    class Wrong(_FakeGemv):
        def check(self, rng, max_values):
            return {"ok": False, "max_err_over_bound": 9.0}

    class Boom(_FakeGemv):
        def time(self, rule):
            raise RuntimeError("ggml_backend_graph_compute returned status -1")

    for cls, status in ((Gone, "unavailable"), (Wrong, "failed"), (Boom, "error")):
        monkeypatch.setattr(ggml_gemv, "GgmlGemv", cls)
        g = ggml_row(s, cfg, eng, None)
        assert g["status"] == status and g["reason"] and g["engine_speedup"] is None
        assert "kernel" not in g
    monkeypatch.setattr(ggml_gemv, "GgmlGemv", _FakeGemv)
    g = ggml_row(s, cfg, eng, None)  # engine row not timed: no ratio, own R
    assert g["status"] == "ok" and g["engine_us"] is None and g["engine_speedup"] is None
    assert g["copies"] >= 2 and g["pct_copy"] is None


def test_ggml_row_on_the_cpu_backend_for_real():
    _cpu_lib_or_skip()
    from harness.bench_kernels_ggml import ggml_row
    s = parse_spec("64x512:Q6_K")
    g = ggml_row(s, KernelsConfig(rule=FAST, cold_bytes=100_000), _engine_row(s), 4000.0,
                 backend="cpu")
    assert g["status"] == "ok" and g["check"]["ok"] and g["kernel"]["us"] > 0
    assert g["engine_speedup"] > 0 and g["same_after_timing"]
    json.dumps(g)  # plain JSON


def _result(with_ggml: bool):
    s = parse_spec("4096x4096:Q8_0")
    row = _engine_row(s)
    if with_ggml:
        row["ggml"] = {"status": "ok", "reason": None, "copies": 5, "backend": "CUDA0",
                       "check": {"ok": True, "max_err_over_bound": 0.1, "ratio_vs_rounded_x": 0.2},
                       "kernel": bs.summarize([9e-6] * 4, bs.CONVERGED), "gb_s": 1999.0,
                       "pct_copy": 50.0, "engine_us": 2.0, "engine_speedup": 4.5,
                       "same_after_timing": True}
    return {"schema": "gguf-harness/kernels/1", "created": "now", "rows": [row],
            "settings": {"modes": ["cold_b2b"]}, "device": {"copy": {"gb_s": 4000.0}},
            "machine": {}}


def test_console_table_and_html_show_the_column_only_when_present():
    from rich.console import Console

    from harness.bench_kernels_cmd import table
    from reports.kernels_html import render_kernels_html
    for with_ggml in (False, True):
        con = Console(record=True, width=400)
        con.print(table(_result(with_ggml)))
        text, html = con.export_text(), render_kernels_html(_result(with_ggml))
        assert ("ggml us" in text) == with_ggml and ("engine x" in text) == with_ggml
        assert ("llama.cpp's own kernels" in html) == with_ggml
    assert "4.50" in text and "1999" in text and "pass" in text
    assert "4.50" in html and "9.00" in html


def test_cli_flag_default_off_and_passed_through(monkeypatch, tmp_path):
    import argparse

    from harness import bench_kernels, gpu
    from harness.bench_kernels_cmd import add_kernels_parser
    p = argparse.ArgumentParser()
    add_kernels_parser(p.add_subparsers())
    assert p.parse_args(["kernels"]).ggml is False
    assert p.parse_args(["kernels", "--ggml"]).ggml is True

    seen = []

    def fake_run(shapes, cfg, log=print, advance=lambda: None, **kw):
        seen.append(kw)
        res = _result(kw.get("ggml", False))
        return {k: res[k] for k in ("schema", "settings", "device", "rows")}
    monkeypatch.setattr(gpu, "require_cupy", lambda: None)
    monkeypatch.setattr(bench_kernels, "run_kernels", fake_run)
    for flag, out in (([], tmp_path / "off"), (["--ggml"], tmp_path / "on")):
        assert cli.main(["bench", "kernels", "--shapes", "square_q8", *flag, "--out", str(out)]) == 0
        (run,) = (out / "runs").iterdir()
        res = json.loads((run / "kernels.json").read_text())
        assert ("ggml" in res["rows"][0]) == bool(flag)
        if flag:
            assert res["rows"][0]["ggml"]["engine_speedup"] == pytest.approx(4.5)
    assert seen == [{}, {"ggml": True}]


# -- GPU: the CUDA backend ---------------------------------------------------------------------
def _cuda_lib_or_skip():
    from gpu_util import cupy_or_skip
    cupy_or_skip()
    try:
        return ggml_gemv.load("cuda")
    except UnsupportedError as e:
        pytest.skip(f"llama.cpp's CUDA libggml does not load here: {e}")


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["1024x5120:Q6_K", "2x512x2048:IQ4_XS", "512x4096:Q4_K"])
def test_cuda_backend_graph_checks_and_times(spec):
    _cuda_lib_or_skip()
    s = parse_spec(spec)
    with GgmlGemv(s, 8, seed=0) as g:
        assert g.backend_name.startswith("CUDA")
        v = g.check(np.random.default_rng(1))
        assert v["ok"] and v["copies_agree"], v
        t = g.time(FAST)
        assert t["us"] > 0 and g.same_as_checked()


@pytest.mark.gpu
def test_bench_kernels_with_ggml_on_one_small_shape(tmp_path):
    _cuda_lib_or_skip()
    rc = cli.main(["bench", "kernels", "--shapes", "attn_k", "--modes", "cold_b2b",
                   "--cold-bytes", "200000000", "--max-time", "1", "--ggml", "--out", str(tmp_path)])
    assert rc == 0
    (run,) = (tmp_path / "runs").iterdir()
    res = json.loads((run / "kernels.json").read_text())
    g = res["rows"][0]["ggml"]
    assert g["status"] == "ok" and g["check"]["ok"] and g["engine_speedup"] > 0
    assert res["settings"]["ggml"]["available"]
    assert "llama.cpp's own kernels" in (run / "kernels.html").read_text()
