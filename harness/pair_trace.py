"""Hand-over between two engine v9 GEMVs launched back to back (kernels/gemv_kq.cu, -DKQ_TRACE=1).

    python -m harness.pair_trace A B [--copies 16] [--out out]

A and B as `harness bench kernels --shapes` (e.g. 5120x6144:Q5_K 2x17408x5120:IQ4_XS): R copies of
each, launched A0 B0 A1 B1 ... in one CUDA graph (PDL between every pair, as in a decode step); the
trace build's per-warp marks (kernel entry, PDL wait return, x staged, last row done, SM id; see
harness.kernel_trace) of the last A and the last B are read from their modules. Question it answers
(session 30, docs/perf-notes.md): when A's SMs end unevenly, do B's blocks that become resident on
the SMs A left early end earlier (a head start), and by how much? (Session 31: not in their ends;
the head start is their first-row prefetch landing before the wait, which shortens staging x.)
handover() gives the figures; runs anywhere. The GPU part needs A and B from different compiled
modules (each module has one trace array): the cluster-split (_c2 / _c4) and wide (32-warp) builds
are, two shapes of one build are not (refused). Each run writes a new folder
OUT/runs/<UTC stamp>-<git sha>/ with pair-trace.json (machine info, engine switches, figures) and
a.npy / b.npy (the two raw traces).
"""
from __future__ import annotations

import argparse
import operator
import sys

import numpy as np

from .kernel_trace import ENTRY, END, QUANTILES, SM, STAGED, WAIT

EARLY_US = 1.0  # a B block "entered early" when resident at least this long before its PDL wait returned
CLOCK_SLACK_NS = 1_000  # A's last mark may follow B's first wait return by this much (%globaltimer updates)
MAX_GAP_NS = 100_000  # ... and precede it by at most this much: B is the launch right after A, not a later one


def _blocks(a, wpb) -> dict:
    """Per block of a [warps, 5] trace (warp w of block b at row b wpb + w): entry (first warp's),
    wait (first warp's), staged and end (last warp's), int64 ns, and the SM id. Raises ValueError for
    a non-integer array, a bad shape or wpb, an unwritten mark, a warp whose marks are out of order
    (entry <= wait <= staged <= end) or a block whose warps report different SMs (a wrong wpb)."""
    a = np.asarray(a)
    try:
        wpb = operator.index(wpb)
    except TypeError:
        raise ValueError(f"warps per block {wpb!r}: expected an integer") from None
    if not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"trace array of dtype {a.dtype}: expected integer ns (the trace build's uint64)")
    if a.ndim != 2 or a.shape[1] != 5 or len(a) == 0 or wpb < 1 or len(a) % wpb:
        raise ValueError(f"trace array of shape {a.shape} with {wpb} warps per block: expected [blocks * wpb, 5]")
    a = a.astype(np.int64)
    if (a[:, :4] == 0).any():
        raise ValueError("trace has unwritten entries (a warp never reached a mark)")
    if (np.diff(a[:, [ENTRY, WAIT, STAGED, END]], axis=1) < 0).any():
        raise ValueError("trace has a warp whose marks are out of order (entry <= wait <= staged <= end)")
    r = a.reshape(-1, wpb, 5)
    if (r[:, :, SM] != r[:, :1, SM]).any():
        raise ValueError(f"a block's warps ran on different SMs: is {wpb} the warps per block?")
    return {"entry": r[:, :, ENTRY].min(1), "wait": r[:, :, WAIT].min(1), "staged": r[:, :, STAGED].max(1),
            "end": r[:, :, END].max(1), "sm": r[:, 0, SM]}


def _corr(x: np.ndarray, y: np.ndarray) -> float | None:
    """Pearson correlation, or None where it is undefined (fewer than 3 points, a constant series)."""
    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return None
    return float(np.corrcoef(x, y)[0, 1])


def handover(a: np.ndarray, a_wpb: int, b: np.ndarray, b_wpb: int, early_us: float = EARLY_US) -> dict:
    """Figures of one A -> B hand-over. a, b: integer (the trace build's uint64) [warps, 5] traces
    (harness.kernel_trace columns, ns) of A's launch and of the B launched right after it; a_wpb /
    b_wpb: warps per block; early_us: finite, >= 0.
    Times in us relative to t0 = B's earliest PDL wait return (A's completion as B sees it), taken
    in integer ns before any float (%globaltimer values are ~1.8e18 ns: float64 would round them to
    256 ns). Returns {"a_sm_end_us": quantiles over SMs of A's last warp end there, "a_done_to_wait_us":
    t0 minus A's last end (grid completion latency), "b_entry_us": quantiles over B's blocks of their
    entry, "b_after_a_sm_us": quantiles of (B block entry - A's last end on that SM: how soon a freed
    SM takes a B block; [] when no B block ran on an SM A ran on), "b_entry_a_end_corr": correlation
    of the two, "b_end_entry_corr": correlation of B blocks' end and entry (either None where
    undefined: under 3 blocks or a constant series), "early" / "late": for B's blocks that entered
    at least early_us before t0 and the others, {"blocks"} and, when blocks > 0, {"stage_us",
    "loop_us", "end_us"} medians (stage: staged - wait, loop: end - staged, end: end - t0),
    "b_span_us": B's last end - t0, "early_us", "quantiles": the percentiles used}. B blocks on SMs
    where A never ran are left out of b_after_a_sm_us and its correlation. Raises ValueError on what
    _blocks refuses, a bad early_us, or traces that are not A then the B right after it (A's last end
    more than CLOCK_SLACK_NS after t0 or more than MAX_GAP_NS before it)."""
    if not (isinstance(early_us, (int, float)) and np.isfinite(early_us) and early_us >= 0):
        raise ValueError(f"early_us {early_us!r}: expected a finite number >= 0")
    A, B = _blocks(a, a_wpb), _blocks(b, b_wpb)
    t0 = int(B["wait"].min())
    gap = t0 - int(A["end"].max())
    if gap < -CLOCK_SLACK_NS or gap > MAX_GAP_NS:
        raise ValueError(f"the B trace does not follow the A trace: A's last warp ends {gap / 1e3:.3f} us before "
                         f"B's PDL wait returns (expected 0..{MAX_GAP_NS / 1e3:.0f} us: B is the launch right after A)")
    us = lambda v: (np.asarray(v, dtype=np.int64) - t0) / 1e3  # int64 difference first (see above)
    q = lambda v: [float(np.percentile(v, p)) for p in QUANTILES]
    a_sm_end = {int(sm): int(A["end"][A["sm"] == sm].max()) for sm in np.unique(A["sm"])}
    b_entry = us(B["entry"])
    on = np.array([int(sm) in a_sm_end for sm in B["sm"]])
    a_end_at_b = us([a_sm_end.get(int(sm), t0) for sm in B["sm"]])
    after = b_entry[on] - a_end_at_b[on]
    stage, loop, end = (B["staged"] - B["wait"]) / 1e3, (B["end"] - B["staged"]) / 1e3, us(B["end"])
    early = b_entry <= -early_us

    def part(m):
        if not m.any():
            return {"blocks": 0}
        return {"blocks": int(m.sum()), "stage_us": float(np.median(stage[m])), "loop_us": float(np.median(loop[m])),
                "end_us": float(np.median(end[m]))}

    return {"a_sm_end_us": q(us(list(a_sm_end.values()))), "a_done_to_wait_us": gap / 1e3,
            "b_entry_us": q(b_entry), "b_after_a_sm_us": q(after) if len(after) else [],
            "b_entry_a_end_corr": _corr(b_entry[on], a_end_at_b[on]), "b_end_entry_corr": _corr(end, b_entry),
            "early": part(early), "late": part(~early), "b_span_us": float(end.max()), "early_us": float(early_us),
            "quantiles": list(QUANTILES)}


def _fmt_corr(c: float | None) -> str:
    return "undefined" if c is None else f"{c:.2f}"


def format_handover(a_spec: str, b_spec: str, h: dict) -> str:
    """A few text lines of handover's figures (for the terminal)."""
    f = lambda v: " ".join(f"{x:7.2f}" for x in v)
    lines = [f"{a_spec} -> {b_spec}: B's last block ends {h['b_span_us']:.2f} us after its PDL wait; "
             f"A's last warp ended {h['a_done_to_wait_us']:.2f} us before that wait returned",
             f"  A's last end per SM, p0/10/50/90/100 us:        {f(h['a_sm_end_us'])}",
             f"  B block entry, p0/10/50/90/100 us:              {f(h['b_entry_us'])}",
             f"  B entry - A's end on that SM, p0/10/50/90/100: {f(h['b_after_a_sm_us'])}" if h["b_after_a_sm_us"] else
             "  B entry - A's end on that SM: no B block on an SM A ran on",
             f"  corr(B entry, A's end on its SM) {_fmt_corr(h['b_entry_a_end_corr'])}; "
             f"corr(B end, B entry) {_fmt_corr(h['b_end_entry_corr'])}"]
    for k in ("early", "late"):
        p = h[k]
        lines.append(f"  B blocks entered {'>=' if k == 'early' else '< '}{h['early_us']:.1f} us before the wait: {p['blocks']}"
                     + (f"; median stage {p['stage_us']:.2f}, loop {p['loop_us']:.2f}, end {p['end_us']:.2f} us" if p["blocks"] else ""))
    return "\n".join(lines)


def trace_pair(a_spec: str, b_spec: str, copies: int, replays: int = 5):
    """Runs A0 B0 A1 B1 ... (copies each) in one CUDA graph with the trace build, replays it and
    returns (A kernel, B kernel, us per A+B pair of the median replay, A's trace, A's warps per
    block, B's trace, B's warps per block) of that replay. Raises UnsupportedError without a GPU,
    ConfigError for a bad spec, ValueError for a shape v9 does not take or two shapes of one module."""
    from .gpu import require_cupy
    from .kernel_shapes import parse_spec
    sa, sb = parse_spec(a_spec), parse_spec(b_spec)  # bad specs are refused before anything needs a GPU
    cp = require_cupy()

    from .gpu_timing import capture
    from .kernel_case import GemvCase
    from .kernel_trace import replay_median, trace_build, trace_module, warp_trace
    cases = []
    with trace_build():
        try:
            stream = cp.cuda.Stream(non_blocking=True)
            for s in (sa, sb):
                cases.append(GemvCase(s, copies, seed=len(cases), stream=stream))
            (ma, wa), (mb, wb) = (trace_module(spec, c.nodes[0]) for spec, c in zip((a_spec, b_spec), cases))
            if ma is mb:  # (module._module caches one module per define set)
                raise ValueError(f"{a_spec} and {b_spec} run kernels of one module (one trace array): pick shapes of two builds")
            arrs = [warp_trace(cp, ma, cases[0].nodes[0]), warp_trace(cp, mb, cases[1].nodes[0])]
            graph = capture(stream, [n.launch for pair in zip(cases[0].nodes, cases[1].nodes) for n in pair])
            us, (a, b) = replay_median(cp, stream, graph, arrs, replays, copies)
            return cases[0].nodes[0].kernel.name, cases[1].nodes[0].kernel.name, us, a, wa, b, wb
        finally:
            for c in cases:
                c.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.pair_trace", description=__doc__.split("\n")[0])
    ap.add_argument("a", help="the first shape (producer), e.g. 5120x6144:Q5_K")
    ap.add_argument("b", help="the shape launched after it, e.g. 2x17408x5120:IQ4_XS")
    ap.add_argument("--copies", type=int, default=16, help="copies of each, launched alternately (>= 2)")
    ap.add_argument("--out", default="out", help="results folder: each run writes OUT/runs/<UTC stamp>-<git sha>/"
                    "pair-trace.json (machine info, engine switches, figures) and a.npy / b.npy (the raw traces)")
    a = ap.parse_args(argv)
    if a.copies < 2:
        print("pair_trace: --copies must be at least 2", file=sys.stderr)
        return 2
    from .errors import HarnessError
    from .kernel_shapes import parse_spec
    from .kernel_trace import write_run
    from .results import check_out_root
    try:
        parse_spec(a.a), parse_spec(a.b)  # bad specs and a bad --out are refused before the GPU work
        root = check_out_root(a.out)
        ka, kb, us, ta, wa, tb, wb = trace_pair(a.a, a.b, a.copies)
        h = handover(ta, wa, tb, wb)
    except (HarnessError, ValueError) as e:  # no GPU, a bad spec or --out, one module, an unwritten mark
        print(f"pair_trace: {e}", file=sys.stderr)
        return 2
    print(f"{ka} -> {kb}: {us:.2f} us per pair")
    print(format_handover(a.a, a.b, h))
    body = {"a": a.a, "b": a.b, "a_kernel": ka, "b_kernel": kb, "us_per_pair": us, "copies": a.copies,
            "a_warps_per_block": wa, "b_warps_per_block": wb, "handover": h}
    path = write_run(root, "pair-trace", "gguf-harness/pair-trace/1", body, {"a": ta, "b": tb})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
