"""EngineBackend: the project's CUDA engine behind the Backend protocol.

load: check the file and the types, plan memory (harness.plan.engine_plan: free device
bytes capped at RunConfig.vram_limit; token_embd on the device or, per
RunConfig.embd_placement, in mapped page-locked host memory read one row per token), upload
the weights into one arena, allocate the step buffers and KV cache, build the node lists.
Each fed token is one replay of a captured CUDA graph (prompt tokens whose logits are not
needed skip the head). info() reports the plan against measured device memory.
"""
from __future__ import annotations

import time

import numpy as np

from harness.config import ModelRef, RunConfig
from harness.errors import ConfigError, ModelError, NumericError, UnsupportedError
from harness.gguf_file import open_gguf

from ..base import CAP_GRAPH, CAP_MEMORY, CAP_NODES, CAP_TIMINGS
from .executor import Executor
from . import ops as _ops
from . import module, switches, xpf
from .formats import check_type



class EngineBackend:
    name = "engine"

    def __init__(self, allow_diag: bool = False) -> None:
        """allow_diag: load under GGUF_HARNESS_DIAG (a timing-only build, backends/engine/module.py),
        as `harness bench nodes` does; every other user is refused at load (ConfigError)."""
        self.pos = 0
        self.n_ctx = 0
        self._loaded = False
        self._allow_diag = allow_diag
        self._diag = False

    # -- loading -------------------------------------------------------------------------
    def load(self, model: ModelRef, cfg: RunConfig) -> None:
        # a bad GGUF_HARNESS_* value, or a diagnostic build where one is not wanted, fails here
        # (ConfigError), before the model is read
        switches.check_for("the engine outside it", allow_diag=self._allow_diag)
        self._diag = bool(module.diag_defines())
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
        pool = cp.get_default_memory_pool()
        free0 = int(cp.cuda.runtime.memGetInfo()[0])  # with the CUDA context, before any allocation
        pool0 = pool.used_bytes()
        plan = self._plan(info, model.name, cfg, free0)
        host = [n for n, _ in plan.host]  # ["token_embd.weight"] or none
        self.arena = Arena(info, names, host=host)
        try:
            self.bufs = arch.Buffers.allocate(p, n_vocab, cfg.n_ctx)
            body, head = arch.build(self.arena, self.bufs, p, cfg.n_ctx)
            xpf.link(body + head)  # GGUF_HARNESS_GEMV_KQ_XPF: each v9 GEMV learns the next one's rows
        except BaseException:  # not loaded, so close() frees nothing: free the arena here
            self.arena.close()
            raise
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.prompt_exec = Executor(body, self.stream)
        self.step_exec = Executor(body + head, self.stream)
        self.params, self.n_vocab, self.n_ctx = p, n_vocab, cfg.n_ctx
        self.vram_limit = cfg.vram_limit
        self._free_at_load = free0
        self.pool_bytes = pool.used_bytes() - pool0
        self.measured_bytes_load = self._device_used()
        self.measured_bytes_step = None
        self._loaded = True
        self.reset()

    def _plan(self, info, name: str, cfg: RunConfig, free: int):
        """The capacity plan (harness.plan.engine_plan: weights + KV + workspace + safety
        margin against min(free, cfg.vram_limit), token_embd placed per cfg.embd_placement);
        ModelError before anything is allocated when it does not fit."""
        from harness.plan import engine_plan, require_fit
        plan = engine_plan(info, cfg.n_ctx, free, cfg.vram_limit, cfg.embd_placement)
        what = f"engine: {name}" + (f" (--vram-limit {cfg.vram_limit:,} B)" if cfg.vram_limit else "")
        require_fit(plan, what)
        self.plan, self.planned_bytes = plan, plan.need
        return plan

    def _device_used(self) -> int:
        """Device bytes in use now minus at the start of load() (cudaMemGetInfo: device-wide,
        so other processes' allocations in between count too; allocation granularity ~2 MiB)."""
        import cupy as cp
        return self._free_at_load - int(cp.cuda.runtime.memGetInfo()[0])

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
        ex = self.step_exec if with_head else self.prompt_exec
        first = ex.graph is None
        ex.replay()
        if first:  # the graph was just captured and instantiated: its device memory counts
            used = self._device_used()
            self.measured_bytes_step = max(used, self.measured_bytes_step or 0)
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
        if state[2] and not self._diag:  # a diagnostic build's values are wrong by design
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
        return {CAP_GRAPH, CAP_MEMORY, CAP_NODES, CAP_TIMINGS}

    def close(self) -> None:
        if self._loaded:
            import cupy as cp
            self.stream.synchronize()
            del self.bufs, self.prompt_exec, self.step_exec  # the graphs first: they read the arena
            self.arena.close()  # device arena and the pinned host memory of token_embd
            del self.arena
            cp.get_default_memory_pool().free_all_blocks()
            self._loaded = False

    # -- extras ----------------------------------------------------------------------------
    def bench(self, prompt, n_decode: int, reps: int) -> dict:
        """Throughput with CUDA events, per repetition: token-major prefill of `prompt` (one
        graph replay per token, host writes the token id and position before each), then
        n_decode chained decode steps: replays of the full step graph back to back, each
        feeding its own device-side argmax to the next (no host work between steps).
        Returns {"prefill_s": [reps], "decode_s": [reps], "decode_sync_s": [reps],
        "decode_window": [reps x [start, end]]}; decode_sync_s repeats the decode with a host
        synchronisation and a read of the token id after every step (what a serving loop pays);
        decode_window is when the chained decode ran on the GPU, in time.monotonic() seconds
        (its end read as the host sees the last event complete, its start that less decode_s),
        for the energy counter (harness/gpu_state.py window_energy_j)."""
        import cupy as cp
        prompt = [int(t) for t in prompt]
        if len(prompt) + n_decode > self.n_ctx:
            raise ConfigError(f"bench needs {len(prompt) + n_decode} positions > n_ctx {self.n_ctx}")
        out = {"prefill_s": [], "decode_s": [], "decode_sync_s": [], "decode_window": []}
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
            end = time.monotonic()
            out["prefill_s"].append(cp.cuda.get_elapsed_time(ev[0], ev[1]) / 1e3)
            out["decode_s"].append(cp.cuda.get_elapsed_time(ev[1], ev[2]) / 1e3)
            out["decode_window"].append([end - out["decode_s"][-1], end])
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
        """Per-node time of one decode step: [{name, kind, fmt, us, us_samples, bytes, gb_s}].
        method "eager": one eager run with a CUDA event pair around every node (host launch
        gaps are not inside the pairs; us_samples = [us]); "graph": every node replayed back to
        back in a CUDA graph of its own (executor.time_nodes_graph), as it runs inside the step
        graph (us = the median of us_samples, one per replay)."""
        self.bufs.state.set(np.array([token, self.pos, 0, 0], np.int32), stream=self.stream)
        if method == "eager":
            timed = [(n, us, [us]) for n, us in self.step_exec.time_nodes()]
        elif method == "graph":
            timed = self.step_exec.time_nodes_graph(restore=(self.bufs.state, self.bufs.x, self.bufs.key))
        else:
            raise ConfigError(f"node timing method {method!r}: expected eager or graph")
        rows = []
        for n, us, samples in timed:
            rows.append({"name": n.name, "kind": n.kind, "fmt": n.fmt, "us": us, "us_samples": list(samples),
                         "bytes": n.bytes, "gb_s": n.bytes / us / 1e3 if us > 0 else None})
        return rows

    def info(self) -> dict:
        """Step facts and memory, predicted vs measured: planned_bytes (plan.need: weights on
        the device + KV + workspace + staging + safety margin) against plan_free_bytes
        (min(free at load, vram_limit)); token_embd: "device" or "host" (page-locked, mapped:
        bytes_host); measured_bytes_load / measured_bytes_step: cudaMemGetInfo's free bytes at
        the start of load() minus after load / after the step graphs were first captured and
        run (None before a step; device-wide, so it includes CUDA module and graph memory and
        any other process's allocations); pool_bytes: CuPy memory-pool bytes the engine's own
        arrays took at load (weights arena, step buffers, KV cache, node workspaces);
        switches_effective: every engine switch's value as run (switches.effective)."""
        return {"bytes_resident": self.arena.bytes_resident, "kv_bytes": self.bufs.kv_bytes(),
                "planned_bytes": self.planned_bytes, "plan_free_bytes": self.plan.free,
                "vram_limit": self.vram_limit,
                "token_embd": "host" if self.arena.on_host("token_embd.weight") else "device",
                "bytes_host": self.arena.bytes_host, "pool_bytes": self.pool_bytes,
                "measured_bytes_load": self.measured_bytes_load,
                "measured_bytes_step": self.measured_bytes_step,
                "nodes_per_step": len(self.step_exec.nodes),
                "bytes_per_step": sum(n.bytes for n in self.step_exec.nodes),
                "gemv_impl": _ops.GEMV_IMPL, "attn_impl": _ops.ATTN_IMPL,
                # every switch's value as run (unset ones too: defaults change between versions)
                "switches_effective": switches.effective()}
