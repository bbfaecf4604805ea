// The segment table of a GEMV node: up to MAX_SEG matrices sharing one input vector
// (e.g. Q, K and V), each with its own GGML type, rows, bias and output.
#pragma once
#include "common.cuh"

#define MAX_SEG 4
#define WARPS 4

struct Seg {              // 32 bytes, mirrored by backends/engine/ops.py SEG_DT
    u64 w;                // weight blocks, [rows, row_bytes] u8
    u64 bias;             // f32 [rows] or 0
    u64 out;              // f32 [rows]
    int type;             // GGML type id
    int rows;
};

// 152 bytes, mirrored by backends/engine/ops.py TABLE_DT: a kernel parameter (v4) or, for the
// pointer convention of v1-v3, in device memory (one per node, written once at build time).
struct SegTable { Seg s[MAX_SEG]; int n; int row_bytes[MAX_SEG]; };

__device__ __forceinline__ int find_seg(const SegTable& t, int& row) {
    int i = 0;
    while (i < t.n - 1 && row >= t.s[i].rows) { row -= t.s[i].rows; ++i; }
    return i;
}

