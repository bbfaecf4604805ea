"""Machine and software facts recorded in every result (CPU, GPU if any, versions, git)."""
from __future__ import annotations

import hashlib
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

PACKAGES = ("numpy", "gguf", "llama-cpp-python", "matplotlib", "jinja2", "cupy-cuda13x",
            "cupy-cuda12x", "cupy")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def versions() -> dict:
    out = {"python": platform.python_version()}
    for p in PACKAGES:
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            pass
    return out


# The code whose digest a result records (source_digest): the packages that compute and time
SOURCE_DIRS = ("harness", "backends", "oracles")
SOURCE_SUFFIXES = (".py", ".cu", ".cuh", ".h")


def source_digest(root: Path | None = None) -> str | None:
    """SHA256 (hex) over the project's source files: every file under SOURCE_DIRS of `root` (the
    checkout holding this package) ending in SOURCE_SUFFIXES, in sorted relative-path order, each
    as its path, a NUL, its size and its bytes. It names the code that ran where the git metadata
    cannot: a tree copied with a stale or missing .git (a remote GPU machine's copy recorded an
    older commit as clean). None when no such file can be read."""
    root = root or Path(__file__).resolve().parent.parent
    h, n = hashlib.sha256(), 0
    files = sorted(p for d in SOURCE_DIRS for p in (root / d).rglob("*")
                   if p.suffix in SOURCE_SUFFIXES and "__pycache__" not in p.parts and p.is_file())
    for p in files:
        try:
            data = p.read_bytes()
        except OSError:
            continue
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
        n += 1
    return h.hexdigest() if n else None


def git_info(cwd: Path | None = None) -> dict:
    """{'sha': ..., 'dirty': bool, 'source_sha256': ...} of the checkout holding this package: sha
    and dirty None without git; source_sha256 (source_digest) whatever git says."""
    cwd = cwd or Path(__file__).resolve().parent.parent
    src = source_digest(cwd)
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=10).stdout.strip() != ""
        return {"sha": sha, "dirty": dirty, "source_sha256": src}
    except (OSError, subprocess.SubprocessError):
        return {"sha": None, "dirty": None, "source_sha256": src}


def gpu_info() -> dict | None:
    """GPU name, memory, driver, CUDA runtime and clocks through CuPy; None without a GPU."""
    try:
        import cupy as cp  # optional dependency (extra `gpu`)
        if cp.cuda.runtime.getDeviceCount() < 1:
            return None
        dev = cp.cuda.Device()
        props = cp.cuda.runtime.getDeviceProperties(dev.id)
        free, total = cp.cuda.runtime.memGetInfo()
        return {
            "name": props["name"].decode(errors="replace"),
            "cc": f"{props['major']}.{props['minor']}",
            "sms": props["multiProcessorCount"],
            "memory_total_bytes": total, "memory_free_bytes": free,
            "l2_bytes": props.get("l2CacheSize"),
            "clock_khz": props.get("clockRate"), "memory_clock_khz": props.get("memoryClockRate"),
            "driver": cp.cuda.runtime.driverGetVersion(),
            "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
        }
    except Exception:  # no CuPy, no driver, no device: all mean "no GPU" here
        return None


# Environment variables that change what the engine computes or how fast (README "Engine A/B
# switches"; read by backends/engine/ops.py and launch.py). Paths such as GGUF_HARNESS_CACHE
# are not switches and stay out of results.
ENGINE_SWITCHES = ("GGUF_HARNESS_GEMV", "GGUF_HARNESS_GEMV_ARGS", "GGUF_HARNESS_GEMV_KQ", "GGUF_HARNESS_GEMV_KQ_SPLIT",
                   "GGUF_HARNESS_GEMV_KQ_UNROLL", "GGUF_HARNESS_GEMV_KQ2_UNROLL",
                   "GGUF_HARNESS_GEMV_KQ_MINB", "GGUF_HARNESS_GEMV_KQ_MINB_IQ3S", "GGUF_HARNESS_GEMV_KQ_PF", "GGUF_HARNESS_GEMV_KQ_PIPE", "GGUF_HARNESS_GEMV_KQ_MIXED",
                   "GGUF_HARNESS_GEMV_KQ_L1PF", "GGUF_HARNESS_GEMV_KQ_P2", "GGUF_HARNESS_GEMV_KQ_P2_MAX_K", "GGUF_HARNESS_GEMV_KQ_P2_MIN_ROWS", "GGUF_HARNESS_GEMV_KQ_Q0", "GGUF_HARNESS_GEMV_KQ_XLANE", "GGUF_HARNESS_GEMV_IQ4_XIL", "GGUF_HARNESS_GEMV_IQ4_KREG", "GGUF_HARNESS_GEMV_KQ_F32_XPERM", "GGUF_HARNESS_GEMV_KQ_WMAJ", "GGUF_HARNESS_GEMV_KQ_BW", "GGUF_HARNESS_GEMV_KQ_WIDE_MIN_ROWS", "GGUF_HARNESS_GEMV_KQ_CSPLIT", "GGUF_HARNESS_GEMV_KQ_GSPLIT", "GGUF_HARNESS_GEMV_KQ_DQ", "GGUF_HARNESS_GEMV_KQ_DQ_P", "GGUF_HARNESS_GEMV_KQ_DQ_T", "GGUF_HARNESS_GEMV_KQ_DQ_MAP", "GGUF_HARNESS_GEMV_KQ_GS_FENCE", "GGUF_HARNESS_GEMV_KQ_PART_ROT", "GGUF_HARNESS_GEMV_KQ_XPF", "GGUF_HARNESS_GEMV_KQ_PF0", "GGUF_HARNESS_GEMV_KQ_PF0_SB", "GGUF_HARNESS_GEMV_KQ_PRE", "GGUF_HARNESS_GEMV_KQ_CONV", "GGUF_HARNESS_GDN_CSPLIT", "GGUF_HARNESS_GDN_EARLY", "GGUF_HARNESS_GDN_CONV", "GGUF_HARNESS_GEMV_TMA", "GGUF_HARNESS_GEMV_TMA_MIN_K",
                   "GGUF_HARNESS_GEMV_TMA_NST", "GGUF_HARNESS_GEMV_TMA_WARPS", "GGUF_HARNESS_GEMV_TMA_MINB",
                   "GGUF_HARNESS_GEMV_TMA_RING", "GGUF_HARNESS_GEMV_TMA_BPS", "GGUF_HARNESS_GEMV_TMA_RPW",
                   "GGUF_HARNESS_GEMV_MMA", "GGUF_HARNESS_GEMV_MMA_MIN_ROWS", "GGUF_HARNESS_GEMV_MMA_WARPS",
                   "GGUF_HARNESS_GEMV_MMA_UNROLL", "GGUF_HARNESS_GEMV_MMA_MINB",
                   "GGUF_HARNESS_GEMV_TCR", "GGUF_HARNESS_GEMV_TCR_WARPS", "GGUF_HARNESS_GEMV_TCR_UNROLL",
                   "GGUF_HARNESS_GEMV_TCR_MINB", "GGUF_HARNESS_GEMV_TCR_PIPE",
                   "GGUF_HARNESS_GEMV_TCR_GRID",
                   "GGUF_HARNESS_GEMV_KQ_IQ3S", "GGUF_HARNESS_GEMV_KQ_IQ3S_GRID",
                   "GGUF_HARNESS_GEMV_PF", "GGUF_HARNESS_ATTN", "GGUF_HARNESS_ATTN_SINGLE", "GGUF_HARNESS_ATTN_SPLIT_MIN",
                   "GGUF_HARNESS_PDL", "GGUF_HARNESS_DIAG")


def _switches_set() -> dict[str, str]:
    """The ENGINE_SWITCHES set in the environment, as set, but GGUF_HARNESS_DIAG in the one
    spelling of the build it makes (backends/engine/module.diag_canonical: "nostage, nowait" and
    "nowait,nostage" are one build, and `harness ab` compares these values)."""
    out = {k: os.environ[k] for k in ENGINE_SWITCHES if k in os.environ}
    if "GGUF_HARNESS_DIAG" in out:
        from backends.engine.module import diag_canonical
        out["GGUF_HARNESS_DIAG"] = diag_canonical(out["GGUF_HARNESS_DIAG"])
    return out


def machine_info() -> dict:
    """Everything a report needs to say where a result came from."""
    return {
        "hostname": platform.node(),
        "os": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_bytes": _mem_total_bytes(),
        # 1/5/15-minute load averages: timings on a loaded machine are not comparable
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "gpu": gpu_info(),
        "versions": versions(),
        "git": git_info(),
        # the engine's implementation switches (README "Engine A/B switches"): a result taken
        # with GGUF_HARNESS_GEMV=q8_1 or an A/B variant must say so
        "switches": _switches_set(),
    }
