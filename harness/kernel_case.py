"""One benchmarked GEMV shape on the GPU (`harness bench kernels`, benchmarks/): random valid
blocks, R device copies of them, one engine GEMV node per copy, the float64 oracle check,
and stream-read roofline nodes over the same bytes. GPU only.

Blocks: oracles.blocks.random_blocks (random bytes, finite fp16 scales), seeded; x: float32
N(0, 1) [K]. Device layout, one buffer: R slots of `stride` bytes, slot i = copy i = the
node's matrices back to back (gate, then up for a pair), each 256-byte aligned
(arena.ALIGN), then a tail of zeros so a roofline read of the node's total bytes from any
slot stays inside the buffer. Copies 1..R-1 are device copies of copy 0: timing needs
distinct addresses (no launch finds its weights in L2), and equal bytes make the oracle
check of copy 0 hold for all. All nodes share x and the NaN-poisoned output.
"""
from __future__ import annotations

import numpy as np

from oracles.blocks import random_blocks
from oracles.dequant import dequantize, get_format
from oracles.gemv_check import check_store, check_swiglu

from .gpu import require_cupy
from .kernel_shapes import CHECK_VALUES, Shape, check_rows
from .roofline import pad16, read_node, xor_words

ALIGN = 256  # backends/engine/arena.ALIGN (16-byte loads need >= 16)


def _up(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


def case_data(shape: Shape, seed: int = 0) -> tuple[list[np.ndarray], np.ndarray]:
    """(host, x) of a case, CPU only: host = one uint8 [rows, row_bytes] block array per
    matrix (gate, then up), x = float32 [K]; the same seed gives the same data (GemvCase and
    harness.ggml_gemv.GgmlGemv both draw theirs here)."""
    rng = np.random.default_rng(seed)
    n_blocks = shape.rows * shape.K // get_format(shape.type_id).block_size
    host = [random_blocks(shape.type_id, n_blocks, rng).reshape(shape.rows, -1)
            for _ in range(shape.n_mats)]
    return host, rng.normal(size=shape.K).astype(np.float32)


class GemvCase:
    """shape: kernel_shapes.Shape; copies: R >= 1. Raises UnsupportedError (no GPU, or a
    type the engine has no kernel for) or ValueError (ops.gemv on a shape it refuses)."""

    def __init__(self, shape: Shape, copies: int, seed: int = 0, stream=None):
        cp = require_cupy()
        from backends.engine import ops
        self.cp, self.ops, self.shape, self.copies = cp, ops, shape, copies
        self.stream = stream or cp.cuda.Stream(non_blocking=True)
        self.host, self.x = case_data(shape, seed)
        self.mat_stride = _up(shape.matrix_bytes)
        self.stride = shape.n_mats * self.mat_stride
        self.roof_bytes = pad16(shape.bytes()["total"])
        self.buf = cp.zeros(copies * self.stride + _up(self.roof_bytes), dtype=cp.uint8)
        self._upload()
        self.xd = cp.asarray(self.x)
        self.out = cp.full(shape.rows, np.nan, dtype=cp.float32)
        self.roof_out = cp.zeros(1, dtype=cp.uint32)
        self.nodes = [self._node(i) for i in range(copies)]
        self.roof = [read_node(f"{shape.name}.read#{i}", self._ptr(i), self.roof_bytes,
                               self.roof_out) for i in range(copies)]
        cp.cuda.Device().synchronize()  # fills above ran on the legacy stream

    def _ptr(self, copy: int, mat: int = 0) -> int:
        return int(self.buf.data.ptr) + copy * self.stride + mat * self.mat_stride

    def _upload(self) -> None:
        """Copy 0 from the host, then doubling device copies into slots 1..R-1."""
        for j, h in enumerate(self.host):
            o = j * self.mat_stride
            self.buf[o:o + h.size].set(h.reshape(-1))
        done = 1
        while done < self.copies:
            n = min(done, self.copies - done) * self.stride
            self.buf[done * self.stride:done * self.stride + n] = self.buf[:n]
            done *= 2
        self.cp.cuda.Device().synchronize()

    def _node(self, i: int):
        from backends.engine.arena import DeviceTensor
        s = self.shape
        segs = [self.ops.Seg(DeviceTensor(f"{s.name}#{i}.{j}", self._ptr(i, j), s.type_id,
                                          (s.K, s.rows), s.row_bytes, s.matrix_bytes), self.out)
                for j in range(s.n_mats)]
        return self.ops.gemv(f"{s.name}#{i}", s.mode, segs, self.xd, s.K)

    def output(self, rows: list[int]) -> np.ndarray:
        """The shared output (float32 [rows]) after the stream's work, at `rows`."""
        self.stream.synchronize()
        return self.out.get()[rows]

    def check(self, rng: np.random.Generator, max_values: int = CHECK_VALUES) -> dict:
        """One launch of copy 0 into a NaN-poisoned output vs the float64 oracle on
        kernel_shapes.check_rows (all rows unless rows * K > max_values). Returns the
        oracles.gemv_check verdict + {"rows_total", "unwritten" (NaN left anywhere),
        "subset" (bool)}; keeps the checked outputs for same_as_checked()."""
        s = self.shape
        with self.stream:
            self.out.fill(np.nan)
            self.nodes[0].launch()
        self.stream.synchronize()
        full = self.out.get()
        self._rows = check_rows(s.rows, s.K, rng, max_values)
        self._y = full[self._rows]
        w = [dequantize(h[self._rows].reshape(-1), s.type_id, (len(self._rows), s.K))
             .astype(np.float64) for h in self.host]
        impl = self.ops.GEMV_IMPL
        if impl == "q16" and self.nodes[0].kernel.name.startswith(("gemvmma_", "gemvtcr_")):
            impl = "mma"  # engine v11 / v12 round x to codes of at most 32639 (kernels/gemv_mma.cu)
        raw = [h[self._rows] for h in self.host]  # the q8_1 check needs legacy offsets
        v = (check_swiglu(self._y, w[0], w[1], self.x, self._rows, impl, raw=tuple(raw),
                          type_ids=(s.type_id, s.type_id)) if s.n_mats == 2
             else check_store(self._y, w[0], self.x, self._rows, impl, raw=raw[0], type_id=s.type_id))
        unwritten = int(np.isnan(full).sum())
        return dict(v, ok=v["ok"] and unwritten == 0, rows_total=s.rows, unwritten=unwritten,
                    subset=len(self._rows) < s.rows)

    def same_as_checked(self) -> bool:
        """The output now (after timed launches) equals the checked one bit for bit."""
        return bool(np.array_equal(self.output(self._rows), self._y, equal_nan=True))

    def check_roofline(self) -> bool:
        """One stream read of copy 0's region; its XOR equals numpy's over the same bytes."""
        with self.stream:
            self.roof_out.fill(0)
            self.roof[0].launch(pdl_ok=False)
        self.stream.synchronize()
        got = int(self.roof_out.get()[0])
        return got == xor_words(self.buf[:self.roof_bytes].get())

    def close(self) -> None:
        self.stream.synchronize()
        self.nodes = self.roof = []
        self.buf = self.out = self.xd = self.roof_out = None
        self.host = []
        self.cp.get_default_memory_pool().free_all_blocks()
