"""oracles.ops against independent formulations (scalar loops with math.*, complex numbers,
the Hugging Face rotate_half form of NEOX RoPE), on odd shapes drawn by hypothesis."""

from __future__ import annotations

import cmath
import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.errors import ConfigError
from oracles import ops

SETTINGS = settings(max_examples=25, deadline=None)


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


@SETTINGS
@given(n=st.integers(1, 5), d=st.integers(1, 37), seed=st.integers(0, 2**16),
       eps=st.sampled_from([0.0, 1e-6, 1e-5, 0.5]))
def test_rms_norm_matches_scalar_loop(n, d, seed, eps):
    rng = _rng(seed)
    x = rng.standard_normal((n, d)) * rng.uniform(0.01, 100)
    w = rng.standard_normal(d)
    got = ops.rms_norm(x, w, eps)
    for i in range(n):
        ms = math.fsum(float(v) * float(v) for v in x[i]) / d
        inv = 1.0 / math.sqrt(ms + eps)
        for j in range(d):
            assert got[i, j] == pytest.approx(x[i, j] * inv * w[j], rel=1e-13, abs=1e-300)


def test_rms_norm_output_has_unit_rms_without_weight():
    x = _rng(1).standard_normal((3, 11)) * 7.0
    y = ops.rms_norm(x, None, 0.0)
    np.testing.assert_allclose(np.sqrt(np.mean(y * y, axis=1)), 1.0, rtol=1e-14)


def _rope_complex(x, pos, n_rot, base, scale):
    """Per-pair complex rotation: z = a + i b, z * exp(i theta) with a scalar pow per pair."""
    out = np.array(x, dtype=np.float64)
    half = n_rot // 2
    for t in range(x.shape[0]):
        for h in range(x.shape[1]):
            for i in range(half):
                theta = scale * pos[t] * math.pow(base, -2.0 * i / n_rot)
                z = complex(x[t, h, i], x[t, h, i + half]) * cmath.exp(1j * theta)
                out[t, h, i], out[t, h, i + half] = z.real, z.imag
    return out


def _rope_rotate_half(x, pos, n_rot, base, scale):
    """Hugging Face form: x * [cos, cos] + rotate_half(x) * [sin, sin] on the rotated dims."""
    inv_freq = 1.0 / (base ** (np.arange(0, n_rot, 2, dtype=np.float64) / n_rot))
    freqs = np.outer(np.asarray(pos, dtype=np.float64) * scale, inv_freq)  # [n, n_rot/2]
    emb = np.concatenate([freqs, freqs], axis=-1)[:, None, :]
    xr = x[..., :n_rot]
    rot = np.concatenate([-xr[..., n_rot // 2:], xr[..., :n_rot // 2]], axis=-1)
    return np.concatenate([xr * np.cos(emb) + rot * np.sin(emb), x[..., n_rot:]], axis=-1)


@SETTINGS
@given(n=st.integers(1, 4), heads=st.integers(1, 3), half=st.integers(1, 9),
       extra=st.integers(0, 3), seed=st.integers(0, 2**16),
       base=st.sampled_from([10000.0, 1e6, 500.0]), scale=st.sampled_from([1.0, 0.25, 0.5]))
def test_rope_neox_matches_complex_and_rotate_half(n, heads, half, extra, seed, base, scale):
    rng = _rng(seed)
    n_rot = 2 * half
    x = rng.standard_normal((n, heads, n_rot + 2 * extra + (extra % 2)))
    pos = rng.integers(0, 5000, size=n)
    got = ops.rope_neox(x, pos, n_rot, base, scale)
    np.testing.assert_allclose(got, _rope_complex(x, pos, n_rot, base, scale), rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(got, _rope_rotate_half(x, pos, n_rot, base, scale), rtol=1e-9, atol=1e-9)
    np.testing.assert_array_equal(got[..., n_rot:], x[..., n_rot:])  # pass-through dims


def test_rope_scores_depend_only_on_relative_position():
    rng = _rng(7)
    q, k = rng.standard_normal((1, 1, 16)), rng.standard_normal((1, 1, 16))

    def score(m, n):
        a = ops.rope_neox(q, [m], 16, 1e4)
        b = ops.rope_neox(k, [n], 16, 1e4)
        return float(np.sum(a * b))

    assert score(5, 2) == pytest.approx(score(103, 100), rel=1e-10)
    assert score(5, 2) != pytest.approx(score(5, 3), rel=1e-6)


def test_rope_rejects_bad_n_rot():
    x = np.zeros((2, 1, 8))
    for n_rot in (0, 3, 10):
        with pytest.raises(ConfigError, match="n_rot"):
            ops.rope_neox(x, [0, 1], n_rot, 1e4)


@SETTINGS
@given(n=st.integers(1, 9), seed=st.integers(0, 2**16), shift=st.sampled_from([0.0, 700.0, -700.0, 1e5]))
def test_softmax_matches_math_exp_and_is_stable(n, seed, shift):
    x = _rng(seed).standard_normal(n) * 3 + shift
    got = ops.softmax(x[None, :])[0]
    m = max(x)
    ref = [math.exp(v - m) for v in x]
    tot = math.fsum(ref)
    np.testing.assert_allclose(got, [r / tot for r in ref], rtol=1e-13)
    assert math.fsum(got) == pytest.approx(1.0, rel=1e-14)


def _attention_loop(q, k, v, pos, kv_len, scale):
    n_q, n_head, dh = q.shape
    group = n_head // k.shape[1]
    out = np.zeros_like(q)
    for t in range(n_q):
        for h in range(n_head):
            hk = h // group
            keys = [j for j in range(kv_len) if j <= pos[t]]
            s = [scale * math.fsum(q[t, h, d] * k[j, hk, d] for d in range(dh)) for j in keys]
            m = max(s)
            e = [math.exp(x - m) for x in s]
            z = math.fsum(e)
            for d in range(dh):
                out[t, h, d] = math.fsum(e[i] * v[j, hk, d] for i, j in enumerate(keys)) / z
    return out


@SETTINGS
@given(n_q=st.integers(1, 4), n_head_kv=st.integers(1, 3), group=st.integers(1, 3),
       dh=st.integers(1, 7), past=st.integers(0, 5), spare=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_attention_matches_per_head_loop(n_q, n_head_kv, group, dh, past, spare, seed):
    rng = _rng(seed)
    n_head, kv_len = n_head_kv * group, past + n_q
    q = rng.standard_normal((n_q, n_head, dh)) * 2
    k = rng.standard_normal((kv_len + spare, n_head_kv, dh))
    v = rng.standard_normal((kv_len + spare, n_head_kv, dh))
    k[kv_len:] = np.nan  # rows past kv_len must never be read
    pos = np.arange(past, kv_len)
    got = ops.attention(q, k, v, pos, kv_len)
    ref = _attention_loop(q, k, v, pos, kv_len, 1.0 / math.sqrt(dh))
    np.testing.assert_allclose(got, ref, rtol=1e-11, atol=1e-12)


def test_attention_is_causal_and_uses_grouped_kv_heads():
    rng = _rng(3)
    q = rng.standard_normal((3, 4, 5))
    k, v = rng.standard_normal((3, 2, 5)), rng.standard_normal((3, 2, 5))
    base = ops.attention(q, k, v, [0, 1, 2], 3)
    v2 = v.copy()
    v2[2] += 10.0  # a future key for queries 0 and 1
    np.testing.assert_array_equal(ops.attention(q, k, v2, [0, 1, 2], 3)[:2], base[:2])
    v3 = v.copy()
    v3[:, 1] += 1.0  # KV head 1 feeds query heads 2 and 3 only (group of 2)
    moved = ops.attention(q, k, v3, [0, 1, 2], 3)
    np.testing.assert_array_equal(moved[:, :2], base[:, :2])
    np.testing.assert_allclose(moved[:, 2:], base[:, 2:] + 1.0, rtol=1e-12)
    np.testing.assert_allclose(base[0], np.repeat(v[0], 2, axis=0), rtol=1e-12)  # only key 0


def test_attention_rejects_future_positions():
    x = np.zeros((1, 1, 2))
    with pytest.raises(ConfigError, match="q_positions"):
        ops.attention(x, x, x, [1], 1)


@SETTINGS
@given(seed=st.integers(0, 2**16), n=st.integers(1, 17))
def test_silu_and_swiglu_match_scalar_formula(seed, n):
    rng = _rng(seed)
    g = rng.standard_normal(n) * 20
    u = rng.standard_normal(n)
    ref_silu = [x / (1.0 + math.exp(-x)) for x in g]
    np.testing.assert_allclose(ops.silu(g), ref_silu, rtol=1e-14, atol=1e-300)
    np.testing.assert_allclose(ops.swiglu(g, u), np.array(ref_silu) * u, rtol=1e-14, atol=1e-300)


def test_silu_extremes_without_overflow_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = ops.silu(np.array([-1e4, -800.0, 0.0, 800.0, 1e4]))
    assert y[0] == 0.0 and y[2] == 0.0 and y[3] == 800.0 and y[4] == 1e4
    assert -1e-300 < y[1] <= 0.0


@SETTINGS
@given(n=st.integers(1, 4), k=st.integers(1, 13), m=st.integers(1, 11), seed=st.integers(0, 2**16),
       bias=st.booleans())
def test_linear_matches_fsum_loop(n, k, m, seed, bias):
    rng = _rng(seed)
    x = rng.standard_normal((n, k))
    w = rng.standard_normal((m, k)).astype(np.float32)  # weights arrive as float32
    b = rng.standard_normal(m) if bias else None
    got = ops.linear(x, w, b)
    for i in range(n):
        for j in range(m):
            ref = math.fsum(float(x[i, c]) * float(w[j, c]) for c in range(k)) + (b[j] if bias else 0.0)
            assert got[i, j] == pytest.approx(ref, rel=1e-12, abs=1e-12)
