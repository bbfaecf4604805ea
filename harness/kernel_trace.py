"""Per-warp timeline of an engine v9 GEMV (kernels/gemv_kq.cu built with -DKQ_TRACE=1).

    python -m harness.kernel_trace SPEC [SPEC ...] [--copies 16] [--out out]

SPEC as `harness bench kernels --shapes` (e.g. 2x17408x5120:IQ4_XS). For each shape: R copies
(harness.kernel_case.GemvCase) launched back to back in one CUDA graph, as the cold_b2b mode
times them; in the trace build lane 0 of every warp writes %globaltimer (ns) at kernel entry,
after the PDL wait, after staging x and after its last row, and its SM id, to a __device__
array that each launch overwrites: after the graph it holds the last launch's timeline. Of 5
replays the median one is summarised (summarize). Prints the table and writes a new folder
OUT/runs/<UTC stamp>-<git sha>/ (--out, default out) with kernel-trace.json (schema
gguf-harness/kernel-trace/1: machine info with the engine switches, copies, and per shape the
figures under "shapes") and the raw [warps, 5] arrays as .npy; an earlier run is never overwritten.
Used in session 15 (docs/perf-notes.md) to find that staging x costs 2-5 us per kernel and
that of an SM's two blocks the one resident first ends first. Since session 28 the trace build
also marks each whole row a warp runs (the one-row-per-warp loops: the row queue and the S = 1
wide rows): its start, end and warp, in a second array (summarize_rows; the raw [rows, 3] array is
saved as kernel-trace-rows-*.npy), which tells whether rows of one size take unequal times and
whether a slow row belongs to a slow warp. GPU only; summarize and summarize_rows run anywhere.
"""
from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np

ENTRY, WAIT, STAGED, END, SM = range(5)  # columns of the trace array (kernels/gemv_kq.cu kq_mark)
QUANTILES = (0, 10, 50, 90, 100)


def summarize(a: np.ndarray, warps_per_block: int | None = None) -> dict:
    """Figures of one launch's trace. a: uint64/int64 [warps, 5] (ENTRY, WAIT, STAGED, END ns;
    SM id); kq_mark writes warp w of block b to row b W + w (W = warps per block).
    Times are relative to t0 = the earliest WAIT (the previous kernel's completion as
    the PDL wait sees it). Returns {"warps", "sms", "t0_ns" (that WAIT, %globaltimer ns),
    "<phase>_us": [p0, p10, p50, p90, p100]} for
    entry (ENTRY - t0, negative: resident before the previous kernel ended), stage (STAGED -
    WAIT), loop (END - STAGED) and end (END - t0), "span_us" (last END - t0), "running" (share of
    warps not yet ended at t0 + 0, 1, 2, ... us), "first_last_end_us" (per SM, the median of
    its first and of its last warp's END - t0) and "sm_loop_spread_us" (per SM, its slowest
    minus its fastest warp's loop; the median over SMs). With warps_per_block = W (a multiple of 4)
    also "loop_by_warp_quarter_us": 4 floats, us, the median loop of the warps w in [k W / 4,
    (k + 1) W / 4) of every block, pooled over the blocks. Loop times compare warps' speeds only
    where the warps have the same work: the static
    builds (GGUF_HARNESS_GEMV_KQ_DQ=0), not the row queue (fast warps take more rows). Raises
    ValueError on a wrong shape, an unwritten row (a zero timestamp) or a warps_per_block that
    is not a multiple of 4 dividing the warp count."""
    a = np.asarray(a).astype(np.int64)
    if a.ndim != 2 or a.shape[1] != 5 or len(a) == 0:
        raise ValueError(f"trace array of shape {a.shape}: expected [warps, 5]")
    if (a[:, :4] == 0).any():
        raise ValueError("trace has unwritten entries (a warp never reached a mark)")
    t0 = a[:, WAIT].min()
    rel = (a[:, :4] - t0) / 1e3
    q = lambda v: [float(np.percentile(v, p)) for p in QUANTILES]
    end = rel[:, END]
    sms = a[:, SM]
    per_sm = [(end[sms == s].min(), end[sms == s].max()) for s in np.unique(sms)]
    loop = rel[:, END] - rel[:, STAGED]
    out = {"warps": int(len(a)), "sms": int(len(per_sm)), "t0_ns": int(t0),
           "entry_us": q(rel[:, ENTRY]), "stage_us": q(rel[:, STAGED] - rel[:, WAIT]),
           "loop_us": q(loop), "end_us": q(end), "span_us": float(end.max()),
           "running": [float((end > t).mean()) for t in range(int(np.ceil(end.max())) + 1)],
           "first_last_end_us": [float(np.median([f for f, _ in per_sm])), float(np.median([l for _, l in per_sm]))],
           "sm_loop_spread_us": float(np.median([np.ptp(loop[sms == s]) for s in np.unique(sms)]))}
    if warps_per_block is not None:
        if warps_per_block < 4 or warps_per_block % 4 or len(a) % warps_per_block:
            raise ValueError(f"warps_per_block {warps_per_block}: expected a multiple of 4 dividing {len(a)} warps")
        quarter = np.arange(len(a)) % warps_per_block * 4 // warps_per_block
        out["loop_by_warp_quarter_us"] = [float(np.median(loop[quarter == k])) for k in range(4)]
    return out


ROW_START, ROW_END, ROW_WARP = range(3)  # columns of the per-row array (kernels/gemv_kq.cu kq_row_mark)


def summarize_rows(r: np.ndarray, t0_ns: int) -> dict:
    """Figures of the per-row marks of one launch. r: uint64/int64 [rows, 3] (start ns, end ns, global
    warp index; all 0 for a row no whole-row loop marked: split rows, P2 pairs, cluster parts); t0_ns:
    the warp trace's earliest PDL wait return (summarize's "t0_ns"). Returns {"rows_marked": n} and, when
    n > 0: "row_us" [p0, p10, p50, p90, p100] of end - start (us), "row_start_us" the same of
    start - t0, "row_us_by_start" the median duration of the rows whose start is in each quarter
    of the start times (early rows run beside every warp, late ones beside few; equal starts are
    ranked by row index), "row_us_by_index" the median duration in each tenth of the marked rows by
    row index (a coarse dependence on where a row lies), both lists shorter when there are fewer
    than 4 / 10 marked rows, "warp_share": the share of the durations' variance between warps (sum
    over warps of n_w (mean_w - mean)^2 / sum (d - mean)^2, the one-way ANOVA eta squared; 1: each
    warp's rows all take its own time) and "warp_share_null": what that share is expected to be when
    the warp tells nothing, (warps - 1) / (rows - 1) (~0.24 for 17408 rows over 4224 warps): read the
    share against it, not against 0. Raises ValueError for a wrong shape or an end before its
    start."""
    r = np.asarray(r).astype(np.int64)
    if r.ndim != 2 or r.shape[1] != 3:
        raise ValueError(f"row trace of shape {r.shape}: expected [rows, 3]")
    idx = np.nonzero(r[:, ROW_END])[0]
    if len(idx) == 0:
        return {"rows_marked": 0}
    m = r[idx]
    d = (m[:, ROW_END] - m[:, ROW_START]) / 1e3
    if (d < 0).any():
        raise ValueError("row trace: an end before its start")
    start = (m[:, ROW_START] - int(t0_ns)) / 1e3
    q = lambda v: [float(np.percentile(v, p)) for p in QUANTILES]
    by_start = np.minimum(4 * np.argsort(np.argsort(start, kind="stable"), kind="stable") // len(d), 3)
    by_index = np.minimum(10 * np.arange(len(d)) // len(d), 9)  # idx is ascending: tenths by row index
    warps, inv = np.unique(m[:, ROW_WARP], return_inverse=True)
    mean_w = np.bincount(inv, weights=d) / np.bincount(inv)
    total = float(((d - d.mean()) ** 2).sum())
    between = float((np.bincount(inv) * (mean_w - d.mean()) ** 2).sum())
    return {"rows_marked": int(len(d)), "row_us": q(d), "row_start_us": q(start),
            "row_us_by_start": [float(np.median(d[by_start == k])) for k in range(4) if (by_start == k).any()],
            "row_us_by_index": [float(np.median(d[by_index == k])) for k in range(10) if (by_index == k).any()],
            "warp_share": between / total if total > 0 else 0.0,
            "warp_share_null": (len(warps) - 1) / (len(d) - 1) if len(d) > 1 else 0.0}


def format_rows(s: dict) -> str:
    """A few text lines of summarize_rows' figures (for the terminal)."""
    if not s["rows_marked"]:
        return "  rows: none marked (this kernel runs no whole row per warp)"
    return "\n".join([
        f"  rows marked: {s['rows_marked']}; a row's time p0/10/50/90/100 us: " + " ".join(f"{v:.2f}" for v in s["row_us"]),
        "  a row's median time by start quarter (us): " + " ".join(f"{v:.2f}" for v in s["row_us_by_start"]),
        "  ... by row-index tenth (us): " + " ".join(f"{v:.2f}" for v in s["row_us_by_index"]),
        f"  share of the rows' time variance between warps: {s['warp_share']:.2f} "
        f"(with no warp effect: ~{s['warp_share_null']:.2f})"])


def format_summary(spec: str, kernel: str, per_kernel_us: float, s: dict) -> str:
    """A few text lines of one shape's summary (for the terminal)."""
    lines = [f"{spec} {kernel}: {per_kernel_us:.2f} us per kernel, last warp ends {s['span_us']:.2f} us "
             f"after the PDL wait ({s['warps']} warps on {s['sms']} SMs)"]
    for k in ("entry_us", "stage_us", "loop_us", "end_us"):
        lines.append(f"  {k[:-3]:6s} p0/10/50/90/100 us: " + " ".join(f"{v:7.2f}" for v in s[k]))
    lines.append("  per SM, first / last warp end (median): %.2f / %.2f us" % tuple(s["first_last_end_us"]))
    lines.append("  per SM, slowest - fastest warp's loop (median): %.2f us" % s["sm_loop_spread_us"])
    if "loop_by_warp_quarter_us" in s:
        lines.append("  loop by the block's warp quarter (median us): " + " ".join(f"{v:.2f}" for v in s["loop_by_warp_quarter_us"]))
    lines.append("  share running per us: " + " ".join(f"{v:.2f}" for v in s["running"]))
    return "\n".join(lines)


@contextmanager
def trace_build():
    """The engine's v9 GEMV nodes built in this block get kernels/gemv_kq.cu's trace build
    (ops.kv9_defines + KQ_TRACE=1; restored on exit)."""
    from backends.engine import ops
    base = ops.kv9_defines
    ops.kv9_defines = lambda: base() + ("KQ_TRACE=1",)
    try:
        yield
    finally:
        ops.kv9_defines = base


def trace_module(spec: str, node):
    """The compiled module of `node` (a GEMV node built under trace_build) and its warps per block.
    Raises ValueError when the engine runs no v9 kernel for `spec` (no trace build)."""
    from backends.engine import module
    if not node.kernel.name.startswith("gemvkq"):
        raise ValueError(f"{spec}: the engine runs {node.kernel.name}, not a v9 kernel (no trace build)")
    # the module the node's kernel came from (the wide build for a wide node: ops.kv9_wide)
    return module._module("gemv_kq.cu", tuple(node.defines)), node.block[0] // 32


def warp_trace(cp, mod, node):
    """The module's per-warp trace array (kq_trace) as a device view of node's [warps, 5]."""
    return cp.ndarray((node.grid[0] * node.block[0] // 32, 5), dtype=cp.uint64, memptr=mod.get_global("kq_trace"))


def replay_median(cp, stream, graph, arrays, replays: int, per: int):
    """Replays `graph` on `stream` `replays` times, zeroing the device `arrays` before each, and
    returns (us per `per` launches, [host copies of arrays]) of the median replay by time."""
    ev0, ev1, runs = cp.cuda.Event(), cp.cuda.Event(), []
    for _ in range(replays):
        for arr in arrays:
            arr.fill(0)
        cp.cuda.Device().synchronize()
        ev0.record(stream)
        graph.launch(stream=stream)
        ev1.record(stream)
        stream.synchronize()
        runs.append((cp.cuda.get_elapsed_time(ev0, ev1) * 1e3 / per, [arr.get() for arr in arrays]))
    return sorted(runs, key=lambda x: x[0])[len(runs) // 2]


def trace_shape(spec: str, copies: int, replays: int = 5):
    """(kernel name, per-kernel us of the median replay, its raw trace array, warps per block, its raw
    per-row array [rows, 3] (kernels/gemv_kq.cu kq_trace_row, the first 2^18 rows)) of one shape on
    the GPU, with the engine's v9 defines + KQ_TRACE=1 (trace_build). Raises UnsupportedError
    without a GPU, ConfigError for a bad spec, ValueError for a shape v9 does not take."""
    from .gpu import require_cupy
    from .kernel_shapes import parse_spec
    shape = parse_spec(spec)  # a bad spec is refused before anything needs a GPU
    cp = require_cupy()

    from .gpu_timing import capture
    from .kernel_case import GemvCase
    case = None
    with trace_build():
        try:
            case = GemvCase(shape, copies, seed=0)
            node = case.nodes[0]
            mod, wpb = trace_module(spec, node)
            arr = warp_trace(cp, mod, node)
            rows = cp.ndarray((min(shape.rows, 1 << 18), 3), dtype=cp.uint64,  # (KQ_TRACE_ROWS)
                              memptr=mod.get_global("kq_trace_row"))
            graph = capture(case.stream, [n.launch for n in case.nodes])
            us, (a, r) = replay_median(cp, case.stream, graph, [arr, rows], replays, copies)
            return node.kernel.name, us, a, wpb, r
        finally:
            if case is not None:
                case.close()


def write_run(out_root: Path, stem: str, schema: str, body: dict, arrays: dict) -> Path:
    """A new folder OUT/runs/<UTC stamp>-<git sha>/ (results.new_run_dir: an earlier run is never
    overwritten) with <stem>.json = {"schema", "created", "machine" (machine_info, engine switches
    included)} + body, written atomically (results.write_json), and each array as <name>.npy.
    out_root: the folder results.check_out_root returned. The document is built before anything
    is written. Returns the JSON's path."""
    from datetime import datetime, timezone

    from .machine import machine_info
    from .results import new_run_dir, write_json
    machine = machine_info()
    doc = {"schema": schema, "created": datetime.now(timezone.utc).isoformat(), "machine": machine} | body
    run = new_run_dir(out_root / "runs", (machine.get("git") or {}).get("sha"))
    for name, arr in arrays.items():
        np.save(run / f"{name}.npy", arr)
    write_json(run / f"{stem}.json", doc)
    return run / f"{stem}.json"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.kernel_trace", description=__doc__.split("\n")[0])
    ap.add_argument("specs", nargs="+", help="shapes, e.g. 2x17408x5120:IQ4_XS")
    ap.add_argument("--copies", type=int, default=16, help="weight copies launched back to back (>= 2)")
    ap.add_argument("--out", default="out", help="results folder: each run writes OUT/runs/<UTC stamp>-<git sha>/"
                    "kernel-trace.json (machine info, engine switches, figures) and the raw .npy arrays")
    a = ap.parse_args(argv)
    if a.copies < 2:
        print("kernel_trace: --copies must be at least 2 (the traced launch follows another)", file=sys.stderr)
        return 2
    from .errors import HarnessError
    from .kernel_shapes import parse_spec
    from .results import check_out_root
    out, raw = {}, {}
    try:
        for spec in a.specs:  # bad specs and a bad --out are refused before any GPU work
            parse_spec(spec)
        root = check_out_root(a.out)
        for spec in a.specs:
            kernel, us, arr, wpb, rows = trace_shape(spec, a.copies)
            # (quarters only for a multiple of 4 warps per block: every v9 build's is)
            s = summarize(arr, wpb if wpb % 4 == 0 else None)  # ValueError: a warp that left a mark unwritten
            rs = summarize_rows(rows, s["t0_ns"])
            out[spec], raw[spec] = dict(s, kernel=kernel, per_kernel_us=us, rows=rs), (arr, rows)
            print(format_summary(spec, kernel, us, s))
            print(format_rows(rs))
    except (HarnessError, ValueError) as e:  # no GPU, a bad spec or --out, a shape v9 does not take
        print(f"kernel_trace: {e}", file=sys.stderr)
        return 2
    arrays = {}  # written only once every shape is traced
    for spec, (arr, rows) in raw.items():
        name = "".join(c if c.isalnum() else "_" for c in spec)
        arrays[f"kernel-trace-{name}"], arrays[f"kernel-trace-rows-{name}"] = arr, rows
    path = write_run(root, "kernel-trace", "gguf-harness/kernel-trace/1", {"copies": a.copies, "shapes": out}, arrays)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
