"""Every engine kernel source compiles with NVRTC, on the CPU machine.

On the GPU machine CuPy compiles kernels/*.cu with NVRTC at first use; a syntax error or an
NVRTC-only incompatibility there costs a device round trip to find. Here the same code strings
(backends.engine.module.source_code: the I-quant tables and the headers digest in front) are
compiled with the same options (--std=c++17, -I<kernels>) for the H200's architecture (sm_90)
through NVRTC's C API with ctypes, from the nvidia-cuda-nvrtc wheel (a dependency; the version
matches the GPU machine's CUDA 13.0). Skipped with the reason when NVRTC cannot be loaded.
A compile takes 1-60 s per source (gemv.cu is the long one: every format's row loops).
"""
from __future__ import annotations

import ctypes
import re
import importlib.util
from pathlib import Path

import pytest

from backends.engine import module

ARCH = "sm_90"  # the H200 (ops.py and the kernels assume Hopper: griddepcontrol, 16-byte loads)
SOURCES = [pytest.param(n, (), marks=pytest.mark.slow) if n == "gemv.cu" else (n, ())  # ~60 s
           for n in sorted(p.name for p in module.KERNEL_DIR.glob("*.cu"))]
# variants the engine compiles with preprocessor defines (module.kernel_in(..., defines))
SOURCES.append(pytest.param("gemv.cu", ("ACT_Q8_1",), marks=pytest.mark.slow))  # ops GEMV_IMPL q8_1
# the _iq4 kernels (wide IQ4_XS loop) of nodes with an IQ4_XS segment (ops.gemv_kernel), q16 and q8_1
SOURCES += [pytest.param("gemv.cu", d + ("GEMV_IQ4",), marks=pytest.mark.slow) for d in ((), ("ACT_Q8_1",))]
# the IQ3_S grid-table A/B builds of the v9 kernels (ops.kv9_iq3s_defines, GGUF_HARNESS_GEMV_KQ_IQ3S_GRID)
# (16 copies is the default since session 20: 1 and 2 take the scalar setup loop)
SOURCES += [("gemv_kq.cu", ("KQ_IQ3S_GRID=0",)), ("gemv_kq.cu", ("KQ_IQ3S_GRID=1",)), ("gemv_kq.cu", ("KQ_IQ3S_GRID=2",)),
            ("gemv_kq.cu", ("KQ_P2=1", "KQ_IQ3S_GRID=32")),  # 32 copies in the dynamic shared memory (A/B)
            ("gemv_kq.cu", ("KQ_P2=1", "KQ_BLOCK_WARPS=32", "KQ_DQ=1", "KQ_IQ3S_GRID=32"))]
# the latency A/B builds (ops.kv9_defines: GGUF_HARNESS_GEMV_KQ_PF / _KQ_PIPE / _KQ_L1PF / _KQ_MINB)
SOURCES += [("gemv_kq.cu", ("KQ_PF=1", "KQ_PIPE=1")), ("gemv_kq.cu", ("KQ_PIPE=2", "KQ_MINB=2")),
            ("gemv_kq.cu", ("KQ_L1PF=2", "KQ_MINB=2"))]
# two rows per warp (GGUF_HARNESS_GEMV_KQ_P2), the natural-order IQ4_XS staging
# (GGUF_HARNESS_GEMV_IQ4_XIL=0), the IQ3_S instances' own minBlocks (_KQ_MINB_IQ3S)
SOURCES += [("gemv_kq.cu", ("KQ_P2=1",)), ("gemv_kq.cu", ("IQ4_XIL=0",)), ("gemv_tma.cu", ("IQ4_XIL=0",)),
            ("gemv_kq.cu", ("KQ_MINB_IQ3S=0",))]
# session 14's builds as the engine makes them (ops.kv9_defines puts KQ_P2=1 first by default): the
# IQ4_XS codebook words as constants (the default holds them in registers), F32 rows beside the
# lane records in the conflict-free lane order (A/B)
SOURCES += [("gemv_kq.cu", ("KQ_P2=1", "IQ4_KREG=0")), ("gemv_kq.cu", ("KQ_P2=1", "KQ_F32_XPERM=1"))]
SOURCES += [("gemv_kq.cu", ("KQ_P2=1", "KQ_WMAJ=1")), ("gemv_kq.cu", ("KQ_P2=1", "KQ_TRACE=1"))]  # session 15: warp-major rows, the timeline build
SOURCES += [("gemv_kq.cu", ("KQ_P2=1", "KQ_BLOCK_WARPS=32", "KQ_DQ=1", "KQ_TRACE=1"))]  # session 28: the row queue's per-row marks
# (the wide build of ops.kv9_wide, KQ_P2=1 KQ_BLOCK_WARPS=32 KQ_WMAJ=1: test_v9_wide_build_launch_bounds)
SOURCES += [("gemv_mma.cu", ("TCR_PIPE=1",)), ("gemv_mma.cu", ("TCR_WARPS=2", "TCR_UNROLL=4"))]  # v12 A/B builds (gemv_tcr.tcr_defines)
SOURCES += [("gemv_kq.cu", ("KQ_P2=1", "KQ_CSPLIT=1"))]  # session 16: the cluster-split instances alone (ops.kv9_csplit)
# session 17: the queue build's A/B form with parts, tail rows and contiguous rows (the default queue
# build, ops.kv9_dq_defines of the wide build: test_v9_wide_build_launch_bounds)
SOURCES += [("gemv_kq.cu", ("KQ_P2=1", "KQ_BLOCK_WARPS=32", "KQ_DQ=1", "KQ_DQ_P=4", "KQ_DQ_T=8", "KQ_DQ_MAP=0"))]
SOURCES += [("gemv_kq.cu", ("KQ_P2=1", "KQ_CSPLIT=1", "KQ_GSPLIT=1"))]  # the cluster kernels without clusters
# session 19: session 18's fence in every thread of a group block (GGUF_HARNESS_GEMV_KQ_GS_FENCE=0)
SOURCES += [("gemv_kq.cu", ("KQ_P2=1", "KQ_CSPLIT=1", "KQ_GSPLIT=1", "KQ_GS_FENCE=0"))]
# session 20: the group build without the leftover rotation (GGUF_HARNESS_GEMV_KQ_PART_ROT=0; on by default,
# keyed by the row group since session 21) ... and keyed by the warp's round (=round, session 20's default)
SOURCES += [("gemv_kq.cu", ("KQ_P2=1", "KQ_CSPLIT=1", "KQ_GSPLIT=1", "KQ_PART_ROT=0")),
            ("gemv_kq.cu", ("KQ_P2=1", "KQ_CSPLIT=1", "KQ_GSPLIT=1", "KQ_PART_ROT=1"))]
# session 17: the next node's prefetch (ops GGUF_HARNESS_GEMV_KQ_XPF; its static_assert holds the
# table to ops.table_dtype(xpf=True)'s 200 bytes), in the default and the queue build
SOURCES += [("gemv_kq.cu", ("KQ_P2=1", "KQ_XPF=1")), ("gemv_kq.cu", ("KQ_P2=1", "KQ_BLOCK_WARPS=32", "KQ_DQ=1", "KQ_XPF=1"))]
# ... and the conv inside ssm_in (GGUF_HARNESS_GEMV_KQ_CONV), alone and with the prefetch (the table's
# three layouts; each with its static_assert), in the default and the wide build
SOURCES += [("gemv_kq.cu", ("KQ_P2=1", "KQ_CONV=1")),
            ("gemv_kq.cu", ("KQ_P2=1", "KQ_XPF=1", "KQ_CONV=1", "KQ_BLOCK_WARPS=32", "KQ_WMAJ=1")),
            ("gemv_kq.cu", ("KQ_P2=1", "KQ_XPF=1", "KQ_CONV=1", "KQ_CSPLIT=1")),
            ("gemv_kq.cu", ("KQ_P2=1", "KQ_CONV=1", "KQ_BLOCK_WARPS=32", "KQ_DQ=1"))]
# session 23: the first-row prefetch never (KQ_PF0=0) or after the PDL wait (=2; ops GGUF_HARNESS_GEMV_KQ_PF0),
# in the default, the queue and the group build
SOURCES += [("gemv_kq.cu", ("KQ_P2=1", "KQ_PF0=0")), ("gemv_kq.cu", ("KQ_P2=1", "KQ_PF0=2")),
            ("gemv_kq.cu", ("KQ_P2=1", "KQ_BLOCK_WARPS=32", "KQ_DQ=1", "KQ_PF0=2")),
            ("gemv_kq.cu", ("KQ_P2=1", "KQ_CSPLIT=1", "KQ_GSPLIT=1", "KQ_PF0=0"))]
SOURCES += [("gemv_kq.cu", ("KQ_P2=1", "KQ_XLANE=0"))]  # the xq_slot staging (x in lane records is the default since session 13)
# the small-ring v10 builds (ops.tma_defines: GGUF_HARNESS_GEMV_TMA_NST / _WARPS / _MINB / _RPW)
SOURCES += [("gemv_tma.cu", ("TMA_NST=2", "TMA_WARPS=8", "TMA_MINB=2")), ("gemv_tma.cu", ("TMA_NST=3", "TMA_WARPS=4")),
            ("gemv_tma.cu", ("TMA_RPW=2",)), ("gemv_tma.cu", ("TMA_RPW=2", "TMA_NST=2", "TMA_WARPS=8", "TMA_MINB=2"))]
# the v11 block shapes (backends/engine/gemv_mma.py mma_defines: GGUF_HARNESS_GEMV_MMA_WARPS / _UNROLL / _MINB)
SOURCES += [("gemv_mma.cu", ("MMA_WARPS=4", "MMA_UNROLL=1")), ("gemv_mma.cu", ("MMA_WARPS=16", "MMA_UNROLL=3", "MMA_MINB=1"))]


def _nvrtc():
    """The NVRTC library of the nvidia-cuda-nvrtc wheel, with its builtins library loaded
    first (libnvrtc opens it by name at compile time). pytest.skip when absent."""
    spec = importlib.util.find_spec("nvidia")
    dirs = [Path(p) / "cu13" / "lib" for p in (spec.submodule_search_locations or [])] if spec else []
    for d in dirs:
        main, builtins = d / "libnvrtc.so.13", sorted(d.glob("libnvrtc-builtins.so.13*"))
        if main.exists() and builtins:
            try:
                ctypes.CDLL(str(builtins[0]), mode=ctypes.RTLD_GLOBAL)
                return ctypes.CDLL(str(main))
            except OSError as e:
                pytest.skip(f"NVRTC in {d} does not load: {e}")
    pytest.skip("NVRTC not installed (pip install nvidia-cuda-nvrtc==13.0.88)")


def compile_source(lib, name: str, defines: tuple[str, ...] = (), ptx: list | None = None) -> tuple[int, str]:
    """(NVRTC result code, compile log) of kernels/<name> as the engine builds it; with a list
    `ptx`, the generated PTX text is appended to it on success."""
    code = module.source_code(name).encode()
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), code, name.encode(), 0, None, None) == 0
    try:
        opts = [b"--std=c++17", f"-I{module.KERNEL_DIR}".encode(), f"--gpu-architecture={ARCH}".encode()]
        opts += [f"-D{d}".encode() for d in defines]
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        if ptx is not None and rc == 0:
            lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetPTX(prog, buf)
            ptx.append(buf.value.decode())
        return rc, log.value.decode(errors="replace")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


# session 24: the timing-only diagnostic builds (module.diag_defines, GGUF_HARNESS_DIAG)
# (KQ_P2=1 DIAG_NOSTAGE alone: test_diag_nostage_skips_the_loads_of_x compiles it)
SOURCES += [("gemv_kq.cu", ("KQ_P2=1", "DIAG_NOWAIT", "DIAG_NOSTAGE")), ("deltanet.cu", ("DIAG_NOWAIT",))]
# session 25: the first-row prefetch cut to the first round is the default (KQ_PF0 3); the whole row
# (KQ_PF0=1, the default before) and the first prefetch's super-blocks per part
# (ops GGUF_HARNESS_GEMV_KQ_PF0_SB) in the default, the queue and the group builds
SOURCES += [("gemv_kq.cu", ("KQ_P2=1", "KQ_PF0=1")), ("gemv_kq.cu", ("KQ_P2=1", "KQ_BLOCK_WARPS=32", "KQ_DQ=1", "KQ_PF0=1")),
            ("gemv_kq.cu", ("KQ_P2=1", "KQ_CSPLIT=1", "KQ_GSPLIT=1", "KQ_PF0=1")),
            ("gemv_kq.cu", ("KQ_P2=1", "KQ_BLOCK_WARPS=32", "KQ_DQ=1", "KQ_PF0_SB=4")),
            ("gemv_kq.cu", ("KQ_P2=1", "KQ_CSPLIT=1", "KQ_GSPLIT=1", "KQ_PF0_SB=16"))]
# session 26: the first row's first round loaded into registers before the PDL wait (ops
# GGUF_HARNESS_GEMV_KQ_PRE=1) in the default, the queue and the group builds
SOURCES += [("gemv_kq.cu", ("KQ_P2=1", "KQ_PRE=1")), ("gemv_kq.cu", ("KQ_P2=1", "KQ_BLOCK_WARPS=32", "KQ_DQ=1", "KQ_PRE=1")),
            ("gemv_kq.cu", ("KQ_P2=1", "KQ_CSPLIT=1", "KQ_GSPLIT=1", "KQ_PRE=1"))]


@pytest.mark.parametrize("name,defines", SOURCES)
def test_kernel_source_compiles_with_nvrtc(name, defines):
    rc, log = compile_source(_nvrtc(), name, defines)
    assert rc == 0, f"{name} {defines}: NVRTC error {rc}\n{log}"


def _min_ctas(ptx: str) -> dict[str, int | None]:
    """Each kernel entry of a PTX text -> its .minnctapersm (launch bounds' minBlocks), None if absent."""
    out = {}
    for m in re.finditer(r"\.entry (\w+)\((?:.|\n)*?\n\{", ptx):
        head = m.group(0)
        mc = re.search(r"\.minnctapersm (\d+)", head)
        out[m.group(1)] = int(mc.group(1)) if mc else None
    return out


def test_v9_iq3s_swiglu_instance_alone_has_no_min_blocks():
    """Session 12's default (kernels/gemv_kq.cu kKqMinB per mode): the IQ3_S SwiGLU instance with
    one warp per row group has no minBlocks (the 27B's IQ3_S gate/up nodes -5.3 % without it), every
    other 8-lane instance keeps KQ_MINB's 2, and KQ_MINB_IQ3S=2 puts it back."""
    lib = _nvrtc()
    for defines, want in (((), None), (("KQ_MINB_IQ3S=2",), 2)):
        ptx: list = []
        rc, log = compile_source(lib, "gemv_kq.cu", defines, ptx)
        assert rc == 0, log
        mins = _min_ctas(ptx[0])
        assert mins["gemvkq_swiglu_iq3_s"] == want, (defines, mins["gemvkq_swiglu_iq3_s"])
        others = {k: v for k, v in mins.items() if k.startswith("gemvkq_") and k != "gemvkq_swiglu_iq3_s"}
        assert len(others) > 40 and set(others.values()) == {2}, (defines, others)


@pytest.mark.parametrize("dq", [False, True])
def test_v9_wide_build_launch_bounds(dq):
    """The wide build the engine runs for split-1 nodes of >= 8192 rows (ops.kv9_wide_defines of
    the default defines), and its queue build (ops.kv9_dq_defines of that, the default for the
    one-row 8-lane nodes since session 17), compile; every v9 instance takes 1024 threads, with
    minBlocks 1 (the 16-warp build's 2, halved: 64 registers either way), and the IQ3_S SwiGLU one
    none, as at 16 warps."""
    from backends.engine import ops
    lib = _nvrtc()
    defines = ops.kv9_wide_defines(("KQ_P2=1",))
    if dq:  # as ops.kv9_dq_defines makes it with its A/B switches unset
        defines = tuple(d for d in defines if d != "KQ_WMAJ=1") + ("KQ_DQ=1",)
    ptx: list = []
    rc, log = compile_source(lib, "gemv_kq.cu", defines, ptx)
    assert rc == 0, log
    mins = _min_ctas(ptx[0])
    v9 = {k: v for k, v in mins.items() if k.startswith("gemvkq")}
    assert len(v9) > 60
    assert mins.pop("gemvkq_swiglu_iq3_s") is None
    assert {v for k, v in mins.items() if k.startswith("gemvkq")} == {1}
    ntid = re.findall(r"\.entry (gemvkq\w+)\((?:.|\n)*?\.maxntid (\d+), 1, 1", ptx[0])
    assert len(ntid) == len(v9) and {n for _, n in ntid} == {"1024"}


def test_iq3s_grid_copies_are_16_byte_aligned():
    """kernels/kwide_iq3s.cuh: iq3s_grid_setup writes 4 or more grid copies with uint4 stores, so
    the static shared array must be 16-byte aligned (session 20: the 16-copy build faulted with
    cudaErrorMisalignedAddress on the H200 while the array sat at .align 4). Read from the PTX of
    the default build (16 copies) and of the 4-copy build."""
    lib = _nvrtc()
    for defines in (("KQ_P2=1",), ("KQ_P2=1", "KQ_IQ3S_GRID=4")):
        ptx = []
        rc, log = compile_source(lib, "gemv_kq.cu", defines, ptx)
        assert rc == 0, log
        decl = re.search(r"\.shared \.align (\d+) \.b8 iq3s_grid_s\[(\d+)\]", ptx[0])
        assert decl, f"{defines}: no iq3s_grid_s in the PTX"
        assert int(decl.group(1)) >= 16, f"{defines}: iq3s_grid_s at .align {decl.group(1)}"
        copies = 16 if len(defines) == 1 else 4
        assert int(decl.group(2)) == 512 * 4 * copies, decl.group(0)


def test_a_broken_source_fails_to_compile(monkeypatch):
    """The check can fail: a kernel with a syntax error does not compile."""
    lib = _nvrtc()
    real = module.source_code
    monkeypatch.setattr(module, "source_code",
                        lambda n: real(n).replace("pdl_wait();", "pdl_wait()", 1))
    rc, log = compile_source(lib, "misc.cu")
    assert rc != 0 and "error" in log


def _entry_bodies(ptx: str) -> dict[str, str]:
    """Each kernel entry of a PTX text -> its text up to the next entry."""
    parts = re.split(r"(?=\.(?:visible )?\.entry )", ptx)
    return {re.match(r"\.(?:visible )?\.entry (\w+)", p).group(1): p for p in parts if ".entry " in p[:40]}


def test_diag_nowait_removes_every_pdl_wait_and_nothing_else():
    """GGUF_HARNESS_DIAG=nowait (module.diag_defines): misc.cu's kernels lose their
    griddepcontrol.wait and nothing else (the PTX without comments and wait lines is the default
    build's, the launch_dependents triggers included)."""
    lib = _nvrtc()
    plain: list = []
    diag: list = []
    assert compile_source(lib, "misc.cu", (), plain)[0] == 0
    assert compile_source(lib, "misc.cu", ("DIAG_NOWAIT",), diag)[0] == 0
    assert plain[0].count("griddepcontrol.wait") >= 3 and "griddepcontrol.launch_dependents" in plain[0]
    assert "griddepcontrol.wait" not in diag[0]
    code = lambda ptx: [ln for ln in ptx.splitlines()
                        if "griddepcontrol.wait" not in ln and not ln.lstrip().startswith("//")]
    assert code(diag[0]) == code(plain[0])


def test_diag_nostage_skips_the_loads_of_x():
    """GGUF_HARNESS_DIAG=nostage: a v9 store kernel's PTX has fewer global loads (x and the
    norm are not read) and still its weight loads; the kernel list is the default's."""
    lib = _nvrtc()
    plain: list = []
    diag: list = []
    assert compile_source(lib, "gemv_kq.cu", ("KQ_P2=1",), plain)[0] == 0
    assert compile_source(lib, "gemv_kq.cu", ("KQ_P2=1", "DIAG_NOSTAGE"), diag)[0] == 0
    a, b = _entry_bodies(plain[0]), _entry_bodies(diag[0])
    assert set(a) == set(b) and len(a) > 40
    name = "gemvkq_store_q4_k"
    loads = lambda t: len(re.findall(r"\bld\.global", t))
    assert 0 < loads(b[name]) < loads(a[name]), (loads(b[name]), loads(a[name]))


def test_diag_nowait_c4_drops_the_wait_of_the_4_part_kernels_only():
    """GGUF_HARNESS_DIAG=nowait_c4 (session 32): in the cluster-split build the _c4 entries lose their
    griddepcontrol.wait, the _c2 entries keep it; nowait_c2 the other way round."""
    lib = _nvrtc()
    base = ("KQ_P2=1", "KQ_CSPLIT=1", "KQ_GSPLIT=1")
    plain: list = []
    c4: list = []
    c2: list = []
    assert compile_source(lib, "gemv_kq.cu", base, plain)[0] == 0
    assert compile_source(lib, "gemv_kq.cu", base + ("DIAG_NOWAIT_C4",), c4)[0] == 0
    assert compile_source(lib, "gemv_kq.cu", base + ("DIAG_NOWAIT_C2",), c2)[0] == 0
    a, b4, b2 = _entry_bodies(plain[0]), _entry_bodies(c4[0]), _entry_bodies(c2[0])
    assert set(a) == set(b4) == set(b2)
    n4 = [n for n in a if n.endswith("_c4")]
    n2 = [n for n in a if n.endswith("_c2")]
    assert n4 and n2
    waits = lambda t: t.count("griddepcontrol.wait")
    for n in n4:
        assert waits(a[n]) >= 1 and waits(b4[n]) == 0 and waits(b2[n]) == waits(a[n]), n
    for n in n2:
        assert waits(a[n]) >= 1 and waits(b2[n]) == 0 and waits(b4[n]) == waits(a[n]), n


def test_diag_nowait_c4_reaches_the_cluster_split_module_only(monkeypatch):
    """module._module adds nowait_c4's define to gemv_kq.cu's KQ_CSPLIT build and to no other module
    (every other module keeps its cached default build); nowait_norm's to every gemv_kq.cu build and
    no other source; plain nowait's to every source."""
    from backends.engine import module
    seen = []
    monkeypatch.setattr(module, "_module_for", lambda source, defines: seen.append((source, defines)))
    builds = [("gemv_kq.cu", ("KQ_P2=1", "KQ_CSPLIT=1", "KQ_GSPLIT=1")), ("gemv_kq.cu", ("KQ_P2=1",)),
              ("deltanet.cu", ()), ("gemv.cu", ())]
    for word, define, want in (("nowait_c4", "DIAG_NOWAIT_C4", [True, False, False, False]),
                               ("nowait_norm", "DIAG_NOWAIT_NORM", [True, True, False, False]),
                               ("nowait", "DIAG_NOWAIT", [True, True, True, True])):
        monkeypatch.setattr(module, "DIAG", word)
        seen.clear()
        for src, d in builds:
            module._module(src, d)
        assert [define in d for _, d in seen] == want, (word, seen)


def test_diag_nowait_norm_compiles_with_the_wait_behind_a_branch():
    """DIAG_NOWAIT_NORM: the v9 builds compile, every entry keeps its griddepcontrol.wait (behind a
    runtime test of the norm pointer) and the entry list is the default's."""
    lib = _nvrtc()
    for base in (("KQ_P2=1",), ("KQ_P2=1", "KQ_BLOCK_WARPS=32", "KQ_DQ=1")):
        plain: list = []
        diag: list = []
        assert compile_source(lib, "gemv_kq.cu", base, plain)[0] == 0
        rc, log = compile_source(lib, "gemv_kq.cu", base + ("DIAG_NOWAIT_NORM",), diag)
        assert rc == 0, log
        a, b = _entry_bodies(plain[0]), _entry_bodies(diag[0])
        assert set(a) == set(b)
        assert all(("griddepcontrol.wait" in b[n]) == ("griddepcontrol.wait" in a[n]) for n in a)
        assert b != a  # the builds differ (the wait is conditional now)
