"""The llamacpp backend (low-level llama-cpp-python API), run in a child process.

References that do not come from the code under test:
- llama-cpp-python's own high-level driver (llama_cpp.Llama.eval) with the same settings;
- the GGUF file itself, parsed by harness.gguf_file (vocabulary, architecture, shapes);
- the GPT-2 byte-level BPE alphabet (openai/gpt-2 src/encoder.py, bytes_to_unicode) to turn
  Qwen2 vocabulary strings into bytes.
Runs on the tiny synthetic qwen2 models of tests/conftest.py (f32 and quantised) and on the real
Qwen2.5-Coder-0.5B Q4_K_M (marker `model`; skipped when it is absent; $GGUF_HARNESS_MODEL_05B).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.registry import available_backends, create
from harness.config import ModelRef, RunConfig
from harness.errors import ConfigError, ModelError, UnsupportedError

pytestmark = pytest.mark.skipif(available_backends()["llamacpp"] is not None,
                                reason=f"llamacpp unavailable: {available_backends()['llamacpp']}")

# One thread: the CI machine has 2 shared cores, and a 2-thread OpenMP barrier stalls whenever
# another process holds one of them (docs/sources.md §4: 1 vs 2 threads give identical logits).
CFG = RunConfig(n_threads=1)
PROMPT = "The quick brown fox jumps over the lazy dog. In 1905, Albert Einstein published"
# prefill(all) vs prefill(prefix) + step(...): llama.cpp computes a batch and a single token
# with different kernels. Measured here on Qwen2.5-0.5B Q4_K_M: max |diff| 0.31-0.38, relative
# RMS 1.0-1.4 %, same top-1; docs/sources.md §4: up to 7e-5 on a tiny f32 model. Limits per case:
# Tiny models measured (CPU): f32 max |diff| 8.3e-7 with this 20-token prompt, 2.5e-4 with 40
# tokens (batches of >= 32 tokens take another f32 matmul path); quantised: bitwise equal.
TOL = {"tiny": {"max_abs": 1e-3, "rel_rms": 5e-4}, "tiny_q": {"max_abs": 1e-3, "rel_rms": 5e-4},
       "real": {"max_abs": 1.0, "rel_rms": 0.05}}


CASES = {"tiny": "tiny_qwen2_f32", "tiny_q": "tiny_qwen2_q", "real": "real_model_05b"}


@pytest.fixture(scope="module", params=[
    pytest.param("tiny", id="tiny"),
    pytest.param("tiny_q", id="tiny_q"),
    pytest.param("real", id="real", marks=pytest.mark.model),
])
def case(request):
    """(kind, ModelRef): the tiny synthetic f32 / quantised qwen2 models (tests/conftest.py)
    or the real default model (skipped when absent)."""
    path = Path(request.getfixturevalue(CASES[request.param]))
    return request.param, ModelRef(path.stem, path)


@pytest.fixture(scope="module")
def llm(case):
    backend = create("llamacpp", in_child=True, call_timeout_s=120)
    backend.load(case[1], CFG)
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def prompt_ids(llm, case):
    if case[0] == "real":
        return llm.tokenize(PROMPT, add_special=False)
    n_vocab = llm.model_info()["n_vocab"]
    return [int(t) for t in np.random.default_rng(3).integers(0, n_vocab, size=20)]


def _rel_rms(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.sqrt(np.mean((a - ref) ** 2) / np.mean(ref ** 2)))


def test_prefill_logits_shape_dtype_finite(llm, case, prompt_ids):
    from harness.gguf_file import open_gguf
    n_vocab = len(open_gguf(case[1].path).require("tokenizer.ggml.tokens"))
    llm.reset()
    logits = llm.prefill(prompt_ids)
    assert logits.shape == (n_vocab,) and logits.dtype == np.float32
    assert np.isfinite(logits).all() and logits.std() > 0


def test_prefix_plus_steps_matches_whole_prompt(llm, case, prompt_ids):
    llm.reset()
    whole = llm.prefill(prompt_ids)
    for k in (1, 4, len(prompt_ids) - 1):
        llm.reset()
        llm.prefill(prompt_ids[:-k])
        for t in prompt_ids[-k:]:
            stepped = llm.step(t)
        tol = TOL[case[0]]
        assert np.abs(stepped - whole).max() <= tol["max_abs"], k
        assert _rel_rms(stepped, whole) <= tol["rel_rms"], k
        assert stepped.argmax() == whole.argmax(), k


def test_feeding_is_positional_not_a_bag_of_tokens(llm, prompt_ids):
    """The same tokens in another order must give other logits (positions reach the model)."""
    llm.reset()
    a = llm.prefill(prompt_ids)
    llm.reset()
    b = llm.prefill(prompt_ids[::-1][1:] + prompt_ids[-1:])
    assert _rel_rms(b, a) > 0.05


def test_reset_gives_bitwise_identical_logits(llm, prompt_ids):
    llm.reset()
    first = llm.prefill(prompt_ids)
    cached = llm.prefill(prompt_ids[:3])      # more tokens in the cache ...
    llm.reset()                                # ... forgotten here
    again = llm.prefill(prompt_ids)
    assert np.array_equal(first, again)
    assert not np.array_equal(cached, first)  # without the reset the cache mattered


def test_chunked_prefill_matches_one_batch(case, llm, prompt_ids):
    """n_batch=4 splits the prompt into several llama_decode calls."""
    llm.reset()
    whole = llm.prefill(prompt_ids)
    small = create("llamacpp", in_child=True, call_timeout_s=120)
    try:
        small.load(case[1], RunConfig(n_threads=1, n_batch=4, n_ubatch=4))
        chunked = small.prefill(prompt_ids)
        t = small.timings()
    finally:
        small.close()
    tol = TOL[case[0]]
    assert np.abs(chunked - whole).max() <= tol["max_abs"]
    assert _rel_rms(chunked, whole) <= tol["rel_rms"] and chunked.argmax() == whole.argmax()
    assert t["prefill_tokens"] == len(prompt_ids) and t["prefill_calls"] == 1


def test_two_processes_give_bitwise_identical_logits(case, llm, prompt_ids):
    llm.reset()
    mine = np.concatenate([llm.prefill(prompt_ids), llm.step(prompt_ids[0])])
    other = create("llamacpp", in_child=True, call_timeout_s=120)
    try:
        other.load(case[1], CFG)
        theirs = np.concatenate([other.prefill(prompt_ids), other.step(prompt_ids[0])])
        assert other.pid != llm.pid
    finally:
        other.close()
    assert np.array_equal(mine, theirs)


def test_bad_tokens_and_full_context_are_config_errors(llm, prompt_ids):
    n_vocab = llm.model_info()["n_vocab"]
    llm.reset()
    with pytest.raises(ConfigError, match=f"token #1 = {n_vocab} is outside"):
        llm.prefill([0, n_vocab])
    with pytest.raises(ConfigError, match="-1 is outside"):
        llm.step(-1)
    with pytest.raises(ConfigError, match="at least one token"):
        llm.prefill([])
    with pytest.raises(ConfigError, match="context full"):
        llm.prefill([1] * (CFG.n_ctx + 1))
    llm.reset()
    assert np.isfinite(llm.prefill(prompt_ids)).all()  # still usable


def test_model_info_agrees_with_the_gguf_file(llm, case):
    from harness.gguf_file import open_gguf
    g = open_gguf(case[1].path)
    info = llm.model_info()
    assert info["arch"] == g.arch
    assert info["n_layer"] == g.arch_key("block_count")
    assert info["n_embd"] == g.arch_key("embedding_length")
    assert info["n_head"] == g.arch_key("attention.head_count")
    assert info["n_vocab"] == len(g.require("tokenizer.ggml.tokens"))
    assert info["n_params"] == sum(int(np.prod(t.shape)) for t in g.tensors.values())
    assert info["config"] == CFG.to_json() and info["seed"] == CFG.seed
    assert info["llama_cpp_python"] == "0.3.36" and "CPU" in info["system_info"]


def test_timings_count_what_was_fed(llm, prompt_ids):
    llm.reset()
    llm.reset_timings()
    llm.prefill(prompt_ids)
    for t in prompt_ids[:3]:
        llm.step(t)
    t = llm.timings()
    assert (t["prefill_tokens"], t["prefill_calls"], t["decode_steps"]) == (len(prompt_ids), 1, 3)
    assert t["prefill_s"] > 0 and t["decode_s"] > 0
    assert t["llama_perf"]["n_p_eval"] == len(prompt_ids) and t["llama_perf"]["n_eval"] == 3
    assert "timings" in llm.capabilities()


def test_bench_reports_each_decode_window_on_the_monotonic_clock(llm, prompt_ids):
    """bench() (in the child process) returns per repetition the decode loop's [start, end] in
    time.monotonic() seconds, the clock the parent's GPU-state sampler stamps its readings with
    (CLOCK_MONOTONIC is system-wide on Linux): inside the call, in order, each as long as its
    decode_s (both read around the same loop)."""
    import time
    before = time.monotonic()
    r = llm.bench(prompt_ids[:5], 3, 2)
    after = time.monotonic()
    assert len(r["decode_window"]) == len(r["decode_s"]) == len(r["prefill_s"]) == 2
    (a0, b0), (a1, b1) = r["decode_window"]
    assert before < a0 < b0 < a1 < b1 < after
    for (a, b), d in zip(r["decode_window"], r["decode_s"]):
        # read back to back with the perf_counter() readings of decode_s; 20 ms of slack for a
        # preempted process on a loaded CI machine
        assert abs((b - a) - d) < 0.02, (a, b, d)


def test_run_config_maps_onto_llama_cpp_params():
    """Enum values from llama.h / ggml.h: GGML_TYPE_F32 0, F16 1, Q8_0 8;
    LLAMA_FLASH_ATTN_TYPE_DISABLED 0, ENABLED 1."""
    from backends.llamacpp import params
    cfg = RunConfig(n_ctx=256, n_batch=64, n_ubatch=32, n_threads=3, n_gpu_layers=0,
                    flash_attn=True, kv_type="q8_0")
    c = params.context_params(cfg)
    assert (c.n_ctx, c.n_batch, c.n_ubatch, c.n_seq_max) == (256, 64, 32, 1)
    assert (c.n_threads, c.n_threads_batch) == (3, 3)
    assert (c.flash_attn_type, c.type_k, c.type_v) == (1, 8, 8)
    assert c.op_offload is False and c.no_perf is False  # 0 GPU layers = CPU only
    c = params.context_params(RunConfig(n_gpu_layers=99, flash_attn=False, kv_type="f32"))
    assert (c.flash_attn_type, c.type_k, c.type_v, c.op_offload) == (0, 0, 0, True)
    assert params.context_params(RunConfig(kv_type="f16")).type_k == 1
    m = params.model_params(RunConfig(n_gpu_layers=7))
    assert (m.n_gpu_layers, m.use_extra_bufts) == (7, False)
    assert params.model_params(RunConfig(use_extra_bufts=True)).use_extra_bufts is True


# ---- errors from load ------------------------------------------------------------------------
def test_missing_and_non_gguf_files_are_model_errors(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"PK\x03\x04 definitely a zip file")
    with create("llamacpp", in_child=True) as b:
        with pytest.raises(ModelError, match="model file not found: .*nowhere.gguf"):
            b.load(ModelRef("x", tmp_path / "nowhere.gguf"), CFG)
        with pytest.raises(ModelError, match=r"junk.gguf is not a GGUF file \(starts with b'PK"):
            b.load(ModelRef("x", junk), CFG)
        assert b.alive


def test_truncated_gguf_is_a_model_error_quoting_llama_cpp(tmp_path, tiny_qwen2_f32):
    cut = tmp_path / "cut.gguf"
    with open(tiny_qwen2_f32, "rb") as f:
        cut.write_bytes(f.read(3000))  # ends inside the metadata
    with create("llamacpp", in_child=True) as b:
        with pytest.raises(ModelError, match="could not load .*cut.gguf.*failed to load model"):
            b.load(ModelRef("cut", cut), CFG)


def test_quantised_v_cache_without_flash_attention_is_unsupported(case):
    """docs/sources.md §4: q8_0 KV without flash attention fails to create a context."""
    with create("llamacpp", in_child=True) as b:
        with pytest.raises(UnsupportedError, match="requires flash_attn"):
            b.load(case[1], RunConfig(n_threads=1, flash_attn=False, kv_type="q8_0"))


# ---- real model only: tokenizer and the llama-cpp-python driver ------------------------------
def _gpt2_byte_decoder() -> dict[str, int]:
    """Character -> byte of GPT-2 byte-level BPE: the 188 printable bytes stand for
    themselves, the other 68 are mapped in increasing order to U+0100, U+0101, ..."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(0x100 + extra)] = b
            extra += 1
    return table


@pytest.fixture(scope="module")
def real_ref(real_model_05b) -> ModelRef:
    return ModelRef(Path(real_model_05b).stem, Path(real_model_05b))


@pytest.fixture(scope="module")
def real_llm(real_ref):
    backend = create("llamacpp", in_child=True, call_timeout_s=120)
    backend.load(real_ref, CFG)
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def real_ids(real_llm):
    return real_llm.tokenize(PROMPT, add_special=False)


@pytest.fixture(scope="module")
def real_vocab(real_ref):
    from harness.gguf_file import open_gguf
    g = open_gguf(real_ref.path)
    return g.require("tokenizer.ggml.tokens"), g.require("tokenizer.ggml.token_type")


@pytest.mark.model
def test_token_bytes_match_the_gguf_vocabulary(real_llm, real_vocab):
    tokens, types = real_vocab
    dec = _gpt2_byte_decoder()
    rng = np.random.default_rng(7)
    normal = [i for i in rng.integers(0, len(tokens), size=400).tolist() if types[i] == 1]
    text = "hello world\n\tdef f(x): return x"
    text_ids = real_llm.tokenize(text, add_special=False)
    ids = text_ids + normal
    expected = [bytes(dec[c] for c in tokens[i]) for i in ids]
    assert len(normal) > 300 and real_llm.pieces(ids) == expected
    assert b"".join(expected[:len(text_ids)]) == text.encode()


@pytest.mark.model
@settings(max_examples=40, deadline=None)
@given(st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=60))
def test_tokenize_round_trip(real_llm, text):
    ids = real_llm.tokenize(text, add_special=False)
    assert real_llm.detokenize(ids) == text


@pytest.mark.model
def test_matches_llama_cpp_python_driver_bitwise(real_llm, real_ref, real_ids, monkeypatch):
    """llama_cpp.Llama.eval builds its own batches; same settings -> the same bits, both for
    the whole prompt (n_batch 512) and token by token (n_batch 1)."""
    import llama_cpp
    import llama_cpp.llama_cpp as low

    original = low.llama_model_default_params

    def no_extra_bufts():  # Llama() has no use_extra_bufts argument; RunConfig's default
        p = original()
        p.use_extra_bufts = False
        return p

    monkeypatch.setattr(low, "llama_model_default_params", no_extra_bufts)
    real_llm.reset()
    whole = real_llm.prefill(real_ids)
    real_llm.reset()
    real_llm.prefill(real_ids[:1])
    for t in real_ids[1:]:
        stepped = real_llm.step(t)
    for n_batch, ours in ((512, whole), (1, stepped)):
        ref_llm = llama_cpp.Llama(str(real_ref.path), n_ctx=512, n_batch=n_batch, n_ubatch=n_batch,
                                  n_threads=1, n_threads_batch=1, flash_attn=True, n_gpu_layers=0,
                                  verbose=False)
        try:
            ref_llm.eval(real_ids)
            ptr = low.llama_get_logits_ith(ref_llm._ctx.ctx, -1)
            ref = np.ctypeslib.as_array(ptr, shape=(ours.size,)).copy()
        finally:
            ref_llm.close()
        assert np.array_equal(ours, ref), n_batch


@pytest.mark.model
def test_in_process_backend_gives_the_same_bits(real_llm, real_ref, real_ids):
    local = create("llamacpp", in_child=False)
    try:
        local.load(real_ref, CFG)
        mine = local.prefill(real_ids)
        assert local.detokenize(real_ids) == PROMPT
    finally:
        local.close()
    real_llm.reset()
    assert np.array_equal(mine, real_llm.prefill(real_ids))
