"""A numpy model of the engine v9 IQ3_S lane (backends/engine/kernels/kwide_iq3s.cuh:
wide_lane_iq3s, wide_load_iq3s, wide_x_iq3s, wide_dot_iq3s, and stage_xq's xq_slot layout), run
on the CPU against the float64 oracle (oracles.dequant: gguf-py's IQ3_S.dequantize_blocks).

The model mirrors the kernel statement by statement on 32-bit words: which bytes a lane reads at
which addresses (the aligned 16-byte window around its qs run and its realignment, the sign
half-words, the qh and scale bytes, d), the lane-order swap of odd lanes, the grid-index pairs
(spread qh bits, byte permutes, shift + mask + copy offset) and the table words they address (the
shared-memory copies, module.py's iq3s_grid words), the sign masks (multiply + sign-replicating
byte permute) and (g ^ M) | 1, the dp2a sums on packed int16 codes at their swizzled slots, the
scale nibble and (1 + 2 sc), and the x block scale. Each lane's partial is compared with the
oracle's dot product of the same 32 weights and staged values; a deliberately broken mapping
(several kinds) must fail that comparison. The GPU tests (tests/test_engine_kernels.py, v9 with
GGUF_HARNESS_GEMV_KQ_IQ3S=1) check the kernel itself.

Tolerance: the model's integer part is exact and its float part is float64 (d, (1 + 2 sc) t and
the x scale are exact products up to one float64 rounding each), and so is the oracle's 32-term
sum (float64 products of fp16-derived weights and int16-code activations, summed in float64):
both agree to ~1e-15 relative to the sum of |w x| over the lane's 32 values, so 1e-12 of that sum
leaves room for float64 rounding only. A mapping error moves at least one weight's term by
2 |w x| (a sign) or by a different grid value, orders of magnitude above it for random blocks.
"""
from __future__ import annotations

import numpy as np
import pytest

from backends.engine.iq_tables import grid_words
from oracles.actquant import round_q16
from oracles.blocks import random_blocks
from oracles.dequant import dequantize

IQ3_S, TS = 21, 110
M32 = 0xFFFFFFFF
BASE = 1 << 16  # address of the weights (arena.py: 256-byte aligned; ops.py checks 8 for v9 IQ3_S)


def xq_slot(e: int) -> int:
    """kwide.cuh xq_slot: bit 4 of e flips bit 0, bit 3 flips bit 2."""
    return e ^ (((e >> 4) & 1) | ((e >> 1) & 4))


def stage(x: np.ndarray):
    """(xq [K/8, 4] packed int16 pairs at xq_slot positions, xd [K/32] block scales) as stage_xq
    stores them (q16: codes = rint(x * 32767/amax) in float32)."""
    K = x.size
    b = x.astype(np.float32).reshape(-1, 32)
    amax = np.abs(b).max(axis=1)
    inv = np.where(amax > 1e-30, np.float32(32767) / amax, 0).astype(np.float32)
    q = np.rint((b * inv[:, None]).astype(np.float32)).astype(np.int64).reshape(-1, 8)
    xq = np.zeros((K // 8, 4), dtype=np.int64)
    for e in range(K // 8):
        xq[xq_slot(e)] = [(int(q[e, 2 * k]) & 0xFFFF) | ((int(q[e, 2 * k + 1]) & 0xFFFF) << 16) for k in range(4)]
    return xq, (amax / np.float32(32767)).astype(np.float32).astype(np.float64)


def prmt(a: int, b: int, c: int) -> int:
    """prmt.b32 (default mode): byte n = byte (c >> 4n) & 7 of b:a, replicated sign if bit 3."""
    src, r = (a & M32) | ((b & M32) << 32), 0
    for n in range(4):
        sel = (c >> (4 * n)) & 0xF
        v = (src >> (8 * (sel & 7))) & 0xFF
        if sel & 8:
            v = 0xFF if v & 0x80 else 0
        r |= v << (8 * n)
    return r


def funnel_r(lo: int, hi: int, s: int) -> int:
    """shf.r.wrap.b32: bits s..s+31 of hi:lo (s mod 32)."""
    return ((((hi & M32) << 32) | (lo & M32)) >> (s & 31)) & M32


def s16(v: int) -> int:
    v &= 0xFFFF
    return v - 0x10000 if v & 0x8000 else v


def s8(v: int) -> int:
    v &= 0xFF
    return v - 0x100 if v & 0x80 else v


def dp2a(a: int, b: int, c: int, hi: bool) -> int:
    """dp2a.{lo,hi}.s32.s32: c + the two int16 of a times int8 bytes 0, 1 (lo) or 2, 3 (hi) of b."""
    o = 16 if hi else 0
    return c + s16(a) * s8(b >> o) + s16(a >> 16) * s8(b >> (o + 8))


def dot8c(x, lo: int, hi: int, c: int) -> int:
    """kwide.cuh dot8c: codes 0..3 against the bytes of lo, 4..7 against hi."""
    c = dp2a(int(x[0]), lo, c, False)
    c = dp2a(int(x[1]), lo, c, True)
    c = dp2a(int(x[2]), hi, c, False)
    return dp2a(int(x[3]), hi, c, True)


def fp16(v: int) -> float:
    return float(np.array([v], np.uint16).view(np.float16)[0])


class Mem:
    """The weights as device bytes at BASE; loads check their alignment and bounds."""

    def __init__(self, raw: np.ndarray):
        self.b = raw.reshape(-1).tobytes()

    def ld(self, addr: int, n: int) -> int:
        assert addr % n == 0, f"{n}-byte load at {addr:#x}"
        assert BASE <= addr and addr + n <= BASE + len(self.b), f"load outside the weights at {addr:#x}"
        return int.from_bytes(self.b[addr - BASE:addr - BASE + n], "little")


def lane_dot(mem: Mem, blk: int, lane: int, sb: int, xq, xd, table: np.ndarray, copies: int,
             bug: str | None = None) -> float:
    """wide_load_iq3s + wide_x_iq3s + wide_dot_iq3s of lane `lane` (i = lane & 7) on the block at
    address blk (super-block sb of its row); table: the grid words as the kernel addresses them
    (copies interleaved, or the global table for copies 0). bug: a deliberate mapping error."""
    i = lane & 7
    lg = {0: 0, 1: 0, 2: 1, 4: 2, 8: 3, 16: 4, 32: 5}[copies]
    # wide_lane_iq3s
    f = 2 * (i & 1)
    if bug == "no_x_swap":
        f = 0
    p = [xq_slot(4 * i + f), xq_slot(4 * i + f + 1), xq_slot(4 * i + (f ^ 2)), xq_slot(4 * i + (f ^ 2) + 1)]
    odd, sh = i & 1, 4 * (i & 1)
    ssel = 0x1054 if odd and bug != "sign_order" else 0x5410
    lc2 = (4 * (lane & (copies - 1))) * 0x10001 if copies > 1 else 0
    # wide_load_iq3s
    run = blk + 2 + 8 * i
    o = run & 7
    assert o % 2 == 0 and blk - 4 <= run - o and run - o + 16 <= blk + 74
    w0, w1 = mem.ld(run - o, 8), mem.ld(run - o + 8, 8)
    ax, ay, bx, by = w0 & M32, w0 >> 32, w1 & M32, w1 >> 32
    s0, s1 = mem.ld(blk + 74 + 4 * i, 2), mem.ld(blk + 76 + 4 * i, 2)
    qh, sc, d = mem.ld(blk + 66 + i, 1), mem.ld(blk + 106 + (i >> 1), 1), mem.ld(blk, 2)
    # wide_x_iq3s: 32 int4 (here [4] words) per super-block
    e = [xq[32 * sb + pk] for pk in p]
    dx = xd[8 * sb + i]
    # wide_dot_iq3s
    up, s = o & 4, 8 * (o & 3)
    u0, u1, u2 = (ay, bx, by) if up else (ax, ay, bx)
    A, B = funnel_r(u0, u1, s), funnel_r(u1, u2, s)
    q0, q1 = (B, A) if odd and bug != "no_qs_swap" else (A, B)
    shq = 0 if bug == "qh_shift" else sh
    h0 = (((qh >> shq) & 0x7F) * 0x00204081) & M32
    h1 = (((qh >> (4 - shq)) & 0x7F) * 0x00204081) & M32
    shf = 2 + lg
    mask = ((0x1FF << shf) * 0x10001) & M32
    g = []
    for P in (prmt(q0, h0, 0x5140), prmt(q0, h0, 0x7362), prmt(q1, h1, 0x5140), prmt(q1, h1, 0x7362)):
        off = (((P << shf) & M32) & mask) | lc2
        for half in (off & 0xFFFF, off >> 16):
            assert half % 4 == 0 and half // 4 < table.size
            if copies > 1:
                assert (half // 4) % copies == lane % copies  # the lane's own copy
            g.append(int(table[half // 4]))
    sg = prmt(s0, s1, ssel)
    S = [sg & 0xFF, prmt(sg, 0, 0x4441), prmt(sg, 0, 0x4442), sg >> 24]
    t = 0
    for k in range(4):
        m0 = prmt((S[k] * 0x80402010) & M32, 0, 0x89AB)
        m1 = prmt((S[k] * 0x08040201) & M32, 0, 0x89AB)
        if bug == "sign_add":  # xor without the |1: -g - 1 instead of -g
            t = dot8c(e[k], g[2 * k] ^ m0, g[2 * k + 1] ^ m1, t)
        else:
            t = dot8c(e[k], (g[2 * k] ^ m0) | 0x01010101, (g[2 * k + 1] ^ m1) | 0x01010101, t)
        assert abs(t) < 2**24  # 32 products of |g| <= 15 and |xq| <= 32767
    scv = (sc >> (0 if bug == "scale_nibble" else sh)) & 15
    assert abs((1 + 2 * scv) * t) < 2**31
    return dx * (fp16(d) * float((1 + 2 * scv) * t))


def table_for(copies: int) -> np.ndarray:
    """The grid words as the kernel addresses them: word copies x index + copy (iq3s_grid_setup),
    or module.py's global table (copies 0)."""
    words = grid_words("IQ3_S").astype(np.int64)
    return np.repeat(words, copies) if copies > 1 else words


def _case(K: int, rows: int, seed: int):
    rng = np.random.default_rng(seed)
    raw = random_blocks(IQ3_S, rows * K // 256, rng).reshape(rows, -1)
    w = dequantize(raw.reshape(-1), IQ3_S, (rows, K)).astype(np.float64)
    x = rng.normal(size=K).astype(np.float32)
    xq, xd = stage(x)
    return raw, w, round_q16(x), xq, xd


def _mismatches(raw, w, xs, xq, xd, copies: int, bug: str | None = None, lane_base: int = 0) -> list:
    """Lanes (row, sb, i) whose model partial differs from the oracle's 32-value dot product by
    more than 1e-12 of its sum of |w x| (module docstring). Rows lie back to back from BASE, so
    blocks sit at all four 8-byte phases; lane L = 8 grp + i with grp = sb % 4 (kq_body)."""
    rows, K = w.shape
    mem, table, bad = Mem(raw), table_for(copies), []
    rb = K // 256 * TS
    for r in range(rows):
        for sb in range(K // 256):
            blk = BASE + r * rb + sb * TS
            for i in range(8):
                lane = (8 * (sb % 4) + i + lane_base) % 32
                got = lane_dot(mem, blk, lane, sb, xq, xd, table, copies, bug)
                v = slice(256 * sb + 32 * i, 256 * sb + 32 * i + 32)
                ref = float(w[r, v] @ xs[v])
                scale = float(np.abs(w[r, v]) @ np.abs(xs[v]))
                if abs(got - ref) > 1e-12 * scale:
                    bad.append((r, sb, i, got, ref))
    return bad


@pytest.mark.parametrize("copies", [1, 0, 16, 32])
@pytest.mark.parametrize("K", [256, 768, 1280])
def test_model_matches_the_oracle_lane_by_lane(K, copies):
    raw, w, xs, xq, xd = _case(K, 5, K + copies)
    assert _mismatches(raw, w, xs, xq, xd, copies) == []
    # and the row sums (what the kernel's group_sum adds), as test_kwide4_model checks them
    mem, table, rb = Mem(raw), table_for(copies), K // 256 * TS
    for r in range(w.shape[0]):
        got = sum(lane_dot(mem, BASE + r * rb + sb * TS, 8 * (sb % 4) + i, sb, xq, xd, table, copies)
                  for sb in range(K // 256) for i in range(8))
        assert abs(got - w[r] @ xs) <= 1e-12 * (np.abs(w[r]) @ np.abs(xs))


def test_every_block_phase_and_lane_copy():
    """Rows of odd super-block counts put blocks at every 8-byte phase (110 = 6 mod 8: o = 2, 0,
    6, 4 over four blocks), and lanes of all 32 positions read their own of 16 grid copies."""
    raw, w, xs, xq, xd = _case(7 * 256, 4, 3)
    phases = {(BASE + r * 7 * TS + sb * TS + 2) & 7 for r in range(4) for sb in range(7)}
    assert phases == {0, 2, 4, 6}
    for base in (0, 8, 16, 24):
        assert _mismatches(raw, w, xs, xq, xd, 16, lane_base=base) == []


@pytest.mark.parametrize("bug", ["no_x_swap", "no_qs_swap", "sign_order", "qh_shift", "sign_add", "scale_nibble"])
def test_a_broken_mapping_is_caught(bug):
    """The comparison can fail: each of these single mistakes in the lane mapping or arithmetic
    (x entries not swapped for odd lanes while the weights are, qs words or sign half-words not
    swapped, the qh nibbles of the wrong half, a missing | 1, the other scale nibble) moves lanes."""
    raw, w, xs, xq, xd = _case(512, 3, 11)
    bad = _mismatches(raw, w, xs, xq, xd, 1, bug)
    assert len(bad) >= 6, bug


def test_sign_masks_and_index_spread_are_carry_free():
    """The two multiply tricks of wide_dot_iq3s for every byte value: S * 0x80402010 and
    S * 0x08040201 followed by prmt(., 0, 0x89AB) give 0xff in byte j exactly when bit j resp.
    4 + j of S is set; ((q & 0x7f) * 0x00204081) has bit n of q at bit 0 of byte n (n < 4)."""
    for S in range(256):
        m0 = prmt((S * 0x80402010) & M32, 0, 0x89AB)
        m1 = prmt((S * 0x08040201) & M32, 0, 0x89AB)
        assert m0 == sum(0xFF << (8 * j) for j in range(4) if S >> j & 1)
        assert m1 == sum(0xFF << (8 * j) for j in range(4) if S >> (4 + j) & 1)
        h = ((S & 0x7F) * 0x00204081) & M32
        assert [(h >> (8 * n)) & 1 for n in range(4)] == [(S >> n) & 1 for n in range(4)]
    # (g ^ M) | 1 negates exactly the odd grid bytes: every iq3s_grid byte is odd
    vals = {(int(wd) >> (8 * b)) & 0xFF for wd in grid_words("IQ3_S") for b in range(4)}
    assert vals == set(range(1, 16, 2))
    for g in vals:
        assert s8((g ^ 0xFF) | 1) == -g


def test_x_loads_are_conflict_free_and_grid_copies_bound_the_lookup():
    """A quarter warp's (one super-block's 8 lanes) 16-byte x loads in load order hit 8 distinct
    16-byte bank groups (odd lanes take entries 2, 3 first; kwide_iq4.cuh's argument); with 16
    grid copies a warp's 32 lookups touch at most 2 distinct words per 4-byte bank."""
    for sb in range(4):
        for k in range(4):
            groups = set()
            for i in range(8):
                f = 2 * (i & 1)
                e = 4 * i + (k ^ f)
                groups.add((32 * sb + xq_slot(e)) % 8)
            assert len(groups) == 8, (sb, k, groups)
    rng = np.random.default_rng(0)
    for _ in range(200):
        idx = rng.integers(0, 512, 32)
        words = {(int(ix) * 16 + L % 16) for L, ix in enumerate(idx)}
        per_bank = {}
        for wd in words:
            per_bank.setdefault(wd % 32, set()).add(wd)
        assert max(len(v) for v in per_bank.values()) <= 2
        # 32 copies (KQ_IQ3S_GRID=32): lane L reads copy L, so every lane has a bank of its own
        words32 = [int(ix) * 32 + L for L, ix in enumerate(idx)]
        assert sorted(wd % 32 for wd in words32) == list(range(32))


@pytest.mark.parametrize("copies", [1, 2, 4, 8, 16, 32])
def test_grid_fill_layout(copies):
    """iq3s_grid_setup's loops (one word per thread and step below 4 copies, one 16-byte store of
    4 copies of a word at and above) write word copies x index + copy = iq3s_grid[index], the
    layout lane_dot reads (table_for); 512 threads per block (KQ_BLOCK_WARPS 16)."""
    words, lg = grid_words("IQ3_S").astype(np.int64), copies.bit_length() - 1
    out = np.full(512 * copies, -1, np.int64)
    for tid in range(512):
        if copies >= 4:
            for k in range(tid, 128 * copies, 512):
                out[4 * k:4 * k + 4] = words[(4 * k) >> lg]
        else:
            for k in range(tid, 512 * copies, 512):
                out[k] = words[k >> lg]
    assert np.array_equal(out, table_for(copies) if copies > 1 else words)
