"""backends.engine.switches: a result names every engine switch's value as run."""
from __future__ import annotations

from harness.machine import ENGINE_SWITCHES


def test_every_engine_switch_has_an_effective_value(monkeypatch):
    """Every name in machine.ENGINE_SWITCHES maps to the variable the engine reads it into (a new
    switch without one fails here), and the value is the variable's, not the environment's:
    unset GGUF_HARNESS_GEMV_KQ_CSPLIT records the default the engine runs with."""
    from backends.engine import deltanet_ops, launch, ops, switches
    monkeypatch.delenv("GGUF_HARNESS_ATTN_SINGLE", raising=False)
    eff = switches.effective()
    assert set(eff) == set(ENGINE_SWITCHES), set(ENGINE_SWITCHES) ^ set(eff)
    assert all(isinstance(v, str) for v in eff.values())
    monkeypatch.setattr(ops, "GEMV_KQ_CSPLIT", "2")
    monkeypatch.setattr(ops, "GEMV_IMPL", "q8_1")
    monkeypatch.setattr(deltanet_ops, "GDN_CSPLIT", "0")
    monkeypatch.setattr(launch, "MODE", "off")
    monkeypatch.setenv("GGUF_HARNESS_ATTN_SINGLE", "128")
    eff = switches.effective()
    assert (eff["GGUF_HARNESS_GEMV_KQ_CSPLIT"], eff["GGUF_HARNESS_GEMV"], eff["GGUF_HARNESS_GDN_CSPLIT"],
            eff["GGUF_HARNESS_PDL"], eff["GGUF_HARNESS_ATTN_SINGLE"]) == ("2", "q8_1", "0", "off", "128")
    assert eff["GGUF_HARNESS_ATTN_SPLIT_MIN"] == str(ops.HEAD_SPLIT_MIN)


def test_diag_switch_words_and_errors(monkeypatch):
    """GGUF_HARNESS_DIAG (backends/engine/module.py): a comma list of nowait / nostage, in a fixed
    order whatever the spelling; another word is a ValueError naming the variable."""
    import pytest

    from backends.engine import module
    assert module.diag_defines("") == ()
    assert module.diag_defines("nowait") == ("DIAG_NOWAIT",)
    assert module.diag_defines(" nostage , nowait ") == ("DIAG_NOWAIT", "DIAG_NOSTAGE")
    with pytest.raises(ValueError, match="GGUF_HARNESS_DIAG"):
        module.diag_defines("nowait,fast")
    monkeypatch.setattr(module, "DIAG", "nostage")
    assert module.diag_defines() == ("DIAG_NOSTAGE",)
