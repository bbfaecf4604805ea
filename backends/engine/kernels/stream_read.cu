// Size-aware roofline of `harness bench kernels` (harness/roofline.py): a plain streaming read
// of n16 16-byte words at p (16-byte aligned), nothing else, so its time for a given byte
// count is what a read-only kernel of that size can reach in the same timing mode (launch
// latency, ramp-up and the last partial wave included).
// Grid: one wave (resident blocks x SMs, from the occupancy API); the read and the XOR fold are
// stream_common.cuh's. The host checks out[0] against numpy's XOR of the same bytes; out[0] must
// be 0 before a checked launch.
// Not launched with PDL and no griddepcontrol: a plain kernel, serialised in stream order.
#include "stream_common.cuh"

extern "C" __global__ void __launch_bounds__(512)
stream_read(const uint4* __restrict__ p, unsigned long long n16, unsigned int* out) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    fold_xor(stream_xor(p, n16, (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x, stride, 0u), out);
}
