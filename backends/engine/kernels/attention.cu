// Decode attention for one new token: NEOX RoPE of q and k, fp16 KV-cache write, GQA
// attention over positions 0..pos with an online softmax, optionally split over the context.
//
// Semantics follow llama.cpp src/models/qwen2.cpp + ggml_rope_ext (mode NEOX: pairs
// (i, i + n_rot/2), theta_i = pos * freq_base^(-2i/n_rot), freq_scale 1, no YaRN) and
// build_attn (softmax(q.k * 1/sqrt(D)) . v; query head h reads KV head h / (n_head/n_kv)).
// The current token's k and v are rounded to fp16 exactly as the cache stores them.
// Online softmax: Milakov & Gimelshein 2018; split-context merge as in flash-decoding.
#include "common.cuh"

#define ATT_WARPS 8   // 8 tiles of 32 positions in flight per block
#define MAX_E 8   // head_dim <= 256: lane owns dims lane + 32e, e < 8 (any D, guarded)

struct AttnArgs {
    const float* q; const float* k; const float* v;   // [n_head*D], [n_kv*D], [n_kv*D]
    u16* kc; u16* vc;                                 // [n_ctx, n_kv, D] fp16
    const int* state;                                 // state[1] = position of the new token
    float* out;                                       // [n_head*D] (no split) or unused
    float* part;                                      // [n_head, n_split, D + 2] (split)
    int n_head, n_kv, D, n_rot, chunk;
    float freq_base, scale, freq_scale;   // freq_scale: linear RoPE scaling (1 = none)
};

// RoPE'd, scaled q and fp16-rounded k, v of the new token into shared memory; the first
// query head of each KV group (and split 0) writes k, v into the cache.
__device__ void prepare(const AttnArgs& a, int h, int g, int pos, float* qs, float* ks, float* vs) {
    const int half = a.n_rot / 2, D = a.D;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        float qv = a.q[h * D + i], kv = a.k[g * D + i];
        if (i < a.n_rot) {
            const int p = i < half ? i : i - half;
            const float theta = a.freq_scale * (float)pos * powf(a.freq_base, -2.f * (float)p / (float)a.n_rot);
            float sn, cs;
            sincosf(theta, &sn, &cs);
            const float q0 = a.q[h * D + p], q1 = a.q[h * D + p + half];
            const float k0 = a.k[g * D + p], k1 = a.k[g * D + p + half];
            qv = i < half ? q0 * cs - q1 * sn : q0 * sn + q1 * cs;
            kv = i < half ? k0 * cs - k1 * sn : k0 * sn + k1 * cs;
        }
        qs[i] = qv * a.scale;
        const u16 kh = f2h(kv), vh = f2h(a.v[g * D + i]);
        ks[i] = h2f(kh);
        vs[i] = h2f(vh);
        // every block of the group writes the same bits, so each one can then read the
        // current row from the cache like any other row (no per-position select)
        const size_t o = ((size_t)pos * a.n_kv + g) * D + i;
        a.kc[o] = kh;
        a.vc[o] = vh;
    }
    __syncthreads();
}

// Score of position t for this lane: q (scaled, shared memory) . k_t (fp16 cache) over D dims.
__device__ __forceinline__ float score(const float* qs, const u16* kr, int D) {
    float s = 0.f;
    if ((D & 7) == 0) {  // 16-byte loads: 8 halves at a time, all independent
        const uint4* k4 = (const uint4*)kr;
#pragma unroll 8
        for (int c = 0; c < D / 8; ++c) {
            const uint4 w = k4[c];
            const u32 h[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                s += qs[8 * c + 2 * j] * h2f((u16)(h[j] & 0xffff));
                s += qs[8 * c + 2 * j + 1] * h2f((u16)(h[j] >> 16));
            }
        }
    } else {
        for (int d = 0; d < D; ++d) s += qs[d] * h2f(kr[d]);
    }
    return s;
}

// Block (h, split): positions [split*chunk, min(pos+1, (split+1)*chunk)). Each warp takes
// tiles of 32 positions: lane j scores position tile+j on its own (no shuffles per
// position, all k loads of the tile in flight together), one max/sum per tile updates the
// online softmax, then the tile's v rows are accumulated with lanes over dims.
extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32) attn_decode(const AttnArgs* __restrict__ ap) {
    pdl_wait();  // PDL contract (common.cuh): v3 keeps no overlap
    const AttnArgs a = *ap;
    extern __shared__ float sm[];
    const int D = a.D, h = blockIdx.x, g = h / (a.n_head / a.n_kv), pos = a.state[1];
    float *qs = sm, *ks = qs + D, *vs = ks + D, *accw = vs + D, *mw = accw + ATT_WARPS * D, *lw = mw + ATT_WARPS;
    prepare(a, h, g, pos, qs, ks, vs);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int t0 = blockIdx.y * a.chunk, t1 = min(pos + 1, t0 + a.chunk);
    const size_t row_stride = (size_t)a.n_kv * D;
    const u16* kbase = a.kc + (size_t)g * D;
    const u16* vbase = a.vc + (size_t)g * D;
    float acc[MAX_E], m = -INFINITY, l = 0.f;
#pragma unroll
    for (int e = 0; e < MAX_E; ++e) acc[e] = 0.f;
    for (int tile = t0 + 32 * warp; tile < t1; tile += 32 * ATT_WARPS) {
        const int t = tile + lane;
        const float s = t < t1 ? score(qs, kbase + t * row_stride, D) : -INFINITY;
        const float mn = fmaxf(m, warp_max(s));  // finite: lane 0 always holds a position
        const float corr = expf(m - mn);
        const float p = t < t1 ? expf(s - mn) : 0.f;
        l = l * corr + warp_sum(p);
#pragma unroll
        for (int e = 0; e < MAX_E; ++e) acc[e] *= corr;
        const int nt = min(32, t1 - tile);
        // v rows of the tile, 8 positions at a time: all 8 x E loads issued before use
        for (int j0 = 0; j0 < nt; j0 += 8) {
            float vv[8][MAX_E];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const u16* vr = vbase + (size_t)(tile + j0 + j) * row_stride;
#pragma unroll
                for (int e = 0; e < MAX_E; ++e) {
                    const int d = lane + 32 * e;
                    vv[j][e] = (j0 + j < nt && d < D) ? h2f(vr[d]) : 0.f;
                }
            }
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float pj = __shfl_sync(0xffffffffu, p, (j0 + j) & 31);
#pragma unroll
                for (int e = 0; e < MAX_E; ++e) acc[e] += pj * vv[j][e];
            }
        }
        m = mn;
    }
    if (lane == 0) { mw[warp] = m; lw[warp] = l; }
#pragma unroll
    for (int e = 0; e < MAX_E; ++e)
        if (lane + 32 * e < D) accw[warp * D + lane + 32 * e] = acc[e];
    __syncthreads();
    float M = -INFINITY;
    for (int w = 0; w < ATT_WARPS; ++w) M = fmaxf(M, mw[w]);
    float L = 0.f;
    for (int w = 0; w < ATT_WARPS; ++w) L += mw[w] == -INFINITY ? 0.f : lw[w] * expf(mw[w] - M);
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float o = 0.f;
        for (int w = 0; w < ATT_WARPS; ++w) o += mw[w] == -INFINITY ? 0.f : accw[w * D + d] * expf(mw[w] - M);
        if (gridDim.y == 1) {
            a.out[h * D + d] = o / L;
        } else {  // partial: unnormalised sum, then (m, l) after the D values
            float* pp = a.part + ((size_t)h * gridDim.y + blockIdx.y) * (D + 2);
            pp[d] = o;
            if (d == 0) { pp[D] = M; pp[D + 1] = L; }
        }
    }
}

// Merge n_split partials per head: out = sum_s o_s e^{m_s - M} / sum_s l_s e^{m_s - M}.
extern "C" __global__ void attn_merge(const AttnArgs* __restrict__ ap, int n_split) {
    pdl_wait();
    const AttnArgs a = *ap;
    const int h = blockIdx.x, D = a.D;
    const float* pp = a.part + (size_t)h * n_split * (D + 2);
    float M = -INFINITY;
    for (int s = 0; s < n_split; ++s) M = fmaxf(M, pp[s * (D + 2) + D]);
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float o = 0.f, L = 0.f;
        for (int s = 0; s < n_split; ++s) {
            const float ms = pp[s * (D + 2) + D];
            if (ms == -INFINITY) continue;  // empty split (beyond the current position)
            const float w = expf(ms - M);
            o += pp[s * (D + 2) + d] * w;
            L += pp[s * (D + 2) + D + 1] * w;
        }
        a.out[h * D + d] = o / L;
    }
}
