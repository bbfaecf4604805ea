// Decode attention v6: one block of 8 warps per (query head h, context split s).
//
// Same semantics as attention.cu / attention_gqa.cu (llama.cpp src/models/qwen2.cpp + ggml_rope_ext
// mode NEOX, build_attn: softmax(q.k / sqrt(D)) . v, query head h reads KV head h / (n_head /
// n_kv); the new token's k and v are rounded to fp16 as the cache stores them). Split-context
// merge as in flash-decoding (Dao et al. 2023); online softmax maths: Milakov & Gimelshein 2018.
//
// Why per query head (docs/perf-notes.md, v6): v5 (attention_gqa.cu) gave one block to a whole
// KV group and scored one position per lane, so each lane ran G x D multiply-adds for its
// position in one serial instruction stream: ~6 us at the 1.5B shape (G = 6, D = 128) whether
// the block held 5 or 71 positions (leave-out ablation). Here a block scores one head, 8 lanes
// per position (D/8 dims each, 3 shuffles), so a lane runs D/8 multiply-adds per position and
// the G heads of a group run on G SMs; the K/V rows they share come from L2.
//
// Splits in use: ns = 1 up to `single` positions, else min(NS, ceil((pos + 1) / split_min));
// blocks s >= ns exit at once. With ns == 1 the block writes the output itself (no partials,
// fence, atomic or merge: ~2.5 us per node here, measured, docs/perf-notes.md v6).
// Per block, 256 threads, positions [t0, t1) (chunk = ceil((pos + 1) / ns)):
//   0. before the PDL wait (nothing here reads the previous kernel's output): RoPE angles of
//      this position; L2 prefetch of earlier K/V rows (the G blocks of a KV group take every
//      G-th row each).
//   A. q of head h roped and scaled -> shared; the block(s) owning `pos` rope k and write the
//      new k, v row of KV head g. Every block of the group whose split holds pos writes that
//      row: the G writers store identical fp16 values (same inputs, same arithmetic), so each
//      block reads back its own write after the barrier and the duplicate stores are benign.
//   B. scores: 8 lanes per position, lane j holds dims [j D/8, (j+1) D/8) of q in registers and
//      reads the same dims of the K row (16-byte loads; 8 lanes read one whole row), then 3
//      xor-shuffles; 32 positions per pass.
//   C. softmax over the block's positions (block max, exp, block sum).
//   D. p . v: threads over (8-dim chunk of the row, row group): D/8 threads read one V row in
//      16-byte loads, 2048/D rows per pass; the row groups' sums meet in shared memory.
//   E. ns > 1: partial (o, m, l) of this split to global memory; the last block of head h to
//      finish (atomic counter, reset for the next launch) merges the ns partials:
//      out = sum_s o_s e^{m_s - M} / sum_s l_s e^{m_s - M}.
#include "rope.cuh"

#define A6_WARPS 8
#define A6_THREADS (A6_WARPS * 32)
#define A6_LPP 8      // lanes per position in the scores
#define A6_MAX_NS 128 // context splits (backends/engine/ops.py gqa_splits)

__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < A6_WARPS ? scratch[lane] : -INFINITY;
    return warp_max(v);
}

template <int D>
__device__ void attn_head_body(const float* __restrict__ q, const float* __restrict__ k,
                               const float* __restrict__ v, u16* kc, u16* vc, const int* state,
                               float* out, float* part, int* counter, int n_head, int n_kv, int n_rot,
                               int ns_max, int chunk_max, int split_min, int single, float freq_base,
                               float scale, float freq_scale) {
    constexpr int DL = D / A6_LPP;       // score dims per lane: 8, 16, 32
    constexpr int RL = D / 8;            // p . v threads per V row (8 dims each): 8, 16, 32
    constexpr int RG = A6_THREADS / RL;  // V rows per pass: 32, 16, 8
    extern __shared__ float sm[];
    float* sc = sm;                      // [chunk_max] scores, then probabilities
    float* red = sc + ((chunk_max + 3) & ~3);  // [RG][D] row-group sums, 16-byte aligned (RG * D = 2048; bytes: ops.py)
    __shared__ __align__(16) float qs[D];
    __shared__ float rsn[128], rcs[128], scratch[32], wm[A6_MAX_NS];
    __shared__ int last;
    const int h = blockIdx.x, s = blockIdx.y, G = n_head / n_kv, g = h / G, hh = h - g * G;
    const int tid = threadIdx.x;
    // the step state was written before this graph launch: readable before the PDL wait
    const int pos = state[1], n = pos + 1;
    const int ns = n <= single ? 1 : min(ns_max, (n + split_min - 1) / split_min);
    if (s >= ns) return;  // no work at this position (reads and writes nothing)
    const int chunk = (n + ns - 1) / ns, t0 = s * chunk, t1 = min(n, t0 + chunk), P = max(0, t1 - t0);
    const size_t row = (size_t)n_kv * D;
    // 0. K/V lines of earlier positions (written by earlier steps) and the RoPE angles
    {
        constexpr int LINES = D / 64;  // 128-byte lines per fp16 row
        const int nr = min(t1, pos) - t0, mine = nr > hh ? (nr - hh + G - 1) / G : 0;
        for (int idx = tid; idx < mine * 2 * LINES; idx += A6_THREADS) {
            const int r = idx / (2 * LINES), kv = (idx / LINES) & 1, c = idx % LINES;
            const u16* base = (kv ? vc : kc) + (size_t)(t0 + hh + G * r) * row + (size_t)g * D + 64 * c;
            asm volatile("prefetch.global.L2 [%0];" ::"l"(base));
        }
    }
    for (int p = tid; p < n_rot / 2; p += A6_THREADS) {
        float sn, cs;
        rope_sincos(pos, p, n_rot, freq_base, freq_scale, sn, cs);
        rsn[p] = sn;
        rcs[p] = cs;
    }
    __syncthreads();
    pdl_wait();     // q, k, v come from the QKV node
    pdl_trigger();  // the o-proj node may launch and prefetch its weights now
    // A. q of head h; the new k, v row of KV head g where this split holds pos
    if (tid < D) qs[tid] = rope_elem(q + (size_t)h * D, tid, n_rot, rsn, rcs) * scale;
    if (t0 <= pos && pos < t1) {
        for (int i = tid; i < D; i += A6_THREADS) {
            const size_t o = (size_t)pos * row + (size_t)g * D + i;
            kc[o] = f2h(rope_elem(k + (size_t)g * D, i, n_rot, rsn, rcs));
            vc[o] = f2h(v[(size_t)g * D + i]);
        }
    }
    __syncthreads();  // qs ready; the new cache row visible to this block
    // B. scores
    {
        const int j = tid & (A6_LPP - 1), slot = tid / A6_LPP;
        float qr[DL];
#pragma unroll
        for (int e = 0; e < DL; ++e) qr[e] = qs[j * DL + e];
        const u16* kb = kc + (size_t)g * D + j * DL;
#pragma unroll 2
        for (int tb = t0; tb < t1; tb += A6_THREADS / A6_LPP) {
            const int t = tb + slot;
            float acc = 0.f;
            if (t < t1) {
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
            // all lanes shuffle (the loop bound is block-uniform); groups of 8 are lane-aligned
            acc += __shfl_xor_sync(0xffffffffu, acc, 1);
            acc += __shfl_xor_sync(0xffffffffu, acc, 2);
            acc += __shfl_xor_sync(0xffffffffu, acc, 4);
            if (j == 0 && t < t1) sc[t - t0] = acc;
        }
    }
    __syncthreads();
    // C. softmax over [t0, t1)
    float m = -INFINITY;
    for (int i = tid; i < P; i += A6_THREADS) m = fmaxf(m, sc[i]);
    m = block_max(m, scratch);
    float l = 0.f;
    for (int i = tid; i < P; i += A6_THREADS) {
        const float p = P > 0 ? expf(sc[i] - m) : 0.f;
        sc[i] = p;
        l += p;
    }
    l = block_sum(l, scratch);  // its barriers also publish the probabilities
    // D. p . v
    {
        const int c = tid % RL, rg = tid / RL;
        float acc[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = 0.f;
        const u16* vb = vc + (size_t)g * D + 8 * c;
#pragma unroll 4
        for (int t = t0 + rg; t < t1; t += RG) {
            const uint4 w = *(const uint4*)(vb + (size_t)t * row);
            float f[8];
            h8(w, f);
            const float p = sc[t - t0];
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[e] = fmaf(p, f[e], acc[e]);
        }
        float4* r4 = (float4*)(red + rg * D + 8 * c);
        r4[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
        r4[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
    }
    __syncthreads();
    constexpr int PS = D + 4;  // partial row: o[D], m, l, pad (float4-aligned rows)
    float* mine = part + ((size_t)h * ns_max + s) * PS;
    for (int i = tid; i < D; i += A6_THREADS) {
        float o = 0.f;
#pragma unroll
        for (int r = 0; r < RG; ++r) o += red[r * D + i];
        if (ns == 1) {  // the only block of head h: normalise and write the output
            out[(size_t)h * D + i] = o / l;
        } else {
            mine[i] = o;
            if (i == 0) {
                mine[D] = P > 0 ? m : -INFINITY;
                mine[D + 1] = l;
            }
        }
    }
    if (ns == 1) return;
    // E. the last block of head h merges (threadfence: partials visible before the count)
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        last = atomicAdd(counter + h, 1) == ns - 1;
        if (last) counter[h] = 0;  // ready for the next launch (graph replay)
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    const float* ph = part + (size_t)h * ns_max * PS;
    float M = -INFINITY;
    for (int j = tid; j < ns; j += A6_THREADS) {
        const float mj = __ldcg(ph + (size_t)j * PS + D);
        wm[j] = mj;
        M = fmaxf(M, mj);
    }
    M = block_max(M, scratch);  // finite: split 0 always holds position 0
    float L = 0.f;
    for (int j = tid; j < ns; j += A6_THREADS) {
        const float w = wm[j] == -INFINITY ? 0.f : expf(wm[j] - M);  // empty split: weight 0
        wm[j] = w;
        L += w * __ldcg(ph + (size_t)j * PS + D + 1);
    }
    L = block_sum(L, scratch);  // its barriers also publish wm
    for (int i = tid; i < D / 4; i += A6_THREADS) {
        float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
        for (int j = 0; j < ns; ++j) {
            const float w = wm[j];
            const float4 x = __ldcg((const float4*)(ph + (size_t)j * PS) + i);
            o.x = fmaf(x.x, w, o.x); o.y = fmaf(x.y, w, o.y); o.z = fmaf(x.z, w, o.z); o.w = fmaf(x.w, w, o.w);
        }
        const float r = 1.f / L;
        *((float4*)(out + (size_t)h * D) + i) = make_float4(o.x * r, o.y * r, o.z * r, o.w * r);
    }
}

#define HEAD_KERNEL(D)                                                                              \
    extern "C" __global__ void __launch_bounds__(A6_THREADS) attn_head_d##D(                        \
        const float* q, const float* k, const float* v, u16* kc, u16* vc, const int* state,         \
        float* out, float* part, int* counter, int n_head, int n_kv, int n_rot, int ns,             \
        int chunk_max, int split_min, int single, float freq_base, float scale, float freq_scale) { \
        attn_head_body<D>(q, k, v, kc, vc, state, out, part, counter, n_head, n_kv, n_rot, ns,      \
                          chunk_max, split_min, single, freq_base, scale, freq_scale);              \
    }
HEAD_KERNEL(64)
HEAD_KERNEL(128)
HEAD_KERNEL(256)
