// Small per-step kernels: embedding row lookup from the quantised table, argmax of the
// logits on the device with a finite-value check, and the end-of-step bookkeeping.
//
// Step state (int32, device memory, read by every kernel that needs it, so a captured CUDA
// graph replays unchanged; docs/sources.md §2: per-token values must come from device memory):
//   state[0] token id fed this step, state[1] its position,
//   state[2] non-finite logits seen (cumulative; the host checks and resets it).
// argmax key (u64): (order-preserving float bits << 32) | ~index, maximised atomically, so
// ties resolve to the lowest index like numpy.argmax.
#include "dequant.cuh"

// Grid: ceil(K/256) blocks of 32 threads. Writes x [K] = dequantised row state[0] of table.
extern "C" __global__ void embed_row(const u8* __restrict__ table, int type, long long row_bytes,
                                     int K, int n_vocab, const int* __restrict__ state, float* x) {
    pdl_wait();  // PDL contract (common.cuh); then let the first layer's QKV node prefetch
    pdl_trigger();
    const int tok = state[0];
    if (tok < 0 || tok >= n_vocab) {  // out-of-range id: poison so the finite check reports it
        for (int i = 256 * blockIdx.x + threadIdx.x; i < min(K, 256 * (blockIdx.x + 1)); i += 32)
            x[i] = __int_as_float(0x7fc00000);
        return;
    }
    row_deq_any(type, table + (size_t)tok * row_bytes, x, K, blockIdx.x, threadIdx.x & 31);
}

__device__ __forceinline__ u32 order_bits(float f) {
    const u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Grid-stride argmax over n logits; key must be 0 before the first block runs.
extern "C" __global__ void argmax_logits(const float* __restrict__ logits, int n, u64* key, int* state) {
    pdl_wait();
    pdl_trigger();
    u64 best = 0;
    int bad = 0;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const float v = logits[i];
        if (!finite_f32(v)) { ++bad; continue; }
        const u64 k = ((u64)order_bits(v) << 32) | (u64)(~(u32)i);
        best = k > best ? k : best;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u64 other = __shfl_xor_sync(0xffffffffu, best, o);
        best = other > best ? other : best;
        bad += __shfl_xor_sync(0xffffffffu, bad, o);
    }
    if ((threadIdx.x & 31) == 0) {
        atomicMax(key, best);
        if (bad) atomicAdd(state + 2, bad);
    }
}

// One thread: next token = argmax, position + 1, key cleared for the next step.
extern "C" __global__ void finish_step(u64* key, int* state) {
    pdl_wait();
    const u64 k = *key;
    state[0] = (int)(~(u32)(k & 0xffffffffu));
    state[1] += 1;
    *key = 0;
}

// Holds the stream until the host sets *flag (per-node timing: every launch is queued
// behind it first, so host launch time never falls between a node's event pair).
extern "C" __global__ void hold_stream(const volatile int* flag) {
    for (int i = 0; *flag == 0 && i < 2000000; ++i) __nanosleep(2000);  // gives up after ~4 s
}
