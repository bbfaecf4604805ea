"""`harness synth --jobs N` (harness.synth.parallel_write): N worker processes write the same
bytes as one process, for both architectures and mixed block types; a failing or dying
worker gives a SynthWorkerError and no file; --jobs 0 is refused. CPU only."""
from __future__ import annotations

import dataclasses
import hashlib
import os
from concurrent.futures.process import BrokenProcessPool

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as QT

import harness.synth.parallel_write as pw
from harness.errors import ConfigError
from harness.synth.gguf_stream import TensorPlan, data_offsets, write_gguf_streaming
from harness.synth.presets import write_preset
from harness.synth.qwen2 import Qwen2Shape, TensorStream, make_weights
from harness.synth.qwen2 import plan_tensors as qwen2_plans
from harness.synth.qwen35 import plan_tensors, write_qwen35
from harness.synth.qwen35_presets import mix_for, shape
from harness.synth.synth_rows import Rows

TINY35 = shape("qwen35-tiny")
# token_embd / output of 40010 rows x 256: three rows() chunks of <= 16384 rows each (the last
# one partial, ending in a partial 64-row group), so chunks of one tensor go to different
# workers; output chunks read token_embd rows (next-token structure).
WIDE_VOCAB = dataclasses.replace(TINY35, n_layer=4, n_vocab=40010)


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class _Spy:
    """Wraps parallel_write.write_data: counts calls and records progress."""

    def __init__(self, monkeypatch):
        self.calls, self.progress, real = 0, [], pw.write_data

        def spy(*a, **k):
            self.calls += 1
            return real(*a, **k)
        monkeypatch.setattr(pw, "write_data", spy)


# (architecture, preset, quant, method): qwen2 mixes are fixed (qwen2-tiny-q: Q5_0, Q8_0,
# Q4_0, Q6_K, Q4_K, F32; qwen2-small-k: Q4_K, Q5_K, Q6_K); qwen35 ud-q4_k_m: Q4_K, Q5_K,
# Q6_K, IQ4_XS, IQ3_S, F32 with shared-row and next-token tensors.
CASES = [("qwen2-tiny-q", None, "direct"), ("qwen2-small-k", None, "direct"),
         ("qwen2-tiny-f16", None, "direct"),
         ("qwen35-tiny", "ud-q4_k_m", "direct"), ("qwen35-tiny", "q4_k_m", "quantize"),
         ("qwen35-tiny", "f16", "direct")]


@pytest.mark.parametrize("preset, quant, method", CASES, ids=lambda v: str(v))
def test_jobs_3_same_bytes_as_jobs_1(tmp_path, monkeypatch, preset, quant, method):
    spy = _Spy(monkeypatch)
    seen = []
    kw = dict(seed=4, quant=quant)
    if method != "direct":
        from harness.synth.qwen35_presets import write_qwen35_preset as write
        kw = dict(seed=4, quant=quant, method=method)
        one = write(preset, tmp_path / "one.gguf", jobs=1, **kw)
        three = write(preset, tmp_path / "three.gguf", jobs=3,
                      progress=lambda d, t, n: seen.append((d, t)), **kw)
    else:
        one = write_preset(preset, tmp_path / "one.gguf", jobs=1, **kw)
        three = write_preset(preset, tmp_path / "three.gguf", jobs=3,
                             progress=lambda d, t, n: seen.append((d, t)), **kw)
    assert spy.calls == 1  # only the jobs=3 file went through the workers
    assert _sha(one) == _sha(three)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.gguf", "three.gguf"]
    done = [d for d, _ in seen]
    assert done == sorted(done) and done[-1] == seen[-1][1] > 0  # progress reaches the total


@pytest.mark.parametrize("s, quant", [(dataclasses.replace(TINY35, tied=True, n_nextn=1), "q4_k_m"),
                                     (WIDE_VOCAB, "ud-q4_k_m")], ids=["tied-mtp", "wide-vocab"])
def test_jobs_same_bytes_qwen35_shapes(tmp_path, s, quant):
    mix = mix_for(quant, s.n_layer)
    a = write_qwen35(tmp_path / "a.gguf", s, mix, seed=7, jobs=1)
    b = write_qwen35(tmp_path / "b.gguf", s, mix, seed=7, jobs=3)
    assert _sha(a) == _sha(b)


QWEN2_WIDE_VOCAB = dict(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=40010,
                        n_ctx_train=512)


def test_jobs_same_bytes_qwen2_multi_chunk_tensors(tmp_path):
    from harness.synth.qwen2 import write_qwen2
    mix = {"token_embd.weight": "Q4_K", "output.weight": "Q6_K", "blk.1.*": "Q5_0", "*": "Q8_0"}
    a = write_qwen2(tmp_path / "a.gguf", **QWEN2_WIDE_VOCAB, quant=mix, seed=2, jobs=1)
    b = write_qwen2(tmp_path / "b.gguf", **QWEN2_WIDE_VOCAB, quant=mix, seed=2, jobs=3)
    assert _sha(a) == _sha(b)


def test_work_units_cover_every_byte_once():
    plans35 = plan_tensors(WIDE_VOCAB, "F32")
    plans2 = qwen2_plans(Qwen2Shape(**QWEN2_WIDE_VOCAB), "Q8_0")
    assert plans2[0].n_rows > 2 * plans2[0].chunk_rows  # token_embd: 3 chunks, one unit
    for plans, sequential in ((plans35, False), (plans2, True)):
        offsets = data_offsets(plans, 32)
        units = pw.work_units(plans, offsets)
        assert all(p.sequential == sequential for p in plans)
        covered = {}
        for i, r0, r1, off in units:
            p = plans[i]
            assert off == offsets[i] + r0 * p.row_bytes and 0 <= r0 < r1 <= p.n_rows
            covered[i] = covered.get(i, 0) + (r1 - r0)
        assert covered == {i: p.n_rows for i, p in enumerate(plans)}
        if sequential:
            assert len(units) == len(plans)
        else:  # token_embd and output: 3 chunks each
            assert len(units) == len(plans) + 4


def test_qwen2_stream_any_call_order_matches_make_weights():
    spec = ("blk.0.ffn_up.weight", (64, 300), "matrix", 0.125)
    whole = make_weights(*spec, seed=3)
    rows = TensorStream(spec, QT.F32, seed=3)
    np.testing.assert_array_equal(rows(0, 128), whole[:128])
    np.testing.assert_array_equal(rows(128, 300), whole[128:])
    np.testing.assert_array_equal(rows(64, 192), whole[64:192])  # restart and skip
    np.testing.assert_array_equal(TensorStream(spec, QT.F32, seed=4)(0, 300),
                                  make_weights(*spec, seed=4))


def _bad_plans(i: int):
    """qwen35-tiny F32 plans with tensor i replaced by Q8_0 rows of an rms so small that
    its fp16 scale underflows: random_rows raises ConfigError, in the worker, while writing."""
    plans = plan_tensors(TINY35, "F32")
    p = plans[i]
    bad = Rows((p.name, p.ne, "matrix", 1e-12), QT.Q8_0, 0, "direct")
    return plans[:i] + [TensorPlan(p.name, p.ne, QT.Q8_0, bad)] + plans[i + 1:]


def test_worker_exception_is_named_and_leaves_no_file(tmp_path):
    plans = _bad_plans(5)
    with pytest.raises(pw.SynthWorkerError, match=rf"{plans[5].name}'? rows 0:\d+: "
                       r"ConfigError: std 1e-12 needs a Q8_0 scale") as e:
        write_gguf_streaming(tmp_path / "x.gguf", "qwen35", lambda w: None, plans, jobs=2)
    assert "no file was written" in str(e.value)
    assert not list(tmp_path.iterdir())  # neither x.gguf nor x.gguf.part


class _Die:
    """A picklable row function whose worker process exits without a word."""

    def __call__(self, r0: int, r1: int) -> np.ndarray:
        os._exit(3)


def test_dead_worker_is_reported_and_leaves_no_file(tmp_path):
    plans = plan_tensors(TINY35, "F32")
    p = plans[2]
    plans[2] = TensorPlan(p.name, p.ne, p.qtype, _Die())
    with pytest.raises(pw.SynthWorkerError, match="worker process died"):
        write_gguf_streaming(tmp_path / "x.gguf", "qwen35", lambda w: None, plans, jobs=2)
    assert not list(tmp_path.iterdir())


class _BrokenPool:
    """A ProcessPoolExecutor whose worker died before a unit was queued: submit() raises
    BrokenProcessPool (the race test_dead_worker_is_reported_and_leaves_no_file can hit
    when the dying worker is faster than the queue filling)."""

    def __init__(self, *a, **k):
        pass

    def submit(self, *a, **k):
        raise BrokenProcessPool("A child process terminated abruptly")

    def shutdown(self, *a, **k):
        pass


def test_pool_broken_at_submit_is_reported_and_leaves_no_file(tmp_path, monkeypatch):
    monkeypatch.setattr(pw, "ProcessPoolExecutor", _BrokenPool)
    plans = plan_tensors(TINY35, "F32")
    with pytest.raises(pw.SynthWorkerError, match="worker process died"):
        write_gguf_streaming(tmp_path / "x.gguf", "qwen35", lambda w: None, plans, jobs=2)
    assert not list(tmp_path.iterdir())


def test_unpicklable_rows_refused_before_the_file_is_opened(tmp_path):
    plans = plan_tensors(TINY35, "F32")
    p = plans[1]
    plans[1] = TensorPlan(p.name, p.ne, p.qtype, lambda r0, r1: p.rows(r0, r1))
    with pytest.raises(ConfigError, match="picklable"):
        write_gguf_streaming(tmp_path / "x.gguf", "qwen35", lambda w: None, plans, jobs=2)
    with pytest.raises(ConfigError, match="jobs must be >= 1"):
        write_gguf_streaming(tmp_path / "x.gguf", "qwen35", lambda w: None, plans, jobs=0)
    assert not list(tmp_path.iterdir())


def test_cli_jobs(tmp_path, capsys):
    def said() -> str:  # the console writes to stderr and wraps lines
        return " ".join("".join(capsys.readouterr()).split())
    from harness.cli import main
    from harness.synth_cmd import usable_cpus
    assert usable_cpus() == len(os.sched_getaffinity(0))
    one, two = tmp_path / "one.gguf", tmp_path / "two.gguf"
    for jobs in ("0", "-2"):
        assert main(["synth", "--preset", "qwen35-tiny", "--quant", "iq3_s", "--out", str(one),
                     "--jobs", jobs]) == 2
        assert "--jobs must be >= 1" in said()
    assert not list(tmp_path.iterdir())
    assert main(["synth", "--preset", "qwen35-tiny", "--quant", "iq3_s", "--out", str(one),
                 "--jobs", "1"]) == 0
    assert main(["synth", "--preset", "qwen35-tiny", "--quant", "iq3_s", "--out", str(two),
                 "--jobs", "2"]) == 0
    assert "--jobs 2)" in said()
    assert _sha(one) == _sha(two)
    three = tmp_path / "three.gguf"  # default --jobs (usable CPUs), a qwen2 preset
    assert main(["synth", "--preset", "qwen2-tiny-q", "--out", str(three)]) == 0
    assert f"--jobs {usable_cpus()})" in said()
    assert _sha(three) == _sha(write_preset("qwen2-tiny-q", tmp_path / "ref.gguf", jobs=1))
