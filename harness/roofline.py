"""Size-aware roofline of `harness bench kernels`: a plain streaming read over as many bytes as
a GEMV node moves (backends/engine/kernels/stream_read.cu), timed in the same mode in the same
run, so "% of roofline" = roofline time / kernel time compares a kernel with what a pure
read of its size reaches (launch latency, ramp-up and a partial last wave included), where
"% of copy bandwidth" compares it with one large copy. GPU only, except xor_words / pad16.
"""
from __future__ import annotations

import numpy as np

THREADS = 512  # stream_read's __launch_bounds__


def pad16(nbytes: int) -> int:
    """nbytes rounded up to a whole number of the kernel's 16-byte loads."""
    return -(-nbytes // 16) * 16


def xor_words(raw: np.ndarray) -> int:
    """XOR of every little-endian uint32 word of raw (uint8, size a multiple of 4): what
    stream_read folds into out[0] for the same bytes. ValueError on a ragged size."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    if raw.size % 4:
        raise ValueError(f"{raw.size} bytes are not whole 32-bit words")
    return int(np.bitwise_xor.reduce(raw.view("<u4"))) if raw.size else 0


def read_node(name: str, ptr: int, nbytes: int, out):
    """executor.Node reading nbytes at device address ptr (both multiples of 16; ValueError
    otherwise), one wave of THREADS-thread blocks; out: cupy uint32 [1] the XOR goes into.
    bytes = nbytes (the GB/s numerator). Launch it with launch(pdl_ok=False): plain order."""
    if nbytes % 16 or ptr % 16 or nbytes < 16:
        raise ValueError(f"stream read of {nbytes} bytes at {ptr:#x}: need 16-byte multiples")
    from backends.engine import module
    from backends.engine.executor import Node
    k = module.kernel_in("stream_read.cu", "stream_read")
    grid = module.blocks_per_sm(k, THREADS, 0) * module.sm_count()
    return Node(name, "roofline", k, (grid,), (THREADS,),
                (np.uint64(ptr), np.uint64(nbytes // 16), out), bytes=nbytes)
