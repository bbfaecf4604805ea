"""A/B of two `harness bench kernels` results (schema gguf-harness/kernels/1): per shape and
timing mode, a noise-aware speed verdict, and every correctness change as a failure. Pure
functions on result dicts; `harness ab` (harness/ab_cmd.py) calls them when both files are
kernel results.

Rows are matched by shape name and spec ("10240x5120:Q4_K"): a name whose spec differs
between A and B is not comparable (UNKNOWN). For each timing mode present in both rows
(cold_b2b, cold_single, hot), with the kernel medians us_A, us_B [microseconds] and each
measurement's own relative noise (p80 - p20) / median (harness/bench_stats.py):
    delta = us_B / us_A - 1            (a time: negative is faster)
    noise = max(noise_A, noise_B)
    UNKNOWN  if either side has fewer than MIN_SAMPLES samples or a non-finite figure;
    SAME     if |delta| <= max(threshold, noise)          (harness/ab.py's rule for tok/s);
    FASTER / SLOWER by the sign of delta otherwise.
Correctness (never a matter of noise), per shape: B's oracle check failed or B did not time
it (status not "ok") while A did, the outputs after timing differ from the checked ones
(same_after_timing false), the roofline read's check failed, or a shape of A is missing in B.
Timings of a shape whose check failed are never compared (bench kernels does not time it).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .jsonread import as_dict, as_list

KERNELS_SCHEMA = "gguf-harness/kernels/1"
MODES = ("cold_b2b", "cold_single", "hot")
MIN_SAMPLES = 3


def is_kernels_result(doc: dict) -> bool:
    """True for a `harness bench kernels` result (its schema field)."""
    return isinstance(doc, dict) and doc.get("schema") == KERNELS_SCHEMA


@dataclass
class KernelPerf:
    """One (shape, mode) speed comparison; us in microseconds, delta/noise as fractions."""

    shape: str
    label: str
    mode: str
    a_us: float | None
    b_us: float | None
    delta: float | None
    noise: float | None
    tolerance: float | None
    verdict: str  # SAME | FASTER | SLOWER | UNKNOWN
    note: str = ""


@dataclass
class KernelCheck:
    """One shape's correctness comparison: state "same", "FAILURE", "fixed" (failed in A, passes
    in B) or "new" (only in B)."""

    shape: str
    what: str
    a: str
    b: str
    state: str


@dataclass
class KernelsAB:
    """A kernels (or, harness/ab_nodes.py, a decode-step nodes) comparison."""
    perf: list[KernelPerf]
    checks: list[KernelCheck]
    notes: list[str]
    kind: str = "kernels"

    @property
    def failures(self) -> int:
        return sum(c.state == "FAILURE" for c in self.checks)

    def count(self, verdict: str) -> int:
        return sum(p.verdict == verdict for p in self.perf)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "perf": [asdict(p) for p in self.perf],
                "checks": [asdict(c) for c in self.checks], "notes": self.notes,
                "failures": self.failures,
                "counts": {v: self.count(v) for v in ("FASTER", "SLOWER", "SAME", "UNKNOWN")}}


def _finite(x) -> float | None:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _rows(doc: dict) -> list[dict]:
    """A kernels result's rows that are mappings (a hand-edited file holds anything)."""
    return [r for r in as_list(doc.get("rows")) if isinstance(r, dict)]


def _key(row: dict) -> str:
    return str(row.get("name") or row.get("spec") or "?")


def _ok(row: dict) -> bool:
    return row.get("status") == "ok" and bool(as_dict(row.get("check")).get("ok"))


def mode_stats(a: dict, b: dict, threshold: float) -> dict:
    """Speed verdict of one mode from the two rows' `modes[mode]["kernel"]` dicts."""
    ka, kb = (as_dict(as_dict(m).get("kernel")) for m in (a, b))
    us_a, us_b = _finite(ka.get("us")), _finite(kb.get("us"))
    na, nb = _finite(ka.get("noise")), _finite(kb.get("noise"))
    enough = min(_finite(ka.get("n")) or 0, _finite(kb.get("n")) or 0) >= MIN_SAMPLES
    if not enough or None in (us_a, us_b, na, nb) or not us_a:
        return {"a_us": us_a, "b_us": us_b, "delta": None, "noise": None, "tolerance": None,
                "verdict": "UNKNOWN"}
    delta, noise = us_b / us_a - 1, max(na, nb)
    tol = max(threshold, noise)
    verdict = "SAME" if abs(delta) <= tol else ("FASTER" if delta < 0 else "SLOWER")
    return {"a_us": us_a, "b_us": us_b, "delta": delta, "noise": noise, "tolerance": tol,
            "verdict": verdict}


def _row_checks(name: str, ra: dict, rb: dict | None) -> list[KernelCheck]:
    if rb is None:
        return [KernelCheck(name, "shape", "present", "missing", "FAILURE")]
    out = []
    a_ok, b_ok = _ok(ra), _ok(rb)
    state = "same" if a_ok == b_ok else ("FAILURE" if a_ok else "fixed")
    out.append(KernelCheck(name, "oracle check", "pass" if a_ok else str(ra.get("status")),
                           "pass" if b_ok else str(rb.get("status") if rb.get("status") != "ok"
                                                   else "FAIL"), state))
    for field, what in (("same_after_timing", "output after timing = checked"),
                        ("roofline_check", "roofline read check")):
        va, vb = ra.get(field), rb.get(field)
        if va is None and vb is None:
            continue
        bad = vb is False and va is not False
        out.append(KernelCheck(name, what, str(va), str(vb), "FAILURE" if bad else "same"))
    return out


def compare_kernels(a: dict, b: dict, threshold: float = 0.02) -> KernelsAB:
    """B against A (both kernel results); rule in the module docstring. Raises ValueError when
    either is not a kernel result."""
    if not (is_kernels_result(a) and is_kernels_result(b)):
        raise ValueError(f"not two {KERNELS_SCHEMA} results")
    rows_b = {_key(r): r for r in _rows(b)}
    perf, checks, notes = [], [], []
    sa, sb = as_dict(a.get("settings")), as_dict(b.get("settings"))
    for k in ("gemv_impl", "gemv_args", "gemv_kq", "pdl"):
        if sa.get(k) != sb.get(k):
            notes.append(f"settings differ: {k} {sa.get(k)!r} -> {sb.get(k)!r}")
    if as_dict(a.get("device")).get("sm_count") != as_dict(b.get("device")).get("sm_count"):
        notes.append("devices differ (SM count)")
    for ra in _rows(a):
        name = _key(ra)
        rb = rows_b.pop(name, None)
        checks += _row_checks(name, ra, rb)
        if rb is None:
            continue
        label = str(ra.get("label") or ra.get("spec") or name)
        if ra.get("spec") != rb.get("spec"):
            perf.append(KernelPerf(name, label, "-", None, None, None, None, None, "UNKNOWN",
                                   f"spec {ra.get('spec')} vs {rb.get('spec')}"))
            continue
        ma, mb = as_dict(ra.get("modes")), as_dict(rb.get("modes"))
        for mode in [m for m in MODES if m in ma or m in mb]:
            if mode in ma and mode in mb:
                perf.append(KernelPerf(name, label, mode, **mode_stats(ma[mode], mb[mode], threshold)))
            else:  # timed in one run only (other --modes, or a failed row): said, not dropped
                perf.append(KernelPerf(name, label, mode, None, None, None, None, None, "UNKNOWN",
                                       f"timed in {'A' if mode in ma else 'B'} only"))
    for name in rows_b:
        checks.append(KernelCheck(name, "shape", "missing", "present", "new"))
    return KernelsAB(perf, checks, notes)


def exit_code(res: KernelsAB, fail_on_slower: bool = False) -> int:
    """0 without correctness failures (and, with fail_on_slower, without SLOWER); else 1."""
    return 1 if res.failures or (fail_on_slower and res.count("SLOWER")) else 0
