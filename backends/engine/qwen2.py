"""The qwen2 decode step as engine nodes (llama.cpp src/models/qwen2.cpp, one token):

    x = token_embd[tok]
    per layer:  q,k,v = Wq,k,v . rmsnorm(x) + b      (one node, norm fused)
                attn  = softmax(rope(q) . rope(k)^T / sqrt(D)) . v   (cache write fused)
                x    += Wo . attn                      (residual fused)
                h     = silu(Wg . rmsnorm(x)) * (Wu . rmsnorm(x))   (one node)
                x    += Wd . h
    logits = Wout . rmsnorm(x) (Wout = token_embd when the file has no output.weight)
    next token = argmax(logits) on the device; position + 1.
5 nodes per layer + 4 (embed, head, argmax, finish).
"""
from __future__ import annotations

from dataclasses import dataclass

from oracles.qwen2_params import Qwen2Params, read_params

from . import ops
from .arena import Arena
from .executor import Node

SPLIT_ABOVE = 4096     # contexts above this use split attention (chunks of SPLIT_CHUNK)
SPLIT_CHUNK = 512


def tensor_names(p: Qwen2Params, tied: bool) -> list[str]:
    names = ["token_embd.weight", "output_norm.weight"] + ([] if tied else ["output.weight"])
    for i in range(p.n_layer):
        b = f"blk.{i}."
        names += [b + n for n in ("attn_norm.weight", "attn_q.weight", "attn_q.bias",
                                  "attn_k.weight", "attn_k.bias", "attn_v.weight", "attn_v.bias",
                                  "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight",
                                  "ffn_up.weight", "ffn_down.weight")]
    return names


@dataclass
class Buffers:
    """Device activations of one step (float32 unless noted) and the KV cache."""

    x: object; q: object; k: object; v: object; attn: object; h: object; logits: object
    state: object   # int32 [4]: token, position, non-finite count, pad
    key: object     # uint64 [1]: argmax key
    kc: list; vc: list  # per layer fp16 (uint16) [n_ctx, n_kv, D]
    part: object | None

    @classmethod
    def allocate(cls, p: Qwen2Params, n_vocab: int, n_ctx: int) -> "Buffers":
        import cupy as cp
        f = lambda n: cp.zeros(n, dtype=cp.float32)  # noqa: E731
        kv = lambda: [cp.zeros((n_ctx, p.n_head_kv, p.head_dim), cp.uint16)  # noqa: E731
                      for _ in range(p.n_layer)]
        split = n_ctx > SPLIT_ABOVE
        n_split = -(-n_ctx // SPLIT_CHUNK)
        return cls(f(p.n_embd), f(p.n_embd_q), f(p.n_embd_kv), f(p.n_embd_kv), f(p.n_embd_q),
                   f(p.n_ff), f(n_vocab), cp.zeros(4, cp.int32), cp.zeros(1, cp.uint64), kv(), kv(),
                   f(p.n_head * n_split * (p.head_dim + 2)) if split else None)

    def kv_bytes(self) -> int:
        return sum(int(a.nbytes) for a in self.kc + self.vc)


def _layer(i: int, p: Qwen2Params, a: Arena, b: Buffers, n_ctx: int) -> list[Node]:
    t = lambda n: a[f"blk.{i}.{n}"]  # noqa: E731
    bias = lambda n: a[f"blk.{i}.{n}"].ptr  # noqa: E731
    qkv = [ops.Seg(t("attn_q.weight"), b.q, bias("attn_q.bias")),
           ops.Seg(t("attn_k.weight"), b.k, bias("attn_k.bias")),
           ops.Seg(t("attn_v.weight"), b.v, bias("attn_v.bias"))]
    nodes = ops.gemv_nodes(f"blk.{i}.qkv", "store", qkv, b.x, p.n_embd, t("attn_norm.weight"), p.eps)
    nodes += ops.attention(f"blk.{i}.attn", b.q, b.k, b.v, b.kc[i], b.vc[i], b.state, b.attn,
                           n_head=p.n_head, n_kv=p.n_head_kv, D=p.head_dim, n_rot=p.n_rot,
                           freq_base=p.freq_base, freq_scale=p.freq_scale, n_ctx=n_ctx,
                           chunk=SPLIT_CHUNK if b.part is not None else 0, part=b.part)
    nodes.append(ops.gemv(f"blk.{i}.attn_output", "add", [ops.Seg(t("attn_output.weight"), b.x)],
                          b.attn, p.n_embd_q))
    return nodes + ffn_nodes(i, a, b, p.n_embd, p.n_ff, "ffn_norm.weight", p.eps)


def ffn_nodes(i: int, a: Arena, b, n_embd: int, n_ff: int, norm: str, eps: float) -> list[Node]:
    """SwiGLU FFN of layer i (llm_graph_context::build_ffn, LLM_FFN_SILU + LLM_FFN_PAR): the
    gate/up pair on the RMS-normed residual (norm: the layer's norm tensor name, ffn_norm
    for qwen2, post_attention_norm for qwen35) into b.h, then ffn_down added into b.x."""
    t = lambda n: a[f"blk.{i}.{n}"]  # noqa: E731
    return [ops.gemv(f"blk.{i}.ffn_gate_up", "swiglu",
                     [ops.Seg(t("ffn_gate.weight"), b.h), ops.Seg(t("ffn_up.weight"), b.h)],
                     b.x, n_embd, t(norm), eps),
            ops.gemv(f"blk.{i}.ffn_down", "add", [ops.Seg(t("ffn_down.weight"), b.x)], b.h, n_ff)]


def build(a: Arena, b: Buffers, p: Qwen2Params, n_ctx: int) -> tuple[list[Node], list[Node]]:
    """(body, head): body = embedding + layers (enough for a prompt token whose logits are
    not needed); head = output norm + head GEMV + argmax + finish."""
    body = [ops.embed("token_embd", a["token_embd.weight"], b.state, b.x)]
    for i in range(p.n_layer):
        body += _layer(i, p, a, b, n_ctx)
    return body, head_nodes(a, b, p.n_embd, p.eps)


def head_nodes(a: Arena, b, n_embd: int, eps: float) -> list[Node]:
    """Output RMSNorm + head GEMV (output.weight, or the tied token_embd) into b.logits,
    device argmax into b.key, finish_step (next token, position + 1). b: any Buffers with
    x, logits, key, state (qwen2 and qwen35)."""
    out_w = a.get("output.weight") or a["token_embd.weight"]
    return [ops.gemv("output", "store", [ops.Seg(out_w, b.logits)], b.x, n_embd,
                     a["output_norm.weight"], eps),
            ops.argmax("argmax", b.logits, b.key, b.state),
            ops.finish("finish", b.key, b.state)]


__all__ = ["Buffers", "build", "ffn_nodes", "head_nodes", "read_params", "tensor_names"]
