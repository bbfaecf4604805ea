// The plain streaming read behind both rooflines: stream_read.cu (`harness bench kernels`' size-
// aware roofline, harness/roofline.py) and stream_chain.cu (a decode step's chain roofline,
// harness/step_roofline.py). Four independent predicated 16-byte loads per thread and pass, not an
// unrolled body and a serial tail: below 4 x (threads of the wave) words (~17 MB on an H200) every
// thread would otherwise walk its words one dependent iteration at a time. The XOR of every 32-bit
// word is folded per block (warp shuffles, then shared memory) and goes into out[0] with one
// atomicXor per block (order-independent): one atomic per warp on one address serialised ~8000
// atomics at the end of each launch.
#pragma once

// acc ^ the XOR of words i, i + stride, ... < n16 of p (a thread's share of a grid-stride read)
__device__ __forceinline__ unsigned int stream_xor(const uint4* __restrict__ p, unsigned long long n16,
                                                   unsigned long long i, unsigned long long stride,
                                                   unsigned int acc) {
    for (; i < n16; i += 4 * stride) {
        const uint4 z = make_uint4(0u, 0u, 0u, 0u);
        const uint4 a = __ldg(p + i);
        const uint4 b = i + stride < n16 ? __ldg(p + i + stride) : z;
        const uint4 c = i + 2 * stride < n16 ? __ldg(p + i + 2 * stride) : z;
        const uint4 d = i + 3 * stride < n16 ? __ldg(p + i + 3 * stride) : z;
        acc ^= (a.x ^ a.y ^ a.z ^ a.w) ^ (b.x ^ b.y ^ b.z ^ b.w) ^ (c.x ^ c.y ^ c.z ^ c.w) ^
               (d.x ^ d.y ^ d.z ^ d.w);
    }
    return acc;
}

// The block's XOR of every thread's acc into out[0] (every thread of the block calls it; a block
// barrier inside; one atomic per block, none when the block's XOR is 0).
__device__ __forceinline__ void fold_xor(unsigned int acc, unsigned int* out) {
    __shared__ unsigned int wx[32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
    const int warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    if ((threadIdx.x & 31) == 0) wx[warp] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned int v = 0;
        for (int w = 0; w < nw; ++w) v ^= wx[w];
        if (v != 0) atomicXor(out, v);
    }
}
