"""Argument checks shared by the engine's node builders (deltanet_ops.py, gated_attn_ops.py):
every buffer a kernel reads or writes is validated on the host before a node exists, so a bad
shape, dtype or alignment is a ValueError naming the argument, not a wrong result or a fault."""
from __future__ import annotations

import numpy as np

from .arena import DeviceTensor


def device_ptr(a) -> int | None:
    """Device address of a DeviceTensor or a cupy array; None for anything else (numpy arrays
    in CPU tests)."""
    if isinstance(a, DeviceTensor):
        return a.ptr
    p = getattr(getattr(a, "data", None), "ptr", None)  # cupy
    return int(p) if p is not None else None


def check_array(a, n: int, what: str, dtype=np.float32, align: int = 4) -> None:
    """a: an array (cupy, or numpy in CPU tests) of `dtype` with n elements, C-contiguous,
    its device pointer (if any) a multiple of `align` bytes. Raises ValueError otherwise."""
    dt = getattr(a, "dtype", None)
    if dt is None or np.dtype(dt) != np.dtype(dtype):
        raise ValueError(f"{what}: expected a {np.dtype(dtype)} array, got {type(a).__name__} dtype {dt}")
    if int(a.size) != n:
        raise ValueError(f"{what}: {int(a.size)} elements (shape {tuple(a.shape)}), expected {n}")
    flags = getattr(a, "flags", None)
    if flags is not None and not flags["C_CONTIGUOUS"]:
        raise ValueError(f"{what}: must be C-contiguous")
    p = device_ptr(a)
    if p is not None and p % align:
        raise ValueError(f"{what}: device pointer {p:#x} not {align}-byte aligned")
