"""Kernel launches with programmatic dependent launch (PDL) through the CUDA driver API.

Why (docs/perf-notes.md, engine v5): a decode step is ~125-145 dependent kernels and each pays
~1 us of graph-node latency plus its own prologue (first weight loads, x staging) before it
does useful work. With PDL the next kernel is launched while the current one still runs: its
blocks issue what does not depend on the current kernel (L2 prefetch of their weight rows,
KV-cache lines of earlier positions, kernel parameters) and then block in
`griddepcontrol.wait` until the previous grid has completed and its writes are visible.

CuPy's RawKernel has no launch attributes, so this module calls cuLaunchKernelEx
(CUDA driver API, CUDA >= 12.0) through ctypes with
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 1. A launch captured into a CUDA
graph becomes a programmatic edge. Semantics: CUDA C++ Programming Guide, "Programmatic
Dependent Launch and Synchronization"; PTX ISA, `griddepcontrol`.

Contract for every kernel launched this way (kernels/common.cuh pdl_wait / pdl_trigger):
before its first read of memory written by an earlier kernel of the same step, and before
any global write, it executes `griddepcontrol.wait`. Reads of constants (weights, biases,
kernel parameters) and of memory written by an earlier graph launch (the KV rows of earlier
positions, the step state) may come before it. Launched without the attribute, the wait is a
no-op, so the same kernels run unchanged in eager mode and on older GPUs.
"""
from __future__ import annotations

import ctypes
import os
from functools import lru_cache

import numpy as np

# CUlaunchAttributeID (cuda.h): CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute (cuda.h): id, 4 bytes of padding, a 64-byte value union whose first
    int is programmaticStreamSerializationAllowed. The union is spelled as int fields on
    purpose: a c_char array field reads back as a *copy* (bytes), so writing through it
    would scribble over an immutable Python bytes object instead of the struct."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_uint32), ("value", ctypes.c_int),
                ("value_rest", ctypes.c_uint32 * 15)]


def pdl_attribute() -> LaunchAttribute:
    """The launch attribute that allows programmatic stream serialization."""
    return LaunchAttribute(id=ATTR_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (cuda.h)."""

    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


def pack_params(args: tuple) -> tuple[list, object]:
    """Kernel arguments as cuLaunchKernelEx wants them: (buffers, void*[n]) where entry i
    points at argument i's bytes. cupy arrays pass their device pointer (8 bytes), numpy
    scalars (including structured scalars such as ops.TABLE_DT) their raw bytes, in the
    layout CuPy's own launcher uses. Raises TypeError for any other argument type."""
    bufs = []
    for a in args:
        if hasattr(a, "data") and hasattr(a.data, "ptr"):          # cupy.ndarray
            raw = np.uint64(a.data.ptr).tobytes()
        elif isinstance(a, np.generic):
            raw = a.tobytes()
        else:
            raise TypeError(f"kernel argument of type {type(a).__name__}: expected a cupy array "
                            f"or a numpy scalar")
        bufs.append(ctypes.create_string_buffer(raw, max(len(raw), 8)))
    ptrs = (ctypes.c_void_p * max(1, len(bufs)))(*[ctypes.addressof(b) for b in bufs])
    return bufs, ptrs


@lru_cache(maxsize=None)
def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuLaunchKernelEx
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return fn


@lru_cache(maxsize=None)
def _occupancy_clusters():
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuOccupancyMaxActiveClusters
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.POINTER(LaunchConfig)]
    return fn


def max_active_clusters(kernel, cluster: int, threads: int, smem: int) -> int:
    """Clusters of `cluster` blocks of `kernel` (a cupy RawKernel compiled with
    __cluster_dims__(cluster, 1, 1)) that can be resident on the device at once, at `threads`
    threads and `smem` bytes of dynamic shared memory per block (cuOccupancyMaxActiveClusters,
    CUDA driver API >= 12.0: blocks of a cluster share one GPC, so this can be less than the
    blocks per SM x SMs / cluster). Raises RuntimeError when the driver call fails."""
    cfg = LaunchConfig(cluster, 1, 1, threads, 1, 1, smem, None, None, 0)
    n = ctypes.c_int(0)
    rc = _occupancy_clusters()(ctypes.byref(n), kernel.kernel.ptr, ctypes.byref(cfg))
    if rc != 0:
        raise RuntimeError(f"cuOccupancyMaxActiveClusters failed with CUresult {rc}")
    return int(n.value)


# "on" (default where the hardware allows) or "off" (CuPy's plain launches, for same-run A/B)
MODE = os.environ.get("GGUF_HARNESS_PDL", "on")


def pdl_available() -> bool:
    """True when PDL launches are on: MODE (GGUF_HARNESS_PDL) is not "off" and the hardware
    allows it (_hw_ok)."""
    if MODE not in ("on", "off"):
        raise ValueError(f"GGUF_HARNESS_PDL={MODE!r}: expected on or off")
    return MODE == "on" and _hw_ok()


@lru_cache(maxsize=None)
def _hw_ok() -> bool:
    """The device is sm_90 or newer (griddepcontrol is a Hopper instruction) and the driver
    has cuLaunchKernelEx."""
    try:
        import cupy as cp
        if int(cp.cuda.Device().compute_capability) < 90:
            return False
        _driver()
    except Exception:  # no CuPy, no device, no libcuda or an old driver: plain launches
        return False
    return True


class PdlLaunch:
    """A prepared launch of one kernel with fixed arguments (a graph node's launch)."""

    def __init__(self, kernel, grid: tuple, block: tuple, args: tuple, smem: int):
        g = tuple(grid) + (1,) * (3 - len(grid))
        b = tuple(block) + (1,) * (3 - len(block))
        self.func = kernel.kernel.ptr  # CUfunction of the cupy RawKernel
        self._bufs, self._ptrs = pack_params(args)
        self._attr = pdl_attribute()
        self._cfg = LaunchConfig(g[0], g[1], g[2], b[0], b[1], b[2], smem, None,
                                 ctypes.pointer(self._attr), 1)

    def __call__(self, stream_ptr: int) -> None:
        self._cfg.hStream = stream_ptr
        rc = _driver()(ctypes.byref(self._cfg), self.func, self._ptrs, None)
        if rc != 0:
            raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {rc}")
