"""The chain roofline of a decode step (harness/step_roofline.py): region layout, the summary,
the report line (CPU); the kernel's reads and PDL handshakes on a GPU."""
from __future__ import annotations

import contextlib
import types

import numpy as np
import pytest

from harness import step_roofline as sr


def test_layout_rounds_each_region_to_words_and_aligns_every_start():
    offsets, sizes, total = sr.layout([0, 1, 16, 17, 300, 4096])
    assert sizes == [16, 16, 16, 32, 304, 4096]
    assert offsets == [0, 256, 512, 768, 1024, 1536]
    assert total == 1536 + 4096
    assert all(o % sr.ALIGN == 0 for o in offsets)
    # regions never overlap
    assert all(o + s <= n for o, s, n in zip(offsets, sizes, offsets[1:] + [total]))


@pytest.mark.parametrize("bad", [[], [-1], [1.5], [True], ["8"]])
def test_layout_rejects_bad_byte_counts(bad):
    with pytest.raises(ValueError):
        sr.layout(bad)


def test_summarize_takes_the_median_and_relates_the_step_to_each_chain():
    res = sr.summarize({"dependent": [5000.0, 4000.0, 4500.0], "independent": [3000.0]},
                       total_bytes=9_000_000_000, step_us=6000.0)
    d = res["modes"]["dependent"]
    assert d["us"] == 4500.0 and d["samples_us"] == [5000.0, 4000.0, 4500.0]
    assert d["gb_s"] == pytest.approx(9e9 / 4500e-6 / 1e9)
    assert res["step_over"] == {"dependent": pytest.approx(6000 / 4500), "independent": pytest.approx(2.0)}
    assert sr.summarize({"dependent": [1.0]}, 16, None)["step_over"] == {}


@pytest.mark.parametrize("samples", [[], [0.0], [float("nan")], [-1.0]])
def test_summarize_rejects_empty_or_non_positive_samples(samples):
    with pytest.raises(ValueError):
        sr.summarize({"dependent": samples}, 16, 1.0)


def test_chain_nodes_check_mode_and_alignment_before_any_gpu_work():
    with pytest.raises(ValueError, match="mode"):
        sr.chain_nodes([16], 0, None, "fast")
    with pytest.raises(ValueError, match="aligned"):
        sr.chain_nodes([16], 128, None, "dependent")
    with pytest.raises(ValueError, match="staged needs x"):
        sr.chain_nodes([16], 0, None, "staged")


def test_run_nodes_times_the_chain_of_the_engines_node_bytes(monkeypatch):
    """run_nodes hands time_chain the step graph's node byte counts and the step time, and puts
    what it returns into the result (a fake engine; time_chain itself is GPU-tested below)."""
    from harness import bench_nodes
    from test_gpu_state import _NodesEngine  # (tests/ is on the path, as for gpu_util)

    eng = _NodesEngine(lambda ids, steps, reps: {"decode_s": [0.064] * 3})
    eng.step_exec = types.SimpleNamespace(nodes=[types.SimpleNamespace(bytes=1000), types.SimpleNamespace(bytes=24)])

    seen = {}

    def fake_chain(byte_counts, step_us, log=print):
        seen.update(byte_counts=byte_counts, step_us=step_us)
        return {"method": sr.METHOD, "modes": {"dependent": {"us": 500.0}}}
    monkeypatch.setattr(bench_nodes, "loaded_engine", lambda model, n_ctx: contextlib.nullcontext(eng))
    monkeypatch.setattr(sr, "time_chain", fake_chain)
    out = bench_nodes.run_nodes(None, 128, [1, 2, 3], methods=("graph",), steps=64, log=lambda m: None)
    assert seen == {"byte_counts": [1000, 24], "step_us": 1000.0}
    assert out["chain_roofline"]["modes"]["dependent"]["us"] == 500.0
    seen.clear()
    out = bench_nodes.run_nodes(None, 128, [1, 2, 3], methods=("graph",), steps=64, log=lambda m: None, chain=False)
    assert not seen and "chain_roofline" not in out


def test_report_line_shows_positive_finite_modes_and_escapes_hostile_names():
    from reports.nodes_html import chain_line, render_nodes_html
    ch = {"modes": {"dependent": {"us": 4321.04}, "prefetch": {"us": float("nan")}, "<b>x</b>": {"us": 1.0},
                    "independent": "junk"},
          "step_over": {"dependent": 1.4251, "<b>x</b>": "nope"}}
    line = chain_line(ch)
    assert line == "dependent 4321.0 µs (step 1.43x) · <b>x</b> 1.0 µs"
    assert chain_line({"why": "needs 1 B"}) == "not run: needs 1 B"
    assert chain_line({"why": " "}) is None and chain_line({"why": 3}) is None
    assert chain_line({"modes": {"dependent": {"us": 1e308}}, "step_over": {"dependent": 1e-300}}) == \
        "dependent 1e+308 µs (step 1e-300x)"
    assert chain_line(None) is None and chain_line({"modes": []}) is None and chain_line({"modes": {}}) is None
    rows = [{"name": "blk.0.ffn_down", "kind": "gemv", "fmt": "Q4_K", "us": 2.0, "bytes": 10, "gb_s": 5.0, "pct": 100.0}]
    m = {"nodes": rows, "sum_us": 2.0, "step_us": 3.0, "gap_us": 1.0, "by_kind": [], "by_op": [], "top": rows}
    html = render_nodes_html({"model": {"name": "m", "sha256": "0"}, "nodes": {
        "n_ctx": 128, "n_prompt": 3, "step_us": 3.0, "engine": {"nodes_per_step": 1, "bytes_per_step": 10},
        "methods": {"graph": m}, "chain_roofline": ch}})
    assert "chain roofline" in html and "dependent 4321.0 µs" in html
    assert "<b>x</b>" not in html and "&lt;b&gt;x&lt;/b&gt;" in html


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(sr.MODES))
def test_chain_reads_every_region_in_every_mode(mode):
    """One eager chain (launched with PDL where available) over odd-sized regions of random
    bytes and a random x: out[0] is the XOR of every region's words (numpy) and, in the staged
    modes, of block 0's read-back of the staged x once per node (words (7 t) mod n, t < 512),
    so each node read exactly its own region and the staging delivered x, whatever the handshake."""
    from gpu_util import cupy_or_skip
    cp = cupy_or_skip()
    from backends.engine.executor import Executor
    from harness.roofline import xor_words
    rng = np.random.default_rng(7)
    counts = [16, 1000, 24_576, 3_000_000, 0, 777_777, 48]  # 7 nodes: an odd count, so x's part shows
    offsets, sizes, total = sr.layout(counts)
    host = rng.integers(0, 256, total, dtype=np.uint8)
    buf = cp.asarray(host)
    assert buf.data.ptr % sr.ALIGN == 0  # cupy's pool allocations are 512-byte aligned
    out = cp.zeros(1, dtype=cp.uint32)
    xh = rng.integers(0, 256, 16 * sr.X_WORDS, dtype=np.uint8)
    want = 0
    for o, s in zip(offsets, sizes):
        want ^= xor_words(host[o:o + s])
    if mode.startswith("staged"):
        n = sr.X_WORDS_OF.get(mode, sr.X_WORDS)
        words = xh.view("<u4").reshape(-1, 4)
        staged = 0
        for t in range(sr.THREADS):
            staged ^= int(np.bitwise_xor.reduce(words[(7 * t) % n]))
        want ^= staged if len(counts) % 2 else 0
    ex = Executor(sr.chain_nodes(counts, buf.data.ptr, out, mode, cp.asarray(xh)), cp.cuda.Stream(non_blocking=True))
    ex.run_eager()
    ex.stream.synchronize()
    assert int(out.get()[0]) == want


@pytest.mark.gpu
def test_time_chain_gives_positive_times_for_each_mode():
    from gpu_util import cupy_or_skip
    cupy_or_skip()
    counts = [1 << 20] * 12 + [4096] * 12
    res = sr.time_chain(counts, step_us=100.0, chains=4, samples=3, log=lambda m: None)
    assert res["method"] == sr.METHOD and res["n_nodes"] == 24 and res["chains"] == 4
    assert res["bytes"] == sum(sr.layout(counts)[1])
    assert set(res["modes"]) == set(sr.MODES)
    for v in res["modes"].values():
        assert len(v["samples_us"]) == 3 and all(s > 0 for s in v["samples_us"])
        assert v["gb_s"] == pytest.approx(res["bytes"] / v["us"] / 1e3)
    # 24 nodes that wait for each other cannot beat 24 that may overlap
    assert res["modes"]["dependent"]["us"] > res["modes"]["independent"]["us"]


def test_time_chain_records_why_when_the_buffer_does_not_fit(monkeypatch):
    """Not enough free device memory for the step's bytes + 1 GiB: {"method", "why"}, logged,
    nothing allocated (a fake CuPy on the CPU)."""
    from harness import gpu

    class Pool:
        def free_bytes(self):
            return 0

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(memGetInfo=lambda: (2 << 30, 4 << 30))),
                                 get_default_memory_pool=Pool,
                                 empty=lambda *a, **k: pytest.fail("allocated"), zeros=lambda *a, **k: pytest.fail("allocated"))
    monkeypatch.setattr(gpu, "require_cupy", lambda: fake)
    lines = []
    res = sr.time_chain([1 << 30, 1 << 30], log=lines.append)
    assert res["method"] == sr.METHOD and "of device memory + 1 GiB" in res["why"] and "2,147,483,648 B free" in res["why"]
    assert lines == [f"chain roofline skipped: {res['why']}"]
    with pytest.raises(ValueError, match="modes"):  # bad arguments before any GPU call
        sr.time_chain([16], modes=("fast",))
    with pytest.raises(ValueError, match="chains"):
        sr.time_chain([16], chains=0)


def test_run_nodes_keeps_its_result_when_the_chain_fails(monkeypatch):
    from harness import bench_nodes
    from test_gpu_state import _NodesEngine
    eng = _NodesEngine(lambda ids, steps, reps: {"decode_s": [0.064] * 3})
    eng.step_exec = types.SimpleNamespace(nodes=[types.SimpleNamespace(bytes=1000)])

    def boom(*a, **k):
        raise RuntimeError("cuLaunchKernelEx failed with CUresult 1")
    monkeypatch.setattr(bench_nodes, "loaded_engine", lambda model, n_ctx: contextlib.nullcontext(eng))
    monkeypatch.setattr(sr, "time_chain", boom)
    lines = []
    out = bench_nodes.run_nodes(None, 128, [1, 2, 3], methods=("graph",), steps=64, log=lines.append)
    assert out["chain_roofline"] == {"method": sr.METHOD, "why": "RuntimeError: cuLaunchKernelEx failed with CUresult 1"}
    assert out["methods"]["graph"]["sum_us"] == 900.0
    assert "chain roofline failed: RuntimeError: cuLaunchKernelEx failed with CUresult 1" in lines


def _chain(us, n_nodes=388, nbytes=15_789_626_208, method=None):
    return {"method": method or sr.METHOD, "n_nodes": n_nodes, "bytes": nbytes, "modes": {"dependent": {"us": us}}}


def test_ab_note_compares_same_method_chains_and_flags_another_gpu():
    a = _chain(4029.0)
    assert sr.ab_note(a, _chain(4033.0)) == "chain dependent 4029.0 -> 4033.0 us (+0.1 %)"
    assert sr.ab_note(a, _chain(4029.0)) == "chain dependent 4029.0 -> 4029.0 us (+0.0 %)"
    assert sr.ab_note(_chain(4029.0), _chain(4028.9)) == "chain dependent 4029.0 -> 4028.9 us (+0.0 %)"
    assert sr.ab_note(a, _chain(4081.0)).endswith("(+1.3 %); the GPUs differ on the chain")
    assert sr.ab_note(_chain(1000.0), _chain(1010.0)).endswith("(+1.0 %)")  # 1 % exactly: not flagged
    assert sr.ab_note(_chain(1000.0), _chain(989.0)).endswith("(-1.1 %); the GPUs differ on the chain")
    other = sr.ab_note(a, _chain(2400.0, n_nodes=300, nbytes=9_000_000_000))
    assert other.endswith("; other node sizes (388 nodes, 15789626208 B -> 300, 9000000000)")
    assert "GPUs" not in other
    assert sr.ab_note(_chain(1e308), _chain(1e308)) == "chain dependent 1e+308 -> 1e+308 us (+0.0 %)"
    for bad in (None, {}, _chain(1.0, method="stream-chain/0"), _chain(float("inf")), _chain(-1.0),
                {"method": sr.METHOD, "modes": []}, {"method": sr.METHOD, "modes": {"dependent": 3}},
                {"method": sr.METHOD, "why": "no room"}):
        assert sr.ab_note(a, bad) == "" and sr.ab_note(bad, a) == ""


def test_harness_ab_of_two_nodes_results_notes_their_chains(tmp_path, capsys):
    """harness ab A.json B.json on nodes results prints the chain note (CLI, CPU)."""
    import json

    from harness import cli
    rows = [{"name": "blk.0.ffn_down", "kind": "gemv", "fmt": "Q4_K", "us": 900.0, "us_samples": [899.0, 900.0, 901.0],
             "bytes": 1000}]

    def doc(chain_us):
        return {"schema": "gguf-harness/nodes/1", "model": {"sha256": "ab"}, "machine": {},
                "nodes": {"schema": "gguf-harness/nodes/1", "n_ctx": 128, "n_prompt": 3, "step_us": 1000.0,
                          "step_samples_us": [999.0, 1000.0, 1001.0], "chain_roofline": _chain(chain_us),
                          "methods": {"graph": {"nodes": rows, "sum_us": 900.0}}}}
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(doc(4029.0)))
    pb.write_text(json.dumps(doc(4081.0)))
    rc = cli.main(["ab", str(pa), str(pb)])
    out = capsys.readouterr().out
    assert rc == 0 and "chain dependent 4029.0 -> 4081.0 us (+1.3 %); the GPUs differ on the chain" in out


def test_module_cli_times_a_stored_nodes_result(tmp_path, monkeypatch, capsys):
    """python -m harness.step_roofline NODES.json --out F: the node byte counts in step order
    and the step time go to time_chain, its result to F; a file that is not a nodes result
    exits 2 with a one-line message."""
    import json
    seen = {}

    def fake(counts, step_us, **kw):
        seen.update(counts=counts, step_us=step_us)
        return _chain(4000.0)
    monkeypatch.setattr(sr, "time_chain", fake)
    rows = [{"name": f"n{i}", "bytes": b} for i, b in enumerate([100, 7, 4096])]
    src = tmp_path / "nodes.json"
    src.write_text(json.dumps({"schema": "gguf-harness/nodes/1",
                               "nodes": {"step_us": 6000.0, "methods": {"graph": {"nodes": rows}}}}))
    out = tmp_path / "chain.json"
    assert sr.main([str(src), "--out", str(out)]) == 0
    assert seen == {"counts": [100, 7, 4096], "step_us": 6000.0}
    assert json.loads(out.read_text()) == {"source": str(src), "chain": _chain(4000.0)}
    for bad in ({"schema": "gguf-harness/nodes/1", "nodes": {}}, {"x": 1}, [1, 2],
                {"schema": "gguf-harness/nodes/1", "nodes": {"methods": {"graph": {"nodes": [{"bytes": "9"}]}}}}):
        src.write_text(json.dumps(bad))
        monkeypatch.setattr(sr, "time_chain", lambda counts, step_us, **kw: sr.layout(counts))
        assert sr.main([str(src)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1


def test_run_nodes_says_when_the_build_is_diagnostic(monkeypatch):
    """run_nodes logs a line when the engine ran a GGUF_HARNESS_DIAG build (timing only), and none
    otherwise (a fake engine)."""
    from harness import bench_nodes
    from test_gpu_state import _NodesEngine

    for diag, said in (("nostage", True), ("", False)):
        eng = _NodesEngine(lambda ids, steps, reps: {"decode_s": [0.064] * 3})
        eng.info = lambda d=diag: {"nodes_per_step": 1, "bytes_per_step": 1,
                                   "switches_effective": {"GGUF_HARNESS_DIAG": d}}
        monkeypatch.setattr(bench_nodes, "loaded_engine", lambda model, n_ctx, e=eng: contextlib.nullcontext(e))
        lines = []
        bench_nodes.run_nodes(None, 128, [1, 2, 3], methods=("graph",), steps=64, log=lines.append, chain=False)
        assert any("GGUF_HARNESS_DIAG=nostage" in m and "timing-only" in m for m in lines) == said, lines
