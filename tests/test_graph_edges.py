"""harness.graph_edges: the summary of constructed edge lists (CPU), read_graph through a fake
CUDA library that answers the driver calls as the CUDA reference says (counts first, then the
arrays), its error paths (a failing call, an oversized count, no edge-data call), and on a GPU
the captured step graph of a tiny qwen35 model with the `beside` fork and join."""
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


class FakeDriver:
    """The DRIVER calls on one fake graph (handle 0x1000): nodes are handles 0x100 + i; every
    call writes through the ctypes pointers it gets, as libcuda does."""

    GRAPH = 0x1000

    def __init__(self, node_types, edges, names, fail=None, edge_count=None):
        self.types, self.edges, self.names = node_types, edges, names
        self.fail, self.edge_count = fail or {}, edge_count
        self.calls = []
        self._keep = []  # name buffers handed out, alive while the fake is

    def _rc(self, name):
        self.calls.append(name)
        return self.fail.get(name, 0)

    def cuGraphGetNodes(self, g, arr, n):
        assert g.value == self.GRAPH
        if arr is not None:
            for i in range(min(n.contents.value, len(self.types))):
                arr[i] = 0x100 + i
        n.contents.value = len(self.types)
        return self._rc("cuGraphGetNodes")

    def cuGraphGetEdges_v2(self, g, frm, to, data, n):
        assert g.value == self.GRAPH
        if frm is None:
            n.contents.value = self.edge_count if self.edge_count is not None else len(self.edges)
            return self._rc("cuGraphGetEdges_v2")
        for i, (a, b, fp, tp, t) in enumerate(self.edges[:n.contents.value]):
            frm[i], to[i] = 0x100 + a, 0x100 + b
            data[i].from_port, data[i].to_port, data[i].type = fp, tp, t
        n.contents.value = len(self.edges)
        return self._rc("cuGraphGetEdges_v2")

    def cuGraphNodeGetType(self, node, t):
        t.contents.value = self.types[node.value - 0x100]
        return self._rc("cuGraphNodeGetType")

    def cuGraphKernelNodeGetParams_v2(self, node, params):
        ctypes.c_void_p.from_buffer(params).value = 0x5000 + node.value - 0x100  # func: first field
        return self._rc("cuGraphKernelNodeGetParams_v2")

    def cuFuncGetName(self, name, func):
        buf = ctypes.create_string_buffer(self.names[func.value - 0x5000].encode())
        self._keep.append(buf)
        ctypes.c_void_p.from_address(ctypes.addressof(name.contents)).value = ctypes.addressof(buf)
        return self._rc("cuFuncGetName")


def _fake(**kw):
    spec = [(0, 1, P), (1, 2, F), (2, 3, P)]
    return FakeDriver([K, K, K, EV_REC], _edges(spec), ["k0", "k1", "k2", "-"], **kw)


def test_read_graph_through_the_driver_calls():
    lib = _fake()
    s = ge.edge_summary(FakeDriver.GRAPH, lib)
    assert s["names_note"] is None and s["nodes"] == 4 and s["edges"] == 3
    assert s["nodes_by_type"] == {"kernel": 3, "event_record": 1}
    assert s["kernel_edges"] == {"programmatic": 1, "full": 1, "other": 0}
    assert [(r["from_name"], r["to_name"]) for r in s["non_programmatic_kernel_edges"]] == [("k1", "k2")]
    assert lib.calls.count("cuFuncGetName") == 3  # kernel nodes only
    assert lib.calls[:4] == ["cuGraphGetNodes"] * 2 + ["cuGraphGetEdges_v2"] * 2  # count, then arrays


@pytest.mark.parametrize("call", ["cuGraphGetNodes", "cuGraphGetEdges_v2", "cuGraphNodeGetType"])
def test_a_failing_call_raises_with_its_name_and_code(call):
    with pytest.raises(RuntimeError, match=f"{call} failed with error code 700"):
        ge.read_graph(FakeDriver.GRAPH, _fake(fail={call: 700}))


def test_failing_name_calls_leave_indices():
    types_, edges, names, note = ge.read_graph(FakeDriver.GRAPH, _fake(fail={"cuFuncGetName": 98}))
    assert names == [None] * 4 and "cuFuncGetName failed with error code 98" in note
    assert len(edges) == 3 and types_ == [K, K, K, EV_REC]  # the edges are still read


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


def test_runtime_names_are_used_for_a_cudart():
    d = _fake()
    rt = types.SimpleNamespace(cudaGraphGetNodes=d.cuGraphGetNodes, cudaGraphGetEdges_v2=d.cuGraphGetEdges_v2,
                               cudaGraphNodeGetType=d.cuGraphNodeGetType,
                               cudaGraphKernelNodeGetParams=d.cuGraphKernelNodeGetParams_v2,
                               cudaFuncGetName=d.cuFuncGetName)
    s = ge.edge_summary(FakeDriver.GRAPH, rt)
    assert s["kernel_edges"]["full"] == 1 and s["non_programmatic_kernel_edges"][0]["from_name"] == "k1"


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


def test_cli_refuses_an_out_file_and_reports_errors_in_one_line(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("")
    assert ge.main(["--model", "x.gguf", "--out", str(f)]) == 2
    assert "cannot create the output folder" in capsys.readouterr().err
    assert ge.main(["--model", str(tmp_path / "missing.gguf")]) == 2  # no GPU here, or no file
    err = capsys.readouterr().err
    assert err.startswith("graph_edges: ") and err.count("\n") == 1


@pytest.mark.gpu
def test_step_graph_of_the_engine_with_beside(tiny_qwen35_mix, monkeypatch, tmp_path):
    """The tiny qwen35 ud-q4_k_m model with GGUF_HARNESS_GEMV_KQ_MIXED=beside: one kernel node
    per engine node, labelled with the engine's names, a fork and a join per attention layer's
    beside node, and (with PDL on) programmatic edges; the CLI writes the same summary."""
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
    assert s["nodes_by_type"].get("kernel") == n and s["labels"] == "engine nodes"
    assert len(s["joins"]) >= 2 and len(s["forks"]) >= 2  # layers 3 and 7: qkv's k, v beside
    assert all(r["name"].startswith("blk.") for r in s["joins"] + s["forks"])
    assert s["nodes_by_type"] == {"kernel": n}  # stream events make edges, not nodes
    assert s["edges"] == n - 1 + len(s["forks"])  # a chain, plus the side edge of each fork
    if res["pdl"]:
        assert s["kernel_edges"]["programmatic"] > 0
    else:
        assert s["kernel_edges"]["programmatic"] == 0
    assert ge.main(["--model", str(path), "--ctx", "128", "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "graph-edges.json").read_text())
    assert out["schema"] == ge.SCHEMA and out["edges"]["nodes"] == s["nodes"]
