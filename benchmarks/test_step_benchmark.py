"""One engine decode step (the captured step graph of EngineBackend, replayed once per round)
on the tiny synthetic "qwen2-tiny-q" model (Q5_0/Q8_0/Q4_0/Q6_K/Q4_K), timed with CUDA
events. Gated on the prefill logits matching the float64 oracle with the engine's KV and
input rounding (the tolerance of tests/test_engine_backend.py). GPU only."""
from __future__ import annotations

import numpy as np
import pytest
from bench_util import WARMUP_ROUNDS, record_figures

from harness.gpu_timing import add_gpu_time, gpu_clock

pytestmark = [pytest.mark.gpu, pytest.mark.benchmark(group="engine decode step", timer=gpu_clock)]
PROMPT = [3, 17, 42, 101, 7, 250, 9, 64]
TOL_Q16, TOL_F32 = 1e-4, 2e-5  # of the logit range; tests/test_engine_backend.py derives them


def _prefill_check(path, eng) -> tuple[dict, np.ndarray]:
    from backends.engine import ops
    from backends.oracle import OracleBackend
    from harness import metrics
    from harness.config import ModelRef, RunConfig
    q16 = ops.GEMV_IMPL == "q16"
    orc = OracleBackend(kv_round="f16", act_round="engine" if q16 else None)
    orc.load(ModelRef(path.stem, path), RunConfig(n_ctx=128))
    orc.prefill(PROMPT)
    ref = orc.last_logits64
    got = np.asarray(eng.prefill(PROMPT))
    c = metrics.compare(ref, got.astype(np.float32))
    bound = (TOL_Q16 if q16 else TOL_F32) * (ref.max() - ref.min())
    return dict(c, ok=bool(c["max_abs"] <= bound), bound=float(bound)), got


def test_engine_decode_step(benchmark, gpu_cp, copy_gbs, slow_factor, rounds, tmp_path_factory):
    from backends.engine import EngineBackend
    from harness.config import ModelRef, RunConfig
    from harness.gpu_timing import EventTimer
    from harness.synth import write_preset
    path = write_preset("qwen2-tiny-q", tmp_path_factory.mktemp("m") / "qwen2-tiny-q.gguf", seed=1)
    eng = EngineBackend()
    eng.load(ModelRef(path.stem, path), RunConfig(n_ctx=128))
    try:
        check, logits = _prefill_check(path, eng)
        benchmark.extra_info["oracle_check"] = check
        if not check["ok"]:
            pytest.fail(f"engine prefill logits differ from the oracle, not timed: {check}")
        timer = EventTimer(eng.stream)  # the hold must block the engine's own stream
        state = np.array([int(np.argmax(logits)), len(PROMPT), 0, 0], np.int32)

        def one_round() -> None:  # same token and position every round (state reset untimed)
            def work():
                for _ in range(slow_factor):
                    eng.step_exec.replay()
            add_gpu_time(timer.time(work, before=lambda: eng.bufs.state.set(state, stream=eng.stream)))
        benchmark.pedantic(one_round, rounds=rounds, warmup_rounds=WARMUP_ROUNDS)
        record_figures(benchmark, eng.info()["bytes_per_step"], copy_gbs, slow_factor)
    finally:
        eng.close()
