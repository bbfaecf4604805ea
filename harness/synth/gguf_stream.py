"""Write a GGUF file tensor by tensor and chunk by chunk, so RAM stays bounded by one chunk.

gguf-py's GGUFWriter.add_tensor keeps every array until the file is written; a 27B model
does not fit. Here GGUFWriter writes only the header, the key/value pairs and the tensor
infos (add_tensor_info needs sizes, not data: gguf/gguf_writer.py), then the data section is
written from a row generator per tensor, each tensor padded to the alignment as the GGUF
format requires (llama.cpp docs/gguf.md: offsets multiple of general.alignment, default 32).
The file is written as <path>.part and renamed at the end, so a failure leaves no partial
model under the final name.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as QT

CHUNK_BYTES = 32 << 20  # bound on one chunk's largest temporary (float64 values)
ROW_GROUP = 64          # rows() is always called with row0 a multiple of this

RowFn = Callable[[int, int], np.ndarray]        # (row0, row1) -> encoded rows
Progress = Callable[[int, int, str], None]     # (bytes done, bytes total, tensor name)


@dataclass(frozen=True)
class TensorPlan:
    """One tensor to write: name, ne (GGUF order, ne[0] contiguous), GGML type, and rows(r0, r1)
    returning rows r0..r1-1 already encoded (uint8 [n, row_bytes] or float32/16 [n, ne0])."""

    name: str
    ne: tuple[int, ...]
    qtype: QT
    rows: RowFn

    @property
    def n_rows(self) -> int:
        return math.prod(self.ne[1:])

    @property
    def row_bytes(self) -> int:
        block, tsize = GGML_QUANT_SIZES[self.qtype]
        return self.ne[0] // block * tsize

    @property
    def nbytes(self) -> int:
        return self.n_rows * self.row_bytes

    @property
    def chunk_rows(self) -> int:
        """Rows per rows() call, a multiple of ROW_GROUP and a function of the shape only (so
        the bytes written never depend on the machine)."""
        return max(ROW_GROUP, CHUNK_BYTES // (8 * self.ne[0]) // ROW_GROUP * ROW_GROUP)


def _padded(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def _write_tensor(f, plan: TensorPlan, done: int, total: int, progress: Progress | None) -> int:
    written = 0
    for r0 in range(0, plan.n_rows, plan.chunk_rows):
        r1 = min(plan.n_rows, r0 + plan.chunk_rows)
        data = np.ascontiguousarray(plan.rows(r0, r1))
        if data.nbytes != (r1 - r0) * plan.row_bytes:
            raise RuntimeError(f"tensor {plan.name!r}: rows {r0}:{r1} gave {data.nbytes} bytes, "
                               f"expected {(r1 - r0) * plan.row_bytes}")
        f.write(data.tobytes())  # tobytes: the array may be a view of a larger buffer
        written += data.nbytes
        if progress:
            progress(done + written, total, plan.name)
    return written


def write_gguf_streaming(path: str | os.PathLike, arch: str,
                         add_metadata: Callable[[GGUFWriter], None], plans: Sequence[TensorPlan],
                         progress: Progress | None = None) -> Path:
    """Write metadata (add_metadata(writer) adds the key/value pairs) and the tensors of
    `plans`, in order, to `path`; returns the Path. Peak memory: one chunk per tensor.
    """
    path = Path(path)
    part = path.with_name(path.name + ".part")
    w = GGUFWriter(part, arch)
    add_metadata(w)
    for p in plans:
        w.add_tensor_info(p.name, tuple(reversed(p.ne)), np.dtype(np.float32), p.nbytes,
                          raw_dtype=p.qtype)
    total = sum(p.nbytes for p in plans)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        f = w.fout[0]
        align = w.data_alignment
        f.write(b"\0" * (_padded(f.tell(), align) - f.tell()))  # start of the data section
        done = 0
        for p in plans:
            n = _write_tensor(f, p, done, total, progress)
            f.write(b"\0" * (_padded(n, align) - n))
            done += n
        w.close()
        os.replace(part, path)
    except BaseException:
        w.close()
        part.unlink(missing_ok=True)
        raise
    return path
