"""Helpers for GPU tests: skip cleanly without CuPy or a device; upload raw blocks."""
from __future__ import annotations

import numpy as np
import pytest


def cupy_or_skip():
    try:
        import cupy as cp
        if cp.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
        return cp
    except Exception as e:  # ImportError, no driver, ...
        pytest.skip(f"needs CuPy and an NVIDIA GPU ({type(e).__name__})")


def no_gpu_or_skip() -> None:
    """Skip a test of the no-GPU path (a clear error, exit 2) when CuPy sees a device."""
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return
    pytest.skip("a GPU is present")


def q16_or_skip(what: str = "these kernels") -> None:
    """Skip unless the engine's GEMV inputs are rounded to int16 (GGUF_HARNESS_GEMV unset or q16):
    under GGUF_HARNESS_GEMV=q8_1 (llama.cpp's int8 rounding, an A/B mode) `what` is not built, and
    the q8_1 kernels have their own tests (tests/test_engine_q8_1.py)."""
    from backends.engine import ops
    if ops.GEMV_IMPL != "q16":
        pytest.skip(f"GGUF_HARNESS_GEMV={ops.GEMV_IMPL}: {what} run on the q16 path only")


def device_tensor(cp, name: str, raw: np.ndarray, type_id: int, ne: tuple[int, ...], keep: list):
    """Upload uint8 [rows, row_bytes] blocks into a fresh 256-aligned buffer -> DeviceTensor."""
    from backends.engine.arena import DeviceTensor
    buf = cp.asarray(np.ascontiguousarray(raw).reshape(-1))
    keep.append(buf)
    return DeviceTensor(name, int(buf.data.ptr), type_id, ne, raw.shape[1] if raw.ndim == 2 else raw.size,
                        int(raw.size))


def nan_poisoned(cp, n: int):
    return cp.full(n, np.nan, dtype=cp.float32)
