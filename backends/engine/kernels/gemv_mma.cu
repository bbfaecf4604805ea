// Engine v11 GEMV (A/B build, ops GGUF_HARNESS_GEMV_MMA=1): the dot products of the K-quant /
// IQ4_XS decode GEMVs on the int8 tensor cores (mma.sync m16n8k32 s8 x s8 -> s32) instead of dp2a.
//
// Why (docs/perf-notes.md sessions 10-12): the v9 loops are issue-bound: 0.17-0.31 warp
// instructions per weight byte, so 85 % of the copy bandwidth needs 56-107 % of every issue slot;
// IQ4_XIL's 2 fewer byte permutes per 8 weights made the IQ4_XS pair 8.8 % faster. Here one mma
// instruction does the multiply-adds of 512 weights (16 rows x 32); what remains per weight is
// unpacking the codes (and IQ4_XS's codebook lookup) and a per-(row, 32-value sub-block) float
// epilogue spread over all 32 lanes. Expected (static count per 256 weights and row, written before
// it ran): Q4_K ~8 warp instructions (v9: 24.75), IQ4_XS ~16 (v9 IQ4_XIL: ~27; the lookup stays).
//
// Layout of one mma (PTX ISA "Matrix Fragments for mma.m16n8k32", .s8): lane L, g = L >> 2,
// t = L & 3. A (16 x 32, row-major) registers a0: row g, k = 4t..4t+3; a1: row g + 8, same k;
// a2: row g, k = 16 + 4t..; a3: row g + 8, k = 16 + 4t... B (32 x 8) b0: k = 4t..4t+3, column g;
// b1: k = 16 + 4t.. . C (16 x 8, s32) c0, c1: row g, columns 2t, 2t + 1; c2, c3: row g + 8.
// A tile is 16 weight rows; a "group" is 4 consecutive 32-value sub-blocks (128 values) of K.
// Lane t's 8 k slots of an mma (its two quads) hold 8 codes of ONE sub-block, s = 4 gi + t of
// group gi, for rows g and g + 8; mma j = 0..3 of the group takes the sub-block's j-th 8 codes.
// B's column n = 2 s' + h holds the x codes of the group's sub-block s' (h = 0: the high byte,
// 1: the low byte of the q16 code, x16 = 256 hi + lo) in the k slots of lane t = s', zeros in the
// other lanes' slots. So after the group's 4 mmas, C[row, 2 s' + h] is the exact int32 dot of the
// row's sub-block s' with x's hi or lo bytes, and lane (g, t) holds both halves of sub-block t for
// rows g and g + 8: dot = 256 c0 + c1 (row g), 256 c2 + c3 (row g + 8) -- every lane has an
// epilogue (d sc dot - dmin m xsum, times the x block scale; IQ4_XS: d (ls - 32) dot).
// The k slots of a lane may hold a sub-block's codes in any order as long as x is staged in the
// same one (stage_x8: natural 8j..8j+7 for the K-quants; the IQ4_XIL order 4j, 4j + 16, 4j + 1,
// .. for IQ4_XS, which is the order a qs word's two codebook lookups come out in).
// x codes: q16 with a maximum of 32639 = 127 * 256 + 127 (not 32767) so hi = (q + 128) >> 8 and
// lo = q - 256 hi both fit s8 (each block's scale amax / 32639: 0.4 % coarser rounding than v9).
// Integer ranges: |dot| <= 32 * 127 * 32639 < 2^27 (IQ4_XS), < 2^25 (Q5_K): exact in int32; the
// float of it rounds as v9's float(sc * dot).
// Not bitwise v9 (other code scale, other float order); judged against the float64 oracle.
//
// Block: NW warps on one 16-row tile at a time (grid-stride over tiles); warp w takes groups w,
// w + NW, ... of K; the warps' row sums meet in shared memory (one barrier per tile, double-
// buffered). MODE 0 store (+bias), 1 add, 2 SwiGLU of a gate/up pair (two matrices, one B).
// Nodes: one GGML type, every segment of it (no F32 rows), K % 256 == 0 (ops.gemv_mma).
#include "qdot.cuh"  // (named here: module.py prefixes the I-quant tables to sources that include it)
#include "xstage.cuh"
#include "kwide_iq4.cuh"  // prmt, iq4_lut2
#include "segs.cuh"

extern __shared__ int4 smem4[];

#ifndef MMA_UNROLL
#define MMA_UNROLL 2  // groups whose loads are in flight together per warp
#endif
constexpr int kMmaUnroll = MMA_UNROLL;
#define MMA_XMAX 32639.f  // 127 * 256 + 127: the largest q16 code whose hi and lo bytes are both s8

// C += A B; AU8: A's bytes unsigned (u8 x s8), else signed (s8 x s8)
template <bool AU8>
__device__ __forceinline__ void mma_s8(int (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    if constexpr (AU8)
        asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    else
        asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// ---- x staging ----
// Shared memory (Kp = K, a multiple of 256): int4 xb[K / 8]: entry 4 b + j = the j-th 8 codes of
// x block b (32 values) in the format's k order (IL: values 4j, 4j + 16, 4j + 1, 4j + 17, 4j + 2,
// 4j + 18, 4j + 3, 4j + 19; else 8j .. 8j + 7), as {hi bytes of the first 4, hi of the last 4,
// lo of the first 4, lo of the last 4}; int4 zero[4]: 64 zero bytes (B of the lanes whose slots
// are zero); float xd[K / 32]: block scale (NaN for a block with NaN/Inf); float xm[K / 32]: the
// block's sum of codes times its scale (the K-quants' min term). Bytes 2.25 K + 64 (ops.mma_smem).
// With an RMSNorm the codes are those of x * norm_weight and 1/rms(x) is returned (applied to the
// finished row sums, as xstage.cuh stage_xq); else 1. The barriers publish the shared memory.
template <bool IL>
__device__ __forceinline__ float stage_x8(const float* __restrict__ x, const float* __restrict__ norm, float eps,
                                          int K, int4* xb, float* xd, float* xm, float* scratch) {
    const int nch = K >> 3;  // entries; K % 256 == 0: a multiple of 32, so c < nch is warp-uniform
    if (threadIdx.x < 4) xb[nch + threadIdx.x] = make_int4(0, 0, 0, 0);  // the zero area
    float ss = 0.f;
    for (int c = threadIdx.x; c < nch; c += blockDim.x) {  // warp-uniform: nch % 32 == 0
        float v[8];
        // float4 units: IL: values 32 b + 4 j .. +3 and 32 b + 16 + 4 j ..; else 8 c .. 8 c + 7
        const int f0 = IL ? 8 * (c >> 2) + (c & 3) : 2 * c, f1 = IL ? f0 + 4 : f0 + 1;
        const float4 a = ((const float4*)x)[f0], b = ((const float4*)x)[f1];
        if (IL) {
            v[0] = a.x; v[1] = b.x; v[2] = a.y; v[3] = b.y; v[4] = a.z; v[5] = b.z; v[6] = a.w; v[7] = b.w;
        } else {
            v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
        }
        if (norm) {
            const float4 na = ((const float4*)norm)[f0], nb = ((const float4*)norm)[f1];
            const float n[8] = {na.x, IL ? nb.x : na.y, IL ? na.y : na.z, IL ? nb.y : na.w,
                                IL ? na.z : nb.x, IL ? nb.z : nb.y, IL ? na.w : nb.z, nb.w};
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                ss = fmaf(v[k], v[k], ss);
                v[k] *= n[k];
            }
        }
        float am;
        int bad;
        block_amax_bad(v, am, bad);  // over the 4 threads of the block (entries 4 b + j)
        const float id = am > XQ_FLUSH ? MMA_XMAX / am : 0.f;
        u32 hi0 = 0, hi1 = 0, lo0 = 0, lo1 = 0;
        int s = 0;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const int q = __float2int_rn(v[k] * id);  // |q| <= 32639 (NaN/Inf: marked by xd below)
            const int h = (q + 128) >> 8, l = q - 256 * h;  // both in [-128, 127]
            s += q;
            const u32 hb = (u32)(h & 0xff) << (8 * (k & 3)), lb = (u32)(l & 0xff) << (8 * (k & 3));
            if (k < 4) { hi0 |= hb; lo0 |= lb; } else { hi1 |= hb; lo1 |= lb; }
        }
        xb[c] = make_int4((int)hi0, (int)hi1, (int)lo0, (int)lo1);
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        if ((c & 3) == 0) {
            const float d = am / MMA_XMAX;
            xd[c >> 2] = bad ? __int_as_float(0x7fc00000) : d;
            xm[c >> 2] = d * (float)s;  // |s| <= 32 * 32639 < 2^21: exact
        }
    }
    const float tot = block_sum(ss, scratch);  // barriers: the codes visible to every warp
    return norm ? rsqrtf(tot / (float)K + eps) : 1.f;
}

// ---- formats ----
// M<T>: a lane's raw bytes of its sub-block s of one row (load), the A registers of the group's
// mma j (afrag: q0 = k slots 4t..4t+3, q1 = 16 + 4t..), and the sub-block's float epilogue (sum:
// dot = the exact int32 dot of codes and x codes, xd / xm its x block's scale / scaled code sum).
template <int T> struct M;

// IQ4_XS (ggml block_iq4_xs, dequantize_row_iq4_xs; kwide_iq4.cuh): d at 0, scales_h at 2,
// scales_l[4] at 4, qs[128] at 8 (136-byte blocks, 8-byte aligned); sub-block w: qs[16 w ..]
// byte l = value l (low nibble) and l + 16 (high); y = d (ls - 32) kvalues_iq4nl[code].
template <> struct M<T_IQ4_XS> {
    static constexpr int TS = 136;
    static constexpr bool IL = true;
    static constexpr bool AU8 = false;  // A as s8 (the codebook values)
    struct Raw { uint2 h, a, b; };
    // offset of sub-block w's 16 qs bytes in the block; the A scale of the lane (1: no folding)
    static __device__ __forceinline__ int qoff(int w) { return 8 + 16 * w; }
    static __device__ __forceinline__ float ascale(int) { return 1.f; }
    static __device__ __forceinline__ void load(const u8* blk, int qo, Raw& r) {
        r.h = *(const uint2*)blk;
        const uint2* q = (const uint2*)(blk + qo);
        r.a = q[0];
        r.b = q[1];
    }
    static __device__ __forceinline__ void afrag(const Raw& r, int j, int, u32& q0, u32& q1) {
        const u32 wd = j == 0 ? r.a.x : j == 1 ? r.a.y : j == 2 ? r.b.x : r.b.y;
        iq4_lut2(wd, q0, q1);  // values 4j, 4j + 16, 4j + 1, 4j + 17 | 4j + 2, 4j + 18, 4j + 3, 4j + 19
    }
    static __device__ __forceinline__ float sum(const Raw& r, int w, int dot, float xd, float) {
        const int ls = (int)((r.h.y >> (4 * w)) & 15u) | (int)(((r.h.x >> (16 + 2 * w)) & 3u) << 4);
        return xd * (h2f((u16)(r.h.x & 0xffffu)) * (float)(ls - 32)) * (float)dot;
    }
};

// get_scale_min_k4 of sub-block w (ggml-quants.c) from the header words y, z, w4 (scales[0..11]).
__device__ __forceinline__ void scale_min_k4_one(u32 y, u32 z, u32 w4, int w, int& sc, int& m) {
    const int sh = 8 * (w & 3);
    if (w < 4) {
        sc = (y >> sh) & 63;
        m = (z >> sh) & 63;
    } else {
        sc = ((w4 >> sh) & 15) | (((y >> sh) >> 6 & 3) << 4);
        m = ((w4 >> sh) >> 4 & 15) | (((z >> sh) >> 6 & 3) << 4);
    }
}

// Q4_K (block_q4_K, dequantize_row_q4_K): d, dmin, scales[12] at 0, qs[128] at 16 (144-byte blocks,
// 16-byte aligned); sub-block w: value l = nibble (w & 1) of qs[32 (w >> 1) + l]; y = d sc q - dmin m.
// Q5_K (block_q5_K): header at 0, qh[32] at 16, qs at 48 (176 bytes): + bit w of qh[l] << 4.
template <int T> struct MK {
    static constexpr bool Q5 = T == T_Q5_K;
    static constexpr int TS = Q5 ? 176 : 144;
    static constexpr bool IL = false;
    // Q4_K: A as u8 and lanes of odd sub-blocks (high nibbles) take w & 0xf0f0f0f0 as it is, 16
    // times the codes (<= 240), one LOP3 per word instead of a shift and a mask; the epilogue
    // scales their x by 1/16 (exact). Q5_K's 5th bit would make that 496: shift and mask there.
    static constexpr bool AU8 = !Q5;
    struct Raw { uint4 h, q0, q1, h0, h1; };  // h0, h1: Q5_K's qh (unused for Q4_K)
    static __device__ __forceinline__ int qoff(int w) { return (Q5 ? 48 : 16) + 32 * (w >> 1); }
    static __device__ __forceinline__ float ascale(int w) { return !Q5 && (w & 1) ? 0.0625f : 1.f; }
    static __device__ __forceinline__ void load(const u8* blk, int qo, Raw& r) {
        r.h = *(const uint4*)blk;
        const uint4* q = (const uint4*)(blk + qo);
        r.q0 = q[0];
        r.q1 = q[1];
        if constexpr (Q5) {
            r.h0 = *(const uint4*)(blk + 16);
            r.h1 = *(const uint4*)(blk + 32);
        }
    }
    // mma j: values 8j .. 8j + 3 (qs word 2j) and 8j + 4 .. 8j + 7 (word 2j + 1)
    static __device__ __forceinline__ void afrag(const Raw& r, int j, int w, u32& q0, u32& q1) {
        const u32 wa = j == 0 ? r.q0.x : j == 1 ? r.q0.z : j == 2 ? r.q1.x : r.q1.z;
        const u32 wb = j == 0 ? r.q0.y : j == 1 ? r.q0.w : j == 2 ? r.q1.y : r.q1.w;
        if constexpr (Q5) {
            const int n = 4 * (w & 1);
            const u32 ha = j == 0 ? r.h0.x : j == 1 ? r.h0.z : j == 2 ? r.h1.x : r.h1.z;
            const u32 hb = j == 0 ? r.h0.y : j == 1 ? r.h0.w : j == 2 ? r.h1.y : r.h1.w;
            q0 = ((wa >> n) & 0x0f0f0f0fu) | (((ha >> w) & 0x01010101u) << 4);
            q1 = ((wb >> n) & 0x0f0f0f0fu) | (((hb >> w) & 0x01010101u) << 4);
        } else {
            const u32 mk = w & 1 ? 0xf0f0f0f0u : 0x0f0f0f0fu;
            q0 = wa & mk;
            q1 = wb & mk;
        }
    }
    static __device__ __forceinline__ float sum(const Raw& r, int w, int dot, float xd, float xm) {
        int sc, m;
        scale_min_k4_one(r.h.y, r.h.z, r.h.w, w, sc, m);
        const float d = h2f((u16)(r.h.x & 0xffffu)), dmin = h2f((u16)(r.h.x >> 16));
        return (d * (float)sc) * (xd * (float)dot) - (dmin * (float)m) * xm;
    }
};
template <> struct M<T_Q4_K> : MK<T_Q4_K> {};
template <> struct M<T_Q5_K> : MK<T_Q5_K> {};

// The tile of global tile index `tile`: segment si and its first row r0 (tiles of 16 rows per
// segment; a segment's last tile may be partial). Returns false past the last tile.
__device__ __forceinline__ bool tile_seg(const SegTable& t, int tile, bool pair, int& si, int& r0) {
    const int n = pair ? 1 : t.n;
    for (si = 0; si < n; ++si) {
        const int nt = (t.s[si].rows + 15) >> 4;
        if (tile < nt) {
            r0 = 16 * tile;
            return true;
        }
        tile -= nt;
    }
    return false;
}

// The end of a 16-row tile (v11 mma_body, v12 tcr_body): lane (g, t)'s acc[m][h] is its part of row
// g + 8 h of matrix m; the 4 lanes t of a row hold its sub-blocks t, t + 4, .. (summed by shuffles),
// then the warps' parts meet in `pp` ([NW][NM][16] floats, the tile's half of a buffer double-buffered
// by tile, so the next tile's writes go to the other half) and warp 0 stores rows r0 .. r0 + 15
// (those below `rows`), times rs (the RMSNorm's 1 / rms or 1).
template <int MODE, int NW, int NM>
__device__ __forceinline__ void tile_finish(const float (&acc)[NM][2], float* pp, const Seg& sg, int r0, int rows,
                                            float rs) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int m = 0; m < NM; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float v = acc[m][h];
            v += __shfl_xor_sync(0xffffffffu, v, 1);
            v += __shfl_xor_sync(0xffffffffu, v, 2);
            if (t == 0) pp[(warp * NM + m) * 16 + g + 8 * h] = v;
        }
    __syncthreads();
    if (warp == 0 && lane < 16 && r0 + lane < rows) {
        float y = 0.f, up = 0.f;
        for (int w2 = 0; w2 < NW; ++w2) {
            y += pp[(w2 * NM) * 16 + lane];
            if (MODE == 2) up += pp[(w2 * NM + 1) * 16 + lane];
        }
        store_row<MODE>(sg, r0 + lane, y * rs, up * rs);
    }
}

template <int T, int MODE, int NW>
__device__ __forceinline__ void mma_body(const SegTable& tb, const float* x, const float* norm, float eps, int K,
                                         int ntiles) {
    using F = M<T>;
    static_assert(NW % 2 == 0, "NW even: a warp's groups keep their parity (the lane's sub-block)");
    constexpr int NM = MODE == 2 ? 2 : 1;  // matrices per tile (gate and up)
    // groups in flight: a K-quant pair holds 12-20 registers per row and group, so unrolled it
    // spilled (Q5_K 312 bytes, Q4_K 64; ptxas, sm_90, minBlocks 2); one group at a time does not
    constexpr int U = T != T_IQ4_XS && MODE == 2 ? 1 : kMmaUnroll;
    __shared__ float scratch[32];
    __shared__ float part[2][NW][NM][16];  // [tile & 1][warp][matrix][row of the tile]
    int4* xb = smem4;
    float* xd = (float*)(smem4 + K / 8 + 4);
    float* xm = xd + K / 32;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int NG = K >> 7;  // groups of 4 sub-blocks
    // L2 prefetch of the lane's first group of the first tile (weights are constants: before the
    // PDL wait, overlapping the previous kernel's tail)
    {
        int si, r0;
        if (warp < NG && tile_seg(tb, blockIdx.x, MODE == 2, si, r0)) {
            const int rows = tb.s[si].rows, s = 4 * warp + t;
#pragma unroll
            for (int m = 0; m < NM; ++m) {
                const Seg& sg = tb.s[MODE == 2 ? m : si];
                const int rb = tb.row_bytes[MODE == 2 ? m : si];
                for (int h = 0; h < 2; ++h) {
                    const int r = min(r0 + g + 8 * h, rows - 1);
                    prefetch_l2((const u8*)sg.w + (size_t)rb * r + (s >> 3) * F::TS);
                }
            }
        }
    }
    pdl_wait();
    pdl_trigger();
    const float rs = stage_x8<F::IL>(x, norm, eps, K, xb, xd, xm, scratch);
    const u32 xba = smem_addr(xb), zero = smem_addr(xb + K / 8), xda = smem_addr(xd), xma = smem_addr(xm);
    int it = 0;
    for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x, ++it) {
        int si, r0;
        tile_seg(tb, tile, MODE == 2, si, r0);
        const int rows = tb.s[si].rows;
        // Warp w takes groups gi = w, w + NW, ..: the super-block gi >> 1 advances by NW / 2 blocks
        // per group and the lane's sub-block w8 = 4 (gi & 1) + t stays the same (NW even).
        const int w8 = 4 * (warp & 1) + t, qo = F::qoff(w8);
        const float as = F::ascale(w8);
        const u8* bp[NM][2];  // the lane's rows g and g + 8 (clamped into the segment): block of gi
#pragma unroll
        for (int m = 0; m < NM; ++m) {
            const Seg& sg = tb.s[MODE == 2 ? m : si];
            const int rb = tb.row_bytes[MODE == 2 ? m : si];
            const u8* b0 = (const u8*)sg.w + (warp >> 1) * F::TS;
            bp[m][0] = b0 + (size_t)rb * min(r0 + g, rows - 1);
            bp[m][1] = b0 + (size_t)rb * min(r0 + g + 8, rows - 1);
        }
        // B: lane (g, t) holds column g = 2 s' + h of the group's sub-block s' = g >> 1: its data
        // only where t == s' (else the zero area); h = g & 1 picks the hi or lo bytes
        const bool bl = (g >> 1) == t;
        u32 ba = (bl ? xba + 64 * (4 * warp + t) : zero) + 8 * (g & 1);
        const u32 bst = bl ? 64 * 4 * NW : 0;  // per group
        u32 xo = 4 * (4 * warp + t);            // the lane's sub-block's xd / xm offset
        float acc[NM][2] = {};
        for (int gi0 = warp; gi0 < NG; gi0 += U * NW) {
            typename F::Raw raw[U][NM][2];
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (gi0 + u * NW < NG) {
#pragma unroll
                    for (int m = 0; m < NM; ++m)
#pragma unroll
                        for (int h = 0; h < 2; ++h) F::load(bp[m][h] + u * (NW / 2) * F::TS, qo, raw[u][m][h]);
                }
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (gi0 + u * NW < NG) {
                    int c[NM][4] = {};
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const int2 bv = lds64(ba + u * bst + 16 * j);
#pragma unroll
                        for (int m = 0; m < NM; ++m) {
                            u32 a0, a1, a2, a3;
                            F::afrag(raw[u][m][0], j, w8, a0, a2);
                            F::afrag(raw[u][m][1], j, w8, a1, a3);
                            mma_s8<F::AU8>(c[m], a0, a1, a2, a3, (u32)bv.x, (u32)bv.y);
                        }
                    }
                    const float d = as * lds32f(xda + xo + u * 16 * NW), mm = lds32f(xma + xo + u * 16 * NW);
#pragma unroll
                    for (int m = 0; m < NM; ++m) {
                        acc[m][0] += F::sum(raw[u][m][0], w8, 256 * c[m][0] + c[m][1], d, mm);
                        acc[m][1] += F::sum(raw[u][m][1], w8, 256 * c[m][2] + c[m][3], d, mm);
                    }
                }
#pragma unroll
            for (int m = 0; m < NM; ++m) {
                bp[m][0] += U * (NW / 2) * F::TS;
                bp[m][1] += U * (NW / 2) * F::TS;
            }
            ba += U * bst;
            xo += U * 16 * NW;
        }
        tile_finish<MODE, NW, NM>(acc, &part[it & 1][0][0][0], tb.s[si], r0, rows, rs);
    }
}

#ifndef MMA_WARPS
#define MMA_WARPS 8
#endif
#ifndef MMA_MINB
#define MMA_MINB 2
#endif
#define MMA_INSTANCE(MODE, MNAME, T, TNAME)                                                        \
    extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32, MMA_MINB)                        \
    gemvmma_##MNAME##_##TNAME(const SegTable t, const float* x, const float* norm, float eps, int K, \
                              int ntiles) {                                                       \
        mma_body<T, MODE, MMA_WARPS>(t, x, norm, eps, K, ntiles);                                 \
    }
#define MMA_MODES(T, TNAME) MMA_INSTANCE(0, store, T, TNAME) MMA_INSTANCE(1, add, T, TNAME) \
    MMA_INSTANCE(2, swiglu, T, TNAME)
// kernel names: gemvmma_<store|add|swiglu>_<q4_k|q5_k|iq4_xs>
MMA_MODES(T_Q4_K, q4_k) MMA_MODES(T_Q5_K, q5_k) MMA_MODES(T_IQ4_XS, iq4_xs)

// ---- engine v12 (A/B build, ops GGUF_HARNESS_GEMV_TCR): v11's mma with Q4_K weights repacked at load ----
// Why (docs/perf-notes.md session 12, "v11 lost"): v11 read the GGUF blocks as they are, so a warp's
// load touched 8 rows x 32-64 bytes (8 cache lines for 256 useful bytes; lanes t and t ^ 1 loaded the
// same 32 qs bytes and each kept half), and every lane re-read its rows' headers. Here the matrix is
// rewritten once (tcr_repack_q4_k, the same bytes in another order) so that one warp load is 512
// contiguous bytes, every byte loaded is used, and the mma A registers come out of the loaded words
// with one LOP3 each (as v11's Q4_K, but from 512 contiguous bytes per warp load instead of 8 rows'
// lines; v9's dp2a loop: 99 lane instructions per 32 weights, session 10's count). Expected (written before it ran): the bulk of a node at >= the head's
// rate (~94 % of copy), i.e. [10240x5120] Q4_K 11.3 -> ~8.5 us cold back to back if the tiles'
// tails allow (2.4 tiles per resident block), and a Q4_K step node -10 to -20 %.
// Measured (session 38, docs/perf-notes.md): 10-15 % slower than v9 on the step's Q4_K shapes, a tie at
// 146 MB; ncu: only 14 % fewer warp instructions than v9, both latency-bound on global loads. A/B only.
//
// Repacked Q4_K matrix, rows % 16 == 0, K % 256 == 0 (nsb = K / 256 super-blocks per row; rb = 144
// nsb bytes per row, as the GGUF matrix): tile T (rows 16 T .. 16 T + 15) starts at byte 16 rb T, its
// super-block sb at + 2304 sb (= 16 x 144: the repack is a permutation of the same bytes). Inside a
// super-block of a tile:
//   [0, 256)      the 16 rows' 16-byte block headers (d, dmin, scales[12]), row r at 16 r;
//   [256, 1280)   group 0 = sub-blocks 0..3, [1280, 2304) group 1 = sub-blocks 4..7; a group is two
//                 512-byte halves (h = 0: rows 0..7, 1: rows 8..15) of 32 lane slots of 16 bytes:
//                 slot L = 4 g + t holds sub-block 4 q + t of row g + 8 h;
//   slot byte n (0..15): low nibble = code n of the sub-block (value 32 s + n), high nibble = code
//                 n + 16 (ggml: code l of sub-block s = nibble (s & 1) of qs[32 (s >> 1) + l]).
// So lane (g, t) loads its rows g and g + 8 with one 16-byte load each (the warp: 512 contiguous
// bytes) and, with words w0..w3 of a slot, mma j takes (a0, a2) = (w0, w1) & 0x0f0f0f0f (j = 0),
// (w2, w3) & 0x0f.. (j = 1), (w0, w1) & 0xf0f0f0f0 (j = 2), (w2, w3) & 0xf0.. (j = 3): codes 8 j ..
// 8 j + 7 as v11's k order (B, stage_x8's natural order, unchanged). Mmas 2 and 3 see 16 x the codes
// (u8 <= 240) and add into their own accumulator ch; dot = (256 cl0 + cl1) + (256 ch0 + ch1) / 16,
// exact (every term of ch is a multiple of 16; |256 ch0 + ch1| <= 16 x 32 x 15 x 32639 < 2^28).
// The float epilogue is v11's MK::sum (d sc (xd dot) - dmin m xm) in v11's order (one lane per sub-block,
// warps in order; v11's 1/16 on odd sub-blocks' x scale is exact), so the outputs should equal v11's
// bit for bit; not tested (both are judged against the float64 oracle).
#ifndef TCR_WARPS
#define TCR_WARPS 8
#endif
#ifndef TCR_MINB
#define TCR_MINB 2
#endif
#ifndef TCR_UNROLL
#define TCR_UNROLL 2
#endif

// One thread per 16-byte chunk of dst (tile-major, then super-block, then the 144 chunks above).
// src: the GGUF Q4_K matrix [rows, 144 nsb] (16-byte aligned); dst: as many bytes, another buffer.
extern "C" __global__ void tcr_repack_q4_k(const u8* __restrict__ src, u8* __restrict__ dst, int rows, int nsb) {
    const long long n = (long long)(rows >> 4) * nsb * 144;
    const size_t rb = (size_t)nsb * 144;
    for (long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x; c < n;
         c += (long long)gridDim.x * blockDim.x) {
        const int k = (int)(c % 144);
        const long long ts = c / 144;  // tile * nsb + sb
        const int sb = (int)(ts % nsb), tile = (int)(ts / nsb);
        uint4 out;
        if (k < 16) {
            out = *(const uint4*)(src + rb * (16 * tile + k) + 144 * sb);
        } else {
            const int c2 = k - 16, q = c2 >> 6, h = (c2 >> 5) & 1, L = c2 & 31, g = L >> 2, t = L & 3;
            const int s = 4 * q + t, sh = 4 * (s & 1);
            const u8* qs = src + rb * (16 * tile + g + 8 * h) + 144 * sb + 16 + 32 * (s >> 1);
            u32 w[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                u32 v = 0;
#pragma unroll
                for (int b = 0; b < 4; ++b) {
                    const int nn = 4 * i + b;
                    v |= ((((u32)qs[nn] >> sh) & 15u) | ((((u32)qs[nn + 16] >> sh) & 15u) << 4)) << (8 * b);
                }
                w[i] = v;
            }
            out = make_uint4(w[0], w[1], w[2], w[3]);
        }
        ((uint4*)dst)[c] = out;
    }
}

// TCR_PIPE (A/B, ops GGUF_HARNESS_GEMV_TCR_PIPE): 0 = each round loads its U groups and then
// computes them; 1 = software-pipelined: a warp issues the loads of its next round (the next U groups
// of the tile, or the first of its next tile) before computing the current one, so its loads are in
// flight while it computes and across the tile's barrier. Why (session 38, first v12 runs): U = 3, 4
// were slower than U = 2 (12.8 -> 14.1, 14.7 us on [10240x5120]; the store kernels without spills): the block's warps
// load together, then compute together, then meet at the tile's barrier, so DRAM and the SM take
// turns; more groups per round only made the turns longer. Costs 2x the load registers.
#ifndef TCR_PIPE
#define TCR_PIPE 0
#endif

// Blocks and warps as v11 (mma_body): NW warps on one 16-row tile at a time, grid-stride over tiles,
// warp w takes groups w, w + NW, .. (NW even: the lane's sub-block 4 (w & 1) + t stays), the warps'
// row sums meet in shared memory. Nodes: Q4_K only, every segment's rows % 16 == 0 (gemv_tcr.tcr_takes).
template <int U, int NM>
struct TcrRound { uint4 hd[U][NM][2], qd[U][NM][2]; };  // a round's header and data words, rows g and g + 8

template <int MODE, int NW>
__device__ __forceinline__ void tcr_body(const SegTable& tb, const float* x, const float* norm, float eps, int K,
                                         int ntiles) {
    static_assert(NW % 2 == 0, "NW even: a warp's groups keep their parity (the lane's sub-block)");
    constexpr int NM = MODE == 2 ? 2 : 1;
    constexpr int U = TCR_UNROLL;
    constexpr int SB = 2304;  // bytes of one super-block of a tile
    using Round = TcrRound<U, NM>;
    __shared__ float scratch[32];
    __shared__ float part[2][NW][NM][16];
    int4* xb = smem4;
    float* xd = (float*)(smem4 + K / 8 + 4);
    float* xm = xd + K / 32;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int NG = K >> 7;
    const int doff = 256 + 1024 * (warp & 1) + 16 * lane;
    // the round of tile `tile` whose first group is gi0: the lane's header and data words
    auto load = [&](int tile, int gi0, Round& r) {
        int si, r0;
        tile_seg(tb, tile, MODE == 2, si, r0);
#pragma unroll
        for (int m = 0; m < NM; ++m) {
            const int sj = MODE == 2 ? m : si;
            const u8* hp = (const u8*)tb.s[sj].w + (size_t)tb.row_bytes[sj] * r0 + (gi0 >> 1) * SB;
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (gi0 + u * NW < NG) {
                    const u8* p = hp + u * (NW / 2) * SB;
                    r.hd[u][m][0] = *(const uint4*)(p + 16 * g);
                    r.hd[u][m][1] = *(const uint4*)(p + 128 + 16 * g);
                    r.qd[u][m][0] = *(const uint4*)(p + doff);
                    r.qd[u][m][1] = *(const uint4*)(p + doff + 512);
                }
        }
    };
    {  // L2 prefetch of the warp's first group (header lines and 1024 data bytes) of the first tile
        int si, r0;
        if (warp < NG && lane < 10 && tile_seg(tb, blockIdx.x, MODE == 2, si, r0)) {
#pragma unroll
            for (int m = 0; m < NM; ++m) {
                const int sj = MODE == 2 ? m : si;
                const u8* p = (const u8*)tb.s[sj].w + (size_t)tb.row_bytes[sj] * r0 + (warp >> 1) * SB;
                prefetch_l2(p + (lane < 2 ? 128 * lane : 256 + 1024 * (warp & 1) + 128 * (lane - 2)));
            }
        }
    }
    pdl_wait();
    pdl_trigger();
    const float rs = stage_x8<false>(x, norm, eps, K, xb, xd, xm, scratch);
    const u32 xba = smem_addr(xb), zero = smem_addr(xb + K / 8), xda = smem_addr(xd), xma = smem_addr(xm);
    const int w8 = 4 * (warp & 1) + t;
    Round cur;
    if (TCR_PIPE && blockIdx.x < ntiles) load(blockIdx.x, warp, cur);
    int it = 0;
    for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x, ++it) {
        int si, r0;
        tile_seg(tb, tile, MODE == 2, si, r0);
        const int rows = tb.s[si].rows;
        // B as v11: lane (g, t) holds column g = 2 s' + h of sub-block s' = g >> 1 where t == s'
        const bool bl = (g >> 1) == t;
        u32 ba = (bl ? xba + 64 * (4 * warp + t) : zero) + 8 * (g & 1);
        const u32 bst = bl ? 64 * 4 * NW : 0;
        u32 xo = 4 * (4 * warp + t);
        float acc[NM][2] = {};
        for (int gi0 = warp; gi0 < NG; gi0 += U * NW) {
            Round nxt;
            if (TCR_PIPE) {  // the next round: this tile's next groups, else the next tile's first
                const bool same = gi0 + U * NW < NG;
                if (same || tile + (int)gridDim.x < ntiles)
                    load(same ? tile : tile + gridDim.x, same ? gi0 + U * NW : warp, nxt);
            } else {
                load(tile, gi0, cur);
            }
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (gi0 + u * NW < NG) {
                    int cl[NM][4] = {}, ch[NM][4] = {};
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const int2 bv = lds64(ba + u * bst + 16 * j);
                        const u32 mk = j < 2 ? 0x0f0f0f0fu : 0xf0f0f0f0u;
#pragma unroll
                        for (int m = 0; m < NM; ++m) {
                            const uint4& r0w = cur.qd[u][m][0];
                            const uint4& r8w = cur.qd[u][m][1];
                            const u32 a0 = ((j & 1) ? r0w.z : r0w.x) & mk, a2 = ((j & 1) ? r0w.w : r0w.y) & mk;
                            const u32 a1 = ((j & 1) ? r8w.z : r8w.x) & mk, a3 = ((j & 1) ? r8w.w : r8w.y) & mk;
                            if (j < 2)
                                mma_s8<true>(cl[m], a0, a1, a2, a3, (u32)bv.x, (u32)bv.y);
                            else
                                mma_s8<true>(ch[m], a0, a1, a2, a3, (u32)bv.x, (u32)bv.y);
                        }
                    }
                    const float d = lds32f(xda + xo + u * 16 * NW), mm = lds32f(xma + xo + u * 16 * NW);
#pragma unroll
                    for (int m = 0; m < NM; ++m)
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            const uint4& hh = cur.hd[u][m][h];
                            const int dot = 256 * cl[m][2 * h] + cl[m][2 * h + 1] +
                                            ((256 * ch[m][2 * h] + ch[m][2 * h + 1]) >> 4);
                            int sc, mn;
                            scale_min_k4_one(hh.y, hh.z, hh.w, w8, sc, mn);
                            const float dd = h2f((u16)(hh.x & 0xffffu)), dmin = h2f((u16)(hh.x >> 16));
                            acc[m][h] += (dd * (float)sc) * (d * (float)dot) - (dmin * (float)mn) * mm;
                        }
                }
            if (TCR_PIPE) cur = nxt;
            ba += U * bst;
            xo += U * 16 * NW;
        }
        tile_finish<MODE, NW, NM>(acc, &part[it & 1][0][0][0], tb.s[si], r0, rows, rs);
    }
}

#define TCR_INSTANCE(MODE, MNAME)                                                                  \
    extern "C" __global__ void __launch_bounds__(TCR_WARPS * 32, TCR_MINB)                        \
    gemvtcr_##MNAME##_q4_k(const SegTable t, const float* x, const float* norm, float eps, int K,  \
                           int ntiles) {                                                          \
        tcr_body<MODE, TCR_WARPS>(t, x, norm, eps, K, ntiles);                                    \
    }
// kernel names: gemvtcr_<store|add|swiglu>_q4_k
TCR_INSTANCE(0, store) TCR_INSTANCE(1, add) TCR_INSTANCE(2, swiglu)
