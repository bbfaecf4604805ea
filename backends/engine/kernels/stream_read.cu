// Size-aware roofline of `harness bench kernels` (harness/roofline.py): a plain streaming read
// of n16 16-byte words at p (16-byte aligned), nothing else, so its time for a given byte
// count is what a read-only kernel of that size can reach in the same timing mode (launch
// latency, ramp-up and the last partial wave included).
// Grid: one wave (resident blocks x SMs, from the occupancy API); a grid-stride loop with 4
// independent 16-byte loads in flight per thread. The XOR of every 32-bit word is folded into
// out[0] (atomicXor, order-independent) so the loads cannot be optimised away; the host checks
// it against numpy's XOR of the same bytes. out[0] must be 0 before a checked launch.
// Not launched with PDL and no griddepcontrol: a plain kernel, serialised in stream order.

extern "C" __global__ void __launch_bounds__(512)
stream_read(const uint4* __restrict__ p, unsigned long long n16, unsigned int* out) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned int acc = 0;
    for (; i + 3 * stride < n16; i += 4 * stride) {
        const uint4 a = __ldg(p + i), b = __ldg(p + i + stride);
        const uint4 c = __ldg(p + i + 2 * stride), d = __ldg(p + i + 3 * stride);
        acc ^= (a.x ^ a.y ^ a.z ^ a.w) ^ (b.x ^ b.y ^ b.z ^ b.w) ^ (c.x ^ c.y ^ c.z ^ c.w) ^
               (d.x ^ d.y ^ d.z ^ d.w);
    }
    for (; i < n16; i += stride) {
        const uint4 a = __ldg(p + i);
        acc ^= a.x ^ a.y ^ a.z ^ a.w;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31) == 0 && acc != 0) atomicXor(out, acc);
}
