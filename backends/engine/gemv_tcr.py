"""Engine v12 GEMV nodes (kernels/gemv_mma.cu tcr_body): v11's int8 tensor-core dot products
(mma.sync m16n8k32) on Q4_K weights repacked once at node build so that a warp's load is 512
contiguous bytes and every loaded byte is used. An A/B build behind GGUF_HARNESS_GEMV_TCR.

Switches (read at import, as ops.py's):
  GGUF_HARNESS_GEMV_TCR        "1" or "q4_k": Q4_K nodes take v12; "" or "0": none (the default).
  GGUF_HARNESS_GEMV_TCR_WARPS  warps per block (2, 4, 8 or 16; the kernel's default 8).
  GGUF_HARNESS_GEMV_TCR_UNROLL groups in flight per warp (1..4; default 2).
  GGUF_HARNESS_GEMV_TCR_MINB   minBlocks of the launch bounds (1..4; default 2).
  GGUF_HARNESS_GEMV_TCR_GRID   blocks of a node: "" (default) the resident blocks, at most one per tile
                               (grid-stride over tiles); N >= 1: ceil(tiles / N) blocks, N tiles per
                               block (N = 1: the hardware hands tiles to SMs as blocks finish).
  GGUF_HARNESS_GEMV_TCR_PIPE   1: software-pipelined rounds (the next round's loads before the
                               current round's arithmetic); 0 (the kernel's default): load, then compute.

The repacked layout (kernels/gemv_mma.cu, the comment above tcr_repack_q4_k, derived from the PTX
ISA's m16n8k32 fragment layout and ggml's block_q4_K) is a permutation of the matrix's bytes: the
same size, tiles of 16 rows, per super-block the 16 headers and then per 128-value group the lanes'
16-byte slots. `repack_q4_k` is its numpy model (CPU tests), `decode_repacked_q4_k` reads a repacked
matrix back into values the way the kernel does, so the CPU tests can hold both to gguf-py's
dequantisation; the GPU test holds the device repack to `repack_q4_k` byte for byte.

The repacked copy is a second buffer beside the GGUF weights (other nodes, e.g. prefill, read the
GGUF layout), kept alive by the node: a v12 build needs the Q4_K bytes twice on the device.
"""
from __future__ import annotations

import os

import numpy as np

from . import module

Q4_K = 12
BLOCK_BYTES = 144  # block_q4_K: d, dmin (fp16), scales[12], qs[128]
SB_BYTES = 16 * BLOCK_BYTES  # one super-block of a 16-row tile (2304)
TILE_ROWS = 16
WARPS_DEFAULT = 8  # kernels/gemv_mma.cu TCR_WARPS

GEMV_TCR = os.environ.get("GGUF_HARNESS_GEMV_TCR", "")
GEMV_TCR_WARPS = os.environ.get("GGUF_HARNESS_GEMV_TCR_WARPS", "")
GEMV_TCR_UNROLL = os.environ.get("GGUF_HARNESS_GEMV_TCR_UNROLL", "")
GEMV_TCR_MINB = os.environ.get("GGUF_HARNESS_GEMV_TCR_MINB", "")
GEMV_TCR_PIPE = os.environ.get("GGUF_HARNESS_GEMV_TCR_PIPE", "")
GEMV_TCR_GRID = os.environ.get("GGUF_HARNESS_GEMV_TCR_GRID", "")


def tcr_grid(ntiles: int, resident: int) -> int:
    """Blocks of a v12 node of `ntiles` tiles when `resident` blocks fit on the GPU at once
    (GGUF_HARNESS_GEMV_TCR_GRID). Raises ValueError on a value that is not a whole number >= 1."""
    v = GEMV_TCR_GRID.strip()
    if not v:
        return min(ntiles, resident)
    if not (v.isascii() and v.isdigit()) or int(v) < 1:
        raise ValueError(f"GGUF_HARNESS_GEMV_TCR_GRID={v!r}: expected tiles per block, a whole number >= 1")
    return -(-ntiles // int(v))


def tcr_on(value: str | None = None) -> bool:
    """Whether Q4_K nodes take v12 (GGUF_HARNESS_GEMV_TCR; value None: the switch read at import).
    Raises ValueError on a value other than "", "0", "1", "q4_k"."""
    v = (GEMV_TCR if value is None else value).strip().lower()
    if v not in ("", "0", "1", "q4_k"):
        raise ValueError(f"GGUF_HARNESS_GEMV_TCR={v!r}: expected 0, 1 or q4_k")
    return v in ("1", "q4_k")


def tcr_defines() -> tuple[str, ...]:
    """Preprocessor defines of the v12 build (TCR_WARPS, TCR_UNROLL, TCR_MINB, TCR_PIPE from their switches;
    unset: the kernel's defaults). Raises ValueError on a value outside the allowed, and on a MINB
    that leaves fewer than 64 registers per thread."""
    out = module.switch_defines((
        ("GGUF_HARNESS_GEMV_TCR_WARPS", GEMV_TCR_WARPS, "TCR_WARPS", (2, 4, 8, 16)),
        ("GGUF_HARNESS_GEMV_TCR_UNROLL", GEMV_TCR_UNROLL, "TCR_UNROLL", (1, 2, 3, 4)),
        ("GGUF_HARNESS_GEMV_TCR_MINB", GEMV_TCR_MINB, "TCR_MINB", (1, 2, 3, 4)),
        ("GGUF_HARNESS_GEMV_TCR_PIPE", GEMV_TCR_PIPE, "TCR_PIPE", (0, 1))))
    # minBlocks x threads caps ptxas at 65536 / that registers: below 64 the store kernels spill too
    # (NVRTC 13.0 sm_90: 16 warps x minBlocks 4 spills 456 bytes); the SwiGLU pairs already spill at
    # 64 (16 warps x 2) and with _PIPE=1 or _UNROLL >= 3 at 128 (perf-notes session 38: "C spills")
    warps = int(GEMV_TCR_WARPS or WARPS_DEFAULT)
    if 65536 // (warps * 32 * int(GEMV_TCR_MINB or 2)) < 64:
        raise ValueError(f"GGUF_HARNESS_GEMV_TCR_MINB={GEMV_TCR_MINB or 2} with {warps} warps per block caps "
                         "registers below 64 (spills)")
    return out


def check_switches() -> None:
    """Refuse bad GGUF_HARNESS_GEMV_TCR* values (switches.check calls this before any work).
    Raises ValueError naming the variable."""
    tcr_on()
    tcr_defines()
    tcr_grid(1, 1)


def _codes(blocks: np.ndarray) -> np.ndarray:
    """uint8 [n, 8, 32]: the 4-bit codes of sub-blocks 0..7 of n Q4_K blocks ([n, 144] uint8)
    (ggml dequantize_row_q4_K: code l of sub-block s = nibble s & 1 of qs[32 (s >> 1) + l])."""
    qs = blocks[:, 16:].reshape(-1, 4, 32)
    return np.stack([qs & 15, qs >> 4], axis=2).reshape(-1, 8, 32)


def repack_q4_k(mat: np.ndarray) -> np.ndarray:
    """The v12 layout of a Q4_K matrix. mat: uint8 [rows, 144 nsb] (GGUF bytes, rows % 16 == 0).
    Returns uint8 [rows * 144 nsb] (kernels/gemv_mma.cu tcr_repack_q4_k). Raises ValueError on
    another shape."""
    rows, rb = mat.shape
    if mat.dtype != np.uint8 or rows % TILE_ROWS or rb % BLOCK_BYTES or rb == 0:
        raise ValueError(f"Q4_K repack needs uint8 [16 n, 144 m], got {mat.dtype} {mat.shape}")
    nsb, nt = rb // BLOCK_BYTES, rows // TILE_ROWS
    blk = mat.reshape(nt, TILE_ROWS, nsb, BLOCK_BYTES)
    out = np.empty((nt, nsb, SB_BYTES), np.uint8)
    out[:, :, :256] = blk[..., :16].transpose(0, 2, 1, 3).reshape(nt, nsb, 256)
    c = _codes(blk.reshape(-1, BLOCK_BYTES)).reshape(nt, 2, 8, nsb, 8, 32)  # [tile, h, g, sb, s, l]
    slot = c[..., :16] | (c[..., 16:] << 4)                            # [tile, h, g, sb, s, 16]
    slot = slot.reshape(nt, 2, 8, nsb, 2, 4, 16)                          # s = 4 q + t
    out[:, :, 256:] = slot.transpose(0, 3, 4, 1, 2, 5, 6).reshape(nt, nsb, 2048)  # [tile, sb, q, h, g, t, n]
    return out.reshape(-1)


def decode_repacked_q4_k(packed: np.ndarray, rows: int, K: int) -> np.ndarray:
    """float64 [rows, K]: the weights of a repacked Q4_K matrix, read as the kernel reads it. In the
    super-block sb of tile T (at byte 16 rb T + 2304 sb), row r of the tile (0..15) has its header at
    16 r and its sub-block s's slot at 256 + 1024 (s >> 2) + 512 (r >> 3) + 16 (4 (r & 7) + (s & 3));
    value = d sc code - dmin m (the scales unpacked by gguf-py's Q4_K.get_scale_min)."""
    nsb, nt = K // 256, rows // TILE_ROWS
    sb = packed.reshape(nt, nsb, SB_BYTES)
    hdr = sb[:, :, :256].reshape(nt, nsb, 16, 16)
    d = hdr[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    dmin = hdr[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    from gguf.quants import Q4_K as GgufQ4K  # the 6-bit scale / min unpacking (ggml get_scale_min_k4)
    sc, mn = (a.reshape(nt, nsb, 16, 8).astype(np.int64)
              for a in GgufQ4K.get_scale_min(np.ascontiguousarray(hdr[..., 4:16]).reshape(-1, 12)))
    data = sb[:, :, 256:].reshape(nt, nsb, 2, 2, 8, 4, 16)  # [tile, sb, q, h, g, t, n]
    codes = np.concatenate([data & 15, data >> 4], axis=-1)  # [.., 32]: code n, then n + 16
    codes = codes.transpose(0, 3, 4, 1, 2, 5, 6).reshape(nt, 16, nsb, 8, 32)  # [tile, row, sb, s, l]
    w = (d.transpose(0, 2, 1)[..., None, None] * sc.transpose(0, 2, 1, 3)[..., None] * codes
         - dmin.transpose(0, 2, 1)[..., None, None] * mn.transpose(0, 2, 1, 3)[..., None])
    return w.reshape(rows, K)


def tcr_takes(mode: str, type_ids, K: int, rows_per_seg) -> bool:
    """Whether v12 takes a q16 node: switch on, every matrix Q4_K, K % 256 == 0, every segment's
    rows % 16 == 0 (whole tiles). Raises ValueError on a bad switch value."""
    return (tcr_on() and set(type_ids) == {Q4_K} and K % 256 == 0
            and all(r % TILE_ROWS == 0 and r > 0 for r in rows_per_seg))


def _on_host(ptr: int) -> bool:
    """Whether a pointer is host memory (cudaPointerGetAttributes type 1: arena.mapped_host)."""
    import cupy as cp
    return int(cp.cuda.runtime.pointerGetAttributes(ptr).type) == 1


def repack_device(w) -> object:
    """A cupy uint8 buffer holding the v12 layout of the Q4_K matrix `w` (arena.DeviceTensor,
    16-byte aligned), repacked on the device (tcr_repack_q4_k) on the current stream, which is
    then synchronised."""
    import cupy as cp
    if w.ptr % 16:
        raise ValueError(f"{w.name}: Q4_K weights must be 16-byte aligned for the v12 repack")
    out = cp.empty(w.nbytes, dtype=cp.uint8)
    nsb = w.row_bytes // BLOCK_BYTES
    chunks = (w.rows // TILE_ROWS) * nsb * (SB_BYTES // 16)
    k = module.kernel_in("gemv_mma.cu", "tcr_repack_q4_k", tcr_defines())  # the v12 GEMVs' module
    src = cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(w.ptr, w.nbytes, None), 0)
    k((min(-(-chunks // 256), 8 * module.sm_count()),), (256,),
      (src, out, np.int32(w.rows), np.int32(nsb)))
    cp.cuda.get_current_stream().synchronize()
    return out


def gemv_tcr(name: str, mode: str, segs, x, K: int, norm, eps: float, rows: int):
    """The engine v12 node of a checked q16 gemv call (arguments as ops.gemv; rows: the node's
    output rows, a pair's gate rows), or None when v12 does not take it (tcr_takes). Each segment's
    weights are repacked into a buffer the node keeps. Grid: tcr_grid (by default the resident
    blocks, at most one per tile; the kernel walks tiles grid-stride). Host-resident weights (mapped
    host memory, e.g. a tied head placed on the host) are not taken: their repacked copy would land
    on the device. Raises ValueError on bad switch values and on weights not 16-byte aligned."""
    if not tcr_takes(mode, [s.w.type_id for s in segs], K, [s.w.rows for s in segs]):
        return None
    if any(_on_host(s.w.ptr) for s in segs):
        return None
    from .arena import DeviceTensor
    from .gemv_mma import tile_node
    from .ops import Seg
    defines = tcr_defines()
    keep, rsegs = [], []
    for s in segs:
        buf = repack_device(s.w)
        keep.append(buf)
        w2 = DeviceTensor(s.w.name + "#tcr", int(buf.data.ptr), s.w.type_id, s.w.ne, s.w.row_bytes, s.w.nbytes)
        rsegs.append(Seg(w2, s.out, s.bias))
    k = module.kernel_in("gemv_mma.cu", f"gemvtcr_{mode}_q4_k", defines)
    return tile_node(name, mode, k, segs, rsegs, x, K, norm, eps, rows, int(GEMV_TCR_WARPS or WARPS_DEFAULT),
                     tcr_grid, keep=keep, defines=defines)
