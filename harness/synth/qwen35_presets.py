"""Named synthetic qwen35 models and per-tensor quant mixes.

Shapes: "qwen35-27b" is the source documents' target (docs/sources.md §1: 64 layers, every 4th full
attention, hidden 5120, FFN 17408, vocab 248320; attention 24 query heads with an output
gate, 4 KV heads x 256, RoPE over 64 dims with sections [11, 11, 10, 0]; DeltaNet 16 key and
48 value heads x 128, conv kernel 4; one MTP block, skipped by plain decoding).
"qwen35-tiny" keeps those ratios at 256 wide (every matrix row whole K-quant super-blocks).
"qwen35-27b-4l" is "qwen35-27b" cut to 4 layers (DeltaNet 0-2, full attention 3) without the
MTP block: every tensor shape of the 27B (engine vs oracle at the real widths, issue #6),
2.66 GB in q4_k_m, float32 weights for the oracle ~11 GB.

Mixes (quant name -> {glob: GGML type}, first match wins, norms/conv/ssm_a/dt always F32):
  q4_k_m     llama.cpp Q4_K_M style: Q4_K, Q6_K for attn_v / ffn_down on "more bits" layers
             (first and last eighth, every third; llama.cpp src/llama-quant.cpp use_more_bits)
             and for output.
  ud-q4_k_m  an "Unsloth dynamic" style mix with the types the source file holds (Q4_K, Q5_K,
             Q6_K, IQ4_XS, IQ3_S, F32): token_embd Q4_K, output Q6_K, DeltaNet in/out Q5_K,
             FFN gate/up IQ4_XS (IQ3_S in the middle layers), ffn_down Q5_K on the outer
             layers and Q4_K inside. Chosen so decode bytes land within 2 % of the source's
             16,102,434,816 (test_synth_qwen35 checks it without writing the file). Outer
             and middle groups are n_layer/8 layers, at least one (4 layers: ffn_down Q5_K
             on 0 and 3, IQ3_S gate/up on 1).
  iq4_xs     IQ4_XS everywhere except output (Q6_K).
  q8_0 / iq3_s / f32 / f16: one type for every matrix (iq3_s keeps output Q6_K).
"""
from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError
from .gguf_stream import Progress
from .qwen35 import Qwen35Shape, decode_bytes, plan_tensors, write_qwen35

SHAPES: dict[str, dict] = {
    "qwen35-tiny": dict(n_layer=8, n_embd=256, n_ff=512, n_vocab=512, n_head=4, n_head_kv=2,
                        head_dim=64, n_rot=16, rope_sections=(3, 3, 2, 0), ssm_d_state=64,
                        ssm_n_group=2, ssm_dt_rank=4, n_ctx_train=4096),
    "qwen35-27b": dict(n_layer=64, n_embd=5120, n_ff=17408, n_vocab=248320, n_head=24,
                       n_head_kv=4, head_dim=256, n_rot=64, rope_sections=(11, 11, 10, 0),
                       ssm_d_state=128, ssm_n_group=16, ssm_dt_rank=48, n_ctx_train=262144,
                       n_nextn=1),
}
SHAPES["qwen35-27b-4l"] = {**SHAPES["qwen35-27b"], "n_layer": 4, "n_nextn": 0}
SOURCE_DECODE_BYTES = 16_102_434_816  # docs/sources.md §1, Qwen3.8-27B-UD-Q4_K_M tensors for decoding


def _more_bits(il: int, n: int) -> bool:
    """llama.cpp llama-quant.cpp use_more_bits(i_layer, n_layers)."""
    return il < n // 8 or il >= 7 * n // 8 or (il - n // 8) % 3 == 2


def _layers(names: list[str], layers, qtype: str) -> dict[str, str]:
    return {f"blk.{il}.{n}.weight": qtype for il in layers for n in names}


def mix_q4_k_m(n_layer: int) -> dict[str, str]:
    more = [il for il in range(n_layer) if _more_bits(il, n_layer)]
    return {"output.weight": "Q6_K", **_layers(["attn_v", "ffn_down"], more, "Q6_K"), "*": "Q4_K"}


def mix_ud_q4_k_m(n_layer: int) -> dict[str, str]:
    k = max(1, n_layer // 8)  # an eighth of the layers, at least one (as n_layer // 8 from 8 up)
    outer = [il for il in range(n_layer) if il < k or il >= 7 * n_layer // 8]
    middle = range(3 * n_layer // 8, 3 * n_layer // 8 + k)
    return {"token_embd.weight": "Q4_K", "output.weight": "Q6_K",
            **_layers(["ffn_down"], outer, "Q5_K"),
            **_layers(["ffn_gate", "ffn_up"], middle, "IQ3_S"),
            "blk.*.ffn_down.weight": "Q4_K", "blk.*.ffn_*.weight": "IQ4_XS",
            "blk.*.attn_k.weight": "Q6_K", "blk.*.attn_v.weight": "Q6_K",
            "blk.*.attn_qkv.weight": "Q5_K", "blk.*.attn_gate.weight": "Q5_K",
            "blk.*.ssm_out.weight": "Q5_K", "blk.*.attn_output.weight": "Q5_K",
            "blk.*.ssm_alpha.weight": "F32", "blk.*.ssm_beta.weight": "F32",
            "blk.*.nextn.*": "Q8_0", "*": "Q4_K"}


def mix_for(quant: str, n_layer: int) -> str | dict[str, str]:
    """The quant mix called `quant` (case-insensitive) for a model of n_layer layers."""
    q = quant.lower()
    mixes = {"q4_k_m": lambda: mix_q4_k_m(n_layer), "ud-q4_k_m": lambda: mix_ud_q4_k_m(n_layer),
             "iq4_xs": lambda: {"output.weight": "Q6_K", "*": "IQ4_XS"},
             "iq3_s": lambda: {"output.weight": "Q6_K", "*": "IQ3_S"},
             "q8_0": lambda: "Q8_0", "f32": lambda: "F32", "f16": lambda: "F16"}
    if q not in mixes:
        raise ConfigError(f"unknown quant mix {quant!r} (known: {', '.join(mixes)})")
    return mixes[q]()


QUANTS = ("f32", "f16", "q8_0", "q4_k_m", "ud-q4_k_m", "iq4_xs", "iq3_s")


def shape(name: str) -> Qwen35Shape:
    """Qwen35Shape of a preset; ConfigError for an unknown name."""
    if name not in SHAPES:
        raise ConfigError(f"unknown qwen35 preset {name!r} (known: {', '.join(SHAPES)})")
    return Qwen35Shape(**SHAPES[name])


def preset_decode_bytes(name: str, quant: str) -> int:
    """Bytes a decode step reads (all tensors but MTP blocks) for a preset and mix; no writing."""
    s = shape(name)
    return decode_bytes(plan_tensors(s, mix_for(quant, s.n_layer)), s)


def write_qwen35_preset(name: str, path: str | Path, quant: str = "f32", seed: int = 0,
                        method: str = "direct", progress: Progress | None = None,
                        jobs: int = 1) -> Path:
    """write_qwen35(path, shape(name), mix_for(quant, n_layer), seed, method, progress,
    jobs=jobs): jobs worker processes, same bytes for any jobs."""
    s = shape(name)
    return write_qwen35(path, s, mix_for(quant, s.n_layer), seed=seed, method=method,
                        progress=progress, jobs=jobs)
