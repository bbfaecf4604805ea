// I-quants (IQ4_NL, IQ4_XS, IQ3_S, IQ3_XXS, IQ2_S, IQ2_XS, IQ2_XXS, IQ1_S, IQ1_M): block
// sizes, each lane's decode of its 8 values, and deq8 (float dequantisation). Included by
// dequant.cuh; the integer dot products are in iqdot.cuh.
//
// Lane mapping as in dequant.cuh: in super-block g, lane L owns values 8L .. 8L + 7, i.e.
// sub-block ib = L/4 (32 values) and eighth l = L%4 of it; for IQ4_NL (32-value blocks) block
// 8g + L/4, quarter l. In every grid format those 8 values are exactly one 8-value codeword
// (IQ2_*, IQ1_*) or two 4-value codewords (IQ3_*) with one 8-bit sign mask, so a lane does one
// or two table lookups. Layouts: ggml/src/ggml-common.h (block_iq*); formulas: ggml-quants.c
// dequantize_row_iq*. The grids (iq2xxs_grid ...) and IQ4NL_K0..3 come from the generated
// header (backends/engine/iq_tables.py), which backends/engine/module.py puts before the code.
//
// Alignment of a block = gcd(type size, 256) (rows start 256-byte aligned, see arena.py):
// IQ4_NL 18, IQ2_XXS 66, IQ2_XS 74, IQ2_S 82, IQ3_XXS 98, IQ3_S 110, IQ1_S 50 bytes are only
// 2-byte aligned (16-bit loads, ld_u32_a2); IQ4_XS 136 and IQ1_M 56 are 8-byte aligned.
//
// Exactness: every dequantised value is a product of the fp16 scale (11 significant bits),
// a small odd integer and a codebook value with at most 24 significant bits in total, so
// ggml's float products are exact and deq8 reproduces them bit for bit in any order.
#pragma once
#include "common.cuh"

#ifndef GGUF_HARNESS_IQ_TABLES
#error "I-quant tables missing: module.py prefixes backends/engine/iq_tables.py's header (nvcc: -include iq_tables.cuh)"
#endif

// The I-quant type ids, for the dispatch switches (gemv.cu row_dot_iq, dequant.cuh row_dot_iq_f32)
#define FOR_EACH_IQ_TYPE(X) X(T_IQ4_NL) X(T_IQ4_XS) X(T_IQ3_S) X(T_IQ3_XXS) X(T_IQ2_S) X(T_IQ2_XS) \
    X(T_IQ2_XXS) X(T_IQ1_S) X(T_IQ1_M)

template <> struct Fmt<T_IQ2_XXS> { static const int QK = 256, TS = 66; };
template <> struct Fmt<T_IQ2_XS>  { static const int QK = 256, TS = 74; };
template <> struct Fmt<T_IQ2_S>   { static const int QK = 256, TS = 82; };
template <> struct Fmt<T_IQ3_XXS> { static const int QK = 256, TS = 98; };
template <> struct Fmt<T_IQ3_S>   { static const int QK = 256, TS = 110; };
template <> struct Fmt<T_IQ1_S>   { static const int QK = 256, TS = 50; };
template <> struct Fmt<T_IQ1_M>   { static const int QK = 256, TS = 56; };
template <> struct Fmt<T_IQ4_NL>  { static const int QK = 32,  TS = 18; };
template <> struct Fmt<T_IQ4_XS>  { static const int QK = 256, TS = 136; };

// ---- codebook helpers ----
// ksigns_iq2xs[s] (ggml-common.h) = s with bit 7 = parity of popcount(s): the 7 stored sign
// bits of IQ2_XXS/IQ2_XS/IQ3_XXS plus an implied 8th that makes the count of minus signs even.
__device__ __forceinline__ u32 ksigns8(u32 s7) { return s7 | ((__popc(s7) & 1u) << 7); }

// kvalues_iq4nl of 4 codes (0..15, one per byte of c) -> 4 int8 values, one per byte.
// __byte_perm selects with 3-bit selectors: once from entries 0..7 (K0, K1), once from 8..15
// (K2, K3); bit 3 of each code then picks between the two results.
__device__ __forceinline__ u32 iq4nl_lut4(u32 c) {
    const u32 t = c | (c >> 4);
    const u32 sel = (t & 0xFFu) | ((t >> 8) & 0xFF00u);  // nibble j = code j
    const u32 lo = __byte_perm(IQ4NL_K0, IQ4NL_K1, sel & 0x7777u);
    const u32 hi = __byte_perm(IQ4NL_K2, IQ4NL_K3, sel & 0x7777u);
    return __byte_perm(lo, hi, 0x3210u | ((sel >> 1) & 0x4444u));
}

// ---- per-lane decode ----
// Grid formats (IQ2_*, IQ3_*): value k = d * f(ls) * grid byte k * (bit k of sg ? -1 : 1),
// with f(ls) = (2 ls + 1) / IqDen<T>::DEN (ggml: d * (0.5 + ls) * 0.25 for IQ2_*,
// d * (0.5 + ls) * 0.5 for IQ3_XXS, d * (1 + 2 ls) for IQ3_S). lo/hi: bytes of values 0..3 / 4..7.
struct IqGrid8 { u32 lo, hi, sg; int ls; float d; };
template <int T> struct IqDen;
template <> struct IqDen<T_IQ2_XXS> { static constexpr float DEN = 8.f; };
template <> struct IqDen<T_IQ2_XS>  { static constexpr float DEN = 8.f; };
template <> struct IqDen<T_IQ2_S>   { static constexpr float DEN = 8.f; };
template <> struct IqDen<T_IQ3_XXS> { static constexpr float DEN = 4.f; };
template <> struct IqDen<T_IQ3_S>   { static constexpr float DEN = 1.f; };

template <int T> __device__ __forceinline__ IqGrid8 iq_grid8(const u8* row, int g, int lane);

__device__ __forceinline__ void split64(u64 w, u32& lo, u32& hi) { lo = (u32)w; hi = (u32)(w >> 32); }

// block_iq2_xxs {d; u16 qs[32]}: sub-block ib = qs[4ib..4ib+3] as two u32: the first holds the
// 4 grid indices (byte l), the second 4 x 7 sign bits (bits 7l..) and the scale (bits 28..31).
template <> __device__ __forceinline__ IqGrid8 iq_grid8<T_IQ2_XXS>(const u8* row, int g, int lane) {
    const u8* b = row + g * 66;
    const int ib = lane >> 2, l = lane & 3;
    const u32 aux = ld_u32_a2(b + 6 + 8 * ib);
    IqGrid8 q;
    split64(iq2xxs_grid[b[2 + 8 * ib + l]], q.lo, q.hi);
    q.sg = ksigns8((aux >> (7 * l)) & 127u);
    q.ls = (int)(aux >> 28);
    q.d = h2f(ld_u16(b));
    return q;
}
// block_iq2_xs {d; u16 qs[32]; u8 scales[8]}: qs[4ib + l] = 9-bit grid index | 7 sign bits << 9;
// scale nibble of scales[ib]: low for l < 2, high for l >= 2.
template <> __device__ __forceinline__ IqGrid8 iq_grid8<T_IQ2_XS>(const u8* row, int g, int lane) {
    const u8* b = row + g * 74;
    const int ib = lane >> 2, l = lane & 3;
    const u32 qs = ld_u16(b + 2 + 8 * ib + 2 * l);
    IqGrid8 q;
    split64(iq2xs_grid[qs & 511u], q.lo, q.hi);
    q.sg = ksigns8(qs >> 9);
    q.ls = (b[66 + ib] >> (4 * (l >> 1))) & 15;
    q.d = h2f(ld_u16(b));
    return q;
}
// block_iq2_s {d; u8 qs[32]; u8 signs[32]; u8 qh[8]; u8 scales[8]}: index = qs[4ib + l] |
// bits 2l..2l+1 of qh[ib] << 8; 8 explicit sign bits signs[4ib + l].
template <> __device__ __forceinline__ IqGrid8 iq_grid8<T_IQ2_S>(const u8* row, int g, int lane) {
    const u8* b = row + g * 82;
    const int ib = lane >> 2, l = lane & 3;
    const u32 idx = b[2 + 4 * ib + l] | (((u32)(b[66 + ib] >> (2 * l)) & 3u) << 8);
    IqGrid8 q;
    split64(iq2s_grid[idx], q.lo, q.hi);
    q.sg = b[34 + 4 * ib + l];
    q.ls = (b[74 + ib] >> (4 * (l >> 1))) & 15;
    q.d = h2f(ld_u16(b));
    return q;
}
// block_iq3_xxs {d; u8 qs[64] grid indices; u32 scales_and_signs[8]}: values 0..3 / 4..7 from
// iq3xxs_grid[qs[8ib + 2l]] / [qs[8ib + 2l + 1]]; signs and scale as in IQ2_XXS.
template <> __device__ __forceinline__ IqGrid8 iq_grid8<T_IQ3_XXS>(const u8* row, int g, int lane) {
    const u8* b = row + g * 98;
    const int ib = lane >> 2, l = lane & 3;
    const u32 idx = ld_u16(b + 2 + 8 * ib + 2 * l);
    const u32 aux = ld_u32_a2(b + 66 + 4 * ib);
    IqGrid8 q;
    q.lo = iq3xxs_grid[idx & 255u];
    q.hi = iq3xxs_grid[idx >> 8];
    q.sg = ksigns8((aux >> (7 * l)) & 127u);
    q.ls = (int)(aux >> 28);
    q.d = h2f(ld_u16(b));
    return q;
}
// block_iq3_s {d; u8 qs[64]; u8 qh[8]; u8 signs[32]; u8 scales[4]}: indices qs[8ib + 2l] |
// bit 2l of qh[ib] << 8 and qs[8ib + 2l + 1] | bit 2l + 1 << 8; signs[4ib + l]; scale nibble
// ib & 1 of scales[ib / 2].
template <> __device__ __forceinline__ IqGrid8 iq_grid8<T_IQ3_S>(const u8* row, int g, int lane) {
    const u8* b = row + g * 110;
    const int ib = lane >> 2, l = lane & 3;
    const u32 idx = ld_u16(b + 2 + 8 * ib + 2 * l);
    const u32 qh = (u32)b[66 + ib] >> (2 * l);
    IqGrid8 q;
    q.lo = iq3s_grid[(idx & 255u) | ((qh & 1u) << 8)];
    q.hi = iq3s_grid[(idx >> 8) | ((qh & 2u) << 7)];
    q.sg = b[74 + 4 * ib + l];
    q.ls = (b[106 + (ib >> 1)] >> (4 * (ib & 1))) & 15;
    q.d = h2f(ld_u16(b));
    return q;
}

// IQ1 formats: value k = d * (2 ls + 1) * (grid byte k + delta), grid bytes int8 in {-1, 0, 1},
// delta = -1/8 if neg else +1/8 (IQ1S_DELTA = IQ1M_DELTA = 0.125).
struct Iq1Lane { u32 lo, hi; int ls; bool neg; float d; };
template <int T> __device__ __forceinline__ Iq1Lane iq1_lane(const u8* row, int g, int lane);

// block_iq1_s {d; u8 qs[32]; u16 qh[8]}: index = qs[4ib + l] | bits 3l..3l+2 of qh[ib] << 8;
// scale = bits 12..14 of qh[ib], delta sign = bit 15.
template <> __device__ __forceinline__ Iq1Lane iq1_lane<T_IQ1_S>(const u8* row, int g, int lane) {
    const u8* b = row + g * 50;
    const int ib = lane >> 2, l = lane & 3;
    const u32 qh = ld_u16(b + 34 + 2 * ib);
    Iq1Lane q;
    split64(iq1s_grid[b[2 + 4 * ib + l] | (((qh >> (3 * l)) & 7u) << 8)], q.lo, q.hi);
    q.ls = (qh >> 12) & 7;
    q.neg = (qh & 0x8000u) != 0;
    q.d = h2f(ld_u16(b));
    return q;
}
// block_iq1_m {u8 qs[32]; u8 qh[16]; u16 sc[4]}: no d field: its fp16 bits are the top
// nibbles of sc[0..3] (sc[0] -> bits 0..3, ..., sc[3] -> bits 12..15). Index = qs[4ib + l] |
// bits 0..2 of nibble l & 1 of qh[2ib + l/2] << 8, delta sign = bit 3 of that nibble; 3-bit
// scale at bit 6 (ib & 1) + 3 (l / 2) of sc[ib / 2].
template <> __device__ __forceinline__ Iq1Lane iq1_lane<T_IQ1_M>(const u8* row, int g, int lane) {
    const u8* b = row + g * 56;
    const int ib = lane >> 2, l = lane & 3;
    u32 w0, w1;  // sc[0] | sc[1] << 16, sc[2] | sc[3] << 16
    ld8_a8(b + 48, w0, w1);
    const u32 d16 = ((w0 >> 12) & 0xFu) | ((w0 >> 24) & 0xF0u) | ((w1 >> 4) & 0xF00u) | ((w1 >> 16) & 0xF000u);
    const u32 sc = (ib < 4 ? w0 : w1) >> (16 * ((ib >> 1) & 1));
    const u32 h = (u32)b[32 + 2 * ib + (l >> 1)] >> (4 * (l & 1));
    Iq1Lane q;
    split64(iq1s_grid[b[4 * ib + l] | ((h & 7u) << 8)], q.lo, q.hi);
    q.ls = (sc >> (6 * (ib & 1) + 3 * (l >> 1))) & 7;
    q.neg = (h & 8u) != 0;
    q.d = h2f((u16)d16);
    return q;
}

// IQ4 formats: 4-bit codes into kvalues_iq4nl; lane's codes are the low (quarters 0, 1) or
// high (2, 3) nibbles of 8 consecutive bytes, as in Q4_0. lo/hi: int8 values per byte.
// block_iq4_nl {d; u8 qs[16]} (2-byte aligned): block 8g + L/4.
__device__ __forceinline__ float iq4nl_lane(const u8* row, int g, int lane, u32& lo, u32& hi) {
    const u8* b = row + (8 * g + (lane >> 2)) * 18;
    const int s = lane & 3, sh = (s >> 1) * 4;
    ld8_a2(b + 2 + 8 * (s & 1), lo, hi);
    lo = iq4nl_lut4((lo >> sh) & 0x0F0F0F0Fu);
    hi = iq4nl_lut4((hi >> sh) & 0x0F0F0F0Fu);
    return h2f(ld_u16(b));
}
// block_iq4_xs {d; u16 scales_h; u8 scales_l[4]; u8 qs[128]} (8-byte aligned): 6-bit scale
// ls = nibble ib & 1 of scales_l[ib / 2] | bits 2ib..2ib+1 of scales_h << 4, value = d (ls - 32) kv.
__device__ __forceinline__ float iq4xs_lane(const u8* row, int g, int lane, u32& lo, u32& hi, int& ls) {
    const u8* b = row + g * 136;
    const int ib = lane >> 2, s = lane & 3, sh = (s >> 1) * 4;
    ld8_a8(b + 8 + 16 * ib + 8 * (s & 1), lo, hi);
    lo = iq4nl_lut4((lo >> sh) & 0x0F0F0F0Fu);
    hi = iq4nl_lut4((hi >> sh) & 0x0F0F0F0Fu);
    ls = (((int)b[4 + (ib >> 1)] >> (4 * (ib & 1))) & 15) | ((((int)ld_u16(b + 2) >> (2 * ib)) & 3) << 4);
    return h2f(ld_u16(b));
}

// ---- deq8 ----
// dequantize_row_iq2_xxs / iq2_xs / iq2_s / iq3_xxs / iq3_s: y = db * grid * (+-1)
template <int T> __device__ __forceinline__ void deq8_grid(const u8* row, int g, int lane, float* v) {
    const IqGrid8 q = iq_grid8<T>(row, g, lane);
    float db;
    if constexpr (T == T_IQ3_S) db = q.d * (float)(1 + 2 * q.ls);
    else if constexpr (T == T_IQ3_XXS) db = q.d * (0.5f + (float)q.ls) * 0.5f;
    else db = q.d * (0.5f + (float)q.ls) * 0.25f;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const float p = db * (float)byte_of(q.lo, q.hi, k);
        v[k] = (q.sg >> k) & 1u ? -p : p;
    }
}
// dequantize_row_iq1_s / iq1_m: y = dl * (grid + delta), dl = d * (2 ls + 1)
template <int T> __device__ __forceinline__ void deq8_iq1(const u8* row, int g, int lane, float* v) {
    const Iq1Lane q = iq1_lane<T>(row, g, lane);
    const float dl = q.d * (float)(2 * q.ls + 1), delta = q.neg ? -0.125f : 0.125f;
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = dl * ((float)(i8)byte_of(q.lo, q.hi, k) + delta);
}

template <> __device__ __forceinline__ void deq8<T_IQ2_XXS>(const u8* row, int g, int lane, int K, float* v) { deq8_grid<T_IQ2_XXS>(row, g, lane, v); }
template <> __device__ __forceinline__ void deq8<T_IQ2_XS>(const u8* row, int g, int lane, int K, float* v) { deq8_grid<T_IQ2_XS>(row, g, lane, v); }
template <> __device__ __forceinline__ void deq8<T_IQ2_S>(const u8* row, int g, int lane, int K, float* v) { deq8_grid<T_IQ2_S>(row, g, lane, v); }
template <> __device__ __forceinline__ void deq8<T_IQ3_XXS>(const u8* row, int g, int lane, int K, float* v) { deq8_grid<T_IQ3_XXS>(row, g, lane, v); }
template <> __device__ __forceinline__ void deq8<T_IQ3_S>(const u8* row, int g, int lane, int K, float* v) { deq8_grid<T_IQ3_S>(row, g, lane, v); }
template <> __device__ __forceinline__ void deq8<T_IQ1_S>(const u8* row, int g, int lane, int K, float* v) { deq8_iq1<T_IQ1_S>(row, g, lane, v); }
template <> __device__ __forceinline__ void deq8<T_IQ1_M>(const u8* row, int g, int lane, int K, float* v) { deq8_iq1<T_IQ1_M>(row, g, lane, v); }
// dequantize_row_iq4_nl: y = d * kvalues_iq4nl[q]
template <> __device__ __forceinline__ void deq8<T_IQ4_NL>(const u8* row, int g, int lane, int K, float* v) {
    u32 lo, hi;
    const float d = iq4nl_lane(row, g, lane, lo, hi);
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = d * (float)(i8)byte_of(lo, hi, k);
}
// dequantize_row_iq4_xs: y = d * (ls - 32) * kvalues_iq4nl[q]
template <> __device__ __forceinline__ void deq8<T_IQ4_XS>(const u8* row, int g, int lane, int K, float* v) {
    u32 lo, hi;
    int ls;
    const float d = iq4xs_lane(row, g, lane, lo, hi, ls);  // sets ls: a statement of its own
    const float dl = d * (float)(ls - 32);
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = dl * (float)(i8)byte_of(lo, hi, k);
}
