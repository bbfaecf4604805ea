"""Safe opening of untrusted GGUF files: bounded header parse, then checked tensor table.

`open_gguf(path)` parses the header itself (harness.gguf_header: every count and length is
bounded by the file size before anything is allocated), then checks each tensor against the
GGML type table of gguf-py (gguf/constants.py GGML_QUANT_SIZES) and against the file:

- the type id is known to gguf-py's GGMLQuantizationType, else UnsupportedError;
- ne[0] is a multiple of the type's block size (ggml src/gguf.cpp checks the row, which
  implies the product is a multiple too);
- nbytes = n_elements / block_size * type_size (ggml ggml_nbytes for a contiguous tensor);
- the offset inside the data section is a multiple of ALIGNMENT (docs/gguf.md) and the
  blob [data_offset + offset, + nbytes) lies inside the file and overlaps no other blob.

gguf-py's GGUFReader (gguf/gguf_reader.py) is opened lazily by `GGUFInfo.reader`, after
these checks passed: it walks the same header in Python per string (7 s for the 151,936-token
Qwen2.5 vocabulary on the CI CPU), which the harness does not need for metadata or data.
"""
from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from .errors import HarnessError, ModelError, UnsupportedError
from .gguf_header import RawHeader, RawTensorInfo, read_header

_MISSING = object()
# gguf-py 0.19.0 sizes Q8_1 as 40 B per block; ggml's block_q8_1 is 2 fp16 + 32 int8 = 36 B
# (ggml/src/ggml-common.h). ggml's size is what a file holds.
_SIZE_FIXES = {GGMLQuantizationType.Q8_1: (32, 36)}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file.

    ne: dimensions in GGUF/ggml order (ne[0] = contiguous row length); shape: the numpy
    row-major shape (reversed ne); offset: absolute byte offset in the file; nbytes: size of
    the blob; block_size/type_size: elements and bytes per block of type_name.
    """

    name: str
    type_name: str
    type_id: int
    ne: tuple[int, ...]
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    block_size: int
    type_size: int

    @property
    def ggml_type(self) -> GGMLQuantizationType:
        return GGMLQuantizationType(self.type_id)

    @property
    def n_elements(self) -> int:
        return math.prod(self.ne)

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of ne[0] elements."""
        return (self.ne[0] if self.ne else 1) // self.block_size * self.type_size

    @property
    def n_rows(self) -> int:
        return self.n_elements // (self.ne[0] if self.ne else 1)


@dataclass
class GGUFInfo:
    """An opened, checked GGUF file. Metadata values: int/float/bool/str, arrays as lists.

    metadata_types maps each key to its GGUF type name ("UINT32", "ARRAY[STRING]", ...).
    tensors keeps file order. The file is mapped read-only; nothing is copied until asked.
    """

    path: Path
    version: int
    alignment: int
    data_offset: int
    file_size: int
    metadata: dict[str, Any]
    metadata_types: dict[str, str]
    tensors: dict[str, TensorInfo]
    _mm: np.memmap = field(repr=False)

    @property
    def arch(self) -> str:
        """general.architecture (e.g. "qwen2"); ModelError if absent."""
        return self.require("general.architecture")

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        """metadata[key]; ModelError naming the key and the file if it is absent."""
        value = self.metadata.get(key, _MISSING)
        if value is _MISSING:
            raise ModelError(f"{self.path.name}: required metadata key {key!r} is missing")
        return value

    def arch_key(self, suffix: str) -> Any:
        """require(f"{arch}.{suffix}"), e.g. arch_key("block_count") -> 24."""
        return self.require(f"{self.arch}.{suffix}")

    def tensor(self, name: str) -> TensorInfo:
        """TensorInfo of name; ModelError naming the tensor if the file lacks it."""
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelError(f"{self.path.name}: tensor {name!r} is missing") from None

    def tensor_data(self, name: str) -> np.ndarray:
        """Read-only uint8 view [n_rows, row_bytes] of the tensor's raw blocks (no copy)."""
        t = self.tensor(name)
        blob = self._mm[t.offset:t.offset + t.nbytes]
        return blob.reshape(t.n_rows, t.row_bytes)

    @cached_property
    def reader(self):
        """gguf-py GGUFReader on the same file (read-only), created on first use."""
        from gguf import GGUFReader
        try:
            return GGUFReader(self.path, "r")
        except Exception as e:  # checks above passed, so this is a gguf-py limitation
            raise ModelError(f"{self.path.name}: gguf-py GGUFReader failed: {e}") from e


def _tensor_info(raw: RawTensorInfo, data_offset: int, alignment: int, where: str) -> TensorInfo:
    try:
        qtype = GGMLQuantizationType(raw.type_id)
    except ValueError:
        raise UnsupportedError(f"{where}: tensor {raw.name!r} has GGML type id {raw.type_id}, "
                               "unknown to gguf-py (gguf.GGMLQuantizationType)") from None
    block, tsize = _SIZE_FIXES.get(qtype) or GGML_QUANT_SIZES[qtype]
    row = raw.ne[0] if raw.ne else 1  # n_dims 0 is a scalar in ggml (all ne = 1)
    if row % block:
        raise ModelError(f"{where}: tensor {raw.name!r} of type {qtype.name} has rows of "
                         f"{row} elements, not a multiple of its block size {block}")
    n_el = math.prod(raw.ne)
    if raw.rel_offset % alignment:
        raise ModelError(f"{where}: tensor {raw.name!r} data offset {raw.rel_offset} is not "
                         f"a multiple of the alignment {alignment}")
    return TensorInfo(raw.name, qtype.name, raw.type_id, raw.ne, tuple(reversed(raw.ne)),
                      data_offset + raw.rel_offset, n_el // block * tsize, block, tsize)


def _check_extents(tensors: list[TensorInfo], data_offset: int, size: int, where: str) -> None:
    """Blobs lie inside the file and do not overlap; ModelError with expected vs actual size."""
    if not tensors:
        return
    end = max(t.offset + t.nbytes for t in tensors)
    if data_offset > size or end > size:
        worst = max(tensors, key=lambda t: t.offset + t.nbytes)
        raise ModelError(f"{where}: file is truncated: expected at least {end:,} bytes "
                         f"(tensor {worst.name!r} ends there), the file has {size:,} bytes")
    ordered = sorted(tensors, key=lambda t: t.offset)
    for a, b in zip(ordered, ordered[1:]):
        if a.offset + a.nbytes > b.offset:
            raise ModelError(f"{where}: tensors {a.name!r} and {b.name!r} overlap in the file")


def _check(hdr: RawHeader, size: int, where: str) -> dict[str, TensorInfo]:
    infos = [_tensor_info(r, hdr.data_offset, hdr.alignment, where) for r in hdr.tensors]
    _check_extents(infos, hdr.data_offset, size, where)
    return {t.name: t for t in infos}


def open_gguf(path: str | os.PathLike) -> GGUFInfo:
    """Open and check a GGUF file without trusting anything in it.

    Returns GGUFInfo. Raises ModelError (missing, not GGUF, truncated, malformed header,
    bad tensor extents) or UnsupportedError (GGUF version other than 2/3, big-endian,
    nested arrays, GGML type unknown to gguf-py). Never lets a numpy/struct error escape.
    """
    p = Path(path)
    where = p.name
    try:
        size = p.stat().st_size
    except OSError as e:
        raise ModelError(f"{path}: cannot open model file ({e.strerror})") from None
    if not p.is_file():
        raise ModelError(f"{path}: cannot open model file (not a regular file)")
    if size < 4:
        with open(p, "rb") as f:
            head = f.read(4)
        raise ModelError(f"{where}: not a GGUF file (magic {head!r}, expected b'GGUF'; "
                         f"the file has {size} bytes)")
    try:
        mm = np.memmap(p, dtype=np.uint8, mode="r")
        hdr = read_header(mm, size, where)
        tensors = _check(hdr, size, where)
    except HarnessError:
        raise
    except (ValueError, OverflowError, TypeError, OSError, MemoryError, struct.error) as e:
        raise ModelError(f"{where}: malformed GGUF file ({type(e).__name__}: {e})") from e
    return GGUFInfo(p, hdr.version, hdr.alignment, hdr.data_offset, size, hdr.metadata,
                    hdr.metadata_types, tensors, mm)
