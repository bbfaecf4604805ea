"""backends.engine.prewarm (CPU): every build names a source and a kernel that source defines
(a renamed kernel would make the prewarm compile fail on the GPU machine), the defines are
spelled as the engine passes them, and without a GPU the command says so and exits 2."""
from __future__ import annotations

import re

import pytest

from backends.engine import module, ops, prewarm
from gpu_util import no_gpu_or_skip


@pytest.fixture(autouse=True)
def _default_switches(monkeypatch):
    """The builds at the engine's defaults, whatever the shell exports (the cluster split on,
    no latency A/B build, the 8-lane kernels)."""
    monkeypatch.setattr(ops, "GEMV_KQ_CSPLIT", "1")
    monkeypatch.setattr(ops, "GEMV_KQ", "v9l8")
    for knob in ("GEMV_KQ_PF", "GEMV_KQ_PIPE", "GEMV_KQ_L1PF", "GEMV_KQ_WMAJ", "GEMV_KQ_BW", "GEMV_KQ_DQ",
                 "GEMV_KQ_DQ_P", "GEMV_KQ_DQ_T", "GEMV_KQ_DQ_MAP", "GEMV_KQ_WIDE_MIN_ROWS", "GEMV_KQ_GSPLIT"):
        monkeypatch.setattr(ops, knob, "")


def test_builds_name_existing_kernels_and_engine_define_orders():
    # macro-instantiated kernels appear in their source as the macro call that makes them
    made_by = {"gemv_store_w1_b4": "GEMV_MODES(1, 4)", "gemv_store_w1_b4_iq4": "GEMV_MODES(1, 4)",
               "gemvf_store_w1": "GEMV_KERNEL(gemvf_store_w1,", "attn_gqa_d128": "GQA_KERNEL(128)",
               "attn_head_d128": "HEAD_KERNEL(128)", "attn_gated_d128": "GATED_KERNEL(128)",
               "gdn_step_s128_r8": "GDN_STEP_KERNEL(128, 8)", "gemvkq_store_q4_k": "KQ_MODES(T_Q4_K, q4_k)",
               "gemvkq_store_q4_k_c4": "KQ_CMODES(T_Q4_K, q4_k)"}
    for source, defines, name in prewarm.builds():
        text = (module.KERNEL_DIR / source).read_text()
        assert (made_by.get(name, "\x00") in text or re.search(rf"\b{re.escape(name)}\(", text)), (source, name)
        if source == "gemv_kq.cu":  # the builds the engine's v9 nodes use (ops.gemv: kv9_defines() + IQ3_S grid's (),
            # and the wide build of that for the split-1 nodes of many rows)
            base = ops.kv9_defines() + ops.kv9_iq3s_defines([12])
            assert defines in (base, ops.kv9_wide_defines(base), ops.kv9_csplit_defines(base, 2),
                               ops.kv9_csplit_defines(base, 4),
                               ops.kv9_dq_defines(ops.kv9_wide_defines(base))), defines
        else:
            assert set(defines) <= {"GEMV_IQ4", "ACT_Q8_1", "PF_AHEAD=0", "PF_AHEAD=1"}
    gemv_defs = {d for s, d, _ in prewarm.builds() if s == "gemv.cu"}
    # the engine's own order (ops.gemv_kernel): ACT_Q8_1 first, then GEMV_IQ4
    for impl in ("q16", "q8_1"):
        for types in ([12], [23]):
            assert ops.gemv_kernel("gemv", "store", 1, 4, types, impl)[1] in gemv_defs
    assert {s for s, _, _ in prewarm.BUILDS} >= set(module.SOURCES)
    # on by default (session 16); since session 19 two builds: groups of 4 in global memory
    # (KQ_GSPLIT=1) and hardware clusters of 2
    cs = [d for _, d, _ in prewarm.builds() if "KQ_CSPLIT=1" in d]
    assert sorted("KQ_GSPLIT=1" in d for d in cs) == [False, True], cs
    assert sum("KQ_DQ=1" in d for _, d, _ in prewarm.builds()) == 1  # on by default (session 17)
    # every prefetch distance ops.pf_ahead can pick other than the default has its builds
    for pf in {ops.pf_ahead(b) for b in (1, 9 << 20, 17 << 20, 1 << 40)} - {ops.PF_DEFAULT}:
        for d in ((), ("GEMV_IQ4",)):
            assert d + (f"PF_AHEAD={pf}",) in gemv_defs


def test_without_a_gpu_it_exits_2(capsys):
    no_gpu_or_skip()  # with a GPU, prewarm would compile every build instead of refusing
    assert prewarm.main([]) == 2
    assert "needs CuPy and a GPU" in capsys.readouterr().err


def test_bad_engine_switch_is_one_line_exit_2(capsys, monkeypatch):
    """A bad GGUF_HARNESS_GEMV_* value stops prewarm with its message and exit 2, before any
    compile (with or without a GPU), not a traceback at import."""
    monkeypatch.setattr(ops, "GEMV_KQ_P2_MIN_ROWS", "abc")
    import harness.gpu
    monkeypatch.setattr(harness.gpu, "require_cupy", lambda: None)  # as if a GPU were here
    assert prewarm.main([]) == 2
    assert "GGUF_HARNESS_GEMV_KQ_P2_MIN_ROWS" in capsys.readouterr().err


def test_the_wide_v9_build_is_prewarmed_unless_off(monkeypatch):
    """With GGUF_HARNESS_GEMV_KQ_WIDE_MIN_ROWS unset (the default) both v9 builds are compiled
    ahead; with "off" only the 16-warp one (no node would take the wide build)."""
    monkeypatch.setattr(ops, "GEMV_KQ_WIDE_MIN_ROWS", "")  # the default, whatever the environment says
    kq = [d for s, d, _ in prewarm.builds() if s == "gemv_kq.cu" and "KQ_CSPLIT=1" not in d and "KQ_DQ=1" not in d]
    assert kq == [ops.kv9_defines(), ops.kv9_wide_defines(ops.kv9_defines())]
    assert "KQ_BLOCK_WARPS=32" in kq[1] and "KQ_WMAJ=1" in kq[1]
    monkeypatch.setattr(ops, "GEMV_KQ_WIDE_MIN_ROWS", "off")
    assert [d for s, d, _ in prewarm.builds() if s == "gemv_kq.cu" and "KQ_CSPLIT=1" not in d] == [ops.kv9_defines()]
    # (the queue build goes with the wide nodes: test_dq_build_only_when_switched_on)


def test_csplit_build_only_when_switched_on(monkeypatch):
    """While GGUF_HARNESS_GEMV_KQ_CSPLIT is on prewarm also compiles the cluster-split build, with
    the defines ops.gemv passes for it (kv9_csplit_defines: KQ_WMAJ dropped, KQ_CSPLIT=1 added)
    and a kernel that build defines; with the switch at 0, or a latency A/B build set, it does not."""
    monkeypatch.setattr(ops, "GEMV_KQ_GSPLIT", "1")  # every group in global memory: one build (GSPLIT=4 below)
    for on in ("1", "2"):
        monkeypatch.setattr(ops, "GEMV_KQ_CSPLIT", on)
        monkeypatch.setattr(ops, "GEMV_KQ_WMAJ", "1")
        cs = [(d, n) for s, d, n in prewarm.builds() if "KQ_CSPLIT=1" in d]
        assert cs == [(ops.kv9_csplit_defines(ops.kv9_defines(), 2), "gemvkq_store_q4_k_c4")]
        assert "KQ_WMAJ=1" in ops.kv9_defines() and not any(d.startswith("KQ_WMAJ") for d in cs[0][0])
    assert "KQ_CMODES(T_Q4_K, q4_k)" in (module.KERNEL_DIR / "gemv_kq.cu").read_text()
    monkeypatch.setattr(ops, "GEMV_KQ_PIPE", "2")
    assert not any("KQ_CSPLIT=1" in d for _, d, _ in prewarm.builds())
    monkeypatch.setattr(ops, "GEMV_KQ_PIPE", "")
    monkeypatch.setattr(ops, "GEMV_KQ", "v9")  # Q4_K / Q5_K on the 4-lane kernels: no cluster node
    assert not any("KQ_CSPLIT=1" in d for _, d, _ in prewarm.builds())
    monkeypatch.setattr(ops, "GEMV_KQ", "v9l8")
    # GGUF_HARNESS_GEMV_KQ_GSPLIT=4: groups of 4 and hardware clusters of 2 are two builds
    monkeypatch.setattr(ops, "GEMV_KQ_CSPLIT", "1")
    monkeypatch.setattr(ops, "GEMV_KQ_GSPLIT", "4")
    cs = [d for s, d, n in prewarm.builds() if "KQ_CSPLIT=1" in d]
    assert cs == [ops.kv9_csplit_defines(ops.kv9_defines(), 2), ops.kv9_csplit_defines(ops.kv9_defines(), 4)]
    assert "KQ_GSPLIT=1" not in cs[0] and "KQ_GSPLIT=1" in cs[1]
    monkeypatch.setattr(ops, "GEMV_KQ_GSPLIT", "")
    monkeypatch.setattr(ops, "GEMV_KQ_CSPLIT", "0")
    assert not any("KQ_CSPLIT=1" in d for _, d, _ in prewarm.builds())


def test_dq_build_only_when_switched_on(monkeypatch):
    """With GGUF_HARNESS_GEMV_KQ_DQ on (unset: the default) prewarm also compiles the queue build with
    the defines ops.gemv passes for it (kv9_dq_defines of the wide build); not with the switch at 0,
    the wide nodes off or a latency A/B build set."""
    monkeypatch.setattr(ops, "GEMV_KQ_WIDE_MIN_ROWS", "")
    monkeypatch.setattr(ops, "GEMV_KQ_DQ", "")
    dq = [(d, n) for s, d, n in prewarm.builds() if "KQ_DQ=1" in d]
    assert dq == [(ops.kv9_dq_defines(ops.kv9_wide_defines(ops.kv9_defines())), "gemvkq_store_q4_k")]
    for knob, value in (("GEMV_KQ_DQ", "0"), ("GEMV_KQ_WIDE_MIN_ROWS", "off"), ("GEMV_KQ_PIPE", "2")):
        monkeypatch.setattr(ops, knob, value)
        assert not any("KQ_DQ=1" in d for _, d, _ in prewarm.builds()), knob


def test_harness_prewarm_lists_compiles_and_refuses(capsys, monkeypatch):
    """`harness prewarm` (harness/prewarm_cmd.py): --list prints one line per build of builds()
    ("source -Ddefine ...") without a GPU; --only filters by source name and an --only that keeps
    nothing, --jobs 0 or a bad engine switch is an error line with exit 2 before any compile; a
    run hands every selected build to compile_builds (jobs: one per build, at most the CPUs) and
    exits 1 when one failed, 0 when none did."""
    import harness.gpu
    from harness import cli
    want = [s + "".join(f" -D{d}" for d in defs) for s, defs, _ in prewarm.builds()]
    assert cli.main(["prewarm", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == want and any("KQ_DQ=1" in line for line in lines)  # the 27B's gate/up build
    assert cli.main(["prewarm", "--list", "--only", "deltanet"]) == 0
    assert capsys.readouterr().out.split() == ["deltanet.cu"]
    seen = []

    def fake_compile(todo, jobs, log):
        seen.append((list(todo), jobs))
        return fail
    monkeypatch.setattr(prewarm, "compile_builds", fake_compile)
    monkeypatch.setattr(harness.gpu, "require_cupy", lambda: None)  # as if a GPU were here
    for fail, rc in ((0, 0), (2, 1)):
        assert cli.main(["prewarm", "--only", "gemv_kq", "--jobs", "3"]) == rc
        assert seen[-1] == ([b for b in prewarm.builds() if b[0] == "gemv_kq.cu"], 3)
    fail = 0
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert cli.main(["prewarm"]) == 0 and seen[-1][1] == 2  # fewer CPUs than builds
    n = len(seen)
    capsys.readouterr()
    for argv in (["prewarm", "--only", "nope"], ["prewarm", "--jobs", "0"]):
        assert cli.main(argv) == 2
        assert "error:" in capsys.readouterr().err
    monkeypatch.setattr(ops, "GEMV_KQ_PF0_SB", "99")
    assert cli.main(["prewarm", "--list"]) == 2
    assert "GGUF_HARNESS_GEMV_KQ_PF0_SB='99'" in capsys.readouterr().err
    assert len(seen) == n  # nothing compiled after a refusal


def test_prewarm_covers_every_gemv_build_of_the_27b_step(monkeypatch):
    """Every gemv_kq.cu build the 27B ud-q4_k_m step's GEMV nodes take (the node kinds, formats and
    shapes of its `harness bench nodes` table: docs/results/sweeps/2026-12-01-h200-nodes-27b-s25-*)
    is one `harness prewarm` compiles, so a prewarmed machine compiles none of them at load; the
    shapes are SEEDS.md's (n_embd 5120, n_ff 17408, d_inner 6144, q|gate 12288 rows, k / v 1024,
    vocab 248320). ops.gemv runs on a fake module (no GPU) that records each compile."""
    from test_engine_args import _fake_module
    from types import SimpleNamespace as NS

    from backends.engine.arena import DeviceTensor
    from backends.engine.formats import FORMATS
    asked = _fake_module(monkeypatch)
    F32, Q4_K, Q5_K, Q6_K, IQ3_S, IQ4_XS = 0, 12, 13, 14, 21, 23
    addr = iter(range(1 << 20, 1 << 40, 1 << 30))

    def seg(t, K, rows):
        rb = K * 4 if t == F32 else K // FORMATS[t].block_size * FORMATS[t].type_size
        w = DeviceTensor(f"w{t}", next(addr), t, (K, rows), rb, rb * rows)
        return ops.Seg(w, NS(size=rows, data=NS(ptr=next(addr))))
    nodes = [("ssm_in", "store", 5120, [(Q5_K, 10240), (Q5_K, 6144), (F32, 48), (F32, 48)]),
             ("ssm_out", "add", 6144, [(Q5_K, 5120)]), ("attn_output", "add", 6144, [(Q5_K, 5120)]),
             ("gate_up", "swiglu", 5120, [(IQ4_XS, 17408), (IQ4_XS, 17408)]),
             ("gate_up", "swiglu", 5120, [(IQ3_S, 17408), (IQ3_S, 17408)]),
             ("ffn_down", "add", 17408, [(Q4_K, 5120)]), ("ffn_down", "add", 17408, [(Q5_K, 5120)]),
             ("qkv", "store", 5120, [(Q4_K, 12288), (Q6_K, 1024), (Q6_K, 1024)]),
             ("output", "store", 5120, [(Q6_K, 248320)])]
    for name, mode, K, segs in nodes:
        ops.gemv_nodes(name, mode, [seg(t, K, rows) for t, rows in segs], NS(), K)
    used = {(src, defs) for src, _, defs in asked}
    assert {src for src, _ in used} == {"gemv_kq.cu"}, used  # every 27B GEMV is a v9 node
    assert len(used) >= 4  # the plain, wide, queue and group-split builds at least
    prewarmed = {(src, defs) for src, defs, _ in prewarm.builds()}
    assert used <= prewarmed, used - prewarmed
