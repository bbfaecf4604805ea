"""Layer-by-layer diff of the engine against the float64 oracle (qwen2 and qwen35 models, GPU).

The oracle runs the prompt as one batch and reports its named intermediates through its
capture callback ([n_tokens, ...] per node, llama.cpp cb() names, harness.layerdiff). The
engine runs the same prompt token by token (its prefill is token-major), eagerly, node by
node; after each node whose output has an oracle counterpart the device buffer is read and
compared with that token's row (harness.layerdiff.compare_node: rel_rms, max_abs; rel_rms^2
is the node's NMSE, ||out - ref||^2 / ||ref||^2). The first node over `tol`, in execution
order (token 0's layers, then token 1's ...), is where the two computations part. `call` in
the result is the prompt position.

qwen2 engine node -> oracle node (backends/engine/qwen2.py builds the nodes):
    blk.i.qkv          q, k (RoPE applied here on the host, oracles.ops.rope_neox: the engine
                       rotates inside the attention kernel) -> Qcur, Kcur; v -> Vcur
    blk.i.attn         attn -> kqv_out
    blk.i.attn_output  x (residual after the add) -> ffn_inp
    blk.i.ffn_gate_up  h -> ffn_swiglu
    blk.i.ffn_down     x -> l_out
    output             logits -> result_output (last prompt token only: the engine's prompt
                       tokens skip the head, as llama.cpp's do)

qwen35 engine node -> oracle node (backends/engine/qwen35.py, oracles/qwen35.py; QWEN35_MAP):
    token_embd         x -> inp_embd
  DeltaNet layer:
    blk.i.ssm_in       qkv -> linear_attn_qkv_mixed; z -> z; sigmoid(beta) (on the host: the
                       engine keeps the raw projection) -> beta_sigmoid; alpha -> alpha
    blk.i.ssm_conv     y -> conv_output_silu
    blk.i.ssm_step     o -> final_output; the layer's delta-rule state -> new_state (last
                       prompt token only: the oracle reports the state after its whole batch;
                       both hold it transposed, [Hv, S_v, S_k])
    blk.i.ssm_out      x (residual after the add) -> attn_residual
  gated attention layer:
    blk.i.qkv          qg, k: per-head RMS norm with attn_q_norm / attn_k_norm and IMROPE
                       applied here on the host (oracles.ops.rms_norm, oracles.rope_multi: the
                       engine does both inside the attention kernel) -> Qcur_normed,
                       Kcur_normed, Qcur, Kcur; the gate half of qg -> gate_reshaped;
                       v -> Vcur
    blk.i.attn         attn (attention times sigmoid(gate)) -> attn_gated
    blk.i.attn_output  x (residual after the add) -> attn_residual
  both:
    blk.i.ffn_gate_up  h -> ffn_swiglu (captured for this, under llama.cpp build_ffn's name)
    blk.i.ffn_down     x -> l_out (post_ffn is the same value)
    output             logits -> result_output (last prompt token only)
  Not compared (NOT_COMPARED_QWEN35; listed in the report with status "missing"): values the
  engine never writes to a buffer (norms fused into the GEMVs, gates, L2 norms and the
  delta-rule output inside gdn_step, q/k norm + RoPE and the pre-gate attention inside the
  attention kernel, matrix products added straight into the residual), and the oracle's
  slices of a compared buffer. The conv state is not captured by the oracle.
Compare like with like: the oracle's act_round should model the engine's GEMV input rounding
(default: "engine" for GGUF_HARNESS_GEMV=q16, "q8_1" for q8_1 on qwen2, none for f32; the
qwen35 oracle has no q8_1 model, so q8_1 on qwen35 compares against unrounded inputs) and its
KV cache fp16 as the engine's.
"""
from __future__ import annotations

import functools
import os
import re
from collections.abc import Sequence

import numpy as np

from harness.config import ModelRef, RunConfig
from harness.errors import ConfigError, UnsupportedError
from harness.layerdiff import LayerDiff, compare_node

DEFAULT_TOL = 1e-3   # q16 engine vs the q16-rounding oracle: ~1e-5 per node (fp32 sums)
# (qwen2, 2 layers); qwen35-tiny, 8 layers: q16 code flips settle near one q16 step, median
# ~3e-5, worst ~3e-4 (CPU estimate, tests/test_engine_layerdiff_qwen35.py)
_NODE = re.compile(r"blk\.(\d+)\.(qkv|attn|attn_output|ffn_gate_up|ffn_down)(\.merge)?$")
ACT_ROUND = {"q16": "engine", "q8_1": "q8_1"}
ARCHS = ("qwen2", "qwen35")
ACT_ROUND_BY_ARCH = {"qwen2": ACT_ROUND, "qwen35": {"q16": "engine"}}  # qwen35: no q8_1 model
# oracle nodes with one value per forward call (not one row per token): compared (or listed)
# at the prompt's last position only
WHOLE_CALL = ("result_norm", "result_output", "new_state")

# qwen35 engine node (name after "blk.i.", or the whole name) -> oracle nodes read after it
QWEN35_MAP: dict[str, tuple[str, ...]] = {
    "token_embd": ("inp_embd",),
    "ssm_in": ("linear_attn_qkv_mixed", "z", "beta_sigmoid", "alpha"),
    "ssm_conv": ("conv_output_silu",),
    "ssm_step": ("final_output", "new_state"),
    "ssm_out": ("attn_residual",),
    "qkv": ("Qcur_normed", "Kcur_normed", "gate_reshaped", "Qcur", "Kcur", "Vcur"),
    "attn": ("attn_gated",),
    "attn_output": ("attn_residual",),
    "ffn_gate_up": ("ffn_swiglu",),
    "ffn_down": ("l_out",),
    "output": ("result_output",),
}
_NODE35 = re.compile(r"blk\.(\d+)\.(" + "|".join(k for k in QWEN35_MAP if k not in
                                                   ("token_embd", "output")) + r")$")
# oracles/qwen35.py captures the engine keeps no buffer for -> why
NOT_COMPARED_QWEN35 = {
    "attn_norm": "RMS norm fused into the ssm_in / qkv GEMV",
    "attn_post_norm": "RMS norm fused into the ffn_gate_up GEMV",
    "a_softplus": "inside gdn_step",
    "gate": "inside gdn_step",
    "q_conv": "slice of conv_output_silu",
    "k_conv": "slice of conv_output_silu",
    "v_conv": "slice of conv_output_silu",
    "q_conv_predelta": "L2 norm inside gdn_step",
    "k_conv_predelta": "L2 norm inside gdn_step",
    "attn_output": "DeltaNet: delta-rule output before the gated norm, inside gdn_step; "
                   "attention: Wo product, added into x by the attn_output GEMV",
    "linear_attn_out": "ssm_out product, added into x by the ssm_out GEMV",
    "attn_pregate": "inside the attention kernel",
    "ffn_out": "ffn_down product, added into x by the ffn_down GEMV",
    "post_ffn": "same value as l_out",
    "result_norm": "RMS norm fused into the head GEMV",
}


def auto_act_round(arch: str, gemv_impl: str) -> str | None:
    """The oracle's act_round matching the engine's GEMV input rounding for `arch`."""
    return ACT_ROUND_BY_ARCH.get(arch, {}).get(gemv_impl)


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


def _f64(buf, *shape) -> np.ndarray:
    """A device buffer as float64 [1, *shape] (shape () keeps it flat)."""
    a = buf.get().astype(np.float64)
    return a.reshape(1, *shape) if shape else a[None]


def _qwen35_outputs(kind: str, il: int, bufs, p, pos: int, weights) -> list[tuple[str, np.ndarray]]:
    """(oracle node name, engine value as float64 [1, ...]) after qwen35 engine node `kind`
    of layer il (-1 outside the layers); weights: the oracle's (q/k norm weights)."""
    from oracles import deltanet, ops
    from oracles.rope_multi import rope_multi
    if kind == "token_embd":
        return [("inp_embd", _f64(bufs.x))]
    if kind == "output":
        return [("result_output", bufs.logits.get().astype(np.float64))]
    if kind == "ssm_in":
        return [("linear_attn_qkv_mixed", _f64(bufs.qkv)), ("z", _f64(bufs.z)),
                ("beta_sigmoid", deltanet.sigmoid(_f64(bufs.beta))), ("alpha", _f64(bufs.alpha))]
    if kind == "ssm_step":
        from backends.engine.deltanet_ops import conv_in_step
        r = sum(p.recurrent[:il])  # the layer's slot among the DeltaNet layers
        out = [("final_output", _f64(bufs.o)), ("new_state", bufs.ssm[r].get().astype(np.float64))]
        # GGUF_HARNESS_GDN_CONV=1: no ssm_conv node; the step writes the conv's y itself
        conv = [("conv_output_silu", _f64(bufs.y))] if conv_in_step(p.ssm_d_state, p.ssm_d_conv) else []
        return conv + out
    if kind == "qkv":
        d, pre = p.head_dim, f"blk.{il}."
        qg = _f64(bufs.qg, p.n_head, 2 * d)  # per head [query D | gate D]
        qn = ops.rms_norm(qg[..., :d], weights.vector64(pre + "attn_q_norm.weight"), p.eps)
        kn = ops.rms_norm(_f64(bufs.k, p.n_head_kv, d),
                          weights.vector64(pre + "attn_k_norm.weight"), p.eps)
        rope = (np.array([pos]), p.n_rot, p.rope_sections, p.freq_base, p.freq_scale)
        return [("Qcur_normed", qn), ("Kcur_normed", kn),
                ("gate_reshaped", qg[..., d:].reshape(1, p.n_head * d)),
                ("Qcur", rope_multi(qn, *rope)), ("Kcur", rope_multi(kn, *rope)),
                ("Vcur", _f64(bufs.v, p.n_head_kv, d))]
    buf = {"ssm_conv": bufs.y, "ssm_out": bufs.x, "attn": bufs.attn, "attn_output": bufs.x,
           "ffn_gate_up": bufs.h, "ffn_down": bufs.x}[kind]
    return [(QWEN35_MAP[kind][0], _f64(buf))]


def engine_layer_diff(model_path: str | os.PathLike, prompt: Sequence[int], *,
                      tol: float = DEFAULT_TOL, n_ctx: int = 256,
                      act_round: str | None = "auto", engine=None,
                      inject: dict | None = None) -> LayerDiff:
    """Diff every mapped engine node against the oracle over the prompt (module docstring).

    model_path: a qwen2 or qwen35 GGUF; prompt: token ids (1..n_ctx); act_round: the
    oracle's GEMV input rounding ("auto": the one matching ops.GEMV_IMPL, auto_act_round);
    engine: a loaded EngineBackend to use (else one is loaded); inject: the qwen35 oracle's
    fault injection {(name, layer): fn} (tests). Returns harness.layerdiff.LayerDiff
    (first_bad, summary, to_json). Raises ConfigError (empty or too long prompt, inject on
    qwen2), UnsupportedError (another architecture), and what the backends raise on load.
    """
    from backends.engine import EngineBackend
    from backends.engine import ops as eops
    from harness.gguf_file import open_gguf

    prompt = [int(t) for t in prompt]
    if not prompt or len(prompt) > n_ctx:
        raise ConfigError(f"engine_layer_diff needs 1..{n_ctx} prompt tokens, got {len(prompt)}")
    arch = open_gguf(model_path).arch
    if arch not in ARCHS:
        raise UnsupportedError(f"engine_layer_diff maps qwen2 and qwen35 nodes only, not {arch}")
    if act_round == "auto":
        act_round = auto_act_round(arch, eops.GEMV_IMPL)
    ref: dict[tuple[str, int], np.ndarray] = {}
    capture = lambda n, l, a: ref.__setitem__((n, l), np.array(a, np.float64))
    if arch == "qwen2":
        from oracles.qwen2 import Qwen2Oracle
        if inject:
            raise ConfigError("inject: the qwen2 oracle has no fault injection")
        oracle = Qwen2Oracle(model_path, n_ctx=n_ctx, kv_round="f16", act_round=act_round,
                             capture=capture)
    else:
        from oracles.qwen35 import Qwen35Oracle
        oracle = Qwen35Oracle(model_path, n_ctx=n_ctx, kv_round="f16", act_round=act_round,
                              capture=capture, inject=inject)
    oracle.prefill(prompt)
    own = engine is None
    if own:
        engine = EngineBackend()
        engine.load(ModelRef(os.path.basename(str(model_path)), model_path), RunConfig(n_ctx=n_ctx))
    try:
        if arch == "qwen2":
            return _walk(engine, prompt, ref, tol, _locate_qwen2,
                         lambda kind, il, pos: _qwen2_outputs(kind, engine.bufs, engine.params, pos))
        return _walk(engine, prompt, ref, tol, _locate_qwen35,
                     lambda kind, il, pos: _qwen35_outputs(kind, il, engine.bufs, engine.params,
                                                           pos, oracle.weights),
                     list_missing=True)
    finally:
        if own:
            engine.close()


def _locate_qwen2(name: str) -> tuple[str, int] | None:
    """(node kind, layer) of a mapped qwen2 engine node (the head: ("output", -1)), else None."""
    m = _NODE.match(name)
    if m is not None:
        return m.group(2), int(m.group(1))
    return ("output", -1) if name == "output" else None


def _qwen2_outputs(kind: str, bufs, p, pos: int) -> list[tuple[str, np.ndarray]]:
    if kind == "output":  # the head: the oracle captured the last prompt row only
        return [("result_output", bufs.logits.get().astype(np.float64))]
    return _engine_outputs(kind, bufs, p, pos)


def _locate_qwen35(name: str) -> tuple[str, int] | None:
    """(node kind, layer) of a mapped qwen35 engine node (token_embd, output: layer -1)."""
    m = _NODE35.match(name)
    if m is not None:
        return m.group(2), int(m.group(1))
    return (name, -1) if name in ("token_embd", "output") else None


@functools.cache
def _part_of(name: str) -> str:
    """The unsplit node a part belongs to: a node split by GGML type (ops.gemv_nodes with
    GGUF_HARNESS_GEMV_KQ_MIXED=split names its parts blk.3.qkv.q4_k, blk.3.qkv.q6_k) is
    compared as blk.3.qkv after its last part; any other name is itself."""
    from backends.engine.formats import ENGINE_TYPES
    base, _, tail = name.rpartition(".")
    return base if base and tail in {t.lower() for t in ENGINE_TYPES.values()} else name


def _walk(engine, prompt: list[int], ref: dict, tol: float, locate, outputs,
          list_missing: bool = False) -> LayerDiff:
    """Run the prompt through `engine` node by node and compare (module doc). locate: node
    name -> (kind, layer) or None (not mapped); outputs(kind, layer, position) -> [(oracle
    name, engine value float64 [1, ...])] read after that node; list_missing: after each
    position, every oracle node of that position left uncompared is reported with status
    "missing" (qwen35; the qwen2 report lists compared nodes only)."""
    rep = LayerDiff(tol)
    bufs = engine.bufs
    engine.reset()
    last = len(prompt) - 1
    for pos, tok in enumerate(prompt):
        bufs.state.set(np.array([tok, pos, 0, 0], np.int32), stream=engine.stream)
        nodes = (engine.step_exec if pos == last else engine.prompt_exec).nodes
        done: set[tuple[str, int]] = set()
        with engine.stream:
            for j, node in enumerate(nodes):
                node.launch(pdl_ok=False)
                at = locate(_part_of(node.name))
                if at is None:
                    continue
                if j + 1 < len(nodes) and nodes[j + 1].name != node.name and \
                        _part_of(nodes[j + 1].name) == _part_of(node.name):
                    continue  # a node split by type: its outputs are final after its last part
                if j + 1 < len(nodes) and nodes[j + 1].name == node.name + ".merge":
                    continue  # split attention (v3): the output is final after its merge node
                engine.stream.synchronize()
                kind, il = at
                for name, val in outputs(kind, il, pos):
                    whole = name in WHOLE_CALL  # one value per oracle call: the last position's
                    if (name, il) in ref and (pos == last or not whole):
                        want = ref[(name, il)] if whole else ref[(name, il)][pos]
                        rep.nodes.append(compare_node(pos, name, il, want, val, tol))
                        done.add((name, il))
        if list_missing:
            rep.nodes += [compare_node(pos, n, il, a, None, tol) for (n, il), a in ref.items()
                          if (n, il) not in done and (pos == last or n not in WHOLE_CALL)]
    engine.pos = len(prompt)
    return rep
