"""Greedy and teacher-forced generation on token ids, compared step by step to a reference.

Protocol (docs/sources.md §3): prefill the prompt ids, take the argmax of the logits as the next
token, feed it with step(), repeat until n_predict tokens exist (so n_predict - 1 decode
steps). Teacher-forced mode feeds the reference's ids instead of the backend's own argmax,
so the logits stay comparable after a divergence.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from . import metrics
from .errors import NumericError

GREEDY = "greedy"
TEACHER_FORCED = "teacher_forced"


@dataclass
class Trace:
    """One backend's generation: ids [n_predict], per-step records, timings in seconds."""

    backend: str
    mode: str
    n_ctx: int
    ids: list[int] = field(default_factory=list)
    steps: list[dict] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    status: str = "ok"
    error: str | None = None
    speculative: dict | None = None  # reference only: harness.speculative's pass statistics


def _logits64(backend, out: np.ndarray) -> np.ndarray:
    """The backend's most precise logits: float64 from the oracle, else the float32 output."""
    hi = getattr(backend, "last_logits64", None)  # a child-process proxy answers any name
    return np.asarray(hi if isinstance(hi, np.ndarray) else out, dtype=np.float64)


def generate(backend, prompt_ids: Sequence[int], n_predict: int, *,
             forced: Sequence[int] | None = None,
             on_logits: Callable[[int, np.ndarray, np.ndarray], None] | None = None,
             ) -> tuple[list[int], float, float]:
    """Run prefill + (n_predict - 1) steps; returns (ids, prefill seconds, decode seconds).

    on_logits(i, logits32, logits64) is called for every position i in [0, n_predict) with
    the logits that predict token i. forced: ids to feed instead of the argmax.
    """
    backend.reset()
    t0 = time.perf_counter()
    out = backend.prefill(list(prompt_ids))
    t1 = time.perf_counter()
    ids: list[int] = []
    for i in range(n_predict):
        hi = _logits64(backend, out)
        if on_logits:
            on_logits(i, np.asarray(out, dtype=np.float32), hi)
        ids.append(int(np.argmax(hi)))
        if i + 1 < n_predict:
            out = backend.step(int(forced[i]) if forced is not None else ids[-1])
    return ids, t1 - t0, time.perf_counter() - t1


def run_reference(backend, name: str, prompt_ids, n_predict: int, n_ctx: int,
                  progress: Callable[[], None] | None = None) -> tuple[Trace, np.ndarray]:
    """Greedy run of the reference; returns its trace and its logits [n_predict, n_vocab] f64."""
    rows: list[np.ndarray] = []
    trace = Trace(name, GREEDY, n_ctx)

    def record(i, l32, l64):
        bad = int((~np.isfinite(l64)).sum())
        if bad:  # a reference with NaN/Inf makes every comparison meaningless: stop here
            raise NumericError(f"reference {name}: {bad} non-finite logits at generated "
                               f"position {i}; the reference must be finite")
        rows.append(l64)
        trace.steps.append({"i": i, "logits_sha256": metrics.logits_sha256(l32)})
        if progress:
            progress()

    trace.ids, trace.prefill_s, trace.decode_s = generate(backend, prompt_ids, n_predict,
                                                          on_logits=record)
    for s, t in zip(trace.steps, trace.ids):
        s["token"] = t
    return trace, np.stack(rows)


def run_compared(backend, name: str, mode: str, prompt_ids, ref_ids: Sequence[int],
                 ref_logits: np.ndarray, n_ctx: int,
                 progress: Callable[[], None] | None = None) -> Trace:
    """Greedy or teacher-forced run of `backend`, every step compared with the reference.

    In greedy mode a step is compared only while the backend's ids so far equal the
    reference's (after a divergence the two condition on different text).
    """
    trace = Trace(name, mode, n_ctx)
    same = [True]  # greedy: have the backend's ids equalled the reference's so far?

    def record(i, l32, l64):
        rec = {"i": i, "logits_sha256": metrics.logits_sha256(l32),
               "nonfinite": int((~np.isfinite(l32)).sum())}
        if mode == TEACHER_FORCED or same[0]:
            rec.update(metrics.compare(ref_logits[i], l32))
        same[0] = same[0] and int(np.argmax(l64)) == ref_ids[i]
        trace.steps.append(rec)
        if progress:
            progress()

    forced = ref_ids if mode == TEACHER_FORCED else None
    trace.ids, trace.prefill_s, trace.decode_s = generate(
        backend, prompt_ids, len(ref_ids), forced=forced, on_logits=record)
    for s, t in zip(trace.steps, trace.ids):
        s["token"] = t
    return trace
