"""`harness layerdiff` (harness.layerdiff_cmd): bad input ends in one `error:` line and exit 2
with nothing written; a run on the tiny synthetic models writes layerdiff.json into a new
folder and exits 0 when every compared node is within --tol, 1 when one is not (naming the
first bad node); --against engine without a GPU is refused with exit 2."""
from __future__ import annotations

import functools
import importlib.util
import json
import math

import numpy as np
import pytest

from harness.cli import main
from harness.layerdiff import LayerDiff, NodeDiff

needs_llama = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                 reason="llama_cpp (llama-cpp-python) missing")
PROMPT = "3,17,42,101,7,250,9,64"


def _ld(model, out, *extra):
    return ["layerdiff", "--model", str(model), "--out", str(out), "--prompt-ids", PROMPT, *extra]


def _docs(out) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("runs/*/layerdiff.json"))]


def _one_error(err: str) -> str:
    assert err.startswith("error:") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("argv, needle", [
    (["--act-round", "bogus"], "--act-round"),
    (["--against", "gpu"], "--against"),
    (["--steps", "x"], "--steps"),
    (["--prompt", "a", "--prompt-ids", "1"], "not allowed with"),
    (["--format", "md"], "--format"),
])
def test_argparse_errors_exit_2(argv, needle, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["layerdiff", "--out", str(tmp_path / "out"), *argv])
    assert e.value.code == 2 and needle in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, needle", [
    (["--steps", "-1"], "--steps"),
    (["--tol", "nan"], "--tol"),
    (["--tol=-1e-3"], "--tol"),
    (["--ctx", "4"], "--ctx"),
    (["--threads", "0"], "--threads"),
    (["--prompt-ids", "1,x"], "--prompt-ids"),
    (["--prompt-ids", ","], "--prompt-ids"),
    (["--prompt-ids", "1,-2"], ">= 0"),
    (["--prompt", "   "], "empty"),
    (["--against", "engine", "--gpu"], "--gpu"),
])
def test_bad_settings_exit_2_before_the_model(argv, needle, tmp_path, capsys):
    """Checked before any model is resolved: a model that does not exist is never reached."""
    code = main(["layerdiff", "--model", str(tmp_path / "absent.gguf"),
                 "--out", str(tmp_path / "out"), *argv])
    assert code == 2 and needle in _one_error(capsys.readouterr().err)


@needs_llama
@pytest.mark.parametrize("argv, needle", [
    (["--prompt-ids", "1,512"], "vocabulary"),          # n_vocab 512: ids 0..511
    (["--ctx", "10", "--steps", "3"], "--ctx 10"),      # 8 prompt ids + 3 steps > 10
    (["--act-round", "llamacpp"], "qwen2 oracle"),      # the qwen2 oracle has no CPU rounding
])
def test_bad_input_for_this_model_exit_2(argv, needle, tiny_qwen2_f32, tmp_path, capsys):
    code = main(_ld(tiny_qwen2_f32, tmp_path / "out", *argv))
    assert code == 2 and needle in _one_error(capsys.readouterr().err)
    assert _docs(tmp_path / "out") == []


def test_out_is_a_file(tiny_qwen2_f32, tmp_path, capsys):
    f = tmp_path / "f"
    f.write_text("x")
    assert main(_ld(tiny_qwen2_f32, f)) == 2
    assert "not a folder" in _one_error(capsys.readouterr().err)


def test_engine_without_gpu_is_refused(tiny_qwen2_f32, tmp_path, capsys):
    from backends.registry import available_backends
    if available_backends()["engine"] is None:
        pytest.skip("the engine is available here")
    code = main(_ld(tiny_qwen2_f32, tmp_path / "out", "--against", "engine"))
    err = _one_error(capsys.readouterr().err)
    assert code == 2 and "--against engine needs the engine backend" in err
    assert _docs(tmp_path / "out") == []


@needs_llama
def test_clean_run_then_tiny_tol(tiny_qwen2_f32, tmp_path, capsys):
    """F32 model: llama.cpp's float32 graph is ~1e-7 off the float64 oracle, so the default
    tol passes (exit 0) and tol 1e-12 fails at the very first compared node (exit 1); the
    second run gets its own folder."""
    from oracles.qwen2 import Qwen2Oracle
    out = tmp_path / "out"
    assert main(_ld(tiny_qwen2_f32, out, "--steps", "2")) == 0
    cap = capsys.readouterr()
    assert "all " in cap.out and "compared nodes within rel_rms 0.001" in cap.out
    assert "ffn_swiglu" in cap.out and "result: " in cap.err
    (doc,) = _docs(out)
    ids = [int(x) for x in PROMPT.split(",")]
    assert doc["schema"] == "gguf-harness/layerdiff/1" and doc["exit_code"] == 0
    assert doc["prompt"] == {"source": "ids", "text": None, "ids": ids}
    assert doc["settings"]["against"] == "llamacpp" and doc["settings"]["act_round_used"] is None
    assert doc["model"]["arch"] == "qwen2" and len(doc["model"]["sha256"]) == 64
    assert doc["machine"]["versions"]["python"]
    # the steps are the oracle's own greedy continuation
    o = Qwen2Oracle(tiny_qwen2_f32, n_ctx=64)
    want = [int(np.argmax(o.prefill(ids)))]
    want.append(int(np.argmax(o.step(want[-1]))))
    assert doc["step_ids"] == want
    nodes = doc["layerdiff"]["nodes"]
    compared = [n for n in nodes if n["status"] in ("ok", "bad")]
    assert {n["call"] for n in compared} == {0, 1, 2} and len(compared) > 50
    assert max(n["rel_rms"] for n in compared) < 1e-5
    assert doc["layerdiff"]["first_bad"] is None
    rows = {(r["phase"], r["name"]): r for r in doc["by_node"]}
    assert rows[("decode", "Qcur")]["compared"] == 2 * 2  # 2 layers x 2 steps
    assert rows[("prefill", "result_output")]["worst_layer"] == -1

    assert main(_ld(tiny_qwen2_f32, out, "--tol", "1e-12")) == 1
    cap = capsys.readouterr()
    assert "first bad node: layer 0, op 'attn_norm'" in cap.out
    docs = _docs(out)
    assert len(docs) == 2, "the second run must not overwrite the first"
    bad = docs[1]["layerdiff"]["first_bad"]
    assert docs[1]["exit_code"] == 1 and (bad["name"], bad["layer"], bad["call"]) == ("attn_norm", 0, 0)


@needs_llama
def test_injected_fault_is_named(tiny_qwen35_f32, tmp_path, capsys, monkeypatch):
    """One oracle node scaled by 1.01 (as tests/test_layerdiff.py does) through the CLI: exit
    1, the JSON and the table name that layer and op; --format json prints the file."""
    import harness.layerdiff as ld
    monkeypatch.setattr(ld, "layer_diff", functools.partial(
        ld.layer_diff, inject={("attn_gated", 3): lambda a: a * 1.01}))
    out = tmp_path / "out"
    assert main(_ld(tiny_qwen35_f32, out, "--format", "json")) == 1
    cap = capsys.readouterr()
    (doc,) = _docs(out)
    assert json.loads(cap.out) == doc
    bad = doc["layerdiff"]["first_bad"]
    assert (bad["name"], bad["layer"]) == ("attn_gated", 3)
    assert bad["rel_rms"] == pytest.approx(1e-2, rel=1e-2)
    assert doc["settings"]["act_round_used"] == "llamacpp"  # auto: qwen35 on the CPU
    statuses = [n["status"] for n in doc["layerdiff"]["nodes"]]
    first = next(i for i, n in enumerate(doc["layerdiff"]["nodes"])
                 if (n["name"], n["layer"]) == ("attn_gated", 3))
    assert statuses[first] == "bad" and "bad" not in statuses[:first]
    row = next(r for r in doc["by_node"] if r["name"] == "attn_gated")
    assert row["bad"] >= 1 and row["max_rel_rms"] >= bad["rel_rms"]


@needs_llama
def test_prompt_text_is_tokenised(tiny_qwen2_f32, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["layerdiff", "--model", str(tiny_qwen2_f32), "--out", str(out), "--prompt",
            "The lighthouse keeper wrote down the weather.", "--steps", "1"]
    assert main(argv) == 0, capsys.readouterr().err
    (doc,) = _docs(out)
    assert doc["prompt"]["source"] == "text" and len(doc["prompt"]["ids"]) > 3
    assert len(doc["step_ids"]) == 1


def test_node_rows_phases_nan_and_not_compared():
    """Engine calls are positions: those past the prompt are decode; a NaN node is the worst
    of its name; missing nodes count as not compared."""
    from harness.layerdiff_cmd import exit_code, node_rows
    n = [NodeDiff(0, "Qcur", 0, "Qcur-0", "ok", 4, 1e-6), NodeDiff(1, "Qcur", 1, "Qcur-1", "ok", 4, 3e-6),
         NodeDiff(1, "Qcur", 0, "Qcur-0", "bad", 4, math.nan),
         NodeDiff(2, "Qcur", 0, "Qcur-0", "ok", 4, 2e-6),
         NodeDiff(0, "attn_out", 0, "attn_out-0", "missing")]
    rep = LayerDiff(1e-3, n)
    rows = {(r["phase"], r["name"]): r for r in node_rows(rep, 2, "engine")}
    pre, dec = rows[("prefill", "Qcur")], rows[("decode", "Qcur")]
    assert (pre["compared"], pre["bad"], pre["worst_layer"], pre["worst_call"]) == (3, 1, 0, 1)
    assert math.isnan(pre["max_rel_rms"])
    assert (dec["compared"], dec["max_rel_rms"], dec["worst_call"]) == (1, 2e-6, 2)
    assert rows[("prefill", "attn_out")]["not_compared"] == 1
    assert rows[("prefill", "attn_out")]["median_rel_rms"] is None
    assert [r["phase"] for r in node_rows(rep, 2, "engine")][-1] == "decode"
    # against llama.cpp, call 0 is the prefill and every later call a decode step
    assert {r["phase"] for r in node_rows(rep, 2, "llamacpp") if r["name"] == "Qcur"} == \
        {"prefill", "decode"}
    assert exit_code(rep) == 1 and exit_code(LayerDiff(1e-3, n[:2])) == 0
    assert exit_code(LayerDiff(1e-3, n[4:])) == 1  # nothing compared is no pass


@pytest.mark.parametrize("fixture, arch", [("tiny_qwen2_f32", "qwen2"),
                                           ("tiny_qwen35_f32", "qwen35")])
def test_act_round_table_matches_the_oracles(fixture, arch, request):
    """ORACLE_ACT_ROUNDS (checked before any work) says what each oracle accepts."""
    from backends.oracle import _oracle_class
    from harness.errors import ConfigError
    from harness.layerdiff_cmd import ACT_ROUNDS, ORACLE_ACT_ROUNDS
    path = request.getfixturevalue(fixture)
    cls = _oracle_class(arch)
    for act in ACT_ROUNDS:
        if act in ("none", "auto"):
            continue
        if act in ORACLE_ACT_ROUNDS[arch]:
            cls(path, n_ctx=16, act_round=act)
        else:
            with pytest.raises(ConfigError):
                cls(path, n_ctx=16, act_round=act)


def _engine_on_the_cpu(monkeypatch, path, **kw):
    """--against engine without a GPU: the registry reports the engine usable and
    engine_layer_diff walks tests/engine35_fake.py's CPU stand-in (the GPU walk itself is
    tested in test_engine_layerdiff_qwen35.py); kw go to engine_layer_diff (inject)."""
    from engine35_fake import FakeQwen35Engine

    import backends.registry as reg
    import harness.engine_layerdiff as eld
    from backends.engine import ops as eops
    avail = reg.available_backends()
    monkeypatch.setattr(reg, "available_backends", lambda: avail | {"engine": None})
    monkeypatch.setattr(eops, "GEMV_IMPL", "q16")
    run = eld.engine_layer_diff
    monkeypatch.setattr(eld, "engine_layer_diff", lambda *a, **k: run(
        *a, engine=FakeQwen35Engine(path, n_ctx=k["n_ctx"]), **k, **kw))


def test_against_engine_takes_qwen35(tiny_qwen35_f32, tmp_path, capsys, monkeypatch):
    """A qwen35 model through `harness layerdiff --against engine` (CPU stand-in): exit 0,
    act_round auto = the engine's q16 rounding, the delta-rule states compared at the last
    position, the nodes the engine keeps no buffer for listed as not compared."""
    _engine_on_the_cpu(monkeypatch, tiny_qwen35_f32)
    out = tmp_path / "out"
    assert main(_ld(tiny_qwen35_f32, out, "--against", "engine", "--steps", "2")) == 0
    cap = capsys.readouterr()
    assert "not compared, the engine keeps no buffer for: a_softplus, attn_norm" in cap.out
    (doc,) = _docs(out)
    assert doc["model"]["arch"] == "qwen35" and doc["settings"]["act_round_used"] == "engine"
    assert len(doc["step_ids"]) == 2 and doc["layerdiff"]["first_bad"] is None
    rows = {(r["phase"], r["name"]): r for r in doc["by_node"]}
    assert rows[("decode", "new_state")]["compared"] == 6  # 6 DeltaNet layers, last position
    assert ("prefill", "new_state") not in rows
    assert rows[("decode", "Qcur")]["compared"] == 2 * 2  # 2 attention layers x 2 steps
    assert rows[("prefill", "beta_sigmoid")]["compared"] == 8 * 6
    a = rows[("prefill", "a_softplus")]
    assert (a["compared"], a["not_compared"], a["max_rel_rms"]) == (0, 8 * 6, None)


def test_against_engine_names_a_qwen35_fault(tiny_qwen35_f32, tmp_path, capsys, monkeypatch):
    _engine_on_the_cpu(monkeypatch, tiny_qwen35_f32, inject={("attn_gated", 3): lambda a: a * 1.01})
    out = tmp_path / "out"
    assert main(_ld(tiny_qwen35_f32, out, "--against", "engine")) == 1
    assert "first bad node: layer 3, op 'attn_gated'" in capsys.readouterr().out
    (doc,) = _docs(out)
    bad = doc["layerdiff"]["first_bad"]
    assert (bad["name"], bad["layer"], bad["call"]) == ("attn_gated", 3, 0)
