"""Synthetic GGUF models for tests that must run without the real models (CPU CI).

    write_qwen2(path, *, n_layer, n_embd, n_head, n_head_kv, n_ff, n_vocab, n_ctx_train,
                quant="F32", seed=0, tied=False, ...) -> Path
    write_preset(name, path, seed=0) -> Path;  PRESETS: name -> write_qwen2 arguments
"""
from .presets import PRESETS, write_preset
from .qwen2 import Qwen2Shape, make_weights, resolve_quant, tensor_specs, write_qwen2
from .quantize import encode, quant_source

__all__ = ["PRESETS", "Qwen2Shape", "encode", "make_weights", "quant_source",
           "resolve_quant", "tensor_specs", "write_preset", "write_qwen2"]
