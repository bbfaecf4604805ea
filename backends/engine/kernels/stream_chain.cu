// Chain roofline of a decode step (harness/step_roofline.py): one plain streaming read per
// step node, over as many bytes as that node moves, each from its own region of one large
// buffer (so every read is cold in L2, as a step's weights are), launched in the step's order
// with programmatic dependent launch (PDL) and replayed as one CUDA graph. Its time is what a
// design of one kernel per node can reach on these node sizes: launch latency, ramp-up, the
// partial last wave and the dependency between nodes included, no arithmetic at all.
//
// The read is stream_read.cu's (stream_common.cuh: one wave of 512-thread blocks, 4 predicated
// 16-byte loads per thread and pass, the XOR of every 32-bit word folded into out[0] with one
// atomic per block);
// what differs is the PDL handshake, by `mode` (warp-uniform, so no divergence):
//   0 independent: griddepcontrol.launch_dependents at entry, no wait: a node may run beside
//     its predecessor (the b2b roofline of `harness bench kernels`, chained);
//   1 dependent: griddepcontrol.wait before the first load, then launch_dependents: a node
//     reads nothing until its predecessor has finished (as a GEMV needs its x);
//   2 dependent + prefetch: as 1, but before the wait every thread asks L2 for the 128-byte
//     lines of its first pass (prefetch.global.L2), as the engine's GEMVs prefetched their
//     first rows until session 24 (weights are constants; since session 25 only each first
//     row's first round, gemv_kq.cu KQ_PF0 3);
//   3 staged: as 1, then every block copies nx16 16-byte words of x (one small buffer for every
//     node, so L2-resident, as a GEMV's input vector is) into shared memory and passes a block
//     barrier before its first load of p: the shape of a GEMV's x staging, without its arithmetic;
//   4 staged + prefetch: 2's prefetch before the wait, then 3's staging (the engine's v9 GEMV:
//     first rows to L2 before the wait, x staged after it);
//   5 staged by a bulk copy: as 3, but thread 0 asks the copy engine for x in one
//     cp.async.bulk (TMA, completing on an mbarrier initialised before the wait) and every
//     thread waits on the mbarrier instead of loading and passing a block barrier.
// The atomic (a global write) and the reads of x come after the wait in modes 1-5 (launch.py's
// contract); in mode 0 the XOR still lands, in some order (XOR is order-independent). out[0] ends
// as the XOR of every word of the nodes' regions and, per node of mode 3-5, of the words block 0's
// threads read back from the staged x (words (7 t) mod nx16, t < blockDim.x).

#include "common.cuh"  // pdl_wait, pdl_trigger
#include "stream_common.cuh"  // stream_xor, fold_xor

extern "C" __global__ void __launch_bounds__(512)
stream_chain(const uint4* __restrict__ p, unsigned long long n16, unsigned int* out, int mode,
             const uint4* __restrict__ x, int nx16) {
    extern __shared__ uint4 xs[];  // mode 3: x staged (nx16 words of dynamic shared memory; 0 bytes otherwise)
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    const unsigned long long i0 = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (mode == 2 || mode == 4) {
        // the first pass's words i0 + k stride (k < 4): one prefetch per 128-byte line, from
        // the thread holding the line's first word (8 words per line; p is 16-byte aligned,
        // regions are 256-byte aligned by the host)
        if ((i0 & 7) == 0)
            for (int k = 0; k < 4; ++k)
                if (i0 + k * stride < n16) asm volatile("prefetch.global.L2 [%0];" ::"l"(p + i0 + k * stride));
    }
    __shared__ alignas(8) unsigned long long bar;
    const unsigned int bar_a = (unsigned int)__cvta_generic_to_shared(&bar);
    const bool staged = mode >= 3 && nx16 > 0;  // (the host passes nx16 > 0 for modes 3-5)
#if __CUDA_ARCH__ >= 900
    if (staged && mode == 5) {  // the mbarrier before the wait: off the dependent path
        if (threadIdx.x == 0) {
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar_a));
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
        __syncthreads();
    }
#endif
    if (mode != 0) pdl_wait();
    pdl_trigger();
    unsigned int acc = 0;
    if (staged) {
#if __CUDA_ARCH__ >= 900
        if (mode == 5) {
            if (threadIdx.x == 0) {
                const unsigned int bytes = 16u * (unsigned int)nx16;
                asm volatile("{ .reg .b64 st; mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1; }" ::"r"(bar_a),
                             "r"(bytes) : "memory");
                asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                             ::"r"((unsigned int)__cvta_generic_to_shared(xs)), "l"(x), "r"(bytes), "r"(bar_a) : "memory");
            }
            asm volatile("{ .reg .pred p;\nW: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], 0;\n@!p bra W; }"
                         ::"r"(bar_a) : "memory");
        } else
#endif
        {
            for (int k = threadIdx.x; k < nx16; k += blockDim.x) xs[k] = x[k];
            __syncthreads();
        }
        // read back, so the staging is not dead code; block 0 alone folds it into the XOR (every
        // block folding the same words would cancel over an even grid), which lets the GPU test
        // check what the staging delivered (tests/test_step_roofline.py)
        const uint4 v = xs[(threadIdx.x * 7) % nx16];
        if (blockIdx.x == 0) acc = v.x ^ v.y ^ v.z ^ v.w;
    }
    fold_xor(stream_xor(p, n16, i0, stride, acc), out);
}
