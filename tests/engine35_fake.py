"""A CPU stand-in for the qwen35 EngineBackend, for tests of harness.engine_layerdiff without a
GPU. It has the engine's node list (backends.engine.qwen35.node_plan), step buffers named
and shaped as qwen35.layout(), float32 like the engine's, and the attributes _walk uses
(params, bufs, stream, prompt_exec / step_exec .nodes, reset, pos). "Launching" a node
fills the buffers that node writes on the GPU from a second float64 oracle ("twin") fed one
token at a time, with the engine's layouts: the raw q|gate and k projections (the engine
norms and rotates them inside its attention kernel), the raw beta projection, the delta-rule
state of the layer's DeltaNet slot, the residual stream after each "add" GEMV.

What it checks: the node -> buffer -> oracle-name mapping, the host-side norm / RoPE /
sigmoid, positions, per-call nodes. What it cannot: that the real engine's buffers hold what
qwen35.py says they hold (the GPU tests in test_engine_layerdiff_qwen35.py do).
noise: every twin node times (1 + noise * N(0, 1)) (float32-like error in every op, carried
through the twin's recurrence, q16 and fp16 roundings); fault: the twin's injection
{(name, layer): fn} (an engine-side bug).
"""
from __future__ import annotations

import contextlib

import numpy as np


def _noisy(fn, noise: float, rng):
    """fn (or the identity) followed by relative noise: a * (1 + noise * N(0, 1))."""
    def apply(a):
        a = fn(a) if fn is not None else a
        return a * (1 + noise * rng.standard_normal(np.shape(a)))
    return apply


class FakeBuf:
    """A host array with CuPy's get() / set() (stream arguments ignored)."""

    def __init__(self, shape, dtype):
        self.a = np.zeros(shape, dtype)

    def get(self, stream=None):
        return self.a.copy()

    def set(self, arr, stream=None):
        self.a[...] = np.asarray(arr).reshape(self.a.shape)


class FakeBufs:
    def __init__(self, arrays: dict, n_rec: int):
        self.__dict__.update(arrays)
        self.ssm = [FakeBuf(arrays["ssm"].a.shape[1:], np.float32) for _ in range(n_rec)]


class FakeStream(contextlib.AbstractContextManager):
    def __exit__(self, *exc):
        return None

    def synchronize(self):
        pass


class FakeNode:
    def __init__(self, name: str, engine: FakeQwen35Engine):
        self.name, self._engine = name, engine

    def launch(self, pdl_ok: bool = True):
        self._engine._launch(self.name)


class _Exec:
    def __init__(self, nodes):
        self.nodes = nodes


class FakeQwen35Engine:
    def __init__(self, path, n_ctx: int = 64, act_round: str | None = "engine",
                 noise: float = 0.0, fault: dict | None = None, seed: int = 0):
        from backends.engine import qwen35
        from harness.gguf_file import open_gguf
        from oracles.qwen35 import Qwen35Oracle
        info = open_gguf(path)
        self.params = p = qwen35.read_params(info)
        n_vocab = int(info.tensor("token_embd.weight").ne[1])
        arrays = {k: FakeBuf(shape, np.dtype(dt)) for k, (shape, dt) in
                  qwen35.layout(p, n_vocab, n_ctx).items()}
        self.bufs = FakeBufs(arrays, sum(p.recurrent))
        self._slot = {il: sum(p.recurrent[:il]) for il in range(p.n_layer) if p.recurrent[il]}
        self._cur: dict[tuple[str, int], np.ndarray] = {}
        inject = dict(fault or {})
        if noise:
            rng = np.random.default_rng(seed)
            names = self._capture_names(path, n_ctx)
            for key in names:
                inject[key] = _noisy(inject.get(key), noise, rng)
        self.twin = Qwen35Oracle(path, n_ctx=n_ctx, kv_round="f16", act_round=act_round,
                                 capture=lambda n, l, a: self._cur.__setitem__((n, l), np.array(a)),
                                 inject=inject)
        names = [n for n, _ in qwen35.node_plan(p)]
        head = names.index("output")
        nodes = [FakeNode(n, self) for n in names]
        self.prompt_exec, self.step_exec = _Exec(nodes[:head]), _Exec(nodes)
        self.stream = FakeStream()
        self.pos = 0
        self.launched: list[str] = []

    @staticmethod
    def _capture_names(path, n_ctx) -> list[tuple[str, int]]:
        from oracles.qwen35 import Qwen35Oracle
        seen: dict = {}
        Qwen35Oracle(path, n_ctx=n_ctx, capture=lambda n, l, a: seen.setdefault((n, l))).prefill([0])
        return list(seen)

    def reset(self):
        self.twin.reset()
        self.pos = 0

    def _row(self, name: str, il: int) -> np.ndarray:
        return self._cur[(name, il)].reshape(-1)

    def _put(self, buf: str, value) -> None:
        getattr(self.bufs, buf).set(np.asarray(value, np.float64).astype(np.float32))

    def _launch(self, name: str) -> None:
        self.launched.append(name)
        twin = self.twin
        if name == "token_embd":
            tok, pos = (int(v) for v in self.bufs.state.get()[:2])
            assert pos == twin.n_past, (pos, twin.n_past)
            self._cur.clear()
            twin.prefill([tok])  # the whole token through the twin; nodes below read it
            self._put("x", self._row("inp_embd", -1))
            return
        if name == "output":
            self._put("logits", self._row("result_output", -1))
            return
        if not name.startswith("blk."):
            return  # argmax, finish: nothing the diff reads
        _, il, kind = name.split(".", 2)
        il, pre = int(il), f"blk.{il}."
        h = self._cur[("attn_norm", il)]  # [1, E], the GEMVs' normed input
        if kind == "ssm_in":
            self._put("qkv", self._row("linear_attn_qkv_mixed", il))
            self._put("z", self._row("z", il))
            self._put("beta", twin._lin(pre + "ssm_beta.weight", h))  # raw: gdn_step applies sigmoid
            self._put("alpha", self._row("alpha", il))
        elif kind == "ssm_conv":
            self._put("y", self._row("conv_output_silu", il))
        elif kind == "ssm_step":
            self._put("o", self._row("final_output", il))
            self.bufs.ssm[self._slot[il]].set(twin._ssm[twin._slot[il]].astype(np.float32))
        elif kind in ("ssm_out", "attn_output"):
            self._put("x", self._row("attn_residual", il))
        elif kind == "qkv":
            self._put("qg", twin._lin(pre + "attn_q.weight", h, twin._bias(pre + "attn_q.bias")))
            self._put("k", twin._lin(pre + "attn_k.weight", h, twin._bias(pre + "attn_k.bias")))
            self._put("v", self._row("Vcur", il))
        elif kind == "attn":
            self._put("attn", self._row("attn_gated", il))
        elif kind == "ffn_gate_up":
            self._put("h", self._row("ffn_swiglu", il))
        elif kind == "ffn_down":
            self._put("x", self._row("l_out", il))
        else:
            raise AssertionError(f"unknown node {name}")

    def close(self):
        pass
