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
// Per block, 256 threads, positions [t0, t1) (chunk = ceil((pos + 1) / ns)); phases B-E are
// shared with attention_gated.cu (attn_split.cuh):
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
#include "attn_split.cuh"

template <int D>
__device__ void attn_head_body(const float* __restrict__ q, const float* __restrict__ k,
                               const float* __restrict__ v, u16* kc, u16* vc, const int* state,
                               float* out, float* part, int* counter, int n_head, int n_kv, int n_rot,
                               int ns_max, int chunk_max, int split_min, int single, float freq_base,
                               float scale, float freq_scale) {
    extern __shared__ float sm[];
    float* sc = sm;                            // [chunk_max] scores, then probabilities
    float* red = sc + ((chunk_max + 3) & ~3);  // [RG][D] row-group sums, 16-byte aligned (RG * D = 2048; bytes: ops.py)
    __shared__ __align__(16) float qs[D];
    __shared__ float rsn[128], rcs[128], scratch[32], wm[SPLIT_MAX_NS];
    __shared__ int last;
    const int h = blockIdx.x, s = blockIdx.y, G = n_head / n_kv, g = h / G, hh = h - g * G;
    const int tid = threadIdx.x;
    const SplitRange r = split_range(state, s, ns_max, split_min, single);
    if (s >= r.ns) return;  // no work at this position (reads and writes nothing)
    const int pos = r.pos;
    const size_t row = (size_t)n_kv * D;
    // 0. K/V lines of earlier positions (written by earlier steps) and the RoPE angles
    split_prefetch<D>(kc, vc, row, g, G, hh, r);
    for (int p = tid; p < n_rot / 2; p += SPLIT_THREADS) {
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
    if (r.t0 <= pos && pos < r.t1) {
        for (int i = tid; i < D; i += SPLIT_THREADS) {
            const size_t o = (size_t)pos * row + (size_t)g * D + i;
            kc[o] = f2h(rope_elem(k + (size_t)g * D, i, n_rot, rsn, rcs));
            vc[o] = f2h(v[(size_t)g * D + i]);
        }
    }
    __syncthreads();  // qs ready; the new cache row visible to this block
    split_scores<D>(qs, kc, row, g, r, sc);  // B
    float m, l;
    split_softmax(sc, r.P, scratch, m, l);    // C
    split_pv<D>(vc, row, g, r, sc, red);      // D
    split_finish<D>(r, h, s, ns_max, m, l, red, nullptr, out, part, counter, scratch, wm, &last);  // E
}

#define HEAD_KERNEL(D)                                                                              \
    extern "C" __global__ void __launch_bounds__(SPLIT_THREADS) attn_head_d##D(                     \
        const float* q, const float* k, const float* v, u16* kc, u16* vc, const int* state,         \
        float* out, float* part, int* counter, int n_head, int n_kv, int n_rot, int ns,             \
        int chunk_max, int split_min, int single, float freq_base, float scale, float freq_scale) { \
        attn_head_body<D>(q, k, v, kc, vc, state, out, part, counter, n_head, n_kv, n_rot, ns,      \
                          chunk_max, split_min, single, freq_base, scale, freq_scale);              \
    }
HEAD_KERNEL(64)
HEAD_KERNEL(128)
HEAD_KERNEL(256)
