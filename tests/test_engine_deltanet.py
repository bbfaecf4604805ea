"""Gated DeltaNet decode kernels (backends/engine/kernels/deltanet.cu, deltanet_ops.py) vs the
float64 oracle (oracles/deltanet.py, wired as oracles/qwen35.py Qwen35Oracle._deltanet).

GPU tests (marked `gpu`, skipped cleanly without CuPy or a device): random float32 inputs,
NaN-poisoned outputs, the conv and delta-rule states carried over several steps, shapes
qwen35-tiny (Hk 2, Hv 4, S 64, K 4) and qwen35-27b (Hk 16, Hv 48, S 128, K 4; the full
float64 oracle costs a few ms per step there, so every head is checked). The step kernel is
fed the conv kernel's own y (also given to the oracle), so each kernel is judged on its own.
CPU tests: the kernel source passes the PDL contract scan, the Python instantiation tables
match the source, shape validation, and a float64 model of the kernel's reformulated row
update (one pass for M k and M q) equals the oracle's recurrence.

Tolerances (u = 2^-24, the fp32 unit roundoff; the oracle sees the same float32 inputs, so
only the kernels' fp32 arithmetic is judged):
  conv: s = sum of K products in an fma chain, |ds| <= K u sum_i |xp_i w_i|; silu(s) =
    s / (1 + expf(-s)) adds <= ~5u relative (expf 2 ulp, add, divide) and passes ds through
    with slope <= 1.1. With K = 4: |dy| <= 4.4u sum|xp w| + 5u |y|; we allow
    8u (sum|xp w| + |y|) (< 2x margin). The conv state is moved, never rounded: exact.
  state, per row j of head h (2-norm; the row update m -> e m (I - beta k k^T) + beta v_j k
    does not grow the 2-norm of an earlier error, since |k| = 1 and 0 < beta < 1): a step
    adds (i) M.k: S/LPR = 4 products per lane then log2(LPR) <= 5 shuffle levels, depth <= 9,
    <= 9u |m_j| (|k| = 1, Cauchy-Schwarz); (ii) k itself: sum of squares over 5 shuffle
    levels + <= 4 partials, sqrt, divide: <= 7u relative per element, another <= 7u |m_j|;
    (iii) gates in fp32: beta <= 3u relative, e = exp(g) relative error <= 3u |g| + 2u and
    |g| e^g <= 1/e, so <= 3u |m_j|; (iv) delta = beta (v - e rk) and the row's fma: <= 3u
    (|v_j| + |m_j|) + 2u |m_j|. In all <= 32u (|m_j| + |v_j|) per step; we allow twice that:
    B_h(t) = sum over steps s <= t of 64u (max_j |M_h,j| + max_j |v_h,j|) (row norms of the
    oracle's state before and after the step, whichever is larger).
  o_j = (e rq + delta kq) / sqrt(S) equals (new row . q) / sqrt(S); its own rounding (rq as
    (i), kq, the fma) is <= 32u (|m_j| + |v_j|), so |do_j| <= (|dM_j| + 32u(...)) / sqrt(S)
    <= B_h / sqrt(S); allowed: tol_o = 2 B_h / sqrt(S).
  out_i = o_i / rms(o) * w_i * silu(z_i): |dout_i| <= |w_i silu(z_i)| tol_o (1/rms + |o_i| /
    rms^2) (the o_i error and the rms error it causes) plus the norm's own rounding: block
    sum of S squares (depth <= 10), sqrt, divide, two multiplies, silu: <= 16u |out_i|.
A wrong head mapping, row, gate or sign moves values by O(|out|) = O(1) here, 10^4 x these
bounds. The state check is run on every step, so a drift shows at the step it starts.
"""
from __future__ import annotations

import math
import re

import numpy as np
import pytest

from oracles import deltanet as dn
from oracles import ops

from gpu_util import cupy_or_skip, nan_poisoned

U = 2.0 ** -24
SHAPES = {"tiny": dict(Hk=2, Hv=4, S=64, K=4), "27b": dict(Hk=16, Hv=48, S=128, K=4)}
EPS = 1e-6  # qwen35 rms epsilon (qwen35-27b GGUF metadata value)


# ------------------------------------------------------------------------ inputs / oracle

class Layer:
    """Random float32 weights of one recurrent layer and float64 oracle states."""

    def __init__(self, Hk, Hv, S, K, seed, state_scale=0.0):
        rng = np.random.default_rng(seed)
        self.Hk, self.Hv, self.S, self.K = Hk, Hv, S, K
        self.C = 2 * Hk * S + Hv * S
        f32 = np.float32
        self.w = rng.normal(0, 0.5, (self.C, K)).astype(f32)           # ssm_conv1d [C, K]
        self.dt_bias = rng.normal(0, 1, Hv).astype(f32)
        self.ssm_a = (-np.exp(rng.normal(0, 0.5, Hv))).astype(f32)     # -exp(A_log)
        self.norm_w = rng.uniform(0.5, 1.5, S).astype(f32)
        self.conv0 = rng.normal(0, 1, (K - 1, self.C)).astype(f32) if state_scale else \
            np.zeros((K - 1, self.C), f32)
        self.state0 = (state_scale * rng.normal(0, 1, (Hv, S, S))).astype(f32)
        self.conv = self.conv0.astype(np.float64)
        self.M = self.state0.astype(np.float64)
        self.B = np.zeros(Hv)  # accumulated state error bound per head (module doc)
        self.rng = rng

    def inputs(self, t):
        """float32 projections of token t: x [C], z [Hv*S], alpha [Hv], beta [Hv]."""
        r, f32 = self.rng, np.float32
        x = r.normal(0, 1, self.C).astype(f32)
        z = r.normal(0, 1, self.Hv * self.S).astype(f32)
        alpha = r.normal(0, 2, self.Hv).astype(f32)
        if t == 1:
            alpha[0] = 25.0  # softplus' linear branch (x > 20) on one head
        beta = r.normal(0, 2, self.Hv).astype(f32)
        return x, z, alpha, beta

    def conv_ref(self, x):
        """(y float64 [C], sum_i |xp_i w_i| [C]); advances the oracle conv state."""
        xp = np.concatenate([self.conv, x[None].astype(np.float64)])
        mag = np.sum(np.abs(xp.T) * np.abs(self.w.astype(np.float64)), axis=1)
        c, self.conv = dn.causal_conv1d(x[None], self.conv, self.w)
        return ops.silu(c)[0], mag

    def step_ref(self, y, z, alpha, beta):
        """Oracle step fed the kernel's y: (out [Hv*S], tol_out [Hv*S]); advances M and B."""
        Hk, Hv, S = self.Hk, self.Hv, self.S
        y = y.astype(np.float64)
        kd = Hk * S
        q = dn.l2_norm(y[:kd].reshape(1, Hk, S), EPS)
        k = dn.l2_norm(y[kd:2 * kd].reshape(1, Hk, S), EPS)
        v = y[2 * kd:].reshape(1, Hv, S)
        g = dn.softplus(alpha.astype(np.float64) + self.dt_bias) * self.ssm_a
        b = dn.sigmoid(beta)
        prev = self.M
        o, self.M = dn.gated_delta_rule(q, k, v, g[None], b[None], prev)
        rown = np.maximum(np.linalg.norm(prev, axis=2).max(axis=1),
                          np.linalg.norm(self.M, axis=2).max(axis=1))
        self.B = self.B + 64 * U * (rown + np.abs(v[0]).max(axis=1))
        zz = z.astype(np.float64).reshape(1, Hv, S)
        out = dn.gated_rms_norm(o, self.norm_w, zz, EPS)[0]  # [Hv, S]
        tol_o = 2 * self.B / math.sqrt(S)                     # [Hv]
        rms = np.sqrt(np.mean(o[0] ** 2, axis=1))             # [Hv]
        assert rms.min() > 0
        ws = np.abs(self.norm_w * zz[0] * dn.sigmoid(zz[0]))  # |w silu(z)| [Hv, S]
        tol = ws * tol_o[:, None] * (1 / rms[:, None] + np.abs(o[0]) / rms[:, None] ** 2) \
            + 16 * U * np.abs(out)
        return out.reshape(-1), tol.reshape(-1)


def _close(got, want, tol, what):
    err = np.abs(got.astype(np.float64) - want)
    bad = ~(err <= tol)  # NaN in got fails
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.size} outside the bound; worst at "
                           f"{int(np.argmax(np.where(bad, err / np.maximum(tol, 1e-300), 0)))}: "
                           f"err {err[bad].max():.3e} tol {tol[bad].min():.3e}")


def _state_check(L, state_gpu, what):
    d = np.linalg.norm(state_gpu.reshape(L.Hv, L.S, L.S).astype(np.float64) - L.M, axis=2)
    bad = ~(d <= L.B[:, None])
    assert not bad.any(), (f"{what}: state rows off in heads {sorted(set(np.nonzero(bad)[0]))}: "
                           f"worst row error {np.nanmax(d):.3e} vs bound {L.B.min():.3e}")


# ------------------------------------------------------------------------ GPU tests

def _device(cp, L):
    """Device buffers of the layer: weights, states, inputs and NaN-poisoned outputs."""
    d = dict(w=cp.asarray(L.w), dt_bias=cp.asarray(L.dt_bias), ssm_a=cp.asarray(L.ssm_a),
             norm_w=cp.asarray(L.norm_w), conv=cp.asarray(L.conv0), state=cp.asarray(L.state0),
             x=cp.zeros(L.C, cp.float32), z=cp.zeros(L.Hv * L.S, cp.float32),
             alpha=cp.zeros(L.Hv, cp.float32), beta=cp.zeros(L.Hv, cp.float32),
             y=nan_poisoned(cp, L.C), out=nan_poisoned(cp, L.Hv * L.S))
    return d


def _nodes(d, L, rows):
    from backends.engine import deltanet_ops as G
    conv = G.conv_step("conv", d["x"], d["conv"], d["w"], d["y"], C=L.C, K=L.K)
    step = G.gdn_step("gdn", d["y"], d["z"], d["alpha"], d["beta"], d["dt_bias"], d["ssm_a"],
                      d["norm_w"], d["state"], d["out"], Hk=L.Hk, Hv=L.Hv, S=L.S, eps=EPS,
                      rows=rows)
    return conv, step


def _run_steps(cp, L, d, run, steps, what, conv_state=None):
    """Feed `steps` random tokens; run() launches the two nodes; check every step. conv_state:
    a function giving the conv state as conv_step keeps it ([K-1, C], oldest first), default
    d["conv"] itself."""
    conv_state = conv_state or (lambda: d["conv"].get())
    for t in range(steps):
        x, z, alpha, beta = L.inputs(t)
        for key, val in (("x", x), ("z", z), ("alpha", alpha), ("beta", beta)):
            d[key].set(val)
        d["y"].fill(np.nan)
        d["out"].fill(np.nan)
        cp.cuda.get_current_stream().synchronize()
        run()
        cp.cuda.get_current_stream().synchronize()
        y = d["y"].get()
        y_ref, mag = L.conv_ref(x)
        _close(y, y_ref, 8 * U * (mag + np.abs(y_ref)), f"{what} step {t}: conv y")
        assert np.array_equal(conv_state().astype(np.float64), L.conv), f"{what} step {t}: conv state"
        out_ref, tol = L.step_ref(y, z, alpha, beta)
        _close(d["out"].get(), out_ref, tol, f"{what} step {t}: out")
        _state_check(L, d["state"].get(), f"{what} step {t}")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("rows", ["default", "all"])
@pytest.mark.parametrize("state_scale", [0.0, 0.3])
def test_deltanet_steps_vs_oracle(shape, rows, state_scale):
    cp = cupy_or_skip()
    from backends.engine import deltanet_ops as G
    p = SHAPES[shape]
    r = G.DEFAULT_ROWS if rows == "default" else max(G.STEP_ROWS[p["S"]])
    seed = 100 * list(SHAPES).index(shape) + 10 * (rows == "all") + int(state_scale > 0)
    L = Layer(**p, seed=seed, state_scale=state_scale)
    d = _device(cp, L)
    conv, step = _nodes(d, L, r)

    def run():
        conv.launch()
        step.launch()
    _run_steps(cp, L, d, run, 8, f"{shape} rows={r} state0={state_scale}")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(SHAPES))
def test_deltanet_graph_replay_carries_state(shape):
    """The two nodes captured once into a CUDA graph (executor.Executor, PDL launches when
    available) and replayed per token with new inputs in the same buffers: the in-place
    state updates advance one token per replay."""
    cp = cupy_or_skip()
    from backends.engine import deltanet_ops as G
    from backends.engine.executor import Executor
    L = Layer(**SHAPES[shape], seed=5, state_scale=0.3)
    d = _device(cp, L)
    stream = cp.cuda.Stream(non_blocking=True)
    ex = Executor(list(_nodes(d, L, G.DEFAULT_ROWS)), stream)
    with stream:
        _run_steps(cp, L, d, ex.replay, 6, f"{shape} graph")


@pytest.mark.gpu
def test_deltanet_weights_as_device_tensors():
    """Weights from the arena (F32 DeviceTensor, GGUF ne) give the same bits as arrays."""
    cp = cupy_or_skip()
    from backends.engine import deltanet_ops as G
    from gpu_util import device_tensor
    L = Layer(**SHAPES["tiny"], seed=9, state_scale=0.3)
    outs = []
    for as_tensor in (False, True):
        d, keep = _device(cp, L), []
        if as_tensor:
            for key, ne in (("w", (L.K, L.C)), ("dt_bias", (L.Hv,)), ("ssm_a", (L.Hv,)),
                            ("norm_w", (L.S,))):
                raw = getattr(L, key).view(np.uint8).reshape(-1, 4 * ne[0])
                d[key] = device_tensor(cp, key, raw, 0, ne, keep)
        x, z, alpha, beta = Layer(**SHAPES["tiny"], seed=10).inputs(0)
        for key, val in (("x", x), ("z", z), ("alpha", alpha), ("beta", beta)):
            d[key].set(val)
        for n in _nodes(d, L, G.DEFAULT_ROWS):
            n.launch()
        outs.append((d["out"].get(), d["state"].get(), d["conv"].get()))
    for a, b in zip(*outs):
        assert np.array_equal(a, b)


# ------------------------------------------------------------------------ CPU tests

def _kernel_model(m, k, q, v, g, beta):
    """float64 model of one head's row loop in kernels/deltanet.cu (section C): one pass for
    rk = M_j . k and rq = M_j . q over the OLD row, then delta, the new row and
    o_j = (e rq + delta (k . q)) / sqrt(S). m [S, S] (rows j), k, q, v [S]."""
    S = m.shape[0]
    e = math.exp(g)
    rk, rq, kq = m @ k, m @ q, float(k @ q)
    delta = beta * (v - e * rk)
    return (e * rq + delta * kq) / math.sqrt(S), e * m + delta[:, None] * k[None, :]


def test_kernel_row_reformulation_equals_oracle():
    rng = np.random.default_rng(3)
    Hk, Hv, S, n = 2, 4, 16, 5
    M = rng.normal(size=(Hv, S, S))
    m_model = M.copy()
    for _ in range(n):
        q = dn.l2_norm(rng.normal(size=(1, Hk, S)), EPS)
        k = dn.l2_norm(rng.normal(size=(1, Hk, S)), EPS)
        v = rng.normal(size=(1, Hv, S))
        g = -dn.softplus(rng.normal(size=(1, Hv)))
        b = dn.sigmoid(rng.normal(size=(1, Hv)))
        o, M = dn.gated_delta_rule(q, k, v, g, b, M)
        for h in range(Hv):
            om, m_model[h] = _kernel_model(m_model[h], k[0, h % Hk], q[0, h % Hk], v[0, h],
                                           float(g[0, h]), float(b[0, h]))
            assert np.allclose(om, o[0, h], rtol=1e-12, atol=1e-12)
        assert np.allclose(m_model, M, rtol=1e-12, atol=1e-12)


def test_deltanet_kernels_pass_the_pdl_contract_scan():
    from test_pdl_contract import _engine_sources, kernels_missing_wait
    src = _engine_sources()
    text = src["deltanet.cu"]
    assert kernels_missing_wait(src) == []
    headers = {n: t for n, t in src.items() if n.endswith(".cuh")}
    # the scan does see each kernel: without the wait in its body, exactly its kernels fail
    for body, prefix in (("gdn_conv_body", "gdn_conv_step_"), ("gdn_step_body", "gdn_step_s")):
        broken = re.sub(r"(void " + body + r"\(.*?)pdl_wait\(\);", r"\1", text, count=1, flags=re.S)
        assert broken != text
        missing = kernels_missing_wait({"deltanet.cu": broken, **headers})
        assert missing and all(m.startswith(prefix) for m in missing), missing


def test_instantiation_tables_match_the_source():
    from backends.engine import deltanet_ops as G
    from backends.engine.module import KERNEL_DIR
    text = (KERNEL_DIR / "deltanet.cu").read_text()
    steps = re.findall(r"^GDN_STEP_KERNEL\((\d+), (\d+)\)", text, flags=re.M)
    table: dict[int, list[int]] = {}
    for s, r in steps:
        table.setdefault(int(s), []).append(int(r))
    assert {s: tuple(r) for s, r in table.items()} == G.STEP_ROWS
    for s in G.STEP_ROWS:
        assert G.DEFAULT_ROWS in G.STEP_ROWS[s]
    convs = tuple(int(k) for k in re.findall(r"^GDN_CONV_KERNEL\((\d+)\)", text, flags=re.M))
    assert convs == G.CONV_WIDTHS
    assert f"#define GDN_CONV_THREADS {G.CONV_THREADS}" in text
    assert "__launch_bounds__(S * 4)" in text and G.step_threads(128) == 512


def _cpu_args(Hk=2, Hv=4, S=64, K=4):
    C, f = 2 * Hk * S + Hv * S, np.float32
    conv = dict(x=np.zeros(C, f), conv_state=np.zeros((K - 1, C), f), w=np.zeros((C, K), f),
                y=np.zeros(C, f))
    step = dict(y=np.zeros(C, f), z=np.zeros(Hv * S, f), alpha=np.zeros(Hv, f),
                beta=np.zeros(Hv, f), dt_bias=np.zeros(Hv, f), ssm_a=np.zeros(Hv, f),
                norm_w=np.zeros(S, f), state=np.zeros((Hv, S, S), f), out=np.zeros(Hv * S, f))
    return C, conv, step


def test_shape_validation_without_cupy():
    from backends.engine import deltanet_ops as G
    from backends.engine.arena import DeviceTensor
    Hk, Hv, S, K = 2, 4, 64, 4
    C, conv, step = _cpu_args(Hk, Hv, S, K)
    G.check_conv_step(**conv, C=C, K=K)
    G.check_gdn_step(**step, Hk=Hk, Hv=Hv, S=S)
    G.check_gdn_step(**step, Hk=Hk, Hv=Hv, S=S, rows=4)
    bad_conv = [dict(x=np.zeros(C - 1, np.float32)), dict(conv_state=np.zeros((K, C), np.float32)),
                dict(w=np.zeros((C, K), np.float64)), dict(y=np.zeros(C + 1, np.float32)),
                dict(w=np.zeros((K, C + 1), np.float32)),
                dict(w=DeviceTensor("w", 256, 1, (K, C), 2 * K, 2 * K * C)),     # F16
                dict(w=DeviceTensor("w", 256, 0, (C, K), 4 * C, 4 * K * C)),     # ne swapped
                dict(w=DeviceTensor("w", 260, 0, (K, C), 4 * K, 4 * K * C)),     # misaligned
                dict(x=np.zeros((2 * C,), np.float32)[::2])]
    for change in bad_conv:
        with pytest.raises(ValueError):
            G.check_conv_step(**(conv | change), C=C, K=K)
        with pytest.raises(ValueError):  # the node builder validates before any CuPy use
            G.conv_step("c", **(conv | change), C=C, K=K)
    G.check_conv_step(**(conv | dict(w=DeviceTensor("w", 256, 0, (K, C), 4 * K, 4 * K * C))), C=C, K=K)
    with pytest.raises(ValueError):
        G.check_conv_step(**conv, C=C, K=3)
    f = np.float32
    bad_step = [dict(y=np.zeros(C + S, f)), dict(z=np.zeros(Hv * S - 1, f)),
                dict(alpha=np.zeros(Hv + 1, f)), dict(beta=np.zeros(Hk, f)),
                dict(dt_bias=np.zeros(Hv, np.float64)), dict(ssm_a=np.zeros(Hv + 1, f)),
                dict(norm_w=np.zeros(2 * S, f)), dict(state=np.zeros((Hk, S, S), f)),
                dict(out=np.zeros(C, f)),
                dict(norm_w=DeviceTensor("n", 256, 0, (Hv,), 4 * Hv, 4 * Hv))]
    for change in bad_step:
        with pytest.raises(ValueError):
            G.check_gdn_step(**(step | change), Hk=Hk, Hv=Hv, S=S)
        with pytest.raises(ValueError):
            G.gdn_step("g", **(step | change), Hk=Hk, Hv=Hv, S=S, eps=EPS)
    for kw in (dict(Hk=3, Hv=4, S=S), dict(Hk=Hk, Hv=Hv, S=96), dict(Hk=Hk, Hv=Hv, S=S, rows=8),
               dict(Hk=0, Hv=Hv, S=S)):
        with pytest.raises(ValueError):
            G.check_gdn_step(**step, **kw)
    # the 27B widths validate
    C27, conv27, step27 = _cpu_args(16, 48, 128, 4)
    G.check_conv_step(**conv27, C=C27, K=4)
    G.check_gdn_step(**step27, Hk=16, Hv=48, S=128, rows=8)


def _emulate_fp32(L, conv, M, x, z, alpha, beta, key_head=lambda h, Hk, Hv: h % Hk):
    """The two kernels' arithmetic in numpy float32 (sums in numpy's order, not the kernels'
    shuffle trees; same rounding magnitude): (y, new conv state, out); M updated in place."""
    f = np.float32
    silu32 = lambda v: (v / (f(1) + np.exp(-v))).astype(f)  # noqa: E731
    xp = np.concatenate([conv, x[None]])
    acc = np.zeros(L.C, f)
    for i in range(L.K):
        acc = (acc + xp[i] * L.w[:, i]).astype(f)
    y = silu32(acc)
    Hk, Hv, S, kd = L.Hk, L.Hv, L.S, L.Hk * L.S
    out = np.empty(Hv * S, f)
    for h in range(Hv):
        hk = key_head(h, Hk, Hv)
        q, k = y[hk * S:(hk + 1) * S], y[kd + hk * S:kd + (hk + 1) * S]
        v = y[2 * kd + h * S:2 * kd + (h + 1) * S]
        q = q / np.sqrt(np.sum(q * q, dtype=f) + f(EPS))
        k = k / np.sqrt(np.sum(k * k, dtype=f) + f(EPS))
        xa = f(alpha[h] + L.dt_bias[h])
        e = f(np.exp(f((xa if xa > 20 else f(np.log1p(np.exp(xa)))) * L.ssm_a[h])))
        b = f(1) / (f(1) + np.exp(-beta[h]))
        m = M[h]
        rk, rq, kq = (m @ k).astype(f), (m @ q).astype(f), f(k @ q)
        delta = (b * (v - e * rk)).astype(f)
        M[h] = (e * m + delta[:, None] * k[None, :]).astype(f)
        o = ((e * rq + delta * kq) * f(1 / math.sqrt(S))).astype(f)
        ms = f(np.sum(o * o, dtype=f) / S)
        out[h * S:(h + 1) * S] = o / np.sqrt(ms + f(EPS)) * L.norm_w * silu32(z[h * S:(h + 1) * S])
    return y, xp[1:].copy(), out


@pytest.mark.parametrize("shape", list(SHAPES))
def test_fp32_emulation_meets_the_bounds_and_a_wrong_mapping_does_not(shape):
    """The GPU tests' bounds (module doc) hold for fp32 arithmetic with a wide margin (the
    emulation stays under 5 % of every bound over 8 steps), and a wrong key-head mapping
    (h // (Hv/Hk) instead of ggml's tiled h % Hk) fails them at the first step."""
    for mapping, ok in ((lambda h, Hk, Hv: h % Hk, True), (lambda h, Hk, Hv: h // (Hv // Hk), False)):
        L = Layer(**SHAPES[shape], seed=3, state_scale=0.3)
        conv, M = L.conv0.copy(), L.state0.copy()
        worst = 0.0
        for t in range(8 if ok else 1):
            x, z, alpha, beta = L.inputs(t)
            y, conv, out = _emulate_fp32(L, conv, M, x, z, alpha, beta, mapping)
            y_ref, mag = L.conv_ref(x)
            _close(y, y_ref, 8 * U * (mag + np.abs(y_ref)), "conv y")
            assert np.array_equal(conv.astype(np.float64), L.conv)
            out_ref, tol = L.step_ref(y, z, alpha, beta)
            if not ok:
                with pytest.raises(AssertionError):
                    _close(out, out_ref, tol, "out")
                break
            _close(out, out_ref, tol, f"step {t}: out")
            _state_check(L, M, f"step {t}")
            d = np.linalg.norm(M.astype(np.float64) - L.M, axis=2)
            worst = max(worst, float((d / L.B[:, None]).max()), float((np.abs(out - out_ref) / tol).max()))
        if ok:
            assert worst < 0.05, worst


def test_gdn_csplit_routing(monkeypatch):
    """GGUF_HARNESS_GDN_CSPLIT=1: the S = 128 step runs gdn_step_cs4_s128 on a grid of 4 Hv blocks
    (a cluster of 4 per head: __cluster_dims__(4) in the source), S = 64 and the switch off keep
    gdn_step_s<S>_r<rows> on Hv blocks; another value is refused before any kernel is asked for."""
    from types import SimpleNamespace as NS
    from backends.engine import deltanet_ops as G
    from backends.engine.module import KERNEL_DIR
    asked = []
    monkeypatch.setattr(G, "kernel", lambda name: asked.append(name) or NS(name=name))
    monkeypatch.setattr(G, "_arg", lambda t: t)
    monkeypatch.setattr(G, "GDN_EARLY", "0")  # the cluster step's plain build (EARLY: its own test)
    for (Hk, Hv, S), on, want, grid in (((16, 48, 128), "1", "gdn_step_cs4_s128", 4 * 48),
                                        ((16, 48, 128), "", "gdn_step_cs4_s128", 4 * 48),  # "": the default
                                        ((16, 48, 128), "0", "gdn_step_s128_r2", 48),
                                        ((2, 4, 64), "1", "gdn_step_s64_r2", 4)):
        monkeypatch.setattr(G, "GDN_CSPLIT", on)
        _, _, step = _cpu_args(Hk, Hv, S, 4)
        n = G.gdn_step("g", **step, Hk=Hk, Hv=Hv, S=S, eps=EPS)
        assert (n.kernel.name, n.grid, n.block) == (want, (grid,), (4 * S,))
    text = (KERNEL_DIR / "deltanet.cu").read_text()
    assert re.search(r"__cluster_dims__\(4, 1, 1\)[^\n]*gdn_step_cs4_s128\(", text) and G.GDN_CS == 4
    monkeypatch.setattr(G, "GDN_CSPLIT", "2")
    n_asked = len(asked)
    with pytest.raises(ValueError, match="GGUF_HARNESS_GDN_CSPLIT"):
        G.gdn_step("g", **_cpu_args(16, 48, 128, 4)[2], Hk=16, Hv=48, S=128, eps=EPS)
    assert len(asked) == n_asked


@pytest.mark.gpu
def test_gdn_csplit_is_bitwise_equal_to_the_step_kernel(monkeypatch):
    """gdn_step_cs4_s128 (GGUF_HARNESS_GDN_CSPLIT=1, kernels/deltanet.cu 3.) computes every row as
    gdn_step_s128 does and adds the mean square's warp partials in block_sum's order, so over 6
    tokens at the 27B widths from a random state its outputs and the state must equal the default
    kernel's bit for bit; both also against the oracle (_run_steps' checks)."""
    cp = cupy_or_skip()
    from backends.engine import deltanet_ops as G
    got = {}
    monkeypatch.setattr(G, "GDN_EARLY", "0")  # the plain cluster build (EARLY's: the test below)
    for on in ("0", "1"):
        monkeypatch.setattr(G, "GDN_CSPLIT", on)
        L = Layer(**SHAPES["27b"], seed=77, state_scale=0.3)
        d = _device(cp, L)
        conv, step = _nodes(d, L, G.DEFAULT_ROWS)
        assert step.kernel.name == ("gdn_step_cs4_s128" if on == "1" else "gdn_step_s128_r2")
        outs = []

        def run():
            conv.launch()
            step.launch()
            outs.append((d["out"].get(), d["state"].get()))
        _run_steps(cp, L, d, run, 6, f"27b GDN_CSPLIT={on}")
        got[on] = outs
    for t, ((o0, s0), (o1, s1)) in enumerate(zip(got["0"], got["1"])):
        assert np.array_equal(o0, o1), f"token {t}: out differs"
        assert np.array_equal(s0, s1), f"token {t}: state differs"


def _ring_node(cp, G, d, L, p0):
    """gdn_conv_step on d's buffers with the conv state d["conv"] laid out as the ring at position
    p0: slots (p0 + 1 + i) % K hold conv state row i, slot p0 % K (never read at p0) NaN.
    Returns (node, ring, step state)."""
    K = L.K
    ring = cp.full((K, L.C), np.nan, cp.float32)
    for i in range(K - 1):
        ring[(p0 + 1 + i) % K] = cp.asarray(L.conv0[i])
    st = cp.asarray(np.array([0, p0, 0, 0], np.int32))
    node = G.gdn_conv_step("gdn", d["x"], ring, d["w"], d["y"], d["z"], d["alpha"], d["beta"],
                           d["dt_bias"], d["ssm_a"], d["norm_w"], d["state"], d["out"], st,
                           Hk=L.Hk, Hv=L.Hv, S=L.S, eps=EPS, K=K)
    return node, ring, st


@pytest.mark.gpu
def test_gdn_early_and_conv_builds_are_bitwise_equal_to_the_cluster_step(monkeypatch):
    """GGUF_HARNESS_GDN_EARLY=1 (state rows in registers before the PDL wait, z early) and
    GGUF_HARNESS_GDN_CONV=1 (the conv inside the step, its state a ring of K slots indexed by the
    position; kernels/deltanet.cu 3.) change when values are loaded, not how they are computed:
    over 6 tokens at the 27B widths from a random delta-rule and conv state, starting at position
    5 so the ring wraps, out, the state, y and the conv state (the ring read oldest first) must
    equal gdn_step_cs4_s128's and conv_step's bit for bit, and each step passes the oracle checks
    of _run_steps. The ring's unread slot starts as NaN: a read of the wrong slot fails."""
    cp = cupy_or_skip()
    from backends.engine import deltanet_ops as G
    p0, steps = 5, 6
    got = {}
    for early, conv in (("0", "0"), ("1", "0"), ("0", "1"), ("1", "1")):
        monkeypatch.setattr(G, "GDN_EARLY", early)
        monkeypatch.setattr(G, "GDN_CONV", conv)
        L = Layer(**SHAPES["27b"], seed=78, state_scale=0.3)
        d = _device(cp, L)
        outs, pos = [], [p0]
        if conv == "1":
            node, ring, st = _ring_node(cp, G, d, L, p0)
            assert node.kernel.name == "gdn_convstep_cs4_s128" + ("_e" if early == "1" else "")

            def ordered():  # what the step at position pos[0] (the next) reads: slots (pos[0] + 1 + i) % K
                r = ring.get()
                return np.stack([r[(pos[0] + 1 + i) % L.K] for i in range(L.K - 1)])

            def run():
                st[1] = pos[0]
                node.launch()
                pos[0] += 1
                outs.append((d["out"].get(), d["state"].get(), d["y"].get(), ordered()))
            _run_steps(cp, L, d, run, steps, f"27b EARLY={early} CONV={conv}", conv_state=ordered)
        else:
            cnode, step = _nodes(d, L, G.DEFAULT_ROWS)
            assert step.kernel.name == "gdn_step_cs4_s128" + ("_e" if early == "1" else "")

            def run():
                cnode.launch()
                step.launch()
                outs.append((d["out"].get(), d["state"].get(), d["y"].get(), d["conv"].get()))
            _run_steps(cp, L, d, run, steps, f"27b EARLY={early} CONV={conv}")
        got[early, conv] = outs
    for key, outs in got.items():
        for t, (a, b) in enumerate(zip(got["0", "0"], outs)):
            for what, x, y in zip(("out", "state", "y", "conv state"), a, b):
                assert np.array_equal(x, y), f"EARLY, CONV = {key}: token {t}: {what} differs"


def test_gdn_early_and_conv_routing(monkeypatch):
    """GGUF_HARNESS_GDN_EARLY / _CONV (deltanet_ops): the cluster step's _e build (EARLY on or "", the
    default; 0 the plain build; ignored with GDN_CSPLIT=0); the conv in the
    step only at S = 128, K = 4 with the cluster step (conv_in_step), its node's kernel, grid and
    argument order (x, ring, w, y, step state, C, then gdn_step's); the ring must be [K, C] and
    the step state int32; bad values and CONV=1 with CSPLIT=0 are refused."""
    from types import SimpleNamespace as NS
    from backends.engine import deltanet_ops as G
    monkeypatch.setattr(G, "kernel", lambda name: NS(name=name))
    monkeypatch.setattr(G, "_arg", lambda t: t)
    Hk, Hv, S, K = 16, 48, 128, 4
    C, conv, step = _cpu_args(Hk, Hv, S, K)
    ring, st = np.zeros((K, C), np.float32), np.zeros(4, np.int32)
    monkeypatch.setattr(G, "GDN_CSPLIT", "1")  # not the environment's values
    monkeypatch.setattr(G, "GDN_CONV", "0")
    for early, name in (("1", "gdn_step_cs4_s128_e"), ("", "gdn_step_cs4_s128_e"), ("0", "gdn_step_cs4_s128")):
        monkeypatch.setattr(G, "GDN_EARLY", early)
        assert G.gdn_step("g", **step, Hk=Hk, Hv=Hv, S=S, eps=EPS).kernel.name == name
    monkeypatch.setattr(G, "GDN_EARLY", "1")
    small = _cpu_args(2, 4, 64, 4)[2]
    assert G.gdn_step("g", **small, Hk=2, Hv=4, S=64, eps=EPS).kernel.name == "gdn_step_s64_r2"
    assert not G.conv_in_step(S, K)
    monkeypatch.setattr(G, "GDN_CONV", "1")
    assert G.conv_in_step(128, 4) and not G.conv_in_step(64, 4) and not G.conv_in_step(128, 3)
    for early, name in (("0", "gdn_convstep_cs4_s128"), ("1", "gdn_convstep_cs4_s128_e"), ("", "gdn_convstep_cs4_s128_e")):
        monkeypatch.setattr(G, "GDN_EARLY", early)
        n = G.gdn_conv_step("g", conv["x"], ring, conv["w"], step["y"], step["z"], step["alpha"],
                            step["beta"], step["dt_bias"], step["ssm_a"], step["norm_w"], step["state"],
                            step["out"], st, Hk=Hk, Hv=Hv, S=S, eps=EPS)
        assert (n.kernel.name, n.grid, n.block) == (name, (4 * Hv,), (4 * S,))
        assert n.args[0] is conv["x"] and n.args[1] is ring and n.args[3] is step["y"] and n.args[4] is st
        assert int(n.args[5]) == C and n.args[6] is step["z"] and int(n.args[-2]) == Hk
    args = lambda **ch: {**dict(x=conv["x"], ring=ring, w=conv["w"], step_state=st), **{k: step[k] for k in  # noqa: E731
                         ("y", "z", "alpha", "beta", "dt_bias", "ssm_a", "norm_w", "state", "out")}, **ch}
    for change, msg in ((dict(ring=np.zeros((K - 1, C), np.float32)), r"conv state \[4, C"),
                        (dict(step_state=np.zeros(4, np.int64)), "step state"),
                        (dict(step_state=np.zeros(1, np.int32)), "step state"),
                        (dict(x=np.zeros(C - 1, np.float32)), "conv x")):
        with pytest.raises(ValueError, match=msg):
            G.gdn_conv_step("g", **args(**change), Hk=Hk, Hv=Hv, S=S, eps=EPS)
    small_args = {**args(), **{k: v for k, v in _cpu_args(2, 4, 64, 4)[2].items()}}
    small_c = 2 * 2 * 64 + 4 * 64
    small_args.update(x=np.zeros(small_c, np.float32), w=np.zeros((small_c, 4), np.float32),
                      ring=np.zeros((4, small_c), np.float32))
    with pytest.raises(ValueError, match="needs S = 128"):
        G.gdn_conv_step("g", **small_args, Hk=2, Hv=4, S=64, eps=EPS)
    for attr, bad in (("GDN_EARLY", "2"), ("GDN_CONV", "yes")):
        with monkeypatch.context() as m:
            m.setattr(G, attr, bad)
            with pytest.raises(ValueError, match="GGUF_HARNESS_" + attr + "="):
                G.check_switches()
    monkeypatch.setattr(G, "GDN_CSPLIT", "0")
    with pytest.raises(ValueError, match="GDN_CSPLIT=0"):
        G.check_switches()
    monkeypatch.setattr(G, "GDN_CONV", "0")
    G.check_switches()  # EARLY on (the default) with CSPLIT=0: ignored, the one-block step
    assert G.gdn_step("g", **step, Hk=Hk, Hv=Hv, S=S, eps=EPS).kernel.name == "gdn_step_s128_r2"


def test_cluster_step_kernels_pass_the_pdl_contract_scan():
    """The cluster step's body (gdn_step_cs_body) carries the wait of all four of its kernels: without
    it the scan flags exactly gdn_step_cs4_s128[_e] and gdn_convstep_cs4_s128[_e] (one macro)."""
    from test_pdl_contract import _engine_sources, kernels_missing_wait
    src = _engine_sources()
    text = src["deltanet.cu"]
    headers = {n: t for n, t in src.items() if n.endswith(".cuh")}
    broken = re.sub(r"(void gdn_step_cs_body\(.*?)pdl_wait\(\);", r"\1", text, count=1, flags=re.S)
    assert broken != text
    missing = sorted(kernels_missing_wait({"deltanet.cu": broken, **headers}))
    # the two conv kernels come from one macro, named by its pattern
    assert missing == ["gdn_convstep_cs4_s128##SUFFIX", "gdn_step_cs4_s128", "gdn_step_cs4_s128_e"], missing


def test_empty_gdn_switches_read_as_their_defaults():
    """GGUF_HARNESS_GDN_EARLY= / GGUF_HARNESS_GDN_CONV= (set but empty) run the defaults, and the
    module variables that results record (switches.effective) say so: "1" and "0", not "" (an empty
    record made `harness ab` print a switch change between two runs of one build)."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, GGUF_HARNESS_GDN_EARLY="", GGUF_HARNESS_GDN_CONV="")
    code = ("from backends.engine import deltanet_ops as G, switches as W; e = W.effective(); "
            "print(G.GDN_EARLY, G.GDN_CONV, e['GGUF_HARNESS_GDN_EARLY'], e['GGUF_HARNESS_GDN_CONV'])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "0", "1", "0"], out
