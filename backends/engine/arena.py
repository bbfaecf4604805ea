"""One device allocation holding every weight tensor in its GGUF block format (no fp16/fp32
copy of quantised matrices), uploaded from the read-only mmap of the file."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harness.gguf_file import GGUFInfo, TensorInfo

ALIGN = 256  # bytes; every tensor starts at a multiple (16-byte loads need >= 16)


@dataclass(frozen=True)
class DeviceTensor:
    """A tensor inside the arena: device pointer, GGML type id, GGUF ne and bytes per row."""

    name: str
    ptr: int
    type_id: int
    ne: tuple[int, ...]
    row_bytes: int
    nbytes: int

    @property
    def rows(self) -> int:
        n = 1
        for d in self.ne[1:]:
            n *= d
        return n


class Arena:
    """Uploads the named tensors of a GGUF file. bytes_resident: size of the allocation."""

    def __init__(self, info: GGUFInfo, names: list[str], progress=None):
        import cupy as cp
        infos: list[TensorInfo] = [info.tensor(n) for n in names]
        offsets, total = [], 0
        for t in infos:
            offsets.append(total)
            total += -(-t.nbytes // ALIGN) * ALIGN
        self.buf = cp.empty(max(total, ALIGN), dtype=cp.uint8)
        self.bytes_resident = int(self.buf.nbytes)
        base = int(self.buf.data.ptr)
        self.tensors: dict[str, DeviceTensor] = {}
        for t, off in zip(infos, offsets):
            host = np.ascontiguousarray(info.tensor_data(t.name)).reshape(-1)  # [nbytes] u8
            self.buf[off:off + t.nbytes].set(host)
            self.tensors[t.name] = DeviceTensor(t.name, base + off, t.type_id, t.ne, t.row_bytes,
                                                t.nbytes)
            if progress:
                progress(t.nbytes)

    def __getitem__(self, name: str) -> DeviceTensor:
        return self.tensors[name]

    def get(self, name: str) -> DeviceTensor | None:
        return self.tensors.get(name)
