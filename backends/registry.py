"""Backend names -> implementations, imported lazily (a missing optional dependency only
makes that one backend unavailable).

    llamacpp  backends.llamacpp:LlamaCppBackend   needs llama_cpp (llama-cpp-python)
    oracle    backends.oracle:OracleBackend       float64 numpy reference, always there
    engine    backends.engine:EngineBackend       needs CuPy and an NVIDIA GPU
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Callable

from harness.errors import ConfigError, UnsupportedError

from .base import Backend
from .proc import BackendProxy

TARGETS = {
    "llamacpp": "backends.llamacpp:LlamaCppBackend",
    "oracle": "backends.oracle:OracleBackend",
    "engine": "backends.engine:EngineBackend",
}


def _module_of(target: str) -> str:
    return target.partition(":")[0]


def _module_missing(target: str) -> str | None:
    try:
        found = importlib.util.find_spec(_module_of(target)) is not None
    except ImportError:
        found = False
    return None if found else f"module {_module_of(target)} is not present"


def _llamacpp_reason() -> str | None:
    try:
        importlib.import_module("llama_cpp")
    except Exception as exc:  # noqa: BLE001 - ImportError, or OSError from the shared library
        return f"llama_cpp does not import ({type(exc).__name__}: {exc}); pip install llama-cpp-python"
    return _module_missing(TARGETS["llamacpp"])


def _oracle_reason() -> str | None:
    return _module_missing(TARGETS["oracle"])


def _engine_reason() -> str | None:
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed (pip install .[gpu])"
    try:
        import cupy
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - no driver, no device, ...
        return f"no usable CUDA device ({type(exc).__name__}: {exc})"
    if n < 1:
        return "no CUDA device found"
    return _module_missing(TARGETS["engine"])


_CHECKS: dict[str, Callable[[], str | None]] = {
    "llamacpp": _llamacpp_reason,
    "oracle": _oracle_reason,
    "engine": _engine_reason,
}


def available_backends() -> dict[str, str | None]:
    """{name: None if usable here, else the reason it is not}, for every known backend."""
    return {name: check() for name, check in _CHECKS.items()}


def create(name: str, in_child: bool = True, **proxy_opts: Any) -> Backend:
    """A new, not yet loaded backend `name`.

    in_child: run it in its own process (backends.proc.BackendProxy) so that a crash raises
    BackendCrash instead of killing the caller; proxy_opts (call_timeout_s, start_timeout_s,
    label) go to the proxy. Raises ConfigError (unknown name), UnsupportedError (not
    available here, with the reason).
    """
    if name not in TARGETS:
        raise ConfigError(f"unknown backend {name!r}; known: {', '.join(TARGETS)}")
    reason = _CHECKS[name]()
    if reason is not None:
        raise UnsupportedError(f"backend {name!r} is not available: {reason}")
    target = TARGETS[name]
    if in_child:
        return BackendProxy(target, label=proxy_opts.pop("label", name), **proxy_opts)
    if proxy_opts:
        raise ConfigError(f"options {sorted(proxy_opts)} only apply with in_child=True")
    module, _, qualname = target.partition(":")
    return getattr(importlib.import_module(module), qualname)()
