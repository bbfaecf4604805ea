// Matrix-vector products directly on GGUF blocks: y[r] = sum_k W[r, k] * x[k].
//
// One launch covers up to MAX_SEG matrices ("segments", e.g. Q, K and V) that share the
// input vector; each segment has its own GGML type, rows, bias and output. One warp per
// row, WARPS rows per block; the input vector is staged once per block in shared memory,
// optionally RMS-normalised on the way (ggml_rms_norm then ggml_mul by the norm weight,
// llama.cpp src/models/qwen2.cpp), which removes a separate norm node per use.
// Epilogues: store (+bias), add into the output (residual stream), SwiGLU of a gate/up
// pair (silu(gate) * up, llm_graph_context::build_ffn with LLM_FFN_SILU + LLM_FFN_PAR).
#include "dequant.cuh"
#include "segs.cuh"

// Stage x [K] into shared memory; with norm != 0: x * rsqrt(mean(x^2) + eps) * norm.
// x is read with float4 loads (all of a thread's loads in flight at once: the prologue is
// on the critical path of every node) and stored padded (XPAD in dequant.cuh) so the
// lanes' float4 reads in row_dot are free of bank conflicts.
__device__ __forceinline__ void stage_x(const float* __restrict__ x, const float* __restrict__ norm,
                                        float eps, int K, float* xs, float* scratch) {
    float ss = 0.f;
    if ((K & 3) == 0) {
        const float4* x4 = (const float4*)x;
#pragma unroll 4
        for (int i = threadIdx.x; i < K / 4; i += blockDim.x) {
            const float4 v = x4[i];
            *(float4*)(xs + XPAD(4 * i)) = v;
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
    } else {
        for (int i = threadIdx.x; i < K; i += blockDim.x) {
            const float v = x[i];
            xs[XPAD(i)] = v;
            ss += v * v;
        }
    }
    if (norm) {
        const float scale = rsqrtf(block_sum(ss, scratch) / (float)K + eps);
#pragma unroll 4
        for (int i = threadIdx.x; i < K; i += blockDim.x) xs[XPAD(i)] = xs[XPAD(i)] * scale * norm[i];
    }
    __syncthreads();
}

// MODE 0: out = y (+ bias); MODE 1: out += y (+ bias); MODE 2: SwiGLU, segments 0 and 1 are
// gate and up with equal rows, out(seg 0) = silu(gate) * up.
// WPR warps share one row (each takes every WPR-th 256-value group; partial sums meet in
// shared memory), so long rows are not one warp's serial loop. A block stages x once and
// then walks row groups with a grid-stride loop (the grid is capped near full occupancy,
// so the staging cost is paid per resident block, not per 4 rows).
template <int MODE, int WPR>
__device__ void gemv_body(const SegTable& t, const float* x, const float* norm, float eps, int K,
                          int total_rows) {
    extern __shared__ float xs[];
    __shared__ float scratch[32];
    __shared__ float part[2][WARPS];
    pdl_wait();  // PDL contract (common.cuh): no overlap in this v3 kernel, only correctness
    stage_x(x, norm, eps, K, xs, scratch);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, sub = warp % WPR;
    const int rows_per_block = WARPS / WPR;
    for (int base = blockIdx.x * rows_per_block; base < total_rows; base += gridDim.x * rows_per_block) {
        int row = base + warp / WPR;
        float y = 0.f, up = 0.f;
        int si = 0;
        if (row < total_rows) {
            si = MODE == 2 ? 0 : find_seg(t, row);
            const Seg& s = t.s[si];
            y = row_dot_any(s.type, (const u8*)s.w + (size_t)t.row_bytes[si] * row, xs, K, lane, sub, WPR);
            if (MODE == 2) {
                const Seg& u = t.s[1];
                up = row_dot_any(u.type, (const u8*)u.w + (size_t)t.row_bytes[1] * row, xs, K, lane, sub, WPR);
            }
        }
        y = warp_sum(y);
        if (MODE == 2) up = warp_sum(up);
        combine_warps<WPR>(y, up, part[0], part[1], warp, sub, lane);
        if (row >= total_rows || sub != 0 || lane != 0) continue;
        store_row<MODE>(t.s[si], row, y, up);
    }
}

#define GEMV_KERNEL(NAME, MODE, WPR)                                                            \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                    \
    NAME(const SegTable* __restrict__ t, const float* x, const float* norm, float eps, int K,   \
         int total_rows) {                                                                      \
        gemv_body<MODE, WPR>(*t, x, norm, eps, K, total_rows);                                  \
    }
// kernel names: gemvf_<mode>_w<warps per row> (engine v1-v3 GEMV, kept for A/B: fp32 x)
GEMV_KERNEL(gemvf_store_w1, 0, 1)
GEMV_KERNEL(gemvf_store_w2, 0, 2)
GEMV_KERNEL(gemvf_store_w4, 0, 4)
GEMV_KERNEL(gemvf_add_w1, 1, 1)
GEMV_KERNEL(gemvf_add_w2, 1, 2)
GEMV_KERNEL(gemvf_add_w4, 1, 4)
GEMV_KERNEL(gemvf_swiglu_w1, 2, 1)
GEMV_KERNEL(gemvf_swiglu_w2, 2, 2)
GEMV_KERNEL(gemvf_swiglu_w4, 2, 4)
