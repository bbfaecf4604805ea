// Shared device helpers for the engine's kernels (compiled by NVRTC through cupy.RawModule).
// No CUDA headers: fp16 <-> fp32 use the hardware cvt instructions through inline PTX
// (docs/sources.md §2: the hardware conversion, not a software routine).
#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef signed char i8;

// NVRTC compiles without the C headers: define what <math.h> would.
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
__device__ __forceinline__ bool finite_f32(float v) {
    return (__float_as_uint(v) & 0x7f800000u) != 0x7f800000u;
}

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Programmatic dependent launch (backends/engine/launch.py; PTX ISA `griddepcontrol`).
// pdl_wait: block until the previous kernel of the stream has completed and its writes are
// visible; every kernel calls it before reading another kernel's output and before any
// global write (no-op when launched without the PDL attribute). pdl_trigger: let the next
// kernel launch now (its blocks start on free SM slots and run up to their own pdl_wait).
// DIAG_NOWAIT (module.py GGUF_HARNESS_DIAG, a timing-only build): no wait at all.
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900 && !defined(DIAG_NOWAIT)
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Thread-block cluster primitives (PTX ISA: %cluster_ctarank, barrier.cluster, mapa,
// st.shared::cluster), for kernels compiled with __cluster_dims__ (gemv_kq.cu KQ_CSPLIT,
// deltanet.cu gdn_step_cs4_s128); without a cluster they act on a cluster of one block.
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r = 0;
#if __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
    return r;
}
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
#endif
}
// full barrier: this thread's earlier shared::cluster stores are visible to the cluster after it
__device__ __forceinline__ void cluster_sync() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}
// *p of the block of cluster rank `rank` (p: this block's address of the same shared variable) = v
__device__ __forceinline__ void st_cluster_f32(float* p, unsigned rank, float v) {
#if __CUDA_ARCH__ >= 900
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    unsigned ra;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(a), "r"(rank));
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(ra), "f"(v) : "memory");
#endif
}

__device__ __forceinline__ float bf2f(u16 b) { return __uint_as_float(((u32)b) << 16); }

// Little-endian loads at 2-byte aligned addresses (Q8_0, Q5_0, Q6_K, Q3_K blocks are only
// 2-byte aligned: 34, 22, 210, 110 bytes).
__device__ __forceinline__ u16 ld_u16(const u8* p) { return *(const u16*)p; }
__device__ __forceinline__ u32 ld_u32_a2(const u8* p) {
    return (u32)ld_u16(p) | ((u32)ld_u16(p + 2) << 16);
}
// 8 bytes from a 2-byte aligned address -> two little-endian words.
__device__ __forceinline__ void ld8_a2(const u8* p, u32& lo, u32& hi) {
    lo = ld_u32_a2(p);
    hi = ld_u32_a2(p + 4);
}
__device__ __forceinline__ void ld8_a8(const u8* p, u32& lo, u32& hi) {
    uint2 v = *(const uint2*)p;
    lo = v.x;
    hi = v.y;
}
__device__ __forceinline__ int byte_of(u32 lo, u32 hi, int k) {
    return (int)(((k < 4 ? lo : hi) >> (8 * (k & 3))) & 0xFF);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block-wide sum; `scratch` holds >= 32 floats of shared memory. All threads get the result.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nw ? scratch[lane] : 0.f;
    return warp_sum(v);
}

// ggml_vec_silu_f32: x / (1 + exp(-x)); expf (not __expf) for accuracy
__device__ __forceinline__ float silu(float x) { return x / (1.f + expf(-x)); }

// GGML type ids (ggml.h enum ggml_type).
#define T_F32 0
#define T_F16 1
#define T_Q4_0 2
#define T_Q4_1 3
#define T_Q5_0 6
#define T_Q5_1 7
#define T_Q8_0 8
#define T_Q2_K 10
#define T_Q3_K 11
#define T_Q4_K 12
#define T_Q5_K 13
#define T_Q6_K 14
#define T_IQ2_XXS 16
#define T_IQ2_XS 17
#define T_IQ3_XXS 18
#define T_IQ1_S 19
#define T_IQ4_NL 20
#define T_IQ3_S 21
#define T_IQ2_S 22
#define T_IQ4_XS 23
#define T_IQ1_M 29
#define T_BF16 30
