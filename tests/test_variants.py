"""Backend variants (harness.variants): NAME@VARIANT specs, the settings they reach the backend
with, and a verify run that compares llama.cpp with itself under another valid setting."""
from __future__ import annotations

import json

import numpy as np
import pytest

from harness import main_job, variants
from harness.cli import main
from harness.config import ModelRef, ProtocolConfig, RunConfig
from harness.errors import ConfigError
from harness.run import verify_model

CTX = 96


def test_plain_name_has_no_variant():
    assert variants.split("llamacpp") == ("llamacpp", ())
    cfg = RunConfig(n_ctx=CTX)
    assert variants.apply("llamacpp", cfg) is cfg


def test_variant_sets_its_fields_and_keeps_the_rest():
    cfg = RunConfig(n_ctx=CTX, n_threads=3, kv_type="f16", flash_attn=True)
    got = variants.apply("llamacpp@no-flash-attn+kv-f32", cfg)
    assert (got.flash_attn, got.kv_type) == (False, "f32")
    assert (got.n_ctx, got.n_threads) == (CTX, 3)
    got = variants.apply("llamacpp@ubatch-1", cfg)
    assert (got.n_batch, got.n_ubatch) == (1, 1)
    assert variants.apply("engine@embd-host", cfg).embd_placement == "host"


@pytest.mark.parametrize("spec,msg", [
    ("llamacpp@", "unknown variant ''"),
    ("llamacpp@fast", "unknown variant 'fast'"),
    ("engine@no-flash-attn", "applies to llamacpp only"),
    ("oracle@kv-f32", "applies to llamacpp only"),
    ("llamacpp@kv-f32+kv-f32", "twice"),
    ("llamacpp@flash-attn+no-flash-attn", "both ways"),
])
def test_bad_specs_are_refused(spec, msg):
    with pytest.raises(ConfigError, match=msg):
        variants.overrides(spec)


class Recorder:
    """A backend stand-in: logits depend on the settings it was loaded with."""

    loaded: list[tuple[str, RunConfig]] = []

    def __init__(self, name):
        self.name = name

    def load(self, model, cfg):
        Recorder.loaded.append((self.name, cfg))
        # flash attention off lifts token 7 just past the leader (see _logits)
        self._shift = 0.0 if cfg.flash_attn else 1e-3
        self._pos = 0

    def reset(self):
        self._pos = 0

    def _logits(self):
        lg = np.zeros(16, dtype=np.float32)
        lg[(self._pos * 5) % 16] = 1.0
        lg[7] = 0.9995 + self._shift  # a near tie with the leader that the shift flips
        return lg

    def prefill(self, tokens):
        self._pos += len(tokens)
        return self._logits()

    def step(self, token):
        self._pos += 1
        return self._logits()

    def capabilities(self):
        return set()

    def close(self):
        pass

    def extra(self):
        return "inner"


def test_variant_backend_loads_with_the_variant_and_delegates_the_rest():
    b = variants.wrap_create(Recorder)("llamacpp@no-flash-attn")
    Recorder.loaded.clear()
    b.load(ModelRef("m", None), RunConfig(n_ctx=CTX))
    assert Recorder.loaded == [("llamacpp", RunConfig(n_ctx=CTX, flash_attn=False))]
    assert b.name == "llamacpp@no-flash-attn" and b.extra() == "inner"
    with pytest.raises(ConfigError):
        variants.wrap_create(Recorder)("llamacpp@nope")


def test_verify_compares_the_reference_with_its_variant():
    proto = ProtocolConfig((1, 2, 3), n_predict=6, contexts=(CTX,), teacher_forced=True)
    Recorder.loaded.clear()
    res = verify_model(ModelRef("m", None), {}, proto, RunConfig(n_ctx=CTX),
                       ["llamacpp", "llamacpp@no-flash-attn"], variants.wrap_create(Recorder),
                       reference="llamacpp")
    assert res["settings"]["variants"] == {"llamacpp@no-flash-attn": {"flash_attn": False}}
    assert [c.flash_attn for _, c in Recorder.loaded] == [True, False]
    tf = [r for r in res["runs"] if r["mode"] == "teacher_forced"]
    assert [r["backend"] for r in tf] == ["llamacpp@no-flash-attn"]
    # the shift makes token 7 win wherever the leader's logit is 1.0 (every step): no agreement
    assert tf[0]["summary"]["top1_agreement"] == 0.0


def test_choose_backends_takes_variants_of_available_backends():
    names, _ = main_job._choose_backends("llamacpp@no-flash-attn", "llamacpp", bench=False)
    assert names == ["llamacpp", "llamacpp@no-flash-attn"]
    with pytest.raises(ConfigError, match="unknown backend"):
        main_job._choose_backends("nosuch@kv-f32", "llamacpp")
    with pytest.raises(ConfigError, match="applies to llamacpp only"):
        main_job._choose_backends("oracle@kv-f32", "llamacpp")
    with pytest.raises(ConfigError, match="both ways"):
        main_job._choose_backends("llamacpp", "llamacpp@flash-attn+no-flash-attn")


def test_cli_llamacpp_against_itself(tiny_qwen2_f32, tmp_path, capsys):
    """llama.cpp (CPU) as the reference, and again with flash attention off and with the prompt
    fed one token per batch: the variants run, are recorded, and each changes the prompt's
    logits (other kernels, other summation orders). Not used here: kv-f32 with flash
    attention on, whose logits equalled the f16 cache's bit for bit on this model on the CPU
    (llama.cpp's CPU flash attention; with no-flash-attn the f32 cache does change them)."""
    argv = ["verify", "--model", str(tiny_qwen2_f32), "--reference", "llamacpp",
            "--backends", "llamacpp,llamacpp@no-flash-attn,llamacpp@ubatch-1",
            "--contexts", str(CTX), "--n-predict", "8", "--prompt", "one two three four five",
            "--out", str(tmp_path), "--no-report", "--no-bench"]
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc in (0, 1), err
    res = json.loads(next((tmp_path / "runs").glob("*/result.json")).read_text())
    assert res["settings"]["variants"] == {"llamacpp@no-flash-attn": {"flash_attn": False},
                                           "llamacpp@ubatch-1": {"n_batch": 1, "n_ubatch": 1}}
    tf = {r["backend"]: r for r in res["runs"] if r["mode"] == "teacher_forced"}
    assert set(tf) == {"llamacpp@no-flash-attn", "llamacpp@ubatch-1"}
    ref0 = res["reference"]["steps"][0]["logits_sha256"]
    for name, r in tf.items():
        assert r["status"] == "ok", name
        assert r["steps"][0]["logits_sha256"] != ref0, name  # the setting reached llama.cpp
        assert r["summary"]["max_abs"] < 0.05, name  # an F32 model: rounding-order noise only
