"""Engine v11 (kernels/gemv_mma.cu, backends/engine/gemv_mma.py): the int8 tensor-core GEMV.

CPU: the switches and the routing (which nodes v11 takes, shared memory, tiles). GPU (marker
gpu): outputs against the float64 oracle with the v11 rounding of x (codes up to 32639:
oracles.gemv_check impl "mma"; the tolerance is the q16 kernels' rule, derived in
tests/test_engine_kernels.py, with the rounding bound amax / 65278 instead of amax / 65534),
NaN-poisoned outputs, odd shapes (partial tiles, fewer groups than warps, segments whose rows
are not multiples of 16), a second launch bitwise equal to the first.
"""
from __future__ import annotations

import numpy as np
import pytest
from gpu_util import cupy_or_skip, device_tensor, nan_poisoned, q16_or_skip

from backends.engine import gemv_mma as gm
# random blocks, the qkv-like node, two launches compared bit for bit
from test_engine_kernels import _matrix, _normed_biased_segments, _run_twice

from oracles import gemv_check

Q4_K, Q5_K, Q6_K, IQ4_XS = 12, 13, 14, 23


@pytest.fixture(autouse=True)
def _switches(monkeypatch):
    """Every v11 switch unset (an exported one must not change what these tests see)."""
    for name in ("GEMV_MMA", "GEMV_MMA_MIN_ROWS", "GEMV_MMA_WARPS", "GEMV_MMA_UNROLL", "GEMV_MMA_MINB"):
        monkeypatch.setattr(gm, name, "")


def test_types_switch(monkeypatch):
    assert gm.mma_types() == frozenset()
    monkeypatch.setattr(gm, "GEMV_MMA", "0")
    assert gm.mma_types() == frozenset()
    monkeypatch.setattr(gm, "GEMV_MMA", "1")
    assert gm.mma_types() == {Q4_K, Q5_K, IQ4_XS}
    monkeypatch.setattr(gm, "GEMV_MMA", "iq4_xs, Q4_K")
    assert gm.mma_types() == {Q4_K, IQ4_XS}
    monkeypatch.setattr(gm, "GEMV_MMA", "q6_k")
    with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_MMA"):
        gm.mma_types()


def test_defines(monkeypatch):
    assert gm.mma_defines() == ()
    monkeypatch.setattr(gm, "GEMV_MMA_WARPS", "16")
    monkeypatch.setattr(gm, "GEMV_MMA_MINB", "1")
    monkeypatch.setattr(gm, "GEMV_MMA_UNROLL", "3")
    assert set(gm.mma_defines()) == {"MMA_WARPS=16", "MMA_MINB=1", "MMA_UNROLL=3"}
    monkeypatch.setattr(gm, "GEMV_MMA_MINB", "2")  # 2 x 512 threads: 64 registers each
    assert "MMA_MINB=2" in gm.mma_defines()
    monkeypatch.setattr(gm, "GEMV_MMA_MINB", "3")  # 3 x 512 threads: 42 registers, spills
    with pytest.raises(ValueError, match="registers"):
        gm.mma_defines()
    monkeypatch.setattr(gm, "GEMV_MMA_MINB", "")
    monkeypatch.setattr(gm, "GEMV_MMA_WARPS", "6")
    with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_MMA_WARPS"):
        gm.mma_defines()


def test_smem_and_tiles():
    # codes 2 bytes per value, 64 zero bytes, scale and scaled sum per 32 values
    assert gm.mma_smem(5120) == 2 * 5120 + 64 + 4 * 160 * 2
    assert gm.mma_tiles("store", [19, 3, 40]) == 2 + 1 + 3  # tiles never straddle segments
    assert gm.mma_tiles("add", [16, 32]) == 3
    assert gm.mma_tiles("swiglu", [17408, 17408]) == 1088  # a pair's tiles: the gate rows'


def test_routing(monkeypatch):
    assert gm.mma_kernel_name("store", [Q4_K], 5120, 5120) is None  # switch off
    monkeypatch.setattr(gm, "GEMV_MMA", "1")
    assert gm.mma_kernel_name("store", [Q4_K, Q4_K], 5120, 10240) == "gemvmma_store_q4_k"
    assert gm.mma_kernel_name("swiglu", [IQ4_XS, IQ4_XS], 5120, 17408) == "gemvmma_swiglu_iq4_xs"
    assert gm.mma_kernel_name("add", [Q5_K], 17408, 5120) == "gemvmma_add_q5_k"
    assert gm.mma_kernel_name("store", [Q6_K], 5120, 5120) is None        # no Q6_K instance
    assert gm.mma_kernel_name("store", [Q5_K, 0], 5120, 5120) is None     # F32 rows stay on v9
    assert gm.mma_kernel_name("store", [Q5_K, Q4_K], 5120, 5120) is None  # one type per node
    assert gm.mma_kernel_name("store", [Q4_K], 5120 + 32, 5120) is None   # K % 256
    monkeypatch.setattr(gm, "GEMV_MMA", "iq4_xs")
    assert gm.mma_kernel_name("store", [Q4_K], 5120, 5120) is None
    monkeypatch.setattr(gm, "GEMV_MMA_MIN_ROWS", "2048")
    assert gm.mma_kernel_name("store", [IQ4_XS], 5120, 1024) is None
    assert gm.mma_kernel_name("store", [IQ4_XS], 5120, 2048) == "gemvmma_store_iq4_xs"
    monkeypatch.setattr(gm, "GEMV_MMA_MIN_ROWS", "x")
    with pytest.raises(ValueError, match="MIN_ROWS"):
        gm.mma_kernel_name("store", [IQ4_XS], 5120, 2048)


# ---- GPU ----

def store_matches(cp, eops, t, rows, K, seed, x, keep, prefix, what):
    """(v11 and v12) A store node of random type-t blocks [rows x K] (seed) and x runs a kernel
    named `prefix`..., reruns bitwise and matches the oracle (impl "mma")."""
    raw, w = _matrix(t, rows, K, seed=seed)
    out = nan_poisoned(cp, rows)
    node = eops.gemv("t", "store", [eops.Seg(device_tensor(cp, "w", raw, t, (K, rows), keep), out)],
                     cp.asarray(x), K)
    (y,) = _run_twice(node, [out], f"{what} [{rows}x{K}]", prefix)
    _check(y, w, x, f"{what} [{rows}x{K}]")


def nan_reaches_every_row(cp, eops, t, raw, x, keep, what):
    """(v11 and v12) With a NaN in x, every output row of a store node over `raw` is non-finite
    (the x block's scale carries it)."""
    K, rows = len(x), raw.shape[0]
    xb = x.copy()
    xb[77] = np.nan
    out = nan_poisoned(cp, rows)
    out.fill(0)
    eops.gemv("t", "store", [eops.Seg(device_tensor(cp, "w", raw, t, (K, rows), keep), out)], cp.asarray(xb),
              K).launch()
    assert not np.isfinite(out.get()).any(), f"{what}: a NaN input was laundered"


def add_and_swiglu_match(cp, eops, t, mats, x, rng, swiglu_shapes, keep, add_kernel, prefix, what):
    """(v11 and v12, tests/test_gemv_tcr.py) An add node over the matrices `mats` ((raw, float64
    weights) of type t, K = len(x)) onto random values runs `add_kernel` and matches the oracle;
    SwiGLU pairs of the (rows, K) in swiglu_shapes run a kernel named `prefix`..., match the oracle
    and rerun bitwise. rng: x and the bases; keep: device buffers to keep alive."""
    K = len(x)
    bases = [rng.normal(size=raw.shape[0]).astype(np.float32) for raw, _ in mats]
    accs = [cp.asarray(b) for b in bases]
    node = eops.gemv("o", "add", [eops.Seg(device_tensor(cp, f"a{j}", raw, t, (K, raw.shape[0]), keep), a)
                                  for j, ((raw, _), a) in enumerate(zip(mats, accs))], cp.asarray(x), K)
    assert node.kernel.name == add_kernel, node.kernel.name
    node.launch()
    for (raw, w), a, b in zip(mats, accs, bases):
        _check(a.get().astype(np.float64) - b, w, x, f"{what} add, {len(mats)} segments")
    for rows, K2 in swiglu_shapes:
        (rg, wg), (ru, wu) = _matrix(t, rows, K2, seed=rows + 1), _matrix(t, rows, K2, seed=rows + 2)
        x2 = rng.normal(size=K2).astype(np.float32)
        h = nan_poisoned(cp, rows)
        node = eops.gemv("f", "swiglu", [eops.Seg(device_tensor(cp, "g", rg, t, (K2, rows), keep), h),
                                         eops.Seg(device_tensor(cp, "u", ru, t, (K2, rows), keep), h)],
                         cp.asarray(x2), K2)
        (y,) = _run_twice(node, [h], f"{what} swiglu [{rows}x{K2}]", prefix)
        v = gemv_check.check_swiglu(y, wg, wu, x2, impl="mma")
        assert v["ok"], f"{what} swiglu [{rows}x{K2}]: {v}"


def _check(y, w, x, what):
    v = gemv_check.check_store(np.asarray(y, np.float64), w, x, impl="mma")
    assert v["ok"], f"{what}: {v}"


@pytest.mark.gpu
@pytest.mark.parametrize("build", [{}, {"GEMV_MMA_WARPS": "4", "GEMV_MMA_UNROLL": "1"},
                                   {"GEMV_MMA_WARPS": "16", "GEMV_MMA_UNROLL": "3", "GEMV_MMA_MINB": "1"}],
                         ids=["default", "w4-u1", "w16-u3"])
def test_gemv_mma_matches_the_oracle_and_reruns_bitwise(build, monkeypatch):
    """Store nodes over many tiles per block with a partial last tile (9001 rows), fewer rows than
    a tile (5), K = 256 (2 groups: most warps without a group), the 27B widths; a 3-segment node
    of 19, 3 and 40 rows behind a fused RMSNorm with biases; add over two segments; SwiGLU pairs;
    a node with F32 rows stays on v9; a NaN in x reaches every row."""
    cp = cupy_or_skip()
    from backends.engine import ops as eops
    q16_or_skip("the v11 kernels")
    monkeypatch.setattr(eops, "GEMV_KQ", "v9l8")
    monkeypatch.setattr(eops, "GEMV_TMA", "")
    monkeypatch.setattr(gm, "GEMV_MMA", "1")
    for knob, val in build.items():
        monkeypatch.setattr(gm, knob, val)
    keep = []
    for t in (Q4_K, Q5_K, IQ4_XS):
        for rows, K in ((9001, 512), (5, 256), (37, 5120), (300, 17408)):
            x = np.random.default_rng(K).normal(size=K).astype(np.float32)
            store_matches(cp, eops, t, rows, K, rows + K + t, x, keep, "gemvmma_", f"v11 {t}")
        # qkv-like: 3 segments of 19, 3 and 40 rows with biases behind a fused RMSNorm (K = 1024)
        K, rng, x, nw_dev, xn, mats, outs, biases, segs = _normed_biased_segments(cp, eops, t, keep)
        ys = _run_twice(eops.gemv("qkv", "store", segs, cp.asarray(x), K, nw_dev, 1e-6), outs, f"v11 {t} qkv", "gemvmma_")
        for (raw, w), y, b in zip(mats, ys, biases):
            _check(y.astype(np.float64) - b, w, xn, f"v11 {t} segment with bias and norm")
        # F32 rows beside the type's: v9
        f32 = (rng.normal(size=(5, K)) * 0.05).astype(np.float32)
        node = eops.gemv("ssm_in", "store", [eops.Seg(device_tensor(cp, "k", mats[0][0], t, (K, 19), keep), outs[0]),
                                             eops.Seg(device_tensor(cp, "f", f32.view(np.uint8), 0, (K, 5), keep),
                                                      nan_poisoned(cp, 5))], cp.asarray(x), K)
        assert node.kernel.name.startswith("gemvkq"), node.kernel.name
        add_and_swiglu_match(cp, eops, t, mats[:2], x, rng, ((23, 5120), (9001, 256), (70, 17408)), keep,
                             f"gemvmma_add_{gm.MMA_TYPES[t]}", "gemvmma_", f"v11 {t}")
        nan_reaches_every_row(cp, eops, t, mats[2][0], x, keep, f"v11 {t}")
