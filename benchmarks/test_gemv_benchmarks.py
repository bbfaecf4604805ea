"""The engine's GEMV kernels on the declared shapes (harness.kernel_shapes.SHAPES), cold back
to back: R distinct weight copies (R x bytes >= 2 GB) launched in one CUDA graph; a round is
one graph replay timed with CUDA events, reported per kernel (graph time / R). Each kernel
is checked against the float64 oracle first and is not timed when it fails; formats the
engine has no kernel for are skipped. GPU only."""
from __future__ import annotations

import numpy as np
import pytest
from bench_util import WARMUP_ROUNDS, record_figures

from harness.gpu_timing import add_gpu_time, capture, gpu_clock
from harness.kernel_shapes import copies_for, table, unsupported_reason

pytestmark = [pytest.mark.gpu, pytest.mark.benchmark(group="gemv cold back-to-back", timer=gpu_clock)]


@pytest.mark.parametrize("shape", table(), ids=lambda s: s.name)
def test_gemv_cold_b2b(benchmark, gpu_cp, timer, copy_gbs, slow_factor, rounds, shape):
    from backends.engine.formats import ENGINE_TYPES
    from harness.kernel_case import GemvCase
    why = unsupported_reason(shape, ENGINE_TYPES)
    if why:
        pytest.skip(f"{shape.fmt}: {why}")
    copies = copies_for(shape.n_mats * shape.matrix_bytes)
    case = GemvCase(shape, copies, seed=0, stream=timer.stream)
    try:
        check = case.check(np.random.default_rng(1))
        benchmark.extra_info.update(shape=shape.spec, copies=copies, oracle_check=check)
        if not check["ok"]:
            pytest.fail(f"{shape.name}: oracle check failed, not timed: {check}")
        s = timer.stream
        graph = capture(s, [n.launch for n in case.nodes for _ in range(slow_factor)])

        def one_round() -> None:  # per-kernel GPU seconds onto gpu_clock
            add_gpu_time(timer.time(lambda: graph.launch(stream=s)) / copies)
        benchmark.pedantic(one_round, rounds=rounds, warmup_rounds=WARMUP_ROUNDS)
        record_figures(benchmark, shape.bytes()["total"], copy_gbs, slow_factor)
        same = case.same_as_checked()
        benchmark.extra_info["same_after_timing"] = same
        assert same, f"{shape.name}: output changed during the timed launches"
    finally:
        case.close()
