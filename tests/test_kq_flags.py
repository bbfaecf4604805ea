"""GGUF_HARNESS_GEMV_KQ_FLAGS (kernels/gemv_kq.cu KQ_FLAGS, backends/engine/kq_flags.py): readiness
counts from a SwiGLU pair to its 4-part ffn_down. CPU: which node pairs link() takes and what it
writes; the builds compile and only the linked kernels carry the count operations. GPU: a linked
pair gives the unlinked pair's outputs bit for bit with h poisoned before every producer launch (a
consumer that read h early would see NaN), and leaves the counts at zero."""
from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest
from gpu_util import cupy_or_skip, device_tensor, nan_poisoned, q16_or_skip

from backends.engine import kq_flags, ops
from oracles import gemv_check
from oracles import ops as oops
from oracles.blocks import random_blocks
from oracles.dequant import dequantize, get_format


class _Arr:  # a device array as link() reads it: .data.ptr, .size, .dtype
    def __init__(self, ptr: int, size: int = 0, dtype=np.float32):
        self.data = SimpleNamespace(ptr=ptr)
        self.size, self.dtype = size, np.dtype(dtype)


def _node(kname: str, defines: tuple, x_ptr: int, out_ptr: int, K: int, rows: int):
    table = np.zeros((), ops.table_dtype(flags="KQ_FLAGS=1" in defines))[()]
    return SimpleNamespace(kernel=SimpleNamespace(name=kname), defines=defines, out=_Arr(out_ptr), grid=(132,),
                           args=(table, _Arr(x_ptr), np.uint64(0), np.float32(0), np.int32(K), np.int32(rows)),
                           _pdl="cached")


PROD = ("KQ_P2=1", "KQ_BLOCK_WARPS=32", "KQ_DQ=1", "KQ_FLAGS=1")
CONS = ("KQ_P2=1", "KQ_FLAGS=1", "KQ_CSPLIT=1", "KQ_GSPLIT=1")


def _pair(K=17408, rows=17408, prod=PROD, cons=CONS, pname="gemvkq_swiglu_iq4_xs", cname="gemvkq_add_q4_k_c4",
          x_ptr=0x2000):
    g = _node(pname, prod, 0x1000, 0x2000, 5120, rows)
    d = _node(cname, cons, x_ptr, 0x3000, K, 5120)
    return g, d


def test_link_fills_both_records_of_a_pair():
    g, d = _pair()
    other = _node("gemvkq_store_q4_k", PROD, 0x1000, 0x5000, 5120, 10240)
    counts = _Arr(0x9000, 32, np.uint32)
    assert kq_flags.link([other, g, d, other], counts) == 1
    for node, role in ((g, 1), (d, 2)):
        f = node.args[0]["flags"]
        assert (int(f["cnt"]), int(f["ng"]), int(f["F"]), int(f["role"])) == (0x9000, 17, 4, role)
        assert node._pdl is None  # relaunches with the new table
    assert int(other.args[0]["flags"]["role"]) == 0 and other._pdl == "cached"


@pytest.mark.parametrize("change", ["not_adjacent", "x_elsewhere", "k_not_1024", "rows_differ", "c2", "no_queue",
                                    "store_producer", "split_producer", "no_flags_build", "too_few_groups",
                                    "too_many_groups"])
def test_link_leaves_other_pairs_alone(change):
    g, d = _pair()
    nodes = [g, d]
    if change == "not_adjacent":
        nodes = [g, _node("gemvkq_store_q4_k", PROD, 0x1000, 0x5000, 5120, 10240), d]
    elif change == "x_elsewhere":
        g, d = _pair(x_ptr=0x7000)
        nodes = [g, d]
    elif change == "k_not_1024":
        g, d = _pair(K=17408 + 256, rows=17408 + 256)
        nodes = [g, d]
    elif change == "rows_differ":
        g, d = _pair(rows=16384)
        nodes = [g, d]
    elif change == "c2":
        g, d = _pair(cname="gemvkq_add_q4_k_c2")
        nodes = [g, d]
    elif change == "no_queue":
        g, d = _pair(prod=("KQ_P2=1", "KQ_FLAGS=1"))
        nodes = [g, d]
    elif change == "store_producer":
        g, d = _pair(pname="gemvkq_store_iq4_xs")
        nodes = [g, d]
    elif change == "split_producer":  # an S-split pair's rows do not come from the queue
        g, d = _pair(pname="gemvkq_swiglu_iq4_xs_s2")
        nodes = [g, d]
    elif change == "no_flags_build":
        g, d = _pair(cons=("KQ_P2=1", "KQ_CSPLIT=1", "KQ_GSPLIT=1"))
        nodes = [g, d]
    elif change == "too_few_groups":
        g, d = _pair(K=3072, rows=3072)
        nodes = [g, d]
    elif change == "too_many_groups":
        g, d = _pair(K=31744, rows=31744)  # 31 groups: word 30 holds the errors
        nodes = [g, d]
    assert kq_flags.link(nodes, _Arr(0x9000, 32, np.uint32)) == 0
    assert all(int(n.args[0]["flags"]["role"]) == 0 for n in nodes if "KQ_FLAGS=1" in n.defines)


def test_unlinked_gives_a_role_0_copy_of_a_linked_node():
    """kq_flags.unlinked: what a node timed alone runs (executor.time_nodes_graph): a linked node's copy
    with the whole flag record zero and no cached launch; the linked node itself unchanged; an
    unlinked node (or one of another build) is returned as it is."""
    from backends.engine.executor import Node
    g, d = _pair()
    assert kq_flags.link([g, d], _Arr(0x9000, 32, np.uint32)) == 1
    real = Node("ffn_down", "gemv", d.kernel, (264,), (512,), d.args, defines=d.defines)
    real._pdl = "cached"
    assert kq_flags.linked(real)
    alone = kq_flags.unlinked(real)
    assert alone is not real and not kq_flags.linked(alone) and alone._pdl is None
    assert int(alone.args[0]["flags"]["cnt"]) == 0 and int(alone.args[0]["flags"]["ng"]) == 0
    assert int(real.args[0]["flags"]["role"]) == 2 and real._pdl == "cached"
    assert alone.name == real.name and alone.grid == real.grid and alone.args[1:] == real.args[1:]
    assert kq_flags.unlinked(alone) is alone
    plain = Node("x", "gemv", d.kernel, (1,), (32,), (np.zeros((), ops.table_dtype())[()],))
    assert kq_flags.unlinked(plain) is plain and not kq_flags.linked(plain)


def test_link_refuses_a_short_count_array():
    g, d = _pair()
    with pytest.raises(ValueError, match="32 words"):
        kq_flags.link([g, d], _Arr(0x9000, 16, np.uint32))
    with pytest.raises(ValueError, match="uint32"):
        kq_flags.link([g, d], _Arr(0x9000, 32, np.int64))


def test_the_switch_adds_the_define_and_the_table_record(monkeypatch):
    monkeypatch.setattr(ops, "GEMV_KQ_FLAGS", "1")
    assert "KQ_FLAGS=1" in ops.kv9_defines()
    monkeypatch.setattr(ops, "GEMV_KQ_FLAGS", "0")
    assert "KQ_FLAGS=1" not in ops.kv9_defines()
    monkeypatch.setattr(ops, "GEMV_KQ_FLAGS", "2")
    with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_KQ_FLAGS"):
        ops.kv9_defines()
    # segs.cuh FlagArgs: 24 bytes after the table (and after the XPF / CONV records)
    assert ops.table_dtype(flags=True).itemsize == ops.table_dtype().itemsize + 24 == 176
    assert ops.table_dtype(True, True, True).itemsize == 152 + 48 + 32 + 24


def test_the_sleep_switch_needs_the_flags_and_a_bound(monkeypatch):
    """GGUF_HARNESS_GEMV_KQ_FLAGS_SLEEP (session 33): ns 1..100000 add KQ_FLAG_SLEEP=<ns> to a KQ_FLAGS
    build; "" and "0" add nothing; without the flags, or out of range, a ValueError names it."""
    monkeypatch.setattr(ops, "GEMV_KQ_FLAGS", "1")
    for v, want in (("", None), ("0", None), ("250", "KQ_FLAG_SLEEP=250"), ("100000", "KQ_FLAG_SLEEP=100000")):
        monkeypatch.setattr(ops, "GEMV_KQ_FLAGS_SLEEP", v)
        got = [d for d in ops.kv9_defines() if d.startswith("KQ_FLAG_SLEEP")]
        assert got == ([want] if want else []), v
    for v in ("100001", "-5", "1e3", "x"):
        monkeypatch.setattr(ops, "GEMV_KQ_FLAGS_SLEEP", v)
        with pytest.raises(ValueError, match="GGUF_HARNESS_GEMV_KQ_FLAGS_SLEEP"):
            ops.kv9_defines()
    monkeypatch.setattr(ops, "GEMV_KQ_FLAGS", "0")
    monkeypatch.setattr(ops, "GEMV_KQ_FLAGS_SLEEP", "250")
    with pytest.raises(ValueError, match="needs GGUF_HARNESS_GEMV_KQ_FLAGS=1"):
        ops.kv9_defines()


def test_sleep_and_flags_pdl_change_only_the_linked_consumer():
    """NVRTC, the group build with KQ_FLAGS=1: KQ_FLAG_SLEEP puts a nanosleep.u32 into the _c4 entries'
    poll and DIAG_FLAGS_PDL a griddepcontrol.wait before it; the _c2 / plain entries stay as they were."""
    from test_kernels_compile import _entry_bodies, _nvrtc, compile_source
    lib = _nvrtc()
    base = ("KQ_P2=1", "KQ_CSPLIT=1", "KQ_GSPLIT=1", "KQ_FLAGS=1")
    plain, slept, pdl = [], [], []
    for defs, out in ((base, plain), (base + ("KQ_FLAG_SLEEP=256",), slept), (base + ("DIAG_FLAGS_PDL",), pdl)):
        rc, log = compile_source(lib, "gemv_kq.cu", defs, out)
        assert rc == 0, log
    a, s, w = _entry_bodies(plain[0]), _entry_bodies(slept[0]), _entry_bodies(pdl[0])
    assert set(a) == set(s) == set(w)
    for n in a:
        c4 = n.endswith("_c4")
        assert ("nanosleep" in s[n]) == c4 and "nanosleep" not in a[n], n
        if c4:
            assert w[n].count("griddepcontrol.wait") == a[n].count("griddepcontrol.wait") + 1, n
            assert w[n].index("griddepcontrol.wait") < w[n].index("ld.relaxed.gpu"), n
        else:
            assert s[n] == a[n] and w[n] == a[n], n


def test_flags_split_diagnostics_change_only_their_side():
    """NVRTC, the KQ_FLAGS builds under the session-34 diagnostics (module.py): DIAG_FLAGS_NOREMAP
    changes only the queue build's SwiGLU entries (their row order), DIAG_FLAGS_NOPM only the group
    build's _c4 entries (their block order); DIAG_FLAGS_NOCOUNT takes the counting out of both
    sides: no global add in the producers, no poll in the _c4 consumers, which make a PDL wait;
    DIAG_FLAGS_NOEND takes the consumers' end count out, DIAG_FLAGS_NOFENCE the producers' fence;
    (session 35) DIAG_FLAGS_NOPOLL the consumers' polls (a PDL wait instead, the end stays),
    DIAG_FLAGS_NOGLOBAL the producers' global adds, DIAG_FLAGS_NOBFENCE their per-row CTA fences."""
    from test_kernels_compile import _entry_bodies, _nvrtc, compile_source
    lib = _nvrtc()
    bodies = {}
    for side, base in (("prod", ("KQ_P2=1", "KQ_BLOCK_WARPS=32", "KQ_DQ=1", "KQ_FLAGS=1")),
                       ("cons", ("KQ_P2=1", "KQ_CSPLIT=1", "KQ_GSPLIT=1", "KQ_FLAGS=1"))):
        for word in ("", "DIAG_FLAGS_NOREMAP", "DIAG_FLAGS_NOPM", "DIAG_FLAGS_NOCOUNT", "DIAG_FLAGS_NOEND",
                     "DIAG_FLAGS_NOFENCE", "DIAG_FLAGS_NOPOLL", "DIAG_FLAGS_NOGLOBAL", "DIAG_FLAGS_NOBFENCE"):
            out = []
            rc, log = compile_source(lib, "gemv_kq.cu", base + ((word,) if word else ()), out)
            assert rc == 0, log
            bodies[side, word] = _entry_bodies(out[0])
    prod, cons = bodies["prod", ""], bodies["cons", ""]
    queue = {n for n in prod if kq_flags._QUEUE_PAIR.match(n)}
    c4 = {n for n in cons if n.endswith("_c4")}
    assert queue and c4
    for n in prod:  # the producer side
        assert bodies["prod", "DIAG_FLAGS_NOPM"][n] == prod[n], n
        assert (bodies["prod", "DIAG_FLAGS_NOREMAP"][n] != prod[n]) == (n in queue), n
        assert bodies["prod", "DIAG_FLAGS_NOEND"][n] == prod[n], n
        assert bodies["prod", "DIAG_FLAGS_NOPOLL"][n] == prod[n], n  # the consumer's side only
        ng, nb = bodies["prod", "DIAG_FLAGS_NOGLOBAL"][n], bodies["prod", "DIAG_FLAGS_NOBFENCE"][n]
        if n in queue:
            assert "atom.global.add.u32" in prod[n] and "atom.global.add.u32" not in bodies["prod", "DIAG_FLAGS_NOCOUNT"][n], n
            assert "fence.acq_rel.gpu" in prod[n] and "fence.acq_rel.gpu" not in bodies["prod", "DIAG_FLAGS_NOFENCE"][n], n
            # the global add goes, the block's shared count and the group fence stay
            assert ng.count("global.add.u32") < prod[n].count("global.add.u32") and "fence.acq_rel.gpu" in ng, n
            assert nb.count("membar.cta") < prod[n].count("membar.cta") and "fence.acq_rel.gpu" in nb, n
        else:
            assert bodies["prod", "DIAG_FLAGS_NOFENCE"][n] == prod[n] and ng == prod[n] and nb == prod[n], n
    for n in cons:  # the consumer side
        assert bodies["cons", "DIAG_FLAGS_NOREMAP"][n] == cons[n], n
        assert (bodies["cons", "DIAG_FLAGS_NOPM"][n] != cons[n]) == (n in c4), n
        nc = bodies["cons", "DIAG_FLAGS_NOCOUNT"][n]
        assert bodies["cons", "DIAG_FLAGS_NOFENCE"][n] == cons[n], n  # the producer's fence only
        ne = bodies["cons", "DIAG_FLAGS_NOEND"][n]
        npl = bodies["cons", "DIAG_FLAGS_NOPOLL"][n]
        assert bodies["cons", "DIAG_FLAGS_NOGLOBAL"][n] == cons[n] and bodies["cons", "DIAG_FLAGS_NOBFENCE"][n] == cons[n], n
        if n in c4:
            # the poll (and its %globaltimer limit) goes, the end's check (relaxed loads) stays
            assert "griddepcontrol.wait" in npl and "globaltimer" in cons[n] and "globaltimer" not in npl, n
            assert 0 < npl.count("ld.relaxed.gpu") < cons[n].count("ld.relaxed.gpu"), n
            assert "ld.relaxed.gpu" in cons[n] and "ld.relaxed.gpu" not in nc, n
            assert "griddepcontrol.wait" in nc, n
            # kq_flag_end's seen-count goes (its result is used: an atom, not a red; the K-split's
            # own count, kq_gcount, stays, so compare counts, not presence); the poll stays
            assert ne.count("atom.global.add.u32") < cons[n].count("atom.global.add.u32"), n
            assert "ld.relaxed.gpu" in ne, n
        else:
            assert nc == cons[n] and ne == cons[n] and npl == cons[n], n


def test_flags_builds_compile_and_count_only_where_linked():
    """NVRTC: with KQ_FLAGS=1 the queue build's SwiGLU entries that take rows from the queue (and only
    those) gain a global add (the counts), and the group build's _c4 entries (and only those) poll
    counts (ld.relaxed.gpu) with a time limit (%globaltimer) and read x through L2 (ld.global.cg),
    after the poll and a barrier (the x loads are volatile asm: they cannot move above it); the
    builds hold the default's entries; the other entries' memory operations are the default's."""
    from test_kernels_compile import _entry_bodies, _nvrtc, compile_source
    lib = _nvrtc()
    ops_of = lambda t: set(re.findall(r"\b(?:red|atom|membar|fence|ld\.relaxed|ld\.acquire|ld\.global\.cg)[\w.]*", t))
    for base, gained, want in ((("KQ_P2=1", "KQ_BLOCK_WARPS=32", "KQ_DQ=1"), "atom.global.add.u32",
                                kq_flags._QUEUE_PAIR.match),
                               (("KQ_P2=1", "KQ_CSPLIT=1", "KQ_GSPLIT=1"), "ld.relaxed.gpu.global.u32",
                                lambda n: n.endswith("_c4"))):
        plain, flags = [], []
        assert compile_source(lib, "gemv_kq.cu", base, plain)[0] == 0
        rc, log = compile_source(lib, "gemv_kq.cu", base + ("KQ_FLAGS=1",), flags)
        assert rc == 0, log
        a, b = _entry_bodies(plain[0]), _entry_bodies(flags[0])
        assert set(a) == set(b)
        having = {n for n in b if gained in ops_of(b[n]) and gained not in ops_of(a[n])}
        assert having and having == {n for n in b if want(n)}, (gained, sorted(having))
        for n in set(b) - having:
            assert ops_of(b[n]) == ops_of(a[n]), n
        for n in having:
            body = b[n]
            if n.endswith("_c4"):
                assert "%globaltimer" in body
                poll = body.index("ld.relaxed.gpu")
                assert body.index("ld.global.cg") > body.index("bar.sync", poll), n


def _matrix(type_id, rows, K, seed):
    rng = np.random.default_rng(seed)
    raw = random_blocks(type_id, rows * K // get_format(type_id).block_size, rng).reshape(rows, -1)
    return raw, dequantize(raw.reshape(-1), type_id, (rows, K)).astype(np.float64)


@pytest.mark.gpu
def test_linked_pair_is_bitwise_the_unlinked_pair(monkeypatch):
    """The 27B's FFN shapes (an IQ4_XS gate/up pair [17408x5120] with a fused norm, then the Q4_K
    ffn_down [5120x17408] added into a residual): with the pair linked, h is NaN before every
    producer launch, the consumer launched right behind it (PDL) and waiting on counts only; 4
    rounds must give the unlinked pair's residual and h bit for bit (the residual against the
    oracle too), and the counts must be zero after each round (the consumer's last block resets).
    Alone, the producer must leave exactly 1024 in each of the 17 group counts (and nothing in the
    other words), the consumer then reset them, and a consumer with no producer stop after its 1 s
    limit with the error word raised. Then each node timed alone (executor.time_nodes_graph, as
    `harness bench nodes` does) must return and leave the counts at zero: session 32's first step A/B hung there (the consumer
    alone waited for counts no producer wrote) before the timing took unlinked copies."""
    cp = cupy_or_skip()
    q16_or_skip()
    from test_engine_kernels import TYPES, _v9_default_routes
    _v9_default_routes(monkeypatch, ops)
    IQ4, Q4 = TYPES["IQ4_XS"], TYPES["Q4_K"]
    E, F = 5120, 17408
    rng = np.random.default_rng(71)
    keep = []
    (rg, wg), (ru, wu), (rd, wd) = _matrix(IQ4, F, E, 1), _matrix(IQ4, F, E, 2), _matrix(Q4, E, F, 3)
    gd, ud, dd = (device_tensor(cp, n, r, t, k, keep) for n, r, t, k in
                  (("g", rg, IQ4, (E, F)), ("u", ru, IQ4, (E, F)), ("d", rd, Q4, (F, E))))
    nw = rng.uniform(0.5, 1.5, E).astype(np.float32)
    nw_dev = device_tensor(cp, "norm", nw.view(np.uint8).reshape(1, -1), 0, (E,), keep)
    x0 = (rng.normal(size=E) * 0.7).astype(np.float32)
    got = {}
    for on in ("0", "1"):
        monkeypatch.setattr(ops, "GEMV_KQ_FLAGS", on)
        x = cp.asarray(x0)  # the residual: the pair's input and ffn_down's output (add)
        h = nan_poisoned(cp, F)
        g = ops.gemv("ffn_gate_up", "swiglu", [ops.Seg(gd, h), ops.Seg(ud, h)], x, E, nw_dev, 1e-6)
        d = ops.gemv("ffn_down", "add", [ops.Seg(dd, x)], h, F)
        assert "KQ_DQ=1" in g.defines and d.kernel.name.endswith("_c4"), (g.defines, d.kernel.name)
        counts = cp.zeros(32, dtype=cp.uint32)
        assert kq_flags.link([g, d], counts) == (1 if on == "1" else 0)
        hs, xs = [], []
        for _ in range(4):
            h.fill(np.nan)
            g.launch()
            d.launch()
            hs.append(h.get())
            xs.append(x.get())
            assert not counts.get().any(), f"FLAGS={on}: counts left {counts.get()}"
        got[on] = (hs, xs)
        if on == "1":  # each node alone: the producer counts exactly 1024 per group; the consumer
            # then passes, resets them and reports nothing; a consumer alone stops after its time
            # limit (1 s) and raises the error word
            h.fill(np.nan)
            g.launch()
            c = counts.get()
            assert (c[:17] == 1024).all() and not c[17:].any(), c
            d.launch()
            assert not counts.get().any(), counts.get()
            d.launch()
            c = counts.get()
            assert c[kq_flags.ERR] >= 1 and not c[:kq_flags.ERR].any() and c[kq_flags.SEEN] == 0, c
            counts.fill(0)
        if on == "1":  # bench nodes' per-node graph replays run each node alone: unlinked, so no hang
            from backends.engine.executor import Executor
            stream = cp.cuda.Stream(non_blocking=True)
            timed = Executor([g, d], stream).time_nodes_graph(reps=3, samples=2, restore=(x,))
            assert [n.name for n, _, _ in timed] == ["ffn_gate_up", "ffn_down"] and all(us > 0 for _, us, _ in timed)
            assert not counts.get().any(), f"counts after the per-node replays: {counts.get()}"
    for i in range(4):
        assert np.array_equal(got["0"][0][i], got["1"][0][i]), f"round {i}: h differs"
        assert np.array_equal(got["0"][1][i], got["1"][1][i]), f"round {i}: the residual differs"
    # round 0 against the oracle: the pair on the normed x0, ffn_down on the pair's own h
    xn = oops.rms_norm(x0[None].astype(np.float64), nw.astype(np.float64), 1e-6)[0]
    h0 = got["1"][0][0]
    v = gemv_check.check_swiglu(h0.astype(np.float64), wg, wu, xn, impl=ops.GEMV_IMPL)
    assert v["ok"], v
    v = gemv_check.check_store(got["1"][1][0].astype(np.float64) - x0, wd, h0, impl=ops.GEMV_IMPL)
    assert v["ok"], v
    assert re.search(r"_c4$", d.kernel.name)
