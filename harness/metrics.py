"""Per-step comparison metrics between a backend's logits and the reference's.

All inputs are logits vectors [n_vocab]; the reference is float64, the backend's float32
(upcast to float64 before any arithmetic).
- NMSE = sum((x - r)^2) / sum(r^2)
- KL(ref || x) = sum_i p_i (log p_i - log q_i), p = softmax(r), q = softmax(x), in nats
- top-k agreement: |topk(r) ∩ topk(x)| / k; top-1 agreement: argmax equal
- reference top-2 margin: r[top1] - r[top2], also relative to the logit range max(r)-min(r)
"""
from __future__ import annotations

import hashlib

import numpy as np


def logits_sha256(logits: np.ndarray) -> str:
    """SHA256 of the logits as little-endian float32 bytes (docs/sources.md §3)."""
    return hashlib.sha256(np.ascontiguousarray(logits, dtype="<f4").tobytes()).hexdigest()


def ids_sha256(ids) -> str:
    """SHA256 of token ids as little-endian int64 (docs/sources.md §3)."""
    return hashlib.sha256(np.asarray(ids, dtype="<i8").tobytes()).hexdigest()


def log_softmax(x: np.ndarray) -> np.ndarray:
    """log softmax in float64, stable (max subtracted)."""
    x = np.asarray(x, dtype=np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def topk(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values, largest first (ties: lower index first)."""
    idx = np.argpartition(-x, k - 1)[:k]
    return idx[np.lexsort((idx, -x[idx]))]


def compare(ref: np.ndarray, x: np.ndarray) -> dict:
    """All per-step figures of x against ref; both [n_vocab]. Raises ValueError on shape mismatch.

    Non-finite values in x make max_abs/NMSE/KL inf and are counted in `nonfinite`.
    """
    if ref.shape != x.shape:
        raise ValueError(f"logits shapes differ: reference {ref.shape}, backend {x.shape}")
    r = np.asarray(ref, dtype=np.float64)
    y = np.asarray(x, dtype=np.float64)
    nonfinite = int((~np.isfinite(y)).sum())
    t5r, t5x = topk(r, 5), topk(y, 5) if nonfinite == 0 else topk(np.nan_to_num(y, nan=-np.inf), 5)
    out = {
        "top1_ref": int(t5r[0]),
        "top5": [[int(i), float(y[i])] for i in t5x],
        "top1": int(t5x[0]),
        "top1_agree": bool(t5r[0] == t5x[0]),
        "top5_overlap": len(set(t5r.tolist()) & set(t5x.tolist())) / 5.0,
        "ref_margin": float(r[t5r[0]] - r[t5r[1]]),
        "ref_margin_rel": float((r[t5r[0]] - r[t5r[1]]) / max(r.max() - r.min(), 1e-300)),
        "nonfinite": nonfinite,
    }
    if nonfinite:
        out.update(max_abs=float("inf"), nmse=float("inf"), kl=float("inf"))
        return out
    d = y - r
    lp, lq = log_softmax(r), log_softmax(y)
    out.update(
        max_abs=float(np.abs(d).max()),
        max_abs_index=int(np.abs(d).argmax()),
        nmse=float((d * d).sum() / max((r * r).sum(), 1e-300)),
        kl=float(max((np.exp(lp) * (lp - lq)).sum(), 0.0)),
    )
    return out
