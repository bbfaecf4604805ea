"""ctypes bindings to ggml's own per-type conversion (the reference the oracle is checked against).

ggml exports ``ggml_get_type_traits(enum ggml_type)`` from libggml-base, which llama-cpp-python
ships in ``llama_cpp/lib/``. The struct layout below follows ``struct ggml_type_traits`` in
llama.cpp ``ggml/include/ggml.h`` (the version vendored by llama-cpp-python 0.3.36):

    const char *type_name; int64_t blck_size; int64_t blck_size_interleave; size_t type_size;
    bool is_quantized; ggml_to_float_t to_float; ggml_from_float_t from_float_ref;

``to_float`` has the signature ``void (const void *x, float *y, int64_t k)`` with k the number of
values (a multiple of blck_size). ggml_get_type_traits only asserts its bound in debug builds, so
type ids are bounded here (0 <= id < GGML_TYPE_COUNT) before any call.
"""

from __future__ import annotations

import ctypes
import os
import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from harness.errors import ModelError, UnsupportedError

# GGML_TYPE_COUNT in ggml/include/ggml.h of the llama.cpp vendored by llama-cpp-python 0.3.36.
GGML_TYPE_COUNT = 43

# gguf-py 0.19.0 sizes Q8_1 as 4 + 4 + 32 bytes (two float32), but ggml's block_q8_1 holds
# two ggml_half then 32 int8 (ggml/src/ggml-common.h) = 36 bytes. Q8_1 is ggml's internal
# activation format (no to_float), never a stored weight type.
KNOWN_SIZE_DIFFERENCES = {9: "Q8_1: gguf-py 40 B per block, ggml 36 B"}

_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


class GgmlUnavailable(UnsupportedError):
    """libggml-base from llama-cpp-python cannot be found or loaded, or its layout is unexpected."""


class _TypeTraits(ctypes.Structure):
    # Mirrors struct ggml_type_traits (ggml.h); natural C alignment, 56 bytes on LP64.
    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
        ("from_float_ref", ctypes.c_void_p),
    ]


@dataclass(frozen=True)
class GgmlTypeInfo:
    """One row of ggml's type-traits table (sizes in values per block and bytes per block)."""

    type_id: int
    name: str  # ggml's spelling, e.g. "q4_K"; "DEPRECATED" for removed ids
    blck_size: int
    blck_size_interleave: int
    type_size: int
    is_quantized: bool
    has_to_float: bool
    has_from_float_ref: bool


def find_libggml_base() -> Path:
    """Path of libggml-base.so: in $LLAMA_CPP_LIB_PATH when set (llama-cpp-python's own
    override, used where the libraries are built separately, e.g. a CUDA build), else next
    to the installed llama_cpp package (not imported).

    Raises GgmlUnavailable when llama_cpp is not installed or ships no libggml-base.
    """
    env = os.environ.get("LLAMA_CPP_LIB_PATH")
    if env and sorted(Path(env).glob("libggml-base.so*")):
        return sorted(Path(env).glob("libggml-base.so*"))[0]
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise GgmlUnavailable("llama-cpp-python is not installed: no libggml-base to check against")
    lib_dir = Path(list(spec.submodule_search_locations)[0]) / "lib"
    candidates = sorted(lib_dir.glob("libggml-base.so*")) + sorted(lib_dir.glob("libggml-base.dylib"))
    if not candidates:
        raise GgmlUnavailable(f"no libggml-base shared library in {lib_dir}")
    return candidates[0]


@functools.cache
def libggml_base() -> ctypes.CDLL:
    """The loaded libggml-base (once per process); GgmlUnavailable if absent or unloadable.
    Callers set the prototypes of the functions they use."""
    path = find_libggml_base()
    try:
        return ctypes.CDLL(str(path))
    except OSError as exc:
        raise GgmlUnavailable(f"cannot load {path}: {exc}") from exc


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = libggml_base()
    lib.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
    return lib


@functools.cache
def _table() -> tuple[tuple[GgmlTypeInfo, int], ...]:
    # [(info, to_float address)] for every id, built once, then checked against gguf-py.
    rows = []
    for type_id in range(GGML_TYPE_COUNT):
        t = _lib().ggml_get_type_traits(type_id).contents
        info = GgmlTypeInfo(
            type_id=type_id,
            name=(t.type_name or b"").decode("ascii", "replace"),
            blck_size=int(t.blck_size),
            blck_size_interleave=int(t.blck_size_interleave),
            type_size=int(t.type_size),
            is_quantized=bool(t.is_quantized),
            has_to_float=bool(t.to_float),
            has_from_float_ref=bool(t.from_float_ref),
        )
        rows.append((info, int(t.to_float or 0)))
    table = tuple(rows)
    bad = [m for m in _mismatches(table) if m.type_id not in KNOWN_SIZE_DIFFERENCES]
    if bad:
        raise GgmlUnavailable(f"libggml type table disagrees with gguf-py (ctypes layout or version?): {bad}")
    return table


@dataclass(frozen=True)
class SizeMismatch:
    """A type whose ggml traits differ from gguf.GGML_QUANT_SIZES (or whose name differs)."""

    type_id: int
    gguf_name: str
    gguf_sizes: tuple[int, int]  # (values per block, bytes per block)
    ggml_name: str
    ggml_sizes: tuple[int, int]


def _mismatches(table) -> list[SizeMismatch]:
    out = []
    for qtype, sizes in sorted(gguf.GGML_QUANT_SIZES.items()):
        if int(qtype) >= GGML_TYPE_COUNT:
            out.append(SizeMismatch(int(qtype), qtype.name, tuple(sizes), "(absent)", (0, 0)))
            continue
        info = table[int(qtype)][0]
        got = (info.blck_size, info.type_size)
        if got != tuple(sizes) or info.name.upper() != qtype.name:
            out.append(SizeMismatch(int(qtype), qtype.name, tuple(sizes), info.name, got))
    return out


def size_mismatches() -> list[SizeMismatch]:
    """Every gguf type whose (block size, type size, name) differs in libggml, known ones included.

    Self-check of the ctypes struct layout: with a wrong layout every row would differ.
    Raises GgmlUnavailable when the library cannot be loaded.
    """
    return _mismatches(_table())


def _entry(ggml_type: int) -> tuple[GgmlTypeInfo, int]:
    type_id = int(ggml_type)
    if not 0 <= type_id < GGML_TYPE_COUNT:
        raise UnsupportedError(f"GGML type id {type_id} is outside ggml's table (0..{GGML_TYPE_COUNT - 1})")
    return _table()[type_id]


def ggml_type_info(ggml_type: int) -> GgmlTypeInfo:
    """ggml's traits for one type id (int or gguf.GGMLQuantizationType).

    Raises GgmlUnavailable (library missing or failing its self-check) or UnsupportedError
    (id outside the table).
    """
    return _entry(ggml_type)[0]


def ggml_to_float_types() -> tuple[int, ...]:
    """Type ids whose ggml traits have a to_float conversion."""
    return tuple(info.type_id for info, ptr in _table() if ptr)


def ggml_to_float(raw: np.ndarray, ggml_type: int, n_values: int) -> np.ndarray:
    """Convert ``n_values`` values stored in ggml blocks to float32 with ggml's own to_float.

    raw: uint8 [n_values / blck_size * type_size] (any shape, C-contiguous after copy).
    Returns float32 [n_values]. Source: ggml type_traits[].to_float (ggml/src/ggml.c,
    dequantize_row_* in ggml/src/ggml-quants.c).
    Raises UnsupportedError (no to_float), ModelError (n_values not whole blocks, wrong length).
    """
    info, to_float = _entry(ggml_type)
    name = info.name
    if not to_float:
        raise UnsupportedError(f"GGML type {name} ({info.type_id}) has no to_float in libggml")
    n_values = int(n_values)
    if n_values < 0 or n_values % info.blck_size:
        raise ModelError(f"{name}: {n_values} values is not a whole number of {info.blck_size}-value blocks")
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8:
        raise ModelError(f"{name}: raw data must be a uint8 numpy array, got {type(raw).__name__}")
    raw = np.ascontiguousarray(raw).reshape(-1)
    expected = n_values // info.blck_size * info.type_size
    if raw.size != expected:
        raise ModelError(f"{name}: {n_values} values need {expected} bytes, got {raw.size}")
    out = np.empty(n_values, dtype=np.float32)
    if n_values:
        _TO_FLOAT(to_float)(raw.ctypes.data, out.ctypes.data, n_values)
    return out
