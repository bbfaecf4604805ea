// Engine v9 GEMV (the default, GGUF_HARNESS_GEMV_KQ=v9l8): y[r] = sum_k W[r, k] * x[k] for
// nodes whose matrices all have ONE of the types Q4_K, Q5_K, Q6_K, IQ4_XS (K a multiple of 256),
// q16 activations, and IQ3_S (kwide_iq3s.cuh; ops.py GEMV_KQ_IQ3S, default on since it ran on the
// H200 in session 9), and Q8_0 / Q4_0 (kwide_q0.cuh: 8 blocks as a super-block; ops.py
// GEMV_KQ_Q0, session 13). Same arithmetic per super-block as gemv.cu's wide rows (kwide.cuh,
// kwide_iq4.cuh: the lane of a warp takes 32 weights of a super-block, 8 lanes per super-block,
// exact int32 dp2a sums, the scales in fp32), so the results equal gemv.cu's up to the order of
// the fp32 additions; what changes is everything around that arithmetic.
//
// Why (ncu on the H200, docs/perf-notes.md session 7): gemv.cu's Q4_K [10240x5120] node executes
// 12.6 M warp instructions for 52.4 M weights (7.7 per weight; the dp2a doing the work are 6.5 %)
// and issues every 1.8 cycles, so it is issue-bound (hot 18.0 us = cold 18.3 us, roofline 8.7):
//   - 25 %: per-row overhead of 2 warps per row (runtime type dispatch, lane constants
//     re-derived per row, L2 prefetch addressing, cross-warp combine with two barriers);
//   - 12 %: stage_xq in each of 528 blocks of 8 warps;
//   - 53 %: the loop body, 131 instructions per lane per super-block, of which ~36 are dp2a,
//     nibble masks and shared loads; the rest address and scale arithmetic.
// Here: one template instance per (type, epilogue), so no dispatch; one warp per row, lane
// constants computed once per kernel, no cross-warp combine and no barrier after staging;
// blocks of 16 warps (half the staging work per warp of gemv.cu's 8-warp blocks) in a one-wave
// grid with a grid-stride row loop; weights walked with a pointer advanced per round; no L2
// prefetch beyond each warp's first row (PF_AHEAD = 2 made the output head read its bytes
// 1.9x: the per-round loads of 16 resident warps per SM keep enough bytes in flight).
// Expected: ~2x fewer instructions per weight. Measured (H200, docs/perf-notes.md session 8):
// x1.08-1.32 faster than gemv.cu per shape once rows are split over S warps (kq_body), the 27B
// decode step 10174 -> 7983 us; 52-70 % of the size-aware roofline.
//
// Q4_K/Q5_K nodes take the gemvkq4_ kernels below instead (kwide4.cuh: 4 lanes per super-block,
// 64 weights per lane, two rows per warp; ops.kv9_kernel; GGUF_HARNESS_GEMV_KQ=v9l8 keeps them
// on the 8-lane gemvkq_ kernels for A/B).
// Arguments as gemv.cu's value convention: (SegTable by value, x, norm, eps, K, total_rows);
// S (warps per row group: 1, 2 or 4) is in the kernel's name (ops.kv9_split);
// MODE 0 store (+bias), 1 add, 2 SwiGLU of a gate/up pair (segments 0 and 1, equal rows).
#include "qdot.cuh"  // (named here: module.py prefixes the I-quant tables to sources that include it)
#include "xstage.cuh"
#ifndef KQ_XLANE
// x for the 8-lane Q4_K / Q5_K / Q6_K rows in lane records (kwide.cuh XLANE), the default of this
// kernel since session 13 (H200, cold back to back: those rows -2.8 to -8.6 %, the output head
// 85.1 % of the size-aware roofline; bitwise equal outputs); -DKQ_XLANE=0 (ops
// GGUF_HARNESS_GEMV_KQ_XLANE=0) builds the xq_slot staging for A/B. kq_traits.cuh's own default
// (0) keeps gemv_tma.cu (v10) as it was.
#define KQ_XLANE 1
#endif
#ifndef IQ4_KREG
// IQ4_XS codebook words K0 / K2 held in registers (kwide_iq4.cuh IQ4_KREG), the default of this
// kernel since session 14 (H200: the 2x[17408x5120] gate/up pair -1.2 %, the 27B step -0.3 %;
// loop SASS -13 %; bitwise equal outputs); -DIQ4_KREG=0 (ops GGUF_HARNESS_GEMV_IQ4_KREG=0) builds
// the constants' version. kwide_iq4.cuh's own default (0) keeps gemv_tma.cu and gemv_mma.cu as they were.
#define IQ4_KREG 1
#endif
#include "kq_traits.cuh"  // Lanes8 / Lanes4, KQ<T> (kwide_iq4.cuh, kwide_iq3s.cuh, kwide4.cuh)
#include "segs.cuh"

extern __shared__ int4 smem4[];  // the staged x (xstage.cuh stage_xq layout); KQ_IQ3S_GRID 32: the grid copies first

#ifndef KQ_UNROLL
#define KQ_UNROLL 2  // rounds (4 super-blocks per warp) whose loads are in flight together
#endif
constexpr int kKqUnroll = KQ_UNROLL;
#ifndef KQ2_UNROLL
#define KQ2_UNROLL 1  // the same for a gate/up pair (two rows' loads per round already)
#endif
constexpr int kKq2Unroll = KQ2_UNROLL;
#ifndef KQ_PF
#define KQ_PF 0  // grid strides ahead whose row each warp asks L2 for at the start of a row (0: none)
#endif
constexpr int kKqPf = KQ_PF;
#ifndef KQ_PIPE
#define KQ_PIPE 0  // 1: kq_row / kq_row2 load round n + 1 (header and qs) before round n's dots; 2: also
                   // the warp's next row's first round during this row's last one (kq_body's Carry)
#endif
constexpr int kKqPipe = KQ_PIPE;
static_assert(kKqPipe >= 0 && kKqPipe <= 2, "KQ_PIPE is 0, 1 or 2");
#ifndef KQ_PF0
// Where each warp asks L2 for its first row (ops GGUF_HARNESS_GEMV_KQ_PF0): 3 before the PDL wait,
// the row's first round only (KQ_PF0_SB below; the default since session 25), 1
// before the wait, the whole row (the default of engine v5 to session 24: weights are constants,
// so the request overlaps the previous kernel's tail), 0 never, 2 right after the wait (during
// the x staging, no longer competing with the previous kernel's last loads). Why: in the step's
// chain roofline (harness/step_roofline.py, H200, session 23) a chain of streaming reads of the
// step's node sizes took 4219 us with its first pass prefetched before the wait against 4029 us
// without (+4.7 %): the previous node's tail is not idle DRAM time, and the prefetches delay its
// completion, which the next node's wait is for (session 18's XPF lesson, again); but PF0=0 cost
// the engine +1.8 % (session 23). The traces put staging x at 2.7 us behind prefetches still in
// flight when the wait returns ([10240x5120] Q4_K, entry p50 -0.5 us). Measured, H200: 3 against
// 1 cold back to back (session 24) [10240x5120] Q4_K -8.8 %, the IQ4_XS gate/up pair -3.9 %,
// [5120x6144] Q5_K 2-part +1.1 %; the 27B step (session 25, first replay samples of two rounds)
// 6181.3 / 6182.0 -> 6097.1 / 6096.8 us (-1.4 %), gate/up -88 us. Values do not depend on it.
#define KQ_PF0 3
#endif
static_assert(KQ_PF0 >= 0 && KQ_PF0 <= 3, "KQ_PF0: 0, 1, 2 or 3");
#ifndef KQ_PF0_SB
// KQ_PF0 3: the row's first KQ_PF0_SB x nparts super-blocks are asked for (ops GGUF_HARNESS_GEMV_KQ_PF0_SB).
// 8 (the default since session 26): each part's first two rounds (part p's rounds take super-blocks
// 4p..4p+3 + 4 nparts i); 4 (session 25's default) the first round; other values cover whole rounds
// of every part only as multiples of 4 (below 4 on split rows: the first rounds of the first
// KQ_PF0_SB x nparts / 4 parts only). Measured, H200, the 27B step (graph replay, us), session 26:
// start 1 (a capped GPU, first samples) 4: 6097.4 / 6097.6, 8: 6076.7; start 2 (uncapped, medians
// of two rounds) 4: 6079.8 / 6079.8, 8: 6058.9 / 6056.9 (-0.35 %), 12: 6067.4 / 6066.9; start 3
// (capped, first samples) 8: 6068.7 / 6070.4, 4: 6090.0 / 6090.6. The sum of the per-node graph
// replays rose (gate/up +18 to +33 us): the gain is in how a node's start overlaps the previous
// node's tail. Values do not depend on it.
#define KQ_PF0_SB 8
#endif
static_assert(KQ_PF0_SB >= 1 && KQ_PF0_SB <= 16, "KQ_PF0_SB: 1..16");
// Bytes of a row the first-row prefetch asks for: the whole row, or (KQ_PF0 3) its first
// KQ_PF0_SB x nparts super-blocks of ts bytes (one contiguous range from the row's start).
__device__ __forceinline__ int kq_pf0_bytes(int row_bytes, int ts, int nparts) {
    return KQ_PF0 == 3 ? min(row_bytes, KQ_PF0_SB * ts * nparts) : row_bytes;
}
#ifndef KQ_L1PF
#define KQ_L1PF 0  // rounds ahead whose bytes each warp asks L1 for (prefetch.global.L1), across rows
#endif
constexpr int kKqL1pf = KQ_L1PF;
// the prefetches sit in the default (unrotated) loops of the 8-lane rows only
static_assert(!(kKqPipe > 0 && kKqL1pf > 0), "KQ_PIPE and KQ_L1PF are separate A/B builds");
#ifndef KQ_PRE
// KQ_PRE=1 (ops GGUF_HARNESS_GEMV_KQ_PRE=1; A/B, session 26): before the PDL wait each warp loads its
// first row's first round (the lane's block of super-block grp + 4 part; both rows of a gate/up
// pair or a KQ_P2 pair) into registers, not only into L2 (KQ_PF0 3 asks L2 for the same bytes);
// once x is staged their dot is taken (kq_pre_dot) and the first row's loop starts one round later
// from that sum (kq_row / kq_row2's init and sb0). Why: after the wait a warp stages x (~1.5-2.7
// us, session 22's traces) and only then issues its first weight loads, whose L2 round trip (~0.4
// us loaded) is on every node's critical path. Registers: the carried blocks live from the load to
// that dot only; the loops carry the two sums and the skip (one copy of each loop: session 26's
// first form ran the first row through a second inlined copy of the row loop, and the SwiGLU
// IQ4_XS pairs lost 2.6 / 3.2 %). Values: the same dots added in the same order (acc = 0 + round 0,
// then + round 1 ...): bitwise the default's. Not with KQ_PIPE (its carry) or KQ_L1PF.
// Measured (H200, session 26, the 27B step at KQ_PF0_SB 4, three pairs in one machine start): +0.7 %;
// the 2-part K = 6144 nodes -1.9 to -2.9 % (3 rounds per part), but the IQ4_XS gate/up pairs +1.4 to
// +2.0 % and ffn_down Q5_K +3.7 % (the group add Q5_K _c4 instance spills 20 bytes with it). Off by
// default.
#define KQ_PRE 0
#endif
static_assert(KQ_PRE == 0 || KQ_PRE == 1, "KQ_PRE: 0 or 1");
static_assert(!(KQ_PRE && (kKqPipe > 0 || kKqL1pf > 0)), "KQ_PRE: not with KQ_PIPE / KQ_L1PF");

// F32 rows riding in a node of type T (qwen35's ssm_in: Q5_K q/k/v and gate with the F32 beta and
// alpha rows, ops.kv9_kernel): lane l of nl lanes per row takes 8-value entries l, l + nl, ...
// against the staged codes (swizzle of the kernel's staging) and their block scales, as
// gemv.cu's per-8 float loop (fdot8) does. Rows are 16-byte aligned (K % 256 == 0, arena.py).
// IL (an IQ4_XIL build's IQ4_XS node, xstage.cuh): the natural entry c = 4b + m (values 8m..8m+7
// of block b) is the low (m < 2) or high (m >= 2) halves of the words of the staged entries
// 4b + 2 (m & 1) and the one after; the products are summed in the default's order, so the row
// is the default build's bit for bit.
// XL (KQ_XLANE build): natural entry c sits at xl_slot<XL>(c) (kwide.cuh lane records).
// KQ_F32_XPERM (A/B build, ops GGUF_HARNESS_GEMV_KQ_F32_XPERM=1; written in session 14, not yet run
// on a GPU): with XL, the lane of window position t = c & 31 takes entry xl_entry(t & 7, t >> 3)
// of its 32-entry window instead of entry t. Why: with entry t the 8 entries of a quarter warp sit
// on 7 distinct 16-byte bank groups of the lane records (one 2-way conflict per quarter warp, a
// CPU replay in tests/test_xlane.py), and the 27B's ssm_in node (Q5_K with F32 rows beside) was
// the one node kind slower with XLANE (+2.7 %, session 14); position q of records 0..7 sits on
// groups 5 i + q mod 8, all distinct. The warp still reads the same 1 KB of weights per
// iteration (each lane one 32-byte sector), in another lane order; each lane's sum runs over
// other entries, so the row is not bitwise the default's.
#ifndef KQ_F32_XPERM
#define KQ_F32_XPERM 0
#endif
template <bool SW4, bool IL = false, int XL = 0>
__device__ __forceinline__ float f32_row(const u8* row, const XS& xa, int K, int l, int nl) {
    float acc = 0.f;
    if constexpr (XL != 0 && KQ_F32_XPERM)  // nl and the windows are multiples of 32 (K % 256 == 0)
        l = (l & ~31) | xl_entry<XL>(l & 7, (l >> 3) & 3);
    for (int c = l; c < K / 8; c += nl) {
        const float4 a = ((const float4*)row)[2 * c], b = ((const float4*)row)[2 * c + 1];
        // two fma chains, not one over a code array: the merged form changed the default
        // build's SASS (42 instances, session 11), this one leaves it as measured
        if constexpr (IL) {
            const int e0 = (c & ~3) + 2 * (c & 1), sh = c & 2 ? 0 : 16;  // sh: low halves up first
            const int4 p = lds128(xa.q + 16 * (SW4 ? xq_slot4(e0) : xq_slot(e0)));
            const int4 q = lds128(xa.q + 16 * (SW4 ? xq_slot4(e0 + 1) : xq_slot(e0 + 1)));
            // (w << sh) >> 16: the signed 16-bit code of the chosen half, as (short) / >> 16 below
            float d = a.x * (float)((int)((unsigned)p.x << sh) >> 16);
            d = fmaf(a.y, (float)((int)((unsigned)p.y << sh) >> 16), d);
            d = fmaf(a.z, (float)((int)((unsigned)p.z << sh) >> 16), d);
            d = fmaf(a.w, (float)((int)((unsigned)p.w << sh) >> 16), d);
            d = fmaf(b.x, (float)((int)((unsigned)q.x << sh) >> 16), d);
            d = fmaf(b.y, (float)((int)((unsigned)q.y << sh) >> 16), d);
            d = fmaf(b.z, (float)((int)((unsigned)q.z << sh) >> 16), d);
            d = fmaf(b.w, (float)((int)((unsigned)q.w << sh) >> 16), d);
            acc = fmaf(d, lds32f(xa.d + 4 * (c >> 2)), acc);
        } else {
            const int4 q = lds128(xa.q + 16 * (XL ? xl_slot<XL>(c) : SW4 ? xq_slot4(c) : xq_slot(c)));
            float d = a.x * (float)(short)(q.x & 0xffff);
            d = fmaf(a.y, (float)(q.x >> 16), d);
            d = fmaf(a.z, (float)(short)(q.y & 0xffff), d);
            d = fmaf(a.w, (float)(q.y >> 16), d);
            d = fmaf(b.x, (float)(short)(q.z & 0xffff), d);
            d = fmaf(b.y, (float)(q.z >> 16), d);
            d = fmaf(b.z, (float)(short)(q.w & 0xffff), d);
            d = fmaf(b.w, (float)(q.w >> 16), d);
            acc = fmaf(d, lds32f(xa.d + 4 * (c >> 2)), acc);
        }
    }
    return acc;
}

// KQ_L1PF = D: at round j of a row (rounds of st super-blocks from sb0: the warp's part of the
// row; nr of them), lanes 0..7 ask L1 for the 128-byte lines of round j + D: of this row, or
// round j + D - nr of the next row `next` (nullptr: none). A round of an 8-lane warp is 4
// consecutive super-blocks (4 TS <= 840 bytes: <= 8 lines; Q8_0's 4 x 272 = 1088 bytes span 9-10,
// whose last 1-2 are not asked for) starting at p - grp TS, p the lane's block. No registers held (unlike KQ_PIPE's rotation, which ptxas schedules late to save them).
template <class Q> __device__ __forceinline__ void kq_l1pf(const u8* p, int pst, int sb, int sb0, int st, int nsb,
                                                            const u8* next) {
    if constexpr (kKqL1pf > 0 && Q::R == 1) {
        const int lane = threadIdx.x & 31, gts = Q::grp(lane) * Q::TS;
        int tsb = sb + kKqL1pf * st;  // the lane's super-block in the target round
        const u8* a;                  // the target round's first byte
        if (tsb < nsb) {
            a = p + kKqL1pf * pst - gts;
        } else {  // in the next row: the rounds of a row span nr st super-blocks from sb0
            tsb -= (nsb - sb0 + st - 1) / st * st;
            if (!next || tsb >= nsb) return;
            a = next + (size_t)tsb * Q::TS - gts;
        }
        const int n = min(4, nsb - (tsb - Q::grp(lane)));  // super-blocks in the target round
        const u8* line = (const u8*)((size_t)a & ~(size_t)127) + 128 * lane;
        if (lane < 8 && line < a + n * Q::TS) asm volatile("prefetch.global.L1 [%0];" ::"l"(line));
    }
}

// KQ_PIPE 2: the first block(s) of the warp's next row, loaded during this row's last round;
// KQ_PRE: the warp's first row's first round, loaded before the PDL wait (kq_pre_load).
template <class Q> struct Carry {
    typename Q::Blk b[2];  // [row of a gate/up pair]
    bool have;
};

// Lane's partial dot product of one row: super-blocks sb0, sb0 + st, ... (nsb = K / 256;
// sb0 = grp + 4 ws, st = 4 S for split part ws of S, kq_body). Q: the format's trait (KQ<T>: 8
// lanes per super-block, grp = lane >> 3, i = lane & 7; KQ4<T>: 4 lanes, grp = (lane >> 2) & 3,
// i = lane & 3). c, next: KQ_PIPE 2's carry and the warp's next row of this type (nullptr:
// none; KQ_L1PF reads next too); unused by the default build.
template <class Q> __device__ __forceinline__ float kq_row(const u8* row, const XS& xa, const typename Q::Lane& w,
                                                           int nsb, int sb0, int st, int i,
                                                           Carry<Q>* c = nullptr, const u8* next = nullptr,
                                                           float init = 0.f) {
    float acc = init;  // (KQ_PRE: the first row's round sb0 - st, taken by kq_pre_dot)
    const u8* p = row + sb0 * Q::TS;
    const int pst = st * Q::TS;
    if constexpr (kKqPipe > 0) {  // round n + 1's loads issued before round n's arithmetic
        typename Q::Blk cur;
        if (kKqPipe > 1 && c && c->have)  // c: nullptr from the P2 / F32-beside calls (no carry)
            cur = c->b[0];
        else if (sb0 < nsb)
            Q::load(p, i, cur);
#pragma unroll kKqUnroll
        for (int sb = sb0; sb < nsb; sb += st) {
            typename Q::Blk nxt;
            p += pst;
            if (sb + st < nsb)
                Q::load(p, i, nxt);
            else if (kKqPipe > 1 && next)  // the last round: the next row's first block
                Q::load(next + sb0 * Q::TS, i, nxt);
            acc += Q::dot(cur, Q::x(xa, sb, i, w), i, w);
            cur = nxt;
        }
        if constexpr (kKqPipe > 1) {
            if (c) {
                c->have = next && sb0 < nsb;
                c->b[0] = cur;
            }
        }
        return acc;
    }
#pragma unroll kKqUnroll
    for (int sb = sb0; sb < nsb; sb += st, p += pst) {
        kq_l1pf<Q>(p, pst, sb, sb0, st, nsb, next);
        typename Q::Blk r;
        Q::load(p, i, r);
        acc += Q::dot(r, Q::x(xa, sb, i, w), i, w);
    }
    return acc;
}

// A part's share of one row (kq_body's plain store/add path): part wpart of NP takes super-blocks
// grp + 4 wpart + 4 NP k (kq_row's sb0, st). With KQ_PART_ROT (since session 20; called by the
// 4-part group / cluster kernels only, kq_body's CS == 4, xstage.cuh kKqPartRot): the ng =
// ceil(nsb / 4) groups of 4 super-blocks are F = ng / NP full sweeps, which every part takes as
// before, and L = ng mod NP leftover groups, of which leftover m goes to part (m + key) mod NP
// instead of always to part m; the key is the same in every part of a row group, so each leftover
// is computed exactly once per row, and stage_xq stages the leftovers in every part. Why: at K =
// 17408 (17 groups), part 0 read 5 groups of every row and parts 1..3 read 4, so the part-0 blocks,
// which run without a barrier with their partners until the final count, did 5 / 4.25 = 1.18x the
// mean work. The key:
// - KQ_PART_ROT=2 (the default since session 21): the row group base / rpb = cb + round ncb
//   (block-major rows: base = rpb cb + R g + round step, step = rpb ncb), a function of the row and
//   the block's warps only, so the _c4 sums do not depend on the grid (the routing itself, the
//   split and the _s4 fallback past KQ_CS_MAXR, still can); a warp's rows cycle through all 4 parts
//   only when the group count ncb is odd, which ops.gemv makes it when that costs no round
//   (ops.kv9_odd_groups). Measured (H200, session 21, bench nodes of the 27B at c = 2048, same
//   start): step 6168.9 us against the round key's 6162.2 / 6162.0 (SAME), ffn_down Q4_K x48
//   959.54 against 959.59 / 959.50 us.
// - KQ_PART_ROT=1 (session 20's default, ops GGUF_HARNESS_GEMV_KQ_PART_ROT=round): key = round, the
//   warp's row loop count. Measured (session 20, four same-start pairs against no rotation):
//   ffn_down Q4_K x48 -2.2 to -2.6 % (FASTER), Q5_K x16 -1.2 to -1.7 % (within noise). Since the
//   round of a row is (row - first) / step, which part adds a leftover depends on the grid's group
//   count (occupancy x SMs): another SM count, a MIG slice or a build with other register use may
//   round differently.
// - KQ_PART_ROT=0: part m always (session 19's sums, the _s4 kernels' bit for bit).
// Not in the S-split kernels (one block, a barrier per round: the round still waits for the part
// with the leftover): there, rotating cost 6-9 % ([5120x17408] IQ3_S and Q6_K at S 4, [1024x5120]
// Q6_K at S 2; kernel table, session 20); not at 2 parts (the 27B's are K = 6144 nodes, L = 0).
// Values: with a key the _c4 kernels add other partial sums than the _s4 ones (equal within the
// oracle rule, not bit for bit).
template <class Q, int NP>
__device__ __forceinline__ float kq_row_part(const u8* row, const XS& xa, const typename Q::Lane& w, int nsb, int grp,
                                             int wpart, int key, int i, float init = 0.f, int skip = 0) {
    // (ops.kv9_csplit never routes a node to the cluster kernels of a PIPE / L1PF build)
    static_assert(NP == 1 || (kKqPipe == 0 && kKqL1pf == 0), "KQ_PART_ROT: not with KQ_PIPE / KQ_L1PF");
    const int ng = (nsb + 3) >> 2, F = ng / NP, L = ng - F * NP;
    // (init, skip: KQ_PRE's first round, grp + 4 wpart, which the first sweep takes when F >= 1, as
    // kq_pre_load requires)
    float acc = kq_row<Q>(row, xa, w, min(nsb, 4 * F * NP), grp + 4 * wpart + skip, 4 * NP, i, nullptr, nullptr, init);
    for (int m = 0; m < L; ++m)  // one round (sb + 4 NP >= nsb); a lane past nsb adds 0
        if ((m + key) % NP == wpart) acc += kq_row<Q>(row, xa, w, nsb, 4 * (F * NP + m) + grp, 4 * NP, i);
    return acc;
}

// kq_body's plain row: kq_row_part when ROT, else kq_row as before (same arguments, same code).
template <class Q, int NP, bool ROT>
__device__ __forceinline__ float kq_row_sel(const u8* row, const XS& xa, const typename Q::Lane& w, int nsb, int sb0,
                                            int st, int i, Carry<Q>* c, const u8* next, int grp, int wpart, int key,
                                            float init = 0.f, int skip = 0) {
    if constexpr (ROT) return kq_row_part<Q, NP>(row, xa, w, nsb, grp, wpart, key, i, init, skip);
    else return kq_row<Q>(row, xa, w, nsb, sb0 + skip, st, i, c, next, init);
}

// Gate and up rows: both rows' blocks loaded before any arithmetic, the activations read once.
template <class Q> __device__ __forceinline__ float2 kq_row2(const u8* r0, const u8* r1, const XS& xa,
                                                             const typename Q::Lane& w, int nsb, int sb0, int st,
                                                             int i, Carry<Q>* c = nullptr,
                                                             const u8* n0 = nullptr, const u8* n1 = nullptr,
                                                             float init0 = 0.f, float init1 = 0.f) {
    float a0 = init0, a1 = init1;  // (KQ_PRE: as kq_row's init)
    const int o = sb0 * Q::TS, pst = st * Q::TS;
    const u8 *p0 = r0 + o, *p1 = r1 + o;
    if constexpr (kKqPipe > 0) {  // as kq_row: the next round's two blocks before this round's dots
        typename Q::Blk g, u;
        if (kKqPipe > 1 && c && c->have) {
            g = c->b[0];
            u = c->b[1];
        } else if (sb0 < nsb) {
            Q::load(p0, i, g);
            Q::load(p1, i, u);
        }
#pragma unroll kKq2Unroll
        for (int sb = sb0; sb < nsb; sb += st) {
            typename Q::Blk g2, u2;
            p0 += pst;
            p1 += pst;
            if (sb + st < nsb) {
                Q::load(p0, i, g2);
                Q::load(p1, i, u2);
            } else if (kKqPipe > 1 && n0) {
                Q::load(n0 + o, i, g2);
                Q::load(n1 + o, i, u2);
            }
            const typename Q::X x = Q::x(xa, sb, i, w);
            a0 += Q::dot(g, x, i, w);
            a1 += Q::dot(u, x, i, w);
            g = g2;
            u = u2;
        }
        if constexpr (kKqPipe > 1) {
            if (c) {
                c->have = n0 && sb0 < nsb;
                c->b[0] = g;
                c->b[1] = u;
            }
        }
        return make_float2(a0, a1);
    }
#pragma unroll kKq2Unroll
    for (int sb = sb0; sb < nsb; sb += st, p0 += pst, p1 += pst) {
        kq_l1pf<Q>(p0, pst, sb, sb0, st, nsb, n0);
        kq_l1pf<Q>(p1, pst, sb, sb0, st, nsb, n1);
        typename Q::Blk b0, b1;
        Q::load(p0, i, b0);
        Q::load(p1, i, b1);
        const typename Q::X x = Q::x(xa, sb, i, w);
        a0 += Q::dot(b0, x, i, w);
        a1 += Q::dot(b1, x, i, w);
    }
    return make_float2(a0, a1);
}

// ---- Q4_K / Q5_K: 4 lanes per super-block, two rows per warp (kwide4.cuh) ----
// Half h of the warp (16 lanes) takes row 2 w + h of the warp's pair; lane (g, j) = ((L >> 2)
// & 3, L & 3) takes super-blocks g, g + 4, ... of that row. x is staged with xq_slot4.
// The 4-lane rows as a KQ-style trait (kq_row / kq_row2 above): the lane constant is j, and the
// "activations" are just where to find them (wide4_dot reads its 8 entries itself).
struct X4 { XS xa; int sb; };
template <int T> struct KQ4 : Lanes4 {
    static constexpr int TYPE = T;
    using Lane = int;
    static __device__ __forceinline__ Lane lane(int j) { return j; }
    using Blk = W4Blk<T>;
    using X = X4;
    static constexpr int TS = Fmt<T>::TS;
    static __device__ __forceinline__ void load(const u8* b, int j, Blk& r) { wide4_load<T>(b, j, r); }
    static __device__ __forceinline__ X x(const XS& xa, int sb, int, const Lane&) { return X4{xa, sb}; }
    static __device__ __forceinline__ float dot(const Blk& r, const X& x, int j, const Lane&) {
        return wide4_dot<T>(r, x.xa, x.sb, j);
    }
};

// KQ_P2 (A/B build, ops GGUF_HARNESS_GEMV_KQ_P2=1): store/add nodes with two adjacent rows per warp,
// every lane on both (kq_row2 as for a gate/up pair: each round's x read once for two rows). Why
// (static SASS count, docs/perf-notes.md session 10): the Q4_K store loop spends 99 instructions
// per lane and 32 weights, 16 of them dp2a; the IQ4_XS gate/up pair 113.5 per row against 132 for
// its store loop: the x loads, x-slot addresses and loop control are shared by the two rows.
template <class Q> struct KQP2 : Q {
    static constexpr int R = 2;  // rows per warp (row groups of 2 rows), all 32 lanes on each
};
template <class Q> struct IsP2 { static constexpr bool v = false; };  // kq_body's test for KQP2
template <class Q> struct IsP2<KQP2<Q>> { static constexpr bool v = true; };

// KQ_WMAJ (ops GGUF_HARNESS_GEMV_KQ_WMAJ=1, and the wide build of ops.kv9_wide with KQ_BLOCK_WARPS
// 32; session 15): row group j of a grid-stride pass goes to warp (g, block) = (j / gridDim.x,
// j % gridDim.x) (warp-major) instead of (j % G, j / G) (block-major), so a partial last pass is
// spread over every block instead of filling the first ones whole (2x[17408x5120] IQ4_XS: 512 row
// groups on blocks 0..31). Measured (H200, cold back to back): alone, with two 16-warp blocks per
// SM, +5 % on that pair (the SM's older block still ends first, KQ_BLOCK_WARPS below); with one
// 32-warp block per SM, -6.1 % against the default (without WMAJ the 32-warp blocks put the partial
// pass on 16 SMs). Only which warp computes a row changes: outputs are the block-major build's.
#ifndef KQ_CSPLIT
// KQ_CSPLIT=1 (ops GGUF_HARNESS_GEMV_KQ_CSPLIT, session 16): a build holding only the cluster-split
// instances gemvkq_<store|add>_<type>_c2 / _c4 (below). They do what the _s2 / _s4 kernels do
// with the S parts of a row group in the S blocks of a thread-block cluster (__cluster_dims__)
// instead of S warps of one block: block rank q takes the super-blocks the S-split's warp part q
// takes, stages only the x those need (stage_xq's CS), sends each row's partial sum to rank 0's
// shared memory (DSMEM) and, after one cluster barrier, rank 0 adds the parts in part order and
// stores. Why (KQ_TRACE on the H200, session 15/16): staging x took 5.0 us of the 22.4 us of
// [5120x17408] Q4_K at S 4, every block reading and quantising all 17408 values; a part needs a
// quarter. The per-round barrier of S > 1 goes too. Nodes with a fused RMSNorm are not taken (the
// norm needs every value's square). Bitwise equal to the _s<CS> kernels.
#define KQ_CSPLIT 0
#endif
#define KQ_CS_MAXR 8  // rounds (grid-stride passes) a cluster-split warp may have (ops.gemv bounds it;
                      // rows of later rounds would not be stored)
#ifndef KQ_GSPLIT
// KQ_GSPLIT=1 (with KQ_CSPLIT=1; ops GGUF_HARNESS_GEMV_KQ_GSPLIT: every group since session 18, the
// groups of 4 only since session 19): the
// same _c2 / _c4 entries without __cluster_dims__. Blocks CS q .. CS q + CS - 1 are a "virtual
// cluster" (rank = blockIdx.x % CS, as a 1-D cluster's rank): each part's sums go to global memory
// (kq_gpart) instead of rank 0's shared memory, each block counts itself in (kq_gcount, after a
// fence), and whichever block of the group counts in last adds the CS parts in part order and
// stores, then resets the count (so the next launch finds 0; the next kernel reads it only after
// its PDL wait, i.e. after this grid has completed). The same partial sums added in the same
// order: the _s<CS> kernel's outputs bit for bit (at CS = 4 only with KQ_PART_ROT=0: kq_row_part).
// Why: clusters of 4 had the right balance for the
// [5120x17408] nodes (20480 parts over 4224 warps: 4.85 rounds, against 2.42 -> 3 rounds at 2
// parts) and staged a quarter of x (5.0 -> 1.9 us), but the GPCs held only 61-62 clusters of 4
// (one ran as a second wave; H200, session 16); without hardware clusters every block slot is used.
// Measured (H200, session 18, the 27B at c = 2048, two pairs in one machine start): with groups of
// S the step 6345.2 / 6343.0 -> 6302.5 / 6303.1 us; ffn_down (4 parts) -1.7 / -2.0 %, the 2-part
// ssm_out / attn_output +7.7 % against hardware clusters of 2 (ops GGUF_HARNESS_GEMV_KQ_GSPLIT).
// Not reentrant: kq_gpart / kq_gcount belong to the compiled module, shared by every node built
// from it, which is safe because no two such nodes run at once: the engine runs its nodes in
// order and every kernel calls pdl_wait before its first global write (a node's writes follow the
// previous grid's completion, the count's reset included); the one exception, a `beside` node on
// a second stream (executor.py, GGUF_HARNESS_GEMV_KQ_MIXED=beside), overlaps only the next main
// node, and ops.gemv_nodes keeps nodes of a KQ_GSPLIT build in line. Two launches of one build
// running at once would race. The grid must
// be whole groups, at most KQ_GS_MAXCB of them: ops.gemv, through which every caller (the engine,
// bench kernels, kernel_trace) builds these nodes, sizes it so.
#define KQ_GSPLIT 0
#endif
#define KQ_GS_MAXCB 512  // virtual clusters a KQ_GSPLIT grid may have (ops.gemv bounds it)
#ifndef KQ_GS_FENCE
// How a KQ_GSPLIT block publishes its parts before counting itself in (ops
// GGUF_HARNESS_GEMV_KQ_GS_FENCE; 1 since session 19). 1: the barrier first, then thread 0 alone
// fences, counts and, in the group's last block, fences again before the barrier that releases
// the block's readers: the cooperative-groups grid-sync form, a release / acquire pair by
// cumulativity through the barriers (PTX ISA memory consistency model, "fence" and "bar"), with
// one fence per block instead of one per thread. 0: every thread fences (__threadfence) before
// the barrier, then thread 0 counts (session 18's form; also correct, as __threadfence is
// fence.sc.gpu and Fence-SC orders every writer's fence before the reader's, but only with sc
// fences: the new form stays correct with acq_rel ones). The values are the same either way.
// Measured (H200, session 19, the 27B at c = 2048, one machine start): all groups in global
// memory, step 6333.1 / 6343.5 -> 6320.7 us (ssm_out -1.1 %, the rest within noise); with the
// 2-part nodes on hardware clusters (GSPLIT 4) 6311.1 -> 6314.1 (ffn_down -0.2 %): no cost.
#define KQ_GS_FENCE 1
#endif
static_assert(KQ_GS_FENCE == 0 || KQ_GS_FENCE == 1, "KQ_GS_FENCE: 0 or 1");
#if KQ_CSPLIT && !KQ_GSPLIT && defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#error "KQ_CSPLIT: thread-block clusters need sm_90 or newer"
#endif
// GGUF_HARNESS_DIAG nowait_c4 / nowait_c2 / nowait_norm (module.py; timing only, values wrong by
// design): the cluster-split instances of 4 / 2 parts, or the kernels with a fused norm, skip their
// PDL wait.
#ifdef DIAG_NOWAIT_C4
constexpr bool kDiagNowaitC4 = true;
#else
constexpr bool kDiagNowaitC4 = false;
#endif
#ifdef DIAG_NOWAIT_C2
constexpr bool kDiagNowaitC2 = true;
#else
constexpr bool kDiagNowaitC2 = false;
#endif
// Whether a v9 kernel makes its PDL wait (common.cuh pdl_wait; callers write `if (kq_waits..)
// pdl_wait();`, the form tests/test_pdl_contract.py reads): always, but in the timing-only builds,
// the CS-part cluster-split instances under nowait_c4 / nowait_c2 and kernels with a fused norm
// under nowait_norm.
template <int CS> __device__ __forceinline__ bool kq_waits(const float* norm) {
    if constexpr ((kDiagNowaitC4 && CS == 4) || (kDiagNowaitC2 && CS == 2)) return false;
#ifdef DIAG_NOWAIT_NORM
    if (norm) return false;
#endif
    (void)norm;
    return true;
}
#if KQ_GSPLIT
static_assert(KQ_CSPLIT, "KQ_GSPLIT is a form of the KQ_CSPLIT build");
// [virtual cluster][round][part][warp]: the parts' row sums; one count per virtual cluster
__device__ float kq_gpart[KQ_GS_MAXCB][KQ_CS_MAXR][4][32];
__device__ unsigned kq_gcount[KQ_GS_MAXCB] = {0};
#endif

// (the cluster primitives cluster_rank / cluster_sync / st_cluster_f32: common.cuh)

#ifndef KQ_WMAJ
#define KQ_WMAJ 0
#endif

// KQ_TRACE (diagnostic build, -DKQ_TRACE=1; never the engine's): lane 0 of each warp writes the
// global timer (ns) at kernel entry, after the PDL wait, after staging x and after its last row
// to kq_trace[block * warps per block + warp][0..3], and the SM id to [4]; a launch overwrites the previous
// one's entries, so after back-to-back launches the array holds the last one's timeline.
#ifndef KQ_TRACE
#define KQ_TRACE 0
#endif
#if KQ_TRACE
#define KQ_TRACE_WARPS (4096 * 16)
__device__ unsigned long long kq_trace[KQ_TRACE_WARPS][5];
__device__ __forceinline__ unsigned long long kq_now() {  // %globaltimer, ns
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ unsigned kq_warp() {  // the warp's index in the grid: kq_trace's row
    return blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
}
__device__ __forceinline__ void kq_mark(int k) {
    const unsigned wi = kq_warp();
    if ((threadIdx.x & 31) == 0 && wi < KQ_TRACE_WARPS) {
        const unsigned long long t = kq_now();
        unsigned sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        kq_trace[wi][k] = t;
        kq_trace[wi][4] = sm;
    }
}
#define KQ_MARK(k) kq_mark(k)
// Per row (session 28): lane 0 of the warp that ran a whole row (the one-row-per-warp loops: the
// queue build and the S = 1 rows of the wide and 16-warp builds) writes its start and end
// (%globaltimer, ns, taken at the top of the row's iteration and after its sums; a first row's
// bytes may already be in L2 (KQ_PF0) or registers (KQ_PRE, KQ_PIPE 2's carry) by then) and the
// warp's global index to kq_trace_row[row] (node-global row; rows past KQ_TRACE_ROWS are not
// written). Tells rows from warps: whether rows of one size take unequal times, and whose.
#define KQ_TRACE_ROWS (1 << 18)
__device__ unsigned long long kq_trace_row[KQ_TRACE_ROWS][3];
struct KqRowMark { int row; unsigned long long t0; };  // a row (node-global) and its start
__device__ __forceinline__ void kq_row_mark(const KqRowMark& m) {
    if ((threadIdx.x & 31) == 0 && (unsigned)m.row < KQ_TRACE_ROWS) {
        kq_trace_row[m.row][0] = m.t0;
        kq_trace_row[m.row][1] = kq_now();
        kq_trace_row[m.row][2] = kq_warp();
    }
}
#define KQ_ROW_START(v, row) const KqRowMark v{(row), kq_now()}
#define KQ_ROW_MARK(v) kq_row_mark(v)
#else
#define KQ_MARK(k)
#define KQ_ROW_START(v, row)
#define KQ_ROW_MARK(v)
#endif

// Sum over the N lanes of each aligned group (every lane gets its group's sum; N = 32: warp_sum).
template <int N> __device__ __forceinline__ float group_sum(float v) {
#pragma unroll
    for (int o = N / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

#if KQ_XPF || KQ_CONV
// The warps of the grid, and this warp's index among them (xpf_tail, conv_prefetch)
__device__ __forceinline__ int grid_warps() { return (int)gridDim.x * (int)(blockDim.x >> 5); }
__device__ __forceinline__ int grid_warp() { return (int)blockIdx.x * (int)(blockDim.x >> 5) + (int)(threadIdx.x >> 5); }
#endif
#if KQ_XPF
// KQ_XPF=1 (ops GGUF_HARNESS_GEMV_KQ_XPF=<MB>, an A/B build of every v9 kernel; session 17, written
// before it ran): once a warp's own rows are done it asks L2 for the first t.xpf[k].bytes of
// rows gw, gw + W, ... of the next v9 GEMV node's segments (gw: the warp's index in the grid, W:
// the grid's warps; backends/engine/xpf.py fills the table from the node list). Why (KQ_TRACE,
// session 15): a node's warps end over 6-9 us, during which the DRAM has fewer and fewer
// requests; the next node's blocks cannot be resident then (a 32-warp block holds the SM's
// registers until its last warp ends), so its first rows are fetched only when it starts. The
// rows are those the next node's warps take first (every v9 order starts with rows 0..W'-1 of
// its row space), their first bytes those its first rounds read. Values are unchanged (a
// prefetch does not write). Measured (H200, session 18, 27B step at c = 2048): 6335.0 -> 6458.1 us
// at 8 MiB, 6554.6 at 16 (+1.9 / +3.5 %): the step's gap over the node sum fell 171 -> 36 / -16
// us, but every node grew more (ffn_down +11.7 % at 16 MiB): the finished warps' prefetches
// compete with the node's own late rows. Off by default.
static_assert(sizeof(SegTable) == 200 + 32 * KQ_CONV, "SegTable with KQ_XPF: 200 bytes, +32 with KQ_CONV (ops.table_dtype)");
__device__ __forceinline__ void xpf_tail(const SegTable& t) {
    const int lane = threadIdx.x & 31, W = grid_warps(), gw = grid_warp();
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        const XpfSeg& s = t.xpf[k];
        if (!s.w) continue;
        for (int r = gw; r < s.rows; r += W) {
            const u8* a = (const u8*)(s.w + (u64)s.row_bytes * (u64)r);
            const u8* end = a + s.bytes;
            for (const u8* l = (const u8*)((size_t)a & ~(size_t)127) + 128 * lane; l < end; l += 128 * 32)
                prefetch_l2(l);
        }
    }
}
#define KQ_XPF_TAIL(t) xpf_tail(t)
#else
#define KQ_XPF_TAIL(t)
#endif

#if KQ_CONV
// KQ_CONV=1 (ops GGUF_HARNESS_GEMV_KQ_CONV=1, an A/B build of every v9 kernel; session 17, written
// before it ran): a store node whose table has conv.state set (qwen35's ssm_in) stores each row r
// of its segment 0 (attn_qkv: the conv's channels) as before and then runs that channel's causal
// conv with the value it stored: xp = [state[0][r], state[1][r], state[2][r], x[r]],
// y[r] = silu(sum_i xp[i] w[r][i]) (tap 0 first, fmaf: deltanet.cu gdn_conv_body's order), and
// shifts the state column, one thread per row as the conv kernel does (each row is stored once,
// by one lane), so the conv node of the layer goes. Why: the 27B step ran 48 conv nodes of 0.9 us
// each plus their node boundaries (session 16-17 node tables: ssm_conv 43 us, gap ~190 us over
// 388 nodes). Values: bitwise the two-node form's (the same stored x, the same arithmetic).
// Measured (H200, session 18, 27B step at c = 2048): 6335 -> 6660.5 us (+5.1 %): ssm_in +33 %
// (7 us per node: the store's dependent state / taps loads end every row), the conv's 43 us gone.
// Off by default; to win, its loads would have to be issued before the row's weight loads.
static_assert(sizeof(SegTable) == 152 + 48 * KQ_XPF + 32, "SegTable with KQ_CONV (ops.table_dtype)");
template <int MODE> __device__ __forceinline__ void store_out(const SegTable& t, int si, int row, float y, float up) {
    store_row<MODE>(t.s[si], row, y, up);
    if (MODE == 0 && si == 0 && t.conv.state) {
        const Seg& s = t.s[0];
        const float x = s.bias ? y + ((const float*)s.bias)[row] : y;  // the value store_row wrote
        float* st = (float*)t.conv.state;
        const int C = t.conv.C;
        const float4 w = ((const float4*)t.conv.w)[row];
        const float xp0 = st[row], xp1 = st[(size_t)C + row], xp2 = st[2 * (size_t)C + row];
        float acc = 0.f;
        acc = fmaf(xp0, w.x, acc);
        acc = fmaf(xp1, w.y, acc);
        acc = fmaf(xp2, w.z, acc);
        acc = fmaf(x, w.w, acc);
        ((float*)t.conv.y)[row] = silu(acc);
        st[row] = xp1;
        st[(size_t)C + row] = xp2;
        st[2 * (size_t)C + row] = x;
    }
}
#define KQ_STORE(MODE, t, si, row, y, up) store_out<MODE>(t, si, row, y, up)
// Before the PDL wait: the conv's taps and state to L2, warp gw of W taking lines gw, gw + W, ...
// (the taps are constants; the state was last written by this node one step ago, and a prefetch
// cannot return stale data), so store_out's dependent loads hit L2.
__device__ __forceinline__ void conv_prefetch(const SegTable& t) {
    if (!t.conv.state) return;
    const int W = grid_warps(), gw = grid_warp();
    const int lane = threadIdx.x & 31, sl = (3 * t.conv.C * 4 + 127) >> 7, wl = (4 * t.conv.C * 4 + 127) >> 7;
    for (int l = gw * 32 + lane; l < sl + wl; l += W * 32)
        prefetch_l2(l < sl ? (const u8*)t.conv.state + 128 * (size_t)l : (const u8*)t.conv.w + 128 * (size_t)(l - sl));
}
#define KQ_CONV_PREFETCH(t) conv_prefetch(t)
#else
#define KQ_STORE(MODE, t, si, row, y, up) store_row<MODE>((t).s[si], row, y, up)
#define KQ_CONV_PREFETCH(t)
#endif

static_assert(sizeof(SegTable) == 152 + 48 * KQ_XPF + 32 * KQ_CONV, "SegTable (ops.table_dtype)");

#ifndef KQ_DQ
// KQ_DQ=1 (ops GGUF_HARNESS_GEMV_KQ_DQ, the wide nodes' build since session 17; 32-warp blocks):
// the split-1 8-lane rows (one row per warp) of a block are handed out by a counter in shared
// memory instead of a fixed warp-major stride. Block b takes the rows b, b + B, b + 2 B, ...
// (KQ_DQ_MAP 1; 0: the contiguous range [b N / B, (b + 1) N / B)); warp w takes the block's row w
// first (prefetched to L2 before the PDL wait, as kq_body does), then whatever the counter gives.
// A full row is the S = 1 kernel's bit for bit: the same call, only which warp runs it changes.
// A/B (KQ_DQ_P > 1): the block's last min(rows, KQ_DQ_T) rows are P units each; part p runs the
// super-blocks grp + 4 p, grp + 4 p + 4 P, ... (the _s<P> kernel's part p), writes its sum to
// shared memory and counts itself in, and the row's last part adds the P sums in part order and
// stores: such a row is the _s<P> kernel's bit for bit (the same block_sum for a fused norm: both
// 32-warp builds).
// Why (KQ_TRACE on the H200, session 15, the wide build of the 2x[17408x5120] IQ4_XS pair): all
// warps ran until 24 us, then the active fraction fell to 0.54 at 27 us and 0.10 at 30 us, the last
// warp ending at 32.8 us; the mean warp end was 27.1 us (per SM at most 27.8). Two causes: 4.12
// rows per warp (about 4 warps per SM run a fifth row alone) and unequal warp speeds.
// Measured (H200, session 17, cold back to back, same machine start): the queue alone (P 1)
// [10240x5120] Q4_K 12.58 / 12.53 -> 12.17 us, the IQ4_XS pair 33.85 / 33.58 -> 32.87, the 27B
// step -0.4 %. Parts were slower on the memory-bound rows: +12 to +20 % at P 4 and 32 tail rows,
// +7 to +10 % at 4 tail rows (the compute-bound IQ3_S pair +0.7 % at P 4, -1.7 % at P 2), but
// with P a runtime value then (every row's loop had a runtime stride; P is a compile-time
// constant since); with the constant P 4 and 8 tail rows the step's gate/up nodes were -0.1 %
// against the queue alone's -1.7 % (contiguous rows, whose map put ssm_in's 96 F32 rows into
// its last block: that node +61 %).
#define KQ_DQ 0
#endif
#ifndef KQ_DQ_P
#define KQ_DQ_P 1  // parts per tail row (1: none, the default; 2 or 4: the S-split kernels' parts)
#endif
static_assert(KQ_DQ_P == 1 || KQ_DQ_P == 2 || KQ_DQ_P == 4, "KQ_DQ_P: 1, 2 or 4");
#ifndef KQ_DQ_T
#define KQ_DQ_T 32  // the most tail rows (split into parts when KQ_DQ_P > 1) per block
#endif
static_assert(KQ_DQ_T >= 1 && KQ_DQ_T <= 32, "KQ_DQ_T: 1..32");
#ifndef KQ_DQ_MAP
#define KQ_DQ_MAP 1  // 1: block b's rows are b, b + B, ...; 0: a contiguous range
#endif
// KQ_PRE: round sb0 of row `row` (node-global) into c (both rows of a gate/up pair, MODE 2), when
// the row is of the kernel's type (not an F32 row beside) and the lane has that super-block.
// Called before the PDL wait: the weights must be constants (no kernel of the step writes them),
// as every caller's are; unlike the L2 prefetch, a register load could return stale data.
template <class Q, int MODE>
__device__ __forceinline__ void kq_pre_load(const SegTable& t, int row, int K, int sb0, int i, Carry<Q>& c) {
    if (sb0 >= (K >> 8)) return;
    const size_t o = (size_t)sb0 * Q::TS;
    if constexpr (MODE == 2) {
        Q::load((const u8*)t.s[0].w + (size_t)t.row_bytes[0] * row + o, i, c.b[0]);
        Q::load((const u8*)t.s[1].w + (size_t)t.row_bytes[1] * row + o, i, c.b[1]);
        c.have = true;
    } else {
        const int si = find_seg(t, row);  // row: segment-local from here
        if (t.s[si].type == Q::TYPE) {
            Q::load((const u8*)t.s[si].w + (size_t)t.row_bytes[si] * row + o, i, c.b[0]);
            c.have = true;
        }
    }
}
// KQ_PRE, KQ_P2's rows r0, r1 (kq_row2's p0, p1): only when both are of the kernel's type, as
// kq_body then calls kq_row2.
template <class Q>
__device__ __forceinline__ void kq_pre_load2(const SegTable& t, int r0, int r1, int K, int sb0, int i, Carry<Q>& c) {
    if (sb0 >= (K >> 8)) return;
    const int s0 = find_seg(t, r0), s1 = find_seg(t, r1);
    if (t.s[s0].type == Q::TYPE && t.s[s1].type == Q::TYPE) {
        const size_t o = (size_t)sb0 * Q::TS;
        Q::load((const u8*)t.s[s0].w + (size_t)t.row_bytes[s0] * r0 + o, i, c.b[0]);
        Q::load((const u8*)t.s[s1].w + (size_t)t.row_bytes[s1] * r1 + o, i, c.b[1]);
        c.have = true;
    }
}
// KQ_PRE, once x is staged: the carried round's dot(s) (of super-block sb0), as a row loop's first
// iteration adds them (0 + d), into s0 (s1: the second row, TWO), and skip = st, the stride the
// first row's loop then starts later by; nothing without a carried round.
template <class Q, bool TWO>
__device__ __forceinline__ void kq_pre_dot(const Carry<Q>& c, const XS& xa, int sb0, int st, int i,
                                           const typename Q::Lane& w, float& s0, float& s1, int& skip) {
    if (!c.have) return;
    const typename Q::X x = Q::x(xa, sb0, i, w);
    s0 = 0.f + Q::dot(c.b[0], x, i, w);
    if constexpr (TWO) s1 = 0.f + Q::dot(c.b[1], x, i, w);
    skip = st;
}

#if KQ_DQ
template <class Q, int MODE, int NW>
__device__ __forceinline__ void kq_dq_body(const SegTable& t, const float* x, const float* norm, float eps,
                                           int K, int total_rows) {
    __shared__ float scratch[32];
    __shared__ int dq_next;                    // the next unit to hand out
    __shared__ int dq_seen[KQ_DQ_T];                // tail row j: parts added so far
    __shared__ float dq_part[KQ_DQ_T][KQ_DQ_P][2];  // tail row j, part p: (y, up)
    int4* xq = smem4 + (Q::TYPE == T_IQ3_S ? kIq3sDynInt4 : 0);  // (KQ_IQ3S_GRID 32: the grid copies first)
    int* xs = (int*)(xq + K / 8);  // K % 256 == 0 (ops.py): Kp = K
    float* xd = (float*)(xs + K / 8);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nsb = K >> 8;
    constexpr int P = KQ_DQ_P;  // compile-time: with a runtime P every row's loop had a runtime stride (session 17)
#if KQ_DQ_MAP  // the block's k-th row is b + k B (rows dealt round-robin over the blocks)
    const int r0 = 0, nb = (int)blockIdx.x < total_rows ? (total_rows - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x : 0;
    auto grow = [&](int k) { return (int)blockIdx.x + k * (int)gridDim.x; };
#else  // the block's k-th row is r0 + k (a contiguous range)
    const int r0 = (int)((long long)blockIdx.x * total_rows / gridDim.x);
    const int nb = (int)((long long)(blockIdx.x + 1) * total_rows / gridDim.x) - r0;
    auto grow = [&](int k) { return r0 + k; };
#endif
    const int T = min(nb, KQ_DQ_T), F = nb - T, nunits = F + T * P;
    // unit u: its row (node-global), part and parts; j: the tail row's index
    auto unit = [&](int u, int& row, int& p, int& np, int& j) {
        if (u < F) {
            row = grow(u), p = 0, np = 1, j = 0;
        } else {
            j = (u - F) / P;
            row = grow(F + j), p = u - F - j * P, np = P;
        }
    };
    if (threadIdx.x == 0) dq_next = NW;  // units 0..NW-1 are the warps' first (stage_xq's barriers publish these)
    if (threadIdx.x < KQ_DQ_T) dq_seen[threadIdx.x] = 0;
    KQ_MARK(0);
    auto prefetch_first = [&]() {  // the first unit's row(s) to L2 (weights are constants)
        if (warp < nunits) {
            int row, p, np, j;
            unit(warp, row, p, np, j);
            const int si = MODE == 2 ? 0 : find_seg(t, row);
            // (KQ_PF0 3: a full row's first round; a tail part's, np > 1, lies within np rounds)
            prefetch_bytes((const u8*)t.s[si].w + (size_t)t.row_bytes[si] * row, kq_pf0_bytes(t.row_bytes[si], Q::TS, np), lane, 32);
            if (MODE == 2) prefetch_bytes((const u8*)t.s[1].w + (size_t)t.row_bytes[1] * row, kq_pf0_bytes(t.row_bytes[1], Q::TS, np), lane, 32);
        }
    };
    if constexpr (KQ_PF0 == 1 || KQ_PF0 == 3) prefetch_first();  // before the PDL wait (KQ_PF0 above)
    Carry<Q> pre;  // KQ_PRE: the first unit's first round (a full row's super-block grp), loaded now
    pre.have = false;
    if constexpr (KQ_PRE) {
        if (warp < nunits) {
            int row, p, np, j;
            unit(warp, row, p, np, j);
            if (np == 1) kq_pre_load<Q, MODE>(t, row, K, Q::grp(lane), Q::idx(lane), pre);
        }
    }
    Q::setup();
    KQ_CONV_PREFETCH(t);
    if (kq_waits<1>(norm)) pdl_wait();  // (timing-only builds may skip it)
    KQ_MARK(1);
    pdl_trigger();
    if constexpr (KQ_PF0 == 2) prefetch_first();
    const float rs = stage_xq<Q::SW4, kIq4Xil && Q::TYPE == T_IQ4_XS, Q::XL, 1>(x, norm, eps, K, xq, xs, xd, scratch, 0);
    KQ_MARK(2);
    const XS xa = xs_addr(xq, xs, xd);
    const int grp = Q::grp(lane), i = Q::idx(lane);
    const typename Q::Lane w = Q::lane(i);
    float pre0 = 0.f, pre1 = 0.f;  // KQ_PRE: the first unit's round grp, its loop starting 4 later
    int pre_skip = 0;
    if constexpr (KQ_PRE) kq_pre_dot<Q, MODE == 2>(pre, xa, grp, 4, i, w, pre0, pre1, pre_skip);
    for (int u = warp; u < nunits;) {
        int nu = 0;  // the warp's next unit, asked for before this one's loads
        if (lane == 0) nu = atomicAdd(&dq_next, 1);
        // (broadcast here, not after the row: measured H200 session 19, the 27B's gate/up +1.5 %
        // with the broadcast after the row)
        nu = __shfl_sync(0xffffffffu, nu, 0);
        int row, p, np, j;
        unit(u, row, p, np, j);
        KQ_ROW_START(kq_rm, row);  // (KQ_TRACE: the unit's start; row still node-global, find_seg below changes it)
        float y, up = 0.f;
        int si = 0;
        // a full row and a part as separate calls, each with a compile-time stride
        if constexpr (MODE == 2) {
            const u8 *g = (const u8*)t.s[0].w + (size_t)t.row_bytes[0] * row, *h = (const u8*)t.s[1].w + (size_t)t.row_bytes[1] * row;
            const float2 v = np == 1 ? kq_row2<Q>(g, h, xa, w, nsb, grp + pre_skip, 4, i, nullptr, nullptr, nullptr, pre0, pre1)
                                     : kq_row2<Q>(g, h, xa, w, nsb, grp + 4 * p, 4 * P, i);
            y = group_sum<32>(v.x);
            up = group_sum<32>(v.y);
        } else {
            si = find_seg(t, row);  // row: segment-local from here
            const u8* rp = (const u8*)t.s[si].w + (size_t)t.row_bytes[si] * row;
            if (t.s[si].type != Q::TYPE)
                y = np == 1 ? f32_row<Q::SW4, kIq4Xil && Q::TYPE == T_IQ4_XS, Q::XL>(rp, xa, K, lane, 32)
                            : f32_row<Q::SW4, kIq4Xil && Q::TYPE == T_IQ4_XS, Q::XL>(rp, xa, K, lane + 32 * p, 32 * P);
            else
                y = np == 1 ? kq_row<Q>(rp, xa, w, nsb, grp + pre_skip, 4, i, nullptr, nullptr, pre0)
                            : kq_row<Q>(rp, xa, w, nsb, grp + 4 * p, 4 * P, i);
            y = group_sum<32>(y);
        }
        if (np == 1) KQ_ROW_MARK(kq_rm);
        if (lane == 0) {
            if (np == 1) {
                KQ_STORE(MODE, t, si, row, y * rs, up * rs);
            } else {
                volatile float* pp = &dq_part[j][0][0];
                pp[2 * p] = y;
                pp[2 * p + 1] = up;
                __threadfence_block();
                if (atomicAdd(&dq_seen[j], 1) == np - 1) {  // the row's last part: the parts in part order
                    __threadfence_block();
                    float ys = pp[0], us = pp[1];
                    for (int q = 1; q < np; ++q) {
                        ys += pp[2 * q];
                        us += pp[2 * q + 1];
                    }
                    KQ_STORE(MODE, t, si, row, ys * rs, us * rs);
                }
            }
        }
        if constexpr (KQ_PRE) {  // the carried round belonged to the first unit only
            pre0 = pre1 = 0.f;
            pre_skip = 0;
        }
        u = nu;
    }
    KQ_MARK(3);
    KQ_XPF_TAIL(t);
}
#endif

// The kernel body for format trait Q (KQ<T> or KQ4<T>). S (1, 2 or 4; ops.kv9_split) warps
// share a row group: warp w is part ws = w % S of group g = w / S, which takes rows R g + h
// (h < Q::R, the row of its lane group of 32 / R lanes) of every block round; part ws takes the
// super-blocks grp + 4 ws, grp + 4 ws + 4 S, ... of those rows, and part 0 adds the parts
// (shared memory, one barrier per round) and stores. Why S > 1: a row per warp leaves the
// [5120 x K] nodes 1.2 waves of warps at 2 blocks of 16 warps per SM (measured session 8:
// Q6_K [5120x17408] 46.0 us against gemv.cu's 39.9 with 4 warps per row).
// CS > 1 (the KQ_CSPLIT build's _c2 / _c4 instances; S = 1): the S parts of a row group sit in
// the CS blocks of a thread-block cluster (KQ_GSPLIT: of a group of consecutive blocks) instead
// of S warps of one block (see KQ_CSPLIT and KQ_GSPLIT above).
template <class Q, int MODE, int NW, int S, int CS = 1>
__device__ __forceinline__ void kq_body(const SegTable& t, const float* x, const float* norm, float eps,
                                        int K, int total_rows) {
    static_assert(NW % S == 0, "S divides the block's warps");
#if KQ_DQ
    if constexpr (S == 1 && CS == 1 && !IsP2<Q>::v && Q::R == 1) {  // the queue build's rows (kq_dq_body)
        kq_dq_body<Q, MODE, NW>(t, x, norm, eps, K, total_rows);
        return;
    }
#endif
    static_assert(CS == 1 || (S == 1 && MODE != 2 && !IsP2<Q>::v && Q::R == 1 && !KQ_WMAJ),
                  "cluster parts: 8-lane store/add rows, one row per warp, block-major");
    static_assert(CS == 1 || CS == 2 || CS == 4, "cluster parts: 2 or 4");
    constexpr bool P2 = IsP2<Q>::v;  // two rows per warp, every lane on both (KQ_P2)
    static_assert(!(P2 && MODE == 2), "KQ_P2 is for store/add nodes");
    constexpr int LPR = P2 ? 32 : 32 / Q::R;  // lanes per row
    __shared__ float scratch[32];
    __shared__ float part[S > 1 ? 2 : 1][S > 1 ? NW : 1][2 * Q::R];  // [round & 1][warp][(y, up) per row]
    __shared__ float cpart[CS > 1 && !KQ_GSPLIT ? KQ_CS_MAXR : 1][CS][CS > 1 && !KQ_GSPLIT ? NW : 1];  // rank 0's: [round][part][warp]
    int4* xq = smem4 + (Q::TYPE == T_IQ3_S ? kIq3sDynInt4 : 0);  // (KQ_IQ3S_GRID 32: the grid copies first)
    int* xs = (int*)(xq + K / 8);  // K % 256 == 0 (ops.py): Kp = K
    float* xd = (float*)(xs + K / 8);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, h = P2 ? 0 : lane / LPR, l = lane % LPR;
    const int G = NW / S, g = warp / S, ws = warp - g * S;  // row groups per block, this warp's
    // CS > 1: the cluster takes the block's place in the row order; the block's rank is its part
    // wpart (nparts of them) where S > 1 uses the warp's part ws
    const int cb = CS > 1 ? (int)blockIdx.x / CS : (int)blockIdx.x, ncb = CS > 1 ? (int)gridDim.x / CS : (int)gridDim.x;
    const int wpart = CS > 1 ? (KQ_GSPLIT ? (int)blockIdx.x % CS : (int)cluster_rank()) : ws;
    constexpr int nparts = CS > 1 ? CS : S;
    if constexpr (CS > 1 && !KQ_GSPLIT) cluster_arrive_relaxed();  // paired with the wait before the first DSMEM store
#if KQ_WMAJ  // the warp's first row group: warp-major g gridDim.x + b
    const int rpb = Q::R * G, first = Q::R * (g * ncb + cb) + h, step = rpb * ncb;
    const int gstride = ncb;  // row groups between those of the block's warp groups g and g + 1
#else  // block-major b G + g
    const int rpb = Q::R * G, first = rpb * cb + Q::R * g + h, step = rpb * ncb;
    constexpr int gstride = 1;
#endif
    // A row's 128-byte lines to L2 (each of the S parts a share of them; a gate/up pair both rows).
    auto prefetch_row = [&](int r) {
        if (r >= total_rows) return;
        const int si = MODE == 2 ? 0 : find_seg(t, r);
        prefetch_bytes((const u8*)t.s[si].w + (size_t)t.row_bytes[si] * r, t.row_bytes[si], l + LPR * wpart, LPR * nparts);
        if (MODE == 2)
            prefetch_bytes((const u8*)t.s[1].w + (size_t)t.row_bytes[1] * r, t.row_bytes[1], l + LPR * wpart, LPR * nparts);
    };
    // The warp's first row: whole (KQ_PF0 1: prefetch_row), or (KQ_PF0 3, the default) each part's
    // first round only; the KQ_PF rows ahead below stay whole rows.
    auto prefetch_first_row = [&](int r) {
        if constexpr (KQ_PF0 == 3) {
            if (r >= total_rows) return;
            const int si = MODE == 2 ? 0 : find_seg(t, r);
            prefetch_bytes((const u8*)t.s[si].w + (size_t)t.row_bytes[si] * r, kq_pf0_bytes(t.row_bytes[si], Q::TS, nparts),
                           l + LPR * wpart, LPR * nparts);
            if (MODE == 2)
                prefetch_bytes((const u8*)t.s[1].w + (size_t)t.row_bytes[1] * r, kq_pf0_bytes(t.row_bytes[1], Q::TS, nparts),
                               l + LPR * wpart, LPR * nparts);
        } else {
            prefetch_row(r);
        }
    };
    // Before the PDL wait (weights are constants): the first row, overlapping the previous
    // kernel's tail.
    KQ_MARK(0);
    if constexpr (KQ_PF0 == 1 || KQ_PF0 == 3) prefetch_first_row(first);  // (KQ_PF0 above)
    Carry<Q> pre;  // KQ_PRE: the first row's first round (super-block grp + 4 wpart), loaded now
    pre.have = false;
    if constexpr (KQ_PRE) {
        // (a first row past the end: none; the 4-part rotation's first sweep has that round only when
        // every part has a full sweep, kq_row_part's F >= 1)
        if (first < total_rows && (!kKqPartRot<CS> || (((K >> 8) + 3) >> 2) >= nparts)) {
            if constexpr (P2) kq_pre_load2<Q>(t, first, first + 1 < total_rows ? first + 1 : first, K,
                                              Q::grp(lane) + 4 * wpart, Q::idx(lane), pre);
            else kq_pre_load<Q, MODE>(t, first, K, Q::grp(lane) + 4 * wpart, Q::idx(lane), pre);
        }
    }
    Q::setup();     // constants only (IQ3_S: the grid to shared memory; stage_xq's barriers publish it)
    KQ_CONV_PREFETCH(t);
    if (kq_waits<CS>(norm)) pdl_wait();  // x (and the output, for "add") come from the previous kernels
    KQ_MARK(1);
    pdl_trigger();
    if constexpr (KQ_PF0 == 2) prefetch_first_row(first);
    // barriers inside; IQ4_XS rows of an IQ4_XIL build take x with interleaved halves (kwide_iq4.cuh)
    // CS > 1: only the part's super-blocks (no norm: ops.kv9_csplit)
    const float rs = stage_xq<Q::SW4, kIq4Xil && Q::TYPE == T_IQ4_XS, Q::XL, CS>(x, norm, eps, K, xq, xs, xd, scratch, wpart);
    KQ_MARK(2);
    if constexpr (CS > 1 && !KQ_GSPLIT) cluster_wait();  // every block of the cluster has started: DSMEM stores allowed
    const XS xa = xs_addr(xq, xs, xd);
    const int grp = Q::grp(lane), i = Q::idx(lane), nsb = K >> 8;
    const int sb0 = grp + 4 * wpart, st = 4 * nparts;
    const typename Q::Lane w = Q::lane(i);
    float pre0 = 0.f, pre1 = 0.f;  // KQ_PRE: the first row's round sb0, its loop starting st later
    int pre_skip = 0;
    if constexpr (KQ_PRE) kq_pre_dot<Q, MODE == 2 || P2>(pre, xa, sb0, st, i, w, pre0, pre1, pre_skip);
    // The loop bound is block-uniform when S > 1 (every warp reaches each round's barrier) and
    // warp-uniform otherwise (the lane groups iterate while any has a row), so every lane reaches
    // the shuffles; a group without a row computes on row 0 and stores nothing.
    int round = 0;
    Carry<Q> carry;  // KQ_PIPE 2 (kq_row): the next row's first block(s), loaded in this row's last round
    carry.have = false;
    // S > 1: the block's first row group of the round (g = 0) bounds the loop for every warp
    for (int base = first - h; (S > 1 ? base - Q::R * g * gstride : base) < total_rows; base += step, ++round) {
        const int row = base + h;
        const bool live = row < total_rows;
        KQ_ROW_START(kq_rm, row);  // (KQ_TRACE: the row's start; marked below for one whole row per warp)
        if constexpr (kKqPf > 0) prefetch_row(row + kKqPf * step);  // KQ_PF rows ahead of this one
        int r = live ? row : 0, si = 0;
        int nr = row + step;  // this lane's next row (KQ_PIPE 2, KQ_L1PF), if it has one
        const bool nlive = (kKqPipe > 1 || kKqL1pf > 0) && nr < total_rows;
        float y, up = 0.f;  // up: a pair's up row, or (KQ_P2) the warp's second row
        int r1 = 0, si1 = 0;  // KQ_P2: the second row (segment-local) and its segment
        const bool live1 = P2 && row + 1 < total_rows;
        if constexpr (P2) {
            // rows row, row + 1 (their segments may differ; a missing second row repeats the first)
            r1 = live1 ? row + 1 : r;
            si = find_seg(t, r);
            si1 = find_seg(t, r1);
            const u8* p0 = (const u8*)t.s[si].w + (size_t)t.row_bytes[si] * r;
            const u8* p1 = (const u8*)t.s[si1].w + (size_t)t.row_bytes[si1] * r1;
            if (t.s[si].type == Q::TYPE && t.s[si1].type == Q::TYPE) {
                const float2 v = kq_row2<Q>(p0, p1, xa, w, nsb, sb0 + pre_skip, st, i, nullptr, nullptr, nullptr, pre0, pre1);
                y = group_sum<32>(v.x);
                up = group_sum<32>(v.y);
            } else {  // an F32 row among them (qwen35's ssm_in): one row at a time
                y = group_sum<32>(t.s[si].type == Q::TYPE ? kq_row<Q>(p0, xa, w, nsb, sb0, st, i)
                                                          : f32_row<Q::SW4, kIq4Xil && Q::TYPE == T_IQ4_XS, Q::XL>(p0, xa, K, l + 32 * ws, 32 * S));
                up = group_sum<32>(t.s[si1].type == Q::TYPE ? kq_row<Q>(p1, xa, w, nsb, sb0, st, i)
                                                            : f32_row<Q::SW4, kIq4Xil && Q::TYPE == T_IQ4_XS, Q::XL>(p1, xa, K, l + 32 * ws, 32 * S));
            }
        } else if constexpr (MODE == 2) {
            const float2 v = kq_row2<Q>((const u8*)t.s[0].w + (size_t)t.row_bytes[0] * r,
                                        (const u8*)t.s[1].w + (size_t)t.row_bytes[1] * r, xa, w, nsb, sb0 + pre_skip, st, i,
                                        &carry, nlive ? (const u8*)t.s[0].w + (size_t)t.row_bytes[0] * nr : nullptr,
                                        nlive ? (const u8*)t.s[1].w + (size_t)t.row_bytes[1] * nr : nullptr, pre0, pre1);
            y = group_sum<LPR>(v.x);
            up = group_sum<LPR>(v.y);
        } else {
            si = find_seg(t, r);
            const u8* rp = (const u8*)t.s[si].w + (size_t)t.row_bytes[si] * r;
            const u8* np = nullptr;  // the next row if it is of this kernel's type (not an F32 row)
            if (nlive) {
                const int nsi = find_seg(t, nr);
                if (t.s[nsi].type == Q::TYPE) np = (const u8*)t.s[nsi].w + (size_t)t.row_bytes[nsi] * nr;
            }
            // with two rows per warp the groups may sit in different segments: they reconverge
            // before the shuffles
            y = group_sum<LPR>(t.s[si].type == Q::TYPE ? kq_row_sel<Q, nparts, kKqPartRot<CS>>(rp, xa, w, nsb, sb0, st, i, &carry, np, grp, wpart, KQ_PART_ROT == 2 ? base / rpb : round, pre0, pre_skip)
                                                       : f32_row<Q::SW4, kIq4Xil && Q::TYPE == T_IQ4_XS, Q::XL>(rp, xa, K, l + LPR * ws, LPR * S));
        }
#if KQ_TRACE
        if constexpr (S == 1 && CS == 1 && Q::R == 1 && !P2)  // one whole row per warp
            if (live) KQ_ROW_MARK(kq_rm);
#endif
        if constexpr (S > 1) {  // double-buffered by round: part 0 reads [round & 1] before any warp passes
                      // the next round's barrier, so the round after that may overwrite it
            float* pp = part[round & 1][warp];
            if (l == 0) {
                pp[2 * h] = y;
                if (MODE == 2 || P2) pp[2 * h + 1] = up;
            }
            __syncthreads();
            if (ws == 0)
                for (int s = 1; s < S; ++s) {
                    y += part[round & 1][warp + s][2 * h];
                    if (MODE == 2 || P2) up += part[round & 1][warp + s][2 * h + 1];
                }
        }
        if constexpr (CS > 1) {  // the part's sum into rank 0's cpart (store after the loop)
#if KQ_GSPLIT
            if (l == 0 && round < KQ_CS_MAXR) kq_gpart[cb][round][wpart][g] = y;
#else
            if (l == 0 && round < KQ_CS_MAXR) st_cluster_f32(&cpart[round][wpart][g], 0, y);
#endif
        } else if constexpr (P2) {
            if (l == 0 && ws == 0) {
                if (live) KQ_STORE(MODE, t, si, r, y * rs, 0.f);
                if (live1) KQ_STORE(MODE, t, si1, r1, up * rs, 0.f);
            }
        } else if (live && l == 0 && ws == 0) {
            KQ_STORE(MODE, t, si, r, y * rs, up * rs);
        }
        if constexpr (KQ_PRE) {  // the carried round belonged to the first row only
            pre0 = pre1 = 0.f;
            pre_skip = 0;
        }
    }
#if KQ_GSPLIT
    if constexpr (CS > 1) {
        // every part's sums are in kq_gpart before its block counts itself in (fence, then the
        // count); the block counting in last reads them after a fence of its own (ld.cg: not from
        // L1) and, like rank 0 below, adds them in part order; warp g's rows are the same in every
        // block of the group (first and step depend on cb and g only)
        __shared__ int gs_last;
#if KQ_GS_FENCE
        __syncthreads();  // the block's part stores happen before thread 0's fence (cumulativity)
        if (threadIdx.x == 0) {
            __threadfence();
            const int last = atomicAdd(&kq_gcount[cb], 1u) == (unsigned)(CS - 1);
            if (last) __threadfence();  // the other blocks' parts, published by their fences, before the reads
            gs_last = last;
        }
        __syncthreads();
#else
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) gs_last = atomicAdd(&kq_gcount[cb], 1u) == (unsigned)(CS - 1);
        __syncthreads();
#endif
        if (gs_last) {  // (one brace outside the #if: tests/test_pdl_contract.py reads the text)
#if !KQ_GS_FENCE
            __threadfence();
#endif
            if (lane < round && lane < KQ_CS_MAXR) {
                int r = first + lane * step;  // (h = 0, R = 1)
                if (r < total_rows) {
                    float y = __ldcg(&kq_gpart[cb][lane][0][g]);
#pragma unroll
                    for (int q = 1; q < CS; ++q) y += __ldcg(&kq_gpart[cb][lane][q][g]);
                    const int si = find_seg(t, r);
                    KQ_STORE(MODE, t, si, r, y * rs, 0.f);
                }
            }
            if (threadIdx.x == 0) kq_gcount[cb] = 0;  // for the next launch (it reads after its PDL wait)
        }
    }
#else
    if constexpr (CS > 1) {
        // every part's stores have landed in rank 0's shared memory (release / acquire); rank 0
        // adds them in part order, as part 0 of an S = CS row group does, so the outputs are the
        // _s<CS> kernel's bit for bit (CS = 4: with KQ_PART_ROT=0); lane j of warp g stores the row of its round j
        cluster_sync();
        if (wpart == 0 && lane < round && lane < KQ_CS_MAXR) {
            int r = first + lane * step;  // (h = 0, R = 1)
            if (r < total_rows) {
                float y = cpart[lane][0][g];
#pragma unroll
                for (int q = 1; q < CS; ++q) y += cpart[lane][q][g];
                const int si = find_seg(t, r);
                KQ_STORE(MODE, t, si, r, y * rs, 0.f);
            }
        }
    }
#endif
    KQ_MARK(3);
    KQ_XPF_TAIL(t);
}

#ifndef KQ_BLOCK_WARPS
// Warps per block. KQ_BLOCK_WARPS=32 (ops GGUF_HARNESS_GEMV_KQ_BW=32 for every node, or the wide build
// of ops.kv9_wide with KQ_WMAJ; session 15): one block of 32 warps per SM instead of two of 16.
// Why (KQ_TRACE on the H200, session 15, 2x[17408x5120] IQ4_XS): of an SM's two blocks the one
// resident first (up to 15 us before the PDL wait returns) ends first (a warp's loop time against
// its block's entry time: correlation 0.79; per SM, median first / last warp end 18.9 / 30.3 us), so
// for the last third of the kernel most SMs ran one block of 16 warps. With 32-warp blocks the
// correlation was -0.19 and the per-SM ends 24.4 / 27.8 us; staging x took 1.7 us instead of 2.2
// (IQ4_XS and [10240x5120] Q4_K). The Q6_K S > 1 instances spill 4-8 bytes at 32 warps (ptxas 13.0).
#define KQ_BLOCK_WARPS 16
#endif
// (Session 24 measured the queue build at 28 and 20 warps, sized so the 27B's SwiGLU pairs fill their
// last round: the step +1.1 % and +4.0 %; each warp's rows are latency-bound, docs/perf-notes.md.)
static_assert(KQ_BLOCK_WARPS == 16 || KQ_BLOCK_WARPS == 32, "KQ_BLOCK_WARPS: 16 or 32");
// minBlocks below are chosen for blocks of 16 warps; 32-warp blocks take half, at least 1 (2 -> 1:
// 64 registers either way; an A/B KQ_MINB of 3 gets 1, 64 registers, not the 42 of 3 x 16 warps)
template <int MB> constexpr int kKqLbScale = KQ_BLOCK_WARPS == 16 || MB <= 1 ? MB : MB / 2;
// Launch bounds: minBlocks 2 (64 registers) for every 8-lane instance (KQ_MINB, default 2). Why:
// without, ptxas gave the Q6_K S > 1 instances 83 registers, so 1 block of 16 warps per SM
// (NVRTC 13.0, sm_90; session 8); the S = 1 instances stayed uncapped (77-94 registers) until
// the same-run A/B of session 10 (H200, docs/perf-notes.md): minBlocks 2 at S = 1 too made
// Q4_K [10240x5120] 14.07 -> 13.56 us, the Q6_K head 330.1 -> 319.6, the rest within 0.6 %, and
// the 27B decode step 2.4 % faster with the mixed qkv split (7478 -> 7298 us).
// KQ_MINB (ops.kv9_defines, GGUF_HARNESS_GEMV_KQ_MINB): one minBlocks for every 8-lane instance
// (3 blocks of 16 warps = 42 registers, measured slower: session 8); 0 is session 9's default
// (none at S = 1, 2 at S > 1), kept for A/B.
#ifndef KQ_MINB
#define KQ_MINB 2
#endif
// KQ_MINB_IQ3S (ops GGUF_HARNESS_GEMV_KQ_MINB_IQ3S; A/B): when set, the same choice for every IQ3_S
// instance. Session 10: MINB 2 cost the 27B IQ3_S gate/up nodes 5.2 % while it won elsewhere.
// (__launch_bounds__(n, 0) compiles as __launch_bounds__(n): same SASS.) Unset (-1): KQ_MINB's for the IQ3_S store/add instances and 0 for the IQ3_S SwiGLU ones, the
// default since session 12: the 27B's IQ3_S gate/up nodes -5.3 %, the step -0.29 % / -0.32 % in two
// A/Bs (H200, docs/perf-notes.md); the store/add instances spill 20 bytes without the cap.
#ifndef KQ_MINB_IQ3S
#define KQ_MINB_IQ3S -1
#endif
template <int T, int MODE> constexpr int kKqMinB =
    T != T_IQ3_S ? KQ_MINB : KQ_MINB_IQ3S >= 0 ? KQ_MINB_IQ3S : MODE == 2 ? 0 : KQ_MINB;
template <int S, int T, int MODE> constexpr int kKqMinBlocks =
    kKqMinB<T, MODE> == 0 ? (S == 1 ? 0 : 2) : kKqMinB<T, MODE>;
// One kernel instance: name PFX_<mode>_<type>[_s2|_s4], format trait TRAIT<T>, launch bounds
// LB(S, T, MODE) (KQ_LB8 / KQ_LB4), kq_body with S warps per row group.
#define KQ_INSTANCE(PFX, TRAIT, LB, MODE, MNAME, T, TNAME, S, SNAME)                              \
    extern "C" __global__ void LB(S, T, MODE)                                                     \
    PFX##_##MNAME##_##TNAME##SNAME(const SegTable t, const float* x, const float* norm, float eps, \
                                   int K, int total_rows) {                                       \
        kq_body<TRAIT<T>, MODE, KQ_BLOCK_WARPS, S>(t, x, norm, eps, K, total_rows);               \
    }
#define KQ_SPLITS(PFX, TRAIT, LB, MODE, MNAME, T, TNAME)                                          \
    KQ_INSTANCE(PFX, TRAIT, LB, MODE, MNAME, T, TNAME, 1, )                                       \
    KQ_INSTANCE(PFX, TRAIT, LB, MODE, MNAME, T, TNAME, 2, _s2)                                    \
    KQ_INSTANCE(PFX, TRAIT, LB, MODE, MNAME, T, TNAME, 4, _s4)
#define KQ_ALL_MODES(PFX, TRAIT, LB, T, TNAME) KQ_SPLITS(PFX, TRAIT, LB, 0, store, T, TNAME)      \
    KQ_SPLITS(PFX, TRAIT, LB, 1, add, T, TNAME) KQ_SPLITS(PFX, TRAIT, LB, 2, swiglu, T, TNAME)
#define KQ_LB8(S, T, MODE) __launch_bounds__(KQ_BLOCK_WARPS * 32, kKqLbScale<kKqMinBlocks<S, T, MODE>>)
#define KQ_MODES(T, TNAME) KQ_ALL_MODES(gemvkq, KQ, KQ_LB8, T, TNAME)
#if KQ_CSPLIT
// kernel names: gemvkq_<store|add>_<type>_c2 / _c4 (CS blocks of a cluster per row group; the
// KQ_CSPLIT build holds these alone). Launch bounds as the S = 1 instances'.
#if KQ_GSPLIT
#define KQ_CDIMS(CS)  // virtual clusters (KQ_GSPLIT): any grid that is a multiple of CS
#else
#define KQ_CDIMS(CS) __cluster_dims__(CS, 1, 1)
#endif
#define KQ_CINSTANCE(MODE, MNAME, T, TNAME, CS)                                                    \
    extern "C" __global__ void KQ_CDIMS(CS) KQ_LB8(1, T, MODE)                                    \
    gemvkq_##MNAME##_##TNAME##_c##CS(const SegTable t, const float* x, const float* norm, float eps, \
                                     int K, int total_rows) {                                     \
        kq_body<KQ<T>, MODE, KQ_BLOCK_WARPS, 1, CS>(t, x, norm, eps, K, total_rows);              \
    }
#define KQ_CMODES(T, TNAME) KQ_CINSTANCE(0, store, T, TNAME, 2) KQ_CINSTANCE(0, store, T, TNAME, 4) \
    KQ_CINSTANCE(1, add, T, TNAME, 2) KQ_CINSTANCE(1, add, T, TNAME, 4)
KQ_CMODES(T_Q4_K, q4_k) KQ_CMODES(T_Q5_K, q5_k) KQ_CMODES(T_Q6_K, q6_k) KQ_CMODES(T_IQ4_XS, iq4_xs)
KQ_CMODES(T_IQ3_S, iq3_s) KQ_CMODES(T_Q8_0, q8_0) KQ_CMODES(T_Q4_0, q4_0)
#else
// kernel names: gemvkq_<store|add|swiglu>_<q4_k|q5_k|q6_k|iq4_xs|iq3_s|q8_0|q4_0>[_s2|_s4] (S warps
// per row group); the iq3_s ones unless GGUF_HARNESS_GEMV_KQ_IQ3S=0, the q8_0 / q4_0 ones unless
// GGUF_HARNESS_GEMV_KQ_Q0=0 (ops.kv9_kernel)
KQ_MODES(T_Q4_K, q4_k) KQ_MODES(T_Q5_K, q5_k) KQ_MODES(T_Q6_K, q6_k) KQ_MODES(T_IQ4_XS, iq4_xs)
KQ_MODES(T_IQ3_S, iq3_s)
// Q8_0 and Q4_0 (kwide_q0.cuh; ops.GEMV_KQ_Q0): store/add/swiglu only, no _p2 instances
KQ_MODES(T_Q8_0, q8_0) KQ_MODES(T_Q4_0, q4_0)

#ifndef KQ_P2
#define KQ_P2 0
#endif
#if KQ_P2
// kernel names: gemvkq_<store|add>_<type>_p2[_s2|_s4] (two rows per warp; the -DKQ_P2=1 build only)
template <int T> using KQ_P2T = KQP2<KQ<T>>;
#define KQ_P2_MODES(T, TNAME) KQ_SPLITS(gemvkq, KQ_P2T, KQ_LB8, 0, store, T, TNAME##_p2) \
    KQ_SPLITS(gemvkq, KQ_P2T, KQ_LB8, 1, add, T, TNAME##_p2)
KQ_P2_MODES(T_Q4_K, q4_k) KQ_P2_MODES(T_Q5_K, q5_k) KQ_P2_MODES(T_Q6_K, q6_k) KQ_P2_MODES(T_IQ4_XS, iq4_xs)
KQ_P2_MODES(T_IQ3_S, iq3_s)
#endif

// minBlocks per type: Q4_K 2 (56-64 registers either way); Q5_K 1, since ptxas held the
// store/add instances at 64 registers with a 28-byte spill otherwise (NVRTC 13.0, sm_90).
template <int T> constexpr int kKq4MinBlocks = T == T_Q5_K ? 1 : 2;
#define KQ_LB4(S, T, MODE) __launch_bounds__(KQ_BLOCK_WARPS * 32, kKqLbScale<kKq4MinBlocks<T>>)
#define KQ4_MODES(T, TNAME) KQ_ALL_MODES(gemvkq4, KQ4, KQ_LB4, T, TNAME)
// kernel names: gemvkq4_<store|add|swiglu>_<q4_k|q5_k>[_s2|_s4] (4 lanes per super-block, 2 rows
// per warp; S warps per row group)
KQ4_MODES(T_Q4_K, q4_k) KQ4_MODES(T_Q5_K, q5_k)
#endif  // KQ_CSPLIT (the default build: every instance above but the cluster ones)
