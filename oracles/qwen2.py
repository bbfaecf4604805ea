"""Float64 reference forward of llama.cpp's `qwen2` architecture (Qwen2 / Qwen2.5).

Graph: llama.cpp src/models/qwen2.cpp (llm_build_qwen2); tensors and their shapes:
src/llama-model.cpp load_tensors, case LLM_ARCH_QWEN2 (output.weight optional: tied to
token_embd when absent; output.bias optional). Per layer il, for the batch x [n, d]:

    h = rms_norm(x) * attn_norm                                    "attn_norm"
    q, k, v = h Wq^T + bq, h Wk^T + bk, h Wv^T + bv               "Vcur" [n, Hkv, Dh]
    q, k = rope_neox(q), rope_neox(k) at positions n_past..       "Qcur", "Kcur"
    a = softmax(q k^T / sqrt(Dh) + causal mask) v (GQA)            "kqv_out" [n, H*Dh]
    ffn_inp = a Wo^T + x                                           "attn_out" (before +x), "ffn_inp"
    f = (silu(g Wg^T) * (g Wu^T)) Wd^T, g = rms_norm(ffn_inp) * ffn_norm   "ffn_norm", "ffn_out"
    x = f + ffn_inp                                                "l_out"
then logits = rms_norm(x[last]) * output_norm  Wout^T             "result_norm", "result_output"
Capture names are llama.cpp's cb() names where it has one ("attn_out" = its wo product).
All arithmetic float64 (oracles.ops); weights are exact dequantised values (oracles.weights).
"""

from __future__ import annotations

import os
import time
from typing import Callable

import numpy as np

from harness.errors import ConfigError
from harness.gguf_file import open_gguf
from oracles import actquant, ops
from oracles.qwen2_params import Qwen2Params, read_params
from oracles.sequence import TokenSequence
from oracles.weights import GGUFWeights

Capture = Callable[[str, int, np.ndarray], None]  # (name, layer or -1, float64 array)
MAX_KV_BYTES = 16 << 30  # refuse a float64 KV cache larger than this (bounded allocation)
LAYER_TENSORS = ("attn_norm.weight", "attn_q.weight", "attn_q.bias", "attn_k.weight",
                 "attn_k.bias", "attn_v.weight", "attn_v.bias", "attn_output.weight",
                 "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")


def _expected_shapes(p: Qwen2Params, n_vocab: int) -> dict[str, tuple[int, ...]]:
    """GGUF ne of every tensor the forward reads (llama-model.cpp, LLM_ARCH_QWEN2)."""
    ne = {"token_embd.weight": (p.n_embd, n_vocab), "output_norm.weight": (p.n_embd,)}
    layer = {"attn_norm.weight": (p.n_embd,), "attn_q.weight": (p.n_embd, p.n_embd_q),
             "attn_q.bias": (p.n_embd_q,), "attn_k.weight": (p.n_embd, p.n_embd_kv),
             "attn_k.bias": (p.n_embd_kv,), "attn_v.weight": (p.n_embd, p.n_embd_kv),
             "attn_v.bias": (p.n_embd_kv,), "attn_output.weight": (p.n_embd_q, p.n_embd),
             "ffn_norm.weight": (p.n_embd,), "ffn_gate.weight": (p.n_embd, p.n_ff),
             "ffn_up.weight": (p.n_embd, p.n_ff), "ffn_down.weight": (p.n_ff, p.n_embd)}
    for il in range(p.n_layer):
        ne.update({f"blk.{il}.{k}": v for k, v in layer.items()})
    return ne


class Qwen2Oracle(TokenSequence):
    """Stateful float64 qwen2 forward with a float64 KV cache.

    model_path: GGUF file; n_ctx: KV cache length in tokens (default min(context_length,
    2048)); cache_dir / sha256: optional dequantised-weight cache (oracles.weights);
    kv_round: None (float64 KV cache) or "f16" (values rounded to fp16 when cached);
    act_round: None, or "engine": every matrix product's input rounded as the engine's q16
    GEMV rounds it (oracles.actquant.round_q16), so engine tests separate kernel error from
    that deliberate rounding; or "q8_1": as llama.cpp's CUDA mmvq rounds it (int8 codes,
    fp16 scale and sum, legacy offsets folded with the sum: actquant.q8_1_parts), float
    weight types unrounded;
    capture: optional callback(name, layer, array) for named intermediates (layer -1 for
    the head). All weights are dequantised and shape-checked here, so errors surface at load.
    Raises UnsupportedError (architecture, rope scaling, tensor type), ModelError (missing
    key / tensor, wrong shape, malformed file), ConfigError (n_ctx out of range).
    Attributes: params, n_vocab, n_ctx, n_past, load_seconds, weights.
    """

    def __init__(self, model_path: str | os.PathLike, n_ctx: int | None = None,
                 cache_dir: str | os.PathLike | None = None, sha256: str | None = None,
                 capture: Capture | None = None, kv_round: str | None = None,
                 act_round: str | None = None) -> None:
        t0 = time.perf_counter()
        if kv_round not in (None, "f16"):
            raise ConfigError(f"kv_round must be None or 'f16', got {kv_round!r}")
        if act_round not in (None, "engine", "q8_1"):
            raise ConfigError(f"act_round must be None, 'engine' or 'q8_1', got {act_round!r}")
        self.act_round = act_round
        self._offsets: dict[str, np.ndarray] = {}  # act_round "q8_1": legacy offsets per tensor
        # kv_round="f16": store K and V rounded to fp16 as llama.cpp's and the engine's f16
        # KV caches do, so kernel tests can separate kernel error from KV precision
        self.kv_round = kv_round
        info = open_gguf(model_path)
        self.params = p = read_params(info)
        self.weights = w = GGUFWeights(info, cache_dir=cache_dir, sha256=sha256)
        self.n_vocab = int(info.tensor("token_embd.weight").ne[-1])
        self._out_name = "output.weight" if w.has("output.weight") else "token_embd.weight"
        shapes = _expected_shapes(p, self.n_vocab)
        if self._out_name == "output.weight":
            shapes["output.weight"] = (p.n_embd, self.n_vocab)
        for name, ne in shapes.items():
            w.check_shape(name, ne)
        self._out_bias = "output.bias" if w.has("output.bias") else None
        if self._out_bias:
            w.check_shape("output.bias", (self.n_vocab,))
        self.n_ctx = self._check_ctx(n_ctx)
        for name in shapes:
            if name != "token_embd.weight" or self._out_name == name:
                w.get(name)  # dequantise everything now: errors and cost at load time
        kv_shape = (p.n_layer, self.n_ctx, p.n_head_kv, p.head_dim)
        self._k = np.zeros(kv_shape, dtype=np.float64)  # [n_layer, n_ctx, Hkv, Dh]
        self._v = np.zeros(kv_shape, dtype=np.float64)
        self.capture = capture
        self.n_past = 0
        self.load_seconds = time.perf_counter() - t0

    def _check_ctx(self, n_ctx: int | None) -> int:
        p = self.params
        n = min(p.n_ctx_train, 2048) if n_ctx is None else int(n_ctx)
        kv_bytes = 2 * p.n_layer * n * p.n_embd_kv * 8
        if n < 1 or kv_bytes > MAX_KV_BYTES:
            raise ConfigError(f"n_ctx {n}: need >= 1 and a float64 KV cache <= "
                              f"{MAX_KV_BYTES >> 30} GiB (this would take {kv_bytes / 2**30:.1f} GiB)")
        return n

    def reset(self) -> None:
        """Empty the KV cache (position back to 0); stale rows are never read again."""
        self.n_past = 0

    def _layer(self, il: int, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        p, w, pre = self.params, self.weights, f"blk.{il}."
        h = ops.rms_norm(x, w.vector64(pre + "attn_norm.weight"), p.eps)
        self._node("attn_norm", il, h)
        a = self._attention(il, h, pos)
        o = self._lin(pre + "attn_output.weight", a)
        self._node("attn_out", il, o)
        ffn_inp = o + x
        self._node("ffn_inp", il, ffn_inp)
        g = ops.rms_norm(ffn_inp, w.vector64(pre + "ffn_norm.weight"), p.eps)
        self._node("ffn_norm", il, g)
        f = ops.swiglu(self._lin(pre + "ffn_gate.weight", g), self._lin(pre + "ffn_up.weight", g))
        self._node("ffn_swiglu", il, f)  # llama-graph.cpp build_ffn's cb name for SwiGLU
        f = self._lin(pre + "ffn_down.weight", f)
        self._node("ffn_out", il, f)
        out = f + ffn_inp
        self._node("l_out", il, out)
        return out

    def _attention(self, il: int, h: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """QKV projections, RoPE, KV-cache write, causal GQA attention -> [n, H*Dh]."""
        p, w, pre, n = self.params, self.weights, f"blk.{il}.", h.shape[0]
        q = self._lin(pre + "attn_q.weight", h, pre + "attn_q.bias").reshape(n, p.n_head, p.head_dim)
        k = self._lin(pre + "attn_k.weight", h, pre + "attn_k.bias").reshape(n, p.n_head_kv, p.head_dim)
        v = self._lin(pre + "attn_v.weight", h, pre + "attn_v.bias").reshape(n, p.n_head_kv, p.head_dim)
        q = ops.rope_neox(q, pos, p.n_rot, p.freq_base, p.freq_scale)
        k = ops.rope_neox(k, pos, p.n_rot, p.freq_base, p.freq_scale)
        self._node("Qcur", il, q)
        self._node("Kcur", il, k)
        self._node("Vcur", il, v)
        if self.kv_round == "f16":
            k, v = (a.astype(np.float16).astype(np.float64) for a in (k, v))
        self._k[il, pos] = k
        self._v[il, pos] = v
        kv_len = int(pos[-1]) + 1
        a = ops.attention(q, self._k[il], self._v[il], pos, kv_len)  # [n, H, Dh]
        a = a.reshape(n, p.n_embd_q)
        self._node("kqv_out", il, a)
        return a

    def _lin(self, name: str, x: np.ndarray, bias: str | None = None) -> np.ndarray:
        """x @ W^T (+ b) in float64; with act_round "engine", x first rounded like the engine."""
        if self.act_round == "engine":
            x = actquant.round_q16(x)
        elif self.act_round == "q8_1":
            return self._lin_q8_1(name, x, bias)
        return self.weights.linear(name, x, bias)

    def _lin_q8_1(self, name: str, x: np.ndarray, bias: str | None) -> np.ndarray:
        t = self.weights.info.tensor(name)
        if t.type_id in actquant.Q8_1_FLOAT_TYPES:  # llama.cpp does not round x for these
            return self.weights.linear(name, x, bias)
        parts = [actquant.q8_1_parts(r) for r in x]
        y = self.weights.linear(name, np.stack([actquant.q8_1_xhat(pr, x.shape[1]) for pr in parts]), bias)
        if t.type_id in actquant.Q8_1_OFFSET:
            offs = self._offsets.get(name)
            if offs is None:
                offs = self._offsets[name] = actquant.q8_1_offsets(self.weights.info.tensor_data(name), t.type_id)
            y += np.stack([actquant.q8_1_offset_term(offs, pr) for pr in parts])
        return y

    def _head(self, x_last: np.ndarray) -> np.ndarray:
        """Output norm and LM head on [1, d]; float64 [n_vocab] logits."""
        return self._head_rows(x_last)[0]

    def _head_rows(self, x: np.ndarray) -> np.ndarray:
        """Output norm and LM head on [n, d], one product; float64 [n, n_vocab] logits.
        Captured "result_output" is [n_vocab] for one row (as llama.cpp's last-token
        output), [n, n_vocab] for several."""
        w = self.weights
        h = ops.rms_norm(x, w.vector64("output_norm.weight"), self.params.eps)
        self._node("result_norm", -1, h)
        logits = self._lin(self._out_name, h, self._out_bias)
        self._node("result_output", -1, logits[0] if len(logits) == 1 else logits)
        return logits
