"""Write a GGUF file tensor by tensor and chunk by chunk, so RAM stays bounded by one chunk.

gguf-py's GGUFWriter.add_tensor keeps every array until the file is written; a 27B model
does not fit. Here GGUFWriter writes only the header, the key/value pairs and the tensor
infos (add_tensor_info needs sizes, not data: gguf/gguf_writer.py), then the data section is
written from a row generator per tensor, each tensor padded to the alignment as the GGUF
format requires (llama.cpp docs/gguf.md: offsets multiple of general.alignment, default 32).
With jobs > 1 the data section is written by worker processes at precomputed offsets
(harness.synth.parallel_write); the bytes are the same. The file is written as <path>.part
and renamed at the end, so a failure leaves no partial model under the final name.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from ..errors import ConfigError

CHUNK_BYTES = 32 << 20  # bound on one chunk's largest temporary (float64 values)
ROW_GROUP = 64          # rows() is always called with row0 a multiple of this

RowFn = Callable[[int, int], np.ndarray]        # (row0, row1) -> encoded rows
Progress = Callable[[int, int, str], None]     # (bytes done, bytes total, tensor name)


@dataclass(frozen=True)
class TensorPlan:
    """One tensor to write: name, ne (GGUF order, ne[0] contiguous), GGML type, and rows(r0, r1)
    returning rows r0..r1-1 already encoded (uint8 [n, row_bytes] or float32/16 [n, ne0]).

    sequential: rows() must be called chunk after chunk from row 0 (one RNG stream consumed
    in order, e.g. qwen2), so a parallel writer keeps the whole tensor in one worker; False
    when any chunk can be made on its own (qwen35: one stream per 64-row group).
    """

    name: str
    ne: tuple[int, ...]
    qtype: QT
    rows: RowFn
    sequential: bool = False

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

    def chunks(self, r0: int = 0, r1: int | None = None) -> Iterator[tuple[int, int]]:
        """The (row0, row1) of every rows() call for rows r0..r1-1 (r0 on a chunk boundary)."""
        r1 = self.n_rows if r1 is None else r1
        for a in range(r0, r1, self.chunk_rows):
            yield a, min(r1, a + self.chunk_rows)


def encoded_chunk(plan: TensorPlan, r0: int, r1: int) -> np.ndarray:
    """plan.rows(r0, r1) as a C-contiguous array; RuntimeError if its size is not
    (r1 - r0) * row_bytes."""
    data = np.ascontiguousarray(plan.rows(r0, r1))  # the array may be a view of a larger one
    if data.nbytes != (r1 - r0) * plan.row_bytes:
        raise RuntimeError(f"tensor {plan.name!r}: rows {r0}:{r1} gave {data.nbytes} bytes, "
                           f"expected {(r1 - r0) * plan.row_bytes}")
    return data


def _padded(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def _write_tensor(f, plan: TensorPlan, done: int, total: int, progress: Progress | None) -> int:
    written = 0
    for r0, r1 in plan.chunks():
        data = encoded_chunk(plan, r0, r1)
        f.write(data.tobytes())
        written += data.nbytes
        if progress:
            progress(done + written, total, plan.name)
    return written


def data_offsets(plans: Sequence[TensorPlan], align: int) -> list[int]:
    """Byte offset of each tensor from the start of the data section: the previous offset
    plus the previous tensor padded to `align` (as GGUFWriter.write_ti_data_to_file)."""
    offsets, off = [], 0
    for p in plans:
        offsets.append(off)
        off += _padded(p.nbytes, align)
    return offsets


def write_gguf_streaming(path: str | os.PathLike, arch: str,
                         add_metadata: Callable[[GGUFWriter], None], plans: Sequence[TensorPlan],
                         progress: Progress | None = None, jobs: int = 1) -> Path:
    """Write metadata (add_metadata(writer) adds the key/value pairs) and the tensors of
    `plans`, in order, to `path`; returns the Path. jobs: worker processes for the data
    section (1 = this process; >1 needs picklable row functions, ConfigError otherwise).
    Peak memory: one chunk per process (see harness.synth.parallel_write for jobs > 1).
    """
    from . import parallel_write as pw
    if jobs < 1:
        raise ConfigError(f"jobs must be >= 1, got {jobs}")
    blob = pw.plans_blob(plans) if jobs > 1 else b""
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
        if jobs > 1:
            start = f.tell()
            offsets = [start + o for o in data_offsets(plans, align)]
            f.flush()
            os.ftruncate(f.fileno(), start + sum(_padded(p.nbytes, align) for p in plans))
            pw.write_data(part, blob, plans, offsets, jobs, progress)
        else:
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
