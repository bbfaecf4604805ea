"""A decode step as a list of nodes, run eagerly (debug, per-node timing, finite checks) or
captured once into a CUDA graph and replayed (token id and position live in device memory)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import launch as pdl


@dataclass
class Node:
    """One kernel launch. bytes: bytes it reads + writes (for GB/s); flops: multiply-adds x 2;
    out: the device array it produces (finite checks, captures); fmt: GGML types it reads."""

    name: str
    kind: str
    kernel: Any
    grid: tuple
    block: tuple
    args: tuple
    smem: int = 0
    bytes: int = 0
    flops: int = 0
    out: Any = None
    fmt: str = ""
    keep: list = field(default_factory=list)  # device arrays the args point into (lifetime)
    defines: tuple = ()  # preprocessor defines of the kernel's build (v9 GEMVs: ops.gemv's kdefs; v12: tcr_defines)
    # runs on a side stream beside the next node that is not `beside` (both after the node before
    # them); the node after that one waits for both (ops.gemv_nodes "beside": qkv's Q6_K rows)
    beside: bool = False
    _pdl: Any = field(default=None, init=False, repr=False, compare=False)

    def launch(self, pdl_ok: bool = True) -> None:
        """Launch on the current cupy stream; with programmatic dependent launch (launch.py)
        when pdl_ok and launch.pdl_available(), else through CuPy's plain launch."""
        if pdl_ok and pdl.pdl_available():
            import cupy as cp
            if self._pdl is None:
                self._pdl = pdl.PdlLaunch(self.kernel, self.grid, self.block, self.args, self.smem)
            self._pdl(cp.cuda.get_current_stream().ptr)
        else:
            self.kernel(self.grid, self.block, self.args, shared_mem=self.smem)


class Executor:
    """Runs `nodes` on `stream` (a cupy Stream); `capture()` builds the CUDA graph once.
    Nodes marked `beside` run on a second stream (a fork from the main stream before them, a
    join after the main node beside them), in eager runs and in the graph alike; the per-node
    timings and first_nonfinite run every node in list order on the main stream."""

    def __init__(self, nodes: list[Node], stream):
        self.nodes, self.stream, self.graph = nodes, stream, None
        self._side = self._fork = self._join = None

    def _launch_all(self) -> None:
        """Launch every node on self.stream (current), `beside` nodes on the side stream:
        fork event recorded on the main stream, waited for by the side stream; the side's join
        event waited for by the main stream right after the next main node's launch."""
        if not any(n.beside for n in self.nodes):
            for n in self.nodes:
                n.launch()
            return
        import cupy as cp
        if self._side is None:
            self._side = cp.cuda.Stream(non_blocking=True)
            self._fork, self._join = cp.cuda.Event(disable_timing=True), cp.cuda.Event(disable_timing=True)
        pending = False  # a side launch the main stream has not joined yet
        try:
            for n in self.nodes:
                if n.beside:
                    if not pending:
                        self._fork.record(self.stream)
                        self._side.wait_event(self._fork)
                    with self._side:
                        n.launch()
                    pending = True
                else:
                    n.launch()
                    if pending:
                        self._join.record(self._side)
                        self.stream.wait_event(self._join)
                        pending = False
        finally:
            if pending:  # a side launch last, or a launch failed after a fork: join (a capture must rejoin)
                self._join.record(self._side)
                self.stream.wait_event(self._join)

    def run_eager(self) -> None:
        with self.stream:
            self._launch_all()

    def capture(self) -> None:
        """Capture every node's launch into self.graph. If a launch raises, the capture is ended
        and dropped (self.graph stays None: a partial step must never be replayed) and that
        error propagates, not one from ending the broken capture."""
        with self.stream:
            self.stream.begin_capture()
            try:
                self._launch_all()
            except BaseException:
                try:
                    self.stream.end_capture()
                except Exception:  # the capture may be invalid by now; the launch's error is the one to see
                    pass
                self.graph = None
                raise
            self.graph = self.stream.end_capture()

    def replay(self) -> None:
        if self.graph is None:
            self.capture()
        self.graph.launch(stream=self.stream)

    def first_nonfinite(self) -> Node | None:
        """Re-run eagerly, synchronising after each node; the first whose output holds NaN/Inf."""
        import cupy as cp
        with self.stream:
            for n in self.nodes:
                n.launch(pdl_ok=False)
                if n.out is not None and not bool(cp.isfinite(n.out).all()):
                    return n
        return None

    def time_nodes(self) -> list[tuple[Node, float]]:
        """(node, microseconds) from a CUDA event pair around every node of one eager run.
        A spinning kernel holds the stream until every launch and event is queued, so the
        pairs time GPU work only, not Python launch overhead (~5 us per launch)."""
        import cupy as cp
        import numpy as np
        from .module import kernel
        flag = cp.zeros(1, dtype=cp.int32)
        evs = [cp.cuda.Event() for _ in range(len(self.nodes) + 1)]
        with self.stream:
            kernel("hold_stream")((1,), (1,), (flag,))
            evs[0].record(self.stream)
            for n, e in zip(self.nodes, evs[1:]):
                n.launch(pdl_ok=False)  # an event between nodes: plain stream order
                e.record(self.stream)
        other = cp.cuda.Stream(non_blocking=True)
        flag.set(np.ones(1, np.int32), stream=other)
        evs[-1].synchronize()
        return [(n, 1e3 * cp.cuda.get_elapsed_time(a, b))
                for n, a, b in zip(self.nodes, evs, evs[1:])]

    def time_nodes_graph(self, reps: int = 20, samples: int = 5,
                         restore=()) -> list[tuple[Node, float, list[float]]]:
        """(node, microseconds per launch, the `samples` replays' microseconds per launch) with
        each node captured `reps` times back to back in its own CUDA graph: the cost of the node
        as it runs inside the step graph (launch latency and tail included, no host gaps). The
        median of `samples` replays; the samples themselves give A/B verdicts their spread
        (harness/ab_nodes.py). Nodes write
        their outputs `reps` times (an "add" node adds reps times); `restore` lists device
        arrays (state, residual stream) copied back after each node so values stay sane."""
        import cupy as cp
        saved = [a.copy() for a in restore]
        ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()
        out = []
        with self.stream:
            for n in self.nodes:
                self.stream.begin_capture()
                try:
                    for _ in range(reps):
                        n.launch()
                finally:
                    graph = self.stream.end_capture()
                graph.launch(stream=self.stream)  # warm-up (first replay uploads the graph)
                ts = []
                for _ in range(samples):
                    ev0.record(self.stream)
                    graph.launch(stream=self.stream)
                    ev1.record(self.stream)
                    ev1.synchronize()
                    ts.append(1e3 * cp.cuda.get_elapsed_time(ev0, ev1) / reps)
                for a, b in zip(restore, saved):
                    a[...] = b
                out.append((n, sorted(ts)[len(ts) // 2], ts))
        self.stream.synchronize()
        return out

