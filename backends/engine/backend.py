"""EngineBackend: the project's CUDA engine behind the Backend protocol.

load: check the file and the types, plan memory, upload the weights into one arena,
allocate the step buffers and KV cache, build the node lists. Each fed token is one replay
of a captured CUDA graph (prompt tokens whose logits are not needed skip the head).
"""
from __future__ import annotations

import time

import numpy as np

from harness.config import ModelRef, RunConfig
from harness.errors import ConfigError, ModelError, NumericError, UnsupportedError
from harness.gguf_file import open_gguf

from ..base import CAP_GRAPH, CAP_NODES, CAP_TIMINGS
from .executor import Executor
from . import ops as _ops
from .formats import check_type



class EngineBackend:
    name = "engine"

    def __init__(self) -> None:
        self.pos = 0
        self.n_ctx = 0
        self._loaded = False

    # -- loading -------------------------------------------------------------------------
    def load(self, model: ModelRef, cfg: RunConfig) -> None:
        try:
            import cupy as cp
        except ImportError as e:
            raise UnsupportedError("the engine needs CuPy and an NVIDIA GPU (pip install .[gpu])") from e
        from . import qwen2, qwen35
        from .arena import Arena
        info = open_gguf(model.path)
        arch = {"qwen2": qwen2, "qwen35": qwen35}.get(info.arch)
        if arch is None:
            raise UnsupportedError(f"{model.name}: architecture {info.arch!r} has no engine "
                                   f"implementation yet (supported: qwen2, qwen35)")
        p = arch.read_params(info)
        tied = "output.weight" not in info.tensors
        if arch is qwen35:  # kernel shapes and the tensors read as plain F32 (qwen35.py)
            qwen35.check_shapes(p)
            names = qwen35.tensor_names(p, tied, info.tensors)
            qwen35.check_types(info, names)
        else:
            names = qwen2.tensor_names(p, tied)
        for n in names:
            check_type(info.tensor(n).type_id, n)
        n_vocab = info.tensor("token_embd.weight").ne[1]
        self._plan(info, model.name, cfg.n_ctx)
        self.arena = Arena(info, names)
        self.bufs = arch.Buffers.allocate(p, n_vocab, cfg.n_ctx)
        body, head = arch.build(self.arena, self.bufs, p, cfg.n_ctx)
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.prompt_exec = Executor(body, self.stream)
        self.step_exec = Executor(body + head, self.stream)
        self.params, self.n_vocab, self.n_ctx = p, n_vocab, cfg.n_ctx
        self._loaded = True
        self.reset()

    def _plan(self, info, name: str, n_ctx: int) -> None:
        """Refuse before allocating when the capacity plan (harness.plan: weights + KV +
        workspace + safety margin against cudaMemGetInfo's free bytes) does not fit.
        token_embd stays on the device: the engine has no host placement yet."""
        import cupy as cp
        from harness.plan import plan_model, require_fit
        free, _ = cp.cuda.runtime.memGetInfo()
        plan = plan_model(info, n_ctx, free, embd_on_host=False)
        require_fit(plan, f"engine: {name}")
        self.planned_bytes = plan.need

    # -- Backend protocol ------------------------------------------------------------------
    def reset(self) -> None:
        self.pos = 0
        clear = getattr(self.bufs, "clear_recurrent", None) if self._loaded else None
        if clear is not None:  # qwen35: zero the conv and delta-rule states
            clear(self.stream)

    def _feed(self, token: int, with_head: bool) -> None:
        if not self._loaded:
            raise ConfigError("engine: load() first")
        if not 0 <= int(token) < self.n_vocab:
            raise ConfigError(f"token id {token} outside [0, {self.n_vocab})")
        if self.pos >= self.n_ctx:
            raise ConfigError(f"context full: n_ctx={self.n_ctx}")
        self.bufs.state.set(np.array([token, self.pos, 0, 0], np.int32), stream=self.stream)
        (self.step_exec if with_head else self.prompt_exec).replay()
        self.pos += 1

    def prefill(self, tokens) -> np.ndarray:
        tokens = list(tokens)
        if not tokens:
            raise ConfigError("prefill needs at least one token")
        for t in tokens[:-1]:
            self._feed(t, with_head=False)
        return self.step(tokens[-1])

    def step(self, token: int) -> np.ndarray:
        self._feed(token, with_head=True)
        logits = self.bufs.logits.get(stream=self.stream)
        state = self.bufs.state.get(stream=self.stream)
        self.stream.synchronize()
        if state[2]:
            self._report_nonfinite(token, int(state[2]))
        return logits

    def _report_nonfinite(self, token: int, count: int) -> None:
        """Re-run the step eagerly, checking every node, and name the first bad one."""
        self.bufs.state.set(np.array([token, self.pos - 1, 0, 0], np.int32), stream=self.stream)
        node = self.step_exec.first_nonfinite()
        where = node.name if node is not None else "the logits"
        raise NumericError(f"engine: {count} non-finite logits at position {self.pos - 1}; "
                           f"first NaN/Inf produced by node {where}")

    def capabilities(self) -> set[str]:
        return {CAP_GRAPH, CAP_NODES, CAP_TIMINGS}

    def close(self) -> None:
        if self._loaded:
            import cupy as cp
            self.stream.synchronize()
            del self.arena, self.bufs, self.prompt_exec, self.step_exec
            cp.get_default_memory_pool().free_all_blocks()
            self._loaded = False

    # -- extras ----------------------------------------------------------------------------
    def bench(self, prompt, n_decode: int, reps: int) -> dict:
        """Throughput with CUDA events, per repetition: token-major prefill of `prompt` (one
        graph replay per token, host writes the token id and position before each), then
        n_decode chained decode steps: replays of the full step graph back to back, each
        feeding its own device-side argmax to the next (no host work between steps).
        Returns {"prefill_s": [reps], "decode_s": [reps], "decode_sync_s": [reps]};
        decode_sync_s repeats the decode with a host synchronisation and a read of the
        token id after every step (what a serving loop pays)."""
        import cupy as cp
        prompt = [int(t) for t in prompt]
        if len(prompt) + n_decode > self.n_ctx:
            raise ConfigError(f"bench needs {len(prompt) + n_decode} positions > n_ctx {self.n_ctx}")
        out = {"prefill_s": [], "decode_s": [], "decode_sync_s": []}
        ev = [cp.cuda.Event() for _ in range(3)]
        for _ in range(reps):
            self.reset()
            ev[0].record(self.stream)
            for t in prompt[:-1]:
                self._feed(t, with_head=False)
            self._feed(prompt[-1], with_head=True)
            ev[1].record(self.stream)
            for _ in range(n_decode):
                self.step_exec.replay()   # state[0..1] advanced on the device (finish_step)
            ev[2].record(self.stream)
            ev[2].synchronize()
            out["prefill_s"].append(cp.cuda.get_elapsed_time(ev[0], ev[1]) / 1e3)
            out["decode_s"].append(cp.cuda.get_elapsed_time(ev[1], ev[2]) / 1e3)
            self.pos = len(prompt)
            self.bufs.state.set(np.array([prompt[-1], self.pos - 1, 0, 0], np.int32), stream=self.stream)
            self.step_exec.replay()
            self.stream.synchronize()
            t0 = time.perf_counter()
            for _ in range(n_decode):
                self.step_exec.replay()
                int(self.bufs.state[0].get(stream=self.stream))  # synchronises
            out["decode_sync_s"].append(time.perf_counter() - t0)
        self.reset()
        return out

    def node_times(self, token: int = 0, method: str = "eager") -> list[dict]:
        """Per-node time of one decode step: [{name, kind, fmt, us, bytes, gb_s}].
        method "eager": one eager run with a CUDA event pair around every node (host launch
        gaps are not inside the pairs); "graph": every node replayed back to back in a CUDA
        graph of its own (executor.time_nodes_graph), as it runs inside the step graph."""
        self.bufs.state.set(np.array([token, self.pos, 0, 0], np.int32), stream=self.stream)
        if method == "eager":
            timed = self.step_exec.time_nodes()
        elif method == "graph":
            timed = self.step_exec.time_nodes_graph(restore=(self.bufs.state, self.bufs.x, self.bufs.key))
        else:
            raise ConfigError(f"node timing method {method!r}: expected eager or graph")
        rows = []
        for n, us in timed:
            rows.append({"name": n.name, "kind": n.kind, "fmt": n.fmt, "us": us,
                         "bytes": n.bytes, "gb_s": n.bytes / us / 1e3 if us > 0 else None})
        return rows

    def info(self) -> dict:
        return {"bytes_resident": self.arena.bytes_resident, "kv_bytes": self.bufs.kv_bytes(),
                "planned_bytes": self.planned_bytes, "nodes_per_step": len(self.step_exec.nodes),
                "bytes_per_step": sum(n.bytes for n in self.step_exec.nodes),
                "gemv_impl": _ops.GEMV_IMPL, "attn_impl": _ops.ATTN_IMPL}
