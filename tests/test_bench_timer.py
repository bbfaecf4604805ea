"""The pytest-benchmark timer of benchmarks/ on the CPU: with `timer=gpu_clock` and a pedantic
target that adds a measured time with add_gpu_time, pytest-benchmark's statistics are exactly
those times (not host time), and `--benchmark-compare-fail=median:5%` fails on a 2x slower
run. The GPU part (the CUDA-event measurement itself) runs in benchmarks/ on a GPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.gpu_timing import add_gpu_time, gpu_clock

ROOT = Path(__file__).resolve().parent.parent
FAKE = '''
import os, time
import pytest
from harness.gpu_timing import add_gpu_time, gpu_clock

TIMES = [float(x) for x in os.environ["FAKE_GPU_TIMES"].split(",")]

@pytest.mark.benchmark(timer=gpu_clock)
def test_fake_kernel(benchmark):
    it = iter(TIMES)
    def one_round():
        time.sleep(0.002)          # host time that must not be measured
        add_gpu_time(next(it))
    benchmark.pedantic(one_round, rounds=len(TIMES))
'''


def test_gpu_clock_accumulates_and_rejects_negative_time():
    t0 = gpu_clock()
    add_gpu_time(0.25)
    assert gpu_clock() - t0 == pytest.approx(0.25)
    with pytest.raises(ValueError):
        add_gpu_time(-1.0)
    with pytest.raises(ValueError):
        add_gpu_time(float("nan"))


def _pytest(tmp_path: Path, times: list[float], *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, FAKE_GPU_TIMES=",".join(map(str, times)),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), "-c", str(tmp_path / "pytest.ini"),
                           str(tmp_path / "test_fake.py"), "--benchmark-only",
                           f"--benchmark-storage=file://{tmp_path / 'store'}", *args],
                          capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path,
                          check=False)


def test_pedantic_statistics_are_the_added_gpu_times_and_compare_fails_when_slower(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_fake.py").write_text(FAKE)
    base = [1e-3, 2e-3, 3e-3, 2e-3, 2e-3]
    r = _pytest(tmp_path, base, "--benchmark-autosave", f"--benchmark-json={tmp_path / 'a.json'}")
    assert r.returncode == 0, r.stdout + r.stderr
    (b,) = json.loads((tmp_path / "a.json").read_text())["benchmarks"]
    assert b["options"]["timer"].endswith("gpu_clock")  # pytest-benchmark stores the name
    st = b["stats"]  # the 2 ms of host sleep per round are not in them
    assert (st["min"], st["median"], st["max"]) == pytest.approx((1e-3, 2e-3, 3e-3))
    assert st["rounds"] == len(base)
    same = _pytest(tmp_path, base, "--benchmark-compare", "--benchmark-compare-fail=median:5%")
    assert same.returncode == 0, same.stdout + same.stderr
    slow = _pytest(tmp_path, [2 * t for t in base], "--benchmark-compare",
                   "--benchmark-compare-fail=median:5%")
    assert slow.returncode != 0 and "regressed" in (slow.stdout + slow.stderr).lower()
