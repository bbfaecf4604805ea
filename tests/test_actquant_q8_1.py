"""llama.cpp's CUDA activation rounding model (oracles.actquant q8_1 functions) and the q8_1
GEMV check (oracles.gemv_check, impl "q8_1"): the GPU tests judge the engine's q8_1 kernels
(GGUF_HARNESS_GEMV=q8_1) against them, so their properties are checked here on the CPU.

The legacy-format test recomputes llama.cpp's per-block integer formula (ggml-cuda
vecdotq.cuh vec_dot_q4_0_q8_1_impl: d4 * (sumi * ds - 8 * sy), vec_dot_q4_1_q8_1_impl:
d * ds * sumi + m * sy) from the raw nibbles, independently of the dequantise-then-correct
route the oracle takes."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from oracles import actquant, gemv_check
from oracles.blocks import random_blocks
from oracles.dequant import dequantize

finite = st.floats(-1e3, 1e3, allow_nan=False, width=32)  # block sums stay below fp16's 65504


@settings(max_examples=200, deadline=None)
@given(arrays(np.float32, st.integers(1, 200), elements=finite))
def test_q8_1_codes_scale_and_error(x):
    q, ds, sy = actquant.q8_1_parts(x)
    assert (q == np.rint(q)).all() and np.abs(q).max() <= 127
    b = np.concatenate([x, np.zeros(-x.size % 32, np.float32)]).reshape(-1, 32).astype(np.float64)
    amax = np.abs(b).max(axis=1)
    # ds is amax / 127 to fp16 precision; a nonzero block's largest value maps to +-127
    assert (np.abs(ds - amax / 127) <= amax / 127 * 2.0 ** -11 + 6e-8).all()
    nz = amax.astype(np.float32) > np.float32(1e-30)  # the flush (q8_1_parts docstring)
    assert (np.abs(q[nz]).max(axis=1) == 127).all() and (q[~nz] == 0).all()
    # sy is the block's sum to fp16 precision (plus fp32 summation)
    s = b.sum(axis=1)
    assert (np.abs(sy - s) <= np.abs(s) * 2.0 ** -11 + np.abs(b).sum(axis=1) * 1e-6 + 6e-8).all()
    # value error: half a code of the unrounded scale plus 127 codes times the fp16 rounding
    # of the scale (relative 2^-11, or half the subnormal spacing 2^-25 below fp16's 6.1e-5:
    # llama.cpp's scales of blocks with amax < 0.0078 are fp16 subnormals)
    r = actquant.round_q8_1(x)
    d = np.repeat(amax / 127, 32)[:x.size]
    dz = np.repeat(~nz, 32)[:x.size]
    lim = d * (0.5 + 1e-6) + 127 * np.maximum(d * 2.0 ** -11, 2.0 ** -25)
    err = np.abs(r - x.astype(np.float64))
    assert (err[~dz] <= lim[~dz]).all() and (r[dz] == 0).all()


def test_q8_1_rounds_ties_away_from_zero_and_zero_block():
    x = np.zeros(64, np.float32)
    x[0], x[1], x[2] = 127.0, 2.5, -2.5  # d = 1: 2.5 -> 3, -2.5 -> -3 (roundf, not rint)
    q, ds, sy = actquant.q8_1_parts(x)
    assert q[0, :3].tolist() == [127, 3, -3] and ds[0] == 1.0 and sy[0] == 127.0
    assert (q[1] == 0).all() and ds[1] == 0 and sy[1] == 0


def _llamacpp_legacy_dot(raw: np.ndarray, type_id: int, x: np.ndarray) -> np.ndarray:
    """Rows of a Q4_0 / Q4_1 matrix times x, the way llama.cpp's CUDA mmvq computes them:
    integer dot of the 4-bit codes with the q8_1 codes per 32-value block, then the format's
    scale and the offset folded with the block's fp16 sum."""
    q8, ds, sy = actquant.q8_1_parts(x)
    nbytes = {2: 18, 3: 20}[type_id]
    blocks = raw.reshape(raw.shape[0], -1, nbytes)
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    qs = blocks[:, :, nbytes - 16:]
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=-1).astype(np.int64)  # value j, j + 16
    sumi = (codes * q8[None].astype(np.int64)).sum(axis=-1)
    if type_id == 2:
        return (d * (sumi * ds[None] - 8 * sy[None])).sum(axis=1)
    m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    return (d * ds[None] * sumi + m * sy[None]).sum(axis=1)


@pytest.mark.parametrize("type_id", [2, 3])
def test_q8_1_oracle_equals_llamacpp_integer_formula(type_id):
    rng = np.random.default_rng(type_id)
    rows, K = 6, 160
    raw = random_blocks(type_id, rows * K // 32, rng).reshape(rows, -1)
    w = dequantize(raw.reshape(-1), type_id, (rows, K)).astype(np.float64)
    x = rng.normal(size=K).astype(np.float32)
    ref = _llamacpp_legacy_dot(raw, type_id, x)
    offs = actquant.q8_1_offsets(raw, type_id)
    got = w @ actquant.round_q8_1(x) + actquant.q8_1_offset_term(offs, actquant.q8_1_parts(x))
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12 * np.abs(ref).max())
    # without the offset term the two differ (the term is not negligible)
    assert np.abs(w @ actquant.round_q8_1(x) - ref).max() > 1e-6 * np.abs(ref).max()


def test_q8_1_check_accepts_llamacpp_and_rejects_a_wrong_block():
    rng = np.random.default_rng(5)
    rows, K = 8, 256
    raw = random_blocks(6, rows * K // 32, rng).reshape(rows, -1)  # Q5_0
    w = dequantize(raw.reshape(-1), 6, (rows, K)).astype(np.float64)
    x = rng.normal(size=K).astype(np.float32)
    y = w @ actquant.round_q8_1(x) + actquant.q8_1_offset_term(actquant.q8_1_offsets(raw, 6),
                                                                actquant.q8_1_parts(x))
    assert gemv_check.check_store(y, w, x, impl="q8_1", raw=raw, type_id=6)["ok"]
    # the same y checked as if the offsets were folded with code sums fails...
    bad = y.copy()
    bad[3] += 0.1 * np.abs(w[3, :32]) @ np.abs(x[:32])  # one block of one row off by 10 %
    v = gemv_check.check_store(bad, w, x, impl="q8_1", raw=raw, type_id=6)
    assert not v["ok"] and v["worst_row"] == 3
    # ... and a legacy check without raw blocks is refused, not silently approximate
    with pytest.raises(ValueError):
        gemv_check.check_store(y, w, x, impl="q8_1", type_id=6)


def test_q8_1_swiglu_check():
    rng = np.random.default_rng(9)
    rows, K = 8, 4096  # the q8_1 rounding error (~sqrt(K) ds |w|) dwarfs the tie allowance
    rg, ru = (random_blocks(t, rows * K // 256, rng).reshape(rows, -1) for t in (12, 14))
    wg = dequantize(rg.reshape(-1), 12, (rows, K)).astype(np.float64)
    wu = dequantize(ru.reshape(-1), 14, (rows, K)).astype(np.float64)
    x = rng.normal(size=K).astype(np.float32)
    xs = actquant.round_q8_1(x)
    g, u = wg @ xs, wu @ xs
    y = g / (1 + np.exp(-g)) * u
    kw = dict(impl="q8_1", raw=(rg, ru), type_ids=(12, 14))
    assert gemv_check.check_swiglu(y, wg, wu, x, **kw)["ok"]
    # the q16-rounded result is not what a q8_1 kernel returns: its error is far above the bound
    xq = actquant.round_q16(x)
    gq, uq = wg @ xq, wu @ xq
    assert not gemv_check.check_swiglu(gq / (1 + np.exp(-gq)) * uq, wg, wu, x, **kw)["ok"]


def test_oracle_q8_1_linear_matches_the_check_formula(tiny_qwen2_q):
    """Qwen2Oracle(act_round="q8_1")._lin on every matrix of the tiny quantised model (Q5_0,
    Q8_0, Q4_0, Q6_K, Q4_K) equals gemv_check's q8_1 reference built from the raw blocks;
    an unknown act_round is refused."""
    from harness.errors import ConfigError
    from oracles.qwen2 import Qwen2Oracle
    o = Qwen2Oracle(tiny_qwen2_q, n_ctx=32, act_round="q8_1")
    rng = np.random.default_rng(4)
    seen = set()
    for t in o.weights.info.tensors.values():
        if len(t.shape) != 2 or t.name == "token_embd.weight":
            continue
        x = rng.normal(size=(2, t.shape[1]))
        got = o._lin(t.name, x)
        w = o.weights.get(t.name).astype(np.float64)
        for r in range(2):
            ref, _, _ = gemv_check._q8_1_ref(w, x[r], o.weights.info.tensor_data(t.name), t.type_id)
            np.testing.assert_allclose(got[r], ref, rtol=1e-12, atol=1e-12 * np.abs(ref).max())
        seen.add(t.type_id)
    assert {2, 6, 8} <= seen  # legacy types with and without an offset term were covered
    with pytest.raises(ConfigError):
        Qwen2Oracle(tiny_qwen2_q, n_ctx=32, act_round="q4")


def test_fused_parts_model_the_normalised_vector():
    """q8_1_parts_fused (the kernel's order: codes of x * w, fp16 of d * rs) equals
    q8_1_parts of the normalised vector except at float32 ties and fp16 boundaries."""
    from oracles import ops
    rng = np.random.default_rng(12)
    K, eps = 8960, 1e-6
    x = (rng.normal(size=K) * 3).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, K).astype(np.float32)
    xn = ops.rms_norm(x[None].astype(np.float64), nw.astype(np.float64), eps)[0]
    qf, dsf, syf = actquant.q8_1_parts_fused(x, nw, eps)
    qn, dsn, syn = actquant.q8_1_parts(xn)
    assert np.mean(qf != qn) < 1e-3 and np.abs(qf - qn).max() <= 1
    assert (np.abs(dsf - dsn) <= dsn * 2.0 ** -10).all()
    assert (np.abs(syf - syn) <= np.abs(syn) * 2.0 ** -10 + 1e-3).all()
