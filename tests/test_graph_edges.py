"""harness.graph_edges: the summary of constructed edge lists (CPU), the layout of the structs
it hands to CUDA, read_graph through a fake CUDA library whose calls are C functions (ctypes
callbacks of the cuda.h prototypes, written here apart from the module's) that answer as the
CUDA reference says (counts first, then the arrays; edge data and kernel node params written at
the header's byte offsets; handles above 32 bits), its error paths (a failing call named with
cuGetErrorName, an oversized count, no edge-data call, a library of Python functions), the CLI's
one-line errors, and on a GPU the captured step graph of a tiny qwen35 model with `beside`."""
from __future__ import annotations

import ctypes
import json
import types

import pytest

from harness import graph_edges as ge

K, EV_REC = 0, 7  # cudaGraphNodeTypeKernel, cudaGraphNodeTypeEventRecord
P, F = (1, 0, 1), (0, 0, 0)  # edge data (from_port, to_port, type): programmatic, full


def _edges(spec):
    return [(a, b) + d for a, b, d in spec]


def test_chain_of_programmatic_edges():
    s = ge.summarize([K, K, K], _edges([(0, 1, P), (1, 2, P)]), ["a", "b", "c"])
    assert s["nodes"] == 3 and s["edges"] == 2 and s["nodes_by_type"] == {"kernel": 3}
    assert s["edges_by_kind"] == [{"type": 1, "from_port": 1, "kind": "programmatic", "n": 2}]
    assert s["kernel_edges"] == {"programmatic": 2, "full": 0, "other": 0}
    assert s["non_programmatic_kernel_edges"] == [] and s["joins"] == [] and s["forks"] == []


def test_fork_and_join_with_full_edges_are_listed():
    # 0 -> {1 beside, 2 main} -> 3: the fork's side edge and the join's side edge are full
    spec = [(0, 1, F), (0, 2, P), (1, 3, F), (2, 3, P)]
    s = ge.summarize([K] * 4, _edges(spec), ["prev", "side", "main", "next"])
    assert s["kernel_edges"] == {"programmatic": 2, "full": 2, "other": 0}
    assert [(r["from_name"], r["to_name"], r["kind"]) for r in s["non_programmatic_kernel_edges"]] == [
        ("prev", "side", "full"), ("side", "next", "full")]
    assert s["joins"] == [{"node": 3, "name": "next", "kinds": {"full": 1, "programmatic": 1}}]
    assert s["forks"] == [{"node": 0, "name": "prev", "kinds": {"full": 1, "programmatic": 1}}]
    assert [(r["type"], r["from_port"], r["n"]) for r in s["edges_by_kind"]] == [(0, 0, 2), (1, 1, 2)]


def test_launch_completion_port_and_non_kernel_nodes():
    # a launch-order edge (type 0, port 2) is "other"; an edge touching an event node is not a
    # kernel edge; programmatic with port 2 (launch completion) is still programmatic
    spec = [(0, 1, (2, 0, 0)), (1, 2, (2, 0, 1)), (2, 3, F)]
    s = ge.summarize([K, K, K, EV_REC], _edges(spec))
    assert s["nodes_by_type"] == {"kernel": 3, "event_record": 1}
    assert s["kernel_edges"] == {"programmatic": 1, "full": 0, "other": 1}
    (r,) = s["non_programmatic_kernel_edges"]
    assert (r["from"], r["to"], r["kind"], r["from_name"]) == (0, 1, "other", None)
    assert ge.edge_kind(1, 2) == "programmatic" and ge.edge_kind(0, 0) == "full"
    assert ge.summarize([99], [])["nodes_by_type"] == {"type 99": 1}


def test_summarize_refuses_bad_indices_and_labels():
    with pytest.raises(ValueError, match="outside 0..1"):
        ge.summarize([K, K], _edges([(0, 2, P)]))
    with pytest.raises(ValueError, match="1 labels for 2 nodes"):
        ge.summarize([K, K], [], ["a"])


def test_edge_data_layout_is_cuda_h_s():
    """CUgraphEdgeData (cuda.h, CUDA 12.3) = cudaGraphEdgeData (driver_types.h): unsigned char
    from_port, to_port, type, reserved[5]: 8 bytes, no padding."""
    E = ge.EdgeData
    assert ctypes.sizeof(E) == 8 and ctypes.alignment(E) == 1
    assert (E.from_port.offset, E.to_port.offset, E.type.offset) == (0, 1, 2)
    assert (E.reserved.offset, E.reserved.size) == (3, 5)


def test_kernel_node_params_layout_is_cuda_h_s():
    """CUDA_KERNEL_NODE_PARAMS_v2 (cuda.h, CUDA >= 12.0, cuGraphKernelNodeGetParams_v2's struct):
    CUfunction func; unsigned int gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY,
    blockDimZ, sharedMemBytes; void **kernelParams; void **extra; CUkernel kern; CUcontext ctx:
    72 bytes on LP64 (4 bytes of padding after sharedMemBytes)."""
    P = ge.KernelNodeParams
    assert ctypes.sizeof(P) == 72 and ctypes.sizeof(ctypes.c_void_p) == 8
    assert (P.func.offset, P.func.size) == (0, 8)
    assert [getattr(P, f).offset for f in ("gridDimX", "gridDimY", "gridDimZ", "blockDimX",
                                            "blockDimY", "blockDimZ", "sharedMemBytes")] == list(range(8, 36, 4))
    assert (P.kernelParams.offset, P.extra.offset, P.kern.offset, P.ctx.offset) == (40, 48, 56, 64)


VP, INT = ctypes.c_void_p, ctypes.c_int
HANDLES, COUNT = ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)
# the cuda.h prototypes (CUresult = int), struct pointers as void *: the fake writes their bytes
PROTOTYPES = {
    "cuGraphGetNodes": (INT, VP, HANDLES, COUNT),  # (CUgraph, CUgraphNode *, size_t *)
    "cuGraphGetEdges_v2": (INT, VP, HANDLES, HANDLES, VP, COUNT),  # (.., from, to, CUgraphEdgeData *, ..)
    "cuGraphNodeGetType": (INT, VP, ctypes.POINTER(INT)),  # (CUgraphNode, CUgraphNodeType *)
    "cuGraphKernelNodeGetParams_v2": (INT, VP, VP),  # (CUgraphNode, CUDA_KERNEL_NODE_PARAMS *)
    "cuFuncGetName": (INT, VP, VP),  # (const char **name, CUfunction)
    "cuGetErrorName": (INT, INT, VP),  # (CUresult, const char **pStr)
}
ERRORS = {700: b"CUDA_ERROR_ILLEGAL_ADDRESS", 400: b"CUDA_ERROR_INVALID_HANDLE"}
CUDA_ERROR_INVALID_VALUE = 1


class FakeDriver:
    """The DRIVER calls (and cuGetErrorName) on one fake graph as C functions: every attribute
    is a ctypes callback of the cuda.h prototype, so read_graph's arguments go through its
    declared argument types into C and back, as with libcuda. Handles are above 32 bits (a
    handle cut to an int would not be found). Edge data is written at byte 8 i + 0 / 1 / 2 and
    the function handle at byte 0 of the params, the header's layout, not by field name. A
    callback that raises records the exception (`errors`; ctypes would only print it) and
    returns 999."""

    GRAPH = 0x7F12_3456_7000
    NODE0 = 0x7E00_0000_0100
    FUNC0 = 0x7D00_0000_5000

    def __init__(self, node_types, edges, names, fail=None, edge_count=None, error_names=True):
        self.types, self.edges, self.names = node_types, edges, names
        self.fail, self.edge_count = fail or {}, edge_count
        self.calls, self.errors, self.graphs, self.nodes_asked = [], [], set(), set()
        self._keep = []  # name buffers handed out, alive while the fake is
        for name, (res, *args) in PROTOTYPES.items():
            if name == "cuGetErrorName" and not error_names:
                continue
            setattr(self, name, ctypes.CFUNCTYPE(res, *args)(self._guarded(name, getattr(self, "_" + name))))

    def _guarded(self, name, fn):
        def call(*args):
            try:
                return fn(*args)
            except Exception as e:  # noqa: BLE001 - reported by the test, not by ctypes
                self.errors.append(f"{name}: {type(e).__name__}: {e}")
                return 999
        return call

    def _rc(self, name):
        self.calls.append(name)
        return self.fail.get(name, 0)

    def _node(self, h):
        self.nodes_asked.add(h)
        return h - self.NODE0

    def _cuGraphGetNodes(self, g, arr, n):
        self.graphs.add(g)
        if arr:
            for i in range(min(n[0], len(self.types))):
                arr[i] = self.NODE0 + i
        n[0] = len(self.types)
        return self._rc("cuGraphGetNodes")

    def _cuGraphGetEdges_v2(self, g, frm, to, data, n):
        self.graphs.add(g)
        if not frm:
            n[0] = self.edge_count if self.edge_count is not None else len(self.edges)
            return self._rc("cuGraphGetEdges_v2")
        for i, (a, b, fp, tp, t) in enumerate(self.edges[:n[0]]):
            frm[i], to[i] = self.NODE0 + a, self.NODE0 + b
            ctypes.memmove(data + 8 * i, bytes([fp, tp, t]), 3)
        n[0] = len(self.edges)
        return self._rc("cuGraphGetEdges_v2")

    def _cuGraphNodeGetType(self, node, t):
        t[0] = self.types[self._node(node)]
        return self._rc("cuGraphNodeGetType")

    def _cuGraphKernelNodeGetParams_v2(self, node, params):
        ctypes.c_void_p.from_address(params).value = self.FUNC0 + self._node(node)
        return self._rc("cuGraphKernelNodeGetParams_v2")

    def _cuFuncGetName(self, name, func):
        buf = ctypes.create_string_buffer(self.names[func - self.FUNC0].encode())
        self._keep.append(buf)
        ctypes.c_void_p.from_address(name).value = ctypes.addressof(buf)
        return self._rc("cuFuncGetName")

    def _cuGetErrorName(self, rc, out):
        if rc not in ERRORS:
            return CUDA_ERROR_INVALID_VALUE  # as cuGetErrorName does; *pStr left NULL
        buf = ctypes.create_string_buffer(ERRORS[rc])
        self._keep.append(buf)
        ctypes.c_void_p.from_address(out).value = ctypes.addressof(buf)
        return 0


def _fake(**kw):
    spec = [(0, 1, P), (1, 2, F), (2, 3, P)]
    return FakeDriver([K, K, K, EV_REC], _edges(spec), ["k0", "k1", "k2", "-"], **kw)


def test_read_graph_through_the_driver_calls():
    lib = _fake()
    s = ge.edge_summary(FakeDriver.GRAPH, lib)
    assert lib.errors == []
    assert s["names_note"] is None and s["nodes"] == 4 and s["edges"] == 3
    assert s["nodes_by_type"] == {"kernel": 3, "event_record": 1}
    assert s["kernel_edges"] == {"programmatic": 1, "full": 1, "other": 0}
    assert [(r["from_name"], r["to_name"]) for r in s["non_programmatic_kernel_edges"]] == [("k1", "k2")]
    assert lib.calls.count("cuFuncGetName") == 3  # kernel nodes only
    assert lib.calls[:4] == ["cuGraphGetNodes"] * 2 + ["cuGraphGetEdges_v2"] * 2  # count, then arrays
    # the 64-bit handles arrived whole in C
    assert lib.graphs == {FakeDriver.GRAPH}
    assert lib.nodes_asked == {FakeDriver.NODE0 + i for i in range(4)}


def test_edge_data_is_read_at_the_header_offsets():
    # every (from_port, to_port, type) a byte pattern of its own, written by offset
    spec = [(0, 1, (1, 0, 1)), (1, 2, (2, 0, 0)), (2, 0, (0, 3, 7))]
    lib = FakeDriver([K, K, K], _edges(spec), ["a", "b", "c"])
    _, edges, names, note = ge.read_graph(FakeDriver.GRAPH, lib)
    assert lib.errors == [] and note is None and names == ["a", "b", "c"]
    assert edges == _edges(spec)


@pytest.mark.parametrize("call", ["cuGraphGetNodes", "cuGraphGetEdges_v2", "cuGraphNodeGetType"])
def test_a_failing_call_raises_with_its_name_and_code(call):
    with pytest.raises(RuntimeError, match=f"^{call} failed with CUDA_ERROR_ILLEGAL_ADDRESS "
                                           r"\(error code 700\)$"):
        ge.read_graph(FakeDriver.GRAPH, _fake(fail={call: 700}))


def test_an_error_code_without_a_name_is_given_as_a_number():
    with pytest.raises(RuntimeError, match=r"^cuGraphGetNodes failed with error code 12345$"):
        ge.read_graph(FakeDriver.GRAPH, _fake(fail={"cuGraphGetNodes": 12345}))  # unknown to it
    with pytest.raises(RuntimeError, match=r"^cuGraphGetNodes failed with error code 700$"):
        ge.read_graph(FakeDriver.GRAPH, _fake(fail={"cuGraphGetNodes": 700}, error_names=False))


def test_failing_name_calls_leave_indices():
    lib = _fake(fail={"cuFuncGetName": 400})
    types_, edges, names, note = ge.read_graph(FakeDriver.GRAPH, lib)
    assert names == [None] * 4
    assert "cuFuncGetName failed with CUDA_ERROR_INVALID_HANDLE (error code 400)" in note
    assert len(edges) == 3 and types_ == [K, K, K, EV_REC]  # the edges are still read
    assert lib.errors == []


def test_an_oversized_edge_count_is_refused_before_allocating(monkeypatch):
    lib = _fake(edge_count=ge.MAX_EDGES + 1)
    with pytest.raises(RuntimeError, match="1,000,001 edges, more than the 1,000,000"):
        ge.read_graph(FakeDriver.GRAPH, lib)
    assert lib.calls.count("cuGraphGetEdges_v2") == 1  # the arrays were never asked for
    monkeypatch.setattr(ge, "MAX_NODES", 3)
    with pytest.raises(RuntimeError, match="4 nodes, more than the 3"):
        ge.read_graph(FakeDriver.GRAPH, _fake())


def test_a_library_without_edge_data_is_refused():
    old = types.SimpleNamespace(cuGraphGetNodes=lambda *a: 0, cuGraphGetEdges=lambda *a: 0)
    with pytest.raises(RuntimeError, match="needs a CUDA >= 12.3 driver"):
        ge.read_graph(FakeDriver.GRAPH, old)


def test_a_library_of_python_functions_is_refused():
    py = types.SimpleNamespace(**{n: (lambda *a: 0) for n in ge.DRIVER})
    with pytest.raises(TypeError, match="cuGraphGetNodes of SimpleNamespace is not a C function"):
        ge.read_graph(FakeDriver.GRAPH, py)


def test_graph_handle_of_a_cupy_graph_and_of_other_objects():
    assert ge.graph_handle(types.SimpleNamespace(graph=0x1234, graphExec=0x99)) == 0x1234
    for bad in (None, object(), types.SimpleNamespace(graph=0)):
        with pytest.raises(TypeError, match="cudaGraph_t in .graph"):
            ge.graph_handle(bad)


def test_engine_labels_only_when_the_kernel_names_match_in_order():
    node = lambda name, kernel: types.SimpleNamespace(name=name, kernel=types.SimpleNamespace(name=kernel))
    step = [node("blk.0.attn_qkv.q6_k", "gemvkq_q6_k"), node("blk.0.attn_qkv.q4_k", "gemvkq_q4_k")]
    kinds = [K, EV_REC, K]
    assert ge.engine_labels(kinds, ["gemvkq_q6_k", None, "gemvkq_q4_k"], step) == (
        ["blk.0.attn_qkv.q6_k", None, "blk.0.attn_qkv.q4_k"], "engine nodes")
    swapped = ["gemvkq_q4_k", None, "gemvkq_q6_k"]
    assert ge.engine_labels(kinds, swapped, step) == (swapped, "kernels")
    assert ge.engine_labels([K], ["gemvkq_q6_k"], step)[1] == "kernels"  # a node count differs
    assert ge.engine_labels(kinds, [None, None, None], step) == ([None] * 3, "indices")


def test_format_summary_names_edges_and_joins():
    spec = [(0, 1, F), (0, 2, P), (1, 3, F), (2, 3, P)]
    text = ge.format_summary(ge.summarize([K] * 4, _edges(spec), ["prev", "side", "main", "next"]))
    assert "4 nodes (kernel 4), 4 edges" in text
    assert "kernel -> kernel: 2 programmatic, 2 full, 0 other" in text
    assert "full edge 0 prev -> 1 side (type 0, from_port 0)" in text
    assert "join at 3 next: 1 full, 1 programmatic" in text


def test_cli_refuses_a_small_ctx(capsys):
    assert ge.main(["--model", "x.gguf", "--ctx", "4"]) == 2
    assert "--ctx must be at least 8" in capsys.readouterr().err


def test_cli_checks_out_as_other_commands_and_reports_errors_in_one_line(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("")
    assert ge.main(["--model", "x.gguf", "--out", str(f)]) == 2
    assert f"--out {f} exists and is not a folder" in capsys.readouterr().err
    assert ge.main(["--model", "x.gguf", "--out", " "]) == 2  # --out "$OUT" with OUT unset
    assert "--out is empty" in capsys.readouterr().err
    assert ge.main(["--model", str(tmp_path / "missing.gguf")]) == 2  # no GPU here, or no file
    err = capsys.readouterr().err
    assert err.startswith("graph_edges: ") and err.count("\n") == 1


def test_cli_reports_a_bad_engine_switch_in_one_line(monkeypatch, tmp_path, capsys):
    """A ValueError from a bad GGUF_HARNESS_* value (here GEMV_KQ_CSPLIT=7, refused by the
    engine's own check as the engine's load refuses it) is one line and exit code 2, no
    traceback; without a GPU: the engine check passes and the engine's load is the check."""
    from backends.engine import EngineBackend, ops

    from harness import bench_cmd
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    monkeypatch.setattr(bench_cmd, "require_engine", lambda cmd: None)
    monkeypatch.setattr(ops, "GEMV_KQ_CSPLIT", "7")
    monkeypatch.setattr(EngineBackend, "load", lambda self, model, cfg: ops.kv9_csplit("", "store", 2, False))
    monkeypatch.setattr(EngineBackend, "close", lambda self: None)
    assert ge.main(["--model", str(model), "--ctx", "64"]) == 2
    err = capsys.readouterr().err
    assert err == "graph_edges: GGUF_HARNESS_GEMV_KQ_CSPLIT='7': expected 0, 1 or 2\n"


def test_cli_reports_a_failing_cuda_call_with_exit_code_1(monkeypatch, tmp_path, capsys):
    from harness import bench_cmd
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    monkeypatch.setattr(bench_cmd, "require_engine", lambda cmd: None)

    def fails(model, n_ctx):
        raise RuntimeError("cuGraphGetNodes failed with CUDA_ERROR_ILLEGAL_ADDRESS (error code 700)")
    monkeypatch.setattr(ge, "step_graph_summary", fails)
    assert ge.main(["--model", str(model), "--out", str(tmp_path / "o")]) == 1
    assert capsys.readouterr().err == ("graph_edges: cuGraphGetNodes failed with "
                                       "CUDA_ERROR_ILLEGAL_ADDRESS (error code 700)\n")
    assert list((tmp_path / "o" / "runs").iterdir()) == []  # no result folder for a failed run


def test_cli_writes_a_new_run_folder_per_run(monkeypatch, tmp_path, capsys):
    from harness import bench_cmd
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    monkeypatch.setattr(bench_cmd, "require_engine", lambda cmd: None)
    summary = ge.summarize([K, K], _edges([(0, 1, P)]), ["a", "b"]) | {"names_note": None,
                                                                      "labels": "engine nodes"}
    monkeypatch.setattr(ge, "step_graph_summary", lambda model, n_ctx: {
        "edges": summary, "pdl": True, "engine": {"nodes_per_step": 2}})
    for _ in range(2):
        assert ge.main(["--model", str(model), "--ctx", "64", "--out", str(tmp_path / "o")]) == 0
    files = sorted((tmp_path / "o" / "runs").glob("*/graph-edges.json"))
    assert len(files) == 2  # never overwritten
    out = json.loads(files[0].read_text())
    assert out["schema"] == ge.SCHEMA and out["n_ctx"] == 64 and out["edges"]["edges"] == 1
    assert out["model"]["name"] == "m" and out["pdl"] is True
    assert "1 programmatic, 0 full, 0 other" in capsys.readouterr().out


@pytest.mark.gpu
def test_step_graph_of_the_engine_with_beside(tiny_qwen35_mix, monkeypatch, tmp_path):
    """The tiny qwen35 ud-q4_k_m model (8 layers, full attention in layers 3 and 7) with
    GGUF_HARNESS_GEMV_KQ_MIXED=beside: one kernel node per engine node, labelled with the
    engine's names, and the topology the H200 showed for the 27B (388 kernel nodes, 418 edges,
    all programmatic; 387 edges, all programmatic, without beside). Each attention layer L's
    blk.L.qkv.q6_k (attn_k + attn_v) runs on the side stream: a fork at the node before it (the
    previous layer's ffn_down: -> q6_k and -> qkv.q4_k) and a join at blk.L.attn (<- q4_k, <-
    q6_k); and the side stream's own order adds an edge q6_k of layer L -> q6_k of the next
    attention layer (L + 4), so every q6_k but the last is a fork and every one but the first a
    join (27B: 16 + 15 forks, 16 + 15 joins). Every fork and join has two edges, so
    edges = nodes - 1 + forks = nodes - 1 + joins (27B: 418 = 387 + 31; tiny: 3 forks, 3 joins).
    With PDL on every edge is programmatic (type 1) as on the H200; off, none is. The CLI
    writes the same summary."""
    from gpu_util import cupy_or_skip
    cupy_or_skip()
    from backends.engine import ops as eops
    from harness.config import ModelRef
    monkeypatch.setattr(eops, "GEMV_KQ_MIXED", "beside")
    path = tiny_qwen35_mix("ud-q4_k_m")
    res = ge.step_graph_summary(ModelRef("tiny", path), 128)
    s = res["edges"]
    print(ge.format_summary(s))  # the answer this tool exists for (pytest -s shows it)
    n = res["engine"]["nodes_per_step"]
    assert s["nodes_by_type"] == {"kernel": n} and s["labels"] == "engine nodes"  # events make edges
    name = {r["node"]: r["name"] for r in s["forks"] + s["joins"]}
    side = sorted(i for i, lab in name.items() if lab.endswith(".qkv.q6_k"))
    assert [name[i] for i in side] == ["blk.3.qkv.q6_k", "blk.7.qkv.q6_k"]
    forks, joins = [r["node"] for r in s["forks"]], [r["node"] for r in s["joins"]]
    assert forks == sorted([i - 1 for i in side] + side[:-1])  # before each q6_k; q6_k -> next q6_k
    assert joins == sorted([i + 2 for i in side] + side[1:])  # attn after q6_k, q4_k; the next q6_k
    assert [name[i - 1] for i in side] == ["blk.2.ffn_down", "blk.6.ffn_down"]
    assert [name[i + 2] for i in side] == ["blk.3.attn", "blk.7.attn"]
    assert all(sum(r["kinds"].values()) == 2 for r in s["forks"] + s["joins"])
    assert s["edges"] == n - 1 + len(s["forks"]) == n - 1 + len(s["joins"])
    if res["pdl"]:
        assert s["kernel_edges"] == {"programmatic": s["edges"], "full": 0, "other": 0}
    else:
        assert s["kernel_edges"]["programmatic"] == 0
    assert ge.main(["--model", str(path), "--ctx", "128", "--out", str(tmp_path)]) == 0
    (f,) = (tmp_path / "runs").glob("*/graph-edges.json")
    out = json.loads(f.read_text())
    assert out["schema"] == ge.SCHEMA and out["edges"]["nodes"] == s["nodes"]
