// Staging of a GEMV's input vector x in shared memory (stage_xq) and L2 prefetch helpers,
// shared by the GEMV kernels (gemv.cu: engine v4-v8, any format; gemv_kq.cu: one warp per row
// for the wide K-quant / IQ4_XS rows). Moved here unchanged from gemv.cu.
#pragma once
#include "kwide4.cuh"  // xq_slot, xq_slot4: the bank swizzles of the staged codes (kwide.cuh, kwide4.cuh)

#ifdef ACT_Q8_1
// llama.cpp-compatible activation rounding (ops.GEMV_IMPL "q8_1", compiled with -DACT_Q8_1):
// the codes, scale and block sum of ggml-cuda's quantize_q8_1 (quantize.cu): d = amax / 127,
// q = roundf(x / d) (0 for an all-zero block), stored as fp16 d and fp16 sum of the block's
// unquantised values; the legacy formats fold their offset with that sum (gemv.cu legacy_off).
// Purpose: engine-vs-llama.cpp comparisons that isolate kernel differences from the int8
// rounding policy (the default q16 is ~2^8 x more accurate: gemv.cu header).
#define XQ_MAX 127.f
#else
#define XQ_MAX 32767.f
#endif
#define XQ_FLUSH 1e-30f  // blocks with max |x| below this become zeros (XQ_MAX / amax overflows ~1e-34)

// Cluster parts (gemv_kq.cu KQ_CSPLIT): a part takes the groups of 4 super-blocks (128 entries of 8
// values) j = part, part + cs, ... of the nch entries. cs_entries: how many entries that is (a
// multiple of 128, so of 32: warp-uniform); cs_entry: the entry of the part's v-th, or nch (no
// entry) for v >= nv; in a partial last group it is >= nch too, which stage_xq's c < nch test
// skips. A warp's 32 entries stay one aligned run of a super-block (XLANE's records).
// KQ_PART_ROT (gemv_kq.cu kq_row_part; rot = KQ_PART_ROT && cs == 4): a part also stages the
// L = ng mod cs leftover groups F cs .. ng - 1 (F = ng / cs full sweeps), since which part computes
// them changes from row to row: its F groups part + cs k, then the L leftovers.
#ifndef KQ_PART_ROT
#define KQ_PART_ROT 2  // keyed by the row group (the default since session 21; gemv_kq.cu kq_row_part)
#endif
static_assert(KQ_PART_ROT >= 0 && KQ_PART_ROT <= 2, "KQ_PART_ROT: 0 off, 1 keyed by the round, 2 by the row group");
template <int CS> constexpr bool kKqPartRot = KQ_PART_ROT && CS == 4;  // one rule for stage_xq and kq_body
__device__ __forceinline__ int cs_entries(int nch, int cs, int part, bool rot) {
    const int ng = (nch + 127) >> 7;
    if (rot) return 128 * (ng / cs + ng % cs);
    return ng > part ? 128 * ((ng - part + cs - 1) / cs) : 0;
}
__device__ __forceinline__ int cs_entry(int v, int nv, int nch, int cs, int part, bool rot) {
    if (rot) {
        const int g = v >> 7, F = ((nch + 127) >> 7) / cs;
        return v < nv ? (((g < F ? g * cs + part : F * cs + g - F) << 7) | (v & 127)) : nch;
    }
    return v < nv ? ((((v >> 7) * cs + part) << 7) | (v & 127)) : nch;
}

// Largest |v| and whether any value is NaN/Inf, over a thread's 8 values and then the 4 lanes
// 4j..4j+3 that hold one 32-value block (every lane of the 4 gets the block's); shared by
// stage_xq and gemv_mma.cu's stage_x8.
__device__ __forceinline__ void block_amax_bad(const float (&v)[8], float& am, int& bad) {
    am = 0.f;
    bad = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        am = fmaxf(am, fabsf(v[k]));
        bad |= !finite_f32(v[k]);
    }
    am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, 1));
    am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, 2));
    bad |= __shfl_xor_sync(0xffffffffu, bad, 1);
    bad |= __shfl_xor_sync(0xffffffffu, bad, 2);
}

// Shared-memory layout for K values, Kp = K rounded up to 256 (zero codes beyond K):
//   int4  xq[Kp / 8]   8 int16 codes per entry; entry c (values 8c..8c+7) is stored at slot
//                      xq_slot(c) (kwide.cuh: a bit swizzle inside each group of 8 entries
//                      that keeps the wide path's 16-byte loads free of bank conflicts)
//   int   xs[Kp / 8]   sum of the 8 codes of that entry
//   float xd[Kp / 32]  scale of each 32-value block (NaN if the block held NaN/Inf)
//   float xf[Kp / 32]  q8_1 only: a quarter of the block's fp16 sum of values, in code units
// Bytes: 2.625 Kp, q8_1 2.75 Kp (mirrored by backends/engine/ops.py gemv_smem).
//
// One pass over x: with an RMSNorm, the codes are those of y = x * norm_weight and the
// norm's scalar 1/rms(x) is returned, to be applied to each finished row sum (scaling a
// block does not change its codes, so this equals quantising the normalised vector up to
// float rounding at code ties); without a norm it returns 1. The block reduction's
// barriers also publish the shared-memory codes.
// SW4: entries at xq_slot4 (the 4-lanes-per-super-block rows of kwide4.cuh) instead of xq_slot.
// IL: each 32-value block's halves interleaved (kwide_iq4.cuh IQ4_XIL): entry 4b + k holds values
// 4k, 4k + 16, 4k + 1, 4k + 17, 4k + 2, 4k + 18, 4k + 3, 4k + 19 of block b (the same 32 values per
// block: scales, flush and NaN marks unchanged; the entry sums xs are of those 8 codes).
// XL (1, 2; kwide.cuh XLANE): entries in lane records at xl_slot (xq and xs replaced by the records,
// same bytes; xd natural); each warp stages one super-block (32 consecutive entries), so a record's
// run sums and scales come from its neighbours by shuffles.
// CS > 1 (gemv_kq.cu KQ_CSPLIT, no norm): only the entries of the super-blocks sb with
// (sb / 4) % CS == part (those kq_body's cluster part reads), at CS = 4 (KQ_PART_ROT) those of the
// leftover groups too; the others are left unwritten.
template <bool SW4 = false, bool IL = false, int XL = 0, int CS = 1>
__device__ __forceinline__ float stage_xq(const float* __restrict__ x, const float* __restrict__ norm,
                                          float eps, int K, int4* xq, int* xs, float* xd, float* scratch,
                                          int part = 0) {
    static_assert(XL == 0 || (!SW4 && !IL), "XL: lane records of the 8-lane K-quant rows only");
#ifdef ACT_Q8_1
    static_assert(XL == 0, "XL: q16 staging only");
#endif
#ifdef DIAG_NOSTAGE
    // timing-only build (module.py GGUF_HARNESS_DIAG): the rows read whatever shared memory holds
    __syncthreads();
    return 1.f;
#endif
    const bool vec = (K & 7) == 0;
    const int nch = ((K + 255) >> 8) * 32;  // multiple of 32: the c < nch test is warp-uniform
#ifdef ACT_Q8_1
    float* xf = xd + nch / 4;
#endif
    float ss = 0.f;
    // CS > 1: the entries of part `part` only, as c = cs_entry (the super-blocks of kq_body's part)
    constexpr bool rot = kKqPartRot<CS>;  // kq_row_part's leftover groups
    const int nv = CS > 1 ? cs_entries(nch, CS, part, rot) : nch;
#pragma unroll 2
    for (int c0 = 0; c0 < nv; c0 += blockDim.x) {
        const int c = CS > 1 ? cs_entry(c0 + threadIdx.x, nv, nch, CS, part, rot) : c0 + threadIdx.x, i0 = 8 * c;
        float v[8];
        // value index of the entry's code j (IL: block 32 (c >> 2), quad c & 3, halves interleaved)
        auto at = [&](int j) { return IL ? 32 * (c >> 2) + 4 * (c & 3) + (j >> 1) + 16 * (j & 1) : i0 + j; };
        if (IL && vec && 32 * (c >> 2) + 32 <= K) {
            const int f = 8 * (c >> 2) + (c & 3);  // float4 of values 4k..4k+3; +4: 4k+16..
            const float4 a = ((const float4*)x)[f], b = ((const float4*)x)[f + 4];
            v[0] = a.x; v[1] = b.x; v[2] = a.y; v[3] = b.y; v[4] = a.z; v[5] = b.z; v[6] = a.w; v[7] = b.w;
            if (norm) {
                // the sum of squares over the natural entry c (values 8c..8c+7) in the default's
                // order, so rs (and with it every output) is the default build's bit for bit
                const float4 ra = ((const float4*)x)[2 * c], rb = ((const float4*)x)[2 * c + 1];
                ss += ra.x * ra.x + ra.y * ra.y + ra.z * ra.z + ra.w * ra.w + rb.x * rb.x + rb.y * rb.y + rb.z * rb.z + rb.w * rb.w;
                const float4 na = ((const float4*)norm)[f], nb = ((const float4*)norm)[f + 4];
                v[0] *= na.x; v[1] *= nb.x; v[2] *= na.y; v[3] *= nb.y; v[4] *= na.z; v[5] *= nb.z; v[6] *= na.w; v[7] *= nb.w;
            }
        } else if (!IL && vec && i0 + 8 <= K) {
            const float4 a = ((const float4*)x)[2 * c], b = ((const float4*)x)[2 * c + 1];
            v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
            if (norm) {
                const float4 na = ((const float4*)norm)[2 * c], nb = ((const float4*)norm)[2 * c + 1];
                ss += v[0] * v[0] + v[1] * v[1] + v[2] * v[2] + v[3] * v[3] + v[4] * v[4] + v[5] * v[5] + v[6] * v[6] + v[7] * v[7];
                v[0] *= na.x; v[1] *= na.y; v[2] *= na.z; v[3] *= na.w; v[4] *= nb.x; v[5] *= nb.y; v[6] *= nb.z; v[7] *= nb.w;
            }
        } else {
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                const int ik = at(k);
                v[k] = ik < K ? x[ik] : 0.f;
                if (norm) {
                    // IL: natural order, but one square at a time, where the natural build sums a
                    // full in-bounds entry as one 8-term expression: bitwise equal to it only for
                    // K % 32 == 0 (every IL caller: IQ4_XS rows, K % 256 == 0; this branch then
                    // sees only the padding entries, c >= K / 8)
                    if constexpr (IL) {
                        const float xn = i0 + k < K ? x[i0 + k] : 0.f;
                        ss += xn * xn;
                    } else {
                        ss += v[k] * v[k];
                    }
                    v[k] = ik < K ? v[k] * norm[ik] : 0.f;
                }
            }
        }
        float am;
        int bad;
        block_amax_bad(v, am, bad);
#ifdef ACT_Q8_1
        float bs = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
        bs += __shfl_xor_sync(0xffffffffu, bs, 1);
        bs += __shfl_xor_sync(0xffffffffu, bs, 2);
#endif
        if (c < nch) {
            int q[8], s = 0;
#ifdef ACT_Q8_1
            const float dq = am / XQ_MAX;
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                q[k] = am > XQ_FLUSH ? (int)roundf(v[k] / dq) : 0;  // below: d is subnormal or 0
                s += q[k];
            }
            if ((c & 3) == 0) xf[c >> 2] = bs;  // raw block sum; fp16-rounded after the norm
#else
            const float id = am > XQ_FLUSH ? XQ_MAX / am : 0.f;
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                q[k] = __float2int_rn(v[k] * id);
                s += q[k];
            }
#endif
            if constexpr (XL != 0) {
                // lane (entry e of this warp's super-block): a record starts at each run-A entry
                // e (xl_pos 0); run B starts 4 (XL 1) or 8 (XL 2) entries later
                constexpr int dB = XL == 1 ? 4 : 8;
                const float sc = bad ? __int_as_float(0x7fc00000) : am / XQ_MAX;  // as xd below
                const int e = c & 31, pair = s + __shfl_down_sync(0xffffffffu, s, 1);
                const int pairb = __shfl_down_sync(0xffffffffu, pair, dB);
                const float scb = __shfl_down_sync(0xffffffffu, sc, dB);
                const int slot = xl_slot<XL>(c);
                xq[slot] = make_int4((q[0] & 0xffff) | (q[1] << 16), (q[2] & 0xffff) | (q[3] << 16),
                                     (q[4] & 0xffff) | (q[5] << 16), (q[6] & 0xffff) | (q[7] << 16));
                if (xl_pos<XL>(e) == 0) xq[slot + 4] = make_int4(pair, pairb, __float_as_int(sc), __float_as_int(scb));
                if ((c & 3) == 0) xd[c >> 2] = sc;
            } else {  // as before XL existed (the two branches' packing is written out in each:
                      // hoisting it changed the XL instances' SASS from the measured build's)
                xq[SW4 ? xq_slot4(c) : xq_slot(c)] = make_int4((q[0] & 0xffff) | (q[1] << 16), (q[2] & 0xffff) | (q[3] << 16),
                                  (q[4] & 0xffff) | (q[5] << 16), (q[6] & 0xffff) | (q[7] << 16));
                xs[c] = s;
                // NaN/Inf must survive quantisation so the finite checks can name this node
                if ((c & 3) == 0) xd[c >> 2] = bad ? __int_as_float(0x7fc00000) : am / XQ_MAX;
            }
        }
    }
    const float tot = block_sum(ss, scratch);  // barriers: codes visible to every warp
    const float rs = norm ? rsqrtf(tot / (float)K + eps) : 1.f;
#ifdef ACT_Q8_1
    // llama.cpp rounds the scale and the sum of the *normalised* block to fp16: ds = fp16(d rs),
    // sy = fp16(sum rs). The row sums are multiplied by rs at the end, so xd holds ds / rs, and
    // xf a quarter of sy in code units (sy / (4 ds)): each of the block's 4 lanes adds its share
    // of the offset term (legacy_off). A block whose ds underflows fp16 contributes nothing.
    for (int b = threadIdx.x; b < nch / 4; b += blockDim.x) {
        const float ds = h2f(f2h(xd[b] * rs)), sy = h2f(f2h(xf[b] * rs));
        xd[b] = ds / rs;  // NaN (a non-finite block) stays NaN
        xf[b] = ds != 0.f ? 0.25f * sy / ds : 0.f;
    }
    __syncthreads();
#endif
    return rs;
}

__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Ask L2 for the 128-byte lines of `rows` bytes at p; the warps of a row share the lines.
__device__ __forceinline__ void prefetch_bytes(const u8* p, int nbytes, int first, int step) {
    const u8* end = p + nbytes;
    for (const u8* a = (const u8*)((size_t)p & ~(size_t)127) + 128 * first; a < end; a += 128 * step)
        prefetch_l2(a);
}

