"""Speculative (draft-verified) greedy run of the reference: the ids of the sequential run
(harness.verify.run_reference) from a few batched forward passes instead of n_predict.

Why: the float64 oracle's cost is weight traffic, so a pass over 200 tokens costs little
more than a pass over one, and the sequential run (prefill + n_predict - 1 one-token steps)
pays the traffic n_predict times. Another backend (llama.cpp, the engine) proposes the
continuation; the reference checks all of it in one pass.

Loop, with ids = the reference's ids so far and the reference holding (prompt + ids)[:held]:
    d = draft(ids, k)                      k <= n_predict - 1 - len(ids) proposed next ids
    rows = logits after each of (prompt + ids)[held:] + d, from the last of
           (prompt + ids)[held:] on              one batched pass: len(d) + 1 rows
    for t = 0..len(d): ids += [argmax rows[t]]; stop at the first t with argmax != d[t]
    rewind the reference to len(prompt) + len(ids) - 1 tokens (the last id is fed next)
A perfect draft needs one pass; each rejected draft token costs one more pass. k is all
that remains at first; after a rejection it shrinks to twice the accepted run (>= MIN_DRAFT)
and doubles again after each full acceptance, so a poor draft costs short passes (their
cost grows with the tokens fed, about 2 flop per weight per token) rather than long ones.

Same ids as the sequential run: rows[t] are the reference's logits given prompt + ids +
d[:t]; a drafted token stays only when it equals the argmax of the row before it, and the
first one that does not is replaced by that argmax, so by induction ids[i] = argmax(logits |
prompt + ids[:i]) for every i, the definition of the greedy run. The logits equal the
sequential run's up to float64 summation order only (a product of n rows may be summed in
another order than one of 1 row, in the BLAS and in the attention reductions), |difference|
~1e-15 relative; so the ids could differ from a sequential run only where the reference's
top-2 margin is that small: min_top2_margin is recorded. The same goes for a float32
logits SHA256 (a value on a float32 rounding boundary may round the other way).

Recurrent models (qwen35) rewind to the state saved at the start of the last pass and feed
the accepted tokens of that pass again (oracles.sequence.TokenSequence.rewind), so passes
are longer, not more numerous. A draft that raises, or returns ids that are not valid,
stops drafting: the run goes on one token per pass, which is the sequential run (same code
path as step()); the error and the position are recorded. A reference without batched
logits (capability "logits_rows") runs sequentially.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from backends.base import CAP_LOGITS_ROWS

from . import metrics
from .errors import NumericError
from .verify import GREEDY, Trace, generate, run_reference

Draft = Callable[[list[int], int], Sequence[int]]  # (ids so far, n) -> next n ids
MIN_DRAFT = 4  # draft tokens asked for after a rejection, at least (see _next_budget)


def backend_draft(backend, prompt_ids: Sequence[int]) -> Draft:
    """draft(prefix, n): `backend`'s own greedy continuation of prompt + prefix (reset,
    prefill, n - 1 steps; harness.verify.generate), n ids."""
    prompt = [int(t) for t in prompt_ids]

    def draft(prefix: list[int], n: int) -> list[int]:
        return generate(backend, prompt + list(prefix), n)[0] if n > 0 else []
    return draft


@dataclass
class _Drafter:
    """Calls the draft source; after its first failure it proposes nothing (sequential)."""

    fn: Draft | None
    n_vocab: int
    calls: int = 0
    seconds: float = 0.0
    error: str | None = None
    fallback_at: int | None = None

    def propose(self, ids: list[int], k: int) -> list[int]:
        if self.fn is None or self.error is not None or k <= 0:
            return []
        t0 = time.perf_counter()
        self.calls += 1
        try:
            d = [int(t) for t in list(self.fn(list(ids), k))[:k]]
            bad = [t for t in d if not 0 <= t < self.n_vocab]
            if bad:
                raise ValueError(f"draft id {bad[0]} is outside [0, {self.n_vocab})")
        except Exception as e:  # noqa: BLE001 - any failure of another backend: go sequential
            self.error, self.fallback_at, d = f"{type(e).__name__}: {e}", len(ids), []
        self.seconds += time.perf_counter() - t0
        return d


@dataclass
class _Pass:
    """Bookkeeping of the verification passes (becomes Trace.speculative)."""

    passes: int = 0
    fed: int = 0
    drafted: int = 0
    accepted: int = 0
    min_margin: float = float("inf")
    min_margin_at: int | None = None

    def count(self, n_head: int, n_draft: int) -> None:
        self.passes += 1
        self.fed += n_head + n_draft
        self.drafted += n_draft

    def margin(self, i: int, row: np.ndarray) -> None:
        top2 = np.partition(row, -2)[-2:]
        m = float(top2[1] - top2[0])
        if m < self.min_margin:
            self.min_margin, self.min_margin_at = m, i


def _check_row(name: str, i: int, row: np.ndarray) -> None:
    bad = int((~np.isfinite(row)).sum())
    if bad:  # same rule as run_reference: a non-finite reference stops the run
        raise NumericError(f"reference {name}: {bad} non-finite logits at generated "
                           f"position {i}; the reference must be finite")


def _verify(rows: np.ndarray, d: list[int], name: str, ids: list[int], out: list[np.ndarray],
            st: _Pass, progress) -> int:
    """Accept rows' argmaxes while they equal the draft; the first that does not is kept.
    Returns the number of draft tokens accepted."""
    for t in range(len(d) + 1):
        row = rows[t]
        _check_row(name, len(ids), row)
        st.margin(len(ids), row)
        ids.append(int(np.argmax(row)))
        out.append(row.copy())  # not a view: the rejected rows of this pass are freed
        if progress:
            progress()
        if t == len(d) or ids[-1] != d[t]:
            return t
        st.accepted += 1
    raise AssertionError("unreachable: the loop returns at t == len(d)")


def _next_budget(budget: int, kept: int, n_draft: int, max_draft: int | None) -> int:
    """Draft tokens to ask for next: after a rejection, twice the accepted run (at least
    MIN_DRAFT), so a poor draft does not make every pass long; after a full acceptance,
    twice as many as before (up to max_draft)."""
    if kept < n_draft:
        budget = max(MIN_DRAFT, 2 * (kept + 1))
    else:
        budget = 2 * budget
    return budget if max_draft is None else min(budget, max_draft)


def run_reference_speculative(backend, name: str, prompt_ids, n_predict: int, n_ctx: int,
                              draft: Draft | None, progress: Callable[[], None] | None = None,
                              *, draft_name: str = "draft", max_draft: int | None = None,
                              ) -> tuple[Trace, np.ndarray]:
    """Greedy run of the reference, verified in batched passes against draft(ids, n) (module
    doc); returns what run_reference returns: its trace (trace.speculative: passes, fed
    tokens, drafted/accepted draft tokens, draft calls and seconds, draft_error and
    fallback_at, min_top2_margin) and its float64 logits [n_predict, n_vocab].
    max_draft: at most this many draft tokens per pass (default: all that remain; after a
    rejection fewer, see _next_budget).
    prefill_s is the first pass (prompt + first draft), decode_s the rest (drafts included).
    """
    if CAP_LOGITS_ROWS not in backend.capabilities():
        trace, logits = run_reference(backend, name, prompt_ids, n_predict, n_ctx, progress)
        trace.speculative = {"used": False, "draft": draft_name,
                             "reason": f"reference {name} has no batched logits"}
        return trace, logits
    prompt, ids, out = [int(t) for t in prompt_ids], [], []
    drafter, st = _Drafter(draft, int(backend.n_vocab)), _Pass()
    trace, held = Trace(name, GREEDY, n_ctx), 0
    backend.reset()
    t_end_first = None
    budget = max_draft if max_draft is not None else n_predict
    while len(ids) < n_predict:
        d = drafter.propose(ids, min(n_predict - 1 - len(ids), budget))
        head = (prompt + ids)[held:]  # accepted tokens the reference does not hold yet
        t0 = time.perf_counter()
        rows = backend.logits_rows(head + d, len(head) - 1)  # [len(d) + 1, n_vocab]
        if t_end_first is None:
            t_end_first = time.perf_counter()
            trace.prefill_s = t_end_first - t0
        st.count(len(head), len(d))
        kept = _verify(rows, d, name, ids, out, st, progress)
        del rows
        budget = _next_budget(budget, kept, len(d), max_draft)
        if len(ids) < n_predict:
            held = backend.rewind(len(prompt) + len(ids) - 1)
    trace.decode_s = time.perf_counter() - t_end_first
    trace.ids = ids
    trace.steps = [{"i": i, "logits_sha256": metrics.logits_sha256(r.astype(np.float32)),
                    "token": t} for i, (r, t) in enumerate(zip(out, ids))]
    trace.speculative = {"used": True, "draft": draft_name, "passes": st.passes,
                         "fed_tokens": st.fed, "drafted": st.drafted, "accepted": st.accepted,
                         "draft_calls": drafter.calls, "draft_s": drafter.seconds,
                         "draft_error": drafter.error, "fallback_at": drafter.fallback_at,
                         "min_top2_margin": st.min_margin if np.isfinite(st.min_margin) else None,
                         "min_top2_margin_at": st.min_margin_at}
    return trace, np.stack(out)
