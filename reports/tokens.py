"""Token-level views of a result: the side-by-side token table and first-divergence details.

Token texts come from result["prompt"]["pieces"] ({id: piece}, keys are strings after a
JSON round trip) and are untrusted model data; they are returned as plain strings and
escaped by the template.
"""
from __future__ import annotations

from typing import Callable

from harness.jsonread import as_dict, as_list

from .fmt import step_position, to_float

CONTEXT_TOKENS = 8  # reference tokens shown before a divergence


def pieces(prompt: dict) -> dict[int, str]:
    """{token id: text} from prompt["pieces"]; entries with a non-integer key are dropped."""
    out: dict[int, str] = {}
    for k, v in as_dict(as_dict(prompt).get("pieces")).items():
        try:
            out[int(k)] = str(v)
        except (TypeError, ValueError):
            continue
    return out


def piece(pcs: dict, tid, default=None):
    """pcs[tid], or default when tid is absent or cannot be a key (a hand-edited id that is a
    list or an object)."""
    try:
        return pcs.get(tid, default)
    except TypeError:
        return default


def first_difference(ids: list, ref_ids: list) -> int | None:
    """Index of the first position where ids and ref_ids differ (a shorter list differs
    where it ends); None when equal."""
    for i, (a, b) in enumerate(zip(ids, ref_ids)):
        if a != b:
            return i
    return None if len(ids) == len(ref_ids) else min(len(ids), len(ref_ids))


def _margins(runs: list[dict]) -> dict[int, tuple]:
    """position -> (reference top-2 margin, relative margin), from any compared step.

    Every compared step holds the same reference margin (it depends on the reference logits
    only); teacher-forced runs cover every position, so they are read last and win."""
    out: dict[int, tuple] = {}
    for run in sorted(runs, key=lambda r: r.get("mode") == "teacher_forced"):
        for n, s in enumerate(as_list(run.get("steps"))):
            if isinstance(s, dict) and "ref_margin" in s:
                out[step_position(s, n)] = (s.get("ref_margin"), s.get("ref_margin_rel"))
    return out


def _cell(i: int, ids: list, ref_id, first: int | None, pcs: dict, anchor: str) -> dict:
    if i >= len(ids):
        return {"id": None, "text": None, "cls": "missing", "anchor": None}
    tid = ids[i]
    if first is None or i < first:
        cls = "same"
    elif i == first:
        cls = "div first-div"
    else:
        cls = "div" if tid != ref_id else "after"
    return {"id": tid, "text": piece(pcs, tid), "cls": cls,
            "anchor": anchor if i == first else None}


def token_table(result: dict, pcs: dict, margin_rel: float,
                run_label: Callable[[dict], str]) -> dict:
    """Reference ids next to every completed greedy run's ids, one row per position.

    Cell classes: same (equal, before any divergence), "div first-div" (the first
    divergence), div (different, after it), after (equal but conditioned on other text),
    missing. Rows whose reference margin is below `margin_rel` of the logit range get
    tie=True (near ties that rounding can flip)."""
    ref_ids = as_list(as_dict(result.get("reference")).get("ids"))
    runs = [as_dict(r) for r in as_list(result.get("runs"))]
    greedy = [(k, r) for k, r in enumerate(runs)
              if r.get("status") == "ok" and r.get("mode") == "greedy"]
    cols = [(k, as_list(r.get("ids")), run_label(r)) for k, r in greedy]
    firsts = [first_difference(ids, ref_ids) for _, ids, _ in cols]
    margins = _margins([r for r in runs if r.get("status") == "ok"])
    n = max([len(ref_ids)] + [len(ids) for _, ids, _ in cols])
    rows = []
    for i in range(n):
        ref_id = ref_ids[i] if i < len(ref_ids) else None
        cells = [_cell(i, ids, ref_id, f, pcs, f"div-{k}") for (k, ids, _), f in zip(cols, firsts)]
        m, rel = margins.get(i, (None, None))
        rel_f = to_float(rel)
        rows.append({"pos": i, "ref_id": ref_id, "ref_text": piece(pcs, ref_id), "margin": m,
                     "margin_rel": rel, "tie": rel_f is not None and rel_f < margin_rel,
                     "cells": cells, "has_div": any(f == i for f in firsts)})
    return {"columns": [label for _, _, label in cols], "rows": rows}


def _top5_rows(entries, ref_id, own_id, pcs: dict) -> list[dict]:
    """[[id, logit], ...] -> rows with rank, text and which id each side chose."""
    rows = []
    for rank, e in enumerate(as_list(entries), start=1):
        if not (isinstance(e, (list, tuple)) and len(e) >= 2):
            continue
        tid = e[0]
        cls = "ref-choice" if tid == ref_id else "own-choice" if tid == own_id else ""
        rows.append({"rank": rank, "id": tid, "text": piece(pcs, tid), "logit": e[1], "cls": cls})
    return rows


def divergences(result: dict, pcs: dict, run_label: Callable[[dict], str]) -> list[dict]:
    """First divergence of every run that has one: position, both ids and texts, the
    reference's top-2 margin, both top-5 [id, logit] lists, the reference text before it."""
    ref_ids = as_list(as_dict(result.get("reference")).get("ids"))
    out = []
    for k, run in enumerate(as_dict(r) for r in as_list(result.get("runs"))):
        d = as_dict(as_dict(run.get("summary")).get("first_divergence"))
        if not d:
            continue
        idx = d.get("index")
        start = max(idx - CONTEXT_TOKENS, 0) if isinstance(idx, int) else 0
        before = ref_ids[start:idx] if isinstance(idx, int) else []
        out.append({
            "anchor": f"div-{k}", "label": run_label(run), "mode": run.get("mode"),
            "index": idx, "ref_id": d.get("ref_id"), "ref_text": piece(pcs, d.get("ref_id")),
            "id": d.get("id"), "text": piece(pcs, d.get("id")), "ref_margin": d.get("ref_margin"),
            "ref_margin_rel": d.get("ref_margin_rel"),
            "context": "".join(piece(pcs, t, f"[{t}]") for t in before) if pcs else None,
            "ref_top5": _top5_rows(d.get("ref_top5"), d.get("ref_id"), d.get("id"), pcs),
            "top5": _top5_rows(d.get("top5"), d.get("ref_id"), d.get("id"), pcs)})
    return out
