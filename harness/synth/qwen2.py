"""Deterministic synthetic GGUF models of llama.cpp's "qwen2" architecture.

What llama.cpp needs to load one (llama.cpp src/llama-model.cpp load_hparams,
src/models/qwen2.cpp load_arch_tensors, src/llama-arch.cpp key and tensor names):
    {arch}.context_length, .embedding_length, .block_count, .feed_forward_length,
    .attention.head_count, .attention.head_count_kv, .rope.freq_base (optional, default 1e4),
    .attention.layer_norm_rms_epsilon (required by qwen2);
    token_embd [n_embd, n_vocab], output_norm [n_embd], output [n_embd, n_vocab] (optional:
    absent = tied to token_embd), and per layer blk.N.{attn_norm, attn_q/k/v (+ bias),
    attn_output, ffn_norm, ffn_gate, ffn_up, ffn_down}. Shapes here are GGUF ne order.
Vocabulary: harness.synth.bpe_vocab (gpt2 model, "qwen2" pre-tokenizer).

Weights are zero-mean normal draws, one stream per tensor seeded by (seed, crc32(name)):
matrices std 1/sqrt(fan_in) so activations stay O(1), token_embd std 1/sqrt(n_embd), norm weights
1 + N(0, 0.1^2), biases N(0, 0.1^2). Zero mean matters: random K-quant blocks have a
positive mean and make greedy output degenerate (project notes, docs/sources.md §4).
The file is streamed (harness.synth.gguf_stream): each tensor's stream is consumed chunk
after chunk (TensorStream, a sequential TensorPlan), so with jobs > 1 the tensors, not the
chunks, are spread over the workers.
"""
from __future__ import annotations

import fnmatch
import math
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFWriter
from gguf.constants import GGMLQuantizationType as QT

from ..errors import ConfigError
from .bpe_vocab import add_vocab
from .gguf_stream import Progress, TensorPlan, write_gguf_streaming
from .quantize import check_row, encode, parse_type, quant_source

ARCH = "qwen2"


@dataclass(frozen=True)
class Qwen2Shape:
    """Hyper-parameters; validated on construction (ConfigError)."""

    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    rope_freq_base: float = 1_000_000.0
    rms_eps: float = 1e-6
    tied: bool = False

    def __post_init__(self) -> None:
        for k in ("n_layer", "n_embd", "n_head", "n_head_kv", "n_ff", "n_vocab", "n_ctx_train"):
            if getattr(self, k) < 1:
                raise ConfigError(f"{k} must be >= 1, got {getattr(self, k)}")
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise ConfigError(f"n_embd {self.n_embd} must split into {self.n_head} heads of "
                              "an even size (RoPE rotates pairs)")
        if self.n_head % self.n_head_kv:
            raise ConfigError(f"n_head {self.n_head} must be a multiple of n_head_kv "
                              f"{self.n_head_kv}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def tensor_specs(s: Qwen2Shape) -> list[tuple[str, tuple[int, ...], str, float]]:
    """[(name, ne in GGUF order, kind, std)]; kind is "matrix", "norm" or "bias"."""
    n_kv = s.head_dim * s.n_head_kv
    e, ff, v = s.n_embd, s.n_ff, s.n_vocab
    # token_embd std 1/sqrt(e): as the tied output head it then gives O(1) logits, and the
    # residual is not dominated by the token's own embedding (else tied models echo it)
    specs = [("token_embd.weight", (e, v), "matrix", 1 / math.sqrt(e)),
             ("output_norm.weight", (e,), "norm", 0.1)]
    if not s.tied:
        specs.append(("output.weight", (e, v), "matrix", 1 / math.sqrt(e)))
    for i in range(s.n_layer):
        b = f"blk.{i}."
        specs += [
            (b + "attn_norm.weight", (e,), "norm", 0.1),
            (b + "attn_q.weight", (e, e), "matrix", 1 / math.sqrt(e)),
            (b + "attn_q.bias", (e,), "bias", 0.1),
            (b + "attn_k.weight", (e, n_kv), "matrix", 1 / math.sqrt(e)),
            (b + "attn_k.bias", (n_kv,), "bias", 0.1),
            (b + "attn_v.weight", (e, n_kv), "matrix", 1 / math.sqrt(e)),
            (b + "attn_v.bias", (n_kv,), "bias", 0.1),
            (b + "attn_output.weight", (e, e), "matrix", 1 / math.sqrt(e)),
            (b + "ffn_norm.weight", (e,), "norm", 0.1),
            (b + "ffn_gate.weight", (e, ff), "matrix", 1 / math.sqrt(e)),
            (b + "ffn_up.weight", (e, ff), "matrix", 1 / math.sqrt(e)),
            (b + "ffn_down.weight", (ff, e), "matrix", 1 / math.sqrt(ff)),
        ]
    return specs


def resolve_quant(quant: str | dict[str, str], specs) -> dict[str, QT]:
    """Tensor name -> GGML type. 1-D tensors (norms, biases) are always F32.

    quant: one type name for every matrix, or {glob pattern: type name}; the first pattern
    (in dict order, fnmatch syntax) matching a matrix name wins, unmatched matrices are F32.
    Raises ConfigError (unknown type, row not a multiple of the block size) or
    UnsupportedError (no encoder for the type).
    """
    rules = [("*", quant)] if isinstance(quant, str) else list(quant.items())
    types = {}
    for name, ne, kind, _ in specs:
        qtype = QT.F32
        if kind == "matrix":
            match = next((t for pat, t in rules if fnmatch.fnmatchcase(name, pat)), "F32")
            qtype = parse_type(match)
            quant_source(qtype)
            check_row(name, qtype, ne[0])
        types[name] = qtype
    return types


def normal_rows(rng: np.random.Generator, n: int, ne0: int, kind: str, std: float) -> np.ndarray:
    """float32 [n, ne0]: the next n rows of a tensor's stream, N(0, std^2) (+1 for norms).
    Drawing a tensor in several calls gives the same values as one call (numpy Generator
    draws are sequential in the bit stream)."""
    x = rng.standard_normal((n, ne0), dtype=np.float64) * std
    if kind == "norm":
        x += 1.0
    return x.astype(np.float32)


def _stream(name: str, seed: int) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def make_weights(name: str, ne: tuple[int, ...], kind: str, std: float, seed: int) -> np.ndarray:
    """float32 array of numpy shape reversed(ne), deterministic in (seed, name)."""
    n_rows = math.prod(ne[1:])
    return normal_rows(_stream(name, seed), n_rows, ne[0], kind, std).reshape(tuple(reversed(ne)))


class TensorStream:
    """rows(r0, r1) -> rows r0..r1-1 of one tensor, encoded as qtype (uint8 [n, row_bytes] or
    float32/16 [n, ne0]): make_weights' values chunk by chunk. The stream is consumed in
    order; a call not starting where the last one ended restarts it and skips r0 rows."""

    def __init__(self, spec: tuple[str, tuple[int, ...], str, float], qtype: QT, seed: int):
        self.spec, self.qtype, self.seed = spec, qtype, seed
        self._rng, self._next = None, 0

    def __getstate__(self) -> dict:  # pickled for worker processes: from the start
        return {**self.__dict__, "_rng": None, "_next": 0}

    def __call__(self, r0: int, r1: int) -> np.ndarray:
        name, ne, kind, std = self.spec
        if self._rng is None or r0 != self._next:
            self._rng, self._next = _stream(name, self.seed), 0
            for a in range(0, r0, 4096):  # skip: draw and drop
                normal_rows(self._rng, min(4096, r0 - a), ne[0], kind, std)
        vals = normal_rows(self._rng, r1 - r0, ne[0], kind, std)
        self._next = r1
        return encode(name, vals, self.qtype)


def plan_tensors(s: Qwen2Shape, quant, seed: int = 0) -> list[TensorPlan]:
    """Sequential TensorPlans of every tensor (types resolved and checked, nothing drawn)."""
    specs = tensor_specs(s)
    types = resolve_quant(quant, specs)
    return [TensorPlan(sp[0], sp[1], types[sp[0]], TensorStream(sp, types[sp[0]], seed),
                       sequential=True) for sp in specs]


def _add_metadata(w: GGUFWriter, s: Qwen2Shape, seed: int, quant) -> None:
    w.add_name(f"synthetic qwen2 L{s.n_layer} E{s.n_embd} seed {seed}")
    for key, val in (("block_count", s.n_layer), ("context_length", s.n_ctx_train),
                     ("embedding_length", s.n_embd), ("feed_forward_length", s.n_ff),
                     ("attention.head_count", s.n_head),
                     ("attention.head_count_kv", s.n_head_kv)):
        w.add_uint32(f"{ARCH}.{key}", val)
    w.add_float32(f"{ARCH}.rope.freq_base", s.rope_freq_base)
    w.add_float32(f"{ARCH}.attention.layer_norm_rms_epsilon", s.rms_eps)
    w.add_uint32("general.quantization_version", 2)
    w.add_uint64("harness.synth.seed", seed)
    w.add_string("harness.synth.quant", repr(quant))


def _add_vocab(w, n_vocab: int) -> None:
    add_vocab(w, n_vocab, "qwen2")


def write_qwen2(path: str | Path, *, n_layer: int, n_embd: int, n_head: int, n_head_kv: int,
                n_ff: int, n_vocab: int, n_ctx_train: int, quant: str | dict[str, str] = "F32",
                seed: int = 0, tied: bool = False, rope_freq_base: float = 1_000_000.0,
                rms_eps: float = 1e-6, jobs: int = 1, progress: Progress | None = None) -> Path:
    """Write a synthetic qwen2 GGUF to path (parents created) and return the Path.

    Same arguments -> byte-identical file (same numpy and libggml builds), whatever `jobs`
    (worker processes, one tensor each at a time). quant: see resolve_quant. Everything is
    checked before the file is opened, and the file is written as <path>.part then renamed,
    so an error leaves no partial file behind. progress(bytes_done, bytes_total, name).
    """
    s = Qwen2Shape(n_layer, n_embd, n_head, n_head_kv, n_ff, n_vocab, n_ctx_train,
                   rope_freq_base, rms_eps, tied)
    plans = plan_tensors(s, quant, seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    def meta(w: GGUFWriter) -> None:
        _add_metadata(w, s, seed, quant)
        _add_vocab(w, n_vocab)
    return write_gguf_streaming(path, ARCH, meta, plans, progress, jobs)
