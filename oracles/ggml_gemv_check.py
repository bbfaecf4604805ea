"""Outputs of llama.cpp's own GEMV kernels (ggml mul_mat with one f32 column, driven by
harness.ggml_gemv) judged against the float64 oracle: per-row bounds and a verdict shaped
like oracles.gemv_check's.

Why a looser bound than the engine's (oracles.gemv_check): ggml does not multiply the f32
x it is given. Its CUDA mul_mat for quantised weights and a single column (mul_mat_vec_q,
ggml/src/ggml-cuda/mmvq.cu) first quantises x to q8_1 (ggml-cuda/quantize.cu,
quantize_q8_1): per block of 32 values d = amax / 127 (float32), q = round(x / d) (int8),
and d is stored as fp16 next to the block sum. So ggml computes W . x' with
|x'_i - x_i| <= |x_i - q d| + |q| |d - fp16(d)| <= d / 2 + 127 d 2^-11 = amax (0.5 + 127 *
2^-11) / 127 (q8_error_bound). The CPU backend quantises x the same way with the weight
type's vec_dot_type (oracles/actquant.py: q8_0 blocks of 32 for Q4_0/Q8_0/..., q8_K blocks
of 256 with a float32 scale for the K- and I-quants), so the same formula holds with the
block length of that format (act_block_for).

The verdict (check_store / check_swiglu):
- "vs exact oracle" decides ok: row r may differ from the float64 W x by
  GEMV_TOL ||w_r|| ||x|| (float32 accumulation, as for the engine) plus
  X_ROUND_SLACK * HOEFFDING_T * sqrt(sum_i (|w_i| d_i / 2)^2 + sum_b (2^-11 sum_{i in b}
  |w_i| (|x_i| + d_b / 2))^2) (x_round_bounds), a high-probability bound on the activation
  rounding, not its worst case: the worst case (every error aligned with the sign of w,
  |w_r| . q8_error_bound(x)) is ~sqrt(K) times the typical error and would pass a kernel
  that is off by tens of percent. Why it holds: x is N(0, 1) (random, seeded); given a
  block's scale d_b, the rounding errors q d_b - x_i of its other values are independent,
  symmetric and within d_b / 2, and the fp16 rounding of d_b adds q (fp16(d_b) - d_b),
  one relative error of at most 2^-11 common to the block (so it is summed per block first);
  blocks are independent and every term changes sign with x_b -> -x_b. Hoeffding's
  inequality then bounds |error| > T sqrt(sum of squared ranges) by 2 exp(-T^2 / 2):
  2.5e-14 per row for T = 8, < 1e-8 over all 248320 rows of the output head.
  X_ROUND_SLACK = 2 leaves room for what the formula does not model: formats with a block
  minimum (Q4_1, Q5_1, maybe the K-quants' mins) may use the q8_1 block sums stored in fp16,
  and ggml rounds half away from zero with a float32 x / d. Measured on the CPU backend
  (tests/test_ggml_gemv.py) and emulated for the table's shapes (w . round_q8_0(x)), a
  correct result reaches 0.06-0.17 of this bound over 64 rows; the same rows scaled by
  1.05 reach 0.2-1.0 (the swiglu pair the least): this check catches errors of a few
  percent and more per row (a wrong block, scale, row or operand is far beyond that),
  the information-only ratio below the finer ones.
- "ratio_vs_rounded_x" (information only, not part of ok): the error against the float64
  product with x rounded as ggml rounds it (actquant.round_q8_0 for q8_1 blocks of 32 —
  same values up to rounding-boundary ties — or actquant.round_for on the CPU backend) over
  GEMV_TOL ||w_r|| ||x||; around or below 1 it says ggml's result is the rounded-x product
  up to float32 accumulation (ties and fp16 block sums can lift it above 1 without a bug).
SwiGLU pair (silu(gate x) * (up x), ggml_swiglu_split): the two rows' bounds propagate as in
oracles.gemv_check.check_swiglu (SILU_SLOPE, EPILOGUE_REL).
"""
from __future__ import annotations

import numpy as np

from . import actquant, ops
from .gemv_check import _verdict, row_bounds, swiglu_bound

Q8_1_BLOCK = 32                      # QK8_1 (ggml-common.h)
X_ROUND_SLACK = 2.0                  # see the module docstring
HOEFFDING_T = 8.0                    # P(false failure) <= 2 exp(-T^2 / 2) per row
FP16_REL = 2.0 ** -11                # relative rounding of an fp16 scale
_Q8_REL = (0.5 + 127 * FP16_REL) / 127  # worst |x' - x| / amax of one block


def act_block_for(type_id: int, backend: str = "cuda") -> int:
    """Block length of ggml's activation rounding for weights of type_id: 32 (q8_1) on the
    CUDA backend; on the CPU backend 256 for the types whose vec_dot_type is q8_K
    (oracles.actquant), else 32."""
    if backend == "cpu" and int(type_id) in {int(t) for t in actquant._Q8_K}:
        return 256
    return Q8_1_BLOCK


def q8_error_bound(x, block: int = Q8_1_BLOCK) -> np.ndarray:
    """Per-value bound [K] of |x' - x| for x rounded to 8-bit blocks of `block` values
    (the last one zero-padded): amax of the value's block * (0.5 + 127 * 2^-11) / 127."""
    x = np.abs(np.asarray(x, np.float64).reshape(-1))
    k = x.size
    amax = np.concatenate([x, np.zeros(-k % block)]).reshape(-1, block).max(axis=1)
    return np.repeat(amax, block)[:k] * _Q8_REL


def rounded_x(x, type_id: int, backend: str = "cuda") -> np.ndarray:
    """x as ggml's mul_mat sees it (float64 [K]), for the information-only ratio."""
    if backend == "cpu":
        return actquant.round_for(type_id, np.asarray(x).reshape(1, -1)).reshape(-1)
    return actquant.round_q8_0(x)


def x_round_bounds(w: np.ndarray, x, block: int = Q8_1_BLOCK) -> np.ndarray:
    """Per-row high-probability bound [rows] of |w_r . (x' - x)| (module docstring),
    X_ROUND_SLACK and HOEFFDING_T included. w: float64 [rows, K]."""
    x = np.asarray(x, np.float64).reshape(-1)
    k = x.size
    pad = -k % block
    ax = np.concatenate([np.abs(x), np.zeros(pad)]).reshape(-1, block)
    d = ax.max(axis=1) / 127                                   # [blocks]
    aw = np.concatenate([np.abs(w), np.zeros((w.shape[0], pad))], axis=1)
    aw = aw.reshape(w.shape[0], -1, block)                     # [rows, blocks, block]
    per_value = (aw * (d / 2)[None, :, None]) ** 2
    per_block = (FP16_REL * (aw * (ax + d[:, None] / 2)[None]).sum(axis=2)) ** 2
    var = per_value.sum(axis=(1, 2)) + per_block.sum(axis=1)
    return X_ROUND_SLACK * HOEFFDING_T * np.sqrt(var)


def exact_bounds(w: np.ndarray, x, block: int = Q8_1_BLOCK) -> np.ndarray:
    """Per-row bound [rows] vs the exact float64 product (module docstring)."""
    return row_bounds(w, x) + x_round_bounds(w, x, block)


def _info(v: dict, y, ref, tol) -> dict:
    err = np.abs(np.asarray(y, np.float64) - ref)
    r = float(np.max(np.where(np.isfinite(err), err / tol, np.inf))) if err.size else 0.0
    return dict(v, ratios={v["check"]: v["max_err_over_bound"]}, ratio_vs_rounded_x=r)


def check_store(y, w: np.ndarray, x, row_ids=None, type_id: int = 2,
                backend: str = "cuda") -> dict:
    """y [n] (ggml output of rows row_ids) vs w [n, K] float64 (those rows, dequantised)
    and x [K]. Returns oracles.gemv_check's verdict keys {check, ok, rows_checked,
    nonfinite, max_err_over_bound, worst_row, worst_ref, worst_got, ratios} plus
    ratio_vs_rounded_x (information only)."""
    y = np.asarray(y, np.float64)
    ids = np.arange(y.size) if row_ids is None else np.asarray(row_ids)
    x64 = np.asarray(x, np.float64)
    bound = exact_bounds(w, x64, act_block_for(type_id, backend))
    v = _verdict(y, w @ x64, bound, ids, "vs exact oracle (x rounded to 8 bits by ggml)")
    return _info(v, y, w @ rounded_x(x64, type_id, backend), row_bounds(w, x64))


def check_swiglu(y, wg: np.ndarray, wu: np.ndarray, x, row_ids=None, type_id: int = 2,
                 backend: str = "cuda") -> dict:
    """y [n] = silu(wg x) * (wu x) from ggml vs the exact float64 oracle; result as
    check_store."""
    y = np.asarray(y, np.float64)
    ids = np.arange(y.size) if row_ids is None else np.asarray(row_ids)
    x64 = np.asarray(x, np.float64)
    block = act_block_for(type_id, backend)
    g, u = wg @ x64, wu @ x64
    eg, eu = exact_bounds(wg, x64, block), exact_bounds(wu, x64, block)
    v = _verdict(y, ops.swiglu(g, u), swiglu_bound(g, u, eg, eu), ids,
                 "swiglu vs exact oracle (x rounded to 8 bits by ggml)")
    xr = rounded_x(x64, type_id, backend)
    gr, ur = wg @ xr, wu @ xr
    tol = swiglu_bound(gr, ur, row_bounds(wg, x64), row_bounds(wu, x64))
    return _info(v, y, ops.swiglu(gr, ur), tol)
