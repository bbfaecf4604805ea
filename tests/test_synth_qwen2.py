"""Synthetic qwen2 factory: loads and runs in llama.cpp, deterministic, sane weights.

References: llama.cpp itself (loading, tokenisation, detokenisation, logits); gguf-py's
dequantize (independent of the ggml quantiser used for K-quants); a plain rank-ordered BPE
written here; the real 0.5B file's tensor table for the "qwen2-0.5b-shape" preset.
"""
from __future__ import annotations

import ctypes
import hashlib
import math

import numpy as np
import pytest
from gguf import GGUFReader
from gguf.constants import GGMLQuantizationType as QT
from gguf.quants import dequantize

from harness.errors import ConfigError, UnsupportedError
from harness.gguf_file import open_gguf
from harness.synth import PRESETS, encode, quant_source, resolve_quant, tensor_specs, write_qwen2
from harness.synth import qwen2 as synth_qwen2
from harness.synth.qwen2 import Qwen2Shape

try:  # llama_cpp's Python files without their shared libraries raise FileNotFoundError, not ImportError
    import llama_cpp as L
except (ImportError, OSError) as e:
    pytest.skip(f"llama_cpp not usable: {type(e).__name__}: {str(e)[:200]}", allow_module_level=True)
TEXT = "The quick brown fox"
TINY = {k: v for k, v in PRESETS["qwen2-tiny"].items() if k != "quant"}


# ---------- llama.cpp helpers (low-level API, CPU, no extra buffer types) ----------

class Llama:
    def __init__(self, path, n_ctx=128):
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.n_gpu_layers, mp.use_extra_bufts = 0, False  # AMX repack path crashes on CI CPUs
        self.model = L.llama_model_load_from_file(str(path).encode(), mp)
        assert self.model, f"llama.cpp could not load {path}"
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        cp = L.llama_context_default_params()
        cp.n_ctx = cp.n_batch = n_ctx
        cp.n_threads = cp.n_threads_batch = 1
        self.ctx = L.llama_init_from_model(self.model, cp)
        assert self.ctx

    def tokenize(self, text: str) -> list[int]:
        b = text.encode()
        buf = (L.llama_token * 256)()
        n = L.llama_tokenize(self.vocab, b, len(b), buf, 256, False, False)
        assert n >= 0
        return list(buf[:n])

    def piece(self, tok: int) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = L.llama_token_to_piece(self.vocab, tok, buf, 64, 0, False)
        return buf.raw[:n]

    def eval(self, ids: list[int]) -> np.ndarray:
        arr = (L.llama_token * len(ids))(*ids)
        assert L.llama_decode(self.ctx, L.llama_batch_get_one(arr, len(ids))) == 0
        ptr = L.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def greedy(self, ids: list[int], n: int) -> tuple[np.ndarray, list[int]]:
        first = logits = self.eval(ids)
        out = []
        for _ in range(n):
            out.append(int(np.argmax(logits)))
            logits = self.eval([out[-1]])
        return first, out

    def close(self):
        L.llama_free(self.ctx)
        L.llama_model_free(self.model)


def _bpe_reference(path, words: list[str]) -> list[int]:
    """Rank-ordered BPE over GPT-2 byte characters, using the file's own tokens and merges."""
    r = GGUFReader(path)
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    ranks = {tuple(m.split(" ")): i for i, m in enumerate(r.fields["tokenizer.ggml.merges"].contents())}
    byte_char = {b: tokens[i] for i, b in enumerate(
        [*range(33, 127), *range(161, 173), *range(174, 256),
         *[b for b in range(256) if not (33 <= b < 127 or 161 <= b < 173 or 174 <= b < 256)]])}
    ids = []
    for w in words:
        sym = [byte_char[b] for b in w.encode()]
        while len(sym) > 1:
            best = min(range(len(sym) - 1), key=lambda i: ranks.get((sym[i], sym[i + 1]), 1e18))
            if (sym[best], sym[best + 1]) not in ranks:
                break
            sym[best:best + 2] = [sym[best] + sym[best + 1]]
        ids += [tokens.index(s) for s in sym]
    return ids


# ---------- llama.cpp loads and runs the tiny presets ----------

def _run_checks(path):
    m = Llama(path)
    try:
        ids = m.tokenize(TEXT)
        assert ids == _bpe_reference(path, ["The", " quick", " brown", " fox"])
        assert any(i >= 256 for i in ids), "no merged token used"
        assert b"".join(m.piece(i) for i in ids) == TEXT.encode()
        logits, out = m.greedy(ids, 20)
    finally:
        m.close()
    assert logits.shape == (PRESETS["qwen2-tiny"]["n_vocab"],) and np.isfinite(logits).all()
    return logits, out


@pytest.mark.parametrize("fixture", ["tiny_qwen2_f32", "tiny_qwen2_q"])
def test_tiny_runs_in_llama_cpp(fixture, request):
    logits, out = _run_checks(request.getfixturevalue(fixture))
    assert logits.std() > 0.3, "logits nearly flat"
    assert len(set(out)) >= 5, f"greedy output degenerate: {out}"


def test_degeneracy_check_catches_positive_mean_weights(tmp_path, monkeypatch):
    # Negative control: |w| (positive mean) must trip the same check. normal_rows draws every
    # chunk of every tensor (write_qwen2 streams; jobs=1 keeps the patch in this process).
    real = synth_qwen2.normal_rows
    monkeypatch.setattr(synth_qwen2, "normal_rows", lambda rng, n, ne0, kind, std: (
        np.abs(real(rng, n, ne0, kind, std)) if kind == "matrix" else real(rng, n, ne0, kind, std)))
    path = write_qwen2(tmp_path / "biased.gguf", **TINY, seed=1)
    _, out = _run_checks(path)
    assert len(set(out)) < 5


# ---------- determinism ----------

def _sha(p):
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_same_seed_same_bytes(tiny_qwen2_q, synth_seed, tmp_path):
    a = write_qwen2(tmp_path / "a.gguf", **PRESETS["qwen2-tiny-q"], seed=synth_seed)
    b = write_qwen2(tmp_path / "b.gguf", **PRESETS["qwen2-tiny-q"], seed=synth_seed + 1)
    assert _sha(a) == _sha(tiny_qwen2_q)
    assert _sha(a) != _sha(b) and a.stat().st_size == b.stat().st_size


# ---------- weights: zero mean, scale, quantisation error ----------

NMSE_MAX = {"F32": 0.0, "Q8_0": 1e-4, "Q6_K": 1e-3, "Q5_0": 3e-3, "Q4_K": 1e-2, "Q4_0": 2e-2}


def test_weights_statistics_and_quantisation(tiny_qwen2_q, synth_seed):
    info = open_gguf(tiny_qwen2_q)
    for name, ne, kind, std in tensor_specs(Qwen2Shape(**TINY)):
        t = info.tensor(name)
        got = dequantize(info.tensor_data(name), QT(t.type_id)).astype(np.float64).ravel()
        exact = synth_qwen2.make_weights(name, ne, kind, std, synth_seed).astype(np.float64).ravel()
        nmse = np.mean((got - exact) ** 2) / np.mean(exact ** 2)
        assert nmse <= NMSE_MAX[t.type_name], (name, t.type_name, nmse)
        if kind == "matrix":
            fan_in = ne[0]
            assert abs(got.mean()) < 5 * got.std() / math.sqrt(got.size), name
            assert 0.9 < got.std() * math.sqrt(fan_in) < 1.1, name
        elif kind == "norm":
            assert abs(got.mean() - 1) < 0.1, name


# (IQ2_XXS/IQ2_XS/IQ1_S work too but ggml builds a large grid table first: ~3 s each)
@pytest.mark.parametrize("qtype", [QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_NL,
                                   QT.IQ4_XS, QT.IQ3_S, QT.Q4_0, QT.Q8_0, QT.F16],
                         ids=lambda q: q.name)
def test_encode_roundtrip_through_gguf_py(qtype):
    x = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32)
    q = encode("t", x, qtype)
    back = dequantize(q, qtype)
    nmse = float(np.mean((back - x) ** 2) / np.mean(x ** 2))
    assert back.shape == x.shape and nmse < 0.2, (qtype.name, nmse)
    assert quant_source(qtype) == ("numpy" if qtype == QT.F16 else
                                   "gguf-py" if qtype in (QT.Q4_0, QT.Q8_0) else "ggml")


# ---------- bad requests ----------

@pytest.mark.parametrize("kwargs, cls, match", [
    (dict(quant={"blk.*.attn_q.weight": "Q4_K"}), ConfigError,
     "'blk.0.attn_q.weight'.*rows of 64 .*Q4_K.*block size 256"),
    (dict(quant="Q9_X"), ConfigError, "unknown GGML type 'Q9_X'"),
    (dict(quant={"*": "I8"}), UnsupportedError, "cannot quantise to I8"),
    (dict(n_head=3), ConfigError, "3 heads"),
    (dict(n_head_kv=3), ConfigError, "multiple of n_head_kv 3"),
    (dict(n_vocab=100), ConfigError, "n_vocab must be >= 260"),
])
def test_bad_requests(tmp_path, kwargs, cls, match):
    args = {**TINY, **kwargs}
    with pytest.raises(cls, match=match):
        write_qwen2(tmp_path / "bad.gguf", **args)
    assert not (tmp_path / "bad.gguf").exists()


def test_presets_are_valid_without_writing():
    for name, p in PRESETS.items():
        args = {k: v for k, v in p.items() if k != "quant"}
        types = resolve_quant(p["quant"], tensor_specs(Qwen2Shape(**args)))
        assert types["token_embd.weight"] in QT, name


def test_tied_has_no_output_tensor(tmp_path):
    info = open_gguf(write_qwen2(tmp_path / "tied.gguf", **TINY, tied=True, seed=3))
    assert "output.weight" not in info.tensors and "token_embd.weight" in info.tensors


@pytest.mark.model
def test_05b_shape_matches_real_model(real_model_05b):
    real = open_gguf(real_model_05b)
    p = PRESETS["qwen2-0.5b-shape"]
    specs = tensor_specs(Qwen2Shape(**{k: v for k, v in p.items() if k != "quant"}))
    assert {n: ne for n, ne, _, _ in specs} == {n: t.ne for n, t in real.tensors.items()}
    for key in ("block_count", "embedding_length", "feed_forward_length",
                "attention.head_count", "attention.head_count_kv", "context_length"):
        assert real.arch_key(key) == {"block_count": p["n_layer"], "embedding_length": p["n_embd"],
                                      "feed_forward_length": p["n_ff"],
                                      "attention.head_count": p["n_head"],
                                      "attention.head_count_kv": p["n_head_kv"],
                                      "context_length": p["n_ctx_train"]}[key]
