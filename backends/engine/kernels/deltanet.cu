// Gated DeltaNet decode step (one token) of one qwen35 recurrent layer, fp32. Two nodes:
//
//   gdn_conv_step_k<K>       y = silu(causal_conv1d(x, conv state, w)), conv state shifted
//   gdn_step_s<S>_r<R>       gates, L2 norms, gated delta rule on the [S_v, S_k] state of one
//                            value head per block, gated RMS norm with z
//
// Semantics: oracles/deltanet.py (float64 reference) as oracles/qwen35.py Qwen35Oracle._deltanet
// wires it, which follows llama.cpp src/models/qwen35.cpp build_layer_attn_linear (gates,
// conv, split, l2 norms, build_norm_gated), src/models/delta-net-base.cpp (build_conv_state,
// build_delta_net_*), ggml/src/ggml-cpu/ops.cpp (ssm_conv_f32; gated_delta_net_one_chunk, the
// recurrence with the transposed state layout) and ggml/src/ggml-impl.h
// (ggml_compute_softplus_f32). Design notes, memory traffic and what is verified:
// backends/engine/DELTANET.md. Python side: backends/engine/deltanet_ops.py.
//
// Buffers (float32, device memory, same pointers at every step so a CUDA graph replays
// unchanged; both recurrent states are updated IN PLACE, see the two kernels):
//   x          [C]            C = 2*Hk*S + Hv*S: the attn_qkv projection of the token
//   conv_state [K-1, C]       the previous K-1 inputs x (zeros after a reset)
//   w          [C, K]         ssm_conv1d.weight (GGUF F32, ne [K, C]: row c holds K taps)
//   y          [C]            silu(conv): q = y[0, Hk*S), k = y[Hk*S, 2*Hk*S), v = the rest
//   z          [Hv*S]         attn_gate projection (the output gate)
//   alpha      [Hv]           ssm_alpha projection (raw, before dt bias and softplus)
//   beta       [Hv]           ssm_beta projection (raw, before the sigmoid)
//   dt_bias    [Hv]           ssm_dt.bias;  ssm_a [Hv]: ssm_a (= -exp(A_log), stored as is)
//   norm_w     [S]            ssm_norm.weight (multiplied as is, not as 1 + w)
//   state      [Hv, S, S]     M, "transposed" as ggml keeps it: M[h][j][i] = S_h[i][j]
//                             (row j of M pairs value index j with every key index i)
//   out        [Hv*S]         gated RMS norm of the delta-rule output (input of ssm_out)
#include "common.cuh"

// ----------------------------------------------------------------------------------------
// 1. Causal depthwise conv, one thread per channel c (ggml ops.cpp ssm_conv_f32; llama.cpp
//    delta-net-base.cpp build_conv_state concatenates the state and the new column and keeps
//    the last K-1 columns):
//        xp = [conv_state[0..K-2][c], x[c]];  y[c] = silu(sum_{i<K} xp[i] * w[c][i])
//        conv_state[i][c] = xp[i + 1]   (i < K-1)
//    State update in place: channel c's column is read whole into registers, then written
//    back shifted by one row by the same thread; no other thread touches column c, so there
//    is no race, no second buffer and no host-side pointer swap: a captured graph replays the
//    same launch every step and the state advances by one token per replay.
//    Reads are coalesced (consecutive threads, consecutive channels of a state row; the K
//    taps of channel c are one 16-byte load when K == 4, w 16-byte aligned: deltanet_ops.py
//    checks it).
// ----------------------------------------------------------------------------------------
#define GDN_CONV_THREADS 256

template <int KC>
__device__ void gdn_conv_body(const float* x, float* conv_state, const float* __restrict__ w,
                              float* y, int C) {
    const int c = blockIdx.x * GDN_CONV_THREADS + threadIdx.x;
    float wr[KC];
    // the weights are uploaded, never written by a kernel: readable before the PDL wait
    if (c < C) {
        if constexpr (KC == 4) {
            const float4 t = *((const float4*)w + c);
            wr[0] = t.x; wr[1] = t.y; wr[2] = t.z; wr[3] = t.w;
        } else {
#pragma unroll
            for (int i = 0; i < KC; ++i) wr[i] = w[(size_t)c * KC + i];
        }
    }
    pdl_wait();     // x comes from the QKV GEMV; the conv state from this node's last step
    pdl_trigger();  // the gdn_step node may launch (it waits for this node's y itself)
    if (c >= C) return;
    float xp[KC];
#pragma unroll
    for (int i = 0; i < KC - 1; ++i) xp[i] = conv_state[(size_t)i * C + c];
    xp[KC - 1] = x[c];
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < KC; ++i) acc = fmaf(xp[i], wr[i], acc);  // oracle's order: tap 0 first
    y[c] = silu(acc);
#pragma unroll
    for (int i = 0; i < KC - 1; ++i) conv_state[(size_t)i * C + c] = xp[i + 1];
}

#define GDN_CONV_KERNEL(KC)                                                                   \
    extern "C" __global__ void __launch_bounds__(GDN_CONV_THREADS) gdn_conv_step_k##KC(       \
        const float* x, float* conv_state, const float* w, float* y, int C) {                 \
        gdn_conv_body<KC>(x, conv_state, w, y, C);                                            \
    }
GDN_CONV_KERNEL(4)

// ----------------------------------------------------------------------------------------
// 2. One block per value head h (grid Hv), NW = S/8 warps (S = 128: 512 threads; S = 64:
//    256). Value head h reads key/query head h % Hk (ggml's tiled broadcast: ops.cpp
//    gated_delta_net iq1 = iv1 % neq1; oracles/deltanet.py gated_delta_rule).
//
//    A. Gates, every thread in registers (qwen35.cpp build_layer_attn_linear):
//         beta = sigmoid(beta_in[h]);  g = softplus(alpha[h] + dt_bias[h]) * ssm_a[h]
//       softplus as ggml_compute_softplus_f32 (x itself above 20; log1pf below, the same
//       function with less cancellation than logf(1 + expf(x))).
//    B. L2 norms of q and k in parallel halves of the block (docs/sources.md §2):
//       threads [0, S) hold q, [S, 2S) hold k, [2S, 3S) stage v; x / sqrt(sum x^2 + eps)
//       (llama.cpp models.h build_gdn_l2_norm == ggml_rms_norm(x, eps/n) / sqrt(n)).
//    C. The gated delta rule on M = state[h] (ggml ops.cpp gated_delta_net_one_chunk,
//       fla naive_recurrent_gated_delta_rule), per row j of M, exactly the oracle's order:
//         M_j <- exp(g) M_j;  delta_j = beta (v_j - M_j . k);  M_j <- M_j + delta_j k;
//         o_j = (M_j . q) / sqrt(S)
//       Every quantity of row j depends on row j, the shared k, q and v_j only, so rows are
//       independent. With rk = M_j(old) . k and rq = M_j(old) . q, both reduced in ONE pass
//       over the old row: M_j . k (decayed) = e rk, and o_j = (e rq + delta_j (k . q)) / sqrt(S)
//       (the updated row dotted with q, expanded); e = exp(g).
//       Thread mapping: LPR = S/4 lanes per row, lane holds columns [4c, 4c + 4) as one
//       float4 (16-byte loads and stores of the state); a warp covers 32/LPR rows per load
//       (S = 128: 1, S = 64: 2). Each iteration a warp loads R rows per lane group into
//       registers before any use (R rows in flight per lane group; R = 2 is the source
//       engine's "two state rows per iteration", larger R puts the warp's whole share in
//       flight), reduces 2R partial sums with log2(LPR) xor shuffles, then stores the R new
//       rows. The block's rows per iteration are contiguous (NW*R*32/LPR rows).
//       In place: row j is read and written by the same lane group in the same iteration,
//       no other thread reads it, and nothing else in the step reads state[h], so no second
//       buffer is needed for decode; the graph replays the same launch and the state
//       advances one token per replay (what double buffering would buy: keeping the old
//       state for a rollback, e.g. speculative/MTP verification or a retried step; see
//       DELTANET.md).
//    D. Gated RMS norm (qwen35.cpp build_norm_gated): out = o / sqrt(mean(o^2) + eps) *
//       norm_w * silu(z_h).
//    Before the PDL wait: L2 prefetch of state[h] (written only by this node at the previous
//    step; a prefetch cannot return stale data, the loads after the wait go to L2 and find
//    the lines there) and the per-head weights (never written by a kernel).
// ----------------------------------------------------------------------------------------
template <int LPR>
__device__ __forceinline__ float group_sum(float v) {  // sum over aligned groups of LPR lanes
#pragma unroll
    for (int o = LPR / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float dot4(float4 a, float4 b) {
    return fmaf(a.w, b.w, fmaf(a.z, b.z, fmaf(a.y, b.y, a.x * b.x)));
}

// A. the gates of value head h (see above): e = exp(g), b = beta.
__device__ __forceinline__ void gdn_gates(const float* alpha, const float* beta_in, int h, float a, float dtb,
                                          float& e, float& b) {
    const float xa = alpha[h] + dtb;
    const float g = (xa > 20.f ? xa : log1pf(expf(xa))) * a;
    e = expf(g);
    b = 1.f / (1.f + expf(-beta_in[h]));
}

template <int S>
__device__ __forceinline__ void gdn_norm_qk(float val, float eps, int tid, int lane, int warp, float* qs,
                                            float* ks, float* red);

// B. q, k of key head hk L2-normalised into qs, ks (threads [0, S) and [S, 2S)), and the NV values
// v[h S + v0 ...] staged into vs by threads [2S, 2S + NV). Ends with a barrier.
template <int S, int NV>
__device__ __forceinline__ void gdn_stage_qkv(const float* y, int n_k_heads, int h, int hk, int v0, float eps,
                                              int tid, int lane, int warp, float* qs, float* ks, float* vs,
                                              float* red) {
    const int ck = n_k_heads * S;
    float val = 0.f;
    if (tid < S) val = y[hk * S + tid];
    else if (tid < 2 * S) val = y[ck + hk * S + (tid - S)];
    else if (tid < 2 * S + NV) vs[tid - 2 * S] = y[2 * ck + h * S + v0 + (tid - 2 * S)];
    gdn_norm_qk<S>(val, eps, tid, lane, warp, qs, ks, red);
}

// B, second half: thread tid < S holds q[tid], S <= tid < 2S holds k[tid - S] (val; 0 on the other
// threads); both L2-normalised into qs, ks. Ends with a barrier (vs staged before it is complete too).
template <int S>
__device__ __forceinline__ void gdn_norm_qk(float val, float eps, int tid, int lane, int warp, float* qs,
                                            float* ks, float* red) {
    const float ss = warp_sum(val * val);  // warps never straddle the halves (S % 32 == 0)
    if (lane == 0) red[warp] = ss;
    __syncthreads();
    if (tid < 2 * S) {
        const int w0 = tid < S ? 0 : S / 32;
        float tot = 0.f;
#pragma unroll
        for (int i = 0; i < S / 32; ++i) tot += red[w0 + i];
        const float r = 1.f / sqrtf(tot + eps);
        if (tid < S) qs[tid] = val * r;
        else ks[tid - S] = val * r;
    }
    __syncthreads();
}

// C. R rows of M in flight for one lane group: row row_of(r) of M (a head's state, or the block's
// first row of it), also its index in vs / os (see above for the algebra). gdn_rows_load takes the
// rows into registers (m), gdn_rows_update reduces, updates and stores them. k4, q4: the lane's
// columns of k and q; kq = k . q.
template <int R, class RowOf>
__device__ __forceinline__ void gdn_rows_load(const float* M, int S, RowOf row_of, int c4, float4 (&m)[R]) {
#pragma unroll
    for (int r = 0; r < R; ++r) m[r] = __ldcg((const float4*)(M + (size_t)row_of(r) * S) + c4);
}

template <int LPR, int R, class RowOf>
__device__ __forceinline__ void gdn_rows_update(float* M, int S, RowOf row_of, int c4, const float4 (&m)[R],
                                                float4 k4, float4 q4, float kq, float e, float b, float scale,
                                                const float* vs, float* os) {
    float pk[R], pq[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        pk[r] = dot4(m[r], k4);
        pq[r] = dot4(m[r], q4);
    }
#pragma unroll
    for (int o = LPR / 2; o > 0; o >>= 1) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            pk[r] += __shfl_xor_sync(0xffffffffu, pk[r], o);
            pq[r] += __shfl_xor_sync(0xffffffffu, pq[r], o);
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int lr = row_of(r);
        const float delta = b * (vs[lr] - e * pk[r]);
        float4 n;
        n.x = fmaf(delta, k4.x, e * m[r].x);
        n.y = fmaf(delta, k4.y, e * m[r].y);
        n.z = fmaf(delta, k4.z, e * m[r].z);
        n.w = fmaf(delta, k4.w, e * m[r].w);
        __stcg((float4*)(M + (size_t)lr * S) + c4, n);
        if (c4 == 0) os[lr] = fmaf(delta, kq, e * pq[r]) * scale;
    }
}

template <int LPR, int R, class RowOf>
__device__ __forceinline__ void gdn_rows(float* M, int S, RowOf row_of, int c4, float4 k4, float4 q4,
                                         float kq, float e, float b, float scale, const float* vs, float* os) {
    float4 m[R];
    gdn_rows_load<R>(M, S, row_of, c4, m);
    gdn_rows_update<LPR, R>(M, S, row_of, c4, m, k4, q4, kq, e, b, scale, vs, os);
}

template <int S, int R>
__device__ void gdn_step_body(const float* y, const float* z, const float* alpha,
                              const float* beta_in, const float* __restrict__ dt_bias,
                              const float* __restrict__ ssm_a, const float* __restrict__ norm_w,
                              float* state, float* out, int n_k_heads, float eps) {
    constexpr int NW = S / 8, NT = NW * 32;  // warps, threads
    constexpr int LPR = S / 4;               // lanes per state row (one float4 each)
    constexpr int RPW = 32 / LPR;            // rows per warp-wide load
    constexpr int RPI = NW * R * RPW;        // rows per block iteration
    constexpr int ITERS = S / RPI;
    static_assert(S == 64 || S == 128, "head size 64 or 128");
    static_assert(S % RPI == 0 && ITERS >= 1, "R must divide the rows of a warp");
    static_assert(3 * S <= NT, "q, k, v staging takes 3S threads");
    __shared__ __align__(16) float qs[S];
    __shared__ __align__(16) float ks[S];
    __shared__ float vs[S], os[S], red[NW], scratch[32];

    const int h = blockIdx.x, hk = h % n_k_heads, tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    float* M = state + (size_t)h * S * S;

    // 0. before the wait: state lines into L2, per-head weights into registers
    for (int l = tid; l < S * S / 32; l += NT) asm volatile("prefetch.global.L2 [%0];" ::"l"(M + 32 * l));
    const float a = ssm_a[h], dtb = dt_bias[h];
    const float wn = tid < S ? norm_w[tid] : 0.f;
    pdl_wait();     // y (conv node, or ssm_in with KQ_CONV), z, alpha, beta (GEMV nodes) come from earlier kernels
    pdl_trigger();  // the ssm_out GEMV may launch and prefetch its weights

    float e, b;  // A. gates
    gdn_gates(alpha, beta_in, h, a, dtb, e, b);
    // B. q, k of key head hk normalised in parallel halves; v of value head h staged
    gdn_stage_qkv<S, S>(y, n_k_heads, h, hk, 0, eps, tid, lane, warp, qs, ks, vs, red);

    // C. delta rule, R rows in flight per lane group
    const int c4 = lane % LPR, sub = lane / LPR;
    const float4 k4 = ((const float4*)ks)[c4], q4 = ((const float4*)qs)[c4];
    const float kq = group_sum<LPR>(dot4(k4, q4));
    const float scale = 1.f / sqrtf((float)S);
#pragma unroll 1
    for (int it = 0; it < ITERS; ++it) {
        gdn_rows<LPR, R>(M, S, [&](int r) { return ((it * NW + warp) * R + r) * RPW + sub; }, c4, k4, q4, kq, e, b, scale, vs, os);
    }

    // D. gated RMS norm of o with z. The barrier is needed: os[j] was written by lane c4 == 0
    //    of whichever warp owned row j, and is read here by thread j before block_sum's own
    //    barriers (without it a thread could read its row's o before the other warp stored it).
    __syncthreads();
    const float o = tid < S ? os[tid] : 0.f;
    const float ms = block_sum(o * o, scratch) * (1.f / S);
    if (tid < S) {
        const float zz = z[h * S + tid];
        out[h * S + tid] = o / sqrtf(ms + eps) * wn * silu(zz);
    }
}

#define GDN_STEP_KERNEL(S, R)                                                                    \
    extern "C" __global__ void __launch_bounds__(S * 4) gdn_step_s##S##_r##R(                   \
        const float* y, const float* z, const float* alpha, const float* beta_in,               \
        const float* dt_bias, const float* ssm_a, const float* norm_w, float* state, float* out, \
        int n_k_heads, float eps) {                                                              \
        gdn_step_body<S, R>(y, z, alpha, beta_in, dt_bias, ssm_a, norm_w, state, out, n_k_heads, \
                            eps);                                                                \
    }
// R = 2: the source engine's two rows per iteration; R = S/16: the warp's whole share of the
// state (S/NW = 8 rows per warp; S = 64 loads 2 rows per warp-wide load) in flight at once
GDN_STEP_KERNEL(64, 2)
GDN_STEP_KERNEL(64, 4)
GDN_STEP_KERNEL(128, 2)
GDN_STEP_KERNEL(128, 8)

// ----------------------------------------------------------------------------------------
// 3. gdn_step_cs4_s128 (deltanet_ops GGUF_HARNESS_GDN_CSPLIT, the default since session 17; its
//    bitwise GPU test passed on the H200, DELTANET.md has the figures): gdn_step_s128 with each head's 128 state rows split over the 4 blocks of
//    a thread-block cluster (grid 4 Hv). Why: gdn_step runs one block per value head, 48 blocks
//    on the 27B, so 84 of the H200's 132 SMs stream nothing while 48 move 128 KB each; the node
//    took 4.87 us for 6.4 MB (1312 GB/s, session 15/16 node tables). Rows are independent (C
//    above), so block rank q takes rows [32 q, 32 q + 32): 2 per lane group (R = 2, one pass).
//    Only the gated RMS norm (D) needs the whole head: each block's warp 0 sums its 32 o^2 (as
//    block_sum's warp q does in gdn_step_s128) and stores the partial into every rank's msp[q]
//    (DSMEM); after one cluster barrier every block adds them as block_sum's butterfly does,
//    (p0 + p2) + (p1 + p3), and writes its 32 outputs. Per-row arithmetic, row order of the sums
//    and that total are gdn_step_s128_r<R>'s, so the outputs and the state are bitwise equal.
// ----------------------------------------------------------------------------------------
//
//    Two variants of it (deltanet_ops GGUF_HARNESS_GDN_EARLY / GGUF_HARNESS_GDN_CONV; same
//    arithmetic in the same order, so outputs and states are bitwise gdn_step_cs4_s128's: GPU
//    test passed on the H200, session 27, with the figures in DELTANET.md):
//    EARLY (kernels *_e; the default since session 27, the 27B step -0.5 %): each lane group's R
//      rows are loaded into registers before the PDL wait (instead of the L2 prefetch: the state
//      is written only by this node at an earlier step, the same argument), and z right after it
//      with the other inputs, so neither L2 trip is on the path after the wait.
//    CONV (gdn_convstep_cs4_s128*; an A/B, measured slower: the step +0.5 %): the causal conv of
//      section 1 runs here and the conv node goes. A block needs q and k of its key head (2 S channels) and its ROWS channels of v:
//      thread tid < 2 S + ROWS takes one channel, its K = 4 taps and K-1 state values loaded
//      before the PDL wait, the projection x[c] after it, y[c] = silu(sum) in section 1's order.
//      Every q/k channel is computed by the 3 x CS blocks of its key head's value heads, so the
//      shifted state of section 1 would race (a block could shift a column another block has
//      not read yet). The conv state is instead a ring of K slots [K, C]: slot s holds the input
//      of the last position p with p % K == s; at position p (step state[1]) the K-1 inputs
//      before it are slots (p + 1 + i) % K, i < K-1 (oldest first), and x is written to slot
//      p % K, which no block reads at position p. One block writes each channel's slot and y
//      (y is kept for captures): q/k by cluster rank 0 of value head h == hk, v by its block.
//      After a reset the ring is zeros, as section 1's state; positions must then advance by one
//      per step (the engine's finish_step and prefill do). K-1 state values and the position
//      are read before the PDL wait: written by this node at earlier steps and by the step's
//      start (host or finish_step), both complete before this node can launch.
// ----------------------------------------------------------------------------------------
// Conv inputs of the CONV variant: x [C] (attn_qkv projection), ring [K, C], taps w [C, K],
// y [C] (written: silu(conv)), step (int32: step[1] = position), C channels.
struct GdnConv {
    const float* x;
    float* ring;
    const float* w;
    float* y;
    const int* step;
    int C;
};

template <int S, int CS, bool CONV, bool EARLY>
__device__ void gdn_step_cs_body(const float* y, const float* z, const float* alpha,
                                 const float* beta_in, const float* __restrict__ dt_bias,
                                 const float* __restrict__ ssm_a, const float* __restrict__ norm_w,
                                 float* state, float* out, int n_k_heads, float eps, GdnConv cv) {
    constexpr int NW = S / 8, NT = NW * 32;  // as gdn_step_body
    constexpr int LPR = S / 4, RPW = 32 / LPR;
    constexpr int ROWS = S / CS;             // this block's rows of the head
    constexpr int R = ROWS / (NW * RPW);     // rows per lane group, one pass
    constexpr int KC = 4;                    // CONV: taps (gdn_convstep_* are K = 4 only)
    static_assert(S == 128 && CS == 4 && ROWS == 32 && R * NW * RPW == ROWS,
                  "one warp's worth of rows per block: the mean square adds warp partials as block_sum");
    static_assert(2 * S + ROWS <= NT, "q, k and the block's v staging");
    __shared__ __align__(16) float qs[S];
    __shared__ __align__(16) float ks[S];
    __shared__ float vs[ROWS], os[ROWS], red[NW], msp[CS];

    const int q = (int)cluster_rank(), h = blockIdx.x / CS, hk = h % n_k_heads, j0 = q * ROWS;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float* M = state + (size_t)h * S * S;
    cluster_arrive_relaxed();  // paired with the wait before the DSMEM stores

    const int c4 = lane % LPR, sub = lane / LPR;
    const auto row_of = [&](int r) { return (warp * R + r) * RPW + sub; };  // local rows (of vs, os)
    float4 m[R];
    if constexpr (EARLY) gdn_rows_load<R>(M + (size_t)j0 * S, S, row_of, c4, m);
    else
        for (int l = tid; l < ROWS * S / 32; l += NT) asm volatile("prefetch.global.L2 [%0];" ::"l"(M + (size_t)j0 * S + 32 * l));
    const float a = ssm_a[h], dtb = dt_bias[h];
    const float wn = tid < ROWS ? norm_w[j0 + tid] : 0.f;
    int c = -1, pos = 0;  // CONV: this thread's channel (-1: none), the position
    float xp[KC], wr[KC];
    if constexpr (CONV) {
        const int ck = n_k_heads * S;
        c = tid < S ? hk * S + tid : tid < 2 * S ? ck + hk * S + (tid - S)
          : tid < 2 * S + ROWS ? 2 * ck + h * S + j0 + (tid - 2 * S) : -1;
        pos = cv.step[1];
        if (c >= 0) {
            const float4 t = *((const float4*)cv.w + c);
            wr[0] = t.x; wr[1] = t.y; wr[2] = t.z; wr[3] = t.w;
#pragma unroll
            for (int i = 0; i < KC - 1; ++i) xp[i] = cv.ring[(size_t)((pos + 1 + i) & (KC - 1)) * cv.C + c];
        }
    }
    pdl_wait();     // y (conv node, or ssm_in with KQ_CONV) or x (CONV), z, alpha, beta come from earlier kernels
    pdl_trigger();  // the ssm_out GEMV may launch and prefetch its weights
    float zz = 0.f;
    if constexpr (EARLY) zz = tid < ROWS ? z[h * S + j0 + tid] : 0.f;

    float e, b;  // A. gates, as gdn_step_body
    gdn_gates(alpha, beta_in, h, a, dtb, e, b);
    // B. q, k of key head hk normalised (as gdn_step_body); v of this block's rows
    if constexpr (CONV) {
        float val = 0.f;
        if (c >= 0) {
            xp[KC - 1] = cv.x[c];
            float acc = 0.f;
#pragma unroll
            for (int i = 0; i < KC; ++i) acc = fmaf(xp[i], wr[i], acc);  // section 1's order
            val = silu(acc);
            if (tid >= 2 * S || (h < n_k_heads && q == 0)) {  // the channel's one writer
                cv.ring[(size_t)(pos & (KC - 1)) * cv.C + c] = xp[KC - 1];
                cv.y[c] = val;
            }
            if (tid >= 2 * S) vs[tid - 2 * S] = val;
        }
        gdn_norm_qk<S>(tid < 2 * S ? val : 0.f, eps, tid, lane, warp, qs, ks, red);
    } else {
        gdn_stage_qkv<S, ROWS>(y, n_k_heads, h, hk, j0, eps, tid, lane, warp, qs, ks, vs, red);
    }

    // C. the delta rule on rows j0 + [0, ROWS), all R rows of a lane group in flight
    const float4 k4 = ((const float4*)ks)[c4], q4 = ((const float4*)qs)[c4];
    const float kq = group_sum<LPR>(dot4(k4, q4));
    const float scale = 1.f / sqrtf((float)S);
    if constexpr (!EARLY) gdn_rows_load<R>(M + (size_t)j0 * S, S, row_of, c4, m);
    gdn_rows_update<LPR, R>(M + (size_t)j0 * S, S, row_of, c4, m, k4, q4, kq, e, b, scale, vs, os);

    // D. gated RMS norm across the cluster
    __syncthreads();  // os complete
    cluster_wait();   // every block of the cluster has started: DSMEM stores allowed
    const float o = tid < ROWS ? os[tid] : 0.f;
    if (warp == 0) {
        const float p = warp_sum(o * o);  // = block_sum's partial of warp q in gdn_step_s128
        if (lane < CS) st_cluster_f32(&msp[q], lane, p);
    }
    cluster_sync();
    const float ms = ((msp[0] + msp[2]) + (msp[1] + msp[3])) * (1.f / S);
    if (tid < ROWS) {
        if constexpr (!EARLY) zz = z[h * S + j0 + tid];
        out[h * S + j0 + tid] = o / sqrtf(ms + eps) * wn * silu(zz);
    }
}

// grid 4 Hv (a cluster of 4 blocks per value head), 4 S threads per block
#define GDN_CS_ARGS const float* z, const float* alpha, const float* beta_in, const float* dt_bias, \
    const float* ssm_a, const float* norm_w, float* state, float* out, int n_k_heads, float eps
extern "C" __global__ void __cluster_dims__(4, 1, 1) __launch_bounds__(128 * 4) gdn_step_cs4_s128(
    const float* y, GDN_CS_ARGS) {
    gdn_step_cs_body<128, 4, false, false>(y, z, alpha, beta_in, dt_bias, ssm_a, norm_w, state, out, n_k_heads, eps, GdnConv{});
}
// _e: ptxas (13.0) gives it 32 registers unasked (4 blocks of 512 threads per SM, as measured in
// session 27). Not pinned with a minimum of 4 blocks: that hint changes NVRTC's PTX (not the register
// count), so the pinned build would not be the measured one; check the count after a toolkit change.
extern "C" __global__ void __cluster_dims__(4, 1, 1) __launch_bounds__(128 * 4) gdn_step_cs4_s128_e(
    const float* y, GDN_CS_ARGS) {
    gdn_step_cs_body<128, 4, false, true>(y, z, alpha, beta_in, dt_bias, ssm_a, norm_w, state, out, n_k_heads, eps, GdnConv{});
}
// CONV: x [C] the attn_qkv projection, ring [4, C], w [C, 4], y [C] written, step[1] the position
#define GDN_CONVSTEP_KERNEL(SUFFIX, EARLY)                                                         \
    extern "C" __global__ void __cluster_dims__(4, 1, 1) __launch_bounds__(128 * 4, 4) gdn_convstep_cs4_s128##SUFFIX( \
        const float* x, float* ring, const float* w, float* y, const int* step, int C, GDN_CS_ARGS) { \
        gdn_step_cs_body<128, 4, true, EARLY>(nullptr, z, alpha, beta_in, dt_bias, ssm_a, norm_w,  \
                                              state, out, n_k_heads, eps, GdnConv{x, ring, w, y, step, C}); \
    }
GDN_CONVSTEP_KERNEL(, false)
GDN_CONVSTEP_KERNEL(_e, true)
