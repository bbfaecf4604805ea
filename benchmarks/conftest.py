"""pytest-benchmark set-up of the declared GPU benchmarks (benchmarks/README.md): fixtures that
skip without a GPU, the slow-down knob, and the GPU facts added to pytest-benchmark's
machine_info. Not collected by `make test` (pyproject testpaths = tests)."""
from __future__ import annotations

import os

import pytest
from bench_util import smi_clocks

SLOW_ENV = "GGUF_HARNESS_BENCH_SLOW"      # launches per timed kernel (>= 1), to show a failing compare
ROUNDS_ENV = "GGUF_HARNESS_BENCH_ROUNDS"  # pedantic rounds per benchmark


def _positive_int(env: str, default: int) -> int:
    raw = os.environ.get(env, str(default))
    try:
        v = int(raw)
    except ValueError:
        v = 0
    if v < 1:
        raise pytest.UsageError(f"${env}={raw!r}: expected a whole number >= 1")
    return v


def _llama_cpp() -> dict:
    try:
        from backends.llamacpp.info import build_info
        return build_info()
    except Exception as e:  # not installed or the library does not load
        return {"error": f"{type(e).__name__}: {e}"}


def pytest_benchmark_update_machine_info(config, machine_info):
    """GPU name, driver, CUDA runtime, max clocks and memory (harness.machine.gpu_info, free
    memory left out: it changes between runs and would make every comparison warn), the
    stable nvidia-smi clocks, CuPy, llama.cpp and the other package versions."""
    from harness.machine import gpu_info, versions
    gpu = gpu_info()
    if gpu is not None:
        gpu.pop("memory_free_bytes", None)
    machine_info["gpu"] = gpu
    clocks = smi_clocks("clocks.max.sm,clocks.max.mem,clocks.applications.graphics")
    machine_info["gpu_clocks_mhz"] = clocks
    machine_info["versions"] = versions()
    machine_info["llama_cpp"] = _llama_cpp()


@pytest.fixture(scope="session")
def gpu_cp():
    """The cupy module; skips every benchmark that uses it without CuPy and a GPU."""
    from harness.errors import UnsupportedError
    from harness.gpu import require_cupy
    try:
        return require_cupy()
    except UnsupportedError as e:
        pytest.skip(f"GPU benchmark: {e}")


@pytest.fixture(scope="session")
def copy_gbs(gpu_cp) -> float:
    """Device copy bandwidth (GB/s, read + write; harness.gpu.copy_bandwidth), measured once."""
    from harness.gpu import copy_bandwidth
    return copy_bandwidth()["gb_s"]


@pytest.fixture(scope="session")
def timer(gpu_cp):
    """harness.gpu_timing.EventTimer on a stream of its own."""
    from harness.gpu_timing import EventTimer
    return EventTimer(gpu_cp.cuda.Stream(non_blocking=True))


@pytest.fixture(scope="session")
def slow_factor() -> int:
    """$GGUF_HARNESS_BENCH_SLOW (default 1): every timed kernel is launched this many times,
    so a run with 2 is ~2x slower and `--benchmark-compare-fail=median:5%` must fail."""
    return _positive_int(SLOW_ENV, 1)


@pytest.fixture(scope="session")
def rounds() -> int:
    """Pedantic rounds per benchmark: $GGUF_HARNESS_BENCH_ROUNDS (default 30)."""
    return _positive_int(ROUNDS_ENV, 30)
