"""Named synthetic qwen2 models: tiny ones for CPU tests, real shapes for sizing/benchmarks.

K-quants need rows that are a multiple of 256 values, so (as in the real Q4_K_M files) the
tensors whose ne[0] is n_embd = 64 or 896 fall back to Q5_0/Q8_0 and only ffn_down (ne[0] =
n_ff) carries Q4_K/Q6_K. Real shapes: Qwen2.5-Coder-0.5B / -1.5B config.json (24 layers x
896, 14/2 heads, FFN 4864; 28 layers x 1536, 12/2 heads, FFN 8960; vocab 151936, ctx 32768).
"""
from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError
from .gguf_stream import Progress
from .qwen2 import write_qwen2

TINY = dict(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=256, n_vocab=512,
            n_ctx_train=512)

# Mirrors the mix of qwen2.5-coder-0.5b-q4_k_m.gguf (Q5_0, Q8_0, Q6_K, Q4_K, F32), plus Q4_0.
TINY_MIX = {
    "token_embd.weight": "Q5_0",
    "output.weight": "Q8_0",
    "blk.*.attn_v.weight": "Q8_0",
    "blk.*.attn_output.weight": "Q4_0",
    "blk.0.ffn_down.weight": "Q6_K",
    "blk.*.ffn_down.weight": "Q4_K",
    "*": "Q5_0",
}

# Every matrix a K-quant: n_embd 256 makes all rows whole super-blocks.
SMALL_K = dict(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=512,
               n_ctx_train=512)
SMALL_K_MIX = {
    "output.weight": "Q6_K",
    "blk.*.attn_v.weight": "Q6_K",
    "blk.*.ffn_down.weight": "Q5_K",
    "*": "Q4_K",
}

Q05B_MIX = {
    "output.weight": "Q8_0",
    "blk.*.attn_v.weight": "Q8_0",
    "blk.*.ffn_down.weight": "Q6_K",
    "*": "Q5_0",
}
Q15B_MIX = {
    "output.weight": "Q6_K",
    "blk.*.attn_v.weight": "Q6_K",
    "blk.*.ffn_down.weight": "Q6_K",
    "*": "Q4_K",
}

PRESETS: dict[str, dict] = {
    "qwen2-tiny": dict(TINY, quant="F32"),
    "qwen2-tiny-f16": dict(TINY, quant="F16"),
    "qwen2-tiny-q": dict(TINY, quant=TINY_MIX),
    "qwen2-tiny-tied": dict(TINY, quant="F32", tied=True),
    "qwen2-small-k": dict(SMALL_K, quant=SMALL_K_MIX),
    "qwen2-0.5b-shape": dict(n_layer=24, n_embd=896, n_head=14, n_head_kv=2, n_ff=4864,
                             n_vocab=151936, n_ctx_train=32768, quant=Q05B_MIX),
    "qwen2-1.5b-shape": dict(n_layer=28, n_embd=1536, n_head=12, n_head_kv=2, n_ff=8960,
                             n_vocab=151936, n_ctx_train=32768, quant=Q15B_MIX),
}


def write_preset(name: str, path: str | Path, seed: int = 0, quant: str | None = None,
                 jobs: int = 1, progress: Progress | None = None) -> Path:
    """write_qwen2(path, **PRESETS[name], seed=seed), or for a qwen35 preset (QWEN35_SHAPES)
    write_qwen35_preset(name, path, quant or "f32", seed); ConfigError for an unknown name.
    jobs: worker processes (same bytes for any value); progress(bytes_done, total, name)."""
    from .qwen35_presets import SHAPES as QWEN35_SHAPES, write_qwen35_preset
    if name in QWEN35_SHAPES:
        return write_qwen35_preset(name, path, quant or "f32", seed=seed, jobs=jobs,
                                   progress=progress)
    if name not in PRESETS:
        known = ", ".join([*PRESETS, *QWEN35_SHAPES])
        raise ConfigError(f"unknown synthetic preset {name!r} (known: {known})")
    if quant is not None:
        raise ConfigError(f"preset {name!r} has a fixed quant mix; a quant applies to qwen35 "
                          "presets only")
    return write_qwen2(path, seed=seed, jobs=jobs, progress=progress, **PRESETS[name])
