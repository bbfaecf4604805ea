"""Engine v11 GEMV nodes (kernels/gemv_mma.cu: the dot products on the int8 tensor cores,
mma.sync m16n8k32), an A/B build behind GGUF_HARNESS_GEMV_MMA.

Switches (read at import, as ops.py's):
  GGUF_HARNESS_GEMV_MMA        "1": every node v11 takes; a comma-separated list of q4_k, q5_k,
                               iq4_xs: those types only; "" or "0": none (the default).
  GGUF_HARNESS_GEMV_MMA_MIN_ROWS  only nodes with at least this many output rows (default 0).
  GGUF_HARNESS_GEMV_MMA_WARPS  warps per block (4, 8 or 16; the kernel's default 8).
  GGUF_HARNESS_GEMV_MMA_UNROLL groups in flight per warp (1..4; default 2).
  GGUF_HARNESS_GEMV_MMA_MINB   minBlocks of the launch bounds (1..4; default 2).
"""
from __future__ import annotations

import math
import os

import numpy as np

from . import module

MMA_TYPES = {12: "q4_k", 13: "q5_k", 23: "iq4_xs"}  # kernels/gemv_mma.cu MMA_MODES
MMA_ALIGN = {12: 16, 13: 16, 23: 8}  # the kernel's widest loads at block starts (M<T>::load)
MMA_WARPS_DEFAULT = 8  # kernels/gemv_mma.cu MMA_WARPS
TILE_ROWS = 16  # rows of one mma tile

GEMV_MMA = os.environ.get("GGUF_HARNESS_GEMV_MMA", "")
GEMV_MMA_MIN_ROWS = os.environ.get("GGUF_HARNESS_GEMV_MMA_MIN_ROWS", "")
GEMV_MMA_WARPS = os.environ.get("GGUF_HARNESS_GEMV_MMA_WARPS", "")
GEMV_MMA_UNROLL = os.environ.get("GGUF_HARNESS_GEMV_MMA_UNROLL", "")
GEMV_MMA_MINB = os.environ.get("GGUF_HARNESS_GEMV_MMA_MINB", "")


def mma_types() -> frozenset[int]:
    """GGML type ids whose nodes take v11 (GGUF_HARNESS_GEMV_MMA). Raises ValueError on an
    unknown value or type name."""
    v = GEMV_MMA.strip().lower()
    if v in ("", "0"):
        return frozenset()
    if v == "1":
        return frozenset(MMA_TYPES)
    by_name = {n: t for t, n in MMA_TYPES.items()}
    names = [n.strip() for n in v.split(",")]
    bad = [n for n in names if n not in by_name]
    if bad:
        raise ValueError(f"GGUF_HARNESS_GEMV_MMA={GEMV_MMA!r}: expected 0, 1 or names of "
                         f"{', '.join(MMA_TYPES.values())}")
    return frozenset(by_name[n] for n in names)


def mma_defines() -> tuple[str, ...]:
    """Preprocessor defines of the gemv_mma.cu build (MMA_WARPS, MMA_UNROLL, MMA_MINB from their
    switches; unset: the kernel's defaults). Raises ValueError on a value outside the allowed, and
    on a MINB that leaves fewer than 64 registers per thread."""
    out = module.switch_defines((
        ("GGUF_HARNESS_GEMV_MMA_WARPS", GEMV_MMA_WARPS, "MMA_WARPS", (4, 8, 16)),
        ("GGUF_HARNESS_GEMV_MMA_UNROLL", GEMV_MMA_UNROLL, "MMA_UNROLL", (1, 2, 3, 4)),
        ("GGUF_HARNESS_GEMV_MMA_MINB", GEMV_MMA_MINB, "MMA_MINB", (1, 2, 3, 4))))
    warps = int(GEMV_MMA_WARPS or MMA_WARPS_DEFAULT)
    # minBlocks x threads caps ptxas at 65536 / that registers: below 64 the v11 loops spill
    # (they use 69-120 uncapped, NVRTC 13.0 sm_90)
    if 65536 // (warps * 32 * int(GEMV_MMA_MINB or 2)) < 64:
        raise ValueError(f"GGUF_HARNESS_GEMV_MMA_MINB={GEMV_MMA_MINB or 2} with {warps} warps per block caps "
                         "registers below 64 (spills)")
    return out


def mma_smem(K: int) -> int:
    """Dynamic shared memory (bytes) of a v11 kernel for input length K (kernels/gemv_mma.cu
    stage_x8: codes 2 K, 64 zero bytes, block scales and scaled sums 2 x K / 8)."""
    return 2 * K + 64 + K // 4


def mma_tiles(mode: str, rows_per_seg: list[int]) -> int:
    """16-row tiles of a node: per segment ceil(rows / 16) (a gate/up pair: its gate rows')."""
    rows = rows_per_seg[:1] if mode == "swiglu" else rows_per_seg
    return sum(math.ceil(r / TILE_ROWS) for r in rows)


def mma_kernel_name(mode: str, type_ids, K: int, rows: int) -> str | None:
    """The v11 kernel for a q16 node (mode, its matrices' GGML types, input length K, output rows),
    or None when v11 does not take it: switch off or type not chosen (mma_types), more than one
    type or an F32 row, K not a multiple of 256, rows below GGUF_HARNESS_GEMV_MMA_MIN_ROWS.
    Raises ValueError on bad switch values."""
    chosen = mma_types()
    types = set(type_ids)
    if not chosen or len(types) != 1 or K % 256:
        return None
    t = types.pop()
    if t not in chosen:
        return None
    if GEMV_MMA_MIN_ROWS and not GEMV_MMA_MIN_ROWS.isdigit():
        raise ValueError(f"GGUF_HARNESS_GEMV_MMA_MIN_ROWS={GEMV_MMA_MIN_ROWS!r}: expected an integer")
    if rows < int(GEMV_MMA_MIN_ROWS or 0):
        return None
    return f"gemvmma_{mode}_{MMA_TYPES[t]}"


def gemv_mma(name: str, mode: str, segs, x, K: int, norm, eps: float, rows: int):
    """The engine v11 node of a checked q16 gemv call (arguments as ops.gemv; rows: the node's
    output rows, a pair's gate rows), or None when v11 does not take it (mma_kernel_name). Grid:
    the resident blocks, at most one per tile (the kernel walks tiles grid-stride). Raises
    ValueError on bad switch values and on weights not aligned as the kernel's loads need."""
    from .formats import ENGINE_TYPES
    kname = mma_kernel_name(mode, [s.w.type_id for s in segs], K, rows)
    if kname is None:
        return None
    for s in segs:
        a = MMA_ALIGN[s.w.type_id]
        if s.w.ptr % a:
            raise ValueError(f"{s.w.name}: {ENGINE_TYPES[s.w.type_id]} weights must be {a}-byte aligned")
    k = module.kernel_in("gemv_mma.cu", kname, mma_defines())
    return tile_node(name, mode, k, segs, segs, x, K, norm, eps, rows, int(GEMV_MMA_WARPS or MMA_WARPS_DEFAULT),
                     min, defines=())


def tile_node(name: str, mode: str, k, segs, table_segs, x, K: int, norm, eps: float, rows: int, warps: int,
              grid_of, keep=(), defines=()):
    """The Node of a 16-row-tile kernel of gemv_mma.cu (v11 mma_body, v12 tcr_body): kernel k, blocks
    of `warps` warps, grid_of(tiles, resident blocks) blocks, stage_x8's shared memory (mma_smem);
    segs: the node's segments (rows, bytes, format); table_segs: the ones whose weight pointers the
    kernel reads (v12: the repacked copies, kept alive by `keep`)."""
    from .executor import Node
    from .formats import ENGINE_TYPES
    from .ops import seg_table_value
    smem = mma_smem(K)
    module.allow_smem(k, smem)
    ntiles = mma_tiles(mode, [s.w.rows for s in segs])
    grid = grid_of(ntiles, module.blocks_per_sm(k, warps * 32, smem) * module.sm_count())
    act = 4 * K * (2 if norm else 1) + 4 * rows * (2 if mode == "add" else 1)
    return Node(name, "gemv", k, (grid,), (warps * 32,),
                (seg_table_value(table_segs), x, np.uint64(norm.ptr if norm else 0), np.float32(eps), np.int32(K),
                 np.int32(ntiles)), smem=smem, bytes=sum(s.w.nbytes for s in segs) + act,
                flops=2 * K * sum(s.w.rows for s in segs), out=segs[0].out,
                fmt="+".join(ENGINE_TYPES[s.w.type_id] for s in segs), keep=list(keep), defines=tuple(defines))
