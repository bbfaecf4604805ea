"""Oracle dequantisation: GGUF block formats -> float32 values, through gguf-py 0.19.0.

The format registry is keyed by GGML type id (gguf.GGMLQuantizationType). Sizes come from
gguf.GGML_QUANT_SIZES (values per block, bytes per block); the set of types that can be
dequantised is read from gguf-py itself (F32 and F16 are special-cased inside
``gguf.quants.dequantize``; every other type registers a class in ``gguf.quants._type_traits``).

Values are returned as float32 because ggml's ``to_float`` produces float32 exactly and gguf-py
matches it bit for bit (checked by tests/test_dequant.py against libggml); oracle arithmetic
upcasts to float64 afterwards. Block layouts: ggml/src/ggml-common.h; conversion formulas:
dequantize_row_* in ggml/src/ggml-quants.c and the classes in gguf-py/gguf/quants.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import gguf
import gguf.quants
import numpy as np

from harness.errors import ModelError, UnsupportedError

QType = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class QuantFormat:
    """One GGUF storage format: ``block_size`` values are stored in ``type_size`` bytes."""

    type_id: int
    name: str  # GGML spelling, e.g. "Q4_K"
    block_size: int
    type_size: int

    def n_bytes(self, n_values: int) -> int:
        """Bytes holding ``n_values`` values (must be whole blocks)."""
        return n_values // self.block_size * self.type_size


def _gguf_dequant_types() -> frozenset[QType]:
    # gguf.quants.dequantize handles F32/F16 inline and the registered classes otherwise.
    registry: dict[QType, Any] = getattr(gguf.quants, "_type_traits")
    return frozenset(registry) | {QType.F32, QType.F16}


def _build_registry() -> dict[int, QuantFormat]:
    fmts = {}
    for qtype in sorted(_gguf_dequant_types()):
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        fmts[int(qtype)] = QuantFormat(int(qtype), qtype.name, block_size, type_size)
    return fmts


FORMATS: dict[int, QuantFormat] = _build_registry()


def supported_types() -> tuple[QType, ...]:
    """GGML types gguf-py 0.19.0 can dequantise, in type-id order (queried from gguf.quants)."""
    return tuple(QType(t) for t in FORMATS)


def get_format(ggml_type: int | QType) -> QuantFormat:
    """Registry entry for a type id. Raises UnsupportedError naming the type when unknown."""
    type_id = int(ggml_type)
    fmt = FORMATS.get(type_id)
    if fmt is not None:
        return fmt
    try:
        name = QType(type_id).name
    except ValueError:
        raise UnsupportedError(f"GGML type id {type_id} is unknown to gguf-py {_gguf_version()}") from None
    raise UnsupportedError(f"GGML type {name} ({type_id}) cannot be dequantised by gguf-py {_gguf_version()}")


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:  # pragma: no cover - gguf imported from a source tree
        return "(unknown version)"


def _check_shape(fmt: QuantFormat, shape: Sequence[int], what: str) -> tuple[int, ...]:
    shape = tuple(int(d) for d in shape)
    if not shape or any(d < 0 for d in shape):
        raise ModelError(f"{what}: invalid shape {shape} for {fmt.name}")
    if shape[-1] % fmt.block_size:
        raise ModelError(
            f"{what}: row length {shape[-1]} is not a multiple of the {fmt.name} block size {fmt.block_size}"
        )
    return shape


def dequantize(raw: np.ndarray, ggml_type: int | QType, shape: Sequence[int], what: str = "tensor") -> np.ndarray:
    """Dequantise GGUF blocks to float32 values of numpy shape ``shape`` (row-major).

    raw: uint8, exactly prod(shape) / block_size * type_size bytes (any array shape).
    shape: numpy order, last axis contiguous (= GGUF ne[0]); it must be whole blocks.
    what: a name for error messages (e.g. the tensor name).
    Returns float32 ``shape``. Source: gguf.quants.dequantize (gguf-py 0.19.0).
    Raises UnsupportedError (type not dequantisable), ModelError (shape or byte length wrong).
    """
    fmt = get_format(ggml_type)
    shape = _check_shape(fmt, shape, what)
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8:
        raise ModelError(f"{what}: raw {fmt.name} data must be a uint8 numpy array, got {type(raw).__name__}")
    n_values = math.prod(shape)  # Python int: no overflow before the length check
    expected = fmt.n_bytes(n_values)
    if raw.size != expected:
        raise ModelError(
            f"{what}: {fmt.name} shape {shape} needs {n_values // fmt.block_size} blocks x "
            f"{fmt.type_size} B = {expected} bytes, got {raw.size}"
        )
    if n_values == 0:
        return np.zeros(shape, dtype=np.float32)
    row_bytes = fmt.n_bytes(shape[-1])
    rows = np.ascontiguousarray(raw).reshape(-1, row_bytes)  # [n_rows, row_bytes] uint8
    # NaN/inf from non-finite scales are data here (ggml produces them too), not warnings.
    with np.errstate(invalid="ignore", over="ignore"):
        values = gguf.quants.dequantize(rows, QType(fmt.type_id))
    if fmt.type_id == QType.F32:
        values = values.copy()  # gguf-py returns a view of raw for F32; never alias the input
    return np.asarray(values, dtype=np.float32).reshape(shape)


def dequantize_tensor(tensor: Any) -> np.ndarray:
    """Dequantise a gguf.GGUFReader tensor (gguf.ReaderTensor) to float32 [rows, cols].

    ReaderTensor.shape is in GGUF ne order (ne[0] = contiguous row length); its ``data`` is
    [.., rows, bytes] uint8 for block formats and typed values otherwise. cols = ne[0] and
    rows = prod(ne[1:]) (1 for a 1-D tensor). Only little-endian files are supported.
    Raises UnsupportedError (type, byte order), ModelError (data size inconsistent with shape).
    """
    name = str(tensor.name)
    fmt = get_format(tensor.tensor_type)
    ne = [int(d) for d in tensor.shape]
    if not ne:
        raise ModelError(f"tensor {name!r}: empty shape")
    cols, rows = ne[0], math.prod(ne[1:])
    data = np.asarray(tensor.data)
    if data.dtype.byteorder == ">":
        raise UnsupportedError(f"tensor {name!r}: big-endian GGUF data is not supported")
    if not data.flags.c_contiguous:
        raise ModelError(f"tensor {name!r}: data is not contiguous")
    raw = data.reshape(-1).view(np.uint8)  # bytes exactly as stored in the file
    return dequantize(raw, fmt.type_id, (rows, cols), what=f"tensor {name!r}")
