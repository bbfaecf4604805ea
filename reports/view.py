"""Result dict (schema gguf-harness/run/1, built by harness.run.verify_model) -> template context.

Every field is read defensively (.get, type checks): a report must render for partial,
old or hand-edited results, and for runs that crashed. Strings from the model (name,
metadata, token pieces, prompt text) stay plain strings here; the template escapes them.
"""
from __future__ import annotations

from harness.jsonread import as_dict, as_list

from .fmt import nbytes, to_float
from .tokens import divergences, pieces, token_table

VERDICT_CLASS = {"PASS": "pass", "FAIL": "fail", "ERROR": "error"}
MODEL_CORE = ("name", "path", "sha256", "size")
MODE_LABEL = {"greedy": "greedy", "teacher_forced": "teacher-forced"}


def run_label(run: dict) -> str:
    """"llama.cpp c=512 greedy" (backend, context, mode)."""
    mode = run.get("mode", "?")
    mode = MODE_LABEL.get(mode, mode) if isinstance(mode, str) else str(mode)
    return f"{run.get('backend', '?')} c={run.get('n_ctx', '?')} {mode}"


def verdict_rows(result: dict) -> tuple[list[dict], str]:
    """Rows of the verdict table and the overall verdict (PASS only when every one passes)."""
    rows = []
    for v in as_list(result.get("verdicts")):
        v = as_dict(v)
        verdict = str(v.get("verdict", "?"))
        rows.append({"backend": v.get("backend"), "n_ctx": v.get("n_ctx"), "verdict": verdict,
                     "cls": VERDICT_CLASS.get(verdict, "unknown"), "reason": v.get("reason")})
    seen = {r["verdict"] for r in rows}
    overall = ("—" if not rows else "FAIL" if "FAIL" in seen else "ERROR" if seen - {"PASS"}
               else "PASS")
    return rows, overall


def _timing(run: dict) -> dict:
    # verify_model stores timing beside the summary; accept it inside the summary too
    return as_dict(run.get("timing")) or as_dict(as_dict(run.get("summary")).get("timing"))


def summary_rows(result: dict) -> list[dict]:
    """One row per run (reference first): ids SHA256, agreement and error figures, speed."""
    ref = as_dict(result.get("reference"))
    ref_sha = ref.get("ids_sha256")
    n_ref = len(as_list(ref.get("ids")))
    spec, how = as_dict(ref.get("speculative")), "reference"
    if spec.get("used"):  # harness.speculative: batched passes, so its tok/s is no step rate
        how += f", speculative: draft {spec.get('draft')}, {spec.get('passes')} pass(es)"
    rows = [{"label": f"{ref.get('backend', 'reference')} ({how})", "status": "ok",
             "sha": ref_sha, "same": None, "prefix": None, "n": n_ref, "s": {},
             "t": _timing(ref), "cls": "ref"}]
    for run in as_list(result.get("runs")):
        run = as_dict(run)
        s = as_dict(run.get("summary"))
        sha = s.get("ids_sha256")
        rows.append({"label": run_label(run), "status": run.get("status", "?"), "sha": sha,
                     "same": (sha == ref_sha) if sha and ref_sha else None,
                     "prefix": s.get("match_prefix"), "n": n_ref, "s": s, "t": _timing(run),
                     "cls": "ok" if run.get("status") == "ok" else "error"})
    return rows


def error_rows(result: dict) -> list[dict]:
    """Runs that did not complete, with their recorded error text."""
    return [{"label": run_label(r), "error": r.get("error") or "(no message recorded)"}
            for r in map(as_dict, as_list(result.get("runs"))) if r.get("status") != "ok"]


def flatten(d: dict, prefix: str = "") -> list[tuple[str, object]]:
    """Nested dict -> [("run.n_ctx", 512), ...]; lists stay values."""
    out: list[tuple[str, object]] = []
    for k, v in as_dict(d).items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.extend(flatten(v, key + "."))
        else:
            out.append((key, v))
    return out


def _with_units(rows: list[tuple[str, object]]) -> list[tuple[str, object]]:
    # "*_bytes" keys also shown in binary units: 17179869184 -> "16.0 GiB (17179869184)"
    return [(k, f"{nbytes(v)} ({v})" if k.endswith("_bytes") and to_float(v) is not None else v)
            for k, v in rows]


def machine_rows(m: dict) -> dict:
    """Machine facts as key/value rows: host, GPU (or None), package versions."""
    m = as_dict(m)
    keys = ("hostname", "os", "cpu", "cpu_count", "memory_bytes")
    host = _with_units([(k, m.get(k)) for k in keys if k in m])
    gpu = m.get("gpu")
    return {"host": host + [(k, v) for k, v in sorted(as_dict(m.get("switches")).items())],
            "gpu": _with_units(flatten(gpu)) if isinstance(gpu, dict) else None,
            "versions": flatten(m.get("versions"))}


def generic_table(title: str, obj) -> dict:
    """An optional section of unknown shape (bench rows, kernel timings) as a table.

    list of dicts -> columns = union of keys; dict with a "rows" list -> that list plus
    the other keys as notes; any other dict -> key/value rows."""
    notes: list[tuple[str, object]] = []
    rows = obj
    if isinstance(obj, dict):
        rows = obj.get("rows")
        notes = [(k, v) for k, v in obj.items() if k != "rows"]
    if isinstance(rows, list) and rows and all(isinstance(r, dict) for r in rows):
        cols: list[str] = []
        for r in rows:
            cols.extend(str(k) for k in r if str(k) not in cols)
        table = [[r.get(c) for c in cols] for r in rows]
        return {"title": title, "columns": cols, "rows": table, "notes": notes}
    if isinstance(obj, dict):
        return {"title": title, "columns": [], "rows": [], "notes": flatten(obj)}
    return {"title": title, "columns": [], "rows": [], "notes": [("value", obj)]}


def plot_series(result: dict) -> list[tuple[str, list[dict]]]:
    """(label, steps) of the teacher-forced runs (comparable at every position); the greedy
    runs when there are none (compared only up to their first divergence)."""
    ok = [r for r in map(as_dict, as_list(result.get("runs"))) if r.get("status") == "ok"]
    chosen = [r for r in ok if r.get("mode") == "teacher_forced"] or ok
    return [(run_label(r), as_list(r.get("steps"))) for r in chosen]


def build_context(result: dict) -> dict:
    """Everything the template shows (plots excluded: html.py adds them)."""
    result = as_dict(result)
    model = as_dict(result.get("model"))
    machine = as_dict(result.get("machine"))
    prompt = as_dict(result.get("prompt"))
    verdicts, overall = verdict_rows(result)
    settings = as_dict(result.get("settings"))
    margin_rel = to_float(as_dict(settings.get("gate")).get("margin_rel")) or 1e-3
    pcs = pieces(prompt)
    return {
        "schema": result.get("schema"), "created": result.get("created"),
        "wall_s": result.get("wall_s"), "model": model,
        "model_meta": [(k, v) for k, v in model.items() if k not in MODEL_CORE],
        "git": as_dict(machine.get("git")), "overall": overall,
        "overall_cls": VERDICT_CLASS.get(overall, "unknown"), "verdicts": verdicts,
        "summary": summary_rows(result), "errors": error_rows(result),
        "tokens": token_table(result, pcs, margin_rel, run_label),
        "divergences": divergences(result, pcs, run_label),
        "machine": machine_rows(machine), "settings": flatten(settings),
        "prompt": {"text": prompt.get("text"), "ids": as_list(prompt.get("ids"))},
        "extras": [generic_table(k, result[k]) for k in ("bench", "kernels")
                   if result.get(k) not in (None, [], {})],
    }
