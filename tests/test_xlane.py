"""The XLANE staging layout (backends/engine/kernels/kwide.cuh xl_lane / xl_pos / xl_slot, written
by xstage.cuh stage_xq with XL = 1, 2), replayed in numpy: the records must hold exactly the x
entries each lane's two runs cover (kwide.cuh header: Q4_K / Q5_K lane i = 2 j + h takes values
64 j + 16 h .. + 15 and + 32; Q6_K lane i = 4 n + k takes 128 n + 16 k .. + 15 and + 64; entry e
holds values 8 e .. 8 e + 7), their run sums and block scales as the staging warp's shuffles
produce them, in the bytes the default layout's xq and xs take, with every one of a lane group's
five 16-byte loads on distinct bank groups. The GPU runs (bitwise equal to the default build):
tests/test_engine_kernels.py test_xlane_build_is_bitwise_equal_to_the_default."""
from __future__ import annotations

import os
import re

import numpy as np
import pytest

from backends.engine import ops


def xl_lane(xl: int, e: int) -> int:  # kwide.cuh
    return 2 * (e >> 3) + ((e >> 1) & 1) if xl == 1 else 4 * (e >> 4) + ((e >> 1) & 3)


def xl_pos(xl: int, e: int) -> int:
    return (e & 1) + 2 * ((e >> 2) & 1) if xl == 1 else (e & 1) + 2 * ((e >> 3) & 1)


def xl_slot(xl: int, c: int) -> int:
    return 40 * (c >> 5) + 5 * xl_lane(xl, c & 31) + xl_pos(xl, c & 31)


def runs(xl: int, i: int) -> tuple[int, int]:
    """First value of lane i's runs A and B within a super-block (the kwide.cuh header's mapping)."""
    if xl == 1:
        a = 64 * (i >> 1) + 16 * (i & 1)
        return a, a + 32
    a = 128 * (i >> 2) + 16 * (i & 3)
    return a, a + 64


@pytest.mark.parametrize("xl", [1, 2])
def test_records_hold_each_lanes_runs_in_the_default_bytes(xl):
    for sb in range(3):
        slots = [xl_slot(xl, 32 * sb + e) for e in range(32)]
        # 32 entries into 40 int4 per super-block (8 records of 4 entries + 1 meta): 640 bytes,
        # the default's 512 bytes of xq + 128 of xs
        assert len(set(slots)) == 32 and min(slots) >= 40 * sb and max(slots) < 40 * sb + 40
        for i in range(8):
            a, b = runs(xl, i)
            want = [a // 8, a // 8 + 1, b // 8, b // 8 + 1]  # entries of run A, then run B
            got = [e for p in range(4) for e in range(32) if xl_slot(xl, 32 * sb + e) == 40 * sb + 5 * i + p]
            assert got == want, (xl, i)
    for p in range(5):  # each of a lane's 5 loads: the 8 lanes' 16-byte slots on distinct bank groups
        assert len({(5 * i + p) % 8 for i in range(8)}) == 8


@pytest.mark.parametrize("xl", [1, 2])
def test_meta_from_the_staging_warps_shuffles(xl):
    """stage_xq (XL): lane e holds its entry's code sum s and its 32-value block's scale sc;
    pair = s + shfl_down(s, 1), pairb = shfl_down(pair, dB), scb = shfl_down(sc, dB) (dB = 4 or
    8; shfl_down past lane 31 returns the lane's own value), and lane e with xl_pos 0 writes
    {pair, pairb, sc, scb} as the fifth int4 of its record: the record's run sums and scales."""
    rng = np.random.default_rng(5)
    s = rng.integers(-(1 << 18), 1 << 18, 32)
    sc = rng.normal(size=8).astype(np.float32)
    dB = 4 if xl == 1 else 8
    down = lambda v, d: np.array([v[e + d] if e + d < 32 else v[e] for e in range(32)])  # noqa: E731
    pair = s + down(s, 1)
    pairb, scb = down(pair, dB), down(np.repeat(sc, 4), dB)
    meta = {xl_lane(xl, e): (pair[e], pairb[e], np.repeat(sc, 4)[e], scb[e]) for e in range(32) if xl_pos(xl, e) == 0}
    assert sorted(meta) == list(range(8))
    for i, m in meta.items():
        a, b = runs(xl, i)
        ea, eb = a // 8, b // 8
        assert m == (s[ea] + s[ea + 1], s[eb] + s[eb + 1], sc[a // 32], sc[b // 32]), (xl, i)


def test_xlane_switch(monkeypatch):
    """GGUF_HARNESS_GEMV_KQ_XLANE: "1" or "" is gemv_kq.cu's own default (KQ_XLANE 1 since session
    13: no define), "0" adds KQ_XLANE=0 (the xq_slot staging, its own cache entry); another value
    is refused; unset, the switch is on; it is in machine info; v10 (gemv_tma.cu) keeps
    kq_traits.cuh's default 0."""
    from harness import machine
    assert ops.GEMV_KQ_XLANE == "1" or "GGUF_HARNESS_GEMV_KQ_XLANE" in os.environ
    monkeypatch.setattr(ops, "GEMV_KQ_P2", "")
    for v in ("", "1"):
        monkeypatch.setattr(ops, "GEMV_KQ_XLANE", v)
        assert ops.kv9_defines() == ()
    monkeypatch.setattr(ops, "GEMV_KQ_XLANE", "0")
    assert ops.kv9_defines() == ("KQ_XLANE=0",)
    monkeypatch.setattr(ops, "GEMV_KQ_XLANE", "2")
    with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_KQ_XLANE"):
        ops.kv9_defines()
    assert "GGUF_HARNESS_GEMV_KQ_XLANE" in machine.ENGINE_SWITCHES
    kdir = ops.module.KERNEL_DIR
    src = (kdir / "gemv_kq.cu").read_text()
    m = re.search(r"#ifndef KQ_XLANE\n(//.*\n)*#define KQ_XLANE 1\n#endif\n", src)
    assert m and m.end() <= src.index('#include "kq_traits.cuh"')  # defined before the traits read it
    assert "#define KQ_XLANE 0" in (kdir / "kq_traits.cuh").read_text()
    assert "KQ_XLANE" not in (kdir / "gemv_tma.cu").read_text().split("kq_traits.cuh")[0]


def xl_entry(xl: int, lane: int, pos: int) -> int:  # kwide.cuh, the inverse of (xl_lane, xl_pos)
    if xl == 1:
        return 8 * (lane >> 1) + 4 * (pos >> 1) + 2 * (lane & 1) + (pos & 1)
    return 16 * (lane >> 2) + 8 * (pos >> 1) + 2 * (lane & 3) + (pos & 1)


@pytest.mark.parametrize("xl", [1, 2])
def test_f32_rows_lane_order_and_its_bank_groups(xl):
    """f32_row (gemv_kq.cu) reads natural entry c of an F32 row's x at xl_slot(c). In the default
    order (the lane at window position t takes entry t) every quarter warp's 8 loads of 16 bytes
    fall on 7 distinct bank groups: one 2-way conflict each (the session-14 finding behind the 27B
    ssm_in node's +2.7 % with XLANE). The KQ_F32_XPERM build's order (position t takes
    xl_entry(t & 7, t >> 3)) is a bijection of each 32-entry window and puts every quarter warp on
    8 distinct groups. The kernel's xl_entry must be this formula (checked in the source)."""
    for e in range(32):
        assert xl_entry(xl, xl_lane(xl, e), xl_pos(xl, e)) == e
    natural = [len({xl_slot(xl, c) % 8 for c in range(b, b + 8)}) for b in range(0, 128, 8)]
    assert natural == [7] * 16
    perm = [xl_entry(xl, t & 7, t >> 3) for t in range(32)]
    assert sorted(perm) == list(range(32))
    for w in range(4):  # four windows: the slot's window term 40 w keeps the groups apart too
        for q in range(4):
            groups = {xl_slot(xl, 32 * w + perm[8 * q + t]) % 8 for t in range(8)}
            assert len(groups) == 8, (xl, w, q, groups)
    src = (ops.module.KERNEL_DIR / "kwide.cuh").read_text()
    assert ("return XL == 1 ? 8 * (lane >> 1) + 4 * (pos >> 1) + 2 * (lane & 1) + (pos & 1)\n"
            "                   : 16 * (lane >> 2) + 8 * (pos >> 1) + 2 * (lane & 3) + (pos & 1);") in src
    gsrc = (ops.module.KERNEL_DIR / "gemv_kq.cu").read_text()
    assert "l = (l & ~31) | xl_entry<XL>(l & 7, (l >> 3) & 3);" in gsrc


def test_f32_xperm_switch(monkeypatch):
    """GGUF_HARNESS_GEMV_KQ_F32_XPERM: "1" adds KQ_F32_XPERM=1 (an A/B build), "0" / "" nothing;
    another value is refused, and "1" without the lane records (XLANE=0); it is in machine info."""
    from harness import machine
    monkeypatch.setattr(ops, "GEMV_KQ_F32_XPERM", "1")
    assert "KQ_F32_XPERM=1" in ops.kv9_defines()
    for v in ("0", ""):
        monkeypatch.setattr(ops, "GEMV_KQ_F32_XPERM", v)
        assert "KQ_F32_XPERM=1" not in ops.kv9_defines()
    monkeypatch.setattr(ops, "GEMV_KQ_F32_XPERM", "on")
    with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_KQ_F32_XPERM"):
        ops.kv9_defines()
    monkeypatch.setattr(ops, "GEMV_KQ_F32_XPERM", "1")
    monkeypatch.setattr(ops, "GEMV_KQ_XLANE", "0")  # no lane records: the build would be the default's
    with pytest.raises(ValueError, match="needs the lane records"):
        ops.kv9_defines()
    assert "GGUF_HARNESS_GEMV_KQ_F32_XPERM" in machine.ENGINE_SWITCHES
