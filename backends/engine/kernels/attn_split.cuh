// Phases shared by the decode attention kernels that give one block of SPLIT_THREADS threads
// to each (query head h, context split s): attention_head.cu (v6, qwen2) and
// attention_gated.cu (qwen35's gated attention). Each kernel does its own prologue (q, and
// the new k/v row into the fp16 cache) and then calls, in order:
//   split_scores   B. 8 lanes per position (D/8 dims of q in registers, 16-byte K loads,
//                     3 xor-shuffles), 32 positions per pass
//   split_softmax  C. block max, exp, block sum over the split's positions
//   split_pv       D. D/8 threads per V row (16-byte loads), 2048/D rows per pass; row-group
//                     sums in shared memory
//   split_finish   E. one split: out = o / l (times a per-dim gate); several: the partial
//                     (o, m, l) to global memory and the last block of head h to finish
//                     (atomic counter, reset for the next graph replay) merges them:
//                     out = sum_s o_s e^{m_s - M} / sum_s l_s e^{m_s - M}
// Split-context merge as in flash-decoding (Dao et al. 2023); online softmax maths:
// Milakov & Gimelshein 2018. Measured design choices: docs/perf-notes.md, v6.
#pragma once
#include "rope.cuh"

#define SPLIT_WARPS 8
#define SPLIT_THREADS (SPLIT_WARPS * 32)
#define SPLIT_LPP 8      // lanes per position in the scores
#define SPLIT_MAX_NS 128 // context splits (backends/engine/ops.py gqa_splits)

// The positions of split s at the step's position (state[1], written before this graph
// launch: readable before the PDL wait). Splits in use: ns = 1 up to `single` positions, else
// min(ns_max, ceil(n / split_min)); blocks s >= ns have nothing to do (P = 0, ns <= s).
struct SplitRange { int pos, ns, t0, t1, P; };

__device__ __forceinline__ SplitRange split_range(const int* state, int s, int ns_max, int split_min,
                                                  int single) {
    SplitRange r;
    r.pos = state[1];
    const int n = r.pos + 1;
    r.ns = n <= single ? 1 : min(ns_max, (n + split_min - 1) / split_min);
    const int chunk = (n + r.ns - 1) / r.ns;
    r.t0 = s * chunk;
    r.t1 = min(n, r.t0 + chunk);
    r.P = max(0, r.t1 - r.t0);
    return r;
}

__device__ __forceinline__ float split_block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < SPLIT_WARPS ? scratch[lane] : -INFINITY;
    return warp_max(v);
}

__device__ __forceinline__ float gate_sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

// 0. Before the PDL wait: L2 prefetch of the K/V rows of earlier positions of this split
// (written by earlier steps); the G blocks of KV head g (hh = h mod G) take every G-th row.
template <int D>
__device__ __forceinline__ void split_prefetch(const u16* kc, const u16* vc, size_t row, int g, int G,
                                               int hh, const SplitRange& r) {
    constexpr int LINES = D / 64;  // 128-byte lines per fp16 row
    const int nr = min(r.t1, r.pos) - r.t0, mine = nr > hh ? (nr - hh + G - 1) / G : 0;
    for (int idx = threadIdx.x; idx < mine * 2 * LINES; idx += SPLIT_THREADS) {
        const int i = idx / (2 * LINES), kv = (idx / LINES) & 1, c = idx % LINES;
        const u16* base = (kv ? vc : kc) + (size_t)(r.t0 + hh + G * i) * row + (size_t)g * D + 64 * c;
        asm volatile("prefetch.global.L2 [%0];" ::"l"(base));
    }
}

// B. sc[t - t0] = qs . K[t] for t in [t0, t1) (qs: the roped, scaled query in shared memory).
template <int D>
__device__ __forceinline__ void split_scores(const float* qs, const u16* kc, size_t row, int g,
                                             const SplitRange& r, float* sc) {
    constexpr int DL = D / SPLIT_LPP;  // score dims per lane: 8, 16, 32
    const int j = threadIdx.x & (SPLIT_LPP - 1), slot = threadIdx.x / SPLIT_LPP;
    float qr[DL];
#pragma unroll
    for (int e = 0; e < DL; ++e) qr[e] = qs[j * DL + e];
    const u16* kb = kc + (size_t)g * D + j * DL;
    // two position passes in flight (a plain constant, the pragma form NVRTC has compiled in
    // every engine kernel so far; no spills at any D, nvcc 13 sm_90)
#pragma unroll 2
    for (int tb = r.t0; tb < r.t1; tb += SPLIT_THREADS / SPLIT_LPP) {
        const int t = tb + slot;
        float acc = 0.f;
        if (t < r.t1) {
            const uint4* kr = (const uint4*)(kb + (size_t)t * row);
            uint4 w[DL / 8];
#pragma unroll
            for (int c = 0; c < DL / 8; ++c) w[c] = kr[c];
#pragma unroll
            for (int c = 0; c < DL / 8; ++c) {
                float f[8];
                h8(w[c], f);
#pragma unroll
                for (int e = 0; e < 8; ++e) acc = fmaf(qr[8 * c + e], f[e], acc);
            }
        }
        // every lane shuffles (block-uniform loop bound); groups of 8 are lane-aligned
        acc += __shfl_xor_sync(0xffffffffu, acc, 1);
        acc += __shfl_xor_sync(0xffffffffu, acc, 2);
        acc += __shfl_xor_sync(0xffffffffu, acc, 4);
        if (j == 0 && t < r.t1) sc[t - r.t0] = acc;
    }
    __syncthreads();
}

// C. softmax numerator in place over sc[0, P); m = max, l = sum of exp (block-uniform).
__device__ __forceinline__ void split_softmax(float* sc, int P, float* scratch, float& m, float& l) {
    m = -INFINITY;
    for (int i = threadIdx.x; i < P; i += SPLIT_THREADS) m = fmaxf(m, sc[i]);
    m = split_block_max(m, scratch);
    l = 0.f;
    for (int i = threadIdx.x; i < P; i += SPLIT_THREADS) {
        const float p = expf(sc[i] - m);
        sc[i] = p;
        l += p;
    }
    l = block_sum(l, scratch);  // its barriers also publish the probabilities
}

// D. red[rg][d] = sum over the rows t = t0 + rg + RG i of sc[t - t0] V[t][d].
template <int D>
__device__ __forceinline__ void split_pv(const u16* vc, size_t row, int g, const SplitRange& r,
                                         const float* sc, float* red) {
    constexpr int RL = D / 8;               // threads per V row (8 dims each): 8, 16, 32
    constexpr int RG = SPLIT_THREADS / RL;  // V rows per pass: 32, 16, 8
    const int c = threadIdx.x % RL, rg = threadIdx.x / RL;
    float acc[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = 0.f;
    const u16* vb = vc + (size_t)g * D + 8 * c;
#pragma unroll 4
    for (int t = r.t0 + rg; t < r.t1; t += RG) {
        const uint4 w = *(const uint4*)(vb + (size_t)t * row);
        float f[8];
        h8(w, f);
        const float p = sc[t - r.t0];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = fmaf(p, f[e], acc[e]);
    }
    float4* r4 = (float4*)(red + rg * D + 8 * c);
    r4[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    r4[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
    __syncthreads();
}

// E. out[h D + i] = o_i / l * gate_i for one split, else partials + merge (see the header).
// gate: per-dim pre-sigmoid gate of head h, or nullptr (factor 1: x * 1.f == x, so the
// ungated kernel's output is unchanged). part: [n_head, ns_max, D + 4]; counter: [n_head];
// wm: shared [SPLIT_MAX_NS]; last: a shared int.
template <int D>
__device__ __forceinline__ void split_finish(const SplitRange& r, int h, int s, int ns_max, float m,
                                             float l, const float* red, const float* gate,
                                             float* out, float* part, int* counter, float* scratch,
                                             float* wm, int* last) {
    constexpr int RG = SPLIT_THREADS / (D / 8);
    constexpr int PS = D + 4;  // partial row: o[D], m, l, pad (float4-aligned rows)
    const int tid = threadIdx.x, ns = r.ns;
    float* mine = part + ((size_t)h * ns_max + s) * PS;
    for (int i = tid; i < D; i += SPLIT_THREADS) {
        float o = 0.f;
#pragma unroll
        for (int j = 0; j < RG; ++j) o += red[j * D + i];
        if (ns == 1) {  // the only block of head h: normalise (and gate), write the output
            out[(size_t)h * D + i] = o / l * (gate ? gate_sigmoid(gate[i]) : 1.f);
        } else {
            mine[i] = o;
            if (i == 0) {
                mine[D] = r.P > 0 ? m : -INFINITY;
                mine[D + 1] = l;
            }
        }
    }
    if (ns == 1) return;
    // the last block of head h merges (threadfence: partials visible before the count)
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        *last = atomicAdd(counter + h, 1) == ns - 1;
        if (*last) counter[h] = 0;  // ready for the next launch (graph replay)
    }
    __syncthreads();
    if (!*last) return;
    __threadfence();
    const float* ph = part + (size_t)h * ns_max * PS;
    float M = -INFINITY;
    for (int j = tid; j < ns; j += SPLIT_THREADS) {
        const float mj = __ldcg(ph + (size_t)j * PS + D);
        wm[j] = mj;
        M = fmaxf(M, mj);
    }
    M = split_block_max(M, scratch);  // finite: split 0 always holds position 0
    float L = 0.f;
    for (int j = tid; j < ns; j += SPLIT_THREADS) {
        const float w = wm[j] == -INFINITY ? 0.f : expf(wm[j] - M);  // empty split: weight 0
        wm[j] = w;
        L += w * __ldcg(ph + (size_t)j * PS + D + 1);
    }
    L = block_sum(L, scratch);  // its barriers also publish wm
    const float rl = 1.f / L;
    for (int i = tid; i < D / 4; i += SPLIT_THREADS) {
        float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
        for (int j = 0; j < ns; ++j) {
            const float w = wm[j];
            const float4 x = __ldcg((const float4*)(ph + (size_t)j * PS) + i);
            o.x = fmaf(x.x, w, o.x); o.y = fmaf(x.y, w, o.y); o.z = fmaf(x.z, w, o.z); o.w = fmaf(x.w, w, o.w);
        }
        float4 y = make_float4(o.x * rl, o.y * rl, o.z * rl, o.w * rl);
        if (gate) {  // the gated kernel's output gate, applied after the normalisation
            const float4 gt = *((const float4*)gate + i);
            y = make_float4(y.x * gate_sigmoid(gt.x), y.y * gate_sigmoid(gt.y), y.z * gate_sigmoid(gt.z),
                            y.w * gate_sigmoid(gt.w));
        }
        *((float4*)(out + (size_t)h * D) + i) = y;
    }
}
