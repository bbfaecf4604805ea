"""Which dependency edges of a captured CUDA graph are programmatic (PDL) and which are full.

    python -m harness.graph_edges [--model NAME|PATH] [--ctx 512] [--out OUT]

The engine launches every kernel with programmatic dependent launch (backends/engine/launch.py)
and captures its decode step into one CUDA graph (backends/engine/executor.py); with
GGUF_HARNESS_GEMV_KQ_MIXED=beside the capture forks a side stream and joins it with events.
Each edge of a graph carries edge data (CUDA >= 12.3): `type` 1 (cudaGraphDependencyTypeProgrammatic)
with `from_port` 1 (cudaGraphKernelNodePortProgrammatic) or 2 (..PortLaunchCompletion) lets the
downstream kernel start before the upstream one ends; type 0 with from_port 0 is a full edge
(the upstream node completes, its writes visible, before the downstream node starts).
This tool loads the engine as `harness bench nodes` does (harness.bench_cmd's --model/--ctx,
engine check and model resolution, bench_nodes.loaded_engine; every GGUF_HARNESS_* switch is
read by the engine as usual), captures one decode step, and prints nodes by type, edges by
(type, from_port), the kernel-to-kernel edges that are not programmatic, and the joins and forks
(nodes with several incoming / outgoing edges). With --out it also writes
OUT/runs/<time>-<sha>/graph-edges.json (schema SCHEMA; a new folder, never overwritten, as
results.new_run_dir makes them; atomic: results.write_json). Errors print one line
(`graph_edges: ...`) and exit 2 for bad input (HarnessError, a bad switch value: ValueError, an
unusable --out or an unwritable result: OSError) or 1 for a failing CUDA call.

Sources: CUDA Driver API reference, Graph Management (cuGraphGetNodes, cuGraphGetEdges_v2,
cuGraphNodeGetType, cuGraphKernelNodeGetParams_v2, cuFuncGetName, cuGetErrorName) and Data
Structures (CUgraphEdgeData); the runtime's twins (cudaGraphEdgeData, ...) take the same handles,
structs and enum values. Every call is made through a ctypes prototype of its cuda.h
declaration (ARGTYPES; results are CUresult, an int enum), so a handle (a pointer) always passes
as 64 bits.
"""
from __future__ import annotations

import argparse
import ctypes
import sys
from collections import Counter, defaultdict
from datetime import datetime, timezone
from pathlib import Path

SCHEMA = "gguf-harness/graph-edges/1"
MAX_NODES = 1_000_000  # counts reported by the library above these are refused, not allocated
MAX_EDGES = 1_000_000

# cudaGraphNodeType (driver_types.h) = CUgraphNodeType (cuda.h)
NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty",
              6: "wait_event", 7: "event_record", 8: "ext_semaphore_signal",
              9: "ext_semaphore_wait", 10: "mem_alloc", 11: "mem_free", 12: "batch_mem_op",
              13: "conditional"}
KERNEL = 0
TYPE_DEFAULT, TYPE_PROGRAMMATIC = 0, 1  # cudaGraphDependencyType
# from_port: 0 cudaGraphKernelNodePortDefault, 1 ..Programmatic, 2 ..LaunchCompletion


class EdgeData(ctypes.Structure):
    """cudaGraphEdgeData = CUgraphEdgeData (cuda.h / driver_types.h, CUDA >= 12.3): unsigned char
    from_port, to_port, type, reserved[5]; 8 bytes, offsets 0, 1, 2 and 3..7, no padding."""

    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte),
                ("type", ctypes.c_ubyte), ("reserved", ctypes.c_ubyte * 5)]


class KernelNodeParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS_v2 (cuda.h, CUDA >= 12.0), what cuGraphKernelNodeGetParams_v2
    fills: CUfunction func at 0; gridDimX/Y/Z, blockDimX/Y/Z, sharedMemBytes (unsigned int) at
    8..35; 4 bytes of padding; void **kernelParams at 40, void **extra at 48, CUkernel kern at
    56, CUcontext ctx at 64: 72 bytes (LP64). Only func is read."""

    _fields_ = [("func", ctypes.c_void_p),
                *[(f, ctypes.c_uint) for f in ("gridDimX", "gridDimY", "gridDimZ", "blockDimX",
                                               "blockDimY", "blockDimZ", "sharedMemBytes")],
                ("kernelParams", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


# the calls used: (nodes, edges, node type, kernel node params, function name)
DRIVER = ("cuGraphGetNodes", "cuGraphGetEdges_v2", "cuGraphNodeGetType",
          "cuGraphKernelNodeGetParams_v2", "cuFuncGetName")
_HANDLE = ctypes.c_void_p  # CUgraph, CUgraphNode, CUfunction: opaque pointers
_HANDLES = ctypes.POINTER(ctypes.c_void_p)
_COUNT = ctypes.POINTER(ctypes.c_size_t)
# argument types of those calls, in that order (the prototypes of cuda.h; every one returns
# CUresult, an int enum):
ARGTYPES = (
    (_HANDLE, _HANDLES, _COUNT),  # GetNodes(graph, nodes[], size_t *numNodes)
    (_HANDLE, _HANDLES, _HANDLES, ctypes.POINTER(EdgeData), _COUNT),  # GetEdges_v2(graph, from[], to[], edgeData[], size_t *numEdges)
    (_HANDLE, ctypes.POINTER(ctypes.c_int)),  # NodeGetType(node, CUgraphNodeType *)
    (_HANDLE, ctypes.POINTER(KernelNodeParams)),  # KernelNodeGetParams(node, params *)
    (ctypes.POINTER(ctypes.c_char_p), _HANDLE),  # FuncGetName(const char **name, func)
)


def load_cuda():
    """libcuda.so.1 (the CUDA driver), loaded as backends/engine/launch.py loads it. Its graph
    calls are the runtime's twins on the same handles (cudaGraph_t is a CUgraph) and it is
    present wherever the engine runs; a libcudart is not (CuPy links the runtime statically), and
    CUDA 13's runtime API renamed cudaGraphGetEdges_v2 to cudaGraphGetEdges (the 4-argument
    call of CUDA 12 under the same name). Raises RuntimeError when it cannot load."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise RuntimeError(f"cannot load the CUDA driver library libcuda.so.1 ({e})") from None


def _require_edge_data(lib) -> None:
    """RuntimeError when `lib` has no cuGraphGetEdges_v2 (a driver older than CUDA 12.3)."""
    if not hasattr(lib, DRIVER[1]):
        raise RuntimeError("the CUDA driver has no cuGraphGetEdges_v2: edge data needs a CUDA >= 12.3 driver")


def _function(lib, name: str, restype, argtypes):
    """lib's C function `name` as a ctypes function of that prototype (restype, argtypes), as
    launch.py declares its calls: every argument is converted to its declared C type (a handle
    given as a Python int passes as a 64-bit pointer, never a 32-bit int). A new function object
    at the same address, so `lib`'s own attribute keeps whatever its owner declared.
    AttributeError when lib has no `name`; TypeError when it is not a C function."""
    fn = getattr(lib, name)
    try:
        address = ctypes.cast(fn, ctypes.c_void_p).value
    except ctypes.ArgumentError:
        raise TypeError(f"{name} of {type(lib).__name__} is not a C function (expected a ctypes "
                        f"library such as load_cuda()'s)") from None
    return ctypes.CFUNCTYPE(restype, *argtypes)(address)


def error_name(lib, rc: int) -> str | None:
    """The name of error code `rc` (e.g. CUDA_ERROR_ILLEGAL_ADDRESS) from cuGetErrorName; None
    when lib has no such call or the call does not know the code."""
    try:
        s = ctypes.c_char_p()
        if _function(lib, "cuGetErrorName", ctypes.c_int, (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)))(
                rc, ctypes.byref(s)) != 0:
            return None
        name = s.value
    except (AttributeError, TypeError, ctypes.ArgumentError):
        return None
    return name.decode(errors="replace") if name else None


def _checked(lib, i: int):
    """Call i of DRIVER of lib, with its prototype (ARGTYPES[i]); a non-zero result raises
    RuntimeError naming the call and the error (error_name, and the number)."""
    name = DRIVER[i]
    fn = _function(lib, name, ctypes.c_int, ARGTYPES[i])

    def call(*args) -> None:
        rc = fn(*args)
        if rc != 0:
            err = error_name(lib, rc)
            raise RuntimeError(f"{name} failed with " + (f"{err} (error code {rc})" if err
                                                          else f"error code {rc}"))
    return call


def _bounded(n: int, limit: int, what: str, call: str) -> int:
    if n > limit:
        raise RuntimeError(f"{call} reports {n:,} {what}, more than the {limit:,} this tool "
                           f"reads (a wrong graph handle?)")
    return n


def _handles(arr, n: int, call: str) -> list[int]:
    out = [arr[i] for i in range(n)]
    if any(h is None for h in out):
        raise RuntimeError(f"{call} returned a NULL node handle")
    return out


def read_graph(graph_handle: int, lib=None) -> tuple[list[int], list[tuple], list, str | None]:
    """(node types, edges, kernel names, names note) of the CUDA graph `graph_handle` (a
    cudaGraph_t / CUgraph as an int). Nodes are indexed in the order cudaGraphGetNodes returns
    them; node types are cudaGraphNodeType values; an edge is (from index, to index, from_port,
    to_port, type) as cudaGraphGetEdges_v2 returns it with its cudaGraphEdgeData; kernel names
    come from cudaGraphKernelNodeGetParams + cudaFuncGetName (None where those fail or for other
    nodes; the note then says why). lib: a ctypes library (default load_cuda()) with the DRIVER
    calls, each called through its prototype (ARGTYPES). Raises RuntimeError for a
    call that returns a non-zero error code (its name, the error's name where cuGetErrorName
    knows it, and the code in the message), a node or edge count over MAX_NODES
    / MAX_EDGES (checked before any array is allocated), a library without the edge-data call,
    or NULL handles; TypeError when lib's graph calls are not C functions."""
    lib = load_cuda() if lib is None else lib
    _require_edge_data(lib)
    api = DRIVER
    get_nodes, get_edges, node_type = (_checked(lib, i) for i in range(3))
    g = ctypes.c_void_p(graph_handle)

    n = ctypes.c_size_t(0)
    get_nodes(g, None, ctypes.byref(n))
    cap = _bounded(n.value, MAX_NODES, "nodes", api[0])
    arr = (ctypes.c_void_p * max(cap, 1))()
    n.value = cap
    get_nodes(g, arr, ctypes.byref(n))
    nodes = _handles(arr, _bounded(n.value, cap, "nodes", api[0]), api[0])

    m = ctypes.c_size_t(0)
    get_edges(g, None, None, None, ctypes.byref(m))
    cap = _bounded(m.value, MAX_EDGES, "edges", api[1])
    frm, to = (ctypes.c_void_p * max(cap, 1))(), (ctypes.c_void_p * max(cap, 1))()
    data = (EdgeData * max(cap, 1))()
    m.value = cap
    get_edges(g, frm, to, data, ctypes.byref(m))
    m = _bounded(m.value, cap, "edges", api[1])
    index = {h: i for i, h in enumerate(nodes)}
    ends = zip(_handles(frm, m, api[1]), _handles(to, m, api[1]))
    try:
        edges = [(index[a], index[b], d.from_port, d.to_port, d.type) for (a, b), d in zip(ends, data)]
    except KeyError:
        raise RuntimeError(f"{api[1]} returned an edge to a node {api[0]} did not list") from None

    types = []
    for h in nodes:
        t = ctypes.c_int(-1)
        node_type(h, ctypes.byref(t))
        types.append(t.value)

    names, note = [None] * len(nodes), None
    try:
        kparams, func_name = _checked(lib, 3), _checked(lib, 4)
        for i, h in enumerate(nodes):
            if types[i] != KERNEL:
                continue
            params = KernelNodeParams()
            kparams(h, ctypes.byref(params))
            if not params.func:
                raise RuntimeError(f"{api[3]} gave no function handle")
            name = ctypes.c_char_p()
            func_name(ctypes.byref(name), params.func)
            names[i] = name.value.decode(errors="replace") if name.value else None
    except (RuntimeError, AttributeError, TypeError) as e:  # names are a convenience: indices stay
        names, note = [None] * len(nodes), f"kernel names unavailable: {e}"
    return types, edges, names, note


def edge_kind(type_: int, from_port: int) -> str:
    """"programmatic" (type 1: the downstream kernel may start before the upstream one ends),
    "full" (type 0, from_port 0: after the upstream node completes) or "other" (type 0 with a
    non-zero port, e.g. launch completion used for launch order; or an unknown type)."""
    if type_ == TYPE_PROGRAMMATIC:
        return "programmatic"
    return "full" if type_ == TYPE_DEFAULT and from_port == 0 else "other"


def summarize(node_types: list[int], edges: list[tuple], labels: list | None = None) -> dict:
    """The summary of a graph given as node types (cudaGraphNodeType values, one per node) and
    edges (from index, to index, from_port, to_port, type) as read_graph returns them; labels:
    one name per node or None (kernel or engine node names). Returns {"nodes": N,
    "nodes_by_type": {type name: n}, "edges": E, "edges_by_kind": [{type, from_port, kind, n}]
    sorted by (type, from_port), "kernel_edges": {programmatic, full, other} (edges between two
    kernel nodes), "non_programmatic_kernel_edges": [{from, to, from_name, to_name, from_port,
    to_port, type, kind}] in edge order, "joins" / "forks": [{node, name, kinds: {kind: n}}] for
    nodes with several incoming / outgoing edges}. Raises ValueError for an edge whose index is
    outside the node list or labels of another length."""
    n = len(node_types)
    labels = [None] * n if labels is None else list(labels)
    if len(labels) != n:
        raise ValueError(f"{len(labels)} labels for {n} nodes")
    for e in edges:
        if not (0 <= e[0] < n and 0 <= e[1] < n):
            raise ValueError(f"edge {e[:2]} refers to a node outside 0..{n - 1}")
    by_type = Counter(NODE_TYPES.get(t, f"type {t}") for t in node_types)
    by_kind = Counter((e[4], e[2]) for e in edges)
    kernel_edges = Counter({"programmatic": 0, "full": 0, "other": 0})
    listed, into, out_of = [], defaultdict(Counter), defaultdict(Counter)
    for a, b, fp, tp, t in edges:
        kind = edge_kind(t, fp)
        into[b][kind] += 1
        out_of[a][kind] += 1
        if node_types[a] == KERNEL and node_types[b] == KERNEL:
            kernel_edges[kind] += 1
            if kind != "programmatic":
                listed.append({"from": a, "to": b, "from_name": labels[a], "to_name": labels[b],
                               "from_port": fp, "to_port": tp, "type": t, "kind": kind})

    def branches(deg: dict) -> list[dict]:
        return [{"node": i, "name": labels[i], "kinds": dict(deg[i])}
                for i in sorted(deg) if sum(deg[i].values()) > 1]

    return {"nodes": n, "nodes_by_type": dict(by_type), "edges": len(edges),
            "edges_by_kind": [{"type": t, "from_port": p, "kind": edge_kind(t, p), "n": c}
                              for (t, p), c in sorted(by_kind.items())],
            "kernel_edges": dict(kernel_edges), "non_programmatic_kernel_edges": listed,
            "joins": branches(into), "forks": branches(out_of)}


def edge_summary(graph_handle: int, lib=None) -> dict:
    """summarize() of the CUDA graph `graph_handle` (cudaGraph_t as an int; graph_handle() gets
    it from a CuPy Graph) labelled with kernel names, plus "names_note" (None, or why kernel
    names are missing). lib and errors: as read_graph."""
    types, edges, names, note = read_graph(graph_handle, lib)
    return summarize(types, edges, names) | {"names_note": note}


def graph_handle(graph) -> int:
    """The cudaGraph_t of a cupy.cuda.graph.Graph (Stream.end_capture()'s result): its `graph`
    attribute (cupy/cuda/graph.pxd: `readonly intptr_t graph  # cudaGraph_t`, beside
    `graphExec`, the instantiated graph). Raises TypeError when there is none (None, another
    object, or a CuPy that names it otherwise)."""
    h = getattr(graph, "graph", None)
    if not isinstance(h, int) or h == 0:
        raise TypeError(f"expected a cupy.cuda.graph.Graph with its cudaGraph_t in .graph, got "
                        f"{type(graph).__name__} (.graph = {h!r})")
    return h


def engine_labels(node_types: list[int], names: list, step_nodes: list) -> tuple[list, str]:
    """(labels, how): the engine's node names (executor.Node.name) on the kernel nodes, "engine
    nodes", when the kernel nodes, in graph node order, carry exactly the kernel names of
    `step_nodes` in list order (Node.kernel.name); else `names` and "kernels", or "indices"
    when a kernel name is missing. Other nodes keep their entry of `names`."""
    kernels = [i for i, t in enumerate(node_types) if t == KERNEL]
    if any(names[i] is None for i in kernels):
        return list(names), "indices"
    if len(kernels) != len(step_nodes) or any(
            names[i] != getattr(n.kernel, "name", None) for i, n in zip(kernels, step_nodes)):
        return list(names), "kernels"
    labels = list(names)
    for i, n in zip(kernels, step_nodes):
        labels[i] = n.name
    return labels, "engine nodes"


def step_graph_summary(model, n_ctx: int, lib=None) -> dict:
    """Load the engine on `model` (harness.config.ModelRef) with n_ctx (bench_nodes.loaded_engine),
    feed token 0 (which captures the decode step graph, executor.Executor.capture, and replays it
    once) and return {"edges": edge_summary of that graph with "labels" (how its nodes are named,
    engine_labels: engine node names such as blk.3.attn_qkv.q6_k where they can be matched),
    "pdl": whether launches were PDL launches, "engine": EngineBackend.info()}. Raises
    UnsupportedError without CuPy/GPU, ConfigError / ModelError on bad input and ValueError on a
    bad GGUF_HARNESS_* switch value (from the engine), RuntimeError / TypeError from read_graph."""
    from backends.engine import launch

    from .bench_nodes import loaded_engine
    with loaded_engine(model, n_ctx) as e:
        e.step(0)
        types, edges, names, note = read_graph(graph_handle(e.step_exec.graph), lib)
        labels, how = engine_labels(types, names, e.step_exec.nodes)
        return {"edges": summarize(types, edges, labels) | {"names_note": note, "labels": how},
                "pdl": launch.pdl_available(), "engine": e.info()}


def format_summary(s: dict) -> str:
    """A few text lines of an edge summary (edge_summary's or step_graph_summary's "edges")."""
    lines = [f"{s['nodes']} nodes (" + ", ".join(f"{k} {v}" for k, v in s["nodes_by_type"].items())
             + f"), {s['edges']} edges", "  type  from_port  kind           edges"]
    for r in s["edges_by_kind"]:
        lines.append(f"  {r['type']:>4}  {r['from_port']:>9}  {r['kind']:<13} {r['n']:>6}")
    k = s["kernel_edges"]
    lines.append(f"kernel -> kernel: {k['programmatic']} programmatic, {k['full']} full, {k['other']} other")
    name = lambda i, lab: f"{i} {lab}" if lab else str(i)
    for r in s["non_programmatic_kernel_edges"]:
        lines.append(f"  {r['kind']} edge {name(r['from'], r['from_name'])} -> {name(r['to'], r['to_name'])}"
                     f" (type {r['type']}, from_port {r['from_port']})")
    for what in ("joins", "forks"):
        for r in s[what]:
            lines.append(f"{what[:-1]} at {name(r['node'], r['name'])}: "
                         + ", ".join(f"{v} {k}" for k, v in sorted(r["kinds"].items())))
    if s.get("names_note"):
        lines.append(s["names_note"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    from . import results
    from .bench_cmd import add_model_args, require_engine, resolve_model
    from .config import MIN_CTX
    from .errors import ConfigError, HarnessError
    ap = argparse.ArgumentParser(prog="python -m harness.graph_edges", description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--out", default=None, help="output root: writes OUT/runs/<time>-<sha>/"
                    "graph-edges.json (none: print only)")
    a = ap.parse_args(argv)
    try:
        if a.ctx < MIN_CTX:
            raise ConfigError(f"--ctx must be at least {MIN_CTX}")
        if a.out is not None:  # an empty or bad --out fails now, not after the engine has loaded
            results.check_out_root(a.out)
        require_engine("python -m harness.graph_edges")  # before a registry model is assembled
        model = resolve_model(a.model, Console(stderr=True))
        res = step_graph_summary(model, a.ctx)
        print(f"PDL launches: {'on' if res['pdl'] else 'off'}; labels: {res['edges']['labels']}")
        print(format_summary(res["edges"]))
        if a.out is not None:
            from .machine import machine_info
            machine = machine_info()
            run_dir = results.new_run_dir(Path(a.out) / "runs", machine.get("git", {}).get("sha"))
            path = run_dir / "graph-edges.json"
            results.write_json(path, {"schema": SCHEMA, "created": datetime.now(timezone.utc).isoformat(),
                                      "machine": machine, "n_ctx": a.ctx,
                                      "model": {"name": model.name, "sha256": model.sha256}} | res)
            print(f"wrote {path}")
    except HarnessError as e:
        print(f"graph_edges: {e}", file=sys.stderr)
        return e.exit_code
    except (ValueError, OSError) as e:  # a bad GGUF_HARNESS_* switch value; the result unwritable
        print(f"graph_edges: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, TypeError) as e:  # a failing CUDA call, no graph handle
        print(f"graph_edges: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
