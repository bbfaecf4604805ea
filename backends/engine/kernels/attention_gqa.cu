// Decode attention v5: one block per (KV head g, context split s), all query heads of the
// group at once; the splits in use grow with the position and are merged by the last block.
//
// Same semantics as attention.cu (llama.cpp src/models/qwen2.cpp + ggml_rope_ext mode NEOX,
// build_attn: softmax(q.k / sqrt(D)) . v, query head h reads KV head h / (n_head / n_kv);
// the new token's k and v are rounded to fp16 as the cache stores them). Why per KV head
// (docs/perf-notes.md, engine v4): every K/V row is read once per group, not once per query
// head. Split-context merge as in flash-decoding (Dao et al. 2023); online softmax maths:
// Milakov & Gimelshein 2018.
//
// Splits in use: ns = min(NS, ceil((pos + 1) / split_min)); blocks s >= ns exit at once.
// With ns == 1 (pos < split_min) the block writes the normalised output itself: no
// partials, no fence, no atomic, no merge (v4 always merged 16 splits: 3.4 of its 10.3 us
// at position 100, measured by leaving phases out, docs/perf-notes.md v5).
// Per block, 4 warps, positions [t0, t1) of this split (chunk = ceil((pos + 1) / ns)):
//   0. prefetch to L2 the K/V rows of earlier positions, then wait for the QKV node (PDL).
//   A. RoPE angles once per rotary pair (shared by the G query heads and k), then q of the
//      G heads roped and scaled -> shared; the block owning `pos` also ropes k and writes
//      the new k, v rows to the cache (it is the only block that reads that row).
//   B. scores, one position per lane: lane j of warp w takes position t0 + 32 (w + 4i) + j
//      and dots its whole K row (16-byte loads) with the G query heads in shared memory
//      (broadcast reads): no shuffles per position (v4's lanes-over-dims scoring did G warp
//      reductions per position: 19.5 us at position 1500).
//   C. softmax per head over the block's positions (max, exp, sum) in shared memory.
//   D. p . v: warps over positions, lanes over dims, G accumulators per lane; the 4 warps'
//      sums meet in shared memory -> the output (ns == 1) or an unnormalised partial
//      (o, m, l) in global memory.
//   E. ns > 1: the last block of group g to finish (atomic counter, reset for the next
//      launch) merges the ns partials: out = sum_s o_s e^{m_s - M} / sum_s l_s e^{m_s - M}.
#include "rope.cuh"

#define NWARP 4
#define MAXG 8     // query heads per KV head
#define MAX_NS 128 // context splits (backends/engine/ops.py gqa_splits)

// Built from the kernel's by-value parameters (no argument struct in global memory: that
// would cost one dependent memory round trip before any other load could start).
struct GqaArgs {
    const float* q; const float* k; const float* v;   // [n_head*D], [n_kv*D], [n_kv*D]
    u16* kc; u16* vc;                                 // [n_ctx, n_kv, D] fp16
    const int* state;                                 // state[1] = position of the new token
    float* out;                                       // [n_head*D]
    float* part;                                      // [n_kv, NS, G, D + 4] (16-byte rows)
    int* counter;                                     // [n_kv], zero between launches
    int n_head, n_kv, n_rot, ns, chunk_max, split_min;  // ns: splits in the grid (max)
    float freq_base, scale, freq_scale;
};

template <int D>
__device__ void attn_gqa_body(const GqaArgs& a) {
    constexpr int E = D / 32;  // dims per lane in p . v
    extern __shared__ float sm[];
    const int G = a.n_head / a.n_kv, g = blockIdx.x, s = blockIdx.y;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    float* qs = sm;                          // [G][D]
    float* sc = qs + G * D;                  // [G][chunk_max]
    float* red = sc + G * a.chunk_max;       // [NWARP][G][D]  (bytes: backends/engine/ops.py)
    __shared__ float mh[MAXG], lh[MAXG], rsn[128], rcs[128];
    __shared__ int last;
    // the step state was written before this graph launch: readable before the PDL wait
    const int pos = a.state[1], n = pos + 1;
    const int ns = min(a.ns, (n + a.split_min - 1) / a.split_min);
    if (s >= ns) return;  // no work at this position (reads and writes nothing)
    const int chunk = (n + ns - 1) / ns, t0 = s * chunk, t1 = min(n, t0 + chunk), P = max(0, t1 - t0);
    const size_t row = (size_t)a.n_kv * D;
    // 0. cache rows of earlier positions were written by earlier steps (earlier graph
    // launches): request their lines from L2 while the QKV node still runs
    for (int idx = tid; idx < 2 * (min(t1, pos) - t0) * (D / 64); idx += blockDim.x) {
        const int kv = idx & 1, r = idx >> 1, t = t0 + r / (D / 64), c = r % (D / 64);
        const u16* base = (kv ? a.vc : a.kc) + (size_t)t * row + (size_t)g * D + 64 * c;
        asm volatile("prefetch.global.L2 [%0];" ::"l"(base));
    }
    pdl_wait();     // q, k, v come from the QKV node
    pdl_trigger();  // the o-proj node may launch and prefetch its weights now
    // A. RoPE angles per pair, then q (and, in the block owning pos, the new k/v row)
    for (int p = tid; p < a.n_rot / 2; p += blockDim.x) {
        float sn, cs;
        rope_sincos(pos, p, a.n_rot, a.freq_base, a.freq_scale, sn, cs);
        rsn[p] = sn;
        rcs[p] = cs;
    }
    __syncthreads();
#pragma unroll 4
    for (int idx = tid; idx < G * D; idx += blockDim.x) {
        const int h = idx / D, i = idx - h * D;
        qs[idx] = rope_elem(a.q + (size_t)(g * G + h) * D, i, a.n_rot, rsn, rcs) * a.scale;
    }
    if (t0 <= pos && pos < t1) {
        for (int i = tid; i < D; i += blockDim.x) {
            const size_t o = (size_t)pos * row + (size_t)g * D + i;
            a.kc[o] = f2h(rope_elem(a.k + (size_t)g * D, i, a.n_rot, rsn, rcs));
            a.vc[o] = f2h(a.v[(size_t)g * D + i]);
        }
    }
    __syncthreads();  // also publishes the new cache row to the block (global writes)
    // B. scores: one position per lane, the whole K row in 16-byte loads
    for (int tile = t0 + 32 * warp; tile < t1; tile += 32 * NWARP) {
        const int t = tile + lane;
        if (t < t1) {
            const uint4* kr = (const uint4*)(a.kc + (size_t)t * row + (size_t)g * D);
            float acc[MAXG];
#pragma unroll
            for (int h = 0; h < MAXG; ++h) acc[h] = 0.f;
#pragma unroll
            for (int c0 = 0; c0 < D / 8; c0 += 8) {  // 64 dims per round: 8 loads in flight
                uint4 w[8];
#pragma unroll
                for (int c = 0; c < 8; ++c) w[c] = kr[c0 + c];
#pragma unroll
                for (int c = 0; c < 8; ++c) {
                    float kf[8];
                    h8(w[c], kf);
#pragma unroll
                    for (int h = 0; h < MAXG; ++h) {
                        if (h < G) {
                            const float4 qa = *(const float4*)(qs + h * D + 8 * (c0 + c));
                            const float4 qb = *(const float4*)(qs + h * D + 8 * (c0 + c) + 4);
                            acc[h] = fmaf(qa.x, kf[0], fmaf(qa.y, kf[1], fmaf(qa.z, kf[2], fmaf(qa.w, kf[3], acc[h]))));
                            acc[h] = fmaf(qb.x, kf[4], fmaf(qb.y, kf[5], fmaf(qb.z, kf[6], fmaf(qb.w, kf[7], acc[h]))));
                        }
                    }
                }
            }
#pragma unroll
            for (int h = 0; h < MAXG; ++h)
                if (h < G) sc[h * a.chunk_max + (t - t0)] = acc[h];
        }
    }
    __syncthreads();
    // C. softmax per head over this block's positions
    for (int h = warp; h < G; h += NWARP) {
        float* sh = sc + h * a.chunk_max;
        float m = -INFINITY;
        for (int j = lane; j < P; j += 32) m = fmaxf(m, sh[j]);
        m = warp_max(m);
        float l = 0.f;
        for (int j = lane; j < P; j += 32) {
            const float p = expf(sh[j] - m);
            sh[j] = p;
            l += p;
        }
        l = warp_sum(l);
        if (lane == 0) { mh[h] = m; lh[h] = l; }
    }
    __syncthreads();
    // D. p . v
    float acc[MAXG][E];
#pragma unroll
    for (int h = 0; h < MAXG; ++h)
#pragma unroll
        for (int e = 0; e < E; ++e) acc[h][e] = 0.f;
    const u16* vb = a.vc + (size_t)g * D + lane * E;
#pragma unroll 4
    for (int t = t0 + warp; t < t1; t += NWARP) {
        float vv[E];
        const u16* vr = vb + (size_t)t * row;
#pragma unroll
        for (int e = 0; e < E; e += 2) {
            const u32 w = *(const u32*)(vr + e);
            vv[e] = h2f((u16)(w & 0xffff));
            vv[e + 1] = h2f((u16)(w >> 16));
        }
#pragma unroll
        for (int h = 0; h < MAXG; ++h) {
            if (h < G) {
                const float p = sc[h * a.chunk_max + (t - t0)];
#pragma unroll
                for (int e = 0; e < E; ++e) acc[h][e] = fmaf(p, vv[e], acc[h][e]);
            }
        }
    }
#pragma unroll
    for (int h = 0; h < MAXG; ++h)
        if (h < G)
#pragma unroll
            for (int e = 0; e < E; ++e) red[(warp * G + h) * D + lane * E + e] = acc[h][e];
    __syncthreads();
    if (ns == 1) {  // the only block of the group: normalise and write the output
        for (int idx = tid; idx < G * D; idx += blockDim.x) {
            const int h = idx / D, i = idx - h * D;
            float o = 0.f;
#pragma unroll
            for (int w = 0; w < NWARP; ++w) o += red[(w * G + h) * D + i];
            a.out[(size_t)(g * G + h) * D + i] = o / lh[h];
        }
        return;
    }
    constexpr int PS = D + 4;  // partial row: o[D], m, l, pad (float4-aligned rows)
    float* part = a.part + ((size_t)g * a.ns + s) * G * PS;
    for (int idx = tid; idx < G * D; idx += blockDim.x) {
        const int h = idx / D, i = idx - h * D;
        float o = 0.f;
#pragma unroll
        for (int w = 0; w < NWARP; ++w) o += red[(w * G + h) * D + i];
        part[h * PS + i] = o;
        if (i == 0) {
            part[h * PS + D] = P > 0 ? mh[h] : -INFINITY;
            part[h * PS + D + 1] = P > 0 ? lh[h] : 0.f;
        }
    }
    // E. the last block of the group merges (threadfence: partials visible before the count)
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        last = atomicAdd(a.counter + g, 1) == ns - 1;
        if (last) a.counter[g] = 0;  // ready for the next launch (graph replay)
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    // merge, in three short phases so no thread walks the splits with dependent loads:
    // (m, l) of every (head, split) -> shared; per head the max and normalised weights;
    // then each (h, i) sums its ns partials with independent loads.
    __shared__ float wm[MAXG * MAX_NS], wl[MAXG * MAX_NS];
    const float* pg = a.part + (size_t)g * a.ns * G * PS;
    for (int idx = tid; idx < G * ns; idx += blockDim.x) {
        const int h = idx / ns, j = idx - h * ns;
        const float* pj = pg + ((size_t)j * G + h) * PS;
        wm[idx] = __ldcg(pj + D);
        wl[idx] = __ldcg(pj + D + 1);
    }
    __syncthreads();
    for (int h = warp; h < G; h += NWARP) {
        float M = -INFINITY;
        for (int j = lane; j < ns; j += 32) M = fmaxf(M, wm[h * ns + j]);
        M = warp_max(M);  // finite: split 0 always holds position 0
        float L = 0.f;
        for (int j = lane; j < ns; j += 32) {
            const float mj = wm[h * ns + j];
            const float w = mj == -INFINITY ? 0.f : expf(mj - M);  // empty split: weight 0
            wm[h * ns + j] = w;
            L += w * wl[h * ns + j];
        }
        L = warp_sum(L);
        for (int j = lane; j < ns; j += 32) wm[h * ns + j] /= L;
    }
    __syncthreads();
    // float4 loads: one block reads ns * G * D floats here, so 4 values per load matter
    for (int idx = tid; idx < G * D / 4; idx += blockDim.x) {
        const int h = idx / (D / 4), i = 4 * (idx - h * (D / 4));
        float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
        for (int j = 0; j < ns; ++j) {
            const float w = wm[h * ns + j];
            const float4 v = __ldcg((const float4*)(pg + ((size_t)j * G + h) * PS + i));
            o.x = fmaf(v.x, w, o.x); o.y = fmaf(v.y, w, o.y); o.z = fmaf(v.z, w, o.z); o.w = fmaf(v.w, w, o.w);
        }
        *(float4*)(a.out + (size_t)(g * G + h) * D + i) = o;
    }
}

#define GQA_KERNEL(D)                                                                              \
    extern "C" __global__ void __launch_bounds__(NWARP * 32) attn_gqa_d##D(                        \
        const float* q, const float* k, const float* v, u16* kc, u16* vc, const int* state,        \
        float* out, float* part, int* counter, int n_head, int n_kv, int n_rot, int ns,            \
        int chunk_max, int split_min, float freq_base, float scale, float freq_scale) {            \
        const GqaArgs a = {q, k, v, kc, vc, state, out, part, counter, n_head, n_kv, n_rot, ns,    \
                           chunk_max, split_min, freq_base, scale, freq_scale};                    \
        attn_gqa_body<D>(a);                                                                       \
    }
GQA_KERNEL(64)
GQA_KERNEL(128)
GQA_KERNEL(256)
