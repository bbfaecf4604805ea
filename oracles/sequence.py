"""Token feeding shared by the float64 reference models (qwen2, qwen35): id checks, context
bounds, prompt batching, the embedding -> layers walk and named-intermediate capture. A model
class provides n_vocab, n_ctx, n_past, params.n_layer, weights, capture,
_layer(il, x [n, d], pos [n]) -> x and _head(hidden [1, d]) -> float64 logits [n_vocab]."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from harness.errors import ConfigError

UBATCH = 512  # prompt tokens per forward pass (bounds the [H, n, n_kv] score temporaries)


class TokenSequence:
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
        x = self._node("inp_embd", -1, self.weights.rows64("token_embd.weight", toks))  # get_rows
        pos = np.arange(self.n_past, self.n_past + len(toks))
        for il in range(self.params.n_layer):
            x = self._layer(il, x, pos)
        self.n_past += len(toks)
        return x
