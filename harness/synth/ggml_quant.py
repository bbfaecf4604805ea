"""Quantisation through libggml's own ggml_quantize_chunk (for types gguf-py cannot quantise).

gguf-py 0.19.0 (gguf/quants.py) implements quantize_blocks only for BF16, Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, TQ1_0, TQ2_0 and MXFP4; the K-quants and I-quants it can only dequantise. For
those we call ggml (ggml/include/ggml.h):

    size_t ggml_quantize_chunk(enum ggml_type type, const float *src, void *dst,
                               int64_t start, int64_t nrows, int64_t n_per_row,
                               const float *imatrix);
    bool ggml_quantize_requires_imatrix(enum ggml_type type);

from the libggml-base that llama-cpp-python ships. ggml aborts the process on a bad call
(GGML_ASSERT), so every argument is checked here first and only listed types are passed.
Types that need an importance matrix get a uniform one (all ones).
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from ..errors import ConfigError, UnsupportedError

# ggml_quantize_chunk has a quantize_* function for each of these (ggml/src/ggml.c).
GGML_QUANT_TYPES = frozenset({
    QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_NL, QT.IQ4_XS, QT.IQ3_S,
    QT.IQ3_XXS, QT.IQ2_S, QT.IQ2_XS, QT.IQ2_XXS, QT.IQ1_S, QT.IQ1_M,
})


@functools.cache
def _lib() -> ctypes.CDLL:
    from oracles.ggml_ref import libggml_base  # raises GgmlUnavailable (an UnsupportedError)
    lib = libggml_base()
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_void_p]
    lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
    return lib


def ggml_quantize(values: np.ndarray, qtype: QT) -> np.ndarray:
    """float32 [n_rows, n_per_row] -> uint8 [n_rows, n_per_row / block_size * type_size].

    Source: ggml_quantize_chunk (ggml/src/ggml.c, quantize_* in ggml/src/ggml-quants.c).
    Raises UnsupportedError for a type not in GGML_QUANT_TYPES or without libggml,
    ConfigError when n_per_row is not a multiple of the block size.
    """
    if qtype not in GGML_QUANT_TYPES:
        raise UnsupportedError(f"ggml_quantize: {qtype.name} is not quantised through ggml here")
    rows = np.ascontiguousarray(values, dtype=np.float32)
    if rows.ndim != 2:
        raise ConfigError(f"ggml_quantize: expected a 2-D array, got shape {rows.shape}")
    n_rows, n_per_row = rows.shape
    block, tsize = GGML_QUANT_SIZES[qtype]
    if n_per_row % block:
        raise ConfigError(f"ggml_quantize: rows of {n_per_row} values are not a multiple of "
                          f"the {qtype.name} block size {block}")
    lib = _lib()
    out = np.zeros((n_rows, n_per_row // block * tsize), dtype=np.uint8)
    imatrix = None
    if lib.ggml_quantize_requires_imatrix(int(qtype)):
        imatrix = np.ones(n_per_row, dtype=np.float32)  # uniform importance
    written = lib.ggml_quantize_chunk(
        int(qtype), rows.ctypes.data, out.ctypes.data, 0, n_rows, n_per_row,
        None if imatrix is None else imatrix.ctypes.data)
    if written != out.nbytes:
        raise UnsupportedError(f"ggml_quantize_chunk({qtype.name}) wrote {written} bytes, "
                               f"expected {out.nbytes}")
    return out
