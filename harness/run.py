"""One verification run: reference first, then every other backend at every context size.

Flow (top-down): validate the GGUF -> tokenise the standard prompt through llama.cpp ->
greedy run of the reference (float64 oracle) -> for each backend and context: greedy and
teacher-forced runs compared step by step -> summaries and gate verdicts -> result dict.
A backend that crashes or refuses the model is recorded and the run goes on.
"""
from __future__ import annotations

import os
import time
from dataclasses import replace
from datetime import datetime, timezone

import numpy as np
from rich.markup import escape

from . import machine, metrics, variants
from .config import ModelRef, ProtocolConfig, RunConfig
from .errors import ConfigError, HarnessError
from .progress import Progress
from .results import SCHEMA
from .summary import Gate, gate, summarize
from .verify import GREEDY, TEACHER_FORCED, Trace, run_compared, run_reference

BACKEND_ERRORS = (HarnessError, OSError, RuntimeError, ValueError, MemoryError)


def _trace_json(t: Trace) -> dict:
    return {"backend": t.backend, "mode": t.mode, "n_ctx": t.n_ctx, "status": t.status,
            "error": t.error, "ids": t.ids, "steps": t.steps, "prefill_s": t.prefill_s,
            "decode_s": t.decode_s}


def _timing(t: Trace, n_prompt: int) -> dict:
    n_dec = max(len(t.ids) - 1, 0)
    return {"prefill_tok_s": n_prompt / t.prefill_s if t.prefill_s > 0 else None,
            "decode_tok_s": n_dec / t.decode_s if t.decode_s > 0 and n_dec else None,
            "ms_per_token": 1e3 * t.decode_s / n_dec if n_dec else None}


def _run_backend(create, name: str, model: ModelRef, cfg: RunConfig, proto: ProtocolConfig,
                 ref: Trace, ref_logits: np.ndarray, prog: Progress) -> list[Trace]:
    """Greedy (+ teacher-forced) traces of one backend at one context; failures recorded."""
    modes = [GREEDY] + ([TEACHER_FORCED] if proto.teacher_forced else [])
    traces: list[Trace] = []
    backend = None
    try:
        backend = create(name)
        backend.load(model, cfg)
        for mode in modes:
            task = prog.task(f"{name} c={cfg.n_ctx} {mode}", len(ref.ids))
            traces.append(run_compared(backend, name, mode, proto.prompt_ids, ref.ids,
                                       ref_logits, cfg.n_ctx, progress=task))
    except BACKEND_ERRORS as e:
        done = {t.mode for t in traces}
        for mode in modes:
            if mode not in done:
                tr = Trace(name, mode, cfg.n_ctx, status="error", error=f"{type(e).__name__}: {e}")
                traces.append(tr)
                break  # one record of the failure; later modes were never attempted
        prog.log(f"[red]{name} c={cfg.n_ctx} failed:[/] {escape(f'{type(e).__name__}: {e}')}")
    finally:
        if backend is not None:
            _close(backend)
    return traces


def _close(backend) -> None:
    try:
        backend.close()
    except Exception:  # a dead child cannot be closed; nothing left to free
        pass


def _open_draft(create, name: str, model: ModelRef, cfg: RunConfig):
    """(loaded draft backend, None) or (None, the load error): a failure is recorded."""
    backend = None
    try:
        backend = create(name)
        backend.load(model, cfg)
        return backend, None
    except Exception as e:  # noqa: BLE001 - the draft is optional: any failure -> sequential
        if backend is not None:
            _close(backend)
        return None, f"load: {type(e).__name__}: {e}"


def _reference(create, reference: str, draft: str | None, model: ModelRef, cfg: RunConfig,
               proto: ProtocolConfig, prog: Progress) -> tuple[Trace, np.ndarray]:
    """The reference's greedy run: sequential, or verified against `draft`'s greedy
    continuations (harness.speculative; the draft backend is loaded first and closed
    after; one that fails to load or crashes leaves the run sequential, recorded)."""
    from .speculative import backend_draft, run_reference_speculative
    draft_backend, draft_error = _open_draft(create, draft, model, cfg) if draft \
        else (None, None)
    try:
        ref_backend = create(reference)
        ref_backend.load(model, cfg)
        task = prog.task(f"{reference} (reference) greedy" + (f", draft {draft}" if draft else ""),
                         proto.n_predict)
        try:
            if draft_backend is None:
                ref, logits = run_reference(ref_backend, reference, proto.prompt_ids,
                                            proto.n_predict, cfg.n_ctx, progress=task)
                if draft:
                    ref.speculative = {"used": False, "draft": draft, "draft_error": draft_error}
                return ref, logits
            return run_reference_speculative(
                ref_backend, reference, proto.prompt_ids, proto.n_predict, cfg.n_ctx,
                backend_draft(draft_backend, proto.prompt_ids), progress=task,
                draft_name=draft)
        finally:
            ref_backend.close()
    finally:
        if draft_backend is not None:
            _close(draft_backend)


def verify_model(model: ModelRef, model_meta: dict, proto: ProtocolConfig, base: RunConfig,
                 backends: list[str], create, reference: str = "oracle",
                 prog: Progress | None = None, gate_cfg: Gate = Gate(),
                 draft: str | None = None) -> dict:
    """Run the protocol; returns the result dict (schema gguf-harness/run/1).

    create(name) -> Backend. The reference runs once at the largest context (its maths do
    not depend on the context size); every other backend runs at every context in proto.
    draft: one of `backends` whose greedy continuations the reference verifies in batched
    passes instead of stepping token by token (harness.speculative; same ids); recorded
    as reference.speculative. Raises ConfigError when draft is not among backends.
    """
    if draft is not None and draft not in backends:
        raise ConfigError(f"draft backend {draft!r} is not among the compared backends {backends}")
    prog = prog or Progress.quiet()
    started = time.time()
    machine_start = machine.machine_info()
    ref, ref_logits = _reference(create, reference, draft,
                                 model, replace(base, n_ctx=max(proto.contexts)), proto, prog)
    if ref.speculative and ref.speculative.get("draft_error"):
        prog.log(f"[yellow]draft {draft} failed, the reference went on sequentially:[/] "
                 f"{escape(str(ref.speculative['draft_error']))}")
    runs, verdicts = [], []
    for name in [b for b in backends if b != reference]:
        for n_ctx in proto.contexts:
            traces = _run_backend(create, name, model, replace(base, n_ctx=n_ctx), proto, ref,
                                  ref_logits, prog)
            summaries = {}
            for t in traces:
                rec = _trace_json(t)
                if t.status == "ok":
                    rec["summary"] = summaries[t.mode] = summarize(t, ref, ref_logits)
                    rec["timing"] = _timing(t, len(proto.prompt_ids))
                runs.append(rec)
            if GREEDY in summaries:
                v = gate(summaries[GREEDY], summaries.get(TEACHER_FORCED), gate_cfg)
            else:
                v = {"verdict": "ERROR", "reason": traces[-1].error if traces else "no run"}
            verdicts.append({"backend": name, "n_ctx": n_ctx, **v})
    ref_json = _trace_json(ref)
    ref_timing = _timing(ref, len(proto.prompt_ids))
    if ref.speculative and ref.speculative.get("used"):
        # batched passes over drafted tokens: prefill/decode seconds are no per-token rates
        ref_timing = {"prefill_tok_s": None, "decode_tok_s": None, "ms_per_token": None,
                      "total_s": ref.prefill_s + ref.decode_s}
    ref_json.update(ids_sha256=metrics.ids_sha256(ref.ids), first_16=ref.ids[:16],
                    last_id=ref.ids[-1], final_logits_sha256=ref.steps[-1]["logits_sha256"],
                    timing=ref_timing)
    if ref.speculative is not None:
        ref_json["speculative"] = ref.speculative
    return {
        "schema": SCHEMA,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "wall_s": time.time() - started,
        "loadavg_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "machine": machine_start,  # taken before the run: its loadavg is the starting load
        "model": {**model.to_json(), **model_meta},
        "settings": {"run": {k: v for k, v in base.to_json().items() if k != "n_ctx"},
                     "contexts": list(proto.contexts),
                     "n_predict": proto.n_predict, "n_prompt": len(proto.prompt_ids),
                     "teacher_forced": proto.teacher_forced, "reference": reference,
                     "draft": draft,
                     "backends": backends, "gate": vars(gate_cfg),
                     # NAME@VARIANT backends: the settings each changes (harness.variants)
                     "variants": variants.describe([reference, *backends])},
        "prompt": {"ids": list(proto.prompt_ids), **proto.extra},
        "reference": ref_json,
        "runs": runs,
        "verdicts": verdicts,
    }
