"""One device allocation holding every weight tensor in its GGUF block format (no fp16/fp32
copy of quantised matrices), uploaded from the read-only mmap of the file; optionally some
tensors (token_embd) in one page-locked host allocation mapped into the device's address
space instead (Arena(host=...))."""
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


def _layout(infos: list[TensorInfo]) -> tuple[list[int], int]:
    """(offset of every tensor, total bytes) with each tensor starting at a multiple of ALIGN."""
    offsets, total = [], 0
    for t in infos:
        offsets.append(total)
        total += -(-t.nbytes // ALIGN) * ALIGN
    return offsets, total


def mapped_host(nbytes: int):
    """(owner, device address, writable numpy uint8 view) of nbytes of page-locked host memory
    mapped into the device's address space (cudaHostAlloc with cudaHostAllocMapped): kernels
    read it through the device address, every access crossing PCIe; no copy on the device.
    The memory is freed when the owner (a cupy PinnedMemory) is dropped."""
    import ctypes

    import cupy as cp

    from harness.errors import UnsupportedError
    rt = cp.cuda.runtime
    mem = cp.cuda.PinnedMemory(nbytes, rt.hostAllocMapped)
    # the address kernels use (equal to the host address with unified addressing)
    dev = int(rt.pointerGetAttributes(int(mem.ptr)).devicePointer)
    if not dev:
        raise UnsupportedError("this device cannot map page-locked host memory "
                               "(cudaPointerGetAttributes gives no device address)")
    view = np.frombuffer((ctypes.c_ubyte * nbytes).from_address(int(mem.ptr)), dtype=np.uint8)
    return mem, dev, view


class Arena:
    """Uploads the named tensors of a GGUF file into one device allocation; the tensors named
    in `host` go instead into one page-locked host allocation mapped into the device's address
    space, which the kernels read through its device address (token_embd: one row per token
    crosses PCIe, inside the step graph). Both are copied from the read-only mmap, blocks as
    stored. bytes_resident: size of the device allocation; bytes_host: of the host one."""

    def __init__(self, info: GGUFInfo, names: list[str], progress=None, host=()):
        import cupy as cp
        host = set(host)
        if not host <= set(names):
            raise ValueError(f"host tensors {sorted(host - set(names))} are not among the arena's names")
        infos: list[TensorInfo] = [info.tensor(n) for n in names]
        dev = [t for t in infos if t.name not in host]
        on_host = [t for t in infos if t.name in host]
        dev_off, total = _layout(dev)
        host_off, total_h = _layout(on_host)
        self.buf = cp.empty(max(total, ALIGN), dtype=cp.uint8)
        self.bytes_resident = int(self.buf.nbytes)
        self.host_mem, self.bytes_host = None, 0
        self.host_names = frozenset(t.name for t in on_host)
        where: dict[str, int] = {}
        base = int(self.buf.data.ptr)
        for t, off in zip(dev, dev_off):
            src = np.ascontiguousarray(info.tensor_data(t.name)).reshape(-1)  # [nbytes] u8
            self.buf[off:off + t.nbytes].set(src)
            where[t.name] = base + off
            if progress:
                progress(t.nbytes)
        if on_host:
            self.host_mem, dev_base, view = mapped_host(total_h)
            self.bytes_host = total_h
            for t, off in zip(on_host, host_off):
                view[off:off + t.nbytes] = info.tensor_data(t.name).reshape(-1)  # mmap -> pinned
                where[t.name] = dev_base + off
                if progress:
                    progress(t.nbytes)
        self.tensors: dict[str, DeviceTensor] = {
            t.name: DeviceTensor(t.name, where[t.name], t.type_id, t.ne, t.row_bytes, t.nbytes)
            for t in infos}

    def __getitem__(self, name: str) -> DeviceTensor:
        return self.tensors[name]

    def get(self, name: str) -> DeviceTensor | None:
        return self.tensors.get(name)

    def on_host(self, name: str) -> bool:
        """True when `name` lives in the mapped host allocation."""
        return name in self.host_names

    def close(self) -> None:
        """Free both allocations (the caller has synchronised every stream that reads them)."""
        self.buf = None
        self.host_mem = None
        self.tensors = {}
