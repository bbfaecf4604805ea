"""Node builder for the gated full-attention decode step of a qwen35 attention layer
(kernels/attention_gated.cu; semantics oracles/qwen35.py Qwen35Oracle._attention, llama.cpp
src/models/qwen35.cpp build_layer_attn).

One node per attention layer and token, between the q/k/v GEMV node (Wq -> qg [n_head*2D],
query and gate interleaved per head; Wk -> k, Wv -> v) and the attn_output GEMV:

    per query head h: q = rope_imrope(rms_norm_D(q_h) * q_norm), k likewise with k_norm,
    fp16 K/V cache write at the position, softmax(q k^T * scale) v (GQA), times sigmoid(gate_h)

Splits over the context as ops._attention_head (v6): one block per head up to `single`
positions, then one split per `split_min` positions, at most `splits`, merged by the last
block of each head. The kernels live in their own NVRTC module compiled from
module.source_code("attention_gated.cu") once per process (as deltanet_ops.py). Validation
reads only sizes, dtypes and pointers, so it runs without CuPy.
"""
from __future__ import annotations

import math

import numpy as np

from . import module
from .arena import DeviceTensor
from .argcheck import check_array, device_ptr
from .executor import Node

DIMS = (64, 128, 256)  # GATED_KERNEL instantiations
THREADS = 256          # kernels/attn_split.cuh SPLIT_THREADS
MAX_SPLITS = 128       # kernels/attn_split.cuh SPLIT_MAX_NS
MAX_HALF_ROT = 128     # rsn / rcs shared arrays: n_rot / 2 <= 128
F32 = 0


def kernel(name: str):
    """RawKernel `name` of kernels/attention_gated.cu (attn_gated_d{64,128,256})."""
    return module.kernel_in("attention_gated.cu", name)


def _check_weight(t, D: int, what: str) -> None:
    if isinstance(t, DeviceTensor):
        if t.type_id != F32 or tuple(t.ne) != (D,):
            raise ValueError(f"{what} ({t.name}): type {t.type_id} ne {tuple(t.ne)}, expected "
                             f"F32 (0) ne ({D},)")
        return
    check_array(t, D, dtype=np.float32, what=what)


def _arg(t):
    return np.uint64(t.ptr) if isinstance(t, DeviceTensor) else t


def check_args(qg, k, v, q_norm, k_norm, kc, vc, state, out, *, n_head: int, n_kv: int,
               D: int, n_rot: int, sections, n_ctx: int, splits: int, split_min: int) -> None:
    """Validate gated_attention's arguments. Raises ValueError."""
    if D not in DIMS:
        raise ValueError(f"gated attention head size D={D}: instantiated for {DIMS}")
    if n_head < 1 or n_kv < 1 or n_head % n_kv:
        raise ValueError(f"head counts n_head={n_head}, n_kv={n_kv}: need n_head % n_kv == 0")
    if n_rot % 2 or not 0 < n_rot <= D or n_rot // 2 > MAX_HALF_ROT:
        raise ValueError(f"n_rot {n_rot}: must be even, in (0, D={D}]")
    sec = [int(s) for s in sections]
    if len(sec) != 4 or min(sec) < 0 or sum(sec) <= 0:
        raise ValueError(f"rope sections {sections}: need 4 counts >= 0 with a positive sum")
    if not 1 <= splits <= MAX_SPLITS or split_min < 1 or n_ctx < 1:
        raise ValueError(f"splits {splits} outside 1..{MAX_SPLITS}, split_min {split_min} or "
                         f"n_ctx {n_ctx} < 1")
    # qg and out 16-byte aligned: the merge path of split_finish (attn_split.cuh) reads the
    # gate (qg + 2Dh + D) and writes out as float4
    check_array(qg, n_head * 2 * D, dtype=np.float32, what="qg [n_head * 2D] (query | gate per head)",
                align=16)
    check_array(k, n_kv * D, dtype=np.float32, what="k [n_kv * D]")
    check_array(v, n_kv * D, dtype=np.float32, what="v [n_kv * D]")
    _check_weight(q_norm, D, "attn_q_norm.weight [D]")
    _check_weight(k_norm, D, "attn_k_norm.weight [D]")
    check_array(kc, n_ctx * n_kv * D, dtype=np.uint16, what="K cache fp16 [n_ctx, n_kv, D]", align=16)
    check_array(vc, n_ctx * n_kv * D, dtype=np.uint16, what="V cache fp16 [n_ctx, n_kv, D]", align=16)
    check_array(state, 4, dtype=np.int32, what="state int32 [4]")
    check_array(out, n_head * D, dtype=np.float32, what="out [n_head * D]", align=16)
    po = device_ptr(out)
    if po is not None and po in (device_ptr(qg), device_ptr(k), device_ptr(v)):
        raise ValueError("out must not alias qg, k or v")


def gated_attention(name: str, qg, k, v, q_norm, k_norm, kc, vc, state, out, *, n_head: int,
                    n_kv: int, D: int, n_rot: int, sections, freq_base: float,
                    freq_scale: float, eps: float, n_ctx: int, scale: float = 0.0,
                    splits: int | None = None, split_min: int | None = None,
                    single: int | None = None) -> Node:
    """The gated attention node of one token (see the module doc and kernels/attention_gated.cu).

    qg: float32 [n_head*2D] Wq output; k, v: float32 [n_kv*D]; q_norm, k_norm: [D] weights
    (F32 DeviceTensor or float32 array); kc, vc: uint16 (fp16) [n_ctx, n_kv, D]; state: int32
    [4], state[1] = position; out: float32 [n_head*D]. sections: the 4 IMROPE section counts;
    scale: 0 = 1/sqrt(D) (Qwen35Params.attn_scale convention). splits / split_min / single:
    defaults as ops.head_splits. Raises ValueError.
    """
    from . import ops
    hs = ops.head_splits(n_ctx, splits, split_min, single)
    check_args(qg, k, v, q_norm, k_norm, kc, vc, state, out, n_head=n_head, n_kv=n_kv, D=D,
               n_rot=n_rot, sections=sections, n_ctx=n_ctx, splits=hs.splits, split_min=hs.split_min)
    part, counter = hs.workspace(n_head, D)
    s0, s1, s2, s3 = (int(s) for s in sections)
    args = (qg, k, v, _arg(q_norm), _arg(k_norm), kc, vc, state, out, part, counter,
            np.int32(n_head), np.int32(n_kv), np.int32(n_rot), np.int32(s0), np.int32(s1),
            np.int32(s2), np.int32(s3), np.int32(hs.splits), np.int32(hs.chunk_max),
            np.int32(hs.split_min), np.int32(hs.single), np.float32(freq_base),
            np.float32(scale or 1.0 / math.sqrt(D)), np.float32(freq_scale), np.float32(eps))
    k_fn = kernel(f"attn_gated_d{D}")
    module.allow_smem(k_fn, hs.smem)
    kv_bytes = 2 * 2 * n_ctx * n_kv * D  # upper bound: the whole cache of this layer, fp16
    return Node(name, "attention", k_fn, (n_head, hs.splits), (THREADS,), args, smem=hs.smem,
                bytes=kv_bytes + 4 * (2 * n_head * D + 2 * n_kv * D + n_head * D),
                flops=4 * n_ctx * n_head * D, out=out, keep=[part, counter])
