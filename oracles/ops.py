"""Float64 reference ops of a llama.cpp transformer block (pure numpy functions, no state).

Every function takes and returns float64 arrays (inputs are upcast; float32 -> float64 is
exact). Semantics follow the ggml CPU ops used by llama.cpp's graph builders
(llama.cpp src/models/qwen2.cpp, src/llama-graph.cpp build_norm / build_attn_mha / build_ffn):

- rms_norm:  ggml_rms_norm + ggml_mul       (ggml/src/ggml-cpu/ops.cpp rms_norm_f32)
- rope_neox: ggml_rope_ext, GGML_ROPE_TYPE_NEOX (ggml/src/ggml-cpu/ops.cpp rope_f32,
             rope_yarn with ext_factor = 0, i.e. no YaRN ramp)
- attention: ggml_mul_mat(k, q) + ggml_soft_max_ext(kq, mask, scale) + ggml_mul_mat(v, kq)
             with GQA broadcast (ggml.c ggml_mul_mat: src0 dims broadcast over src1)
- swiglu:    ggml_swiglu_split (silu(gate) * up, LLM_FFN_SILU + LLM_FFN_PAR)
- linear:    ggml_mul_mat(W, x) + optional ggml_add(bias)
Shapes are given in numpy order (last axis contiguous = ggml ne[0]).
"""

from __future__ import annotations

import numpy as np

from harness.errors import ConfigError

F64 = np.float64


def _f64(a) -> np.ndarray:
    return np.asarray(a, dtype=F64)


def rms_norm(x, w, eps: float) -> np.ndarray:
    """RMS norm times weight: y[i, j] = x[i, j] / sqrt(mean_j(x[i]^2) + eps) * w[j].

    x: [n, d]; w: [d] (or None for the bare norm); eps: the model's
    `<arch>.attention.layer_norm_rms_epsilon`. Returns float64 [n, d].
    Source: ggml/src/ggml-cpu/ops.cpp ggml_compute_forward_rms_norm_f32 (mean of squares over
    ne[0], scale 1/sqrt(mean + eps)), then ggml_mul by the norm weight (llama-graph.cpp build_norm).
    """
    x = _f64(x)
    mean_sq = np.mean(x * x, axis=-1, keepdims=True)  # [n, 1]
    y = x / np.sqrt(mean_sq + float(eps))
    return y if w is None else y * _f64(w)


def rope_angles(positions, n_rot: int, freq_base: float, freq_scale: float) -> np.ndarray:
    """Rotation angles theta[t, i] = freq_scale * pos[t] * freq_base^(-2 i / n_rot).

    positions: [n_tokens] ints; returns float64 [n_tokens, n_rot // 2] radians.
    Source: ggml/src/ggml-cpu/ops.cpp rope cache (theta_scale = freq_base^(-2/n_dims)) and
    rope_yarn (theta_interp = freq_scale * theta_extrap; ext_factor 0 keeps it).
    """
    i = np.arange(n_rot // 2, dtype=F64)
    inv_freq = float(freq_base) ** (-2.0 * i / n_rot)  # [n_rot/2]
    pos = _f64(positions).reshape(-1, 1)
    return float(freq_scale) * pos * inv_freq


def rope_neox(x, positions, n_rot: int, freq_base: float, freq_scale: float = 1.0) -> np.ndarray:
    """Rotary position embedding, NEOX layout (pairs (i, i + n_rot/2)).

    x: [n_tokens, n_heads, head_dim]; positions: [n_tokens]; n_rot: rotated dims (even,
    <= head_dim; dims >= n_rot pass through). For i < n_rot/2, with a = x[.., i],
    b = x[.., i + n_rot/2], theta from rope_angles:
        out[.., i] = a cos(theta) - b sin(theta);  out[.., i + n_rot/2] = a sin(theta) + b cos(theta).
    Returns float64 [n_tokens, n_heads, head_dim]. Raises ConfigError on bad n_rot / shapes.
    Source: ggml/src/ggml-cpu/ops.cpp ggml_compute_forward_rope (NEOX: n_offset = n_dims/2),
    with YaRN off (mscale = attn_factor = 1).
    """
    x = _f64(x)
    if x.ndim != 3:
        raise ConfigError(f"rope_neox: x must be [n_tokens, n_heads, head_dim], got {x.shape}")
    if n_rot % 2 or not 0 < n_rot <= x.shape[2]:
        raise ConfigError(f"rope_neox: n_rot {n_rot} must be even and in (0, {x.shape[2]}]")
    if np.shape(positions) != (x.shape[0],):
        raise ConfigError(f"rope_neox: positions shape {np.shape(positions)} != ({x.shape[0]},)")
    theta = rope_angles(positions, n_rot, freq_base, freq_scale)[:, None, :]  # [n, 1, n_rot/2]
    cos, sin = np.cos(theta), np.sin(theta)
    half = n_rot // 2
    a, b = x[..., :half], x[..., half:n_rot]
    out = x.copy()
    out[..., :half] = a * cos - b * sin
    out[..., half:n_rot] = a * sin + b * cos
    return out


def softmax(x, axis: int = -1) -> np.ndarray:
    """Numerically stable softmax along `axis` (max subtracted; -inf entries give 0).

    x: any shape with at least one finite entry per slice. Returns float64 of x's shape.
    Source: ggml/src/ggml-cpu/ops.cpp soft_max_f32 (max subtraction, exp, normalise).
    """
    x = _f64(x)
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / np.sum(e, axis=axis, keepdims=True)


def attention(q, k_cache, v_cache, q_positions, kv_len: int, scale: float | None = None) -> np.ndarray:
    """Causal multi-head attention with grouped-query (GQA) KV heads.

    q: [n_q, H, Dh]; k_cache, v_cache: [>= kv_len, Hkv, Dh], row j holds position j;
    q_positions: [n_q] ints < kv_len; kv_len: number of valid cache rows; scale: default
    1/sqrt(Dh) (the value llama.cpp src/models/qwen2.cpp passes to build_attn).
    Query head h reads KV head h // (H / Hkv) (ggml_mul_mat broadcast of src0 over src1 dim 2).
    Key j is visible to a query at position p iff j <= p (llama-kv-cache.cpp causal mask).
    out[t, h] = sum_j softmax_j(scale * q[t, h] . k[j, hk]) v[j, hk]. Returns float64 [n_q, H, Dh].
    Raises ConfigError on inconsistent shapes or positions.
    """
    q, k, v = _f64(q), _f64(k_cache)[:kv_len], _f64(v_cache)[:kv_len]
    n_q, n_head, d_head = q.shape
    n_head_kv = k.shape[1]
    pos = np.asarray(q_positions, dtype=np.int64)
    _check_attention(q.shape, k.shape, v.shape, pos, kv_len)
    group = n_head // n_head_kv
    scale = 1.0 / np.sqrt(d_head) if scale is None else float(scale)
    qg = q.reshape(n_q, n_head_kv, group, d_head)  # head h = hk * group + g
    scores = np.einsum("qhgd,khd->hgqk", qg, k) * scale  # [Hkv, G, n_q, kv_len]
    visible = np.arange(kv_len)[None, :] <= pos[:, None]  # [n_q, kv_len]
    scores = np.where(visible, scores, -np.inf)
    probs = softmax(scores, axis=-1)
    out = np.einsum("hgqk,khd->qhgd", probs, v)  # [n_q, Hkv, G, Dh]
    return out.reshape(n_q, n_head, d_head)


def _check_attention(q_shape, k_shape, v_shape, pos: np.ndarray, kv_len: int) -> None:
    n_q, n_head, d_head = q_shape
    if k_shape != v_shape or len(k_shape) != 3 or k_shape[0] != kv_len or k_shape[2] != d_head:
        raise ConfigError(f"attention: k {k_shape} / v {v_shape} do not match q {q_shape}, kv_len {kv_len}")
    if n_head % k_shape[1]:
        raise ConfigError(f"attention: {n_head} query heads not a multiple of {k_shape[1]} KV heads")
    if pos.shape != (n_q,) or (n_q and (pos.min() < 0 or pos.max() >= kv_len)):
        raise ConfigError(f"attention: q_positions must be [{n_q}] ints in [0, {kv_len})")


def silu(x) -> np.ndarray:
    """x * sigmoid(x), float64 (ggml/src/ggml-cpu/vec.h ggml_silu_f32). Shape of x.

    sigmoid is evaluated from exp(-|x|) so that no exp overflows for large |x|.
    """
    x = _f64(x)
    e = np.exp(-np.abs(x))
    sig = np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    return x * sig


def swiglu(gate, up) -> np.ndarray:
    """silu(gate) * up, same shapes [n, d_ff] (ggml_swiglu_split; llama-graph.cpp build_ffn
    with LLM_FFN_SILU + LLM_FFN_PAR). Returns float64 [n, d_ff]."""
    return silu(gate) * _f64(up)


def linear(x, w, b=None) -> np.ndarray:
    """y = x @ W^T (+ b), products and sums in float64.

    x: [n, k]; w: [m, k] (GGUF ne = [k, m]); b: [m] or None. Returns float64 [n, m].
    Source: ggml_mul_mat(W, x) then ggml_add(bias) (llama-graph.cpp build_lora_mm).
    """
    y = _f64(x) @ _f64(w).T
    return y if b is None else y + _f64(b)
