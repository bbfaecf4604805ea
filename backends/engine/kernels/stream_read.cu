// Size-aware roofline of `harness bench kernels` (harness/roofline.py): a plain streaming read
// of n16 16-byte words at p (16-byte aligned), nothing else, so its time for a given byte
// count is what a read-only kernel of that size can reach in the same timing mode (launch
// latency, ramp-up and the last partial wave included).
// Grid: one wave (resident blocks x SMs, from the occupancy API); a grid-stride loop whose
// 4 independent 16-byte loads per thread are predicated, not split into an unrolled body and
// a serial tail: below 4 x (threads of the wave) words (~17 MB on an H200) every thread would
// otherwise walk its words one dependent iteration at a time. The XOR of every 32-bit word is
// folded per block (warp shuffles, then shared memory) and the block's value goes into out[0]
// with one atomicXor (order-independent): one atomic per warp on one address serialised ~8000
// atomics at the end of each launch. The host checks out[0] against numpy's XOR of the same
// bytes; out[0] must be 0 before a checked launch.
// Not launched with PDL and no griddepcontrol: a plain kernel, serialised in stream order.

extern "C" __global__ void __launch_bounds__(512)
stream_read(const uint4* __restrict__ p, unsigned long long n16, unsigned int* out) {
    __shared__ unsigned int wx[32];
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned int acc = 0;
    for (; i < n16; i += 4 * stride) {
        const uint4 z = make_uint4(0u, 0u, 0u, 0u);
        const uint4 a = __ldg(p + i);
        const uint4 b = i + stride < n16 ? __ldg(p + i + stride) : z;
        const uint4 c = i + 2 * stride < n16 ? __ldg(p + i + 2 * stride) : z;
        const uint4 d = i + 3 * stride < n16 ? __ldg(p + i + 3 * stride) : z;
        acc ^= (a.x ^ a.y ^ a.z ^ a.w) ^ (b.x ^ b.y ^ b.z ^ b.w) ^ (c.x ^ c.y ^ c.z ^ c.w) ^
               (d.x ^ d.y ^ d.z ^ d.w);
    }
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
