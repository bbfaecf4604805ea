"""CUDA-event timing of GPU work behind a stream hold, an L2 flush, graph capture, and
`gpu_clock`: a clock of accumulated GPU seconds for pytest-benchmark (benchmarks/README.md).
GPU only (UnsupportedError from harness.gpu.require_cupy without CuPy and a device).

EventTimer.time(work, before) runs on its stream:
    before()                # untimed (e.g. the L2 flush), stream order
    hold_stream(flag)       # backends/engine/kernels/misc.cu: spins while flag == 0
    e0.record; work(); e1.record
then sets the flag from another stream, waits for e1 and returns elapsed(e0, e1) in seconds.
All of work()'s launches are queued behind the spinning kernel before it starts, so the
event pair times GPU work only, not the host's launch calls (~5 us each for CuPy, a few us
for a graph launch); executor.Executor.time_nodes holds the stream the same way.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from .gpu import require_cupy

_GPU_SECONDS = [0.0]  # accumulated by add_gpu_time, read by gpu_clock


def gpu_clock() -> float:
    """Seconds of GPU time added by add_gpu_time so far (monotonic, starts at 0). As
    pytest-benchmark's timer, start/end readings around a target that calls add_gpu_time
    once give exactly the GPU time that target measured."""
    return _GPU_SECONDS[0]


def add_gpu_time(seconds: float) -> None:
    """Advance gpu_clock by `seconds` (>= 0; ValueError otherwise)."""
    if not seconds >= 0:
        raise ValueError(f"GPU time must be >= 0 s, got {seconds}")
    _GPU_SECONDS[0] += seconds


def l2_bytes() -> int:
    """L2 cache size of the current device in bytes (cudaDevAttrL2CacheSize)."""
    cp = require_cupy()
    return int(cp.cuda.Device().attributes["L2CacheSize"])


class EventTimer:
    """Times work on `stream` (a cupy Stream) with a CUDA event pair behind a stream hold."""

    def __init__(self, stream):
        cp = require_cupy()
        from backends.engine.module import kernel
        self.cp, self.stream = cp, stream
        self.flag = cp.zeros(1, cp.int32)
        self.e0, self.e1 = cp.cuda.Event(), cp.cuda.Event()
        self.other = cp.cuda.Stream(non_blocking=True)
        self._hold = kernel("hold_stream")
        self._zero, self._one = np.zeros(1, np.int32), np.ones(1, np.int32)
        cp.cuda.Device().synchronize()  # the flag's memset ran on the legacy stream

    def time(self, work: Callable[[], None], before: Callable[[], None] | None = None) -> float:
        """Seconds of GPU time between the events around work() (see the module docstring)."""
        self.stream.synchronize()                       # the last sample's work is done
        self.flag.set(self._zero, stream=self.other)    # armed before the hold is queued
        self.other.synchronize()
        try:
            with self.stream:
                if before is not None:
                    before()
                self._hold((1,), (1,), (self.flag,))
                self.e0.record(self.stream)
                work()
                self.e1.record(self.stream)
        finally:  # release even when a launch raised: the stream must not stay held
            self.flag.set(self._one, stream=self.other)  # the queued work starts now
        self.e1.synchronize()
        return self.cp.cuda.get_elapsed_time(self.e0, self.e1) / 1e3


class L2Flush:
    """Callable writing a scratch buffer of 2 x the L2 size (at least 1 MiB) with a new byte
    value each call, on the current stream: evicts what an earlier launch left in L2."""

    def __init__(self, nbytes: int | None = None):
        cp = require_cupy()
        self.nbytes = max(nbytes or 2 * l2_bytes(), 1 << 20)
        self.buf = cp.empty(self.nbytes, dtype=cp.uint8)
        self._v = 0

    def __call__(self) -> None:
        self._v = (self._v + 1) % 251
        self.buf.fill(self._v)


def capture(stream, launches: list[Callable[[], None]]):
    """A CUDA graph (cupy Graph) of the launches, captured in order on `stream`."""
    with stream:
        stream.begin_capture()
        try:
            for f in launches:
                f()
        finally:
            graph = stream.end_capture()
    return graph
