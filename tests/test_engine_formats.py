"""The engine's format tables on the CPU: the generated I-quant lookup tables against gguf-py
and ggml-common.h, and the kernels' per-format constants and dispatch lists against the
oracle's registry (the GPU tests in test_engine_kernels.py run the kernels themselves)."""
from __future__ import annotations

import re

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as QT

from backends.engine import iq_tables, module
from backends.engine.formats import ENGINE_TYPES
from oracles.dequant import get_format

KERNELS = module.KERNEL_DIR
FLOAT_TYPES = {0, 1, 30}

# ggml/src/ggml-common.h: GGML_TABLE_BEGIN(type, name, size) of each grid, and a few entries
GGML_SIZES = {"iq2xxs_grid": (np.uint64, 256), "iq2xs_grid": (np.uint64, 512),
              "iq2s_grid": (np.uint64, 1024), "iq3xxs_grid": (np.uint32, 256),
              "iq3s_grid": (np.uint32, 512), "iq1s_grid": (np.uint64, 2048)}  # NGRID_IQ1S
GGML_ENTRIES = {
    "iq2xxs_grid": {0: 0x0808080808080808, 1: 0x080808080808082B, 255: 0x2B2B2B1908081908},
    "iq2xs_grid": {0: 0x0808080808080808, 2: 0x0808080808081919},
    "iq3xxs_grid": {0: 0x04040404, 1: 0x04040414, 2: 0x04040424},
    "iq3s_grid": {511: 0x0F0F0101},
    "iq1s_grid": {0: 0xFFFFFFFFFFFFFFFF, 1: 0xFFFFFFFFFFFFFF01, 2: 0xFFFFFFFFFFFF0000, 3: 0xFFFFFFFFFFFF01FF},
}
KVALUES_IQ4NL = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]


def _words(name: str) -> np.ndarray:
    cls = next(c for n, c, _, _ in iq_tables.GRIDS if n == name)
    return iq_tables.grid_words(cls)


@pytest.mark.parametrize("name", list(GGML_SIZES))
def test_grid_sizes_and_entries_match_ggml(name):
    dtype, size = GGML_SIZES[name]
    w = _words(name)
    assert w.dtype == dtype and w.shape == (size,)
    for i, v in GGML_ENTRIES.get(name, {}).items():
        assert int(w[i]) == v, f"{name}[{i}] = {int(w[i]):#x}, ggml-common.h has {v:#x}"


@pytest.mark.parametrize("name,cls", [(n, c) for n, c, _, _ in iq_tables.GRIDS])
def test_grid_words_unpack_to_gguf_py_values(name, cls):
    w = _words(name)
    per = w.dtype.itemsize
    b = w.view(np.uint8).reshape(-1, per)
    values = b.view(np.int8) if name == "iq1s_grid" else b
    np.testing.assert_array_equal(values.astype(np.int64), iq_tables.grid_values(cls))


@pytest.mark.parametrize("name", [n for n, _, _, _ in iq_tables.GRIDS if n != "iq1s_grid"])
def test_signed_grids_have_no_zero_byte(name):
    """kernels/iqdot.cuh apply_signs4 negates a byte as (g ^ 0xff) + 1, carry-free only for
    1 <= g <= 127."""
    b = _words(name).view(np.uint8)
    assert b.min() >= 1 and b.max() <= 127


def test_iq1_grid_is_ternary_int8():
    assert set(np.unique(_words("iq1s_grid").view(np.int8))) == {-1, 0, 1}


def test_ksigns_closed_form():
    """kernels/iquants.cuh ksigns8: s | parity(popcount(s)) << 7 is ggml's ksigns_iq2xs."""
    s = np.arange(128)
    parity = np.array([bin(int(v)).count("1") & 1 for v in s])
    np.testing.assert_array_equal(s | (parity << 7), iq_tables.ksigns_iq2xs())


def test_kvalues_words():
    assert iq_tables.kvalues_iq4nl().tolist() == KVALUES_IQ4NL
    w = iq_tables.kvalues_words()
    assert w.dtype == np.uint32 and w.view(np.int8).tolist() == KVALUES_IQ4NL


def test_header_holds_the_generated_arrays():
    h = iq_tables.header()
    for name, cls, n, _ in iq_tables.GRIDS:
        m = re.search(rf"static __device__ const unsigned (long long|int) {name}\[(\d+)\] = \{{(.*?)\}};", h, re.S)
        assert m and int(m.group(2)) == n, name
        vals = [int(v.rstrip("ul"), 16) for v in re.findall(r"0x[0-9a-f]+u?l*", m.group(3))]
        assert vals == [int(v) for v in iq_tables.grid_words(cls)], name
    for i, w in enumerate(iq_tables.kvalues_words()):
        assert f"constexpr unsigned int IQ4NL_K{i} = 0x{int(w):08x}u;" in h
    assert f"#ifndef {iq_tables.HEADER_GUARD}" in (KERNELS / "iquants.cuh").read_text()


def test_tables_go_only_to_sources_that_read_blocks():
    h = iq_tables.header()
    for src in ("gemv.cu", "gemv_f32.cu", "misc.cu"):
        assert module.source_code(src).startswith(h)
    for src in ("attention.cu", "attention_gqa.cu"):
        code = module.source_code(src)
        assert "iq2xxs_grid" not in code and "kernel headers sha256" in code


# ---- kernel sources vs the registry ----

def _kernel_text() -> str:
    return "".join(p.read_text() for p in sorted(KERNELS.glob("*.cu*")))


def _type_ids() -> dict[str, int]:
    return {m.group(1): int(m.group(2))
            for m in re.finditer(r"#define T_(\w+) (\d+)", (KERNELS / "common.cuh").read_text())}


def test_type_ids_match_gguf():
    ids = _type_ids()
    for tid, name in ENGINE_TYPES.items():
        assert int(QT[name]) == tid and ids[name] == tid, name


def test_block_sizes_match_the_oracle_registry():
    text = _kernel_text()
    for tid, name in ENGINE_TYPES.items():
        m = re.search(rf"struct Fmt<T_{name}>\s*{{ static const int QK = (\d+),\s*TS = (\d+); }}", text)
        assert m, f"no Fmt<T_{name}>"
        f = get_format(tid)
        assert (int(m.group(1)), int(m.group(2))) == (f.block_size, f.type_size), name


def _cases(text: str, func: str) -> set[str]:
    body = re.search(rf"{func}\(.*?\n}}\n", text, re.S).group(0)
    return set(re.findall(r"case T_(\w+):", body))


def test_every_engine_type_is_dispatched():
    names = set(ENGINE_TYPES.values())
    text = _kernel_text()

    def macro_types(macro):
        body = re.search(rf"#define {macro}\(X\)(.*?)\n(?!    )", text, re.S).group(1)
        return set(re.findall(r"X\(T_(\w+)\)", body))

    iq, wide = macro_types("FOR_EACH_IQ_TYPE"), macro_types("FOR_EACH_WIDE_TYPE")
    assert macro_types("FOR_EACH_TYPE") | wide | iq == names
    assert not macro_types("FOR_EACH_TYPE") & wide
    # the wide loop (kwide.cuh) and, under NARROW_BIT, the per-8 loop for each wide format
    gemv = (KERNELS / "gemv.cu").read_text()
    for func in ("row_dot_kq", "row_dot2_kq"):
        body = re.search(rf" {func}\(.*?\n}}\n", gemv, re.S).group(0)
        assert "FOR_EACH_WIDE_TYPE(CASE)" in body, f"gemv.cu {func} does not dispatch the wide types"
    for func in ("row_dot_any", "row_dot2_any"):
        body = re.search(rf" {func}\(.*?\n}}\n", gemv, re.S).group(0)
        assert "case T | NARROW_BIT:" in body and "FOR_EACH_WIDE_TYPE(CASE)" in body, func
    for name in wide:
        assert re.search(rf"float wide_dot<T_{name}>\(", text), f"no wide_dot<T_{name}>"
    for src, func in (("gemv.cu", "row_dot_iq"), ("dequant.cuh", "row_dot_iq_f32")):
        body = re.search(rf"float {func}\(.*?\n}}\n", (KERNELS / src).read_text(), re.S).group(0)
        assert "FOR_EACH_IQ_TYPE(CASE)" in body, f"{src} {func} does not dispatch the I-quants"
    deq = (KERNELS / "dequant.cuh").read_text()
    assert _cases(deq, "float row_dot_any") | iq == names
    assert _cases(deq, "void row_deq_any") == names
    for name in names:
        assert re.search(rf"void deq8<T_{name}>\(", text), f"no deq8<T_{name}>"
        if int(QT[name]) not in FLOAT_TYPES:
            assert re.search(rf"float qdot8<T_{name}>\(", text), f"no qdot8<T_{name}>"


def test_random_blocks_of_every_engine_type_are_finite():
    """The GPU tests' weights (oracles.blocks.random_blocks): finite scales for every type the
    engine reads, including IQ1_M's fp16 d spread over the top nibbles of its scales."""
    from oracles.blocks import random_blocks
    from oracles.dequant import dequantize
    rng = np.random.default_rng(0)
    for tid, name in ENGINE_TYPES.items():
        f = get_format(tid)
        raw = random_blocks(tid, 64, rng)
        w = dequantize(raw.reshape(-1), tid, (64 * f.block_size,))
        assert np.isfinite(w).all() and np.abs(w).max() > 0, name
    sc = random_blocks(29, 64, rng)[:, 48:56].copy().view("<u2")
    d16 = sum(((sc[:, k] >> 12) & 0xF) << (4 * k) for k in range(4)).astype(np.uint16)
    assert np.all(np.abs(d16.view(np.float16).astype(np.float64)) >= 0.01 - 1e-5)
    assert np.all(np.abs(d16.view(np.float16).astype(np.float64)) <= 0.02 + 1e-5)
