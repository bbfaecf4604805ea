"""The Backend protocol every inference backend implements (docs/sources.md §5).

All methods work on token ids; text only exists at the edges (tokenisation goes through
llama.cpp). Logits are float32 numpy arrays of shape [n_vocab].
"""
from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from harness.config import ModelRef, RunConfig

# Optional capabilities a backend may report.
CAP_NODES = "nodes"        # per-node timing of one decode step
CAP_CAPTURE = "capture"    # named intermediate tensors for layer-by-layer diffs
CAP_GRAPH = "graph"        # decode step replayed as a CUDA graph
CAP_TIMINGS = "timings"    # prefill/decode wall-clock seconds
CAP_LOGITS_ROWS = "logits_rows"  # float64 logits of every fed position + rewind (oracle)
CAP_MEMORY = "memory"      # info() holds planned vs measured device memory (engine)


@runtime_checkable
class Backend(Protocol):
    """An inference backend.

    load:    open the model; raises harness.errors.ModelError / UnsupportedError.
    reset:   empty the KV cache and any recurrent state (position back to 0).
    prefill: feed tokens (list of int, len >= 1) from the current position; returns the
             float32 [n_vocab] logits after the last one.
    step:    feed one token; returns float32 [n_vocab] logits for the next position.
    """

    name: str

    def load(self, model: ModelRef, cfg: RunConfig) -> None: ...

    def reset(self) -> None: ...

    def prefill(self, tokens: Sequence[int]) -> np.ndarray: ...

    def step(self, token: int) -> np.ndarray: ...

    def capabilities(self) -> set[str]: ...

    def close(self) -> None: ...
