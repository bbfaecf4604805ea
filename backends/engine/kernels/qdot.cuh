// Integer dot products of one lane's 8 weights with 8 int16-quantised activations.
//
// Lane/value mapping as in dequant.cuh: in 256-value group g, lane L owns values
// 256g + 8L .. +7, all inside one 32-value block of x (block 8g + L/4). The activation is
// quantised per 32-value block to int16 (x ~= dx * xq, dx = amax / 32767, see gemv.cu
// stage_xq), so for every integer format
//     sum_k w_k x_k = dx * (a * sum_k q_k xq_k + b * sum_k xq_k)
// where q_k are the raw unsigned (or, for Q8_0, signed) codes and (a, b) follow from the
// format's dequantisation formula (ggml-quants.c dequantize_row_*): y = a q + b. qdot8
// returns a * dot + b * s8 (s8 = sum_k xq_k, staged with x); the caller multiplies by dx.
//
// The dot product uses dp2a (16-bit x 8-bit, 2 products per instruction, exact int32):
// 4 instructions for 8 weights instead of 8 int->float conversions and 16 FMAs. The codes
// are put into bytes with 32-bit mask/shift/or on packed words (4 values at a time).
// Range: |q| <= 127, |xq| <= 32767, 8 products -> |dot| < 2^25, exact in int32; its float
// conversion is exact below 2^24 (all formats but Q8_0, which loses < 6e-8 relative).
#pragma once
#include "dequant.cuh"

__device__ __forceinline__ int dp2a_lo(int a, u32 b, int c) {
    int d;
    asm("dp2a.lo.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
__device__ __forceinline__ int dp2a_hi(int a, u32 b, int c) {
    int d;
    asm("dp2a.hi.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// x: 8 int16 (x.x = xq0 | xq1 << 16, ...); lo, hi: codes of values 0..3 and 4..7, one per byte.
__device__ __forceinline__ int dot8(const int4& x, u32 lo, u32 hi) {
    int s = dp2a_lo(x.x, lo, 0);
    s = dp2a_hi(x.y, lo, s);
    s = dp2a_lo(x.z, hi, s);
    return dp2a_hi(x.w, hi, s);
}

// Bits 0..3 of b -> bit 0 of bytes 0..3 (the four shifted copies occupy disjoint bit ranges
// 0-3, 7-10, 14-17, 21-24, so the multiply has no carries).
__device__ __forceinline__ u32 spread4(u32 b) { return ((b & 15u) * 0x00204081u) & 0x01010101u; }

#define NIB 0x0F0F0F0Fu

template <int T> __device__ __forceinline__ float qdot8(const u8* row, int g, int lane, const int4& x, int s8);

// dequantize_row_q4_0: y = d (q - 8)
template <> __device__ __forceinline__ float qdot8<T_Q4_0>(const u8* row, int g, int lane, const int4& x, int s8) {
    const u8* b = row + (8 * g + (lane >> 2)) * 18;
    const int s = lane & 3, sh = (s >> 1) * 4;
    u32 lo, hi;
    ld8_a2(b + 2 + 8 * (s & 1), lo, hi);
    return h2f(ld_u16(b)) * (float)(dot8(x, (lo >> sh) & NIB, (hi >> sh) & NIB) - 8 * s8);
}
// dequantize_row_q4_1: y = d q + m
template <> __device__ __forceinline__ float qdot8<T_Q4_1>(const u8* row, int g, int lane, const int4& x, int s8) {
    const u8* b = row + (8 * g + (lane >> 2)) * 20;
    const int s = lane & 3, sh = (s >> 1) * 4;
    u32 lo, hi;
    ld8_a4(b + 4 + 8 * (s & 1), lo, hi);
    return h2f(ld_u16(b)) * (float)dot8(x, (lo >> sh) & NIB, (hi >> sh) & NIB) + h2f(ld_u16(b + 2)) * (float)s8;
}
// dequantize_row_q5_0: 5th bit of value j is bit j of qh; y = d (q - 16)
template <> __device__ __forceinline__ float qdot8<T_Q5_0>(const u8* row, int g, int lane, const int4& x, int s8) {
    const u8* b = row + (8 * g + (lane >> 2)) * 22;
    const int s = lane & 3, sh = (s >> 1) * 4;
    const u32 hb = ld_u32_a2(b + 2) >> (8 * s);
    u32 lo, hi;
    ld8_a2(b + 6 + 8 * (s & 1), lo, hi);
    lo = ((lo >> sh) & NIB) | (spread4(hb) << 4);
    hi = ((hi >> sh) & NIB) | (spread4(hb >> 4) << 4);
    return h2f(ld_u16(b)) * (float)(dot8(x, lo, hi) - 16 * s8);
}
// dequantize_row_q5_1: y = d q + m
template <> __device__ __forceinline__ float qdot8<T_Q5_1>(const u8* row, int g, int lane, const int4& x, int s8) {
    const u8* b = row + (8 * g + (lane >> 2)) * 24;
    const int s = lane & 3, sh = (s >> 1) * 4;
    const u32 hb = *(const u32*)(b + 4) >> (8 * s);
    u32 lo, hi;
    ld8_a8(b + 8 + 8 * (s & 1), lo, hi);
    lo = ((lo >> sh) & NIB) | (spread4(hb) << 4);
    hi = ((hi >> sh) & NIB) | (spread4(hb >> 4) << 4);
    return h2f(ld_u16(b)) * (float)dot8(x, lo, hi) + h2f(ld_u16(b + 2)) * (float)s8;
}
// dequantize_row_q8_0: y = d q (signed bytes)
template <> __device__ __forceinline__ float qdot8<T_Q8_0>(const u8* row, int g, int lane, const int4& x, int s8) {
    const u8* b = row + (8 * g + (lane >> 2)) * 34;
    u32 lo, hi;
    ld8_a2(b + 2 + 8 * (lane & 3), lo, hi);
    return h2f(ld_u16(b)) * (float)dot8(x, lo, hi);
}
// dequantize_row_q2_K: y = d (sc & 15) q - dmin (sc >> 4)
template <> __device__ __forceinline__ float qdot8<T_Q2_K>(const u8* row, int g, int lane, const int4& x, int s8) {
    const u8* b = row + g * 84;
    const int c = lane >> 2, s = lane & 3, n = c >> 2, sh = 2 * (c & 3);
    const int sc = b[2 * c + (s >> 1)];
    u32 lo, hi;
    ld8_a4(b + 16 + 32 * n + 8 * s, lo, hi);
    const int dt = dot8(x, (lo >> sh) & 0x03030303u, (hi >> sh) & 0x03030303u);
    return h2f(ld_u16(b + 80)) * (float)(sc & 15) * (float)dt - h2f(ld_u16(b + 82)) * (float)(sc >> 4) * (float)s8;
}
// dequantize_row_q3_K: y = dl (q2 | h << 2) - 4 dl, h = hmask bit c (set: +0, clear: -4)
template <> __device__ __forceinline__ float qdot8<T_Q3_K>(const u8* row, int g, int lane, const int4& x, int s8) {
    const u8* b = row + g * 110;
    const int c = lane >> 2, s = lane & 3, n = c >> 2, sh = 2 * (c & 3);
    u32 lo, hi, mlo, mhi;
    ld8_a2(b + 32 + 32 * n + 8 * s, lo, hi);
    ld8_a2(b + 8 * s, mlo, mhi);
    lo = ((lo >> sh) & 0x03030303u) | (((mlo >> c) & 0x01010101u) << 2);
    hi = ((hi >> sh) & 0x03030303u) | (((mhi >> c) & 0x01010101u) << 2);
    const float dl = h2f(ld_u16(b + 108)) * (float)scale_q3k(b + 96, 2 * c + (s >> 1));
    return dl * (float)(dot8(x, lo, hi) - 4 * s8);
}
// dequantize_row_q4_K: y = d sc q - dmin m
template <> __device__ __forceinline__ float qdot8<T_Q4_K>(const u8* row, int g, int lane, const int4& x, int s8) {
    const u8* b = row + g * 144;
    const int c = lane >> 2, s = lane & 3, sh = 4 * (c & 1);
    int sc, m;
    scale_min_k4(c, b + 4, sc, m);
    u32 lo, hi;
    ld8_a8(b + 16 + 32 * (c >> 1) + 8 * s, lo, hi);
    const int dt = dot8(x, (lo >> sh) & NIB, (hi >> sh) & NIB);
    return h2f(ld_u16(b)) * (float)(sc * dt) - h2f(ld_u16(b + 2)) * (float)(m * s8);
}
// dequantize_row_q5_K: as Q4_K, 5th bit = bit c of qh[l]
template <> __device__ __forceinline__ float qdot8<T_Q5_K>(const u8* row, int g, int lane, const int4& x, int s8) {
    const u8* b = row + g * 176;
    const int c = lane >> 2, s = lane & 3, sh = 4 * (c & 1);
    int sc, m;
    scale_min_k4(c, b + 4, sc, m);
    u32 lo, hi, hlo, hhi;
    ld8_a8(b + 48 + 32 * (c >> 1) + 8 * s, lo, hi);
    ld8_a8(b + 16 + 8 * s, hlo, hhi);
    lo = ((lo >> sh) & NIB) | (((hlo >> c) & 0x01010101u) << 4);
    hi = ((hi >> sh) & NIB) | (((hhi >> c) & 0x01010101u) << 4);
    return h2f(ld_u16(b)) * (float)(sc * dot8(x, lo, hi)) - h2f(ld_u16(b + 2)) * (float)(m * s8);
}
// dequantize_row_q6_K: y = d sc (q - 32), q = 4 low bits | 2 high bits << 4
template <> __device__ __forceinline__ float qdot8<T_Q6_K>(const u8* row, int g, int lane, const int4& x, int s8) {
    const u8* b = row + g * 210;
    const int c = lane >> 2, s = lane & 3, n = c >> 2, qq = c & 3;
    const int sl = 4 * (qq >> 1), shh = 2 * qq;
    u32 lo, hi, hlo, hhi;
    ld8_a2(b + 64 * n + 32 * (qq & 1) + 8 * s, lo, hi);
    ld8_a2(b + 128 + 32 * n + 8 * s, hlo, hhi);
    lo = ((lo >> sl) & NIB) | (((hlo >> shh) & 0x03030303u) << 4);
    hi = ((hi >> sl) & NIB) | (((hhi >> shh) & 0x03030303u) << 4);
    const int sc = (i8)b[192 + 8 * n + (s >> 1) + 2 * qq];
    return h2f(ld_u16(b + 208)) * (float)(sc * (dot8(x, lo, hi) - 32 * s8));
}

// I-quants (iqdot.cuh)
#include "iqdot.cuh"

// Float weight types: dequantise in fp32 and multiply by the int16 codes (exact in fp32).
template <int T> __device__ __forceinline__ float fdot8(const u8* row, int g, int lane, int K, const int4& x) {
    float v[8];
    deq8<T>(row, g, lane, K, v);
    const int xs[4] = {x.x, x.y, x.z, x.w};
    float acc = 0.f;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const int w = xs[k >> 1];
        const float xk = (float)(k & 1 ? (w >> 16) : (int)(short)(w & 0xffff));
        if (256 * g + 8 * lane + k < K) acc = fmaf(v[k], xk, acc);
    }
    return acc;
}
