"""Float64 reference forward of llama.cpp's `qwen35` hybrid (Gated DeltaNet + gated attention).

Graph: llama.cpp src/models/qwen35.cpp (llm_build_qwen35 graph, build_layer_attn,
build_layer_attn_linear, build_layer_ffn) on src/models/delta-net-base.cpp; tensors and
shapes: qwen35.cpp load_arch_tensors (MTP blocks after n_layer are not run). Per layer il,
for the batch x [n, E] (capture names are llama.cpp's cb() names):

    h = rms_norm(x) * attn_norm                                            "attn_norm"
    DeltaNet layer (recurrent):
      qkv = h Wqkv^T, z = h Wgate^T                                "linear_attn_qkv_mixed", "z"
      beta = sigmoid(h Wbeta^T); alpha = h Walpha^T                  "beta_sigmoid", "alpha"
      g = softplus(alpha + dt_bias) * ssm_a   (ssm_a = -exp(A_log))      "a_softplus", "gate"
      c = silu(causal_conv1d(qkv, conv state, ssm_conv1d))               "conv_output_silu"
      q, k, v = split(c) as [Hk, S], [Hk, S], [Hv, S]            "q_conv", "k_conv", "v_conv"
      q, k = l2_norm(q), l2_norm(k)                       "q_conv_predelta", "k_conv_predelta"
      o = gated_delta_rule(q, k, v, g, beta, state)             "attn_output", "new_state"
      y = rms_norm_S(o) * ssm_norm * silu(z); out = y Wout^T   "final_output", "linear_attn_out"
    gated attention layer:
      [q | gate] per head = h Wq^T; k, v = h Wk^T, h Wv^T
      q, k = rms_norm_D(q) * q_norm, rms_norm_D(k) * k_norm       "Qcur_normed", "Kcur_normed"
      q, k = rope_multi(q), rope_multi(k) (IMROPE, n_rot dims)          "Qcur", "Kcur", "Vcur"
      a = softmax(q k^T * scale + causal mask) v (GQA)                   "attn_pregate"
      out = (a * sigmoid(gate)) Wo^T                             "attn_gated", "attn_output"
    r = out + x                                                          "attn_residual"
    g = rms_norm(r) * post_attention_norm                                "attn_post_norm"
    s = silu(g Wgate^T) * (g Wup^T); f = s Wdown^T  (SwiGLU)       "ffn_swiglu", "ffn_out"
    x = f + r                                                            "post_ffn", "l_out"
then logits = rms_norm(x[last]) * output_norm Wout^T              "result_norm", "result_output"
Ops: oracles.ops (norm, attention, SwiGLU), oracles.deltanet, oracles.rope_multi.
"""
from __future__ import annotations

import os
import time
from typing import Callable

import numpy as np

from harness.errors import ConfigError
from harness.gguf_file import open_gguf
from oracles import actquant
from oracles import deltanet as dn
from oracles import ops
from oracles.qwen35_params import Qwen35Params, read_params
from oracles.rope_multi import rope_multi
from oracles.sequence import TokenSequence
from oracles.weights import GGUFWeights

Capture = Callable[[str, int, np.ndarray], None]  # (name, layer or -1, float64 array)
Inject = Callable[[np.ndarray], np.ndarray]
MAX_STATE_BYTES = 16 << 30  # refuse a float64 KV cache + recurrent state larger than this
MAX_WEIGHT_BYTES = 32 << 30  # refuse to dequantise more float32 weights than this (27B: 102 GiB)


def _layer_shapes(p: Qwen35Params, il: int) -> dict[str, tuple[int, ...]]:
    e, ff, d = p.n_embd, p.n_ff, p.head_dim
    ne = {"attn_norm.weight": (e,), "post_attention_norm.weight": (e,),
          "ffn_gate.weight": (e, ff), "ffn_up.weight": (e, ff), "ffn_down.weight": (ff, e)}
    if p.recurrent[il]:
        hv, s = p.ssm_dt_rank, p.ssm_d_state
        ne.update({"attn_qkv.weight": (e, p.conv_dim), "attn_gate.weight": (e, p.d_inner),
                   "ssm_conv1d.weight": (p.ssm_d_conv, p.conv_dim), "ssm_dt.bias": (hv,),
                   "ssm_a": (hv,), "ssm_beta.weight": (e, hv), "ssm_alpha.weight": (e, hv),
                   "ssm_norm.weight": (s,), "ssm_out.weight": (p.d_inner, e)})
    else:
        q, kv = p.n_head * d, p.n_head_kv * d
        ne.update({"attn_q.weight": (e, 2 * q), "attn_k.weight": (e, kv),
                   "attn_v.weight": (e, kv), "attn_output.weight": (q, e),
                   "attn_q_norm.weight": (d,), "attn_k_norm.weight": (d,)})
    return {f"blk.{il}.{k}": v for k, v in ne.items()}


def expected_shapes(p: Qwen35Params, n_vocab: int, tied: bool) -> dict[str, tuple[int, ...]]:
    """GGUF ne of every tensor the forward reads (llama.cpp qwen35.cpp load_arch_tensors)."""
    ne = {"token_embd.weight": (p.n_embd, n_vocab), "output_norm.weight": (p.n_embd,)}
    if not tied:
        ne["output.weight"] = (p.n_embd, n_vocab)
    for il in range(p.n_layer):
        ne.update(_layer_shapes(p, il))
    return ne


class Qwen35Oracle(TokenSequence):
    """Stateful float64 qwen35 forward: float64 KV cache for the attention layers, conv and
    delta-rule states for the DeltaNet layers (one sequence).

    model_path: GGUF file; n_ctx: KV length (default min(context_length, 2048)); cache_dir /
    sha256: dequantised-weight cache (oracles.weights); capture(name, layer, array): named
    intermediates (module doc); inject: {(name, layer): fn} replaces the value of a named
    node before the forward continues (fault injection for layer-diff tests); kv_round "f16":
    K/V rounded to fp16 when cached (as an f16 KV cache); act_round "llamacpp": activations of
    quantised matrix products rounded as llama.cpp's CPU backend does (oracles.actquant);
    "engine": every matrix product's input rounded as the engine's q16 GEMV does
    (actquant.round_q16), for engine tests.
    Raises UnsupportedError, ModelError (missing key/tensor, wrong shape) or ConfigError.
    Attributes: params, n_vocab, n_ctx, n_past, load_seconds, weights.
    """

    recurrent_state = True  # DeltaNet conv and delta-rule states (TokenSequence.rewind)

    def __init__(self, model_path: str | os.PathLike, n_ctx: int | None = None,
                 cache_dir: str | os.PathLike | None = None, sha256: str | None = None,
                 capture: Capture | None = None,
                 inject: dict[tuple[str, int], Inject] | None = None,
                 kv_round: str | None = None, act_round: str | None = None) -> None:
        t0 = time.perf_counter()
        if kv_round not in (None, "f16") or act_round not in (None, "llamacpp", "engine"):
            raise ConfigError(f"kv_round must be None or 'f16' and act_round None, 'llamacpp' or "
                              f"'engine', "
                              f"got {kv_round!r}, {act_round!r}")
        self.kv_round, self.act_round = kv_round, act_round
        info = open_gguf(model_path)
        self.params = p = read_params(info)
        self.weights = w = GGUFWeights(info, cache_dir=cache_dir, sha256=sha256)
        self.n_vocab = int(info.tensor("token_embd.weight").ne[-1])
        tied = not w.has("output.weight")
        self._out_name = "token_embd.weight" if tied else "output.weight"
        shapes = expected_shapes(p, self.n_vocab, tied)
        for name, ne in shapes.items():
            w.check_shape(name, ne)
        self._check_biases()
        self.n_ctx = self._check_ctx(n_ctx)
        names = [n for n in shapes if n != "token_embd.weight" or tied]
        need = 4 * sum(info.tensor(n).n_elements for n in names)
        if need > MAX_WEIGHT_BYTES:
            raise ConfigError(f"{info.path.name}: the oracle keeps weights as float32: "
                              f"{need / 2**30:.1f} GiB > {MAX_WEIGHT_BYTES >> 30} GiB allowed")
        for name in names:
            w.get(name)  # dequantise now: errors and cost at load time
        attn = [il for il in range(p.n_layer) if not p.recurrent[il]]
        rec = [il for il in range(p.n_layer) if p.recurrent[il]]
        self._slot = {il: k for k, il in enumerate(attn)} | {il: k for k, il in enumerate(rec)}
        self._k = np.zeros((len(attn), self.n_ctx, p.n_head_kv, p.head_dim))  # [La, ctx, Hkv, D]
        self._v = np.zeros_like(self._k)
        self._conv = np.zeros((len(rec), p.ssm_d_conv - 1, p.conv_dim))  # [Lr, K-1, C]
        self._ssm = np.zeros((len(rec), p.ssm_dt_rank, p.ssm_d_state, p.ssm_d_state))
        self.capture, self.inject = capture, dict(inject or {})
        self.n_past = 0
        self.load_seconds = time.perf_counter() - t0

    def _check_biases(self) -> None:
        p, w = self.params, self.weights
        for il in (i for i in range(p.n_layer) if not p.recurrent[i]):
            for t, m in (("q", 2 * p.n_head * p.head_dim), ("k", p.n_head_kv * p.head_dim),
                         ("v", p.n_head_kv * p.head_dim)):
                if w.has(f"blk.{il}.attn_{t}.bias"):
                    w.check_shape(f"blk.{il}.attn_{t}.bias", (m,))

    def _check_ctx(self, n_ctx: int | None) -> int:
        p = self.params
        n = min(p.n_ctx_train, 2048) if n_ctx is None else int(n_ctx)
        n_attn = p.n_layer - sum(p.recurrent)
        kv = 2 * n_attn * n * p.n_head_kv * p.head_dim * 8
        rec = sum(p.recurrent) * (p.ssm_dt_rank * p.ssm_d_state ** 2 + 3 * p.conv_dim) * 8
        if n < 1 or kv + rec > MAX_STATE_BYTES:
            raise ConfigError(f"n_ctx {n}: need >= 1 and a float64 KV cache + recurrent state <= "
                              f"{MAX_STATE_BYTES >> 30} GiB (this needs "
                              f"{(kv + rec) / 2**30:.1f} GiB)")
        return n

    def reset(self) -> None:
        """Empty the KV cache and zero every conv and delta-rule state (position 0)."""
        self.n_past = 0
        self._conv[:] = 0.0
        self._ssm[:] = 0.0

    def _node(self, name: str, il: int, arr: np.ndarray) -> np.ndarray:
        """A named intermediate: injected replacement (if any), then the capture callback."""
        fn = self.inject.get((name, il))
        if fn is not None:
            arr = np.asarray(fn(arr), dtype=np.float64)
        return super()._node(name, il, arr)

    def _layer(self, il: int, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        p, w, pre = self.params, self.weights, f"blk.{il}."
        h = ops.rms_norm(x, w.vector64(pre + "attn_norm.weight"), p.eps)
        h = self._node("attn_norm", il, h)
        cur = self._deltanet(il, h) if p.recurrent[il] else self._attention(il, h, pos)
        res = self._node("attn_residual", il, cur + x)
        g = self._node("attn_post_norm", il,
                       ops.rms_norm(res, w.vector64(pre + "post_attention_norm.weight"), p.eps))
        f = ops.swiglu(self._lin(pre + "ffn_gate.weight", g), self._lin(pre + "ffn_up.weight", g))
        f = self._node("ffn_swiglu", il, f)  # llama-graph.cpp build_ffn's cb name for SwiGLU
        f = self._node("ffn_out", il, self._lin(pre + "ffn_down.weight", f))
        return self._node("l_out", il, self._node("post_ffn", il, f + res))

    def _deltanet(self, il: int, h: np.ndarray) -> np.ndarray:
        p, w, pre, r, n = self.params, self.weights, f"blk.{il}.", self._slot[il], h.shape[0]
        hk, hv, s = p.ssm_n_group, p.ssm_dt_rank, p.ssm_d_state
        qkv = self._node("linear_attn_qkv_mixed", il, self._lin(pre + "attn_qkv.weight", h))
        z = self._node("z", il, self._lin(pre + "attn_gate.weight", h))  # [n, Hv*S]
        beta = self._node("beta_sigmoid", il, dn.sigmoid(self._lin(pre + "ssm_beta.weight", h)))
        alpha = self._node("alpha", il, self._lin(pre + "ssm_alpha.weight", h))  # [n, Hv]
        sp = self._node("a_softplus", il, dn.softplus(alpha + w.vector64(pre + "ssm_dt.bias")))
        g = self._node("gate", il, sp * w.vector64(pre + "ssm_a"))
        conv, self._conv[r] = dn.causal_conv1d(qkv, self._conv[r], w.get(pre + "ssm_conv1d.weight"))
        c = self._node("conv_output_silu", il, ops.silu(conv))  # [n, C]
        kd = hk * s
        q = self._node("q_conv", il, c[:, :kd].reshape(n, hk, s))
        k = self._node("k_conv", il, c[:, kd:2 * kd].reshape(n, hk, s))
        v = self._node("v_conv", il, c[:, 2 * kd:].reshape(n, hv, s))
        q = self._node("q_conv_predelta", il, dn.l2_norm(q, p.eps))
        k = self._node("k_conv_predelta", il, dn.l2_norm(k, p.eps))
        o, self._ssm[r] = dn.gated_delta_rule(q, k, v, g, beta, self._ssm[r])
        o = self._node("attn_output", il, o)  # [n, Hv, S]
        self._node("new_state", il, self._ssm[r].copy())  # [Hv, S_v, S_k]
        y = dn.gated_rms_norm(o, w.vector64(pre + "ssm_norm.weight"), z.reshape(n, hv, s), p.eps)
        y = self._node("final_output", il, y.reshape(n, p.d_inner))
        return self._node("linear_attn_out", il, self._lin(pre + "ssm_out.weight", y))

    def _lin(self, name: str, x: np.ndarray, bias: str | None = None) -> np.ndarray:
        """x @ W^T (+ b) in float64; with act_round, x first rounded like llama.cpp's CPU."""
        if self.act_round == "engine":  # the engine's q16 GEMV input rounding (qwen2 oracle)
            x = actquant.round_q16(x)
        elif self.act_round:
            x = actquant.round_for(self.weights.info.tensor(name).type_id, x)
        return self.weights.linear(name, x, bias)

    def _bias(self, name: str) -> str | None:
        return name if self.weights.has(name) else None

    def _attention(self, il: int, h: np.ndarray, pos: np.ndarray) -> np.ndarray:
        p, w, pre, n, d = self.params, self.weights, f"blk.{il}.", h.shape[0], self.params.head_dim
        qg = self._lin(pre + "attn_q.weight", h, self._bias(pre + "attn_q.bias"))
        qg = qg.reshape(n, p.n_head, 2 * d)  # per head: [query D | gate D]
        k = self._lin(pre + "attn_k.weight", h, self._bias(pre + "attn_k.bias"))
        v = self._lin(pre + "attn_v.weight", h, self._bias(pre + "attn_v.bias"))
        q = self._node("Qcur_normed", il,
                       ops.rms_norm(qg[..., :d], w.vector64(pre + "attn_q_norm.weight"), p.eps))
        k = self._node("Kcur_normed", il, ops.rms_norm(
            k.reshape(n, p.n_head_kv, d), w.vector64(pre + "attn_k_norm.weight"), p.eps))
        gate = self._node("gate_reshaped", il, qg[..., d:].reshape(n, p.n_head * d))
        rope = (p.n_rot, p.rope_sections, p.freq_base, p.freq_scale)
        q = self._node("Qcur", il, rope_multi(q, pos, *rope))
        k = self._node("Kcur", il, rope_multi(k, pos, *rope))
        v = self._node("Vcur", il, v.reshape(n, p.n_head_kv, d))
        slot = self._slot[il]
        if self.kv_round == "f16":
            k, v = (a.astype(np.float16).astype(np.float64) for a in (k, v))
        self._k[slot, pos], self._v[slot, pos] = k, v
        scale = p.attn_scale or 1.0 / np.sqrt(d)
        a = ops.attention(q, self._k[slot], self._v[slot], pos, int(pos[-1]) + 1, scale)
        a = self._node("attn_pregate", il, a.reshape(n, p.n_head * d))
        a = self._node("attn_gated", il, a * dn.sigmoid(gate))
        return self._node("attn_output", il, self._lin(pre + "attn_output.weight", a))

    def _head(self, x_last: np.ndarray) -> np.ndarray:
        return self._head_rows(x_last)[0]

    def _head_rows(self, x: np.ndarray) -> np.ndarray:
        """Output norm and LM head on [n, d], one product; float64 [n, n_vocab]. The
        "result_output" node is [n_vocab] for one row, [n, n_vocab] for several."""
        w = self.weights
        h = self._node("result_norm", -1,
                       ops.rms_norm(x, w.vector64("output_norm.weight"), self.params.eps))
        logits = self._lin(self._out_name, h)
        out = self._node("result_output", -1, logits[0] if len(logits) == 1 else logits)
        return np.asarray(out).reshape(len(logits), -1)

    def _save_state(self):
        return self._conv.copy(), self._ssm.copy()

    def _load_state(self, saved) -> None:
        self._conv[:], self._ssm[:] = saved
