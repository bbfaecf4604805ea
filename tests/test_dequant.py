"""gguf-py dequantisation (oracles.dequant) against ggml's own to_float (oracles.ggml_ref).

The reference is libggml-base from llama-cpp-python (C code, independent of gguf-py). Random
bytes give NaN/inf through non-finite fp16 scales; those are compared NaN-aware (positions must
match, payloads may differ: ggml quiets F16 signalling NaNs, IQ2/IQ3 NaN signs differ). Blocks
with finite scales must match bit for bit with no NaN at all.
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.errors import ModelError, UnsupportedError
from oracles import dequant, ggml_ref

Q = gguf.GGMLQuantizationType

# Types gguf-py 0.19.0 and libggml (llama-cpp-python 0.3.36) both convert, measured in
# docs/sources.md §5; a dependency upgrade that drops one must fail here, not skip.
EXPECTED_CROSS = {
    "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
    "TQ1_0", "TQ2_0", "MXFP4", "NVFP4",
}
CROSS_TYPES = [t for t in dequant.supported_types() if t != Q.F32]  # ggml has no F32 to_float
BLOCKS_PER_EXAMPLE = 2048

# Scale fields per block, from the structs in ggml/src/ggml-common.h: (byte, mask) pairs whose
# AND clears the top exponent bit(s) of every fp16 / bf16 / e8m0 / ue4m3 scale, so each scale
# is finite and below 2 (no NaN, no overflow downstream).
_FP16_AT = {  # byte offsets of fp16 scales (d, dmin / m)
    Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
    Q.IQ2_XXS: (0,), Q.IQ2_XS: (0,), Q.IQ3_XXS: (0,), Q.IQ1_S: (0,), Q.IQ4_NL: (0,),
    Q.IQ3_S: (0,), Q.IQ2_S: (0,), Q.IQ4_XS: (0,), Q.TQ1_0: (52,), Q.TQ2_0: (64,),
}


def _finite_masks(qtype: Q) -> list[tuple[int, int]]:
    if qtype in _FP16_AT:
        return [(off + 1, 0xBF) for off in _FP16_AT[qtype]]  # high byte, bit 14 of the half
    return {
        Q.F16: [(1, 0xBF)], Q.BF16: [(1, 0xBF)],
        Q.IQ1_M: [(55, 0xBF)],  # fp16 bits 12..15 = top nibble of scales[3] (uint16 at 54)
        Q.MXFP4: [(0, 0x7F)],  # e8m0 exponent byte
        Q.NVFP4: [(i, 0x3F) for i in range(4)],  # four ue4m3 sub-block scales
    }[qtype]


def _ggml_or_skip(qtype: Q) -> None:
    try:
        info = ggml_ref.ggml_type_info(qtype)
    except ggml_ref.GgmlUnavailable as exc:
        pytest.skip(f"libggml not available: {exc}")
    assert info.has_to_float, f"gguf-py dequantises {qtype.name} but libggml has no to_float for it"


def _blocks(qtype: Q, n_blocks: int, seed: int, fill: str) -> np.ndarray:
    """Random blocks, uint8 [n_blocks * type_size]."""
    rng = np.random.default_rng(seed)
    n = n_blocks * dequant.get_format(qtype).type_size
    if fill == "uniform":
        return rng.integers(0, 256, n, dtype=np.uint8)
    pool = [0x00, 0xFF, 0x80, 0x7F] if fill == "extremes" else rng.integers(0, 256, 4)
    return rng.choice(np.asarray(pool, dtype=np.uint8), n)


def _nan_aware_mismatch(ref: np.ndarray, out: np.ndarray) -> np.ndarray:
    """bool mask: NaN position differs, or both non-NaN and the float32 bits differ."""
    ref_nan, out_nan = np.isnan(ref), np.isnan(out)
    bits_differ = ref.view(np.uint32) != out.view(np.uint32)
    return (ref_nan != out_nan) | (~ref_nan & ~out_nan & bits_differ)


def _report(qtype: Q, raw: np.ndarray, ref: np.ndarray, out: np.ndarray, bad: np.ndarray) -> str:
    fmt = dequant.get_format(qtype)
    i = int(np.flatnonzero(bad)[0])
    b = i // fmt.block_size
    block = raw[b * fmt.type_size:(b + 1) * fmt.type_size]
    return (f"{qtype.name}: {int(bad.sum())} of {bad.size} values differ; first at value {i} "
            f"(block {b}): ggml {ref[i]!r} ({ref.view(np.uint32)[i]:#010x}) vs gguf-py {out[i]!r} "
            f"({out.view(np.uint32)[i]:#010x}); block bytes {block.tobytes().hex()}")


def _compare(qtype: Q, raw: np.ndarray, n_rows: int, *, finite: bool) -> None:
    fmt = dequant.get_format(qtype)
    n_values = raw.size // fmt.type_size * fmt.block_size
    out = dequant.dequantize(raw, qtype, (n_rows, n_values // n_rows)).reshape(-1)
    ref = ggml_ref.ggml_to_float(raw, qtype, n_values)
    assert out.dtype == np.float32 and out.shape == ref.shape
    bad = _nan_aware_mismatch(ref, out)
    assert not bad.any(), _report(qtype, raw, ref, out, bad)
    if finite:
        assert np.isfinite(ref).all() and np.isfinite(out).all(), f"{qtype.name}: non-finite values"


def test_cross_checked_types_are_the_measured_set():
    assert {t.name for t in CROSS_TYPES} == EXPECTED_CROSS
    assert Q.F32 in dequant.supported_types()


@pytest.mark.parametrize("qtype", CROSS_TYPES, ids=[t.name for t in CROSS_TYPES])
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**63 - 1), fill=st.sampled_from(["uniform", "extremes", "few_bytes"]),
       n_rows=st.sampled_from([1, 2, 8, 2048]))
def test_random_blocks_match_ggml(qtype, seed, fill, n_rows):
    """2048 random blocks per example, 4 examples per type: NaN-aware bit equality."""
    _ggml_or_skip(qtype)
    raw = _blocks(qtype, BLOCKS_PER_EXAMPLE, seed, fill)
    _compare(qtype, raw, n_rows, finite=False)


@pytest.mark.parametrize("qtype", CROSS_TYPES, ids=[t.name for t in CROSS_TYPES])
def test_finite_scale_blocks_match_ggml_exactly(qtype):
    """Blocks with finite scales: every value finite in both, bits identical."""
    _ggml_or_skip(qtype)
    fmt = dequant.get_format(qtype)
    raw = _blocks(qtype, 2048, seed=int(qtype), fill="uniform").reshape(-1, fmt.type_size)
    for byte, mask in _finite_masks(qtype):
        raw[:, byte] &= mask
    _compare(qtype, raw.reshape(-1), 1, finite=True)


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16], ids=["F16", "BF16"])
def test_every_16_bit_pattern_matches_ggml(qtype):
    _ggml_or_skip(qtype)
    raw = np.arange(1 << 16, dtype="<u2").view(np.uint8)
    _compare(qtype, raw, 256, finite=False)
    # Independent check of the non-NaN values: numpy's own half / bf16 = top half of a float32.
    out = dequant.dequantize(raw, qtype, (1 << 16,))
    want = (np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32) if qtype == Q.F16
            else (np.arange(1 << 16, dtype=np.uint32) << 16).astype(np.uint32).view(np.float32))
    assert not _nan_aware_mismatch(want, out).any()


def test_f32_is_a_copy_of_the_bytes():
    vals = np.random.default_rng(1).standard_normal(96).astype("<f4")
    raw = vals.view(np.uint8).copy()
    out = dequant.dequantize(raw, Q.F32, (3, 32))
    assert np.array_equal(out.reshape(-1).view(np.uint32), vals.view(np.uint32))
    out[0, 0] = 123.0
    assert raw[:4].view("<f4")[0] == vals[0]  # output does not alias the input


def test_registry_sizes_match_ggml_headers():
    # (values per block, bytes per block) from the block structs in ggml/src/ggml-common.h
    for qtype, sizes in {Q.Q4_K: (256, 2 + 2 + 12 + 128), Q.Q6_K: (256, 128 + 64 + 16 + 2),
                         Q.IQ4_XS: (256, 2 + 2 + 4 + 128), Q.Q8_0: (32, 2 + 32),
                         Q.IQ3_S: (256, 2 + 64 + 32 + 8 + 4), Q.NVFP4: (64, 4 + 32)}.items():
        fmt = dequant.get_format(qtype)
        assert (fmt.block_size, fmt.type_size, fmt.name) == (*sizes, qtype.name)


# ---- bounds and errors ------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.IQ4_NL, Q.F16], ids=["Q4_K", "IQ4_NL", "F16"])
@given(n_blocks=st.integers(1, 64), delta=st.integers(-40, 40).filter(bool))
def test_wrong_byte_length_is_a_model_error(qtype, n_blocks, delta):
    fmt = dequant.get_format(qtype)
    n_bytes = max(0, n_blocks * fmt.type_size + delta)
    raw = np.zeros(n_bytes, dtype=np.uint8)
    with pytest.raises(ModelError, match=f"{qtype.name}.*{n_blocks * fmt.type_size} bytes, got {n_bytes}"):
        dequant.dequantize(raw, qtype, (1, n_blocks * fmt.block_size), what="blk.0.x")


@given(n_rows=st.integers(0, 4), n_blocks=st.integers(0, 4))
def test_exact_byte_length_gives_the_requested_shape(n_rows, n_blocks):
    fmt = dequant.get_format(Q.Q5_K)
    raw = np.zeros(n_rows * n_blocks * fmt.type_size, dtype=np.uint8)
    out = dequant.dequantize(raw, Q.Q5_K, (n_rows, n_blocks * 256))
    assert out.shape == (n_rows, n_blocks * 256) and out.dtype == np.float32
    assert not out.any()  # zero bytes: zero scales -> zeros


@pytest.mark.parametrize("shape", [(1, 100), (2, 255), (-1, 256), ()])
def test_bad_shape_is_a_model_error(shape):
    with pytest.raises(ModelError, match="Q4_K"):
        dequant.dequantize(np.zeros(144, dtype=np.uint8), Q.Q4_K, shape)


def test_raw_must_be_uint8():
    with pytest.raises(ModelError, match="uint8"):
        dequant.dequantize(np.zeros(36, dtype=np.int8), Q.Q8_0, (1, 64))
    with pytest.raises(ModelError, match="uint8"):
        dequant.dequantize(bytes(34), Q.Q8_0, (1, 32))


@pytest.mark.parametrize("type_id, needle", [(Q.Q8_K, "Q8_K"), (Q.Q8_1, "Q8_1"), (Q.I32, "I32"),
                                             (Q.Q1_0, "Q1_0"), (4, "id 4"), (99, "id 99"), (-1, "id -1")])
def test_unsupported_type_names_the_type(type_id, needle):
    with pytest.raises(UnsupportedError, match=needle):
        dequant.dequantize(np.zeros(0, dtype=np.uint8), type_id, (0, 256))


def _lib_or_skip():
    try:
        return ggml_ref.size_mismatches()
    except ggml_ref.GgmlUnavailable as exc:
        pytest.skip(f"libggml not available: {exc}")


def test_ggml_type_table_matches_gguf_sizes():
    """ctypes layout self-check: all gguf types agree except Q8_1 (ggml: two ggml_half + 32 int8)."""
    mismatches = _lib_or_skip()
    assert [(m.gguf_name, m.gguf_sizes, m.ggml_sizes) for m in mismatches] == [("Q8_1", (32, 40), (32, 36))]
    info = ggml_ref.ggml_type_info(Q.Q4_K)
    assert (info.name, info.blck_size, info.type_size, info.is_quantized) == ("q4_K", 256, 144, True)
    assert ggml_ref.ggml_type_info(Q.F16).is_quantized is False
    assert set(ggml_ref.ggml_to_float_types()) >= {int(t) for t in CROSS_TYPES}


def test_ggml_to_float_bounds():
    _lib_or_skip()
    for bad_id in (-1, ggml_ref.GGML_TYPE_COUNT, 1000):
        with pytest.raises(UnsupportedError, match=f"id {bad_id}"):
            ggml_ref.ggml_to_float(np.zeros(0, dtype=np.uint8), bad_id, 0)
    for no_conv in (Q.F32, Q.Q8_K, Q.Q8_1):
        with pytest.raises(UnsupportedError, match="no to_float"):
            ggml_ref.ggml_to_float(np.zeros(0, dtype=np.uint8), no_conv, 0)
    with pytest.raises(ModelError, match="144 bytes, got 143"):
        ggml_ref.ggml_to_float(np.zeros(143, dtype=np.uint8), Q.Q4_K, 256)
    with pytest.raises(ModelError, match="whole number"):
        ggml_ref.ggml_to_float(np.zeros(144, dtype=np.uint8), Q.Q4_K, 255)
    with pytest.raises(ModelError, match="uint8"):
        ggml_ref.ggml_to_float(np.zeros(144, dtype=np.float32), Q.Q4_K, 256)


# ---- GGUF tensors -----------------------------------------------------------------------------

def _write_gguf(path: Path) -> dict[str, tuple[Q, np.ndarray, tuple[int, ...]]]:
    """Tiny GGUF: name -> (type, raw bytes, numpy shape [.., rows, cols])."""
    rng = np.random.default_rng(7)
    fmt = dequant.get_format(Q.Q4_K)
    q4k = rng.integers(0, 256, (3, 2, fmt.type_size), dtype=np.uint8)
    q4k[..., 1] &= 0xBF  # finite d
    q4k[..., 3] &= 0xBF  # finite dmin
    tensors = {
        "q4k": (Q.Q4_K, q4k.reshape(3, -1), (3, 512)),  # ne = [512, 3]
        "cube": (Q.Q8_0, _blocks(Q.Q8_0, 12, 3, "uniform").reshape(2, 3, -1), (2, 3, 64)),
        "norm": (Q.F32, rng.standard_normal(64).astype(np.float32).view(np.uint8), (64,)),
    }
    w = gguf.GGUFWriter(str(path), "test")
    for name, (qtype, raw, shape) in tensors.items():
        if qtype == Q.F32:
            w.add_tensor(name, raw.view(np.float32))
        else:
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


def test_dequantize_tensor_rows_cols(tmp_path):
    tensors = _write_gguf(tmp_path / "tiny.gguf")
    reader = gguf.GGUFReader(str(tmp_path / "tiny.gguf"))
    for t in reader.tensors:
        qtype, raw, shape = tensors[t.name]
        out = dequant.dequantize_tensor(t)
        assert out.shape == (math.prod(shape[:-1]), shape[-1]), t.name  # [rows, cols]
        if qtype == Q.F32:
            want = raw.view("<f4")
        else:
            _ggml_or_skip(qtype)
            want = ggml_ref.ggml_to_float(raw.reshape(-1), qtype, math.prod(shape))
        assert np.array_equal(out.reshape(-1).view(np.uint32), want.view(np.uint32)), t.name


def test_dequantize_tensor_detects_truncated_data(tmp_path):
    _write_gguf(tmp_path / "tiny.gguf")
    t = next(t for t in gguf.GGUFReader(str(tmp_path / "tiny.gguf")).tensors if t.name == "q4k")
    with pytest.raises(ModelError, match="'q4k'.*got 576"):
        dequant.dequantize_tensor(t._replace(data=t.data[:2]))
    with pytest.raises(UnsupportedError, match="Q8_K"):
        dequant.dequantize_tensor(t._replace(tensor_type=Q.Q8_K))


@pytest.fixture(scope="module")
def qwen_reader(real_model_05b):
    """The real default model (conftest: registry or $GGUF_HARNESS_MODEL_05B; skips with the
    install hint when neither has it)."""
    return gguf.GGUFReader(str(real_model_05b))


@pytest.mark.model
def test_real_model_tensors_match_ggml(qwen_reader):
    """First tensor of each type in the file; up to 4096 blocks of whole rows, bit-exact, finite."""
    seen = {}
    for t in qwen_reader.tensors:
        seen.setdefault(t.tensor_type, t)
    assert {Q.Q4_K, Q.Q6_K} <= set(seen), "a Q4_K_M file holds Q4_K and Q6_K tensors"
    for qtype, t in seen.items():
        fmt = dequant.get_format(qtype)
        cols = int(t.shape[0])
        n_rows = max(1, min(t.data.shape[0] if t.data.ndim > 1 else 1, 4096 * fmt.block_size // cols))
        raw = np.ascontiguousarray(t.data.reshape(-1, t.data.shape[-1])[:n_rows]).view(np.uint8).reshape(-1)
        out = dequant.dequantize(raw, qtype, (n_rows, cols), what=t.name)
        assert np.isfinite(out).all(), t.name
        if qtype == Q.F32:
            assert np.array_equal(out.reshape(-1), np.asarray(t.data).reshape(-1)[: out.size])
            continue
        _ggml_or_skip(qtype)
        ref = ggml_ref.ggml_to_float(raw, qtype, out.size)
        assert np.array_equal(out.reshape(-1).view(np.uint32), ref.view(np.uint32)), t.name


@pytest.mark.model
def test_real_model_every_tensor_matches_ggml(qwen_reader):
    """Every tensor of the file, in chunks of 4096 rows: bit-exact and finite (~4 s, 291 tensors)."""
    n_blocks = 0
    for t in qwen_reader.tensors:
        fmt = dequant.get_format(t.tensor_type)
        rows = t.data.reshape(-1, t.data.shape[-1]) if t.data.ndim > 1 else t.data.reshape(1, -1)
        for start in range(0, rows.shape[0], 4096):
            raw = np.ascontiguousarray(rows[start:start + 4096]).view(np.uint8).reshape(-1)
            n_values = raw.size // fmt.type_size * fmt.block_size
            out = dequant.dequantize(raw, t.tensor_type, (n_values,), what=t.name)
            if t.tensor_type == Q.F32:
                ref = raw.view("<f4")
            else:
                _ggml_or_skip(t.tensor_type)
                ref = ggml_ref.ggml_to_float(raw, t.tensor_type, n_values)
            assert np.array_equal(out.view(np.uint32), ref.view(np.uint32)), t.name
            assert np.isfinite(out).all(), t.name
            n_blocks += raw.size // fmt.type_size
    assert n_blocks == sum(int(t.n_bytes) // dequant.get_format(t.tensor_type).type_size
                           for t in qwen_reader.tensors)
