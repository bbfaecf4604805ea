"""backends.engine.switches: a result names every engine switch's value as run."""
from __future__ import annotations

import pytest

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


def test_diag_is_recorded_in_one_spelling():
    """module.diag_canonical: the build a GGUF_HARNESS_DIAG value makes, spelt one way (results and
    the nodes page read it); an unknown word is left as typed for diag_defines to refuse."""
    from backends.engine import module
    for typed, canon in (("", ""), (",", ""), ("  ", ""), ("nostage, nowait", "nowait,nostage"),
                         ("nowait,,", "nowait"), ("nostage", "nostage"), ("NoWait", "NoWait")):
        assert module.diag_canonical(typed) == canon, typed
    assert module.diag_defines(module.diag_canonical("nostage, nowait")) == ("DIAG_NOWAIT", "DIAG_NOSTAGE")


def test_check_refuses_a_bad_switch_before_any_work(monkeypatch, capsys):
    """switches.check (called by EngineBackend.load, bench nodes / kernels and run / verify with the
    engine before a model is read): the defaults pass; a bad value of any checked switch is a
    ConfigError naming the variable; the CLI turns it into an error line with exit 2 before the
    model is looked up (here a registry name that is never fetched)."""
    import pytest

    from backends.engine import deltanet_ops, gemv_mma, launch, module, ops, switches
    from harness import cli
    from harness.errors import ConfigError
    switches.check()
    for mod, attr, bad, env in ((module, "DIAG", "fast", "GGUF_HARNESS_DIAG"),
                                (module, "GEMV_PF", "9", "GGUF_HARNESS_GEMV_PF"),
                                (ops, "GEMV_KQ_PF0", "3W", "GGUF_HARNESS_GEMV_KQ_PF0"),
                                (ops, "GEMV_KQ_DQ", "2", "GGUF_HARNESS_GEMV_KQ_DQ"),
                                (ops, "GEMV_KQ_WIDE_MIN_ROWS", "many", "GGUF_HARNESS_GEMV_KQ_WIDE_MIN_ROWS"),
                                (ops, "GEMV_IMPL", "q4", "GGUF_HARNESS_GEMV"),
                                (ops, "GEMV_KQ", "v8", "GGUF_HARNESS_GEMV_KQ"),
                                (ops, "GEMV_KQ_SPLIT", "3", "GGUF_HARNESS_GEMV_KQ_SPLIT"),
                                (ops, "ATTN_IMPL", "flash", "GGUF_HARNESS_ATTN"),
                                (ops, "GEMV_TMA_NST", "9", "GGUF_HARNESS_GEMV_TMA_NST"),
                                (gemv_mma, "GEMV_MMA_WARPS", "3", "GGUF_HARNESS_GEMV_MMA_WARPS"),
                                (launch, "MODE", "maybe", "GGUF_HARNESS_PDL"),
                                (deltanet_ops, "GDN_CSPLIT", "2", "GGUF_HARNESS_GDN_CSPLIT")):
        with monkeypatch.context() as m:
            m.setattr(mod, attr, bad)
            with pytest.raises(ConfigError, match=env + "="):
                switches.check()
    with monkeypatch.context() as m:
        m.setenv("GGUF_HARNESS_ATTN_SINGLE", "lots")
        with pytest.raises(ConfigError, match="engine switch"):
            switches.check()
    monkeypatch.setattr(module, "DIAG", "fast")
    capsys.readouterr()
    assert cli.main(["bench", "nodes", "--model", "no-such-model-name", "--out", "/nonexistent/x"]) == 2
    err = capsys.readouterr().err
    assert "GGUF_HARNESS_DIAG='fast'" in err and "no-such-model-name" not in err, err


def test_diag_defines_reach_every_engine_build_but_the_rooflines(monkeypatch):
    """module._module adds GGUF_HARNESS_DIAG's defines to each engine source's NVRTC options (one
    cache entry per resulting set), never to ROOFLINE_SOURCES; kernel_in goes through it. A fake
    CuPy records the options (no GPU)."""
    import sys
    import types

    from backends.engine import module
    seen = []

    class RawModule:
        def __init__(self, code, options):
            seen.append(options)

        def get_function(self, name):
            return name
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(RawModule=RawModule))
    monkeypatch.setattr(module, "DIAG", "nowait,nostage")
    module._module_for.cache_clear()
    try:
        module.kernel_in("misc.cu", "argmax_logits")
        module.kernel_in("gemv_kq.cu", "gemvkq_store_q4_k", ("KQ_P2=1",))
        for src in sorted(module.ROOFLINE_SOURCES):
            module.kernel_in(src, "x")
        monkeypatch.setattr(module, "DIAG", "")
        module.kernel_in("misc.cu", "argmax_logits")
    finally:
        module._module_for.cache_clear()
    diag = {"-DDIAG_NOWAIT", "-DDIAG_NOSTAGE"}
    assert diag <= set(seen[0]) and diag <= set(seen[1]) and "-DKQ_P2=1" in seen[1]
    assert len(seen) == 5 and not any(diag & set(o) for o in seen[2:]), seen


def test_the_engine_refuses_a_diagnostic_build_outside_bench_nodes(monkeypatch):
    """EngineBackend.load under GGUF_HARNESS_DIAG: ConfigError before anything is read (run,
    verify, layerdiff), unless made with allow_diag (bench_nodes.loaded_engine); run / verify
    with the engine refuse it before the model is assembled (main_job._choose_backends)."""
    import pytest

    from backends.engine import EngineBackend, module
    from backends import registry
    from harness import main_job
    from harness.errors import ConfigError, UnsupportedError
    monkeypatch.setattr(module, "DIAG", "nowait")
    with pytest.raises(ConfigError, match="GGUF_HARNESS_DIAG=nowait: a timing-only build"):
        EngineBackend().load(None, None)
    from harness import layerdiff_cmd
    with pytest.raises(ConfigError, match="layerdiff does not"):
        layerdiff_cmd.check_backends(__import__("types").SimpleNamespace(against="engine", prompt_ids=[1], gpu=False))
    try:  # allowed: it goes on to CuPy (absent on the CPU machine) or to the (absent) model
        EngineBackend(allow_diag=True).load(None, None)
    except ConfigError as e:
        pytest.fail(f"refused with allow_diag: {e}")
    except (UnsupportedError, AttributeError, TypeError):
        pass
    monkeypatch.setattr(registry, "available_backends", lambda: {"engine": None, "llamacpp": None, "reference": None})
    with pytest.raises(ConfigError, match="run / verify does not"):
        main_job._choose_backends("engine,llamacpp", "llamacpp")
    monkeypatch.setattr(module, "DIAG", "")
    assert main_job._choose_backends("engine,llamacpp", "llamacpp")[0] == ["engine", "llamacpp"]


def test_check_refuses_a_bad_value_of_every_engine_switch(monkeypatch):
    """Every name in machine.ENGINE_SWITCHES set to a value no switch takes is a ConfigError of
    switches.check naming it (a new switch without a check fails here)."""
    import pytest

    from backends.engine import switches
    from harness.errors import ConfigError
    from harness.machine import ENGINE_SWITCHES
    for env in ENGINE_SWITCHES:
        with monkeypatch.context() as m:
            if env in ("GGUF_HARNESS_ATTN_SINGLE", "GGUF_HARNESS_ATTN_SPLIT_MIN"):  # read at call time
                m.setenv(env, "bogus")
            else:
                mod, attr = switches._ALIASES.get(env, (None, env.removeprefix("GGUF_HARNESS_")))
                mod = mod or next(x for x in switches._MODULES if hasattr(x, attr))
                m.setattr(mod, attr, "bogus")
            with pytest.raises(ConfigError, match=env + "="):
                switches.check()


def test_results_record_diag_in_one_spelling(monkeypatch):
    """machine_info()'s switches (what was set) carry GGUF_HARNESS_DIAG spelt as the build it makes,
    so two results of one build compare equal in `harness ab`; other switches as typed."""
    from harness import machine
    monkeypatch.setenv("GGUF_HARNESS_DIAG", "nostage, nowait")
    monkeypatch.setenv("GGUF_HARNESS_GEMV_KQ_PF0", " 3")
    sw = machine._switches_set()
    assert sw["GGUF_HARNESS_DIAG"] == "nowait,nostage" and sw["GGUF_HARNESS_GEMV_KQ_PF0"] == " 3"
