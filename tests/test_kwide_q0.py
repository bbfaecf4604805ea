"""The lane arithmetic of the v9 Q8_0 / Q4_0 rows (backends/engine/kernels/kwide_q0.cuh), replayed
in numpy on random blocks before any GPU runs it: lane i of 8 loads the 16-byte chunks from
32 i (Q8_0, 3 chunks) or 16 i (Q4_0, 2 chunks) of a group of 8 blocks, picks the words from
m = i >> 1 by two levels of selects and realigns them with shf.r.clamp by 16 or 32 bits. The
bytes it ends with must be block i's d and qs as ggml lays them out (block_q8_0 / block_q4_0:
fp16 d, then qs), the values its 4 x entries meet must be the ones the nibbles hold
(dequantize_row_q4_0: qs[j] low nibble = value j, high = value j + 16), and the entry order must
give the 16-byte shared-memory loads the bank groups the header claims. GPU runs of the kernels
themselves: tests/test_engine_kernels.py (v9 tests with GGUF_HARNESS_GEMV_KQ_Q0=1)."""
from __future__ import annotations

import numpy as np
import pytest

BLOCK = {"Q8_0": 34, "Q4_0": 18}
CHUNKS = {"Q8_0": 3, "Q4_0": 2}
STRIDE = {"Q8_0": 32, "Q4_0": 16}  # bytes between the lanes' first chunks


def xq_slot(e: int) -> int:  # kernels/kwide.cuh xq_slot
    return e ^ (((e >> 4) & 1) | ((e >> 1) & 4))


def funnel_rc(lo: int, hi: int, s: int) -> int:  # shf.r.clamp.b32
    s = min(s, 32)
    return (((hi << 32) | lo) >> s) & 0xFFFFFFFF


def lane_words(group: bytes, fmt: str, i: int) -> tuple[int, list[int]]:
    """(d as a 16-bit integer, the qs words) lane i ends with (wide_load_q0, q0_window, wide_dot_q0)."""
    base = STRIDE[fmt] * i
    raw = group[base:base + 16 * CHUNKS[fmt]]
    assert len(raw) == 16 * CHUNKS[fmt], "a chunk left the group"
    v = list(np.frombuffer(raw, "<u4").astype(np.int64))
    nw = 9 if fmt == "Q8_0" else 5
    m, sh = i >> 1, 16 + 16 * (i & 1)
    u = [v[k + 2] if m & 2 else v[k] for k in range(nw + 1)]
    w = [u[k + 1] if m & 1 else u[k] for k in range(nw)]
    d = funnel_rc(w[0], 0, sh - 16) & 0xFFFF
    return d, [funnel_rc(w[j], w[j + 1], sh) for j in range(nw - 1)]


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0"])
def test_each_lane_realigns_exactly_its_block(fmt):
    rng = np.random.default_rng(13)
    bs = BLOCK[fmt]
    for _ in range(20):
        group = rng.integers(0, 256, 8 * bs, dtype=np.uint8).tobytes()  # 272 / 144 bytes
        for i in range(8):
            d, q = lane_words(group, fmt, i)
            blk = group[bs * i:bs * (i + 1)]
            assert d == int.from_bytes(blk[:2], "little"), (fmt, i)
            assert b"".join(int(x).to_bytes(4, "little") for x in q) == blk[2:], (fmt, i)


def test_q4_0_entries_meet_their_nibbles_and_banks_are_distinct():
    """Q4_0: lane i reads its entries in the order o ^ (i & 2) and shifts the nibbles by ns = 4 for
    those lanes (high nibbles first): the 8 codes of each entry slot must be the block's values
    8 (o ^ r) .. + 7, and for every slot o the 8 lanes of a group must hit 8 distinct 16-byte
    bank groups (xq_slot mod 8). Q8_0 keeps the natural order: 4 distinct groups (the 2-way
    conflict the header states)."""
    rng = np.random.default_rng(7)
    group = rng.integers(0, 256, 144, dtype=np.uint8).tobytes()
    for i in range(8):
        r = i & 2
        ns = 4 if r else 0
        _, q = lane_words(group, "Q4_0", i)
        qs = np.frombuffer(group[18 * i + 2:18 * i + 18], np.uint8)
        vals = np.concatenate([qs & 15, qs >> 4])  # dequantize_row_q4_0's value order
        nib = lambda w, s: [(w >> (s + 8 * b)) & 15 for b in range(4)]  # noqa: E731
        slots = [nib(q[0], ns) + nib(q[1], ns), nib(q[2], ns) + nib(q[3], ns),
                 nib(q[0], 4 - ns) + nib(q[1], 4 - ns), nib(q[2], 4 - ns) + nib(q[3], 4 - ns)]
        for o in range(4):
            e = o ^ r
            assert slots[o] == list(vals[8 * e:8 * e + 8]), (i, o)
    for o in range(4):
        assert len({xq_slot(4 * i + (o ^ (i & 2))) % 8 for i in range(8)}) == 8, o
        assert len({xq_slot(4 * i + o) % 8 for i in range(8)}) == 4, o
