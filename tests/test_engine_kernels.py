"""Engine kernels vs the float64 oracle on random valid blocks, NaN-poisoned outputs, odd
shapes (rows not a multiple of the 4 rows per block, 1 row, K not a multiple of 256 for the
32-value formats and of 8 for float types). GPU only.

GEMV tolerance (why it is what it is): the q16 kernels (engine v4) first round the input to
int16 codes per 32-value block (oracles.actquant.round_q16 models that rounding in float32
exactly as the kernel does it); the integer dot products are exact and the rest is fp32: a
scale multiply per 8 weights and K/256 fp32 partial sums per lane, then a 5-level warp tree.
Rounding errors of such sums grow like sqrt(n) * eps32 * ||w|| ||x|| in practice (< 3e-6
for K <= 17408). Against the float64 product with the *rounded* x we allow 1e-5 * ||w_r||
||x|| per row: a wrong scale, nibble or bit in one 32-value chunk moves a row by ~||w_chunk||
||x_chunk||, orders of magnitude more. Against the exact product we add the rounding's own
worst case, sum_k |w_k| * amax(block of k) / 65534 (oracles.actquant.q16_error_bound); a
rounding half-way tie decided differently by the kernel's fp32 normalisation moves one code
by 1, ~|w_k| amax / 32767, far inside the 1e-5 term. The f32 kernels (GGUF_HARNESS_GEMV=f32)
see x unrounded.
"""
from __future__ import annotations

import math
import re

import numpy as np
import pytest
from gpu_util import cupy_or_skip, device_tensor, nan_poisoned, q16_or_skip

from oracles import gemv_check, ops
from oracles.blocks import random_blocks
from oracles.dequant import dequantize, get_format

pytestmark = pytest.mark.gpu

TYPES = {"F32": 0, "F16": 1, "BF16": 30, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8,
         "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14,
         "IQ4_NL": 20, "IQ4_XS": 23, "IQ3_S": 21, "IQ3_XXS": 18, "IQ2_S": 22, "IQ2_XS": 17,
         "IQ2_XXS": 16, "IQ1_S": 19, "IQ1_M": 29}


def _shapes(type_id):
    bs = get_format(type_id).block_size
    base = [(1, 256), (7, 512), (33, 1024), (130, 2048), (9001, 256)]  # 9001: grid-stride rows
    if bs == 32:
        base += [(5, 96), (9, 896), (3, 8960)]
    if bs == 1:
        base += [(5, 100), (3, 37)]
    return base


def _matrix(type_id, rows, K, seed):
    rng = np.random.default_rng(seed)
    f = get_format(type_id)
    raw = random_blocks(type_id, rows * K // f.block_size, rng).reshape(rows, -1)
    w = dequantize(raw.reshape(-1), type_id, (rows, K)).astype(np.float64)
    return raw, w


def _x_seen(x):
    """x as the GEMV kernels see it (float64): rounded to int16 codes by the q16 kernels."""
    from backends.engine import ops as eops
    return gemv_check.x_seen(x, eops.GEMV_IMPL)


def _v9_default_routes(monkeypatch, eops):
    """The v9 routing switches at the shipped defaults, whatever the environment says (8-lane
    rows, split by rows, P2 for Q6_K from 2048 rows, the wide and queue builds, cluster splits
    with groups of 4 in global memory, one fence per group block, leftover groups rotated)."""
    monkeypatch.setattr(eops, "GEMV_KQ", "v9l8")
    for knob in ("GEMV_KQ_SPLIT", "GEMV_KQ_WIDE_MIN_ROWS", "GEMV_KQ_P2", "GEMV_KQ_P2_MIN_ROWS", "GEMV_KQ_CSPLIT",
                 "GEMV_KQ_DQ", "GEMV_KQ_DQ_P", "GEMV_KQ_DQ_T", "GEMV_KQ_DQ_MAP", "GEMV_KQ_BW", "GEMV_KQ_WMAJ",
                 "GEMV_KQ_GSPLIT", "GEMV_KQ_GS_FENCE", "GEMV_KQ_PART_ROT"):
        monkeypatch.setattr(eops, knob, {"GEMV_KQ_SPLIT": "auto", "GEMV_KQ_P2": "q6_k", "GEMV_KQ_P2_MIN_ROWS": "2048",
                                         "GEMV_KQ_CSPLIT": "1"}.get(knob, ""))


def _check_rows(y, w, x, what):
    """y [rows] from the kernel vs the float64 products with the rule derived in the module
    docstring (oracles.gemv_check holds it, shared with `harness bench kernels`)."""
    from backends.engine import ops as eops
    v = gemv_check.check_store(y, w, x, impl=eops.GEMV_IMPL)
    assert v["ok"], f"{what}: {v}"


def _add_node(cp, eops, t, mats, x, rng, keep):
    """An "add" node over the segments `mats` ([(raw, dequantised)] of type t) onto random values
    (the residual stream; find_seg per row). Returns the node, the device accumulators and the
    values they started from."""
    K = x.size
    bases = [rng.normal(size=raw.shape[0]).astype(np.float32) for raw, _ in mats]
    accs = [cp.asarray(b) for b in bases]
    node = eops.gemv("o", "add", [eops.Seg(device_tensor(cp, f"a{j}", raw, t, (K, raw.shape[0]), keep), a)
                                  for j, ((raw, _), a) in enumerate(zip(mats, accs))], cp.asarray(x), K)
    return node, accs, bases


def _swiglu_node(cp, eops, t, rows, K, rng, keep):
    """A gate/up SwiGLU node of two random [rows x K] matrices of type t on a random x. Returns
    the node, its NaN-poisoned output and the float64 reference silu(Wg x) * (Wu x) on the x the
    kernels see."""
    (rg, wg), (ru, wu) = _matrix(t, rows, K, seed=rows + 1), _matrix(t, rows, K, seed=rows + 2)
    x = rng.normal(size=K).astype(np.float32)
    h = nan_poisoned(cp, rows)
    node = eops.gemv("f", "swiglu", [eops.Seg(device_tensor(cp, "g", rg, t, (K, rows), keep), h),
                                     eops.Seg(device_tensor(cp, "u", ru, t, (K, rows), keep), h)], cp.asarray(x), K)
    return node, h, ops.swiglu(wg @ _x_seen(x), wu @ _x_seen(x))


def _normed_biased_segments(cp, eops, t, keep):
    """A qkv-like node of GGML type t at K = 1024: 3 segments of 19, 3 and 40 rows with biases
    behind a fused RMSNorm (find_seg per row), NaN-poisoned outputs. Returns K, the rng (for
    more draws), x, the norm weight on the device, x normalised in float64, [(raw, dequantised)]
    per segment, the outputs, the biases and the ops.Seg list (device buffers kept in keep)."""
    K = 1024
    rng = np.random.default_rng(t)
    x = rng.normal(size=K).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, K).astype(np.float32)
    nw_dev = device_tensor(cp, "norm", nw.view(np.uint8).reshape(1, -1), 0, (K,), keep)
    xn = ops.rms_norm(x[None].astype(np.float64), nw.astype(np.float64), 1e-6)[0]
    mats = [_matrix(t, r, K, 50 + r) for r in (19, 3, 40)]
    outs = [nan_poisoned(cp, r) for r in (19, 3, 40)]
    biases = [rng.normal(size=r).astype(np.float32) for r in (19, 3, 40)]
    bdev = [cp.asarray(b) for b in biases]
    keep.extend(bdev)
    segs = [eops.Seg(device_tensor(cp, f"m{j}", raw, t, (K, raw.shape[0]), keep), o, int(b.data.ptr))
            for j, ((raw, _), o, b) in enumerate(zip(mats, outs, bdev))]
    return K, rng, x, nw_dev, xn, mats, outs, biases, segs


@pytest.mark.parametrize("name", list(TYPES))
def test_gemv_store_every_format_and_odd_shape(name):
    cp = cupy_or_skip()
    from backends.engine import ops as eops
    t = TYPES[name]
    for i, (rows, K) in enumerate(_shapes(t)):
        raw, w = _matrix(t, rows, K, seed=100 * t + i)
        keep = []
        dt = device_tensor(cp, name, raw, t, (K, rows), keep)
        x = np.random.default_rng(i).normal(size=K).astype(np.float32)
        out = nan_poisoned(cp, rows)
        node = eops.gemv("t", "store", [eops.Seg(dt, out)], cp.asarray(x), K)
        node.launch()
        _check_rows(out.get().astype(np.float64), w, x,
                    f"{name} [{rows}x{K}]")


def test_gemv_multi_segment_bias_norm_add_swiglu():
    cp = cupy_or_skip()
    from backends.engine import ops as eops
    K, keep = 512, []
    rng = np.random.default_rng(7)
    x = rng.normal(size=K).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, K).astype(np.float32)
    nw_dev = device_tensor(cp, "norm", nw.view(np.uint8).reshape(1, -1), 0, (K,), keep)
    eps = 1e-6
    xn = ops.rms_norm(x[None].astype(np.float64), nw.astype(np.float64), eps)[0]
    # store with bias over three segments of different formats and row counts
    mats = [(_matrix(t, r, K, 10 + t)) for t, r in ((12, 9), (14, 2), (8, 5))]
    outs = [nan_poisoned(cp, r) for r in (9, 2, 5)]
    biases = [rng.normal(size=r).astype(np.float32) for r in (9, 2, 5)]
    bdev = [cp.asarray(b) for b in biases]
    segs = [eops.Seg(device_tensor(cp, f"m{j}", raw, t, (K, raw.shape[0]), keep), o, int(b.data.ptr))
            for j, ((raw, _), t, o, b) in enumerate(zip(mats, (12, 14, 8), outs, bdev))]
    eops.gemv("qkv", "store", segs, cp.asarray(x), K, nw_dev, eps).launch()
    for (raw, w), o, b in zip(mats, outs, biases):
        _check_rows(o.get().astype(np.float64) - b, w, xn, "segment with bias")
    # add into an existing output (residual)
    raw, w = _matrix(13, 6, K, 3)
    base = rng.normal(size=6).astype(np.float32)
    out = cp.asarray(base)
    eops.gemv("o", "add", [eops.Seg(device_tensor(cp, "o", raw, 13, (K, 6), keep), out)],
              cp.asarray(x), K).launch()
    _check_rows(out.get().astype(np.float64) - base, w, x, "add")
    # swiglu of a Q5_K gate and a Q6_K up (mixed formats, as in the source model)
    (rg, wg), (ru, wu) = _matrix(13, 11, K, 4), _matrix(14, 11, K, 5)
    h = nan_poisoned(cp, 11)
    eops.gemv("ffn", "swiglu", [eops.Seg(device_tensor(cp, "g", rg, 13, (K, 11), keep), h),
                                eops.Seg(device_tensor(cp, "u", ru, 14, (K, 11), keep), h)],
              cp.asarray(x), K, nw_dev, eps).launch()
    ref = ops.swiglu(wg @ _x_seen(xn), wu @ _x_seen(xn))
    got = h.get().astype(np.float64)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("name", list(TYPES))
def test_embedding_row_lookup(name):
    cp = cupy_or_skip()
    from backends.engine import ops as eops
    t = TYPES[name]
    K = 96 if get_format(t).block_size == 32 else (100 if get_format(t).block_size == 1 else 512)
    raw, w = _matrix(t, 13, K, 5)
    keep = []
    table = device_tensor(cp, "emb", raw, t, (K, 13), keep)
    state = cp.asarray(np.array([11, 0, 0, 0], np.int32))
    x = nan_poisoned(cp, K)
    eops.embed("e", table, state, x).launch()
    np.testing.assert_array_equal(x.get(), w[11].astype(np.float32))
    state[0] = 13  # out of range: poisoned, so the finite checks name this node
    eops.embed("e", table, state, x).launch()
    assert np.isnan(x.get()).all()


def test_argmax_ties_nonfinite_and_finish():
    cp = cupy_or_skip()
    from backends.engine import ops as eops
    n = 151_936
    logits = np.random.default_rng(0).normal(size=n).astype(np.float32)
    logits[[777, 90_000]] = 50.0  # tie: lowest index wins, like numpy.argmax
    logits[5] = -np.inf
    logits[6] = np.nan
    state = cp.asarray(np.array([0, 41, 0, 0], np.int32))
    key = cp.zeros(1, cp.uint64)
    eops.argmax("a", cp.asarray(logits), key, state).launch()
    eops.finish("f", key, state).launch()
    s = state.get()
    assert s[0] == 777 and s[1] == 42 and s[2] == 2 and int(key.get()[0]) == 0


ATTN_SHAPES = [(16, 4, 2, 0), (48, 3, 1, 16), (64, 14, 2, 0), (128, 12, 2, 0), (64, 4, 4, 16),
               (256, 6, 2, 0), (128, 8, 1, 16), (64, 16, 2, 0)]  # D, n_head, n_kv, v3 chunk


def _attn_cases():
    """v3 on every shape; the head kernel (v6, ops.GQA_DIMS, any group size) and the gqa kernel
    (v5, ops.GQA_DIMS, <= ops.GQA_MAXG query heads per KV head) on the shapes they take (they
    split on their own, so no v3 chunk), with the default
    split_min and with a new split every 1 / 4 positions (gqa-s1 / gqa-s4), so the partials
    and the merge (and, with 1, empty splits once the 16-split cap binds) run within 40
    positions. Other shapes fall back to v3 (test_attention_falls_back_to_v3)."""
    from backends.engine.ops import GQA_DIMS, GQA_MAXG
    cases = [(*sh, "v3") for sh in ATTN_SHAPES]
    for D, n_head, n_kv, chunk in ATTN_SHAPES:
        if D in GQA_DIMS and not chunk:  # v6 "head": any group size
            cases += [(D, n_head, n_kv, chunk, impl) for impl in ("head", "head-s1", "head-s4")]
        if D in GQA_DIMS and n_head // n_kv <= GQA_MAXG and not chunk:
            cases += [(D, n_head, n_kv, chunk, impl) for impl in ("gqa", "gqa-s1", "gqa-s4")]
    return cases


def test_attention_falls_back_to_v3():
    """Shapes outside the gqa kernel (head dim 16; 16 query heads per KV head) and the head
    kernel (head dim 16) get v3's node."""
    cp = cupy_or_skip()
    from backends.engine import ops as eops
    for D, n_head, n_kv in ((16, 4, 2), (64, 16, 1)):
        q, k, v = (cp.zeros(n * D, cp.float32) for n in (n_head, n_kv, n_kv))
        kc, vc = (cp.zeros((8, n_kv, D), cp.uint16) for _ in range(2))
        nodes = eops.attention("a", q, k, v, kc, vc, cp.zeros(4, cp.int32), cp.zeros(n_head * D, cp.float32),
                               n_head=n_head, n_kv=n_kv, D=D, n_rot=D, freq_base=1e4, freq_scale=1.0,
                               n_ctx=8, impl="gqa")
        assert nodes[0].kernel.name == "attn_decode", (D, n_head, n_kv)
    nodes = eops.attention("a", q, k, v, kc, vc, cp.zeros(4, cp.int32), cp.zeros(n_head * D, cp.float32),
                           n_head=4, n_kv=2, D=16, n_rot=16, freq_base=1e4, freq_scale=1.0, n_ctx=8,
                           impl="head")
    assert nodes[0].kernel.name == "attn_decode"


@pytest.mark.parametrize("D,n_head,n_kv,chunk,impl", _attn_cases())
def test_attention_decode_against_oracle(D, n_head, n_kv, chunk, impl):
    cp = cupy_or_skip()
    from backends.engine import ops as eops
    impl, _, smin = impl.partition("-s")
    n_ctx, steps, base = 64, 40, 10000.0
    rng = np.random.default_rng(D + n_head)
    kc = cp.zeros((n_ctx, n_kv, D), cp.uint16)
    vc = cp.zeros((n_ctx, n_kv, D), cp.uint16)
    q, k, v = (cp.zeros(n * D, cp.float32) for n in (n_head, n_kv, n_kv))
    out = nan_poisoned(cp, n_head * D)
    state = cp.zeros(4, cp.int32)
    n_split = 1 if chunk == 0 else math.ceil(n_ctx / chunk)
    part = cp.zeros(n_head * n_split * (D + 2), cp.float32) if chunk else None
    nodes = eops.attention("a", q, k, v, kc, vc, state, out, n_head=n_head, n_kv=n_kv, D=D,
                           n_rot=D, freq_base=base, freq_scale=1.0, n_ctx=n_ctx, chunk=chunk,
                           part=part, impl=impl, split_min=int(smin) if smin else None,
                           single=0 if smin and impl == "head" else None)
    assert nodes[0].kernel.name.startswith({"gqa": "attn_gqa", "head": "attn_head", "v3": "attn_decode"}[impl])
    ks, vs = np.zeros((n_ctx, n_kv, D)), np.zeros((n_ctx, n_kv, D))
    for pos in range(steps):
        qh, kh, vh = (rng.normal(size=(1, n, D)) for n in (n_head, n_kv, n_kv))
        q.set(qh.astype(np.float32).ravel()); k.set(kh.astype(np.float32).ravel())
        v.set(vh.astype(np.float32).ravel()); state[1] = pos
        out.fill(np.nan)
        for nd in nodes:
            nd.launch()
        qf, kf = (a.astype(np.float32).astype(np.float64) for a in (qh, kh))
        qr = ops.rope_neox(qf, [pos], D, base)
        # the cache stores fp16: the oracle sees the same rounded k (after RoPE) and v
        ks[pos] = ops.rope_neox(kf, [pos], D, base)[0].astype(np.float16)
        vs[pos] = vh[0].astype(np.float32).astype(np.float16)
        ref = ops.attention(qr, ks, vs, [pos], pos + 1)[0].ravel()
        got = out.get().astype(np.float64)
        assert np.isfinite(got).all(), f"pos {pos}: NaN"
        # fp32 accumulation over <= 40 positions of O(1) values; RoPE angles in fp32
        np.testing.assert_allclose(got, ref, rtol=0, atol=2e-4, err_msg=f"pos {pos}")
    # the kernel rotates in fp32 (angles up to pos*1 rad, fp32 error ~3e-6 absolute on O(1)
    # values), the oracle in fp64: fp16 rounding may then land one half away (2^-10 relative)
    np.testing.assert_allclose(kc.get()[:steps].view(np.float16).astype(np.float64), ks[:steps],
                               rtol=2.0 ** -10, atol=1e-5)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_gemv_nonfinite_input_is_not_laundered(bad):
    """Rounding x to integer codes must not turn NaN/Inf into finite numbers: the finite
    checks (argmax count, then the eager re-run) rely on non-finite values propagating."""
    cp = cupy_or_skip()
    from backends.engine import ops as eops
    rows, K, keep = 6, 512, []
    for t in (TYPES["Q4_K"], TYPES["Q8_0"], TYPES["F16"]):
        raw, _ = _matrix(t, rows, K, seed=t)
        x = np.random.default_rng(1).normal(size=K).astype(np.float32)
        x[300] = bad
        out = cp.zeros(rows, cp.float32)
        eops.gemv("t", "store", [eops.Seg(device_tensor(cp, "w", raw, t, (K, rows), keep), out)],
                  cp.asarray(x), K).launch()
        assert not np.isfinite(out.get()).any(), f"type {t}: non-finite x[300] gave finite rows"


# K/256 super-blocks: 1, 3 (fewer than the 4 a warp takes per round), 5 and 7 (not a multiple
# of 4; odd, so Q6_K rows start at every even offset mod 16), 35 (ffn_down of the 1.5B).
def _check_store_and_add(cp, raw, w, t, x, wpr, nw, what, keep, rng):
    """One matrix (raw blocks [rows, row_bytes] of type t, dequantised w [rows, K]) through
    the "store" epilogue into a NaN-poisoned output and the "add" epilogue onto random
    values, both judged by _check_rows."""
    from backends.engine import ops as eops
    rows, K = w.shape
    out = nan_poisoned(cp, rows)
    eops.gemv("t", "store", [eops.Seg(device_tensor(cp, "w", raw, t, (K, rows), keep), out)],
              cp.asarray(x), K, wpr=wpr, nw=nw).launch()
    _check_rows(out.get().astype(np.float64), w, x, what)
    base = rng.normal(size=rows).astype(np.float32)
    acc = cp.asarray(base)
    eops.gemv("t", "add", [eops.Seg(device_tensor(cp, "w", raw, t, (K, rows), keep), acc)],
              cp.asarray(x), K, wpr=wpr, nw=nw).launch()
    _check_rows(acc.get().astype(np.float64) - base, w, x, what + " add")


WIDE_K = (256, 768, 1280, 1792, 8960)


# (type, GEMV_KQ) cases: the four wide types on every row loop; IQ3_S on the v9 ones with its
# switch on (GGUF_HARNESS_GEMV_KQ_IQ3S=1, the default; elsewhere it runs gemv.cu's I-quant loop)
KQ_LOOP_CASES = [(n, kq) for kq in ("wide", "narrow", "v9", "v9l8") for n in ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS")]
KQ_LOOP_CASES += [("IQ3_S", "v9"), ("IQ3_S", "v9l8")]


@pytest.mark.parametrize("name,kq", KQ_LOOP_CASES)
def test_gemv_kquant_wide_and_narrow_loops(name, kq, monkeypatch):
    """Q4_K/Q5_K/Q6_K/IQ4_XS rows on both q16 row loops (ops.GEMV_KQ, kernels/kwide.cuh and
    kwide_iq4.cuh, and the per-8 qdot8 loop; IQ4_XS narrow: the non-inlined I-quant call;
    IQ4_XS nodes, pairs mixed with Q6_K included, run the _iq4 kernels, ops.gemv_kernel):
    super-block counts that leave lanes of a round idle, every block shape (WPR = 8 with fewer
    super-blocks than the 32 a row's warps cover per round), store, add and gate/up pairs of
    the same format (IQ4_XS: row_dot2_wide_iq4, the 27B's SwiGLU node) and mixed with another
    wide format. Odd super-block counts put IQ4_XS rows at both 16-byte parities (136-byte
    blocks: the qs runs are 16-byte aligned in every other block). kq "v9": same-format nodes
    run kernels/gemv_kq.cu (Q4_K/Q5_K with 4 lanes per super-block, two rows per warp; "v9l8":
    all with 8 lanes, one row per warp; the block shape arguments do not apply), the mixed pair
    stays on gemv.cu's wide loop. IQ3_S (v9 only, GGUF_HARNESS_GEMV_KQ_IQ3S: kernels/kwide_iq3s.cuh): its same-format
    nodes run the gemvkq_*_iq3_s kernels (110-byte blocks at every 8-byte phase), the pair mixed
    with Q6_K gemv.cu's I-quant loop."""
    cp = cupy_or_skip()
    from backends.engine import ops as eops
    q16_or_skip("the wide loop")
    monkeypatch.setattr(eops, "GEMV_KQ", kq)
    monkeypatch.setattr(eops, "GEMV_KQ_IQ3S", "1")
    t, keep = TYPES[name], []
    other = TYPES["Q6_K"] if name != "Q6_K" else TYPES["Q4_K"]
    for K in WIDE_K:
        rng = np.random.default_rng(K + t)
        x = rng.normal(size=K).astype(np.float32)
        raw, w = _matrix(t, 13, K, seed=K + t)
        (rg, wg), (ru, wu) = _matrix(t, 13, K, seed=K + t + 1), _matrix(other, 13, K, seed=K + t + 2)
        shapes = sorted(eops.GEMV_SHAPES) if K in (768, 1792) else [(None, None)]
        for nw, wpr in shapes:
            what = f"{name} {kq} K={K} b{nw} w{wpr}"
            _check_store_and_add(cp, raw, w, t, x, wpr, nw, what, keep, rng)
            for (ru2, wu2, tu) in ((rg, wg, t), (ru, wu, other)):  # same-format pair, mixed pair
                h = nan_poisoned(cp, 13)
                eops.gemv("f", "swiglu", [eops.Seg(device_tensor(cp, "g", raw, t, (K, 13), keep), h),
                                          eops.Seg(device_tensor(cp, "u", ru2, tu, (K, 13), keep), h)],
                          cp.asarray(x), K, wpr=wpr, nw=nw).launch()
                ref = ops.swiglu(w @ _x_seen(x), wu2 @ _x_seen(x))
                np.testing.assert_allclose(h.get(), ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max(),
                                           err_msg=f"{what} swiglu with type {tu}")


@pytest.mark.parametrize("split", ["auto", "1", "2", "4"])
@pytest.mark.parametrize("kq", ["v9", "v9l8"])
def test_gemv_v9_grid_stride_segments_norm_bias(kq, split, monkeypatch):
    """Engine v9 (kernels/gemv_kq.cu, ops.GEMV_KQ = "v9") beyond test_gemv_kquant_wide_and_narrow_loops:
    more rows than resident warps (the grid-stride row loop: 9001 rows), a 3-segment node of one
    type with different row counts and biases behind a fused RMSNorm (find_seg per row), the 27B
    widths K = 5120 and 17408, all four types, IQ3_S and Q8_0 / Q4_0 (their switches on), add over two
    segments, SwiGLU pairs at K = 5120 and over 9001 rows; each node asserted to run the gemv_kq
    kernel; NaN-poisoned outputs, the same oracle rule. split: row groups of S warps forced (1, 2, 4: K = 512 leaves most parts of
    S = 4 without a super-block) or chosen by ops.kv9_split ("auto")."""
    cp = cupy_or_skip()
    from backends.engine import ops as eops
    q16_or_skip("the v9 kernels")
    monkeypatch.setattr(eops, "GEMV_KQ", kq)
    monkeypatch.setattr(eops, "GEMV_KQ_SPLIT", split)
    monkeypatch.setattr(eops, "GEMV_KQ_IQ3S", "1")  # IQ3_S nodes on v9 (kernels/kwide_iq3s.cuh)
    monkeypatch.setattr(eops, "GEMV_KQ_Q0", "1")    # Q8_0 / Q4_0 nodes on v9 (kernels/kwide_q0.cuh)
    monkeypatch.setattr(eops, "GEMV_KQ_P2_MIN_ROWS", "")  # P2 (q6_k by default) on these few-row nodes too
    l4 = kq == "v9"
    keep = []

    def kv9_name(mode, types, K):  # the kernel of a forced split; "auto": any split of that kernel
        return eops.kv9_kernel(mode, types, K, lanes4=l4, split=1 if split == "auto" else int(split))

    def ran(node, mode, types, K):
        name = node.kernel.name
        want = kv9_name(mode, types, K)
        if want is None:  # a node v9 does not take stays on gemv.cu
            return name.startswith("gemv_")
        if name.endswith(("_c2", "_c4")):  # the cluster split (ops.kv9_csplit; default on since session 16)
            if "KQ_CSPLIT=1" not in node.defines:
                return False
            return (name == eops.kv9_csplit(want, mode, int(split), False) if split != "auto"
                    else re.sub(r"_c[24]$", "", name) == want)
        return name == want if split != "auto" else re.sub(r"_s[24]$", "", name) == want
    for name in ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ3_S", "Q8_0", "Q4_0"):
        t = TYPES[name]
        for rows, K in ((9001, 512), (37, 5120), (5, 17408)):
            raw, w = _matrix(t, rows, K, seed=rows + K + t)
            x = np.random.default_rng(K).normal(size=K).astype(np.float32)
            node = eops.gemv("t", "store", [eops.Seg(device_tensor(cp, "w", raw, t, (K, rows), keep),
                                                     out := nan_poisoned(cp, rows))], cp.asarray(x), K)
            assert ran(node, "store", [t], K), node.kernel.name
            if name in ("Q8_0", "Q4_0"):  # on v9 (kwide_q0.cuh), not back on gemv.cu: ran() asks kv9_kernel
                assert node.kernel.name.startswith(f"gemvkq_store_{name.lower()}"), node.kernel.name
            node.launch()
            _check_rows(out.get().astype(np.float64), w, x, f"v9 {name} [{rows}x{K}]")
        K, rng, x, nw_dev, xn, mats, outs, biases, segs = _normed_biased_segments(cp, eops, t, keep)
        eops.gemv("qkv", "store", segs, cp.asarray(x), K, nw_dev, 1e-6).launch()
        for (raw, w), o, b in zip(mats, outs, biases):
            _check_rows(o.get().astype(np.float64) - b, w, xn, f"v9 {name} segment with bias and norm")
        # qwen35's ssm_in shape of node: two matrices of the type and two F32 ones (beta, alpha;
        # gemv_kq.cu f32_row), odd row counts so the halves of a 2-row warp straddle segments
        f32s = [(rng.normal(size=(r, K)) * 0.05).astype(np.float32) for r in (5, 7)]
        fouts = [nan_poisoned(cp, r) for r in (5, 7)]
        segs = [eops.Seg(device_tensor(cp, f"k{j}", raw, t, (K, raw.shape[0]), keep), o)
                for j, ((raw, _), o) in enumerate(zip(mats[:2], outs[:2]))]
        segs += [eops.Seg(device_tensor(cp, f"f{j}", f.view(np.uint8), 0, (K, f.shape[0]), keep), o)
                 for j, (f, o) in enumerate(zip(f32s, fouts))]
        for o in outs[:2]:
            o.fill(np.nan)
        node = eops.gemv("ssm_in", "store", segs, cp.asarray(x), K, nw_dev, 1e-6)
        assert ran(node, "store", [t, t, 0, 0], K), node.kernel.name
        node.launch()
        for (raw, w), o in zip(mats[:2], outs[:2]):
            _check_rows(o.get().astype(np.float64), w, xn, f"v9 {name} ssm_in-like K-quant segment")
        for f, o in zip(f32s, fouts):
            _check_rows(o.get().astype(np.float64), f.astype(np.float64), xn, f"v9 {name} ssm_in-like F32 segment")
        # add onto random values over two segments (the residual stream; find_seg per row)
        node, accs, bases = _add_node(cp, eops, t, mats[:2], x, rng, keep)
        assert ran(node, "add", [t], K), node.kernel.name
        node.launch()
        for (raw, w), a, b in zip(mats[:2], accs, bases):
            _check_rows(a.get().astype(np.float64) - b, w, x, f"v9 {name} add, two segments")
        # SwiGLU pairs: the 27B width (K = 5120) and more rows than resident warps (grid stride)
        for rows, K2 in ((23, 5120), (9001, 256)):
            node, h, ref = _swiglu_node(cp, eops, t, rows, K2, rng, keep)
            assert ran(node, "swiglu", [t, t], K2), node.kernel.name
            node.launch()
            np.testing.assert_allclose(h.get(), ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max(),
                                       err_msg=f"v9 {name} swiglu [{rows}x{K2}]")


@pytest.mark.parametrize("split", ["auto", "4"])
@pytest.mark.parametrize("build", [{"GEMV_KQ_PF": "1"}, {"GEMV_KQ_PIPE": "1"}, {"GEMV_KQ_PIPE": "2"},
                                   {"GEMV_KQ_PIPE": "2", "GEMV_KQ_MINB": "2"},
                                   {"GEMV_KQ_L1PF": "1", "GEMV_KQ_MINB": "2"}, {"GEMV_KQ_L1PF": "2", "GEMV_KQ_MINB": "2"},
                                   {"GEMV_KQ_P2": "1"}, {"GEMV_IQ4_XIL": "0"}, {"GEMV_KQ_XLANE": "0"},
                                   {"GEMV_KQ_F32_XPERM": "1"}],
                         ids=["pf1", "pipe1", "pipe2", "pipe2-minb2", "l1pf1-minb2", "l1pf2-minb2", "p2", "iq4-natural",
                              "xlane-off", "f32-xperm"])
def test_gemv_v9_latency_builds(build, split, monkeypatch):
    """The session-9 latency A/B builds of gemv_kq.cu (ops.kv9_defines: KQ_PF, the next row's
    L2 prefetch; KQ_PIPE 1, round n + 1's blocks loaded before round n's dots; KQ_PIPE 2, also
    the warp's next row's first blocks in its last round, carried into the next row; KQ_L1PF,
    L1 prefetches of the round D ahead, into the next row; prefetches change no value but must
    stay inside the weights) on every
    case of test_gemv_v9_grid_stride_segments_norm_bias: a carried block must be used by exactly
    the row it was loaded for (rows > resident warps, 3 segments with different row counts,
    F32 rows beside the type's: no carry into or out of them, SwiGLU pairs), and none where the
    warp's part has no super-block (K = 512 with S = 4) or its last row has no successor.
    p2 (session 10, GGUF_HARNESS_GEMV_KQ_P2): store/add nodes with two adjacent rows per warp, the
    same cases: odd row counts (a warp's second row missing), rows of a pair in two segments, an
    F32 row beside a K-quant one (one row at a time), each node asserted to run a _p2 kernel.
    xlane-off (GGUF_HARNESS_GEMV_KQ_XLANE=0): the xq_slot staging the Q4_K / Q5_K / Q6_K rows had before
    session 13 made lane records (kwide.cuh XLANE) their default, the same cases.
    f32-xperm (GGUF_HARNESS_GEMV_KQ_F32_XPERM=1, session 14): F32 rows beside a K-quant type read
    x in another lane order (gemv_kq.cu f32_row); the ssm_in-like cases check them."""
    from backends.engine import ops as eops
    for knob, val in build.items():
        monkeypatch.setattr(eops, knob, val)
    assert all(f"KQ_{k[8:]}={v}" in eops.kv9_defines() or f"{k[5:]}={v}" in eops.kv9_defines()
               for k, v in build.items())
    if "GEMV_KQ_P2" in build:
        assert eops.kv9_kernel("store", [12], 5120, lanes4=False) == "gemvkq_store_q4_k_p2"
    test_gemv_v9_grid_stride_segments_norm_bias("v9l8", split, monkeypatch)


@pytest.mark.parametrize("grid", ["", "0", "1", "32"], ids=["default", "global", "copies1", "copies32"])
def test_gemv_v9_iq3s_grid_tables(grid, monkeypatch):
    """The IQ3_S v9 rows (GGUF_HARNESS_GEMV_KQ_IQ3S=1) with each grid table of
    GGUF_HARNESS_GEMV_KQ_IQ3S_GRID: the default build (16 shared-memory copies since session 20:
    32 KiB of static shared memory, at K = 17408 with the staged x over the 48 KiB default, so
    module.allow_smem opts in), the global table (0), one copy, and 32 copies at the start of the
    dynamic shared memory with x after them (64 KiB more per block), store and SwiGLU nodes of the 27B's
    IQ3_S shapes cut to few rows, each asserted to run the iq3_s kernel; the oracle rule above."""
    cp = cupy_or_skip()
    from backends.engine import ops as eops
    q16_or_skip("the v9 kernels")
    _v9_default_routes(monkeypatch, eops)  # (the 8200-row pair below: the wide queue build)
    monkeypatch.setattr(eops, "GEMV_KQ_IQ3S", "1")
    monkeypatch.setattr(eops, "GEMV_KQ_IQ3S_GRID", grid)
    t, keep = TYPES["IQ3_S"], []
    for rows, K in ((41, 17408), (300, 5120)):
        raw, w = _matrix(t, rows, K, seed=rows + K)
        x = np.random.default_rng(K).normal(size=K).astype(np.float32)
        node = eops.gemv("t", "store", [eops.Seg(device_tensor(cp, "w", raw, t, (K, rows), keep),
                                                 out := nan_poisoned(cp, rows))], cp.asarray(x), K)
        assert re.fullmatch(r"gemvkq_store_iq3_s(_s[24])?", node.kernel.name), node.kernel.name
        node.launch()
        _check_rows(out.get().astype(np.float64), w, x, f"v9 IQ3_S grid {grid!r} [{rows}x{K}]")
    # 77 rows: the 16-warp build; 8200 rows: the wide queue build the 27B's IQ3_S gate/up pairs run
    # (GGUF_HARNESS_GEMV_KQ_WIDE_MIN_ROWS 8192 by default; kq_dq_body stages x after the copies too)
    for rows in (77, 8200):
        K = 5120
        (rg, wg), (ru, wu) = _matrix(t, rows, K, seed=1), _matrix(t, rows, K, seed=2)
        x = np.random.default_rng(3).normal(size=K).astype(np.float32)
        h = nan_poisoned(cp, rows)
        node = eops.gemv("f", "swiglu", [eops.Seg(device_tensor(cp, "g", rg, t, (K, rows), keep), h),
                                         eops.Seg(device_tensor(cp, "u", ru, t, (K, rows), keep), h)], cp.asarray(x), K)
        assert re.fullmatch(r"gemvkq_swiglu_iq3_s(_s[24])?", node.kernel.name), node.kernel.name
        assert ("KQ_BLOCK_WARPS=32" in node.defines) == (rows == 8200), node.defines
        assert ("KQ_DQ=1" in node.defines) == (rows == 8200), node.defines  # kq_dq_body
        node.launch()
        ref = ops.swiglu(wg @ _x_seen(x), wu @ _x_seen(x))
        np.testing.assert_allclose(h.get(), ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max(),
                                   err_msg=f"v9 IQ3_S grid {grid!r} swiglu [{rows}x{K}]")


def test_gemv_every_block_shape(monkeypatch):
    """Every (warps per block, warps per row) instantiation of the q16 GEMV, on formats with
    32- and 256-value blocks, rows not a multiple of the rows per block, all three modes; two
    I-quants for their non-inlined row loop (kernels/gemv.cu row_dot_iq), also as gate/up pair."""
    cp = cupy_or_skip()
    from backends.engine import ops as eops
    q16_or_skip("the block shapes")
    monkeypatch.setattr(eops, "GEMV_KQ", "wide")  # Q6_K at K = 2304 would take gemv_kq.cu (v9)
    K, keep = 2304, []
    rng = np.random.default_rng(3)
    x = rng.normal(size=K).astype(np.float32)
    for t in (TYPES["Q5_0"], TYPES["Q6_K"], TYPES["IQ3_S"], TYPES["IQ1_M"]):
        raw, w = _matrix(t, 37, K, seed=t)
        (rg, wg), (ru, wu) = _matrix(t, 37, K, seed=t + 1), _matrix(t, 37, K, seed=t + 2)
        for nw, wpr in sorted(eops.GEMV_SHAPES):
            what = f"type {t} b{nw} w{wpr}"
            _check_store_and_add(cp, raw, w, t, x, wpr, nw, what, keep, rng)
            h = nan_poisoned(cp, 37)
            eops.gemv("f", "swiglu", [eops.Seg(device_tensor(cp, "g", rg, t, (K, 37), keep), h),
                                      eops.Seg(device_tensor(cp, "u", ru, t, (K, 37), keep), h)],
                      cp.asarray(x), K, wpr=wpr, nw=nw).launch()
            ref = ops.swiglu(wg @ _x_seen(x), wu @ _x_seen(x))
            np.testing.assert_allclose(h.get(), ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max(), err_msg=what)


def test_gemv_nodes_mixed_split_matches_the_oracle(monkeypatch):
    """GGUF_HARNESS_GEMV_KQ_MIXED=split (ops.gemv_nodes): the 27B attention's qkv shape of node,
    Q4_K q+gate rows with Q6_K k and v rows behind a fused RMSNorm and with biases, as one v9
    node per type; every segment's NaN-poisoned output against the float64 oracle (the rule of
    the v9 tests above), and the unsplit gemv.cu node on the same inputs agreeing too."""
    cp = cupy_or_skip()
    from backends.engine import ops as eops
    q16_or_skip("the v9 kernels")
    monkeypatch.setattr(eops, "GEMV_KQ", "v9l8")
    K, keep = 5120, []
    rng = np.random.default_rng(7)
    x = rng.normal(size=K).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, K).astype(np.float32)
    nw_dev = device_tensor(cp, "norm", nw.view(np.uint8).reshape(1, -1), 0, (K,), keep)
    xn = ops.rms_norm(x[None].astype(np.float64), nw.astype(np.float64), 1e-6)[0]
    spec = [(TYPES["Q4_K"], 77), (TYPES["Q6_K"], 9), (TYPES["Q6_K"], 9)]
    mats = [_matrix(t, r, K, 300 + j) for j, (t, r) in enumerate(spec)]
    biases = [rng.normal(size=r).astype(np.float32) for _, r in spec]
    bdev = [cp.asarray(b) for b in biases]  # alive as long as the nodes run
    for mixed, want_nodes in (("split", 2), ("one", 1)):
        monkeypatch.setattr(eops, "GEMV_KQ_MIXED", mixed)
        outs = [nan_poisoned(cp, r) for _, r in spec]
        segs = [eops.Seg(device_tensor(cp, f"m{j}", raw, t, (K, r), keep), o, int(bd.data.ptr))
                for j, ((t, r), (raw, _), o, bd) in enumerate(zip(spec, mats, outs, bdev))]
        nodes = eops.gemv_nodes("blk.0.qkv", "store", segs, cp.asarray(x), K, nw_dev, 1e-6)
        assert len(nodes) == want_nodes, [n.name for n in nodes]
        for n in nodes:
            n.launch()
        for (raw, w), o, b in zip(mats, outs, biases):
            _check_rows(o.get().astype(np.float64) - b, w, xn, f"qkv mixed={mixed!r} segment")


def _run_twice(node, outs, what, prefix):
    """Launch `node` (its kernel's name must start with `prefix`) twice, the outputs refilled with
    NaN in between; assert the second launch's outputs equal the first's bit for bit (fixed lanes
    and order, no atomics). Returns the first launch's outputs (numpy)."""
    assert node.kernel.name.startswith(prefix), (what, node.kernel.name)
    node.launch()
    first = [o.get() for o in outs]
    for o in outs:
        o.fill(np.nan)
    node.launch()
    for a, o in zip(first, outs):
        assert np.array_equal(a, o.get(), equal_nan=True), f"{what}: second launch differs"
    return first


@pytest.mark.parametrize("build", [{}, {"GEMV_TMA_NST": "2", "GEMV_TMA_WARPS": "8", "GEMV_TMA_MINB": "2",
                                        "GEMV_TMA_RING": "65536"},
                                   {"GEMV_TMA_NST": "3", "GEMV_TMA_WARPS": "4", "GEMV_TMA_RING": "16384"},
                                   {"GEMV_TMA_RPW": "2"}, {"GEMV_TMA_RPW": "2", "GEMV_TMA_NST": "2", "GEMV_TMA_WARPS": "8",
                                                           "GEMV_TMA_RING": "65536"}],
                         ids=["default", "ring64k-w8", "nst3-w4-ring16k", "rpw2", "rpw2-ring64k-w8"])
def test_gemv_tma_matches_the_oracle_and_reruns_bitwise(build, monkeypatch):
    """Engine v10 (kernels/gemv_tma.cu, GGUF_HARNESS_GEMV_TMA=1): the weights reach shared memory
    through bulk copies into a ring of stages. Cases: every type at K = 512 over 9001 rows (many
    tiles per block), K = 5120 (whole rows per stage) and K = 17408 over 300 rows (rows in
    several chunks; Q6_K / IQ3_S chunks start off 16-byte boundaries), fewer rows than SMs (5:
    blocks of one row, most tile warps idle); a 3-segment node behind a fused RMSNorm with biases
    (tiles straddle segments); add over two segments; SwiGLU pairs at the 27B width, over 9001
    rows and at K = 17408. Each asserted to run a gemvtma_ kernel, NaN-poisoned outputs, the v9
    tests' oracle rule, and a second launch bitwise equal (fixed lanes and order: no atomics).
    A node with F32 rows beside the type's stays on v9. build: the default ring, and small-ring
    builds (2 stages of 8 rows in 64 KiB; 3 stages of 4 rows in 16 KiB: rows in many chunks, a
    ring index that is not a power of two), and two rows per warp (TMA_RPW 2: a warp's second row
    missing at odd row counts, the rows of a warp in two segments)."""
    cp = cupy_or_skip()
    from backends.engine import ops as eops
    q16_or_skip("the v10 kernels")
    for knob, val in build.items():
        monkeypatch.setattr(eops, knob, val)
    monkeypatch.setattr(eops, "GEMV_KQ", "v9l8")
    monkeypatch.setattr(eops, "GEMV_KQ_IQ3S", "1")
    monkeypatch.setattr(eops, "GEMV_TMA", "1")
    keep = []

    def run_twice(node, outs, what):
        return _run_twice(node, outs, what, "gemvtma_")

    for name in ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ3_S"):
        t = TYPES[name]
        for rows, K in ((9001, 512), (37, 5120), (5, 17408), (300, 17408)):
            raw, w = _matrix(t, rows, K, seed=rows + K + t)
            x = np.random.default_rng(K).normal(size=K).astype(np.float32)
            out = nan_poisoned(cp, rows)
            node = eops.gemv("t", "store", [eops.Seg(device_tensor(cp, "w", raw, t, (K, rows), keep), out)],
                             cp.asarray(x), K)
            (y,) = run_twice(node, [out], f"v10 {name} [{rows}x{K}]")
            _check_rows(y.astype(np.float64), w, x, f"v10 {name} [{rows}x{K}]")
        K, rng, x, nw_dev, xn, mats, outs, biases, segs = _normed_biased_segments(cp, eops, t, keep)
        ys = run_twice(eops.gemv("qkv", "store", segs, cp.asarray(x), K, nw_dev, 1e-6), outs, f"v10 {name} qkv")
        for (raw, w), y, b in zip(mats, ys, biases):
            _check_rows(y.astype(np.float64) - b, w, xn, f"v10 {name} segment with bias and norm")
        f32 = (rng.normal(size=(5, K)) * 0.05).astype(np.float32)
        node = eops.gemv("ssm_in", "store", [eops.Seg(device_tensor(cp, "k", mats[0][0], t, (K, 19), keep), outs[0]),
                                             eops.Seg(device_tensor(cp, "f", f32.view(np.uint8), 0, (K, 5), keep),
                                                      nan_poisoned(cp, 5))], cp.asarray(x), K)
        assert node.kernel.name.startswith("gemvkq"), node.kernel.name
        node, accs, bases = _add_node(cp, eops, t, mats[:2], x, rng, keep)
        assert node.kernel.name == f"gemvtma_add_{eops.KV9_NAMES[t]}", node.kernel.name
        node.launch()
        for (raw, w), a, b in zip(mats[:2], accs, bases):
            _check_rows(a.get().astype(np.float64) - b, w, x, f"v10 {name} add, two segments")
        for rows, K2 in ((23, 5120), (9001, 256), (70, 17408)):
            node, h, ref = _swiglu_node(cp, eops, t, rows, K2, rng, keep)
            (y,) = run_twice(node, [h], f"v10 {name} swiglu [{rows}x{K2}]")
            np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max(),
                                       err_msg=f"v10 {name} swiglu [{rows}x{K2}]")


def test_iq4_xil_build_is_bitwise_equal_to_the_default(monkeypatch):
    """GGUF_HARNESS_GEMV_IQ4_XIL=1 (kernels/kwide_iq4.cuh: x staged with interleaved halves, the
    qs words' lookups used as they are) sums the same integer products in another order, the
    RMSNorm's sum of squares in the default's order (xstage.cuh) and F32 rows beside IQ4_XS ones
    in the default's order too (gemv_kq.cu f32_row), so its IQ4_XS outputs must equal the default
    build's bit for bit: v9 store and gate/up nodes at the 27B widths behind a fused RMSNorm, for
    several activation vectors (a sum of squares in another order changes 1/rms in the last bit
    for most of them: session 11's first XIL build did, and the 27B logits differed), an
    ssm_in-like node (IQ4_XS and F32 rows, which must stay on gemv_kq.cu), and the store and
    gate/up nodes through v10 (GGUF_HARNESS_GEMV_TMA=1); each output also checked against the
    oracle rule."""
    cp = cupy_or_skip()
    from backends.engine import ops as eops
    q16_or_skip()
    monkeypatch.setattr(eops, "GEMV_KQ", "v9l8")
    t, keep = TYPES["IQ4_XS"], []
    rng = np.random.default_rng(23)
    K = 5120
    xs = [rng.normal(size=K).astype(np.float32) * s for s in (1.0, 0.3, 7.0, 1.0)]
    nw = rng.uniform(0.5, 1.5, K).astype(np.float32)
    nw_dev = device_tensor(cp, "norm", nw.view(np.uint8).reshape(1, -1), 0, (K,), keep)
    (rg, wg), (ru, _) = _matrix(t, 301, K, seed=5), _matrix(t, 301, K, seed=6)
    g_dev = device_tensor(cp, "g", rg, t, (K, 301), keep)
    u_dev = device_tensor(cp, "u", ru, t, (K, 301), keep)
    f32 = (rng.normal(size=(7, K)) * 0.05).astype(np.float32)
    f_dev = device_tensor(cp, "f", f32.view(np.uint8), 0, (K, 7), keep)
    for tma in ("", "1"):
        monkeypatch.setattr(eops, "GEMV_TMA", tma)
        got = {}
        for xil in ("", "1"):
            monkeypatch.setattr(eops, "GEMV_IQ4_XIL", xil)
            got[xil] = []
            for x in xs:
                xn = ops.rms_norm(x[None].astype(np.float64), nw.astype(np.float64), 1e-6)[0]
                y, h = nan_poisoned(cp, 301), nan_poisoned(cp, 301)
                n1 = eops.gemv("s", "store", [eops.Seg(g_dev, y)], cp.asarray(x), K, nw_dev, 1e-6)
                n2 = eops.gemv("f", "swiglu", [eops.Seg(g_dev, h), eops.Seg(u_dev, h)], cp.asarray(x), K, nw_dev, 1e-6)
                want = "gemvtma_" if tma else "gemvkq_"
                assert n1.kernel.name.startswith(want) and n2.kernel.name.startswith(want), (n1.kernel.name, n2.kernel.name)
                # IQ4_XS with F32 rows: v9 in either build (v10 takes no F32 rows)
                ys, yf = nan_poisoned(cp, 301), nan_poisoned(cp, 7)
                n3 = eops.gemv("ssm_in", "store", [eops.Seg(g_dev, ys), eops.Seg(f_dev, yf)], cp.asarray(x), K,
                               nw_dev, 1e-6)
                assert n3.kernel.name.startswith("gemvkq_"), n3.kernel.name
                for n in (n1, n2, n3):
                    n.launch()
                got[xil].append((y.get(), h.get(), ys.get(), yf.get()))
                _check_rows(got[xil][-1][0].astype(np.float64), wg, xn, f"IQ4_XIL={xil!r} tma={tma!r} store")
                _check_rows(got[xil][-1][3].astype(np.float64), f32.astype(np.float64), xn,
                            f"IQ4_XIL={xil!r} F32 rows")
        for i, (a, b) in enumerate(zip(got[""], got["1"])):
            for what, u, v in zip(("store", "swiglu", "ssm_in IQ4_XS", "ssm_in F32"), a, b):
                assert np.array_equal(u, v), f"tma={tma!r} x #{i}: {what} differs"


def test_xlane_build_is_bitwise_equal_to_the_default(monkeypatch):
    """GGUF_HARNESS_GEMV_KQ_XLANE=1, the default (kernels/kwide.cuh XLANE: x staged in lane-major records with
    each lane's run sums and block scales, read from one base address) feeds the 8-lane Q4_K /
    Q5_K / Q6_K rows the same codes, sums and scales as the default staging and runs the same
    arithmetic, so every output must equal the xq_slot build's (XLANE=0) bit for bit: store nodes at the
    27B widths behind a fused RMSNorm for several activation vectors, add and SwiGLU nodes, the
    Q6_K store through P2 (two rows per warp, the default for K <= 6144 and >= 2048 rows, forced here
    for the few rows of these cases), an ssm_in-like node
    (F32 rows beside the K-quant ones: f32_row reads natural entries from the records), each at
    every split; each output also checked against the oracle rule."""
    _build_is_bitwise_equal("GEMV_KQ_XLANE", ("0", "1"), "KQ_XLANE=0", "0",
                            (("Q4_K", 5120, 301), ("Q5_K", 6144, 77), ("Q6_K", 5120, 301), ("Q6_K", 17408, 9)),
                            monkeypatch)


def test_iq4_kreg_build_is_bitwise_equal_to_the_default(monkeypatch):
    """GGUF_HARNESS_GEMV_IQ4_KREG=1, the default since session 14 (kernels/kwide_iq4.cuh IQ4_KREG:
    codebook words K0 and K2 loaded once into registers instead of re-made from constants before
    each lookup) runs the same
    lookups on the same values, so every IQ4_XS output must equal the default build's bit for bit:
    store nodes behind a fused RMSNorm, SwiGLU pairs, add nodes and ssm_in-like nodes (F32 rows
    beside), the 27B widths, every split; each output also checked against the oracle rule."""
    _build_is_bitwise_equal("GEMV_IQ4_KREG", ("0", "1"), "IQ4_KREG=0", "0",
                            (("IQ4_XS", 5120, 301), ("IQ4_XS", 17408, 9), ("IQ4_XS", 5120, 77)), monkeypatch)


@pytest.mark.parametrize("kq", ["v9", "v9l8"])
def test_wmaj_build_is_bitwise_equal_to_the_default(kq, monkeypatch):
    """GGUF_HARNESS_GEMV_KQ_WMAJ=1 (kernels/gemv_kq.cu KQ_WMAJ: row groups dealt warp-major over the
    grid) only changes which warp computes a row, so every output must equal the block-major
    build's bit for bit, also on the second and third launch of a node. Row counts above the H200's
    4224 resident warps (a partial last pass; F32 rows beside the last ones): 8-lane and 4-lane
    (kq "v9") Q4_K / Q5_K rows, Q6_K through P2, IQ4_XS pairs; every split (S > 1: the block-
    uniform loop bound of a warp-major block)."""
    _build_is_bitwise_equal("GEMV_KQ_WMAJ", ("0", "1"), "KQ_WMAJ=1", "1",
                            (("Q4_K", 5120, 9001), ("Q5_K", 6144, 8999), ("Q6_K", 5120, 9001), ("IQ4_XS", 5120, 8777)),
                            monkeypatch, kq=kq, relaunch=3)


@pytest.mark.parametrize("kq", ["v9", "v9l8"])
def test_bw32_build_matches_the_default(kq, monkeypatch):
    """GGUF_HARNESS_GEMV_KQ_BW=32 (kernels/gemv_kq.cu KQ_BLOCK_WARPS=32: one block of 32 warps per SM)
    changes which warp computes a row and how many warps share the staging, so the nodes without a
    norm must equal the 16-warp build's bit for bit, also on relaunch; the nodes with a fused
    RMSNorm are held to the oracle rule only: block_sum adds the sum of squares from 32 warps'
    partials instead of 16 (another float order; the 27B engine's logits differed in their last
    bits, session 15). The cases of the KQ_WMAJ test, every split."""
    _build_is_bitwise_equal("GEMV_KQ_BW", ("", "32"), "KQ_BLOCK_WARPS=32", "32",
                            (("Q4_K", 5120, 9001), ("Q5_K", 6144, 8999), ("Q6_K", 5120, 9001), ("IQ4_XS", 5120, 8777)),
                            monkeypatch, kq=kq, relaunch=3, normed=False)


@pytest.mark.parametrize("kq", ["v9", "v9l8"])
def test_wide_nodes_match_the_default(kq, monkeypatch):
    """GGUF_HARNESS_GEMV_KQ_WIDE_MIN_ROWS (default 8192): split-1 nodes of that many rows run the
    wide build (1024-thread blocks, warp-major rows) and must give the 16-warp build's outputs: bit
    for bit without a norm, within the oracle rule with a fused RMSNorm (test_bw32_build_matches_
    the_default says why); the nodes of fewer rows, or of S > 1, stay on 512-thread blocks. (The
    wide SwiGLU nodes run the row-queue form of the wide build since session 17, also bitwise equal.)"""
    cp = cupy_or_skip()
    from backends.engine import ops as eops
    q16_or_skip()
    monkeypatch.setattr(eops, "GEMV_KQ", kq)
    monkeypatch.setattr(eops, "GEMV_KQ_WIDE_MIN_ROWS", "")
    keep = []
    rg, _ = _matrix(TYPES["IQ4_XS"], 8777, 5120, seed=5)
    w = device_tensor(cp, "w", rg, TYPES["IQ4_XS"], (5120, 8777), keep)
    ws = device_tensor(cp, "ws", rg[:777], TYPES["IQ4_XS"], (5120, 777), keep)
    out, x = cp.zeros(8777, dtype=cp.float32), cp.ones(5120, dtype=cp.float32)
    assert eops.gemv("w", "swiglu", [eops.Seg(w, out), eops.Seg(w, out)], x, 5120).block == (1024,)
    assert eops.gemv("s", "swiglu", [eops.Seg(ws, out), eops.Seg(ws, out)], x, 5120).block == (512,)
    # the helper's nodes of 9001 rows at split 1 go wide too (its "" runs are not the "off" build)
    monkeypatch.setattr(eops, "GEMV_KQ_SPLIT", "1")
    rq, _ = _matrix(TYPES["Q4_K"], 9001, 5120, seed=6)
    q = device_tensor(cp, "q", rq, TYPES["Q4_K"], (5120, 9001), keep)
    node = eops.gemv("q", "store", [eops.Seg(q, cp.zeros(9001, dtype=cp.float32))], x, 5120)
    assert node.block == (1024,) and "KQ_BLOCK_WARPS=32" in node.defines
    _build_is_bitwise_equal("GEMV_KQ_WIDE_MIN_ROWS", ("off", ""), "<no define: a routing switch>", "<never>",
                            (("Q4_K", 5120, 9001), ("Q6_K", 5120, 9001), ("IQ4_XS", 5120, 8777)),
                            monkeypatch, kq=kq, relaunch=3, normed=False)


@pytest.mark.parametrize("split,gsplit,rot", [("2", "0", ""), ("2", "1", ""), ("4", "0", "0"), ("4", "1", "0"),
                                              ("4", "0", ""), ("4", "1", ""), ("4", "0", "round"), ("4", "1", "round")])
def test_csplit_nodes_are_bitwise_equal_to_the_split_kernels(split, gsplit, rot, monkeypatch):
    """GGUF_HARNESS_GEMV_KQ_CSPLIT=1 (kernels/gemv_kq.cu KQ_CSPLIT): the parts of a row group in the
    blocks of a thread-block cluster compute the partial sums the _s<S> kernel's warps compute and
    rank 0 adds them in the same order, so store and add nodes without a norm must equal the
    S-split's outputs bit for bit (also on relaunch), each checked against the oracle, and each
    node must have run the _c<S> kernel with a grid of whole clusters. With
    GGUF_HARNESS_GEMV_KQ_GSPLIT=1 (KQ_GSPLIT) the same for groups of blocks without hardware
    clusters, whose parts meet in global memory (the relaunch also checks that the last block
    reset the group's count). Cases: every 8-lane type; K
    = 17408 (17 groups of 4 super-blocks: parts of unequal size), K = 2816 (a partial group), K =
    512 at S = 4 (parts without a super-block), row counts above one round of clusters, two
    segments of different row counts. A node of more than KQ_CS_MAXR rounds falls back to the
    S-split kernel, and a normed node is never taken. All of that with GGUF_HARNESS_GEMV_KQ_PART_ROT=0,
    the default row key ("") and session 20's round key (`rot`; the two "round" cases were added
    after session 21's runs and have not run). By default (gemv_kq.cu kq_row_part) the 4-part _c4 kernels hand a row's leftover groups
    of 4 super-blocks to a part that changes with the row group, which the _s4 kernels do not: then
    the two add other partial sums, so at S = 4 a node with leftovers is held to the oracle rule
    only (K = 17408: one leftover group of 17; K = 2816: all 3 groups leftovers, the last partial;
    K = 512: one partial group; 2000 rows: later rounds, where the leftover moves to other parts);
    a node without (K = 4096: 4 groups) and every S = 2 node keep the bitwise check. (Session 21 on
    the H200, under session 20's round key: the 4 cases with the rotation passed; the 2 with rot 0
    failed on the define check, which then wrongly asked the _s4 build for KQ_PART_ROT=0, since
    fixed: only the cluster builds take it.)"""
    cp = cupy_or_skip()
    from backends.engine import ops as eops
    q16_or_skip()
    monkeypatch.setattr(eops, "GEMV_KQ_PART_ROT", rot)
    monkeypatch.setattr(eops, "GEMV_KQ", "v9l8")
    monkeypatch.setattr(eops, "GEMV_KQ_P2_MIN_ROWS", "1000000")  # Q6_K on the one-row-per-warp kernels
    monkeypatch.setattr(eops, "GEMV_KQ_SPLIT", split)
    monkeypatch.setattr(eops, "GEMV_KQ_GSPLIT", gsplit)
    # every type's cluster kernels, not only the default's KV9_CSPLIT_TYPES (all passed this test on
    # the H200 in session 16 before the default was narrowed to the types measured faster)
    monkeypatch.setattr(eops, "KV9_CSPLIT_TYPES", ("q4_k", "q5_k", "q6_k", "iq4_xs", "iq3_s", "q8_0", "q4_0"))
    S = int(split)
    rng = np.random.default_rng(41)
    keep = []
    cases = [("Q4_K", 17408, 1500), ("Q5_K", 6144, 4099), ("Q6_K", 5120, 301), ("IQ4_XS", 5120, 777),
             ("IQ3_S", 2048, 333), ("Q8_0", 4096, 257), ("Q4_0", 2048, 97), ("Q4_K", 2816, 2000)]
    if S == 4:  # (2000 rows: more than one round of groups, so the rotation's later rounds run)
        cases.append(("Q4_K", 512, 2000))
    for name, K, rows in cases:
        t = TYPES[name]
        (ra, wa), (rb, wb) = _matrix(t, rows, K, seed=rows + 7), _matrix(t, 29, K, seed=rows + 8)
        a_dev = device_tensor(cp, "a", ra, t, (K, rows), keep)
        b_dev = device_tensor(cp, "b", rb, t, (K, 29), keep)
        x = (rng.normal(size=K) * 0.7).astype(np.float32)
        base = rng.normal(size=rows).astype(np.float32)
        got = {}
        for cs in ("0", "1"):
            monkeypatch.setattr(eops, "GEMV_KQ_CSPLIT", cs)
            ya, yb = nan_poisoned(cp, rows), nan_poisoned(cp, 29)
            acc = cp.asarray(base)
            nodes = [eops.gemv("s", "store", [eops.Seg(a_dev, ya), eops.Seg(b_dev, yb)], cp.asarray(x), K),
                     eops.gemv("o", "add", [eops.Seg(a_dev, acc)], cp.asarray(x), K)]
            want = f"_c{S}" if cs == "1" else f"_s{S}"
            for n in nodes:
                assert n.kernel.name.startswith("gemvkq_") and n.kernel.name.endswith(want), (cs, n.kernel.name)
                assert n.grid[0] % S == 0 or cs == "0", n.grid
                assert ("KQ_CSPLIT=1" in n.defines) == (cs == "1"), n.defines
                assert ("KQ_GSPLIT=1" in n.defines) == (cs == "1" and gsplit == "1"), n.defines
                # (only the 4-part cluster builds take the define: kv9_csplit_defines; the row key,
                # "" or row, is the kernel's default)
                want_rot = [{"0": "KQ_PART_ROT=0", "round": "KQ_PART_ROT=1"}[rot]] \
                    if cs == "1" and S == 4 and rot in ("0", "round") else []
                assert [d for d in n.defines if d.startswith("KQ_PART_ROT")] == want_rot, n.defines
                n.launch()
            got[cs] = (ya.get(), yb.get(), acc.get())
            ya.fill(np.nan)  # a relaunch that stored nothing (a group count left unreset) must show
            yb.fill(np.nan)
            nodes[0].launch()
            assert np.array_equal(got[cs][0], ya.get()) and np.array_equal(got[cs][1], yb.get()), \
                f"{name} [{rows}x{K}] CSPLIT={cs}: store changed on relaunch"
            what = f"{name} [{rows}x{K}] S={S} CSPLIT={cs}"
            _check_rows(got[cs][0].astype(np.float64), wa, x, f"{what} store, segment 0")
            _check_rows(got[cs][1].astype(np.float64), wb, x, f"{what} store, segment 1")
            _check_rows(got[cs][2].astype(np.float64) - base, wa, x, f"{what} add")
        if S == 4 and rot != "0" and -(-K // 1024) % 4:
            continue  # leftover groups: the rotated _c4 kernel adds other partial sums than _s4 (oracle above)
        for what, u, v in zip(("store seg 0", "store seg 1", "add"), got["0"], got["1"]):
            assert np.array_equal(u, v), f"{name} [{rows}x{K}] S={S}: {what} differs from the S-split"
    # more rounds than KQ_CS_MAXR: the S-split kernel; a fused norm: never a cluster
    monkeypatch.setattr(eops, "GEMV_KQ_CSPLIT", "1")
    # more than KQ_CS_MAXR rounds even at 4 blocks of 16 warps per SM (2 clusters of 2 per SM)
    rows = (eops.KQ_CS_MAXR + 1) * 16 * 2 * eops.module.sm_count()
    raw, _ = _matrix(TYPES["Q8_0"], rows, 256, seed=3)
    big = device_tensor(cp, "big", raw, TYPES["Q8_0"], (256, rows), keep)
    out = cp.zeros(rows, dtype=cp.float32)
    n = eops.gemv("big", "store", [eops.Seg(big, out)], cp.ones(256, dtype=cp.float32), 256)
    assert n.kernel.name.endswith(f"_s{S}"), n.kernel.name
    nw = device_tensor(cp, "nw", np.ones(5120, np.float32).view(np.uint8).reshape(1, -1), 0, (5120,), keep)
    (r6, _) = _matrix(TYPES["Q6_K"], 301, 5120, seed=9)
    w6 = device_tensor(cp, "w6", r6, TYPES["Q6_K"], (5120, 301), keep)
    n = eops.gemv("normed", "store", [eops.Seg(w6, cp.zeros(301, dtype=cp.float32))], cp.ones(5120, dtype=cp.float32),
                  5120, nw, 1e-6)
    assert n.kernel.name.endswith(f"_s{S}"), n.kernel.name


@pytest.mark.gpu
def test_part_rot_row_key_does_not_depend_on_the_grid(monkeypatch):
    """The row key (GGUF_HARNESS_GEMV_KQ_PART_ROT "" or row, kernels/gemv_kq.cu KQ_PART_ROT=2, the
    default since session 21; session 21 ran this test with =row and then with the default, the
    same build, passing both times) keys a row's leftover
    groups on its row group rather than on the warp's round, so the same 4-part node run as groups
    in global memory (GGUF_HARNESS_GEMV_KQ_GSPLIT=1: every block slot) and as hardware clusters
    (GSPLIT=0: as many clusters as are co-resident), two different group counts, must give the same
    outputs bit for bit, each within the oracle rule, with odd group counts where ops.kv9_odd_groups
    can make them so. Nodes with a leftover group over more than one round: K = 17408 (17 groups)
    and 5120 (5), and a partial one (K = 2816)."""
    cp = cupy_or_skip()
    from backends.engine import ops as eops
    q16_or_skip()
    _v9_default_routes(monkeypatch, eops)
    monkeypatch.setattr(eops, "GEMV_KQ_PART_ROT", "")
    monkeypatch.setattr(eops, "GEMV_KQ_SPLIT", "4")
    rng = np.random.default_rng(61)
    keep, compared = [], 0
    for name, K, rows in (("Q4_K", 17408, 3000), ("Q5_K", 5120, 2500), ("Q4_K", 2816, 2100)):
        t = TYPES[name]
        raw, w = _matrix(t, rows, K, seed=rows + K)
        dev = device_tensor(cp, "w", raw, t, (K, rows), keep)
        x = (rng.normal(size=K) * 0.7).astype(np.float32)
        got, grids = {}, {}
        for gsplit in ("1", "0"):
            monkeypatch.setattr(eops, "GEMV_KQ_GSPLIT", gsplit)
            out = nan_poisoned(cp, rows)
            n = eops.gemv("d", "store", [eops.Seg(dev, out)], cp.asarray(x), K)
            assert n.kernel.name.endswith("_c4") and not any(d.startswith("KQ_PART_ROT") for d in n.defines), \
                (n.kernel.name, n.defines)
            assert ("KQ_GSPLIT=1" in n.defines) == (gsplit == "1"), n.defines
            n.launch()
            got[gsplit], grids[gsplit] = out.get(), n.grid[0] // 4
            _check_rows(got[gsplit].astype(np.float64), w, x, f"{name} [{rows}x{K}] row key, GSPLIT={gsplit}")
            if grids[gsplit] > 2:  # odd wherever one group fewer costs no round (ops.kv9_odd_groups)
                even_ok = -(-rows // (16 * (grids[gsplit] - 1))) > -(-rows // (16 * grids[gsplit]))
                assert grids[gsplit] % 2 or even_ok, (name, rows, K, gsplit, grids[gsplit])
        if grids["1"] == grids["0"]:
            continue  # the same group count either way on this GPU: nothing to compare for this shape
        compared += 1
        assert np.array_equal(got["1"], got["0"]), f"{name} [{rows}x{K}]: groups {grids} gave other bits"
    if not compared:
        pytest.skip("every shape had the same group count as groups and as clusters on this GPU")


def _dq_tail(n_rows, grid, T, strided=False):
    """Boolean [n_rows]: the rows kernels/gemv_kq.cu kq_dq_body splits into parts, the last
    min(rows, T) of each block's rows: the range [b N / B, (b + 1) N / B), or (KQ_DQ_MAP=1) the rows
    b, b + B, ... (written from the kernel's comment, not from ops)."""
    tail = np.zeros(n_rows, bool)
    for b in range(grid):
        mine = np.arange(b, n_rows, grid) if strided else np.arange(b * n_rows // grid, (b + 1) * n_rows // grid)
        tail[mine[mine.size - min(mine.size, T):]] = True
    return tail


@pytest.mark.gpu
@pytest.mark.parametrize("T,P,MAP", [("", "", ""), ("8", "4", "0"), ("32", "2", "1"), ("32", "1", "0")])
def test_dq_nodes_are_bitwise_equal_to_the_split_kernels(T, P, MAP, monkeypatch):
    """GGUF_HARNESS_GEMV_KQ_DQ (kernels/gemv_kq.cu KQ_DQ, default on): a wide node's rows come from a
    queue per block and (A/B) each block's last T rows are split into P parts, so every full row must equal the
    32-warp S = 1 kernel's bit for bit and every tail row the 32-warp _s<P> kernel's (the same
    partial sums added in the same order; the same block_sum for a fused norm), also on relaunch;
    each output also against the oracle; the default (P 1, rows b, b + B, ... per block) and A/B
    builds (P 4 / 2, 8 / 32 tail rows, contiguous rows). Cases: a normed IQ4_XS SwiGLU pair, normed
    Q4_K store and add, an ssm_in-like normed Q5_K store with F32 rows beside in blocks of fewer rows
    than warps, Q6_K at K = 17408 (17 rounds), an IQ3_S pair at K = 2816 (3 rounds: a part of 4
    without super-blocks adds 0) and Q8_0 at K = 512 (one round)."""
    cp = cupy_or_skip()
    from backends.engine import ops as eops
    q16_or_skip()
    monkeypatch.setattr(eops, "GEMV_KQ", "v9l8")
    monkeypatch.setattr(eops, "GEMV_KQ_CSPLIT", "0")
    monkeypatch.setattr(eops, "GEMV_KQ_P2_MIN_ROWS", "1000000")  # Q6_K on the one-row-per-warp kernels
    monkeypatch.setattr(eops, "GEMV_KQ_DQ_P", P)
    monkeypatch.setattr(eops, "GEMV_KQ_DQ_T", T)
    monkeypatch.setattr(eops, "GEMV_KQ_DQ_MAP", MAP)
    P, T, MAP = int(P or 1), int(T or 32), MAP or "1"  # unset: the kernel's KQ_DQ_P 1, KQ_DQ_T 32, KQ_DQ_MAP 1
    rng = np.random.default_rng(43)
    keep = []
    cases = [("IQ4_XS", 5120, 8777, "swiglu"), ("Q4_K", 5120, 9001, "store"), ("Q4_K", 5120, 9001, "add"),
             ("Q5_K", 5120, 700, "ssm_in"), ("Q6_K", 17408, 5000, "store"), ("IQ3_S", 2816, 3001, "swiglu"),
             ("Q8_0", 512, 9001, "store")]
    runs = {"dq": dict(GEMV_KQ_BW="", GEMV_KQ_WIDE_MIN_ROWS="0", GEMV_KQ_DQ="all"),  # store/add nodes too
            "s1": dict(GEMV_KQ_BW="32", GEMV_KQ_WIDE_MIN_ROWS="off", GEMV_KQ_DQ="0")}
    for name, K, rows, kind in cases:
        t = TYPES[name]
        (ra, wa), (rb, wb) = _matrix(t, rows, K, seed=rows + 1), _matrix(t, rows, K, seed=rows + 2)
        a_dev = device_tensor(cp, "a", ra, t, (K, rows), keep)
        b_dev = device_tensor(cp, "b", rb, t, (K, rows), keep)
        f32 = (rng.normal(size=(29, K)) * 0.05).astype(np.float32)
        f_dev = device_tensor(cp, "f", f32.view(np.uint8), 0, (K, 29), keep)
        nw = rng.uniform(0.5, 1.5, K).astype(np.float32)
        nw_dev = device_tensor(cp, "norm", nw.view(np.uint8).reshape(1, -1), 0, (K,), keep)
        x = (rng.normal(size=K) * 0.7).astype(np.float32)
        xn = ops.rms_norm(x[None].astype(np.float64), nw.astype(np.float64), 1e-6)[0]
        base = rng.normal(size=rows).astype(np.float32)
        got, grid = {}, None
        for run in ("dq", "s1", "sP"):
            for k, v in (runs[run] if run != "sP" else runs["s1"]).items():
                monkeypatch.setattr(eops, k, v)
            monkeypatch.setattr(eops, "GEMV_KQ_SPLIT", str(P) if run == "sP" else "1")
            outs = [nan_poisoned(cp, rows)] + ([nan_poisoned(cp, 29)] if kind == "ssm_in" else [])
            if kind == "swiglu":
                node = eops.gemv("f", "swiglu", [eops.Seg(a_dev, outs[0]), eops.Seg(b_dev, outs[0])], cp.asarray(x), K,
                                 nw_dev, 1e-6)
            elif kind == "ssm_in":
                node = eops.gemv("ssm_in", "store", [eops.Seg(a_dev, outs[0]), eops.Seg(f_dev, outs[1])], cp.asarray(x),
                                 K, nw_dev, 1e-6)
            elif kind == "add":
                outs = [cp.asarray(base)]
                node = eops.gemv("o", "add", [eops.Seg(a_dev, outs[0])], cp.asarray(x), K)
            else:
                node = eops.gemv("s", "store", [eops.Seg(a_dev, outs[0])], cp.asarray(x), K, nw_dev, 1e-6)
            what = f"{name} [{rows}x{K}] {kind} {run}"
            assert node.kernel.name.startswith("gemvkq_") and "_p2" not in node.kernel.name, (what, node.kernel.name)
            assert ("KQ_DQ=1" in node.defines) == (run == "dq"), (what, node.defines)
            assert node.block == (1024,), (what, node.block)
            if run == "dq":
                assert "KQ_WMAJ=1" not in node.defines, node.defines
                grid = node.grid[0]
            node.launch()
            got[run] = np.concatenate([o.get() for o in outs])
            if kind != "add":  # relaunch: the same outputs (the add accumulates)
                node.launch()
                assert np.array_equal(got[run], np.concatenate([o.get() for o in outs])), f"{what}: changed on relaunch"
            y = got[run].astype(np.float64)
            if kind == "swiglu":
                v = gemv_check.check_swiglu(y, wa, wb, xn, impl=eops.GEMV_IMPL)
                assert v["ok"], f"{what}: {v}"
            elif kind == "add":
                _check_rows(y - base, wa, x, what)
            else:
                _check_rows(y[:rows], wa, xn, what)
                if kind == "ssm_in":
                    _check_rows(y[rows:], f32.astype(np.float64), xn, f"{what} F32 rows")
        tail = _dq_tail(got["dq"].size, grid, T, MAP == "1")
        assert tail.any() and (kind == "ssm_in" or not tail.all() or T == 32)
        what = f"{name} [{rows}x{K}] {kind} (P {P}, grid {grid})"
        assert np.array_equal(got["dq"][~tail], got["s1"][~tail]), f"{what}: full rows differ from S = 1"
        assert np.array_equal(got["dq"][tail], got["sP"][tail]), f"{what}: tail rows differ from S = {P}"


@pytest.mark.gpu
@pytest.mark.parametrize("switch,value,define", [("GEMV_KQ_XPF", "8", "KQ_XPF=1"), ("GEMV_KQ_PF0", "0", "KQ_PF0=0"),
                                                 ("GEMV_KQ_PF0", "1", "KQ_PF0=1"), ("GEMV_KQ_PF0", "2", "KQ_PF0=2"),
                                                 ("GEMV_KQ_PF0_SB", "2", "KQ_PF0_SB=2"), ("GEMV_KQ_PF0_SB", "4", "KQ_PF0_SB=4"),
                                                 ("GEMV_KQ_PRE", "1", "KQ_PRE=1")])
def test_xpf_build_is_bitwise_equal_to_the_default(switch, value, define, monkeypatch):
    """GGUF_HARNESS_GEMV_KQ_XPF (kernels/gemv_kq.cu KQ_XPF, backends/engine/xpf.py) only adds L2
    prefetches of the next node's rows, and GGUF_HARNESS_GEMV_KQ_PF0 (KQ_PF0) and _PF0_SB only drop,
    move or resize each warp's first-row prefetch, and _PRE only loads each warp's first round before
    the PDL wait and adds it first, so a chain of v9 nodes (linked by xpf.link for XPF) must give
    the outputs of the default build bit for bit, also when run again; each output also against
    the oracle. The chain covers the routes of the 27B step: a normed wide store (warp-major), a
    normed SwiGLU pair (the row queue), a cluster-split add, an S-split Q6_K store, a Q6_K
    store through P2, two ssm_in-like normed stores of Q5_K rows with F32 rows after them (the
    wide warp-major build, and a 16-warp split build where some warps' first rows are F32 rows),
    the 4-part group add of the 27B's ffn_down ([5120x17408], rotated leftovers) and two adds at
    K = 1280 forced to 2 and 4 parts (5 super-blocks: lanes whose part has no first super-block,
    and a 4-part rotation without a full sweep, where PRE loads nothing); with XPF on every node
    but the last must have been given a target."""
    cp = cupy_or_skip()
    from backends.engine import ops as eops, xpf
    q16_or_skip()
    _v9_default_routes(monkeypatch, eops)
    for knob in ("GEMV_KQ_XPF", "GEMV_KQ_PF0", "GEMV_KQ_PF0_SB", "GEMV_KQ_PRE"):  # the default build on the "" side
        monkeypatch.setattr(eops, knob, "")
    rng = np.random.default_rng(47)
    keep = []
    K = 5120
    nw = rng.uniform(0.5, 1.5, K).astype(np.float32)
    nw_dev = device_tensor(cp, "norm", nw.view(np.uint8).reshape(1, -1), 0, (K,), keep)
    x = (rng.normal(size=K) * 0.7).astype(np.float32)
    xn = ops.rms_norm(x[None].astype(np.float64), nw.astype(np.float64), 1e-6)[0]
    x6 = (rng.normal(size=6144) * 0.7).astype(np.float32)
    x17 = (rng.normal(size=17408) * 0.7).astype(np.float32)
    x12 = (rng.normal(size=1280) * 0.7).astype(np.float32)
    mats = {}
    for key, (name, rows, k) in {"q4": ("Q4_K", 9001, K), "g": ("IQ4_XS", 8777, K), "u": ("IQ4_XS", 8777, K),
                                 "q5": ("Q5_K", 5120, 6144), "q6s": ("Q6_K", 1024, K), "q6p": ("Q6_K", 4096, K),
                                 "si": ("Q5_K", 9001, K), "sj": ("Q5_K", 700, K), "d4": ("Q4_K", 5120, 17408),
                                 "k2": ("Q4_K", 700, 1280), "k4": ("Q4_K", 700, 1280)}.items():
        raw, w = _matrix(TYPES[name], rows, k, seed=rows + len(key))
        mats[key] = (device_tensor(cp, key, raw, TYPES[name], (k, rows), keep), w)
    f32 = (rng.normal(size=(29, K)) * 0.05).astype(np.float32)  # ssm_in's beta / alpha rows
    f_dev = device_tensor(cp, "f", f32.view(np.uint8), 0, (K, 29), keep)
    base = rng.normal(size=5120).astype(np.float32)
    base7 = rng.normal(size=700).astype(np.float32)
    got, kernels = {}, {}
    for on in ("", value):
        monkeypatch.setattr(eops, switch, on)
        outs = {"q4": nan_poisoned(cp, 9001), "g": nan_poisoned(cp, 8777), "q5": cp.asarray(base),
                "q6s": nan_poisoned(cp, 1024), "q6p": nan_poisoned(cp, 4096), "si": nan_poisoned(cp, 9001),
                "sj": nan_poisoned(cp, 700), "sif": nan_poisoned(cp, 29), "sjf": nan_poisoned(cp, 29),
                "d4": cp.asarray(base), "k2": cp.asarray(base7), "k4": cp.asarray(base7)}
        S = eops.Seg
        nodes = [eops.gemv("s", "store", [S(mats["q4"][0], outs["q4"])], cp.asarray(x), K, nw_dev, 1e-6),
                 eops.gemv("f", "swiglu", [S(mats["g"][0], outs["g"]), S(mats["u"][0], outs["g"])], cp.asarray(x), K,
                           nw_dev, 1e-6),
                 eops.gemv("o", "add", [S(mats["q5"][0], outs["q5"])], cp.asarray(x6), 6144),
                 eops.gemv("q6", "store", [S(mats["q6s"][0], outs["q6s"])], cp.asarray(x), K),
                 eops.gemv("p2", "store", [S(mats["q6p"][0], outs["q6p"])], cp.asarray(x), K),
                 eops.gemv("si", "store", [S(mats["si"][0], outs["si"]), S(f_dev, outs["sif"])], cp.asarray(x), K,
                           nw_dev, 1e-6),
                 eops.gemv("sj", "store", [S(mats["sj"][0], outs["sj"]), S(f_dev, outs["sjf"])], cp.asarray(x), K,
                           nw_dev, 1e-6),
                 eops.gemv("d4", "add", [S(mats["d4"][0], outs["d4"])], cp.asarray(x17), 17408)]
        for key, split in (("k2", "2"), ("k4", "4")):  # forced splits (auto leaves K = 1280 whole)
            monkeypatch.setattr(eops, "GEMV_KQ_SPLIT", split)
            nodes.append(eops.gemv(key, "add", [S(mats[key][0], outs[key])], cp.asarray(x12), 1280))
        monkeypatch.setattr(eops, "GEMV_KQ_SPLIT", "auto")
        kernels[on] = [n.kernel.name for n in nodes]
        assert all((define in n.defines) == (on == value) for n in nodes), [n.defines for n in nodes]
        if on and switch == "GEMV_KQ_XPF":
            assert xpf.link(nodes) == len(nodes) - 1
            assert all(int(n.args[0]["xpf"][0]["w"]) != 0 for n in nodes[:-1])
            assert int(nodes[-1].args[0]["xpf"][0]["w"]) == 0
        for n in nodes:
            n.launch()
        got[on] = {k: v.get() for k, v in outs.items()}
        for n in nodes[:2] + nodes[3:7]:  # again (not the adds: they accumulate)
            n.launch()
        for k in ("q4", "g", "q6s", "q6p", "si", "sj", "sif", "sjf"):
            assert np.array_equal(got[on][k], outs[k].get()), f"XPF={on!r} {k}: changed on relaunch"
        what = f"{switch}={on!r}"
        _check_rows(got[on]["q4"].astype(np.float64), mats["q4"][1], xn, f"{what} normed wide store")
        v = gemv_check.check_swiglu(got[on]["g"].astype(np.float64), mats["g"][1], mats["u"][1], xn, impl=eops.GEMV_IMPL)
        assert v["ok"], f"{what} swiglu: {v}"
        _check_rows(got[on]["q5"].astype(np.float64) - base, mats["q5"][1], x6, f"{what} cluster add")
        _check_rows(got[on]["q6s"].astype(np.float64), mats["q6s"][1], x, f"{what} S-split store")
        _check_rows(got[on]["q6p"].astype(np.float64), mats["q6p"][1], x, f"{what} P2 store")
        _check_rows(got[on]["d4"].astype(np.float64) - base, mats["d4"][1], x17, f"{what} 4-part group add")
        for k in ("k2", "k4"):
            _check_rows(got[on][k].astype(np.float64) - base7, mats[k][1], x12, f"{what} K = 1280 add, {k}")
        for k in ("si", "sj"):
            _check_rows(got[on][k].astype(np.float64), mats[k][1], xn, f"{what} ssm_in-like {k}")
            _check_rows(got[on][k + "f"].astype(np.float64), f32.astype(np.float64), xn, f"{what} ssm_in-like {k} F32 rows")
    assert kernels[""] == kernels[value]  # the same routes, only the build differs
    assert any(k.endswith("_c2") for k in kernels[value]) and any(k.endswith("_s2") for k in kernels[value])
    assert kernels[value][-3:] == ["gemvkq_add_q4_k_c4", "gemvkq_add_q4_k_c2", "gemvkq_add_q4_k_c4"], kernels[value]
    for k in got[""]:
        assert np.array_equal(got[""][k], got[value][k]), f"{k}: {switch}={value} changed the output"


@pytest.mark.gpu
@pytest.mark.parametrize("wide", [False, True])
def test_fused_conv_is_bitwise_equal_to_the_conv_node(wide, monkeypatch):
    """GGUF_HARNESS_GEMV_KQ_CONV=1 (kernels/gemv_kq.cu KQ_CONV): an ssm_in-like store node (Q5_K
    qkv rows, Q5_K gate rows, F32 beta / alpha rows, fused RMSNorm) given its layer's conv runs
    deltanet.cu's conv on each qkv row it stores, so over 5 tokens its qkv, conv output y and conv
    state must equal those of the node without the conv followed by deltanet_ops.conv_step, bit for
    bit; y also against the float64 conv of the stored qkv (oracles.deltanet.causal_conv1d, silu).
    wide: 12288 qkv rows (the wide 32-warp build) or 640 (the 16-warp build)."""
    cp = cupy_or_skip()
    from backends.engine import deltanet_ops
    from backends.engine import ops as eops
    from oracles import deltanet
    q16_or_skip()
    for knob, v in (("GEMV_KQ", "v9l8"), ("GEMV_KQ_SPLIT", "auto"), ("GEMV_KQ_WIDE_MIN_ROWS", ""),
                    ("GEMV_KQ_XPF", ""), ("GEMV_KQ_BW", ""), ("GEMV_KQ_WMAJ", ""), ("GEMV_KQ_DQ", ""),
                    ("GEMV_KQ_DQ_P", ""), ("GEMV_KQ_DQ_T", ""), ("GEMV_KQ_DQ_MAP", ""), ("GEMV_KQ_P2", "q6_k"),
                    ("GEMV_KQ_P2_MIN_ROWS", "2048"), ("GEMV_KQ_CSPLIT", "1"), ("GEMV_KQ_GSPLIT", "")):
        monkeypatch.setattr(eops, knob, v)
    rng = np.random.default_rng(53)
    keep = []
    K, C, Z, H = 1024, (12288 if wide else 640), 256, 4
    (rq, wq), (rz, wz) = _matrix(TYPES["Q5_K"], C, K, seed=C), _matrix(TYPES["Q5_K"], Z, K, seed=Z)
    q_dev = device_tensor(cp, "qkv", rq, TYPES["Q5_K"], (K, C), keep)
    z_dev = device_tensor(cp, "z", rz, TYPES["Q5_K"], (K, Z), keep)
    fb = (rng.normal(size=(2 * H, K)) * 0.05).astype(np.float32)
    b_dev = device_tensor(cp, "beta", fb[:H].view(np.uint8), 0, (K, H), keep)
    a_dev = device_tensor(cp, "alpha", fb[H:].view(np.uint8), 0, (K, H), keep)
    taps = (rng.normal(size=(C, 4)) * 0.5).astype(np.float32)
    t_dev = device_tensor(cp, "ssm_conv1d.weight", taps.view(np.uint8).reshape(1, -1), 0, (4, C), keep)
    nw = rng.uniform(0.5, 1.5, K).astype(np.float32)
    nw_dev = device_tensor(cp, "norm", nw.view(np.uint8).reshape(1, -1), 0, (K,), keep)
    xs = [(rng.normal(size=K) * 0.7).astype(np.float32) for _ in range(5)]
    got = {}
    for on in ("0", "1"):
        monkeypatch.setattr(eops, "GEMV_KQ_CONV", on)
        qkv, z, beta, alpha = (cp.zeros(n, dtype=cp.float32) for n in (C, Z, H, H))
        y, state = nan_poisoned(cp, C), cp.full((3, C), 0.25, dtype=cp.float32)
        x = cp.zeros(K, dtype=cp.float32)
        segs = [eops.Seg(q_dev, qkv), eops.Seg(z_dev, z), eops.Seg(b_dev, beta), eops.Seg(a_dev, alpha)]
        node = eops.gemv("ssm_in", "store", segs, x, K, nw_dev, 1e-6, conv=(state, t_dev, y, C))
        assert ("KQ_CONV=1" in node.defines) == (on == "1") and (node.block == (1024,)) == wide, node.defines
        nodes = [node] if on == "1" else [node, deltanet_ops.conv_step("conv", qkv, state, t_dev, y, C=C, K=4)]
        host_state = np.full((3, C), 0.25)
        got[on] = []
        for i, xv in enumerate(xs):
            x.set(xv)
            for n in nodes:
                n.launch()
            q, yy, st = qkv.get(), y.get(), state.get()
            got[on].append((q, yy, st))
            ref, host_state = deltanet.causal_conv1d(q[None].astype(np.float64), host_state, taps.astype(np.float64))
            ref = ops.silu(ref[0])
            np.testing.assert_allclose(yy, ref, rtol=1e-5, atol=1e-6 * max(1.0, np.abs(ref).max()),
                                       err_msg=f"CONV={on} token {i}: y against the float64 conv")
            assert np.array_equal(st, host_state.astype(np.float32)), f"CONV={on} token {i}: conv state"
    for i, (a, b) in enumerate(zip(got["0"], got["1"])):
        for what, u, v in zip(("qkv", "y", "conv state"), a, b):
            assert np.array_equal(u, v), f"token {i}: {what} differs with the fused conv"


def _build_is_bitwise_equal(knob, values, define, define_when, cases, monkeypatch, kq="v9l8", relaunch=1,
                            normed=True):
    """Outputs of v9 nodes under ops.<knob> = values[0] and values[1] (ops.kv9_defines holds
    `define` exactly when the knob is `define_when`) must be bitwise equal; each also checked
    against the oracle (store, SwiGLU, ssm_in-like with F32 rows, add; every split). kq: ops.GEMV_KQ
    ("v9l8": the 8-lane kernels for every type; "v9": Q4_K / Q5_K on the 4-lane ones). relaunch:
    launches of each store / SwiGLU / ssm_in node (their outputs must not change between them).
    normed=False: the nodes with a fused RMSNorm (store, ssm_in) are held to the oracle rule only."""
    cp = cupy_or_skip()
    from backends.engine import ops as eops
    q16_or_skip()
    monkeypatch.setattr(eops, "GEMV_KQ", kq)
    monkeypatch.setattr(eops, "GEMV_KQ_P2_MIN_ROWS", "")  # the Q6_K nodes below through P2 despite few rows
    monkeypatch.setattr(eops, "GEMV_KQ_WIDE_MIN_ROWS", "off")  # every node on the build under test (a knob may set it)
    monkeypatch.setattr(eops, "GEMV_KQ_CSPLIT", "0")  # the S-split kernels, as these builds were measured
    rng = np.random.default_rng(31)
    keep = []
    for name, K, rows in cases:
        t = TYPES[name]
        xs = [rng.normal(size=K).astype(np.float32) * s for s in (1.0, 0.3, 7.0)]
        nw = rng.uniform(0.5, 1.5, K).astype(np.float32)
        nw_dev = device_tensor(cp, "norm", nw.view(np.uint8).reshape(1, -1), 0, (K,), keep)
        (rg, wg), (ru, wu) = _matrix(t, rows, K, seed=rows + 1), _matrix(t, rows, K, seed=rows + 2)
        g_dev = device_tensor(cp, "g", rg, t, (K, rows), keep)
        u_dev = device_tensor(cp, "u", ru, t, (K, rows), keep)
        f32 = (rng.normal(size=(7, K)) * 0.05).astype(np.float32)
        f_dev = device_tensor(cp, "f", f32.view(np.uint8), 0, (K, 7), keep)
        base = rng.normal(size=rows).astype(np.float32)
        for split in ("auto", "1", "2", "4"):
            monkeypatch.setattr(eops, "GEMV_KQ_SPLIT", split)
            got = {}
            for xl in values:
                monkeypatch.setattr(eops, knob, xl)
                assert (define in eops.kv9_defines()) == (xl == define_when)
                got[xl] = []
                for x in xs:
                    xn = ops.rms_norm(x[None].astype(np.float64), nw.astype(np.float64), 1e-6)[0]
                    y, h, ys, yf = (nan_poisoned(cp, n) for n in (rows, rows, rows, 7))
                    acc = cp.asarray(base)
                    nodes = [eops.gemv("s", "store", [eops.Seg(g_dev, y)], cp.asarray(x), K, nw_dev, 1e-6),
                             eops.gemv("f", "swiglu", [eops.Seg(g_dev, h), eops.Seg(u_dev, h)], cp.asarray(x), K),
                             eops.gemv("ssm_in", "store", [eops.Seg(g_dev, ys), eops.Seg(f_dev, yf)], cp.asarray(x),
                                       K, nw_dev, 1e-6),
                             eops.gemv("o", "add", [eops.Seg(u_dev, acc)], cp.asarray(x), K)]
                    for n in nodes:
                        assert n.kernel.name.startswith("gemvkq"), n.kernel.name
                        n.launch()
                    got[xl].append((y.get(), h.get(), ys.get(), yf.get(), acc.get()))
                    for _ in range(relaunch - 1):  # the same nodes again (not the add: it accumulates)
                        for n in nodes[:3]:
                            n.launch()
                        again = (y.get(), h.get(), ys.get(), yf.get())
                        for what, u, v in zip(("store", "swiglu", "ssm_in", "ssm_in F32"), got[xl][-1], again):
                            assert np.array_equal(u, v), f"{name} [{rows}x{K}] {knob}={xl!r}: {what} changed on relaunch"
                    what = f"{name} [{rows}x{K}] {knob}={xl!r} split={split}"
                    _check_rows(got[xl][-1][0].astype(np.float64), wg, xn, f"{what} store")
                    _check_rows(got[xl][-1][2].astype(np.float64), wg, xn, f"{what} ssm_in K-quant rows")
                    _check_rows(got[xl][-1][3].astype(np.float64), f32.astype(np.float64), xn, f"{what} ssm_in F32 rows")
                    _check_rows(got[xl][-1][4].astype(np.float64) - base, wu, x, f"{what} add")
                    ref = ops.swiglu(wg @ _x_seen(x), wu @ _x_seen(x))
                    np.testing.assert_allclose(got[xl][-1][1], ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max(),
                                               err_msg=f"{what} swiglu")
            for i, (a, b) in enumerate(zip(got[values[0]], got[values[1]])):
                for what, u, v in zip(("store", "swiglu", "ssm_in", "ssm_in F32", "add"), a, b):
                    if normed or what in ("swiglu", "add"):
                        assert np.array_equal(u, v), f"{name} [{rows}x{K}] split={split} x #{i}: {what} differs"
