"""Compile every engine kernel module ahead of use, several NVRTC compiles at once.

CuPy compiles a RawModule on first use, one after another, and keeps the result in its
on-disk kernel cache (CUPY_CACHE_DIR, keyed by code string and options: module.py). gemv.cu
alone takes 60-110 s per build (docs/perf-notes.md) and there are eight builds of it (q16 /
q8_1 x plain / _iq4, and q16 with a shorter L2 prefetch distance, ops.pf_ahead), so a fresh
machine or an edited kernel header costs minutes of serial compiles inside the first run or
test. Here each build compiles in its own process
(spawned: no CUDA context is shared), so the wall time is about the slowest build; later
processes find every module in the cache.

    harness prewarm [--jobs N] [--only gemv] [--list]     (harness/prewarm_cmd.py)
    python -m backends.engine.prewarm [--jobs N] [--only gemv]

Prints one line per build (seconds, ok or the compile error's first line); exit status 1 if
any build failed, 2 without a GPU (CuPy needs a device to compile for its architecture) or on a
bad engine switch value. `python -m backends.engine.prewarm` is `harness prewarm`.
"""
from __future__ import annotations

import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

from . import ops

# (source, defines, one kernel it defines): get_function forces the compile. Defines in the
# order the engine passes them (ops.gemv_kernel), or the cache key differs.
# None: the defines the engine passes under this environment, resolved at run time (builds()).
WIDE = ("<the wide v9 build>",)  # resolved in builds()
CSPLIT = ("<the cluster-split v9 build>",)  # likewise
DQ = ("<the queue v9 build>",)  # likewise
BUILDS: tuple[tuple[str, tuple[str, ...] | None, str], ...] = (
    ("gemv.cu", (), "gemv_store_w1_b4"),
    ("gemv.cu", ("GEMV_IQ4",), "gemv_store_w1_b4_iq4"),
    ("gemv.cu", ("ACT_Q8_1",), "gemv_store_w1_b4"),
    ("gemv.cu", ("ACT_Q8_1", "GEMV_IQ4"), "gemv_store_w1_b4_iq4"),
    # shorter L2 prefetch distances for nodes with large grid strides (ops.pf_ahead)
    ("gemv.cu", ("PF_AHEAD=0",), "gemv_store_w1_b4"),
    ("gemv.cu", ("PF_AHEAD=1",), "gemv_store_w1_b4"),
    ("gemv.cu", ("GEMV_IQ4", "PF_AHEAD=0"), "gemv_store_w1_b4_iq4"),
    ("gemv.cu", ("GEMV_IQ4", "PF_AHEAD=1"), "gemv_store_w1_b4_iq4"),
    ("gemv_f32.cu", (), "gemvf_store_w1"),
    ("attention.cu", (), "attn_decode"),
    ("attention_gqa.cu", (), "attn_gqa_d128"),
    ("attention_head.cu", (), "attn_head_d128"),
    ("misc.cu", (), "embed_row"),
    ("attention_gated.cu", (), "attn_gated_d128"),
    ("deltanet.cu", (), "gdn_step_s128_r8"),
    # engine v9 (the default GGUF_HARNESS_GEMV_KQ=v9l8): one build holds every v9 kernel, the
    # IQ3_S ones (GGUF_HARNESS_GEMV_KQ_IQ3S, default on) included; with the defines the engine
    # passes under this environment (ops.kv9_defines: ("KQ_P2=1",) by default since P2 for q6_k
    # became the default in session 12; until session 14 this entry had none, a build the engine
    # never used); the grid A/B builds (GGUF_HARNESS_GEMV_KQ_IQ3S_GRID) compile at first use
    ("gemv_kq.cu", None, "gemvkq_store_q4_k"),
    # its wide build (32 warps per block, warp-major rows; ops.kv9_wide_defines) for the split-1
    # nodes of >= GGUF_HARNESS_GEMV_KQ_WIDE_MIN_ROWS rows (default 8192 since session 15)
    ("gemv_kq.cu", WIDE, "gemvkq_store_q4_k"),
    # the cluster-split build (ops.kv9_csplit) while GGUF_HARNESS_GEMV_KQ_CSPLIT is on (the default)
    ("gemv_kq.cu", CSPLIT, "gemvkq_store_q4_k_c4"),
    # the queue build of the wide nodes (ops.kv9_dq) while GGUF_HARNESS_GEMV_KQ_DQ=1
    ("gemv_kq.cu", DQ, "gemvkq_store_q4_k"),
)


def builds() -> list[tuple[str, tuple[str, ...], str]]:
    """BUILDS with the engine's v9 defines filled in (ops.kv9_defines(); the wide entry as
    ops.kv9_wide_defines of those, left out under GGUF_HARNESS_GEMV_KQ_WIDE_MIN_ROWS=off; the
    cluster-split build(s) while GGUF_HARNESS_GEMV_KQ_CSPLIT is on, the queue build while
    GGUF_HARNESS_GEMV_KQ_DQ=1 and wide nodes are on; ValueError
    on a bad GGUF_HARNESS_GEMV_KQ_* / IQ4_* switch value)."""
    out = []
    for src, d, name in BUILDS:
        if d is WIDE:
            if ops.kv9_wide(1 << 30, 1):  # some node could take it
                out.append((src, ops.kv9_wide_defines(ops.kv9_defines()), name))
        elif d is CSPLIT:
            # the switch is on and the 8-lane kernels run (GGUF_HARNESS_GEMV_KQ=v9 puts Q4_K / Q5_K
            # on the 4-lane ones, which have no cluster form)
            # one build per part count a node can get (GGUF_HARNESS_GEMV_KQ_GSPLIT=4 makes groups of 2
            # and 4 different builds)
            if ops.GEMV_KQ == "v9l8":
                for cs in sorted({int(c[-1]) for c in (ops.kv9_csplit(f"gemvkq_store_q4_k_s{s}", "store", s, False)
                                                       for s in (2, 4)) if c}):
                    if (src, defs := ops.kv9_csplit_defines(ops.kv9_defines(), cs), name) not in out:
                        out.append((src, defs, name))
        elif d is DQ:
            if ops.kv9_wide(1 << 30, 1) and ops.kv9_dq("gemvkq_swiglu_iq4_xs"):
                out.append((src, ops.kv9_dq_defines(ops.kv9_wide_defines(ops.kv9_defines())), name))
        else:
            out.append((src, ops.kv9_defines() if d is None else d, name))
    return out


def label(build: tuple[str, tuple[str, ...], str]) -> str:
    """"source -Ddefine ..." of a builds() entry (the compile lines, `harness prewarm --list`)."""
    source, defines, _ = build
    return source + "".join(f" -D{d}" for d in defines)


def _compile(build: tuple[str, tuple[str, ...], str]) -> tuple[str, float, str]:
    """Child process: compile one build; (label, seconds, "ok" or the error's first line)."""
    from . import module
    source, defines, name = build
    text = label(build)
    t0 = time.perf_counter()
    try:
        module.kernel_in(source, name, defines)
        status = "ok"
    except Exception as e:  # a compile error names the build; the others still run
        status = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    return text, time.perf_counter() - t0, status


def compile_builds(todo, jobs: int, log=print) -> int:
    """Compile `todo` (builds() entries) in up to `jobs` spawned processes, one line per build
    through `log` as each finishes in order ("<s> s  <source -Ddefines>: ok" or the compile
    error's first line), then a summary line; returns the number that failed. Needs CuPy and a
    GPU in the children (the caller checks: harness.gpu.require_cupy)."""
    t0 = time.perf_counter()
    failed = 0
    with ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=get_context("spawn")) as ex:
        for label, secs, status in ex.map(_compile, todo):
            failed += status != "ok"
            log(f"{secs:7.1f} s  {label}: {status}")
    log(f"prewarm: {len(todo)} builds, {failed} failed, {time.perf_counter() - t0:.1f} s wall")
    return failed


def main(argv: list[str] | None = None) -> int:
    """`python -m backends.engine.prewarm [ARGS]`: `harness prewarm [ARGS]` (harness/prewarm_cmd.py)."""
    from harness import cli
    return cli.main(["prewarm", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
