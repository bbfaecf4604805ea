"""The PDL launcher's ctypes mirror of the driver structs and its argument packing (CPU),
and bitwise equality of the engine's step with and without PDL (GPU)."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from backends.engine import launch
from backends.engine import ops as eops
from harness import metrics
from harness.config import ModelRef, RunConfig

from gpu_util import cupy_or_skip


def test_struct_layout_matches_cuda_h():
    # cuda.h: CUlaunchAttribute = {id (4), pad (4), value union (64)}; CUlaunchConfig has 7
    # unsigned ints, then the stream handle at the next 8-byte boundary, attrs, numAttrs
    assert ctypes.sizeof(launch.LaunchAttribute) == 72
    assert launch.LaunchAttribute.value.offset == 8
    assert launch.LaunchConfig.sharedMemBytes.offset == 24
    assert launch.LaunchConfig.hStream.offset == 32
    assert launch.LaunchConfig.attrs.offset == 40
    assert launch.LaunchConfig.numAttrs.offset == 48
    assert ctypes.sizeof(launch.LaunchConfig) == 56


class _FakeArray:
    class data:  # noqa: N801 - mimics cupy.ndarray.data.ptr
        ptr = 0x7F00_0000_1234


def test_pdl_attribute_bytes():
    # id 6 at offset 0, programmaticStreamSerializationAllowed = 1 at offset 8, rest zero;
    # and building it must not write anywhere else (an earlier version wrote through a
    # c_char field's bytes copy and corrupted Python's empty-bytes singleton)
    a = launch.pdl_attribute()
    raw = ctypes.string_at(ctypes.addressof(a), ctypes.sizeof(a))
    assert raw[:4] == (6).to_bytes(4, "little")
    assert raw[8:12] == (1).to_bytes(4, "little")
    assert raw[12:] == bytes(60) and raw[4:8] == bytes(4)
    assert b"" == bytes() and len(b"") == 0


def test_pack_params_bytes():
    table = np.zeros((), eops.TABLE_DT)
    table["n"] = 3
    table["s"]["rows"][1] = 77
    args = (_FakeArray(), np.int32(-5), np.float32(1.5), np.uint64(2**63 + 7), table[()])
    bufs, ptrs = launch.pack_params(args)
    got = [ctypes.string_at(ptrs[i], n) for i, n in enumerate((8, 4, 4, 8, eops.TABLE_DT.itemsize))]
    assert got[0] == (0x7F00_0000_1234).to_bytes(8, "little")
    assert got[1] == (-5).to_bytes(4, "little", signed=True)
    assert np.frombuffer(got[2], np.float32)[0] == 1.5
    assert int.from_bytes(got[3], "little") == 2**63 + 7
    # compare fields, not bytes: the struct's tail padding is not defined (numpy copies
    # structured values field by field)
    back = np.frombuffer(got[4], eops.TABLE_DT)[0]
    assert back["n"] == 3 and not back["s"]["w"].any() and not back["row_bytes"].any()
    assert list(back["s"]["rows"]) == [0, 77, 0, 0]


def test_pack_params_refuses_python_scalars():
    with pytest.raises(TypeError, match="int"):
        launch.pack_params((np.int32(1), 3))


def test_bad_mode_is_an_error(monkeypatch):
    monkeypatch.setattr(launch, "MODE", "maybe")
    with pytest.raises(ValueError, match="GGUF_HARNESS_PDL"):
        launch.pdl_available()


@pytest.mark.gpu
def test_step_bits_equal_with_and_without_pdl(tiny_qwen2_q, monkeypatch):
    """PDL only changes when kernels start; every kernel waits before reading another's
    output, so the logits must be bit-identical (a missing wait shows up as a race here)."""
    cupy_or_skip()
    from backends.engine import EngineBackend
    shas = {}
    for mode in ("off", "on"):
        monkeypatch.setattr(launch, "MODE", mode)
        e = EngineBackend()
        e.load(ModelRef(tiny_qwen2_q.stem, tiny_qwen2_q), RunConfig(n_ctx=128))
        out = [e.prefill([3, 17, 42, 101, 7, 250, 9, 64])]
        for t in (5, 9, 11, 2, 250, 31, 77, 1):
            out.append(e.step(t))
        # chained replays (the decode benchmark's path): device-side argmax feeds the next step
        for _ in range(20):
            e.step_exec.replay()
        out.append(e.bufs.logits.get(stream=e.stream))
        e.stream.synchronize()
        shas[mode] = [metrics.logits_sha256(np.asarray(o)) for o in out]
        e.close()
    assert shas["on"] == shas["off"]
