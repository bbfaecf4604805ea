"""The qwen35 hybrid decode step as engine nodes (llama.cpp src/models/qwen35.cpp, one token;
float64 reference oracles/qwen35.py, whose module doc lists the graph with llama.cpp's names):

    x = token_embd[tok]
    DeltaNet layer (p.recurrent[il]):
        qkv, z, beta, alpha = Wqkv, Wgate, Wbeta, Walpha . rmsnorm(x)*attn_norm  (one 4-segment GEMV)
        y   = silu(conv(qkv, conv_state))          conv state shifted in place   (deltanet_ops.conv_step)
        o   = gated_rms_norm(delta_rule(y, ...))   delta-rule state in place      (deltanet_ops.gdn_step)
        x  += Wssm_out . o                                                        (GEMV "add")
    gated attention layer:
        qg, k, v = Wq, Wk, Wv . rmsnorm(x)*attn_norm (qg: [query D | gate D] per head; one GEMV)
        a   = gated attention (q/k norms, IMROPE, fp16 KV write, GQA softmax, * sigmoid(gate))
                                                                      (gated_attn_ops.gated_attention)
        x  += Wo . a                                                              (GEMV "add")
    both:   h = silu(Wg . rmsnorm(x)*post_attention_norm) * (Wu . ...)            (one GEMV)
            x += Wd . h
    logits = Wout . rmsnorm(x)*output_norm (Wout = token_embd when the file has no output.weight)
    next token = argmax(logits) on the device; position + 1.
4 nodes per DeltaNet layer + 2 FFN (3 + 2 with GGUF_HARNESS_GEMV_KQ_CONV=1: the conv inside the
ssm_in GEMV; 3 + 2 with GGUF_HARNESS_GDN_CONV=1: the conv inside the step, its state a ring
[K, C]), 3 per attention layer + 2 FFN, + 4 (embed, head, argmax,
finish). MTP blocks (n_nextn, after n_layer) are not loaded. The recurrent states (conv
[Lr, K-1, C] or the ring [Lr, K, C], delta rule [Lr, Hv, S, S], float32) are updated in place by their nodes, so the
step graph replays unchanged; Buffers.clear_recurrent zeroes them (load and reset).
Buffer sizes and the node list come from Qwen35Params alone (layout(), node_plan(): no CuPy).
"""
from __future__ import annotations

from dataclasses import dataclass

from harness.errors import UnsupportedError
from oracles.qwen35_params import Qwen35Params, read_params

from . import deltanet_ops, gated_attn_ops, ops
from .arena import Arena
from .executor import Node
from .qwen2 import ffn_nodes, head_nodes

F32 = 0
# tensors read by the DeltaNet / gated-attention kernels or as fused RMSNorm weights: the
# kernels read them as float32 in place (no GEMV dequantisation)
F32_SUFFIXES = ("_norm.weight", "ssm_conv1d.weight", "ssm_dt.bias", "ssm_a")
ATTN_BIASES = ("attn_q.bias", "attn_k.bias", "attn_v.bias")


def _layer_names(p: Qwen35Params, il: int) -> list[str]:
    common = ["attn_norm.weight", "post_attention_norm.weight", "ffn_gate.weight",
              "ffn_up.weight", "ffn_down.weight"]
    if p.recurrent[il]:
        own = ["attn_qkv.weight", "attn_gate.weight", "ssm_beta.weight", "ssm_alpha.weight",
               "ssm_conv1d.weight", "ssm_dt.bias", "ssm_a", "ssm_norm.weight", "ssm_out.weight"]
    else:
        own = ["attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
               "attn_q_norm.weight", "attn_k_norm.weight"]
    return [f"blk.{il}.{n}" for n in common + own]


def tensor_names(p: Qwen35Params, tied: bool, present=()) -> list[str]:
    """Every tensor the step reads; optional q/k/v biases of attention layers when `present`
    (the file's tensor names) holds them (the oracle accepts them; qwen35 files have none)."""
    names = ["token_embd.weight", "output_norm.weight"] + ([] if tied else ["output.weight"])
    for il in range(p.n_layer):
        names += _layer_names(p, il)
        if not p.recurrent[il]:
            names += [f"blk.{il}.{b}" for b in ATTN_BIASES if f"blk.{il}.{b}" in present]
    return names


def f32_only(name: str) -> bool:
    """True for tensors the kernels read as plain float32 (norm weights, conv taps, gates)."""
    return name.endswith(F32_SUFFIXES) or name.endswith(".bias")


def check_types(info, names: list[str]) -> None:
    """UnsupportedError when a tensor the kernels read as float32 is stored otherwise (the
    GEMV matrices are checked by formats.check_type)."""
    for n in names:
        t = info.tensor(n)
        if f32_only(n) and t.type_id != F32:
            raise UnsupportedError(f"{n}: stored as GGML type {t.type_id}; the engine's qwen35 "
                                   "kernels read it as F32")


def check_shapes(p: Qwen35Params) -> None:
    """UnsupportedError for shapes the kernels are not instantiated for."""
    if not all(p.recurrent) and p.head_dim not in gated_attn_ops.DIMS:
        raise UnsupportedError(f"attention head size {p.head_dim}: the gated attention kernel "
                               f"takes {gated_attn_ops.DIMS}")
    if any(p.recurrent):
        if p.ssm_d_state not in deltanet_ops.STEP_ROWS:
            raise UnsupportedError(f"DeltaNet state size {p.ssm_d_state}: gdn_step takes "
                                   f"{tuple(deltanet_ops.STEP_ROWS)}")
        if p.ssm_d_conv not in deltanet_ops.CONV_WIDTHS:
            raise UnsupportedError(f"conv kernel {p.ssm_d_conv}: gdn_conv_step takes "
                                   f"{deltanet_ops.CONV_WIDTHS}")


def layout(p: Qwen35Params, n_vocab: int, n_ctx: int) -> dict[str, tuple]:
    """(shape, dtype name) of every step buffer; per-layer lists sized by layer kind."""
    n_attn = p.n_layer - sum(p.recurrent)
    n_rec = sum(p.recurrent)
    q, kv, C = p.n_head * p.head_dim, p.n_head_kv * p.head_dim, p.conv_dim
    hv, s = p.ssm_dt_rank, p.ssm_d_state
    return {
        "x": ((p.n_embd,), "float32"), "h": ((p.n_ff,), "float32"),
        "logits": ((n_vocab,), "float32"), "state": ((4,), "int32"), "key": ((1,), "uint64"),
        # attention layers
        "qg": ((2 * q,), "float32"), "k": ((kv,), "float32"), "v": ((kv,), "float32"),
        "attn": ((q,), "float32"),
        "kc": ((n_attn, n_ctx, p.n_head_kv, p.head_dim), "uint16"),
        "vc": ((n_attn, n_ctx, p.n_head_kv, p.head_dim), "uint16"),
        # DeltaNet layers
        "qkv": ((C,), "float32"), "z": ((p.d_inner,), "float32"), "beta": ((hv,), "float32"),
        "alpha": ((hv,), "float32"), "y": ((C,), "float32"), "o": ((p.d_inner,), "float32"),
        # the conv state: shifted [K-1, C] (conv_step), or a ring [K, C] when the conv runs in the
        # step (GGUF_HARNESS_GDN_CONV=1, deltanet_ops.gdn_conv_step)
        "conv": ((n_rec, p.ssm_d_conv - (0 if deltanet_ops.conv_in_step(s, p.ssm_d_conv) else 1), C),
                 "float32"),
        "ssm": ((n_rec, hv, s, s), "float32"),
    }


def node_plan(p: Qwen35Params) -> list[tuple[str, str]]:
    """(name, builder) of every node of the full step, in order (CPU tests, docs)."""
    out = [("token_embd", "embed")]
    for il in range(p.n_layer):
        b = f"blk.{il}."
        if p.recurrent[il]:
            out += [(b + "ssm_in", "gemv"), (b + "ssm_step", "gdn_conv_step"), (b + "ssm_out", "gemv")] \
                if deltanet_ops.conv_in_step(p.ssm_d_state, p.ssm_d_conv) else \
                [(b + "ssm_in", "gemv"), (b + "ssm_conv", "conv_step"),
                 (b + "ssm_step", "gdn_step"), (b + "ssm_out", "gemv")]
        else:
            out += [(b + "qkv", "gemv"), (b + "attn", "gated_attention"),
                    (b + "attn_output", "gemv")]
        out += [(b + "ffn_gate_up", "gemv"), (b + "ffn_down", "gemv")]
    return out + [("output", "gemv"), ("argmax", "argmax"), ("finish", "finish")]


@dataclass
class Buffers:
    """Device activations of one step (float32 unless noted), the KV cache of the attention
    layers and the recurrent states of the DeltaNet layers (see layout())."""

    arrays: dict
    kc: list; vc: list      # per attention layer, fp16 (uint16) [n_ctx, n_kv, D] views
    conv: list; ssm: list   # per DeltaNet layer, float32 [K-1, C] (ring [K, C]: GDN_CONV) / [Hv, S, S] views

    def __getattr__(self, name):
        try:
            return self.__dict__["arrays"][name]
        except KeyError:
            raise AttributeError(name) from None

    @classmethod
    def allocate(cls, p: Qwen35Params, n_vocab: int, n_ctx: int) -> "Buffers":
        import cupy as cp
        arr = {k: cp.zeros(shape, dtype=getattr(cp, dt))
               for k, (shape, dt) in layout(p, n_vocab, n_ctx).items()}
        n_attn, n_rec = arr["kc"].shape[0], arr["conv"].shape[0]
        return cls(arr, [arr["kc"][i] for i in range(n_attn)], [arr["vc"][i] for i in range(n_attn)],
                   [arr["conv"][i] for i in range(n_rec)], [arr["ssm"][i] for i in range(n_rec)])

    def clear_recurrent(self, stream) -> None:
        """Zero both recurrent states (a new sequence); the KV cache needs no clearing (rows
        beyond the position are never read)."""
        with stream:
            self.arrays["conv"].fill(0)
            self.arrays["ssm"].fill(0)

    def kv_bytes(self) -> int:
        a = self.arrays
        return int(a["kc"].nbytes + a["vc"].nbytes + a["conv"].nbytes + a["ssm"].nbytes)


def _deltanet(il: int, r: int, p: Qwen35Params, a: Arena, b: Buffers) -> list[Node]:
    t = lambda n: a[f"blk.{il}.{n}"]  # noqa: E731
    pre = f"blk.{il}."
    hk, hv, s, C = p.ssm_n_group, p.ssm_dt_rank, p.ssm_d_state, p.conv_dim
    proj = [ops.Seg(t("attn_qkv.weight"), b.qkv), ops.Seg(t("attn_gate.weight"), b.z),
            ops.Seg(t("ssm_beta.weight"), b.beta), ops.Seg(t("ssm_alpha.weight"), b.alpha)]
    ssm_out = ops.gemv(pre + "ssm_out", "add", [ops.Seg(t("ssm_out.weight"), b.x)], b.o, p.d_inner)
    if deltanet_ops.conv_in_step(s, p.ssm_d_conv):  # GGUF_HARNESS_GDN_CONV=1 (refused with KQ_CONV=1)
        ssm_in = ops.gemv(pre + "ssm_in", "store", proj, b.x, p.n_embd, t("attn_norm.weight"), p.eps)
        return [ssm_in,
                deltanet_ops.gdn_conv_step(pre + "ssm_step", b.qkv, b.conv[r], t("ssm_conv1d.weight"),
                                           b.y, b.z, b.alpha, b.beta, t("ssm_dt.bias"), t("ssm_a"),
                                           t("ssm_norm.weight"), b.ssm[r], b.o, b.state, Hk=hk,
                                           Hv=hv, S=s, eps=p.eps, K=p.ssm_d_conv),
                ssm_out]
    # GGUF_HARNESS_GEMV_KQ_CONV=1: ssm_in runs the conv too (ops.gemv conv=, kernels/gemv_kq.cu
    # KQ_CONV) when its build has it; else the conv node
    conv = (b.conv[r], t("ssm_conv1d.weight"), b.y, C) if p.ssm_d_conv == 4 else None  # KQ_CONV: K = 4
    ssm_in = ops.gemv(pre + "ssm_in", "store", proj, b.x, p.n_embd, t("attn_norm.weight"), p.eps, conv=conv)
    conv = [] if conv and "KQ_CONV=1" in ssm_in.defines else [
        deltanet_ops.conv_step(pre + "ssm_conv", b.qkv, b.conv[r], t("ssm_conv1d.weight"), b.y,
                               C=C, K=p.ssm_d_conv)]
    return [
        ssm_in,
        *conv,
        deltanet_ops.gdn_step(pre + "ssm_step", b.y, b.z, b.alpha, b.beta, t("ssm_dt.bias"),
                              t("ssm_a"), t("ssm_norm.weight"), b.ssm[r], b.o, Hk=hk, Hv=hv,
                              S=s, eps=p.eps),
        ssm_out,
    ]


def _attention(il: int, j: int, p: Qwen35Params, a: Arena, b: Buffers, n_ctx: int) -> list[Node]:
    t = lambda n: a[f"blk.{il}.{n}"]  # noqa: E731
    bias = lambda n: a.get(f"blk.{il}.{n}").ptr if a.get(f"blk.{il}.{n}") else 0  # noqa: E731
    pre = f"blk.{il}."
    qkv = [ops.Seg(t("attn_q.weight"), b.qg, bias("attn_q.bias")),
           ops.Seg(t("attn_k.weight"), b.k, bias("attn_k.bias")),
           ops.Seg(t("attn_v.weight"), b.v, bias("attn_v.bias"))]
    return [
        *ops.gemv_nodes(pre + "qkv", "store", qkv, b.x, p.n_embd, t("attn_norm.weight"), p.eps),
        gated_attn_ops.gated_attention(
            pre + "attn", b.qg, b.k, b.v, t("attn_q_norm.weight"), t("attn_k_norm.weight"),
            b.kc[j], b.vc[j], b.state, b.attn, n_head=p.n_head, n_kv=p.n_head_kv,
            D=p.head_dim, n_rot=p.n_rot, sections=p.rope_sections, freq_base=p.freq_base,
            freq_scale=p.freq_scale, eps=p.eps, n_ctx=n_ctx, scale=p.attn_scale),
        ops.gemv(pre + "attn_output", "add", [ops.Seg(t("attn_output.weight"), b.x)], b.attn,
                 p.n_head * p.head_dim),
    ]


def build(a: Arena, b: Buffers, p: Qwen35Params, n_ctx: int) -> tuple[list[Node], list[Node]]:
    """(body, head) as qwen2.build: body = embedding + layers; head = output norm + head GEMV
    + argmax + finish."""
    body = [ops.embed("token_embd", a["token_embd.weight"], b.state, b.x)]
    j = r = 0
    for il in range(p.n_layer):
        if p.recurrent[il]:
            body += _deltanet(il, r, p, a, b)
            r += 1
        else:
            body += _attention(il, j, p, a, b, n_ctx)
            j += 1
        body += ffn_nodes(il, a, b, p.n_embd, p.n_ff, "post_attention_norm.weight", p.eps)
    return body, head_nodes(a, b, p.n_embd, p.eps)


__all__ = ["Buffers", "build", "check_shapes", "check_types", "layout", "node_plan",
           "read_params", "tensor_names"]
