"""The engine end to end on synthetic qwen2 models against the float64 oracle (GPU only):
logits error, greedy ids, graph replay == eager, prefill == token-by-token, determinism,
NaN injection naming the node, refusal of a model that does not fit."""
from __future__ import annotations

import numpy as np
import pytest

from harness import metrics
from harness.config import ModelRef, RunConfig
from harness.errors import ModelError, NumericError, UnsupportedError

from gpu_util import cupy_or_skip

pytestmark = pytest.mark.gpu
PROMPT = [3, 17, 42, 101, 7, 250, 9, 64]


def _engine(path, n_ctx=128):
    cupy_or_skip()
    from backends.engine import EngineBackend
    e = EngineBackend()
    e.load(ModelRef(path.stem, path), RunConfig(n_ctx=n_ctx))
    return e


def _oracle(path, kv_round=None, act_round=None):
    from backends.oracle import OracleBackend
    o = OracleBackend(kv_round=kv_round, act_round=act_round)
    o.load(ModelRef(path.stem, path), RunConfig(n_ctx=128))
    return o


def _teacher_forced(backend, ids):
    out = [np.asarray(backend.prefill(PROMPT), np.float64)]
    for t in ids[:-1]:
        out.append(np.asarray(backend.step(t), np.float64))
    return np.stack(out)


@pytest.mark.parametrize("fixture", ["tiny_qwen2_f32", "tiny_qwen2_q"])
def test_engine_matches_oracle(fixture, request):
    path = request.getfixturevalue(fixture)
    from backends.engine import ops as eops
    if eops.GEMV_IMPL == "q8_1":
        # int8 codes are too coarse for an end-to-end bound: the engine's fp32 inputs differ
        # from the oracle's fp64 ones by ~1e-7, which now and then flips one code; one flip
        # moves a K=64 dot product by ~3e-3 and the next GEMV then flips a few % of its codes
        # (measured on tiny_qwen2_q: every node within 3e-7 until position 6, then 3.9e-3 at
        # l_out-0 and 2e-2 one layer later; 7.6e-3 of the logit range at the prompt's end).
        # The q8_1 kernels are checked where inputs are identical: tests/test_engine_q8_1.py.
        # docs/llamacpp-cuda-numerics.md has the measurements.
        pytest.skip("GGUF_HARNESS_GEMV=q8_1: int8 input rounding is chaotic end to end")
    eng = _engine(path)
    # same KV precision and GEMV input rounding as the engine (see the tolerance below)
    orc = _oracle(path, kv_round="f16", act_round={"q16": "engine"}.get(eops.GEMV_IMPL))
    ref = [np.asarray(orc.prefill(PROMPT), np.float64)]
    ref64 = [orc.last_logits64]
    ids = [int(np.argmax(ref64[0]))]
    for _ in range(23):
        ref.append(np.asarray(orc.step(ids[-1])))
        ref64.append(orc.last_logits64)
        ids.append(int(np.argmax(ref64[-1])))
    got = _teacher_forced(eng, ids)
    for i, (r, g) in enumerate(zip(ref64, got)):
        c = metrics.compare(r, g.astype(np.float32))
        # fp32 compute of an O(1)-activation model against fp64 with the same fp16 KV and the
        # same int16 rounding of every GEMV input: ~1e-6 relative; 2e-5 of the logit range
        # (an fp16 KV cache alone would cost ~5e-4, measured 2.6e-4 on tiny_qwen2_f32 against
        # a float64 KV cache; the int16 input rounding alone measured 1.1e-4 of the range on
        # tiny_qwen2_f32 against the unrounded oracle, engine v4).
        # q16: rounding to integer codes is discontinuous. The kernel's fp32 products and the
        # oracle's fp64 values differ by ~1e-7 relative, which flips the codes of inputs that
        # sit within ~3e-3 of a half-way point (~0.6 % of them per GEMV), each flip moving
        # the input by one step (amax / 32767); through the layers that measured 3.0e-5 of
        # the range on both tiny models (engine v4). 1e-4 keeps a 3x margin; a kernel bug
        # moves logits by ~1e-2 of the range or more.
        tol = {"q16": 1e-4}.get(eops.GEMV_IMPL, 2e-5)
        assert c["max_abs"] <= tol * (r.max() - r.min()), f"step {i}: {c}"
        if c["ref_margin_rel"] > 1e-3:
            assert c["top1_agree"], f"step {i}: top-1 differs at margin {c['ref_margin_rel']}"
    eng.close()


def test_graph_replay_prefill_and_determinism(tiny_qwen2_q):
    eng = _engine(tiny_qwen2_q)
    a = eng.prefill(PROMPT)
    shas = [metrics.logits_sha256(eng.step(5))]
    eng.reset()
    for t in PROMPT:                 # token by token == prefill (the same graph per token)
        b = eng.step(t)
    assert metrics.logits_sha256(a) == metrics.logits_sha256(b)
    shas.append(metrics.logits_sha256(eng.step(5)))
    eng.close()
    eng2 = _engine(tiny_qwen2_q)     # a fresh load gives the same bits
    eng2.prefill(PROMPT)
    shas.append(metrics.logits_sha256(eng2.step(5)))
    # eager execution of the same nodes gives the same bits as the graph
    eng2.reset()
    eng2.prefill(PROMPT)
    eng2.bufs.state.set(np.array([5, eng2.pos, 0, 0], np.int32), stream=eng2.stream)
    eng2.step_exec.run_eager()
    eng2.stream.synchronize()
    shas.append(metrics.logits_sha256(eng2.bufs.logits.get()))
    assert len(set(shas)) == 1, shas
    eng2.close()


def test_nan_in_weights_names_the_node(tiny_qwen2_q):
    cp = cupy_or_skip()
    eng = _engine(tiny_qwen2_q)
    t = eng.arena["blk.1.ffn_down.weight"]
    # overwrite the first block's fp16 scale with NaN (0x7e00); every format here keeps a
    # scale in bytes 0..1 or at the end: poison whole first row to be format-independent
    cp.cuda.runtime.memset(t.ptr, 0xFF, t.row_bytes)
    with pytest.raises(NumericError, match="blk.1.ffn_down"):
        eng.prefill(PROMPT)
    eng.close()


def test_refuses_model_that_does_not_fit(tiny_qwen2_q, monkeypatch):
    cp = cupy_or_skip()
    monkeypatch.setattr(cp.cuda.runtime, "memGetInfo", lambda: (1 << 20, 1 << 30))
    from backends.engine import EngineBackend
    with pytest.raises(ModelError, match=r"does not fit: .* but 1.0 MiB is free"):
        EngineBackend().load(ModelRef("m", tiny_qwen2_q), RunConfig(n_ctx=64))


def test_refuses_other_architectures(tmp_path):
    cupy_or_skip()
    from gguf import GGUFWriter
    p = tmp_path / "llama.gguf"
    w = GGUFWriter(str(p), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    from backends.engine import EngineBackend
    with pytest.raises(UnsupportedError, match="llama"):
        EngineBackend().load(ModelRef("m", p), RunConfig(n_ctx=64))


def test_bench_reports_each_decode_window_on_the_monotonic_clock(tiny_qwen2_q):
    """bench() returns per repetition when the chained decode ran on the GPU, in
    time.monotonic() seconds (harness/gpu_state.py window_energy_j matches them with the energy
    counter): inside the call, in order, each as long as its decode_s (the end read as the
    last event completes, the start that less the CUDA-event time)."""
    import time
    eng = _engine(tiny_qwen2_q)
    before = time.monotonic()
    r = eng.bench(PROMPT, 16, 3)
    after = time.monotonic()
    assert len(r["decode_window"]) == len(r["decode_s"]) == 3
    ends = [x for w in r["decode_window"] for x in w]
    assert before < ends[0] and ends == sorted(ends) and ends[-1] < after
    for (a, b), d in zip(r["decode_window"], r["decode_s"]):
        assert b - a == pytest.approx(d, abs=1e-9) and d > 0
