"""Cross-node L2 prefetch (GGUF_HARNESS_GEMV_KQ_XPF, kernels/gemv_kq.cu KQ_XPF): each v9 GEMV node
of a decode step learns the rows the next v9 GEMV node reads first, and its warps ask L2 for them
once their own rows are done.

Which rows: the v9 row orders of the default builds (block-major, warp-major, the row queue with
its default strided rows, the S-split and the cluster split) start their first grid-stride pass
with the rows 0..n-1 of the node's row space, n = first_pass_rows (the grid's warps, times the
rows a warp takes at once, over the warps or blocks sharing a row). Not so the queue's A/B
contiguous map (GGUF_HARNESS_GEMV_KQ_DQ_MAP=0: block b starts at row b N / B), whose prefetches
then miss. Which bytes: the first ones of each such row (its first rounds). The per-node cap
(GGUF_HARNESS_GEMV_KQ_XPF MiB) bounds what is asked for so it stays in L2 until used: session 7
measured 44 MB prefetched ahead of the output head read 1.9x its bytes from DRAM (evicted first).
"""
from __future__ import annotations

import re

import numpy as np

from . import ops

LINE = 128  # bytes of an L2 line: the per-row share is a multiple of it


def _is_xpf(node) -> bool:
    return "KQ_XPF=1" in getattr(node, "defines", ())


def first_pass_rows(kernel_name: str, warps: int) -> int:
    """Rows a v9 kernel's first grid-stride pass covers with `warps` warps in its grid: a warp per
    row, times 2 for the two-row kernels (_p2, gemvkq4_), divided by the warps or blocks that share
    a row (_s<S>, _c<S>)."""
    rows = warps * (2 if "_p2" in kernel_name or kernel_name.startswith("gemvkq4_") else 1)
    m = re.search(r"_[sc](\d)$", kernel_name)
    return rows // int(m.group(1)) if m else rows


def targets(node, cap: int) -> list[tuple[int, int, int, int]]:
    """(weight address, row bytes, rows, bytes per row) for up to 2 segments of the v9 GEMV `node`
    as the node before it should prefetch them: the rows of its first pass (at most its grid's
    warps, in row-space order across segments; a SwiGLU pair's gate and up rows alike) and the
    first bytes of each, the per-row share of `cap` bytes in whole lines (at least one line, at
    most the row). [] when cap is 0."""
    if cap <= 0:
        return []
    table = node.args[0]
    n = int(table["n"])
    name = str(getattr(node.kernel, "name", ""))
    first = first_pass_rows(name, int(node.grid[0]) * (int(node.block[0]) // 32))
    pair = "_swiglu_" in name  # gate and up rows share row indices
    segs, left = [], first
    for i in range(min(n, 2)):
        rows = int(table["s"][i]["rows"])
        take = min(rows, first if pair else left)
        if take <= 0:
            break
        segs.append((int(table["s"][i]["w"]), int(table["row_bytes"][i]), take))
        if not pair:
            left -= take
    total_rows = sum(r for _, _, r in segs)
    if not total_rows:
        return []
    share = max(LINE, (cap // total_rows) // LINE * LINE)
    return [(w, rb, rows, min(rb, share)) for w, rb, rows in segs]


def link(nodes: list, cap: int | None = None) -> int:
    """Fill the KQ_XPF fields of every v9 node's table in `nodes` (in step order) with targets()
    of the next v9 node (the last one's stay zero); nodes of other kinds are skipped over. Returns
    how many nodes were linked. cap: bytes per next node (default ops.kv9_xpf_bytes()). Nodes
    whose table lacks the fields (not the KQ_XPF build) are left alone. Node's cached PDL launch
    is dropped, so a node linked after launching relaunches with the new table. The prompt graph
    shares these nodes: its last body node prefetches output-head rows it never reads (at most
    the cap per prompt token)."""
    cap = ops.kv9_xpf_bytes() if cap is None else cap
    v9 = [n for n in nodes if _is_xpf(n)]
    linked = 0
    for cur, nxt in zip(v9, v9[1:]):
        table = np.array(cur.args[0])  # a copy of the by-value table (its build's dtype: ops.table_dtype)
        table["xpf"] = 0
        for k, (w, rb, rows, nbytes) in enumerate(targets(nxt, cap)):
            table["xpf"][k] = (w, rb, rows, nbytes, 0)
        cur.args = (table[()],) + tuple(cur.args[1:])
        cur._pdl = None  # a launch made before would have cached the old table
        linked += 1
    return linked
