"""Backend variants: one backend under other valid settings, compared as a backend of its own.

`--backends llamacpp,llamacpp@no-flash-attn --reference llamacpp` runs llama.cpp twice, the
second time with flash attention off, and compares the two like any backend and reference
(token ids, teacher-forced top-1, KL): the reference's agreement with itself under another of
its supported configurations. That is the noise floor a top-1 or KL gate against that reference
has to be read against: a gate stricter than the reference's agreement with itself fails on
the reference's own rounding, not on the backend under test (docs/perf-notes.md, session 39).

Spec: NAME@VARIANT[+VARIANT...], each VARIANT one entry of VARIANTS (RunConfig fields set on
top of the run's settings), allowed only for the backends its entry names.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from .config import RunConfig
from .errors import ConfigError

SEP, JOIN = "@", "+"

# variant -> (backends it applies to, RunConfig fields it sets)
VARIANTS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "no-flash-attn": (("llamacpp",), {"flash_attn": False}),  # ggml's soft_max attention path
    "flash-attn": (("llamacpp",), {"flash_attn": True}),
    "kv-f32": (("llamacpp",), {"kv_type": "f32"}),
    # the prompt fed one token per batch: llama.cpp's batch-1 matrix-vector kernels for the
    # prompt instead of its batched matrix-matrix ones
    "ubatch-1": (("llamacpp",), {"n_batch": 1, "n_ubatch": 1}),
    # token_embd in page-locked host memory (one row sent per token), or in device memory
    "embd-host": (("engine",), {"embd_placement": "host"}),
    "embd-device": (("engine",), {"embd_placement": "device"}),
}


def base(spec: str) -> str:
    """The backend name of a spec, not checked ('llamacpp' of 'llamacpp@kv-f32')."""
    return spec.partition(SEP)[0]


def split(spec: str) -> tuple[str, tuple[str, ...]]:
    """(backend name, variant names) of a backend spec; ('llamacpp', ()) for a plain name.

    Raises ConfigError for an empty, unknown, repeated or inapplicable variant."""
    name, sep, rest = spec.partition(SEP)
    if not sep:
        return spec, ()
    names = tuple(rest.split(JOIN))
    for v in names:
        if v not in VARIANTS:
            raise ConfigError(f"backend {spec!r}: unknown variant {v!r}; known: "
                              f"{', '.join(sorted(VARIANTS))}")
        if name not in VARIANTS[v][0]:
            raise ConfigError(f"backend {spec!r}: variant {v!r} applies to "
                              f"{', '.join(VARIANTS[v][0])} only")
    if len(set(names)) != len(names):
        raise ConfigError(f"backend {spec!r} names a variant twice")
    return name, names


def overrides(spec: str) -> dict[str, Any]:
    """The RunConfig fields a spec sets ({} for a plain name); ConfigError when two of its
    variants set one field differently (e.g. flash-attn+no-flash-attn)."""
    out: dict[str, Any] = {}
    for v in split(spec)[1]:
        for k, val in VARIANTS[v][1].items():
            if k in out and out[k] != val:
                raise ConfigError(f"backend {spec!r}: its variants set {k} both ways")
            out[k] = val
    return out


def apply(spec: str, cfg: RunConfig) -> RunConfig:
    """cfg with the spec's variant fields set (RunConfig validates the result)."""
    o = overrides(spec)
    return replace(cfg, **o) if o else cfg


class VariantBackend:
    """A backend whose load() sees the variant's settings (apply); everything else is the
    inner backend's (tokenize, bench, info, ...). name is the full spec, as results record it."""

    def __init__(self, spec: str, inner):
        self.name, self._inner = spec, inner

    def load(self, model, cfg: RunConfig) -> None:
        self._inner.load(model, apply(self.name, cfg))

    def __getattr__(self, attr):
        return getattr(self._inner, attr)


def wrap_create(create: Callable[[str], Any]) -> Callable[[str], Any]:
    """create(name) -> backend that also takes NAME@VARIANT specs (the variant is checked
    before create runs, so a bad spec raises ConfigError before any backend starts)."""
    def make(spec: str):
        name, names = split(spec)
        if not names:
            return create(spec)
        overrides(spec)  # contradicting variants, before a child process starts
        return VariantBackend(spec, create(name))
    return make


def describe(specs) -> dict[str, dict[str, Any]]:
    """{spec: the RunConfig fields it sets} for the specs that carry variants (for results)."""
    return {s: overrides(s) for s in specs if split(s)[1]}
