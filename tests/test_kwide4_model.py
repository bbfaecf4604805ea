"""A numpy model of the engine v9 Q4_K/Q5_K row dot with 4 lanes per super-block
(backends/engine/kernels/kwide4.cuh, wide4_load / wide4_dot, and stage_xq<true>'s xq_slot4
layout), run on the CPU against the float64 oracle: it checks the index arithmetic the CUDA
code uses (which qs/qh bytes a lane reads, which staged x entries at which swizzled slots,
which scale/min pair, the code sums and block scales), that xq_slot4 is a permutation inside
each aligned group of 8 entries, and that a quarter warp's 16-byte x loads hit 8 distinct
bank groups. The model mirrors the kernel statement by statement; the GPU tests
(tests/test_engine_kernels.py, kq "v9") check the kernel itself."""
from __future__ import annotations

import numpy as np
import pytest

from oracles.actquant import round_q16
from oracles.blocks import random_blocks
from oracles.dequant import dequantize

Q4_K, Q5_K = 12, 13
TS = {Q4_K: 144, Q5_K: 176}
NIB = 0x0F0F0F0F


def xq_slot4(e: int) -> int:
    return e ^ (((e >> 3) & 3) | (((e >> 5) & 1) << 2))


def stage(x: np.ndarray):
    """(slots [K/8, 8] int16 codes at xq_slot4 positions, xs [K/8] code sums (plain order),
    xd [K/32] block scales) as stage_xq<true> stores them (q16: codes = rint(x * 32767/amax))."""
    K = x.size
    b = x.astype(np.float32).reshape(-1, 32)
    amax = np.abs(b).max(axis=1)
    inv = np.where(amax > 1e-30, np.float32(32767) / amax, 0).astype(np.float32)
    q = np.rint((b * inv[:, None]).astype(np.float32)).astype(np.int64).reshape(-1, 8)
    slots = np.zeros_like(q)
    for e in range(K // 8):
        slots[xq_slot4(e)] = q[e]
    return slots, q.sum(axis=1), (amax / np.float32(32767)).astype(np.float32).astype(np.float64)


def dp2a_dot8(x8: np.ndarray, lo: int, hi: int) -> int:
    """dot8c: 8 int16 codes against the 8 unsigned bytes of words lo (codes 0-3), hi (4-7)."""
    w = [(lo >> (8 * b)) & 0xFF for b in range(4)] + [(hi >> (8 * b)) & 0xFF for b in range(4)]
    return int(np.dot(x8, w))


def scale_min_pair(hdr: bytes, j: int):
    """kwide.cuh scale_min_k4_pair: (sc, m) of sub-blocks 2j and 2j + 1 (get_scale_min_k4)."""
    y, z, w = (int.from_bytes(hdr[4 + 4 * i:8 + 4 * i], "little") for i in range(3))
    sh = 16 * (j & 1)
    y, z, w = y >> sh, z >> sh, w >> sh
    sc = (y & 0x3f3f) if j < 2 else ((w & 0x0f0f) | ((y >> 2) & 0x3030))
    m = (z & 0x3f3f) if j < 2 else (((w >> 4) & 0x0f0f) | ((z >> 2) & 0x3030))
    return sc & 0xff, sc >> 8, m & 0xff, m >> 8


def lane_dot(blk: bytes, t: int, slots, xs, xd, sb: int, j: int) -> float:
    """wide4_load + wide4_dot of lane j on super-block sb (float64 for the float part)."""
    qoff = 16 + 32 * j if t == Q4_K else 48 + 32 * j
    w = [int.from_bytes(blk[qoff + 4 * m:qoff + 4 * m + 4], "little") for m in range(8)]
    if t == Q5_K:
        th = [int.from_bytes(blk[16 + 4 * m:20 + 4 * m], "little") >> (2 * j) for m in range(8)]
        lo = [(w[m] & NIB) | ((th[m] & 0x01010101) << 4) for m in range(8)]
        hi = [((w[m] >> 4) & NIB) | ((th[m] << 3) & 0x10101010) for m in range(8)]
    else:
        lo = [w[m] & NIB for m in range(8)]
        hi = [(w[m] >> 4) & NIB for m in range(8)]
    e0, sw = 32 * sb + 8 * j, j | ((sb & 1) << 2)
    ta = sum(dp2a_dot8(slots[e0 + (k ^ sw)], lo[2 * k], lo[2 * k + 1]) for k in range(4))
    tb = sum(dp2a_dot8(slots[e0 + ((k + 4) ^ sw)], hi[2 * k], hi[2 * k + 1]) for k in range(4))
    suma, sumb = int(xs[e0:e0 + 4].sum()), int(xs[e0 + 4:e0 + 8].sum())
    sa, sbb, ma, mb = scale_min_pair(blk[:16], j)
    d = float(np.frombuffer(blk[0:2], np.float16)[0])
    dmin = float(np.frombuffer(blk[2:4], np.float16)[0])
    ya = d * (sa * ta) - dmin * (ma * suma)
    yb = d * (sbb * tb) - dmin * (mb * sumb)
    return xd[8 * sb + 2 * j] * ya + xd[8 * sb + 2 * j + 1] * yb


@pytest.mark.parametrize("t", [Q4_K, Q5_K])
@pytest.mark.parametrize("K", [256, 768, 1280])
def test_model_matches_the_oracle(t, K):
    rng = np.random.default_rng(K + t)
    rows = 5
    raw = random_blocks(t, rows * K // 256, rng).reshape(rows, -1)
    w = dequantize(raw.reshape(-1), t, (rows, K)).astype(np.float64)
    x = rng.normal(size=K).astype(np.float32)
    slots, xs, xd = stage(x)
    ref = w @ round_q16(x)
    for r in range(rows):
        row = raw[r].tobytes()
        got = sum(lane_dot(row[sb * TS[t]:(sb + 1) * TS[t]], t, slots, xs, xd, sb, j)
                  for sb in range(K // 256) for j in range(4))
        scale = np.abs(w[r]) @ np.abs(round_q16(x))
        assert abs(got - ref[r]) <= 1e-9 * scale, (r, got, ref[r])


def test_a_wrong_pairing_is_caught():
    """The model's check can fail: swapping the two runs' block scales moves the rows."""
    t, K = Q4_K, 512
    rng = np.random.default_rng(1)
    raw = random_blocks(t, 2 * K // 256, rng).reshape(2, -1)
    w = dequantize(raw.reshape(-1), t, (2, K)).astype(np.float64)
    x = rng.normal(size=K).astype(np.float32)
    slots, xs, xd = stage(x)
    bad = xd.copy().reshape(-1, 2)[:, ::-1].reshape(-1)
    row = raw[0].tobytes()
    got = sum(lane_dot(row[sb * 144:(sb + 1) * 144], t, slots, xs, bad, sb, j)
              for sb in range(2) for j in range(4))
    assert abs(got - (w @ round_q16(x))[0]) > 1e-6 * (np.abs(w[0]) @ np.abs(x))


def test_slot_swizzle_is_a_permutation_and_conflict_free():
    for base in range(0, 256, 8):
        assert sorted(xq_slot4(e) for e in range(base, base + 8)) == list(range(base, base + 8))
    # quarter warp of one row: lanes (g, j), g in {2p, 2p + 1}, j = 0..3, round r: sb = g + 4 r;
    # load k reads slot e0 + (k ^ sw); 16-byte bank group = slot mod 8
    for r in range(3):
        for p in range(2):
            for k in range(8):
                groups = set()
                for g in (2 * p, 2 * p + 1):
                    for j in range(4):
                        sb = g + 4 * r
                        e0, sw = 32 * sb + 8 * j, j | ((sb & 1) << 2)
                        slot = e0 + (k ^ sw)
                        assert slot == xq_slot4(e0 + k)
                        groups.add(slot % 8)
                assert len(groups) == 8, (r, p, k, groups)
