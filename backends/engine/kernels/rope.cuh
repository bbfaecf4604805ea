// RoPE (NEOX pairs) and fp16 row helpers shared by the decode attention kernels
// (attention_gqa.cu v5, attention_head.cu v6). Semantics: ggml_rope_ext mode NEOX as used by
// llama.cpp src/models/qwen2.cpp: pairs (p, p + n_rot/2), theta = freq_scale * pos *
// freq_base^(-2p/n_rot), fp32 as ggml computes it.
#pragma once
#include "common.cuh"

// sin and cos of the RoPE angle of pair p at position pos. The angle is reduced to [-pi, pi]
// by a two-constant Cody-Waite step (exact enough for |theta| < 1e5) and evaluated with the
// fast __sincosf (abs error < 4e-7 on [-pi, pi]): sincosf would add its Payne-Hanek slow
// path, whose local-memory array made every launch of a kernel that contains it slow
// (docs/perf-notes.md, v4).
__device__ __forceinline__ void rope_sincos(int pos, int p, int n_rot, float freq_base, float freq_scale,
                                            float& sn, float& cs) {
    const float theta = freq_scale * (float)pos * powf(freq_base, -2.f * (float)p / (float)n_rot);
    const float k = rintf(theta * 0.159154943f);             // 1 / (2 pi)
    float r = fmaf(-k, 6.28318548f, theta);                  // 2 pi, high part (fp32)
    r = fmaf(-k, -1.74845553e-7f, r);                        // 2 pi - 6.28318548f
    __sincosf(r, &sn, &cs);
}

// Element i of a rotated head vector x (NEOX pairs (p, p + n_rot/2)); sn/cs hold the
// angles' sine and cosine per pair p < n_rot/2.
__device__ __forceinline__ float rope_elem(const float* x, int i, int n_rot, const float* sn, const float* cs) {
    const int half = n_rot / 2;
    if (i >= n_rot) return x[i];
    const int p = i < half ? i : i - half;
    const float x0 = x[p], x1 = x[p + half];
    return i < half ? x0 * cs[p] - x1 * sn[p] : x0 * sn[p] + x1 * cs[p];
}

// 8 fp16 values of a 16-byte load -> fp32
__device__ __forceinline__ void h8(const uint4 w, float* f) {
    f[0] = h2f((u16)(w.x & 0xffff)); f[1] = h2f((u16)(w.x >> 16));
    f[2] = h2f((u16)(w.y & 0xffff)); f[3] = h2f((u16)(w.y >> 16));
    f[4] = h2f((u16)(w.z & 0xffff)); f[5] = h2f((u16)(w.z >> 16));
    f[6] = h2f((u16)(w.w & 0xffff)); f[7] = h2f((u16)(w.w >> 16));
}
