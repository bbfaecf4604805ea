"""Zero-mean random quantised rows written directly as GGML blocks (no quantiser involved).

Random bytes are valid blocks for every format below; only the scale fields need choosing.
Each generator builds blocks whose dequantised values have mean zero in expectation and an
rms of `std` (up to a per-block jitter of +-25 %), so activations stay O(1):

- Q8_0 (34 B): d, 32 int8 in [-127, 127] (symmetric; -128 left out).
- Q4_0 (18 B): d * (q - 8) with a random sign on d (q - 8 alone has mean -1/2).
- Q4_K (144 B) / Q5_K (176 B): d*sc_j*q - dmin*m_j with m_j = sc_j and dmin = 7.5 d
  (Q5_K: 15.5 d), i.e. d*sc_j*(q - 7.5): mean zero for uniform q. 6-bit sc_j in [32, 63].
- Q6_K (210 B): d * sc_j * (q - 32) with int8 sub-block scales of random sign, |sc| 16..127.
- IQ4_XS (136 B): d * (ls - 32) * kvalues[q] with ls - 32 of random sign, |ls - 32| 8..31
  (the IQ4_NL codebook alone has mean -5.9).
- IQ3_S (110 B): random grid indices, signs and 4-bit scales are sign-symmetric already.
- F32 / F16: normal values.
Block layouts and scale packing: llama.cpp ggml/src/ggml-common.h (block_q4_K, ...) and the
unpacking in gguf-py gguf/quants.py (Q4_K.get_scale_min, IQ4_XS.dequantize_blocks). The
rms of a block with unit d is measured once per type by dequantising a fixed sample with
gguf-py (`unit_rms`), so d = std / unit_rms needs no closed form per codebook.
"""
from __future__ import annotations

import functools

import numpy as np
from gguf import quants as gq
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as QT

from ..errors import ConfigError

JITTER = 0.25          # per-block |d| drawn from [1 - JITTER, 1 + JITTER] * nominal
FP16_TINY = 2.0 ** -20  # smallest nominal d accepted (fp16 subnormals keep >= 4 bits here)


def _f16(x: np.ndarray) -> np.ndarray:
    """float -> fp16 bytes [n, 2] (little-endian, as ggml_half is stored)."""
    return np.asarray(x, dtype=np.float16).reshape(-1, 1).view(np.uint8)


def _raw(rng: np.random.Generator, n_blocks: int, size: int) -> np.ndarray:
    return np.frombuffer(rng.bytes(n_blocks * size), dtype=np.uint8).reshape(n_blocks, size).copy()


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """6-bit scales/mins [n, 8] -> the 12-byte K_SCALE_SIZE field (inverse of get_scale_min)."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return out


def _q8_0(rng, d):
    blk = _raw(rng, d.size, 34)
    q = rng.integers(-127, 128, (d.size, 32), dtype=np.int8)  # [n, 32] symmetric
    blk[:, 2:] = q.view(np.uint8)
    blk[:, 0:2] = _f16(d)
    return blk


def _q4_0(rng, d):
    blk = _raw(rng, d.size, 18)
    blk[:, 0:2] = _f16(d * rng.choice([-1.0, 1.0], d.size))
    return blk


def _k_quant(rng, d, size: int, q_mid: float):
    blk = _raw(rng, d.size, size)
    sc = rng.integers(32, 64, (d.size, 8), dtype=np.uint8)  # [n, 8] 6-bit, away from 0
    blk[:, 4:16] = _pack_k_scales(sc, sc)
    blk[:, 0:2] = _f16(d)
    blk[:, 2:4] = _f16(d * q_mid)  # dmin: mean of d*sc*q - dmin*sc is then zero
    return blk


def _q6_k(rng, d, mag_lo: int = 16, mag_hi: int = 128):
    blk = _raw(rng, d.size, 210)
    mag = rng.integers(mag_lo, mag_hi, (d.size, 16))
    sign = rng.choice(np.array([-1, 1]), (d.size, 16))
    blk[:, 192:208] = (mag * sign).astype(np.int8).view(np.uint8)
    blk[:, 208:210] = _f16(d)
    return blk


def _iq4_xs(rng, d):
    blk = _raw(rng, d.size, 136)
    mag = rng.integers(8, 32, (d.size, 8))
    ls = 32 + mag * rng.choice(np.array([-1, 1]), (d.size, 8))  # [n, 8] in [1, 63]
    lo, hi = (ls & 15).astype(np.uint16), (ls >> 4).astype(np.uint16)
    blk[:, 4:8] = (lo[:, 0::2] | (lo[:, 1::2] << 4)).astype(np.uint8)
    scales_h = np.zeros(d.size, dtype=np.uint16)
    for ib in range(8):
        scales_h |= hi[:, ib] << (2 * ib)
    blk[:, 2:4] = scales_h.reshape(-1, 1).view(np.uint8)
    blk[:, 0:2] = _f16(d)
    return blk


def _iq3_s(rng, d):
    blk = _raw(rng, d.size, 110)
    blk[:, 0:2] = _f16(d)
    return blk


_BLOCKS = {
    QT.Q8_0: _q8_0,
    QT.Q4_0: _q4_0,
    QT.Q4_K: lambda rng, d: _k_quant(rng, d, 144, 7.5),
    QT.Q5_K: lambda rng, d: _k_quant(rng, d, 176, 15.5),
    QT.Q6_K: _q6_k,
    QT.IQ4_XS: _iq4_xs,
    QT.IQ3_S: _iq3_s,
}
DIRECT_TYPES = frozenset(_BLOCKS) | {QT.F32, QT.F16}
# Generators with ~8x smaller sub-block scales, taken only when the usual ones would need a
# super-block scale below FP16_TINY: Q6_K's int8 scales of 16..127 put its unit rms near 1300,
# so a 27B-width ffn_down (std 6.7e-4 after the residual-branch factor) needed d = 4.6e-7.
_SMALL_SCALE_BLOCKS = {
    QT.Q6_K: lambda rng, d: _q6_k(rng, d, 2, 16),
}


@functools.cache
def unit_rms(qtype: QT, small_scales: bool = False) -> float:
    """rms of dequantised values of blocks made with d = 1 (fixed sample of 4096 blocks);
    small_scales: of the _SMALL_SCALE_BLOCKS generator."""
    gen = _SMALL_SCALE_BLOCKS[qtype] if small_scales else _BLOCKS[qtype]
    blk = gen(np.random.default_rng(12345), np.ones(4096))
    vals = gq.dequantize(blk, qtype).astype(np.float64)
    return float(np.sqrt(np.mean(vals * vals)))


def random_rows(qtype: QT, n_rows: int, ne0: int, std: float,
                rng: np.random.Generator) -> np.ndarray:
    """n_rows rows of ne0 values stored as qtype: uint8 [n_rows, row_bytes] for block types,
    float32/float16 [n_rows, ne0] for F32/F16. Values: mean 0, rms ~std.

    Raises ConfigError for a type without a direct generator, a row that is not whole
    blocks, or a std too small for an fp16 scale (Q6_K first falls back to ~8x smaller
    sub-block scales).
    """
    if qtype in (QT.F32, QT.F16):
        vals = rng.standard_normal((n_rows, ne0), dtype=np.float32) * np.float32(std)
        return vals if qtype == QT.F32 else vals.astype(np.float16)
    if qtype not in _BLOCKS:
        raise ConfigError(f"no direct random-block generator for {qtype.name} "
                          f"(have: {', '.join(sorted(t.name for t in DIRECT_TYPES))})")
    block, tsize = GGML_QUANT_SIZES[qtype]
    if ne0 % block:
        raise ConfigError(f"rows of {ne0} values are not whole {qtype.name} blocks of {block}")
    nominal, gen = std / unit_rms(qtype), _BLOCKS[qtype]
    if nominal < FP16_TINY and qtype in _SMALL_SCALE_BLOCKS:
        nominal, gen = std / unit_rms(qtype, small_scales=True), _SMALL_SCALE_BLOCKS[qtype]
    if not FP16_TINY <= nominal <= 6.0e4:
        raise ConfigError(f"std {std:g} needs a {qtype.name} scale of {nominal:g}, outside the "
                          f"usable fp16 range [{FP16_TINY:g}, 6e4]")
    n_blocks = n_rows * (ne0 // block)
    d = nominal * rng.uniform(1 - JITTER, 1 + JITTER, n_blocks)
    return gen(rng, d).reshape(n_rows, ne0 // block * tsize)
