"""RunConfig -> llama.cpp parameter structs (llama.h: llama_model_params, llama_context_params).

Field meanings are those of llama.h in the llama.cpp bundled with llama-cpp-python 0.3.36.
"""
from __future__ import annotations

import llama_cpp

from harness.config import RunConfig
from harness.errors import ConfigError

# ggml/include/ggml.h enum ggml_type: KV cache element types the harness offers.
KV_GGML_TYPES = {
    "f32": llama_cpp.GGML_TYPE_F32,
    "f16": llama_cpp.GGML_TYPE_F16,
    "q8_0": llama_cpp.GGML_TYPE_Q8_0,
}


def model_params(cfg: RunConfig) -> llama_cpp.llama_model_params:
    """n_gpu_layers and use_extra_bufts from cfg; everything else at llama.cpp defaults.

    use_extra_bufts=False avoids ggml's CPU weight-repacking (AMX) buffers, which crash on
    quantised models on some VMs (see README).
    """
    p = llama_cpp.llama_model_default_params()
    p.n_gpu_layers = cfg.n_gpu_layers
    p.use_extra_bufts = cfg.use_extra_bufts
    return p


def context_params(cfg: RunConfig) -> llama_cpp.llama_context_params:
    """One sequence, fixed thread counts, explicit flash attention and KV type.

    flash_attn maps to LLAMA_FLASH_ATTN_TYPE_ENABLED / _DISABLED (never AUTO, so the setting
    recorded is the one used); perf counters are switched on (no_perf=False) for timings().
    op_offload follows n_gpu_layers: with 0 layers on the GPU, a CUDA build would otherwise
    still send large batches (>= 32 tokens) of CPU-resident weights to the GPU (measured on an
    H200: 7.5e-3 prefill-vs-step logit gap on an f32 model instead of 8e-7), so 0 means CPU only.
    """
    if cfg.kv_type not in KV_GGML_TYPES:
        raise ConfigError(f"kv_type {cfg.kv_type!r} has no llama.cpp mapping")
    p = llama_cpp.llama_context_default_params()
    p.n_ctx = cfg.n_ctx
    p.n_batch = cfg.n_batch
    p.n_ubatch = cfg.n_ubatch
    p.n_seq_max = 1
    p.n_threads = cfg.n_threads
    p.n_threads_batch = cfg.n_threads
    p.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if cfg.flash_attn
                         else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
    p.type_k = KV_GGML_TYPES[cfg.kv_type]
    p.type_v = KV_GGML_TYPES[cfg.kv_type]
    p.no_perf = False
    p.op_offload = cfg.n_gpu_layers != 0
    return p
