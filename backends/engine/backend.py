"""EngineBackend: the project's CUDA engine behind the Backend protocol.

load: check the file and the types, plan memory, upload the weights into one arena,
allocate the step buffers and KV cache, build the node lists. Each fed token is one replay
of a captured CUDA graph (prompt tokens whose logits are not needed skip the head).
"""
from __future__ import annotations

import numpy as np

from harness.config import ModelRef, RunConfig
from harness.errors import ConfigError, ModelError, NumericError, UnsupportedError
from harness.gguf_file import open_gguf

from .executor import Executor
from .formats import check_type

MARGIN_BYTES = 512 << 20  # safety margin kept free on the device (planner, SEEDS.md §2)


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
        from . import qwen2
        from .arena import Arena
        info = open_gguf(model.path)
        if info.arch != "qwen2":
            raise UnsupportedError(f"{model.name}: architecture {info.arch!r} has no engine "
                                   f"implementation yet (supported: qwen2)")
        p = qwen2.read_params(info)
        tied = "output.weight" not in info.tensors
        names = qwen2.tensor_names(p, tied)
        for n in names:
            check_type(info.tensor(n).type_id, n)
        n_vocab = info.tensor("token_embd.weight").ne[1]
        self._plan(sum(info.tensor(n).nbytes for n in names), p, n_vocab, cfg.n_ctx)
        self.arena = Arena(info, names)
        self.bufs = qwen2.Buffers.allocate(p, n_vocab, cfg.n_ctx)
        body, head = qwen2.build(self.arena, self.bufs, p, cfg.n_ctx)
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.prompt_exec = Executor(body, self.stream)
        self.step_exec = Executor(body + head, self.stream)
        self.params, self.n_vocab, self.n_ctx = p, n_vocab, cfg.n_ctx
        self._loaded = True
        self.reset()

    def _plan(self, weight_bytes: int, p, n_vocab: int, n_ctx: int) -> None:
        """Refuse before allocating when weights + KV + activations + margin exceed free memory."""
        import cupy as cp
        kv = 2 * 2 * p.n_layer * n_ctx * p.n_head_kv * p.head_dim
        act = 4 * (3 * p.n_embd + 3 * p.n_embd_q + p.n_ff + n_vocab)
        need = weight_bytes + kv + act + MARGIN_BYTES
        free, _ = cp.cuda.runtime.memGetInfo()
        if need > free:
            raise ModelError(f"the model needs {need / 2**30:.2f} GiB on the GPU (weights "
                             f"{weight_bytes / 2**30:.2f}, KV {kv / 2**30:.2f}, margin "
                             f"{MARGIN_BYTES >> 20} MiB) but only {free / 2**30:.2f} GiB is free")
        self.planned_bytes = need

    # -- Backend protocol ------------------------------------------------------------------
    def reset(self) -> None:
        self.pos = 0

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
        return {"graph", "nodes", "timings"}

    def close(self) -> None:
        if self._loaded:
            import cupy as cp
            self.stream.synchronize()
            del self.arena, self.bufs, self.prompt_exec, self.step_exec
            cp.get_default_memory_pool().free_all_blocks()
            self._loaded = False

    # -- extras ----------------------------------------------------------------------------
    def info(self) -> dict:
        return {"bytes_resident": self.arena.bytes_resident, "kv_bytes": self.bufs.kv_bytes(),
                "planned_bytes": self.planned_bytes, "nodes_per_step": len(self.step_exec.nodes),
                "bytes_per_step": sum(n.bytes for n in self.step_exec.nodes)}
