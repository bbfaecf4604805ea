"""Metrics against independent scalar formulations."""
import hashlib
import math
import struct

import numpy as np
from hypothesis import given, settings, strategies as st
from hypothesis.extra.numpy import arrays

from harness import metrics


def test_logits_sha256_is_little_endian_float32():
    x = np.array([1.0, -2.5, 3.25], dtype=np.float64)
    expect = hashlib.sha256(b"".join(struct.pack("<f", v) for v in x)).hexdigest()
    assert metrics.logits_sha256(x) == expect


def test_ids_sha256_is_little_endian_int64():
    ids = [1, 151643, 7]
    expect = hashlib.sha256(b"".join(struct.pack("<q", v) for v in ids)).hexdigest()
    assert metrics.ids_sha256(ids) == expect


finite = st.floats(-30, 30, allow_nan=False, width=32)


@settings(max_examples=50, deadline=None)
@given(arrays(np.float64, st.integers(6, 40), elements=finite),
       arrays(np.float64, 40, elements=st.floats(-1, 1, width=32)))
def test_kl_nmse_against_scalar_loops(r, noise):
    x = (r + noise[: r.size]).astype(np.float32)
    out = metrics.compare(r, x)
    zr = sum(math.exp(v) for v in r)
    zx = sum(math.exp(float(v)) for v in x)
    kl = sum(math.exp(a) / zr * (a - math.log(zr) - (float(b) - math.log(zx))) for a, b in zip(r, x))
    assert math.isclose(out["kl"], max(kl, 0.0), rel_tol=1e-6, abs_tol=1e-12)
    num = sum((float(b) - a) ** 2 for a, b in zip(r, x))
    den = sum(a * a for a in r)
    if den > 0:
        assert math.isclose(out["nmse"], num / den, rel_tol=1e-9, abs_tol=1e-300)
    assert out["max_abs"] == max(abs(float(b) - a) for a, b in zip(r, x))


def test_kl_zero_and_top_agreement_for_identical_logits():
    r = np.arange(10, dtype=np.float64)
    out = metrics.compare(r, r.astype(np.float32))
    assert out["kl"] == 0.0 and out["max_abs"] == 0.0
    assert out["top1_agree"] and out["top5_overlap"] == 1.0
    assert out["ref_margin"] == 1.0 and math.isclose(out["ref_margin_rel"], 1 / 9)


def test_topk_order_and_ties():
    x = np.array([0.0, 5.0, 5.0, 1.0, 9.0])
    assert metrics.topk(x, 3).tolist() == [4, 1, 2]


def test_nonfinite_is_counted_not_hidden():
    r = np.zeros(8)
    x = np.zeros(8, dtype=np.float32)
    x[3] = np.nan
    out = metrics.compare(r, x)
    assert out["nonfinite"] == 1 and out["kl"] == math.inf


def test_shape_mismatch_raises():
    import pytest
    with pytest.raises(ValueError, match="shapes differ"):
        metrics.compare(np.zeros(4), np.zeros(5, dtype=np.float32))
