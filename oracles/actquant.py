"""Emulation of llama.cpp's CPU activation rounding in quantised matrix products (optional).

ggml's CPU mul_mat converts the activation rows (src1) to the weight type's `vec_dot_type`
before the dot products (ggml/src/ggml-cpu/ggml-cpu.c type_traits_cpu): Q8_0 for Q4_0, Q5_0,
Q8_0, IQ4_NL; Q8_1 for Q4_1, Q5_1; Q8_K for the K-quants and the other I-quants; F16 for F16
and BF16 for BF16 weights; F32 weights see the activations unchanged. The integer dot
products are exact, so dequant(w) . dequant(q(x)) in float64 equals ggml's result up to its
float32 accumulation (~1e-7 relative). With this rounding the float64 oracle reproduces what
llama.cpp computes on quantised models instead of the exact product; the plain oracle stays
the reference for accuracy, this mode separates kernel bugs from activation rounding.

Rounding rules (float32 arithmetic, as ggml does it):
  Q8_0 / Q8_1 (blocks of 32): amax = max|x|; d = amax / 127 stored as fp16; q = round-half-
      even(x * (127 / amax)) (ggml-cpu/arch/x86/quants.c quantize_row_q8_0, AVX path);
      value = q * fp16(d).
  Q8_K (blocks of 256): max = the signed x of largest |x| (first one); iscale = -127 / max;
      q = min(127, round-half-even(iscale * x)); d = 1 / iscale (float32); value = q * d
      (ggml/src/ggml-quants.c quantize_row_q8_K_ref).
"""
from __future__ import annotations

import numpy as np
from gguf.constants import GGMLQuantizationType as QT

from harness.errors import ConfigError

from .dequant import get_format

F32 = np.float32
_Q8_0 = {QT.Q4_0, QT.Q5_0, QT.Q8_0, QT.IQ4_NL, QT.Q4_1, QT.Q5_1}
_Q8_K = {QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ2_XXS, QT.IQ2_XS, QT.IQ2_S,
         QT.IQ3_XXS, QT.IQ3_S, QT.IQ1_S, QT.IQ1_M, QT.IQ4_XS, QT.TQ1_0, QT.TQ2_0}


def _blocks(x, size: int) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64).astype(F32)
    if x.shape[-1] % size:
        raise ConfigError(f"activation rows of {x.shape[-1]} values are not blocks of {size}")
    return x.reshape(*x.shape[:-1], -1, size)


def round_q8_0(x) -> np.ndarray:
    """x [..., k] -> float64 values after Q8_0 quantisation (k a multiple of 32)."""
    b = _blocks(x, 32)
    amax = np.max(np.abs(b), axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, F32(127) / amax, F32(0)).astype(F32)
    q = np.rint((b * inv).astype(F32))
    d16 = (amax / F32(127)).astype(F32).astype(np.float16).astype(np.float64)
    return (q * d16).reshape(np.shape(x))


def round_q8_k(x) -> np.ndarray:
    """x [..., k] -> float64 values after Q8_K quantisation (k a multiple of 256)."""
    b = _blocks(x, 256)
    idx = np.argmax(np.abs(b), axis=-1)[..., None]  # first index of the largest |x|
    mx = np.take_along_axis(b, idx, axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(mx != 0, F32(-127) / mx, F32(0)).astype(F32)
        q = np.minimum(127, np.rint((iscale * b).astype(F32)))
        d = np.where(mx != 0, F32(1) / iscale, F32(0)).astype(F32)
    return (q * d.astype(np.float64)).reshape(np.shape(x))


Q16_FLUSH = 1e-30  # kernels/gemv.cu XQ_FLUSH
Q16_MMA_MAX = 32639  # kernels/gemv_mma.cu MMA_XMAX = 127 * 256 + 127


def round_q16(x, qmax: int = 32767) -> np.ndarray:
    """x [..., k] -> float64 values after the engine's GEMV input rounding (engine v4,
    backends/engine/kernels/gemv.cu stage_xq), float32 arithmetic as the kernel does it:
    per 32-value block of each row (the last one zero-padded) amax = max|x|, q =
    round-half-even(x * (32767 / amax)) as int16, value = q * (amax / 32767).
    |value - x| <= amax / 65534 (up to float32 rounding of the scale). Blocks with
    amax <= Q16_FLUSH become zeros (32767 / amax would overflow float32 below ~1e-34).
    qmax: the largest code (32767; the engine v11 tensor-core GEMV, kernels/gemv_mma.cu, uses
    Q16_MMA_MAX = 32639 so each code splits into two int8 bytes), the bound then amax / (2 qmax)."""
    x = np.asarray(x, dtype=np.float64).astype(F32)
    shape, k = x.shape, x.shape[-1]
    rows = x.reshape(-1, k)
    b = np.concatenate([rows, np.zeros((rows.shape[0], -k % 32), F32)], axis=1).reshape(rows.shape[0], -1, 32)
    amax = np.max(np.abs(b), axis=-1, keepdims=True)
    # np.where evaluates both branches: the flushed blocks' 32767 / amax may divide by zero or
    # overflow there, and is discarded
    with np.errstate(divide="ignore", over="ignore"):
        inv = np.where(amax > F32(Q16_FLUSH), F32(qmax) / amax, F32(0)).astype(F32)
    q = np.rint((b * inv).astype(F32))
    d = (amax / F32(qmax)).astype(F32).astype(np.float64)
    return (q * d).reshape(rows.shape[0], -1)[:, :k].reshape(shape)


def q16_error_bound(x, qmax: int = 32767) -> np.ndarray:
    """Per-value bound [k] of |round_q16(x, qmax) - x|: amax of the value's 32-block / (2 qmax)
    (65534 for the default), plus float32 rounding of the scale (2^-23 relative)."""
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    k = x.size
    b = np.concatenate([np.abs(x), np.zeros(-k % 32)]).reshape(-1, 32)
    amax = np.repeat(b.max(axis=-1), 32)[:k]
    return np.where(amax.astype(F32) > F32(Q16_FLUSH), amax * (1 / (2 * qmax) + 2.0 ** -22), amax)


# llama.cpp's CUDA mul_mat_vec_q input (ggml-cuda/quantize.cu quantize_q8_1, vecdotq.cuh), the
# engine's GEMV_IMPL "q8_1" (backends/engine/kernels/gemv.cu, -DACT_Q8_1).
Q8_1_OFFSET = {2: ("d", -8.0), 6: ("d", -16.0), 3: ("m", 1.0), 7: ("m", 1.0)}  # Q4_0 Q5_0 Q4_1 Q5_1
Q8_1_FLOAT_TYPES = (0, 1, 30)  # F32, F16, BF16: llama.cpp multiplies them with unrounded x


def _q8_1_codes(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Blocks b [nb, 32] float32 -> (q [nb, 32], d [nb, 1] float32): d = amax / 127,
    q = roundf(b / d) in float32 (half away from zero), 0 for amax <= 1e-30."""
    amax = np.max(np.abs(b), axis=-1, keepdims=True)
    d = (amax / F32(127)).astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.where(amax > F32(Q16_FLUSH), np.divide(b, d, dtype=F32), F32(0)).astype(np.float64)
    return np.sign(v) * np.floor(np.abs(v) + 0.5), d


def _blocks32(v) -> np.ndarray:
    v = np.asarray(v, dtype=np.float64).astype(F32).reshape(-1)
    return np.concatenate([v, np.zeros(-v.size % 32, F32)]).reshape(-1, 32)


def _f16(a) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.asarray(a, F32).astype(np.float16).astype(np.float64)


def q8_1_parts(x) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [K] -> (q [nb, 32], ds [nb], sy [nb]) float64 as llama.cpp's CUDA quantize_q8_1 makes
    them, float32 arithmetic: per 32-value block (the last zero-padded) amax = max|x|,
    d = amax / 127, q = roundf(x / d) (half away from zero; 0 for blocks with amax <= 1e-30,
    the engine's flush, where d is a float32 subnormal or 0 and llama.cpp's codes overflow
    int8 or divide by zero; llama.cpp zeroes only amax == 0),
    ds = fp16(d), sy = fp16(sum of the block's unquantised values) (+-inf beyond 65504, as
    llama.cpp's half2 store gives)."""
    b = _blocks32(x)
    q, d = _q8_1_codes(b)
    return q, _f16(d[:, 0]), _f16(b.astype(np.float64).sum(axis=-1))


def q8_1_parts_fused(x, norm_w, eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q8_1_parts of the RMS-normalised x * norm_w computed in the engine's order (gemv.cu
    stage_xq with -DACT_Q8_1): codes of v = x * norm_w (one float32 multiply) with
    d = amax(v) / 127, then with rs = 1 / sqrt(mean(x^2) + eps): ds = fp16(d rs) and
    sy = fp16(sum(v) rs). The codes are those of the normalised vector up to float32 ties;
    here they are exactly the kernel's (same float32 operations); rs differs from the
    kernel's rsqrtf by ~2 ulp, which can move ds or sy to a neighbouring fp16 value."""
    x64 = np.asarray(x, np.float64).reshape(-1)
    v = (x64.astype(F32) * np.asarray(norm_w, np.float64).astype(F32).reshape(-1)).astype(F32)
    rs = 1.0 / np.sqrt(np.mean(x64.astype(F32).astype(np.float64) ** 2) + eps)
    b = _blocks32(v)
    q, d = _q8_1_codes(b)
    return q, _f16(d[:, 0].astype(np.float64) * rs), _f16(b.astype(np.float64).sum(axis=-1) * rs)


def q8_1_xhat(parts, k: int) -> np.ndarray:
    """The values ds * q [k] (float64) that the CUDA mmvq dot products see, from q8_1_parts."""
    q, ds, _ = parts
    return (q * ds[:, None]).reshape(-1)[:k]


def round_q8_1(x) -> np.ndarray:
    """x [K] -> float64 [K]: q8_1_xhat of q8_1_parts(x)."""
    return q8_1_xhat(q8_1_parts(x), np.asarray(x).size)


def q8_1_offsets(raw: np.ndarray, type_id: int) -> np.ndarray | None:
    """Per-block offsets b [rows, K/32] float64 of a legacy matrix (y = a q + b per 32-value
    block: Q4_0 -8 d, Q5_0 -16 d, Q4_1 / Q5_1 m; ggml-quants.c dequantize_row_*), from its raw
    blocks [rows, row_bytes] uint8; None for the other types (their q8_1 dot products use
    code sums, no correction)."""
    if int(type_id) not in Q8_1_OFFSET:
        return None
    field, k = Q8_1_OFFSET[int(type_id)]
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    blocks = raw.reshape(raw.shape[0], -1, get_format(int(type_id)).type_size)
    at = 0 if field == "d" else 2
    h = blocks[:, :, at:at + 2].copy().view(np.float16)[..., 0]
    return k * h.astype(np.float64)


def q8_1_offset_term(offsets: np.ndarray | None, parts) -> np.ndarray | float:
    """What llama.cpp adds to w . q8_1_xhat(parts) for a legacy matrix: its dot products fold
    the offset b with the block's fp16 value sum sy instead of ds * sum(q) (vecdotq.cuh
    vec_dot_q4_0_q8_1_impl: d4 * (sumi * ds - 8 * sy)), so row r gets
    sum_b b[r, b] (sy_b - ds_b sum_k q_bk). parts: q8_1_parts or q8_1_parts_fused of the
    input. float64 [rows], or 0.0 without offsets."""
    if offsets is None:
        return 0.0
    q, ds, sy = parts
    return offsets @ (sy - ds * q.sum(axis=-1))[:offsets.shape[1]]


def round_for(weight_type: int, x) -> np.ndarray:
    """Activations x [n, k] as ggml's CPU mul_mat sees them for weights of `weight_type`."""
    t = QT(int(weight_type))
    if t == QT.F32:
        return np.asarray(x, dtype=np.float64)
    if t in _Q8_0:
        return round_q8_0(x)
    if t in _Q8_K:
        return round_q8_k(x)
    if t == QT.F16:
        return np.asarray(x, dtype=np.float64).astype(F32).astype(np.float16).astype(np.float64)
    if t == QT.BF16:
        u = np.asarray(x, dtype=np.float64).astype(F32).view(np.uint32)
        u = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)  # round to nearest even
        return u.view(F32).astype(np.float64)
    raise ConfigError(f"no activation-rounding rule for weights of type {t.name}")
