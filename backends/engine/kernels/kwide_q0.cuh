// Engine v9 rows of the 32-value formats Q8_0 and Q4_0 (gemv_kq.cu, KQ<T_Q8_0> / KQ<T_Q4_0> in
// kq_traits.cuh; ops.GEMV_KQ_Q0). Formats (ggml-common.h block_q8_0 / block_q4_0,
// ggml-quants.c dequantize_row_q8_0 / _q4_0):
//   Q8_0: fp16 d, int8 qs[32]              (34 bytes)  y[j] = d qs[j]
//   Q4_0: fp16 d, qs[16] (two nibbles each) (18 bytes)  y[j] = d ((qs[j] & 15) - 8),
//                                                        y[j + 16] = d ((qs[j] >> 4) - 8)
// A v9 "super-block" here is 8 consecutive blocks (256 values: 272 / 144 bytes; 16-byte aligned
// in rows of K % 256 == 0 whose matrix starts 16-byte aligned, ops.KV9_ALIGN). Lane i of its 8
// takes block i whole: 32 weights, one fp16 scale, x entries 4i .. 4i + 3 (one x block scale),
// so the dot of a lane is one exact int32 sum and one float epilogue per 32 weights, against
// gemv.cu's per-8 loop (qdot8: 8 weights, a u16 scale load and 2-byte loads per lane).
//
// Loads: block i starts at byte 34 i = 32 i + 2 i (Q8_0) or 18 i = 16 i + 2 i (Q4_0) of the
// group, 2 i < 16, so the 16-byte aligned chunks from 32 i (Q8_0: 3 chunks, the block ends at
// 32 i + 2 i + 33 <= 32 i + 47) or 16 i (Q4_0: 2 chunks, ends at 16 i + 2 i + 17 <= 16 i + 31)
// cover it and never leave the group. In those words v[]: d is half (i & 1) of word m = i >> 1,
// and qs start at byte 2 i + 2: word m + 1 for odd i, the upper half of word m for even i.
// q0_window selects the words v[m ..] (two levels of selects on the bits of m, no local
// memory), then qs word j = shf.r.clamp(W[j], W[j + 1], 16 or 32) (a shift of 32 gives W[j + 1]).
//
// Ranges: Q8_0 |dot| <= 32 * 128 * 32767 < 2^27 (int32 exact; its float conversion rounds at
// 2^-24 relative, as gemv.cu's); Q4_0 |dot - 8 sum| <= 32 * 8 * 32767 < 2^24 (exact in float).
//
// Shared-memory banks: the 8 lanes of a group read entries 4 i + o, whose xq_slot values fall on
// only 4 distinct 16-byte bank groups (2-way conflicts per quarter warp). Q4_0 lanes with
// i & 2 read their entries in the order o ^ 2 (the high nibbles first, a lane-constant shift
// swaps lo and hi), which makes the 8 slots distinct; Q8_0 keeps the conflict (its qs words
// would need 8 selects to swap, and it reads twice the weight bytes per x byte).
#pragma once
#include "kwide.cuh"

// shf.r.clamp.b32: bits s..s+31 of the 64-bit hi:lo, s clamped to 32 (s = 32 gives hi)
__device__ __forceinline__ u32 funnel_rc(u32 lo, u32 hi, u32 s) {
    u32 r;
    asm("shf.r.clamp.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(lo), "r"(hi), "r"(s));
    return r;
}

// W[k] = v[m + k] for k < NW, m = 0..3, by selects on bit 1 then bit 0 of m.
template <int NW, int NV> __device__ __forceinline__ void q0_window(const u32 (&v)[NV], int m, u32 (&w)[NW]) {
    static_assert(NW + 3 <= NV, "the window starts at most 3 words in");
    u32 u[NW + 1];
#pragma unroll
    for (int k = 0; k <= NW; ++k) u[k] = (m & 2) ? v[k + 2] : v[k];
#pragma unroll
    for (int k = 0; k < NW; ++k) w[k] = (m & 1) ? u[k + 1] : u[k];
}

// A lane's constants: byte offsets (in a super-block's 512 bytes of xq) of its 4 x entries in
// the order the dot reads them, the qs realignment shift, the window start m = i >> 1 and
// (Q4_0) the nibble shift of the first two entries (0: low nibbles first, 4: high first).
struct WLaneQ0 { u32 p0, p1, p2, p3, sh; int m, ns; };

template <int T> __device__ __forceinline__ WLaneQ0 wide_lane_q0(int i) {
    const int r = T == T_Q4_0 ? (i & 2) : 0;  // entry order o ^ r (see the bank note above)
    WLaneQ0 w;
    w.p0 = 16 * xq_slot(4 * i + (0 ^ r));
    w.p1 = 16 * xq_slot(4 * i + (1 ^ r));
    w.p2 = 16 * xq_slot(4 * i + (2 ^ r));
    w.p3 = 16 * xq_slot(4 * i + (3 ^ r));
    w.sh = 16 + 16 * (i & 1);
    w.m = i >> 1;
    w.ns = r ? 4 : 0;
    return w;
}

// The lane's x: its 4 entries (in the lane's order), the sum of their 32 codes (Q4_0's offset
// term) and the x block scale.
struct WXQ0 { int4 a, b, c, e; int s; float d; };

template <int T> __device__ __forceinline__ WXQ0 wide_x_q0(const XS& xa, int sb, int i, const WLaneQ0& w) {
    WXQ0 x;
    const u32 q = xa.q + 512 * sb;
    x.a = lds128(q + w.p0);
    x.b = lds128(q + w.p1);
    x.c = lds128(q + w.p2);
    x.e = lds128(q + w.p3);
    if constexpr (T == T_Q4_0) {  // xs: one int per entry, entries 4i..4i+3 16-byte aligned
        const int4 s = lds128(xa.s + 128 * sb + 16 * i);
        x.s = (s.x + s.y) + (s.z + s.w);
    } else {
        x.s = 0;
    }
    x.d = lds32f(xa.d + 32 * sb + 4 * i);
    return x;
}

// The lane's raw chunks: 3 (Q8_0) or 2 (Q4_0) aligned 16-byte loads.
template <int T> struct WQ0 { uint4 c[T == T_Q8_0 ? 3 : 2]; };

template <int T> __device__ __forceinline__ void wide_load_q0(const u8* b, int i, WQ0<T>& r) {
    const uint4* p = (const uint4*)(b + (T == T_Q8_0 ? 32 : 16) * i);
#pragma unroll
    for (int k = 0; k < (T == T_Q8_0 ? 3 : 2); ++k) r.c[k] = p[k];
}

// Lane's partial of one group: x block scale * d * (integer dot of the block), the caller sums
// lanes and applies the row scale.
template <int T> __device__ __forceinline__ float wide_dot_q0(const WQ0<T>& r, const WXQ0& x, const WLaneQ0& w) {
    constexpr int NC = T == T_Q8_0 ? 3 : 2, NW = T == T_Q8_0 ? 9 : 5;
    u32 v[4 * NC], W[NW];
#pragma unroll
    for (int k = 0; k < NC; ++k) {
        v[4 * k] = r.c[k].x; v[4 * k + 1] = r.c[k].y; v[4 * k + 2] = r.c[k].z; v[4 * k + 3] = r.c[k].w;
    }
    q0_window(v, w.m, W);
    const float d = h2f((u16)funnel_rc(W[0], 0u, w.sh - 16));  // half (i & 1) of word m
    u32 q[NW - 1];
#pragma unroll
    for (int j = 0; j < NW - 1; ++j) q[j] = funnel_rc(W[j], W[j + 1], w.sh);
    int t;
    if constexpr (T == T_Q8_0) {  // entries 0..3 = qs words (0, 1), (2, 3), (4, 5), (6, 7)
        t = dot8c(x.a, q[0], q[1], 0);
        t = dot8c(x.b, q[2], q[3], t);
        t = dot8c(x.c, q[4], q[5], t);
        t = dot8c(x.e, q[6], q[7], t);
    } else {  // entries 0, 1: low nibbles of words (0, 1), (2, 3); entries 2, 3: high nibbles;
              // a lane with ns = 4 reads entries 2, 3, 0, 1 (wide_lane_q0), so high first
        const u32 nf = w.ns, ns = 4 - w.ns;
        t = dot8c(x.a, (q[0] >> nf) & NIB, (q[1] >> nf) & NIB, 0);
        t = dot8c(x.b, (q[2] >> nf) & NIB, (q[3] >> nf) & NIB, t);
        t = dot8c(x.c, (q[0] >> ns) & NIB, (q[1] >> ns) & NIB, t);
        t = dot8c(x.e, (q[2] >> ns) & NIB, (q[3] >> ns) & NIB, t);
        t -= 8 * x.s;
    }
    return x.d * (d * (float)t);
}
