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


def make_weights(name: str, ne: tuple[int, ...], kind: str, std: float, seed: int) -> np.ndarray:
    """float32 array of numpy shape reversed(ne), deterministic in (seed, name)."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    x = rng.standard_normal(tuple(reversed(ne)), dtype=np.float64) * std
    if kind == "norm":
        x += 1.0
    return x.astype(np.float32)


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
                rms_eps: float = 1e-6) -> Path:
    """Write a synthetic qwen2 GGUF to path (parents created) and return the Path.

    Same arguments -> byte-identical file (same numpy and libggml builds). quant: see
    resolve_quant. Everything is checked before the file is opened, so a ConfigError or
    UnsupportedError leaves no partial file behind.
    """
    s = Qwen2Shape(n_layer, n_embd, n_head, n_head_kv, n_ff, n_vocab, n_ctx_train,
                   rope_freq_base, rms_eps, tied)
    specs = tensor_specs(s)
    types = resolve_quant(quant, specs)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(path, ARCH)
    _add_metadata(w, s, seed, quant)
    _add_vocab(w, n_vocab)
    for name, ne, kind, std in specs:
        data = encode(name, make_weights(name, ne, kind, std, seed), types[name])
        w.add_tensor(name, data, raw_dtype=None if data.dtype != np.uint8 else types[name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
