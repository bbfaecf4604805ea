"""Speculative (draft-verified) reference run (harness.speculative) against the sequential
greedy run (harness.verify.run_reference) of the float64 oracle on the tiny synthetic models.

What must hold for any draft: the same ids as the sequential run, every position's logits
equal up to float64 summation order (bound below), and a pass count that follows from the
draft's quality (one pass for a perfect draft; one per rejected draft token otherwise).
The expected ids come from the sequential run, never from the code under test.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from backends.oracle import OracleBackend
from harness import metrics
from harness.cli import main
from harness.config import ModelRef, ProtocolConfig, RunConfig
from harness.errors import BackendCrash, ConfigError
from harness.run import verify_model
from harness.speculative import backend_draft, run_reference_speculative
from harness.verify import run_reference

PROMPT = [5, 17, 200, 33, 9]
N = 40  # generated ids on qwen2-tiny
N35 = 16  # generated ids on qwen35-tiny (its DeltaNet loop is slower per token)
CTX = 96
U = 2.0 ** -53  # float64 unit roundoff


def gamma(k: int) -> float:
    """Higham's gamma_k = k u / (1 - k u): |fl(sum of k terms) - sum| <= gamma_k * sum|terms|
    for any order of summation (Accuracy and Stability of Numerical Algorithms, 2nd ed.,
    eq. 3.4 / Lemma 3.1)."""
    return k * U / (1 - k * U)


def order_bound(n_stages: int, k_max: int, head_scale: float) -> float:
    """Bound on |batched - sequential| of a logit when only the summation order differs.

    Each of the two runs is within gamma_k * sum|terms| of the exact value at every
    reduction, so they differ by at most 2 gamma_k sum|terms| there; to first order the
    relative differences of the n_stages chained reductions (matrix products, norms,
    attention sums) add up, with the network's gain per stage taken as 1 (RMS norm before
    each block). k_max is the longest reduction; head_scale = max over positions and vocab
    of sum_j |W_out[v, j] h_j| (>= |logit|), the scale of the last reduction. gamma_k is the
    worst case, linear in k; real rounding errors grow like sqrt(k), which leaves room for
    gains above 1 in the earlier stages."""
    return 2 * n_stages * gamma(k_max) * head_scale


class Setup:
    """A loaded oracle, its sequential run and the bound for this model."""

    def __init__(self, path, n_predict: int):
        self.norms: list[np.ndarray] = []
        self.backend = OracleBackend(capture=self._capture)
        self.backend.load(ModelRef(path.stem, path), RunConfig(n_ctx=CTX))
        self.n = n_predict
        self.seq, self.logits = run_reference(self.backend, "oracle", PROMPT, n_predict, CTX)
        self.backend.capture = None
        o = self.backend._oracle
        w = np.abs(o.weights.get(o._out_name).astype(np.float64))  # [n_vocab, d]
        scale = float((np.abs(np.concatenate(self.norms)) @ w.T).max())
        p = o.params
        if hasattr(p, "recurrent"):  # qwen35: DeltaNet / gated attention + FFN, <= 12 stages
            stages, k = 12 * p.n_layer + 2, max(p.n_embd, p.n_ff, 2 * p.ssm_n_group * p.ssm_d_state
                                                 + p.ssm_dt_rank * p.ssm_d_state, CTX)
        else:  # qwen2: attn norm, qkv, q.k, softmax sum, p.v, wo, ffn norm, gate/up, down
            stages, k = 9 * p.n_layer + 2, max(p.n_embd, p.n_ff, p.n_head * p.head_dim, CTX)
        self.bound = order_bound(stages, k, scale)
        self.n_vocab = self.backend.n_vocab

    def _capture(self, name, il, arr):
        if name == "result_norm":
            self.norms.append(np.array(arr, dtype=np.float64).reshape(-1, arr.shape[-1]))

    def right(self, prefix, n):
        """The perfect draft: the sequential ids that follow prefix."""
        return self.seq.ids[len(prefix):len(prefix) + n]

    def wrong(self, prefix, n):
        """A draft wrong at every position."""
        return [(t + 1) % self.n_vocab for t in self.right(prefix, n)]

    def run(self, draft, **kw):
        return run_reference_speculative(self.backend, "oracle", PROMPT, self.n, CTX, draft, **kw)

    def check_same(self, trace, logits):
        assert trace.ids == self.seq.ids
        assert logits.shape == self.logits.shape
        diff = float(np.abs(logits - self.logits).max())
        assert diff <= self.bound, f"max |batched - sequential| {diff:.3g} > bound {self.bound:.3g}"
        st = trace.speculative
        # every pass adds exactly one id that is not an accepted draft token
        assert st["used"] and st["accepted"] + st["passes"] == self.n
        assert [s["i"] for s in trace.steps] == list(range(self.n))
        assert [s["token"] for s in trace.steps] == trace.ids
        assert [s["logits_sha256"] for s in trace.steps] == \
            [metrics.logits_sha256(r.astype(np.float32)) for r in logits]
        return diff


@pytest.fixture(scope="module")
def q2(tiny_qwen2_f32):
    s = Setup(tiny_qwen2_f32, N)
    assert len(set(s.seq.ids)) > 5, "degenerate greedy output: the drafts below prove nothing"
    return s


@pytest.fixture(scope="module")
def q35(tiny_qwen35_f32):
    return Setup(tiny_qwen35_f32, N35)


def test_bound_is_tight_enough_to_mean_something(q2):
    """The bound must stay far below any logic error (a wrong row or a stale KV row moves
    logits by O(0.1-1)), and the sequential run's logits are not all alike."""
    assert q2.bound < 1e-9
    assert np.abs(np.diff(q2.logits, axis=0)).max() > 1e-3


def test_perfect_draft_the_oracle_itself_needs_one_pass(q2, tiny_qwen2_f32):
    other = OracleBackend()
    other.load(ModelRef("draft", tiny_qwen2_f32), RunConfig(n_ctx=CTX))
    trace, logits = q2.run(backend_draft(other, PROMPT), draft_name="oracle")
    q2.check_same(trace, logits)
    st = trace.speculative
    assert (st["passes"], st["accepted"], st["draft_calls"]) == (1, N - 1, 1)
    assert st["fed_tokens"] == len(PROMPT) + N - 1 and st["draft_error"] is None


def test_draft_right_for_five_then_wrong(q2):
    def draft(prefix, n):
        d = q2.right(prefix, n)
        return d[:5] + [(t + 1) % q2.n_vocab for t in d[5:]]
    trace, logits = q2.run(draft)
    q2.check_same(trace, logits)
    # each pass: 5 accepted draft tokens + the reference's own correction (last pass: rest)
    assert trace.speculative["passes"] == math.ceil(N / 6)


def test_always_wrong_draft_costs_one_pass_per_id(q2):
    trace, logits = q2.run(q2.wrong)
    q2.check_same(trace, logits)
    assert (trace.speculative["passes"], trace.speculative["accepted"]) == (N, 0)


def test_max_draft_limits_the_pass_length(q2):
    trace, logits = q2.run(q2.right, max_draft=8)
    q2.check_same(trace, logits)
    assert trace.speculative["passes"] == math.ceil(N / 9)


def test_draft_raising_at_once_is_the_sequential_run_bit_for_bit(q2):
    def draft(prefix, n):
        raise BackendCrash("draft child died")
    trace, logits = q2.run(draft)
    st = trace.speculative
    assert trace.ids == q2.seq.ids and np.array_equal(logits, q2.logits)
    assert st["draft_error"] == "BackendCrash: draft child died" and st["fallback_at"] == 0
    assert (st["passes"], st["fed_tokens"]) == (N, len(PROMPT) + N - 1)


@pytest.mark.parametrize("bad", ["raise", "out_of_vocab"])
def test_draft_failing_midway_falls_back(q2, bad):
    calls = []

    def draft(prefix, n):
        calls.append(len(prefix))
        if len(calls) == 2:
            if bad == "raise":
                raise RuntimeError("lost the GPU")
            return [q2.n_vocab + 3] * n
        d = q2.right(prefix, n)  # first call: right for 10, then wrong
        return d[:10] + [(t + 1) % q2.n_vocab for t in d[10:]]
    trace, logits = q2.run(draft)
    q2.check_same(trace, logits)
    st = trace.speculative
    assert st["fallback_at"] == calls[1] == 11 and st["draft_calls"] == 2
    assert ("lost the GPU" if bad == "raise" else "outside") in st["draft_error"]
    assert st["passes"] == 1 + (N - 11)  # then one id per pass


@pytest.mark.parametrize("kind", ["right", "five", "wrong"])
def test_recurrent_model_rewinds_through_its_saved_state(q35, kind):
    def five(prefix, n):
        d = q35.right(prefix, n)
        return d[:5] + [(t + 1) % q35.n_vocab for t in d[5:]]
    draft = {"right": q35.right, "five": five, "wrong": q35.wrong}[kind]
    trace, logits = q35.run(draft)
    q35.check_same(trace, logits)
    passes = {"right": 1, "five": math.ceil(N35 / 6), "wrong": N35}[kind]
    assert trace.speculative["passes"] == passes


def test_recurrent_rewind_before_the_saved_state_is_refused(q35):
    o = q35.backend
    o.reset()
    o.logits_rows(PROMPT + [1, 2, 3], len(PROMPT) - 1)
    assert o.rewind(len(PROMPT) + 2) == len(PROMPT)  # the state saved after tokens[first]
    with pytest.raises(ConfigError, match="saved"):
        o.rewind(2)


# ---- harness.run.verify_model and the CLI ------------------------------------------------

class Crashing(OracleBackend):
    """An oracle that dies after `after` steps (a draft backend's child process crashing)."""

    def __init__(self, after=None):
        super().__init__()
        self.after, self.steps = after, 0

    def load(self, model, cfg):
        if self.after is None:
            raise BackendCrash("child died while loading")
        super().load(model, cfg)

    def step(self, token):
        self.steps += 1
        if self.steps > self.after:
            raise BackendCrash("child died: SIGSEGV")
        return super().step(token)


def _verify(path, draft, extra=None):
    made = {"oracle": OracleBackend, "other": OracleBackend, **(extra or {})}
    proto = ProtocolConfig(tuple(PROMPT), n_predict=12, contexts=(CTX,), teacher_forced=False)
    return verify_model(ModelRef(path.stem, path), {}, proto, RunConfig(n_ctx=CTX),
                        ["oracle", "other", *(extra or {})], lambda n: made[n](), draft=draft)


@pytest.fixture(scope="module")
def plain(tiny_qwen2_f32):
    return _verify(tiny_qwen2_f32, None)


def test_verify_model_records_the_speculative_reference(tiny_qwen2_f32, plain):
    res = _verify(tiny_qwen2_f32, "other")
    ref = res["reference"]
    assert ref["ids"] == plain["reference"]["ids"] and res["settings"]["draft"] == "other"
    assert ref["speculative"]["used"] and ref["speculative"]["passes"] == 1
    assert ref["speculative"]["accepted"] == 11
    assert "speculative" not in plain["reference"] and plain["settings"]["draft"] is None
    assert [v["verdict"] for v in res["verdicts"]] == ["PASS"]
    # batched passes are no per-token rate: the reference's rates are left empty, its time kept
    assert ref["timing"]["decode_tok_s"] is None and ref["timing"]["total_s"] > 0
    assert plain["reference"]["timing"]["decode_tok_s"] is not None


@pytest.mark.parametrize("after", [None, 3])
def test_verify_model_survives_a_crashing_draft(tiny_qwen2_f32, plain, after):
    res = _verify(tiny_qwen2_f32, "bad", {"bad": lambda: Crashing(after)})
    spec = res["reference"]["speculative"]
    assert res["reference"]["ids"] == plain["reference"]["ids"]
    assert "child died" in spec["draft_error"]
    if after is None:  # failed to load: the plain sequential run
        assert spec["used"] is False
    else:  # crashed in its first draft (3 of 11 steps): sequential from position 0
        assert spec["used"] and spec["fallback_at"] == 0 and spec["passes"] == 12
    bad = [r for r in res["runs"] if r["backend"] == "bad"]
    assert bad and bad[0]["status"] == "error"  # compared as usual, crash recorded there too


def test_verify_model_refuses_a_draft_not_compared(tiny_qwen2_f32):
    with pytest.raises(ConfigError, match="not among"):
        _verify(tiny_qwen2_f32, "llamacpp")


def test_cli_verify_with_llamacpp_draft(tiny_qwen2_f32, q2, tmp_path, capsys):
    argv = ["verify", "--model", str(tiny_qwen2_f32), "--backends", "oracle,llamacpp",
            "--contexts", str(CTX), "--n-predict", "12", "--prompt", "one two three four five",
            "--out", str(tmp_path), "--no-report", "--no-teacher-forced"]
    assert main(argv + ["--draft", "engine"]) == 2
    assert "not among" in capsys.readouterr().err
    assert main(argv + ["--draft", "oracle"]) == 2  # the reference drafting for itself
    assert "the reference itself" in capsys.readouterr().err
    assert not list(tmp_path.glob("runs/*/result.json"))  # nothing written
    assert main(argv + ["--draft", "llamacpp"]) == 0, capsys.readouterr().err
    res = json.loads(next((tmp_path / "runs").glob("*/result.json")).read_text())
    ref, prompt = res["reference"], res["prompt"]["ids"]
    seq, _ = run_reference(q2.backend, "oracle", prompt, 12, CTX)
    assert ref["ids"] == seq.ids and ref["speculative"]["used"]
    assert ref["speculative"]["draft"] == "llamacpp" and ref["speculative"]["draft_error"] is None
    assert ref["speculative"]["accepted"] + ref["speculative"]["passes"] == 12
