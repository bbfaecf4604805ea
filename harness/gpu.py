"""Device facts measured by the harness: copy bandwidth (the roofline used for % of peak)
and device-wide memory in use. Needs CuPy and a GPU; every function raises UnsupportedError
without them."""
from __future__ import annotations

import statistics

from .errors import UnsupportedError


def require_cupy():
    """The cupy module once a CUDA device answers; UnsupportedError (naming the cause) else."""
    try:
        import cupy as cp
        cp.cuda.runtime.getDeviceCount()
        return cp
    except Exception as e:  # ImportError, no driver, no device
        raise UnsupportedError(f"needs CuPy and a GPU ({type(e).__name__}: {e})") from e


def copy_bandwidth(nbytes: int = 2 << 30, reps: int = 10) -> dict:
    """Device-to-device copy of nbytes, timed with CUDA events: GB/s counting read + write
    (docs/sources.md §4: 4.17 TB/s measured this way on the H200, 2 GiB buffers, median of 10)."""
    cp = require_cupy()
    a = cp.empty(nbytes, dtype=cp.uint8)
    b = cp.empty_like(a)
    a.fill(1)
    b[...] = a  # warm-up
    s, e = cp.cuda.Event(), cp.cuda.Event()
    gbs = []
    for _ in range(reps):
        s.record()
        b[...] = a
        e.record()
        e.synchronize()
        gbs.append(2 * nbytes / (cp.cuda.get_elapsed_time(s, e) / 1e3) / 1e9)
    del a, b
    cp.get_default_memory_pool().free_all_blocks()
    return {"gb_s": statistics.median(gbs), "min": min(gbs), "max": max(gbs), "bytes": nbytes,
            "reps": reps, "method": "cupy d2d copy, (read+write bytes)/time, CUDA events"}


def memory_used() -> int:
    """Bytes in use on the device, all processes (total - free)."""
    cp = require_cupy()
    free, total = cp.cuda.runtime.memGetInfo()
    return int(total - free)
