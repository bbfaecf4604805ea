"""Token feeding shared by the float64 reference models (qwen2, qwen35): id checks, context
bounds, prompt batching, the embedding -> layers walk and named-intermediate capture. A model
class provides n_vocab, n_ctx, n_past, params.n_layer, weights, capture,
_layer(il, x [n, d], pos [n]) -> x and _head(hidden [1, d]) -> float64 logits [n_vocab];
optionally _head_rows(hidden [n, d]) -> [n, n_vocab] (one LM-head product for n rows) and
_save_state() / _load_state(saved) for recurrent state (see rewind).

Speculative verification (harness.speculative) uses logits_rows (logits of every fed
position from one batched pass) and rewind (drop rejected draft tokens)."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from harness.errors import ConfigError

UBATCH = 512  # prompt tokens per forward pass (bounds the [H, n, n_kv] score temporaries)
MAX_LOGITS_BYTES = 4 << 30  # refuse to return more float64 logits than this from one call


class TokenSequence:
    recurrent_state = False  # True: state beyond the KV cache (_save_state / _load_state)
    _saved: tuple | None = None  # (position, recurrent state) saved by logits_rows

    def prefill(self, tokens: Sequence[int]) -> np.ndarray:
        """Feed tokens from the current position, in batches of UBATCH; float64 [n_vocab]
        logits after the last. Raises ConfigError (empty input, context overflow, token id
        outside the vocabulary or not an integer)."""
        toks = [self._check_id(t, k) for k, t in enumerate(tokens)]
        if not toks:
            raise ConfigError("prefill needs at least one token")
        if self.n_past + len(toks) > self.n_ctx:
            raise ConfigError(f"context overflow: {self.n_past} cached + {len(toks)} new tokens "
                              f"> n_ctx {self.n_ctx}")
        for s in range(0, len(toks), UBATCH):
            hidden = self._forward(toks[s:s + UBATCH])
        return self._head(hidden[-1:])

    def step(self, token: int) -> np.ndarray:
        """Feed one token; float64 [n_vocab] logits for the next position."""
        return self.prefill([token])

    def logits_rows(self, tokens: Sequence[int], first: int = 0) -> np.ndarray:
        """Feed tokens as prefill does (UBATCH per forward pass) and return the float64
        logits after each of tokens[first:]: [len(tokens) - first, n_vocab]; row r predicts
        the token after tokens[first + r]. Rows before `first` skip the LM head.

        The rows equal what prefill()/step() would give for the same positions up to float64
        summation order (a matrix product of n rows may group its sums differently from one
        of 1 row). Models with recurrent state feed tokens[:first + 1] and tokens[first + 1:]
        as two batches and save the state between them (see rewind): two passes over the
        weights. Raises ConfigError as prefill, and when first is outside [0, len(tokens))
        or the rows would take more than MAX_LOGITS_BYTES."""
        toks = [self._check_id(t, k) for k, t in enumerate(tokens)]
        if not 0 <= first < len(toks):
            raise ConfigError(f"logits_rows: first {first} is outside [0, {len(toks)})")
        n_rows = len(toks) - first
        if n_rows * self.n_vocab * 8 > MAX_LOGITS_BYTES:
            raise ConfigError(f"logits_rows: {n_rows} rows x {self.n_vocab} float64 logits "
                              f"> {MAX_LOGITS_BYTES >> 30} GiB")
        if self.n_past + len(toks) > self.n_ctx:
            raise ConfigError(f"context overflow: {self.n_past} cached + {len(toks)} new tokens "
                              f"> n_ctx {self.n_ctx}")
        if not self.recurrent_state:
            return self._rows(toks, first)
        rows = self._rows(toks[:first + 1], first)
        self._saved = (self.n_past, self._save_state())
        if first + 1 < len(toks):
            rows = np.concatenate([rows, self._rows(toks[first + 1:], 0)])
        return rows

    def _rows(self, toks: list[int], first: int) -> np.ndarray:
        """Feed toks in UBATCH batches; logits [len(toks) - first, n_vocab] of toks[first:]."""
        out = []
        for s in range(0, len(toks), UBATCH):
            hidden = self._forward(toks[s:s + UBATCH])
            lo = max(first - s, 0)
            if lo < len(hidden):
                out.append(self._head_rows(hidden[lo:]))
        return np.concatenate(out)

    def rewind(self, n_past: int) -> int:
        """Go back to holding the first n_past fed tokens as far as the model's state allows;
        returns the position now held (<= n_past): the caller feeds tokens[returned:n_past]
        again before going on.

        Attention-only models (qwen2): the KV cache is indexed by position and attention
        reads rows < pos + 1 only, so setting n_past is exact; later rows are stale and get
        overwritten. Models with recurrent state (qwen35's DeltaNet conv and delta-rule
        states, which cannot be undone token by token): the state that the last logits_rows
        call saved after tokens[first] is restored (one copy of the state per call, no
        per-token snapshots); rewinding to an earlier position raises ConfigError. A
        speculative pass feeds accepted tokens + [last id] + draft with first at the last
        id, so only the accepted draft tokens are fed again.
        """
        n_past = int(n_past)
        if not 0 <= n_past <= self.n_past:
            raise ConfigError(f"rewind to {n_past}: the sequence holds {self.n_past} tokens")
        if n_past == self.n_past or not self.recurrent_state:
            self.n_past = n_past
            return n_past
        at, state = self._saved or (None, None)
        if at is None or at > n_past:
            raise ConfigError(f"rewind to {n_past}: the recurrent state was saved at {at}")
        self._load_state(state)
        self.n_past = at
        return at

    def _save_state(self):
        """A copy of the recurrent state (models with recurrent_state = True)."""
        raise NotImplementedError

    def _load_state(self, saved) -> None:
        """Make a state returned by _save_state the current one."""
        raise NotImplementedError

    def _head_rows(self, hidden: np.ndarray) -> np.ndarray:
        """Logits [n, n_vocab] after each hidden row [n, d]; row by row unless the model
        class batches its LM head."""
        return np.stack([self._head(hidden[r:r + 1]) for r in range(len(hidden))])

    def _check_id(self, t, k: int) -> int:
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise ConfigError(f"token #{k} is {t!r}, not an integer id")
        if not 0 <= int(t) < self.n_vocab:
            raise ConfigError(f"token #{k} = {int(t)} is outside the vocabulary [0, {self.n_vocab})")
        return int(t)

    def _node(self, name: str, il: int, arr: np.ndarray) -> np.ndarray:
        """A named intermediate (llama.cpp cb() name; il = -1 outside the layers) goes to the
        capture callback; returned so subclasses may substitute it (fault injection)."""
        if self.capture is not None:
            self.capture(name, il, arr)
        return arr

    def _forward(self, toks: list[int]) -> np.ndarray:
        """Run all layers on a batch at positions n_past..; returns hidden [n, d] float64."""
        if self._saved is not None and self.n_past < self._saved[0]:
            self._saved = None  # fed again from before the save (reset): it is stale
        x = self._node("inp_embd", -1, self.weights.rows64("token_embd.weight", toks))  # get_rows
        pos = np.arange(self.n_past, self.n_past + len(toks))
        for il in range(self.params.n_layer):
            x = self._layer(il, x, pos)
        self.n_past += len(toks)
        return x
