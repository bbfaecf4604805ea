"""backends.proc: objects in a child process; crashes, errors and timeouts become exceptions.

The helper classes below are the child-side targets (imported in the child by module name).
"""
from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from backends.base import Backend
from backends.proc import BackendProxy, ChildProxy, exit_description
from harness.errors import BackendCrash, ConfigError, ModelError

HERE = __name__  # module name as the test runner imported it; the child imports the same


class Worker:
    """Well-behaved and misbehaving methods, one per failure mode."""

    name = "worker"

    def __init__(self, scale: float = 2.0, close_marker: str | None = None) -> None:
        self.scale = scale
        self.close_marker = close_marker

    def getpid(self) -> int:
        return os.getpid()

    def scaled(self, arr: np.ndarray) -> np.ndarray:
        return arr * self.scale

    def echo(self, value):
        return value

    def raise_model_error(self, text: str) -> None:
        raise ModelError(text)

    def divide_by_zero(self) -> float:
        return 1 / 0

    def segfault(self) -> None:
        os.kill(os.getpid(), signal.SIGSEGV)

    def abort(self, note: str) -> None:
        sys.stderr.write(note + "\n")
        sys.stderr.flush()
        os.abort()

    def exit_hard(self, code: int) -> None:
        os._exit(code)

    def sleep(self, seconds: float) -> str:
        time.sleep(seconds)
        return "woke"

    def unpicklable(self):
        return lambda: None

    def close(self) -> None:
        if self.close_marker:
            with open(self.close_marker, "w") as f:
                f.write("closed")


class FailingInit:
    def __init__(self, path: str) -> None:
        raise ModelError(f"cannot open {path}")


class FakeBackend:
    """Minimal Backend: logits are a one-hot of (sum of fed tokens) mod 7."""

    name = "fake"

    def __init__(self) -> None:
        self.total = 0

    def load(self, model, cfg) -> None:
        self.total = 0

    def reset(self) -> None:
        self.total = 0

    def prefill(self, tokens):
        self.total += sum(tokens)
        return np.eye(7, dtype=np.float32)[self.total % 7]

    def step(self, token):
        return self.prefill([token])

    def capabilities(self):
        return {"timings"}

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def worker():
    proxy = ChildProxy(f"{HERE}:Worker", {"scale": 3.0}, call_timeout_s=30)
    yield proxy
    proxy.shutdown()


def test_runs_in_another_process_and_moves_arrays(worker):
    assert worker.getpid() != os.getpid()
    assert worker.child_info["pid"] == worker.pid
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = worker.scaled(arr)
    assert out.dtype == np.float32 and out.shape == (3, 4)
    np.testing.assert_array_equal(out, np.arange(12, dtype=np.float32).reshape(3, 4) * 3)


@settings(max_examples=25, deadline=None)
@given(hnp.arrays(dtype=st.sampled_from([np.float32, np.float64, np.int64, np.uint8, np.float16]),
                  shape=hnp.array_shapes(min_dims=0, max_dims=3, max_side=9)))
def test_arrays_survive_the_round_trip(worker, arr):
    out = worker.echo(arr)
    assert out.dtype == arr.dtype and out.shape == arr.shape
    np.testing.assert_array_equal(out, arr)  # NaN-aware: NaN == NaN at the same place


def test_harness_error_keeps_its_class_and_the_child_lives(worker):
    with pytest.raises(ModelError, match="tensor blk.0.attn_q.weight is short") as info:
        worker.raise_model_error("tensor blk.0.attn_q.weight is short")
    assert "raise_model_error" in info.value.child_traceback
    assert worker.echo(5) == 5 and worker.alive


def test_other_exceptions_become_backend_crash(worker):
    with pytest.raises(BackendCrash, match="ZeroDivisionError"):
        worker.divide_by_zero()
    with pytest.raises(BackendCrash, match="pickle|Pickl"):
        worker.unpicklable()
    assert worker.echo("still here") == "still here"


def test_private_names_are_not_served(worker):
    with pytest.raises(AttributeError):
        worker._conn_missing  # noqa: B018 - attribute access is the test
    with pytest.raises(BackendCrash, match="private"):
        worker.call("__init__")


def test_segfault_names_the_signal_and_spares_other_children(worker):
    victim = ChildProxy(f"{HERE}:Worker", call_timeout_s=30, label="victim")
    with pytest.raises(BackendCrash, match="SIGSEGV") as info:
        victim.segfault()
    assert info.value.signal == "SIGSEGV" and info.value.exitcode == -signal.SIGSEGV
    assert "victim" in str(info.value)
    assert "Segmentation fault" in info.value.stderr_tail  # faulthandler's report
    assert not victim.alive
    with pytest.raises(BackendCrash, match="gone"):
        victim.echo(1)
    victim.shutdown()
    assert worker.echo(7) == 7  # the shared child is unaffected


def test_abort_is_reported_with_the_child_stderr():
    with ChildProxy(f"{HERE}:Worker", call_timeout_s=30) as p:
        with pytest.raises(BackendCrash, match="SIGABRT") as info:
            p.abort("GGML_ASSERT(fake) failed")
        assert "GGML_ASSERT(fake) failed" in str(info.value)


def test_abort_names_its_cause_even_behind_a_long_backtrace():
    """libggml prints its GGML_ASSERT and then a debugger backtrace longer than the stderr tail
    the message quotes: the assertion must still be in the error's first line."""
    with ChildProxy(f"{HERE}:Worker", call_timeout_s=30) as p:
        frames = "".join(f"#{i} 0x00007f00deadbeef in frame_{i} () from libggml-base.so error\n" for i in range(200))
        with pytest.raises(BackendCrash, match="SIGABRT") as info:
            p.abort("llama.cpp/src/llama-model.cpp:42: GGML_ASSERT(hparams.n_layer > 0) failed\n" + frames)
        first = str(info.value).splitlines()[0]
        assert "GGML_ASSERT(hparams.n_layer > 0) failed" in first, first
        assert len(frames) > 4000  # the assertion left the quoted tail


def test_plain_exit_code_is_reported():
    with ChildProxy(f"{HERE}:Worker", call_timeout_s=30) as p:
        with pytest.raises(BackendCrash, match="exit code 3") as info:
            p.exit_hard(3)
        assert info.value.exitcode == 3 and info.value.signal is None


def test_timeout_kills_the_child_quickly():
    p = ChildProxy(f"{HERE}:Worker", call_timeout_s=30)
    assert p.call("sleep", (0.01,), timeout_s=10) == "woke"
    t0 = time.monotonic()
    with pytest.raises(BackendCrash, match="timed out after 0.5 s"):
        p.call("sleep", (60,), timeout_s=0.5)
    assert time.monotonic() - t0 < 10
    assert not p.alive and p.exitcode == -signal.SIGKILL
    p.shutdown()


def test_constructor_errors_reach_the_parent():
    with pytest.raises(ModelError, match="cannot open /nowhere.gguf"):
        ChildProxy(f"{HERE}:FailingInit", {"path": "/nowhere.gguf"})
    with pytest.raises(BackendCrash, match="ModuleNotFoundError"):
        ChildProxy("no_such_module_xyz:Thing")


def test_shutdown_calls_close_in_the_child(tmp_path):
    marker = tmp_path / "closed.txt"
    p = ChildProxy(f"{HERE}:Worker", {"close_marker": str(marker)})
    pid = p.pid
    p.shutdown()
    assert marker.read_text() == "closed"
    assert p.exitcode == 0 and not p.alive
    assert not os.path.exists(p.stderr_path)
    with pytest.raises(OSError):
        os.kill(pid, 0)  # reaped, gone
    p.shutdown()  # idempotent


def test_backend_proxy_implements_the_protocol():
    with BackendProxy(f"{HERE}:FakeBackend") as b:
        assert isinstance(b, Backend) and b.name == "fake"
        b.load(None, None)
        np.testing.assert_array_equal(b.prefill([1, 2]), np.eye(7, dtype=np.float32)[3])
        np.testing.assert_array_equal(b.step(np.int64(5)), np.eye(7, dtype=np.float32)[1])
        b.reset()
        assert b.step(6).argmax() == 6
        assert b.capabilities() == {"timings"}


def test_exit_description():
    assert exit_description(-int(signal.SIGSEGV)) == (
        f"signal SIGSEGV (exit code {-int(signal.SIGSEGV)})", "SIGSEGV")
    assert exit_description(2) == ("exit code 2", None)


def test_registry_rejects_unknown_names():
    from backends.registry import available_backends, create

    names = available_backends()
    assert {"llamacpp", "oracle", "engine"} <= set(names)
    with pytest.raises(ConfigError, match="unknown backend 'nope'"):
        create("nope", in_child=True)
