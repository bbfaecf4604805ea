"""Summaries of a Trace against the reference, and the pass/fail gate of a verification.

Gate (documented in README "The verification protocol"): a compared backend PASSES when
- none of its logits (greedy or teacher-forced, any step) is NaN/Inf, and
- its greedy ids equal the reference's over the first `min_prefix` ids, or its first
  divergence happens where the reference's own top-2 margin is below `margin_rel` of the
  logit range (a near tie that float32 rounding can flip), and
- when a teacher-forced run exists, its top-1 agreement over all steps is >= `min_top1`
  (so a backend that goes wrong after the first `min_prefix` ids still fails).
Otherwise it FAILS.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import metrics
from .verify import Trace


@dataclass(frozen=True)
class Gate:
    min_prefix: int = 32
    margin_rel: float = 1e-3
    min_top1: float = 0.99


def _top5(logits: np.ndarray) -> list[list]:
    return [[int(i), float(logits[i])] for i in metrics.topk(np.asarray(logits, np.float64), 5)]


def _stat(steps: list[dict], key: str, fn) -> float | None:
    vals = [s[key] for s in steps if key in s]
    return float(fn(vals)) if vals else None


def summarize(trace: Trace, ref: Trace, ref_logits: np.ndarray) -> dict:
    """Figures of one trace: id SHA256, first 16 ids, first divergence (with the reference's
    and the backend's top-5 [id, logit] lists), error statistics over the compared steps.
    ref_logits: [n_predict, n_vocab] float64."""
    n = min(len(trace.ids), len(ref.ids))
    prefix = next((i for i in range(n) if trace.ids[i] != ref.ids[i]), n)
    compared = [s for s in trace.steps if "kl" in s]
    out = {
        "n_generated": len(trace.ids),
        "ids_sha256": metrics.ids_sha256(trace.ids),
        "ids_equal": trace.ids == ref.ids,
        "first_16": trace.ids[:16],
        "last_id": trace.ids[-1] if trace.ids else None,
        "match_prefix": prefix,
        "n_compared": len(compared),
        "top1_agreement": _stat(compared, "top1_agree", np.mean),
        "top5_overlap": _stat(compared, "top5_overlap", np.mean),
        "kl_mean": _stat(compared, "kl", np.mean),
        "kl_max": _stat(compared, "kl", np.max),
        "max_abs": _stat(compared, "max_abs", np.max),
        "nmse_mean": _stat(compared, "nmse", np.mean),
        "nmse_max": _stat(compared, "nmse", np.max),
        "final_logits_sha256": trace.steps[-1]["logits_sha256"] if trace.steps else None,
        "nonfinite_steps": sum(1 for s in trace.steps if s.get("nonfinite")),
        "first_divergence": None,
    }
    if prefix < n:
        step = trace.steps[prefix]
        out["first_divergence"] = {
            "index": prefix, "ref_id": ref.ids[prefix], "id": trace.ids[prefix],
            "ref_top5": _top5(ref_logits[prefix]), "top5": step.get("top5"),
            "ref_margin": float(step.get("ref_margin", np.nan)),
            "ref_margin_rel": float(step.get("ref_margin_rel", np.nan))}
    return out


def gate(greedy: dict, forced: dict | None, g: Gate = Gate()) -> dict:
    """PASS/FAIL with the reason, from the summaries of a greedy and a teacher-forced trace."""
    bad = greedy.get("nonfinite_steps", 0) + (forced or {}).get("nonfinite_steps", 0)
    if bad:
        return {"verdict": "FAIL", "reason": f"non-finite logits in {bad} step(s)"}
    top1 = forced["top1_agreement"] if forced else None
    forced_ok = top1 is None or top1 >= g.min_top1
    tf = f"; teacher-forced top-1 {top1:.3f}" if top1 is not None else ""
    div = greedy["first_divergence"]
    if greedy["match_prefix"] >= min(g.min_prefix, greedy["n_generated"]):
        why = f"first {greedy['match_prefix']} ids equal{tf}"
    elif div is not None and div["ref_margin_rel"] < g.margin_rel:
        why = (f"diverges at {div['index']} where the reference top-2 margin is "
               f"{div['ref_margin_rel']:.2e} of the logit range (< {g.margin_rel:g}){tf}")
    else:
        why = (f"diverges at {div['index']} with reference margin {div['ref_margin_rel']:.2e} "
               f"of the logit range" if div else "no divergence recorded") + tf
        return {"verdict": "FAIL", "reason": why}
    if not forced_ok:
        return {"verdict": "FAIL", "reason": why + f" (< {g.min_top1:g})"}
    return {"verdict": "PASS", "reason": why}
