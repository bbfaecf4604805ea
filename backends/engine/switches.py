"""The engine switches' effective values, for results, and their check before any work.

harness.machine records the GGUF_HARNESS_* variables that were *set*; what an unset one meant
depends on the version (GGUF_HARNESS_GEMV_KQ_CSPLIT unset meant clusters of 2 in sessions 16-17
and groups of S since 18). effective() reads the module variable each switch sets, so a result
says what ran, whatever the defaults were then.
"""
from __future__ import annotations

import os

from harness.machine import ENGINE_SWITCHES

from . import deltanet_ops, gemv_mma, gemv_tcr, launch, module, ops

# switches whose variable is not named after them (env name minus GGUF_HARNESS_)
_ALIASES = {"GGUF_HARNESS_GEMV": (ops, "GEMV_IMPL"), "GGUF_HARNESS_ATTN": (ops, "ATTN_IMPL"),
            "GGUF_HARNESS_PDL": (launch, "MODE")}
_MODULES = (ops, deltanet_ops, gemv_mma, gemv_tcr, launch, module)


def effective() -> dict[str, str]:
    """{switch name: the value the engine runs with, as a string} for every ENGINE_SWITCHES name
    the engine reads into a module variable (ops, deltanet_ops, gemv_mma, gemv_tcr, launch, module), plus
    GGUF_HARNESS_ATTN_SINGLE / _SPLIT_MIN (ops.head_splitting, read at call time). "" where the
    variable is unset and its default lives in the kernel (its define's default) or in a routing
    function. Raises nothing: a switch without such a variable is left out."""
    out = {}
    for env in ENGINE_SWITCHES:
        mod, attr = _ALIASES.get(env, (None, env.removeprefix("GGUF_HARNESS_")))
        for m in (mod,) if mod else _MODULES:
            if hasattr(m, attr):
                out[env] = str(getattr(m, attr))
                break
    try:
        single, split_min = ops.head_splitting()
        out["GGUF_HARNESS_ATTN_SINGLE"], out["GGUF_HARNESS_ATTN_SPLIT_MIN"] = str(single), str(split_min)
    except ValueError:  # a non-integer setting: the attention node raises it where it is used
        pass
    return out


def check() -> None:
    """Refuse a bad engine switch value before a model is read or a weight uploaded: each switch of
    harness.machine.ENGINE_SWITCHES through its own validator where one exists without a GPU
    (module.diag_defines, module.gemv_pf_defines, ops.kv9_defines with its wide and queue builds,
    the P2 routing, ops.tma_defines, gemv_mma's, the PDL mode, deltanet's GDN_CSPLIT / _EARLY / _CONV, the
    attention splits), else by the values the engine's use of it accepts (tests/test_switches.py
    sets every one to a bad value). Raises harness.errors.ConfigError naming the variable (the
    validators' ValueError), which the CLI reports as an error line."""
    from harness.errors import ConfigError
    try:
        module.diag_defines()
        module.gemv_pf_defines()
        ops.kv9_wide_defines(ops.kv9_defines())
        ops.kv9_p2_types(), ops.kv9_p2_max_k(), ops.kv9_p2_min_rows()
        ops.tma_defines()
        gemv_mma.mma_defines()
        gemv_mma.mma_types()
        gemv_tcr.check_switches()
        deltanet_ops.check_switches()  # GDN_CSPLIT, GDN_EARLY, GDN_CONV and their combinations
        for env, val, ok in (("GGUF_HARNESS_GEMV_KQ_MIXED", ops.GEMV_KQ_MIXED, ("split", "beside", "one")),
                             ("GGUF_HARNESS_GEMV_KQ_Q0", ops.GEMV_KQ_Q0, ("0", "1")),
                             ("GGUF_HARNESS_GEMV_KQ_IQ3S", ops.GEMV_KQ_IQ3S, ("0", "1")),
                             ("GGUF_HARNESS_GEMV_KQ_IQ3S_GRID", ops.GEMV_KQ_IQ3S_GRID, ("",) + ops.KQ_IQ3S_GRIDS),
                             ("GGUF_HARNESS_GEMV_TMA", ops.GEMV_TMA, ("", "0", "1")),
                             ("GGUF_HARNESS_PDL", launch.MODE, ("on", "off")),
                             ("GGUF_HARNESS_GEMV", ops.GEMV_IMPL, ops.GEMV_IMPLS),
                             ("GGUF_HARNESS_GEMV_ARGS", ops.GEMV_ARGS, ("value", "pointer")),
                             ("GGUF_HARNESS_GEMV_KQ", ops.GEMV_KQ, ops.GEMV_KQ_MODES),
                             ("GGUF_HARNESS_ATTN", ops.ATTN_IMPL, ("head", "gqa", "v3")),
                             ("GGUF_HARNESS_GEMV_KQ_SPLIT", ops.GEMV_KQ_SPLIT,
                              ("auto",) + tuple(str(s) for s in ops.KV9_SPLITS))):
            if val not in ok:
                raise ValueError(f"{env}={val!r}: expected one of {', '.join(repr(v) for v in ok)}")
        for env, val in (("GGUF_HARNESS_GEMV_TMA_MIN_K", ops.GEMV_TMA_MIN_K), ("GGUF_HARNESS_GEMV_TMA_RING", ops.GEMV_TMA_RING),
                         ("GGUF_HARNESS_GEMV_TMA_BPS", ops.GEMV_TMA_BPS),
                         ("GGUF_HARNESS_GEMV_MMA_MIN_ROWS", gemv_mma.GEMV_MMA_MIN_ROWS)):
            if val and not (val.isascii() and val.isdigit()):
                raise ValueError(f"{env}={val!r}: expected a whole number")
        try:
            ops.head_splitting()
        except ValueError:
            raise ValueError(f"GGUF_HARNESS_ATTN_SINGLE={os.environ.get('GGUF_HARNESS_ATTN_SINGLE')!r} / "
                             f"GGUF_HARNESS_ATTN_SPLIT_MIN={os.environ.get('GGUF_HARNESS_ATTN_SPLIT_MIN')!r}: "
                             f"expected whole numbers") from None
    except ValueError as e:
        raise ConfigError(f"engine switch: {e}") from None


def check_for(what: str, allow_diag: bool = False) -> None:
    """check(), then refuse a GGUF_HARNESS_DIAG build (timing only, values wrong by design) unless
    allow_diag: `harness bench nodes` and `bench kernels` time such builds, `what` (e.g.
    "verify") would report its wrong values. Raises harness.errors.ConfigError."""
    from harness.errors import ConfigError
    check()
    if not allow_diag and module.diag_defines():
        raise ConfigError(f"GGUF_HARNESS_DIAG={module.DIAG}: a timing-only build whose values are wrong by "
                          f"design; `harness bench nodes` runs it, {what} does not: unset it")
