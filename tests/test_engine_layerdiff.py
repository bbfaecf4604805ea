"""harness.engine_layerdiff: the engine node by node against the float64 oracle on the tiny
synthetic qwen2 models (GPU only). A correct engine agrees on every mapped node; a corrupted
weight is found at the first node that reads it."""
from __future__ import annotations

import numpy as np
import pytest

from harness.config import ModelRef, RunConfig

from gpu_util import cupy_or_skip

pytestmark = pytest.mark.gpu
PROMPT = [3, 17, 42, 101, 7, 250, 9, 64]


def _engine(path):
    cupy_or_skip()
    from backends.engine import EngineBackend
    e = EngineBackend()
    e.load(ModelRef(path.stem, path), RunConfig(n_ctx=128))
    return e


@pytest.mark.parametrize("fixture", ["tiny_qwen2_f32", "tiny_qwen2_q"])
def test_every_node_agrees_with_the_oracle(fixture, request):
    from harness.engine_layerdiff import engine_layer_diff
    path = request.getfixturevalue(fixture)
    eng = _engine(path)
    rep = engine_layer_diff(path, PROMPT, n_ctx=128, engine=eng)
    eng.close()
    names = {d.name for d in rep.compared}
    # every mapped node of every layer and the head were compared (2 layers, 8 tokens)
    assert {"Qcur", "Kcur", "Vcur", "kqv_out", "ffn_inp", "ffn_swiglu", "l_out", "result_output"} <= names
    assert len(rep.compared) == 8 * 2 * 7 + 1, rep.summary()
    assert rep.first_bad is None, rep.summary()


def test_a_corrupted_weight_is_named(tiny_qwen2_q):
    """Scale the first row of blk.1.ffn_up by flipping its bytes: the first bad node is that
    layer's ffn_swiglu at token 0 (everything before it still agrees)."""
    cp = cupy_or_skip()
    from harness.engine_layerdiff import engine_layer_diff
    eng = _engine(tiny_qwen2_q)
    t = eng.arena["blk.1.ffn_up.weight"]
    row = cp.ndarray((t.row_bytes,), cp.uint8, cp.cuda.MemoryPointer(
        cp.cuda.UnownedMemory(t.ptr, t.row_bytes, eng), 0))
    row[:] = cp.asarray(np.random.default_rng(0).integers(0, 256, t.row_bytes, dtype=np.uint8))
    rep = engine_layer_diff(tiny_qwen2_q, PROMPT, n_ctx=128, engine=eng)
    eng.close()
    bad = rep.first_bad
    assert bad is not None and (bad.name, bad.layer, bad.call) == ("ffn_swiglu", 1, 0), rep.summary()
    before = [d for d in rep.compared if d.call == 0 and d.layer == 0]  # layer 0 of token 0
    assert len(before) == 7 and all(d.status == "ok" for d in before), rep.summary()
