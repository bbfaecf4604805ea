"""The engine's llama.cpp-compatible GEMV rounding (GGUF_HARNESS_GEMV=q8_1, kernels/gemv.cu
compiled with -DACT_Q8_1) against the q8_1 oracle (oracles.gemv_check impl "q8_1": x rounded
as ggml-cuda's quantize_q8_1, legacy offsets folded with the fp16 block sum; bounds derived in
gemv_check.q8_1_allowance). NaN-poisoned outputs, odd shapes, every format. GPU only."""
from __future__ import annotations

import numpy as np
import pytest

from oracles import gemv_check

from gpu_util import cupy_or_skip, device_tensor, nan_poisoned
from test_engine_kernels import TYPES, _matrix, _shapes

pytestmark = pytest.mark.gpu


@pytest.fixture
def q8_1(monkeypatch):
    cp = cupy_or_skip()
    from backends.engine import ops as eops
    monkeypatch.setattr(eops, "GEMV_IMPL", "q8_1")
    return cp, eops


@pytest.mark.parametrize("name", list(TYPES))
def test_q8_1_gemv_every_format_and_odd_shape(name, q8_1):
    cp, eops = q8_1
    t = TYPES[name]
    for i, (rows, K) in enumerate(_shapes(t)):
        raw, w = _matrix(t, rows, K, seed=300 * t + i)
        keep = []
        dt = device_tensor(cp, name, raw, t, (K, rows), keep)
        x = np.random.default_rng(50 + i).normal(size=K).astype(np.float32)
        out = nan_poisoned(cp, rows)
        eops.gemv("t", "store", [eops.Seg(dt, out)], cp.asarray(x), K).launch()
        v = gemv_check.check_store(out.get().astype(np.float64), w, x, impl="q8_1", raw=raw, type_id=t)
        assert v["ok"], f"{name} [{rows}x{K}]: {v}"


@pytest.mark.parametrize("gate,up", [(6, 6), (12, 12), (13, 14), (2, 3)])
def test_q8_1_fused_norm_swiglu_and_qkv(gate, up, q8_1):
    """RMSNorm fused into the staging (codes of x * w, 1/rms applied to the row sums, fp16
    scale and sum rounded after it) with legacy and K-quant pairs, as the 0.5B (Q5_0) and
    1.5B (Q4_K / Q6_K) models use them. The reference follows the kernel's order
    (actquant.q8_1_parts_fused), so no tie allowance is needed: this check is sharp (the
    first H200 run, with a tie allowance as large as the rounding error, could not be)."""
    cp, eops = q8_1
    K, rows, keep = 896 if gate in (2, 3, 6, 7) else 1536, 37, []
    rng = np.random.default_rng(gate * 16 + up)
    x = (rng.normal(size=K) * 3).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, K).astype(np.float32)
    nw_dev = device_tensor(cp, "norm", nw.view(np.uint8).reshape(1, -1), 0, (K,), keep)
    eps = 1e-6
    (rg, wg), (ru, wu) = _matrix(gate, rows, K, 1), _matrix(up, rows, K, 2)
    h = nan_poisoned(cp, rows)
    eops.gemv("ffn", "swiglu", [eops.Seg(device_tensor(cp, "g", rg, gate, (K, rows), keep), h),
                                eops.Seg(device_tensor(cp, "u", ru, up, (K, rows), keep), h)],
              cp.asarray(x), K, nw_dev, eps).launch()
    v = gemv_check.check_swiglu(h.get().astype(np.float64), wg, wu, x, impl="q8_1",
                                raw=(rg, ru), type_ids=(gate, up), norm=(nw, eps))
    assert v["ok"], v
    # a store of the gate alone with the same norm (qkv-style node)
    out = nan_poisoned(cp, rows)
    eops.gemv("q", "store", [eops.Seg(device_tensor(cp, "g2", rg, gate, (K, rows), keep), out)],
              cp.asarray(x), K, nw_dev, eps).launch()
    v = gemv_check.check_store(out.get().astype(np.float64), wg, x, impl="q8_1", raw=rg,
                               type_id=gate, norm=(nw, eps))
    assert v["ok"], v


def test_q8_1_differs_from_q16_on_legacy_formats(q8_1):
    """The mode is really on: a Q5_0 product differs from the q16 kernel's by about the int8
    rounding error, far beyond the q16 bound."""
    cp, eops = q8_1
    rows, K, keep = 64, 4096, []
    raw, w = _matrix(6, rows, K, 11)
    dt = device_tensor(cp, "w", raw, 6, (K, rows), keep)
    x = np.random.default_rng(3).normal(size=K).astype(np.float32)
    outs = {}
    for impl in ("q8_1", "q16"):
        eops.GEMV_IMPL = impl
        outs[impl] = nan_poisoned(cp, rows)
        eops.gemv("t", "store", [eops.Seg(dt, outs[impl])], cp.asarray(x), K).launch()
    y8, y16 = (outs[k].get().astype(np.float64) for k in ("q8_1", "q16"))
    assert gemv_check.check_store(y16, w, x, impl="q16")["ok"]
    assert not gemv_check.check_store(y8, w, x, impl="q16")["ok"]
    assert gemv_check.check_store(y8, w, x, impl="q8_1", raw=raw, type_id=6)["ok"]
