// Engine v10 GEMV (A/B, GGUF_HARNESS_GEMV_TMA=1; ops.gemv, tma_plan.py): y[r] = sum_k W[r, k] x[k]
// for the nodes v9 takes (one of Q4_K, Q5_K, Q6_K, IQ4_XS, IQ3_S; K a multiple of 256; q16
// activations; no F32 rows), with v9's arithmetic per super-block (the 8-lane rows of
// kq_traits.cuh: kwide.cuh, kwide_iq4.cuh, kwide_iq3s.cuh), so the results equal v9's up to the
// order of the fp32 additions. What changes is how the weights reach the registers.
//
// Why (docs/perf-notes.md sessions 8-10): v9 is latency-bound. ncu on the H200: DRAM 28-47 % busy,
// issue slots 38-56 %, 1.1-1.9 eligible warps per scheduler, long-scoreboard stalls first; every
// attempt to put more loads in flight from registers (UNROLL 3/4, PIPE 1/2, L1/L2 prefetch,
// minBlocks 3) was slower or the same. A warp can only have the bytes in flight that its
// registers hold, and the dots need those registers too. Little's law asks for ~25 KB in flight
// per SM (4.2 TB/s x ~0.8 us / 132 SMs).
// Here the copy engine (TMA, cp.async.bulk) moves the weights into a ring of NST shared-memory
// stages, one producer warp issuing the copies, NW consumer warps computing from the stages:
// bytes in flight per SM = the ring (~100-180 KB, tma_plan.py), independent of registers.
//
// Work: block b of G (one per SM, persistent) takes rows [b R / G, (b + 1) R / G) of the node's
// R rows (every block the same bytes to +-1 row: no wave quantisation, unlike v9's grid-stride
// rows). Those rows go in tiles of NW consecutive rows (warp w: tile row w), each tile in chunks
// of kc super-blocks (the last chunk of a row may be shorter); one stage = one chunk of every row
// of the tile (x2 for a gate/up pair), one cp.async.bulk per row and matrix, all completing on
// the stage's "full" mbarrier; the consumers free a stage through its "empty" mbarrier. With
// TMA_RPW 2 (store/add nodes) a tile is 2 NW rows and warp w takes rows 2w and 2w + 1 with one x
// read per round (as gemv_kq.cu's KQ_P2).
// A lane keeps its row's partial in a register across the chunks of a tile, so the sums are
// deterministic (fixed lanes, fixed order: no atomics), as the engine's bitwise-rerun check needs.
//
// Bulk copies need 16-byte aligned addresses and sizes: a row chunk at global address a (Q6_K,
// IQ3_S rows are not multiples of 16 bytes) is copied from a & ~15 to the next multiple of 16
// past its end into a 16-byte aligned slot, and read at slot + (a & 15): every address keeps its
// value mod 16, which is all the 8-lane loads assume. The copy reads up to 15 bytes past a
// matrix's end: inside the arena's 256-byte padding (arena.py ALIGN) or a CuPy allocation's
// 512-byte unit; ops.gemv checks 16-byte aligned matrix starts.
//
// Shared memory: stage_xq's x (2.625 K bytes), then the ring: NST stages x NP matrices x TR slots
// (TR = kTileRows: NW x TMA_RPW, a pair NW) of slot bytes (tma_plan.py). Barriers are static. TMA_NST, TMA_WARPS, TMA_MINB: A/B builds
// (ops.tma_defines) with a ring small enough for 2-3 blocks per SM, i.e. room for the previous and
// next kernels' blocks (the session-10 lesson: ~200 KB per SM cost the step its kernel overlap).
// PTX: cp.async.bulk, mbarrier (PTX ISA 8.0, sm_90; CUDA C++ Programming Guide, "Asynchronous
// Data Copies using the Tensor Memory Accelerator").
#include "qdot.cuh"  // (named here: module.py prefixes the I-quant tables to sources that include it)
#include "xstage.cuh"
#include "kq_traits.cuh"
static_assert(KQ_IQ3S_GRID != 32, "gemv_tma.cu stages x at the start of its dynamic shared memory: no dynamic IQ3_S grid");
#include "segs.cuh"

extern __shared__ int4 smem4[];  // x (stage_xq layout), then the stage ring at byte offset ring_off

#ifndef TMA_NST
#define TMA_NST 4  // stages in the ring
#endif
constexpr int kNst = TMA_NST;
#ifndef TMA_RPW
#define TMA_RPW 1  // rows per consumer warp in store/add nodes (2: kernels/gemv_kq.cu KQ_P2's sharing of x)
#endif
static_assert(TMA_RPW == 1 || TMA_RPW == 2, "TMA_RPW is 1 or 2");
// Tile rows of a node: NW consumer warps x rows per warp (a gate/up pair: one row of each matrix).
template <int MODE, int NW> constexpr int kTileRows = NW * (MODE == 2 ? 1 : TMA_RPW);

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {  // one arrival + bytes to come
    asm volatile("{ .reg .b64 st; mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1; }" ::"r"(bar), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("{ .reg .b64 st; mbarrier.arrive.shared::cta.b64 st, [%0]; }" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile(
        "{ .reg .pred p;\n"
        "W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra W; }" ::"r"(bar), "r"(parity) : "memory");
}
// bytes (multiple of 16) from global src (16-byte aligned) to shared dst, completing on bar
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// Where stage n is in block b's sequence: tile (TR rows from r0 + TR tile), chunk of kc blocks.
struct TmaPlan {
    int r0, r1;   // the block's rows [r0, r1)
    int nsb, kc;  // super-blocks per row, per chunk
    int nch;      // chunks per row
    u32 slot;     // bytes per row slot (a multiple of 16)
};

// Global address of row `row`'s chunk c of matrix m (0, or 1 for a pair's up rows) and its bytes.
template <class Q, int MODE> __device__ __forceinline__ const u8* chunk_src(const SegTable& t, const TmaPlan& p,
                                                                              int row, int m, int c, u32& len) {
    int si = MODE == 2 ? m : find_seg(t, row);  // row becomes the segment's row
    const int sb = c * p.kc;
    len = (u32)(min(p.kc, p.nsb - sb) * Q::TS);
    return (const u8*)t.s[si].w + (size_t)t.row_bytes[si] * row + (size_t)sb * Q::TS;
}

// The producer: lane l < NP TR issues the copy of tile row l % TR of matrix l / TR (TR tile rows);
// lane 0 arms the stage's full barrier with the stage's bytes first (a warp sum of the copies' sizes).
template <class Q, int MODE, int NW>
__device__ __forceinline__ void produce(const SegTable& t, const TmaPlan& p, int n, u32 ring, u32 full) {
    constexpr int NP = MODE == 2 ? 2 : 1, TR = kTileRows<MODE, NW>;
    static_assert(NP * TR <= 32, "one producer lane per copy");
    const int lane = threadIdx.x & 31, tile = n / p.nch, c = n - tile * p.nch, s = n % kNst;
    const int row = p.r0 + TR * tile + lane % TR, m = lane / TR;
    u32 bytes = 0;
    const u8* a = nullptr;
    if (lane < NP * TR && row < p.r1) {
        u32 len;
        const u8* src = chunk_src<Q, MODE>(t, p, row, m, c, len);
        a = (const u8*)((size_t)src & ~(size_t)15);
        bytes = ((u32)(src - a) + len + 15u) & ~15u;
    }
    const u32 total = __reduce_add_sync(0xffffffffu, bytes);
    if (lane == 0) mbar_expect_tx(full + 8 * s, total);
    __syncwarp();
    if (bytes) bulk_copy(ring + ((s * NP + m) * TR + lane % TR) * p.slot, a, bytes, full + 8 * s);
}

template <class Q, int MODE, int NW>
__device__ __forceinline__ void tma_body(const SegTable& t, const float* x, const float* norm, float eps, int K,
                                         int total_rows, int kc, int slot, int ring_off) {
    constexpr int NP = MODE == 2 ? 2 : 1, TR = kTileRows<MODE, NW>, RPW = TR / NW;
    __shared__ float scratch[32];
    __shared__ __align__(8) unsigned long long bars[2 * kNst];  // [full x NST, empty x NST]
    int4* xq = smem4;
    int* xs = (int*)(smem4 + K / 8);
    float* xd = (float*)(xs + K / 8);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    TmaPlan p;
    p.r0 = (int)((long long)total_rows * blockIdx.x / gridDim.x);
    p.r1 = (int)((long long)total_rows * (blockIdx.x + 1) / gridDim.x);
    p.nsb = K >> 8;
    p.kc = kc;
    p.nch = (p.nsb + kc - 1) / kc;
    p.slot = (u32)slot;
    const int nst = (p.r1 - p.r0 + TR - 1) / TR * p.nch;  // stages of this block
    const u32 full = smem_addr(bars), empty = full + 8 * kNst, ring = smem_addr(smem4) + (u32)ring_off;
    if (threadIdx.x == 0) {
        for (int s = 0; s < kNst; ++s) {
            mbar_init(full + 8 * s, 1);
            mbar_init(empty + 8 * s, NW);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    Q::setup();
    __syncthreads();
    // Weights are constants: the first stages are asked for before the PDL wait.
    if (warp == NW)
        for (int n = 0; n < min(kNst, nst); ++n) produce<Q, MODE, NW>(t, p, n, ring, full);
    pdl_wait();  // x (and the output, for "add") come from the previous kernels
    pdl_trigger();
    // barriers inside; interleaved halves for IQ4_XS in an IQ4_XIL build (kwide_iq4.cuh)
    const float rs = stage_xq<false, kIq4Xil && Q::TYPE == T_IQ4_XS, Q::XL>(x, norm, eps, K, xq, xs, xd, scratch);
    if (warp == NW) {  // the producer: stage n + NST once every consumer has left stage n
        for (int n = kNst; n < nst; ++n) {
            mbar_wait(empty + 8 * (n % kNst), ((n / kNst) - 1) & 1);
            produce<Q, MODE, NW>(t, p, n, ring, full);
        }
        return;
    }
    const XS xa = xs_addr(xq, xs, xd);
    const int grp = Q::grp(lane), i = Q::idx(lane);
    const typename Q::Lane w = Q::lane(i);
    for (int n = 0, tile = 0; n < nst; ++tile) {
        const int row = p.r0 + TR * tile + RPW * warp;  // RPW 2: rows row, row + 1 (slots RPW warp + 0, 1)
        const bool live = row < p.r1, live1 = RPW == 2 && row + 1 < p.r1;
        float a0 = 0.f, a1 = 0.f;
        for (int c = 0; c < p.nch; ++c, ++n) {
            const int s = n % kNst;
            mbar_wait(full + 8 * s, (n / kNst) & 1);
            if (live) {
                u32 len;
                const int sb0 = c * p.kc, cnt = min(p.kc, p.nsb - sb0);
                const u8* src0 = chunk_src<Q, MODE>(t, p, row, 0, c, len);
                const u8* b0 = (const u8*)smem4 + ring_off + ((s * NP) * TR + RPW * warp) * p.slot + ((size_t)src0 & 15);
                if constexpr (MODE == 2 || RPW == 2) {
                    // the pair's up row (matrix 1, same tile row), or the warp's second row (a
                    // missing one: the first again, not stored)
                    const u8* b1 = b0;
                    if (MODE == 2 || live1) {
                        const u8* src1 = chunk_src<Q, MODE>(t, p, MODE == 2 ? row : row + 1, MODE == 2 ? 1 : 0, c, len);
                        b1 = (const u8*)smem4 + ring_off + ((s * NP + (MODE == 2)) * TR + RPW * warp + (MODE != 2)) * p.slot +
                             ((size_t)src1 & 15);
                    }
#pragma unroll 2
                    for (int k = grp; k < cnt; k += 4) {
                        typename Q::Blk g, u;
                        Q::load(b0 + k * Q::TS, i, g);
                        Q::load(b1 + k * Q::TS, i, u);
                        const typename Q::X xv = Q::x(xa, sb0 + k, i, w);
                        a0 += Q::dot(g, xv, i, w);
                        a1 += Q::dot(u, xv, i, w);
                    }
                } else {
#pragma unroll 2
                    for (int k = grp; k < cnt; k += 4) {
                        typename Q::Blk r;
                        Q::load(b0 + k * Q::TS, i, r);
                        a0 += Q::dot(r, Q::x(xa, sb0 + k, i, w), i, w);
                    }
                }
            }
            __syncwarp();
            if (lane == 0) mbar_arrive(empty + 8 * s);
        }
        if (live) {  // warp-uniform
            const float y = warp_sum(a0), up = MODE == 2 || RPW == 2 ? warp_sum(a1) : 0.f;
            int r = row;
            const int si = MODE == 2 ? 0 : find_seg(t, r);
            if (lane == 0) store_row<MODE>(t.s[si], r, y * rs, MODE == 2 ? up * rs : 0.f);
            if (RPW == 2 && live1) {
                int r1 = row + 1;
                const int si1 = find_seg(t, r1);
                if (lane == 0) store_row<MODE>(t.s[si1], r1, up * rs, 0.f);
            }
        }
    }
}

#ifndef TMA_WARPS
#define TMA_WARPS 16  // consumer warps per block (tile rows); the block has one more, the producer
#endif
static_assert(TMA_WARPS == 4 || TMA_WARPS == 8 || TMA_WARPS == 16, "a pair's 2 x TMA_WARPS copies: one producer lane each");
#ifndef TMA_MINB
#define TMA_MINB 1  // minBlocks (ops.tma_defines): 2 or 3 with a small ring, so neighbours' blocks fit beside
#endif
// One instance per (mode, type): gemvtma_<store|add|swiglu>_<q4_k|q5_k|q6_k|iq4_xs|iq3_s>.
// Arguments: v9's (SegTable by value, x, norm, eps, K, total_rows), then kc (super-blocks per
// chunk), slot (bytes per row slot) and ring_off (byte offset of the ring in shared memory).
#define TMA_INSTANCE(MODE, MNAME, T, TNAME)                                                                    \
    extern "C" __global__ void __launch_bounds__((TMA_WARPS + 1) * 32, TMA_MINB)                              \
    gemvtma_##MNAME##_##TNAME(const SegTable t, const float* x, const float* norm, float eps, int K,            \
                              int total_rows, int kc, int slot, int ring_off) {                                 \
        tma_body<KQ<T>, MODE, TMA_WARPS>(t, x, norm, eps, K, total_rows, kc, slot, ring_off);                   \
    }
#define TMA_MODES(T, TNAME) TMA_INSTANCE(0, store, T, TNAME) TMA_INSTANCE(1, add, T, TNAME) \
    TMA_INSTANCE(2, swiglu, T, TNAME)
TMA_MODES(T_Q4_K, q4_k) TMA_MODES(T_Q5_K, q5_k) TMA_MODES(T_Q6_K, q6_k) TMA_MODES(T_IQ4_XS, iq4_xs)
TMA_MODES(T_IQ3_S, iq3_s)
