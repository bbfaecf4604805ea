"""Hyperparameters of a llama.cpp `qwen2` model, read and checked from GGUF metadata.

Keys, defaults and checks follow llama.cpp src/llama-model.cpp (load_hparams: generic keys,
then the LLM_ARCH_QWEN2 case) and src/models/qwen2.cpp (asserts head_dim_k == head_dim_v
== n_rot); key names from src/llama-arch.cpp (LLM_KV_*), gguf-py gguf/constants.py (Keys).
Required: block_count, context_length, embedding_length, feed_forward_length,
attention.head_count, attention.layer_norm_rms_epsilon. Optional as in llama.cpp:
attention.head_count_kv (default head_count), rope.freq_base (10000), rope.dimension_count,
attention.key_length / value_length (embedding_length / head_count), rope.scaling.type
("linear"), rope.scale_linear or rope.scaling.factor (0 = none; freq_scale = 1 / factor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from harness.errors import ModelError, UnsupportedError
from harness.gguf_file import GGUFInfo

ARCH = "qwen2"
MAX_DIM = 1 << 20      # bound on any width read from the file (hidden, FFN, vocab, heads)
MAX_LAYERS = 1024
ROPE_TYPES = ("none", "linear")  # YaRN / LongRoPE ramps are not implemented here


@dataclass(frozen=True)
class Qwen2Params:
    """Checked hyperparameters. Widths in elements; freq_scale = 1 / rope scaling factor."""

    n_layer: int
    n_ctx_train: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    eps: float
    freq_base: float
    freq_scale: float

    @property
    def n_embd_q(self) -> int:
        return self.n_head * self.head_dim

    @property
    def n_embd_kv(self) -> int:
        return self.n_head_kv * self.head_dim


def _int(info: GGUFInfo, key: str, default: int | None = None, hi: int = MAX_DIM) -> int:
    full = f"{ARCH}.{key}"
    value = info.require(full) if default is None else info.get(full, default)
    if isinstance(value, list) and value and all(v == value[0] for v in value):
        value = value[0]  # per-layer arrays (head_count_kv) with one value are accepted
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelError(f"{info.path.name}: metadata {full!r} must be an integer, got {value!r}")
    if not 1 <= value <= hi:
        raise ModelError(f"{info.path.name}: metadata {full!r} = {value} is outside [1, {hi}]")
    return value


def _float(info: GGUFInfo, key: str, default: float | None = None) -> float:
    full = f"{ARCH}.{key}"
    value = info.require(full) if default is None else info.get(full, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ModelError(f"{info.path.name}: metadata {full!r} must be a finite number, got {value!r}")
    return float(value)


def _rope_scale(info: GGUFInfo) -> float:
    kind = info.get(f"{ARCH}.rope.scaling.type", "linear")
    if kind not in ROPE_TYPES:
        raise UnsupportedError(f"{info.path.name}: rope scaling type {kind!r} is not implemented "
                               f"by the oracle (supported: {', '.join(ROPE_TYPES)})")
    factor = _float(info, "rope.scale_linear", 0.0)
    if factor == 0.0:
        factor = _float(info, "rope.scaling.factor", 0.0)
    if factor < 0.0:
        raise ModelError(f"{info.path.name}: rope scaling factor {factor} is negative")
    return 1.0 if factor == 0.0 else 1.0 / factor


def read_params(info: GGUFInfo) -> Qwen2Params:
    """Qwen2Params from GGUF metadata.

    Raises UnsupportedError (general.architecture is not "qwen2", rope scaling other than
    none/linear) or ModelError naming the key (missing, wrong type, out of bounds, or
    inconsistent: head_count % head_count_kv, key_length != value_length, n_rot != head_dim).
    """
    arch = info.arch
    if arch != ARCH:
        raise UnsupportedError(f"{info.path.name}: architecture {arch!r} is not supported by the "
                               f"qwen2 oracle")
    n_embd = _int(info, "embedding_length")
    n_head = _int(info, "attention.head_count")
    n_head_kv = _int(info, "attention.head_count_kv", n_head)
    if f"{ARCH}.attention.key_length" not in info.metadata and n_embd % n_head:
        raise ModelError(f"{info.path.name}: embedding_length {n_embd} is not a multiple of "
                         f"head_count {n_head} (and no attention.key_length is given)")
    head_dim = _int(info, "attention.key_length", max(1, n_embd // n_head))
    if _int(info, "attention.value_length", head_dim) != head_dim:
        raise ModelError(f"{info.path.name}: key_length != value_length is not a qwen2 model")
    n_rot = _int(info, "rope.dimension_count", head_dim)
    if n_rot != head_dim:
        raise ModelError(f"{info.path.name}: rope.dimension_count {n_rot} must equal the head "
                         f"size {head_dim} (llama.cpp src/models/qwen2.cpp asserts it)")
    if head_dim % 2:
        raise ModelError(f"{info.path.name}: head size {head_dim} is odd; RoPE rotates pairs")
    if n_head % n_head_kv:
        raise ModelError(f"{info.path.name}: head_count {n_head} is not a multiple of "
                         f"head_count_kv {n_head_kv}")
    eps = _float(info, "attention.layer_norm_rms_epsilon")
    freq_base = _float(info, "rope.freq_base", 10000.0)
    if eps < 0.0 or freq_base <= 0.0:
        raise ModelError(f"{info.path.name}: need rms epsilon >= 0 and rope.freq_base > 0, got "
                         f"{eps}, {freq_base}")
    return Qwen2Params(
        n_layer=_int(info, "block_count", hi=MAX_LAYERS),
        n_ctx_train=_int(info, "context_length", hi=1 << 24),
        n_embd=n_embd, n_ff=_int(info, "feed_forward_length"), n_head=n_head,
        n_head_kv=n_head_kv, head_dim=head_dim, n_rot=n_rot, eps=eps, freq_base=freq_base,
        freq_scale=_rope_scale(info))
