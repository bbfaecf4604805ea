"""The `oracle` backend: the float64 numpy reference forward behind the Backend protocol.

Logits are returned as float32 [n_vocab] as the protocol asks; the float64 logits of the
last call stay available as `last_logits64` so verification can measure other backends'
error against float64. The architecture is read from the file (general.architecture) and
dispatched through ORACLES; others raise UnsupportedError. Capability "capture": set
`capture` to a callback(name, layer, array) to receive named float64 intermediates
(oracles.qwen2 lists the names). Capability "logits_rows": logits_rows(tokens, first) gives
the float64 logits of every fed position from one batched pass and rewind(n_past) drops
tokens again (oracles.sequence; used by harness.speculative). Dequantised weights can be
cached on disk: pass cache_dir, or set $GGUF_HARNESS_ORACLE_CACHE.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from harness.config import ModelRef, RunConfig
from harness.errors import ConfigError, UnsupportedError
from harness.gguf_file import open_gguf

from .base import CAP_CAPTURE, CAP_LOGITS_ROWS

CACHE_ENV = "GGUF_HARNESS_ORACLE_CACHE"


def _oracle_class(arch: str):
    if arch == "qwen2":
        from oracles.qwen2 import Qwen2Oracle
        return Qwen2Oracle
    if arch == "qwen35":
        from oracles.qwen35 import Qwen35Oracle
        return Qwen35Oracle
    raise UnsupportedError(f"the float64 oracle has no forward for architecture {arch!r} "
                           "(supported: qwen2, qwen35)")


class OracleBackend:
    """Backend protocol (backends/base.py) on oracles.<arch>. Extras: last_logits64,
    capture (settable callback), load_seconds, n_vocab, pos."""

    name = "oracle"

    def __init__(self, cache_dir: str | os.PathLike | None = None,
                 capture: Callable[[str, int, np.ndarray], None] | None = None,
                 kv_round: str | None = None, act_round: str | None = None) -> None:
        env = os.environ.get(CACHE_ENV)
        self._kv_round = kv_round  # "f16": emulate an fp16 KV cache (kernel tests)
        self._act_round = act_round  # "engine": the engine's GEMV input rounding (qwen2)
        self._cache_dir = Path(cache_dir) if cache_dir else (Path(env) if env else None)
        self._capture = capture
        self._oracle = None
        self.last_logits64: np.ndarray | None = None
        self.load_seconds = 0.0

    @property
    def capture(self):
        return self._capture

    @capture.setter
    def capture(self, fn) -> None:
        self._capture = fn
        if self._oracle is not None:
            self._oracle.capture = fn

    def load(self, model: ModelRef, cfg: RunConfig) -> None:
        """Open and dequantise `model`; cfg.n_ctx sizes the float64 KV cache (other fields
        are llama.cpp settings the oracle has no use for). Raises ModelError /
        UnsupportedError / ConfigError."""
        self.close()
        arch = open_gguf(model.path).arch  # header only: cheap, and checks the file first
        cls = _oracle_class(arch)
        extra = {"kv_round": self._kv_round} if self._kv_round else {}
        if self._act_round:
            extra["act_round"] = self._act_round
        self._oracle = cls(model.path, n_ctx=cfg.n_ctx, cache_dir=self._cache_dir,
                           sha256=model.sha256, capture=self._capture, **extra)
        self.load_seconds = self._oracle.load_seconds

    def _need(self):
        if self._oracle is None:
            raise ConfigError("oracle backend: call load() first")
        return self._oracle

    def reset(self) -> None:
        self._need().reset()
        self.last_logits64 = None

    def prefill(self, tokens: Sequence[int]) -> np.ndarray:
        """float32 [n_vocab] logits after the last token (float64 kept in last_logits64)."""
        self.last_logits64 = self._need().prefill(tokens)
        return self.last_logits64.astype(np.float32)

    def step(self, token: int) -> np.ndarray:
        """float32 [n_vocab] logits for the next position (float64 in last_logits64)."""
        self.last_logits64 = self._need().step(token)
        return self.last_logits64.astype(np.float32)

    def logits_rows(self, tokens: Sequence[int], first: int = 0) -> np.ndarray:
        """Feed tokens in one batched pass; float64 logits [len(tokens) - first, n_vocab]
        after each of tokens[first:] (oracles.sequence.TokenSequence.logits_rows)."""
        rows = self._need().logits_rows(tokens, first)
        self.last_logits64 = rows[-1]
        return rows

    def rewind(self, n_past: int) -> int:
        """Keep the first n_past tokens as far as the state allows; returns the position
        now held, <= n_past (oracles.sequence.TokenSequence.rewind)."""
        self.last_logits64 = None
        return self._need().rewind(n_past)

    def capabilities(self) -> set[str]:
        return {CAP_CAPTURE, CAP_LOGITS_ROWS}

    @property
    def n_vocab(self) -> int:
        return self._need().n_vocab

    @property
    def pos(self) -> int:
        """Tokens in the KV cache (next position)."""
        return self._need().n_past

    def close(self) -> None:
        """Drop the model (weights and KV cache are freed with it). Idempotent."""
        self._oracle = None
        self.last_logits64 = None
