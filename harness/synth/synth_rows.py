"""Row generators for synthetic tensors: reproducible per row group, streamed by chunks.

Every tensor is drawn in groups of ROW_GROUP rows, each group from its own stream
(seed, crc32(name + salt), group), so any row range can be produced on its own and the file
never depends on chunk sizes. Three structures keep a random model well conditioned
(measured on qwen35-tiny against llama.cpp, see harness/synth/QWEN35.md):

- Shared rows (`SharedRows`): the DeltaNet key channels of attn_qkv reuse, block by block
  with probability qk_share, the blocks of the query channels (and ssm_conv1d the taps).
  Random q and k are nearly orthogonal, so the delta-rule output is a cancelling sum that
  amplified llama.cpp's activation rounding ~6x in one layer; correlated q/k give O(1)
  retrieval like a trained model's.
- Next-token rows (`NextTokenRows`): output row i = sqrt(1 - g^2) R_i + g e_perm(i) (rms
  rescaled), e = token_embd rows. Logits of i.i.d. random rows are Gaussian with top-2 gaps
  of ~0.3 sd, so any rounding flips the argmax; real LMs put most steps' top token clearly
  ahead. perm permutes whole row groups and rotates inside them (no fixed points), so an
  output chunk needs only the matching token_embd groups.
- Residual-branch scale (applied to the specs by the caller): attn_output / ssm_out /
  ffn_down rms times 1/sqrt(2 n_layer) (GPT-2's initialisation), so the residual stream
  stays O(1) and each layer's rounding error stays small against it.
"""
from __future__ import annotations

import math
import zlib

import numpy as np
from gguf import quants as gq
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from .gguf_stream import ROW_GROUP
from .quantize import encode
from .randblocks import DIRECT_TYPES, random_rows

Spec = tuple[str, tuple[int, ...], str, float]  # (name, ne, kind, std)


def float_rows(kind: str, std: float, shape: tuple[int, int], rng) -> np.ndarray:
    """float32 values of a kind: matrix/conv/dt_bias N(0, std^2), norm 1 + N(0, std^2),
    ssm_a -U(0.05, 1) (a decay rate A > 0 stored as -A)."""
    if kind == "ssm_a":
        return -rng.uniform(0.05, 1.0, shape).astype(np.float32)
    x = rng.standard_normal(shape, dtype=np.float64) * std
    return (x + 1.0 if kind == "norm" else x).astype(np.float32)


class Rows:
    """rows(r0, r1) -> encoded rows of one tensor (uint8 blocks or float32/16 values)."""

    def __init__(self, spec: Spec, qtype: QT, seed: int, method: str) -> None:
        self.spec, self.qtype, self.seed, self.method = spec, qtype, seed, method
        self.n_rows = math.prod(spec[1][1:])

    def _rng(self, g: int, salt: str = "") -> np.random.Generator:
        return np.random.default_rng([self.seed, zlib.crc32((self.spec[0] + salt).encode()), g])

    def _group(self, g: int) -> np.ndarray:
        name, ne, kind, std = self.spec
        n = min(ROW_GROUP, self.n_rows - g * ROW_GROUP)
        if kind == "matrix" and self.method == "direct" and self.qtype in DIRECT_TYPES:
            return random_rows(self.qtype, n, ne[0], std, self._rng(g))
        vals = float_rows(kind, std, (n, ne[0]), self._rng(g))
        return vals if kind != "matrix" else encode(name, vals, self.qtype)

    def plain(self, r0: int, r1: int) -> np.ndarray:
        groups = range(r0 // ROW_GROUP, (r1 + ROW_GROUP - 1) // ROW_GROUP)
        rows = np.concatenate([self._group(g) for g in groups], axis=0)
        off = r0 - groups[0] * ROW_GROUP
        return rows[off:off + r1 - r0]

    def floats(self, r0: int, r1: int) -> np.ndarray:
        """float32 [r1 - r0, ne0]: the stored values (dequantised when blocks)."""
        raw = self.plain(r0, r1)
        return raw.astype(np.float32) if raw.dtype != np.uint8 else gq.dequantize(raw, self.qtype)

    def __call__(self, r0: int, r1: int) -> np.ndarray:
        return self.plain(r0, r1)


class SharedRows(Rows):
    """Rows [start, start + length) copy, per block with probability frac, rows - length."""

    def __init__(self, spec: Spec, qtype: QT, seed: int, method: str, start: int, length: int,
                 frac: float) -> None:
        super().__init__(spec, qtype, seed, method)
        self.start, self.length, self.frac = start, length, frac

    def _units(self) -> int:
        ne0, block = self.spec[1][0], GGML_QUANT_SIZES[self.qtype][0]
        return ne0 // block if block > 1 else (ne0 // 32 if ne0 % 32 == 0 else ne0)

    def __call__(self, r0: int, r1: int) -> np.ndarray:
        out = self.plain(r0, r1)
        a, b = max(r0, self.start), min(r1, self.start + self.length)
        if a < b:
            base, own = self.plain(a - self.length, b - self.length), out[a - r0:b - r0]
            g0, g1 = a // ROW_GROUP, (b + ROW_GROUP - 1) // ROW_GROUP  # per group: chunk-proof
            mask = np.concatenate([self._rng(g, "#share").random((ROW_GROUP, self._units()))
                                   for g in range(g0, g1)])[a - g0 * ROW_GROUP:][:b - a] < self.frac
            bb, ob = base.reshape(b - a, mask.shape[1], -1), own.reshape(b - a, mask.shape[1], -1)
            out[a - r0:b - r0] = np.where(mask[..., None], bb, ob).reshape(own.shape)
        return out


def next_token_perm(n: int, seed: int) -> np.ndarray:
    """int64 [n]: perm(i), one cycle through all rows of the whole ROW_GROUP groups: the groups
    follow a random cyclic order and each group adds a rotation 1..G-1 inside it, the
    rotations summing to an odd number (so G steps around the group cycle never return to
    the start early). Rows of a trailing partial group map to themselves."""
    rng = np.random.default_rng([seed, zlib.crc32(b"next-token perm")])
    n_full = n // ROW_GROUP
    out = np.arange(n)
    if n_full == 0:
        return out
    order = rng.permutation(n_full)
    gp = np.empty(n_full, dtype=np.int64)
    gp[order] = np.roll(order, -1)  # group order[k] -> order[k + 1]: a single cycle
    shift = rng.integers(1, ROW_GROUP, n_full)
    if shift.sum() % 2 == 0:  # flip the parity of one rotation, staying in [1, G-1]
        shift[0] += 1 if shift[0] < ROW_GROUP - 1 else -1
    g, k = out[:n_full * ROW_GROUP] // ROW_GROUP, out[:n_full * ROW_GROUP] % ROW_GROUP
    out[:n_full * ROW_GROUP] = gp[g] * ROW_GROUP + (k + shift[g]) % ROW_GROUP
    return out


class NextTokenRows(Rows):
    """Output rows mixing fresh normal rows with permuted token_embd rows (module doc)."""

    def __init__(self, spec: Spec, qtype: QT, seed: int, method: str, embd: Rows,
                 gamma: float) -> None:
        super().__init__(spec, qtype, seed, method)
        self.embd, self.gamma = embd, gamma
        self.perm = next_token_perm(self.n_rows, seed)

    def __call__(self, r0: int, r1: int) -> np.ndarray:
        name, ne, _, std = self.spec
        own = np.concatenate([float_rows("matrix", std, (min(ROW_GROUP, r1 - g0), ne[0]),
                                         self._rng(g0 // ROW_GROUP))
                              for g0 in range(r0, r1, ROW_GROUP)])
        emb = np.empty_like(own)
        for g0 in range(r0, r1, ROW_GROUP):  # one source group per output group
            src = self.perm[g0:min(r1, g0 + ROW_GROUP)]
            lo = int(src.min()) // ROW_GROUP * ROW_GROUP
            block = self.embd.floats(lo, min(self.embd.n_rows, lo + ROW_GROUP))
            emb[g0 - r0:g0 - r0 + src.size] = block[src - lo]
        scale = std / self.embd.spec[3]
        vals = (math.sqrt(1 - self.gamma ** 2) * own + self.gamma * scale * emb).astype(np.float32)
        return encode(name, vals, self.qtype)
