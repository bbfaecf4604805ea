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
//   B-D. scores, softmax, p . v: attn_split.cuh, shared with attention_head.cu.
//   E. ns == 1: out = o / l * sigmoid(gate); else partials, and the last block of head h
//      merges them and applies the gate.
// Buffers (float32 unless noted):
//   qg [n_head * 2D]: Wq output, head h at [2Dh, 2Dh + D) query, [2Dh + D, 2Dh + 2D) gate
//   k, v [n_kv * D]: Wk, Wv outputs; qn_w, kn_w [D]: attn_q_norm / attn_k_norm weights
//   kc, vc: fp16 (u16) [n_ctx, n_kv, D]; state: int32 [4], state[1] = position
//   out [n_head * D]; part [n_head * ns_max * (D + 4)]; counter int32 [n_head] (zeros)
// Python side: backends/engine/gated_attn_ops.py.
#include "attn_split.cuh"

// Position stream of rotated pair p under IMROPE (oracles/rope_multi.py pair_streams):
// true when the pair reads stream e (position 0 for text), false for t/h/w (the token position).
__device__ __forceinline__ bool imrope_stream_e(int p, int s0, int s1, int s2, int s3) {
    const int sec = p % (s0 + s1 + s2 + s3), r = sec % 3;
    if (r == 1 && sec < 3 * s1) return false;
    if (r == 2 && sec < 3 * s2) return false;
    if (r == 0 && sec < 3 * s0) return false;
    return true;
}

template <int D>
__device__ void attn_gated_body(const float* qg, const float* k, const float* v,
                                const float* __restrict__ qn_w, const float* __restrict__ kn_w,
                                u16* kc, u16* vc, const int* state, float* out, float* part,
                                int* counter, int n_head, int n_kv, int n_rot, int s0, int s1,
                                int s2, int s3, int ns_max, int chunk_max, int split_min,
                                int single, float freq_base, float scale, float freq_scale,
                                float eps) {
    static_assert(D <= SPLIT_THREADS, "one thread per head dim in the norms");
    extern __shared__ float sm[];
    float* sc = sm;                            // [chunk_max] scores, then probabilities
    float* red = sc + ((chunk_max + 3) & ~3);  // [RG][D] row-group sums (RG * D = 2048)
    __shared__ __align__(16) float qs[D];
    __shared__ float qn[D], kn[D], rsn[128], rcs[128], scratch[32], wm[SPLIT_MAX_NS];
    __shared__ int last;
    const int h = blockIdx.x, s = blockIdx.y, G = n_head / n_kv, g = h / G, hh = h - g * G;
    const int tid = threadIdx.x;
    // the step state was written before this graph launch (host set or the previous
    // replay's finish_step): readable before the PDL wait, as in attention_head.cu
    const SplitRange r = split_range(state, s, ns_max, split_min, single);
    if (s >= r.ns) return;  // no work at this position (reads and writes nothing)
    const int pos = r.pos;
    const size_t row = (size_t)n_kv * D;
    // 0. K/V lines of earlier positions, RoPE angles, norm weights (none written by a kernel
    //    of this step)
    split_prefetch<D>(kc, vc, row, g, G, hh, r);
    for (int p = tid; p < n_rot / 2; p += SPLIT_THREADS) {
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
    if (r.t0 <= pos && pos < r.t1) {
        for (int i = tid; i < D; i += SPLIT_THREADS) {
            const size_t o = (size_t)pos * row + (size_t)g * D + i;
            kc[o] = f2h(rope_elem(kn, i, n_rot, rsn, rcs));
            vc[o] = f2h(v[(size_t)g * D + i]);
        }
    }
    __syncthreads();  // qs ready; the new cache row visible to this block
    split_scores<D>(qs, kc, row, g, r, sc);  // B
    float m, l;
    split_softmax(sc, r.P, scratch, m, l);    // C
    split_pv<D>(vc, row, g, r, sc, red);      // D
    const float* gate = qg + (size_t)h * 2 * D + D;
    split_finish<D>(r, h, s, ns_max, m, l, red, gate, out, part, counter, scratch, wm, &last);  // E
}

// minBlocks 2 lets ptxas use up to 128 registers: with the default it capped these kernels at
// 64 and spilled 8 bytes at D = 256 (nvcc 13, sm_90); 68-72 registers, no spills, with it.
#define GATED_KERNEL(D)                                                                        \
    extern "C" __global__ void __launch_bounds__(SPLIT_THREADS, 2) attn_gated_d##D(               \
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
