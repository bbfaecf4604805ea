// Gated full-attention decode step of a qwen35 attention layer: one block of 8 warps per
// (query head h, context split s), fp16 KV cache, GQA, output gate.
//
// Semantics: oracles/qwen35.py Qwen35Oracle._attention (float64 reference), which follows
// llama.cpp src/models/qwen35.cpp build_layer_attn: the Wq projection holds, per query head,
// [query D | gate D] (interleaved per head, not two halves of the whole row); q and k get a
// per-head RMS norm with the attn_q_norm / attn_k_norm weights, then the interleaved
// multi-section RoPE (ggml_rope_multi, GGML_ROPE_TYPE_IMROPE) on the first n_rot dims in NEOX
// pair order; softmax(q k^T * scale) v over positions <= pos with query head h reading KV
// head h / (n_head / n_kv); the result times sigmoid(gate) is this node's output (the input
// of the attn_output GEMV). Text positions: llama.cpp feeds the streams (p, p, p, 0)
// (src/llama-graph.cpp llm_graph_input_pos::set_input), so a rotated pair takes the token
// position unless IMROPE assigns it to stream e, whose position is 0 (not rotated): the pair
// rule is oracles/rope_multi.py pair_streams (ggml-cpu ops.cpp ggml_mrope_cache_init).
//
// Structure: attention_head.cu (v6 decode attention) with the norms, the IMROPE position
// choice and the gate added; the same split rule, 8 lanes per position in the scores, row
// groups in p . v and the last-block merge of the splits (flash-decoding, Dao et al. 2023;
// online softmax maths: Milakov & Gimelshein 2018). Per block, 256 threads:
//   0. before the PDL wait: RoPE angles of this position (0 for stream-e pairs), the q/k norm
//      weights (uploaded, never written by a kernel), L2 prefetch of earlier K/V rows.
//   A. q of head h: rms-normed * q_norm, roped, scaled -> shared; k of KV head g normed and
//      roped; the block(s) whose split holds pos write the new k, v row as fp16 (the G writer
//      blocks of a group store identical values; see attention_head.cu).
//   B-D. scores, softmax, p . v as attention_head.cu.
//   E. ns == 1: out = o / l * sigmoid(gate); else partials, and the last block of head h
//      merges them and applies the gate.
// Buffers (float32 unless noted):
//   qg [n_head * 2D]: Wq output, head h at [2Dh, 2Dh + D) query, [2Dh + D, 2Dh + 2D) gate
//   k, v [n_kv * D]: Wk, Wv outputs; qn_w, kn_w [D]: attn_q_norm / attn_k_norm weights
//   kc, vc: fp16 (u16) [n_ctx, n_kv, D]; state: int32 [4], state[1] = position
//   out [n_head * D]; part [n_head * ns_max * (D + 4)]; counter int32 [n_head] (zeros)
// Python side: backends/engine/gated_attn_ops.py.
#include "rope.cuh"

#define AG_WARPS 8
#define AG_THREADS (AG_WARPS * 32)
#define AG_LPP 8       // lanes per position in the scores
#define AG_MAX_NS 128  // context splits (gated_attn_ops.py MAX_SPLITS)

__device__ __forceinline__ float ag_block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < AG_WARPS ? scratch[lane] : -INFINITY;
    return warp_max(v);
}

// Position stream of rotated pair p under IMROPE (oracles/rope_multi.py pair_streams):
// true when the pair reads stream e (position 0 for text), false for t/h/w (the token position).
__device__ __forceinline__ bool imrope_stream_e(int p, int s0, int s1, int s2, int s3) {
    const int sec = p % (s0 + s1 + s2 + s3), r = sec % 3;
    if (r == 1 && sec < 3 * s1) return false;
    if (r == 2 && sec < 3 * s2) return false;
    if (r == 0 && sec < 3 * s0) return false;
    return true;
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.f / (1.f + expf(-x)); }

template <int D>
__device__ void attn_gated_body(const float* qg, const float* k, const float* v,
                                const float* __restrict__ qn_w, const float* __restrict__ kn_w,
                                u16* kc, u16* vc, const int* state, float* out, float* part,
                                int* counter, int n_head, int n_kv, int n_rot, int s0, int s1,
                                int s2, int s3, int ns_max, int chunk_max, int split_min,
                                int single, float freq_base, float scale, float freq_scale,
                                float eps) {
    constexpr int DL = D / AG_LPP;       // score dims per lane: 8, 16, 32
    constexpr int RL = D / 8;            // p . v threads per V row (8 dims each): 8, 16, 32
    constexpr int RG = AG_THREADS / RL;  // V rows per pass: 32, 16, 8
    static_assert(D <= AG_THREADS, "one thread per head dim in the norms");
    extern __shared__ float sm[];
    float* sc = sm;                            // [chunk_max] scores, then probabilities
    float* red = sc + ((chunk_max + 3) & ~3);  // [RG][D] row-group sums (RG * D = 2048)
    __shared__ __align__(16) float qs[D];
    __shared__ float qn[D], kn[D], rsn[128], rcs[128], scratch[32], wm[AG_MAX_NS];
    __shared__ int last;
    const int h = blockIdx.x, s = blockIdx.y, G = n_head / n_kv, g = h / G, hh = h - g * G;
    const int tid = threadIdx.x;
    // the step state was written before this graph launch (host set or the previous
    // replay's finish_step): readable before the PDL wait, as in attention_head.cu
    const int pos = state[1], n = pos + 1;
    const int ns = n <= single ? 1 : min(ns_max, (n + split_min - 1) / split_min);
    if (s >= ns) return;  // no work at this position (reads and writes nothing)
    const int chunk = (n + ns - 1) / ns, t0 = s * chunk, t1 = min(n, t0 + chunk), P = max(0, t1 - t0);
    const size_t row = (size_t)n_kv * D;
    // 0. K/V lines of earlier positions, RoPE angles, norm weights (none written by a kernel
    //    of this step)
    {
        constexpr int LINES = D / 64;  // 128-byte lines per fp16 row
        const int nr = min(t1, pos) - t0, mine = nr > hh ? (nr - hh + G - 1) / G : 0;
        for (int idx = tid; idx < mine * 2 * LINES; idx += AG_THREADS) {
            const int r = idx / (2 * LINES), kv = (idx / LINES) & 1, c = idx % LINES;
            const u16* base = (kv ? vc : kc) + (size_t)(t0 + hh + G * r) * row + (size_t)g * D + 64 * c;
            asm volatile("prefetch.global.L2 [%0];" ::"l"(base));
        }
    }
    for (int p = tid; p < n_rot / 2; p += AG_THREADS) {
        float sn, cs;
        rope_sincos(imrope_stream_e(p, s0, s1, s2, s3) ? 0 : pos, p, n_rot, freq_base, freq_scale, sn, cs);
        rsn[p] = sn;
        rcs[p] = cs;
    }
    const float wq = tid < D ? qn_w[tid] : 0.f, wk = tid < D ? kn_w[tid] : 0.f;
    pdl_wait();     // qg, k, v come from the QKV node
    pdl_trigger();  // the o-proj node may launch and prefetch its weights now
    // A. per-head RMS norms (ggml_rms_norm over D, then * weight), one thread per dim
    const float xq = tid < D ? qg[(size_t)h * 2 * D + tid] : 0.f;
    const float xk = tid < D ? k[(size_t)g * D + tid] : 0.f;
    const float ssq = block_sum(xq * xq, scratch);
    const float ssk = block_sum(xk * xk, scratch);
    if (tid < D) {
        qn[tid] = xq * (1.f / sqrtf(ssq / (float)D + eps)) * wq;
        kn[tid] = xk * (1.f / sqrtf(ssk / (float)D + eps)) * wk;
    }
    __syncthreads();  // qn, kn (and the angles) ready
    if (tid < D) qs[tid] = rope_elem(qn, tid, n_rot, rsn, rcs) * scale;
    if (t0 <= pos && pos < t1) {
        for (int i = tid; i < D; i += AG_THREADS) {
            const size_t o = (size_t)pos * row + (size_t)g * D + i;
            kc[o] = f2h(rope_elem(kn, i, n_rot, rsn, rcs));
            vc[o] = f2h(v[(size_t)g * D + i]);
        }
    }
    __syncthreads();  // qs ready; the new cache row visible to this block
    // B. scores: 8 lanes per position
    {
        const int j = tid & (AG_LPP - 1), slot = tid / AG_LPP;
        float qr[DL];
#pragma unroll
        for (int e = 0; e < DL; ++e) qr[e] = qs[j * DL + e];
        const u16* kb = kc + (size_t)g * D + j * DL;
        // two position passes in flight, one at D = 256 (32 q values per lane: two passes
        // spilled at 64 registers, nvcc 13 sm_90; attention_head.cu d256 spills there too)
#pragma unroll(D == 256 ? 1 : 2)
        for (int tb = t0; tb < t1; tb += AG_THREADS / AG_LPP) {
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
            // every lane shuffles (block-uniform loop bound); groups of 8 are lane-aligned
            acc += __shfl_xor_sync(0xffffffffu, acc, 1);
            acc += __shfl_xor_sync(0xffffffffu, acc, 2);
            acc += __shfl_xor_sync(0xffffffffu, acc, 4);
            if (j == 0 && t < t1) sc[t - t0] = acc;
        }
    }
    __syncthreads();
    // C. softmax over [t0, t1)
    float m = -INFINITY;
    for (int i = tid; i < P; i += AG_THREADS) m = fmaxf(m, sc[i]);
    m = ag_block_max(m, scratch);
    float l = 0.f;
    for (int i = tid; i < P; i += AG_THREADS) {
        const float p = expf(sc[i] - m);
        sc[i] = p;
        l += p;
    }
    l = block_sum(l, scratch);  // its barriers also publish the probabilities
    // D. p . v: RL threads per V row (8 dims each), RG rows per pass
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
    const float* gate = qg + (size_t)h * 2 * D + D;
    constexpr int PS = D + 4;  // partial row: o[D], m, l, pad (float4-aligned rows)
    float* mine = part + ((size_t)h * ns_max + s) * PS;
    for (int i = tid; i < D; i += AG_THREADS) {
        float o = 0.f;
#pragma unroll
        for (int r = 0; r < RG; ++r) o += red[r * D + i];
        if (ns == 1) {  // the only block of head h: normalise, gate, write the output
            out[(size_t)h * D + i] = o / l * sigmoidf_(gate[i]);
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
    for (int j = tid; j < ns; j += AG_THREADS) {
        const float mj = __ldcg(ph + (size_t)j * PS + D);
        wm[j] = mj;
        M = fmaxf(M, mj);
    }
    M = ag_block_max(M, scratch);  // finite: split 0 always holds position 0
    float L = 0.f;
    for (int j = tid; j < ns; j += AG_THREADS) {
        const float w = wm[j] == -INFINITY ? 0.f : expf(wm[j] - M);  // empty split: weight 0
        wm[j] = w;
        L += w * __ldcg(ph + (size_t)j * PS + D + 1);
    }
    L = block_sum(L, scratch);  // its barriers also publish wm
    const float r = 1.f / L;
    for (int i = tid; i < D; i += AG_THREADS) {
        float o = 0.f;
#pragma unroll 8
        for (int j = 0; j < ns; ++j) o = fmaf(__ldcg(ph + (size_t)j * PS + i), wm[j], o);
        out[(size_t)h * D + i] = o * r * sigmoidf_(gate[i]);
    }
}

#define GATED_KERNEL(D)                                                                        \
    extern "C" __global__ void __launch_bounds__(AG_THREADS) attn_gated_d##D(                  \
        const float* qg, const float* k, const float* v, const float* qn_w, const float* kn_w, \
        u16* kc, u16* vc, const int* state, float* out, float* part, int* counter, int n_head, \
        int n_kv, int n_rot, int s0, int s1, int s2, int s3, int ns, int chunk_max,           \
        int split_min, int single, float freq_base, float scale, float freq_scale, float eps) { \
        attn_gated_body<D>(qg, k, v, qn_w, kn_w, kc, vc, state, out, part, counter, n_head,    \
                           n_kv, n_rot, s0, s1, s2, s3, ns, chunk_max, split_min, single,      \
                           freq_base, scale, freq_scale, eps);                                 \
    }
GATED_KERNEL(64)
GATED_KERNEL(128)
GATED_KERNEL(256)
