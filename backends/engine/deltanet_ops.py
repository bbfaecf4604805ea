"""Node builders for the Gated DeltaNet decode step of a qwen35 recurrent layer
(kernels/deltanet.cu; design and cost model: backends/engine/DELTANET.md).

Two nodes per recurrent layer and token, after the projections (attn_qkv -> x, attn_gate -> z,
ssm_alpha -> alpha, ssm_beta -> beta, all float32 GEMV outputs) and before the ssm_out GEMV:

    conv_step(x, conv_state, w) -> y = silu(causal conv), conv_state shifted in place
    gdn_step(y, z, alpha, beta, ...) -> out = gated_rms_norm(delta_rule(...)), state in place

Formulas: oracles/deltanet.py (float64 reference) wired as oracles/qwen35.py
Qwen35Oracle._deltanet; sources: llama.cpp src/models/qwen35.cpp build_layer_attn_linear,
src/models/delta-net-base.cpp, ggml/src/ggml-cpu/ops.cpp ssm_conv_f32 and
gated_delta_net_one_chunk.

The kernels live in their own NVRTC module (not listed in module.SOURCES); it is compiled
from module.source_code("deltanet.cu") (headers digest in the code string, so an edit of
common.cuh recompiles) once per process. Arguments are cupy arrays (activations, states) or,
for weights, DeviceTensor (F32 in the arena) or cupy float32 arrays. The validation below
reads only .size / .dtype / .shape / pointers, so it runs without CuPy (tests call it on
numpy arrays).
"""
from __future__ import annotations

import os


import numpy as np

from . import module
from .arena import DeviceTensor
from .argcheck import check_array, device_ptr
from .executor import Node

CONV_THREADS = 256            # kernels/deltanet.cu GDN_CONV_THREADS
CONV_WIDTHS = (4,)            # GDN_CONV_KERNEL instantiations (qwen35: ssm.conv_kernel = 4)
STEP_ROWS = {64: (2, 4), 128: (2, 8)}  # GDN_STEP_KERNEL(S, R) instantiations
# Rows in flight per lane group in gdn_step: 2 is the source engine's scheme (docs/sources.md
# §2), S/16 puts a warp's whole share of the state in flight. Not measured yet (DELTANET.md).
DEFAULT_ROWS = 2
F32 = 0                       # GGML type id
# GDN_CSPLIT: "1" runs the S = 128 step as gdn_step_cs4_s128 (kernels/deltanet.cu 3.: a head's
# rows over the 4 blocks of a thread-block cluster, grid 4 Hv; bitwise equal to gdn_step_s128: GPU
# test passed on the H200, session 17), the default since session 17 (H200, 27B c = 2048 graph
# replay, one machine start: ssm_step 4.87 -> 4.54 us per layer, the step 6460.7 / 6460.1 ->
# 6403.9 us, -0.9 %; "" as unset); "0": gdn_step_s<S>_r<rows> (S = 64 always takes that).
GDN_CSPLIT = os.environ.get("GGUF_HARNESS_GDN_CSPLIT", "1")
GDN_CS = 4                    # blocks per head of gdn_step_cs4_s128
# Builds of the cluster step (kernels/deltanet.cu 3.; same arithmetic, bitwise equal outputs and
# states):
# GDN_EARLY "1" (the default since session 27; "" reads as 1): gdn_step_cs4_s128_e, the block's
#   state rows loaded into registers before the PDL wait (not just prefetched into L2) and z with
#   the other inputs, two L2 trips off the path (H200, 27B c = 2048, two machine starts, five
#   pairs: the step -0.49 to -0.65 %, ssm_step 4.57 -> 3.56 us per layer); "0": gdn_step_cs4_s128.
#   Ignored with GDN_CSPLIT=0 (the one-block step has no such build).
# GDN_CONV "1" (A/B, off, measured slower: the step +0.5 %; "" reads as 0): the causal conv inside the step (gdn_convstep_cs4_s128[_e],
#   gdn_conv_step below): the conv node goes, the conv state becomes a ring of K slots [K, C]
#   indexed by the position. Needs the cluster step (S = 128, GDN_CSPLIT on) and K = 4; other
#   shapes keep the conv node (qwen35-tiny, S = 64).
GDN_EARLY = os.environ.get("GGUF_HARNESS_GDN_EARLY") or "1"  # (empty reads as "1": results record what ran)
GDN_CONV = os.environ.get("GGUF_HARNESS_GDN_CONV") or "0"    # (empty reads as "0")


def check_switches() -> None:
    """Refuse bad GGUF_HARNESS_GDN_* values and GDN_CONV=1 with GDN_CSPLIT=0 or with
    GGUF_HARNESS_GEMV_KQ_CONV=1 (switches.check and conv_in_step call this). Raises ValueError
    naming the variable."""
    for env, val in (("GGUF_HARNESS_GDN_CSPLIT", GDN_CSPLIT), ("GGUF_HARNESS_GDN_EARLY", GDN_EARLY),
                     ("GGUF_HARNESS_GDN_CONV", GDN_CONV)):
        if val not in ("", "0", "1"):
            raise ValueError(f"{env}={val!r}: expected 0 or 1")
    if GDN_CSPLIT == "0" and GDN_CONV == "1":
        raise ValueError("GGUF_HARNESS_GDN_CONV=1 builds the conv into the cluster step: not with "
                         "GGUF_HARNESS_GDN_CSPLIT=0")
    from . import ops  # (ops imports this module)
    if GDN_CONV == "1" and ops.GEMV_KQ_CONV == "1":
        raise ValueError("GGUF_HARNESS_GEMV_KQ_CONV=1 and GGUF_HARNESS_GDN_CONV=1 both move the "
                         "conv (into ssm_in / into the step): set one")


def _early() -> str:
    """Kernel name suffix of the cluster step's build: "_e" with GDN_EARLY on (the default)."""
    return "_e" if GDN_EARLY in ("", "1") else ""


def _cluster(S: int) -> bool:
    """True when the S-wide step runs on the cluster kernels (GDN_CSPLIT on, S = 128)."""
    return GDN_CSPLIT in ("", "1") and S == 128


def conv_in_step(S: int, K: int) -> bool:
    """True when GGUF_HARNESS_GDN_CONV=1 applies to a layer of head size S and conv width K:
    the conv runs inside the step (gdn_conv_step) and the conv state is a ring [K, C]; False:
    conv_step's node and its shifted state [K-1, C]. Raises ValueError on a bad switch value."""
    check_switches()
    return GDN_CONV == "1" and _cluster(S) and K == 4


def kernel(name: str):
    """RawKernel `name` of kernels/deltanet.cu (gdn_conv_step_k4, gdn_step_s{64,128}_r{R})."""
    return module.kernel_in("deltanet.cu", name)


def step_threads(S: int) -> int:
    """Threads of a gdn_step block: S/8 warps (kernels/deltanet.cu gdn_step_body NT)."""
    return 4 * S


# ---------------------------------------------------------------------------- validation

def _check_weight(t, ne: tuple[int, ...], what: str, align: int = 4) -> None:
    """A weight: DeviceTensor of type F32 with GGUF ne exactly `ne`, or a float32 array with
    prod(ne) elements."""
    if isinstance(t, DeviceTensor):
        if t.type_id != F32 or tuple(t.ne) != tuple(ne):
            raise ValueError(f"{what} ({t.name}): type {t.type_id} ne {tuple(t.ne)}, expected "
                             f"F32 (0) ne {tuple(ne)}")
        if t.ptr % align:
            raise ValueError(f"{what} ({t.name}): pointer {t.ptr:#x} not {align}-byte aligned")
        return
    check_array(t, int(np.prod(ne)), what, align=align)


def _arg(t):
    """Kernel argument: a DeviceTensor as its pointer, an array as itself."""
    return np.uint64(t.ptr) if isinstance(t, DeviceTensor) else t


def check_conv_step(x, conv_state, w, y, *, C: int, K: int, slots: int | None = None) -> None:
    """Validate conv_step's arguments (see conv_step); slots: rows of the conv state, K-1
    (conv_step's shifted state, the default) or K (gdn_conv_step's ring). Raises ValueError."""
    if K not in CONV_WIDTHS:
        raise ValueError(f"conv kernel width K={K}: instantiated for {CONV_WIDTHS}")
    if C < 1:
        raise ValueError(f"conv channels C={C} < 1")
    check_array(x, C, "conv x")
    slots = K - 1 if slots is None else slots
    check_array(conv_state, slots * C, f"conv state [{slots}, C={C}]")
    _check_weight(w, (K, C), "ssm_conv1d.weight [C, K]", align=16)  # float4 taps when K == 4
    check_array(y, C, "conv y")
    if device_ptr(y) is not None and device_ptr(y) in (device_ptr(x), device_ptr(conv_state)):
        raise ValueError("conv y must not alias x or the conv state")


def check_gdn_step(y, z, alpha, beta, dt_bias, ssm_a, norm_w, state, out, *, Hk: int, Hv: int,
                   S: int, rows: int = DEFAULT_ROWS) -> None:
    """Validate gdn_step's arguments (see gdn_step). Raises ValueError."""
    if S not in STEP_ROWS:
        raise ValueError(f"DeltaNet head size S={S}: instantiated for {tuple(STEP_ROWS)}")
    if rows not in STEP_ROWS[S]:
        raise ValueError(f"rows in flight {rows}: S={S} instantiates {STEP_ROWS[S]}")
    if Hk < 1 or Hv < 1 or Hv % Hk:
        raise ValueError(f"head counts Hk={Hk}, Hv={Hv}: need Hv % Hk == 0 (llama.cpp "
                         "delta-net-base.cpp: H_v % H_k == 0)")
    C = 2 * Hk * S + Hv * S
    check_array(y, C, f"conv output y [C = 2*{Hk}*{S} + {Hv}*{S}]")
    check_array(z, Hv * S, "z [Hv*S]")
    check_array(alpha, Hv, "alpha [Hv]")
    check_array(beta, Hv, "beta [Hv]")
    _check_weight(dt_bias, (Hv,), "ssm_dt.bias [Hv]")
    _check_weight(ssm_a, (Hv,), "ssm_a [Hv]")
    _check_weight(norm_w, (S,), "ssm_norm.weight [S]")
    check_array(state, Hv * S * S, "delta-rule state [Hv, S, S]", align=16)  # float4 rows
    check_array(out, Hv * S, "out [Hv*S]")
    po = device_ptr(out)
    if po is not None and po in (device_ptr(y), device_ptr(z), device_ptr(state)):
        raise ValueError("out must not alias y, z or the state")


# ---------------------------------------------------------------------------- nodes

def conv_step(name: str, x, conv_state, w, y, *, C: int, K: int = 4) -> Node:
    """Causal depthwise conv of one token + silu, conv state shifted in place.

    x: float32 [C] (attn_qkv output, C = 2*Hk*S + Hv*S); conv_state: float32 [K-1, C] (zeros
    after a reset), updated in place; w: ssm_conv1d.weight, F32 DeviceTensor ne [K, C] or a
    float32 array [C, K], 16-byte aligned; y: float32 [C] output, = silu(sum_i xp[i] w[c, i])
    with xp = [conv_state; x] (oracles.deltanet.causal_conv1d then ops.silu; ggml ops.cpp
    ssm_conv_f32, llama.cpp delta-net-base.cpp build_conv_state). Grid ceil(C/256) x 256.
    Raises ValueError on inconsistent shapes, dtypes, alignment, K not in CONV_WIDTHS.
    """
    check_conv_step(x, conv_state, w, y, C=C, K=K)
    k = kernel(f"gdn_conv_step_k{K}")
    nbytes = 4 * C * (1 + 2 * (K - 1) + K + 1)  # x, state read+write, taps, y
    return Node(name, "deltanet", k, (-(-C // CONV_THREADS),), (CONV_THREADS,),
                (x, conv_state, _arg(w), y, np.int32(C)), bytes=nbytes, flops=2 * K * C,
                out=y, fmt="F32")


def _step_bytes(Hk: int, Hv: int, S: int) -> int:
    """Bytes one gdn_step moves: the state read and written; q, k (per value head, L2 hits after
    the first), v, z, out, gates."""
    return 2 * 4 * Hv * S * S + 4 * (2 * Hk * S + 3 * Hv * S + 4 * Hv + S)


def gdn_step(name: str, y, z, alpha, beta, dt_bias, ssm_a, norm_w, state, out, *, Hk: int,
             Hv: int, S: int, eps: float, rows: int = DEFAULT_ROWS) -> Node:
    """Gates, q/k L2 norms, gated delta rule and gated RMS norm of one token, all Hv heads.

    y: float32 [C] conv output (q [Hk, S] | k [Hk, S] | v [Hv, S]); z: float32 [Hv*S]
    (attn_gate output); alpha, beta: float32 [Hv] raw ssm_alpha / ssm_beta projections;
    dt_bias, ssm_a: [Hv] and norm_w: [S] weights (F32 DeviceTensor or float32 array);
    state: float32 [Hv, S, S] transposed delta-rule state (oracles.deltanet module doc),
    16-byte aligned, updated in place; out: float32 [Hv*S]. eps: the model's RMS epsilon (L2
    norms and output norm). rows: state rows in flight per lane group (STEP_ROWS[S]).
    Per head h (key head h % Hk): beta = sigmoid(beta[h]), g = softplus(alpha[h] +
    dt_bias[h]) * ssm_a[h]; q, k = l2_norm; M = e^g M; delta = beta (v - M k); M += delta k^T;
    o = M q / sqrt(S); out = o / rms(o) * norm_w * silu(z) (oracles.qwen35 _deltanet,
    llama.cpp qwen35.cpp build_layer_attn_linear, ggml ops.cpp gated_delta_net_one_chunk).
    Grid Hv blocks of 4*S threads (GGUF_HARNESS_GDN_CSPLIT unset or 1, the default, and S = 128: 4 Hv, a cluster of 4
    blocks per head, `rows` unused; its _e build unless GGUF_HARNESS_GDN_EARLY=0). Raises
    ValueError on inconsistent shapes, dtypes, alignment, S or rows not instantiated,
    Hv % Hk != 0, a bad GGUF_HARNESS_GDN_* value (check_switches).
    """
    check_gdn_step(y, z, alpha, beta, dt_bias, ssm_a, norm_w, state, out, Hk=Hk, Hv=Hv, S=S,
                   rows=rows)
    check_switches()
    cs = GDN_CS if _cluster(S) else 1  # GGUF_HARNESS_GDN_CSPLIT ("": the default, on)
    k = kernel(f"gdn_step_cs{cs}_s{S}{_early()}" if cs > 1 else f"gdn_step_s{S}_r{rows}")
    nbytes = _step_bytes(Hk, Hv, S)
    # per state element: two dot-product multiply-adds (M.k, M.q) and the update (mul + fma)
    flops = 2 * 4 * Hv * S * S
    return Node(name, "deltanet", k, (cs * Hv,), (step_threads(S),),
                (y, z, alpha, beta, _arg(dt_bias), _arg(ssm_a), _arg(norm_w), state, out,
                 np.int32(Hk), np.float32(eps)), bytes=nbytes, flops=flops, out=out, fmt="F32")


def gdn_conv_step(name: str, x, ring, w, y, z, alpha, beta, dt_bias, ssm_a, norm_w, state, out,
                  step_state, *, Hk: int, Hv: int, S: int, eps: float, K: int = 4) -> Node:
    """conv_step and gdn_step in one node (GGUF_HARNESS_GDN_CONV=1; kernels/deltanet.cu 3.,
    gdn_convstep_cs4_s128[_e]): the same values, bitwise, with the conv state kept as a ring.

    x: float32 [C] attn_qkv projection; ring: float32 [K, C] conv state, slot s = the input of
    the last position p with p % K == s (zeros after a reset; positions must advance by one per
    step, as the engine's finish_step and prefill do), updated in place (slot step_state[1] % K);
    w: ssm_conv1d.weight as conv_step; y: float32 [C], written = silu(conv) (as conv_step's y;
    read by captures only); z .. out: as gdn_step; step_state: int32 [>= 2], step_state[1] the
    position. Only S = 128, K = 4 and the cluster step (conv_in_step). Grid 4 Hv blocks of 4 S
    threads. Raises ValueError as conv_step and gdn_step do, for a ring that is not [K, C], a
    step state that is not int32 [>= 2], or a shape conv_in_step does not take.
    """
    C = 2 * Hk * S + Hv * S
    check_conv_step(x, ring, w, y, C=C, K=K, slots=K)
    check_gdn_step(y, z, alpha, beta, dt_bias, ssm_a, norm_w, state, out, Hk=Hk, Hv=Hv, S=S)
    if getattr(step_state, "dtype", None) != np.int32 or int(step_state.size) < 2:
        raise ValueError(f"step state: expected an int32 array of >= 2 elements, got "
                         f"{type(step_state).__name__} {getattr(step_state, 'dtype', None)}")
    if not conv_in_step(S, K):
        raise ValueError(f"gdn_conv_step: S={S}, K={K} with GGUF_HARNESS_GDN_CONV={GDN_CONV!r}, "
                         f"GGUF_HARNESS_GDN_CSPLIT={GDN_CSPLIT!r}: needs S = 128, K = 4, both on")
    k = kernel("gdn_convstep_cs4_s128" + _early())
    # the step's bytes + the conv's: taps, K-1 ring slots read, one written, y (the step's
    # q/k/v reads are now the x reads: x counted there)
    nbytes = _step_bytes(Hk, Hv, S) + 4 * C * (K + K - 1 + 1 + 1)
    flops = 2 * 4 * Hv * S * S + 2 * K * C
    return Node(name, "deltanet", k, (GDN_CS * Hv,), (step_threads(S),),
                (x, ring, _arg(w), y, step_state, np.int32(C), z, alpha, beta, _arg(dt_bias),
                 _arg(ssm_a), _arg(norm_w), state, out, np.int32(Hk), np.float32(eps)),
                bytes=nbytes, flops=flops, out=out, fmt="F32")
