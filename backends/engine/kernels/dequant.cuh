// Per-format dequantisation of 8 consecutive weights for one lane of a warp.
//
// Indexing (shared by every format): a row of K weights is walked in groups of 256 values;
// in group g, lane L (0..31) owns values 256*g + 8*L + k, k = 0..7. For 256-value K-quant
// super-blocks g is the super-block and the lane's 8 values are chunk c = L/4 (32 values),
// quarter s = L%4. For 32-value blocks the lane's block is 8*g + L/4, quarter s = L%4.
// Block layouts and the maths follow ggml/src/ggml-common.h (structs) and
// ggml/src/ggml-quants.c (dequantize_row_*); every formula below cites the function.
#pragma once
#include "common.cuh"

// Shared-memory layout of the staged input vector: 4 floats of padding after every 32, so
// lane L's 8 values (index 256g + 8L .. +7) start at bank 8L + 4(L/4) mod 32 and the 8
// lanes of each 128-bit phase hit disjoint banks. Size for K values: XPAD(K) + 4 floats.
#define XPAD(i) ((i) + (((i) >> 5) << 2))

// 8 bytes at a 4-byte aligned address.
__device__ __forceinline__ void ld8_a4(const u8* p, u32& lo, u32& hi) {
    lo = *(const u32*)p;
    hi = *(const u32*)(p + 4);
}

template <int T> struct Fmt;  // block size QK (values), type size TS (bytes)
template <> struct Fmt<T_F32>  { static const int QK = 1,   TS = 4; };
template <> struct Fmt<T_F16>  { static const int QK = 1,   TS = 2; };
template <> struct Fmt<T_BF16> { static const int QK = 1,   TS = 2; };
template <> struct Fmt<T_Q4_0> { static const int QK = 32,  TS = 18; };
template <> struct Fmt<T_Q4_1> { static const int QK = 32,  TS = 20; };
template <> struct Fmt<T_Q5_0> { static const int QK = 32,  TS = 22; };
template <> struct Fmt<T_Q5_1> { static const int QK = 32,  TS = 24; };
template <> struct Fmt<T_Q8_0> { static const int QK = 32,  TS = 34; };
template <> struct Fmt<T_Q2_K> { static const int QK = 256, TS = 84; };
template <> struct Fmt<T_Q3_K> { static const int QK = 256, TS = 110; };
template <> struct Fmt<T_Q4_K> { static const int QK = 256, TS = 144; };
template <> struct Fmt<T_Q5_K> { static const int QK = 256, TS = 176; };
template <> struct Fmt<T_Q6_K> { static const int QK = 256, TS = 210; };

// Does lane L hold any valid value in group g of a row of K values?
template <int T> __device__ __forceinline__ bool lane_valid(int g, int lane, int K) {
    if (Fmt<T>::QK == 256) return true;                        // caller loops g < K/256
    if (Fmt<T>::QK == 32) return (8 * g + (lane >> 2)) * 32 < K;
    return 256 * g + 8 * lane < K;                             // float types: per value below
}

template <int T> __device__ __forceinline__ void deq8(const u8* row, int g, int lane, int K, float* v);

// ---- plain float types: values 256g + 8L + k, zero beyond K ----
template <> __device__ __forceinline__ void deq8<T_F32>(const u8* row, int g, int lane, int K, float* v) {
    const float* r = (const float*)row;
    const int i0 = 256 * g + 8 * lane;
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = i0 + k < K ? r[i0 + k] : 0.f;
}
template <> __device__ __forceinline__ void deq8<T_F16>(const u8* row, int g, int lane, int K, float* v) {
    const u16* r = (const u16*)row;
    const int i0 = 256 * g + 8 * lane;
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = i0 + k < K ? h2f(r[i0 + k]) : 0.f;
}
template <> __device__ __forceinline__ void deq8<T_BF16>(const u8* row, int g, int lane, int K, float* v) {
    const u16* r = (const u16*)row;
    const int i0 = 256 * g + 8 * lane;
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = i0 + k < K ? bf2f(r[i0 + k]) : 0.f;
}

// ---- 32-value blocks; j = 8s + k is the value index inside the block ----
// dequantize_row_q4_0: y[j] = ((qs[j] & 15) - 8) * d, y[j+16] = ((qs[j] >> 4) - 8) * d
template <> __device__ __forceinline__ void deq8<T_Q4_0>(const u8* row, int g, int lane, int K, float* v) {
    const u8* b = row + (8 * g + (lane >> 2)) * 18;
    const int s = lane & 3, sh = (s >> 1) * 4;
    const float d = h2f(ld_u16(b));
    u32 lo, hi;
    ld8_a2(b + 2 + 8 * (s & 1), lo, hi);
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = (float)(((byte_of(lo, hi, k) >> sh) & 15) - 8) * d;
}
// dequantize_row_q4_1: y = q * d + m
template <> __device__ __forceinline__ void deq8<T_Q4_1>(const u8* row, int g, int lane, int K, float* v) {
    const u8* b = row + (8 * g + (lane >> 2)) * 20;
    const int s = lane & 3, sh = (s >> 1) * 4;
    const float d = h2f(ld_u16(b)), m = h2f(ld_u16(b + 2));
    u32 lo, hi;
    ld8_a4(b + 4 + 8 * (s & 1), lo, hi);
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = (float)((byte_of(lo, hi, k) >> sh) & 15) * d + m;
}
// dequantize_row_q5_0: 5th bit of value j is bit j of qh; y = (q - 16) * d
template <> __device__ __forceinline__ void deq8<T_Q5_0>(const u8* row, int g, int lane, int K, float* v) {
    const u8* b = row + (8 * g + (lane >> 2)) * 22;
    const int s = lane & 3, sh = (s >> 1) * 4;
    const float d = h2f(ld_u16(b));
    const u32 qh = ld_u32_a2(b + 2);
    u32 lo, hi;
    ld8_a2(b + 6 + 8 * (s & 1), lo, hi);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const int j = 8 * s + k;
        const int q = ((byte_of(lo, hi, k) >> sh) & 15) | (((qh >> j) & 1) << 4);
        v[k] = (float)(q - 16) * d;
    }
}
// dequantize_row_q5_1: y = q * d + m
template <> __device__ __forceinline__ void deq8<T_Q5_1>(const u8* row, int g, int lane, int K, float* v) {
    const u8* b = row + (8 * g + (lane >> 2)) * 24;
    const int s = lane & 3, sh = (s >> 1) * 4;
    const float d = h2f(ld_u16(b)), m = h2f(ld_u16(b + 2));
    const u32 qh = *(const u32*)(b + 4);
    u32 lo, hi;
    ld8_a8(b + 8 + 8 * (s & 1), lo, hi);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const int j = 8 * s + k;
        const int q = ((byte_of(lo, hi, k) >> sh) & 15) | (((qh >> j) & 1) << 4);
        v[k] = (float)q * d + m;
    }
}
// dequantize_row_q8_0: y = q * d
template <> __device__ __forceinline__ void deq8<T_Q8_0>(const u8* row, int g, int lane, int K, float* v) {
    const u8* b = row + (8 * g + (lane >> 2)) * 34;
    const int s = lane & 3;
    const float d = h2f(ld_u16(b));
    u32 lo, hi;
    ld8_a2(b + 2 + 8 * s, lo, hi);
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = (float)(i8)byte_of(lo, hi, k) * d;
}

// ---- 256-value super-blocks; chunk c = L/4 (0..7), l = 8s + k (0..31) in the chunk ----
// get_scale_min_k4 (ggml-quants.c): 6-bit scale and min j of the 12 packed bytes q
__device__ __forceinline__ void scale_min_k4(int j, const u8* q, int& sc, int& m) {
    if (j < 4) {
        sc = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}
// dequantize_row_q2_K: chunk c = 4n + j takes 2-bit fields at shift 2j of qs[32n + l];
// scale byte 2c (+1 for l >= 16): low nibble scales d, high nibble scales dmin
template <> __device__ __forceinline__ void deq8<T_Q2_K>(const u8* row, int g, int lane, int K, float* v) {
    const u8* b = row + g * 84;
    const int c = lane >> 2, s = lane & 3, n = c >> 2, sh = 2 * (c & 3);
    const float d = h2f(ld_u16(b + 80)), dmin = h2f(ld_u16(b + 82));
    const int sc = b[2 * c + (s >> 1)];
    const float dl = d * (float)(sc & 15), ml = dmin * (float)(sc >> 4);
    u32 lo, hi;
    ld8_a4(b + 16 + 32 * n + 8 * s, lo, hi);
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = dl * (float)((byte_of(lo, hi, k) >> sh) & 3) - ml;
}
// dequantize_row_q3_K: 6-bit signed scales (minus 32) unpacked from 12 bytes; value =
// ((qs[32n + l] >> 2j) & 3) - (hmask[l] bit c ? 0 : 4)
__device__ __forceinline__ int scale_q3k(const u8* sc, int i) {
    const int low = i < 8 ? (sc[i] & 15) : (sc[i - 8] >> 4);
    const int high = (sc[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
    return (low | (high << 4)) - 32;
}
template <> __device__ __forceinline__ void deq8<T_Q3_K>(const u8* row, int g, int lane, int K, float* v) {
    const u8* b = row + g * 110;
    const int c = lane >> 2, s = lane & 3, n = c >> 2, sh = 2 * (c & 3);
    const float dl = h2f(ld_u16(b + 108)) * (float)scale_q3k(b + 96, 2 * c + (s >> 1));
    u32 lo, hi, mlo, mhi;
    ld8_a2(b + 32 + 32 * n + 8 * s, lo, hi);
    ld8_a2(b + 8 * s, mlo, mhi);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const int q = (byte_of(lo, hi, k) >> sh) & 3;
        const int h = (byte_of(mlo, mhi, k) >> c) & 1;
        v[k] = dl * (float)(q - (h ? 0 : 4));
    }
}
// dequantize_row_q4_K: chunk c uses qs[32*(c/2) + l], low nibble for even c; y = d*sc*q - dmin*m
template <> __device__ __forceinline__ void deq8<T_Q4_K>(const u8* row, int g, int lane, int K, float* v) {
    const u8* b = row + g * 144;
    const int c = lane >> 2, s = lane & 3, sh = 4 * (c & 1);
    int sc, m;
    scale_min_k4(c, b + 4, sc, m);
    const float d1 = h2f(ld_u16(b)) * (float)sc, m1 = h2f(ld_u16(b + 2)) * (float)m;
    u32 lo, hi;
    ld8_a8(b + 16 + 32 * (c >> 1) + 8 * s, lo, hi);
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = d1 * (float)((byte_of(lo, hi, k) >> sh) & 15) - m1;
}
// dequantize_row_q5_K: as Q4_K plus the 5th bit = bit c of qh[l]
template <> __device__ __forceinline__ void deq8<T_Q5_K>(const u8* row, int g, int lane, int K, float* v) {
    const u8* b = row + g * 176;
    const int c = lane >> 2, s = lane & 3, sh = 4 * (c & 1);
    int sc, m;
    scale_min_k4(c, b + 4, sc, m);
    const float d1 = h2f(ld_u16(b)) * (float)sc, m1 = h2f(ld_u16(b + 2)) * (float)m;
    u32 lo, hi, hlo, hhi;
    ld8_a8(b + 48 + 32 * (c >> 1) + 8 * s, lo, hi);
    ld8_a8(b + 16 + 8 * s, hlo, hhi);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const int q = ((byte_of(lo, hi, k) >> sh) & 15) | (((byte_of(hlo, hhi, k) >> c) & 1) << 4);
        v[k] = d1 * (float)q - m1;
    }
}
// dequantize_row_q6_K: chunk c = 4n + qq: low 4 bits from ql[64n + 32*(qq&1) + l] (shift
// 4*(qq>>1)), high 2 bits from qh[32n + l] >> 2qq; y = d * sc[8n + l/16 + 2qq] * (q - 32)
template <> __device__ __forceinline__ void deq8<T_Q6_K>(const u8* row, int g, int lane, int K, float* v) {
    const u8* b = row + g * 210;
    const int c = lane >> 2, s = lane & 3, n = c >> 2, qq = c & 3;
    const float ds = h2f(ld_u16(b + 208)) * (float)(i8)b[192 + 8 * n + (s >> 1) + 2 * qq];
    u32 lo, hi, hlo, hhi;
    ld8_a2(b + 64 * n + 32 * (qq & 1) + 8 * s, lo, hi);
    ld8_a2(b + 128 + 32 * n + 8 * s, hlo, hhi);
    const int sl = 4 * (qq >> 1), shh = 2 * qq;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const int q = ((byte_of(lo, hi, k) >> sl) & 15) | (((byte_of(hlo, hhi, k) >> shh) & 3) << 4);
        v[k] = ds * (float)(q - 32);
    }
}

// I-quants: Fmt, deq8 (iquants.cuh)
#include "iquants.cuh"

// Lane's partial dot product of one row (K values) with x (float, shared memory), over the
// 256-value groups g0, g0 + gstep, ... (gstep warps share a row). No early exit, so the
// loop unrolls and several groups' loads are in flight at once (decode GEMVs are
// latency-bound: a warp must keep many independent loads outstanding).
template <int T> __device__ __forceinline__ float row_dot(const u8* row, const float* x, int K, int lane,
                                                          int g0, int gstep) {
    const int ng = (K + 255) / 256;
    float acc = 0.f;
#pragma unroll 4
    for (int g = g0; g < ng; g += gstep) {
        if (lane_valid<T>(g, lane, K)) {
            float v[8];
            deq8<T>(row, g, lane, K, v);
            const int i0 = 256 * g + 8 * lane;
            const float* xp = x + XPAD(i0);  // 8 values, contiguous after padding
            if (Fmt<T>::QK > 1 || i0 + 8 <= K) {
                const float4 a = *(const float4*)xp, b = *(const float4*)(xp + 4);
                acc = fmaf(v[0], a.x, acc); acc = fmaf(v[1], a.y, acc);
                acc = fmaf(v[2], a.z, acc); acc = fmaf(v[3], a.w, acc);
                acc = fmaf(v[4], b.x, acc); acc = fmaf(v[5], b.y, acc);
                acc = fmaf(v[6], b.z, acc); acc = fmaf(v[7], b.w, acc);
            } else {
#pragma unroll
                for (int k = 0; k < 8; ++k)
                    if (i0 + k < K) acc = fmaf(v[k], xp[k], acc);
            }
        }
    }
    return acc;
}

// I-quants behind a call, as in gemv.cu (row_dot_iq): inlined they raised the registers of
// every gemvf kernel (62 -> 72).
__device__ __noinline__ float row_dot_iq_f32(int type, const u8* row, const float* x, int K, int lane,
                                             int g0, int gstep) {
    switch (type) {
#define CASE(T) case T: return row_dot<T>(row, x, K, lane, g0, gstep);
        FOR_EACH_IQ_TYPE(CASE)
#undef CASE
    }
    return __int_as_float(0x7fc00000);  // unknown type: NaN, caught by the finite checks
}

// Runtime dispatch on the GGML type id (uniform per warp, so no divergence).
__device__ __forceinline__ float row_dot_any(int type, const u8* row, const float* x, int K, int lane,
                                             int g0, int gstep) {
    switch (type) {
        case T_F32:  return row_dot<T_F32>(row, x, K, lane, g0, gstep);
        case T_F16:  return row_dot<T_F16>(row, x, K, lane, g0, gstep);
        case T_BF16: return row_dot<T_BF16>(row, x, K, lane, g0, gstep);
        case T_Q4_0: return row_dot<T_Q4_0>(row, x, K, lane, g0, gstep);
        case T_Q4_1: return row_dot<T_Q4_1>(row, x, K, lane, g0, gstep);
        case T_Q5_0: return row_dot<T_Q5_0>(row, x, K, lane, g0, gstep);
        case T_Q5_1: return row_dot<T_Q5_1>(row, x, K, lane, g0, gstep);
        case T_Q8_0: return row_dot<T_Q8_0>(row, x, K, lane, g0, gstep);
        case T_Q2_K: return row_dot<T_Q2_K>(row, x, K, lane, g0, gstep);
        case T_Q3_K: return row_dot<T_Q3_K>(row, x, K, lane, g0, gstep);
        case T_Q4_K: return row_dot<T_Q4_K>(row, x, K, lane, g0, gstep);
        case T_Q5_K: return row_dot<T_Q5_K>(row, x, K, lane, g0, gstep);
        case T_Q6_K: return row_dot<T_Q6_K>(row, x, K, lane, g0, gstep);
    }
    return row_dot_iq_f32(type, row, x, K, lane, g0, gstep);
}

// Dequantise group g of a row into out[256g + 8L + k] (embedding lookup).
template <int T> __device__ __forceinline__ void row_deq(const u8* row, float* out, int K, int g, int lane) {
    if (!lane_valid<T>(g, lane, K)) return;
    float v[8];
    deq8<T>(row, g, lane, K, v);
#pragma unroll
    for (int k = 0; k < 8; ++k)
        if (256 * g + 8 * lane + k < K) out[256 * g + 8 * lane + k] = v[k];
}

__device__ __forceinline__ void row_deq_any(int type, const u8* row, float* out, int K, int g, int lane) {
    switch (type) {
        case T_F32:  row_deq<T_F32>(row, out, K, g, lane); return;
        case T_F16:  row_deq<T_F16>(row, out, K, g, lane); return;
        case T_BF16: row_deq<T_BF16>(row, out, K, g, lane); return;
        case T_Q4_0: row_deq<T_Q4_0>(row, out, K, g, lane); return;
        case T_Q4_1: row_deq<T_Q4_1>(row, out, K, g, lane); return;
        case T_Q5_0: row_deq<T_Q5_0>(row, out, K, g, lane); return;
        case T_Q5_1: row_deq<T_Q5_1>(row, out, K, g, lane); return;
        case T_Q8_0: row_deq<T_Q8_0>(row, out, K, g, lane); return;
        case T_Q2_K: row_deq<T_Q2_K>(row, out, K, g, lane); return;
        case T_Q3_K: row_deq<T_Q3_K>(row, out, K, g, lane); return;
        case T_Q4_K: row_deq<T_Q4_K>(row, out, K, g, lane); return;
        case T_Q5_K: row_deq<T_Q5_K>(row, out, K, g, lane); return;
        case T_Q6_K: row_deq<T_Q6_K>(row, out, K, g, lane); return;
        case T_IQ4_NL: row_deq<T_IQ4_NL>(row, out, K, g, lane); return;
        case T_IQ4_XS: row_deq<T_IQ4_XS>(row, out, K, g, lane); return;
        case T_IQ3_S: row_deq<T_IQ3_S>(row, out, K, g, lane); return;
        case T_IQ3_XXS: row_deq<T_IQ3_XXS>(row, out, K, g, lane); return;
        case T_IQ2_S: row_deq<T_IQ2_S>(row, out, K, g, lane); return;
        case T_IQ2_XS: row_deq<T_IQ2_XS>(row, out, K, g, lane); return;
        case T_IQ2_XXS: row_deq<T_IQ2_XXS>(row, out, K, g, lane); return;
        case T_IQ1_S: row_deq<T_IQ1_S>(row, out, K, g, lane); return;
        case T_IQ1_M: row_deq<T_IQ1_M>(row, out, K, g, lane); return;
    }
}
