"""Engine v12 (kernels/gemv_mma.cu tcr_body, backends/engine/gemv_tcr.py): v11's int8 tensor-core
GEMV on Q4_K weights repacked at node build.

CPU: the repacked layout read back as the kernel reads it equals gguf-py's dequantisation; the
mma fragment mapping (which slot words feed which mma, against which x codes) gives the exact
integer dot; the switches and routing. GPU (marker gpu): the device repack equals the numpy model
byte for byte; outputs against the float64 oracle with v11's rounding of x (impl "mma", the
tolerance of tests/test_gemv_mma.py), NaN-poisoned outputs, a second launch bitwise equal.
"""
from __future__ import annotations

import numpy as np
import pytest
from gpu_util import cupy_or_skip, device_tensor, nan_poisoned, q16_or_skip

from backends.engine import gemv_tcr as gt
from oracles.blocks import random_blocks
from oracles.dequant import dequantize

Q4_K, Q5_K = 12, 13


@pytest.fixture(autouse=True)
def _switches(monkeypatch):
    """Every v12 switch and v11's unset (an exported one must not change what these tests see)."""
    from backends.engine import gemv_mma
    for name in ("GEMV_TCR", "GEMV_TCR_WARPS", "GEMV_TCR_UNROLL", "GEMV_TCR_MINB", "GEMV_TCR_PIPE", "GEMV_TCR_GRID"):
        monkeypatch.setattr(gt, name, "")
    monkeypatch.setattr(gemv_mma, "GEMV_MMA", "")


def _q4k(rows: int, K: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return random_blocks(Q4_K, rows * K // 256, rng).reshape(rows, -1)


@pytest.mark.parametrize("rows,K", [(16, 256), (48, 768), (32, 2560)])
def test_repacked_matrix_decodes_to_the_gguf_values(rows, K):
    raw = _q4k(rows, K, rows + K)
    packed = gt.repack_q4_k(raw)
    assert packed.shape == (raw.size,) and packed.dtype == np.uint8
    # a permutation of the bytes' nibbles and headers: the same values as gguf-py reads from GGUF
    want = dequantize(raw.reshape(-1), Q4_K, (rows, K)).astype(np.float64)
    got = gt.decode_repacked_q4_k(packed, rows, K)
    # gguf-py computes d * sc and dmin * m in float32 and then y = a * q - b in float32: one or two
    # roundings of 2^-24 relative to the larger term (|d sc q| or |dmin m|), never more
    np.testing.assert_allclose(got, want, rtol=0, atol=float(4 * 2.0 ** -24 * np.abs(want).max()))


def test_repack_moves_every_byte_and_changes_the_order():
    raw = _q4k(32, 512, 7)
    packed = gt.repack_q4_k(raw)
    # headers are copied as they are; the qs nibbles are only reordered
    assert np.array_equal(np.sort(packed.reshape(2, 2, 2304)[..., :256].reshape(-1)),
                          np.sort(raw.reshape(32, 2, 144)[..., :16].reshape(-1)))
    nib = lambda b: np.sort(np.concatenate([b & 15, b >> 4]))
    assert np.array_equal(nib(packed.reshape(2, 2, 2304)[..., 256:].reshape(-1)),
                          nib(raw.reshape(32, 2, 144)[..., 16:].reshape(-1)))


def test_repack_refuses_partial_tiles_and_other_dtypes():
    with pytest.raises(ValueError, match="16 n"):
        gt.repack_q4_k(_q4k(17, 256, 1))
    with pytest.raises(ValueError, match="16 n"):
        gt.repack_q4_k(_q4k(16, 256, 1).astype(np.int16))


def _mma_dot(slot: np.ndarray, xq: np.ndarray) -> int:
    """The kernel's integer dot of one lane slot (16 bytes) with the sub-block's 32 q16 codes xq:
    mma j takes (w0, w1) (j even) or (w2, w3) (j odd) masked by 0x0f.. (j < 2) or 0xf0.. (j >= 2)
    as the 8 k slots against x codes 8 j .. 8 j + 7 split into hi / lo bytes (x = 256 hi + lo,
    hi = (x + 128) >> 8, both s8); dot = 256 cl0 + cl1 + (256 ch0 + ch1) >> 4."""
    words = slot.view("<u4")
    hi = (xq.astype(np.int64) + 128) >> 8
    lo = xq.astype(np.int64) - 256 * hi
    assert (np.abs(hi) <= 128).all() and (hi <= 127).all() and (lo >= -128).all() and (lo <= 127).all()
    cl, ch = [0, 0], [0, 0]
    for j in range(4):
        mk = 0x0F0F0F0F if j < 2 else 0xF0F0F0F0
        a = np.array([words[2 * (j & 1)] & mk, words[2 * (j & 1) + 1] & mk], "<u4").view(np.uint8).astype(np.int64)
        acc = cl if j < 2 else ch
        acc[0] += int(a @ hi[8 * j:8 * j + 8])
        acc[1] += int(a @ lo[8 * j:8 * j + 8])
    assert (256 * ch[0] + ch[1]) % 16 == 0
    return 256 * cl[0] + cl[1] + ((256 * ch[0] + ch[1]) >> 4)


def test_mma_fragments_give_the_exact_sub_block_dot():
    rows, K = 16, 512
    raw = _q4k(rows, K, 3)
    packed = gt.repack_q4_k(raw).reshape(1, K // 256, 2304)
    codes = gt._codes(raw.reshape(-1, 144)).reshape(rows, K // 256, 8, 32).astype(np.int64)
    rng = np.random.default_rng(4)
    for _ in range(40):
        sb, q, h, g, t = (int(rng.integers(n)) for n in (K // 256, 2, 2, 8, 4))
        slot = packed[0, sb, 256 + 1024 * q + 512 * h + 16 * (4 * g + t):][:16]
        xq = rng.integers(-32639, 32640, size=32)
        xq[:2] = (32639, -32639)  # the extremes whose hi byte is 127 / -127
        want = int(codes[g + 8 * h, sb, 4 * q + t] @ xq)
        assert _mma_dot(slot, xq) == want


def test_switches_and_routing(monkeypatch):
    assert not gt.tcr_takes("store", [Q4_K], 5120, [10240])  # off by default
    monkeypatch.setattr(gt, "GEMV_TCR", "1")
    assert gt.tcr_takes("store", [Q4_K], 5120, [10240])
    assert gt.tcr_takes("add", [Q4_K, Q4_K], 17408, [5120, 16])
    assert gt.tcr_takes("swiglu", [Q4_K, Q4_K], 5120, [17408, 17408])
    assert not gt.tcr_takes("store", [Q4_K], 5120, [10240 + 1])      # whole tiles only
    assert not gt.tcr_takes("store", [Q4_K, Q5_K], 5120, [16, 16])   # Q4_K only
    assert not gt.tcr_takes("store", [Q4_K, 0], 5120, [16, 16])      # F32 rows stay on v9
    assert not gt.tcr_takes("store", [Q4_K], 5120 + 32, [16])        # K % 256
    monkeypatch.setattr(gt, "GEMV_TCR", "q4_k")
    assert gt.tcr_takes("store", [Q4_K], 256, [16])
    monkeypatch.setattr(gt, "GEMV_TCR", "q5_k")
    with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_TCR"):
        gt.tcr_takes("store", [Q4_K], 256, [16])
    assert gt.tcr_defines() == ()
    monkeypatch.setattr(gt, "GEMV_TCR_WARPS", "16")
    monkeypatch.setattr(gt, "GEMV_TCR_UNROLL", "3")
    assert gt.tcr_defines() == ("TCR_WARPS=16", "TCR_UNROLL=3")
    monkeypatch.setattr(gt, "GEMV_TCR_PIPE", "1")
    assert gt.tcr_defines() == ("TCR_WARPS=16", "TCR_UNROLL=3", "TCR_PIPE=1")
    monkeypatch.setattr(gt, "GEMV_TCR_MINB", "2")  # 2 x 512 threads: 64 registers each
    assert gt.tcr_defines()[-2:] == ("TCR_MINB=2", "TCR_PIPE=1")
    monkeypatch.setattr(gt, "GEMV_TCR_MINB", "3")  # 3 x 512 threads: 42 registers, spills
    with pytest.raises(ValueError, match="below 64"):
        gt.tcr_defines()
    monkeypatch.setattr(gt, "GEMV_TCR_MINB", "5")
    with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_TCR_MINB"):
        gt.tcr_defines()


def test_grid(monkeypatch):
    assert gt.tcr_grid(640, 264) == 264 and gt.tcr_grid(100, 264) == 100  # resident, <= one per tile
    monkeypatch.setattr(gt, "GEMV_TCR_GRID", "1")
    assert gt.tcr_grid(640, 264) == 640
    monkeypatch.setattr(gt, "GEMV_TCR_GRID", "3")
    assert gt.tcr_grid(640, 264) == 214
    for bad in ("0", "x", "-1"):
        monkeypatch.setattr(gt, "GEMV_TCR_GRID", bad)
        with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_TCR_GRID"):
            gt.tcr_grid(640, 264)


# ---- GPU ----

@pytest.mark.gpu
def test_device_repack_equals_the_numpy_model():
    cp = cupy_or_skip()
    keep = []
    for rows, K in ((16, 256), (48, 768), (160, 5120)):
        raw = _q4k(rows, K, rows * K)
        w = device_tensor(cp, "w", raw, Q4_K, (K, rows), keep)
        got = gt.repack_device(w).get()
        assert np.array_equal(got, gt.repack_q4_k(raw)), f"[{rows}x{K}]"


@pytest.mark.gpu
@pytest.mark.parametrize("build", [{}, {"GEMV_TCR_WARPS": "4", "GEMV_TCR_UNROLL": "1"},
                                   {"GEMV_TCR_WARPS": "16", "GEMV_TCR_UNROLL": "3", "GEMV_TCR_MINB": "1"},
                                   {"GEMV_TCR_PIPE": "1"}, {"GEMV_TCR_PIPE": "1", "GEMV_TCR_UNROLL": "1"},
                                   {"GEMV_TCR_GRID": "1"}, {"GEMV_TCR_GRID": "3"}, {"GEMV_TCR_PIPE": "1", "GEMV_TCR_GRID": "3"}],
                         ids=["default", "w4-u1", "w16-u3", "pipe", "pipe-u1", "grid1", "grid3", "pipe-grid3"])
def test_gemv_tcr_matches_the_oracle_and_reruns_bitwise(build, monkeypatch):
    """Store nodes of several tiles per block (9008 rows: 563 tiles; [1024x5120] with _GRID=3: three
    tiles of 5 rounds each per block, the pipelined build's step into the next tile), one tile, K = 256
    (2 groups: most warps without one), the 27B widths; add over two segments onto random values; SwiGLU pairs; rows
    that are not whole tiles stay on v9; a NaN in x reaches every row."""
    cp = cupy_or_skip()
    from backends.engine import ops as eops
    from test_engine_kernels import _matrix
    from test_gemv_mma import add_and_swiglu_match, nan_reaches_every_row, store_matches
    q16_or_skip("the v12 kernels")
    monkeypatch.setattr(eops, "GEMV_KQ", "v9l8")
    monkeypatch.setattr(eops, "GEMV_TMA", "")
    monkeypatch.setattr(gt, "GEMV_TCR", "1")
    for knob, val in build.items():
        monkeypatch.setattr(gt, knob, val)
    keep = []
    rng = np.random.default_rng(0)
    for rows, K in ((9008, 512), (1024, 5120), (16, 256), (48, 5120), (320, 17408)):
        store_matches(cp, eops, Q4_K, rows, K, rows + K, rng.normal(size=K).astype(np.float32), keep, "gemvtcr_", "v12")
    # add over two segments (32 and 16 rows) onto random values; SwiGLU pairs
    K = 1024
    mats = [_matrix(Q4_K, r, K, r) for r in (32, 16)]
    x = rng.normal(size=K).astype(np.float32)
    add_and_swiglu_match(cp, eops, Q4_K, mats, x, rng, ((32, 5120), (9008, 256), (64, 17408)), keep,
                         "gemvtcr_add_q4_k", "gemvtcr_", "v12")
    # rows that are not whole tiles: v9
    raw, w = _matrix(Q4_K, 16, 256, 5)
    node = eops.gemv("t", "store", [eops.Seg(device_tensor(cp, "p", raw[:15], Q4_K, (256, 15), keep),
                                             nan_poisoned(cp, 15))], cp.asarray(x[:256]), 256)
    assert node.kernel.name.startswith("gemvkq"), node.kernel.name
    nan_reaches_every_row(cp, eops, Q4_K, mats[0][0], x, keep, "v12")
