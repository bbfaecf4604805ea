"""The GEMV segment table's host mirror (backends/engine/ops.py TABLE_DT) against the C
layout of struct SegTable in kernels/segs.cuh (CPU only: the bytes the kernel will read)."""
from __future__ import annotations

import struct
from types import SimpleNamespace as NS

from backends.engine import ops


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
