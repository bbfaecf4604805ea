"""Chain roofline of a decode step: what a design of one kernel per node can reach on the
step's node sizes (GPU only, except `layout` and `summarize`).

For every node of the engine's step graph, in order, one plain streaming read of as many bytes
as that node moves (backends/engine/kernels/stream_chain.cu), each from its own 256-byte
aligned region of one buffer (so every read is cold in L2, as a step's weights are), launched
with programmatic dependent launch (backends/engine/launch.py) and captured `chains` times
back to back into one CUDA graph. The time per chain is the step time of a hypothetical engine
whose every node were a pure read of its bytes: launch latency, ramp-up, the last partial
wave and the dependency between consecutive nodes included, no arithmetic (the staged
handshakes add the staging of an input vector).

Seven handshakes (stream_chain.cu `mode`):
  independent  no griddepcontrol.wait: nodes may overlap (the b2b roofline of `harness bench
               kernels`, summed over a step);
  dependent    each node reads nothing until its predecessor has finished (a GEMV needs its x);
  prefetch     as dependent, after asking L2 for its first pass's lines before the wait (as the
               engine's GEMVs prefetched their first rows until session 24; since session 25
               they ask for only each first row's first round, kernels/gemv_kq.cu KQ_PF0);
  staged       as dependent, then every block copies 20 KiB of an L2-resident x into shared
               memory and passes a barrier before its first load (a GEMV's x staging, without
               the quantisation arithmetic);
  staged_prefetch  prefetch's requests before the wait, then staged's staging: the structure
               of the engine's v9 GEMVs, with a plain read for their arithmetic;
  staged_bulk  as staged, but x comes in one bulk copy (TMA, cp.async.bulk) that the block's
               threads wait for on an mbarrier: what staging could cost without per-thread loads;
  staged_codes as staged, over 10.6 KiB (x as int16 codes + block scales, as a producer could
               write it) instead of 20 KiB of fp32.

step / dependent-chain is then how far the engine's kernels are from the per-node design's
ceiling, and (dependent - independent) what the dependency itself costs on these sizes.
"""
from __future__ import annotations

import statistics

from .jsonread import whole

ALIGN = 256        # region alignment (bytes): every region starts on its own 128-byte lines
THREADS = 512      # stream_chain's __launch_bounds__
MODES = {"independent": 0, "dependent": 1, "prefetch": 2, "staged": 3, "staged_prefetch": 4, "staged_bulk": 5,
         "staged_codes": 3}
X_WORDS = 1280     # the staged modes: 16-byte words of x each block stages (20 KiB: 5120 fp32, the 27B's width)
# ... except staged_codes: x as a producer could write it already quantised, 5120 int16 codes and
# 160 fp32 block scales (10,880 bytes = 680 words), staged the same way
X_WORDS_OF = {"staged_codes": 680}
# recorded with the figures; change it when the kernel or the timing changes. /1: session 23's
# measurements (docs/perf-notes.md); /2: block 0 alone folds the staged words into the XOR
METHOD = "stream-chain/2"
MARGIN = 1 << 30   # device bytes left free beside the buffer


def layout(byte_counts: list[int]) -> tuple[list[int], list[int], int]:
    """(offsets, sizes, total bytes) of one region per node: size = the node's bytes rounded up
    to whole 16-byte words (at least one), offsets 256-byte aligned, in node order.
    Raises ValueError on a negative or non-integer byte count or an empty list."""
    if not byte_counts:
        raise ValueError("no nodes")
    offsets, sizes, off = [], [], 0
    for b in byte_counts:
        if whole(b) is None:
            raise ValueError(f"node byte count {b!r}: expected an int >= 0")
        size = max(16, -(-b // 16) * 16)
        offsets.append(off)
        sizes.append(size)
        off += -(-size // ALIGN) * ALIGN
    return offsets, sizes, off


def summarize(per_mode_us: dict[str, list[float]], total_bytes: int, step_us: float | None) -> dict:
    """{"modes": {mode: {"us" (median of the samples), "samples_us", "gb_s" (1e9 bytes/s)}}, "step_over":
    {mode: step us / chain us}} from each mode's per-chain samples (us > 0); step_over is how
    many times the chain's time the measured step takes (1.0: the engine runs at the chain's
    speed; {} without a positive step_us). Raises ValueError on an empty or non-positive
    sample list."""
    modes = {}
    for mode, samples in per_mode_us.items():
        if not samples or any(not (s > 0) for s in samples):
            raise ValueError(f"chain roofline {mode}: samples {samples!r} must be > 0")
        us = statistics.median(samples)
        modes[mode] = {"us": us, "samples_us": list(samples), "gb_s": total_bytes / us / 1e3}
    over = {m: step_us / v["us"] for m, v in modes.items()} if step_us and step_us > 0 else {}
    return {"modes": modes, "step_over": over}


def chain_nodes(byte_counts: list[int], base_ptr: int, out, mode: str, x=None) -> list:
    """executor.Node list: one stream_chain read per byte count, region i at base_ptr +
    layout()'s offset i (base_ptr 256-byte aligned; ValueError otherwise or on an unknown
    mode), one wave of THREADS-thread blocks each; out: cupy uint32 [1] for the XOR; x: a
    cupy array of at least X_WORDS x 16 bytes (16-byte aligned) that the staged modes stage
    (X_WORDS_OF's count for staged_codes; ValueError when it is missing or smaller there;
    other modes ignore it)."""
    import numpy as np

    from backends.engine import module
    from backends.engine.executor import Node
    if mode not in MODES:
        raise ValueError(f"chain roofline mode {mode!r}: expected one of {', '.join(MODES)}")
    if base_ptr % ALIGN:
        raise ValueError(f"buffer at {base_ptr:#x} is not {ALIGN}-byte aligned")
    if mode.startswith("staged") and (x is None or x.nbytes < 16 * X_WORDS):
        raise ValueError(f"mode {mode} needs x of {16 * X_WORDS} bytes")
    k = module.kernel_in("stream_chain.cu", "stream_chain")  # (source_code: a header change recompiles)
    words = X_WORDS_OF.get(mode, X_WORDS) if mode.startswith("staged") else 0
    smem = 16 * words  # (dynamic: the other modes' blocks carry none)
    grid = module.blocks_per_sm(k, THREADS, smem) * module.sm_count()
    offsets, sizes, _ = layout(byte_counts)
    return [Node(f"read#{i}", "roofline", k, (grid,), (THREADS,),
                 (np.uint64(base_ptr + o), np.uint64(s // 16), out, np.int32(MODES[mode]),
                  np.uint64(x.data.ptr if x is not None else 0), np.int32(words if x is not None else 0)),
                 smem=smem, bytes=s)
            for i, (o, s) in enumerate(zip(offsets, sizes))]


def time_chain(byte_counts: list[int], step_us: float | None = None, modes=tuple(MODES),
               chains: int = 8, samples: int = 5, log=print) -> dict:
    """Time the chain (module docstring) for each mode: one CUDA graph of `chains` chains,
    warmed once, replayed `samples` times behind a stream hold (gpu_timing.EventTimer).

    Returns summarize()'s dict plus "method", "n_nodes", "bytes" (sum of the regions), "chains",
    "pdl" (whether launches carried the PDL attribute: without it every mode is plain stream
    order); or {"method", "why"} when the buffer (sum of regions + 1 GiB) does not fit in the
    free device memory. Raises UnsupportedError without CuPy and a GPU, ValueError on bad
    byte counts or modes."""
    from backends.engine import launch
    from backends.engine.executor import Executor

    from .gpu import require_cupy
    from .gpu_timing import EventTimer
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"chain roofline modes {bad or modes}: expected some of {', '.join(MODES)}")
    if chains < 1 or samples < 1:
        raise ValueError("need chains >= 1 and samples >= 1")
    _, sizes, total = layout(byte_counts)
    cp = require_cupy()
    free = int(cp.cuda.runtime.memGetInfo()[0]) + int(cp.get_default_memory_pool().free_bytes())
    if total + ALIGN + MARGIN > free:
        why = f"needs {total + ALIGN:,} B of device memory + 1 GiB, {free:,} B free"
        log(f"chain roofline skipped: {why}")
        return {"method": METHOD, "why": why}
    # the small things first: if one of them fails, nothing holds the large buffer
    out = cp.zeros(1, dtype=cp.uint32)
    x = cp.zeros(16 * X_WORDS, dtype=cp.uint8)
    stream = cp.cuda.Stream(non_blocking=True)
    timer = EventTimer(stream)
    per_mode = {}
    buf = cp.empty(total + ALIGN, dtype=cp.uint8)
    try:
        base = -(-buf.data.ptr // ALIGN) * ALIGN
        for mode in modes:
            nodes = chain_nodes(byte_counts, base, out, mode, x)
            ex = Executor(nodes * chains, stream)
            ex.capture()
            ex.replay()  # warm-up: the first replay uploads the graph
            stream.synchronize()
            per_mode[mode] = [1e6 * timer.time(lambda: ex.graph.launch(stream=stream)) / chains
                              for _ in range(samples)]
            del ex
    finally:
        del buf
        cp.get_default_memory_pool().free_all_blocks()
    res = summarize(per_mode, sum(sizes), step_us)
    res.update(method=METHOD, n_nodes=len(byte_counts), bytes=sum(sizes), chains=chains,
               pdl=launch.pdl_available())
    log("chain roofline (a streaming read of each node's bytes, PDL chain): " + ", ".join(
        f"{m} {v['us']:.1f} us" + (f" (step {step_us / v['us']:.2f}x it)" if step_us else "")
        for m, v in res["modes"].items()))
    return res


def _us_text(v: float) -> str:
    """A time in us for a note or report line: one decimal, or 3 significant digits beyond 1e7
    (a hostile file's 1e308 must not print 309 digits)."""
    return f"{v:.1f}" if v < 1e7 else f"{v:.3g}"


def ab_note(a, b, mode: str = "dependent") -> str:
    """`harness ab` note on two nodes results' chain rooflines (their "chain_roofline" dicts):
    "chain dependent A -> B us (+x.x %)" when both timed `mode` with the same METHOD (positive
    finite times only; "" otherwise). The chain does not depend on the engine's code, only on
    the node sizes and the GPU, so with the same node count and bytes a change of more than 1 %
    adds "; the GPUs differ on the chain" (session 23: +1.3 % for the dependent chain between
    two H200s); with other node sizes (another n_ctx, another node list) it adds "; other node
    sizes (n nodes, bytes)" and says nothing of the GPUs."""
    from .jsonread import finite_pos

    def us(c):
        if not isinstance(c, dict) or not isinstance(c.get("modes"), dict):
            return None
        m = c["modes"].get(mode)
        return finite_pos(m.get("us")) if isinstance(m, dict) else None
    ua, ub = us(a), us(b)
    if not (ua and ub) or a.get("method") != b.get("method"):
        return ""
    d = 100 * (ub / ua - 1)
    text = f"chain {mode} {_us_text(ua)} -> {_us_text(ub)} us ({d:+.1f} %)".replace("(-0.0 %)", "(+0.0 %)")
    size_a, size_b = (a.get("n_nodes"), a.get("bytes")), (b.get("n_nodes"), b.get("bytes"))
    if size_a != size_b:
        return text + f"; other node sizes ({size_a[0]} nodes, {size_a[1]} B -> {size_b[0]}, {size_b[1]})"[:200]
    return text + ("; the GPUs differ on the chain" if round(abs(d), 1) > 1 else "")  # (as printed)


def main(argv: list[str] | None = None) -> int:
    """python -m harness.step_roofline NODES.json [--out FILE]: time the chain of a stored
    `harness bench nodes` result's node byte counts (NODES.json or .json.gz; graph or eager
    method's node list, in step order) on this GPU, without the engine; prints each mode, writes {"source", "chain"} as JSON
    to FILE when given. Exit 0, or 2 on a file that is not a nodes result (one-line message)."""
    import argparse
    import json
    import sys
    from pathlib import Path

    from .errors import HarnessError
    from .results import read_json, write_json
    p = argparse.ArgumentParser(prog="python -m harness.step_roofline", description=main.__doc__.split(":")[0])
    p.add_argument("nodes_json")
    p.add_argument("--out")
    args = p.parse_args(argv)
    try:
        doc = read_json(Path(args.nodes_json))
        n = doc.get("nodes") if isinstance(doc, dict) else None
        methods = n.get("methods") if isinstance(n, dict) else None
        rows = next((methods[m]["nodes"] for m in ("graph", "eager")
                     if isinstance(methods, dict) and isinstance(methods.get(m), dict)
                     and isinstance(methods[m].get("nodes"), list)), None)
        if not rows:
            raise ValueError("not a nodes result with a node list")
        counts = [r.get("bytes") if isinstance(r, dict) else None for r in rows]
        step = n.get("step_us") if isinstance(n.get("step_us"), (int, float)) else None
        res = time_chain(counts, step)
    except (HarnessError, ValueError, OSError) as e:
        print(f"error: {args.nodes_json}: {e}", file=sys.stderr)
        return 2
    if args.out:
        write_json(Path(args.out), {"source": args.nodes_json, "chain": res})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
