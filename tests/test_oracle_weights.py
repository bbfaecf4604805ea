"""oracles.weights: chunked float64 products, row lookup, and the on-disk float32 cache,
checked against gguf-py's reader and plain numpy float64 products."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

import oracles.weights as ow
from harness.errors import ConfigError, ModelError
from oracles.weights import GGUFWeights


def _reader_values(path, name):
    t = next(x for x in gguf.GGUFReader(path).tensors if x.name == name)
    return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)


def test_values_and_rows_match_gguf_reader(tiny_qwen2_q):
    w = GGUFWeights(tiny_qwen2_q)
    name = "token_embd.weight"  # Q5_0 in the tiny-q preset
    ref = _reader_values(tiny_qwen2_q, name)
    ids = [511, 0, 7, 7, 300]
    np.testing.assert_array_equal(w.rows64(name, ids), ref[ids])
    assert name not in w._loaded  # only the rows were dequantised
    np.testing.assert_array_equal(w.get(name), ref)
    np.testing.assert_array_equal(w.rows64(name, ids), ref[ids])  # from the resident copy
    with pytest.raises(ConfigError, match="token id 512"):
        w.rows64(name, [1, 512])


@pytest.mark.parametrize("chunk", [8, 1000, 1 << 30])
def test_chunked_linear_equals_float64_product(tiny_qwen2_q, monkeypatch, chunk):
    monkeypatch.setattr(ow, "CHUNK_BYTES", chunk)  # 8 B: one row per chunk
    w = GGUFWeights(tiny_qwen2_q)
    x = np.random.default_rng(0).standard_normal((3, 256))
    down = _reader_values(tiny_qwen2_q, "blk.1.ffn_down.weight")  # Q4_K [64, 256]
    np.testing.assert_allclose(w.linear("blk.1.ffn_down.weight", x), x @ down.T, rtol=1e-13, atol=1e-13)
    q = _reader_values(tiny_qwen2_q, "blk.0.attn_q.weight")
    bias = _reader_values(tiny_qwen2_q, "blk.0.attn_q.bias")
    got = w.linear("blk.0.attn_q.weight", x[:, :64], "blk.0.attn_q.bias")
    np.testing.assert_allclose(got, x[:, :64] @ q.T + bias, rtol=1e-13, atol=1e-13)
    with pytest.raises(ConfigError, match="does not match"):
        w.linear("blk.0.attn_q.weight", x)


def test_disk_cache_round_trip_and_repair(tiny_qwen2_q, tmp_path):
    first = GGUFWeights(tiny_qwen2_q, cache_dir=tmp_path, sha256="abc")
    ref = first.get("blk.0.ffn_gate.weight").copy()
    path = tmp_path / "abc" / "blk.0.ffn_gate.weight.npy"
    assert path.is_file() and first.dequant_seconds > 0
    second = GGUFWeights(tiny_qwen2_q, cache_dir=tmp_path, sha256="abc")
    np.testing.assert_array_equal(second.get("blk.0.ffn_gate.weight"), ref)
    assert second.dequant_seconds == 0.0 and isinstance(second.get("blk.0.ffn_gate.weight"), np.memmap)
    np.save(path, np.zeros((3, 3), np.float32))  # wrong shape: must be ignored and rewritten
    third = GGUFWeights(tiny_qwen2_q, cache_dir=tmp_path, sha256="abc")
    np.testing.assert_array_equal(third.get("blk.0.ffn_gate.weight"), ref)
    assert np.load(path).shape == ref.shape


def test_cache_key_defaults_to_file_sha256(tiny_qwen2_q, tmp_path):
    import hashlib
    w = GGUFWeights(tiny_qwen2_q, cache_dir=tmp_path)
    w.get("output_norm.weight")
    digest = hashlib.sha256(tiny_qwen2_q.read_bytes()).hexdigest()
    assert (tmp_path / digest / "output_norm.weight.npy").is_file()


def test_missing_tensor_and_wrong_shape_are_named(tiny_qwen2_q):
    w = GGUFWeights(tiny_qwen2_q)
    with pytest.raises(ModelError, match="blk.9.attn_q.weight"):
        w.get("blk.9.attn_q.weight")
    with pytest.raises(ModelError, match=r"'blk.0.attn_k.weight' has ne \(64, 32\), expected \(64, 64\)"):
        w.check_shape("blk.0.attn_k.weight", (64, 64))


def test_cache_file_names_stay_inside_the_cache(tiny_qwen2_q, tmp_path):
    w = GGUFWeights(tiny_qwen2_q, cache_dir=tmp_path / "c", sha256="ABC")
    inside = (tmp_path / "c" / "abc").resolve()
    for name in ("../../evil", "/etc/passwd", ".hidden", "blk.0.attn_q.weight"):
        assert w._cache_path(name).resolve().parent == inside
    with pytest.raises(ConfigError, match="hex digest"):
        GGUFWeights(tiny_qwen2_q, cache_dir=tmp_path, sha256="../x")
