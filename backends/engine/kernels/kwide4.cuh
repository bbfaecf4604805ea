// Engine v9 row dot for Q4_K and Q5_K with 4 lanes per super-block and 64 weights per lane
// (gemv_kq.cu, two rows per warp: 16 lanes per row, 4 super-blocks per round and row).
//
// Why (docs/perf-notes.md session 7): with kwide.cuh's 8 lanes per super-block each lane
// decodes the scale/min pair and the block's d/dmin for only 32 weights, and its two 16-value
// runs sit in two different sub-blocks; with 4 lanes each lane owns a whole sub-block pair
// (2j, 2j + 1) = 64 weights, so those costs halve per weight, and the rows of the source
// model's widths (K = 5120, 6144, 17408: 20, 24, 68 super-blocks) fill every round of 4.
//
// Lane L of a warp: h = L >> 4 (which of the warp's two rows), g = (L >> 2) & 3 (super-block
// of the round), j = L & 3 (sub-block pair). In ggml's block_q4_K (dequantize_row_q4_K;
// gguf-py Q4_K.dequantize_blocks) qs[32 j + l] holds value 64 j + l (low nibble, sub-block 2 j)
// and 64 j + 32 + l (high nibble, sub-block 2 j + 1), l = 0..31: the lane loads qs[32 j ..
// 32 j + 31] (two 16-byte loads) and the 16-byte header (d, dmin, scales[12]; the 4 lanes of a
// super-block read the same address). block_q5_K adds qh[32] after the header: the 5th bit of
// value 64 j + l is bit 2 j of qh[l], of 64 j + 32 + l bit 2 j + 1 (the lane loads all 32 qh
// bytes). Values: y = d sc q - dmin m (scale_min_k4_pair, kwide.cuh).
// Activations (xstage.cuh, staged with this file's slot swizzle): the lane's values are the xq
// entries 32 sb + 8 j + k (k = 0..3: sub-block 2 j, k = 4..7: 2 j + 1), the x blocks 8 sb + 2 j
// and + 1 (block scales xd, adjacent: one 8-byte load) and their code sums (xs, per entry).
// Per run r = d sc dot(q, xq) - dmin m sum(xq), times the x block's scale; integer parts exact
// in int32: |dot| <= 32 * 31 * 32767 < 2^25 (Q5_K), sc * dot < 63 * 2^25 < 2^31.
//
// Shared-memory banks: a quarter warp (8 lanes: g in {2p, 2p + 1}, j = 0..3, one row) reads in
// its k-th 16-byte load the entries 32 sb + 8 j + k; plain, all 8 sit at the same offset mod 8
// entries (8-way conflict). xq_slot4 XORs an entry's low 3 bits with (j | (sb & 1) << 2) of
// the entry, so those 8 loads hit 8 distinct 16-byte bank groups. The swizzle permutes each
// aligned group of 8 entries (a super-block's 32 entries stay in place).
#pragma once
#include "kwide.cuh"

__device__ __forceinline__ int xq_slot4(int e) { return e ^ (((e >> 3) & 3) | (((e >> 5) & 1) << 2)); }

// The lane's raw bytes of one super-block: header, 32 qs bytes (and for Q5_K 32 qh bytes).
template <int T> struct W4Blk;
template <> struct W4Blk<T_Q4_K> { uint4 h, q0, q1; };
template <> struct W4Blk<T_Q5_K> { uint4 h, q0, q1, qh0, qh1; };

template <int T> __device__ __forceinline__ void wide4_load(const u8* b, int j, W4Blk<T>& r);
template <> __device__ __forceinline__ void wide4_load<T_Q4_K>(const u8* b, int j, W4Blk<T_Q4_K>& r) {
    r.h = *(const uint4*)b;
    const uint4* q = (const uint4*)(b + 16 + 32 * j);
    r.q0 = q[0];
    r.q1 = q[1];
}
template <> __device__ __forceinline__ void wide4_load<T_Q5_K>(const u8* b, int j, W4Blk<T_Q5_K>& r) {
    r.h = *(const uint4*)b;
    r.qh0 = *(const uint4*)(b + 16);
    r.qh1 = *(const uint4*)(b + 32);
    const uint4* q = (const uint4*)(b + 48 + 32 * j);
    r.q0 = q[0];
    r.q1 = q[1];
}

// 4-bit (Q4_K) or 5-bit (Q5_K) codes of qs word w (bytes l = 4m .. 4m + 3 of the lane's run)
// for the low run (sub-block 2 j) and the high run (2 j + 1); t = the qh word of the same l
// shifted right by 2 j (Q5_K only).
__device__ __forceinline__ void codes4(u32 w, u32& lo, u32& hi) {
    lo = w & NIB;
    hi = (w >> 4) & NIB;
}
__device__ __forceinline__ void codes5(u32 w, u32 t, u32& lo, u32& hi) {
    lo = (w & NIB) | ((t & 0x01010101u) << 4);
    hi = ((w >> 4) & NIB) | ((t << 3) & 0x10101010u);
}

// Lane's partial of one super-block sb (times the x block scales; the caller sums lanes).
// xa: staged x (shared-window addresses, kwide.cuh XS).
template <int T> __device__ __forceinline__ float wide4_dot(const W4Blk<T>& r, const XS& xa, int sb, int j) {
    u32 w[8] = {r.q0.x, r.q0.y, r.q0.z, r.q0.w, r.q1.x, r.q1.y, r.q1.z, r.q1.w};
    u32 lo[8], hi[8];
    if constexpr (T == T_Q5_K) {
        const u32 t[8] = {r.qh0.x, r.qh0.y, r.qh0.z, r.qh0.w, r.qh1.x, r.qh1.y, r.qh1.z, r.qh1.w};
#pragma unroll
        for (int m = 0; m < 8; ++m) codes5(w[m], t[m] >> (2 * j), lo[m], hi[m]);
    } else {
#pragma unroll
        for (int m = 0; m < 8; ++m) codes4(w[m], lo[m], hi[m]);
    }
    // entries 32 sb + 8 j + k at their swizzled slots: slot = entry ^ (j | (sb & 1) << 2)
    const int e0 = 32 * sb + 8 * j, sw = j | ((sb & 1) << 2);
    int ta = 0, tb = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const int4 xl = lds128(xa.q + 16 * (e0 + (k ^ sw)));
        const int4 xh = lds128(xa.q + 16 * (e0 + ((k + 4) ^ sw)));
        ta = dot8c(xl, lo[2 * k], lo[2 * k + 1], ta);
        tb = dot8c(xh, hi[2 * k], hi[2 * k + 1], tb);
    }
    // code sums of the two 32-value blocks (xs per entry, plain order) and their scales
    const int4 s0 = lds128(xa.s + 4 * e0), s1 = lds128(xa.s + 4 * (e0 + 4));
    const int suma = (s0.x + s0.y) + (s0.z + s0.w), sumb = (s1.x + s1.y) + (s1.z + s1.w);
    const int2 dd = lds64(xa.d + 4 * (8 * sb + 2 * j));
    int sa, sbb, ma, mb;
    scale_min_k4_pair(r.h.y, r.h.z, r.h.w, j, sa, sbb, ma, mb);
    const float d = h2f((u16)(r.h.x & 0xffff)), dmin = h2f((u16)(r.h.x >> 16));
    const float ya = d * (float)(sa * ta) - dmin * (float)(ma * suma);
    const float yb = d * (float)(sbb * tb) - dmin * (float)(mb * sumb);
    return fmaf(__int_as_float(dd.x), ya, __int_as_float(dd.y) * yb);
}
