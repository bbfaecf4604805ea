"""Engine GEMV outputs judged against the float64 oracle: per-row error bounds, as a verdict
(used by `harness bench kernels` and the pytest benchmarks before anything is timed).

The rule is the one of tests/test_engine_kernels.py (its module docstring derives it):
- x_seen = round_q16(x) for the q16 kernels (the engine's int16 input rounding, modelled by
  oracles.actquant.round_q16), x itself for the f32 kernels (GGUF_HARNESS_GEMV=f32).
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
    """x [K] as the GEMV kernels see it (float64): rounded to int16 codes for impl "q16"."""
    return actquant.round_q16(x) if impl == "q16" else np.asarray(x, np.float64)


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


def check_store(y, w: np.ndarray, x, row_ids=None, impl: str = "q16") -> dict:
    """y [n] (kernel output of rows row_ids) vs w [n, K] float64 (those rows, dequantised)
    and x [K]. Returns {ok, rows_checked, nonfinite, max_err_over_bound, worst_row,
    worst_ref, worst_got, check, ratios}; ok is False for any NaN/Inf in y."""
    y = np.asarray(y, np.float64)
    ids = np.arange(y.size) if row_ids is None else np.asarray(row_ids)
    x64 = np.asarray(x, np.float64)
    bound = row_bounds(w, x64)
    a = _verdict(y, w @ x_seen(x64, impl), bound, ids, "vs rounded-x oracle")
    if impl != "q16":
        return _merge(a)
    exact = bound + np.abs(w) @ actquant.q16_error_bound(x64)
    return _merge(a, _verdict(y, w @ x64, exact, ids, "vs exact oracle"))


def swiglu_bound(g: np.ndarray, u: np.ndarray, eg: np.ndarray, eu: np.ndarray) -> np.ndarray:
    """Bound on |dy| of y = silu(g) * u given bounds eg, eu on the errors of g and u (module
    docstring: first-order propagation plus the float32 epilogue). float64, shape of g."""
    return (SILU_SLOPE * np.abs(u) * eg + np.abs(ops.silu(g)) * eu + eg * eu
            + EPILOGUE_REL * np.abs(ops.swiglu(g, u)))


def check_swiglu(y, wg: np.ndarray, wu: np.ndarray, x, row_ids=None, impl: str = "q16") -> dict:
    """y [n] = silu(wg x) * (wu x) from the kernel vs the float64 oracle with x_seen (the
    inputs of both rows are rounded the same way); result as check_store."""
    y = np.asarray(y, np.float64)
    ids = np.arange(y.size) if row_ids is None else np.asarray(row_ids)
    xs = x_seen(x, impl)
    g, u = wg @ xs, wu @ xs
    eg, eu = row_bounds(wg, x), row_bounds(wu, x)
    return _merge(_verdict(y, ops.swiglu(g, u), swiglu_bound(g, u, eg, eu), ids,
                           "swiglu vs rounded-x oracle"))
