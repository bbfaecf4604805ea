"""Engine GEMV outputs judged against the float64 oracle: per-row error bounds, as a verdict
(used by `harness bench kernels` and the pytest benchmarks before anything is timed).

The rule is the one of tests/test_engine_kernels.py (its module docstring derives it):
- x_seen = round_q16(x) for the q16 kernels (the engine's int16 input rounding, modelled by
  oracles.actquant.round_q16), x itself for the f32 kernels (GGUF_HARNESS_GEMV=f32).
- q8_1 kernels (GGUF_HARNESS_GEMV=q8_1, llama.cpp's CUDA rounding) are judged against
  W @ round_q8_1(x) plus llama.cpp's legacy offset term (actquant.q8_1_offset_term), with
  row_bounds + q8_1_allowance (fp16 neighbours, derived there; with a fused RMSNorm the
  reference follows the kernel's order, actquant.q8_1_parts_fused); float weight types run
  the f32 kernels in that mode and are judged as f32.
- Against the float64 product W @ x_seen, row r may differ by GEMV_TOL * ||w_r|| * ||x||.
- Against the exact W @ x additionally by |w_r| . q16_error_bound(x), the rounding's own
  worst case (q16 only).
SwiGLU pair (y = silu(g) * u, g / u the gate / up row products, oracles.ops.swiglu): first
order propagation of the two rows' bounds eg, eu: |dy| <= S1 |u| eg + |silu(g)| eu + eg eu,
S1 = max |silu'| = 1.0999 (silu'(x) = s(x) (1 + x (1 - s(x))), largest near x = 2.4), plus
1e-6 |y| for the kernel's float32 silu and product (expf is accurate to ~2 ulp).
"""
from __future__ import annotations

import numpy as np

from . import actquant, ops

GEMV_TOL = 1e-5      # derivation: tests/test_engine_kernels.py module docstring
SILU_SLOPE = 1.1     # >= max |silu'(x)| = 1.0999
EPILOGUE_REL = 1e-6  # float32 silu(g) * u in the kernel


def x_seen(x, impl: str = "q16") -> np.ndarray:
    """x [K] as the GEMV kernels see it (float64): rounded to int16 codes for impl "q16" ("mma":
    the v11 tensor-core kernels' codes of at most 32639),
    to llama.cpp's q8_1 values for "q8_1", unrounded for "f32"."""
    if impl == "q16":
        return actquant.round_q16(x)
    if impl == "mma":  # engine v11 (kernels/gemv_mma.cu): codes up to 32639, not 32767
        return actquant.round_q16(x, actquant.Q16_MMA_MAX)
    if impl == "q8_1":
        return actquant.round_q8_1(x)
    return np.asarray(x, np.float64)


F16_STEP = 2.0 ** -10  # largest relative gap between neighbouring fp16 values (normal range)


def q8_1_allowance(w: np.ndarray, parts, offsets: np.ndarray | None, fused: bool = False) -> np.ndarray:
    """Extra error [rows] a correct q8_1 kernel may show against the q8_1 oracle, beyond
    row_bounds. parts: the oracle's (q, ds, sy) (actquant.q8_1_parts, or q8_1_parts_fused for
    a kernel with a fused RMSNorm, which follows the kernel's order of operations). The codes
    are then bit-identical to the kernel's (same float32 max, multiply, division and roundf),
    so no code can differ; what can: (a) the block sum sy, summed in another order, and with
    a fused norm also the scale ds (the kernel's rsqrtf is ~2 ulp off the oracle's rs), can
    round to the neighbouring fp16 value, moving the row by at most F16_STEP of that block's
    share |b_b sy_b| or |w_b . xhat_b|. The unrounded values differ by a few float32
    roundings (~3e-7 relative) against fp16's 2^-11 half-spacing, so a block flips with
    probability ~1e-3: we allow 2 + ceil(2e-3 nb) flipped blocks of nb, the row's largest
    shares. Anything wrong in a block (a scale, a nibble, the offset folded with code sums, a
    wrong code) costs ~|w_b| |x_b| or the block's whole rounding error instead."""
    sy = parts[2]
    K = w.shape[1]
    xhat = actquant.q8_1_xhat(parts, K)
    nb = -(-K // 32)
    wp = np.concatenate([w * xhat, np.zeros((w.shape[0], nb * 32 - K))], axis=1).reshape(w.shape[0], nb, 32)
    flips = min(nb, 2 + int(np.ceil(2e-3 * nb)))

    def largest(shares):  # [rows, nb] -> sum of each row's `flips` largest |shares|
        return -np.sort(-np.abs(shares), axis=-1)[:, :flips].sum(axis=-1)
    a = F16_STEP * largest(wp.sum(axis=-1)) if fused else np.zeros(w.shape[0])
    if offsets is not None:
        a = a + F16_STEP * largest(offsets * sy[None, :offsets.shape[1]])
    return a


def _q8_1_ref(w, x, raw, type_id, norm=None):
    """(w . xhat + llama.cpp's legacy offset term, offsets, parts) for one matrix; norm =
    (norm weight [K], eps) when the kernel fused an RMSNorm and x is its raw input."""
    offs = actquant.q8_1_offsets(raw, type_id) if raw is not None else None
    if offs is None and type_id is not None and int(type_id) in actquant.Q8_1_OFFSET:
        raise ValueError("q8_1 check of a legacy format needs its raw blocks (offsets)")
    parts = actquant.q8_1_parts(x) if norm is None else actquant.q8_1_parts_fused(x, *norm)
    ref = w @ actquant.q8_1_xhat(parts, w.shape[1]) + actquant.q8_1_offset_term(offs, parts)
    return ref, offs, parts


def _normalised(x, norm) -> np.ndarray:
    """x itself, or the RMS-normalised x * w for norm = (w, eps) (oracles.ops.rms_norm)."""
    x = np.asarray(x, np.float64)
    if norm is None:
        return x
    return ops.rms_norm(x[None], np.asarray(norm[0], np.float64), norm[1])[0]


def row_bounds(w: np.ndarray, x) -> np.ndarray:
    """GEMV_TOL * ||w_r|| * ||x|| per row of w [rows, K] (float64 [rows]); 1e-30 floor."""
    x = np.asarray(x, np.float64)
    return GEMV_TOL * np.linalg.norm(w, axis=1) * np.linalg.norm(x) + 1e-30


def _verdict(y: np.ndarray, ref: np.ndarray, bound: np.ndarray, row_ids, what: str) -> dict:
    err = np.abs(y - ref)
    ratio = np.where(np.isfinite(err), err / bound, np.inf)
    worst = int(np.argmax(ratio))
    return {"check": what, "ok": bool((ratio <= 1).all()), "rows_checked": int(y.size),
            "nonfinite": int((~np.isfinite(y)).sum()), "max_err_over_bound": float(ratio[worst]),
            "worst_row": int(row_ids[worst]), "worst_ref": float(ref[worst]),
            "worst_got": float(y[worst])}


def _merge(*vs: dict) -> dict:
    """The failing (else the tightest) verdict, with ok = all ok and every check's ratio."""
    worst = max(vs, key=lambda v: (not v["ok"], v["max_err_over_bound"]))
    return dict(worst, ok=all(v["ok"] for v in vs),
                ratios={v["check"]: v["max_err_over_bound"] for v in vs})


def check_store(y, w: np.ndarray, x, row_ids=None, impl: str = "q16", raw=None,
                type_id: int | None = None, norm=None) -> dict:
    """y [n] (kernel output of rows row_ids) vs w [n, K] float64 (those rows, dequantised)
    and x [K]. Returns {ok, rows_checked, nonfinite, max_err_over_bound, worst_row,
    worst_ref, worst_got, check, ratios}; ok is False for any NaN/Inf in y. impl "q8_1"
    needs the rows' raw blocks [n, row_bytes] and type_id for the legacy formats (ValueError
    without them); norm = (norm weight, eps) when the kernel fused an RMSNorm: x is then
    the kernel's raw input (q8_1 only: the reference follows the kernel's order,
    actquant.q8_1_parts_fused; other impls take the normalised x)."""
    y = np.asarray(y, np.float64)
    ids = np.arange(y.size) if row_ids is None else np.asarray(row_ids)
    raw_x, x64 = x, _normalised(x, norm)
    bound = row_bounds(w, x64)
    if impl == "q8_1" and type_id is not None and int(type_id) in actquant.Q8_1_FLOAT_TYPES:
        impl = "f32"
    if impl == "q8_1":
        ref, offs, parts = _q8_1_ref(w, raw_x if norm is not None else x64, raw, type_id, norm)
        return _merge(_verdict(y, ref, bound + q8_1_allowance(w, parts, offs, norm is not None),
                               ids, "vs q8_1 (llama.cpp-rounded) oracle"))
    a = _verdict(y, w @ x_seen(x64, impl), bound, ids, "vs rounded-x oracle")
    if impl not in ("q16", "mma"):
        return _merge(a)
    qmax = actquant.Q16_MMA_MAX if impl == "mma" else 32767
    exact = bound + np.abs(w) @ actquant.q16_error_bound(x64, qmax)
    return _merge(a, _verdict(y, w @ x64, exact, ids, "vs exact oracle"))


def swiglu_bound(g: np.ndarray, u: np.ndarray, eg: np.ndarray, eu: np.ndarray) -> np.ndarray:
    """Bound on |dy| of y = silu(g) * u given bounds eg, eu on the errors of g and u (module
    docstring: first-order propagation plus the float32 epilogue). float64, shape of g."""
    return (SILU_SLOPE * np.abs(u) * eg + np.abs(ops.silu(g)) * eu + eg * eu
            + EPILOGUE_REL * np.abs(ops.swiglu(g, u)))


def check_swiglu(y, wg: np.ndarray, wu: np.ndarray, x, row_ids=None, impl: str = "q16",
                 raw=(None, None), type_ids=(None, None), norm=None) -> dict:
    """y [n] = silu(wg x) * (wu x) from the kernel vs the float64 oracle with x_seen (the
    inputs of both rows are rounded the same way); result as check_store (raw / type_ids:
    the gate's and up's, for q8_1)."""
    y = np.asarray(y, np.float64)
    ids = np.arange(y.size) if row_ids is None else np.asarray(row_ids)
    raw_x, x = x, _normalised(x, norm)
    eg, eu = row_bounds(wg, x), row_bounds(wu, x)
    if impl == "q8_1" and any(t is not None and int(t) in actquant.Q8_1_FLOAT_TYPES for t in type_ids):
        impl = "f32"
    if impl == "q8_1":
        src = raw_x if norm is not None else x
        (g, og, pg), (u, ou, pu) = (_q8_1_ref(m, src, r, t, norm) for m, r, t in zip((wg, wu), raw, type_ids))
        eg = eg + q8_1_allowance(wg, pg, og, norm is not None)
        eu = eu + q8_1_allowance(wu, pu, ou, norm is not None)
    else:
        xs = x_seen(x, impl)
        g, u = wg @ xs, wu @ xs
    return _merge(_verdict(y, ops.swiglu(g, u), swiglu_bound(g, u, eg, eu), ids,
                           "swiglu vs rounded-x oracle"))
