// "Wide" row dot of the q16 GEMV (gemv.cu) for Q4_K, Q5_K and Q6_K: 8 lanes per 256-value
// super-block and 32 weights per lane, so one warp covers 4 super-blocks per round.
//
// Why: the per-8 path (qdot.cuh qdot8) issues ~6-10 small global loads (bytes, u16, u32,
// one u64) per 8 weights; here a lane issues per 32 weights
//   Q4_K: 2 loads  (16-byte block header: d, dmin, scales[12] -- the 8 lanes of a super-block
//                   read the same address, one broadcast; 16 bytes of qs)
//   Q5_K: 3 loads  (header, 16 bytes of qh, 16 bytes of qs)
//   Q6_K: 9 loads  (3 x 8 bytes for a 16-byte run of ql, 3 x 8 for one of qh: the block is
//                   only 2-byte aligned, the runs are realigned with funnel shifts; 2 int8
//                   scales and d)
// and 4 x 16 + 2 x 8 + 2 x 4 bytes of shared memory (x codes, code sums, block scales).
//
// Lane L of a warp: grp = L >> 3 (super-block of the round), i = L & 7. Each lane owns two
// runs of 16 consecutive values, A and B, each inside one 32-value block of x, so per run
// the activation is xq entries e, e + 1 (8 codes each), the sum of their 16 codes and one
// block scale (gemv.cu stage_xq); run values relative to the super-block:
//   Q4_K, Q5_K (ggml block_q4_K / block_q5_K, dequantize_row_q4_K / _q5_K): j = i >> 1,
//     h = i & 1; qs[32j + l] holds value 64j + l (low nibble, sub-block 2j) and 64j + 32 + l
//     (high nibble, sub-block 2j + 1); the lane's 16 qs bytes qs[16i .. 16i + 15] give
//     A = 64j + 16h + t (scale/min 2j) and B = A + 32 (scale/min 2j + 1), t = 0..15.
//     Q5_K: 5th bit of value 64j + l is bit 2j of qh[l], of 64j + 32 + l bit 2j + 1
//     (l = 16h + t: the lane's qh bytes are qh[16h .. 16h + 15]).
//   Q6_K (block_q6_K, dequantize_row_q6_K): n = i >> 2, k = i & 3; ql[64n + l] (l < 64)
//     holds value 128n + l in its low nibble and 128n + 64 + l in its high nibble, so the
//     lane's ql bytes ql[64n + 16k .. + 15] give A = 128n + 16k + t and B = A + 64, scales
//     scales[8n + k] and scales[8n + 4 + k]; the 2 high bits come from qh[32n + 16(k & 1) + t]
//     at shift 0 (A) / 4 (B) for k < 2 and 2 / 6 for k >= 2.
// Per run r = d * sc * dot(q, xq) - dmin * m * sum(xq) (Q4_K, Q5_K) or d * sc * (dot(q, xq) -
// 32 sum(xq)) (Q6_K), times the 32-value block's scale; integer parts are exact in int32
// (16 products: |sc dot| < 63 * 16 * 31 * 32767 < 2^31, |dot - 32 sum| <= 16 * 32 * 32767 < 2^24).
//
// Shared-memory banks: with this mapping the 8 lanes of a super-block read xq entries whose
// plain indices coincide mod 8 (Q4_K: 8j + 2h, 4-way bank conflicts per 16-byte load), so
// stage_xq stores entry e at xq_slot(e) (an XOR of its low bits with two higher ones): every
// 16-byte load of the wide path and of the per-8 path then hits 8 distinct 16-byte bank
// groups per quarter warp (wide: Q4_K/Q5_K slots 2h ^ o ^ F(j), Q6_K 2k ^ o ^ F(2n + B),
// o = 0, 1 the entry of the run, F = xq_slot's XOR mask, are 8 distinct values mod 8).
#pragma once
#include "qdot.cuh"

#ifndef WIDE_UNROLL
#define WIDE_UNROLL 2   // rounds (4 super-blocks per warp) whose loads are in flight together
#endif
#ifndef WIDE2_UNROLL
#define WIDE2_UNROLL 1  // the same for a gate/up pair (two rows' loads per round already)
#endif
constexpr int kWideUnroll = WIDE_UNROLL, kWide2Unroll = WIDE2_UNROLL;

// Slot of xq entry e in shared memory: bit 4 of e flips bit 0, bit 3 flips bit 2 (a
// permutation inside each aligned group of 8 entries, so 32-entry super-blocks stay put).
__device__ __forceinline__ int xq_slot(int e) { return e ^ (((e >> 4) & 1) | ((e >> 1) & 4)); }

// shf.r.wrap: bits s..s+31 of the 64-bit hi:lo (s < 32)
__device__ __forceinline__ u32 funnel_r(u32 lo, u32 hi, u32 s) {
    u32 r;
    asm("shf.r.wrap.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(lo), "r"(hi), "r"(s));
    return r;
}

// A lane's constants: first xq entries of its runs A and B inside a super-block (even) and
// the shared-memory slots of the 4 entries.
struct WLane { int ea, eb, pa0, pa1, pb0, pb1; };

template <int T> __device__ __forceinline__ WLane wide_lane(int i) {
    WLane w;
    if (T == T_Q6_K) { w.ea = 2 * (i + (i & 4)); w.eb = w.ea + 8; }  // values 128n+16k, +64
    else { w.ea = 8 * (i >> 1) + 2 * (i & 1); w.eb = w.ea + 4; }  // values 64j+16h, +32
    w.pa0 = xq_slot(w.ea); w.pa1 = xq_slot(w.ea + 1);
    w.pb0 = xq_slot(w.eb); w.pb1 = xq_slot(w.eb + 1);
    return w;
}

// The lane's activations for super-block sb: 8 + 8 codes of each run, their sums, the scales.
struct WX { int4 a0, a1, b0, b1; int sa, sb; float da, db; };

// Shared-memory loads at shared-window addresses (explicit ld.shared: with plain pointers
// nvcc 13 allocated registers worse, e.g. 12-byte spills in the w8_b8 kernels).
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
__device__ __forceinline__ int4 lds128(u32 a) {
    int4 v;
    asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
    return v;
}
__device__ __forceinline__ int2 lds64(u32 a) {
    int2 v;
    asm volatile("ld.shared.v2.s32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(a));
    return v;
}
__device__ __forceinline__ float lds32f(u32 a) {
    float v;
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(a));
    return v;
}
// The staged x (gemv.cu stage_xq) as shared-window addresses of xq, xs, xd. Read only after
// stage_xq's barriers (the volatile loads stay in program order after them).
struct XS { u32 q, s, d; };
__device__ __forceinline__ XS xs_addr(const int4* xq, const int* xs, const float* xd) {
    return XS{smem_addr(xq), smem_addr(xs), smem_addr(xd)};
}

__device__ __forceinline__ WX wide_x(const XS& xa, int sb, const WLane& w) {
    WX x;
    const u32 q = xa.q + 512 * sb, s = xa.s + 128 * sb, d = xa.d + 32 * sb;  // 32 int4, 32 int, 8 float
    x.a0 = lds128(q + 16 * w.pa0); x.a1 = lds128(q + 16 * w.pa1);
    x.b0 = lds128(q + 16 * w.pb0); x.b1 = lds128(q + 16 * w.pb1);
    const int2 sa = lds64(s + 4 * w.ea), sbb = lds64(s + 4 * w.eb);  // ea, eb even: 8-byte aligned
    x.sa = sa.x + sa.y;
    x.sb = sbb.x + sbb.y;
    x.da = lds32f(d + 4 * (w.ea >> 2));
    x.db = lds32f(d + 4 * (w.eb >> 2));
    return x;
}

// XLANE (gemv_kq.cu's default since session 13, KQ_XLANE 1; ops GGUF_HARNESS_GEMV_KQ_XLANE=0 for the
// old staging): x staged lane-major
// for the 8-lane Q4_K / Q5_K (XL = 1) and Q6_K (XL = 2) rows. Why (SASS of the default
// gemvkq_store_q4_k, session 13): ~35 of the unrolled loop's 198 instructions (2 rounds) re-derive
// the lane's 4 xq slot addresses and its xs / xd offsets from the lane index every iteration
// (ptxas rematerialises them under the 64-register cap), and the x reads are 4 LDS.128 + 2 LDS.64
// + 2 LDS per round. Here super-block sb's x is 8 lane records of 80 bytes at 640 sb + 80 i:
// entries ea, ea + 1, eb, eb + 1 (wide_lane's runs A and B), then {sum of run A's 16 codes, sum
// of run B's, scale of A's 32-value block, scale of B's} (xstage.cuh stage_xq writes them): one
// base address and 5 LDS.128 at immediate offsets. Bank groups: the 8 lanes' records start at
// 16-byte slot 5 i mod 8 = 0, 5, 2, 7, 4, 1, 6, 3, distinct, so each of the 5 loads is
// conflict-free. Same bytes as 4 xq entries + 2 xs pairs per lane (2.5 bytes per value: the
// records take exactly the default's xq + xs space; xd stays natural for F32 rows). The values
// and the arithmetic are the default's, so the results are bitwise equal (a GPU test).
// Entry e of a super-block (0..31) -> (lane, position in its record): XL 1 runs at 64 j + 16 h
// and + 32 (e = 8 j + 2 h + {0, 1}, + 4), XL 2 at 128 n + 16 k and + 64 (e = 16 n + 2 k + {0, 1}, + 8).
template <int XL> __device__ __forceinline__ int xl_lane(int e) {
    return XL == 1 ? 2 * (e >> 3) + ((e >> 1) & 1) : 4 * (e >> 4) + ((e >> 1) & 3);
}
template <int XL> __device__ __forceinline__ int xl_pos(int e) {
    return XL == 1 ? (e & 1) + 2 * ((e >> 2) & 1) : (e & 1) + 2 * ((e >> 3) & 1);
}
// The inverse: the entry at position `pos` of lane record `lane` (XL 1: e = 8 (lane >> 1) +
// 4 (pos >> 1) + 2 (lane & 1) + (pos & 1); XL 2: e = 16 (lane >> 2) + 8 (pos >> 1) + 2 (lane & 3) +
// (pos & 1)).
template <int XL> __device__ __forceinline__ int xl_entry(int lane, int pos) {
    return XL == 1 ? 8 * (lane >> 1) + 4 * (pos >> 1) + 2 * (lane & 1) + (pos & 1)
                   : 16 * (lane >> 2) + 8 * (pos >> 1) + 2 * (lane & 3) + (pos & 1);
}
// int4 index of natural entry c (values 8c .. 8c + 7) in the XL layout; its lane record's
// fifth int4 (xl_slot(c) - pos + 4) holds the record's sums and scales
template <int XL> __device__ __forceinline__ int xl_slot(int c) {
    return 40 * (c >> 5) + 5 * xl_lane<XL>(c & 31) + xl_pos<XL>(c & 31);
}
__device__ __forceinline__ WX wide_x_lane(const XS& xa, int sb, int i) {
    const u32 b = xa.q + 640 * sb + 80 * i;
    WX x;
    x.a0 = lds128(b);
    x.a1 = lds128(b + 16);
    x.b0 = lds128(b + 32);
    x.b1 = lds128(b + 48);
    const int4 m = lds128(b + 64);
    x.sa = m.x;
    x.sb = m.y;
    x.da = __int_as_float(m.z);
    x.db = __int_as_float(m.w);
    return x;
}

// dot8 with an accumulator: the two halves of a 16-value run chain into one dp2a sequence.
__device__ __forceinline__ int dot8c(const int4& x, u32 lo, u32 hi, int c) {
    c = dp2a_lo(x.x, lo, c);
    c = dp2a_hi(x.y, lo, c);
    c = dp2a_lo(x.z, hi, c);
    return dp2a_hi(x.w, hi, c);
}
// 16 codes (4 words of 4 bytes) of one run against its two xq entries
__device__ __forceinline__ int dot16(const int4& x0, const int4& x1, u32 w0, u32 w1, u32 w2, u32 w3) {
    return dot8c(x1, w2, w3, dot8c(x0, w0, w1, 0));
}

// Raw registers of one lane's share of a super-block (loaded for every row of a row_dot2
// before any arithmetic).
template <int T> struct WBlk;
template <> struct WBlk<T_Q4_K> { uint4 h, q; };
template <> struct WBlk<T_Q5_K> { uint4 h, qh, q; };
template <> struct WBlk<T_Q6_K> { uint2 l[3], hb[3]; int sa, sb; u16 d; u32 o; };

template <int T> __device__ __forceinline__ void wide_load(const u8* b, int i, WBlk<T>& r);
// Q4_K: d, dmin, scales[12] at 0 (16 bytes, 16-byte aligned: 144-byte blocks, rows 256-byte
// aligned, arena.py ALIGN), qs[128] at 16
template <> __device__ __forceinline__ void wide_load<T_Q4_K>(const u8* b, int i, WBlk<T_Q4_K>& r) {
    r.h = *(const uint4*)b;
    r.q = *(const uint4*)(b + 16 + 16 * i);
}
// Q5_K: header at 0, qh[32] at 16, qs[128] at 48 (176-byte blocks: 16-byte aligned)
template <> __device__ __forceinline__ void wide_load<T_Q5_K>(const u8* b, int i, WBlk<T_Q5_K>& r) {
    r.h = *(const uint4*)b;
    r.qh = *(const uint4*)(b + 16 + 16 * (i & 1));
    r.q = *(const uint4*)(b + 48 + 16 * i);
}
// Q6_K: ql[128] at 0, qh[64] at 128, int8 scales[16] at 192, d at 208 (210-byte blocks:
// 2-byte aligned). A 16-byte run at p is covered by the 3 aligned 8-byte words from p & ~7
// (never past the block: the qh run ends at most at byte 200); ql and qh runs share p & 7.
template <> __device__ __forceinline__ void wide_load<T_Q6_K>(const u8* b, int i, WBlk<T_Q6_K>& r) {
    const int n = i >> 2, k = i & 3;
    const u8* pl = b + 64 * n + 16 * k;
    const uint2* al = (const uint2*)((size_t)pl & ~(size_t)7);
    const uint2* ah = (const uint2*)((size_t)(b + 128 + 32 * n + 16 * (k & 1)) & ~(size_t)7);
    r.l[0] = al[0]; r.l[1] = al[1]; r.l[2] = al[2];
    r.hb[0] = ah[0]; r.hb[1] = ah[1]; r.hb[2] = ah[2];
    r.sa = (i8)b[192 + 8 * n + k];
    r.sb = (i8)b[196 + 8 * n + k];
    r.d = ld_u16(b + 208);
    r.o = (u32)(size_t)pl & 7u;
}

// get_scale_min_k4 for the sub-block pair (2j, 2j + 1) from header words y, z, w (scale
// bytes 0-3, 4-7, 8-11): for s < 4 scale = byte s of y & 63, min = byte s of z & 63; for
// s >= 4 scale = low nibble of byte s-4 of w | top 2 bits of byte s-4 of y << 4, min = high
// nibble of w's byte | top 2 bits of z's byte << 4. Both bytes at once (16-bit pairs).
__device__ __forceinline__ void scale_min_k4_pair(u32 y, u32 z, u32 w, int j, int& sa, int& sb,
                                                  int& ma, int& mb) {
    const u32 sh = 16 * (j & 1);
    y >>= sh; z >>= sh; w >>= sh;
    const u32 sc = j < 2 ? (y & 0x3f3fu) : ((w & 0x0f0fu) | ((y >> 2) & 0x3030u));
    const u32 m = j < 2 ? (z & 0x3f3fu) : (((w >> 4) & 0x0f0fu) | ((z >> 2) & 0x3030u));
    sa = sc & 0xff; sb = sc >> 8;
    ma = m & 0xff; mb = m >> 8;
}

// Lane's partial of one super-block (times the block scales of x; the caller sums lanes and
// applies the row scale).
template <int T> __device__ __forceinline__ float wide_dot(const WBlk<T>& r, const WX& x, int i);

// dequantize_row_q4_K: y = d sc q - dmin m
template <> __device__ __forceinline__ float wide_dot<T_Q4_K>(const WBlk<T_Q4_K>& r, const WX& x, int i) {
    int sa, sb, ma, mb;
    scale_min_k4_pair(r.h.y, r.h.z, r.h.w, i >> 1, sa, sb, ma, mb);
    const int ta = dot16(x.a0, x.a1, r.q.x & NIB, r.q.y & NIB, r.q.z & NIB, r.q.w & NIB);
    const int tb = dot16(x.b0, x.b1, (r.q.x >> 4) & NIB, (r.q.y >> 4) & NIB, (r.q.z >> 4) & NIB,
                         (r.q.w >> 4) & NIB);
    const float d = h2f((u16)(r.h.x & 0xffff)), dmin = h2f((u16)(r.h.x >> 16));
    const float ya = d * (float)(sa * ta) - dmin * (float)(ma * x.sa);
    const float yb = d * (float)(sb * tb) - dmin * (float)(mb * x.sb);
    return fmaf(x.da, ya, x.db * yb);
}

// dequantize_row_q5_K: as Q4_K with the 5th bit (bit 2j of qh[l] for run A, 2j + 1 for B)
template <> __device__ __forceinline__ float wide_dot<T_Q5_K>(const WBlk<T_Q5_K>& r, const WX& x, int i) {
    const int j = i >> 1;
    int sa, sb, ma, mb;
    scale_min_k4_pair(r.h.y, r.h.z, r.h.w, j, sa, sb, ma, mb);
    const u32 q[4] = {r.q.x, r.q.y, r.q.z, r.q.w}, qh[4] = {r.qh.x, r.qh.y, r.qh.z, r.qh.w};
    u32 lo[4], hi[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const u32 t = qh[k] >> (2 * j);
        lo[k] = (q[k] & NIB) | ((t & 0x01010101u) << 4);
        hi[k] = ((q[k] >> 4) & NIB) | ((t << 3) & 0x10101010u);
    }
    const int ta = dot16(x.a0, x.a1, lo[0], lo[1], lo[2], lo[3]);
    const int tb = dot16(x.b0, x.b1, hi[0], hi[1], hi[2], hi[3]);
    const float d = h2f((u16)(r.h.x & 0xffff)), dmin = h2f((u16)(r.h.x >> 16));
    const float ya = d * (float)(sa * ta) - dmin * (float)(ma * x.sa);
    const float yb = d * (float)(sb * tb) - dmin * (float)(mb * x.sb);
    return fmaf(x.da, ya, x.db * yb);
}

// 16 bytes at byte offset o (even, < 8) of the 3 aligned 8-byte words w
__device__ __forceinline__ void realign16(const uint2* w, u32 o, u32* out) {
    const bool up = o & 4u;  // start in the second word
    const u32 s = 8u * (o & 3u);
    const u32 a[6] = {w[0].x, w[0].y, w[1].x, w[1].y, w[2].x, w[2].y};
    u32 u[5];
#pragma unroll
    for (int k = 0; k < 5; ++k) u[k] = up ? a[k + 1] : a[k];
#pragma unroll
    for (int k = 0; k < 4; ++k) out[k] = funnel_r(u[k], u[k + 1], s);
}

// dequantize_row_q6_K: y = d sc (q - 32), q = 4 low bits | 2 high bits << 4
template <> __device__ __forceinline__ float wide_dot<T_Q6_K>(const WBlk<T_Q6_K>& r, const WX& x, int i) {
    u32 ql[4], qh[4], lo[4], hi[4];
    realign16(r.l, r.o, ql);
    realign16(r.hb, r.o, qh);
    const u32 sha = 2 * ((i & 3) >> 1);  // high bits of run A at shift 0 or 2, of B at 4 or 6
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        lo[k] = (ql[k] & NIB) | ((qh[k] << (4 - sha)) & 0x30303030u);
        hi[k] = ((ql[k] >> 4) & NIB) | ((qh[k] >> sha) & 0x30303030u);
    }
    const int ta = dot16(x.a0, x.a1, lo[0], lo[1], lo[2], lo[3]) - 32 * x.sa;
    const int tb = dot16(x.b0, x.b1, hi[0], hi[1], hi[2], hi[3]) - 32 * x.sb;
    const float d = h2f(r.d);
    return fmaf(x.da * (d * (float)r.sa), (float)ta, x.db * (d * (float)r.sb) * (float)tb);
}

// Lane's partial dot product of one row with the staged x: super-blocks 4 g0 + grp + 4 gstep r
// (g0 = warp of the row, gstep = warps per row). The round loop is warp-uniform and its body
// predicated (no early exit), so it unrolls and several rounds' loads are in flight.
template <int T> __device__ __forceinline__ float row_dot_wide(const u8* row, const XS& xa, int K, int lane,
                                                               int g0, int gstep) {
    const int nsb = K >> 8, grp = lane >> 3, i = lane & 7;  // K-quant rows: whole super-blocks
    const WLane w = wide_lane<T>(i);
    float acc = 0.f;
#pragma unroll kWideUnroll
    for (int s0 = 4 * g0; s0 < nsb; s0 += 4 * gstep) {
        const int sb = s0 + grp;
        if (sb < nsb) {
            WBlk<T> r;
            wide_load<T>(row + sb * Fmt<T>::TS, i, r);
            acc += wide_dot<T>(r, wide_x(xa, sb, w), i);
        }
    }
    return acc;
}

// Gate and up rows of the same type: both rows' blocks are loaded before any arithmetic, and
// the activations are read once for both.
template <int T> __device__ __forceinline__ float2 row_dot2_wide(const u8* r0, const u8* r1, const XS& xa,
                                                                 int K, int lane, int g0, int gstep) {
    const int nsb = K >> 8, grp = lane >> 3, i = lane & 7;
    const WLane w = wide_lane<T>(i);
    float a0 = 0.f, a1 = 0.f;
#pragma unroll kWide2Unroll
    for (int s0 = 4 * g0; s0 < nsb; s0 += 4 * gstep) {
        const int sb = s0 + grp;
        if (sb < nsb) {
            WBlk<T> b0, b1;
            wide_load<T>(r0 + sb * Fmt<T>::TS, i, b0);
            wide_load<T>(r1 + sb * Fmt<T>::TS, i, b1);
            const WX x = wide_x(xa, sb, w);
            a0 += wide_dot<T>(b0, x, i);
            a1 += wide_dot<T>(b1, x, i);
        }
    }
    return make_float2(a0, a1);
}
