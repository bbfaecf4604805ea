"""Node builders: each returns executor.Node(s) for one kernel of kernels/*.cu, with the
argument structs packed exactly as the CUDA structs lay them out."""
from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass

import numpy as np

from . import module
from .arena import DeviceTensor
from .argcheck import device_ptr
from .deltanet_ops import check_conv_step
from .executor import Node
from .formats import ENGINE_TYPES, FORMATS, check_type
from .gemv_mma import gemv_mma
from .gemv_tcr import gemv_tcr

WARPS = 4            # rows per GEMV block (kernels/gemv.cu WARPS)
MAX_SEG = 4          # kernels/gemv.cu MAX_SEG
ATT_WARPS = 8        # kernels/attention.cu ATT_WARPS
ARGMAX_BLOCKS = 264  # 2 per SM on a 132-SM H200; grid-stride loop covers any vocab
# GEMV implementation: "q16" (v4, int16 activations + dp2a, kernels/gemv.cu), "f32" (v1-v3,
# fp32 activations, kernels/gemv_f32.cu), kept selectable for same-run A/B measurements, or
# "q8_1" (gemv.cu compiled with -DACT_Q8_1: the activation rounded as llama.cpp's CUDA mmvq
# rounds it, int8 codes with fp16 scale and sum; float weight types take the f32 kernels, as
# llama.cpp multiplies them with unrounded x) for engine-vs-llama.cpp comparisons.
GEMV_IMPL = os.environ.get("GGUF_HARNESS_GEMV", "q16")
GEMV_IMPLS = ("q16", "f32", "q8_1")
FLOAT_TYPES = (0, 1, 30)  # F32, F16, BF16
# Attention: "head" (v6, kernels/attention_head.cu, one 8-warp block per query head and
# context split, head dims 64/128/256), "gqa" (v4/v5, kernels/attention_gqa.cu, one block per
# KV head, <= 8 query heads per KV head) or "v3" (kernels/attention.cu); shapes a kernel does
# not take fall back to v3. Kept selectable for same-run A/B (docs/perf-notes.md, v6).
ATTN_IMPL = os.environ.get("GGUF_HARNESS_ATTN", "head")
GQA_DIMS = (64, 128, 256)
GQA_MAXG = 8         # kernels/attention_gqa.cu MAXG
GQA_WARPS = 4        # kernels/attention_gqa.cu NWARP
HEAD_THREADS = 256   # kernels/attn_split.cuh SPLIT_THREADS
ATTN_FMT = "<8Q5i3f"  # struct AttnArgs (96 bytes)


@dataclass
class Seg:
    """One matrix of a multi-matrix GEMV: weights, optional f32 bias pointer, f32 output."""

    w: DeviceTensor
    out: object          # cupy float32 [rows]
    bias: int = 0


def _device_bytes(data: bytes):
    import cupy as cp
    return cp.asarray(np.frombuffer(data, dtype=np.uint8))


def warps_per_row(K: int) -> int:
    """Warps sharing one row: a warp walks ceil(K/256) groups; more than ~4 groups in one
    warp's serial loop leaves the GEMV latency-bound (measured v1: 19 groups, 15 us/node)."""
    groups = -(-K // 256)
    return 1 if groups <= 4 else (2 if groups <= 8 else 4)


# (warps per block, warps per row) pairs instantiated in kernels/gemv.cu (GEMV_MODES)
GEMV_SHAPES = {(4, 1), (8, 1), (8, 2), (8, 4), (8, 8)}
# q16 GEMV segment table: "value" (kernel parameter, v4) or "pointer" (device memory, v1-v3)
GEMV_ARGS = os.environ.get("GGUF_HARNESS_GEMV_ARGS", "value")
# q16 GEMV row loop of Q4_K, Q5_K, Q6_K and IQ4_XS: "wide" (8 lanes per super-block, 32 weights
# per lane, kernels/kwide.cuh and kwide_iq4.cuh) or "narrow" (8 weights per lane and group,
# qdot.cuh qdot8; IQ4_XS through the non-inlined I-quant call), kept for same-run A/B; read by
# gemv() at call time (set this attribute or the env before building).
# "v9" (engine v9, experimental, kernels/gemv_kq.cu): nodes whose matrices all have one of these
# types and K % 256 == 0 run in 16-warp blocks (kv9_kernel): Q4_K/Q5_K with 4 lanes per super-block
# and two rows per warp (kwide4.cuh), Q6_K/IQ4_XS one warp per row with kwide.cuh's 8 lanes;
# "v9l8" (the default since session 8): every v9 type on the 8-lane rows, row groups of S warps
# (kv9_split); other nodes as "wide". Measured on the H200 (docs/perf-notes.md session 8): the
# 27B decode step 10174 us (wide) -> 8292 (v9) -> 7983 (v9l8), graph replay, same session.
GEMV_KQ = os.environ.get("GGUF_HARNESS_GEMV_KQ", "v9l8")
GEMV_KQ_MODES = ("wide", "narrow", "v9", "v9l8")
KV9_L4_TYPES = (12, 13)  # Q4_K, Q5_K: the gemvkq4_ kernels (2 rows per warp)
KQ_WIDE_TYPES = (12, 13, 14, 23)  # Q4_K, Q5_K, Q6_K, IQ4_XS
KV9_NAMES = {12: "q4_k", 13: "q5_k", 14: "q6_k", 23: "iq4_xs", 21: "iq3_s"}  # kernels/gemv_kq.cu KQ_MODES
IQ3_S = 21
# Q8_0 and Q4_0 rows on v9 (kernels/kwide_q0.cuh, gemvkq_*_q8_0 / _q4_0: lane i of 8 takes block i
# of 8 consecutive blocks; no _p2, TMA or gemvkq4_ kernels): "1" takes store/add/SwiGLU nodes of
# one of these types with K % 256 == 0 (the default since session 13: on the H200, cold back to
# back, [4096x4096] Q8_0 10.29 -> 8.24 us and Q4_0 10.06 -> 4.98 us, x1.10 / x1.46 llama.cpp's
# kernel in the same run; docs/perf-notes.md session 13); "0" leaves them on gemv.cu's per-8 loop
# (qdot8), for A/B. Read by kv9_kernel at call time.
GEMV_KQ_Q0 = os.environ.get("GGUF_HARNESS_GEMV_KQ_Q0", "1")
KV9_Q0_NAMES = {8: "q8_0", 2: "q4_0"}  # kernels/gemv_kq.cu KQ_MODES(T_Q8_0, q8_0), (T_Q4_0, q4_0)
# IQ3_S rows on v9 (kernels/kwide_iq3s.cuh, gemvkq_*_iq3_s): "1" (the default since session 9:
# [5120x17408] 52.2 -> 32.2 us, the 27B decode step 7955 -> 7469 us, docs/perf-notes.md "v9
# IQ3_S rows"); "0" keeps IQ3_S nodes on gemv.cu's I-quant loop. Read by kv9_kernel at call time.
GEMV_KQ_IQ3S = os.environ.get("GGUF_HARNESS_GEMV_KQ_IQ3S", "1")
# A/B of where those rows read the IQ3_S grid: "" the kernel's default (16 copies in shared
# memory since session 20: the 27B's IQ3_S gate/up -13 %), or N = 0 (the global table), 1, 2, 4, 8,
# 16 shared-memory copies, 32 (64 KiB at the start of the dynamic shared memory, before x;
# kv9_iq3s_dyn_bytes; session 21: the 27B's IQ3_S gate/up -1.4 to -1.5 %, not made the default for
# 64 KiB of shared memory per block): gemv_kq.cu built
# with -DKQ_IQ3S_GRID=N (its own NVRTC compile and CuPy cache entry; kv9_iq3s_defines).
GEMV_KQ_IQ3S_GRID = os.environ.get("GGUF_HARNESS_GEMV_KQ_IQ3S_GRID", "")
KQ_IQ3S_GRIDS = ("0", "1", "2", "4", "8", "16", "32")  # 32: dynamic shared memory (kv9_iq3s_dyn_bytes)
KV9_WARPS = 16  # kernels/gemv_kq.cu KQ_BLOCK_WARPS (the default; kv9_warps() for the build's)
# v9 warps per row group (kernels/gemv_kq.cu S, the kernel name's _s2 / _s4): "auto" (kv9_split)
# or a forced 1, 2 or 4 for every v9 node (same-run A/B); read by gemv() at call time.
GEMV_KQ_SPLIT = os.environ.get("GGUF_HARNESS_GEMV_KQ_SPLIT", "auto")
# A store/add node whose matrices have several v9 types (the 27B's attention qkv: Q4_K q+gate,
# Q6_K k and v; 16 x 27.7 us on gemv.cu at 1595 GB/s, docs/perf-notes.md session 9): "split"
# (the default) makes it one v9 launch per type (gemv_nodes); "one" keeps one gemv.cu launch
# (A/B). Measured on the H200 (session 10): 27B ud-q4_k_m decode step 7468 -> 7396 us (-1.0 %;
# the default twice within 0.1 %), although each launch stages x again.
GEMV_KQ_MIXED = os.environ.get("GGUF_HARNESS_GEMV_KQ_MIXED", "split")
KV9_SPLITS = (1, 2, 4)
# Engine v10 (kernels/gemv_tma.cu, tma_plan.py): "1" sends every node v9 would take, except those
# with F32 rows, through the TMA-fed kernels (weights copied into a shared-memory ring by a
# producer warp; one persistent block per SM); "" (default) keeps v9. A/B, written in session 10.
GEMV_TMA = os.environ.get("GGUF_HARNESS_GEMV_TMA", "")
# ... only for nodes with K >= this (GGUF_HARNESS_GEMV_TMA_MIN_K; "" = every K). Why: the first
# H200 sweep (session 10) had v10 faster on the K = 17408 / 6144 shapes (-4 to -13 %) and slower
# on the K = 5120 ones (+1 to +9 %).
GEMV_TMA_MIN_K = os.environ.get("GGUF_HARNESS_GEMV_TMA_MIN_K", "")
# v10 builds (kernels/gemv_tma.cu TMA_NST stages, TMA_WARPS consumer warps, TMA_MINB minBlocks) and
# the most ring bytes per block (GGUF_HARNESS_GEMV_TMA_RING): "" = the defaults (4, 16, 1, as much
# as fits). A/B for a ring that leaves room for neighbouring kernels' blocks (docs/perf-notes.md
# session 10), e.g. NST=2 WARPS=8 MINB=2 RING=65536.
GEMV_TMA_NST = os.environ.get("GGUF_HARNESS_GEMV_TMA_NST", "")
GEMV_TMA_WARPS = os.environ.get("GGUF_HARNESS_GEMV_TMA_WARPS", "")
GEMV_TMA_MINB = os.environ.get("GGUF_HARNESS_GEMV_TMA_MINB", "")
GEMV_TMA_RING = os.environ.get("GGUF_HARNESS_GEMV_TMA_RING", "")
# rows per consumer warp of store/add nodes (TMA_RPW: "" or 1, or 2 = two rows sharing each round's x)
GEMV_TMA_RPW = os.environ.get("GGUF_HARNESS_GEMV_TMA_RPW", "")
# ... and blocks per SM in the grid (GGUF_HARNESS_GEMV_TMA_BPS, "" = as many as are resident): 1 with
# a small ring leaves an SM's remaining registers and shared memory to the neighbouring kernels
GEMV_TMA_BPS = os.environ.get("GGUF_HARNESS_GEMV_TMA_BPS", "")
# v9 rounds whose loads are in flight together (kernels/gemv_kq.cu KQ_UNROLL, default 2): "" keeps
# the default build; a number selects a build with -DKQ_UNROLL=N (same-run A/B of memory-level
# parallelism: bytes in flight per SM are at the Little's-law edge, docs/perf-notes.md session 8).
GEMV_KQ_UNROLL = os.environ.get("GGUF_HARNESS_GEMV_KQ_UNROLL", "")
# the same for the gate/up pairs (kq_row2, KQ2_UNROLL, default 1)
GEMV_KQ2_UNROLL = os.environ.get("GGUF_HARNESS_GEMV_KQ2_UNROLL", "")
# minBlocks of every 8-lane v9 instance (KQ_MINB; unset: the kernel's default 2, measured best in
# session 10; 0: session 9's default, none at S = 1 and 2 at S > 1), A/B
GEMV_KQ_MINB = os.environ.get("GGUF_HARNESS_GEMV_KQ_MINB", "")
# KQ_MINB_IQ3S: when set, the same for every IQ3_S instance (kernels/gemv_kq.cu kKqMinBlocks; A/B).
# Unset: KQ_MINB's for the IQ3_S store/add instances, none for the IQ3_S SwiGLU ones (the default
# since session 12: the 27B IQ3_S gate/up nodes -5.3 %, the step -0.3 % twice; with 0 the gate/up
# instance keeps its 57 registers, the store/add ones spill 20 bytes under ptxas 13.0).
GEMV_KQ_MINB_IQ3S = os.environ.get("GGUF_HARNESS_GEMV_KQ_MINB_IQ3S", "")
# L2 prefetch of the row KQ_PF grid strides ahead at the start of each row (KQ_PF; unset: 0, none
# beyond each warp's first row). A/B only: measured slower (docs/perf-notes.md session 9).
GEMV_KQ_PF = os.environ.get("GGUF_HARNESS_GEMV_KQ_PF", "")
# KQ_PIPE=1: kq_row / kq_row2 issue round n + 1's loads (super-block header and qs) before round
# n's dots, a register rotation (the default build's loop has ptxas pipeline only the qs loads:
# each iteration waits for its headers; docs/perf-notes.md session 9); 2: also the warp's next
# row's first round during this row's last one. A/B builds, not yet run on a GPU.
GEMV_KQ_PIPE = os.environ.get("GGUF_HARNESS_GEMV_KQ_PIPE", "")
# KQ_L1PF=D: each warp asks L1 (prefetch.global.L1, no registers held) for the bytes of its round
# D rounds ahead, into the next row at a row's end. A/B build, not yet run on a GPU; ptxas gives
# its S = 1 instances 77-87 registers unless GGUF_HARNESS_GEMV_KQ_MINB=2 caps them (no spills).
# 8-lane rows only (GEMV_KQ=v9's 4-lane Q4_K/Q5_K kernels ignore it); not with KQ_PIPE.
GEMV_KQ_L1PF = os.environ.get("GGUF_HARNESS_GEMV_KQ_L1PF", "")
# KQ_P2: store/add nodes of the listed types ("1": every 8-lane type; or names, e.g. "q4_k,iq4_xs")
# with two adjacent rows per warp, every lane on both (kernels/gemv_kq.cu KQP2, names ..._p2). A/B
# build; static SASS count per 32 weights and row: Q4_K 99 -> 84.5, Q5_K 122 -> 111.5, IQ4_XS
# 132 -> 121, Q6_K 136.5 -> 134.5, IQ3_S 146 -> 148. Measured in session 11: the head -11 %, Q4_K
# [10240x5120] +7 %, [1024x5120] Q6_K +35 % (docs/perf-notes.md).
# Default since session 12: q6_k with K <= 6144 (the output head -11 %, qkv.q6_k -6 %; the 27B
# step -0.66 %, -0.69 %, -0.77 % in three same-session A/Bs, docs/perf-notes.md sessions 11-12);
# "0" or "" turns P2 off.
GEMV_KQ_P2 = os.environ.get("GGUF_HARNESS_GEMV_KQ_P2", "q6_k")
# KQ_P2_MAX_K=N: the _p2 kernels only for nodes with K <= N (session 11's 27B nodes: P2 gained on
# the K = 5120 / 6144 Q5_K and Q6_K nodes, the head -11.5 %, and lost on the K = 17408 ffn_down).
# Default 6144 (with the default P2 types); "" = every K.
GEMV_KQ_P2_MAX_K = os.environ.get("GGUF_HARNESS_GEMV_KQ_P2_MAX_K", "6144")
# KQ_P2_MIN_ROWS=N: the _p2 kernels only for nodes of >= N rows. Why: two rows per warp halve the
# row groups, and a [1024 x 5120] node then has 64 blocks of 16 warps for 132 SMs (the 2-round rule
# keeps S <= 2 at K = 5120): [1024x5120] Q6_K took 6.06 us with P2 against 4.36 without (session
# 14, same run, cold back to back), while the 27B's 2048-row qkv.q6_k node gained 6 % with P2
# (session 11). Default 2048; "" = every row count.
GEMV_KQ_P2_MIN_ROWS = os.environ.get("GGUF_HARNESS_GEMV_KQ_P2_MIN_ROWS", "2048")
# KQ_XLANE: the 8-lane Q4_K / Q5_K / Q6_K rows read x from lane-major records (kernels/kwide.cuh
# XLANE: one base address, 5 LDS.128 per round instead of 8 loads from re-derived slot addresses;
# static SASS of the store loops -18 to -25 %), bitwise equal outputs. "1" or unset: gemv_kq.cu's
# default since session 13 (H200, cold back to back: Q4_K [10240x5120] -3.6 %, Q5_K [5120x17408]
# -3.4 %, Q6_K -2.8 to -8.6 %, the output head -5.6 %; docs/perf-notes.md); "0": the build with
# -DKQ_XLANE=0 (the xq_slot staging, for A/B).
GEMV_KQ_XLANE = os.environ.get("GGUF_HARNESS_GEMV_KQ_XLANE", "1")
# IQ4_XIL: IQ4_XS rows of v9 / v10 with x staged in interleaved halves (kernels/kwide_iq4.cuh), two
# fewer prmt per 8 weights, results bitwise equal to the default build's (the RMSNorm's sum of
# squares and the F32 rows of a node (gemv_kq.cu f32_row) keep the natural order). The default
# since session 11 (the 27B step -2.4 %); "0" (or "") gives the natural-order build back.
GEMV_IQ4_XIL = os.environ.get("GGUF_HARNESS_GEMV_IQ4_XIL", "1")
# IQ4_KREG: the v9 IQ4_XS rows hold the iq4nl codebook words K0 / K2 in registers
# (kernels/kwide_iq4.cuh IQ4_KREG; without it ptxas re-makes one before each lookup). "1" or unset:
# gemv_kq.cu's default since session 14 (H200: 2x[17408x5120] IQ4_XS 36.1 -> 35.7 us, the 27B step
# -0.3 %; docs/perf-notes.md); "0": the build with -DIQ4_KREG=0 (A/B). Bitwise equal outputs.
GEMV_IQ4_KREG = os.environ.get("GGUF_HARNESS_GEMV_IQ4_KREG", "1")
# KQ_F32_XPERM: F32 rows beside Q4_K / Q5_K / Q6_K ones (qwen35's ssm_in) read the lane records in a
# conflict-free lane order (kernels/gemv_kq.cu f32_row). "1": that build (A/B, written in session
# 14, not yet run on a GPU); "0" or unset: the default. Not bitwise equal (other partial sums).
GEMV_KQ_F32_XPERM = os.environ.get("GGUF_HARNESS_GEMV_KQ_F32_XPERM", "0")
# KQ_WMAJ: v9 row groups dealt warp-major over the grid (kernels/gemv_kq.cu KQ_WMAJ), so a partial
# last grid-stride pass is spread over every block instead of filling the first blocks. "1": that
# build (A/B, written in session 15); "0" or unset: block-major. Bitwise equal outputs.
GEMV_KQ_WMAJ = os.environ.get("GGUF_HARNESS_GEMV_KQ_WMAJ", "0")
# KQ_BW: warps per v9 block (kernels/gemv_kq.cu KQ_BLOCK_WARPS): "16" or unset the default (two
# blocks per SM), "32" one block of 32 warps per SM for every node (A/B, session 15). Not bitwise
# equal on nodes with a fused RMSNorm (block_sum adds 32 warps' partials); the Q6_K S > 1 instances
# spill 4-8 bytes at 32 warps (ptxas 13.0).
GEMV_KQ_BW = os.environ.get("GGUF_HARNESS_GEMV_KQ_BW", "")
# KQ_CSPLIT: v9 store/add nodes of split S > 1 without a fused norm run the cluster-split kernels
# (kernels/gemv_kq.cu KQ_CSPLIT: the S parts of a row group in the S blocks of a group, each
# staging only its part of x; kv9_csplit). "1": on, groups of S blocks (the default since session
# 18, with KQ_GSPLIT's groups below); "2": on, groups of at most 2 blocks (an S = 4 node runs as 2
# parts; the default of sessions 16-17 with hardware clusters: H200, session 16, only 61-62
# clusters of 4 were resident, 248 of 264 block slots, and one cluster ran as a second wave; the 27B
# step 6673.0 -> 6463.4 us, -3.1 %, decode x1.67 -> x1.72 llama.cpp); "0": off. Bitwise equal
# outputs to the _s<group size> kernels (the same partial sums, added in the same order), except
# at 4 parts with the leftover rotation (KQ_PART_ROT below; GGUF_HARNESS_GEMV_KQ_PART_ROT=0). The
# latency A/B builds (GGUF_HARNESS_GEMV_KQ_PF / _PIPE / _L1PF) keep the S-split kernels (their
# prefetch and carry code has not run in cluster form), and a cluster build never has KQ_WMAJ
# (block-major groups only). Unset or "": the default (1).
GEMV_KQ_CSPLIT = os.environ.get("GGUF_HARNESS_GEMV_KQ_CSPLIT", "1")
KQ_CS_MAXR = 8  # kernels/gemv_kq.cu KQ_CS_MAXR: grid-stride rounds a cluster-split warp may have (ops.gemv
# bounds it: the kernel keeps the partial sums of that many rounds; a test ties the two values)
# The types whose nodes take it: the ones measured faster (H200, session 16, cold back to back,
# clusters of 2: [5120x17408] Q4_K -2.5 %, Q5_K -5.4 %, [5120x6144] Q5_K -9.1 %); measured slower:
# [5120x17408] Q6_K +3.1 %, IQ3_S +5.3 %, [1024x5120] Q6_K +7 %; the others not measured.
KV9_CSPLIT_TYPES = ("q4_k", "q5_k")
# KQ_GSPLIT: the cluster-split kernels without hardware clusters (kernels/gemv_kq.cu KQ_GSPLIT):
# blocks CS q .. CS q + CS - 1 exchange their parts' sums through global memory and the last of
# them to finish adds and stores, so every block slot is used. "4" or unset (the default since
# session 19): groups of 4 only, groups of 2 as hardware clusters; "1": every cluster-split node
# (session 18's default); "0": hardware clusters (__cluster_dims__) for all. Bitwise equal outputs
# either way, but under the round key of the leftover rotation (KQ_PART_ROT=1) the 4-part nodes'
# bits follow the grid's group count, which differs between the two (the default row key's do not). Measured (H200, session 19, same machine start): "4" against "1" the step 6311.1
# against 6333.1 / 6343.5 us, ssm_out and attn_output -7.1 % each, the rest the same.
# Measured (H200, session 18, 27B c = 2048, `harness bench nodes`, same machine start, two
# pairs): with GGUF_HARNESS_GEMV_KQ_CSPLIT=1 the step 6345.2 / 6343.0 (clusters of 2, the old
# default) -> 6302.5 / 6303.1 us (-0.65 %): ffn_down Q4_K / Q5_K (4 parts) -1.7 / -2.0 %, but the
# 2-part ssm_out / attn_output +7.7 % (hence "4"); with clusters of at most 2 (CSPLIT=2) the step
# +1.0 % (ffn_down +3.3 % as 2 parts in global memory).
GEMV_KQ_GSPLIT = os.environ.get("GGUF_HARNESS_GEMV_KQ_GSPLIT", "4")
KQ_GS_MAXCB = 512  # kernels/gemv_kq.cu KQ_GS_MAXCB: virtual clusters a KQ_GSPLIT grid may have


# KQ_WIDE_MIN_ROWS: v9 nodes of at least this many output rows whose split is 1 (kv9_split with
# the default blocks) run the "wide" build: one block of 32 warps per SM and warp-major row groups
# (kernels/gemv_kq.cu KQ_BLOCK_WARPS=32 + KQ_WMAJ=1; kv9_wide_defines). Why (H200, session 15,
# cold back to back, same machine start): 2x[17408x5120] IQ4_XS 35.86 -> 33.69 us, the Q6_K head
# 268.75 -> 261.44, while the S > 1 rows lost 1.2-27 % with it (several of those instances spill
# at 32 warps, so the cause is mixed), hence a per-node choice. The 27B's wide nodes: gate/up
# (17408 rows), ssm_in (16480), qkv.q4_k (12288) and the head (248320); the step 6945.6 -> 6683.2
# us (-3.8 %). Unset or "": KV9_WIDE_MIN_ROWS, the default since session 15; "off": never; an
# integer: that threshold (below 8192 not measured: split-1 [5120x6144] Q6_K and [4096x4096] Q8_0
# were 1-3 % faster wide in the kernel table). Not bitwise equal to the 16-warp build on nodes with
# a fused RMSNorm (block_sum adds the sum of squares over 32 warps' partials, not 16).
KV9_WIDE_MIN_ROWS = 8192
GEMV_KQ_WIDE_MIN_ROWS = os.environ.get("GGUF_HARNESS_GEMV_KQ_WIDE_MIN_ROWS", "")


def kv9_wide(rows: int, split: int) -> bool:
    """Whether a v9 node of `rows` output rows at split `split` takes the wide build
    (GGUF_HARNESS_GEMV_KQ_WIDE_MIN_ROWS); ValueError on a value other than "", "off" or a
    non-negative integer."""
    v = GEMV_KQ_WIDE_MIN_ROWS
    if v == "off":
        return False
    if v and not v.isdigit():
        raise ValueError(f"GGUF_HARNESS_GEMV_KQ_WIDE_MIN_ROWS={v!r}: expected a row count or off")
    return split == 1 and rows >= (int(v) if v else KV9_WIDE_MIN_ROWS)


def kv9_wide_defines(defines: tuple[str, ...]) -> tuple[str, ...]:
    """The gemv_kq.cu defines of the wide build: `defines` (kv9_defines() + ...) with 32 warps per
    block and warp-major row groups in place of their own settings of those two."""
    keep = tuple(d for d in defines if not d.startswith(("KQ_BLOCK_WARPS=", "KQ_WMAJ=")))
    return keep + ("KQ_BLOCK_WARPS=32", "KQ_WMAJ=1")


# KQ_DQ: wide SwiGLU nodes whose kernel is an 8-lane one-row-per-warp one take their rows from a
# counter in shared memory per block instead of a fixed warp-major stride (kernels/gemv_kq.cu
# KQ_DQ, kq_dq_body; kv9_dq). Unset or "1": the SwiGLU pairs (the 27B's gate/up), the default since
# session 17; "all": also the store/add nodes (ssm_in, qkv.q4_k); "0": off, the warp-major wide
# build. Outputs bitwise equal to the wide build's either way (with P 1). Measured (H200, session
# 17, 27B c = 2048): with "all" the step 6428.7 / 6430.8 / 6428.0 -> 6402.5 us (-0.4 %), per node
# group gate/up 2268.2 -> 2209.0 us (-2.6 %) but ssm_in 1019.1 -> 1074.0 (+5.4 %) and qkv.q4_k
# 180.6 -> 188.1 (+4 %), hence the SwiGLU pairs only (that routing's step not measured: expected
# ~-60 us); cold back to back, same machine start, [10240x5120] Q4_K 12.58 / 12.53 -> 12.17 us, the
# 2x[17408x5120] IQ4_XS pair 33.85 / 33.58 -> 32.87. Its A/B defines:
# GGUF_HARNESS_GEMV_KQ_DQ_P (1, 2 or 4; unset: the kernel's 1): the block's last rows split into
# that many parts, each the _s<P> kernel's part, so those rows equal the _s<P> kernel's, not the
# wide build's (measured slower, session 17: docs/perf-notes.md); GGUF_HARNESS_GEMV_KQ_DQ_T
# (1..32; unset 32): the most split rows per block (no effect at P 1); GGUF_HARNESS_GEMV_KQ_DQ_MAP
# (0 or 1; unset: the kernel's 1): 1 gives block b the rows b, b + B, ..., 0 a contiguous range
# (with 0 the 27B's ssm_in put its 96 F32 rows into its last block: that node +61 %).
# KQ_XPF: every v9 GEMV node's warps, once their rows are done, ask L2 for the first bytes of the
# rows the next v9 node takes first (kernels/gemv_kq.cu xpf_tail; backends/engine/xpf.py links the
# nodes). A number of MiB (1..32): the most bytes per next node; "" or "0": off. A/B, measured
# slower (H200, session 18, the 27B step +1.9 % at 8 MiB, +3.5 % at 16: every node grew more than
# the gap between nodes shrank). Bitwise equal outputs (prefetches only; GPU test passed).
GEMV_KQ_XPF = os.environ.get("GGUF_HARNESS_GEMV_KQ_XPF", "")


def kv9_xpf_bytes() -> int:
    """Bytes of the next node's rows a v9 node prefetches (GGUF_HARNESS_GEMV_KQ_XPF MiB; 0 = off).
    ValueError unless "", 0 or an integer 1..32."""
    v = GEMV_KQ_XPF
    if v in ("", "0"):
        return 0
    if not (v.isascii() and v.isdigit()) or not 1 <= int(v) <= 32:  # 32 MiB: well inside the 50-60 MB L2
        raise ValueError(f"GGUF_HARNESS_GEMV_KQ_XPF={v!r}: expected MiB 1..32, or 0")
    return int(v) << 20


# KQ_PF0: where a v9 GEMV's warps ask L2 for their first row (kernels/gemv_kq.cu KQ_PF0): "3" or
# unset before the PDL wait but only the row's first round (the default since session 25), "1"
# before the wait the whole row (the default before), "0" never, "2" right after the wait (A/Bs
# of session 23). Session 24's "3w" (3 in the wide and queue builds only) lost to 3 on the 27B step
# (session 25: first replay samples 6111.0 / 6112.2 against 6097.1 / 6096.8 us) and is gone.
# Unset or empty reads as the default's value ("3"), so results record which prefetch ran
# (switches.effective), whatever the default was when they ran.
GEMV_KQ_PF0 = os.environ.get("GGUF_HARNESS_GEMV_KQ_PF0") or "3"
# KQ_PF0_SB: with KQ_PF0 3, how much of the row that first prefetch asks for: its first SB x parts
# super-blocks (1..16; unset "8": each part's first two rounds, the kernel's default since session
# 26 (the 27B step -0.35 % against 4); "4" each part's first round, session 25's default; other values
# are whole rounds of every part only as multiples of 4; below 4, on a split row, the first rounds of
# the first SB x parts / 4 parts only: part p's first round is super-blocks 4p..4p+3).
GEMV_KQ_PF0_SB = os.environ.get("GGUF_HARNESS_GEMV_KQ_PF0_SB") or "8"
# KQ_PRE: "1" each v9 warp loads its first row's first round into registers before the PDL wait
# (kernels/gemv_kq.cu KQ_PRE; bitwise equal; A/B, measured slower in session 26: the 27B step
# +0.7 %); "0" or unset: not (the default).
GEMV_KQ_PRE = os.environ.get("GGUF_HARNESS_GEMV_KQ_PRE") or "0"  # (empty reads as "0", as PF0 / PF0_SB)


# KQ_CONV: qwen35's ssm_in node also runs its layer's causal conv (kernels/gemv_kq.cu KQ_CONV), so
# the conv node goes (qwen35._deltanet). "1": on (A/B, measured slower: H200, session 18, the 27B
# step +5.1 %, ssm_in +33 %); "0" or unset: off. Bitwise equal outputs and states (GPU test passed).
GEMV_KQ_CONV = os.environ.get("GGUF_HARNESS_GEMV_KQ_CONV", "0")


GEMV_KQ_DQ = os.environ.get("GGUF_HARNESS_GEMV_KQ_DQ", "1")
GEMV_KQ_DQ_P = os.environ.get("GGUF_HARNESS_GEMV_KQ_DQ_P", "")
GEMV_KQ_DQ_T = os.environ.get("GGUF_HARNESS_GEMV_KQ_DQ_T", "")
GEMV_KQ_DQ_MAP = os.environ.get("GGUF_HARNESS_GEMV_KQ_DQ_MAP", "")


def kv9_dq(kname: str) -> bool:
    """Whether a wide node (kv9_wide) whose v9 kernel is `kname` runs the queue build
    (GGUF_HARNESS_GEMV_KQ_DQ): 8-lane kernels of one row per warp at split 1 (gemvkq_, not _p2, no
    _s<S> suffix), SwiGLU ones unless the switch is "all" (off at "0"), and no latency A/B build
    (GGUF_HARNESS_GEMV_KQ_PF / _PIPE / _L1PF: their code is not in the queue loop). ValueError on a
    GGUF_HARNESS_GEMV_KQ_DQ other than "", 0, 1 or all, a _DQ_MAP other than "", 0 or 1, a _DQ_P
    other than "", 1, 2 or 4, a _DQ_T other than "" or 1..32."""
    if GEMV_KQ_DQ not in ("", "0", "1", "all"):
        raise ValueError(f"GGUF_HARNESS_GEMV_KQ_DQ={GEMV_KQ_DQ!r}: expected 0, 1 or all")
    _switch01("GGUF_HARNESS_GEMV_KQ_DQ_MAP", GEMV_KQ_DQ_MAP)
    if GEMV_KQ_DQ_P not in ("", "1", "2", "4"):
        raise ValueError(f"GGUF_HARNESS_GEMV_KQ_DQ_P={GEMV_KQ_DQ_P!r}: expected 1, 2 or 4")
    if GEMV_KQ_DQ_T and not (GEMV_KQ_DQ_T.isascii() and GEMV_KQ_DQ_T.isdigit() and 1 <= int(GEMV_KQ_DQ_T) <= 32):
        raise ValueError(f"GGUF_HARNESS_GEMV_KQ_DQ_T={GEMV_KQ_DQ_T!r}: expected 1..32")
    return (GEMV_KQ_DQ != "0" and not (GEMV_KQ_PF or GEMV_KQ_PIPE or GEMV_KQ_L1PF)
            and kname.startswith("gemvkq_") and "_p2" not in kname and not kname[-3:-1] == "_s"
            and (GEMV_KQ_DQ == "all" or kname.startswith("gemvkq_swiglu_")))


def kv9_dq_defines(defines: tuple[str, ...]) -> tuple[str, ...]:
    """The gemv_kq.cu defines of the queue build: `defines` (a wide build's) without KQ_WMAJ (the
    queue deals each block its own rows), plus KQ_DQ=1 and whichever of KQ_DQ_P, KQ_DQ_T and
    KQ_DQ_MAP are set (GGUF_HARNESS_GEMV_KQ_DQ_P / _T / _MAP)."""
    return (tuple(d for d in defines if not d.startswith("KQ_WMAJ=")) + ("KQ_DQ=1",)
            + tuple(f"{d}={int(v)}" for d, v in (("KQ_DQ_P", GEMV_KQ_DQ_P), ("KQ_DQ_T", GEMV_KQ_DQ_T),
                                                  ("KQ_DQ_MAP", GEMV_KQ_DQ_MAP)) if v))  # int: "08" is no C literal


def kv9_csplit(kname: str, mode: str, split: int, normed: bool, f32_rows: bool = False) -> str | None:
    """The cluster-split kernel (kernels/gemv_kq.cu KQ_CSPLIT build) that replaces the v9 kernel
    `kname` of a node at split `split` when GGUF_HARNESS_GEMV_KQ_CSPLIT is 1 (or unset: the default)
    or 2 and
    no latency A/B build (GGUF_HARNESS_GEMV_KQ_PF / _PIPE / _L1PF) is set, else None: only 8-lane
    store/add kernels of one row per warp (gemvkq_, not _p2) of a KV9_CSPLIT_TYPES type (Q4_K,
    Q5_K), split 2 or 4, without a fused norm and without F32 rows beside (`f32_rows`: f32_row
    walks a whole row in every block, not a part's super-blocks)
    (`normed`: the cluster's blocks stage disjoint parts of x, so none sees every square).
    gemvkq_<mode>_<type>_s<S> -> gemvkq_<mode>_<type>_c<S> (switch 2: _c2 for S = 4 too). ValueError
    on a switch value other than "", 0, 1 or 2. The caller also bounds the rounds per warp (KQ_CS_MAXR)."""
    if GEMV_KQ_CSPLIT not in ("", "0", "1", "2"):  # "": the default, 1
        raise ValueError(f"GGUF_HARNESS_GEMV_KQ_CSPLIT={GEMV_KQ_CSPLIT!r}: expected 0, 1 or 2")
    if (GEMV_KQ_CSPLIT == "0" or GEMV_KQ_PF or GEMV_KQ_PIPE or GEMV_KQ_L1PF
            or split not in (2, 4) or mode not in ("store", "add") or normed or f32_rows
            or not any(f"_{t}_s" in kname for t in KV9_CSPLIT_TYPES)
            or not kname.startswith("gemvkq_") or "_p2" in kname or not kname.endswith(f"_s{split}")):
        return None
    return kname[: -len(f"_s{split}")] + f"_c{min(split, 2 if GEMV_KQ_CSPLIT == '2' else 4)}"


def kv9_gsplit(cs: int) -> bool:
    """Whether a cluster-split node of `cs` parts (2 or 4) runs its parts as a group of blocks
    meeting in global memory rather than a hardware cluster (GGUF_HARNESS_GEMV_KQ_GSPLIT: 1 every
    group, "" or 4 (the default since session 19) groups of 4 only, 0 none; kernels/gemv_kq.cu
    KQ_GSPLIT). ValueError on another switch value."""
    if GEMV_KQ_GSPLIT not in ("", "0", "1", "4"):
        raise ValueError(f"GGUF_HARNESS_GEMV_KQ_GSPLIT={GEMV_KQ_GSPLIT!r}: expected 0, 1 or 4")
    return GEMV_KQ_GSPLIT == "1" or (GEMV_KQ_GSPLIT in ("", "4") and cs == 4)


# KQ_PART_ROT (kernels/gemv_kq.cu kq_row_part): the 4-part group / cluster kernels hand a row's
# leftover groups of 4 super-blocks (K / 1024 mod 4) to part (m + key) mod 4 instead of part m, so
# the blocks of a [5120x17408] node read 4.25 groups per row each rather than 5 in part 0 (the
# 27B's ffn_down Q4_K -2.2 to -2.6 %, session 20). "" or "row" (KQ_PART_ROT=2, the default since
# session 21): keyed by the row group, so the _c4 kernels' sums do not depend on the grid, with an
# odd group count where that costs no round (gemv, kv9_odd_groups; where the count stays even it
# rotates less); as fast as the round key (session 21: step and ffn_down SAME). "round" or "1"
# (KQ_PART_ROT=1, session 20's default): keyed by the warp's round (sums depend on the grid's group
# count). "0": part m (session 19's sums, the _s4 kernels' bit for bit; kv9_csplit_defines).
GEMV_KQ_PART_ROT = os.environ.get("GGUF_HARNESS_GEMV_KQ_PART_ROT", "row")  # (results record "row")

# KQ_GS_FENCE (kernels/gemv_kq.cu): how a KQ_GSPLIT block publishes its parts; "1" or "" (the
# default since session 19): one fence by thread 0 after the barrier (the cooperative-groups
# grid-sync form), "0": a fence in every thread before it (session 18's). Same values either way.
GEMV_KQ_GS_FENCE = os.environ.get("GGUF_HARNESS_GEMV_KQ_GS_FENCE", "1")


def kv9_csplit_defines(defines: tuple[str, ...], cs: int) -> tuple[str, ...]:
    """The gemv_kq.cu defines of the cluster-split build of a node of `cs` parts: `defines`
    (kv9_defines() + ...) without KQ_WMAJ (the cluster kernels deal row groups block-major), plus
    KQ_CSPLIT=1, and KQ_GSPLIT=1 when kv9_gsplit(cs) (with KQ_GS_FENCE=0 when
    GGUF_HARNESS_GEMV_KQ_GS_FENCE is 0; the kernel's default is 1), and KQ_PART_ROT=0 when
    GGUF_HARNESS_GEMV_KQ_PART_ROT is 0 and KQ_PART_ROT=1 when it is "round" or 1, for cs == 4 only
    (the kernel's default is 2, the row key; only the 4-part kernels read it, so other builds stay
    the default's and compile once). ValueError on a _GS_FENCE other than "", 0 or 1 and as kv9_part_rot."""
    _switch01("GGUF_HARNESS_GEMV_KQ_GS_FENCE", GEMV_KQ_GS_FENCE)
    rot = kv9_part_rot()
    gs = kv9_gsplit(cs)
    return (tuple(d for d in defines if not d.startswith("KQ_WMAJ=")) + ("KQ_CSPLIT=1",)
            + (("KQ_GSPLIT=1",) if gs else ()) + (("KQ_GS_FENCE=0",) if gs and GEMV_KQ_GS_FENCE == "0" else ())
            + ((f"KQ_PART_ROT={rot}",) if rot != 2 and cs == 4 else ()))  # (only the 4-part kernels read it)


def kv9_part_rot() -> int:
    """The KQ_PART_ROT value of GGUF_HARNESS_GEMV_KQ_PART_ROT: "" or "row" -> 2 (the kernel's
    default: the leftover groups rotated by row group), "round" or "1" -> 1 (by the warp's round),
    "0" -> 0 (off). ValueError on another value."""
    rot = {"": 2, "row": 2, "round": 1, "1": 1, "0": 0}.get(GEMV_KQ_PART_ROT)
    if rot is None:
        raise ValueError(f"GGUF_HARNESS_GEMV_KQ_PART_ROT={GEMV_KQ_PART_ROT!r}: expected row, round, 1 or 0")
    return rot


def kv9_odd_groups(groups: int, rows: int, nw: int, K: int) -> int:
    """The group count of a 4-part cluster node of K columns under the row key
    (GGUF_HARNESS_GEMV_KQ_PART_ROT "" or row, the default): `groups` less one when it is even,
    the rows have leftover groups of 4 super-blocks (ceil(K / 256) / 4 groups, not a multiple of
    4), and one fewer group still covers the rows in as many rounds of nw rows per group
    (kernels/gemv_kq.cu kq_row_part: a warp's row groups cb + round ncb take the leftover in part
    (m + cb + round ncb) mod 4, which cycles through every part only for odd ncb); otherwise
    `groups`. When the count stays even (one group fewer would cost a round), the row key rotates
    less than the round key: ncb = 0 mod 4 not at all (each warp's leftover always in one part),
    2 mod 4 over 2 of the 4 parts; a node of one round is not rotated by either key."""
    if kv9_part_rot() != 2 or groups % 2 or groups < 3 or not (-(-K // 256) + 3) // 4 % 4:
        return groups
    return groups - 1 if -(-rows // (nw * (groups - 1))) == -(-rows // (nw * groups)) else groups


def kv9_warps() -> int:
    """Warps per block of the gemv_kq.cu build (GGUF_HARNESS_GEMV_KQ_BW: 16, the default, or 32);
    ValueError on another value."""
    if GEMV_KQ_BW not in ("", "16", "32"):
        raise ValueError(f"GGUF_HARNESS_GEMV_KQ_BW={GEMV_KQ_BW!r}: expected 16 or 32")
    return int(GEMV_KQ_BW or KV9_WARPS)


def _switch01(env: str, value: str) -> None:
    """Refuse a value of the on/off switch `env` other than "", "0" or "1" (ValueError naming it)."""
    if value not in ("", "0", "1"):
        raise ValueError(f"{env}={value!r}: expected 0 or 1")


def kv9_defines() -> tuple[str, ...]:
    """Preprocessor defines of the gemv_kq.cu build (GEMV_KQ_UNROLL -> KQ_UNROLL, GEMV_KQ2_UNROLL
    -> KQ2_UNROLL, GEMV_KQ_MINB -> KQ_MINB, GEMV_KQ_MINB_IQ3S -> KQ_MINB_IQ3S, GEMV_KQ_PF -> KQ_PF,
    GEMV_KQ_PIPE -> KQ_PIPE, GEMV_KQ_L1PF -> KQ_L1PF, GEMV_KQ_P2 -> KQ_P2=1, GEMV_KQ_XLANE=0 ->
    KQ_XLANE=0, GEMV_IQ4_KREG=0 -> IQ4_KREG=0, GEMV_KQ_F32_XPERM=1 -> KQ_F32_XPERM=1, GEMV_KQ_WMAJ=1 ->
    KQ_WMAJ=1, GEMV_KQ_BW=32 -> KQ_BLOCK_WARPS=32 (kv9_warps), GEMV_KQ_XPF=<MiB> -> KQ_XPF=1,
    GEMV_KQ_PF0=0|1|2 -> KQ_PF0=0|1|2 (3: none), GEMV_KQ_PF0_SB=<n> -> KQ_PF0_SB=<n> (8: none),
    GEMV_KQ_PRE=1 -> KQ_PRE=1, GEMV_KQ_CONV=1 -> KQ_CONV=1, then
    iq4_xil_defines(); unset: the kernel's defaults). Raises ValueError unless each is empty or an
    integer 1..8 (PIPE: 1 or 2; the MINBs: 0..8), for PIPE with L1PF or PRE=1 with either (the kernel
    has no build of both), XLANE, IQ4_KREG, F32_XPERM, WMAJ, PRE and CONV unless empty, 0 or 1, CSPLIT unless empty, 0, 1 or
    2, for a BW other than 16 or 32, for a
    WIDE_MIN_ROWS other than a row count or off, for F32_XPERM with XLANE=0 (it
    would build the default), for a PF0 other than empty or 0..3, a PF0_SB other than empty or
    1..16, a PF0_SB other than 8 with a PF0 other than 3 (the build would not use it), and as kv9_p2_types, kv9_p2_max_k, kv9_p2_min_rows, kv9_dq and
    kv9_xpf_bytes."""
    out = []
    for env, val, define in (("GGUF_HARNESS_GEMV_KQ_UNROLL", GEMV_KQ_UNROLL, "KQ_UNROLL"),
                             ("GGUF_HARNESS_GEMV_KQ2_UNROLL", GEMV_KQ2_UNROLL, "KQ2_UNROLL"),
                             ("GGUF_HARNESS_GEMV_KQ_MINB", GEMV_KQ_MINB, "KQ_MINB"),
                             ("GGUF_HARNESS_GEMV_KQ_MINB_IQ3S", GEMV_KQ_MINB_IQ3S, "KQ_MINB_IQ3S"),
                             ("GGUF_HARNESS_GEMV_KQ_PF", GEMV_KQ_PF, "KQ_PF"),
                             ("GGUF_HARNESS_GEMV_KQ_PIPE", GEMV_KQ_PIPE, "KQ_PIPE"),
                             ("GGUF_HARNESS_GEMV_KQ_L1PF", GEMV_KQ_L1PF, "KQ_L1PF")):
        if not val:
            continue
        hi = 2 if define == "KQ_PIPE" else 8
        lo = 0 if define in ("KQ_MINB", "KQ_MINB_IQ3S") else 1
        if not val.isdigit() or not lo <= int(val) <= hi:
            raise ValueError(f"{env}={val!r}: expected an integer {lo}..{hi}")
        out.append(f"{define}={int(val)}")
    if GEMV_KQ_PIPE and GEMV_KQ_L1PF:
        raise ValueError("GGUF_HARNESS_GEMV_KQ_PIPE and GGUF_HARNESS_GEMV_KQ_L1PF: separate A/B builds, set one")
    _switch01("GGUF_HARNESS_GEMV_KQ_XLANE", GEMV_KQ_XLANE)
    if kv9_p2_types():
        out.append("KQ_P2=1")
    if GEMV_KQ_XLANE == "0":  # "1" / "": the kernel's default (KQ_XLANE 1)
        out.append("KQ_XLANE=0")
    kv9_p2_max_k()  # refuse a bad GGUF_HARNESS_GEMV_KQ_P2_MAX_K before any build, P2 or not
    kv9_p2_min_rows()  # likewise _MIN_ROWS
    _switch01("GGUF_HARNESS_GEMV_IQ4_KREG", GEMV_IQ4_KREG)
    if GEMV_IQ4_KREG == "0":  # "1" / "": the kernel's default (IQ4_KREG 1)
        out.append("IQ4_KREG=0")
    _switch01("GGUF_HARNESS_GEMV_KQ_F32_XPERM", GEMV_KQ_F32_XPERM)
    if GEMV_KQ_F32_XPERM == "1":
        if GEMV_KQ_XLANE == "0":  # f32_row permutes only lane-record reads: the build would be the default's
            raise ValueError("GGUF_HARNESS_GEMV_KQ_F32_XPERM=1 needs the lane records (GGUF_HARNESS_GEMV_KQ_XLANE=1)")
        out.append("KQ_F32_XPERM=1")
    _switch01("GGUF_HARNESS_GEMV_KQ_WMAJ", GEMV_KQ_WMAJ)  # an off-by-default A/B build
    if GEMV_KQ_WMAJ == "1":
        out.append("KQ_WMAJ=1")
    kv9_csplit("", "store", 1, False)  # refuse a bad GGUF_HARNESS_GEMV_KQ_CSPLIT (a routing switch) early
    kv9_gsplit(4)  # likewise GGUF_HARNESS_GEMV_KQ_GSPLIT (a define of the cluster build only)
    _switch01("GGUF_HARNESS_GEMV_KQ_GS_FENCE", GEMV_KQ_GS_FENCE)  # and _GS_FENCE
    if kv9_warps() != KV9_WARPS:
        out.append(f"KQ_BLOCK_WARPS={kv9_warps()}")
    kv9_wide(0, 1)  # refuse a bad GGUF_HARNESS_GEMV_KQ_WIDE_MIN_ROWS before any build
    kv9_dq("")  # likewise GGUF_HARNESS_GEMV_KQ_DQ / _DQ_P / _DQ_T / _DQ_MAP (the wide nodes' queue build)
    if kv9_xpf_bytes():  # GGUF_HARNESS_GEMV_KQ_XPF: every v9 build with the next node's prefetch
        out.append("KQ_XPF=1")
    if GEMV_KQ_PF0 not in ("", "0", "1", "2", "3"):
        raise ValueError(f"GGUF_HARNESS_GEMV_KQ_PF0={GEMV_KQ_PF0!r}: expected 0, 1, 2 or 3")
    if GEMV_KQ_PF0 in ("0", "1", "2"):  # "3" / "": the kernel's default (KQ_PF0 3)
        out.append(f"KQ_PF0={GEMV_KQ_PF0}")
    v = GEMV_KQ_PF0_SB
    if v:  # "" / "8": the kernel's default (each part's first two rounds)
        if not (v.isascii() and v.isdigit()) or not 1 <= int(v) <= 16:
            raise ValueError(f"GGUF_HARNESS_GEMV_KQ_PF0_SB={v!r}: expected super-blocks 1..16")
        if int(v) != 8:
            if GEMV_KQ_PF0 not in ("", "3"):  # the other prefetches take whole rows: the build would not use it
                raise ValueError(f"GGUF_HARNESS_GEMV_KQ_PF0_SB={v} needs GGUF_HARNESS_GEMV_KQ_PF0=3 (it is {GEMV_KQ_PF0!r})")
            out.append(f"KQ_PF0_SB={int(v)}")
    _switch01("GGUF_HARNESS_GEMV_KQ_PRE", GEMV_KQ_PRE)
    if GEMV_KQ_PRE == "1":
        if GEMV_KQ_PIPE or GEMV_KQ_L1PF:  # the kernel has no build of both (its static_assert)
            raise ValueError("GGUF_HARNESS_GEMV_KQ_PRE=1 with GGUF_HARNESS_GEMV_KQ_PIPE / _L1PF: separate A/B builds, set one")
        out.append("KQ_PRE=1")
    _switch01("GGUF_HARNESS_GEMV_KQ_CONV", GEMV_KQ_CONV)
    if GEMV_KQ_CONV == "1":  # every v9 build with the conv fields (only ssm_in nodes set them)
        out.append("KQ_CONV=1")
    kv9_part_rot()  # refuse a bad GGUF_HARNESS_GEMV_KQ_PART_ROT early (a define of the cluster build only)
    return tuple(out) + iq4_xil_defines()


def iq4_xil_defines() -> tuple[str, ...]:
    """Defines of the gemv_kq.cu and gemv_tma.cu builds for GGUF_HARNESS_GEMV_IQ4_XIL: () when 1 or
    unset (the kernels' default, kwide_iq4.cuh), ("IQ4_XIL=0",) when "0" or "" (x staged in the
    natural order); ValueError on another value."""
    _switch01("GGUF_HARNESS_GEMV_IQ4_XIL", GEMV_IQ4_XIL)
    return () if GEMV_IQ4_XIL == "1" else ("IQ4_XIL=0",)


def kv9_p2_max_k() -> float:
    """Largest K whose store/add nodes of a kv9_p2_types() type take the _p2 kernels
    (GGUF_HARNESS_GEMV_KQ_P2_MAX_K; unset: every K). Raises ValueError unless a positive integer."""
    if not GEMV_KQ_P2_MAX_K:
        return float("inf")
    if not GEMV_KQ_P2_MAX_K.isdigit() or int(GEMV_KQ_P2_MAX_K) < 1:
        raise ValueError(f"GGUF_HARNESS_GEMV_KQ_P2_MAX_K={GEMV_KQ_P2_MAX_K!r}: expected a positive integer")
    return int(GEMV_KQ_P2_MAX_K)


def kv9_p2_min_rows() -> int:
    """Fewest rows of a store/add node of a kv9_p2_types() type that takes the _p2 kernels
    (GGUF_HARNESS_GEMV_KQ_P2_MIN_ROWS; unset: 2048, empty: 0 = every node). Raises ValueError
    unless empty or a non-negative integer."""
    if not GEMV_KQ_P2_MIN_ROWS:
        return 0
    if not GEMV_KQ_P2_MIN_ROWS.isdigit():
        raise ValueError(f"GGUF_HARNESS_GEMV_KQ_P2_MIN_ROWS={GEMV_KQ_P2_MIN_ROWS!r}: expected a non-negative integer")
    return int(GEMV_KQ_P2_MIN_ROWS)


def kv9_p2_types() -> frozenset[int]:
    """GGML type ids whose store/add v9 nodes take two rows per warp (GGUF_HARNESS_GEMV_KQ_P2: "1"
    for every 8-lane v9 type, or comma-separated names such as q4_k,iq4_xs; "" or "0" none; unset:
    q6_k, the default). Raises ValueError on an unknown name."""
    if GEMV_KQ_P2 in ("", "0"):
        return frozenset()
    if GEMV_KQ_P2 == "1":
        return frozenset(KV9_NAMES)
    by_name = {v: k for k, v in KV9_NAMES.items()}
    names = [n.strip().lower() for n in GEMV_KQ_P2.split(",")]
    bad = [n for n in names if n not in by_name]
    if bad:
        raise ValueError(f"GGUF_HARNESS_GEMV_KQ_P2={GEMV_KQ_P2!r}: expected 1 or names of {', '.join(KV9_NAMES.values())}")
    return frozenset(by_name[n] for n in names)


# Alignment the wide loop's loads need at the weights' start (rows of whole super-blocks keep it):
# Q4_K/Q5_K 16-byte loads at block starts (144 / 176-byte blocks), IQ4_XS 8-byte loads (136-byte
# blocks); Q6_K realigns its 2-byte aligned blocks itself.
KQ_WIDE_ALIGN = {12: 16, 13: 16, 23: 8}
# v9 adds IQ3_S: its 110-byte blocks are 2-byte aligned and read through the 8-byte words around
# each lane's qs run (kernels/kwide_iq3s.cuh), which start inside the weights only if the
# weights start 8-byte aligned.
KV9_ALIGN = {**KQ_WIDE_ALIGN, IQ3_S: 8, 8: 16, 2: 16}  # Q8_0 / Q4_0: 16-byte chunk loads (kwide_q0.cuh)
NARROW_BIT = 0x100            # kernels/gemv.cu NARROW_BIT: per-8 loop for a KQ_WIDE_TYPES segment
# The wide IQ4_XS loop lives only in the "_iq4" GEMV kernels (kernels/gemv.cu built with
# -DGEMV_IQ4, engine v8): launched exactly for segment tables holding an IQ4_XS matrix, so that
# every other node keeps v6's kernels (registers and occupancy, docs/perf-notes.md v8).
IQ4_XS = 23
# struct Seg: "type" is the GGML type id, | NARROW_BIT for a Q4_K/Q5_K/Q6_K/IQ4_XS segment on
# the narrow loop (q16 only: the f32 kernels read the plain id)
SEG_DT = np.dtype([("w", "<u8"), ("bias", "<u8"), ("out", "<u8"), ("type", "<i4"), ("rows", "<i4")],
                  align=True)
TABLE_DT = np.dtype([("s", SEG_DT, (MAX_SEG,)), ("n", "<i4"), ("row_bytes", "<i4", (MAX_SEG,))],
                    align=True)  # struct SegTable, kernels/segs.cuh (152 bytes)
XPF_DT = np.dtype([("w", "<u8"), ("row_bytes", "<i4"), ("rows", "<i4"), ("bytes", "<i4"), ("pad", "<i4")],
                  align=True)  # struct XpfSeg, kernels/segs.cuh (24 bytes)
CONV_DT = np.dtype([("state", "<u8"), ("w", "<u8"), ("y", "<u8"), ("C", "<i4"), ("pad", "<i4")],
                   align=True)  # struct ConvArgs, kernels/segs.cuh (32 bytes)


def table_dtype(xpf: bool = False, conv: bool = False) -> np.dtype:
    """struct SegTable of a gemv_kq.cu build (kernels/segs.cuh): TABLE_DT, then the KQ_XPF records
    (2 x XPF_DT) and the KQ_CONV record (CONV_DT) when the build has them: 152, 200, 184 or 232
    bytes (the kernel's static_asserts hold the C side to these)."""
    fields = [("s", SEG_DT, (MAX_SEG,)), ("n", "<i4"), ("row_bytes", "<i4", (MAX_SEG,))]
    fields += [("xpf", XPF_DT, (2,))] if xpf else []
    fields += [("conv", CONV_DT)] if conv else []
    return np.dtype(fields, align=True)



def gemv_shape(K: int, rows: int, mode: str = "store") -> tuple[int, int]:
    """(warps per row, warps per block) of a q16 GEMV node, from cold back-to-back sweeps of
    every block shape (docs/perf-notes.md: engine v4 on the 0.5B, v6 on the 1.5B and the
    source shapes): the output head (many rows) and rows of <= 8 super-blocks (1.5B, K = 1536:
    qkv 3.30 vs 3.58 us, gate/up 9.33 vs 15.68 us with 2 warps per row) take 1 warp per row in
    8-warp blocks; K <= 1024 (0.5B, K = 896) keeps v4's shapes; longer rows 2 or 4 warps."""
    if rows >= 32768:
        return 1, 8
    if K <= 1024:
        return (1, 4) if mode == "swiglu" else (2, 8)
    if K <= 2048:
        return 1, 8
    return (2, 8) if K <= 6144 else (4, 8)


def gemv_smem(K: int, impl: str = "q16") -> int:
    """Dynamic shared memory of a q16 / q8_1 GEMV block (kernels/gemv.cu stage_xq): int16
    codes, a sum per 8 codes and a float scale per 32 values, for K rounded up to 256; q8_1
    adds a float (the block's value sum) per 32 values."""
    kp = -(-K // 256) * 256
    return 2 * kp + 4 * (kp // 8) + 4 * (kp // 32) * (2 if impl == "q8_1" else 1)


def kv9_kernel(mode: str, type_ids, K: int, lanes4: bool = True, split: int = 1,
               rows: int | None = None) -> str | None:
    """Name of the engine v9 kernel (kernels/gemv_kq.cu) for a q16 node with matrices of GGML
    types `type_ids` and input length K, or None when v9 does not take it (mixed types, a type
    outside Q4_K/Q5_K/Q6_K/IQ4_XS, IQ3_S and Q8_0/Q4_0, IQ3_S with GGUF_HARNESS_GEMV_KQ_IQ3S=0,
    Q8_0/Q4_0 with GGUF_HARNESS_GEMV_KQ_Q0=0, K not a multiple of 256; F32 segments beside one
    such type are taken in store/add nodes): such
    nodes stay on gemv.cu. lanes4: Q4_K/Q5_K take the 4-lanes-per-super-block kernels (gemvkq4_,
    two rows per warp). split: S warps share each row group (1, 2 or 4; the name's _s2 / _s4,
    kv9_split). Store/add nodes of a GGUF_HARNESS_GEMV_KQ_P2 type with K <= kv9_p2_max_k() and, when
    `rows` (the node's output rows) is given, rows >= kv9_p2_min_rows() take the _p2 kernels (two
    rows per warp, 8 lanes per super-block; never Q8_0/Q4_0). Raises ValueError on another split,
    for an IQ3_S (Q8_0/Q4_0) node on a GGUF_HARNESS_GEMV_KQ_IQ3S (_Q0) other than 0 or 1, and as
    kv9_p2_max_k / kv9_p2_min_rows on a P2 candidate."""
    if split not in KV9_SPLITS:
        raise ValueError(f"v9 split {split!r}: expected one of {KV9_SPLITS}")
    type_ids = list(type_ids)
    # F32 segments may ride along in store/add nodes (qwen35's ssm_in: Q5_K q/k/v and gate with
    # F32 beta/alpha rows; kernels/gemv_kq.cu f32_row), not in a gate/up pair
    types = set(type_ids) - {0} if mode != "swiglu" else set(type_ids)
    if len(types) != 1 or K % 256:
        return None
    t = types.pop()
    name = KV9_NAMES.get(t) or KV9_Q0_NAMES.get(t)  # Q8_0 / Q4_0: never gemvkq4_ or _p2 (neither set holds them)
    if name is None:
        return None
    if t in KV9_Q0_NAMES:  # GEMV_KQ_Q0 (default on)
        if GEMV_KQ_Q0 not in ("0", "1"):
            raise ValueError(f"GGUF_HARNESS_GEMV_KQ_Q0={GEMV_KQ_Q0!r}: expected 0 or 1")
        if GEMV_KQ_Q0 != "1":
            return None
    if t == IQ3_S:  # GEMV_KQ_IQ3S (default on)
        if GEMV_KQ_IQ3S not in ("0", "1"):
            raise ValueError(f"GGUF_HARNESS_GEMV_KQ_IQ3S={GEMV_KQ_IQ3S!r}: expected 0 or 1")
        if GEMV_KQ_IQ3S != "1":
            return None
    sfx = "" if split == 1 else f"_s{split}"
    if lanes4 and t in KV9_L4_TYPES:
        return f"gemvkq4_{mode}_{name}{sfx}"
    p2 = "_p2" if (mode != "swiglu" and t in kv9_p2_types() and K <= kv9_p2_max_k()
                   and (rows is None or rows >= kv9_p2_min_rows())) else ""  # GGUF_HARNESS_GEMV_KQ_P2
    return f"gemvkq_{mode}_{name}{p2}{sfx}"


def kv9_iq3s_defines(type_ids) -> tuple[str, ...]:
    """Preprocessor defines the gemv_kq.cu build of a v9 node of GGML types `type_ids` adds to
    kv9_defines(): ("KQ_IQ3S_GRID=N",) for an IQ3_S node when GGUF_HARNESS_GEMV_KQ_IQ3S_GRID=N is
    set, else () (the default build, which prewarm compiles). ValueError on another value."""
    if IQ3_S not in tuple(type_ids) or GEMV_KQ_IQ3S_GRID == "":
        return ()
    if GEMV_KQ_IQ3S_GRID not in KQ_IQ3S_GRIDS:
        raise ValueError(f"GGUF_HARNESS_GEMV_KQ_IQ3S_GRID={GEMV_KQ_IQ3S_GRID!r}: expected one of "
                         f"{', '.join(KQ_IQ3S_GRIDS)}")
    return (f"KQ_IQ3S_GRID={GEMV_KQ_IQ3S_GRID}",)


def kv9_iq3s_dyn_bytes(type_ids) -> int:
    """Dynamic shared memory a v9 IQ3_S node adds before its staged x: 64 KiB (32 grid copies of
    2 KiB, kernels/kwide_iq3s.cuh kIq3sDynInt4) under GGUF_HARNESS_GEMV_KQ_IQ3S_GRID=32, else 0.
    ValueError as kv9_iq3s_defines."""
    return 512 * 32 * 4 if kv9_iq3s_defines(type_ids) == ("KQ_IQ3S_GRID=32",) else 0


def kv9_split_cost(rows: int, K: int, rows_per_warp: int, split: int, block_slots: int) -> int:
    """Relative time of a v9 node (kernels/gemv_kq.cu) with `split` warps per row group, in
    super-blocks one warp reads: grid-stride passes x super-blocks per warp and pass. A pass
    covers block_slots resident blocks (blocks per SM x SMs) of kv9_warps() / split row groups;
    a row group reads 4 super-blocks per row and round (R = rows_per_warp rows), split over
    `split` warps. Why: a [5120 x K] node with one row per warp is 1.2 passes of 264 blocks of 16
    warps, so 2, with the second at 21 % of the machine (Q6_K [5120x17408] 46.0 us against
    gemv.cu's 39.9, session 8); a memory-bound kernel's tail pass costs about a full one."""
    rpb = rows_per_warp * (kv9_warps() // split)
    blocks = -(-rows // rpb)
    passes = -(-blocks // max(1, min(blocks, block_slots)))
    return passes * rows_per_warp * -(-(K // 256) // (4 * split))


def kv9_split(rows: int, K: int, rows_per_warp: int, block_slots) -> int:
    """S of a v9 node: the least kv9_split_cost over the S in KV9_SPLITS that leave each part at
    least 2 rounds (K / 256 >= 8 S; S = 1 always), ties to the smaller S (no barrier).
    block_slots: S -> resident blocks of that kernel (registers differ per S). The 2-round rule
    is measured (session 8, cold back to back): [1024x5120] Q6_K took 4.56 us at S 2 and 5.05 at
    S 4, where the cost model says 3 against 2 units; a part of one round pays the barrier and
    the combine with no second round's loads to hide them."""
    ok = [s for s in KV9_SPLITS if s == 1 or K // 256 >= 8 * s]
    return min(ok, key=lambda s: (kv9_split_cost(rows, K, rows_per_warp, s, block_slots(s)), s))


def kv9_rows_per_warp(kernel_name: str) -> int:
    """Rows one warp takes at a time: 2 for the gemvkq4_ and the _p2 kernels, else 1."""
    return 2 if kernel_name.startswith("gemvkq4_") or "_p2" in kernel_name else 1


PF_DEFAULT = 2           # kernels/gemv.cu PF_AHEAD when not defined
PF_BUDGET = 16 << 20     # bytes of rows a q16 GEMV node may have prefetched to L2 ahead of use


def pf_ahead(stride_bytes: int) -> int:
    """Grid-stride iterations a q16 gemv.cu node prefetches ahead (its build's PF_AHEAD): as many
    as fit PF_BUDGET bytes, at most PF_DEFAULT. stride_bytes = weight bytes one grid-stride
    iteration reads (blocks x rows per block x row bytes). Measured on the H200 (same run,
    cold back to back, docs/perf-notes.md session 7): with 44 MB prefetched ahead the output
    head [248320x5120] Q6_K read 1.9x its bytes from DRAM (evicted before use) and took 454.5 us,
    369.2 at 0 ahead; strides of 12.6-17 MB (Q5_K/Q6_K [5120x17408], IQ4_XS gate/up
    2x[17408x5120]) gained 8-12 % at 1 (or 0) ahead; the 6 MB stride of Q4_K [10240x5120] was best
    at 2. Every model node of the 0.5B/1.5B strides < 8 MB, so those keep 2."""
    return min(PF_DEFAULT, PF_BUDGET // max(1, stride_bytes))


def seg_type(type_id: int, narrow: bool = False) -> int:
    """The segment table's type field: the GGML id, with NARROW_BIT for the q16 per-8 loop."""
    return type_id | NARROW_BIT if narrow and type_id in KQ_WIDE_TYPES else type_id


def seg_table_value(segs: list[Seg], narrow: bool = False, xpf: bool = False, conv: bool = False,
                    conv_args: tuple[int, int, int, int] | None = None):
    """struct SegTable as a numpy structured scalar, passed by value as a kernel parameter.
    narrow: mark Q4_K/Q5_K/Q6_K/IQ4_XS segments for the per-8 loop (seg_type). xpf / conv: the
    table of a KQ_XPF / KQ_CONV build (table_dtype), the next-node fields zero (xpf.link fills
    them); conv_args: (state, taps, y addresses, C) of a fused conv (zero: none)."""
    if not 1 <= len(segs) <= MAX_SEG:
        raise ValueError(f"a GEMV node takes 1..{MAX_SEG} matrices, got {len(segs)}")
    t = np.zeros((), table_dtype(xpf, conv))
    if conv and conv_args:
        t["conv"] = tuple(conv_args) + (0,)
    for i, s in enumerate(segs):
        t["s"][i] = (s.w.ptr, s.bias, int(s.out.data.ptr), seg_type(s.w.type_id, narrow), s.w.rows)
        t["row_bytes"][i] = s.w.row_bytes
    t["n"] = len(segs)
    return t[()]


def seg_table(segs: list[Seg], narrow: bool = False):
    """Device copy of struct SegTable (152 bytes): the pointer convention of v1-v3."""
    return _device_bytes(np.array(seg_table_value(segs, narrow)).tobytes())


def gemv_kernel(prefix: str, mode: str, wpr: int, nw: int, type_ids, impl: str = "q16"
                ) -> tuple[str, tuple[str, ...]]:
    """(kernel name, preprocessor defines of kernels/gemv.cu) of a q16 / q8_1 GEMV node whose
    segments have the GGML types `type_ids`: gemv[p]_<mode>_w<wpr>_b<nw>, with the suffix _iq4
    and -DGEMV_IQ4 (the build holding the wide IQ4_XS loop) exactly when a segment is IQ4_XS,
    and -DACT_Q8_1 for impl "q8_1"."""
    iq4 = IQ4_XS in tuple(type_ids)
    defines = (("ACT_Q8_1",) if impl == "q8_1" else ()) + (("GEMV_IQ4",) if iq4 else ())
    return f"{prefix}_{mode}_w{wpr}_b{nw}" + ("_iq4" if iq4 else ""), defines


def gemv(name: str, mode: str, segs: list[Seg], x, K: int, norm: DeviceTensor | None = None,
         eps: float = 0.0, wpr: int | None = None, nw: int | None = None, conv=None) -> Node:
    """y = W x for every segment (mode "store" | "add" | "swiglu", see kernels/gemv.cu).

    conv: (conv_state float32 [3, C], ssm_conv1d.weight [C, 4], y float32 [C], C) of a qwen35
    DeltaNet layer whose ssm_in this is: with GGUF_HARNESS_GEMV_KQ_CONV=1 and a v9 store node the
    kernel also runs the causal conv of segment 0's rows (kernels/gemv_kq.cu KQ_CONV; the node's
    defines then hold KQ_CONV=1 and the caller drops its conv node); otherwise ignored.

    x: cupy float32 [K]; every segment's weights must have ne[0] == K. norm: F32 [K] weight
    of an RMSNorm applied to x first. wpr / nw: warps per row / per block (q16 only; default
    gemv_shape). Q4_K/Q5_K/Q6_K/IQ4_XS rows take the GEMV_KQ loop (q16; a node with an IQ4_XS
    segment runs the _iq4 kernel, gemv_kernel). Raises UnsupportedError / ValueError on bad input.
    """
    for s in segs:
        check_type(s.w.type_id, s.w.name)
        if s.w.ne[0] != K or s.out.size < s.w.rows:
            raise ValueError(f"{s.w.name}: ne {s.w.ne} does not fit K={K} / output {s.out.size}")
    if mode == "swiglu" and (len(segs) != 2 or segs[0].w.rows != segs[1].w.rows):
        raise ValueError("swiglu takes a gate and an up matrix with equal rows")
    rows = segs[0].w.rows if mode == "swiglu" else sum(s.w.rows for s in segs)
    impl = GEMV_IMPL
    if impl == "q8_1" and any(s.w.type_id in FLOAT_TYPES for s in segs):
        impl = "f32"  # llama.cpp: float weights see x unrounded (no q8_1)
    v9_rows = 1  # rows a warp takes at a time (2 for the gemvkq4_ kernels)
    cs_grid = 0  # a cluster-split node's grid (kv9_csplit)
    kdefs: tuple[str, ...] = ()  # the gemv_kq.cu build's defines (v9 nodes; Node.defines)
    v9_family = impl == "q16" and GEMV_ARGS == "value" and GEMV_KQ in ("v9", "v9l8")  # v9 and its A/Bs
    if impl == "f32":
        wpr, nw = warps_per_row(K), WARPS
        k = module.kernel(f"gemvf_{mode}_w{wpr}")
        smem = 4 * (K + K // 8 + 8)  # padded x (kernels/dequant.cuh XPAD)
    elif v9_family and (tc := gemv_tcr(name, mode, segs, x, K, norm, eps, rows)):
        return tc  # engine v12 (GGUF_HARNESS_GEMV_TCR, gemv_tcr.py)
    elif v9_family and (mn := gemv_mma(name, mode, segs, x, K, norm, eps, rows)):
        return mn  # engine v11 (GGUF_HARNESS_GEMV_MMA, gemv_mma.py)
    elif v9_family and (tn := gemv_tma(name, mode, segs, x, K, norm, eps, rows)):
        return tn  # engine v10 (GGUF_HARNESS_GEMV_TMA=1)
    elif v9_family and \
            (kname := kv9_kernel(mode, types := [s.w.type_id for s in segs], K, l4 := GEMV_KQ == "v9",
                                 rows=rows)):
        for s in segs:  # F32 rows: 16-byte loads (gemv_kq.cu f32_row)
            a = 16 if s.w.type_id == 0 else KV9_ALIGN.get(s.w.type_id, 1)
            if s.w.ptr % a:
                raise ValueError(f"{s.w.name}: {ENGINE_TYPES[s.w.type_id]} weights must be {a}-byte aligned")
        smem = gemv_smem(K, impl) + kv9_iq3s_dyn_bytes(types)  # (GGUF_HARNESS_GEMV_KQ_IQ3S_GRID=32: the copies first)
        v9_rows = kv9_rows_per_warp(kname)
        kdefs = kv9_defines() + kv9_iq3s_defines(types)

        def v9k(sp: int):  # the kernel of split sp (its name: kv9_kernel)
            return module.kernel_in("gemv_kq.cu", kv9_kernel(mode, types, K, l4, sp, rows), kdefs)
        def slots(sp: int) -> int:  # resident blocks of split sp (after the shared-memory opt-in,
            kk = v9k(sp)              # which the occupancy query needs above 48 KiB: IQ3_S's grid)
            module.allow_smem(kk, smem)
            return module.blocks_per_sm(kk, kv9_warps() * 32, smem) * module.sm_count()
        if GEMV_KQ_SPLIT == "auto":
            split = kv9_split(rows, K, v9_rows, slots)
        elif GEMV_KQ_SPLIT in [str(sp) for sp in KV9_SPLITS]:
            split = int(GEMV_KQ_SPLIT)
        else:
            raise ValueError(f"GGUF_HARNESS_GEMV_KQ_SPLIT={GEMV_KQ_SPLIT!r}: expected auto, 1, 2 or 4")
        k = v9k(split)
        wpr, nw = split, kv9_warps()  # a row group of `split` warps takes v9_rows rows
        if kv9_wide(rows, split):  # GGUF_HARNESS_GEMV_KQ_WIDE_MIN_ROWS: 32 warps per block, warp-major
            kdefs = kv9_wide_defines(kdefs)
            if kv9_dq(kv9_kernel(mode, types, K, l4, split, rows)):  # GGUF_HARNESS_GEMV_KQ_DQ: a row queue per block
                kdefs = kv9_dq_defines(kdefs)
            k, nw = v9k(split), 32
        elif cname := kv9_csplit(kv9_kernel(mode, types, K, l4, split, rows), mode, split, norm is not None,
                                 f32_rows=0 in types):
            # GGUF_HARNESS_GEMV_KQ_CSPLIT: a group of `split` (switch 2: at most 2) blocks per row
            # group, as many groups as are co-resident, at most KQ_CS_MAXR rounds (else the S-split)
            cs = int(cname[-1])  # the cluster size (_c2 / _c4)
            cdefs = kv9_csplit_defines(kdefs, cs)
            ck = module.kernel_in("gemv_kq.cu", cname, cdefs)
            module.allow_smem(ck, smem)
            if kv9_gsplit(cs):  # groups in global memory: every block slot, at most KQ_GS_MAXCB groups
                resident = module.blocks_per_sm(ck, nw * 32, smem) * module.sm_count() // cs
                clusters = min(-(-rows // nw), resident, KQ_GS_MAXCB)
            else:
                clusters = min(-(-rows // nw), module.max_active_clusters(ck, cs, nw * 32, smem))
            if cs == 4:  # the row key (the default): an odd count where it costs no round
                clusters = kv9_odd_groups(clusters, rows, nw, K)
            if clusters > 0 and -(-rows // (nw * clusters)) <= KQ_CS_MAXR:
                kdefs, k = cdefs, ck
                cs_grid = clusters * cs
    elif impl in ("q16", "q8_1"):
        dw, dn = gemv_shape(K, sum(s.w.rows for s in segs), mode)
        wpr, nw = wpr or dw, nw or dn
        if (nw, wpr) not in GEMV_SHAPES:
            raise ValueError(f"no q16 GEMV kernel with {wpr} warps per row, {nw} per block")
        prefix = {"value": "gemv", "pointer": "gemvp"}.get(GEMV_ARGS)
        if prefix is None:
            raise ValueError(f"GGUF_HARNESS_GEMV_ARGS={GEMV_ARGS!r}: expected value or pointer")
        if GEMV_KQ not in GEMV_KQ_MODES:
            raise ValueError(f"GGUF_HARNESS_GEMV_KQ={GEMV_KQ!r}: expected one of {', '.join(GEMV_KQ_MODES)}")
        for s in segs:  # the wide loads (KQ_WIDE_ALIGN; arena.py ALIGN = 256 gives it)
            a = KQ_WIDE_ALIGN.get(s.w.type_id, 1) if GEMV_KQ != "narrow" else 1
            if s.w.ptr % a:
                raise ValueError(f"{s.w.name}: {ENGINE_TYPES[s.w.type_id]} weights must be {a}-byte aligned")
        kname, defines = gemv_kernel(prefix, mode, wpr, nw, [s.w.type_id for s in segs], impl)
        k = module.kernel_in("gemv.cu", kname, defines)
        smem = gemv_smem(K, impl)
        if impl == "q16" and not module.GEMV_PF:  # GGUF_HARNESS_GEMV_PF set: that build for all
            per_row = (sum if mode == "swiglu" else max)(s.w.row_bytes for s in segs)
            g = min(math.ceil(rows / (nw // wpr)), module.blocks_per_sm(k, nw * 32, smem) * module.sm_count())
            pf = pf_ahead(g * (nw // wpr) * per_row)
            if pf != PF_DEFAULT:
                k = module.kernel_in("gemv.cu", kname, defines + (f"PF_AHEAD={pf}",))
    else:
        raise ValueError(f"GGUF_HARNESS_GEMV={GEMV_IMPL!r}: expected one of {', '.join(GEMV_IMPLS)}")
    module.allow_smem(k, smem)
    by_value = impl != "f32" and GEMV_ARGS == "value"
    narrow = impl != "f32" and GEMV_KQ == "narrow"
    fused = conv is not None and "KQ_CONV=1" in kdefs and mode == "store"  # ssm_in with its conv
    if fused:
        conv_state, conv_w, conv_y, conv_c = conv
        if conv_c != segs[0].w.rows:
            raise ValueError(f"{name}: the conv's {conv_c} channels are not segment 0's {segs[0].w.rows} rows")
        check_conv_step(segs[0].out, conv_state, conv_w, conv_y, C=conv_c, K=4)  # as conv_step's
        if not all(device_ptr(a) for a in (conv_state, conv_w, conv_y)):  # state 0 would skip the conv
            raise ValueError(f"{name}: a fused conv needs device arrays (conv state, taps, y)")
    table = (seg_table_value(segs, narrow, xpf="KQ_XPF=1" in kdefs, conv="KQ_CONV=1" in kdefs,
                             conv_args=(device_ptr(conv_state) or 0, device_ptr(conv_w) or 0, device_ptr(conv_y) or 0,
                                        conv_c) if fused else None)
             if by_value else seg_table(segs, narrow))
    wbytes = sum(s.w.nbytes for s in segs)
    act = 4 * K * (2 if norm else 1) + 4 * rows * (2 if mode == "add" else 1)
    # one wave: at most as many blocks as can be resident; a block then walks its rows with
    # a grid-stride loop that prefetches the next iteration's rows (kernels/gemv.cu)
    rows_per_block = (nw // wpr) * v9_rows
    grid = cs_grid or min(math.ceil(rows / rows_per_block), module.blocks_per_sm(k, nw * 32, smem) * module.sm_count())
    if fused:  # the conv's state read + write, taps and y (deltanet_ops.conv_step's bytes less x)
        act += 4 * conv_c * (2 * 3 + 4 + 1)
    return Node(name, "gemv", k, (grid,), (nw * 32,),
                (table, x, np.uint64(norm.ptr if norm else 0), np.float32(eps), np.int32(K),
                 np.int32(rows)), smem=smem, bytes=wbytes + act,
                flops=2 * K * sum(s.w.rows for s in segs), out=segs[0].out,
                fmt="+".join(ENGINE_TYPES[s.w.type_id] for s in segs), keep=[] if by_value else [table],
                defines=kdefs)


def tma_defines() -> tuple[str, ...]:
    """Preprocessor defines of the gemv_tma.cu build: TMA_NST (GGUF_HARNESS_GEMV_TMA_NST, 2..8),
    TMA_WARPS (_TMA_WARPS: 4, 8 or 16), TMA_MINB (_TMA_MINB, 1..4), TMA_RPW (_TMA_RPW: 1 or 2),
    and iq4_xil_defines(); unset ones are left to the kernel's defaults (4, 16, 1, 1). Raises
    ValueError on another value, and on a MINB above 1 with 16 consumer warps (ptxas spills
    under that register cap)."""
    out = list(module.switch_defines((
        ("GGUF_HARNESS_GEMV_TMA_NST", GEMV_TMA_NST, "TMA_NST", range(2, 9)),
        ("GGUF_HARNESS_GEMV_TMA_WARPS", GEMV_TMA_WARPS, "TMA_WARPS", (4, 8, 16)),
        ("GGUF_HARNESS_GEMV_TMA_MINB", GEMV_TMA_MINB, "TMA_MINB", range(1, 5)),
        ("GGUF_HARNESS_GEMV_TMA_RPW", GEMV_TMA_RPW, "TMA_RPW", (1, 2)))))
    out += iq4_xil_defines()
    # minBlocks > 1 at 16 + 1 warps caps ptxas at 56 registers or fewer: spills in 9 of 15 instances
    # (MINB 2) or all (3), NVRTC 13.0 sm_90; the default ring leaves one block per SM anyway
    if GEMV_TMA_MINB and int(GEMV_TMA_MINB) * (int(GEMV_TMA_WARPS or 16) + 1) * 32 > 1024:
        raise ValueError(f"GGUF_HARNESS_GEMV_TMA_MINB={GEMV_TMA_MINB} needs GGUF_HARNESS_GEMV_TMA_WARPS=4 or 8 "
                         f"(at most 1024 threads per SM of minBlocks x block)")
    return tuple(out)


def gemv_tma(name: str, mode: str, segs: list[Seg], x, K: int, norm, eps: float, rows: int) -> Node | None:
    """The engine v10 node (kernels/gemv_tma.cu) of a checked q16 gemv call (arguments as gemv;
    rows: the node's output rows, a pair's gate rows) when GGUF_HARNESS_GEMV_TMA=1 and the node
    is one v9 takes with a single GGML type and no F32 rows (and K >= GGUF_HARNESS_GEMV_TMA_MIN_K
    if set); else None, and gemv goes on to v9 or gemv.cu. Grid: the resident blocks (one per SM
    with the default ring; at most GGUF_HARNESS_GEMV_TMA_BPS per SM if set), at most one per row;
    shared memory per tma_plan.plan; the build per tma_defines. Raises ValueError on bad switch
    values and on matrices not 16-byte aligned (bulk copies)."""
    _switch01("GGUF_HARNESS_GEMV_TMA", GEMV_TMA)
    if GEMV_TMA_MIN_K and not GEMV_TMA_MIN_K.isdigit():
        raise ValueError(f"GGUF_HARNESS_GEMV_TMA_MIN_K={GEMV_TMA_MIN_K!r}: expected an integer")
    types = {s.w.type_id for s in segs}
    if (GEMV_TMA != "1" or len(types) != 1 or not types <= set(KV9_NAMES)  # no gemvtma_ for Q8_0 / Q4_0
            or not kv9_kernel(mode, types, K, False) or K < int(GEMV_TMA_MIN_K or 0)):
        return None
    from .tma_plan import TMA_NST, TMA_WARPS, plan
    defs = tma_defines()
    nst = int(GEMV_TMA_NST or TMA_NST)
    warps = int(GEMV_TMA_WARPS or TMA_WARPS)
    tile_rows = warps * (int(GEMV_TMA_RPW or 1) if mode != "swiglu" else 1)  # gemv_tma.cu kTileRows
    if GEMV_TMA_RING and not GEMV_TMA_RING.isdigit():
        raise ValueError(f"GGUF_HARNESS_GEMV_TMA_RING={GEMV_TMA_RING!r}: expected a byte count")
    t = types.pop()
    for s in segs:
        if s.w.ptr % 16:
            raise ValueError(f"{s.w.name}: the TMA GEMV copies 16-byte aligned matrices")
    k = module.kernel_in("gemv_tma.cu", f"gemvtma_{mode}_{KV9_NAMES[t]}", defs)
    # the ring takes what the instance's static shared memory leaves (IQ3_S's grid copies: 33 KB)
    p = plan(K, FORMATS[t].type_size, mode == "swiglu", gemv_smem(K), module.smem_optin(), nst, tile_rows,
             int(GEMV_TMA_RING) if GEMV_TMA_RING else None, module.static_smem(k))
    if p is None:
        return None
    module.allow_smem(k, p.smem)
    act = 4 * K * (2 if norm else 1) + 4 * rows * (2 if mode == "add" else 1)
    threads = (warps + 1) * 32
    if GEMV_TMA_BPS and not (GEMV_TMA_BPS.isdigit() and int(GEMV_TMA_BPS) >= 1):
        raise ValueError(f"GGUF_HARNESS_GEMV_TMA_BPS={GEMV_TMA_BPS!r}: expected a positive integer")
    bps = module.blocks_per_sm(k, threads, p.smem)
    grid = min(rows, min(bps, int(GEMV_TMA_BPS or bps)) * module.sm_count())
    return Node(name, "gemv", k, (grid,), (threads,),
                (seg_table_value(segs), x, np.uint64(norm.ptr if norm else 0), np.float32(eps), np.int32(K),
                 np.int32(rows), np.int32(p.kc), np.int32(p.slot), np.int32(p.ring_off)), smem=p.smem,
                bytes=sum(s.w.nbytes for s in segs) + act, flops=2 * K * sum(s.w.rows for s in segs),
                out=segs[0].out, fmt="+".join(ENGINE_TYPES[s.w.type_id] for s in segs), keep=[])


def gemv_nodes(name: str, mode: str, segs: list[Seg], x, K: int, norm: DeviceTensor | None = None,
               eps: float = 0.0) -> list[Node]:
    """The node(s) of y = W x over `segs` (arguments as gemv): [gemv(...)], or with
    GGUF_HARNESS_GEMV_KQ_MIXED=split (the default) or beside, for a store/add node of two or more GGML
    types that v9 takes one by one (q16, GEMV_KQ v9/v9l8, value arguments, no F32 segment), one gemv node per
    type in order of first appearance, named "<name>.<type>" (e.g. blk.3.qkv.q4_k), each with
    that type's segments, the same x, norm and eps. Segments keep their own outputs, so the
    nodes are independent. With GGUF_HARNESS_GEMV_KQ_MIXED=beside the same nodes, but every one
    except the one of most bytes is marked `beside` and put before it: the executor runs them on
    a second stream beside it (executor.Executor; the node after them waits for all); a node of a
    KQ_GSPLIT build (its group arrays are per module, not reentrant) keeps them in line. Raises
    ValueError on another GEMV_KQ_MIXED value, and as gemv."""
    if GEMV_KQ_MIXED not in ("one", "split", "beside"):
        raise ValueError(f"GGUF_HARNESS_GEMV_KQ_MIXED={GEMV_KQ_MIXED!r}: expected split, beside or one")
    types = list(dict.fromkeys(s.w.type_id for s in segs))
    if (GEMV_KQ_MIXED != "one" and mode != "swiglu" and len(types) > 1 and GEMV_IMPL == "q16"
            and GEMV_KQ in ("v9", "v9l8") and GEMV_ARGS == "value"
            and all(t != 0 and kv9_kernel(mode, [t], K, GEMV_KQ == "v9") for t in types)):
        nodes = [gemv(f"{name}.{ENGINE_TYPES[t].lower()}", mode, [s for s in segs if s.w.type_id == t],
                      x, K, norm, eps) for t in types]
        if GEMV_KQ_MIXED == "beside" and not any("KQ_GSPLIT=1" in n.defines for n in nodes):
            main = max(nodes, key=lambda n: n.bytes)
            for n in nodes:
                n.beside = n is not main
            nodes = [n for n in nodes if n.beside] + [main]
        return nodes
    return [gemv(name, mode, segs, x, K, norm, eps)]


GQA_MAX_SPLITS = 128  # kernels/attention_gqa.cu MAX_NS
# Positions per context split of the v5 attention (impl "gqa", kept for A/B) before a second
# split is used. Measured (docs/perf-notes.md, v6 sweep on the 1.5B shapes): 128 was v5's best
# at 70 positions, and no value made v5 competitive with v6 (1 / 16 / 32 / 128 all 13-18 us).
GQA_SPLIT_MIN = 128


def gqa_splits(n_ctx: int) -> int:
    """Most context splits of the v4/v5 attention (the grid's second dimension): 16 up to
    4096 positions, then ~256 positions per split (<= 128). The kernel uses
    min(this, ceil((pos + 1) / GQA_SPLIT_MIN)) of them at a position. Measured
    (docs/perf-notes.md, v4): 64 splits cost 28 us at position 100 against 17 us for 16,
    because the last block of each group reads every split's partial."""
    return min(GQA_MAX_SPLITS, max(16, -(-n_ctx // 256)))


def attention(name: str, q, k, v, kc, vc, state, out, *, n_head: int, n_kv: int, D: int,
              n_rot: int, freq_base: float, freq_scale: float, n_ctx: int,
              chunk: int = 0, part=None, impl: str | None = None, splits: int | None = None,
              split_min: int | None = None, single: int | None = None) -> list[Node]:
    """Decode attention nodes for one new token (q [n_head*D], k, v [n_kv*D] float32; kc, vc
    fp16 caches [n_ctx, n_kv, D]; state[1] = position; out [n_head*D] float32).

    impl "head" (default, kernels/attention_head.cu, head dims 64/128/256): one node, blocks
    over (query head, context split): one split up to `single` positions, else one per
    `split_min` positions, at most `splits` (defaults: head_splitting(), gqa_splits(n_ctx)),
    merged by the last block. impl "gqa" (kernels/attention_gqa.cu, <= 8 query heads per KV
    head): blocks over (KV head, context split), one split per `split_min` positions (default
    GQA_SPLIT_MIN). Other shapes fall back to impl "v3" (kernels/attention.cu): one pass when chunk == 0, else split over
    the context in chunks of `chunk` positions plus a merge node (part: float32
    [n_head * n_split * (D + 2)] workspace). Raises ValueError on unsupported shapes."""
    if D > 256 or n_head % n_kv or n_rot > D or n_rot % 2:
        raise ValueError(f"attention shape not supported: D={D} n_head={n_head} n_kv={n_kv} n_rot={n_rot}")
    impl = impl or ATTN_IMPL
    if impl == "head" and D in GQA_DIMS:
        return [_attention_head(name, q, k, v, kc, vc, state, out, n_head=n_head, n_kv=n_kv, D=D,
                                n_rot=n_rot, freq_base=freq_base, freq_scale=freq_scale, n_ctx=n_ctx,
                                splits=splits, split_min=split_min, single=single)]
    if impl == "gqa" and D in GQA_DIMS and n_head // n_kv <= GQA_MAXG:
        return [_attention_gqa(name, q, k, v, kc, vc, state, out, n_head=n_head, n_kv=n_kv, D=D,
                               n_rot=n_rot, freq_base=freq_base, freq_scale=freq_scale, n_ctx=n_ctx,
                               splits=splits or gqa_splits(n_ctx),
                               split_min=GQA_SPLIT_MIN if split_min is None else split_min)]
    if impl not in ("head", "gqa", "v3"):
        raise ValueError(f"attention impl {impl!r}: expected head, gqa or v3")
    n_split = 1 if chunk == 0 else math.ceil(n_ctx / chunk)
    if n_split > 1 and (part is None or part.size < n_head * n_split * (D + 2)):
        raise ValueError("split attention needs a partials workspace")
    raw = struct.pack(ATTN_FMT, *(int(a.data.ptr) for a in (q, k, v, kc, vc, state, out)),
                      int(part.data.ptr) if part is not None else 0, n_head, n_kv, D, n_rot,
                      chunk if n_split > 1 else n_ctx, freq_base, 1.0 / math.sqrt(D), freq_scale)
    args = _device_bytes(raw)
    kv_bytes = 2 * 2 * n_ctx * n_kv * D  # upper bound: the whole cache of this layer, fp16
    nodes = [Node(name, "attention", module.kernel("attn_decode"), (n_head, n_split),
                  (ATT_WARPS * 32,), (args,), smem=4 * ((3 + ATT_WARPS) * D + 2 * ATT_WARPS), bytes=kv_bytes,
                  flops=4 * n_ctx * n_head * D, out=out if n_split == 1 else None, keep=[args])]
    if n_split > 1:
        nodes.append(Node(name + ".merge", "attention", module.kernel("attn_merge"), (n_head,),
                          (min(D, 256),), (args, np.int32(n_split)),
                          bytes=4 * n_head * n_split * (D + 2), out=out, keep=[args]))
    return nodes


def _attention_gqa(name, q, k, v, kc, vc, state, out, *, n_head, n_kv, D, n_rot, freq_base,
                   freq_scale, n_ctx, splits, split_min) -> Node:
    import cupy as cp
    G = n_head // n_kv
    if split_min < 1:
        raise ValueError(f"attention split_min {split_min} < 1")
    # longest split: ceil(n / ns) <= split_min while ns < splits, else <= ceil(n_ctx / splits)
    chunk_max = max(min(split_min, n_ctx), -(-n_ctx // splits))
    part = cp.zeros(n_kv * splits * G * (D + 4), cp.float32)  # kernels/attention_gqa.cu PS
    counter = cp.zeros(n_kv, cp.int32)
    if not 1 <= splits <= GQA_MAX_SPLITS:
        raise ValueError(f"attention splits {splits} outside 1..{GQA_MAX_SPLITS}")
    args = tuple(a for a in (q, k, v, kc, vc, state, out, part, counter)) + (
        np.int32(n_head), np.int32(n_kv), np.int32(n_rot), np.int32(splits), np.int32(chunk_max),
        np.int32(split_min), np.float32(freq_base), np.float32(1.0 / math.sqrt(D)), np.float32(freq_scale))
    k_fn = module.kernel(f"attn_gqa_d{D}")
    smem = 4 * (G * D + G * chunk_max + GQA_WARPS * G * D)  # qs, scores, warp sums
    module.allow_smem(k_fn, smem)
    kv_bytes = 2 * 2 * n_ctx * n_kv * D  # upper bound: the whole cache of this layer, fp16
    return Node(name, "attention", k_fn, (n_kv, splits), (GQA_WARPS * 32,), args, smem=smem,
                bytes=kv_bytes, flops=4 * n_ctx * n_head * D, out=out, keep=[part, counter])


# v6 attention splits (docs/perf-notes.md, v6: per-node sweep at the 0.5B and 1.5B shapes):
# one block per query head up to HEAD_SINGLE positions (no merge; best up to ~256), then one
# split per HEAD_SPLIT_MIN positions (64 was the fastest from 300 to 2047 positions).
HEAD_SINGLE = 256
HEAD_SPLIT_MIN = 64


def head_splitting() -> tuple[int, int]:
    """(single, split_min) of the v6 attention, read at call time for same-run A/B: env
    GGUF_HARNESS_ATTN_SINGLE and GGUF_HARNESS_ATTN_SPLIT_MIN override the defaults."""
    return (int(os.environ.get("GGUF_HARNESS_ATTN_SINGLE", HEAD_SINGLE)),
            int(os.environ.get("GGUF_HARNESS_ATTN_SPLIT_MIN", HEAD_SPLIT_MIN)))


@dataclass(frozen=True)
class HeadSplits:
    """Context splitting of the per-query-head attention kernels (kernels/attn_split.cuh:
    attention_head.cu, attention_gated.cu): one split up to `single` positions, else one per
    `split_min` positions, at most `splits` (the grid's second dimension)."""

    splits: int
    split_min: int
    single: int
    chunk_max: int  # longest split in positions (the scores' shared memory)

    @property
    def smem(self) -> int:
        """Dynamic shared memory bytes: scores (16-byte padded) + RG x D = 2048 row-group sums."""
        return 4 * (-(-self.chunk_max // 4) * 4 + 2048)

    def workspace(self, n_head: int, D: int):
        """(partials float32 [n_head, splits, D + 4] (split_finish's PS rows), counters int32
        [n_head], zero: the last block of a head resets its counter for the next replay)."""
        import cupy as cp
        return cp.zeros(n_head * self.splits * (D + 4), cp.float32), cp.zeros(n_head, cp.int32)


def head_splits(n_ctx: int, splits: int | None = None, split_min: int | None = None,
                single: int | None = None) -> HeadSplits:
    """HeadSplits with defaults gqa_splits(n_ctx) and head_splitting(). Raises ValueError."""
    d_single, d_split = head_splitting()
    single = d_single if single is None else single
    split_min = d_split if split_min is None else split_min
    splits = splits or gqa_splits(n_ctx)
    if split_min < 1:
        raise ValueError(f"attention split_min {split_min} < 1")
    if not 1 <= splits <= GQA_MAX_SPLITS:
        raise ValueError(f"attention splits {splits} outside 1..{GQA_MAX_SPLITS}")
    # longest split: all positions up to `single`, else ceil(n / ns) <= split_min while
    # ns < splits, else <= ceil(n_ctx / splits)
    chunk_max = min(n_ctx, max(single, split_min, -(-n_ctx // splits)))
    return HeadSplits(splits, split_min, single, chunk_max)


def _attention_head(name, q, k, v, kc, vc, state, out, *, n_head, n_kv, D, n_rot, freq_base,
                    freq_scale, n_ctx, splits, split_min, single) -> Node:
    hs = head_splits(n_ctx, splits, split_min, single)
    part, counter = hs.workspace(n_head, D)
    args = (q, k, v, kc, vc, state, out, part, counter, np.int32(n_head), np.int32(n_kv),
            np.int32(n_rot), np.int32(hs.splits), np.int32(hs.chunk_max), np.int32(hs.split_min),
            np.int32(hs.single), np.float32(freq_base), np.float32(1.0 / math.sqrt(D)),
            np.float32(freq_scale))
    k_fn = module.kernel(f"attn_head_d{D}")
    module.allow_smem(k_fn, hs.smem)
    kv_bytes = 2 * 2 * n_ctx * n_kv * D  # upper bound: the whole cache of this layer, fp16
    return Node(name, "attention", k_fn, (n_head, hs.splits), (HEAD_THREADS,), args, smem=hs.smem,
                bytes=kv_bytes, flops=4 * n_ctx * n_head * D, out=out, keep=[part, counter])


def embed(name: str, table: DeviceTensor, state, x) -> Node:
    """x [K] = dequantised row state[0] of the token embedding table (GGUF ne [K, n_vocab])."""
    check_type(table.type_id, table.name)
    K, n_vocab = table.ne[0], table.rows
    return Node(name, "embed", module.kernel("embed_row"), (math.ceil(K / 256),), (32,),
                (np.uint64(table.ptr), np.int32(table.type_id), np.int64(table.row_bytes),
                 np.int32(K), np.int32(n_vocab), state, x),
                bytes=table.row_bytes + 4 * K, out=x, fmt=ENGINE_TYPES[table.type_id])


def argmax(name: str, logits, key, state) -> Node:
    """Device argmax of logits into the u64 key; counts non-finite logits into state[2]."""
    return Node(name, "argmax", module.kernel("argmax_logits"), (ARGMAX_BLOCKS,), (256,),
                (logits, np.int32(logits.size), key, state), bytes=4 * logits.size)


def finish(name: str, key, state) -> Node:
    """state[0] = argmax token, state[1] += 1, key = 0 (kernels/misc.cu finish_step)."""
    return Node(name, "finish", module.kernel("finish_step"), (1,), (1,), (key, state), bytes=24)
