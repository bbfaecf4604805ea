"""The `llamacpp` backend: llama.cpp through llama-cpp-python 0.3.36's low-level ctypes API.

One model, one context, one sequence (seq_id 0). Positions are tracked here: prefill feeds
tokens at positions pos, pos+1, ... in batches of at most n_batch with the output (logits) flag
set on the very last token only; step feeds one token at the next position. Logits are copied
out of llama.cpp's buffer (llama.h: llama_get_logits_ith) as float32 [n_vocab].
llama.cpp may crash the process on bad input; run it through backends.proc to survive that.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

import llama_cpp
import numpy as np

from harness.config import ModelRef, RunConfig
from harness.errors import BackendCrash, ConfigError, ModelError, UnsupportedError

from ..base import CAP_TIMINGS
from . import info, logs, params, vocab

GGUF_MAGIC = b"GGUF"   # gguf-py constants.GGUF_MAGIC, little-endian file start
_backend_ready = False


def _init_backend() -> None:
    """llama_backend_init once per process (llama.h: 'call once at the start')."""
    global _backend_ready
    if not _backend_ready:
        logs.capture()
        llama_cpp.llama_backend_init()
        _backend_ready = True


def check_gguf_file(path: Path) -> None:
    """ModelError unless `path` is a readable file that starts with the GGUF magic."""
    if not path.is_file():
        raise ModelError(f"model file not found: {path}")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelError(f"model file {path} cannot be read: {exc}") from exc
    if magic != GGUF_MAGIC:
        raise ModelError(f"{path} is not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")


def _log_hint() -> str:
    lines = logs.capture().problems()
    return ("; llama.cpp says: " + " | ".join(lines)) if lines else ""


class LlamaCppBackend:
    """Backend protocol (backends/base.py) on llama.cpp. Extra: tokenize, detokenize,
    pieces, model_info, timings, reset_timings."""

    name = "llamacpp"

    def __init__(self) -> None:
        self._model = None
        self._ctx = None
        self._batch = None
        self._vocab = None
        self._ref: ModelRef | None = None
        self._cfg: RunConfig | None = None
        self.n_vocab = 0
        self.pos = 0     # next position to fill; == number of tokens in the KV cache
        self._times = info.Timings()

    # ---- Backend protocol ---------------------------------------------------------------
    def load(self, model: ModelRef, cfg: RunConfig) -> None:
        """Open `model` with `cfg`. Raises ModelError (missing, not GGUF, rejected by
        llama.cpp) or UnsupportedError (context creation refused, e.g. q8_0 V cache
        without flash attention), both quoting llama.cpp's log."""
        self.close()
        path = Path(model.path)
        check_gguf_file(path)
        _init_backend()
        logs.capture().clear()
        t0 = time.perf_counter()
        self._model = llama_cpp.llama_model_load_from_file(str(path).encode(), params.model_params(cfg))
        if not self._model:
            self._model = None
            raise ModelError(f"llama.cpp could not load {path}{_log_hint()}")
        self._ctx = llama_cpp.llama_init_from_model(self._model, self._context_params(cfg))
        if not self._ctx:
            hint = _log_hint()
            self.close()
            raise UnsupportedError(f"llama.cpp refused a context for {path.name} with "
                                   f"{cfg.to_json()}{hint}")
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        self._batch = self._new_batch(cfg.n_batch)
        self._ref, self._cfg, self.pos = model, cfg, 0
        self._times = info.Timings(load_s=time.perf_counter() - t0)

    def _context_params(self, cfg: RunConfig):
        """llama_context_params for cfg; subclasses extend it (capture.py sets cb_eval)."""
        return params.context_params(cfg)

    def reset(self) -> None:
        """Clear the KV cache (data too: llama_memory_clear(mem, true)) and go to position 0."""
        self._need_loaded()
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self._ctx), True)
        self.pos = 0

    def prefill(self, tokens: Sequence[int]) -> np.ndarray:
        """Feed `tokens` (len >= 1) from the current position; float32 [n_vocab] logits of the
        last one. Raises ConfigError (bad id, context full), BackendCrash (llama_decode failed)."""
        ids = self._checked(tokens)
        t0 = time.perf_counter()
        logits = self._feed(ids)
        self._times.add_prefill(time.perf_counter() - t0, len(ids))
        return logits

    def step(self, token: int) -> np.ndarray:
        """Feed one token at the next position; float32 [n_vocab] logits for the next one."""
        ids = self._checked([token])
        t0 = time.perf_counter()
        logits = self._feed(ids)
        self._times.add_decode(time.perf_counter() - t0)
        return logits

    def bench(self, prompt: Sequence[int], n_decode: int, reps: int) -> dict:
        """Throughput like llama-bench: per repetition, empty the cache, prefill `prompt` in
        one call, then n_decode single-token llama_decode calls (tokens cycled from the
        prompt, logits not read, as llama-bench's tg does), synchronising after each.
        Returns {"prefill_s": [reps], "decode_s": [reps], "decode_window": [reps x [start,
        end]]} (host clock around synchronised work; the whole loop runs inside this process, no
        IPC in the timed region); decode_window: the decode loop's ends in time.monotonic()
        seconds (system-wide, so the parent's GPU-state sampler can match them: harness/gpu_state.py
        window_energy_j)."""
        ids = self._checked(prompt)
        if self.pos + ids.size + n_decode > self._cfg.n_ctx:
            raise ConfigError(f"bench needs {ids.size + n_decode} positions > n_ctx {self._cfg.n_ctx}")
        out = {"prefill_s": [], "decode_s": [], "decode_window": []}
        for _ in range(reps):
            self.reset()
            t0 = time.perf_counter()
            self._feed(ids)
            llama_cpp.llama_synchronize(self._ctx)
            t1, m1 = time.perf_counter(), time.monotonic()
            for i in range(n_decode):
                self._decode(ids[i % ids.size: i % ids.size + 1], logits_last=True)
                llama_cpp.llama_synchronize(self._ctx)
            t2, m2 = time.perf_counter(), time.monotonic()
            out["prefill_s"].append(t1 - t0)
            out["decode_s"].append(t2 - t1)
            out["decode_window"].append([m1, m2])
        self.reset()
        return out

    def capabilities(self) -> set[str]:
        return {CAP_TIMINGS}

    def close(self) -> None:
        """Free batch, context and model (in that order). Idempotent."""
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx is not None:
            llama_cpp.llama_free(self._ctx)
            self._ctx = None
        if self._model is not None:
            llama_cpp.llama_model_free(self._model)
            self._model = None
        self._vocab = None

    # ---- extras ---------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of `text`; add_special adds BOS/EOS where the model's metadata asks."""
        self._need_loaded()
        return vocab.tokenize(self._vocab, text, add_special, parse_special)

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of `ids`, piece by piece (special tokens rendered), for display."""
        self._need_loaded()
        return vocab.detokenize(self._vocab, [self._checked_id(i, k) for k, i in enumerate(ids)])

    def pieces(self, ids: Sequence[int]) -> list[bytes]:
        """Raw bytes of each token (a piece may hold part of a UTF-8 character)."""
        self._need_loaded()
        return [vocab.piece(self._vocab, self._checked_id(i, k)) for k, i in enumerate(ids)]

    def model_info(self) -> dict:
        """Architecture and size facts plus llama.cpp build info; see backends.llamacpp.info."""
        self._need_loaded()
        return info.model_info(self._model, self._vocab, self._ref, self._cfg)

    def timings(self) -> dict:
        """Wall-clock seconds (prefill_s, decode_s, load_s), counts, and llama_perf_context."""
        self._need_loaded()
        return self._times.to_json() | {"llama_perf": info.perf(self._ctx)}

    def reset_timings(self) -> None:
        self._need_loaded()
        self._times = info.Timings(load_s=self._times.load_s)
        llama_cpp.llama_perf_context_reset(self._ctx)

    # ---- internals ------------------------------------------------------------------------
    @staticmethod
    def _new_batch(n: int):
        batch = llama_cpp.llama_batch_init(n, 0, 1)
        for i in range(n):  # one sequence: these never change
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
        return batch

    def _need_loaded(self) -> None:
        if self._ctx is None:
            raise ConfigError("llamacpp backend: call load() first")

    def _checked_id(self, t, k: int) -> int:
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise ConfigError(f"token #{k} is {t!r}, not an integer id")
        if not 0 <= int(t) < self.n_vocab:
            raise ConfigError(f"token #{k} = {int(t)} is outside the vocabulary [0, {self.n_vocab})")
        return int(t)

    def _checked(self, tokens: Sequence[int]) -> np.ndarray:
        self._need_loaded()
        ids = np.array([self._checked_id(t, k) for k, t in enumerate(tokens)], dtype=np.int32)
        if ids.size == 0:
            raise ConfigError("prefill needs at least one token")
        if self.pos + ids.size > self._cfg.n_ctx:
            raise ConfigError(f"context full: {self.pos} tokens cached + {ids.size} new > "
                              f"n_ctx {self._cfg.n_ctx}")
        return ids

    def _feed(self, ids: np.ndarray) -> np.ndarray:
        n_batch = self._cfg.n_batch
        for start in range(0, ids.size, n_batch):
            chunk = ids[start:start + n_batch]
            self._decode(chunk, logits_last=start + chunk.size == ids.size)
        return self._last_logits(chunk.size - 1)

    def _decode(self, chunk: np.ndarray, logits_last: bool) -> None:
        b, n = self._batch, int(chunk.size)
        for i in range(n):
            b.token[i] = int(chunk[i])
            b.pos[i] = self.pos + i
            b.logits[i] = 0
        b.logits[n - 1] = 1 if logits_last else 0
        b.n_tokens = n
        logs.capture().clear()
        rc = llama_cpp.llama_decode(self._ctx, b)
        if rc != 0:
            hint, at = _log_hint(), self.pos
            self.reset()  # a failed decode may leave part of the batch in the cache
            raise BackendCrash(f"llama_decode returned {rc} for {n} tokens at position "
                               f"{at}; KV cache cleared{hint}")
        self.pos += n

    def _last_logits(self, i: int) -> np.ndarray:
        ptr = llama_cpp.llama_get_logits_ith(self._ctx, i)
        if not ptr:
            raise BackendCrash(f"llama_get_logits_ith({i}) returned NULL{_log_hint()}")
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).astype(np.float32, copy=True)
