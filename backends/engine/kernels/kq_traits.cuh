// Format traits of the engine's 8-lane K-quant / IQ rows (kwide.cuh, kwide_iq4.cuh,
// kwide_iq3s.cuh) as one interface, shared by gemv_kq.cu (v9: weights loaded from global memory)
// and gemv_tma.cu (v10: the same loads from shared-memory copies of the weights). Moved here
// unchanged from gemv_kq.cu (session 10).
#pragma once
#include "kwide_iq4.cuh"
#include "kwide_iq3s.cuh"
#include "kwide4.cuh"
#include "kwide_q0.cuh"

// Lane mappings of a warp: 8 lanes per super-block, one row per warp (kwide.cuh's rows), or 4
// lanes per super-block, two rows per warp (16 lanes each; kwide4.cuh, x staged with xq_slot4).
// grp: the lane's super-block of a round (4 per round and row), idx: its place in that block.
// setup: block-wide preparation before the PDL wait, published by stage_xq's barriers (IQ3_S:
// its grid table into shared memory); nothing for the others.
struct Lanes8 {
    static constexpr int R = 1;
    static constexpr bool SW4 = false;
    static constexpr int XL = 0;  // x staging: 0 xq_slot / xq_slot4, 1 / 2 lane records (kwide.cuh XLANE)
    static __device__ __forceinline__ void setup() {}
    static __device__ __forceinline__ int grp(int lane) { return lane >> 3; }
    static __device__ __forceinline__ int idx(int lane) { return lane & 7; }
};
struct Lanes4 {
    static constexpr int R = 2;
    static constexpr bool SW4 = true;
    static constexpr int XL = 0;
    static __device__ __forceinline__ void setup() {}
    static __device__ __forceinline__ int grp(int lane) { return (lane >> 2) & 3; }
    static __device__ __forceinline__ int idx(int lane) { return lane & 3; }
};

#ifndef KQ_XLANE
#define KQ_XLANE 0  // 1: Q4_K / Q5_K / Q6_K rows read x from lane records (kwide.cuh XLANE; gemv_kq.cu's default)
#endif
// One format's super-block step: lane constants, raw block registers, activations, the dot.
template <int T> struct KQ : Lanes8 {
    static constexpr int TYPE = T;
    static constexpr int XL = KQ_XLANE ? (T == T_Q6_K ? 2 : 1) : 0;
    using Lane = WLane;
    using Blk = WBlk<T>;
    using X = WX;
    static constexpr int TS = Fmt<T>::TS;
    static __device__ __forceinline__ Lane lane(int i) { return wide_lane<T>(i); }
    static __device__ __forceinline__ void load(const u8* b, int i, Blk& r) { wide_load<T>(b, i, r); }
    static __device__ __forceinline__ X x(const XS& xa, int sb, int i, const Lane& w) {
        if constexpr (XL != 0) return wide_x_lane(xa, sb, i);
        else return wide_x(xa, sb, w);
    }
    static __device__ __forceinline__ float dot(const Blk& r, const X& x, int i, const Lane&) {
        return wide_dot<T>(r, x, i);
    }
};
template <> struct KQ<T_IQ4_XS> : Lanes8 {
    static constexpr int TYPE = T_IQ4_XS;
    using Lane = WLaneIq4;
    using Blk = WIq4;
    using X = WXIq4;
    static constexpr int TS = Fmt<T_IQ4_XS>::TS;
    static __device__ __forceinline__ Lane lane(int i) { return wide_lane_iq4(i); }
    static __device__ __forceinline__ void load(const u8* b, int i, Blk& r) { wide_load_iq4(b, i, r); }
    static __device__ __forceinline__ X x(const XS& xa, int sb, int i, const Lane& w) {
        return wide_x_iq4(xa, sb, i, w);
    }
    static __device__ __forceinline__ float dot(const Blk& r, const X& x, int, const Lane& w) {
        return wide_dot_iq4(r, x, w);
    }
};
template <> struct KQ<T_IQ3_S> : Lanes8 {
    static constexpr int TYPE = T_IQ3_S;
    using Lane = WLaneIq3;
    using Blk = WIq3;
    using X = WXIq3;
    static constexpr int TS = Fmt<T_IQ3_S>::TS;
    static __device__ __forceinline__ void setup() { iq3s_grid_setup(); }
    static __device__ __forceinline__ Lane lane(int i) { return wide_lane_iq3s(i); }
    static __device__ __forceinline__ void load(const u8* b, int i, Blk& r) { wide_load_iq3s(b, i, r); }
    static __device__ __forceinline__ X x(const XS& xa, int sb, int i, const Lane& w) {
        return wide_x_iq3s(xa, sb, i, w);
    }
    static __device__ __forceinline__ float dot(const Blk& r, const X& x, int, const Lane& w) {
        return wide_dot_iq3s(r, x, w);
    }
};
// Q8_0 / Q4_0 (kwide_q0.cuh): a "super-block" of 8 blocks, lane i takes block i (TS: the 8 blocks)
template <int T> struct KQQ0 : Lanes8 {
    static constexpr int TYPE = T;
    using Lane = WLaneQ0;
    using Blk = WQ0<T>;
    using X = WXQ0;
    static constexpr int TS = 8 * Fmt<T>::TS;
    static __device__ __forceinline__ Lane lane(int i) { return wide_lane_q0<T>(i); }
    static __device__ __forceinline__ void load(const u8* b, int i, Blk& r) { wide_load_q0<T>(b, i, r); }
    static __device__ __forceinline__ X x(const XS& xa, int sb, int i, const Lane& w) { return wide_x_q0<T>(xa, sb, i, w); }
    static __device__ __forceinline__ float dot(const Blk& r, const X& x, int, const Lane& w) {
        return wide_dot_q0<T>(r, x, w);
    }
};
template <> struct KQ<T_Q8_0> : KQQ0<T_Q8_0> {};
template <> struct KQ<T_Q4_0> : KQQ0<T_Q4_0> {};
