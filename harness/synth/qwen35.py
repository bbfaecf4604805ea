"""Deterministic synthetic GGUF models of llama.cpp's "qwen35" hybrid architecture.

Layers: Gated DeltaNet (linear attention) except every `full_attn_interval`-th layer, which is
gated full attention (llama.cpp src/models/qwen35.cpp, load_arch_hparams: layer il is
recurrent iff (il + 1) % interval != 0). Keys and tensors as llama.cpp loads them
(src/models/qwen35.cpp load_arch_hparams / load_arch_tensors, names from src/llama-arch.cpp),
shapes in GGUF ne order:
  token_embd [E, V], output_norm [E], output [E, V] (absent when tied)
  all layers: attn_norm [E], post_attention_norm [E], ffn_gate/ffn_up [E, FF], ffn_down [FF, E]
  DeltaNet:   attn_qkv [E, 2*Hk*S + Hv*S], attn_gate [E, Hv*S], ssm_conv1d [K, 2*Hk*S + Hv*S],
              ssm_dt.bias [Hv], ssm_a [Hv], ssm_beta [E, Hv], ssm_alpha [E, Hv], ssm_norm [S],
              ssm_out [Hv*S, E]   (S = ssm.state_size, Hk = ssm.group_count, Hv = time_step_rank)
  attention:  attn_q [E, 2*H*D] (query and output gate interleaved per head), attn_k/attn_v
              [E, Hkv*D], attn_output [H*D, E], attn_q_norm/attn_k_norm [D]
  MTP (n_nextn extra blocks, skipped by plain decoding): an attention block plus
              nextn.eh_proj [2E, E], nextn.enorm/hnorm/shared_head_norm [E].
Weights: zero-mean, one stream per (seed, tensor, row group): matrices rms 1/sqrt(fan_in),
residual-branch outputs times 1/sqrt(2 n_layer) (token_embd rms 1, or 1/sqrt(E) when tied so
the head gives O(1) logits); norms 1 + N(0, 0.1^2) (RMSNorm weights are stored as 1 + w in real
files, ssm_norm as w; both sit near 1); conv taps N(0, 0.5^2); ssm_a = -A with A ~ U(0.05, 1)
(real files store -exp(A_log)); ssm_dt.bias N(0, 0.5^2). Correlated DeltaNet q/k channels and
next-token structure in the output rows: SynthStyle and harness.synth.synth_rows.
Block types are written directly as random blocks (harness.synth.randblocks) or, with
method="quantize", as normal floats encoded by gguf-py / libggml (harness.synth.quantize).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path


from ..errors import ConfigError
from .bpe_vocab import add_vocab
from .gguf_stream import Progress, TensorPlan, write_gguf_streaming
from .qwen2 import resolve_quant
from .synth_rows import NextTokenRows, Rows, SharedRows, Spec

ARCH = "qwen35"
METHODS = ("direct", "quantize")


@dataclass(frozen=True)
class Qwen35Shape:
    """Hyper-parameters of a qwen35 model; validated on construction (ConfigError)."""

    n_layer: int
    n_embd: int
    n_ff: int
    n_vocab: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    rope_sections: tuple[int, int, int, int]
    ssm_d_state: int
    ssm_n_group: int
    ssm_dt_rank: int
    ssm_d_conv: int = 4
    full_attn_interval: int = 4
    n_ctx_train: int = 4096
    n_nextn: int = 0
    rope_freq_base: float = 10_000_000.0
    rms_eps: float = 1e-6
    tied: bool = False

    def __post_init__(self) -> None:
        for k in ("n_layer", "n_embd", "n_ff", "n_vocab", "n_head", "n_head_kv", "head_dim",
                  "n_rot", "ssm_d_state", "ssm_n_group", "ssm_dt_rank", "ssm_d_conv",
                  "full_attn_interval", "n_ctx_train"):
            if getattr(self, k) < 1:
                raise ConfigError(f"{k} must be >= 1, got {getattr(self, k)}")
        if self.n_nextn < 0:
            raise ConfigError(f"n_nextn must be >= 0, got {self.n_nextn}")
        if self.n_head % self.n_head_kv:
            raise ConfigError(f"n_head {self.n_head} is not a multiple of n_head_kv "
                              f"{self.n_head_kv}")
        if self.n_rot % 2 or self.n_rot > self.head_dim:
            raise ConfigError(f"n_rot {self.n_rot} must be even and <= head_dim {self.head_dim}")
        if len(self.rope_sections) != 4 or min(self.rope_sections) < 0 \
                or not 0 < sum(self.rope_sections) <= self.head_dim:
            raise ConfigError(f"rope_sections {self.rope_sections}: 4 counts >= 0 with a sum in "
                              f"(0, head_dim]")
        if self.ssm_dt_rank % self.ssm_n_group:
            raise ConfigError(f"ssm_dt_rank {self.ssm_dt_rank} (value heads) is not a multiple of "
                              f"ssm_n_group {self.ssm_n_group} (key heads)")

    @property
    def d_inner(self) -> int:
        return self.ssm_dt_rank * self.ssm_d_state

    @property
    def conv_dim(self) -> int:
        return 2 * self.ssm_n_group * self.ssm_d_state + self.d_inner

    def is_recurrent(self, il: int) -> bool:
        return il < self.n_layer and (il + 1) % self.full_attn_interval != 0


def _mat(name: str, ne0: int, ne1: int) -> Spec:
    return (name, (ne0, ne1), "matrix", 1 / math.sqrt(ne0))


def _attention_specs(s: Qwen35Shape, b: str) -> list[Spec]:
    q, kv = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    return [_mat(b + "attn_q.weight", s.n_embd, 2 * q), _mat(b + "attn_k.weight", s.n_embd, kv),
            _mat(b + "attn_v.weight", s.n_embd, kv), _mat(b + "attn_output.weight", q, s.n_embd),
            (b + "attn_q_norm.weight", (s.head_dim,), "norm", 0.1),
            (b + "attn_k_norm.weight", (s.head_dim,), "norm", 0.1)]


def _deltanet_specs(s: Qwen35Shape, b: str) -> list[Spec]:
    e, hv = s.n_embd, s.ssm_dt_rank
    return [_mat(b + "attn_qkv.weight", e, s.conv_dim), _mat(b + "attn_gate.weight", e, s.d_inner),
            (b + "ssm_conv1d.weight", (s.ssm_d_conv, s.conv_dim), "conv",
             1 / math.sqrt(s.ssm_d_conv)),
            (b + "ssm_dt.bias", (hv,), "dt_bias", 0.5), (b + "ssm_a", (hv,), "ssm_a", 0.0),
            _mat(b + "ssm_beta.weight", e, hv), _mat(b + "ssm_alpha.weight", e, hv),
            (b + "ssm_norm.weight", (s.ssm_d_state,), "norm", 0.1),
            _mat(b + "ssm_out.weight", s.d_inner, e)]


def _block_specs(s: Qwen35Shape, il: int) -> list[Spec]:
    b, e = f"blk.{il}.", s.n_embd
    specs = [(b + "attn_norm.weight", (e,), "norm", 0.1),
             (b + "post_attention_norm.weight", (e,), "norm", 0.1)]
    specs += _deltanet_specs(s, b) if s.is_recurrent(il) else _attention_specs(s, b)
    if il >= s.n_layer:  # MTP block (llama.cpp load_block_mtp)
        specs += [_mat(b + "nextn.eh_proj.weight", 2 * e, e),
                  (b + "nextn.enorm.weight", (e,), "norm", 0.1),
                  (b + "nextn.hnorm.weight", (e,), "norm", 0.1),
                  (b + "nextn.shared_head_norm.weight", (e,), "norm", 0.1)]
    return specs + [_mat(b + "ffn_gate.weight", e, s.n_ff), _mat(b + "ffn_up.weight", e, s.n_ff),
                    _mat(b + "ffn_down.weight", s.n_ff, e)]


def tensor_specs(s: Qwen35Shape) -> list[Spec]:
    """[(name, ne in GGUF order, kind, std)] in file order; kind: matrix, norm, conv,
    dt_bias or ssm_a (only matrices are ever quantised)."""
    e, v = s.n_embd, s.n_vocab
    embd_std = 1 / math.sqrt(e) if s.tied else 1.0
    specs: list[Spec] = [("token_embd.weight", (e, v), "matrix", embd_std),
                         ("output_norm.weight", (e,), "norm", 0.1)]
    if not s.tied:
        specs.append(_mat("output.weight", e, v))
    for il in range(s.n_layer + s.n_nextn):
        specs += _block_specs(s, il)
    return specs


@dataclass(frozen=True)
class SynthStyle:
    """How weights are drawn (not part of the architecture; harness.synth.synth_rows).

    branch_scale: rms factor of the residual-branch outputs (attn_output, ssm_out, ffn_down);
    None = 1/sqrt(2 n_layer). next_token: logit advantage A, in sd of the other logits, that
    the permuted next token would get if the final hidden state were the token embedding
    alone; each output row takes a share g = min(0.9, A / sqrt(n_embd)) from a permuted
    token_embd row (the advantage grows as g sqrt(n_embd), so a fixed g would make wide
    models deterministic). 0 = i.i.d. rows; ignored when tied. qk_share: fraction of DeltaNet
    key-projection blocks copied from the query projection.
    """

    branch_scale: float | None = None
    next_token: float = 4.8
    qk_share: float = 0.75

    def __post_init__(self) -> None:
        if not self.next_token >= 0.0 or not 0.0 <= self.qk_share <= 1.0:
            raise ConfigError(f"next_token must be >= 0 and qk_share in [0, 1], got "
                              f"{self.next_token}, {self.qk_share}")

    def gamma(self, n_embd: int) -> float:
        """Share of each output row taken from a permuted token_embd row."""
        return min(0.9, self.next_token / math.sqrt(n_embd))
        if self.branch_scale is not None and not self.branch_scale > 0:
            raise ConfigError(f"branch_scale must be > 0, got {self.branch_scale}")


BRANCH_OUT = ("attn_output.weight", "ssm_out.weight", "ffn_down.weight")


def _styled(specs: list[Spec], s: Qwen35Shape, style: SynthStyle) -> list[Spec]:
    c = style.branch_scale or 1.0 / math.sqrt(2 * s.n_layer)
    return [(n, ne, k, std * c if n.endswith(BRANCH_OUT) else std) for n, ne, k, std in specs]


def _row_fns(specs: list[Spec], types: dict, s: Qwen35Shape, seed: int, method: str,
             style: SynthStyle) -> dict[str, Rows]:
    kd = s.ssm_n_group * s.ssm_d_state
    fns: dict[str, Rows] = {}
    for sp in specs:
        name, qt = sp[0], types[sp[0]]
        if name.endswith("attn_qkv.weight"):
            fns[name] = SharedRows(sp, qt, seed, method, kd, kd, style.qk_share)
        elif name.endswith("ssm_conv1d.weight"):
            fns[name] = SharedRows(sp, qt, seed, method, kd, kd, 1.0)
        elif name == "output.weight" and style.next_token > 0:
            fns[name] = NextTokenRows(sp, qt, seed, method, fns["token_embd.weight"],
                                      style.gamma(s.n_embd))
        else:
            fns[name] = Rows(sp, qt, seed, method)
    return fns


def _add_metadata(w, s: Qwen35Shape, seed: int, quant, method: str, style: SynthStyle) -> None:
    w.add_name(f"synthetic qwen35 L{s.n_layer} E{s.n_embd} seed {seed}")
    u32 = {"block_count": s.n_layer + s.n_nextn, "context_length": s.n_ctx_train,
           "embedding_length": s.n_embd, "feed_forward_length": s.n_ff,
           "attention.head_count": s.n_head, "attention.head_count_kv": s.n_head_kv,
           "attention.key_length": s.head_dim, "attention.value_length": s.head_dim,
           "rope.dimension_count": s.n_rot, "ssm.conv_kernel": s.ssm_d_conv,
           "ssm.state_size": s.ssm_d_state, "ssm.group_count": s.ssm_n_group,
           "ssm.time_step_rank": s.ssm_dt_rank, "ssm.inner_size": s.d_inner,
           "full_attention_interval": s.full_attn_interval}
    if s.n_nextn:
        u32["nextn_predict_layers"] = s.n_nextn
    for key, val in u32.items():
        w.add_uint32(f"{ARCH}.{key}", val)
    w.add_array(f"{ARCH}.rope.dimension_sections", list(s.rope_sections))
    w.add_float32(f"{ARCH}.rope.freq_base", s.rope_freq_base)
    w.add_float32(f"{ARCH}.attention.layer_norm_rms_epsilon", s.rms_eps)
    w.add_uint32("general.quantization_version", 2)
    w.add_uint64("harness.synth.seed", seed)
    w.add_string("harness.synth.quant", repr(quant))
    w.add_string("harness.synth.method", method)
    w.add_string("harness.synth.style", repr(style))
    _add_vocab(w, s.n_vocab)


def _add_vocab(w, n_vocab: int) -> None:
    add_vocab(w, n_vocab, "qwen35")


def plan_tensors(s: Qwen35Shape, quant, seed: int = 0, method: str = "direct",
                 style: SynthStyle = SynthStyle()) -> list[TensorPlan]:
    """TensorPlans of every tensor (types resolved and checked; nothing generated yet).
    quant: one GGML type name or {glob: type} (harness.synth.qwen2.resolve_quant rules)."""
    if method not in METHODS:
        raise ConfigError(f"method must be one of {METHODS}, got {method!r}")
    specs = _styled(tensor_specs(s), s, style)
    types = resolve_quant(quant, specs)
    fns = _row_fns(specs, types, s, seed, method, style)
    return [TensorPlan(sp[0], sp[1], types[sp[0]], fns[sp[0]]) for sp in specs]


def write_qwen35(path: str | Path, shape: Qwen35Shape, quant: str | dict[str, str] = "F32",
                 seed: int = 0, method: str = "direct", progress: Progress | None = None,
                 style: SynthStyle = SynthStyle(), jobs: int = 1) -> Path:
    """Write a synthetic qwen35 GGUF (streamed: peak RAM ~ one chunk per process) and
    return its Path.

    Same arguments -> the same bytes (same numpy and libggml builds), whatever `jobs`
    (worker processes, harness.synth.parallel_write). Raises ConfigError / UnsupportedError
    before the file is opened; a failure while writing removes the file (SynthWorkerError
    when a worker failed). progress(bytes_done, bytes_total, tensor_name) is called after
    every chunk.
    """
    plans = plan_tensors(shape, quant, seed, method, style)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    meta = lambda w: _add_metadata(w, shape, seed, quant, method, style)  # noqa: E731
    return write_gguf_streaming(path, ARCH, meta, plans, progress, jobs)


def decode_bytes(plans: list[TensorPlan], shape: Qwen35Shape) -> int:
    """Bytes of the tensors a plain decode step reads: everything but the MTP blocks."""
    mtp = tuple(f"blk.{il}." for il in range(shape.n_layer, shape.n_layer + shape.n_nextn))
    return sum(p.nbytes for p in plans if not p.name.startswith(mtp))
