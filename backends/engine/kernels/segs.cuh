// The segment table of a GEMV node: up to MAX_SEG matrices sharing one input vector
// (e.g. Q, K and V), each with its own GGML type, rows, bias and output.
#pragma once
#include "common.cuh"

#define MAX_SEG 4
#define WARPS 4

struct Seg {              // 32 bytes, mirrored by backends/engine/ops.py SEG_DT
    u64 w;                // weight blocks, [rows, row_bytes] u8
    u64 bias;             // f32 [rows] or 0
    u64 out;              // f32 [rows]
    int type;             // GGML type id
    int rows;
};

#ifndef KQ_XPF
#define KQ_XPF 0
#endif
// KQ_XPF (gemv_kq.cu's A/B build, ops GGUF_HARNESS_GEMV_KQ_XPF): the next v9 GEMV node's rows whose
// first bytes this node's warps ask L2 for once their own rows are done (gemv_kq.cu xpf_tail).
struct XpfSeg {           // 24 bytes, mirrored by backends/engine/ops.py XPF_DT
    u64 w;                // the next node's weight rows of one segment, 0: none
    int row_bytes;
    int rows;             // rows 0..rows-1 of that segment
    int bytes;            // the first `bytes` of each
    int pad;
};

#ifndef KQ_CONV
#define KQ_CONV 0
#endif
// KQ_CONV (gemv_kq.cu's A/B build, ops GGUF_HARNESS_GEMV_KQ_CONV): a qwen35 ssm_in node's segment 0
// (the attn_qkv rows) also runs the delta-rule layer's causal conv of each row it stores
// (gemv_kq.cu store_out: deltanet.cu gdn_conv_body's arithmetic), so the conv node goes.
struct ConvArgs {         // 32 bytes, mirrored by backends/engine/ops.py CONV_DT
    u64 state;            // float [K-1 = 3, C] conv state, updated in place; 0: no conv
    u64 w;                // float [C, 4] ssm_conv1d taps
    u64 y;                // float [C] silu(conv) output
    int C;
    int pad;
};

// 152 bytes (+48 with KQ_XPF, +32 with KQ_CONV), mirrored by backends/engine/ops.py
// table_dtype(): a kernel parameter (v4) or, for the pointer convention of v1-v3, in device
// memory (one per node, written once at build time).
struct SegTable {
    Seg s[MAX_SEG];
    int n;
    int row_bytes[MAX_SEG];
#if KQ_XPF
    XpfSeg xpf[2];
#endif
#if KQ_CONV
    ConvArgs conv;
#endif
};

// GEMV epilogue shared by gemv.cu and gemv_f32.cu. The WPR warps of a row meet in shared
// memory (p0, p1: one float per warp of the block, for the row sum and the up sum); the
// first warp of the row then has the totals in y, up.
template <int WPR> __device__ __forceinline__ void combine_warps(float& y, float& up, float* p0, float* p1,
                                                                  int warp, int sub, int lane) {
    if (WPR > 1) {
        if (lane == 0) { p0[warp] = y; p1[warp] = up; }
        __syncthreads();
        if (sub == 0) {
            for (int w = 1; w < WPR; ++w) { y += p0[warp + w]; up += p1[warp + w]; }
        }
        __syncthreads();
    }
}

// MODE 0: out = y (+ bias); MODE 1: out += y (+ bias); MODE 2: out = silu(y) * up (SwiGLU,
// y from the gate row, up from the up row; llm_graph_context::build_ffn, LLM_FFN_SILU).
template <int MODE> __device__ __forceinline__ void store_row(const Seg& s, int row, float y, float up) {
    if (MODE == 2) {
        ((float*)s.out)[row] = silu(y) * up;
    } else {
        if (s.bias) y += ((const float*)s.bias)[row];
        float* o = (float*)s.out + row;
        *o = MODE == 1 ? *o + y : y;
    }
}

__device__ __forceinline__ int find_seg(const SegTable& t, int& row) {
    int i = 0;
    while (i < t.n - 1 && row >= t.s[i].rows) { row -= t.s[i].rows; ++i; }
    return i;
}

