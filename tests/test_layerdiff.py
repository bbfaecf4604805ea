"""Layer-by-layer diff (harness.layerdiff) through llama.cpp's eval callback
(backends.llamacpp.capture): clean runs agree node by node, and an error injected into one
op of the oracle is reported at exactly that layer and op."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from harness.layerdiff import LayerDiff, compare_node, diff_call, layer_diff, llama_name

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                reason="llama_cpp (llama-cpp-python) missing")
PROMPT = [17, 250, 3, 499, 88, 120, 7, 301]


def test_compare_node_statuses():
    a = np.array([1.0, -2.0, 3.0])
    ok = compare_node(0, "z", 4, a, a.astype(np.float32) * (1 + 1e-7), 1e-3)
    assert ok.status == "ok" and ok.llama_name == "z-4" and ok.rel_rms < 1e-6
    bad = compare_node(0, "z", 4, a, np.array([1.0, -2.0, 3.5]), 1e-3)
    assert bad.status == "bad" and bad.worst_index == 2 and bad.out_value == 3.5
    assert compare_node(0, "z", 4, a, None, 1e-3).status == "missing"
    assert compare_node(0, "z", 4, a, np.ones(4), 1e-3).status == "size"
    assert compare_node(0, "z", 4, a, np.array([1.0, np.nan, 3.0]), 1e-3).status == "bad"
    assert llama_name("inp_embd", -1) == "model.input_embed"
    assert llama_name("v_conv", 2) == "v_conv_predelta-2"


def test_compare_node_last_row_when_llama_kept_only_the_output_row():
    ref = np.arange(12, dtype=np.float64).reshape(3, 4)  # [n_tokens, n_embd]
    last = compare_node(0, "l_out", 23, ref, ref[-1].astype(np.float32), 1e-3)
    assert last.status == "ok" and last.n == 4
    wrong = compare_node(0, "l_out", 23, ref, ref[0].astype(np.float32), 1e-3)
    assert wrong.status == "bad"  # the first row is not the output row
    assert compare_node(0, "l_out", 23, ref, np.ones(6), 1e-3).status == "size"


def test_first_bad_is_the_first_in_order():
    ref = [("a", 0, np.ones(3)), ("b", 0, np.ones(3)), ("c", 1, np.ones(3))]
    got = {"a-0": np.ones(3), "b-0": np.full(3, 2.0), "c-1": np.full(3, 5.0)}
    rep = LayerDiff(1e-3, diff_call(0, ref, got.get, 1e-3))
    assert (rep.first_bad.name, rep.first_bad.layer) == ("b", 0)
    assert "layer 0, op 'b'" in rep.summary()


def test_clean_f32_run_agrees_node_by_node(tiny_qwen35_f32):
    rep = layer_diff(tiny_qwen35_f32, PROMPT, steps=[5, 9])
    assert rep.first_bad is None, rep.summary()
    compared = {(d.name, d.layer) for d in rep.compared}
    # both layer types, the recurrent state, the head, and all three calls were compared
    for key in [("new_state", 0), ("q_conv_predelta", 2), ("attn_gated", 3), ("Kcur", 7),
                ("l_out", 7), ("result_output", -1)]:
        assert key in compared, key
    assert {d.call for d in rep.compared} == {0, 1, 2}
    assert max(d.rel_rms for d in rep.compared) < 1e-5  # float32 graph vs float64
    assert len(rep.compared) > 300


@pytest.mark.parametrize("name, layer", [("a_softplus", 2), ("k_conv_predelta", 1),
                                         ("Kcur", 3), ("attn_gated", 7), ("ffn_out", 5)])
def test_injected_error_is_named(tiny_qwen35_f32, name, layer):
    """Scale one oracle node by 1 + 1e-2: the report's first bad node is that layer and op
    (every earlier node still agrees at the default tolerance 1e-3)."""
    rep = layer_diff(tiny_qwen35_f32, PROMPT, inject={(name, layer): lambda a: a * 1.01})
    bad = rep.first_bad
    assert bad is not None and (bad.name, bad.layer) == (name, layer), rep.summary()
    assert f"layer {layer}, op '{name}'" in rep.summary()
    assert bad.rel_rms == pytest.approx(1e-2, rel=1e-2)


def test_injection_in_a_decode_step_only(tiny_qwen35_f32):
    """The delta-rule state after the prompt is right; corrupt only the second call's
    output of layer 4 (n == 1 token): the report names call 1, layer 4."""
    def once(a):
        return a + 0.05 if a.shape[0] == 1 else a
    rep = layer_diff(tiny_qwen35_f32, PROMPT, steps=[5], inject={("attn_output", 4): once})
    bad = rep.first_bad
    assert (bad.call, bad.layer, bad.name) == (1, 4, "attn_output"), rep.summary()
