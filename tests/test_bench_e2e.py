"""harness.bench_e2e with fake backends: the warm-up repetition is dropped, rows and ratios
follow from the remaining samples, a failing backend is recorded and the others kept."""
from __future__ import annotations

import pytest

from harness.bench_e2e import bench_e2e
from harness.config import ModelRef, RunConfig
from harness.errors import ModelError


class Fake:
    def __init__(self, name, prefill, decode, fail=False):
        self.name, self.prefill, self.decode, self.fail = name, prefill, decode, fail
        self.asked = None

    def load(self, model, cfg):
        if self.fail:
            raise ModelError("does not load")

    def bench(self, prompt, n_decode, reps):
        self.asked = reps
        # first repetition slow (warm-up), then the steady figures
        return {"prefill_s": [10 * self.prefill] + [self.prefill] * (reps - 1),
                "decode_s": [10 * self.decode] + [self.decode] * (reps - 1)}

    def capabilities(self):
        return set()

    def close(self):
        pass


def test_warmup_dropped_and_ratios():
    made = {}

    def create(name):
        made[name] = {"llamacpp": Fake("llamacpp", 0.01, 0.2), "engine": Fake("engine", 0.1, 0.1),
                      "broken": Fake("broken", 1, 1, fail=True)}[name]
        return made[name]
    out = bench_e2e(ModelRef("m", "m.gguf"), 1_000_000, ["llamacpp", "engine", "broken"], [512],
                    list(range(70)), RunConfig(), create, n_decode=128, reps=3, log=lambda m: None)
    assert made["engine"].asked == 4  # reps + the warm-up
    rows = {r["backend"]: r for r in out["rows"]}
    assert rows["engine"]["reps"] == 3 and rows["engine"]["raw"]["decode_s"] == [0.1] * 3
    assert rows["engine"]["decode_tok_s"] == pytest.approx(1280.0)
    assert rows["llamacpp"]["prefill_tok_s"] == pytest.approx(7000.0)
    assert rows["engine"]["decode_tok_s_min"] == rows["engine"]["decode_tok_s_max"]  # no warm-up in the spread
    (ratio,) = out["ratios"]
    assert ratio["decode_ratio"] == pytest.approx(2.0) and ratio["prefill_ratio"] == pytest.approx(0.1)
    assert [e["backend"] for e in out["errors"]] == ["broken"]


def test_wrong_number_of_repetitions_is_an_error():
    class Short(Fake):
        def bench(self, prompt, n_decode, reps):
            return {"prefill_s": [0.1] * reps, "decode_s": [0.1] * (reps - 1)}
    out = bench_e2e(ModelRef("m", "m.gguf"), 1, ["engine"], [512], [1, 2], RunConfig(),
                    lambda n: Short(n, 0, 0), reps=3, log=lambda m: None)
    assert not out["rows"] and "expected 4" in out["errors"][0]["error"]
