"""Random *valid* quantised blocks for kernel tests and benchmarks.

Random bytes are valid blocks for every GGML format except that their fp16 scale fields can
be NaN/Inf or huge. `random_blocks` overwrites every scale field with a finite fp16 drawn
from a chosen magnitude. Scale offsets come from the block structs in ggml/src/ggml-common.h
(docs/sources.md §5: Q2_K d/dmin at 80/82, Q3_K d at 108, Q6_K d at 208, every
other listed type d (and dmin/m) at bytes 0/2; IQ1_M's d split over the top nibbles of its
four uint16 scales at byte 48).
"""
from __future__ import annotations

import numpy as np

from .dequant import get_format

# type id -> byte offsets of the fp16 scale fields inside one block
FP16_SCALES: dict[int, tuple[int, ...]] = {
    2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,),          # Q4_0 Q4_1 Q5_0 Q5_1 Q8_0
    10: (80, 82), 11: (108,), 12: (0, 2), 13: (0, 2), 14: (208,),  # Q2_K..Q6_K
    16: (0,), 17: (0,), 18: (0,), 19: (0,), 20: (0,), 21: (0,), 22: (0,), 23: (0,),  # IQ*
    34: (52,), 35: (64,),                                      # TQ1_0 TQ2_0
}
IQ1_M_SCALES = 48  # IQ1_M (29) has no d field: fp16 bits 4k..4k+3 = top nibble of uint16 scales[k]
FLOAT_TYPES = {0: np.float32, 1: np.float16}  # BF16 (30) handled separately


def random_blocks(type_id: int, n_blocks: int, rng: np.random.Generator,
                  scale: float = 0.02) -> np.ndarray:
    """uint8 [n_blocks, type_size] of random blocks whose scales are finite fp16 values with
    |d| in [scale/2, scale] (random sign on d, positive min scales so dequantised weights
    straddle zero). Float types get N(0, scale) values. Raises UnsupportedError for a type
    the oracle does not know, ValueError for a type without a known scale layout."""
    fmt = get_format(type_id)
    if type_id in FLOAT_TYPES:
        vals = rng.normal(0, scale, n_blocks).astype(FLOAT_TYPES[type_id])
        return vals.view(np.uint8).reshape(n_blocks, fmt.type_size)
    if type_id == 30:  # BF16: top half of an fp32
        f = rng.normal(0, scale, n_blocks).astype(np.float32).view(np.uint32)
        return (f >> 16).astype(np.uint16).view(np.uint8).reshape(n_blocks, 2)
    if type_id == 29:
        return _iq1_m(rng.integers(0, 256, (n_blocks, fmt.type_size), dtype=np.uint8), rng, scale)
    if type_id not in FP16_SCALES:
        raise ValueError(f"no scale layout known for {fmt.name}")
    raw = rng.integers(0, 256, (n_blocks, fmt.type_size), dtype=np.uint8)
    for j, off in enumerate(FP16_SCALES[type_id]):
        mag = rng.uniform(scale / 2, scale, n_blocks)
        sign = rng.choice([-1.0, 1.0], n_blocks) if j == 0 else 1.0
        raw[:, off:off + 2] = (sign * mag).astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    return raw


def _iq1_m(raw: np.ndarray, rng: np.random.Generator, scale: float) -> np.ndarray:
    """IQ1_M blocks [n, 56]: the fp16 d (random sign, |d| in [scale/2, scale]) written into the
    top nibbles of the four uint16 scales at byte 48 (dequantize_row_iq1_m, ggml-quants.c)."""
    n = raw.shape[0]
    d = (rng.choice([-1.0, 1.0], n) * rng.uniform(scale / 2, scale, n)).astype(np.float16).view(np.uint16)
    sc = raw[:, IQ1_M_SCALES:IQ1_M_SCALES + 8].copy().view("<u2")  # [n, 4]
    for k in range(4):
        sc[:, k] = (sc[:, k] & 0x0FFF) | (((d >> (4 * k)) & 0xF) << 12)
    raw[:, IQ1_M_SCALES:IQ1_M_SCALES + 8] = sc.view(np.uint8)
    return raw
