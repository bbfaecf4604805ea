"""Facts about a loaded llama.cpp model and run timings (llama.h: llama_model_desc,
llama_model_size, llama_model_n_params, llama_model_meta_val_str, llama_print_system_info,
llama_perf_context)."""
from __future__ import annotations

import ctypes
from dataclasses import asdict, dataclass

import llama_cpp

from harness.config import ModelRef, RunConfig

_META_BUF = 512


def meta_str(model, key: str) -> str | None:
    """GGUF metadata value as llama.cpp renders it, or None when the key is absent."""
    buf = ctypes.create_string_buffer(_META_BUF)
    n = llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, _META_BUF)
    return buf.value.decode("utf-8", errors="replace") if n >= 0 else None


def _desc(model) -> str:
    buf = ctypes.create_string_buffer(256)
    llama_cpp.llama_model_desc(model, buf, 256)
    return buf.value.decode("utf-8", errors="replace")


def build_info() -> dict:
    """llama-cpp-python version, ggml CPU feature string, GPU offload support."""
    return {
        "llama_cpp_python": llama_cpp.__version__,
        "system_info": llama_cpp.llama_print_system_info().decode("utf-8", errors="replace").strip(),
        "gpu_offload": bool(llama_cpp.llama_supports_gpu_offload()),
    }


def model_info(model, vocab, ref: ModelRef, cfg: RunConfig) -> dict:
    """arch, name, desc, size (tensor bytes), n_params, n_vocab, n_layer, n_embd, n_head,
    n_ctx_train, add_bos, bos, eos, the settings used (config, seed) and build_info()."""
    return {
        "backend": "llamacpp",
        "model": ref.to_json(),
        "arch": meta_str(model, "general.architecture"),
        "name": meta_str(model, "general.name"),
        "desc": _desc(model),
        "size": int(llama_cpp.llama_model_size(model)),
        "n_params": int(llama_cpp.llama_model_n_params(model)),
        "n_vocab": int(llama_cpp.llama_vocab_n_tokens(vocab)),
        "n_layer": int(llama_cpp.llama_model_n_layer(model)),
        "n_embd": int(llama_cpp.llama_model_n_embd(model)),
        "n_head": int(llama_cpp.llama_model_n_head(model)),
        "n_ctx_train": int(llama_cpp.llama_model_n_ctx_train(model)),
        "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
        "bos": int(llama_cpp.llama_vocab_bos(vocab)),
        "eos": int(llama_cpp.llama_vocab_eos(vocab)),
        "config": cfg.to_json(),
        "seed": cfg.seed,   # recorded only: greedy decoding on raw logits uses no RNG
        **build_info(),
    }


def perf(ctx) -> dict:
    """llama.cpp's own counters (milliseconds; n_p_eval counts batched tokens, n_eval
    single-token decodes)."""
    p = llama_cpp.llama_perf_context(ctx)
    return {f: getattr(p, f) for f, _ in p._fields_}


@dataclass
class Timings:
    """Wall-clock seconds measured around llama_decode + the logits copy, in the backend."""

    load_s: float = 0.0
    prefill_s: float = 0.0
    prefill_tokens: int = 0
    prefill_calls: int = 0
    decode_s: float = 0.0
    decode_steps: int = 0

    def add_prefill(self, seconds: float, n_tokens: int) -> None:
        self.prefill_s += seconds
        self.prefill_tokens += n_tokens
        self.prefill_calls += 1

    def add_decode(self, seconds: float) -> None:
        self.decode_s += seconds
        self.decode_steps += 1

    def to_json(self) -> dict:
        return asdict(self)
