"""Synthetic qwen35 models (harness.synth.qwen35 and friends): valid zero-mean random blocks,
reproducible streamed files, presets and quant mixes (27B decode bytes without writing the
file), llama.cpp loading, the llama.cpp quantiser path and the `harness synth` command."""
from __future__ import annotations

import dataclasses
import importlib.util

import numpy as np
import pytest
from gguf import quants as gq
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as QT

from harness.errors import ConfigError, ModelError
from harness.gguf_file import open_gguf
from harness.synth.gguf_stream import ROW_GROUP
from harness.synth.qwen35 import Qwen35Shape, SynthStyle, plan_tensors, write_qwen35
from harness.synth.qwen35_presets import (
    QUANTS,
    SOURCE_DECODE_BYTES,
    mix_for,
    preset_decode_bytes,
    shape,
    write_qwen35_preset,
)
from harness.synth.randblocks import DIRECT_TYPES, _pack_k_scales, random_rows
from harness.synth.synth_rows import next_token_perm

HAVE_LLAMA = importlib.util.find_spec("llama_cpp") is not None
needs_llama = pytest.mark.skipif(not HAVE_LLAMA, reason="llama_cpp (llama-cpp-python) missing")
TINY = shape("qwen35-tiny")


@pytest.mark.parametrize("qtype", sorted(DIRECT_TYPES))
def test_random_rows_zero_mean_unit_rms(qtype):
    """Dequantised by gguf-py (independent of the generator): mean ~0, rms ~std, finite."""
    rng = np.random.default_rng(0)
    rows = random_rows(qtype, 128, 512, 0.02, rng)
    block, tsize = GGML_QUANT_SIZES[qtype]
    vals = rows.astype(np.float64) if rows.dtype != np.uint8 else \
        gq.dequantize(rows, qtype).astype(np.float64)
    assert vals.shape == (128, 512) and np.isfinite(vals).all()
    if rows.dtype == np.uint8:
        assert rows.shape == (128, 512 // block * tsize)
    assert abs(vals.mean()) < 0.01 * 0.02 * 10  # |mean| < 10 % of std (65,536 values)
    assert 0.9 < np.sqrt(np.mean(vals ** 2)) / 0.02 < 1.1


def test_q6_k_small_std_takes_smaller_sub_block_scales():
    """A Q6_K std whose usual blocks would need d < FP16_TINY (the 27B q4_k_m ffn_down: 6.7e-4)
    gets ~8x smaller int8 sub-block scales instead of an error: mean ~0, rms ~std by gguf-py's
    dequantisation, |scales| < 16; a std the usual blocks can carry keeps scales >= 16."""
    rng = np.random.default_rng(2)
    for std, small in ((6.7e-4, True), (0.02, False)):
        rows = random_rows(QT.Q6_K, 64, 512, std, rng)
        vals = gq.dequantize(rows, QT.Q6_K).astype(np.float64)
        assert np.isfinite(vals).all() and abs(vals.mean()) < 0.1 * std
        assert 0.85 < np.sqrt(np.mean(vals ** 2)) / std < 1.15
        scales = np.abs(rows.reshape(-1, 210)[:, 192:208].view(np.int8).astype(int))
        assert (scales.max() < 16) if small else (scales.min() >= 16), (std, scales.min(), scales.max())


def test_k_scale_packing_inverts_gguf_py_unpacking():
    rng = np.random.default_rng(1)
    sc = rng.integers(0, 64, (50, 8), dtype=np.uint8)
    m = rng.integers(0, 64, (50, 8), dtype=np.uint8)
    got_sc, got_m = gq.Q4_K.get_scale_min(_pack_k_scales(sc, m))
    np.testing.assert_array_equal(got_sc.reshape(50, 8), sc)
    np.testing.assert_array_equal(got_m.reshape(50, 8), m)


def test_random_rows_errors():
    rng = np.random.default_rng(0)
    with pytest.raises(ConfigError, match="whole Q4_K blocks"):
        random_rows(QT.Q4_K, 1, 100, 0.1, rng)
    with pytest.raises(ConfigError, match="no direct"):
        random_rows(QT.IQ2_XXS, 1, 256, 0.1, rng)
    with pytest.raises(ConfigError, match="fp16"):
        random_rows(QT.Q6_K, 1, 256, 1e-12, rng)


def test_shape_validation():
    base = dataclasses.asdict(TINY)
    for change, needle in [(dict(n_head=3), "n_head_kv"), (dict(n_rot=15), "n_rot"),
                           (dict(ssm_dt_rank=3), "ssm_n_group"),
                           (dict(rope_sections=(40, 40, 0, 0)), "rope_sections"),
                           (dict(n_layer=0), "n_layer")]:
        with pytest.raises(ConfigError, match=needle):
            Qwen35Shape(**{**base, **change})
    with pytest.raises(ConfigError, match="next_token"):
        SynthStyle(next_token=-1.0)


def test_rows_do_not_depend_on_chunking():
    """Any aligned row range equals the same rows of a whole-tensor call (reproducible file)."""
    for plan in plan_tensors(TINY, mix_for("q4_k_m", TINY.n_layer), seed=3):
        if plan.n_rows < 3 * ROW_GROUP:
            continue
        whole = plan.rows(0, plan.n_rows)
        part = np.concatenate([plan.rows(r, min(plan.n_rows, r + ROW_GROUP))
                               for r in range(0, plan.n_rows, ROW_GROUP)])
        np.testing.assert_array_equal(whole, part, err_msg=plan.name)


@pytest.mark.parametrize("n, seed", [(1000, 5), (512, 1), (248320, 0), (64, 2)])
def test_next_token_perm_is_one_cycle(n, seed):
    """perm visits every row of the whole groups before returning (no short greedy loops
    built into the weights); rows of a partial last group are left alone."""
    p = next_token_perm(n, seed)
    full = n // ROW_GROUP * ROW_GROUP
    i, steps = 0, 0
    while True:
        i, steps = int(p[i]), steps + 1
        if i == 0 or steps > n:
            break
    assert steps == full
    np.testing.assert_array_equal(p[full:], np.arange(full, n))


def test_written_file_matches_plan_and_is_deterministic(tmp_path):
    a = write_qwen35_preset("qwen35-tiny", tmp_path / "a.gguf", "ud-q4_k_m", seed=2)
    b = write_qwen35_preset("qwen35-tiny", tmp_path / "b.gguf", "ud-q4_k_m", seed=2)
    c = write_qwen35_preset("qwen35-tiny", tmp_path / "c.gguf", "ud-q4_k_m", seed=3)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    assert not list(tmp_path.glob("*.part"))
    info = open_gguf(a)
    plans = plan_tensors(TINY, mix_for("ud-q4_k_m", TINY.n_layer), seed=2)
    assert list(info.tensors) == [p.name for p in plans]
    for p in plans:
        t = info.tensors[p.name]
        assert (t.ne, t.type_id) == (p.ne, int(p.qtype))
        raw = np.asarray(info.tensor_data(p.name)).reshape(-1)
        assert raw.tobytes() == np.ascontiguousarray(p.rows(0, p.n_rows)).tobytes(), p.name
    assert info.arch_key("ssm.inner_size") == TINY.ssm_dt_rank * TINY.ssm_d_state
    assert info.arch_key("rope.dimension_sections") == [3, 3, 2, 0]


def test_failed_write_leaves_no_file(tmp_path, monkeypatch):
    import harness.synth.gguf_stream as gs
    plans = plan_tensors(TINY, "F32")
    boom = gs.TensorPlan(plans[3].name, plans[3].ne, plans[3].qtype,
                         lambda r0, r1: (_ for _ in ()).throw(RuntimeError("disk full")))
    monkeypatch.setattr("harness.synth.qwen35.plan_tensors",
                        lambda *a, **k: plans[:3] + [boom] + plans[4:])
    with pytest.raises(RuntimeError, match="disk full"):
        write_qwen35(tmp_path / "x.gguf", TINY)
    assert not list(tmp_path.iterdir())


def test_27b_decode_bytes_and_mix_without_writing():
    """docs/sources.md §1: decode bytes 16,102,434,816 (token_embd Q4_K 715,161,600 B and output Q6_K
    1,042,944,000 B included); ud-q4_k_m must land within 2 %."""
    got = preset_decode_bytes("qwen35-27b", "ud-q4_k_m")
    assert abs(got / SOURCE_DECODE_BYTES - 1) < 0.02, got
    s = shape("qwen35-27b")
    plans = {p.name: p for p in plan_tensors(s, mix_for("ud-q4_k_m", s.n_layer))}
    assert plans["token_embd.weight"].nbytes == 715_161_600
    assert plans["output.weight"].nbytes == 1_042_944_000
    types = {p.qtype.name for p in plans.values()}
    assert types >= {"Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ3_S", "F32"}
    assert sum(n.startswith("blk.64.") for n in plans) > 0  # one MTP block, not in decode bytes
    assert plans["blk.0.attn_qkv.weight"].ne == (5120, 10240)
    assert plans["blk.3.attn_q.weight"].ne == (5120, 12288)
    assert plans["blk.0.ssm_conv1d.weight"].ne == (4, 10240)
    for q in QUANTS:  # every mix resolves at 27B shapes (row sizes fit the block sizes)
        plan_tensors(s, mix_for(q, s.n_layer))


def test_27b_4l_plan_without_writing(capsys):
    """qwen35-27b-4l: the 27B's widths with 4 layers (DeltaNet 0-2, attention 3) and no MTP
    block; every tensor has its 27B shape, names / shapes are what the engine and the oracle
    read, the float32 weights fit the oracle's cap; the mixes pick sensible layers for 4."""
    from backends.engine import qwen35 as eq
    from harness.synth.qwen35 import decode_bytes
    from oracles.qwen35 import MAX_WEIGHT_BYTES, expected_shapes
    from oracles.qwen35_params import Qwen35Params
    s, big = shape("qwen35-27b-4l"), shape("qwen35-27b")
    assert (s.n_layer, s.n_nextn) == (4, 0)
    assert dataclasses.replace(s, n_layer=64, n_nextn=1) == big
    assert [s.is_recurrent(il) for il in range(4)] == [True, True, True, False]
    p = Qwen35Params(n_layer=4, n_nextn=0, n_ctx_train=s.n_ctx_train, n_embd=s.n_embd,
                     n_ff=s.n_ff, n_head=s.n_head, n_head_kv=s.n_head_kv, head_dim=s.head_dim,
                     n_rot=s.n_rot, rope_sections=s.rope_sections, eps=s.rms_eps,
                     freq_base=s.rope_freq_base, freq_scale=1.0, attn_scale=0.0,
                     ssm_d_conv=s.ssm_d_conv, ssm_d_state=s.ssm_d_state,
                     ssm_n_group=s.ssm_n_group, ssm_dt_rank=s.ssm_dt_rank,
                     recurrent=(True, True, True, False))
    eq.check_shapes(p)  # head 256, state 128, conv 4: instantiated engine kernels
    want_bytes = {"q4_k_m": 2_662_169_216, "ud-q4_k_m": 2_651_714_176}
    types = {}
    for q in QUANTS:
        plans = plan_tensors(s, mix_for(q, s.n_layer))
        big_ne = {b.name: b.ne for b in plan_tensors(big, mix_for(q, big.n_layer))}
        ne = {b.name: b.ne for b in plans}
        assert all(ne[n] == big_ne[n] for n in ne), q
        assert {n.split(".")[1] for n in ne if n.startswith("blk.")} == {"0", "1", "2", "3"}
        assert sorted(ne) == sorted(eq.tensor_names(p, tied=False))
        assert ne == {n: tuple(v) for n, v in expected_shapes(p, s.n_vocab, tied=False).items()}
        if q in want_bytes:
            assert decode_bytes(plans, s) == sum(b.nbytes for b in plans) == want_bytes[q]
            assert preset_decode_bytes("qwen35-27b-4l", q) == want_bytes[q]
            types[q] = {b.name: b.qtype.name for b in plans}
    f32_bytes = 4 * sum(int(np.prod(b)) for n, b in ne.items() if n != "token_embd.weight")
    assert f32_bytes < MAX_WEIGHT_BYTES  # the oracle loads it (~11.2 GB)
    assert "blk.0.attn_qkv.weight" in ne and "blk.3.attn_q.weight" in ne
    assert "blk.3.attn_qkv.weight" not in ne and "blk.0.attn_q.weight" not in ne
    # q4_k_m: llama.cpp's use_more_bits(il, 4) is layers 2 and 3
    t = types["q4_k_m"]
    assert [t[f"blk.{il}.ffn_down.weight"] for il in range(4)] == ["Q4_K", "Q4_K", "Q6_K", "Q6_K"]
    assert t["blk.3.attn_v.weight"] == "Q6_K" and t["output.weight"] == "Q6_K"
    # ud-q4_k_m: outer (0, 3) and middle (1) groups of one layer each
    t = types["ud-q4_k_m"]
    assert [t[f"blk.{il}.ffn_down.weight"] for il in range(4)] == ["Q5_K", "Q4_K", "Q4_K", "Q5_K"]
    assert [t[f"blk.{il}.ffn_up.weight"] for il in range(4)] == ["IQ4_XS", "IQ3_S", "IQ4_XS", "IQ4_XS"]
    from harness.cli import main
    assert main(["synth", "--list"]) == 0
    assert "qwen35-27b-4l" in capsys.readouterr().out  # the listing is the answer: stdout (| grep)


def test_ud_mix_layer_groups_unchanged_from_8_layers_up():
    """The at-least-one-layer groups of mix_ud_q4_k_m change nothing for 8 and 64 layers."""
    for n in (8, 64):
        mix = mix_for("ud-q4_k_m", n)
        outer = {il for il in range(n) if il < n // 8 or il >= 7 * n // 8}
        middle = set(range(3 * n // 8, 3 * n // 8 + n // 8))
        assert {int(k.split(".")[1]) for k, v in mix.items()
                if k.endswith("ffn_down.weight") and v == "Q5_K" and k[4].isdigit()} == outer
        assert {int(k.split(".")[1]) for k, v in mix.items()
                if k.endswith("ffn_gate.weight") and v == "IQ3_S"} == middle


def test_unknown_names():
    with pytest.raises(ConfigError, match="unknown quant mix"):
        mix_for("q3_k_xl", 8)
    with pytest.raises(ConfigError, match="unknown qwen35 preset"):
        shape("qwen35-9b")


@needs_llama
@pytest.mark.parametrize("quant", ["f32", "q8_0", "q4_k_m", "ud-q4_k_m", "iq4_xs", "iq3_s"])
def test_tiny_presets_load_in_llamacpp_with_o1_logits(tmp_path, quant):
    """Every direct mix loads; logits have sd ~1 (O(1) activations) and greedy output moves."""
    from backends.llamacpp import LlamaCppBackend
    from harness.config import ModelRef, RunConfig
    path = write_qwen35_preset("qwen35-tiny", tmp_path / f"{quant}.gguf", quant, seed=1)
    b = LlamaCppBackend()
    b.load(ModelRef("m", path), RunConfig(n_ctx=128, kv_type="f32", flash_attn=False))
    logits, ids = b.prefill([17, 250, 3, 499, 88, 120, 7, 301]), []
    for _ in range(24):
        assert np.isfinite(logits).all()
        assert 0.5 < logits.std() < 2.0
        ids.append(int(np.argmax(logits)))
        logits = b.step(ids[-1])
    b.close()
    assert len(set(ids)) >= 12, ids


@needs_llama
def test_llama_quantiser_path(tiny_qwen35_f32, tmp_path):
    from harness.synth.llama_quantize import llama_quantize
    out = llama_quantize(tiny_qwen35_f32, tmp_path / "q.gguf", "q4_k_m")
    types = {t.type_name for t in open_gguf(out).tensors.values()}
    assert {"Q4_K", "Q6_K", "F32"} <= types
    assert open_gguf(out).tensors["blk.0.ssm_conv1d.weight"].type_name == "F32"
    with pytest.raises(ConfigError, match="unknown llama.cpp file type"):
        llama_quantize(tiny_qwen35_f32, tmp_path / "x.gguf", "q9_9")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(ModelError, match="llama_model_quantize"):
        llama_quantize(junk, tmp_path / "y.gguf", "q8_0")
    assert not (tmp_path / "y.gguf").exists()


@needs_llama
def test_mtp_block_is_loaded_by_llamacpp_and_skipped_by_oracle(tmp_path):
    from backends.llamacpp import LlamaCppBackend
    from harness.config import ModelRef, RunConfig
    from oracles.qwen35 import Qwen35Oracle
    path = write_qwen35(tmp_path / "mtp.gguf", dataclasses.replace(TINY, n_nextn=1), "Q8_0", seed=1)
    assert open_gguf(path).arch_key("block_count") == TINY.n_layer + 1
    o = Qwen35Oracle(path, n_ctx=32)
    assert o.params.n_layer == TINY.n_layer and o.params.n_nextn == 1
    b = LlamaCppBackend()
    b.load(ModelRef("m", path), RunConfig(n_ctx=32, kv_type="f32", flash_attn=False))
    a, c = b.prefill([1, 2, 3]), o.prefill([1, 2, 3])
    b.close()
    assert int(np.argmax(a)) == int(np.argmax(c))


def test_cli_synth(tmp_path, capsys):
    from harness.cli import main
    out = tmp_path / "t.gguf"
    assert main(["synth", "--preset", "qwen35-tiny", "--quant", "iq4_xs", "--out", str(out),
                 "--seed", "4"]) == 0
    assert open_gguf(out).tensors["blk.0.ffn_up.weight"].type_name == "IQ4_XS"
    assert main(["synth", "--preset", "qwen35-tiny", "--quant", "q7", "--out", str(out)]) == 2
    assert main(["synth", "--list"]) == 0
