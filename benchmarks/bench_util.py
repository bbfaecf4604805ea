"""Helpers of the pytest benchmarks: figures from pytest-benchmark's statistics into
extra_info (the timer is harness.gpu_timing.gpu_clock, so the statistics are GPU seconds)."""
from __future__ import annotations

import subprocess

from harness import bench_stats as bs

WARMUP_ROUNDS = 2
SMI_CLOCKS = "clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,clocks.applications.graphics"


def smi_clocks(fields: str = SMI_CLOCKS) -> dict | None:
    """nvidia-smi's clock readings in MHz (read only; no setting is touched), None when
    nvidia-smi is missing or fails."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=15, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    first = out.strip().splitlines()[0] if out.strip() else ""
    return dict(zip(fields.split(","), (v.strip() for v in first.split(","))))


def record_figures(benchmark, nbytes: int, copy_gbs: float, slow: int) -> None:
    """extra_info += GB/s of nbytes per median time, % of copy bandwidth, slow factor and
    the current clocks; nothing when benchmarks are disabled (no statistics)."""
    st = benchmark.stats
    if not st:
        return
    us = 1e6 * st.stats.median
    g = bs.gb_s(nbytes, us)
    benchmark.extra_info.update(
        bytes=nbytes, median_us=us, gb_s=g, pct_copy=bs.pct(g, copy_gbs), copy_gb_s=copy_gbs,
        slow_factor=slow, timer="CUDA events behind a stream hold (harness.gpu_timing)",
        gpu_clocks_mhz=smi_clocks())
