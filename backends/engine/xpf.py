"""Cross-node L2 prefetch (GGUF_HARNESS_GEMV_KQ_XPF, kernels/gemv_kq.cu KQ_XPF): each v9 GEMV node
of a decode step learns the rows the next v9 GEMV node reads first, and its warps ask L2 for them
once their own rows are done.

Which rows: every v9 row order (block-major, warp-major, the row queue, the S-split and the
cluster split) starts its first grid-stride pass with the rows 0..n-1 of the node's row space;
n is taken as the warps of its grid: exact for one row per warp, more than the pass for S > 1 and
cluster parts (a row takes several warps), half of it for two rows per warp (the _p2 and
gemvkq4_ kernels). Which bytes: the first ones of each such row (its first rounds). The per-node cap
(GGUF_HARNESS_GEMV_KQ_XPF MiB) bounds what is asked for so it stays in L2 until used: session 7
measured 44 MB prefetched ahead of the output head read 1.9x its bytes from DRAM (evicted first).
"""
from __future__ import annotations

import numpy as np

from . import ops

LINE = 128  # bytes of an L2 line: the per-row share is a multiple of it


def _is_xpf(node) -> bool:
    return "KQ_XPF=1" in getattr(node, "defines", ())


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
    warps = int(node.grid[0]) * (int(node.block[0]) // 32)
    pair = "_swiglu_" in str(getattr(node.kernel, "name", ""))  # gate and up rows share row indices
    segs, left = [], warps
    for i in range(min(n, 2)):
        rows = int(table["s"][i]["rows"])
        take = min(rows, warps if pair else left)
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
    whose table lacks the fields (not the KQ_XPF build) are left alone; call before the first
    launch (Node caches its launch arguments)."""
    cap = ops.kv9_xpf_bytes() if cap is None else cap
    v9 = [n for n in nodes if _is_xpf(n)]
    linked = 0
    for cur, nxt in zip(v9, v9[1:]):
        table = np.array(cur.args[0])  # a copy of the by-value table (its build's dtype: ops.table_dtype)
        table["xpf"] = 0
        for k, (w, rb, rows, nbytes) in enumerate(targets(nxt, cap)):
            table["xpf"][k] = (w, rb, rows, nbytes, 0)
        cur.args = (table[()],) + tuple(cur.args[1:])
        linked += 1
    return linked
