"""Hyperparameters of a llama.cpp `qwen35` model, read and checked from GGUF metadata.

Keys and defaults follow llama.cpp src/llama-model.cpp (generic load_hparams: block_count,
nextn_predict_layers, head counts, key/value_length, rope.dimension_count, rope.freq_base,
rope scaling) and src/models/qwen35.cpp load_arch_hparams (required: rms epsilon,
rope.dimension_sections, ssm.conv_kernel / inner_size / state_size / time_step_rank /
group_count; recurrent layers from attention.recurrent_layers or full_attention_interval,
default 4). Key names: src/llama-arch.cpp. Consistency checks are the graph's asserts
(qwen35.cpp: head_k == head_v; delta-net-base.cpp: S_k == S_v, H_v % H_k == 0) plus what
the recurrent state reshape needs (ssm.inner_size == state_size * time_step_rank).
"""
from __future__ import annotations

from dataclasses import dataclass

from harness.errors import ModelError, UnsupportedError
from harness.gguf_file import GGUFInfo

ARCH = "qwen35"
MAX_DIM = 1 << 20
MAX_LAYERS = 1024
ROPE_TYPES = ("none", "linear")  # YaRN / LongRoPE ramps are not implemented here


@dataclass(frozen=True)
class Qwen35Params:
    """Checked hyperparameters. n_layer excludes the n_nextn MTP blocks (never run here)."""

    n_layer: int
    n_nextn: int
    n_ctx_train: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    rope_sections: tuple[int, int, int, int]
    eps: float
    freq_base: float
    freq_scale: float
    attn_scale: float        # 0.0 = 1/sqrt(head_dim) (llama.cpp f_attention_scale)
    ssm_d_conv: int
    ssm_d_state: int          # S: key and value head size of the DeltaNet
    ssm_n_group: int          # Hk: key/query heads
    ssm_dt_rank: int          # Hv: value heads
    recurrent: tuple[bool, ...]

    @property
    def d_inner(self) -> int:
        return self.ssm_dt_rank * self.ssm_d_state

    @property
    def conv_dim(self) -> int:
        return 2 * self.ssm_n_group * self.ssm_d_state + self.d_inner


def _where(info: GGUFInfo) -> str:
    return info.path.name


def _uniform(info: GGUFInfo, full: str, value, n_layer: int):
    if isinstance(value, list):
        vals = {v for v in value[:n_layer] if v != 0}  # 0 marks layers without attention heads
        if len(value) < n_layer or len(vals) != 1:
            raise ModelError(f"{_where(info)}: metadata {full!r} = {value[:8]}... must give one "
                             f"value for all {n_layer} layers")
        value = vals.pop()
    return value


def _int(info: GGUFInfo, key: str, default: int | None = None, hi: int = MAX_DIM,
         n_layer: int = 1) -> int:
    full = f"{ARCH}.{key}"
    value = info.require(full) if default is None else info.get(full, default)
    value = _uniform(info, full, value, n_layer)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= hi:
        raise ModelError(f"{_where(info)}: metadata {full!r} = {value!r} must be an integer in "
                         f"[1, {hi}]")
    return value


def _float(info: GGUFInfo, key: str, default: float | None = None) -> float:
    full = f"{ARCH}.{key}"
    value = info.require(full) if default is None else info.get(full, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value \
            or abs(value) == float("inf"):
        raise ModelError(f"{_where(info)}: metadata {full!r} must be a finite number, "
                         f"got {value!r}")
    return float(value)


def _sections(info: GGUFInfo, head_dim: int) -> tuple[int, int, int, int]:
    full = f"{ARCH}.rope.dimension_sections"
    raw = info.require(full)
    raw = raw if isinstance(raw, list) else [raw]
    if len(raw) < 4 or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in raw[:4]):
        raise ModelError(f"{_where(info)}: metadata {full!r} = {raw!r} must hold 4 integers >= 0")
    sec = tuple(raw[:4])
    if not 0 < sum(sec) <= head_dim:  # ggml_mrope_cache_init asserts sect_dims <= ne0
        raise ModelError(f"{_where(info)}: metadata {full!r} = {list(sec)} must sum to a value "
                         f"in (0, head size {head_dim}]")
    return sec


def _recurrent(info: GGUFInfo, n_all: int, n_layer: int) -> tuple[bool, ...]:
    full = f"{ARCH}.attention.recurrent_layers"
    arr = info.get(full)
    if arr is not None:
        if not isinstance(arr, list) or len(arr) < n_layer:
            raise ModelError(f"{_where(info)}: metadata {full!r} must be an array of {n_all} flags")
        return tuple(bool(v) for v in arr[:n_layer])
    interval = _int(info, "full_attention_interval", 4, hi=MAX_LAYERS)
    return tuple((il + 1) % interval != 0 for il in range(n_layer))


def _check_ssm(info: GGUFInfo, d_state: int, n_group: int, dt_rank: int) -> None:
    inner = _int(info, "ssm.inner_size")
    if inner != d_state * dt_rank:
        raise ModelError(f"{_where(info)}: metadata 'qwen35.ssm.inner_size' = {inner} must equal "
                         f"ssm.state_size * ssm.time_step_rank = {d_state} * {dt_rank} "
                         f"(value heads of size state_size)")
    if dt_rank % n_group:
        raise ModelError(f"{_where(info)}: metadata 'qwen35.ssm.time_step_rank' = {dt_rank} "
                         f"(value heads) is not a multiple of 'qwen35.ssm.group_count' = "
                         f"{n_group} (key heads)")


def _heads(info: GGUFInfo, n_embd: int, n_layer: int) -> tuple[int, int, int, int]:
    n_head = _int(info, "attention.head_count", n_layer=n_layer)
    n_head_kv = _int(info, "attention.head_count_kv", n_head, n_layer=n_layer)
    if f"{ARCH}.attention.key_length" not in info.metadata and n_embd % n_head:
        raise ModelError(f"{_where(info)}: embedding_length {n_embd} is not a multiple of "
                         f"head_count {n_head} and 'qwen35.attention.key_length' is missing")
    head_dim = _int(info, "attention.key_length", max(1, n_embd // n_head))
    if _int(info, "attention.value_length", head_dim) != head_dim:
        raise ModelError(f"{_where(info)}: 'qwen35.attention.value_length' != key_length "
                         "(llama.cpp qwen35.cpp asserts equal head sizes)")
    if n_head % n_head_kv:
        raise ModelError(f"{_where(info)}: 'qwen35.attention.head_count' {n_head} is not a "
                         f"multiple of 'qwen35.attention.head_count_kv' {n_head_kv}")
    n_rot = _int(info, "rope.dimension_count", head_dim)
    if n_rot % 2 or n_rot > head_dim:
        raise ModelError(f"{_where(info)}: 'qwen35.rope.dimension_count' {n_rot} must be even "
                         f"and <= the head size {head_dim}")
    return n_head, n_head_kv, head_dim, n_rot


def read_params(info: GGUFInfo) -> Qwen35Params:
    """Qwen35Params from GGUF metadata.

    Raises UnsupportedError (architecture is not "qwen35", rope scaling other than
    none/linear) or ModelError naming the key (missing, wrong type, out of bounds, or
    inconsistent head counts / state sizes / sections).
    """
    if info.arch != ARCH:
        raise UnsupportedError(f"{_where(info)}: architecture {info.arch!r} is not supported by "
                               "the qwen35 oracle")
    n_all = _int(info, "block_count", hi=MAX_LAYERS)
    n_nextn = info.get(f"{ARCH}.nextn_predict_layers", 0)
    if isinstance(n_nextn, bool) or not isinstance(n_nextn, int) or not 0 <= n_nextn < n_all:
        raise ModelError(f"{_where(info)}: 'qwen35.nextn_predict_layers' = {n_nextn!r} must be in "
                         f"[0, block_count {n_all})")
    n_layer = n_all - n_nextn
    n_embd = _int(info, "embedding_length")
    n_head, n_head_kv, head_dim, n_rot = _heads(info, n_embd, n_layer)
    d_state, n_group = _int(info, "ssm.state_size"), _int(info, "ssm.group_count")
    dt_rank = _int(info, "ssm.time_step_rank")
    _check_ssm(info, d_state, n_group, dt_rank)
    eps = _float(info, "attention.layer_norm_rms_epsilon")
    freq_base = _float(info, "rope.freq_base", 10000.0)
    if eps < 0.0 or freq_base <= 0.0:
        raise ModelError(f"{_where(info)}: need rms epsilon >= 0 and rope.freq_base > 0, got "
                         f"{eps}, {freq_base}")
    return Qwen35Params(
        n_layer=n_layer, n_nextn=n_nextn, n_ctx_train=_int(info, "context_length", hi=1 << 24),
        n_embd=n_embd, n_ff=_int(info, "feed_forward_length", n_layer=n_layer), n_head=n_head,
        n_head_kv=n_head_kv, head_dim=head_dim, n_rot=n_rot,
        rope_sections=_sections(info, head_dim), eps=eps, freq_base=freq_base,
        freq_scale=_qwen35_rope_scale(info), attn_scale=_float(info, "attention.scale", 0.0),
        ssm_d_conv=_int(info, "ssm.conv_kernel", hi=64), ssm_d_state=d_state,
        ssm_n_group=n_group, ssm_dt_rank=dt_rank,
        recurrent=_recurrent(info, n_all, n_layer))


def _qwen35_rope_scale(info: GGUFInfo) -> float:
    """1 / rope scaling factor (rope.scaling.factor, else rope.scale_linear; 0 = none).
    Only linear scaling: YaRN / LongRoPE ramps are not implemented (UnsupportedError)."""
    kind = info.get(f"{ARCH}.rope.scaling.type", "linear")
    if kind not in ROPE_TYPES:
        raise UnsupportedError(f"{_where(info)}: rope scaling type {kind!r} is not implemented by "
                               f"the oracle (supported: {', '.join(ROPE_TYPES)})")
    key = "rope.scaling.factor" if f"{ARCH}.rope.scaling.factor" in info.metadata \
        else "rope.scale_linear"  # llama.cpp reads the old key only when the new one is absent
    factor = _float(info, key, 0.0)
    if factor < 0.0:
        raise ModelError(f"{_where(info)}: rope scaling factor {factor} is negative")
    return 1.0 if factor == 0.0 else 1.0 / factor
