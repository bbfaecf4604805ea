// Engine v9 rows for IQ3_S (gemv_kq.cu KQ<T_IQ3_S>): 8 lanes per 256-value super-block, 32
// weights per lane, exact int32 dp2a sums against the staged int16 codes, as kwide.cuh /
// kwide_iq4.cuh do for Q4_K..IQ4_XS. Checked on the CPU (NVRTC, a numpy model of the lane:
// tests/test_kwide_iq3s_model.py) and on the H200 (GPU tests, the kernel table; session 9 on).
//
// Why (docs/perf-notes.md session 8): IQ3_S nodes run gemv.cu's generic I-quant loop (iquants.cuh
// iq_grid8 + iqdot.cuh qdot8_grid: 8 weights per call, 5 small global loads per 8 weights plus
// two grid loads, behind the non-inlined row_dot_iq): [5120x17408] 52.5 us against 35.5 for
// llama.cpp's kernel, and the 27B's IQ3_S gate/up pair 2x[17408x5120] 103 us per node (744 GB/s,
// 10 % of the decode step).
//
// Format (ggml-common.h block_iq3_s, 110 bytes; formulas: ggml/src/ggml-quants.c
// dequantize_row_iq3_s, gguf-py gguf/quants.py IQ3_S.dequantize_blocks, the project's oracle;
// ggml/src/ggml-cuda/vecdotq.cuh vec_dot_iq3_s_q8_1 gives a lane the same 32 values):
//   d (fp16) at 0, qs[64] at 2, qh[8] at 66, signs[32] at 74, scales[4] at 106.
// Sub-block ib (values 32 ib .. 32 ib + 31): grid indices m = 0..7, index m = qs[8 ib + m] |
// bit m of qh[ib] << 8, selects iq3s_grid word (4 unsigned bytes, each one of 1, 3, .., 15) for
// values 32 ib + 4m .. + 3; value 32 ib + 8l + j (l < 4, j < 8) is negated when bit j of
// signs[4 ib + l] is set; the scale is db = d (1 + 2 sc), sc = nibble ib & 1 of
// scales[ib / 2]. Lane i of a super-block's 8 lanes owns sub-block i: 8 qs bytes, one qh byte,
// 4 sign bytes, one scale nibble, and the x block 8 sb + i (xq entries 4i .. 4i + 3; entry
// 4i + e holds values 8e .. 8e + 7 = grid indices 2e, 2e + 1 and sign byte e).
//
// Per lane and super-block: 7 global loads (the qs run as two aligned 8-byte words, the 4 sign
// bytes as two u16, the qh byte, the scale byte, d), 5 shared loads of x (4 x 16 bytes of codes
// and the block scale) and 8 grid lookups (shared memory, see below); 16 dp2a.
//
// Signs for free in the arithmetic: every grid byte g is odd, so with M = 0xff in the bytes to
// negate (0 elsewhere) (g ^ M) | 1 is g or ~g | 1 = -g - 1 | 1 = -g (int8): one LOP3 per 4
// weights instead of xor + add of a carry-free "one" (iqdot.cuh apply_signs4). M itself: for a
// sign byte S (bits 0..7), S * 0x08040201 places bit 7 - j at the top of byte j (the partial
// products k + 9j' never collide for k < 9, so no carries), S * 0x80402010 bit 3 - j; a byte
// permute with the sign-replicate flag (selector nibble | 8, kwide_iq4.cuh prmt) then spreads
// those top bits over bytes 3..0: 2 IMAD + 2 PRMT + 1 byte extract per 8 weights.
//
// Grid indices two at a time: H = ((qh >> 0 or 4) & 0x7f) * (1 + 2^7 + 2^14 + 2^21) has bit n
// of the nibble at bit 0 of byte n (partial products k + 7j never collide for k < 7: no carries;
// the other bits are garbage), prmt(qs word, H, 0x5140 / 0x7362) puts (qs byte, H byte) of index
// 2e in the low and of 2e + 1 in the high 16 bits, and one shift + mask (+ the copy offset: one
// LOP3) gives both byte offsets into the table (the mask keeps the 9 index bits).
//
// The grid table: module.py prefixes iq_tables.py's header, where iq3s_grid is a `static
// __device__ const` array, i.e. global memory read through L1 (iqdot.cuh's path and llama.cpp's
// vec_dot_iq3_s_q8_1 read it so). A warp's lookup gathers 32 random words of its 2 KiB: up to 16
// different 128-byte lines per request. In shared memory the same gather costs as many
// wavefronts as the most distinct words in one bank: 3.3 on average for 32 random indices
// (a numpy count; x's 16-byte loads take 4 each, conflict-free). Estimate per warp and
// round of 4 super-blocks (440 bytes): x codes 4 x 4 + block scales 1 + grid 8 x 3.3 = 44
// shared-memory wavefronts, i.e. at one wavefront per clock and SM (132 SMs, 1.98 GHz) 2.6 TB/s
// before the global loads' own L1 wavefronts: the L1/shared pipe, not DRAM, is the likely limit
// (to be checked with ncu: l1tex data-pipe wavefronts). So the table is copied into shared
// memory once per block (before the PDL wait; stage_xq's barriers publish it), KQ_IQ3S_GRID
// copies of every word interleaved: lane L reads copy L % copies, so 16 copies bound a lookup at
// 2 wavefronts (32 KiB per block; 2, 4, 8 copies gain nothing: 3.3-3.4). 32 copies (1 wavefront)
// need 64 KiB, over the 48 KiB a static __shared__ array may take (NVRTC fails), so they live in
// the dynamic allocation (KQ_IQ3S_GRID=32 below, an A/B). KQ_IQ3S_GRID 0 reads the global table
// instead (__ldg; SASS: 2 more integer ops per lookup for the 64-bit address). Default 16 since
// session 20 (was 1): in the 27B decode step (H200, c = 2048, bench nodes, three same-start pairs)
// the IQ3_S gate/up pairs went -12.6 to -13.3 % (362 -> 315 us per step over 8 nodes), where the
// kernel table's single [5120x17408] store had shown only -3 % (session 9). 32 KiB of static
// shared memory per block (+2.625 K bytes of x, ~1.4 KiB more static and reserved): two 16-warp
// blocks per SM up to K ~ 31000. 16
// copies need the array 16-byte aligned (iq3s_grid_setup's uint4 stores): without __align__ the
// build faulted with a misaligned address once the kernel's other static arrays moved it (session
// 20). 0, 1, 2, 4, 8 stay an A/B (ops.py GEMV_KQ_IQ3S_GRID).
//
// Alignment: rows start 256-byte aligned (arena.py ALIGN), blocks are 110 = 2 x 55 bytes, so a
// block is only 2-byte aligned and the lane's qs run (offset 2 + 8i) starts at byte o = (block +
// 2) & 7 (even) of an 8-byte word. Narrow loads would take 4 u16 loads for it (the per-8 path's
// ld8_a2); here the two aligned 8-byte words from run - o are realigned with funnel shifts (o
// even: shifts of 0 or 16), as kwide.cuh's Q6_K runs. The window ends before byte 74 of the block
// and starts at most 4 bytes before it (inside the previous block; for the first block of 8-byte
// aligned weights, which ops.py checks for v9 IQ3_S, at the block itself). Cost: 2 loads and ~12
// integer ops (the block's offset, 3 selects, 2 funnel shifts, the lane-order swap; SASS)
// instead of 4 loads and 2 byte merges; chosen because the load/shared pipe, not issue, is the
// estimated limit (above); 4 x u16 is the A/B if the GPU disagrees. The 4 sign bytes (offset
// 74 + 4i: 2- or 4-byte aligned) are two u16 loads (an aligned pair of words would be two loads
// as well); their merge puts them in the lane's order for free (WLaneIq3::ssel).
//
// Shared-memory banks of x: the lane reads entries 4i + o, as kwide_iq4.cuh's IQ4_XS lane, so
// the same fix: odd lanes take entries 2, 3 before 0, 1 (8 distinct 16-byte bank groups per
// quarter warp in every load). The lane's weights follow in that order: its two qs words are
// swapped, its sign half-words merged in swapped order, its qh nibbles shifted by 4.
//
// Integer ranges: |signed grid value| <= 15, |xq| <= 32767: the lane's 32-product dot < 32 x 15 x
// 32767 < 2^24 and times (1 + 2 sc) <= 31 < 2^29, exact in int32; converted once to fp32
// (relative error <= 2^-24), times d (fp16) and the x block scale in fp32.
#pragma once
#include "kwide_iq4.cuh"  // prmt, laneid_v; via kwide.cuh: XS, lds128, lds32f, xq_slot, dot8c, funnel_r

#ifndef KQ_IQ3S_GRID
#define KQ_IQ3S_GRID 16  // copies of iq3s_grid in shared memory (0: the global table)
#endif
constexpr int kIq3sCopies = KQ_IQ3S_GRID;
static_assert(kIq3sCopies == 0 || kIq3sCopies == 1 || kIq3sCopies == 2 || kIq3sCopies == 4 || kIq3sCopies == 8 ||
                  kIq3sCopies == 16 || kIq3sCopies == 32,
              "KQ_IQ3S_GRID: 0 (global table) or 1, 2, 4, 8, 16 (static) or 32 (dynamic) shared-memory copies");
constexpr int kIq3sLg = kIq3sCopies <= 1 ? 0 : kIq3sCopies == 2 ? 1 : kIq3sCopies == 4 ? 2 : kIq3sCopies == 8 ? 3
                        : kIq3sCopies == 16 ? 4 : 5;
// KQ_IQ3S_GRID=32 (A/B, ops GGUF_HARNESS_GEMV_KQ_IQ3S_GRID=32; measured in session 21: the 27B's
// IQ3_S gate/up -1.4 to -1.5 % against 16 copies, so the lookups no longer bind): one copy per lane, so
// a lookup is one wavefront whatever the indices (16 copies: up to 2, the lanes L and L + 16 of one
// bank). 64 KiB, over the 48 KiB a static array may take, so the copies sit at the start of the
// dynamic shared memory (a constant base, as the static array's: no add per lookup) and the IQ3_S
// instances stage x after them (kIq3sDynInt4; ops.gemv adds kv9_iq3s_dyn_bytes to the node's dynamic
// shared memory). The 16-bit offsets of iq3s_pair still fit: 4 (32 x 511 + 31) < 2^16.
constexpr int kIq3sDynInt4 = KQ_IQ3S_GRID == 32 ? 512 * 32 * 4 / 16 : 0;  // int4 slots of the dynamic copies

#if KQ_IQ3S_GRID == 32
extern __shared__ int4 smem4[];  // (gemv_kq.cu's dynamic shared memory: the copies, then x)
#define iq3s_grid_s ((u32*)smem4)
#elif KQ_IQ3S_GRID > 0
// Word copies x index + copy (byte offset 4x that) = iq3s_grid[index]. Allocated only in the
// kernels that use it (the IQ3_S instances; ptxas -v: the others keep their static shared memory).
__shared__ __align__(16) u32 iq3s_grid_s[512 * KQ_IQ3S_GRID];  // 16: uint4 stores (setup)
#endif

// Fill the shared copies (every thread of the block; the caller's later barrier publishes them).
__device__ __forceinline__ void iq3s_grid_setup() {
#if KQ_IQ3S_GRID >= 4
    for (int k = threadIdx.x; k < 128 * kIq3sCopies; k += blockDim.x) {  // 4 copies per 16-byte store
        const u32 v = iq3s_grid[(4 * k) >> kIq3sLg];
        ((uint4*)iq3s_grid_s)[k] = make_uint4(v, v, v, v);
    }
#elif KQ_IQ3S_GRID > 0
    for (int k = threadIdx.x; k < 512 * kIq3sCopies; k += blockDim.x) iq3s_grid_s[k] = iq3s_grid[k >> kIq3sLg];
#endif
}

// The grid word at byte offset `off` (= 4 (copies x index + copy)) of the table.
__device__ __forceinline__ u32 iq3s_word(u32 off) {
#if KQ_IQ3S_GRID > 0
    return *(const u32*)((const u8*)iq3s_grid_s + off);  // LDS [off + table]
#else
    return __ldg((const u32*)((const u8*)iq3s_grid + off));
#endif
}

// A lane's constants: byte offsets in a super-block's codes (16 x xq_slot) of its 4 x entries in
// load order (entry 4i + (o ^ f), f = 2 (i & 1)); odd: 1 for odd i (weights in that order too);
// sh: 4 odd (the qh nibble of load slots 0, 1 and the scale nibble of sub-block i); ssel: merge
// selector of the sign half-words; lc2: 4 x the lane's grid copy in both 16-bit halves.
struct WLaneIq3 { u32 p0, p1, p2, p3, odd, sh, ssel, lc2; };
__device__ __forceinline__ WLaneIq3 wide_lane_iq3s(int i) {
    const int f = 2 * (i & 1);
    WLaneIq3 w;
    w.p0 = 16 * xq_slot(4 * i + f); w.p1 = 16 * xq_slot(4 * i + f + 1);
    w.p2 = 16 * xq_slot(4 * i + (f ^ 2)); w.p3 = 16 * xq_slot(4 * i + (f ^ 2) + 1);
    w.odd = i & 1;
    w.sh = 4 * (i & 1);
    w.ssel = i & 1 ? 0x1054u : 0x5410u;  // sign bytes (2, 3, 0, 1) or (0, 1, 2, 3)
    w.lc2 = kIq3sCopies > 1 ? (4u * ((u32)laneid_v() & (kIq3sCopies - 1))) * 0x10001u : 0u;
    return w;
}

// The lane's activations for super-block sb: its 4 entries of 8 codes in load order and the
// 32-value block's scale (no code sums: IQ3_S has no offset term).
struct WXIq3 { int4 e0, e1, e2, e3; float d; };
__device__ __forceinline__ WXIq3 wide_x_iq3s(const XS& xa, int sb, int i, const WLaneIq3& w) {
    WXIq3 x;
    const u32 q = xa.q + 512 * sb;  // 32 int4 per super-block
    x.e0 = lds128(q + w.p0); x.e1 = lds128(q + w.p1);
    x.e2 = lds128(q + w.p2); x.e3 = lds128(q + w.p3);
    x.d = lds32f(xa.d + 32 * sb + 4 * i);  // block 8 sb + i
    return x;
}

// Raw registers of a lane's share of a block: the aligned 16-byte window holding qs[8i .. 8i + 7]
// at byte o, the sign half-words signs[4i, 4i + 1] and [4i + 2, 4i + 3], qh[i], scales[i / 2], d.
struct WIq3 { uint2 a, b; u32 o, s0, s1, qh, sc; u16 d; };
__device__ __forceinline__ void wide_load_iq3s(const u8* blk, int i, WIq3& r) {
    const u8* run = blk + 2 + 8 * i;
    r.o = (u32)(size_t)run & 7u;                 // even (blocks are 2-byte aligned)
    const uint2* a = (const uint2*)(run - r.o);  // pointer arithmetic, so still a global load (LDG)
    r.a = a[0];
    r.b = a[1];
    r.s0 = ld_u16(blk + 74 + 4 * i);
    r.s1 = ld_u16(blk + 76 + 4 * i);
    r.qh = blk[66 + i];
    r.sc = blk[106 + (i >> 1)];
    r.d = ld_u16(blk);
}

// Two grid lookups: P = (qs byte 2e, a byte whose bit 0 is index 2e's high bit, qs byte 2e + 1,
// the same for 2e + 1) (prmt of a qs word with the spread qh bits); the mask keeps bits 0..8 of
// each 16-bit half, i.e. the two 9-bit indices, at 4 (copies x index + copy).
__device__ __forceinline__ void iq3s_pair(u32 P, u32 lc2, u32& g0, u32& g1) {
    constexpr u32 sh = 2 + kIq3sLg, mask = (0x1ffu << sh) * 0x10001u;  // 4 (32 x 511 + 31) < 2^16
    const u32 off = ((P << sh) & mask) | lc2;
    g0 = iq3s_word(off & 0xffffu);
    g1 = iq3s_word(off >> 16);
}

// 8 codes of one x entry against 8 signed grid values: grid words g0 (values 0..3), g1 (4..7),
// sign byte S (bit j: negate value j).
__device__ __forceinline__ int iq3s_dot8(const int4& x, u32 g0, u32 g1, u32 S, int c) {
    const u32 m0 = prmt(S * 0x80402010u, 0u, 0x89ABu);  // byte j: 0xff if bit j of S (j < 4)
    const u32 m1 = prmt(S * 0x08040201u, 0u, 0x89ABu);  // byte j: 0xff if bit 4 + j
    return dot8c(x, (g0 ^ m0) | 0x01010101u, (g1 ^ m1) | 0x01010101u, c);  // odd g: g ^ 0xff | 1 = -g
}

// dequantize_row_iq3_s: y = d (1 + 2 sc) grid (+-1). Lane's partial of one super-block, times
// the x block scale (the caller sums lanes).
__device__ __forceinline__ float wide_dot_iq3s(const WIq3& r, const WXIq3& x, const WLaneIq3& w) {
    // the qs run: bytes o .. o + 7 of the window a.x a.y b.x b.y (o even: shift 0 or 16)
    const bool up = r.o & 4u;
    const u32 s = 8u * (r.o & 3u);
    const u32 u0 = up ? r.a.y : r.a.x, u1 = up ? r.b.x : r.a.y, u2 = up ? r.b.y : r.b.x;
    const u32 A = funnel_r(u0, u1, s), B = funnel_r(u1, u2, s);  // qs[8i .. 8i + 3], [8i + 4 .. 8i + 7]
    const u32 q0 = w.odd ? B : A, q1 = w.odd ? A : B;             // load order
    // qh bits of load slots 0, 1 (indices 0..3 in load order) and 2, 3: bit 0 of byte n = bit n
    // (7 bits times 1 + 2^7 + 2^14 + 2^21: partial products k + 7j never collide for k < 7, so
    // no carries; the other bits of each byte are garbage that iq3s_pair's mask drops)
    const u32 h0 = ((r.qh >> w.sh) & 0x7fu) * 0x00204081u;
    const u32 h1 = ((r.qh >> (4u - w.sh)) & 0x7fu) * 0x00204081u;
    u32 g[8];
    iq3s_pair(prmt(q0, h0, 0x5140u), w.lc2, g[0], g[1]);
    iq3s_pair(prmt(q0, h0, 0x7362u), w.lc2, g[2], g[3]);
    iq3s_pair(prmt(q1, h1, 0x5140u), w.lc2, g[4], g[5]);
    iq3s_pair(prmt(q1, h1, 0x7362u), w.lc2, g[6], g[7]);
    const u32 sg = prmt(r.s0, r.s1, w.ssel);  // sign byte of load slot o in byte o
    int t = iq3s_dot8(x.e0, g[0], g[1], sg & 0xffu, 0);
    t = iq3s_dot8(x.e1, g[2], g[3], prmt(sg, 0u, 0x4441u), t);
    t = iq3s_dot8(x.e2, g[4], g[5], prmt(sg, 0u, 0x4442u), t);
    t = iq3s_dot8(x.e3, g[6], g[7], sg >> 24, t);
    const int sc = (int)((r.sc >> w.sh) & 15u);
    return x.d * (h2f(r.d) * (float)((1 + 2 * sc) * t));
}
