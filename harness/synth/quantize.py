"""Encode float32 weights as a GGML type: numpy (F32/F16), gguf-py, or libggml.

Which path a type takes (see quant_source): F32/F16 by numpy casts; the types gguf-py 0.19.0
can quantise (gguf/quants.py classes with quantize_blocks) through gguf.quants.quantize;
the K-quants and I-quants through ggml_quantize_chunk (harness.synth.ggml_quant). Any other
type raises UnsupportedError: nothing here invents a block encoder.
"""
from __future__ import annotations

import numpy as np
from gguf import quants as gq
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from ..errors import ConfigError, UnsupportedError
from .ggml_quant import GGML_QUANT_TYPES, ggml_quantize


def parse_type(name: str) -> QT:
    """"Q4_K" / "q4_k" -> GGMLQuantizationType; ConfigError for an unknown name."""
    try:
        return QT[name.upper()]
    except KeyError:
        known = ", ".join(t.name for t in QT)
        raise ConfigError(f"unknown GGML type {name!r} (known: {known})") from None


def _gguf_py_types() -> frozenset[QT]:
    # gguf-py registers a class per type; only some override quantize_blocks.
    return frozenset(t for t, cls in gq._type_traits.items()
                     if "quantize_blocks" in cls.__dict__)


def quant_source(qtype: QT) -> str:
    """"numpy", "gguf-py" or "ggml": who encodes qtype; UnsupportedError if nobody here can."""
    if qtype in (QT.F32, QT.F16):
        return "numpy"
    if qtype in _gguf_py_types():
        return "gguf-py"
    if qtype in GGML_QUANT_TYPES:
        return "ggml"
    raise UnsupportedError(f"cannot quantise to {qtype.name}: neither gguf-py 0.19.0 nor the "
                           "ggml path of harness.synth implements an encoder for it")


def check_row(name: str, qtype: QT, ne0: int) -> None:
    """ConfigError if a row of ne0 values is not a whole number of qtype blocks."""
    block = GGML_QUANT_SIZES[qtype][0]
    if ne0 % block:
        raise ConfigError(f"tensor {name!r}: rows of {ne0} values cannot be stored as "
                          f"{qtype.name} (block size {block}); choose another type")


def encode(name: str, values: np.ndarray, qtype: QT) -> np.ndarray:
    """float32 [n_rows, ne0] -> the array GGUFWriter stores for qtype.

    F32 -> float32, F16 -> float16 (same shape); others -> uint8 [n_rows, row_bytes].
    Raises ConfigError (row not a multiple of the block size) or UnsupportedError.
    """
    source = quant_source(qtype)
    check_row(name, qtype, values.shape[-1])
    values = np.ascontiguousarray(values, dtype=np.float32)
    if source == "numpy":
        return values if qtype == QT.F32 else values.astype(np.float16)
    if source == "gguf-py":
        return gq.quantize(values, qtype)
    return ggml_quantize(values.reshape(-1, values.shape[-1]), qtype).reshape(
        *values.shape[:-1], -1)
