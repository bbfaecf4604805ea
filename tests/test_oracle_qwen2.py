"""The float64 qwen2 oracle (oracles.qwen2, backends.oracle) on synthetic tiny models and,
when present, the real Qwen2.5-Coder-0.5B: batch/step consistency, determinism, errors
naming the key or tensor, an independent check of the output head, and agreement with
llama.cpp (the independent implementation)."""

from __future__ import annotations

import importlib.util

import gguf
import numpy as np
import pytest

import oracles.sequence
from backends.base import Backend
from backends.oracle import OracleBackend
from harness.config import ModelRef, RunConfig
from harness.errors import ConfigError, ModelError, UnsupportedError
from harness.gguf_file import open_gguf
from harness.metrics import compare
from oracles.dequant import dequantize
from oracles.qwen2 import Qwen2Oracle

HAVE_LLAMA = importlib.util.find_spec("llama_cpp") is not None
PROMPT = [17, 250, 3, 499, 88, 120, 7, 301, 42, 64, 5, 411, 230]


def _rel_err(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def oracle_f32(tiny_qwen2_f32):
    return Qwen2Oracle(tiny_qwen2_f32, n_ctx=64)


@pytest.mark.parametrize("fixture", ["tiny_qwen2_f32", "tiny_qwen2_q"])
def test_prefill_equals_prefix_then_steps(fixture, request):
    o = Qwen2Oracle(request.getfixturevalue(fixture), n_ctx=64)
    whole = o.prefill(PROMPT)
    o.reset()
    o.prefill(PROMPT[:5])
    for t in PROMPT[5:]:
        last = o.step(t)
    assert o.n_past == len(PROMPT)
    assert _rel_err(last, whole) < 1e-12
    assert np.abs(whole).max() > 1.0  # logits are not trivially zero


def test_ubatch_split_equals_one_batch(oracle_f32, monkeypatch):
    oracle_f32.reset()
    whole = oracle_f32.prefill(PROMPT)
    monkeypatch.setattr(oracles.sequence, "UBATCH", 4)
    oracle_f32.reset()
    assert _rel_err(oracle_f32.prefill(PROMPT), whole) < 1e-12


def test_reset_is_deterministic(oracle_f32):
    runs = []
    for _ in range(2):
        oracle_f32.reset()
        logits = [oracle_f32.prefill(PROMPT[:6])]
        logits += [oracle_f32.step(t) for t in PROMPT[6:9]]
        runs.append(np.stack(logits))
    np.testing.assert_array_equal(runs[0], runs[1])
    assert not np.array_equal(runs[0][0], runs[0][1])  # positions change the output


def _independent_head(path, hidden_last):
    """rms_norm + output matrix, with weights read by gguf-py's own reader (not oracles)."""
    r = gguf.GGUFReader(path)
    t = {x.name: x for x in r.tensors}
    kv = r.fields["qwen2.attention.layer_norm_rms_epsilon"].contents()
    out = t.get("output.weight") or t["token_embd.weight"]
    w = gguf.quants.dequantize(out.data, out.tensor_type).astype(np.float64)  # [n_vocab, d]
    norm = np.asarray(t["output_norm.weight"].data, dtype=np.float64)
    h = hidden_last / np.sqrt(np.mean(hidden_last ** 2) + kv) * norm
    return w @ h


@pytest.mark.parametrize("preset", ["qwen2-tiny", "qwen2-tiny-tied"])
def test_capture_names_and_independent_head(preset, synth_dir):
    from harness.synth import write_preset
    path = write_preset(preset, synth_dir / f"{preset}-head.gguf", seed=3)
    seen = {}
    o = Qwen2Oracle(path, n_ctx=32, capture=lambda n, il, a: seen.setdefault((n, il), a))
    logits = o.prefill(PROMPT[:7])
    per_layer = {"attn_norm", "Qcur", "Kcur", "Vcur", "kqv_out", "attn_out", "ffn_inp",
                 "ffn_norm", "ffn_out", "l_out"}
    assert {(n, il) for n in per_layer for il in range(2)} <= set(seen)
    assert seen[("Qcur", 0)].shape == (7, 4, 16) and seen[("Kcur", 1)].shape == (7, 2, 16)
    np.testing.assert_array_equal(seen[("result_output", -1)], logits)
    ref = _independent_head(path, seen[("l_out", 1)][-1])
    assert _rel_err(logits, ref) < 1e-12


def _rewrite(src, dst, *, arch="qwen2", drop_keys=(), drop_tensors=(), set_keys=None):
    """Copy an F32 synthetic model with changed metadata / tensors."""
    info = open_gguf(src)
    add = {"UINT32": "add_uint32", "UINT64": "add_uint64", "FLOAT32": "add_float32",
           "STRING": "add_string", "BOOL": "add_bool", "ARRAY[STRING]": "add_array",
           "ARRAY[INT32]": "add_array"}
    w = gguf.GGUFWriter(dst, arch)
    items = [(k, v, info.metadata_types[k]) for k, v in info.metadata.items()
             if k != "general.architecture" and k not in drop_keys and k not in (set_keys or {})]
    items += [(k, v, kind) for k, (v, kind) in (set_keys or {}).items()]
    for key, val, kind in items:
        key = arch + key[len("qwen2"):] if key.startswith("qwen2.") else key
        getattr(w, add[kind])(key, val)
    for name, t in info.tensors.items():
        if name not in drop_tensors:
            w.add_tensor(name, dequantize(info.tensor_data(name), t.type_id, t.shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize("change, error, needle", [
    (dict(drop_keys=("qwen2.attention.layer_norm_rms_epsilon",)), ModelError,
     "qwen2.attention.layer_norm_rms_epsilon"),
    (dict(drop_keys=("qwen2.block_count",)), ModelError, "qwen2.block_count"),
    (dict(drop_tensors=("blk.1.ffn_up.weight",)), ModelError, "blk.1.ffn_up.weight"),
    (dict(drop_tensors=("output_norm.weight",)), ModelError, "output_norm.weight"),
    (dict(arch="llama"), UnsupportedError, "'llama'"),
    (dict(set_keys={"qwen2.rope.scaling.type": ("yarn", "STRING")}), UnsupportedError, "yarn"),
    (dict(set_keys={"qwen2.attention.head_count_kv": (4, "UINT32")}), ModelError,
     "blk.0.attn_k.weight"),
    (dict(set_keys={"qwen2.attention.head_count": (3, "UINT32")}), ModelError,
     "not a multiple of head_count 3"),
    (dict(set_keys={"qwen2.attention.head_count": (64, "UINT32")}), ModelError, "head size 1 is odd"),
    (dict(set_keys={"qwen2.attention.key_length": (8, "UINT32")}), ModelError, "blk.0.attn_q.weight"),
    (dict(set_keys={"qwen2.block_count": (0, "UINT32")}), ModelError, "outside"),
    (dict(set_keys={"qwen2.rope.freq_base": ("x", "STRING")}), ModelError, "qwen2.rope.freq_base"),
])
def test_bad_models_raise_named_errors(tiny_qwen2_f32, tmp_path, change, error, needle):
    bad = _rewrite(tiny_qwen2_f32, tmp_path / "bad.gguf", **change)
    with pytest.raises(error, match=needle.replace(".", r"\.")):
        Qwen2Oracle(bad, n_ctx=16)


def test_rewrite_without_changes_loads(tiny_qwen2_f32, tmp_path, oracle_f32):
    """The copy helper itself is faithful (else the error tests above prove nothing)."""
    copy = Qwen2Oracle(_rewrite(tiny_qwen2_f32, tmp_path / "copy.gguf"), n_ctx=16)
    oracle_f32.reset()
    np.testing.assert_array_equal(copy.prefill(PROMPT[:4]), oracle_f32.prefill(PROMPT[:4]))


def test_context_and_token_errors(oracle_f32):
    oracle_f32.reset()
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        oracle_f32.prefill([1, 512])
    assert oracle_f32.n_past == 0  # nothing was fed
    with pytest.raises(ConfigError, match="context overflow"):
        oracle_f32.prefill(list(range(65)))
    with pytest.raises(ConfigError, match="at least one token"):
        oracle_f32.prefill([])


def test_oracle_backend_protocol(tiny_qwen2_f32):
    b = OracleBackend()
    assert isinstance(b, Backend) and "capture" in b.capabilities()
    b.load(ModelRef("tiny", tiny_qwen2_f32), RunConfig(n_ctx=8))
    names = []
    b.capture = lambda n, il, a: names.append(n)
    out = b.prefill(PROMPT[:8])
    assert out.dtype == np.float32 and b.last_logits64.dtype == np.float64
    np.testing.assert_array_equal(out, b.last_logits64.astype(np.float32))
    assert "l_out" in names
    with pytest.raises(ConfigError, match="n_ctx 8"):
        b.step(1)  # cfg.n_ctx bounds the KV cache
    b.reset()
    assert b.pos == 0 and b.step(PROMPT[0]).shape == (512,)
    b.close()


def _llamacpp(path, kv_type="f32"):
    from backends.llamacpp import LlamaCppBackend
    b = LlamaCppBackend()
    # flash attention off: ggml's CPU flash-attention path rounds K/V to F16 even for an f32
    # cache (measured 1.6e-3 relative logit error vs 1.0e-6 without it).
    b.load(ModelRef("m", path), RunConfig(n_ctx=128, kv_type=kv_type, flash_attn=False, n_threads=2))
    return b


@pytest.mark.skipif(not HAVE_LLAMA, reason="llama_cpp (llama-cpp-python) is not importable")
def test_greedy_matches_llamacpp_f32(tiny_qwen2_f32, oracle_f32):
    """llama.cpp computes in float32 (f32 weights, f32 KV, f32 RoPE cache and softmax), so its
    logits should be within ~1e-6 relative of float64 (measured 1.0e-6); bound 1e-4."""
    lc = _llamacpp(tiny_qwen2_f32)
    oracle_f32.reset()
    a, b = lc.prefill(PROMPT[:8]), oracle_f32.prefill(PROMPT[:8])
    ids_a, ids_b, worst = [], [], 0.0
    for _ in range(32):
        ids_a.append(int(np.argmax(a)))
        ids_b.append(int(np.argmax(b)))
        worst = max(worst, _rel_err(a, b))
        a, b = lc.step(ids_a[-1]), oracle_f32.step(ids_b[-1])
    lc.close()
    assert ids_a == ids_b
    assert len(set(ids_b)) >= 8  # greedy output is not degenerate
    assert worst < 1e-4, worst


@pytest.mark.skipif(not HAVE_LLAMA, reason="llama_cpp (llama-cpp-python) is not importable")
def test_linear_rope_scaling_matches_llamacpp(tiny_qwen2_f32, tmp_path):
    """rope.scaling.factor 4 (freq_scale 1/4) and freq_base 1e4, as llama.cpp reads them."""
    keys = {"qwen2.rope.scaling.type": ("linear", "STRING"),
            "qwen2.rope.scaling.factor": (4.0, "FLOAT32"), "qwen2.rope.freq_base": (1e4, "FLOAT32")}
    path = _rewrite(tiny_qwen2_f32, tmp_path / "scaled.gguf", set_keys=keys)
    o = Qwen2Oracle(path, n_ctx=64)
    assert o.params.freq_scale == 0.25 and o.params.freq_base == 1e4
    lc = _llamacpp(path)
    logits = [(lc.prefill(PROMPT), o.prefill(PROMPT))]
    logits += [(lc.step(t), o.step(t)) for t in (5, 6, 7)]
    lc.close()
    assert max(_rel_err(a, b) for a, b in logits) < 1e-4
    plain = Qwen2Oracle(tiny_qwen2_f32, n_ctx=64).prefill(PROMPT)
    assert _rel_err(plain, logits[0][1]) > 1e-3  # the scaling really changed the output


@pytest.mark.skipif(not HAVE_LLAMA, reason="llama_cpp (llama-cpp-python) is not importable")
def test_quantised_model_close_to_llamacpp(tiny_qwen2_q):
    """Same weights bit for bit, but llama.cpp rounds activations to Q8_0/Q8_K inside each
    quantised matmul: measured NMSE <= 1.4e-3 over 16 teacher-forced steps; bound 1e-2."""
    lc, o = _llamacpp(tiny_qwen2_q), Qwen2Oracle(tiny_qwen2_q, n_ctx=64)
    a, b = lc.prefill(PROMPT[:8]), o.prefill(PROMPT[:8])
    stats = []
    for _ in range(16):
        stats.append(compare(b, a))
        t = int(np.argmax(b))
        a, b = lc.step(t), o.step(t)
    lc.close()
    assert max(s["nmse"] for s in stats) < 1e-2
    assert sum(s["top1_agree"] for s in stats) >= 14


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.skipif(not HAVE_LLAMA, reason="llama_cpp (llama-cpp-python) is not importable")
def test_real_model_matches_llamacpp(real_model_05b):
    """Qwen2.5-Coder-0.5B Q4_K_M, standard 70-token prompt, 8 steps teacher-forced on
    llama.cpp's greedy ids: top-1 equal every step; NMSE measured 8e-5..7e-4 (llama.cpp's Q8
    activation rounding), bound 5e-3."""
    from harness.prompt import standard_prompt_ids
    lc = _llamacpp(real_model_05b)
    ids = standard_prompt_ids(lc.tokenize)
    o = Qwen2Oracle(real_model_05b, n_ctx=128)
    a, b = lc.prefill(ids), o.prefill(ids)
    stats = []
    for _ in range(8):
        stats.append(compare(b, a))
        t = int(np.argmax(a))
        a, b = lc.step(t), o.step(t)
    lc.close()
    assert all(s["top1_agree"] for s in stats), [(s["top1"], s["top1_ref"]) for s in stats]
    assert max(s["nmse"] for s in stats) < 5e-3
