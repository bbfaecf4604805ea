"""harness.engine_layerdiff on qwen35: the engine node by node against the float64 oracle.

CPU tests: the node-name -> oracle-name tables against the engine's node plan and the
oracle's captures; the walk itself (positions, host norm / RoPE / sigmoid, per-call nodes,
fault localisation) with tests/engine35_fake.py, a CPU stand-in whose buffers come from a
second oracle fed token by token; and the noise floor the tolerance is derived from.

GPU tests (marked `gpu`, skipped cleanly without CuPy or a device; passed on the H200 in
sessions 7 and 8, the slow one in 102 s):
every mapped node of the engine on qwen35-tiny (F32, Q4_K_M, UD-Q4_K_M) within DEFAULT_TOL;
an oracle fault injected into one node named at that layer, node and position; a scaled
engine weight named at the first node that reads it; and (also `slow`) the 4-layer model at
the 27B widths (qwen35-27b-4l, Q4_K_M, 2.7 GB written to a temporary folder).

Tolerance: DEFAULT_TOL = 1e-3 on every node's rel_rms (rel_rms^2 = NMSE). The oracle rounds
every matrix product's input as the engine's q16 GEMV does and its KV cache to fp16, so
what is left is fp32 arithmetic (llama.cpp's fp32 CPU graph is 2e-7 - 4e-7 off float64 on
this model, tests/test_layerdiff.py) and rounding-code flips it causes. A flip costs a whole
q16 step (1/32767 of a 32-value block's max), so flips feed the next layer's flips and the
difference settles near that step whatever the fp32 error: the CPU stand-in with 1e-7 ..
1e-5 relative noise on every op measures a median rel_rms ~3e-5 and a worst of 2e-4 - 3.1e-4
(attn_gated, and alpha: 4 values per token) over 8 tokens, for F32, Q4_K_M and UD-Q4_K_M
(test_noise_floor_is_below_the_tolerance). 1e-3 leaves ~3x; a wiring bug (wrong segment,
gate half, head order, state slot) or the injected 1e-2 faults stand well above it.
"""
from __future__ import annotations

import numpy as np
import pytest
from engine35_fake import FakeQwen35Engine
from gpu_util import cupy_or_skip

from harness.config import ModelRef, RunConfig
from harness.engine_layerdiff import (
    DEFAULT_TOL,
    NOT_COMPARED_QWEN35,
    QWEN35_MAP,
    WHOLE_CALL,
    _locate_qwen2,
    _locate_qwen35,
    auto_act_round,
    engine_layer_diff,
)
from oracles.qwen35_params import Qwen35Params

PROMPT = [3, 17, 42, 101, 7, 250, 9, 64]
MAPPED = {n for names in QWEN35_MAP.values() for n in names}
# qwen35-tiny: 6 DeltaNet layers x 9 nodes + 2 attention layers x 10 + inp_embd per token,
# and at the last token the 6 delta-rule states and the logits
PER_TOKEN, AT_LAST = 1 + 6 * 9 + 2 * 10, 6 + 1
# (node, layer) scaled by 1.01 in the oracle: reported there, at token 0
INJECT = [("inp_embd", -1), ("linear_attn_qkv_mixed", 0), ("beta_sigmoid", 1), ("alpha", 2),
          ("conv_output_silu", 2), ("final_output", 4), ("attn_residual", 5), ("z", 6),
          ("Qcur_normed", 3), ("Kcur_normed", 7), ("gate_reshaped", 3), ("Qcur", 7),
          ("Kcur", 3), ("Vcur", 7), ("attn_gated", 3), ("ffn_swiglu", 6), ("l_out", 7)]


def _params(n_layer=8, **kw) -> Qwen35Params:
    base = {"n_layer": n_layer, "n_nextn": 0, "n_ctx_train": 4096, "n_embd": 256, "n_ff": 512,
            "n_head": 4, "n_head_kv": 2, "head_dim": 64, "n_rot": 16,
            "rope_sections": (3, 3, 2, 0), "eps": 1e-6, "freq_base": 10000.0, "freq_scale": 1.0,
            "attn_scale": 0.0, "ssm_d_conv": 4, "ssm_d_state": 64, "ssm_n_group": 2,
            "ssm_dt_rank": 4}
    base["recurrent"] = tuple((il + 1) % 4 != 0 for il in range(n_layer))
    return Qwen35Params(**(base | kw))


P27B = {"n_layer": 64, "n_embd": 5120, "n_ff": 17408, "n_head": 24, "n_head_kv": 4,
        "head_dim": 256, "n_rot": 64, "rope_sections": (11, 11, 10, 0), "ssm_d_state": 128,
        "ssm_n_group": 16, "ssm_dt_rank": 48}


def _scale(f):
    return lambda a: a * f


# ------------------------------------------------------------------------------ CPU: tables

@pytest.mark.parametrize("p", [_params(), _params(**P27B), _params(**(P27B | {"n_layer": 4}))],
                         ids=["tiny", "27b", "27b-4l"])
def test_every_engine_node_is_located(p):
    from backends.engine import qwen35
    located = {}
    for name, _ in qwen35.node_plan(p):
        at = _locate_qwen35(name)
        if name in ("argmax", "finish"):
            assert at is None
            continue
        assert at is not None and at[0] in QWEN35_MAP, name
        located[name] = at
    assert located["token_embd"] == ("token_embd", -1) and located["output"] == ("output", -1)
    assert located["blk.0.ssm_in"] == ("ssm_in", 0) and located["blk.3.qkv"] == ("qkv", 3)
    kinds = {k for k, _ in located.values()}
    assert kinds == set(QWEN35_MAP)  # every table entry is used by the plan
    for bad in ("blk.3.attn.merge", "blk.0.ssm_inx", "xblk.0.ssm_in", "blk.a.qkv"):
        assert _locate_qwen35(bad) is None


def test_the_conv_output_is_compared_after_the_step_when_the_conv_runs_there(monkeypatch):
    """GGUF_HARNESS_GDN_CONV=1 (no ssm_conv node; the step writes y): conv_output_silu is read from y
    after ssm_step, before the step's own nodes; without the switch the step gives only its own."""
    from types import SimpleNamespace as NS
    from backends.engine import deltanet_ops
    from harness.engine_layerdiff import _qwen35_outputs
    p = _params(ssm_d_state=128)
    dev = lambda a: NS(get=lambda: a)  # noqa: E731  (a device buffer: .get() gives the host copy)
    bufs = NS(o=dev(np.arange(4.0, dtype=np.float32)), y=dev(np.full(3, 7.0, np.float32)),
              ssm=[dev(np.zeros((2, 2), np.float32))] * 8)
    names = lambda: [n for n, _ in _qwen35_outputs("ssm_step", 0, bufs, p, 0, None)]  # noqa: E731
    assert names() == ["final_output", "new_state"]
    monkeypatch.setattr(deltanet_ops, "GDN_CONV", "1")
    got = _qwen35_outputs("ssm_step", 0, bufs, p, 0, None)
    assert [n for n, _ in got] == ["conv_output_silu", "final_output", "new_state"]
    assert np.array_equal(got[0][1], np.full((1, 3), 7.0))


def test_qwen2_locations_unchanged():
    assert _locate_qwen2("blk.1.attn") == ("attn", 1)
    assert _locate_qwen2("blk.1.attn.merge") == ("attn", 1)
    assert _locate_qwen2("blk.12.ffn_down") == ("ffn_down", 12)
    assert _locate_qwen2("output") == ("output", -1)
    assert _locate_qwen2("blk.0.ssm_in") is None and _locate_qwen2("argmax") is None


def test_every_oracle_node_is_mapped_or_listed(tiny_qwen35_f32):
    """Each name oracles/qwen35.py captures is compared or in NOT_COMPARED_QWEN35 (a new
    capture must be placed in one of them), never both."""
    from oracles.qwen35 import Qwen35Oracle
    seen: set[str] = set()
    Qwen35Oracle(tiny_qwen35_f32, n_ctx=8, capture=lambda n, l, a: seen.add(n)).prefill([1, 2])
    assert not MAPPED & set(NOT_COMPARED_QWEN35)
    assert seen == MAPPED | set(NOT_COMPARED_QWEN35)
    assert {"new_state", "result_output", "result_norm"} == set(WHOLE_CALL)


def test_auto_act_round_per_arch():
    from harness.layerdiff_cmd import ORACLE_ACT_ROUNDS
    assert auto_act_round("qwen2", "q16") == "engine" and auto_act_round("qwen2", "q8_1") == "q8_1"
    assert auto_act_round("qwen35", "q16") == "engine"
    assert auto_act_round("qwen35", "q8_1") is None  # the qwen35 oracle has no q8_1 model
    assert auto_act_round("qwen2", "f32") is None and auto_act_round("llama", "q16") is None
    for arch in ("qwen2", "qwen35"):
        for impl in ("q16", "q8_1", "f32"):
            a = auto_act_round(arch, impl)
            assert a is None or a in ORACLE_ACT_ROUNDS[arch]


# ------------------------------------------------------------------------------ CPU: the walk

def test_walk_with_the_cpu_stand_in(tiny_qwen35_f32):
    eng = FakeQwen35Engine(tiny_qwen35_f32, n_ctx=64)
    rep = engine_layer_diff(tiny_qwen35_f32, PROMPT, n_ctx=64, engine=eng)
    assert rep.first_bad is None, rep.summary()
    assert len(rep.compared) == len(PROMPT) * PER_TOKEN + AT_LAST
    assert {d.name for d in rep.compared} == MAPPED
    # the stand-in's buffers are float32 copies of the oracle's own values
    assert max(d.rel_rms for d in rep.compared) < 1e-6
    last = len(PROMPT) - 1
    assert {d.call for d in rep.compared if d.name in WHOLE_CALL} == {last}
    assert sorted(d.layer for d in rep.compared if d.name == "new_state") == [0, 1, 2, 4, 5, 6]
    missing = [d for d in rep.nodes if d.status == "missing"]
    assert {d.name for d in missing} == set(NOT_COMPARED_QWEN35)
    assert {d.call for d in missing if d.name == "result_norm"} == {last}
    assert eng.pos == len(PROMPT)
    # prompt tokens skip the head, the last one runs it: 8 embeddings, one head
    assert eng.launched.count("token_embd") == len(PROMPT) and eng.launched.count("output") == 1


@pytest.mark.parametrize("quant", ["f32", "q4_k_m", "ud-q4_k_m"])
@pytest.mark.parametrize("noise", [1e-7, 1e-5])
def test_noise_floor_is_below_the_tolerance(quant, noise, tiny_qwen35_mix):
    """Where the tolerance comes from (module doc): fp32-like relative noise on every op of
    the stand-in settles near one q16 step; measured median ~3e-5, worst <= 3.1e-4."""
    path = tiny_qwen35_mix(quant)
    rep = engine_layer_diff(path, PROMPT, n_ctx=64,
                            engine=FakeQwen35Engine(path, n_ctx=64, noise=noise, seed=1))
    rel = np.array([d.rel_rms for d in rep.compared])
    assert rep.first_bad is None, rep.summary()
    assert np.median(rel) < 1e-4 and rel.max() < DEFAULT_TOL / 2, (np.median(rel), rep.summary())


@pytest.mark.parametrize("name, layer", INJECT)
def test_injected_oracle_fault_is_named_cpu(name, layer, tiny_qwen35_f32):
    rep = engine_layer_diff(tiny_qwen35_f32, PROMPT, n_ctx=64, inject={(name, layer): _scale(1.01)},
                            engine=FakeQwen35Engine(tiny_qwen35_f32, n_ctx=64))
    _assert_first_bad(rep, name, layer, 0, rel=1e-2)


def test_fault_in_one_position_only_cpu(tiny_qwen35_f32):
    def at5(a):
        a = a.copy()
        a[5] += 0.05 * np.abs(a[5]).max()
        return a
    rep = engine_layer_diff(tiny_qwen35_f32, PROMPT, n_ctx=64, inject={("attn_residual", 4): at5},
                            engine=FakeQwen35Engine(tiny_qwen35_f32, n_ctx=64))
    _assert_first_bad(rep, "attn_residual", 4, 5)


def test_uncompared_node_fault_shows_at_the_next_compared_node_cpu(tiny_qwen35_f32):
    """ffn_out is added into x inside the engine's ffn_down GEMV: a fault there is named at
    that layer's l_out (ffn_out is ~15 % of l_out on this model: 1e-1 -> ~1.5e-2)."""
    rep = engine_layer_diff(tiny_qwen35_f32, PROMPT, n_ctx=64, inject={("ffn_out", 5): _scale(1.1)},
                            engine=FakeQwen35Engine(tiny_qwen35_f32, n_ctx=64))
    _assert_first_bad(rep, "l_out", 5, 0)


def test_engine_side_fault_is_named_cpu(tiny_qwen35_f32):
    """The stand-in's own ssm_out product of layer 1 scaled by 1.1 (as the GPU test scales
    that weight): named at attn_residual of layer 1, token 0 (~0.1 x 0.2 = 2e-2)."""
    eng = FakeQwen35Engine(tiny_qwen35_f32, n_ctx=64, fault={("linear_attn_out", 1): _scale(1.1)})
    rep = engine_layer_diff(tiny_qwen35_f32, PROMPT, n_ctx=64, engine=eng)
    _assert_first_bad(rep, "attn_residual", 1, 0)
    assert rep.first_bad.rel_rms > 1e-2


def test_prompt_and_arch_checks_for_qwen35(tiny_qwen35_f32):
    from harness.errors import ConfigError
    with pytest.raises(ConfigError, match="prompt"):
        engine_layer_diff(tiny_qwen35_f32, list(range(17)), n_ctx=16)
    with pytest.raises(ConfigError, match="act_round"):  # the qwen35 oracle has no q8_1 model
        engine_layer_diff(tiny_qwen35_f32, [1, 2], n_ctx=16, act_round="q8_1",
                          engine=FakeQwen35Engine(tiny_qwen35_f32, n_ctx=16))


def _assert_first_bad(rep, name: str, layer: int, call: int, rel: float | None = None) -> None:
    bad = rep.first_bad
    assert bad is not None and (bad.name, bad.layer, bad.call) == (name, layer, call), rep.summary()
    i = rep.nodes.index(bad)
    assert all(d.status in ("ok", "missing") for d in rep.nodes[:i]), rep.summary()
    if rel is not None:
        assert bad.rel_rms == pytest.approx(rel, rel=0.1), rep.summary()


# ------------------------------------------------------------------------------ GPU

def _need_gpu():
    """Skip without CuPy / a device, or when the oracle cannot model the engine's GEMV input
    rounding (GGUF_HARNESS_GEMV=q8_1: the qwen35 oracle has no q8_1 model)."""
    cupy_or_skip()
    from backends.engine import ops as eops
    if auto_act_round("qwen35", eops.GEMV_IMPL) is None and eops.GEMV_IMPL != "f32":
        pytest.skip(f"GGUF_HARNESS_GEMV={eops.GEMV_IMPL}: the qwen35 oracle does not model "
                    "this GEMV input rounding")


def _gpu_engine(path, n_ctx=128):
    _need_gpu()
    from backends.engine import EngineBackend
    e = EngineBackend()
    e.load(ModelRef(path.stem, path), RunConfig(n_ctx=n_ctx))
    return e


@pytest.fixture(scope="module")
def f32_engine(tiny_qwen35_f32):
    """One engine on the F32 tiny model for the injection cases (each walk resets it)."""
    eng = _gpu_engine(tiny_qwen35_f32)
    yield eng
    eng.close()


@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["f32", "q4_k_m", "ud-q4_k_m"])
def test_every_node_agrees_with_the_oracle(quant, tiny_qwen35_mix):
    path = tiny_qwen35_mix(quant)
    eng = _gpu_engine(path)
    try:
        rep = engine_layer_diff(path, PROMPT, n_ctx=128, engine=eng)
    finally:
        eng.close()
    assert len(rep.compared) == len(PROMPT) * PER_TOKEN + AT_LAST, rep.summary()
    assert {d.name for d in rep.compared} == MAPPED
    assert rep.first_bad is None, rep.summary()


@pytest.mark.gpu
@pytest.mark.parametrize("name, layer", INJECT)
def test_injected_oracle_fault_is_named(name, layer, tiny_qwen35_f32, f32_engine):
    """One oracle node scaled by 1.01: the engine's report names that node, layer and token 0,
    every node before it within tol."""
    rep = engine_layer_diff(tiny_qwen35_f32, PROMPT, n_ctx=128, engine=f32_engine,
                            inject={(name, layer): _scale(1.01)})
    _assert_first_bad(rep, name, layer, 0, rel=1e-2)


@pytest.mark.gpu
def test_fault_in_one_position_only(tiny_qwen35_f32, f32_engine):
    def at5(a):
        a = a.copy()
        a[5] += 0.05 * np.abs(a[5]).max()
        return a
    rep = engine_layer_diff(tiny_qwen35_f32, PROMPT, n_ctx=128, engine=f32_engine,
                            inject={("attn_residual", 4): at5})
    _assert_first_bad(rep, "attn_residual", 4, 5)


@pytest.mark.gpu
def test_a_scaled_engine_weight_is_named(tiny_qwen35_f32):
    """blk.1.ssm_out.weight (F32 in this file) times 1.1 in the engine's arena: the first bad
    node is attn_residual of layer 1 at token 0 (the ssm_out GEMV adds into x)."""
    cp = cupy_or_skip()
    eng = _gpu_engine(tiny_qwen35_f32)
    try:
        t = eng.arena["blk.1.ssm_out.weight"]
        assert t.type_id == 0  # F32
        off = t.ptr - int(eng.arena.buf.data.ptr)
        w = eng.arena.buf[off:off + t.nbytes].view(cp.float32)
        w *= cp.float32(1.1)
        cp.cuda.Device().synchronize()
        rep = engine_layer_diff(tiny_qwen35_f32, PROMPT, n_ctx=128, engine=eng)
    finally:
        eng.close()
    _assert_first_bad(rep, "attn_residual", 1, 0)
    assert rep.first_bad.rel_rms > 1e-2


@pytest.mark.gpu
@pytest.mark.slow
def test_27b_widths_4_layers(tmp_path_factory):
    """qwen35-27b-4l, Q4_K_M: every mapped node of 4 tokens within DEFAULT_TOL (3 DeltaNet
    layers x 9 nodes + 1 attention layer x 10 + inp_embd per token; 3 states and the logits
    at the last). Host: ~2.7 GB file, ~11 GB of float32 oracle weights."""
    _need_gpu()
    from harness.synth.qwen35_presets import write_qwen35_preset
    path = write_qwen35_preset("qwen35-27b-4l", tmp_path_factory.mktemp("q35-27b-4l") / "m.gguf",
                               "q4_k_m", seed=1)
    prompt = [11, 200_000, 7, 123_456]
    eng = _gpu_engine(path, n_ctx=64)
    try:
        rep = engine_layer_diff(path, prompt, n_ctx=64, engine=eng)
    finally:
        eng.close()
        path.unlink()
    assert len(rep.compared) == len(prompt) * (1 + 3 * 9 + 10) + 3 + 1, rep.summary()
    assert rep.first_bad is None, rep.summary()
