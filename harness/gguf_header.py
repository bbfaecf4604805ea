"""Bounded parse of a GGUF header (metadata and tensor infos) from an untrusted file.

Layout relied on (ggml docs/gguf.md, "File Structure"; gguf-py gguf/gguf_reader.py;
ggml src/gguf.cpp gguf_init_from_reader), all little-endian:

    magic   4 bytes b"GGUF"
    version uint32  (2 or 3; 1 had 32-bit counts and is not read by ggml any more)
    n_tensors uint64, n_kv uint64
    n_kv x  { key: string, value_type: uint32, value }
    n_tensors x { name: string, n_dims: uint32, ne: uint64[n_dims], ggml_type: uint32,
                  offset: uint64 (relative to the data section, a multiple of ALIGNMENT) }
    zero padding to ALIGNMENT (metadata "general.alignment", uint32, default 32)
    data section: tensor blobs, each padded to ALIGNMENT
    string = { len: uint64, len bytes of UTF-8, no terminator }
    array  = { item_type: uint32, count: uint64, count items }

Every count and length read here is checked against the bytes left in the file before
anything is built from it, so a hostile header cannot make us allocate more than the file
holds. Nested arrays are allowed by the spec but rejected by ggml's gguf.cpp; we reject them
too. Big-endian files (version reads as 0xXXXX0000) are reported as unsupported. Keys and
tensor names must be UTF-8; string values that are not (ggml does not check them) keep their
bytes as surrogate escapes: value.encode("utf-8", "surrogateescape") gives the bytes back.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import ModelError, UnsupportedError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_TENSORS = 1_000_000
MAX_KV = 1_000_000
MAX_DIMS = 4           # GGML_MAX_DIMS (ggml/include/ggml.h)
MAX_NAME = 64          # GGML_MAX_NAME: tensor names must be shorter (ggml/include/ggml.h)
DEFAULT_ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT (docs/gguf.md)

# GGUF value type id -> (name, struct format or None for string/array, item size in bytes)
VALUE_TYPES: dict[int, tuple[str, str | None, int]] = {
    0: ("UINT8", "<B", 1), 1: ("INT8", "<b", 1), 2: ("UINT16", "<H", 2),
    3: ("INT16", "<h", 2), 4: ("UINT32", "<I", 4), 5: ("INT32", "<i", 4),
    6: ("FLOAT32", "<f", 4), 7: ("BOOL", "<b", 1), 8: ("STRING", None, 8),
    9: ("ARRAY", None, 12), 10: ("UINT64", "<Q", 8), 11: ("INT64", "<q", 8),
    12: ("FLOAT64", "<d", 8),
}
_NP_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4",
              7: "<i1", 10: "<u8", 11: "<i8", 12: "<f8"}
_MIN_KV_BYTES = 8 + 1 + 4 + 1          # key len, 1-byte key, value type, 1-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 4 + 8  # name len, 1-byte name, n_dims, type, offset


@dataclass
class RawTensorInfo:
    """One tensor info record as stored: ne in GGUF order, type id unchecked, offset relative."""

    name: str
    ne: tuple[int, ...]
    type_id: int
    rel_offset: int
    info_offset: int  # file offset of the record, for error messages


@dataclass
class RawHeader:
    """Everything before the data section. data_offset: absolute start of the tensor data."""

    version: int
    n_tensors: int
    metadata: dict[str, Any] = field(default_factory=dict)
    metadata_types: dict[str, str] = field(default_factory=dict)
    tensors: list[RawTensorInfo] = field(default_factory=list)
    alignment: int = DEFAULT_ALIGNMENT
    data_offset: int = 0


class _Cursor:
    """Reads little-endian values from a byte buffer, never past its end."""

    def __init__(self, buf, size: int, where: str) -> None:
        self.buf, self.size, self.pos, self.where = buf, size, 0, where

    def fail(self, msg: str) -> ModelError:
        return ModelError(f"{self.where}: {msg} (at byte offset {self.pos})")

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(f"truncated header: {what} needs {n} bytes, only "
                            f"{self.size - self.pos} remain in a {self.size}-byte file")

    def scalar(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def raw_string(self, what: str) -> bytes:
        n = self.scalar("<Q", f"length of {what}")
        if n > self.size - self.pos:
            raise self.fail(f"{what} claims {n} bytes, but only {self.size - self.pos} remain "
                            f"in the {self.size}-byte file (truncated or corrupt header)")
        b = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return b

    def string(self, what: str, strict: bool = True) -> str:
        """UTF-8 text; strict=False keeps invalid bytes as surrogate escapes (lossless)."""
        b = self.raw_string(what)
        try:
            return b.decode("utf-8", "strict" if strict else "surrogateescape")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not valid UTF-8 ({e.reason})") from None


def _value(cur: _Cursor, type_id: int, key: str, in_array: bool = False) -> Any:
    """One metadata value of GGUF type type_id (scalar, string or a flat array)."""
    if type_id not in VALUE_TYPES:
        raise cur.fail(f"metadata key {key!r} has unknown GGUF value type {type_id}")
    name, fmt, _ = VALUE_TYPES[type_id]
    if fmt is not None:
        v = cur.scalar(fmt, f"value of {key!r}")
        return bool(v) if name == "BOOL" else v
    if name == "STRING":
        return cur.string(f"string value of {key!r}", strict=False)
    if in_array:
        raise UnsupportedError(f"{cur.where}: metadata key {key!r} is a nested array "
                               "(ggml's gguf.cpp rejects these too)")
    return _array(cur, key)


def _array(cur: _Cursor, key: str) -> list:
    item_type = cur.scalar("<I", f"item type of array {key!r}")
    count = cur.scalar("<Q", f"length of array {key!r}")
    if item_type not in VALUE_TYPES:
        raise cur.fail(f"array {key!r} has unknown GGUF item type {item_type}")
    item_size = VALUE_TYPES[item_type][2]  # minimum encoded size of one item
    if count > (cur.size - cur.pos) // item_size:
        raise cur.fail(f"array {key!r} claims {count} items of type "
                       f"{VALUE_TYPES[item_type][0]}, more than the {cur.size - cur.pos} "
                       "bytes left in the file can hold")
    if item_type in _NP_DTYPES:  # fixed-size items: one bounded bulk read
        nbytes = count * item_size
        arr = np.frombuffer(cur.buf, dtype=_NP_DTYPES[item_type], count=count, offset=cur.pos)
        cur.pos += nbytes
        return (arr != 0).tolist() if item_type == 7 else arr.tolist()
    return [_value(cur, item_type, key, in_array=True) for _ in range(count)]


def _read_kv(cur: _Cursor, hdr: RawHeader) -> None:
    key = cur.string("metadata key")
    if not key:
        raise cur.fail("empty metadata key")
    if key in hdr.metadata:
        raise cur.fail(f"duplicate metadata key {key!r}")
    type_id = cur.scalar("<I", f"value type of {key!r}")
    start = cur.pos
    value = _value(cur, type_id, key)
    tname = VALUE_TYPES[type_id][0]
    if tname == "ARRAY":  # the item type was read (and checked) by _array at `start`
        tname = f"ARRAY[{VALUE_TYPES[struct.unpack_from('<I', cur.buf, start)[0]][0]}]"
    hdr.metadata[key] = value
    hdr.metadata_types[key] = tname


def _read_tensor_info(cur: _Cursor, names: set[str]) -> RawTensorInfo:
    at = cur.pos
    name = cur.string("tensor name")
    if not name or len(name.encode()) >= MAX_NAME:
        raise cur.fail(f"tensor name {name[:80]!r} must be 1..{MAX_NAME - 1} bytes long")
    if name in names:
        raise cur.fail(f"duplicate tensor name {name!r}")
    n_dims = cur.scalar("<I", f"n_dims of tensor {name!r}")
    if n_dims > MAX_DIMS:
        raise cur.fail(f"tensor {name!r} has {n_dims} dimensions, at most {MAX_DIMS} allowed")
    ne = tuple(cur.scalar("<Q", f"dimension {j} of tensor {name!r}") for j in range(n_dims))
    if any(d == 0 or d >= 2**63 for d in ne):
        raise cur.fail(f"tensor {name!r} has an invalid shape (ne) {ne}")
    type_id = cur.scalar("<I", f"GGML type of tensor {name!r}")
    rel = cur.scalar("<Q", f"data offset of tensor {name!r}")
    names.add(name)
    return RawTensorInfo(name, ne, type_id, rel, at)


def _alignment(cur: _Cursor, hdr: RawHeader) -> int:
    if "general.alignment" not in hdr.metadata:
        return DEFAULT_ALIGNMENT
    a = hdr.metadata["general.alignment"]
    if hdr.metadata_types["general.alignment"] != "UINT32" or a == 0 or a & (a - 1):
        raise cur.fail(f"general.alignment must be a UINT32 power of two, got "
                       f"{hdr.metadata_types['general.alignment']} {a!r}")
    return a


def read_header(buf, size: int, where: str) -> RawHeader:
    """Parse magic, counts, metadata and tensor infos from buf (bytes-like, size bytes).

    Raises ModelError (not GGUF, truncated, inconsistent counts/lengths, bad UTF-8,
    duplicate keys or tensor names) or UnsupportedError (version, big-endian, nested arrays).
    Tensor types, sizes and offsets are not checked here (see harness.gguf_file).
    """
    cur = _Cursor(buf, size, where)
    magic = bytes(buf[:4]) if size >= 4 else bytes(buf[:size])
    if magic != GGUF_MAGIC:
        raise ModelError(f"{where}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    cur.pos = 4
    version = cur.scalar("<I", "version")
    if version & 0xFFFF == 0 and version:
        raise UnsupportedError(f"{where}: big-endian GGUF files are not supported "
                               f"(version field reads {version:#x})")
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedError(f"{where}: GGUF version {version} is not supported "
                               f"(supported: {SUPPORTED_VERSIONS})")
    n_tensors = cur.scalar("<Q", "tensor count")
    n_kv = cur.scalar("<Q", "metadata count")
    left = size - cur.pos
    if n_kv > MAX_KV or n_kv * _MIN_KV_BYTES > left:
        raise cur.fail(f"metadata count {n_kv} is impossible for a {size}-byte file")
    if n_tensors > MAX_TENSORS or n_tensors * _MIN_TENSOR_INFO_BYTES > left:
        raise cur.fail(f"tensor count {n_tensors} is impossible for a {size}-byte file "
                       f"(limit {MAX_TENSORS})")
    hdr = RawHeader(version, n_tensors)
    for _ in range(n_kv):
        _read_kv(cur, hdr)
    hdr.alignment = _alignment(cur, hdr)
    names: set[str] = set()
    hdr.tensors = [_read_tensor_info(cur, names) for _ in range(n_tensors)]
    hdr.data_offset = -(-cur.pos // hdr.alignment) * hdr.alignment
    return hdr
