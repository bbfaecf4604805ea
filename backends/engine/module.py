"""Compiles the engine's .cu files with cupy.RawModule (NVRTC, for the current device's
architecture) once per process and hands out kernels by name. Sources that read GGUF blocks
(they include dequant.cuh) are compiled behind the generated I-quant tables
(iq_tables.header()); every source behind a digest of the kernel headers: CuPy keys its
on-disk kernel cache by the code string and options, not by included files, so both must be
in the code for an edit of a table or a .cuh file to recompile."""
from __future__ import annotations

import hashlib
import os
import re
from functools import lru_cache
from pathlib import Path

KERNEL_DIR = Path(__file__).with_name("kernels")
SOURCES = ("gemv.cu", "gemv_f32.cu", "attention.cu", "attention_gqa.cu", "attention_head.cu", "misc.cu")
SMEM_DEFAULT_MAX = 48 * 1024  # dynamic shared memory above this needs an opt-in attribute


# A/B knob: rows prefetched to L2 ahead of use by the q16/q8_1 GEMV (kernels/gemv.cu PF_AHEAD,
# default 2 there): GGUF_HARNESS_GEMV_PF=0..4 builds gemv.cu with -DPF_AHEAD=N (its own CuPy
# cache entry). Why a knob: ncu on the H200 (docs/perf-notes.md, session 7) read 1.9x the output
# head's weight bytes from DRAM at PF_AHEAD=2: lines prefetched two grid strides ahead (~44 MB
# for that head) are evicted before their loads arrive.
GEMV_PF = os.environ.get("GGUF_HARNESS_GEMV_PF", "")


def gemv_pf_defines(value: str | None = None) -> tuple[str, ...]:
    """("PF_AHEAD=N",) for GGUF_HARNESS_GEMV_PF=N (0..4) (value None: this module's GEMV_PF,
    read at call time), () when unset; ValueError else."""
    value = GEMV_PF if value is None else value
    if value == "":
        return ()
    if not (value.isdigit() and 0 <= int(value) <= 4):
        raise ValueError(f"GGUF_HARNESS_GEMV_PF={value!r}: expected an integer 0..4")
    return (f"PF_AHEAD={int(value)}",)


def switch_defines(switches) -> tuple[str, ...]:
    """("DEFINE=N", ..) of an A/B build's integer switches: `switches` holds (env name, its value
    as read, define, allowed ints) per switch; an unset ("") one is left out (the kernel's default).
    Raises ValueError naming the variable on a value outside `allowed`."""
    out = []
    for env, val, define, ok in switches:
        if not val:
            continue
        if not val.isdigit() or int(val) not in ok:
            raise ValueError(f"{env}={val!r}: expected one of {', '.join(map(str, ok))}")
        out.append(f"{define}={int(val)}")
    return tuple(out)


# Diagnostic builds (timing only: their outputs are wrong by design), to measure what a cost is worth
# before building the change that would remove it. GGUF_HARNESS_DIAG is a comma list of
#   nowait   every engine kernel skips its PDL wait (common.cuh pdl_wait): each node starts on
#            whatever its input holds as soon as its blocks are resident, so the step time bounds
#            what any finer dependency between nodes (flags per chunk of x, a fused step) could gain;
#   nostage  the GEMVs skip staging x (xstage.cuh stage_xq: no loads of x or the norm, no scales
#            or codes written, no barrier beyond one): bounds what faster staging could gain;
#   nowait_c4, nowait_c2
#            only the cluster-split GEMVs of 4 (2) parts skip their PDL wait (gemv_kq.cu kq_body; the
#            27B's ffn_down after its gate/up pair, resp. ssm_out / attn_output): bounds what
#            per-chunk readiness flags between those consumers and their producers could gain.
#            Added to the KQ_CSPLIT build of gemv_kq.cu only, so no other module recompiles;
#   nowait_norm
#            only the v9 GEMVs with a fused RMSNorm skip their PDL wait (gate/up, ssm_in, qkv, the
#            head): bounds what staging x chunk by chunk in those consumers could gain. Added to
#            gemv_kq.cu's builds only.
# The rooflines' sources (ROOFLINE_SOURCES) are built without them. Only `harness bench nodes` and
# `harness bench kernels` run them (the engine refuses them elsewhere: backend.EngineBackend); the
# engine does not raise on their non-finite logits; results record the switch (harness.machine).
DIAG_DEFINES = {"nowait": "DIAG_NOWAIT", "nostage": "DIAG_NOSTAGE", "nowait_c4": "DIAG_NOWAIT_C4",
                "nowait_c2": "DIAG_NOWAIT_C2", "nowait_norm": "DIAG_NOWAIT_NORM"}
# defines that only some builds read, so no other module recompiles: define -> (source, defines) -> bool
_DIAG_ONLY_IN = {"DIAG_NOWAIT_C4": lambda src, d: src == "gemv_kq.cu" and "KQ_CSPLIT=1" in d,
                 "DIAG_NOWAIT_C2": lambda src, d: src == "gemv_kq.cu" and "KQ_CSPLIT=1" in d,
                 "DIAG_NOWAIT_NORM": lambda src, d: src == "gemv_kq.cu"}


def _diag_words(value: str) -> list[str] | None:
    """The DIAG_DEFINES words of a GGUF_HARNESS_DIAG value in their fixed order, None when it
    holds another word."""
    words = {w.strip() for w in value.split(",")} - {""}
    return [w for w in DIAG_DEFINES if w in words] if words <= set(DIAG_DEFINES) else None


def diag_canonical(value: str) -> str:
    """GGUF_HARNESS_DIAG in one spelling: its known words in DIAG_DEFINES' order, comma-joined
    ("nostage, nowait" -> "nowait,nostage"; "" or "," -> ""), so results record what the build
    is; a value with another word is returned as it is (diag_defines refuses it)."""
    words = _diag_words(value)
    return value if words is None else ",".join(words)


DIAG = diag_canonical(os.environ.get("GGUF_HARNESS_DIAG", ""))


def diag_defines(value: str | None = None) -> tuple[str, ...]:
    """The preprocessor defines of GGUF_HARNESS_DIAG (value None: this module's DIAG, read at
    call time): ("DIAG_NOWAIT",) for "nowait", both for "nowait,nostage"; () when unset.
    Raises ValueError on another word (words are lower case)."""
    value = DIAG if value is None else value
    words = _diag_words(value)
    if words is None:
        raise ValueError(f"GGUF_HARNESS_DIAG={value!r}: expected a comma list of {', '.join(DIAG_DEFINES)}")
    return tuple(DIAG_DEFINES[w] for w in words)


# the rooflines' sources (harness/roofline.py, harness/step_roofline.py): never a diagnostic build,
# their dependency and reads are what they measure
ROOFLINE_SOURCES = frozenset({"stream_read.cu", "stream_chain.cu"})


def _module(source: str, defines: tuple[str, ...] = ()):
    """The module of kernels/<source> built with `defines`, plus gemv.cu's GGUF_HARNESS_GEMV_PF
    build and GGUF_HARNESS_DIAG's defines (not for ROOFLINE_SOURCES); one compile per process and
    resulting set of defines (_module_for's cache)."""
    if source == "gemv.cu" and not any(d.startswith("PF_AHEAD=") for d in defines):
        defines = tuple(defines) + gemv_pf_defines()  # ops.pf_ahead's own choice wins
    if source not in ROOFLINE_SOURCES:
        defines = tuple(defines) + tuple(d for d in diag_defines()
                                         if d not in defines and _DIAG_ONLY_IN.get(d, lambda *_: True)(source, defines))
    return _module_for(source, tuple(defines))  # one cache key per (source, defines)


@lru_cache(maxsize=None)
def _module_for(source: str, defines: tuple[str, ...]):
    import cupy as cp
    opts = ("--std=c++17", f"-I{KERNEL_DIR}") + tuple(f"-D{d}" for d in defines)
    return cp.RawModule(code=source_code(source), options=opts)


def source_code(source: str) -> str:
    """The code string NVRTC compiles for kernels/<source> (see the module docstring)."""
    from .iq_tables import header
    text = (KERNEL_DIR / source).read_text()
    tables = header() if re.search(r'#include "(dequant|qdot)\.cuh"', text) else ""
    return tables + f"// kernel headers sha256 {_headers_digest()}\n" + f'#line 1 "{source}"\n' + text


@lru_cache(maxsize=None)
def _headers_digest() -> str:
    h = hashlib.sha256()
    for p in sorted(KERNEL_DIR.glob("*.cuh")):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


@lru_cache(maxsize=None)
def kernel(name: str):
    """The RawKernel `name` from whichever source defines it (KeyError if none does)."""
    # GEMV kernels are instantiated by a GEMV_KERNEL macro: no literal name to search for
    if name.startswith(("gemv_", "gemvp_")):  # the _iq4 ones: the -DGEMV_IQ4 build (ops.gemv_kernel)
        return _module("gemv.cu", ("GEMV_IQ4",) if name.endswith("_iq4") else ()).get_function(name)
    if name.startswith("gemvf_"):
        return _module("gemv_f32.cu").get_function(name)
    if name.startswith("attn_gqa_d"):  # GQA_KERNEL macro, one per head dim
        return _module("attention_gqa.cu").get_function(name)
    if name.startswith("attn_head_d"):  # HEAD_KERNEL macro, one per head dim
        return _module("attention_head.cu").get_function(name)
    for src in SOURCES:
        if re.search(rf"\b{re.escape(name)}\(", (KERNEL_DIR / src).read_text()):
            return _module(src).get_function(name)
    raise KeyError(f"no engine kernel named {name!r}")


def kernel_in(source: str, name: str, defines: tuple[str, ...] = ()):
    """The RawKernel `name` of kernels/<source>, compiled once per process and set of
    preprocessor `defines` (e.g. ("ACT_Q8_1",) for gemv.cu's llama.cpp-compatible rounding;
    sources outside SOURCES, e.g. the qwen35 kernels, name their file; AttributeError-free:
    CuPy raises its own error if the source has no such kernel)."""
    return _module(source, defines).get_function(name)


def static_smem(k) -> int:
    """Bytes of static shared memory of kernel `k` (e.g. gemv_kq.cu's IQ3_S grid copies,
    kernels/kwide_iq3s.cuh, 2-33 KiB); 0 when the object does not say (test doubles)."""
    return int(getattr(k, "shared_size_bytes", 0) or 0)


def allow_smem(k, nbytes: int) -> None:
    """Opt a kernel in to `nbytes` of dynamic shared memory when that and its static shared
    memory (static_smem) together exceed the 48 KiB default."""
    static = static_smem(k)
    if nbytes + static > SMEM_DEFAULT_MAX and k.max_dynamic_shared_size_bytes < nbytes:
        k.max_dynamic_shared_size_bytes = nbytes


@lru_cache(maxsize=None)
def sm_count() -> int:
    """Streaming multiprocessors of the current device (grid sizing)."""
    import cupy as cp
    return int(cp.cuda.Device().attributes["MultiProcessorCount"])


@lru_cache(maxsize=None)
def smem_optin() -> int:
    """Most shared memory (bytes) one block may opt in to on the current device (227 KiB on
    sm_90: cudaDevAttrMaxSharedMemoryPerBlockOptin)."""
    import cupy as cp
    return int(cp.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"])


def blocks_per_sm(k, threads: int, smem: int) -> int:
    """Resident blocks of kernel `k` per SM at this block size and dynamic shared memory
    (cuOccupancyMaxActiveBlocksPerMultiprocessor: registers, shared memory, thread limits)."""
    from cupy_backends.cuda.api import driver
    return max(1, int(driver.occupancyMaxActiveBlocksPerMultiprocessor(k.kernel.ptr, threads, smem)))



def max_active_clusters(k, cluster: int, threads: int, smem: int) -> int:
    """Co-resident clusters of `cluster` blocks of kernel `k` (compiled with __cluster_dims__)
    on the current device (launch.max_active_clusters: cuOccupancyMaxActiveClusters; blocks of a
    cluster share a GPC). Where the driver cannot answer (no libcuda, an old driver), the blocks
    per SM x SMs // cluster, an upper bound."""
    from .launch import max_active_clusters as query
    try:
        return query(k, cluster, threads, smem)
    except (OSError, AttributeError, RuntimeError):
        return blocks_per_sm(k, threads, smem) * sm_count() // cluster
