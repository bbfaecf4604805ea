"""open_gguf on valid, damaged and hostile files.

References: gguf-py's GGUFReader for valid files (an independent parser); for damaged files
the positions of fields are found by searching the bytes (length-prefixed names), not with
the code under test, and expected sizes come from GGUFReader on the intact file.
"""
from __future__ import annotations

import struct
import time
import tracemalloc

import numpy as np
import pytest
from gguf import GGUFReader
from hypothesis import HealthCheck, given, settings, strategies as st

from harness.errors import HarnessError, ModelError, UnsupportedError
from harness.gguf_file import open_gguf


# ---------- helpers ----------

def _copy(src, tmp_path, data: bytes | None = None, name="patched.gguf"):
    p = tmp_path / name
    p.write_bytes(src.read_bytes() if data is None else data)
    return p


def _patched(src, tmp_path, pos: int, new: bytes, name="patched.gguf"):
    buf = bytearray(src.read_bytes())
    buf[pos:pos + len(new)] = new
    return _copy(src, tmp_path, bytes(buf), name)


def _string_pos(buf: bytes, s: str) -> int:
    """Offset of the GGUF string s (uint64 length + bytes); must occur exactly once."""
    pat = struct.pack("<Q", len(s.encode())) + s.encode()
    assert buf.count(pat) == 1, s
    return buf.find(pat)


def _tensor_fields(buf: bytes, name: str) -> dict[str, int]:
    """Byte offsets of n_dims, ne[0], type and offset of tensor `name`'s info record."""
    p = _string_pos(buf, name) + 8 + len(name.encode())
    n_dims = struct.unpack_from("<I", buf, p)[0]
    return {"n_dims": p, "ne0": p + 4, "type": p + 4 + 8 * n_dims,
            "offset": p + 8 + 8 * n_dims}


# ---------- valid files against GGUFReader ----------

@pytest.mark.parametrize("fixture", ["tiny_qwen2_f32", "tiny_qwen2_q"])
def test_matches_gguf_reader(fixture, request):
    path = request.getfixturevalue(fixture)
    info, ref = open_gguf(path), GGUFReader(path)
    ref_meta = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert info.metadata.keys() == ref_meta.keys()
    for k, v in ref_meta.items():
        assert info.metadata[k] == (pytest.approx(v) if isinstance(v, float) else v), k
    assert list(info.tensors) == [t.name for t in ref.tensors]
    for rt in ref.tensors:
        t = info.tensors[rt.name]
        assert (t.type_name, t.ne, t.offset, t.nbytes) == \
            (rt.tensor_type.name, tuple(rt.shape.tolist()), rt.data_offset, rt.n_bytes)
        assert t.shape == tuple(reversed(rt.shape.tolist()))
        assert info.tensor_data(rt.name).tobytes() == rt.data.tobytes()
    assert info.data_offset == ref.data_offset and info.alignment == ref.alignment


def test_accessors(tiny_qwen2_q):
    info = open_gguf(tiny_qwen2_q)
    assert info.arch == "qwen2" and info.version == 3
    assert info.arch_key("block_count") == 2 and info.get("nope", 7) == 7
    assert info.metadata_types["tokenizer.ggml.tokens"] == "ARRAY[STRING]"
    with pytest.raises(ModelError, match="qwen2.no_such_key"):
        info.arch_key("no_such_key")
    with pytest.raises(ModelError, match="blk.9.attn_q.weight"):
        info.tensor("blk.9.attn_q.weight")
    t = info.tensor("blk.0.ffn_down.weight")  # Q6_K, ne (256, 64): 1 block per row
    data = info.tensor_data(t.name)
    assert t.type_name == "Q6_K" and data.shape == (64, 210) and data.dtype == np.uint8
    with pytest.raises(ValueError):
        data[0, 0] = 1  # read-only mapping
    assert info.reader.tensors[0].name == next(iter(info.tensors))


# ---------- not GGUF at all ----------

@pytest.mark.parametrize("data", [b"", b"GG", b"hello world, not a model" * 10,
                                  b"\x00" * 64, b"GGML" + b"\x00" * 60])
def test_not_gguf(tmp_path, data):
    p = tmp_path / "x.gguf"
    p.write_bytes(data)
    with pytest.raises(ModelError, match="not a GGUF file"):
        open_gguf(p)


def test_missing_file_or_directory(tmp_path):
    with pytest.raises(ModelError, match="absent.gguf: cannot open"):
        open_gguf(tmp_path / "absent.gguf")
    with pytest.raises(ModelError, match="not a regular file"):
        open_gguf(tmp_path)


@pytest.mark.parametrize("version, match", [(1, "version 1"), (4, "version 4"),
                                            (0x03000000, "big-endian")])
def test_bad_version(tiny_qwen2_q, tmp_path, version, match):
    p = _patched(tiny_qwen2_q, tmp_path, 4, struct.pack("<I", version))
    with pytest.raises(UnsupportedError, match=match):
        open_gguf(p)


def test_version_2_is_read(tiny_qwen2_q, tmp_path):
    # v2 and v3 share the little-endian layout (docs/gguf.md: v3 added big-endian support)
    info = open_gguf(_patched(tiny_qwen2_q, tmp_path, 4, struct.pack("<I", 2)))
    assert info.version == 2 and info.tensors == open_gguf(tiny_qwen2_q).tensors


# ---------- truncation ----------

def test_truncated_in_tensor_data(tiny_qwen2_q, tmp_path):
    full = tiny_qwen2_q.read_bytes()
    ref = GGUFReader(tiny_qwen2_q)
    need = max(t.data_offset + t.n_bytes for t in ref.tensors)
    cut = ref.data_offset + (need - ref.data_offset) // 2
    p = _copy(tiny_qwen2_q, tmp_path, full[:cut])
    with pytest.raises(ModelError, match="truncated") as e:
        open_gguf(p)
    assert f"{need:,}" in str(e.value) and f"{cut:,}" in str(e.value)


def test_truncated_in_header(tiny_qwen2_q, tmp_path):
    full = tiny_qwen2_q.read_bytes()
    cut = _string_pos(full, "tokenizer.ggml.merges") + 40  # inside the metadata
    with pytest.raises(ModelError, match="truncated header"):
        open_gguf(_copy(tiny_qwen2_q, tmp_path, full[:cut]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frac=st.floats(0.0, 0.9999))
def test_any_truncation_is_a_model_error(tiny_qwen2_q, tmp_path, frac):
    full = tiny_qwen2_q.read_bytes()
    p = _copy(tiny_qwen2_q, tmp_path, full[:int(len(full) * frac)], name="cut.gguf")
    with pytest.raises(ModelError):
        open_gguf(p)


# ---------- hostile header values ----------

def _fast_small(fn):
    """Run fn; return (seconds, peak traced bytes)."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        fn()
    finally:
        dt = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return dt, peak


@pytest.mark.parametrize("pos, value, match", [
    (8, 2**40, "tensor count"), (8, 2**64 - 1, "tensor count"),
    (16, 2**40, "metadata count"), (24, 2**62, f"metadata key claims {2**62} bytes"),
])
def test_absurd_counts_do_not_allocate(tiny_qwen2_q, tmp_path, pos, value, match):
    p = _patched(tiny_qwen2_q, tmp_path, pos, struct.pack("<Q", value))
    dt, peak = _fast_small(lambda: _expect(ModelError, match, p))
    assert dt < 2.0 and peak < 20e6


def test_absurd_array_length(tiny_qwen2_q, tmp_path):
    buf = tiny_qwen2_q.read_bytes()
    key = "tokenizer.ggml.tokens"
    count_pos = _string_pos(buf, key) + 8 + len(key) + 4 + 4  # after value type, item type
    p = _patched(tiny_qwen2_q, tmp_path, count_pos, struct.pack("<Q", 2**61))
    dt, peak = _fast_small(lambda: _expect(ModelError, f"array '{key}' claims {2**61} items", p))
    assert dt < 2.0 and peak < 20e6


def _expect(cls, match, path):
    with pytest.raises(cls, match=match):
        open_gguf(path)


def test_unknown_value_type(tiny_qwen2_q, tmp_path):
    buf = tiny_qwen2_q.read_bytes()
    key = "qwen2.block_count"
    p = _patched(tiny_qwen2_q, tmp_path, _string_pos(buf, key) + 8 + len(key),
                 struct.pack("<I", 13))
    _expect(ModelError, "block_count.*unknown GGUF value type 13", p)


@pytest.mark.parametrize("type_id", [99, 4, 2**31])
def test_unknown_tensor_type(tiny_qwen2_q, tmp_path, type_id):
    buf = tiny_qwen2_q.read_bytes()
    f = _tensor_fields(buf, "blk.1.attn_k.weight")
    p = _patched(tiny_qwen2_q, tmp_path, f["type"], struct.pack("<I", type_id))
    _expect(UnsupportedError, rf"'blk.1.attn_k.weight'.*type id {type_id}\b", p)


def test_row_not_multiple_of_block(tiny_qwen2_q, tmp_path):
    buf = tiny_qwen2_q.read_bytes()
    f = _tensor_fields(buf, "output.weight")  # Q8_0, ne0 64
    p = _patched(tiny_qwen2_q, tmp_path, f["ne0"], struct.pack("<Q", 48))
    _expect(ModelError, "'output.weight'.*48.*block size 32", p)


def test_misaligned_and_overlapping_offsets(tiny_qwen2_q, tmp_path):
    buf = tiny_qwen2_q.read_bytes()
    f = _tensor_fields(buf, "blk.0.ffn_up.weight")
    off = struct.unpack_from("<Q", buf, f["offset"])[0]
    _expect(ModelError, "ffn_up.*not a multiple of the alignment 32",
            _patched(tiny_qwen2_q, tmp_path, f["offset"], struct.pack("<Q", off + 4)))
    g = _tensor_fields(buf, "blk.0.ffn_gate.weight")
    _expect(ModelError, "overlap",
            _patched(tiny_qwen2_q, tmp_path, g["offset"], struct.pack("<Q", off)))


def test_too_many_dims_and_zero_dim(tiny_qwen2_q, tmp_path):
    buf = tiny_qwen2_q.read_bytes()
    f = _tensor_fields(buf, "output.weight")
    _expect(ModelError, "5 dimensions",
            _patched(tiny_qwen2_q, tmp_path, f["n_dims"], struct.pack("<I", 5)))
    _expect(ModelError, "invalid shape",
            _patched(tiny_qwen2_q, tmp_path, f["ne0"], struct.pack("<Q", 0)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_header_corruption_never_escapes(tiny_qwen2_q, tmp_path, data):
    buf = bytearray(tiny_qwen2_q.read_bytes())
    n = data.draw(st.integers(1, 8))
    for _ in range(n):
        pos = data.draw(st.integers(0, 12_000))  # the header of this file is ~11 KB
        buf[pos] = data.draw(st.integers(0, 255))
    p = _copy(tiny_qwen2_q, tmp_path, bytes(buf), name="fuzz.gguf")
    try:
        open_gguf(p)
    except HarnessError:
        pass  # any other exception type fails the test


# ---------- the real model ----------

@pytest.mark.model
def test_real_model_05b(real_model_05b):
    t0 = time.perf_counter()
    info = open_gguf(real_model_05b)
    dt = time.perf_counter() - t0
    assert info.arch == "qwen2" and info.arch_key("block_count") == 24
    assert "blk.23.ffn_down.weight" in info.tensors and "blk.24.attn_q.weight" not in info.tensors
    assert {t.type_name for t in info.tensors.values()} <= {"Q5_0", "Q8_0", "Q6_K", "Q4_K", "F32"}
    assert len(info.metadata["tokenizer.ggml.tokens"]) == info.tensor("token_embd.weight").ne[1]
    end = max(t.offset + t.nbytes for t in info.tensors.values())
    assert end <= info.file_size and dt < 5.0
