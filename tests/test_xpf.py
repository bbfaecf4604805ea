"""GGUF_HARNESS_GEMV_KQ_XPF (kernels/gemv_kq.cu KQ_XPF, backends/engine/xpf.py): the switch, the
by-value table's layout with the next node's rows, and which rows of which node each v9 GEMV is
told to prefetch. The kernel side: tests/test_kernels_compile.py (the build compiles, and its
static_assert holds the C struct to 200 bytes) and the GPU test in tests/test_engine_kernels.py."""
from __future__ import annotations

from types import SimpleNamespace as NS

import numpy as np
import pytest

from backends.engine import ops, xpf
from harness import machine

MiB = 1 << 20


def test_xpf_switch(monkeypatch):
    """Unset, "" or "0": off (no define, 0 bytes); 1..64 MiB: KQ_XPF=1 in every v9 build's defines
    and that many bytes per next node; anything else refused, also by kv9_defines before a build."""
    for off in ("", "0"):
        monkeypatch.setattr(ops, "GEMV_KQ_XPF", off)
        assert ops.kv9_xpf_bytes() == 0 and "KQ_XPF=1" not in ops.kv9_defines()
    monkeypatch.setattr(ops, "GEMV_KQ_XPF", "16")
    assert ops.kv9_xpf_bytes() == 16 * MiB and "KQ_XPF=1" in ops.kv9_defines()
    assert "KQ_XPF=1" in ops.kv9_wide_defines(ops.kv9_defines())
    assert "KQ_XPF=1" in ops.kv9_csplit_defines(ops.kv9_defines(), 4)
    for bad in ("33", "-1", "8M", "1.5", "on", "\u0668"):
        monkeypatch.setattr(ops, "GEMV_KQ_XPF", bad)
        with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_KQ_XPF"):
            ops.kv9_defines()
    assert "GGUF_HARNESS_GEMV_KQ_XPF" in machine.ENGINE_SWITCHES


def test_xpf_table_layout():
    """ops.table_dtype(xpf=True) is struct SegTable with KQ_XPF (kernels/segs.cuh): the 152 bytes of the plain
    table, then two 24-byte XpfSeg records (u64 pointer, then four int32) at byte 152; the kernel
    asserts sizeof(SegTable) == 200 in that build."""
    assert ops.TABLE_DT.itemsize == 152
    assert ops.XPF_DT.itemsize == 24 and [ops.XPF_DT.fields[f][1] for f in ("w", "row_bytes", "rows", "bytes")] == [0, 8, 12, 16]
    assert ops.table_dtype(xpf=True).itemsize == 200 and ops.table_dtype(xpf=True).fields["xpf"][1] == 152
    for f in ("s", "n", "row_bytes"):
        assert ops.table_dtype(xpf=True).fields[f][1] == ops.TABLE_DT.fields[f][1]
    src = (ops.module.KERNEL_DIR / "gemv_kq.cu").read_text()
    assert "static_assert(sizeof(SegTable) == 200" in src


def _seg(ptr, type_id, rows, row_bytes):
    w = NS(ptr=ptr, type_id=type_id, rows=rows, row_bytes=row_bytes)
    return NS(w=w, bias=0, out=NS(data=NS(ptr=4096)))


def _node(name, segs, grid, block, xpf_build=True, kind="gemv"):
    table = ops.seg_table_value(segs, xpf=xpf_build)
    return NS(name=name, kind=kind, kernel=NS(name=name), grid=(grid,), block=(block,),
              args=(table, "x", 0), defines=("KQ_P2=1", "KQ_XPF=1") if xpf_build else ("KQ_P2=1",))


def test_link_points_each_v9_node_at_the_next_ones_first_rows():
    """A 27B-like run of nodes: ssm_in (Q5_K 16384 rows + F32 96 rows, 132 blocks of 32 warps),
    a delta-rule node (not a GEMV), ssm_out (Q5_K, 264 blocks of 16 warps), a gate/up pair
    (2 x 17408 IQ4_XS rows, 132 x 32 warps) and a GEMV of another build. Expected values worked
    out by hand from xpf.py's docstring: the next v9 node's first-pass rows are its grid's warps
    (4224 here; half that for the cluster-of-2 kernel), a pair's gate and up rows alike, spread
    over the segments in row order; the per-row share is the cap over those rows in whole
    128-byte lines, at most the row."""
    Q5_K, IQ4_XS, F32 = 13, 23, 0
    ssm_in = _node("gemvkq_store_q5_k", [_seg(0x1000000, Q5_K, 16384, 3520), _seg(0x9000000, F32, 96, 20480)], 132, 1024)
    step = _node("gdn_step", [_seg(0xA000000, F32, 1, 256)], 192, 512, xpf_build=False, kind="deltanet")
    ssm_out = _node("gemvkq_add_q5_k_c2", [_seg(0x2000000, Q5_K, 5120, 4224)], 264, 512)
    pair = _node("gemvkq_swiglu_iq4_xs", [_seg(0x3000000, IQ4_XS, 17408, 2720), _seg(0x5000000, IQ4_XS, 17408, 2720)],
                 132, 1024)
    other = _node("gemv_store_w1_b4", [_seg(0x7000000, Q5_K, 10, 3520)], 4, 128, xpf_build=False)
    nodes = [ssm_in, step, ssm_out, pair, other]
    before_step, before_other = step.args[0].tobytes(), other.args[0].tobytes()
    assert xpf.link(nodes, 16 * MiB) == 2
    got = lambda n: [tuple(int(v) for v in n.args[0]["xpf"][k]) for k in range(2)]
    # ssm_in -> ssm_out, clusters of 2 (_c2): 264 x 16 = 4224 warps, a row per 2 blocks' warps: rows
    # 0..2111; 16 MiB / 2112 = 7943.8 B -> 7936 (62 lines), capped at the 4224-byte row
    assert got(ssm_in) == [(0x2000000, 4224, 2112, 4224, 0), (0, 0, 0, 0, 0)]
    # ssm_out -> the pair: 4224 gate rows and 4224 up rows; 16 MiB / 8448 = 1985.9 B -> 1920 (15 lines)
    assert got(ssm_out) == [(0x3000000, 2720, 4224, 1920, 0), (0x5000000, 2720, 4224, 1920, 0)]
    assert got(pair) == [(0, 0, 0, 0, 0)] * 2  # the last v9 node: nothing after it
    assert step.args[0].tobytes() == before_step and other.args[0].tobytes() == before_other
    assert ssm_in.args[1:] == ("x", 0)  # the other arguments kept
    # a node before ssm_in of the XPF build: ssm_in's first 4224 rows lie in its Q5_K segment
    first = _node("gemvkq_add_q5_k", [_seg(0x8000000, Q5_K, 5120, 3520)], 132, 1024)
    xpf.link([first, ssm_in], 16 * MiB)
    assert got(first) == [(0x1000000, 3520, 4224, 3520, 0), (0, 0, 0, 0, 0)]  # 3968 capped at the 3520-byte row
    # a small next node: all its rows, each whole (the share capped at the row)
    small = _node("gemvkq_store_q6_k", [_seg(0x6000000, 14, 100, 4200), _seg(0x6100000, F32, 3, 512)], 132, 1024)
    xpf.link([first, small], 16 * MiB)
    assert got(first) == [(0x6000000, 4200, 100, 4200, 0), (0x6100000, 512, 3, 512, 0)]
    # cap 0: fields cleared
    xpf.link([first, small], 0)
    assert got(first) == [(0, 0, 0, 0, 0)] * 2


def test_link_is_called_at_load(monkeypatch):
    """The engine links the decode step's nodes once they are built (backend.py), before any
    launch: a source check, since loading needs a GPU."""
    from backends.engine import backend
    src = open(backend.__file__).read()
    build = src.index("arch.build(")
    assert "xpf.link(body + head)" in src[build:build + 300]
    assert src.index("xpf.link(") < src.index("Executor(body")


def test_first_pass_rows_by_kernel_form():
    """The rows a v9 kernel's first pass covers, worked out from kq_body's row orders: one row per
    warp (S = 1, the queue, warp-major), two for _p2 and gemvkq4_, a row per S warps (_s2 / _s4)
    or per cluster of blocks (_c2 / _c4)."""
    W = 4224
    assert xpf.first_pass_rows("gemvkq_swiglu_iq4_xs", W) == 4224
    assert xpf.first_pass_rows("gemvkq_store_q6_k_p2", W) == 8448
    assert xpf.first_pass_rows("gemvkq4_store_q4_k", W) == 8448
    assert xpf.first_pass_rows("gemvkq_add_q4_k_s4", W) == 1056
    assert xpf.first_pass_rows("gemvkq_store_q6_k_p2_s2", W) == 4224
    assert xpf.first_pass_rows("gemvkq_add_q5_k_c2", W) == 2112


def test_link_drops_a_cached_launch():
    """A node launched before linking relaunches with the linked table (its cached PDL launch,
    built from the old arguments, is dropped)."""
    a = _node("gemvkq_store_q5_k", [_seg(0x1000000, 13, 100, 3520)], 132, 1024)
    b = _node("gemvkq_store_q5_k", [_seg(0x2000000, 13, 100, 3520)], 132, 1024)
    a._pdl = object()
    xpf.link([a, b], MiB)
    assert a._pdl is None and int(a.args[0]["xpf"][0]["w"]) == 0x2000000
