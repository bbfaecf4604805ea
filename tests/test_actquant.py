"""The engine's GEMV input rounding model (oracles.actquant.round_q16): the GPU tests judge the
q16 kernels against it, so its own properties are checked here on the CPU."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from oracles.actquant import q16_error_bound, round_q16

finite = st.floats(-1e6, 1e6, allow_nan=False, width=32)


@settings(max_examples=200, deadline=None)
@given(arrays(np.float32, st.integers(1, 200), elements=finite))
def test_round_q16_error_within_bound(x):
    r = round_q16(x)
    assert r.shape == x.shape
    assert (np.abs(r - x.astype(np.float64)) <= q16_error_bound(x)).all()


def test_round_q16_codes_are_int16_and_block_maximum_exact():
    rng = np.random.default_rng(0)
    x = (rng.normal(size=96) * np.repeat([1e-3, 1.0, 300.0], 32)).astype(np.float32)
    r = round_q16(x).reshape(3, 32)
    amax = np.abs(x.reshape(3, 32)).max(axis=1, keepdims=True).astype(np.float64)
    d = (amax.astype(np.float32) / np.float32(32767)).astype(np.float64)
    codes = r / d
    np.testing.assert_allclose(codes, np.rint(codes), atol=1e-6)  # integer codes
    assert np.abs(np.rint(codes)).max() == 32767                  # the block maximum maps to 32767
    # each block is scaled on its own: the small block keeps its relative precision
    assert np.abs(r[0] - x[:32]).max() <= amax[0, 0] / 65534 * (1 + 1e-6)


def test_round_q16_zero_block_and_padding():
    x = np.zeros(40, np.float32)
    x[35] = 2.0
    r = round_q16(x)
    assert (r[:32] == 0).all() and abs(r[35] - 2.0) <= 2.0 / 65534 and (np.delete(r[32:], 3) == 0).all()


def test_round_q16_rows_are_independent():
    x = np.random.default_rng(2).normal(size=(3, 70)).astype(np.float32)
    x[1] *= 1000
    r = round_q16(x)
    for i in range(3):
        np.testing.assert_array_equal(r[i], round_q16(x[i]))


@settings(max_examples=100, deadline=None)
@given(arrays(np.float32, st.integers(1, 200), elements=finite))
def test_round_q16_mma_codes_split_into_two_s8_bytes(x):
    """The v11 rounding (kernels/gemv_mma.cu: codes capped at Q16_MMA_MAX = 127 * 256 + 127):
    within its own bound, and every code q has hi = (q + 128) >> 8 and lo = q - 256 hi in s8,
    which the kernel's B operand needs (32767, the q16 kernels' cap, would not)."""
    from oracles.actquant import Q16_MMA_MAX
    r = round_q16(x, Q16_MMA_MAX)
    assert (np.abs(r - x.astype(np.float64)) <= q16_error_bound(x, Q16_MMA_MAX)).all()
    b = np.concatenate([x.astype(np.float64), np.zeros(-x.size % 32)]).reshape(-1, 32)
    amax = np.abs(b).max(axis=1, keepdims=True).astype(np.float32)
    d = np.where(amax > 1e-30, amax / np.float32(Q16_MMA_MAX), 1).astype(np.float32).astype(np.float64)
    q = np.rint(np.concatenate([r, np.zeros(-x.size % 32)]).reshape(-1, 32) / d).astype(np.int64)
    assert np.abs(q).max() <= Q16_MMA_MAX
    hi = (q + 128) >> 8
    lo = q - 256 * hi
    assert hi.min() >= -128 and hi.max() <= 127 and lo.min() >= -128 and lo.max() <= 127
