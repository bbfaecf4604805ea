"""Layer-by-layer diff of the engine against the float64 oracle (qwen2 models, GPU).

The oracle runs the prompt as one batch and reports its named intermediates through its
capture callback ([n_tokens, ...] per node, llama.cpp cb() names, harness.layerdiff). The
engine runs the same prompt token by token (its prefill is token-major), eagerly, node by
node; after each node whose output has an oracle counterpart the device buffer is read and
compared with that token's row (harness.layerdiff.compare_node: rel_rms, max_abs). The
first node over `tol`, in execution order (token 0's layers, then token 1's ...), is where
the two computations part. `call` in the result is the prompt position.

Engine node -> oracle node (backends/engine/qwen2.py builds the nodes):
    blk.i.qkv          q, k (RoPE applied here on the host, oracles.ops.rope_neox: the engine
                       rotates inside the attention kernel) -> Qcur, Kcur; v -> Vcur
    blk.i.attn         attn -> kqv_out
    blk.i.attn_output  x (residual after the add) -> ffn_inp
    blk.i.ffn_gate_up  h -> ffn_swiglu
    blk.i.ffn_down     x -> l_out
    output             logits -> result_output (last prompt token only: the engine's prompt
                       tokens skip the head, as llama.cpp's do)
Compare like with like: the oracle's act_round should model the engine's GEMV input rounding
(default: "engine" for GGUF_HARNESS_GEMV=q16, "q8_1" for q8_1, none for f32) and its KV cache
fp16 as the engine's.
"""
from __future__ import annotations

import os
import re
from typing import Sequence

import numpy as np

from harness.config import ModelRef, RunConfig
from harness.errors import ConfigError, UnsupportedError
from harness.layerdiff import LayerDiff, compare_node

DEFAULT_TOL = 1e-3   # q16 engine vs the q16-rounding oracle: ~1e-5 per node (fp32 sums)
_NODE = re.compile(r"blk\.(\d+)\.(qkv|attn|attn_output|ffn_gate_up|ffn_down)(\.merge)?$")
ACT_ROUND = {"q16": "engine", "q8_1": "q8_1"}


def _engine_outputs(kind: str, bufs, p, pos: int) -> list[tuple[str, np.ndarray]]:
    """(oracle node name, engine value as float64 [1, ...]) after engine node `kind`."""
    from oracles import ops
    if kind == "qkv":
        q = bufs.q.get().astype(np.float64).reshape(1, p.n_head, p.head_dim)
        k = bufs.k.get().astype(np.float64).reshape(1, p.n_head_kv, p.head_dim)
        at = np.array([pos])
        return [("Qcur", ops.rope_neox(q, at, p.n_rot, p.freq_base, p.freq_scale)),
                ("Kcur", ops.rope_neox(k, at, p.n_rot, p.freq_base, p.freq_scale)),
                ("Vcur", bufs.v.get().astype(np.float64).reshape(1, p.n_head_kv, p.head_dim))]
    buf = {"attn": bufs.attn, "attn_output": bufs.x, "ffn_gate_up": bufs.h, "ffn_down": bufs.x}[kind]
    name = {"attn": "kqv_out", "attn_output": "ffn_inp", "ffn_gate_up": "ffn_swiglu",
            "ffn_down": "l_out"}[kind]
    return [(name, buf.get().astype(np.float64)[None])]


def engine_layer_diff(model_path: str | os.PathLike, prompt: Sequence[int], *,
                      tol: float = DEFAULT_TOL, n_ctx: int = 256,
                      act_round: str | None = "auto", engine=None) -> LayerDiff:
    """Diff every mapped engine node against the oracle over the prompt (module docstring).

    model_path: a qwen2 GGUF; prompt: token ids (1..n_ctx); act_round: the oracle's GEMV input
    rounding ("auto": the one matching ops.GEMV_IMPL); engine: a loaded EngineBackend to use
    (else one is loaded). Returns harness.layerdiff.LayerDiff (first_bad, summary, to_json).
    Raises ConfigError (empty or too long prompt), UnsupportedError (not qwen2), and what
    the backends raise on load.
    """
    from backends.engine import EngineBackend
    from backends.engine import ops as eops
    from oracles.qwen2 import Qwen2Oracle
    from harness.gguf_file import open_gguf

    prompt = [int(t) for t in prompt]
    if not prompt or len(prompt) > n_ctx:
        raise ConfigError(f"engine_layer_diff needs 1..{n_ctx} prompt tokens, got {len(prompt)}")
    if open_gguf(model_path).arch != "qwen2":
        raise UnsupportedError("engine_layer_diff maps qwen2 nodes only")
    if act_round == "auto":
        act_round = ACT_ROUND.get(eops.GEMV_IMPL)
    ref: dict[tuple[str, int], np.ndarray] = {}
    oracle = Qwen2Oracle(model_path, n_ctx=n_ctx, kv_round="f16", act_round=act_round,
                         capture=lambda n, l, a: ref.__setitem__((n, l), np.array(a, np.float64)))
    oracle.prefill(prompt)
    own = engine is None
    if own:
        engine = EngineBackend()
        engine.load(ModelRef(os.path.basename(str(model_path)), model_path), RunConfig(n_ctx=n_ctx))
    try:
        return _walk(engine, prompt, ref, tol)
    finally:
        if own:
            engine.close()


def _walk(engine, prompt: list[int], ref: dict, tol: float) -> LayerDiff:
    rep = LayerDiff(tol)
    p, bufs = engine.params, engine.bufs
    engine.reset()
    last = len(prompt) - 1
    for pos, tok in enumerate(prompt):
        bufs.state.set(np.array([tok, pos, 0, 0], np.int32), stream=engine.stream)
        nodes = (engine.step_exec if pos == last else engine.prompt_exec).nodes
        with engine.stream:
            for j, node in enumerate(nodes):
                node.launch(pdl_ok=False)
                m = _NODE.match(node.name)
                if m is None and node.name != "output":
                    continue
                if j + 1 < len(nodes) and nodes[j + 1].name == node.name + ".merge":
                    continue  # split attention (v3): the output is final after its merge node
                engine.stream.synchronize()
                if m is None:  # the head: the oracle captured the last prompt row only
                    outs, il = [("result_output", bufs.logits.get().astype(np.float64))], -1
                else:
                    il = int(m.group(1))
                    outs = _engine_outputs(m.group(2), bufs, p, pos)
                for name, val in outs:
                    if (name, il) in ref:
                        want = ref[(name, il)] if il < 0 else ref[(name, il)][pos]
                        rep.nodes.append(compare_node(pos, name, il, want, val, tol))
    engine.pos = len(prompt)
    return rep
