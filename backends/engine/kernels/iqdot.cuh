// Integer dot products (qdot8, see qdot.cuh) of the I-quants: the lane's 8 codebook values as
// signed bytes, dp2a with the int16 activation codes, the block's scales applied after the
// integer sum. Decoding (indices, signs, scales): iquants.cuh. Included by qdot.cuh.
//
// With dx the activation block scale, the caller's r * dx is the exact dot product of the
// dequantised weights (ggml-quants.c dequantize_row_iq*) with the activation, up to fp32
// rounding of r:
//   IQ2_*, IQ3_*: w_k = d (2 ls + 1) / DEN * s_k grid_k  -> r = d ((2 ls + 1) dot(s grid, xq)) / DEN
//   IQ1_S/IQ1_M: w_k = d (2 ls + 1) (grid_k +- 1/8)     -> r = d ((2 ls + 1) (8 dot(grid, xq) +- s8)) / 8
//   IQ4_NL: w_k = d kv_k -> r = d dot(kv, xq);  IQ4_XS: w_k = d (ls - 32) kv_k -> r = d ((ls - 32) dot)
// (the IQ1 delta is the `b * s8` term of qdot.cuh's a * dot + b * s8).
// Ranges (|xq| <= 32767, 8 products): grid values <= 62 and scale factors <= 31 -> < 2^30;
// IQ1: 15 * (8 * 8 + 8) * 32767 < 2^26; IQ4_XS: 32 * 8 * 127 * 32767 < 2^31. All exact in int32.
#pragma once
#include "iquants.cuh"

// Signs onto 4 positive grid bytes (1..127): bytes whose bit in s (bits 0..3) is set become
// -g = (g ^ 0xff) + 1 mod 256; g > 0 keeps (g ^ 0xff) + 1 <= 255, so no carry crosses bytes.
// The grids have no zero byte (tests/test_engine_iq_tables.py checks it).
__device__ __forceinline__ u32 apply_signs4(u32 g, u32 s) {
    const u32 one = spread4(s);
    return (g ^ (one * 0xFFu)) + one;
}

template <int T> __device__ __forceinline__ float qdot8_grid(const u8* row, int g, int lane, const int4& x) {
    const IqGrid8 q = iq_grid8<T>(row, g, lane);
    const int dt = dot8(x, apply_signs4(q.lo, q.sg), apply_signs4(q.hi, q.sg >> 4));
    return q.d * (float)((2 * q.ls + 1) * dt) * (1.f / IqDen<T>::DEN);
}
template <int T> __device__ __forceinline__ float qdot8_iq1(const u8* row, int g, int lane, const int4& x, int s8) {
    const Iq1Lane q = iq1_lane<T>(row, g, lane);
    const int t = 8 * dot8(x, q.lo, q.hi) + (q.neg ? -s8 : s8);
    return q.d * (float)((2 * q.ls + 1) * t) * 0.125f;
}

template <> __device__ __forceinline__ float qdot8<T_IQ2_XXS>(const u8* row, int g, int lane, const int4& x, int s8) { return qdot8_grid<T_IQ2_XXS>(row, g, lane, x); }
template <> __device__ __forceinline__ float qdot8<T_IQ2_XS>(const u8* row, int g, int lane, const int4& x, int s8) { return qdot8_grid<T_IQ2_XS>(row, g, lane, x); }
template <> __device__ __forceinline__ float qdot8<T_IQ2_S>(const u8* row, int g, int lane, const int4& x, int s8) { return qdot8_grid<T_IQ2_S>(row, g, lane, x); }
template <> __device__ __forceinline__ float qdot8<T_IQ3_XXS>(const u8* row, int g, int lane, const int4& x, int s8) { return qdot8_grid<T_IQ3_XXS>(row, g, lane, x); }
template <> __device__ __forceinline__ float qdot8<T_IQ3_S>(const u8* row, int g, int lane, const int4& x, int s8) { return qdot8_grid<T_IQ3_S>(row, g, lane, x); }
template <> __device__ __forceinline__ float qdot8<T_IQ1_S>(const u8* row, int g, int lane, const int4& x, int s8) { return qdot8_iq1<T_IQ1_S>(row, g, lane, x, s8); }
template <> __device__ __forceinline__ float qdot8<T_IQ1_M>(const u8* row, int g, int lane, const int4& x, int s8) { return qdot8_iq1<T_IQ1_M>(row, g, lane, x, s8); }
template <> __device__ __forceinline__ float qdot8<T_IQ4_NL>(const u8* row, int g, int lane, const int4& x, int s8) {
    u32 lo, hi;
    const float d = iq4nl_lane(row, g, lane, lo, hi);
    return d * (float)dot8(x, lo, hi);
}
template <> __device__ __forceinline__ float qdot8<T_IQ4_XS>(const u8* row, int g, int lane, const int4& x, int s8) {
    u32 lo, hi;
    int ls;
    const float d = iq4xs_lane(row, g, lane, lo, hi, ls);
    return d * (float)((ls - 32) * dot8(x, lo, hi));
}
