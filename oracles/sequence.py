"""Token feeding shared by the float64 reference models (qwen2, qwen35): id checks, context
bounds, prompt batching. A model class provides n_vocab, n_ctx, n_past, _forward(ids) ->
hidden [n, d] (advancing n_past) and _head(hidden [1, d]) -> float64 logits [n_vocab]."""
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
