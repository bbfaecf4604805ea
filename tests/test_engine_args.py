"""The GEMV segment table's host mirror (backends/engine/ops.py TABLE_DT) against the C
layout of struct SegTable in kernels/segs.cuh (CPU only: the bytes the kernel will read)."""
from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace as NS

import numpy as np
import pytest

from backends.engine import ops
from harness import machine



@pytest.fixture(autouse=True)
def _default_build_switches(monkeypatch):
    """Every gemv_kq.cu / gemv_tma.cu build switch at its default (unset), whatever the shell
    exports: the tests set the ones they are about."""
    for knob in ("GEMV_KQ_UNROLL", "GEMV_KQ2_UNROLL", "GEMV_KQ_MINB", "GEMV_KQ_MINB_IQ3S", "GEMV_KQ_PF",
                 "GEMV_KQ_PIPE", "GEMV_KQ_L1PF", "GEMV_KQ_P2", "GEMV_KQ_P2_MAX_K", "GEMV_TMA_NST",
                 "GEMV_TMA_WARPS", "GEMV_TMA_MINB", "GEMV_TMA_RING", "GEMV_TMA_RPW", "GEMV_TMA_BPS"):
        monkeypatch.setattr(ops, knob, "")
    monkeypatch.setattr(ops, "GEMV_IQ4_XIL", "1")
    monkeypatch.setattr(ops, "GEMV_KQ_CSPLIT", "1")
    monkeypatch.setattr(ops, "GEMV_KQ_GSPLIT", "")
    monkeypatch.setattr(ops, "GEMV_KQ_BW", "")


def test_table_matches_the_c_struct_layout():
    assert ops.TABLE_DT.itemsize == 152 and ops.SEG_DT.itemsize == 32
    segs = [ops.Seg(NS(ptr=1000 + i, type_id=6 + i, rows=9 + i, row_bytes=22 * i + 5),
                    NS(data=NS(ptr=5000 + i)), 77 * i) for i in range(3)]
    raw = bytes(memoryview(ops.seg_table_value(segs)))
    # struct Seg {u64 w, bias, out; int type, rows} x 4, then int n, int row_bytes[4], pad to 8
    for i, s in enumerate(segs):
        assert struct.unpack_from("<QQQii", raw, 32 * i) == (s.w.ptr, s.bias, s.out.data.ptr,
                                                            s.w.type_id, s.w.rows)
    assert raw[96:128] == bytes(32)  # unused 4th segment
    assert struct.unpack_from("<i4i", raw, 128) == (3, 5, 27, 49, 0)


def test_narrow_bit_marks_only_the_wide_kquants():
    """GGUF_HARNESS_GEMV_KQ=narrow: Q4_K/Q5_K/Q6_K segments carry NARROW_BIT (kernels/gemv.cu
    takes the per-8 loop for them), every other type keeps its plain GGML id."""
    segs = [ops.Seg(NS(ptr=256 * i, type_id=t, rows=3, row_bytes=144), NS(data=NS(ptr=0)))
            for i, t in enumerate((12, 13, 14, 8))]
    for narrow, want in ((False, [12, 13, 14, 8]), (True, [12 | 0x100, 13 | 0x100, 14 | 0x100, 8])):
        raw = bytes(memoryview(ops.seg_table_value(segs, narrow)))
        assert [struct.unpack_from("<i", raw, 32 * i + 24)[0] for i in range(4)] == want
    assert ops.NARROW_BIT == 0x100


def _fake_module(monkeypatch) -> list:
    """Fake module's compile and occupancy calls (no GPU): kernel_in records (source, name,
    defines) into the returned list and gives an object with that name; 2 blocks per SM, 132
    SMs, no shared-memory opt-in, device tables kept as bytes."""
    asked = []
    monkeypatch.setattr(ops.module, "kernel_in", lambda src, name, defines=(): asked.append(
        (src, name, tuple(defines))) or NS(name=name))
    monkeypatch.setattr(ops.module, "allow_smem", lambda k, n: None)
    monkeypatch.setattr(ops.module, "blocks_per_sm", lambda k, threads, smem: 2)
    monkeypatch.setattr(ops.module, "sm_count", lambda: 132)
    # the H200's cluster occupancy at 2 blocks per SM (session 16: 62 clusters of 4, not 66)
    monkeypatch.setattr(ops.module, "max_active_clusters", lambda k, cs, threads, smem: 132 if cs == 2 else 62)
    monkeypatch.setattr(ops, "_device_bytes", lambda raw: NS(raw=raw))
    return asked


def _gemv_node(mode, types, K, rows, ptr_of):
    """ops.gemv on fake device tensors: one [rows x K] matrix per GGML type id in `types` at
    address ptr_of(i), outputs at 4096 (i + 1)."""
    from backends.engine.arena import DeviceTensor
    from backends.engine.formats import FORMATS
    segs = []
    for i, t in enumerate(types):
        f = FORMATS[t]
        rb = K // f.block_size * f.type_size
        w = DeviceTensor(f"w{i}", ptr_of(i), t, (K, rows), rb, rb * rows)
        segs.append(ops.Seg(w, NS(size=rows, data=NS(ptr=4096 * (i + 1)))))
    return ops.gemv("n", mode, segs, NS(), K)


def _launch_kernel_names(monkeypatch, cases, impl="q16", args="value", kq="wide"):
    """(kernel name, defines, segment types in the table) ops.gemv launches for each
    (mode, [GGML type ids]) of `cases`, with module's compile/occupancy calls faked (no GPU)."""
    asked = _fake_module(monkeypatch)
    monkeypatch.setattr(ops, "GEMV_IMPL", impl)
    monkeypatch.setattr(ops, "GEMV_ARGS", args)
    monkeypatch.setattr(ops, "GEMV_KQ", kq)
    K, rows, got = 2048, 64, []
    for mode, types in cases:
        node = _gemv_node(mode, types, K, rows, lambda i: 1 << 20 + i)
        table = node.args[0] if args == "value" else np.frombuffer(node.args[0].raw, ops.TABLE_DT)[0]
        src, name, defines = asked[-1]
        assert src == "gemv.cu" and node.kernel.name == name
        got.append((name, defines, [int(table["s"][i]["type"]) for i in range(len(types))]))
    return got


def test_gemv_takes_the_iq4_kernels_exactly_for_iq4_xs_segments(monkeypatch):
    """The wide IQ4_XS loop is compiled only into the _iq4 GEMV kernels (kernels/gemv.cu with
    -DGEMV_IQ4, engine v8); every other node must keep v6's kernels. An IQ4_XS segment
    anywhere in the table (QKV-like triple, gate/up pair, mixed pair) selects them; the other
    I-quants (IQ4_NL 20, IQ3_S 21) and K-quants do not."""
    Q8_0, Q4_K, Q6_K, IQ4_NL, IQ3_S, IQ4_XS = 8, 12, 14, 20, 21, 23
    cases = [("store", [Q8_0]), ("store", [Q4_K, Q6_K, IQ4_XS]), ("add", [IQ4_XS]),
             ("swiglu", [IQ4_XS, IQ4_XS]), ("swiglu", [Q6_K, IQ4_XS]), ("swiglu", [Q4_K, Q4_K]),
             ("store", [IQ4_NL, IQ3_S]), ("add", [Q6_K])]
    iq4 = [IQ4_XS in types for _, types in cases]
    assert sum(iq4) == 4
    for impl, extra in (("q16", ()), ("q8_1", ("ACT_Q8_1",))):
        for args, prefix in (("value", "gemv"), ("pointer", "gemvp")):
            got = _launch_kernel_names(monkeypatch, cases, impl, args)
            for (mode, types), has, (name, defines, seg_types) in zip(cases, iq4, got):
                assert name.startswith(f"{prefix}_{mode}_w") and name.endswith("_iq4") == has, (impl, name)
                assert defines == extra + (("GEMV_IQ4",) if has else ()), (impl, name)
                assert seg_types == types  # wide: plain type ids
    # narrow (per-8 loops): IQ4_XS carries NARROW_BIT, which only the _iq4 kernels' I-quant
    # call masks (the v6 kernels' row_dot_iq would give NaN), so it must still take them
    got = _launch_kernel_names(monkeypatch, cases, kq="narrow")
    for (mode, types), has, (name, defines, seg_types) in zip(cases, iq4, got):
        assert name.endswith("_iq4") == has and defines == (("GEMV_IQ4",) if has else ())
        assert seg_types == [t | ops.NARROW_BIT if t in (Q4_K, 13, Q6_K, IQ4_XS) else t for t in types]
    assert ops.gemv_kernel("gemv", "store", 1, 8, [Q8_0]) == ("gemv_store_w1_b8", ())
    assert ops.gemv_kernel("gemvp", "swiglu", 4, 8, [IQ4_XS, Q6_K], "q8_1") == (
        "gemvp_swiglu_w4_b8_iq4", ("ACT_Q8_1", "GEMV_IQ4"))


def test_module_kernel_builds_iq4_names_with_the_iq4_define(monkeypatch):
    """module.kernel (by name, no defines) must look the _iq4 GEMV kernels up in the
    -DGEMV_IQ4 build, the others in the plain one (kernels/gemv.cu compiles one set per build)."""
    from backends.engine import module
    seen = []
    monkeypatch.setattr(module, "_module", lambda src, defines=(): seen.append((src, tuple(defines))) or
                        NS(get_function=lambda n: n))
    module.kernel.cache_clear()
    try:
        assert module.kernel("gemv_store_w1_b8") == "gemv_store_w1_b8"
        assert module.kernel("gemvp_swiglu_w2_b8_iq4") == "gemvp_swiglu_w2_b8_iq4"
    finally:
        module.kernel.cache_clear()
    assert seen == [("gemv.cu", ()), ("gemv.cu", ("GEMV_IQ4",))]


def test_v9_takes_only_single_type_kquant_nodes_with_whole_super_blocks(monkeypatch):
    """ops.kv9_kernel: engine v9 (kernels/gemv_kq.cu) gets a node only when every matrix has the
    same of its types and K is a multiple of 256; the names exist in the source (IQ3_S with its
    opt-in switch on: test_v9_iq3s_is_opt_in)."""
    from backends.engine import module, ops
    monkeypatch.setattr(ops, "GEMV_KQ_IQ3S", "1")
    src = (module.KERNEL_DIR / "gemv_kq.cu").read_text()
    for t, n in ops.KV9_NAMES.items():
        for mode in ("store", "add", "swiglu"):
            l4 = t in (12, 13)  # Q4_K, Q5_K: 4 lanes per super-block, two rows per warp
            name = ops.kv9_kernel(mode, [t, t], 5120)
            assert name == (f"gemvkq4_{mode}_{n}" if l4 else f"gemvkq_{mode}_{n}")
            assert ops.kv9_rows_per_warp(name) == (2 if l4 else 1)
            assert ops.kv9_kernel(mode, [t], 5120, lanes4=False) == f"gemvkq_{mode}_{n}"
            assert f"KQ_MODES(T_{n.upper()}, {n})" in src
            assert (f"KQ4_MODES(T_{n.upper()}, {n})" in src) == l4
    assert ops.kv9_kernel("store", [12], 5120 + 32) is None      # K not whole super-blocks
    assert ops.kv9_kernel("swiglu", [13, 14], 5120) is None      # mixed gate/up pair
    assert ops.kv9_kernel("store", [12, 12, 14], 5120) is None   # mixed QKV
    monkeypatch.setattr(ops, "GEMV_KQ_Q0", "0")
    assert ops.kv9_kernel("store", [8], 4096) is None            # Q8_0 with its switch off (test_v9_q8_0_q4_0_switch)
    assert set(ops.KV9_NAMES) == set(ops.KQ_WIDE_TYPES) | {ops.IQ3_S}
    # F32 rows ride along in store/add (qwen35's ssm_in: Q5_K q/k/v + gate, F32 beta/alpha)
    assert ops.kv9_kernel("store", [13, 13, 0, 0], 5120) == "gemvkq4_store_q5_k"
    assert ops.kv9_kernel("add", [14, 0], 5120) == "gemvkq_add_q6_k"
    assert ops.kv9_kernel("store", [0, 0], 5120) is None          # no K-quant at all
    assert ops.kv9_kernel("swiglu", [13, 0], 5120) is None        # not in a gate/up pair


def test_v9_iq3s_switch(monkeypatch):
    """IQ3_S nodes (kernels/kwide_iq3s.cuh) take the v9 kernels with GGUF_HARNESS_GEMV_KQ_IQ3S=1,
    the default since they ran on the H200 (session 9), and gemv.cu's with "0" (ops.GEMV_KQ_IQ3S,
    read at call time); another value is refused once an IQ3_S node asks. The other v9 types do
    not care."""
    from backends.engine import ops
    IQ3_S = 21
    assert ops.IQ3_S == IQ3_S and ops.KV9_NAMES[IQ3_S] == "iq3_s"
    assert ops.GEMV_KQ_IQ3S == "1" or "GGUF_HARNESS_GEMV_KQ_IQ3S" in os.environ  # default on
    for flag in ("0", "1"):
        monkeypatch.setattr(ops, "GEMV_KQ_IQ3S", flag)
        for mode, types in (("store", [IQ3_S]), ("add", [IQ3_S, IQ3_S]), ("swiglu", [IQ3_S, IQ3_S]),
                            ("store", [IQ3_S, 0])):
            for lanes4 in (True, False):
                for split, sfx in ((1, ""), (2, "_s2"), (4, "_s4")):
                    got = ops.kv9_kernel(mode, types, 5120, lanes4=lanes4, split=split)
                    assert got == (f"gemvkq_{mode}_iq3_s{sfx}" if flag == "1" else None), (flag, mode, types)
        assert ops.kv9_kernel("swiglu", [IQ3_S, 23], 5120) is None  # mixed pair: never
        assert ops.kv9_kernel("store", [IQ3_S], 5120 + 32) is None  # K not whole super-blocks
        assert ops.kv9_kernel("store", [14], 5120) == "gemvkq_store_q6_k"
        assert ops.kv9_kernel("swiglu", [23, 23], 5120) == "gemvkq_swiglu_iq4_xs"
    monkeypatch.setattr(ops, "GEMV_KQ_IQ3S", "yes")
    with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_KQ_IQ3S"):
        ops.kv9_kernel("store", [IQ3_S], 5120)
    assert ops.kv9_kernel("store", [12], 5120) == "gemvkq4_store_q4_k"  # only IQ3_S nodes ask
    assert "GGUF_HARNESS_GEMV_KQ_IQ3S" in machine.ENGINE_SWITCHES
    assert "GGUF_HARNESS_GEMV_KQ_IQ3S_GRID" in machine.ENGINE_SWITCHES


def test_v9_iq3s_grid_defines(monkeypatch):
    """GGUF_HARNESS_GEMV_KQ_IQ3S_GRID=N builds gemv_kq.cu with -DKQ_IQ3S_GRID=N for IQ3_S nodes
    only (ops.kv9_iq3s_defines; kernels/kwide_iq3s.cuh: 0 = global table, else shared-memory
    copies); unset = the default build; a value the kernel rejects is refused here."""
    from backends.engine import module, ops
    src = (module.KERNEL_DIR / "kwide_iq3s.cuh").read_text()
    assert "#define KQ_IQ3S_GRID 16" in src  # the default since session 20
    assert "__shared__ __align__(16) u32 iq3s_grid_s" in src  # the uint4 stores of the setup
    monkeypatch.setattr(ops, "GEMV_KQ_IQ3S_GRID", "")
    assert ops.kv9_iq3s_defines([21]) == () and ops.kv9_iq3s_defines([12]) == ()
    for n in ops.KQ_IQ3S_GRIDS:
        monkeypatch.setattr(ops, "GEMV_KQ_IQ3S_GRID", n)
        assert ops.kv9_iq3s_defines([21, 21]) == (f"KQ_IQ3S_GRID={n}",)
        assert ops.kv9_iq3s_defines([21, 0]) == (f"KQ_IQ3S_GRID={n}",)
        assert ops.kv9_iq3s_defines([14]) == ()
        assert f"kIq3sCopies == {n}" in src  # the kernel's static_assert admits it
    monkeypatch.setattr(ops, "GEMV_KQ_IQ3S_GRID", "64")  # no such build
    with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_KQ_IQ3S_GRID"):
        ops.kv9_iq3s_defines([21])
    with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_KQ_IQ3S_GRID"):
        ops.kv9_iq3s_dyn_bytes([21])
    # 32 copies (64 KiB) live in the dynamic shared memory, before x: only IQ3_S nodes add them
    for n in ops.KQ_IQ3S_GRIDS:
        monkeypatch.setattr(ops, "GEMV_KQ_IQ3S_GRID", n)
        assert ops.kv9_iq3s_dyn_bytes([21]) == (65536 if n == "32" else 0)
        assert ops.kv9_iq3s_dyn_bytes([12]) == 0
    assert "constexpr int kIq3sDynInt4 = KQ_IQ3S_GRID == 32 ? 512 * 32 * 4 / 16 : 0;" in src
    assert 512 * 32 * 4 // 16 * 16 == 65536  # kIq3sDynInt4 int4 slots = kv9_iq3s_dyn_bytes's bytes
    kq = (module.KERNEL_DIR / "gemv_kq.cu").read_text()
    assert kq.count("int4* xq = smem4 + (Q::TYPE == T_IQ3_S ? kIq3sDynInt4 : 0);") == 2  # both row bodies


def _v9_launches(monkeypatch, cases, ptr_of=lambda i: 1 << 20 + i, csplit="0"):
    """(source, kernel name, defines) ops.gemv asks module.kernel_in for, per (mode, types) case,
    with the default v9l8 path and module's compile/occupancy calls faked (no GPU); the cluster
    split (GGUF_HARNESS_GEMV_KQ_CSPLIT) at `csplit` (off unless asked: test_gemv_routes_csplit)."""
    asked = _fake_module(monkeypatch)
    monkeypatch.setattr(ops, "GEMV_IMPL", "q16")
    monkeypatch.setattr(ops, "GEMV_ARGS", "value")
    monkeypatch.setattr(ops, "GEMV_KQ", "v9l8")
    monkeypatch.setattr(ops, "GEMV_KQ_SPLIT", "auto")
    monkeypatch.setattr(ops, "GEMV_KQ_CSPLIT", csplit)
    got = []
    for mode, types in cases:
        node = _gemv_node(mode, types, 5120, 64, ptr_of)
        assert node.kernel.name == asked[-1][1]
        got.append(asked[-1])
    return got


def test_gemv_routes_iq3s_nodes_by_the_opt_in(monkeypatch):
    """ops.gemv: an IQ3_S node (store, SwiGLU pair, with F32 rows) runs gemv.cu's kernels by
    default and gemv_kq.cu's iq3_s kernels with GGUF_HARNESS_GEMV_KQ_IQ3S=1 (with the grid
    define when GGUF_HARNESS_GEMV_KQ_IQ3S_GRID is set); mixed nodes stay on gemv.cu; the weights
    must be 8-byte aligned for the v9 IQ3_S loads (ops.KV9_ALIGN), 2-byte on gemv.cu."""
    IQ3_S = 21
    cases = [("store", [IQ3_S]), ("swiglu", [IQ3_S, IQ3_S]), ("store", [IQ3_S, IQ3_S, 0]),
             ("swiglu", [IQ3_S, 14]), ("store", [14])]
    monkeypatch.setattr(ops, "GEMV_KQ_IQ3S_GRID", "")
    monkeypatch.setattr(ops, "GEMV_KQ_IQ3S", "0")
    got = _v9_launches(monkeypatch, cases)
    assert [src for src, _, _ in got] == ["gemv.cu"] * 4 + ["gemv_kq.cu"]
    monkeypatch.setattr(ops, "GEMV_KQ_IQ3S", "1")
    got = _v9_launches(monkeypatch, cases)
    assert [src for src, _, _ in got] == ["gemv_kq.cu"] * 3 + ["gemv.cu", "gemv_kq.cu"]
    # S by kv9_split (K = 5120: 20 super-blocks; 64 rows in 264 block slots -> 2 warps per row)
    assert [n for _, n, _ in got[:3]] == ["gemvkq_store_iq3_s_s2", "gemvkq_swiglu_iq3_s_s2",
                                          "gemvkq_store_iq3_s_s2"]
    assert all(d == () for _, _, d in got)
    monkeypatch.setattr(ops, "GEMV_KQ_IQ3S_GRID", "16")
    got = _v9_launches(monkeypatch, cases)
    assert [d for _, _, d in got] == [("KQ_IQ3S_GRID=16",)] * 3 + [(), ()]
    monkeypatch.setattr(ops, "GEMV_KQ_IQ3S_GRID", "")
    with pytest.raises(ValueError, match="8-byte aligned"):
        _v9_launches(monkeypatch, [("store", [IQ3_S])], ptr_of=lambda i: (1 << 20) + 2)
    monkeypatch.setattr(ops, "GEMV_KQ_IQ3S", "0")  # gemv.cu reads IQ3_S with 16-bit loads
    assert _v9_launches(monkeypatch, [("store", [IQ3_S])], ptr_of=lambda i: (1 << 20) + 2)[0][0] == "gemv.cu"


def test_v9_split_names_and_choice():
    """Engine v9 row groups of S warps (kernels/gemv_kq.cu KQ_SPLITS): the _s2 / _s4 names exist
    in the source, another S is refused, and ops.kv9_split picks by passes x super-blocks per
    warp. Hand counts with 264 block slots (2 blocks of 16 warps on 132 SMs):
    [5120 x 17408] (68 super-blocks), one row per warp: S 1: 320 blocks, 2 passes x 17 = 34;
    S 2: 640 blocks, 3 x 9 = 27; S 4: 1280 blocks, 5 x 5 = 25 -> 4. [5120 x 6144] (24): S 1:
    2 x 6 = 12; S 2: 3 x 3 = 9; S 4: 5 x 2 = 10 -> 2. [10240 x 5120] (20): S 1: 640 blocks,
    3 x 5 = 15; S 2: 1280, 5 x 3 = 15 (tie: the smaller S); S 4: 10 x 2 = 20 -> 1. The output
    head [248320 x 5120]: S 1: 15520 blocks, 59 x 5 = 295; S 2: 118 x 3 = 354 -> 1."""
    from backends.engine import module, ops
    src = (module.KERNEL_DIR / "gemv_kq.cu").read_text()
    # every (prefix, trait) goes through KQ_SPLITS: S = 1 unsuffixed, 2 and 4 as _s2 / _s4
    assert "KQ_INSTANCE(PFX, TRAIT, LB, MODE, MNAME, T, TNAME, 2, _s2)" in src
    assert "KQ_INSTANCE(PFX, TRAIT, LB, MODE, MNAME, T, TNAME, 4, _s4)" in src
    assert "KQ_ALL_MODES(gemvkq, KQ, KQ_LB8, T, TNAME)" in src and "KQ_ALL_MODES(gemvkq4, KQ4, KQ_LB4, T, TNAME)" in src
    assert ops.kv9_kernel("store", [14], 5120, split=4) == "gemvkq_store_q6_k_s4"
    assert ops.kv9_kernel("swiglu", [12, 12], 5120, split=2) == "gemvkq4_swiglu_q4_k_s2"
    assert ops.kv9_kernel("add", [12], 5120, lanes4=False, split=1) == "gemvkq_add_q4_k"
    assert ops.kv9_rows_per_warp("gemvkq4_store_q5_k_s4") == 2
    with pytest.raises(ValueError, match="split"):
        ops.kv9_kernel("store", [14], 5120, split=3)
    slots = lambda s: 264
    assert ops.kv9_split(5120, 17408, 1, slots) == 4
    assert ops.kv9_split(5120, 6144, 1, slots) == 2
    assert ops.kv9_split(10240, 5120, 1, slots) == 1
    assert ops.kv9_split(248320, 5120, 1, slots) == 1
    # [1024 x 5120] (20 super-blocks): S 1: 64 blocks, 1 x 5 = 5; S 2: 1 x 3 = 3; S 4 (1 x 2 = 2)
    # would leave its parts 1.25 rounds (20 < 8 x 4): not a candidate -> 2
    assert ops.kv9_split(1024, 5120, 1, slots) == 2
    assert ops.kv9_split(1024, 1024, 1, slots) == 1  # 4 super-blocks: S 2 needs 16
    assert [ops.kv9_split_cost(5120, 17408, 1, s, 264) for s in (1, 2, 4)] == [34, 27, 25]
    assert [ops.kv9_split_cost(248320, 5120, 1, s, 264) for s in (1, 2)] == [295, 354]
    # two rows per warp (gemvkq4_) at 132 slots (one block per SM): [5120 x 17408] S 1: 160
    # blocks, 2 passes x 2 x 17 = 68; S 2: 320, 3 x 2 x 9 = 54; S 4: 640, 5 x 2 x 5 = 50 -> 4
    assert ops.kv9_split(5120, 17408, 2, lambda s: 132) == 4
    # a kernel with fewer slots at S > 1 (more registers) changes the choice: [5120 x 6144]
    # with S 2 / 4 at one block per SM: S 2: 640 blocks, 5 x 3 = 15 > 12 of S 1; S 4: 1280
    # blocks / 132 = 10 x 2 = 20
    assert ops.kv9_split(5120, 6144, 1, lambda s: 264 if s == 1 else 132) == 1


def test_v9_unroll_build_defines(monkeypatch):
    """GGUF_HARNESS_GEMV_KQ_UNROLL / _KQ2_UNROLL select the gemv_kq.cu build (-DKQ_UNROLL=N,
    -DKQ2_UNROLL=M; the kernel's defaults 2 and 1 when unset); a non-integer or out-of-range
    value is refused before any build."""
    from backends.engine import module, ops
    assert "#ifndef KQ_UNROLL\n#define KQ_UNROLL 2" in (module.KERNEL_DIR / "gemv_kq.cu").read_text()
    monkeypatch.setattr(ops, "GEMV_KQ_UNROLL", "")
    assert ops.kv9_defines() == ()
    monkeypatch.setattr(ops, "GEMV_KQ2_UNROLL", "")
    assert ops.kv9_defines() == ()
    monkeypatch.setattr(ops, "GEMV_KQ_UNROLL", "4")
    assert ops.kv9_defines() == ("KQ_UNROLL=4",)
    monkeypatch.setattr(ops, "GEMV_KQ2_UNROLL", "2")
    assert ops.kv9_defines() == ("KQ_UNROLL=4", "KQ2_UNROLL=2")
    assert "#ifndef KQ2_UNROLL\n#define KQ2_UNROLL 1" in (module.KERNEL_DIR / "gemv_kq.cu").read_text()
    for bad in ("0", "9", "x", "-1", "2.5"):
        monkeypatch.setattr(ops, "GEMV_KQ_UNROLL", bad)
        with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_KQ_UNROLL"):
            ops.kv9_defines()
    monkeypatch.setattr(ops, "GEMV_KQ_UNROLL", "")
    monkeypatch.setattr(ops, "GEMV_KQ2_UNROLL", "0")
    with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_KQ2_UNROLL"):
        ops.kv9_defines()
    monkeypatch.setattr(ops, "GEMV_KQ2_UNROLL", "")
    monkeypatch.setattr(ops, "GEMV_KQ_MINB", "3")
    assert ops.kv9_defines() == ("KQ_MINB=3",)
    # the IQ3_S instances' own minBlocks (kKqMinBlocks; -1 in the kernel: KQ_MINB's)
    assert "#define KQ_MINB_IQ3S -1" in (module.KERNEL_DIR / "gemv_kq.cu").read_text()
    monkeypatch.setattr(ops, "GEMV_KQ_MINB_IQ3S", "0")
    assert ops.kv9_defines() == ("KQ_MINB=3", "KQ_MINB_IQ3S=0")
    monkeypatch.setattr(ops, "GEMV_KQ_MINB_IQ3S", "9")
    with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_KQ_MINB_IQ3S"):
        ops.kv9_defines()
    monkeypatch.setattr(ops, "GEMV_KQ_MINB_IQ3S", "")
    assert "GGUF_HARNESS_GEMV_KQ_MINB_IQ3S" in machine.ENGINE_SWITCHES
    assert "#ifndef KQ_MINB\n#define KQ_MINB 2" in (module.KERNEL_DIR / "gemv_kq.cu").read_text()
    monkeypatch.setattr(ops, "GEMV_KQ_MINB", "0")  # session 9's launch bounds, for A/B
    assert ops.kv9_defines() == ("KQ_MINB=0",)
    monkeypatch.setattr(ops, "GEMV_KQ_MINB", "")
    # the latency A/B builds (session 9): next-row L2 prefetch, pipelined loads (PIPE 1 or 2)
    monkeypatch.setattr(ops, "GEMV_KQ_PF", "1")
    monkeypatch.setattr(ops, "GEMV_KQ_PIPE", "2")
    assert ops.kv9_defines() == ("KQ_PF=1", "KQ_PIPE=2")
    src = (module.KERNEL_DIR / "gemv_kq.cu").read_text()
    assert "#ifndef KQ_PF\n#define KQ_PF 0" in src and "#ifndef KQ_PIPE\n#define KQ_PIPE 0" in src
    monkeypatch.setattr(ops, "GEMV_KQ_PF", "")
    monkeypatch.setattr(ops, "GEMV_KQ_PIPE", "")
    monkeypatch.setattr(ops, "GEMV_KQ_L1PF", "2")
    monkeypatch.setattr(ops, "GEMV_KQ_MINB", "2")
    assert ops.kv9_defines() == ("KQ_MINB=2", "KQ_L1PF=2")
    assert "#ifndef KQ_L1PF\n#define KQ_L1PF 0" in src
    monkeypatch.setattr(ops, "GEMV_KQ_PIPE", "1")  # the prefetches live in the unrotated loop only
    with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_KQ_PIPE and GGUF_HARNESS_GEMV_KQ_L1PF"):
        ops.kv9_defines()
    monkeypatch.setattr(ops, "GEMV_KQ_PIPE", "")
    monkeypatch.setattr(ops, "GEMV_KQ_L1PF", "")
    monkeypatch.setattr(ops, "GEMV_KQ_MINB", "")
    for knob, bad in (("GEMV_KQ_PF", "0"), ("GEMV_KQ_PIPE", "3"), ("GEMV_KQ_PIPE", "2.0"), ("GEMV_KQ_L1PF", "9")):
        monkeypatch.setattr(ops, knob, bad)
        with pytest.raises(ValueError, match="GGUF_HARNESS_" + knob):
            ops.kv9_defines()
        monkeypatch.setattr(ops, knob, "")
    assert ops.kv9_defines() == ()


def test_prefetch_distance_rule_matches_the_measured_strides():
    """ops.pf_ahead on the strides of the H200 A/B (docs/perf-notes.md session 7): blocks x rows
    per block x row bytes of each measured node, and the distance that measured best."""
    measured = {  # stride bytes: best PF_AHEAD (cold back to back, same run)
        660 * 8 * 4200: 0,            # output head [248320x5120] Q6_K, w1_b8: 454.5 -> 369.2 us
        396 * 8 * (2720 + 2720): 0,   # IQ4_XS gate+up 2x[17408x5120], w1_b8 pair: 51.3 -> 46.2
        528 * 2 * 14280: 1,           # Q6_K [5120x17408], w4_b8: 45.7 -> 40.0
        528 * 2 * 11968: 1,           # Q5_K [5120x17408], w4_b8: 38.0 -> 35.0
        528 * 4 * 2880: 2,            # Q4_K [10240x5120], w2_b8: 18.49 best at 2
    }
    for stride, best in measured.items():
        assert ops.pf_ahead(stride) == best, stride
    assert ops.pf_ahead(0) == ops.PF_DEFAULT and ops.pf_ahead(1 << 40) == 0


def test_gemv_nodes_split_mixed_types_only_when_asked(monkeypatch):
    """ops.gemv_nodes: with GGUF_HARNESS_GEMV_KQ_MIXED=one one gemv node (the 27B qkv, Q4_K +
    Q6_K + Q6_K, on gemv.cu); with split (the default) one v9 node per type in order of first appearance,
    named <name>.<type>, each with its own segments' outputs; not for a SwiGLU pair, a node
    with an F32 segment, a type v9 does not take (Q5_0; Q8_0 with GGUF_HARNESS_GEMV_KQ_Q0=0), or
    the gemv.cu loops; another value is refused."""
    from backends.engine.arena import DeviceTensor
    from backends.engine.formats import FORMATS
    asked = _fake_module(monkeypatch)
    for knob, val in (("GEMV_IMPL", "q16"), ("GEMV_ARGS", "value"), ("GEMV_KQ", "v9l8"),
                      ("GEMV_KQ_SPLIT", "auto"), ("GEMV_KQ_IQ3S", "1"), ("GEMV_KQ_CSPLIT", "0")):
        monkeypatch.setattr(ops, knob, val)  # (the cluster split: test_gemv_routes_csplit)

    def segs(types, K=5120, rows=64):
        out = []
        for i, t in enumerate(types):
            rb = K // FORMATS[t].block_size * FORMATS[t].type_size
            w = DeviceTensor(f"w{i}", 1 << (20 + i), t, (K, rows), rb, rb * rows)
            out.append(ops.Seg(w, NS(size=rows, data=NS(ptr=4096 * (i + 1)))))
        return out

    qkv = segs([12, 14, 14])
    monkeypatch.setattr(ops, "GEMV_KQ_MIXED", "one")
    (node,) = ops.gemv_nodes("blk.3.qkv", "store", qkv, NS(), 5120)
    assert node.name == "blk.3.qkv" and asked[-1][0] == "gemv.cu"
    monkeypatch.setattr(ops, "GEMV_KQ_MIXED", "split")
    nodes = ops.gemv_nodes("blk.3.qkv", "store", qkv, NS(), 5120)
    assert [n.name for n in nodes] == ["blk.3.qkv.q4_k", "blk.3.qkv.q6_k"]
    assert [re.sub(r"_s[24]$", "", n.kernel.name) for n in nodes] == ["gemvkq_store_q4_k", "gemvkq_store_q6_k"]
    assert [n.fmt for n in nodes] == ["Q4_K", "Q6_K+Q6_K"]
    assert [int(n.args[5]) for n in nodes] == [64, 128]  # rows of each part
    for mode, types in (("swiglu", [12, 14]), ("store", [12, 0]), ("store", [12, 6])):
        assert len(ops.gemv_nodes("n", mode, segs(types), NS(), 5120)) == 1, (mode, types)
    monkeypatch.setattr(ops, "GEMV_KQ_Q0", "1")  # Q8_0 rows on v9 (the default): a part of their own
    assert [n.name for n in ops.gemv_nodes("n", "store", segs([12, 8]), NS(), 5120)] == ["n.q4_k", "n.q8_0"]
    monkeypatch.setattr(ops, "GEMV_KQ_Q0", "0")
    assert len(ops.gemv_nodes("n", "store", segs([12, 8]), NS(), 5120)) == 1
    # beside: the same nodes, the one of fewer bytes marked and put first (the executor forks it)
    monkeypatch.setattr(ops, "GEMV_KQ_MIXED", "beside")
    big = segs([12, 14, 14], rows=64)[:1] + segs([12, 14, 14], rows=8)[1:]  # Q4_K 64 rows, Q6_K 2 x 8
    nodes = ops.gemv_nodes("blk.3.qkv", "store", big, NS(), 5120)
    assert [(n.name, n.beside) for n in nodes] == [("blk.3.qkv.q6_k", True), ("blk.3.qkv.q4_k", False)]
    small = segs([12, 14, 14], rows=8)[:1] + segs([12, 14, 14], rows=512)[1:]  # the Q6_K rows the bigger
    nodes = ops.gemv_nodes("blk.3.qkv", "store", small, NS(), 5120)
    assert [(n.name, n.beside) for n in nodes] == [("blk.3.qkv.q4_k", True), ("blk.3.qkv.q6_k", False)]
    assert nodes[0].bytes < nodes[1].bytes
    # a part of a KQ_GSPLIT build stays in line: its group arrays are per module (not reentrant)
    real_gemv = ops.gemv

    def gsplit_gemv(*a, **k):
        n = real_gemv(*a, **k)
        n.defines = n.defines + ("KQ_GSPLIT=1",) if n.name.endswith("q4_k") else n.defines
        return n
    monkeypatch.setattr(ops, "gemv", gsplit_gemv)
    nodes = ops.gemv_nodes("blk.3.qkv", "store", big, NS(), 5120)
    assert [(n.name, n.beside) for n in nodes] == [("blk.3.qkv.q4_k", False), ("blk.3.qkv.q6_k", False)]
    monkeypatch.setattr(ops, "gemv", real_gemv)
    monkeypatch.setattr(ops, "GEMV_KQ", "wide")
    assert len(ops.gemv_nodes("n", "store", qkv, NS(), 5120)) == 1
    monkeypatch.setattr(ops, "GEMV_KQ_MIXED", "yes")
    with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_KQ_MIXED"):
        ops.gemv_nodes("n", "store", qkv, NS(), 5120)
    assert "GGUF_HARNESS_GEMV_KQ_MIXED" in machine.ENGINE_SWITCHES


def test_tma_plan_hand_counts():
    """tma_plan.plan (engine v10's shared memory) on hand counts with 227 KiB per block: the
    ring after the staged x (gemv_smem, 128-byte aligned), 4 stages x 16 tile rows (x2 for a
    pair) of slots, each roundup16(kc x type_size) + 16 bytes."""
    from backends.engine.tma_plan import plan
    smem = 227 * 1024
    # Q4_K K = 5120: x 13440 B; (232448 - 4096 - 13440) / 64 = 3358 B per slot: whole rows
    p = plan(5120, 144, False, ops.gemv_smem(5120), smem)
    assert (p.kc, p.chunks, p.slot, p.ring_off, p.smem) == (20, 1, 2896, 13440, 13440 + 64 * 2896)
    # Q6_K K = 17408: x 45696 B; 2854 B per slot: 13 blocks fit, a multiple of 4 taken: 12 -> 6 chunks
    p = plan(17408, 210, False, ops.gemv_smem(17408), smem)
    assert (p.kc, p.chunks, p.slot, p.smem) == (12, 6, 2544, 45696 + 64 * 2544)
    # IQ4_XS gate/up pair K = 5120: 128 slots of 1679 B: 12 blocks, chunks of 12 and 8
    p = plan(5120, 136, True, ops.gemv_smem(5120), smem)
    assert (p.kc, p.chunks, p.slot, p.smem) == (12, 2, 1648, 13440 + 128 * 1648)
    assert plan(256, 210, False, ops.gemv_smem(256), smem).kc == 1
    # IQ3_S K = 17408 beside its 32960 B of static grid copies: (232448 - 32960 - 45696) / 64 = 2403 B
    # per slot: 21 blocks fit, 20 taken -> 4 chunks. With only the 4096 B reserve it planned kc 24,
    # 215680 B, over the opt-in limit with the static part (session 37's GPU failure).
    p = plan(17408, 110, False, ops.gemv_smem(17408), smem, static=32960)
    assert (p.kc, p.chunks, p.slot, p.smem) == (20, 4, 2224, 45696 + 64 * 2224)
    assert p.smem + 32960 <= smem
    assert plan(17408, 110, False, ops.gemv_smem(17408), smem, static=100).smem == \
        plan(17408, 110, False, ops.gemv_smem(17408), smem).smem  # at least the reserve is kept
    assert plan(5120, 144, False, ops.gemv_smem(5120), 20 * 1024) is None  # 46 B per slot: no block fits
    for bad in ((100, 144), (0, 144), (512, 0)):
        with pytest.raises(ValueError, match="TMA plan"):
            plan(bad[0], bad[1], False, 0, smem)


def test_gemv_tma_routing(monkeypatch):
    """ops.gemv with GGUF_HARNESS_GEMV_TMA=1: a single-type v9 node of each mode goes to
    gemv_tma.cu's gemvtma_<mode>_<type> with one block per SM (at most one per row), 17 warps, the
    plan's kc / slot / ring offset as arguments; F32 rows beside the type, Q8_0 and mixed types
    keep their kernels; a small-ring build (GGUF_HARNESS_GEMV_TMA_NST / _WARPS / _MINB / _RING)
    compiles with its defines and plans within its ring; unset keeps v9; a misaligned matrix and
    bad values are refused."""
    asked = _fake_module(monkeypatch)
    monkeypatch.setattr(ops.module, "smem_optin", lambda: 227 * 1024)
    for knob, val in (("GEMV_IMPL", "q16"), ("GEMV_ARGS", "value"), ("GEMV_KQ", "v9l8"),
                      ("GEMV_KQ_SPLIT", "auto"), ("GEMV_KQ_IQ3S", "1"), ("GEMV_TMA", "1"), ("GEMV_TMA_MIN_K", ""),
                      ("GEMV_TMA_NST", ""), ("GEMV_TMA_WARPS", ""), ("GEMV_TMA_MINB", ""), ("GEMV_TMA_RING", ""),
                      ("GEMV_TMA_BPS", ""), ("GEMV_TMA_RPW", "")):
        monkeypatch.setattr(ops, knob, val)
    for mode, types, K, rows, want in (("store", [12], 5120, 10240, "gemvtma_store_q4_k"),
                                       ("add", [14, 14], 17408, 5120, "gemvtma_add_q6_k"),
                                       ("swiglu", [23, 23], 5120, 17408, "gemvtma_swiglu_iq4_xs"),
                                       ("store", [21], 17408, 5, "gemvtma_store_iq3_s")):
        node = _gemv_node(mode, types, K, rows, lambda i: 256 << (20 + i))
        assert (asked[-1][0], node.kernel.name, asked[-1][2]) == ("gemv_tma.cu", want, ())
        assert node.grid == (min(2 * 132, rows),) and node.block == (17 * 32,)  # fake: 2 blocks per SM
        from backends.engine.tma_plan import plan
        from backends.engine.formats import FORMATS
        p = plan(K, FORMATS[types[0]].type_size, mode == "swiglu", ops.gemv_smem(K), 227 * 1024)
        assert [int(a) for a in node.args[6:]] == [p.kc, p.slot, p.ring_off] and node.smem == p.smem
    # the plan leaves room for the instance's static shared memory (IQ3_S: the grid copies)
    monkeypatch.setattr(ops.module, "kernel_in", lambda src, name, defines=(): asked.append(
        (src, name, tuple(defines))) or NS(name=name, shared_size_bytes=32960 if "iq3_s" in name else 192))
    for mode, types, K, rows in (("store", [21], 17408, 5120), ("swiglu", [21, 21], 5120, 17408),
                                 ("add", [14], 17408, 5120)):
        node = _gemv_node(mode, types, K, rows, lambda i: 256 << (20 + i))
        assert node.smem + node.kernel.shared_size_bytes <= 227 * 1024, (mode, types, node.smem)
    for types in ([12, 0], [8], [12, 14]):
        node = _gemv_node("store", types, 5120, 64, lambda i: 256 << (20 + i))
        assert not node.kernel.name.startswith("gemvtma_"), (types, node.kernel.name)
    with pytest.raises(ValueError, match="16-byte aligned"):
        _gemv_node("store", [12], 5120, 64, lambda i: (256 << 20) + 8)
    # a small-ring build: its defines, the plan of 2 stages x 8 rows under a 64 KiB ring, 9 warps
    for knob, val in (("GEMV_TMA_NST", "2"), ("GEMV_TMA_WARPS", "8"), ("GEMV_TMA_MINB", "2"), ("GEMV_TMA_RING", "65536")):
        monkeypatch.setattr(ops, knob, val)
    node = _gemv_node("store", [12], 5120, 10240, lambda i: 256 << 20)
    assert asked[-1][2] == ("TMA_NST=2", "TMA_WARPS=8", "TMA_MINB=2") and node.block == (9 * 32,)
    p = plan(5120, 144, False, ops.gemv_smem(5120), 227 * 1024, 2, 8, 65536)
    assert (p.kc, p.chunks) == (20, 1) and p.smem == 13440 + 16 * 2896  # 4096 B per slot: whole rows
    assert [int(a) for a in node.args[6:]] == [p.kc, p.slot, p.ring_off] and node.smem == p.smem
    # two rows per warp: 16 tile rows of a store node (2 stages x 16 slots of <= 2048 B: 14 blocks fit,
    # 12 taken, chunks of 12 and 8), a
    # gate/up pair keeps one row of each matrix per warp
    monkeypatch.setattr(ops, "GEMV_TMA_RPW", "2")
    node = _gemv_node("store", [12], 5120, 10240, lambda i: 256 << 20)
    assert asked[-1][2] == ("TMA_NST=2", "TMA_WARPS=8", "TMA_MINB=2", "TMA_RPW=2")
    p2 = plan(5120, 144, False, ops.gemv_smem(5120), 227 * 1024, 2, 16, 65536)
    assert [int(a) for a in node.args[6:]] == [p2.kc, p2.slot, p2.ring_off] and (p2.kc, p2.chunks) == (12, 2)
    node = _gemv_node("swiglu", [23, 23], 5120, 512, lambda i: 256 << (20 + i))
    pp = plan(5120, 136, True, ops.gemv_smem(5120), 227 * 1024, 2, 8, 65536)
    assert [int(a) for a in node.args[6:]] == [pp.kc, pp.slot, pp.ring_off]
    monkeypatch.setattr(ops, "GEMV_TMA_RPW", "")
    monkeypatch.setattr(ops, "GEMV_TMA_BPS", "1")  # one block per SM (the fake module has 2 resident)
    assert _gemv_node("store", [12], 5120, 10240, lambda i: 256 << 20).grid == (132,)
    monkeypatch.setattr(ops, "GEMV_TMA_BPS", "")
    monkeypatch.setattr(ops, "GEMV_TMA_WARPS", "")  # 16 warps: minBlocks 2 refused (spills)
    with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_TMA_MINB=2 needs"):
        _gemv_node("store", [12], 5120, 64, lambda i: 256 << 20)
    monkeypatch.setattr(ops, "GEMV_TMA_MINB", "")
    monkeypatch.setattr(ops, "GEMV_KQ", "wide")  # v10 replaces v9 only: gemv.cu's loops stay
    assert _gemv_node("store", [12], 5120, 64, lambda i: 256 << 20).kernel.name.startswith("gemv_")
    monkeypatch.setattr(ops, "GEMV_KQ", "v9l8")
    for knob, bad in (("GEMV_TMA_NST", "1"), ("GEMV_TMA_WARPS", "32"), ("GEMV_TMA_MINB", "0"), ("GEMV_TMA_RING", "64k"),
                      ("GEMV_TMA_BPS", "0"), ("GEMV_TMA_RPW", "3")):
        monkeypatch.setattr(ops, knob, bad)
        with pytest.raises(ValueError, match="GGUF_HARNESS_" + knob):
            _gemv_node("store", [12], 5120, 64, lambda i: 256 << 20)
        monkeypatch.setattr(ops, knob, "")
    monkeypatch.setattr(ops, "GEMV_TMA", "")
    assert _gemv_node("store", [12], 5120, 64, lambda i: 256 << 20).kernel.name.startswith("gemvkq_")
    monkeypatch.setattr(ops, "GEMV_TMA", "yes")
    with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_TMA"):
        _gemv_node("store", [12], 5120, 64, lambda i: 256 << 20)
    assert "GGUF_HARNESS_GEMV_TMA" in machine.ENGINE_SWITCHES


def test_v9_q8_0_q4_0_switch(monkeypatch):
    """GGUF_HARNESS_GEMV_KQ_Q0 (ops.GEMV_KQ_Q0, read at call time): "1" sends store/add/SwiGLU
    nodes of one of Q8_0 / Q4_0 with K % 256 == 0 to gemvkq_<mode>_q8_0 / _q4_0 (every split,
    F32 rows riding along in store/add, never the 4-lane, _p2 or TMA kernels); "0" leaves them on
    gemv.cu; another value is refused once such a node asks. The names exist in the source. Unset,
    the switch is on (the default since session 13's H200 run)."""
    assert ops.GEMV_KQ_Q0 == "1" or "GGUF_HARNESS_GEMV_KQ_Q0" in os.environ
    src = (ops.module.KERNEL_DIR / "gemv_kq.cu").read_text()
    assert ops.KV9_Q0_NAMES == {8: "q8_0", 2: "q4_0"}
    monkeypatch.setattr(ops, "GEMV_KQ_P2", "1")  # every P2 type: still none for Q8_0 / Q4_0
    for flag in ("0", "1"):
        monkeypatch.setattr(ops, "GEMV_KQ_Q0", flag)
        for t, n in ops.KV9_Q0_NAMES.items():
            assert f"KQ_MODES(T_{n.upper()}, {n})" in src
            for mode, types in (("store", [t]), ("add", [t, t]), ("swiglu", [t, t]), ("store", [t, 0, 0])):
                for lanes4 in (True, False):
                    for split, sfx in ((1, ""), (2, "_s2"), (4, "_s4")):
                        got = ops.kv9_kernel(mode, types, 4096, lanes4=lanes4, split=split)
                        assert got == (f"gemvkq_{mode}_{n}{sfx}" if flag == "1" else None), (flag, mode, types)
            assert ops.kv9_kernel("store", [t], 4096 + 32) is None   # K not whole groups of 8 blocks
            assert ops.kv9_kernel("swiglu", [t, 12], 4096) is None   # mixed pair
            assert ops.kv9_kernel("swiglu", [t, 0], 4096) is None    # F32 not in a gate/up pair
            assert ops.KV9_ALIGN[t] == 16                             # 16-byte chunk loads
        assert ops.kv9_kernel("store", [8, 2], 4096) is None          # two of them: mixed
    monkeypatch.setattr(ops, "GEMV_TMA", "1")  # no gemvtma_ instance for them: gemv_tma declines
    assert ops.gemv_tma("t", "store", [ops.Seg(NS(type_id=8), None)], None, 4096,
                        None, 0.0, 64) is None
    monkeypatch.setattr(ops, "GEMV_KQ_Q0", "yes")
    with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_KQ_Q0"):
        ops.kv9_kernel("store", [8], 4096)
    assert ops.kv9_kernel("store", [14], 5120, lanes4=False).startswith("gemvkq_store_q6_k")  # others do not ask
    assert "GGUF_HARNESS_GEMV_KQ_Q0" in machine.ENGINE_SWITCHES


def test_kv9_two_rows_per_warp_build(monkeypatch):
    """GGUF_HARNESS_GEMV_KQ_P2: "1" or type names select the _p2 kernels (two rows per warp) for
    store/add nodes of those 8-lane types, never for a gate/up pair or the 4-lane gemvkq4_ ones;
    the build gets -DKQ_P2=1 (so its cache entry and instances are its own); the split cost model
    sees 2 rows per warp; an unknown name is refused; unset changes nothing."""
    monkeypatch.setattr(ops, "GEMV_KQ_IQ3S", "1")
    monkeypatch.setattr(ops, "GEMV_KQ_P2", "")
    assert ops.kv9_defines() == () and ops.kv9_kernel("store", [12], 5120, lanes4=False) == "gemvkq_store_q4_k"
    monkeypatch.setattr(ops, "GEMV_KQ_P2", "1")
    assert ops.kv9_defines() == ("KQ_P2=1",)
    for t, name in ops.KV9_NAMES.items():
        assert ops.kv9_kernel("add", [t, 0], 5120, lanes4=False, split=2) == f"gemvkq_add_{name}_p2_s2"
        assert ops.kv9_kernel("swiglu", [t, t], 5120, lanes4=False) == f"gemvkq_swiglu_{name}"
    assert ops.kv9_kernel("store", [12], 5120, lanes4=True) == "gemvkq4_store_q4_k"
    assert ops.kv9_rows_per_warp("gemvkq_store_q4_k_p2_s4") == 2 and ops.kv9_rows_per_warp("gemvkq_store_q4_k") == 1
    monkeypatch.setattr(ops, "GEMV_KQ_P2", "Q4_K, iq4_xs")
    assert ops.kv9_p2_types() == {12, 23}
    assert ops.kv9_kernel("store", [14], 5120, lanes4=False) == "gemvkq_store_q6_k"
    assert ops.kv9_kernel("store", [23], 5120, lanes4=False) == "gemvkq_store_iq4_xs_p2"
    src = (ops.module.KERNEL_DIR / "gemv_kq.cu").read_text()
    assert "#if KQ_P2" in src and "TNAME##_p2" in src
    monkeypatch.setattr(ops, "GEMV_KQ_P2", "q4_k,q8_0")
    with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_KQ_P2"):
        ops.kv9_defines()
    assert "GGUF_HARNESS_GEMV_KQ_P2" in machine.ENGINE_SWITCHES


def test_kv9_two_rows_per_warp_default_is_q6_k_up_to_6144():
    """With neither switch exported the engine builds P2 for q6_k nodes with K <= 6144 (the
    session-12 default: the 27B's head and qkv.q6_k nodes); "0" turns it off."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if not k.startswith("GGUF_HARNESS_GEMV_KQ_P2")}
    code = ("from backends.engine import ops; print(sorted(ops.kv9_p2_types()), ops.kv9_p2_max_k(), "
            "ops.kv9_kernel('store', [14], 5120, lanes4=False), ops.kv9_kernel('store', [14], 17408, lanes4=False))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["[14]", "6144", "gemvkq_store_q6_k_p2", "gemvkq_store_q6_k"], out
    out = subprocess.run([sys.executable, "-c", code], env={**env, "GGUF_HARNESS_GEMV_KQ_P2": "0"},
                         capture_output=True, text=True, check=True).stdout
    assert out.split()[:1] == ["[]"] and "gemvkq_store_q6_k_p2" not in out, out


def test_kv9_two_rows_per_warp_only_up_to_max_k(monkeypatch):
    """GGUF_HARNESS_GEMV_KQ_P2_MAX_K=N keeps the _p2 kernels to nodes with K <= N (the 27B's
    K = 17408 ffn_down lost with them); unset: every K; a non-positive or non-integer value is
    refused."""
    monkeypatch.setattr(ops, "GEMV_KQ_P2", "q5_k,q6_k")
    monkeypatch.setattr(ops, "GEMV_KQ_P2_MAX_K", "")
    assert ops.kv9_kernel("store", [13], 17408, lanes4=False) == "gemvkq_store_q5_k_p2"
    monkeypatch.setattr(ops, "GEMV_KQ_P2_MAX_K", "6144")
    assert ops.kv9_kernel("store", [13], 6144, lanes4=False) == "gemvkq_store_q5_k_p2"
    assert ops.kv9_kernel("add", [14, 14], 5120, lanes4=False) == "gemvkq_add_q6_k_p2"
    assert ops.kv9_kernel("store", [13], 17408, lanes4=False) == "gemvkq_store_q5_k"
    assert ops.kv9_kernel("add", [12], 5120, lanes4=False) == "gemvkq_add_q4_k"  # not a P2 type
    for bad in ("0", "-5", "6k"):
        monkeypatch.setattr(ops, "GEMV_KQ_P2_MAX_K", bad)
        with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_KQ_P2_MAX_K"):
            ops.kv9_kernel("store", [13], 6144, lanes4=False)
        monkeypatch.setattr(ops, "GEMV_KQ_P2", "")  # refused at build time even without P2
        with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_KQ_P2_MAX_K"):
            ops.kv9_defines()
        monkeypatch.setattr(ops, "GEMV_KQ_P2", "q5_k,q6_k")
    assert "GGUF_HARNESS_GEMV_KQ_P2_MAX_K" in machine.ENGINE_SWITCHES


def test_iq4_xil_switch(monkeypatch):
    """GGUF_HARNESS_GEMV_IQ4_XIL: 1 or unset (the default since session 11) builds gemv_kq.cu and
    gemv_tma.cu with the kernels' own IQ4_XIL default (no define), "0" or "" with -DIQ4_XIL=0; an
    IQ4_XS node with F32 rows stays on gemv_kq.cu either way (f32_row reads the interleaved
    staging in the natural order); other values are refused."""
    for off in ("", "0"):
        monkeypatch.setattr(ops, "GEMV_IQ4_XIL", off)
        assert ops.kv9_defines() == ("IQ4_XIL=0",) and ops.tma_defines() == ("IQ4_XIL=0",)
        assert ops.kv9_kernel("store", [23, 0], 5120, lanes4=False) == "gemvkq_store_iq4_xs"
    monkeypatch.setattr(ops, "GEMV_IQ4_XIL", "1")
    assert ops.kv9_defines() == () and ops.tma_defines() == ()
    assert ops.kv9_kernel("store", [23, 0], 5120, lanes4=False) == "gemvkq_store_iq4_xs"
    assert ops.kv9_kernel("swiglu", [23, 23], 5120, lanes4=False) == "gemvkq_swiglu_iq4_xs"
    assert ops.kv9_kernel("store", [12, 0], 5120, lanes4=False) == "gemvkq_store_q4_k"
    monkeypatch.setattr(ops, "GEMV_IQ4_XIL", "2")
    with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_IQ4_XIL"):
        ops.kv9_defines()
    # unset means on: a fresh interpreter without the variable
    env = {k: v for k, v in os.environ.items() if k != "GGUF_HARNESS_GEMV_IQ4_XIL"}
    out = subprocess.run([sys.executable, "-c", "from backends.engine import ops; print(ops.GEMV_IQ4_XIL, ops.iq4_xil_defines())"],
                         env=env, capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.split() == ["1", "()"], out
    assert "GGUF_HARNESS_GEMV_IQ4_XIL" in machine.ENGINE_SWITCHES


def test_kv9_two_rows_per_warp_only_from_min_rows(monkeypatch):
    """GGUF_HARNESS_GEMV_KQ_P2_MIN_ROWS=N keeps the _p2 kernels to nodes of >= N rows when the
    caller gives the node's rows (the 1024-row Q6_K node leaves most SMs idle with two rows per
    warp); the default is 2048, "" takes every row count, a non-integer is refused."""
    monkeypatch.setattr(ops, "GEMV_KQ_P2", "q6_k")
    monkeypatch.setattr(ops, "GEMV_KQ_P2_MAX_K", "6144")
    monkeypatch.setattr(ops, "GEMV_KQ_P2_MIN_ROWS", "2048")
    assert ops.kv9_p2_min_rows() == 2048
    assert ops.kv9_kernel("store", [14], 5120, lanes4=False, rows=1024) == "gemvkq_store_q6_k"
    assert ops.kv9_kernel("store", [14], 5120, lanes4=False, rows=2047) == "gemvkq_store_q6_k"
    assert ops.kv9_kernel("add", [14, 14], 5120, lanes4=False, rows=2048) == "gemvkq_add_q6_k_p2"
    assert ops.kv9_kernel("store", [14], 5120, lanes4=False, rows=248320, split=2) == "gemvkq_store_q6_k_p2_s2"
    assert ops.kv9_kernel("store", [14], 5120, lanes4=False) == "gemvkq_store_q6_k_p2"  # rows not given
    monkeypatch.setattr(ops, "GEMV_KQ_P2_MIN_ROWS", "")
    assert ops.kv9_kernel("store", [14], 5120, lanes4=False, rows=1024) == "gemvkq_store_q6_k_p2"
    for bad in ("-1", "2k", "1.5"):
        monkeypatch.setattr(ops, "GEMV_KQ_P2_MIN_ROWS", bad)
        with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_KQ_P2_MIN_ROWS"):
            ops.kv9_kernel("store", [14], 5120, lanes4=False, rows=4096)
        with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_KQ_P2_MIN_ROWS"):
            ops.kv9_defines()
    assert "GGUF_HARNESS_GEMV_KQ_P2_MIN_ROWS" in machine.ENGINE_SWITCHES


def test_iq4_kreg_switch(monkeypatch):
    """GGUF_HARNESS_GEMV_IQ4_KREG: "1" or "" the default build (gemv_kq.cu defines IQ4_KREG 1: the
    IQ4_XS codebook words in registers), "0" builds it with IQ4_KREG=0; anything else is refused
    before a build."""
    monkeypatch.setattr(ops, "GEMV_IQ4_KREG", "0")
    assert "IQ4_KREG=0" in ops.kv9_defines()
    for v in ("1", ""):
        monkeypatch.setattr(ops, "GEMV_IQ4_KREG", v)
        assert not any(d.startswith("IQ4_KREG") for d in ops.kv9_defines())
    src = (Path(ops.__file__).parent / "kernels" / "gemv_kq.cu").read_text()
    m = re.search(r"#ifndef IQ4_KREG\n(//.*\n)*#define IQ4_KREG 1\n#endif\n", src)
    assert m and m.end() <= src.index('#include "kq_traits.cuh"')  # before kwide_iq4.cuh reads it
    hdr = (Path(ops.__file__).parent / "kernels" / "kwide_iq4.cuh").read_text()
    assert hdr.index("#define IQ4_XIL 1") < hdr.index("#if IQ4_KREG && IQ4_XIL")  # the guard sees XIL
    monkeypatch.setattr(ops, "GEMV_IQ4_KREG", "yes")
    with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_IQ4_KREG"):
        ops.kv9_defines()
    assert "GGUF_HARNESS_GEMV_IQ4_KREG" in machine.ENGINE_SWITCHES


def test_bw_switch(monkeypatch):
    """GGUF_HARNESS_GEMV_KQ_BW: "" or "16" the default 16-warp blocks (no define), "32" builds
    KQ_BLOCK_WARPS=32 and the node's block, grid and split model follow (kv9_warps); anything else
    is refused before a build; results record it."""
    for v in ("", "16"):
        monkeypatch.setattr(ops, "GEMV_KQ_BW", v)
        assert ops.kv9_warps() == 16 and not any(d.startswith("KQ_BLOCK_WARPS") for d in ops.kv9_defines())
    monkeypatch.setattr(ops, "GEMV_KQ_BW", "32")
    assert ops.kv9_warps() == 32 and "KQ_BLOCK_WARPS=32" in ops.kv9_defines()
    # 2 rows per warp, S = 2: 32 rows per block-round instead of 16; 320 blocks over 132 slots = 3 passes
    assert ops.kv9_split_cost(10240, 5120, 2, 2, 132) == 3 * 2 * 3
    for bad in ("8", "64", "x"):
        monkeypatch.setattr(ops, "GEMV_KQ_BW", bad)
        with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_KQ_BW"):
            ops.kv9_defines()
    assert "GGUF_HARNESS_GEMV_KQ_BW" in machine.ENGINE_SWITCHES


def test_wide_min_rows_switch(monkeypatch):
    """GGUF_HARNESS_GEMV_KQ_WIDE_MIN_ROWS: unset or "" takes the split-1 nodes of at least
    KV9_WIDE_MIN_ROWS (8192) rows to the wide build (S > 1 nodes never), a row count that
    threshold, "off" none; the wide build's defines replace the block size and row order settings;
    a bad value is refused before a build."""
    for v in ("", "8192"):
        monkeypatch.setattr(ops, "GEMV_KQ_WIDE_MIN_ROWS", v)
        assert ops.kv9_wide(17408, 1) and ops.kv9_wide(8192, 1) and ops.kv9_wide(248320, 1)
        assert not ops.kv9_wide(8191, 1) and not ops.kv9_wide(17408, 2) and not ops.kv9_wide(5120, 1)
    monkeypatch.setattr(ops, "GEMV_KQ_WIDE_MIN_ROWS", "off")
    assert not ops.kv9_wide(248320, 1)
    monkeypatch.setattr(ops, "GEMV_KQ_WIDE_MIN_ROWS", "0")
    assert ops.kv9_wide(1, 1) and not ops.kv9_wide(1, 4)
    assert ops.kv9_wide_defines(("KQ_P2=1", "KQ_BLOCK_WARPS=16", "KQ_WMAJ=1", "IQ4_XIL=0")) == (
        "KQ_P2=1", "IQ4_XIL=0", "KQ_BLOCK_WARPS=32", "KQ_WMAJ=1")
    for bad in ("-1", "8k", "1.5", "on"):
        monkeypatch.setattr(ops, "GEMV_KQ_WIDE_MIN_ROWS", bad)
        with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_KQ_WIDE_MIN_ROWS"):
            ops.kv9_defines()
    assert "GGUF_HARNESS_GEMV_KQ_WIDE_MIN_ROWS" in machine.ENGINE_SWITCHES



def test_wmaj_switch(monkeypatch):
    """GGUF_HARNESS_GEMV_KQ_WMAJ (row groups dealt warp-major): "1" builds gemv_kq.cu with KQ_WMAJ=1,
    and the wide build keeps it; "0" or "" leaves the kernel's default; anything else is refused
    before a build; results record it."""
    attr, env, define = "GEMV_KQ_WMAJ", "GGUF_HARNESS_GEMV_KQ_WMAJ", "KQ_WMAJ=1"
    monkeypatch.setattr(ops, attr, "1")
    assert define in ops.kv9_defines()
    assert define in ops.kv9_wide_defines(ops.kv9_defines())
    for v in ("0", ""):
        monkeypatch.setattr(ops, attr, v)
        assert not any(d.startswith(define.split("=")[0]) for d in ops.kv9_defines())
    for bad in ("on", "2"):
        monkeypatch.setattr(ops, attr, bad)
        with pytest.raises(ValueError, match=env):
            ops.kv9_defines()
    assert env in machine.ENGINE_SWITCHES


def test_csplit_routing(monkeypatch):
    """GGUF_HARNESS_GEMV_KQ_CSPLIT=1 (kernels/gemv_kq.cu KQ_CSPLIT): ops.kv9_csplit names the _c<S>
    cluster kernel for the 8-lane store/add kernels of split 2 or 4 without a fused norm (=2: _c2
    for both), and
    nothing else (SwiGLU pairs, split 1, the _p2 and gemvkq4_ kernels, normed nodes, the switch
    off); a bad value is refused, also by kv9_defines before any build; results record it."""
    monkeypatch.setattr(ops, "GEMV_KQ_CSPLIT", "1")
    assert ops.kv9_csplit("gemvkq_store_q4_k_s4", "store", 4, False) == "gemvkq_store_q4_k_c4"
    assert ops.kv9_csplit("gemvkq_add_q5_k_s2", "add", 2, False) == "gemvkq_add_q5_k_c2"
    for other in ("q6_k", "iq3_s", "iq4_xs", "q8_0", "q4_0"):  # measured slower (Q6_K, IQ3_S) or not measured
        assert ops.kv9_csplit(f"gemvkq_add_{other}_s4", "add", 4, False) is None
    for args in (("gemvkq_store_q4_k_s4", "store", 4, True),     # a fused norm
                 ("gemvkq_swiglu_q4_k_s2", "swiglu", 2, False),  # a pair
                 ("gemvkq_store_q4_k", "store", 1, False),       # split 1
                 ("gemvkq_store_q6_k_p2_s2", "store", 2, False),  # two rows per warp
                 ("gemvkq4_store_q4_k_s2", "store", 2, False),   # 4 lanes per super-block
                 ("gemvkq_store_q4_k_s2", "store", 4, False)):   # a name of another split
        assert ops.kv9_csplit(*args) is None, args
    monkeypatch.setattr(ops, "GEMV_KQ_CSPLIT", "2")  # clusters of at most 2 blocks
    assert ops.kv9_csplit("gemvkq_store_q4_k_s4", "store", 4, False) == "gemvkq_store_q4_k_c2"
    assert ops.kv9_csplit("gemvkq_add_q5_k_s2", "add", 2, False) == "gemvkq_add_q5_k_c2"
    assert ops.kv9_csplit("gemvkq_store_q4_k_s4", "store", 4, True) is None
    for knob in ("GEMV_KQ_PF", "GEMV_KQ_PIPE", "GEMV_KQ_L1PF"):  # the latency A/B builds keep the S-split
        monkeypatch.setattr(ops, knob, "1")
        assert ops.kv9_csplit("gemvkq_store_q4_k_s4", "store", 4, False) is None
        monkeypatch.setattr(ops, knob, "")
    monkeypatch.setattr(ops, "GEMV_KQ_CSPLIT", "0")
    assert ops.kv9_csplit("gemvkq_store_q4_k_s4", "store", 4, False) is None
    monkeypatch.setattr(ops, "GEMV_KQ_CSPLIT", "")  # unset: the default, groups of S
    assert ops.kv9_csplit("gemvkq_store_q4_k_s4", "store", 4, False) == "gemvkq_store_q4_k_c4"
    monkeypatch.setattr(ops, "GEMV_KQ_GSPLIT", "0")
    assert ops.kv9_csplit_defines(("KQ_P2=1", "KQ_WMAJ=1", "IQ4_XIL=0"), 4) == ("KQ_P2=1", "IQ4_XIL=0", "KQ_CSPLIT=1")
    monkeypatch.setattr(ops, "GEMV_KQ_CSPLIT", "2")
    assert ops.kv9_csplit("gemvkq_store_q4_k_s2", "store", 2, False, f32_rows=True) is None  # F32 rows beside


def test_csplit_round_bound_matches_the_kernel():
    """ops.KQ_CS_MAXR (the host's bound on a cluster-split warp's rounds) is the kernel's
    KQ_CS_MAXR (the partial sums it keeps: rows of later rounds would not be stored)."""
    src = (Path(ops.__file__).parent / "kernels" / "gemv_kq.cu").read_text()
    m = re.search(r"^#define KQ_CS_MAXR (\d+)", src, re.M)
    assert m and int(m.group(1)) == ops.KQ_CS_MAXR


def test_max_active_clusters_falls_back_without_the_driver(monkeypatch):
    """module.max_active_clusters: where cuOccupancyMaxActiveClusters cannot answer (no libcuda, a
    failed call), blocks per SM x SMs // cluster size."""
    from backends.engine import launch, module
    monkeypatch.setattr(module, "blocks_per_sm", lambda k, threads, smem: 2)
    monkeypatch.setattr(module, "sm_count", lambda: 132)
    for exc in (OSError("libcuda.so.1"), RuntimeError("CUresult 1")):
        def fail(*a, exc=exc):
            raise exc
        monkeypatch.setattr(launch, "max_active_clusters", fail)
        assert module.max_active_clusters(NS(), 2, 512, 0) == 132 and module.max_active_clusters(NS(), 4, 512, 0) == 66
    monkeypatch.setattr(launch, "max_active_clusters", lambda k, cs, threads, smem: 61)
    assert module.max_active_clusters(NS(), 4, 512, 0) == 61
    for bad in ("on", "3"):
        monkeypatch.setattr(ops, "GEMV_KQ_CSPLIT", bad)
        with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_KQ_CSPLIT"):
            ops.kv9_csplit("gemvkq_store_q4_k_s4", "store", 4, False)
        with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_KQ_CSPLIT"):
            ops.kv9_defines()
    assert "GGUF_HARNESS_GEMV_KQ_CSPLIT" in machine.ENGINE_SWITCHES


def test_part_rot_switch(monkeypatch):
    """GGUF_HARNESS_GEMV_KQ_PART_ROT (kernels/gemv_kq.cu kq_row_part: a row's leftover super-block
    groups rotated over the 4 parts of the group / cluster kernels) is keyed by the row group by
    default: "" and row add no define (the kernel's default, 2), round and 1 add KQ_PART_ROT=1 and 0
    KQ_PART_ROT=0, to the 4-part cluster builds only (no other kernel reads it); another value is
    refused before any build; results record it; the kernel's default is 2 and one rule
    (kKqPartRot: CS == 4) serves the staging and the row loop."""
    for on in ("", "row"):
        monkeypatch.setattr(ops, "GEMV_KQ_PART_ROT", on)
        assert ops.kv9_part_rot() == 2
        assert not any(d.startswith("KQ_PART_ROT") for d in ops.kv9_csplit_defines(ops.kv9_defines(), 4))
    for value, define in (("0", "KQ_PART_ROT=0"), ("round", "KQ_PART_ROT=1"), ("1", "KQ_PART_ROT=1")):
        monkeypatch.setattr(ops, "GEMV_KQ_PART_ROT", value)
        assert define in ops.kv9_csplit_defines(ops.kv9_defines(), 4), value
        assert not any(d.startswith("KQ_PART_ROT") for d in ops.kv9_csplit_defines(ops.kv9_defines(), 2))
        assert not any(d.startswith("KQ_PART_ROT") for d in ops.kv9_defines())
    for bad in ("2", "on", "Row"):
        monkeypatch.setattr(ops, "GEMV_KQ_PART_ROT", bad)
        with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_KQ_PART_ROT"):
            ops.kv9_defines()
        with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_KQ_PART_ROT"):
            ops.kv9_csplit_defines((), 4)
    assert "GGUF_HARNESS_GEMV_KQ_PART_ROT" in machine.ENGINE_SWITCHES
    kdir = Path(ops.__file__).parent / "kernels"
    xs = (kdir / "xstage.cuh").read_text()
    assert re.search(r"^#define KQ_PART_ROT (\d+)", xs, re.M).group(1) == "2"
    assert "constexpr bool kKqPartRot = KQ_PART_ROT && CS == 4;" in xs
    assert "constexpr bool rot = kKqPartRot<CS>;" in xs
    assert "kq_row_sel<Q, nparts, kKqPartRot<CS>>" in (kdir / "gemv_kq.cu").read_text()
    # the key: the row group under 2 (the default), the warp's round under 1
    assert "KQ_PART_ROT == 2 ? base / rpb : round, pre0, pre_skip)" in (kdir / "gemv_kq.cu").read_text()


def test_part_rot_row_key_takes_an_odd_group_count(monkeypatch):
    """Under the row key (GGUF_HARNESS_GEMV_KQ_PART_ROT "" or row, the default) the leftover's part
    is (m + cb + round ncb) mod 4 (kernels/gemv_kq.cu), which cycles through the 4 parts over a
    warp's rounds only for an odd group count ncb: ops.kv9_odd_groups drops one group from an even
    count when the rows still fit in as many rounds, and changes nothing otherwise or under the
    other settings."""
    monkeypatch.setattr(ops, "GEMV_KQ_PART_ROT", "")
    assert ops.kv9_odd_groups(66, 5120, 16, 17408) == 65  # "" is the row key
    assert ops.kv9_odd_groups(66, 5120, 16, 2816) == 65  # 11 super-blocks: 3 groups, all leftovers
    assert ops.kv9_odd_groups(66, 5120, 16, 1024) == 65  # 1 group: a leftover too
    for K in (16384, 8192, 4096):  # 16, 8, 4 groups: no leftover, nothing to rotate, the full count
        assert ops.kv9_odd_groups(66, 5120, 16, K) == 66, K
    monkeypatch.setattr(ops, "GEMV_KQ_PART_ROT", "row")
    assert ops.kv9_odd_groups(66, 5120, 16, 17408) == 65  # 320 row groups: 5 rounds either way
    assert ops.kv9_odd_groups(65, 5120, 16, 17408) == 65  # already odd
    assert ops.kv9_odd_groups(64, 1024, 16, 17408) == 64  # 64 row groups: 1 round, 63 groups would need 2
    assert ops.kv9_odd_groups(2, 5120, 16, 17408) == 2    # too few to drop one
    for key in ("round", "1", "0"):
        monkeypatch.setattr(ops, "GEMV_KQ_PART_ROT", key)
        assert ops.kv9_odd_groups(66, 5120, 16, 17408) == 66
    for groups in range(3, 80):  # the property the kernel needs, wherever a group could go
        monkeypatch.setattr(ops, "GEMV_KQ_PART_ROT", "row")
        for rows in (1000, 5120, 9001):
            got = ops.kv9_odd_groups(groups, rows, 16, 17408)
            assert got in (groups, groups - 1)
            assert -(-rows // (16 * got)) == -(-rows // (16 * groups))
            assert got % 2 or -(-rows // (16 * (groups - 1))) > -(-rows // (16 * groups))


def test_dq_routing(monkeypatch):
    """GGUF_HARNESS_GEMV_KQ_DQ (kernels/gemv_kq.cu KQ_DQ, a row queue per block): unset or "1" (the
    default) gives the wide SwiGLU nodes whose kernel is an 8-lane one-row-per-warp one (the 27B's
    gate/up pairs) the wide build without KQ_WMAJ plus KQ_DQ=1 (and KQ_DQ_P / _T / _MAP when set);
    "all" also the store/add ones (ssm_in with its F32 rows, qkv.q4_k); the _p2 wide nodes (the
    Q6_K head), nodes below the wide threshold, S > 1 nodes and the latency A/B builds keep their
    builds; "0" changes nothing; bad values of any of the four switches are refused, also by
    kv9_defines before any build; results record them."""
    IQ4_XS, Q4_K, Q5_K, Q6_K = 23, 12, 13, 14
    _fake_module(monkeypatch)
    monkeypatch.setattr(ops, "GEMV_IMPL", "q16")
    monkeypatch.setattr(ops, "GEMV_ARGS", "value")
    monkeypatch.setattr(ops, "GEMV_KQ", "v9l8")
    monkeypatch.setattr(ops, "GEMV_KQ_SPLIT", "auto")
    monkeypatch.setattr(ops, "GEMV_KQ_WIDE_MIN_ROWS", "")
    monkeypatch.setattr(ops, "GEMV_KQ_P2", "q6_k")
    monkeypatch.setattr(ops, "GEMV_KQ_P2_MIN_ROWS", "2048")
    for knob in ("GEMV_KQ_DQ", "GEMV_KQ_DQ_P", "GEMV_KQ_DQ_T", "GEMV_KQ_DQ_MAP"):  # unset: the defaults
        monkeypatch.setattr(ops, knob, "")
    ptr = lambda i: 1 << 20 + i
    wide = ops.kv9_wide_defines(ops.kv9_defines())
    want = tuple(d for d in wide if not d.startswith("KQ_WMAJ=")) + ("KQ_DQ=1",)
    pair = ("swiglu", [IQ4_XS, IQ4_XS], 17408)
    stores = (("store", [Q5_K, 0], 16480), ("store", [Q4_K], 12288))
    for on in ("", "1", "all"):
        monkeypatch.setattr(ops, "GEMV_KQ_DQ", on)
        for mode, types, rows in (pair,) + stores:
            n = _gemv_node(mode, types, 5120, rows, ptr)
            queued = mode == "swiglu" or on == "all"
            assert n.defines == (want if queued else wide), (on, mode, n.kernel.name, n.defines)
            assert n.block == (1024,) and n.kernel.name[-3:-1] != "_s", (on, mode, n.kernel.name)
    monkeypatch.setattr(ops, "GEMV_KQ_DQ", "all")
    head = _gemv_node("store", [Q6_K], 5120, 248320, ptr)  # two rows per warp: the plain wide build
    assert head.kernel.name == "gemvkq_store_q6_k_p2" and head.defines == wide
    assert "KQ_DQ=1" not in _gemv_node("store", [Q4_K], 5120, 4096, ptr).defines  # below 8192 rows
    monkeypatch.setattr(ops, "GEMV_KQ_DQ_P", "2")
    monkeypatch.setattr(ops, "GEMV_KQ_DQ_T", "8")
    monkeypatch.setattr(ops, "GEMV_KQ_DQ_MAP", "0")
    assert _gemv_node("store", [Q4_K], 5120, 12288, ptr).defines == want + ("KQ_DQ_P=2", "KQ_DQ_T=8", "KQ_DQ_MAP=0")
    monkeypatch.setattr(ops, "GEMV_KQ_DQ_T", "08")  # a decimal count, not an octal C literal
    assert "KQ_DQ_T=8" in _gemv_node("store", [Q4_K], 5120, 12288, ptr).defines
    for knob in ("GEMV_KQ_DQ_P", "GEMV_KQ_DQ_T", "GEMV_KQ_DQ_MAP"):
        monkeypatch.setattr(ops, knob, "")
    for knob in ("GEMV_KQ_PF", "GEMV_KQ_PIPE", "GEMV_KQ_L1PF"):
        monkeypatch.setattr(ops, knob, "1")
        assert "KQ_DQ=1" not in _gemv_node(*pair[:2], 5120, pair[2], ptr).defines, knob
        monkeypatch.setattr(ops, knob, "")
    assert not ops.kv9_dq("gemvkq_swiglu_q4_k_s2") and not ops.kv9_dq("gemvkq4_swiglu_q4_k")
    monkeypatch.setattr(ops, "GEMV_KQ_DQ", "0")
    assert _gemv_node(*pair[:2], 5120, pair[2], ptr).defines == wide
    for knob, bad in (("GEMV_KQ_DQ", "2"), ("GEMV_KQ_DQ", "on"), ("GEMV_KQ_DQ_P", "3"), ("GEMV_KQ_DQ_P", "8"),
                      ("GEMV_KQ_DQ_T", "0"), ("GEMV_KQ_DQ_T", "33"), ("GEMV_KQ_DQ_T", "\u0668"),
                      ("GEMV_KQ_DQ_MAP", "2")):
        monkeypatch.setattr(ops, knob, bad)
        with pytest.raises(ValueError, match="GGUF_HARNESS_" + knob):
            ops.kv9_defines()
        monkeypatch.setattr(ops, knob, "")
    assert {"GGUF_HARNESS_GEMV_KQ_DQ", "GGUF_HARNESS_GEMV_KQ_DQ_P", "GGUF_HARNESS_GEMV_KQ_DQ_T",
            "GGUF_HARNESS_GEMV_KQ_DQ_MAP"} <= set(machine.ENGINE_SWITCHES)


def test_conv_fusion_routing(monkeypatch):
    """GGUF_HARNESS_GEMV_KQ_CONV=1 (kernels/gemv_kq.cu KQ_CONV): every v9 build gets the conv fields
    (KQ_CONV=1 in kv9_defines, tables of ops.table_dtype(conv=True)); a store node given `conv`
    (qwen35's ssm_in) carries the conv state, taps and output addresses and C in its table, and its
    bytes grow by the conv's; a conv whose C is not segment 0's rows, or whose arrays are wrong, is
    refused; `conv` on a node of another mode, or with the switch off, changes nothing; a bad switch
    value is refused before a build; results record it."""
    from backends.engine.arena import DeviceTensor
    from backends.engine.formats import FORMATS
    Q5_K, F32 = 13, 0
    _fake_module(monkeypatch)
    for knob, v in (("GEMV_IMPL", "q16"), ("GEMV_ARGS", "value"), ("GEMV_KQ", "v9l8"), ("GEMV_KQ_SPLIT", "auto"),
                    ("GEMV_KQ_WIDE_MIN_ROWS", ""), ("GEMV_KQ_XPF", "")):
        monkeypatch.setattr(ops, knob, v)
    K, C = 512, 640
    rb = K // FORMATS[Q5_K].block_size * FORMATS[Q5_K].type_size
    qkv_w = DeviceTensor("qkv", 1 << 24, Q5_K, (K, C), rb, rb * C)
    f32_w = DeviceTensor("beta", 1 << 25, F32, (K, 4), 4 * K, 16 * K)
    taps = DeviceTensor("ssm_conv1d.weight", 1 << 26, F32, (4, C), 16, 16 * C)

    def arr(n, ptr):  # a cupy-like float32 array at device address ptr
        return NS(dtype=np.float32, size=n, shape=(n,), flags={"C_CONTIGUOUS": True}, data=NS(ptr=ptr))
    qkv, state, y = arr(C, 0x10000), arr(3 * C, 0x20000), arr(C, 0x30000)
    segs = [ops.Seg(qkv_w, qkv), ops.Seg(f32_w, arr(4, 0x40000))]
    conv = (state, taps, y, C)
    monkeypatch.setattr(ops, "GEMV_KQ_CONV", "0")
    plain = ops.gemv("ssm_in", "store", segs, NS(), K, conv=conv)
    assert "KQ_CONV=1" not in plain.defines and "conv" not in plain.args[0].dtype.names
    monkeypatch.setattr(ops, "GEMV_KQ_CONV", "1")
    assert "KQ_CONV=1" in ops.kv9_defines()
    n = ops.gemv("ssm_in", "store", segs, NS(), K, conv=conv)
    assert "KQ_CONV=1" in n.defines and n.args[0].dtype == ops.table_dtype(conv=True)
    assert tuple(int(v) for v in n.args[0]["conv"]) == (0x20000, 1 << 26, 0x30000, C, 0)
    assert n.bytes - plain.bytes == 4 * C * (6 + 4 + 1)  # state read + write, taps, y
    other = ops.gemv("plain", "store", segs, NS(), K)  # the same build, no conv given: fields zero
    assert "KQ_CONV=1" in other.defines and int(other.args[0]["conv"]["state"]) == 0
    with pytest.raises(ValueError, match="channels"):
        ops.gemv("ssm_in", "store", segs, NS(), K, conv=(state, taps, y, C - 1))
    with pytest.raises(ValueError, match="conv state"):
        ops.gemv("ssm_in", "store", segs, NS(), K, conv=(arr(2 * C, 0x20000), taps, y, C))
    add = ops.gemv("o", "add", [ops.Seg(qkv_w, qkv)], NS(), K, conv=conv)  # not a store: ignored
    assert int(add.args[0]["conv"]["state"]) == 0
    for bad in ("2", "on"):
        monkeypatch.setattr(ops, "GEMV_KQ_CONV", bad)
        with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_KQ_CONV"):
            ops.kv9_defines()
    assert "GGUF_HARNESS_GEMV_KQ_CONV" in machine.ENGINE_SWITCHES


def _deltanet_layer(monkeypatch, S=64, slots=3):
    """qwen35._deltanet's inputs for one small DeltaNet layer (Hk 2, Hv 4, head size S, n_embd 512),
    fake device arrays and a fake kernel module: (p, arena, buffers b, weights); b.conv[0] has
    `slots` rows (3: conv_step's shifted state, 4: GDN_CONV's ring)."""
    from backends.engine.arena import DeviceTensor
    from backends.engine.formats import FORMATS
    Q5_K, F32 = 13, 0
    _fake_module(monkeypatch)
    for knob, v in (("GEMV_IMPL", "q16"), ("GEMV_ARGS", "value"), ("GEMV_KQ_SPLIT", "auto"),
                    ("GEMV_KQ_WIDE_MIN_ROWS", ""), ("GEMV_KQ_XPF", "")):
        monkeypatch.setattr(ops, knob, v)
    E, hk, hv = 512, 2, 4
    C, d_inner = 2 * hk * S + hv * S, hv * S
    p = NS(ssm_n_group=hk, ssm_dt_rank=hv, ssm_d_state=S, conv_dim=C, ssm_d_conv=4, n_embd=E, eps=1e-6,
           d_inner=d_inner)
    ptr = iter(range(1 << 24, 1 << 40, 1 << 22))

    def tensor(name, t, ne):
        f = FORMATS[t]
        rb = ne[0] // f.block_size * f.type_size
        return DeviceTensor(name, next(ptr), t, ne, rb, rb * (ne[1] if len(ne) > 1 else 1))
    weights = {"attn_qkv.weight": tensor("qkv", Q5_K, (E, C)), "attn_gate.weight": tensor("gate", Q5_K, (E, d_inner)),
               "ssm_beta.weight": tensor("beta", F32, (E, hv)), "ssm_alpha.weight": tensor("alpha", F32, (E, hv)),
               "attn_norm.weight": tensor("norm", F32, (E,)), "ssm_conv1d.weight": tensor("taps", F32, (4, C)),
               "ssm_dt.bias": tensor("dt", F32, (hv,)), "ssm_a": tensor("a", F32, (hv,)),
               "ssm_norm.weight": tensor("sn", F32, (S,)), "ssm_out.weight": tensor("out", Q5_K, (d_inner, E))}
    arena = {f"blk.0.{k}": v for k, v in weights.items()}

    def arr(*shape, dtype=np.float32):
        n = int(np.prod(shape))
        return NS(dtype=dtype, size=n, shape=shape, flags={"C_CONTIGUOUS": True}, data=NS(ptr=next(ptr)))
    b = NS(x=arr(E), qkv=arr(C), z=arr(d_inner), beta=arr(hv), alpha=arr(hv), y=arr(C), o=arr(d_inner),
           conv=[arr(slots, C)], ssm=[arr(hv, S, S)], state=arr(4, dtype=np.int32))
    return p, arena, b, weights


def test_qwen35_layer_drops_its_conv_node_only_when_fused(monkeypatch):
    """backends/engine/qwen35._deltanet with GGUF_HARNESS_GEMV_KQ_CONV=1 and a v9 ssm_in: 3 nodes
    (ssm_in, ssm_step, ssm_out), the ssm_in table carrying the layer's conv state, taps and y;
    with the switch off, or with ssm_in on gemv.cu (GGUF_HARNESS_GEMV_KQ=wide: no KQ_CONV build),
    4 nodes with the conv node. Small shapes (Hk 2, Hv 4, S 64, C 512, n_embd 512), fake
    device arrays."""
    from backends.engine import qwen35
    p, arena, b, weights = _deltanet_layer(monkeypatch)
    C = p.conv_dim
    for kq, on, want in (("v9l8", "1", ["ssm_in", "ssm_step", "ssm_out"]),
                         ("v9l8", "0", ["ssm_in", "ssm_conv", "ssm_step", "ssm_out"]),
                         ("wide", "1", ["ssm_in", "ssm_conv", "ssm_step", "ssm_out"])):
        monkeypatch.setattr(ops, "GEMV_KQ", kq)
        monkeypatch.setattr(ops, "GEMV_KQ_CONV", on)
        nodes = qwen35._deltanet(0, 0, p, arena, b)
        assert [n.name.split(".")[-1] for n in nodes] == want, (kq, on)
        table = nodes[0].args[0]
        if len(want) == 3:
            assert tuple(int(v) for v in table["conv"]) == (b.conv[0].data.ptr, weights["ssm_conv1d.weight"].ptr,
                                                          b.y.data.ptr, C, 0)
        else:
            assert "conv" not in (table.dtype.names or ()) or int(table["conv"]["state"]) == 0


def test_qwen35_layer_with_the_conv_in_the_step(monkeypatch):
    """GGUF_HARNESS_GDN_CONV=1 at S = 128: qwen35._deltanet gives ssm_in (no conv fields), ssm_step on
    gdn_convstep_cs4_s128_e fed the projection qkv, the ring b.conv[0] [4, C], y and the step state,
    and ssm_out; with GGUF_HARNESS_GEMV_KQ_CONV=1 as well it refuses the pair (ValueError)."""
    from backends.engine import deltanet_ops, qwen35
    p, arena, b, _ = _deltanet_layer(monkeypatch, S=128, slots=4)
    monkeypatch.setattr(deltanet_ops, "GDN_CONV", "1")
    monkeypatch.setattr(deltanet_ops, "GDN_EARLY", "1")
    monkeypatch.setattr(deltanet_ops, "GDN_CSPLIT", "1")
    monkeypatch.setattr(ops, "GEMV_KQ", "v9l8")
    monkeypatch.setattr(ops, "GEMV_KQ_CONV", "0")
    nodes = qwen35._deltanet(0, 0, p, arena, b)
    assert [n.name.split(".")[-1] for n in nodes] == ["ssm_in", "ssm_step", "ssm_out"]
    step = nodes[1]
    assert step.grid == (4 * 4,) and step.args[0] is b.qkv and step.args[1] is b.conv[0]
    assert step.args[3] is b.y and step.args[4] is b.state and int(step.args[5]) == p.conv_dim
    assert "KQ_CONV=1" not in nodes[0].defines
    monkeypatch.setattr(ops, "GEMV_KQ_CONV", "1")
    with pytest.raises(ValueError, match="GGUF_HARNESS_GDN_CONV=1"):
        qwen35._deltanet(0, 0, p, arena, b)


def test_table_dtypes_match_the_kernel_struct():
    """ops.table_dtype mirrors struct SegTable of kernels/segs.cuh in each build: 152 bytes, the
    two XpfSeg records (24 bytes each) at 152 with KQ_XPF, the ConvArgs record (32 bytes) after
    them (at 152 or 200) with KQ_CONV; gemv_kq.cu's static_asserts hold the C side to the same
    sizes (its NVRTC compiles in tests/test_kernels_compile.py)."""
    want = {(False, False): (152, None, None), (True, False): (200, 152, None),
            (False, True): (184, None, 152), (True, True): (232, 152, 200)}
    for (x, c), (size, xoff, coff) in want.items():
        dt = ops.table_dtype(x, c)
        assert dt.itemsize == size, (x, c)
        assert (dt.fields["xpf"][1] if x else None) == xoff and (dt.fields["conv"][1] if c else None) == coff
    assert ops.CONV_DT.itemsize == 32 and ops.table_dtype() == ops.TABLE_DT
    src = (Path(ops.__file__).parent / "kernels" / "gemv_kq.cu").read_text()
    assert "sizeof(SegTable) == 200 + 32 * KQ_CONV" in src and "sizeof(SegTable) == 152 + 48 * KQ_XPF + 32" in src


def test_gemv_routes_csplit(monkeypatch):
    """ops.gemv with GGUF_HARNESS_GEMV_KQ_CSPLIT on (2, the default; 1): a v9 store/add node of split
    2 or 4 of a KV9_CSPLIT_TYPES type without a norm runs the _c kernel of the cluster-split build
    (kv9_csplit_defines) on a
    grid of whole clusters, as many as are co-resident (module.max_active_clusters) and no more
    than its row groups need; a SwiGLU pair, a split-1 node and a node of more than KQ_CS_MAXR
    rounds keep their kernels."""
    IQ3_S, Q4_K = 21, 12
    asked = _fake_module(monkeypatch)
    monkeypatch.setattr(ops, "GEMV_IMPL", "q16")
    monkeypatch.setattr(ops, "GEMV_ARGS", "value")
    monkeypatch.setattr(ops, "GEMV_KQ", "v9l8")
    monkeypatch.setattr(ops, "GEMV_KQ_SPLIT", "auto")
    monkeypatch.setattr(ops, "GEMV_KQ_CSPLIT", "2")
    monkeypatch.setattr(ops, "GEMV_KQ_GSPLIT", "0")  # hardware clusters (test_gemv_routes_gsplit: the groups)
    ptr = lambda i: 1 << 20 + i
    n = _gemv_node("store", [Q4_K], 5120, 64, ptr)  # split 2 by kv9_split (as the IQ3_S test above)
    assert n.kernel.name == "gemvkq_store_q4_k_c2" and n.grid == (2 * 4,) and n.block == (512,)
    assert n.defines == ops.kv9_csplit_defines(ops.kv9_defines(), 2)
    assert _gemv_node("store", [IQ3_S], 5120, 64, ptr).kernel.name == "gemvkq_store_iq3_s_s2"  # not its type
    n = _gemv_node("add", [Q4_K], 17408, 5120, ptr)  # the 27B's ffn_down: split 4
    assert n.kernel.name == "gemvkq_add_q4_k_c2" and n.grid == (2 * 132,)
    assert _gemv_node("swiglu", [Q4_K, Q4_K], 5120, 64, ptr).kernel.name == "gemvkq_swiglu_q4_k_s2"
    assert _gemv_node("store", [Q4_K], 5120, 10240, ptr).kernel.name == "gemvkq_store_q4_k"
    monkeypatch.setattr(ops, "GEMV_KQ_CSPLIT", "1")
    n = _gemv_node("add", [Q4_K], 17408, 5120, ptr)
    # 6 rounds of 62 clusters; the row key (the default) makes it 61 (6 rounds still: kv9_odd_groups)
    assert n.kernel.name == "gemvkq_add_q4_k_c4" and n.grid == (4 * 61,)
    monkeypatch.setattr(ops, "GEMV_KQ_SPLIT", "2")
    n = _gemv_node("store", [Q4_K], 4096, 40000, ptr)  # 19 rounds of 132 clusters of 2 > KQ_CS_MAXR
    assert n.kernel.name == "gemvkq_store_q4_k_s2" and "KQ_CSPLIT=1" not in n.defines
    assert asked[-1][1] == "gemvkq_store_q4_k_c2"  # compiled for the occupancy query, then not used
    monkeypatch.setattr(ops, "GEMV_KQ_SPLIT", "auto")
    monkeypatch.setattr(ops, "GEMV_KQ_CSPLIT", "2")
    # F32 rows beside (an ssm_in without its norm): the S-split (f32_row reads a whole row per block)
    assert _gemv_node("store", [Q4_K, 0], 5120, 64, ptr).kernel.name == "gemvkq_store_q4_k_s2"
    # a fused norm: the S-split (the norm needs every square)
    from backends.engine.arena import DeviceTensor
    from backends.engine.formats import FORMATS
    rb = 5120 // FORMATS[Q4_K].block_size * FORMATS[Q4_K].type_size
    w = DeviceTensor("w", 1 << 20, Q4_K, (5120, 64), rb, rb * 64)
    nw = DeviceTensor("nw", 1 << 21, 0, (5120,), 4 * 5120, 4 * 5120)
    n = ops.gemv("n", "store", [ops.Seg(w, NS(size=64, data=NS(ptr=4096)))], NS(), 5120, nw, 1e-6)
    assert n.kernel.name == "gemvkq_store_q4_k_s2"
    # 32-warp blocks (GGUF_HARNESS_GEMV_KQ_BW=32): 32 row groups per cluster, 1024-thread blocks
    monkeypatch.setattr(ops, "GEMV_KQ_BW", "32")
    monkeypatch.setattr(ops.module, "blocks_per_sm", lambda k, threads, smem: 1)
    n = _gemv_node("add", [Q4_K], 17408, 5120, ptr)
    assert n.kernel.name.endswith("_c2") and n.block == (1024,) and n.grid == (2 * 132,)
    assert "KQ_BLOCK_WARPS=32" in n.defines and "KQ_CSPLIT=1" in n.defines
    # the 4-lane kernels (GGUF_HARNESS_GEMV_KQ=v9) have no cluster form
    monkeypatch.setattr(ops, "GEMV_KQ_BW", "")
    monkeypatch.setattr(ops, "GEMV_KQ", "v9")
    assert _gemv_node("add", [Q4_K], 17408, 5120, ptr).kernel.name.startswith("gemvkq4_")


def test_gemv_routes_gsplit(monkeypatch):
    """GGUF_HARNESS_GEMV_KQ_GSPLIT=1: a cluster-split node keeps its _c kernel name and routing but
    is built with KQ_GSPLIT=1 (no __cluster_dims__) on a grid of every block slot in whole groups
    (blocks per SM x SMs // parts, not the cluster occupancy: 66 groups of 4 where the GPCs held 62
    clusters), no more than its row groups need nor KQ_GS_MAXCB; a bad switch value raises."""
    Q4_K = 12
    _fake_module(monkeypatch)
    for knob, v in (("GEMV_IMPL", "q16"), ("GEMV_ARGS", "value"), ("GEMV_KQ", "v9l8"), ("GEMV_KQ_SPLIT", "auto"),
                    ("GEMV_KQ_CSPLIT", "1"), ("GEMV_KQ_BW", ""), ("GEMV_KQ_GSPLIT", "1")):
        monkeypatch.setattr(ops, knob, v)
    ptr = lambda i: 1 << 20 + i
    n = _gemv_node("add", [Q4_K], 17408, 5120, ptr)  # the 27B's ffn_down: split 4
    # 66 groups (every block slot); the row key (the default) takes 65: 5 rounds either way (kv9_odd_groups)
    assert n.kernel.name == "gemvkq_add_q4_k_c4" and n.grid == (4 * 65,) and n.block == (512,)
    assert n.defines == ops.kv9_csplit_defines(ops.kv9_defines(), 4) and n.defines[-2:] == ("KQ_CSPLIT=1", "KQ_GSPLIT=1")
    n = _gemv_node("store", [Q4_K], 5120, 64, ptr)  # 4 row groups of 16 warps: 4 groups of 2 blocks
    assert n.kernel.name == "gemvkq_store_q4_k_c2" and n.grid == (2 * 4,) and "KQ_GSPLIT=1" in n.defines
    # "4": groups of 4 in global memory, 2-part nodes as hardware clusters (their occupancy query)
    monkeypatch.setattr(ops, "GEMV_KQ_GSPLIT", "4")
    n = _gemv_node("add", [Q4_K], 17408, 5120, ptr)
    assert n.kernel.name == "gemvkq_add_q4_k_c4" and n.grid == (4 * 65,) and "KQ_GSPLIT=1" in n.defines
    n = _gemv_node("add", [Q4_K], 6144, 5120, ptr)  # the 27B's ssm_out: split 2
    assert n.kernel.name == "gemvkq_add_q4_k_c2" and "KQ_GSPLIT=1" not in n.defines and n.grid == (2 * 132,)
    monkeypatch.setattr(ops, "GEMV_KQ_GSPLIT", "1")
    monkeypatch.setattr(ops.module, "blocks_per_sm", lambda k, threads, smem: 16)  # 528 groups of 4 > 512
    n = _gemv_node("add", [Q4_K], 17408, 16 * 600, ptr)  # 600 row groups (kv9_split picks 2 or 4 parts)
    cs = int(n.kernel.name[-1])
    assert n.kernel.name[:-1] == "gemvkq_add_q4_k_c" and n.grid == (cs * ops.KQ_GS_MAXCB,)
    src = (Path(ops.__file__).parent / "kernels" / "gemv_kq.cu").read_text()
    assert re.search(r"^#define KQ_GS_MAXCB (\d+)", src, re.M).group(1) == str(ops.KQ_GS_MAXCB)
    # GGUF_HARNESS_GEMV_KQ_GS_FENCE=0: a fence in every thread (session 18's form), a define of the
    # KQ_GSPLIT builds only; "" and 1 leave the kernel's default (one fence per block)
    monkeypatch.setattr(ops, "GEMV_KQ_GS_FENCE", "0")
    n = _gemv_node("add", [Q4_K], 17408, 5120, ptr)
    assert n.defines[-3:] == ("KQ_CSPLIT=1", "KQ_GSPLIT=1", "KQ_GS_FENCE=0")
    monkeypatch.setattr(ops, "GEMV_KQ_GSPLIT", "4")  # a hardware cluster of 2 has no group to fence
    assert "KQ_GS_FENCE=0" not in _gemv_node("add", [Q4_K], 6144, 5120, ptr).defines
    for v in ("", "1"):
        monkeypatch.setattr(ops, "GEMV_KQ_GS_FENCE", v)
        assert not any(d.startswith("KQ_GS_FENCE") for d in _gemv_node("add", [Q4_K], 17408, 5120, ptr).defines)
    src = (Path(ops.__file__).parent / "kernels" / "gemv_kq.cu").read_text()
    assert re.search(r"^#define KQ_GS_FENCE (\d+)", src, re.M).group(1) == "1"
    monkeypatch.setattr(ops, "GEMV_KQ_GS_FENCE", "2")
    with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_KQ_GS_FENCE"):
        ops.kv9_defines()
    monkeypatch.setattr(ops, "GEMV_KQ_GS_FENCE", "")
    assert "GGUF_HARNESS_GEMV_KQ_GS_FENCE" in machine.ENGINE_SWITCHES
    monkeypatch.setattr(ops, "GEMV_KQ_GSPLIT", "")  # unset: the default, 4
    assert "KQ_GSPLIT=1" in _gemv_node("add", [Q4_K], 17408, 5120, ptr).defines
    assert "KQ_GSPLIT=1" not in _gemv_node("add", [Q4_K], 6144, 5120, ptr).defines
    monkeypatch.setattr(ops, "GEMV_KQ_GSPLIT", "0")
    assert "KQ_GSPLIT=1" not in _gemv_node("add", [Q4_K], 17408, 5120, ptr).defines
    for bad in ("yes", "2", " 1"):
        monkeypatch.setattr(ops, "GEMV_KQ_GSPLIT", bad)
        with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_KQ_GSPLIT"):
            ops.kv9_defines()


def test_first_row_prefetch_switch(monkeypatch):
    """GGUF_HARNESS_GEMV_KQ_PF0 (kernels/gemv_kq.cu KQ_PF0): unset or "3" keeps the kernel's default
    (the first round asked for before the PDL wait: no define), "0" / "1" / "2" build KQ_PF0=0 / 1 / 2
    into every v9 GEMV node (the wide, queue and cluster builds too); GGUF_HARNESS_GEMV_KQ_PF0_SB=n
    builds KQ_PF0_SB=n (8, the kernel's default, none) and n != 8 only with PF0 3; any other value
    is refused before a build; results record both, the defaults too (test below)."""
    from backends.engine import switches
    _fake_module(monkeypatch)
    for knob, v in (("GEMV_IMPL", "q16"), ("GEMV_ARGS", "value"), ("GEMV_KQ", "v9l8"), ("GEMV_KQ_SPLIT", "auto"),
                    ("GEMV_KQ_WIDE_MIN_ROWS", ""), ("GEMV_KQ_XPF", ""), ("GEMV_KQ_CONV", "0"), ("GEMV_KQ_PF0_SB", "")):
        monkeypatch.setattr(ops, knob, v)
    for v in ("", "3"):
        monkeypatch.setattr(ops, "GEMV_KQ_PF0", v)
        assert not any(d.startswith("KQ_PF0") for d in ops.kv9_defines())
    IQ4_XS, Q4_K, Q5_K = 23, 12, 13
    ptr = lambda i: 1 << 20 + i
    monkeypatch.setattr(ops, "GEMV_KQ_DQ", "")
    for v in ("0", "1", "2"):
        monkeypatch.setattr(ops, "GEMV_KQ_PF0", v)
        assert f"KQ_PF0={v}" in ops.kv9_defines()
        (src, _, defines), = _v9_launches(monkeypatch, [("store", [Q4_K])])
        assert src == "gemv_kq.cu" and f"KQ_PF0={v}" in defines
        assert switches.effective()["GGUF_HARNESS_GEMV_KQ_PF0"] == v
        pair = _gemv_node("swiglu", [IQ4_XS, IQ4_XS], 5120, 17408, ptr)
        assert f"KQ_PF0={v}" in pair.defines and "KQ_DQ=1" in pair.defines  # wide, queued
        assert f"KQ_PF0={v}" in _gemv_node("store", [Q4_K], 5120, 10240, ptr).defines  # wide
        part = _gemv_node("add", [Q5_K], 6144, 5120, ptr)  # the 27B's ssm_out: a split node
        assert part.kernel.name[-3:-1] in ("_s", "_c") and f"KQ_PF0={v}" in part.defines, (part.kernel.name, part.defines)
    for v in ("", "3"):
        monkeypatch.setattr(ops, "GEMV_KQ_PF0", v)
        for sb, define in (("8", None), ("4", "KQ_PF0_SB=4"), ("2", "KQ_PF0_SB=2"), ("16", "KQ_PF0_SB=16"), ("1", "KQ_PF0_SB=1")):
            monkeypatch.setattr(ops, "GEMV_KQ_PF0_SB", sb)
            got = [d for d in ops.kv9_defines() if d.startswith("KQ_PF0")]
            assert got == ([define] if define else []), (v, sb, got)
        assert "KQ_PF0_SB=1" in _gemv_node("swiglu", [IQ4_XS, IQ4_XS], 5120, 17408, ptr).defines
        assert switches.effective()["GGUF_HARNESS_GEMV_KQ_PF0_SB"] == "1"
    for bad in ("0", "17", "x", " 2"):
        monkeypatch.setattr(ops, "GEMV_KQ_PF0_SB", bad)
        with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_KQ_PF0_SB"):
            ops.kv9_defines()
    monkeypatch.setattr(ops, "GEMV_KQ_PF0_SB", "2")
    monkeypatch.setattr(ops, "GEMV_KQ_PF0", "1")  # whole rows: SB would not be used
    with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_KQ_PF0_SB=2 needs"):
        ops.kv9_defines()
    monkeypatch.setattr(ops, "GEMV_KQ_PF0_SB", "8")  # the default's value: nothing to refuse
    assert [d for d in ops.kv9_defines() if d.startswith("KQ_PF0")] == ["KQ_PF0=1"]
    monkeypatch.setattr(ops, "GEMV_KQ_PF0_SB", "")
    for bad in ("4", "on", " 0", "3W", "3w"):
        monkeypatch.setattr(ops, "GEMV_KQ_PF0", bad)
        with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_KQ_PF0"):
            ops.kv9_defines()
    assert {"GGUF_HARNESS_GEMV_KQ_PF0", "GGUF_HARNESS_GEMV_KQ_PF0_SB"} <= set(machine.ENGINE_SWITCHES)


def test_first_round_preload_switch(monkeypatch):
    """GGUF_HARNESS_GEMV_KQ_PRE (kernels/gemv_kq.cu KQ_PRE): unset or "0" builds no define, "1"
    KQ_PRE=1 into every v9 GEMV node of the 27B step's routes (the wide queue build of a SwiGLU pair
    and of a wide store, the 16-warp split and P2 builds, the group-split build); with KQ_PIPE or
    KQ_L1PF (their own carried registers / prefetches) and any value but 0 / 1 it is refused before
    a build; results record it."""
    from backends.engine import switches
    _fake_module(monkeypatch)
    for knob, v in (("GEMV_IMPL", "q16"), ("GEMV_ARGS", "value"), ("GEMV_KQ", "v9l8"), ("GEMV_KQ_SPLIT", "auto"),
                    ("GEMV_KQ_WIDE_MIN_ROWS", ""), ("GEMV_KQ_XPF", ""), ("GEMV_KQ_CONV", "0"), ("GEMV_KQ_PF0_SB", ""),
                    ("GEMV_KQ_PF0", ""), ("GEMV_KQ_PIPE", ""), ("GEMV_KQ_L1PF", ""), ("GEMV_KQ_DQ", ""),
                    ("GEMV_KQ_P2", "q6_k"), ("GEMV_KQ_P2_MIN_ROWS", "2048")):
        monkeypatch.setattr(ops, knob, v)
    IQ4_XS, Q4_K, Q5_K, Q6_K = 23, 12, 13, 14
    ptr = lambda i: 1 << 20 + i
    routes = lambda: [_gemv_node("swiglu", [IQ4_XS, IQ4_XS], 5120, 17408, ptr), _gemv_node("store", [Q4_K], 5120, 10240, ptr),
                      _gemv_node("add", [Q5_K], 6144, 5120, ptr), _gemv_node("add", [Q4_K], 17408, 5120, ptr),
                      _gemv_node("store", [Q6_K], 5120, 4096, ptr), _gemv_node("store", [Q6_K], 5120, 1024, ptr)]
    for v in ("", "0"):
        monkeypatch.setattr(ops, "GEMV_KQ_PRE", v)
        assert not any(d.startswith("KQ_PRE") for d in ops.kv9_defines())
        assert not any(d.startswith("KQ_PRE") for n in routes() for d in n.defines)
    monkeypatch.setattr(ops, "GEMV_KQ_PRE", "1")
    nodes = routes()
    assert all("KQ_PRE=1" in n.defines for n in nodes), [(n.kernel.name, n.defines) for n in nodes]
    names = [n.kernel.name for n in nodes]
    assert "KQ_DQ=1" in nodes[0].defines and any("_p2" in k for k in names), names
    assert any(k.endswith(("_c2", "_c4")) for k in names) and any(k.endswith(("_s2", "_s4")) for k in names), names
    assert switches.effective()["GGUF_HARNESS_GEMV_KQ_PRE"] == "1"
    for other in ("GEMV_KQ_PIPE", "GEMV_KQ_L1PF"):
        with monkeypatch.context() as m:
            m.setattr(ops, other, "1")
            with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_KQ_PRE=1 with"):
                ops.kv9_defines()
    for bad in ("2", "on", " 1", "true"):
        monkeypatch.setattr(ops, "GEMV_KQ_PRE", bad)
        with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_KQ_PRE"):
            ops.kv9_defines()
    assert "GGUF_HARNESS_GEMV_KQ_PRE" in machine.ENGINE_SWITCHES


def test_first_row_prefetch_defaults_are_recorded():
    """Unset or empty, GGUF_HARNESS_GEMV_KQ_PF0, _PF0_SB and _PRE read as the kernel's defaults ("3", "8", "0"), so a
    result's switches_effective tells the session-25 default from the PF0=1 default before it
    (whose unset value read "") (a fresh interpreter: the module reads the environment at import)."""
    import json
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GGUF_HARNESS_GEMV_KQ_PF0", "GGUF_HARNESS_GEMV_KQ_PRE"))}
    code = ("import json; from backends.engine import ops, switches; e = switches.effective(); "
            "print(json.dumps([e['GGUF_HARNESS_GEMV_KQ_PF0'], e['GGUF_HARNESS_GEMV_KQ_PF0_SB'], e['GGUF_HARNESS_GEMV_KQ_PRE'], "
            "[d for d in ops.kv9_defines() if d.startswith('KQ_PF0')]]))")
    for pf0, sb in ((None, None), ("", "")):
        run_env = env | {k: v for k, v in (("GGUF_HARNESS_GEMV_KQ_PF0", pf0), ("GGUF_HARNESS_GEMV_KQ_PF0_SB", sb),
                                           ("GGUF_HARNESS_GEMV_KQ_PRE", sb))
                         if v is not None}
        out = subprocess.run([sys.executable, "-c", code], env=run_env, cwd=Path(__file__).resolve().parents[1],
                             capture_output=True, text=True, check=True).stdout
        assert json.loads(out) == ["3", "8", "0", []], (pf0, sb)
