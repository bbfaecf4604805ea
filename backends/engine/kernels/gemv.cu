// Matrix-vector products directly on GGUF blocks: y[r] = sum_k W[r, k] * x[k]  (engine v4).
//
// One launch covers up to MAX_SEG matrices ("segments", e.g. Q, K and V, segs.cuh) sharing
// the input vector. NW warps per block, WPR warps per row. Per block:
//   1. prefetch (to L2) the rows of its first PF_AHEAD row iterations, then wait for the
//      previous kernel (programmatic dependent launch, launch.py): the prefetch overlaps it.
//   2. stage x in shared memory: optionally RMS-normalised (ggml_rms_norm then ggml_mul by
//      the norm weight, llama.cpp src/models/qwen2.cpp), then quantised per 32-value block
//      to int16 codes with a float scale, plus the sum of every 8 codes (qdot8's offsets).
//   3. walk its rows (grid-stride, each iteration prefetching the rows PF_AHEAD ahead): for
//      Q4_K, Q5_K, Q6_K and IQ4_XS 8 lanes share a 256-value super-block and each lane takes
//      32 weights (row_dot_wide, kwide.cuh, and row_dot_wide_iq4, kwide_iq4.cuh, the latter
//      only in the _iq4 kernels: 2-9 global loads per 32 weights); for the other formats, or
//      with the segment type's NARROW_BIT set (backends/engine/ops.py,
//      GGUF_HARNESS_GEMV_KQ=narrow, kept for same-run A/B), every lane takes 8 weights per
//      256-value group and calls qdot8 (integer dp2a, qdot.cuh; the I-quants behind the
//      non-inlined row_dot_iq / row_dot_iq_smem).
// Epilogues: store (+bias), add into the output (residual stream), SwiGLU of a gate/up
// pair (silu(gate) * up, llm_graph_context::build_ffn with LLM_FFN_SILU + LLM_FFN_PAR).
//
// Why int16 activations (llama.cpp's mmvq uses int8, q8_1): the integer dot product is what
// makes the GEMV cheap (docs/perf-notes.md: fp32 dequantisation cost ~30 instructions per
// weight and made every node latency/issue-bound), and 16-bit codes keep the activation's
// relative rounding error at <= 2^-16 of its block maximum instead of 2^-8, so the engine
// stays far more accurate than llama.cpp (tests/test_engine_kernels.py derives the bound).
#include "qdot.cuh"
#include "kwide.cuh"
// gemv.cu stages x in the natural order (stage_xq<SW4 = false, IL = false>): the IQ4_XS wide dot of
// kwide_iq4.cuh must read it so (its IQ4_XIL default is gemv_kq.cu's and gemv_tma.cu's)
#undef IQ4_XIL
#define IQ4_XIL 0
#include "kwide_iq4.cuh"
static_assert(!kIq4Xil, "gemv.cu stages x in the natural order");
#include "segs.cuh"
#include "xstage.cuh"  // stage_xq (the layout comment is there), prefetch_l2 / prefetch_bytes

#ifndef ROW_UNROLL
#define ROW_UNROLL 4   // groups of one row whose loads are in flight together (row_dot)
#endif
#ifndef ROW2_UNROLL
#define ROW2_UNROLL 2  // the same for a gate/up pair (row_dot2: two rows' loads per group)
#endif
// (#pragma unroll takes a constant expression, not a macro)
constexpr int kRowUnroll = ROW_UNROLL, kRow2Unroll = ROW2_UNROLL;
#ifndef PF_AHEAD
#define PF_AHEAD 2  // grid-stride iterations whose rows are prefetched to L2 ahead of use
#endif
__device__ __forceinline__ void prefetch_row(const SegTable& t, int row, int total_rows, bool pair,
                                             int first, int step) {
    if (row >= total_rows) return;
    const int si = pair ? 0 : find_seg(t, row);
    prefetch_bytes((const u8*)t.s[si].w + (size_t)t.row_bytes[si] * row, t.row_bytes[si], first, step);
    if (pair) prefetch_bytes((const u8*)t.s[1].w + (size_t)t.row_bytes[1] * row, t.row_bytes[1], first, step);
}

#ifdef ACT_Q8_1
// llama.cpp's vec_dot_q{4,5}_{0,1}_q8_1 (ggml-cuda/vecdotq.cuh) fold the format's offset b
// (y = a q + b per 32-value block: b = -8 d, -16 d, m, m) with the q8_1 block's fp16 sum of the
// unquantised values, where qdot8 folds it with the sum of the codes s8. Correction of one
// lane's 8 values: b * (sy / (4 ds) - s8) in code units (xf, stage_xq). K-quants use code
// sums in llama.cpp too (dp4a with 0x01010101), so they need none.
template <int T> constexpr bool kLegacyOff = T == T_Q4_0 || T == T_Q4_1 || T == T_Q5_0 || T == T_Q5_1;
template <int T> __device__ __forceinline__ float legacy_off(const u8* row, int g, int lane, const float* xd,
                                                             int K, int c, int s8) {
    const u8* b = row + (8 * g + (lane >> 2)) * Fmt<T>::TS;
    float off;
    if constexpr (T == T_Q4_0) off = -8.f * h2f(ld_u16(b));
    else if constexpr (T == T_Q5_0) off = -16.f * h2f(ld_u16(b));
    else off = h2f(ld_u16(b + 2));  // Q4_1, Q5_1: the block minimum m
    const float* xf = xd + ((K + 255) >> 8) * 8;
    return off * (xf[c >> 2] - (float)s8);
}
#endif

// Lane's partial dot product of one row with the staged x over groups g0, g0 + gstep, ...
// (no early exit, so the loop unrolls and several groups' loads are in flight together).
template <int T> __device__ __forceinline__ float row_dot(const u8* row, const int4* xq, const int* xs,
                                                          const float* xd, int K, int lane, int g0, int gstep) {
    const int ng = (K + 255) / 256, xl = xq_slot(lane);
    float acc = 0.f;
#pragma unroll kRowUnroll
    for (int g = g0; g < ng; g += gstep) {
        if (lane_valid<T>(g, lane, K)) {
            const int c = 32 * g + lane, p = 32 * g + xl;  // p: slot of entry c
            float r;
            if constexpr (Fmt<T>::QK == 1) r = fdot8<T>(row, g, lane, K, xq[p]);
            else r = qdot8<T>(row, g, lane, xq[p], xs[c]);
#ifdef ACT_Q8_1
            if constexpr (kLegacyOff<T>) r += legacy_off<T>(row, g, lane, xd, K, c, xs[c]);
#endif
            acc = fmaf(r, xd[c >> 2], acc);
        }
    }
    return acc;
}

// Gate and up rows of the same type in one loop: twice the independent loads per iteration.
template <int T> __device__ __forceinline__ float2 row_dot2(const u8* r0, const u8* r1, const int4* xq,
                                                            const int* xs, const float* xd, int K, int lane,
                                                            int g0, int gstep) {
    const int ng = (K + 255) / 256, xl = xq_slot(lane);
    float a0 = 0.f, a1 = 0.f;
#pragma unroll kRow2Unroll
    for (int g = g0; g < ng; g += gstep) {
        if (lane_valid<T>(g, lane, K)) {
            const int c = 32 * g + lane, p = 32 * g + xl;
            const float d = xd[c >> 2];
            if constexpr (Fmt<T>::QK == 1) {
                a0 = fmaf(fdot8<T>(r0, g, lane, K, xq[p]), d, a0);
                a1 = fmaf(fdot8<T>(r1, g, lane, K, xq[p]), d, a1);
            } else {
                float q0 = qdot8<T>(r0, g, lane, xq[p], xs[c]), q1 = qdot8<T>(r1, g, lane, xq[p], xs[c]);
#ifdef ACT_Q8_1
                if constexpr (kLegacyOff<T>) {
                    q0 += legacy_off<T>(r0, g, lane, xd, K, c, xs[c]);
                    q1 += legacy_off<T>(r1, g, lane, xd, K, c, xs[c]);
                }
#endif
                a0 = fmaf(q0, d, a0);
                a1 = fmaf(q1, d, a1);
            }
        }
    }
    return make_float2(a0, a1);
}

// Formats whose row loops are inlined into every GEMV kernel: per-8 loops (row_dot) only ...
#define FOR_EACH_TYPE(X) X(T_F32) X(T_F16) X(T_BF16) X(T_Q4_0) X(T_Q4_1) X(T_Q5_0) X(T_Q5_1) \
    X(T_Q8_0) X(T_Q2_K) X(T_Q3_K)
// ... and wide loops (row_dot_wide, kwide.cuh) with the per-8 loop as type | NARROW_BIT.
#define FOR_EACH_WIDE_TYPE(X) X(T_Q4_K) X(T_Q5_K) X(T_Q6_K)
// IQ4_XS also has a wide loop (row_dot_wide_iq4, kwide_iq4.cuh; in row_dot_kq / row_dot2_kq), but
// only in the kernels instantiated with IQ4 = true (the "_iq4" names, compiled with -DGEMV_IQ4,
// below), which ops.py launches exactly for segment tables holding an IQ4_XS matrix. There its
// per-8 loop under NARROW_BIT stays the non-inlined I-quant call (row_dot_iq_smem). The other
// kernels (IQ4 = false) are engine v6's code: an IQ4_XS row reaching one of them would take the
// per-8 I-quant call (row_dot_iq), IQ4_XS | NARROW_BIT would give NaN.
#define NARROW_BIT 0x100  // set in a segment's type by ops.py for GGUF_HARNESS_GEMV_KQ=narrow
// I-quants: row loops in one non-inlined function. Inlined as 9 more cases they changed the
// register allocation of every kernel (nvcc 13, sm_90: swiglu w2_b8 79 -> 128 registers, 24 ->
// 16 resident warps per SM; store w1_b4 52 -> 62) although each format alone fitted; behind a
// call the kernels keep their registers and occupancy, and only I-quant rows pay the call and
// generic (not shared-window) loads of x. Gate/up pairs of I-quants run as two calls (no row_dot2).
// (FOR_EACH_IQ_TYPE: iquants.cuh)
__device__ __noinline__ float row_dot_iq(int type, const u8* row, const int4* xq, const int* xs,
                                         const float* xd, int K, int lane, int g0, int gstep) {
    switch (type) {
#define CASE(T) case T: return row_dot<T>(row, xq, xs, xd, K, lane, g0, gstep);
        FOR_EACH_IQ_TYPE(CASE)
#undef CASE
    }
    return __int_as_float(0x7fc00000);  // unknown type: NaN, caught by the finite checks
}

// The I-quant call of the _iq4 kernels (v7): x addressed from the shared array itself, not
// passed as 3 generic pointers (generic loads), so fewer values live across the call, which
// the inlined wide IQ4_XS loop needs (docs/perf-notes.md v7/v8 register tables).
extern __shared__ int4 smem4[];  // the staged x (stage_xq layout: xstage.cuh)

__device__ __noinline__ float row_dot_iq_smem(int type, const u8* row, int K, int lane, int g0, int gstep) {
    const int Kp = (K + 255) & ~255;
    const int4* xq = smem4;
    const int* xs = (const int*)(smem4 + Kp / 8);
    const float* xd = (const float*)(xs + Kp / 8);
    switch (type & ~NARROW_BIT) {  // IQ4_XS | NARROW_BIT: its per-8 loop (GGUF_HARNESS_GEMV_KQ=narrow)
#define CASE(T) case T: return row_dot<T>(row, xq, xs, xd, K, lane, g0, gstep);
        FOR_EACH_IQ_TYPE(CASE)
#undef CASE
    }
    return __int_as_float(0x7fc00000);  // unknown type: NaN, caught by the finite checks
}

// Q4_K, Q5_K, Q6_K (kwide.cuh) and, with IQ4, IQ4_XS (kwide_iq4.cuh) wide loops, reached after
// the switch of the other formats. Inlined: behind a __noinline__ call as for the I-quants every
// store/add kernel rose to 64 registers (nvcc 13, sm_90; a kernel needs its callee's register
// count). Register counts react to the shape of this dispatch (a single switch with the wide
// cases gave 12-16 byte spills in the w1_b8 and w8_b8 kernels): compare ptxas -v before
// changing it (docs/perf-notes.md v7 and v8 have the tables).
template <bool IQ4> __device__ __forceinline__ bool is_wide(int type) {
    return (type >= T_Q4_K && type <= T_Q6_K) || (IQ4 && type == T_IQ4_XS);
}
template <bool IQ4> __device__ __forceinline__ float row_dot_kq(int type, const u8* row, XS xa, int K,
                                                                int lane, int g0, int gstep) {
    switch (type) {
#define CASE(T) case T: return row_dot_wide<T>(row, xa, K, lane, g0, gstep);
        FOR_EACH_WIDE_TYPE(CASE)
#undef CASE
        case T_IQ4_XS:
            if constexpr (IQ4) return row_dot_wide_iq4(row, xa, K, lane, g0, gstep);
            break;
    }
    return __int_as_float(0x7fc00000);
}
template <bool IQ4> __device__ __forceinline__ float2 row_dot2_kq(int type, const u8* r0, const u8* r1, XS xa,
                                                                  int K, int lane, int g0, int gstep) {
    switch (type) {
#define CASE(T) case T: return row_dot2_wide<T>(r0, r1, xa, K, lane, g0, gstep);
        FOR_EACH_WIDE_TYPE(CASE)
#undef CASE
        case T_IQ4_XS:
            if constexpr (IQ4) return row_dot2_wide_iq4(r0, r1, xa, K, lane, g0, gstep);
            break;
    }
    return make_float2(__int_as_float(0x7fc00000), __int_as_float(0x7fc00000));
}

// Runtime dispatch on the GGML type id (uniform per warp, so no divergence).
template <bool IQ4>
__device__ __forceinline__ float row_dot_any(int type, const u8* row, const int4* xq, const int* xs,
                                             const float* xd, int K, int lane, int g0, int gstep) {
    switch (type) {
#define CASE(T) case T: return row_dot<T>(row, xq, xs, xd, K, lane, g0, gstep);
        FOR_EACH_TYPE(CASE)
#undef CASE
#define CASE(T) case T | NARROW_BIT: return row_dot<T>(row, xq, xs, xd, K, lane, g0, gstep);
        FOR_EACH_WIDE_TYPE(CASE)
#undef CASE
    }
    if (is_wide<IQ4>(type)) return row_dot_kq<IQ4>(type, row, xs_addr(xq, xs, xd), K, lane, g0, gstep);
    if constexpr (IQ4) return row_dot_iq_smem(type, row, K, lane, g0, gstep);  // IQ4_XS | NARROW_BIT included
    else return row_dot_iq(type, row, xq, xs, xd, K, lane, g0, gstep);
}

template <bool IQ4>
__device__ __forceinline__ float2 row_dot2_any(int t0, int t1, const u8* r0, const u8* r1, const int4* xq,
                                               const int* xs, const float* xd, int K, int lane, int g0,
                                               int gstep) {
    if (t0 == t1) {
        switch (t0) {
#define CASE(T) case T: return row_dot2<T>(r0, r1, xq, xs, xd, K, lane, g0, gstep);
            FOR_EACH_TYPE(CASE)
#undef CASE
#define CASE(T) case T | NARROW_BIT: return row_dot2<T>(r0, r1, xq, xs, xd, K, lane, g0, gstep);
            FOR_EACH_WIDE_TYPE(CASE)
#undef CASE
        }
        if (is_wide<IQ4>(t0)) return row_dot2_kq<IQ4>(t0, r0, r1, xs_addr(xq, xs, xd), K, lane, g0, gstep);
    }
    return make_float2(row_dot_any<IQ4>(t0, r0, xq, xs, xd, K, lane, g0, gstep),
                       row_dot_any<IQ4>(t1, r1, xq, xs, xd, K, lane, g0, gstep));
}

// MODE 0: out = y (+ bias); MODE 1: out += y (+ bias); MODE 2: SwiGLU, segments 0 and 1 are
// gate and up with equal rows, out(seg 0) = silu(gate) * up.
// IQ4: the wide IQ4_XS loop is compiled in (the _iq4 kernels). Those keep the norm's scale in
// shared memory, re-read per row (xsc), instead of a register, for the registers of the inlined
// IQ4_XS loop; the others are v6's code (register tables: docs/perf-notes.md v8).
template <int MODE, int WPR, int NW, bool IQ4>
__device__ void gemv_body(const SegTable& t, const float* x, const float* norm, float eps, int K,
                          int total_rows) {
    __shared__ float scratch[32];
    __shared__ float part[2][NW];
    __shared__ float xsc[IQ4 ? NW : 1];  // IQ4: the norm's scale per warp
    const int Kp = (K + 255) & ~255;
    int4* xq = smem4;
    int* xs = (int*)(smem4 + Kp / 8);
    float* xd = (float*)(xs + Kp / 8);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, sub = warp % WPR;
    const int rows_per_block = NW / WPR, stride = gridDim.x * rows_per_block;
    const int first = blockIdx.x * rows_per_block + warp / WPR;
    // Before the PDL wait (the weights are constants): ask L2 for the rows of the first
    // PF_AHEAD iterations, so their HBM latency overlaps the previous kernel's tail.
#pragma unroll
    for (int i = 0; i < PF_AHEAD; ++i)
        prefetch_row(t, first + i * stride, total_rows, MODE == 2, sub * 32 + lane, WPR * 32);
    pdl_wait();     // x (and the output, for "add") come from the previous kernels
    pdl_trigger();  // the next node may launch and start its own prefetch now
    const float rs = stage_xq(x, norm, eps, K, xq, xs, xd, scratch);  // every lane: the same value
    if constexpr (IQ4) xsc[warp] = rs;
    for (int base = blockIdx.x * rows_per_block; base < total_rows; base += stride) {
        int row = base + warp / WPR;
        prefetch_row(t, row + PF_AHEAD * stride, total_rows, MODE == 2, sub * 32 + lane, WPR * 32);
        float y = 0.f, up = 0.f;
        int si = 0;
        if (row < total_rows) {
            if (MODE == 2) {
                const float2 r = row_dot2_any<IQ4>(t.s[0].type, t.s[1].type,
                                                   (const u8*)t.s[0].w + (size_t)t.row_bytes[0] * row,
                                                   (const u8*)t.s[1].w + (size_t)t.row_bytes[1] * row,
                                                   xq, xs, xd, K, lane, sub, WPR);
                y = r.x;
                up = r.y;
            } else {
                si = find_seg(t, row);
                y = row_dot_any<IQ4>(t.s[si].type, (const u8*)t.s[si].w + (size_t)t.row_bytes[si] * row,
                                     xq, xs, xd, K, lane, sub, WPR);
            }
        }
        const float xscale = IQ4 ? xsc[warp] : rs;
        y = warp_sum(y) * xscale;
        if (MODE == 2) up = warp_sum(up) * xscale;
        combine_warps<WPR>(y, up, part[0], part[1], warp, sub, lane);
        if (row >= total_rows || sub != 0 || lane != 0) continue;
        store_row<MODE>(t.s[si], row, y, up);
    }
}

// Two argument conventions: the segment table by value (kernel parameter space: no memory
// round trip before the first weight prefetch can be issued; engine v4 default) or through
// a device pointer (engine v1-v3; kept selectable for A/B, GGUF_HARNESS_GEMV_ARGS=pointer).
// Compiled with -DGEMV_IQ4 the source holds only the _iq4 kernels (IQ4_XS wide loop, v7's
// code; ops.py builds that module only for a node with an IQ4_XS segment), without it only
// the others (v6's code): each build compiles half the instances, and a model without IQ4_XS
// never compiles the _iq4 ones.
#ifdef GEMV_IQ4
#define GEMV_IQ4_FLAG true
#define GEMV_SFX _iq4
#else
#define GEMV_IQ4_FLAG false
#define GEMV_SFX
#endif
#define GEMV_KERNEL(MODE, MNAME, WPR, NW, SFX)                                                 \
    extern "C" __global__ void __launch_bounds__(NW * 32)                                       \
    gemv_##MNAME##_w##WPR##_b##NW##SFX(const SegTable t, const float* x, const float* norm,     \
                                       float eps, int K, int total_rows) {                      \
        gemv_body<MODE, WPR, NW, GEMV_IQ4_FLAG>(t, x, norm, eps, K, total_rows);                \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(NW * 32)                                       \
    gemvp_##MNAME##_w##WPR##_b##NW##SFX(const SegTable* __restrict__ t, const float* x,         \
                                        const float* norm, float eps, int K, int total_rows) {  \
        gemv_body<MODE, WPR, NW, GEMV_IQ4_FLAG>(*t, x, norm, eps, K, total_rows);               \
    }
// (GEMV_MODES_ receives GEMV_SFX macro-expanded: _iq4 or nothing, then pasted onto the name)
#define GEMV_MODES_(WPR, NW, SFX) GEMV_KERNEL(0, store, WPR, NW, SFX) \
    GEMV_KERNEL(1, add, WPR, NW, SFX) GEMV_KERNEL(2, swiglu, WPR, NW, SFX)
#define GEMV_MODES(WPR, NW) GEMV_MODES_(WPR, NW, GEMV_SFX)
// kernel names: gemv[p]_<mode>_w<warps per row>_b<warps per block>[_iq4]
GEMV_MODES(1, 4) GEMV_MODES(1, 8) GEMV_MODES(2, 8) GEMV_MODES(4, 8) GEMV_MODES(8, 8)
