// "Wide" row dot of the q16 GEMV (gemv.cu) for IQ4_XS: 8 lanes per 256-value super-block and
// 32 weights per lane, as kwide.cuh does for Q4_K/Q5_K/Q6_K (engine v7, compile-checked only).
//
// Why the per-8 path is slow (measured on the H200, docs/perf-notes.md "Kernels vs llama.cpp's
// own": the 27B's gate/up pair 2x[17408x5120] takes 128.45 us = 738 GB/s against 51.12 us for
// llama.cpp's kernel and 1596 GB/s for a wide Q4_K row):
//   - loads: per 8 weights a lane issues 4 global loads (iquants.cuh iq4xs_lane: 8 bytes of
//     qs, the byte scales_l[ib / 2], the u16 scales_h and the u16 d; the 4 lanes of a 32-value
//     sub-block re-read the same scale bytes), i.e. 16 per 32 weights, plus 2 loads of x (16
//     bytes of codes, the block scale) per 8 weights;
//   - those x loads were generic, not ld.shared (v7 reads x in row_dot_iq from the shared
//     array itself, so the narrow path now has shared loads): the I-quants run behind the __noinline__
//     row_dot_iq (gemv.cu; inlined, the 9 I-quant cases changed every kernel's register
//     allocation), which takes x as plain pointers, and every row pays a call (the caller's
//     live registers saved around it);
//   - a gate/up pair runs as two calls, one row after the other, so only one row's loads are
//     in flight at a time (the K-quants' row_dot2 interleaves both rows' loads);
//   - the codebook lookup is done per 4 codes (iq4nl_lut4: ~10 instructions per 4 weights).
// Here, per 32 weights, a lane issues 3 global loads (the 8-byte block header d | scales_h |
// scales_l, the same address for the 8 lanes of a super-block: one broadcast; 16 bytes of qs
// as two 8-byte loads, see alignment below) and 5 shared loads (4 x 16 bytes of codes, one
// block scale, explicit ld.shared at shared-window addresses: kwide.cuh XS); the rows are
// inlined into the GEMV kernels (gemv.cu row_dot_kq / row_dot2_kq, register table in
// docs/perf-notes.md v7) and a gate/up pair of two IQ4_XS matrices loads both rows' blocks
// before any arithmetic (row_dot2_wide_iq4); the lookup costs 8 byte permutes per 8 weights.
// Expected: IQ4_XS rows move like Q4_K's wide rows (Q4_K [10240x5120]: 1596 GB/s; 1.5B gate/up
// pair: 1663 GB/s): the 27B gate/up node 128 -> ~55-65 us (x2-2.3), i.e. x0.8-0.95 of
// llama.cpp's 51 us; not more, since the Q4_K wide rows with the same load pattern stop there.
//
// Lane L of a warp: grp = L >> 3 (super-block of the round), i = L & 7 owns sub-block i, i.e.
// values 32i .. 32i + 31 of the super-block = the 32-value x block 8 sb + i. kwide.cuh's lane
// mapping (Q4_K: runs 64j + 16h and +32, two sub-blocks and two x blocks) does not fit: in
// ggml's block_iq4_xs (dequantize_row_iq4_xs; gguf-py IQ4_XS.dequantize_blocks) sub-block ib
// is qs[16 ib .. 16 ib + 15], byte t holding value 32 ib + t in its low nibble and 32 ib + 16
// + t in its high nibble, both scaled by ls(ib). So a lane's 16 qs bytes give run A = values
// 32i + t (low nibbles, xq entries 4i and 4i + 1) and run B = 32i + 16 + t (high nibbles, xq
// entries 4i + 2 and 4i + 3), one scale ls(i) and one x block scale for both.
// Block layout (136 bytes): d (fp16) at 0, scales_h (u16) at 2, scales_l[4] at 4, qs[128] at 8;
// ls(i) = nibble i of scales_l (as a little-endian u32) | bits 2i, 2i + 1 of scales_h << 4;
// value = d (ls - 32) kvalues_iq4nl[code].
//
// Alignment: rows start 256-byte aligned (arena.py ALIGN) and blocks are 136 = 8 x 17 bytes, so
// a block is only 8-byte aligned and the lane's qs run (offset 8 + 16 i) is 16-byte aligned in
// every other block. A 16-byte load would need two code paths chosen per block; the 4 groups
// of a round take consecutive super-blocks (alternating parity), so a warp would diverge. The
// run is read as two 8-byte loads at every block (the same sectors; ops.py checks 8-byte
// alignment of IQ4_XS weights).
//
// Shared-memory banks: a lane reads xq entries e = 4i + o (o = 0..3) in 4 loads of 16 bytes;
// xq_slot(e) (kwide.cuh) = e ^ (bit 4 of e -> bit 0) ^ (bit 3 of e -> bit 2). In load o with
// plain order, slot mod 8 has bits (o0 ^ i2, o1, i0 ^ i1): only 4 distinct 16-byte bank groups
// for the 8 lanes of a quarter warp (2-way conflicts). So odd lanes take their runs in the
// other order (load o reads entry 4i + (o ^ 2 (i & 1)): run B first): slot bits (o0 ^ i2,
// o1 ^ i0, i0 ^ i1), a bijection of i for every o -> 8 distinct bank groups, conflict-free.
// The swap costs nothing: the last byte permute of the lookup (which separates the low- and
// high-nibble values) takes the lane's selector sel instead of a constant.
//
// Codebook lookup of one qs word w (8 codes: nibble 2n = low nibble of byte n, 2n + 1 the high
// one): with IQ4NL_K0..K3 the 16 int8 kvalues as 4 words (iq_tables.py), prmt(K0, K1, c) gives
// entries 0..7 and prmt(K2, K3, c) entries 8..15 for the 4 codes in c's low 16 bits (3-bit
// selectors: bit 3 of a prmt selector nibble would replicate the sign, so c = w & 0x77777777);
// a third prmt picks per byte by bit 3 of the code (selector n | 4 * bit 3). Done for the low
// and the high half of w this gives t0 = values of nibbles 0..3 (lo b0, hi b0, lo b1, hi b1),
// t1 = nibbles 4..7; prmt(t0, t1, 0x6420) are the 4 low-nibble values, 0x7531 the 4 high-nibble
// ones (llama.cpp's get_int_from_table_16 does the same). 8 prmt + 5 ALU per 8 weights.
//
// Integer ranges: |kvalues| <= 127, |xq| <= 32767 (q8_1: 127): a run's dot (16 products)
// < 2^26 and the lane's 32-product dot < 32 * 127 * 32767 < 2^27, exact in int32. The scale
// (ls - 32) in [-32, 31] times that could reach 2^32, so it is applied in fp32: float(dot)
// (rounded to 24 bits above 2^24, relative error <= 2^-24, as the Q4_K wide path's float(sc *
// dot)) times d (ls - 32) (exact: 11 x 6 bits) times the x block scale.
#pragma once
#include "kwide.cuh"

// IQ4_XIL (the default of gemv_kq.cu and gemv_tma.cu since session 11; ops GGUF_HARNESS_GEMV_IQ4_XIL=0
// builds them with IQ4_XIL=0; gemv.cu stages x in the natural order and sets 0 itself): x staged
// with each 32-value block's halves interleaved (xstage.cuh stage_xq IL: entry 4b + k holds values
// 4k, 4k + 16, 4k + 1, 4k + 17, .., 4k + 3, 4k + 19 of block b), so a qs word's two lookups t0, t1
// (values of nibbles 0-3 and 4-7: lo b0, hi b0, lo b1, hi b1 = values t, t + 16, t + 1, t + 17)
// are dp2a operands as they are: no separating prmt pair (2 of the 8 prmt per 8 weights), and odd
// lanes, which read their runs in the other order for the bank swizzle, swap their two 8-byte qs
// loads instead of the selector. The integer sums are the same products in another order (exact),
// so the results equal the default build's bit for bit.
#ifndef IQ4_XIL
#define IQ4_XIL 1
#endif
constexpr bool kIq4Xil = IQ4_XIL;

// prmt.b32 without mode: byte n of the result = byte (c >> 4n) & 7 of the pair (b:a); the
// caller keeps bit 3 of the 4 selector nibbles clear (it would replicate the byte's sign).
// (__byte_perm masks its selector with 0x7777 itself: one more instruction per call.)
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 c) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

// IQ4_KREG (gemv_kq.cu defines it 1, its default since session 14; ops GGUF_HARNESS_GEMV_IQ4_KREG=0
// builds it with 0; this header's default 0 keeps gemv.cu, gemv_tma.cu and gemv_mma.cu as they
// were; only the IQ4_XIL lookups, iq4_lut2, take the words): the lane holds codebook words K0 and
// K2 in registers for the whole row loop. Why: nvdisasm of the old
// gemvkq_swiglu_iq4_xs (59 registers) shows 27 of its 221 loop instructions to be
// `IMAD.U32 Rn, RZ, RZ, URk` re-making K0 / K2: a lookup `prmt(K0, K1, c)` compiles to
// PRMT Rd, Ra = K0, Rb = c, imm = K1 (one operand may be an immediate, the other must be a
// register), and ptxas writes Rd over a fresh copy of K0 each time rather than hold it. Words
// loaded from global memory (inline asm, opaque to ptxas; a shuffle of the constant was folded
// back into it) cannot be re-made from a constant, so ptxas keeps them: 2 registers, one 8-byte
// load per lane (the same address for every lane) per kernel. Same lookups, same values: bitwise
// the default's outputs.
#ifndef IQ4_KREG
#define IQ4_KREG 0
#endif
struct Iq4Book { u32 k0, k1, k2, k3; };
#if IQ4_KREG && IQ4_XIL
__device__ __align__(8) const u32 kIq4BookK02[2] = {IQ4NL_K0, IQ4NL_K2};
#endif
__device__ __forceinline__ Iq4Book iq4_book() {
#if IQ4_KREG && IQ4_XIL
    u32 k0, k2;
    asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];"
                 : "=r"(k0), "=r"(k2) : "l"(__cvta_generic_to_global(kIq4BookK02)));
    return {k0, IQ4NL_K1, k2, IQ4NL_K3};
#else
    return {IQ4NL_K0, IQ4NL_K1, IQ4NL_K2, IQ4NL_K3};
#endif
}

// kvalues_iq4nl of the 8 codes of qs word w: f = the values of the 4 low nibbles (sel =
// 0x6420) or of the 4 high nibbles (sel = 0x7531), s = the other 4.
__device__ __forceinline__ void iq4_lut8(u32 w, u32 sel, u32& f, u32& s) {
    const u32 c = w & 0x77777777u;
    const u32 h = ((w >> 1) & 0x44444444u) | 0x32103210u;
    const u32 t0 = prmt(prmt(IQ4NL_K0, IQ4NL_K1, c), prmt(IQ4NL_K2, IQ4NL_K3, c), h);
    const u32 t1 = prmt(prmt(IQ4NL_K0, IQ4NL_K1, c >> 16), prmt(IQ4NL_K2, IQ4NL_K3, c >> 16), h >> 16);
    f = prmt(t0, t1, sel);
    s = prmt(t0, t1, sel ^ 0x1111u);
}

// The two lookups of iq4_lut8 before its last step: t0 = kvalues of nibbles 0-3 of w, t1 of 4-7.
__device__ __forceinline__ void iq4_lut2(u32 w, u32& t0, u32& t1,
                                         const Iq4Book& k = {IQ4NL_K0, IQ4NL_K1, IQ4NL_K2, IQ4NL_K3}) {
    const u32 c = w & 0x77777777u;
    const u32 h = ((w >> 1) & 0x44444444u) | 0x32103210u;
    t0 = prmt(prmt(k.k0, k.k1, c), prmt(k.k2, k.k3, c), h);
    t1 = prmt(prmt(k.k0, k.k1, c >> 16), prmt(k.k2, k.k3, c >> 16), h >> 16);
}

// A lane's constants: shared-memory slots of its 4 xq entries in load order (first run, then
// second), the lookup selector of the first run, the shifts of its scale bits; the codebook
// words (constants unless IQ4_KREG).
struct WLaneIq4 { int p0, p1, p2, p3; u32 sel, shl, shh; Iq4Book kb; };
// %laneid through volatile asm: the row functions below derive their lane constants from it, so
// the compiler cannot hoist them out of gemv_body's row loop, where they would stay live across
// the non-inlined I-quant call and push kernels into spills (ptxas -v, docs/perf-notes.md v7).
__device__ __forceinline__ int laneid_v() {
    int l;
    asm volatile("mov.u32 %0, %%laneid;" : "=r"(l));
    return l;
}
__device__ __forceinline__ WLaneIq4 wide_lane_iq4(int i) {
    const int f = 2 * (i & 1);  // odd lanes: run B (high nibbles, entries 4i + 2, 4i + 3) first
    WLaneIq4 w;
    w.p0 = xq_slot(4 * i + f); w.p1 = xq_slot(4 * i + f + 1);
    w.p2 = xq_slot(4 * i + (f ^ 2)); w.p3 = xq_slot(4 * i + (f ^ 2) + 1);
    w.sel = f ? 0x7531u : 0x6420u;
    w.shl = 4 * i;       // nibble i of scales_l (bits 32.. of the header)
    w.shh = 16 + 2 * i;  // bits 2i, 2i + 1 of scales_h (bits 16.. of the header)
    w.kb = iq4_book();
    return w;
}

// The lane's activations for super-block sb: 8 + 8 codes of the first and second run and the
// 32-value block's scale (no code sums: IQ4_XS has no offset term).
struct WXIq4 { int4 f0, f1, s0, s1; float d; };
__device__ __forceinline__ WXIq4 wide_x_iq4(const XS& xa, int sb, int i, const WLaneIq4& w) {
    WXIq4 x;
    const u32 q = xa.q + 512 * sb;  // 32 int4 per super-block
    x.f0 = lds128(q + 16 * w.p0); x.f1 = lds128(q + 16 * w.p1);
    x.s0 = lds128(q + 16 * w.p2); x.s1 = lds128(q + 16 * w.p3);
    x.d = lds32f(xa.d + 32 * sb + 4 * i);  // block 8 sb + i
    return x;
}

// Raw registers of a lane's share of a block: header (d | scales_h << 16, scales_l[0..3]) and
// qs[16i .. 16i + 7], qs[16i + 8 .. 16i + 15].
struct WIq4 { uint2 h, a, b; };
__device__ __forceinline__ void wide_load_iq4(const u8* blk, int i, WIq4& r) {
    r.h = *(const uint2*)blk;
    const uint2* q = (const uint2*)(blk + 8 + 16 * i);  // 8-byte aligned (see the header)
    if constexpr (kIq4Xil) {  // odd lanes take their words 2, 3 first (wide_lane_iq4's load order)
        const int sw = i & 1;
        r.a = q[sw];
        r.b = q[sw ^ 1];
    } else {
        r.a = q[0];
        r.b = q[1];
    }
}

// dequantize_row_iq4_xs: y = d (ls - 32) kv. Lane's partial of one super-block, times the x
// block scale (the caller sums lanes).
__device__ __forceinline__ float wide_dot_iq4(const WIq4& r, const WXIq4& x, const WLaneIq4& w) {
    if constexpr (kIq4Xil) {  // word o of the (swapped) run against the lane's load o of x
        u32 t[8];
        iq4_lut2(r.a.x, t[0], t[1], w.kb);
        iq4_lut2(r.a.y, t[2], t[3], w.kb);
        iq4_lut2(r.b.x, t[4], t[5], w.kb);
        iq4_lut2(r.b.y, t[6], t[7], w.kb);
        const int tt = dot8c(x.s1, t[6], t[7], dot8c(x.s0, t[4], t[5], dot8c(x.f1, t[2], t[3], dot8c(x.f0, t[0], t[1], 0))));
        const int ls = (int)((r.h.y >> w.shl) & 15u) | (int)(((r.h.x >> w.shh) & 3u) << 4);
        const float dl = h2f((u16)(r.h.x & 0xffffu)) * (float)(ls - 32);
        return x.d * dl * (float)tt;
    }
    u32 f[4], s[4];
    iq4_lut8(r.a.x, w.sel, f[0], s[0]);
    iq4_lut8(r.a.y, w.sel, f[1], s[1]);
    iq4_lut8(r.b.x, w.sel, f[2], s[2]);
    iq4_lut8(r.b.y, w.sel, f[3], s[3]);
    const int tf = dot16(x.f0, x.f1, f[0], f[1], f[2], f[3]);
    const int ts = dot16(x.s0, x.s1, s[0], s[1], s[2], s[3]);
    const int ls = (int)((r.h.y >> w.shl) & 15u) | (int)(((r.h.x >> w.shh) & 3u) << 4);
    const float dl = h2f((u16)(r.h.x & 0xffffu)) * (float)(ls - 32);
    return x.d * dl * (float)(tf + ts);
}

// Lane's partial dot product of one IQ4_XS row (row_dot_wide's loop: super-blocks 4 g0 + grp +
// 4 gstep r, warp-uniform predicated rounds). `lane` is re-read as %laneid (laneid_v).
__device__ __forceinline__ float row_dot_wide_iq4(const u8* row, const XS& xa, int K, int lane, int g0,
                                                  int gstep) {
    lane = laneid_v();
    const int nsb = K >> 8, grp = lane >> 3, i = lane & 7;
    const WLaneIq4 w = wide_lane_iq4(i);
    float acc = 0.f;
#pragma unroll kWideUnroll
    for (int s0 = 4 * g0; s0 < nsb; s0 += 4 * gstep) {
        const int sb = s0 + grp;
        if (sb < nsb) {
            WIq4 r;
            wide_load_iq4(row + sb * Fmt<T_IQ4_XS>::TS, i, r);
            acc += wide_dot_iq4(r, wide_x_iq4(xa, sb, i, w), w);
        }
    }
    return acc;
}

// Gate and up rows, both IQ4_XS: both rows' blocks loaded before any arithmetic, x read once.
__device__ __forceinline__ float2 row_dot2_wide_iq4(const u8* r0, const u8* r1, const XS& xa, int K, int lane,
                                                    int g0, int gstep) {
    lane = laneid_v();
    const int nsb = K >> 8, grp = lane >> 3, i = lane & 7;
    const WLaneIq4 w = wide_lane_iq4(i);
    float a0 = 0.f, a1 = 0.f;
#pragma unroll kWide2Unroll
    for (int s0 = 4 * g0; s0 < nsb; s0 += 4 * gstep) {
        const int sb = s0 + grp;
        if (sb < nsb) {
            WIq4 b0, b1;
            wide_load_iq4(r0 + sb * Fmt<T_IQ4_XS>::TS, i, b0);
            wide_load_iq4(r1 + sb * Fmt<T_IQ4_XS>::TS, i, b1);
            const WXIq4 x = wide_x_iq4(xa, sb, i, w);
            a0 += wide_dot_iq4(b0, x, w);
            a1 += wide_dot_iq4(b1, x, w);
        }
    }
    return make_float2(a0, a1);
}
