"""Shared-memory plan of the engine v10 GEMV (kernels/gemv_tma.cu, GGUF_HARNESS_GEMV_TMA=1): how
many super-blocks of each row one pipeline stage holds, and where the stage ring sits.

A block holds stage_xq's x (ops.gemv_smem(K) bytes), then a ring of TMA_NST stages; a stage
holds one chunk of kc super-blocks of each of the block's tile rows (TMA_WARPS x TMA_RPW; a
gate/up pair TMA_WARPS), for NP matrices (2 for a pair). A row chunk's slot is the chunk's bytes rounded up to 16 plus 16 more:
the copy starts at the chunk's address rounded down to 16 and ends rounded up to 16
(gemv_tma.cu header), so it spans at most roundup16(kc * type_size) + 16 bytes.

kc is as large as fits the shared memory left (whole rows when possible: one chunk per row, no
per-chunk barrier round trips); a row in several chunks takes a multiple of 4 super-blocks per
chunk (a warp's 4 lane groups take 4 super-blocks per round, so a chunk of 10 would leave half
the lanes idle in every third round; only the row's last chunk may be short)."""
from __future__ import annotations

from dataclasses import dataclass

TMA_NST = 4      # kernels/gemv_tma.cu TMA_NST
TMA_WARPS = 16   # kernels/gemv_tma.cu TMA_WARPS (consumer warps; the block has one more)
RING_ALIGN = 128
STATIC_RESERVE = 4096  # static shared memory reserved at least: barriers, scratch. An instance with
# more (the IQ3_S ones: kernels/kwide_iq3s.cuh's 16 grid copies, 32960 B in all, session 20) passes
# its own figure as `static`; with 4096 their plan overran the opt-in limit and the launch set-up
# failed (CUDA_ERROR_INVALID_VALUE, the GPU test of session 37).


@dataclass(frozen=True)
class TmaPlan:
    kc: int        # super-blocks per row chunk
    chunks: int    # chunks per row
    slot: int      # bytes per row slot (multiple of 16)
    ring_off: int  # byte offset of the ring in dynamic shared memory
    smem: int      # dynamic shared memory bytes of a block


def _slot(kc: int, type_size: int) -> int:
    return -(-kc * type_size // 16) * 16 + 16


def plan(K: int, type_size: int, pair: bool, x_bytes: int, smem_max: int,
         nst: int = TMA_NST, warps: int = TMA_WARPS, ring_max: int | None = None,
         static: int = 0) -> TmaPlan | None:
    """The plan of a node with input length K (a multiple of 256), super-blocks of `type_size`
    bytes, `pair` True for a gate/up pair, x_bytes of staged x (ops.gemv_smem) and smem_max bytes
    of shared memory per block (module.smem_optin()); nst stages of `warps` tile rows (the build's
    TMA_NST, and TMA_WARPS x TMA_RPW for a store/add node); ring_max: at most this many ring bytes (a small ring lets 2-3 blocks share
    an SM); static: the instance's static shared memory in bytes (the kernel's shared_size_bytes;
    at least STATIC_RESERVE is kept free). The plan's smem + static <= smem_max. None when not
    even one super-block per slot fits. Raises ValueError on K not a
    positive multiple of 256 or a non-positive size."""
    if K <= 0 or K % 256 or type_size <= 0 or x_bytes < 0:
        raise ValueError(f"TMA plan: K={K} (a positive multiple of 256), type_size={type_size}")
    nsb = K // 256
    ring_off = -(-x_bytes // RING_ALIGN) * RING_ALIGN
    slots = nst * (2 if pair else 1) * warps
    per_slot = (smem_max - max(STATIC_RESERVE, static) - ring_off) // slots
    if ring_max is not None:
        per_slot = min(per_slot, ring_max // slots)
    kc = min(nsb, (per_slot - 16) // type_size)
    while kc > 0 and _slot(kc, type_size) > per_slot:
        kc -= 1
    if kc < 1:
        return None
    if kc < nsb and kc >= 4:
        kc -= kc % 4
    chunks = -(-nsb // kc)
    slot = _slot(kc, type_size)
    return TmaPlan(kc, chunks, slot, ring_off, ring_off + slots * slot)
