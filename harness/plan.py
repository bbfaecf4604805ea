"""GPU memory capacity planner (`harness plan`; docs/sources.md §2, the source engine's rule):

    peak = resident weights + full-attention KV cache + recurrent state x 2 (double buffered)
           + persistent workspace + max(prefill, decode temporaries) + staging + safety margin

against the memory really free on the device (cudaMemGetInfo, or `--free` / `--vram-limit`
to emulate a smaller card). If the weights do not fit, token_embd (read one row per token)
can live on the host: the decode step then sends one row per token to the device (the
engine's embedding kernel reads it straight from mapped page-locked host memory; the plan
still counts one row of device staging, a bound). The engine plans with engine_plan (its
--vram-limit / --embd-placement settings, harness.config.RunConfig). Over budget ->
ModelError with the figures, before anything is allocated; the context is never shortened
and the KV precision never lowered to make it fit.

Sizes (bytes): KV = 2 (k, v) x 2 (fp16) x n_ctx x n_kv x head_dim per attention layer;
DeltaNet state = Hv x S x S fp32 (the [48,128,128] matrix per layer at the 27B shape) plus the
causal-conv state (d_conv - 1) x conv_dim fp32, both x 2 buffers; workspace = the step's fp32
activations (largest vectors: n_ff, n_vocab logits) + attention partials; temporaries of a
token-major prefill are the decode step's, so max(prefill, decode) = decode here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .config import EMBD_PLACEMENTS
from .errors import ConfigError, ModelError, UnsupportedError
from .gguf_file import GGUFInfo

MiB = 1 << 20
# Kept free beyond the plan: "free" is measured after the CUDA context exists, so this covers
# what still grows later (CUDA graph instantiation of ~100-700 kernel nodes, module loads,
# allocator rounding), each a few MiB.
SAFETY_BYTES = 32 * MiB
ATTN_PARTIAL_SPLITS = 16     # backends/engine/ops.py gqa_splits below 4096 positions


@dataclass
class Plan:
    """A placement and its budget. items: (name, bytes) on the device; host: tensors kept in
    host memory; free: the device bytes the plan was made against."""

    free: int
    items: list[tuple[str, int]] = field(default_factory=list)
    host: list[tuple[str, int]] = field(default_factory=list)

    @property
    def need(self) -> int:
        return sum(b for _, b in self.items)

    @property
    def margin(self) -> int:
        """free - need (the safety margin is one of the items, so this is what is left over)."""
        return self.free - self.need

    @property
    def fits(self) -> bool:
        return self.margin >= 0

    def as_dict(self) -> dict:
        return {"free": self.free, "need": self.need, "margin": self.margin, "fits": self.fits,
                "device": [{"name": n, "bytes": b} for n, b in self.items],
                "host": [{"name": n, "bytes": b} for n, b in self.host]}


@dataclass(frozen=True)
class Shape:
    """What the plan needs of a model besides its tensors (bytes are computed from these)."""

    n_embd: int
    n_ff: int
    n_vocab: int
    n_head: int
    n_kv: int
    head_dim: int
    n_attn_layers: int       # layers with a KV cache
    n_rec_layers: int = 0    # Gated DeltaNet layers
    ssm_heads: int = 0       # Hv
    ssm_state: int = 0       # S
    conv_dim: int = 0
    d_conv: int = 0


def shape_of(info: GGUFInfo) -> Shape:
    """Shape of a qwen2 or qwen35 GGUF (header only). UnsupportedError for other archs."""
    n_vocab = int(info.tensor("token_embd.weight").ne[-1])
    if info.arch == "qwen2":
        from oracles.qwen2_params import read_params
        p = read_params(info)
        return Shape(p.n_embd, p.n_ff, n_vocab, p.n_head, p.n_head_kv, p.head_dim, p.n_layer)
    if info.arch == "qwen35":
        from oracles.qwen35_params import read_params
        p = read_params(info)
        n_rec = sum(p.recurrent)
        return Shape(p.n_embd, p.n_ff, n_vocab, p.n_head, p.n_head_kv, p.head_dim,
                     p.n_layer - n_rec, n_rec, p.ssm_dt_rank, p.ssm_d_state, p.conv_dim, p.ssm_d_conv)
    raise UnsupportedError(f"no memory plan for architecture {info.arch!r} (qwen2, qwen35)")


def kv_bytes(s: Shape, n_ctx: int) -> int:
    """fp16 K and V of every attention layer for n_ctx positions (64 KiB per token at 27B)."""
    return 2 * 2 * n_ctx * s.n_kv * s.head_dim * s.n_attn_layers


def state_bytes(s: Shape) -> int:
    """One buffer of recurrent state: delta-rule matrices + conv windows, fp32, every layer."""
    return 4 * s.n_rec_layers * (s.ssm_heads * s.ssm_state * s.ssm_state
                                 + max(s.d_conv - 1, 0) * s.conv_dim)


def workspace_bytes(s: Shape) -> int:
    """The step's fp32 activation vectors (residual, q/k/v/attention output, FFN hidden,
    logits, DeltaNet projections) and the attention partials of every layer."""
    vectors = 3 * s.n_embd + 4 * s.n_head * s.head_dim + 2 * s.n_kv * s.head_dim + s.n_ff + s.n_vocab
    vectors += 2 * s.conv_dim + 2 * s.ssm_heads * s.ssm_state if s.n_rec_layers else 0
    g = max(s.n_head // max(s.n_kv, 1), 1)
    partials = s.n_attn_layers * s.n_kv * ATTN_PARTIAL_SPLITS * g * (s.head_dim + 4)
    return 4 * (vectors + partials)


def plan_sizes(weights: int, embd: int, embd_row: int, s: Shape, n_ctx: int, free: int,
               embd_on_host: bool | None = None, safety: int = SAFETY_BYTES) -> Plan:
    """Plan from sizes. weights: every decode tensor's bytes (token_embd included, MTP not);
    embd / embd_row: token_embd's bytes and bytes per row. embd_on_host None: on the device if
    everything fits, else on the host (the only placement change ever made)."""
    def build(host: bool) -> Plan:
        p = Plan(free=free)
        p.items.append(("weights" + (" (without token_embd)" if host else ""), weights - (embd if host else 0)))
        p.items.append((f"KV cache fp16, {n_ctx} positions", kv_bytes(s, n_ctx)))
        if s.n_rec_layers:
            p.items.append(("recurrent state x 2", 2 * state_bytes(s)))
        p.items.append(("workspace", workspace_bytes(s)))
        if host:
            p.items.append(("staging (one token_embd row)", embd_row))
            p.host.append(("token_embd.weight", embd))
        p.items.append(("safety margin", safety))
        return p
    if embd_on_host is not None:
        return build(embd_on_host)
    on_device = build(False)
    return on_device if on_device.fits else build(True)


def plan_model(info: GGUFInfo, n_ctx: int, free: int, embd_on_host: bool | None = None,
               safety: int = SAFETY_BYTES) -> Plan:
    """plan_sizes for a GGUF file's header (tensors needed for decoding, MTP excluded)."""
    if n_ctx < 1:
        raise ModelError(f"n_ctx {n_ctx} < 1")
    from .model_bytes import decode_tensors
    s = shape_of(info)
    tensors = decode_tensors(info)
    blocks = {int(n.split(".")[1]) for n in tensors if n.startswith("blk.") and n.split(".")[1].isdigit()}
    n_blocks = s.n_attn_layers + s.n_rec_layers
    if blocks != set(range(n_blocks)):  # a header whose block_count the tensors do not back
        raise ModelError(f"{info.path.name}: block_count gives {n_blocks} decode layers but the "
                         f"file holds tensors for {len(blocks)} blocks")
    weights = sum(t.nbytes for t in tensors.values())
    e = info.tensor("token_embd.weight")
    tied = "output.weight" not in info.tensors
    host = False if tied else embd_on_host  # a tied head reads the whole table every step
    return plan_sizes(weights, e.nbytes, e.row_bytes, s, n_ctx, free, host, safety)


def budget(free: int, vram_limit: int | None) -> int:
    """The device bytes a plan is made against: the free bytes, capped at vram_limit (a
    smaller card emulated on a larger one)."""
    return int(free) if vram_limit is None else min(int(free), int(vram_limit))


def engine_plan(info: GGUFInfo, n_ctx: int, free: int, vram_limit: int | None = None,
                placement: str = "auto", safety: int = SAFETY_BYTES) -> Plan:
    """The plan the engine loads with (backends/engine/backend.py; pure, no GPU needed):
    plan_model against budget(free, vram_limit), token_embd on the device ("device"), on the
    host ("host") or where plan_model puts it ("auto": the host only when the model does not
    fit otherwise). The caller refuses with require_fit before allocating anything.
    ConfigError: an unknown placement, or "host" for a model whose output head is token_embd
    itself (tied: the head reads the whole table every step, so it stays on the device)."""
    if placement not in EMBD_PLACEMENTS:
        raise ConfigError(f"token_embd placement must be one of {EMBD_PLACEMENTS}, got {placement!r}")
    if placement == "host" and "output.weight" not in info.tensors:
        raise ConfigError(f"{info.path.name}: token_embd is also the output head (no output.weight) "
                          "and is read whole every step: it cannot live on the host (placement "
                          "auto or device)")
    on_host = {"auto": None, "device": False, "host": True}[placement]
    return plan_model(info, n_ctx, budget(free, vram_limit), embd_on_host=on_host, safety=safety)


def require_fit(plan: Plan, what: str) -> None:
    """ModelError naming every item when the plan does not fit."""
    if plan.fits:
        return
    parts = ", ".join(f"{n} {b / MiB:,.1f} MiB" for n, b in plan.items)
    raise ModelError(f"{what} does not fit: needs {plan.need / MiB:,.1f} MiB ({parts}) but "
                     f"{plan.free / MiB:,.1f} MiB is free (short by {-plan.margin / MiB:,.1f} MiB)")
