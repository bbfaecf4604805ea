"""Float64 reference ops of the Gated DeltaNet (linear attention) layers of qwen35.

Semantics follow llama.cpp's graph (src/models/qwen35.cpp build_layer_attn_linear,
src/models/delta-net-base.cpp build_conv_state / build_delta_net_*) and ggml's CPU kernels
(ggml/src/ggml-cpu/ops.cpp: ssm_conv_f32, gated_delta_net_one_chunk; ggml-impl.h
ggml_compute_softplus_f32). The recurrence is the gated delta rule of flash-linear-attention
(fla/ops/gated_delta_rule/naive.py, naive_recurrent_gated_delta_rule). Shapes in numpy order.

State layout: ggml keeps the [S_k, S_v] state of a head transposed, M[j, i] = S[i, j]
(row j of M = column j of S, "state is stored transposed" in ops.cpp). Here too: state
[H_v, S_v, S_k] float64, so it can be compared element for element with llama.cpp's.
"""
from __future__ import annotations

import numpy as np

from harness.errors import ConfigError

F64 = np.float64


def sigmoid(x) -> np.ndarray:
    """1 / (1 + exp(-x)) without overflow (exp of -|x| only). float64, shape of x.
    Source: ggml_sigmoid (ggml/src/ggml-cpu/vec.h ggml_vec_sigmoid_f32)."""
    x = np.asarray(x, dtype=F64)
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def softplus(x) -> np.ndarray:
    """log(1 + exp(x)), and x itself above 20 exactly as ggml_compute_softplus_f32
    (ggml/src/ggml-impl.h) does. float64, shape of x."""
    x = np.asarray(x, dtype=F64)
    return np.where(x > 20.0, x, np.logaddexp(0.0, np.minimum(x, 20.0)))


def l2_norm(x, eps: float) -> np.ndarray:
    """x / sqrt(sum(x^2) + eps) over the last axis. float64, shape of x.

    Source: llama.cpp src/models/models.h build_gdn_l2_norm = ggml_rms_norm(x, eps/n) scaled
    by 1/sqrt(n), which is this expression (eps = the model's RMS epsilon).
    """
    x = np.asarray(x, dtype=F64)
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + float(eps))


def causal_conv1d(x, conv_state, w) -> tuple[np.ndarray, np.ndarray]:
    """Depthwise causal convolution over tokens with a rolling state (no activation).

    x: [n, C] new inputs; conv_state: [K-1, C] the previous K-1 inputs (zeros after reset);
    w: [C, K] kernel (GGUF ne [K, C]). With xp = concat(conv_state, x) ([K-1+n, C]):
        y[t, c] = sum_{i<K} xp[t + i, c] * w[c, i]
    Returns (y [n, C], new_state = xp[-(K-1):]) float64.
    Source: llama.cpp delta-net-base.cpp build_conv_state (concat state and the transposed
    inputs, keep the last K-1 columns) and ggml ops.cpp ssm_conv_f32 (sliding row dot product).
    Raises ConfigError on inconsistent shapes.
    """
    x, st, w = (np.asarray(a, dtype=F64) for a in (x, conv_state, w))
    n_k = w.shape[1]
    if x.ndim != 2 or st.shape != (n_k - 1, x.shape[1]) or w.shape[0] != x.shape[1]:
        raise ConfigError(f"causal_conv1d: x {x.shape}, state {st.shape}, kernel {w.shape} "
                          "do not fit [n, C], [K-1, C], [C, K]")
    xp = np.concatenate([st, x], axis=0)  # [K-1+n, C]
    n = x.shape[0]
    y = np.zeros_like(x)
    for i in range(n_k):
        y += xp[i:i + n] * w[:, i]
    return y, xp[xp.shape[0] - (n_k - 1):].copy()


def _check_gdn(q, k, v, g, beta, state) -> None:
    n, h_k, s_k = q.shape
    _, h_v, s_v = v.shape
    ok = (k.shape == q.shape and v.shape[0] == n and s_k == s_v and h_v % h_k == 0
          and g.shape == (n, h_v) and beta.shape == (n, h_v) and state.shape == (h_v, s_v, s_k))
    if not ok:
        raise ConfigError(f"gated_delta_rule: q {q.shape}, k {k.shape}, v {v.shape}, g {g.shape}, "
                          f"beta {beta.shape}, state {state.shape} do not fit [n, Hk, S], "
                          "[n, Hv, S], [n, Hv], [n, Hv], [Hv, S, S] with Hv % Hk == 0")


def gated_delta_rule(q, k, v, g, beta, state) -> tuple[np.ndarray, np.ndarray]:
    """The gated delta rule over n tokens, one value head at a time, in llama.cpp's order.

    q, k: [n, Hk, S] (already L2-normalised); v: [n, Hv, S]; g: [n, Hv] log-decay (<= 0);
    beta: [n, Hv] in (0, 1); state: [Hv, S_v, S_k] transposed state M (see module doc).
    Value head h reads key/query head h % Hk (ggml's tiled broadcast, ops.cpp iq1 = iv1 % neq1).
    Per token, with M the state of head h:
        M <- exp(g) * M                          decay
        delta = beta * (v - M k)                 delta-rule correction (M k = S^T k)
        M <- M + delta (x) k                     rank-1 update (S += k delta^T)
        out = (M q) / sqrt(S)                    output from the updated state
    Returns (out [n, Hv, S], new state [Hv, S, S]) float64; the input state is not modified.
    Source: ggml ops.cpp ggml_compute_forward_gated_delta_net_one_chunk (scalar-gate path,
    scale 1/sqrt(S_v)); fla naive_recurrent_gated_delta_rule computes the same recurrence.
    """
    q, k, v, g, beta = (np.asarray(a, dtype=F64) for a in (q, k, v, g, beta))
    m = np.array(state, dtype=F64)  # copy: [Hv, S_v, S_k]
    _check_gdn(q, k, v, g, beta, m)
    n, h_k, s = q.shape
    head = np.arange(v.shape[1]) % h_k  # value head -> key head (tiled)
    out = np.empty_like(v)
    scale = 1.0 / np.sqrt(s)
    for t in range(n):
        kt, qt = k[t, head], q[t, head]  # [Hv, S]
        m *= np.exp(g[t])[:, None, None]
        delta = beta[t][:, None] * (v[t] - np.einsum("hji,hi->hj", m, kt))  # [Hv, S_v]
        m += delta[:, :, None] * kt[:, None, :]
        out[t] = np.einsum("hji,hi->hj", m, qt) * scale
    return out, m


def gated_rms_norm(x, w, z, eps: float) -> np.ndarray:
    """RMS norm over the last axis times w, times silu(z): the DeltaNet output norm.

    x, z: [n, Hv, S]; w: [S] (ssm_norm, stored as is, not as 1 + w). Returns float64 [n, Hv, S].
    Source: llama.cpp qwen35.cpp build_norm_gated (build_norm RMS, ggml_silu(gate), ggml_mul).
    """
    x, z = np.asarray(x, dtype=F64), np.asarray(z, dtype=F64)
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + float(eps)) * np.asarray(w, F64)
    return y * z * sigmoid(z)
