"""The engine switches' effective values, for results.

harness.machine records the GGUF_HARNESS_* variables that were *set*; what an unset one meant
depends on the version (GGUF_HARNESS_GEMV_KQ_CSPLIT unset meant clusters of 2 in sessions 16-17
and groups of S since 18). effective() reads the module variable each switch sets, so a result
says what ran, whatever the defaults were then.
"""
from __future__ import annotations

from harness.machine import ENGINE_SWITCHES

from . import deltanet_ops, gemv_mma, launch, module, ops

# switches whose variable is not named after them (env name minus GGUF_HARNESS_)
_ALIASES = {"GGUF_HARNESS_GEMV": (ops, "GEMV_IMPL"), "GGUF_HARNESS_ATTN": (ops, "ATTN_IMPL"),
            "GGUF_HARNESS_PDL": (launch, "MODE")}
_MODULES = (ops, deltanet_ops, gemv_mma, launch, module)


def effective() -> dict[str, str]:
    """{switch name: the value the engine runs with, as a string} for every ENGINE_SWITCHES name
    the engine reads into a module variable (ops, deltanet_ops, gemv_mma, launch, module), plus
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
