"""Float64 multi-section rotary embedding (ggml_rope_multi, M-RoPE / interleaved M-RoPE).

qwen35 rotates only the first n_rot dims of each head (64 of 256 in the 27B model), in NEOX
pair order (i, i + n_rot/2), and each pair takes its position from one of four position
streams (t, h, w, e) chosen by `sections` (llama.cpp src/llama-model.cpp: LLM_ARCH_QWEN35 ->
LLAMA_ROPE_TYPE_IMROPE). For text, llama.cpp feeds positions (p, p, p, 0) per token
(src/llama-graph.cpp llm_graph_input_pos::set_input), so only pairs assigned to stream e
differ from plain NEOX RoPE: they are not rotated.

Pair i (0 <= i < n_rot/2), sector = i mod sum(sections):
  IMROPE (interleaved): stream h if sector % 3 == 1 and sector < 3*sections[1]; w if
          sector % 3 == 2 and sector < 3*sections[2]; t if sector % 3 == 0 and
          sector < 3*sections[0]; else e.
  MROPE (contiguous):   t for sector < s0, h for < s0+s1, w for < s0+s1+s2, else e.
  theta = freq_scale * pos[stream] * freq_base^(-2 i / n_rot)   (index i not reset per section)
Sources: ggml/include/ggml.h (ggml_rope_multi comment, GGML_ROPE_TYPE_IMROPE = 40),
ggml/src/ggml-cpu/ops.cpp ggml_mrope_cache_init (sector rules) and rope_yarn with
ext_factor = 0 and attn_factor = 1 (YaRN off).
"""
from __future__ import annotations

import numpy as np

from harness.errors import ConfigError

IMROPE, MROPE = "imrope", "mrope"


def pair_streams(n_pairs: int, sections, mode: str = IMROPE) -> np.ndarray:
    """int [n_pairs]: position stream (0 t, 1 h, 2 w, 3 e) of each rotated pair."""
    s = [int(v) for v in sections]
    if len(s) != 4 or min(s) < 0 or sum(s) <= 0:
        raise ConfigError(f"rope sections {sections}: need 4 counts >= 0 with a positive sum")
    if mode not in (IMROPE, MROPE):
        raise ConfigError(f"rope mode {mode!r} is not one of {IMROPE}, {MROPE}")
    out = np.empty(n_pairs, dtype=np.int64)
    for i in range(n_pairs):
        sec = i % sum(s)
        if mode == IMROPE:
            out[i] = next((a for a in (1, 2, 0) if sec % 3 == a and sec < 3 * s[a]), 3)
        else:
            bounds = np.cumsum(s[:3])
            out[i] = int(np.searchsorted(bounds, sec, side="right"))
    return out


def text_positions(positions) -> np.ndarray:
    """int [n, 4] streams (p, p, p, 0) for 1-D text positions [n] (llama-graph.cpp)."""
    p = np.asarray(positions, dtype=np.int64).reshape(-1)
    return np.stack([p, p, p, np.zeros_like(p)], axis=1)


def rope_multi(x, positions, n_rot: int, sections, freq_base: float, freq_scale: float = 1.0,
               mode: str = IMROPE) -> np.ndarray:
    """Rotate the first n_rot dims of every head; dims >= n_rot pass through.

    x: [n, H, D]; positions: [n] text positions or [n, 4] streams; n_rot even, <= D.
    For pair i with a = x[.., i], b = x[.., i + n_rot/2] and theta as in the module doc:
        out[.., i] = a cos(theta) - b sin(theta)
        out[.., i + n_rot/2] = a sin(theta) + b cos(theta)
    Returns float64 [n, H, D]. Raises ConfigError on bad shapes, n_rot or sections.
    """
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 3:
        raise ConfigError(f"rope_multi: x must be [n, H, D], got {x.shape}")
    if n_rot % 2 or not 0 < n_rot <= x.shape[2]:
        raise ConfigError(f"rope_multi: n_rot {n_rot} must be even and in (0, {x.shape[2]}]")
    pos = np.asarray(positions, dtype=np.int64)
    pos = text_positions(pos) if pos.ndim == 1 else pos
    if pos.shape != (x.shape[0], 4):
        raise ConfigError(f"rope_multi: positions {pos.shape} do not fit {x.shape[0]} tokens")
    half = n_rot // 2
    streams = pair_streams(half, sections, mode)  # [half]
    inv_freq = float(freq_base) ** (-2.0 * np.arange(half) / n_rot)  # [half]
    theta = float(freq_scale) * pos[:, streams].astype(np.float64) * inv_freq  # [n, half]
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    a, b = x[..., :half], x[..., half:n_rot]
    out = x.copy()
    out[..., :half] = a * cos - b * sin
    out[..., half:n_rot] = a * sin + b * cos
    return out
