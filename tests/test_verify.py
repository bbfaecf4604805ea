"""Greedy / teacher-forced loops, summaries and gate with scripted fake backends."""
import numpy as np

from harness import metrics
from harness.summary import Gate, gate, summarize
from harness.verify import GREEDY, TEACHER_FORCED, run_compared, run_reference

V = 16


class Scripted:
    """Logits depend on (position, last token) so feeding matters; `flip` changes one step."""

    name = "scripted"

    def __init__(self, flip_at=None, noise=0.0):
        self.flip_at, self.noise, self.pos, self.fed = flip_at, noise, 0, []

    def reset(self):
        self.pos, self.fed = 0, []

    def _logits(self):
        rng = np.random.default_rng(1000 * self.pos + (self.fed[-1] if self.fed else 0))
        x = rng.normal(size=V)
        if self.flip_at is not None and self.pos - 3 == self.flip_at:  # 3 prompt tokens: position 3 predicts id 0
            x[np.argsort(x)[-2]] = x.max() + 1.0  # promote the runner-up
        return (x + self.noise).astype(np.float32)

    def prefill(self, tokens):
        self.fed += list(tokens)
        self.pos += len(tokens)
        return self._logits()

    def step(self, token):
        self.fed.append(token)
        self.pos += 1
        return self._logits()


def _ref(n=12):
    tr, logits = run_reference(Scripted(), "ref", [1, 2, 3], n, 64)
    return tr, logits


def test_reference_ids_are_argmax_and_counts():
    tr, logits = _ref()
    assert len(tr.ids) == 12 and logits.shape == (12, V)
    assert tr.ids == [int(np.argmax(row)) for row in logits]


def test_identical_backend_passes_with_zero_error():
    ref, logits = _ref()
    t = run_compared(Scripted(), "x", GREEDY, [1, 2, 3], ref.ids, logits, 64)
    s = summarize(t, ref, logits)
    assert s["ids_equal"] and s["match_prefix"] == 12 and s["kl_max"] == 0.0
    assert s["ids_sha256"] == metrics.ids_sha256(ref.ids)
    assert gate(s, None)["verdict"] == "PASS"


def test_divergence_found_and_teacher_forcing_keeps_comparing():
    ref, logits = _ref()
    g = run_compared(Scripted(flip_at=4), "x", GREEDY, [1, 2, 3], ref.ids, logits, 64)
    sg = summarize(g, ref, logits)
    assert sg["match_prefix"] == 4 and sg["first_divergence"]["index"] == 4
    assert sg["first_divergence"]["ref_id"] == ref.ids[4]
    assert len(sg["first_divergence"]["top5"]) == 5
    # greedy: steps after the divergence are not compared
    assert sg["n_compared"] == 5
    f = run_compared(Scripted(flip_at=4), "x", TEACHER_FORCED, [1, 2, 3], ref.ids, logits, 64)
    sf = summarize(f, ref, logits)
    assert sf["n_compared"] == 12 and abs(sf["top1_agreement"] - 11 / 12) < 1e-12
    # a promoted runner-up by a full logit is no near tie: FAIL
    v = gate(sg, sf, Gate(min_prefix=12))
    assert v["verdict"] == "FAIL" and "diverges at 4" in v["reason"]


def test_near_tie_divergence_passes_gate():
    s = {"match_prefix": 3, "n_generated": 129,
         "first_divergence": {"index": 3, "ref_margin_rel": 1e-5}}
    f = {"top1_agreement": 0.995}
    assert gate(s, f)["verdict"] == "PASS"
    assert gate(s, {"top1_agreement": 0.9})["verdict"] == "FAIL"


class NaNAfter(Scripted):
    """Scripted logits, all NaN from generated position `at` on (argmax of NaN is 0)."""

    def __init__(self, at):
        super().__init__()
        self.at = at

    def _logits(self):
        x = super()._logits()
        if self.pos - 3 >= self.at:
            x[:] = np.nan
        return x


def test_nonfinite_logits_fail_the_gate_even_with_equal_ids():
    ref, logits = _ref()
    g = run_compared(NaNAfter(10), "x", GREEDY, [1, 2, 3], ref.ids, logits, 64)
    s = summarize(g, ref, logits)
    assert s["nonfinite_steps"] == 2
    v = gate(s, None, Gate(min_prefix=8))
    assert v["verdict"] == "FAIL" and "non-finite" in v["reason"]


def test_nonfinite_reference_is_an_error():
    import pytest
    from harness.errors import NumericError
    with pytest.raises(NumericError, match="position 5"):
        run_reference(NaNAfter(5), "ref", [1, 2, 3], 12, 64)


def test_teacher_forced_agreement_is_required_even_after_a_long_match():
    s = {"match_prefix": 32, "n_generated": 129, "first_divergence": None, "nonfinite_steps": 0}
    assert gate(s, {"top1_agreement": 0.30, "nonfinite_steps": 0})["verdict"] == "FAIL"
    assert gate(s, {"top1_agreement": 0.995, "nonfinite_steps": 0})["verdict"] == "PASS"
