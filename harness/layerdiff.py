"""Layer-by-layer diff: compare named intermediates of the float64 oracle with llama.cpp's.

The oracle reports every node it computes through its capture callback (name, layer, array),
in graph order; llama.cpp reports its graph nodes through the eval callback
(backends.llamacpp.capture), named "<name>-<layer>" by its builders' cb() calls. For each
oracle node with a llama.cpp counterpart of the same element count, both are flattened in
memory order (numpy order [tokens, ...] equals ggml's ne order reversed) and compared:
    rel_rms = ||out - ref|| / ||ref||,  max_abs, and the worst flat index.
The first node (in the oracle's order: layer by layer, op by op) whose rel_rms exceeds `tol`
is the first bad node: where the two computations part. Nodes llama.cpp does not expose
under that name are listed as missing, never as bad.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import numpy as np

from harness.config import ModelRef, RunConfig
from harness.errors import ConfigError

# oracle name -> llama.cpp name where a later cb() renames the same tensor (qwen35.cpp)
RENAMED = {"inp_embd": "model.input_embed", "v_conv": "v_conv_predelta", "post_ffn": "l_out"}
DEFAULT_TOL = 1e-3  # F32 models: llama.cpp's float32 graph is ~1e-6 off float64


def llama_name(name: str, layer: int) -> str:
    """The graph-node name llama.cpp gives an oracle node (src/llama-context.cpp graph_get_cb)."""
    base = RENAMED.get(name, name)
    return base if layer < 0 else f"{base}-{layer}"


@dataclass(frozen=True)
class NodeDiff:
    """One compared node. status: ok, bad (rel_rms > tol), missing (no llama.cpp node of that
    name), size (element counts differ). call: 0 = prefill, k = k-th step."""

    call: int
    name: str
    layer: int
    llama_name: str
    status: str
    n: int = 0
    rel_rms: float = float("nan")
    max_abs: float = float("nan")
    worst_index: int = -1
    ref_value: float = float("nan")
    out_value: float = float("nan")


@dataclass
class LayerDiff:
    """All compared nodes in order; first_bad is the first with status "bad"."""

    tol: float
    nodes: list[NodeDiff] = field(default_factory=list)

    @property
    def first_bad(self) -> NodeDiff | None:
        return next((d for d in self.nodes if d.status == "bad"), None)

    @property
    def compared(self) -> list[NodeDiff]:
        return [d for d in self.nodes if d.status in ("ok", "bad")]

    def summary(self) -> str:
        """One line: the first bad layer and op, or that every compared node agreed."""
        bad = self.first_bad
        n = len(self.compared)
        if bad is None:
            worst = max(self.compared, key=lambda d: d.rel_rms, default=None)
            w = f"; worst {worst.llama_name} rel_rms {worst.rel_rms:.2e}" if worst else ""
            return f"all {n} compared nodes within rel_rms {self.tol:g}{w}"
        where = "head" if bad.layer < 0 else f"layer {bad.layer}"
        return (f"first bad node: {where}, op {bad.name!r} (llama.cpp {bad.llama_name!r}, call "
                f"{bad.call}): rel_rms {bad.rel_rms:.3e} > {self.tol:g}, max_abs {bad.max_abs:.3e} "
                f"at flat index {bad.worst_index} (ref {bad.ref_value:.6g}, llama.cpp "
                f"{bad.out_value:.6g}); {n} nodes compared")

    def to_json(self) -> dict:
        bad = self.first_bad
        return {"tol": self.tol, "first_bad": asdict(bad) if bad else None,
                "summary": self.summary(), "nodes": [asdict(d) for d in self.nodes]}


def compare_node(call: int, name: str, layer: int, ref: np.ndarray, out: np.ndarray | None,
                 tol: float) -> NodeDiff:
    """Diff of one oracle node `ref` ([n_tokens, ...]) against llama.cpp's `out` (None = not
    exposed). When llama.cpp holds only one row's worth of elements, the oracle's last row is
    compared (the output rows of the prompt's last layer); other size mismatches are "size"."""
    lname = llama_name(name, layer)
    if out is None:
        return NodeDiff(call, name, layer, lname, "missing")
    ref = np.asarray(ref, np.float64)
    a, b = ref.ravel(), np.asarray(out, np.float64).ravel()
    if a.size != b.size and ref.ndim >= 2 and b.size == ref[-1].size:
        # llama.cpp computes the last layer's tail only for the rows it outputs (the prompt's
        # last token: llama-graph.cpp inp_out_ids), the oracle for every prompt row
        a = ref[-1].ravel()
    if a.size != b.size:
        return NodeDiff(call, name, layer, lname, "size", n=a.size)
    diff = np.abs(b - a)
    worst = int(np.nanargmax(diff)) if diff.size and not np.isnan(diff).all() else 0
    norm = float(np.linalg.norm(a))
    rel = float(np.linalg.norm(b - a) / norm) if norm > 0 else float(np.linalg.norm(b - a))
    status = "ok" if rel <= tol else "bad"  # NaN compares false: a NaN node is bad
    return NodeDiff(call, name, layer, lname, status, a.size, rel,
                    float(diff[worst]) if diff.size else 0.0, worst,
                    float(a[worst]) if a.size else 0.0, float(b[worst]) if b.size else 0.0)


def diff_call(call: int, ref_nodes: Sequence[tuple[str, int, np.ndarray]],
              lookup: Callable[[str], np.ndarray | None], tol: float) -> list[NodeDiff]:
    """Compare one forward call's oracle nodes with llama.cpp's (lookup: name -> last node)."""
    return [compare_node(call, n, l, a, lookup(llama_name(n, l)), tol) for n, l, a in ref_nodes]


def layer_diff(model_path: str | os.PathLike, prompt: Sequence[int], steps: Sequence[int] = (),
               *, tol: float = DEFAULT_TOL, n_ctx: int = 256, n_threads: int = 2,
               inject: dict | None = None, act_round: str | None = None,
               gpu: bool = False) -> LayerDiff:
    """Run the prompt (one prefill) and then `steps` (one token each) through the qwen35/qwen2
    oracle and through llama.cpp (CPU, f32 KV cache, flash attention off so no F16 rounding),
    capturing both, and diff every call. gpu=True: llama.cpp as the verification protocol
    runs it on CUDA (every layer offloaded, flash attention on, f16 KV cache) and the oracle
    with an f16 KV cache (kv_round="f16"), so what is left is llama.cpp's kernel arithmetic
    (int8 activations in mmvq/mmq, fp16 inside flash attention). inject: the oracle's fault injection
    {(name, layer): fn} (tests); act_round="llamacpp": the oracle rounds activations of
    quantised products as llama.cpp's CPU backend (oracles.actquant), so quantised models
    can be diffed at a float32-level tolerance. Raises ConfigError / ModelError /
    UnsupportedError.
    """
    from backends.llamacpp.capture import CapturingLlamaCpp
    from backends.oracle import _oracle_class
    from harness.gguf_file import open_gguf

    if not prompt:
        raise ConfigError("layer_diff needs a non-empty prompt")
    nodes: list[tuple[str, int, np.ndarray]] = []
    cls = _oracle_class(open_gguf(model_path).arch)
    kwargs = {k: v for k, v in (("inject", inject), ("act_round", act_round),
                                ("kv_round", "f16" if gpu else None)) if v}
    oracle = cls(model_path, n_ctx=n_ctx, capture=lambda n, l, a: nodes.append((n, l, a.copy())),
                 **kwargs)
    lc = CapturingLlamaCpp()
    cfg = (RunConfig(n_ctx=n_ctx, kv_type="f16", flash_attn=True, n_gpu_layers=99,
                     n_threads=n_threads) if gpu else
           RunConfig(n_ctx=n_ctx, kv_type="f32", flash_attn=False, n_threads=n_threads))
    lc.load(ModelRef("layer-diff", model_path), cfg)
    report = LayerDiff(tol)
    try:
        for call, toks in enumerate([list(prompt)] + [[t] for t in steps]):
            nodes.clear()
            lc.capture.clear()
            oracle.prefill(toks)
            lc.prefill(toks)
            report.nodes += diff_call(call, nodes, lc.capture.last, tol)
    finally:
        lc.close()
    return report
