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

#define MAX_SEG 4
#define WARPS 4

struct Seg {              // 32 bytes, mirrored by backends/engine/ops.py SEG_DTYPE
    u64 w;                // weight blocks, [rows, row_bytes] u8
    u64 bias;             // f32 [rows] or 0
    u64 out;              // f32 [rows]
    int type;             // GGML type id
    int rows;
};

// Lives in device memory (one per node, written once when the step is built): 152 bytes.
struct SegTable { Seg s[MAX_SEG]; int n; int row_bytes[MAX_SEG]; };

// Stage x [K] into shared memory; with norm != 0: x * rsqrt(mean(x^2) + eps) * norm.
__device__ __forceinline__ void stage_x(const float* __restrict__ x, const float* __restrict__ norm,
                                        float eps, int K, float* xs, float* scratch) {
    float ss = 0.f;
    for (int i = threadIdx.x; i < K; i += blockDim.x) {
        const float v = x[i];
        xs[i] = v;
        ss += v * v;
    }
    if (norm) {
        const float scale = rsqrtf(block_sum(ss, scratch) / (float)K + eps);
        for (int i = threadIdx.x; i < K; i += blockDim.x) xs[i] = xs[i] * scale * norm[i];
    }
    __syncthreads();
}

__device__ __forceinline__ int find_seg(const SegTable& t, int& row) {
    int i = 0;
    while (i < t.n - 1 && row >= t.s[i].rows) { row -= t.s[i].rows; ++i; }
    return i;
}

// MODE 0: out = y (+ bias); MODE 1: out += y (+ bias); MODE 2: SwiGLU, segments 0 and 1 are
// gate and up with equal rows, out(seg 0) = silu(gate) * up.
template <int MODE>
__device__ void gemv_body(const SegTable& t, const float* x, const float* norm, float eps, int K,
                          int total_rows) {
    extern __shared__ float xs[];
    __shared__ float scratch[32];
    stage_x(x, norm, eps, K, xs, scratch);
    const int lane = threadIdx.x & 31;
    int row = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (row >= total_rows) return;
    const int si = MODE == 2 ? 0 : find_seg(t, row);
    const Seg& s = t.s[si];
    const size_t rb = (size_t)t.row_bytes[si];
    float y = warp_sum(row_dot_any(s.type, (const u8*)s.w + rb * row, xs, K, lane));
    if (MODE == 2) {
        const Seg& u = t.s[1];
        const float up = warp_sum(row_dot_any(u.type, (const u8*)u.w + (size_t)t.row_bytes[1] * row, xs, K, lane));
        if (lane == 0) ((float*)s.out)[row] = silu(y) * up;
        return;
    }
    if (lane == 0) {
        if (s.bias) y += ((const float*)s.bias)[row];
        float* o = (float*)s.out + row;
        *o = MODE == 1 ? *o + y : y;
    }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
gemv_store(const SegTable* __restrict__ t, const float* x, const float* norm, float eps, int K, int total_rows) {
    gemv_body<0>(*t, x, norm, eps, K, total_rows);
}
extern "C" __global__ void __launch_bounds__(WARPS * 32)
gemv_add(const SegTable* __restrict__ t, const float* x, const float* norm, float eps, int K, int total_rows) {
    gemv_body<1>(*t, x, norm, eps, K, total_rows);
}
extern "C" __global__ void __launch_bounds__(WARPS * 32)
gemv_swiglu(const SegTable* __restrict__ t, const float* x, const float* norm, float eps, int K, int total_rows) {
    gemv_body<2>(*t, x, norm, eps, K, total_rows);
}
