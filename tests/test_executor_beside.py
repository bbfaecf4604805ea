"""backends/engine/executor.Executor with `beside` nodes, on a fake cupy (CPU): the order of
launches, stream forks and joins it issues. The GPU side (the same values as the in-line order,
in a captured graph) is tests/test_engine_qwen35.py::test_qkv_beside_is_bitwise_equal_to_split."""
from __future__ import annotations

import sys
import types

import pytest

from backends.engine.executor import Executor


class _Log(list):
    current = None


def _fake_cupy(log: _Log):
    class Stream:
        def __init__(self, name="side", non_blocking=False):
            self.name = name
            log.append(("stream", name))

        def begin_capture(self):
            log.append(("begin_capture", self.name))

        def end_capture(self):
            log.append(("end_capture", self.name))
            return "graph"

        def __enter__(self):
            self._prev, log.current = log.current, self
            return self

        def __exit__(self, *exc):
            log.current = self._prev

        def wait_event(self, ev):
            log.append(("wait", self.name, ev.name))

    class Event:
        n = 0

        def __init__(self, disable_timing=False):
            Event.n += 1
            self.name = ("fork", "join")[(Event.n - 1) % 2]

        def record(self, stream):
            log.append(("record", stream.name, self.name))

    cuda = types.SimpleNamespace(Stream=Stream, Event=Event)
    return types.SimpleNamespace(cuda=cuda), Stream


class _Node:
    def __init__(self, name, log, beside=False, fail=False):
        self.name, self.log, self.beside, self.fail = name, log, beside, fail

    def launch(self, pdl_ok=True):
        if self.fail:
            raise RuntimeError(f"launch of {self.name} failed")
        self.log.append(("launch", self.log.current.name, self.name))


def _executor(monkeypatch, spec):
    log = _Log()
    cp, Stream = _fake_cupy(log)
    monkeypatch.setitem(sys.modules, "cupy", cp)
    main = Stream("main")
    log.clear()
    nodes = [_Node(t[0], log, t[1], len(t) > 2 and t[2]) for t in spec]  # (name, beside[, fail])
    return Executor(nodes, main), log


def _run(monkeypatch, spec):
    ex, log = _executor(monkeypatch, spec)
    ex.run_eager()
    return log


def test_beside_node_forks_before_and_joins_after_the_next_main_node(monkeypatch):
    log = _run(monkeypatch, [("ffn_down", False), ("qkv.q6_k", True), ("qkv.q4_k", False), ("attn", False)])
    assert log[0] == ("stream", "side")  # made once, at the first run
    log = log[1:]
    assert log == [("launch", "main", "ffn_down"),
                   ("record", "main", "fork"), ("wait", "side", "fork"),
                   ("launch", "side", "qkv.q6_k"),
                   ("launch", "main", "qkv.q4_k"),
                   ("record", "side", "join"), ("wait", "main", "join"),
                   ("launch", "main", "attn")]


def test_consecutive_beside_nodes_share_one_fork_and_a_last_one_is_joined(monkeypatch):
    log = _run(monkeypatch, [("a", True), ("b", True), ("c", False), ("d", True)])[1:]
    assert log == [("record", "main", "fork"), ("wait", "side", "fork"),
                   ("launch", "side", "a"), ("launch", "side", "b"),
                   ("launch", "main", "c"), ("record", "side", "join"), ("wait", "main", "join"),
                   ("record", "main", "fork"), ("wait", "side", "fork"), ("launch", "side", "d"),
                   ("record", "side", "join"), ("wait", "main", "join")]


def test_no_beside_node_launches_in_line_without_a_side_stream(monkeypatch):
    ex, log = _executor(monkeypatch, [("a", False), ("b", False)])
    ex.run_eager()
    assert log == [("launch", "main", "a"), ("launch", "main", "b")]
    assert ex._side is None


def test_capture_joins_inside_the_capture(monkeypatch):
    ex, log = _executor(monkeypatch, [("q6", True), ("q4", False), ("attn", False)])
    ex.capture()
    assert ex.graph == "graph"
    assert log[0] == ("begin_capture", "main") and log[-1] == ("end_capture", "main")
    assert log.index(("wait", "main", "join")) < log.index(("launch", "main", "attn"))


def test_a_failed_launch_after_a_fork_rejoins_drops_the_graph_and_raises_its_own_error(monkeypatch):
    ex, log = _executor(monkeypatch, [("q6", True), ("q4", False, True), ("attn", False)])
    with pytest.raises(RuntimeError, match="launch of q4 failed"):
        ex.capture()
    assert ex.graph is None  # a partial step is never replayed
    assert ("wait", "main", "join") in log and log[-1] == ("end_capture", "main")
    assert ("launch", "main", "attn") not in log
