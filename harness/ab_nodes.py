"""A/B of two `harness bench nodes` results (schema gguf-harness/nodes/1): the decode step and
each node group, B against A, as harness/ab_kernels.py compares kernel results (same verdict
rule, same record types). Pure functions on result dicts; `harness ab` (harness/ab_cmd.py)
calls them when both files are nodes results.

Rows (times in microseconds per decode step; delta = us_B / us_A - 1, negative is faster):
  - "decode step": the captured step graph over chained replays (nodes.step_us, the median of
    the replay samples). noise = max over A and B of (max - min) / median of
    nodes.step_samples_us (recorded since session 9; absent in older files);
  - "decode step, unslowed windows" (only when either file has a step window slowed by a
    power cap or thermal limit and both have windows without one; bench_nodes.windows: the timed windows'
    nodes.step_samples_slowdown and the retaken ones' nodes.step_retakes, since bench_nodes
    retakes slowed windows after a cool-down; files from before session 30 give the shares from
    their raw GPU-state readings and replay windows, where kept): their medians, noise their
    spread as above (>= 3 each, else the threshold alone). Why: a capped GPU slows the later windows by a few percent and unevenly, and the
    median of three then hides a change of under 1 % (session 30: the plain step row said SAME,
    +0.44 % within +-3.68 %, for a change whose unslowed windows moved +0.9 % in two pairs);
  - "sum of nodes", then one row per node group of the timing method both files have (graph,
    else eager): nodes of one name without the layer prefix and one format (e.g. all 48
    "ffn_down [Q4_K]"), the sum of their per-node medians, largest |us_B - us_A| first.
    noise of a group (and of the sum) = sqrt(sum over its nodes of (slowest replay - fastest
    replay)^2) / sum of the medians, from the per-node replay samples (us_samples, >= 3 per
    node; recorded since session 11 for the graph method): each node replays in a graph of its
    own at its own time, so their noise is taken as independent and the ranges add in
    quadrature (a plain sum would let ~400 nodes' ranges hide a real change of the sum); the
    max over A and B is used.
Verdict: SAME if |delta| <= max(threshold, noise), else FASTER / SLOWER; without a recorded
spread (eager node times, older files) the threshold alone decides and the row says so.
Checks: groups or node counts present on one side only are structural changes ("new",
"missing", "count"), never correctness failures: a nodes result checks no outputs.
Comparability: two files of different model SHA256 are not an A/B of the engine (ConfigError,
as harness.ab.compare refuses run results; force compares them with a note). When either file
is of a diagnostic build (GGUF_HARNESS_DIAG, bench_nodes.diag_build) only the decode step is
compared, with a note: its node rows are not a decode step's.
"""
from __future__ import annotations

import math
from collections import defaultdict

from reports.fmt import visible

from .ab import energy_note
from .ab_kernels import KernelCheck, KernelPerf, KernelsAB, _finite
from .bench_nodes import SCHEMA as NODES_SCHEMA
from .bench_nodes import clean_samples, diag_sides, slowed_windows, split_name
from .gpu_state import ab_notes
from .jsonread import as_dict, as_list

NO_SPREAD = "no spread recorded: threshold only"


def is_nodes_result(doc: dict) -> bool:
    """True for a `harness bench nodes` result (its schema field)."""
    return isinstance(doc, dict) and doc.get("schema") == NODES_SCHEMA


def _body(doc: dict) -> dict:
    return doc.get("nodes") if isinstance(doc.get("nodes"), dict) else {}


def spread(samples) -> float | None:
    """(max - min) / median of >= 3 finite positive samples, else None."""
    xs = sorted(x for x in (_finite(s) for s in as_list(samples)) if x is not None and x > 0)
    if len(xs) < 3:
        return None
    return (xs[-1] - xs[0]) / xs[len(xs) // 2]


def verdict(a_us, b_us, noise, threshold: float) -> dict:
    """The speed verdict of one time pair (ab_kernels.mode_stats' rule; noise None: threshold)."""
    a_us, b_us = _finite(a_us), _finite(b_us)
    if a_us is None or b_us is None or a_us <= 0:
        return {"a_us": a_us, "b_us": b_us, "delta": None, "noise": noise, "tolerance": None,
                "verdict": "UNKNOWN"}
    delta = b_us / a_us - 1
    tol = threshold if noise is None else max(threshold, noise)
    v = "SAME" if abs(delta) <= tol else ("FASTER" if delta < 0 else "SLOWER")
    return {"a_us": a_us, "b_us": b_us, "delta": delta, "noise": noise, "tolerance": tol, "verdict": v}


def node_range(row: dict) -> tuple[float, float] | None:
    """(fastest, slowest) of a node row's replay samples (us_samples), None with fewer than 3
    finite positive ones or without a finite positive median (us)."""
    us = _finite(row.get("us"))
    xs = [x for x in (_finite(s) for s in row.get("us_samples") or []) if x is not None and x > 0]
    return (min(xs), max(xs)) if len(xs) >= 3 and us is not None and us > 0 else None


def group_noise(rows: list[dict]) -> float | None:
    """sqrt(sum of (slowest - fastest replay)^2) / sum of medians of node rows (module
    docstring); None when a row has no range (node_range)."""
    ranges = [node_range(r) for r in rows]
    if not rows or any(x is None for x in ranges):
        return None
    return math.sqrt(sum((hi - lo) ** 2 for lo, hi in ranges)) / sum(_finite(r.get("us")) for r in rows)


def groups(rows: list[dict]) -> dict[str, tuple[int, float, float | None]]:
    """{"op [fmt]": (node count, summed us, group_noise)} of one method's node rows."""
    acc: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        fmt = r.get("fmt") or ""
        acc[f"{split_name(str(r.get('name')))[1]}" + (f" [{fmt}]" if fmt else "")].append(r)
    return {k: (len(v), sum(_finite(r.get("us")) or 0.0 for r in v), group_noise(v)) for k, v in acc.items()}


def _cut(t) -> str:
    """A name or value of a result file, made visible and cut to 60 characters (hand-edited files
    hold anything)."""
    return visible(t, 60, spaces=False)


def _short(sw, n: int = 400) -> dict[str, str]:
    """A {name: value} record as {cut name: cut value}, its first n names in name order; {} when
    it is not a mapping."""
    return {_cut(k): _cut(v) for k, v in sorted(as_dict(sw).items(), key=lambda kv: str(kv[0]))[:n]}


def set_switches(d: dict) -> dict[str, str]:
    """machine.switches (the GGUF_HARNESS_* variables set for the run), as _short."""
    return _short(as_dict(d.get("machine")).get("switches"))


def effective_switches(d: dict) -> dict[str, str] | None:
    """The engine switches' values as run (backends/engine/switches.effective) recorded in a nodes
    result (nodes.engine.switches_effective) or a kernels result (settings.switches_effective,
    from session 25), as _short; None when the result has no such mapping (older results)."""
    for holder in (as_dict(_body(d).get("engine")), as_dict(d.get("settings"))):
        if isinstance(holder.get("switches_effective"), dict):
            return _short(holder["switches_effective"])
    return None


def switch_notes(a: dict, b: dict, most: int = 40) -> list[str]:
    """The A/B notes of the engine switches: "engine switch K: VA -> VB" for each variable set
    differently (machine.switches; "(unset)" on a side without it, followed by "(ran V)" where that
    side records running another, non-empty value V: session 26's "(unset) (ran 4) -> 8", when the
    unset default was 4), then "engine switch K as run: VA -> VB" for each other switch whose value
    as run differs when both results record them (effective_switches): a changed default, as
    session 25 made GGUF_HARNESS_GEMV_KQ_PF0 3 where it had been 1 with the variable unset on both
    sides. A switch one side does not record and the other records as "" (the kernel's default of
    its version) is not a difference anyone can read, and is left out. At most `most` notes, the
    last saying how many more there were."""
    wa, wb = set_switches(a), set_switches(b)
    ea, eb = effective_switches(a), effective_switches(b)
    changed = [k for k in sorted(set(wa) | set(wb)) if wa.get(k) != wb.get(k)]

    def side(w: dict, e: dict | None, k: str) -> str:
        ran = (e or {}).get(k)
        v = w.get(k, "(unset)")
        return f"{v} (ran {ran})" if ran and ran != w.get(k) else v
    notes = [f"engine switch {k}: {side(wa, ea, k)} -> {side(wb, eb, k)}" for k in changed]
    if ea is not None and eb is not None:
        shown = lambda d, k: "(not recorded)" if k not in d else "(the default then)" if d[k] == "" else d[k]  # noqa: E731
        notes += [f"engine switch {k} as run: {shown(ea, k)} -> {shown(eb, k)}"
                  for k in sorted(set(ea) | set(eb))
                  if k not in changed and ea.get(k) != eb.get(k) and (ea.get(k) or eb.get(k))]
    if len(notes) > most:
        notes = notes[:most - 1] + [f"... and {len(notes) - most + 1} more engine switch differences"]
    return notes


def clean_step_row(na: dict, nb: dict, threshold: float) -> KernelPerf | None:
    """The "decode step, unslowed windows" row (module docstring), or None when neither side had a
    slowed window or either lacks unslowed samples."""
    import statistics
    ca, cb = clean_samples(na), clean_samples(nb)
    if not (slowed_windows(na) or slowed_windows(nb)) or not ca or not cb:
        return None
    sa, sb = spread(ca), spread(cb)
    noise = None if sa is None or sb is None else max(sa, sb)
    counts = f"{len(ca)} / {len(cb)} windows"
    return KernelPerf("step_unslowed", "decode step, unslowed windows", "graph",
                      **verdict(statistics.median(ca), statistics.median(cb), noise, threshold),
                      note=counts if noise is not None else f"{counts}; {NO_SPREAD}")


def _both(na: float | None, nb: float | None) -> float | None:
    return None if na is None or nb is None else max(na, nb)


def compare_nodes(a: dict, b: dict, threshold: float = 0.02, force: bool = False) -> KernelsAB:
    """B against A (both nodes results); rule in the module docstring. Raises ValueError when
    either is not a nodes result, ConfigError for two model files unless force."""
    from .errors import ConfigError
    if not (is_nodes_result(a) and is_nodes_result(b)):
        raise ValueError(f"not two {NODES_SCHEMA} results")
    na, nb = _body(a), _body(b)
    perf: list[KernelPerf] = []
    checks: list[KernelCheck] = []
    notes: list[str] = []
    sha_a, sha_b = (as_dict(d.get("model")).get("sha256") for d in (a, b))
    if sha_a != sha_b:
        why = f"the nodes results are of different models ({str(sha_a)[:12]} vs {str(sha_b)[:12]})"
        if not force:
            raise ConfigError(why + "; --force compares them anyway")
        notes.append(why)
    for k in ("n_ctx", "n_prompt"):
        if na.get(k) != nb.get(k):
            notes.append(f"{k} differs: {na.get(k)} -> {nb.get(k)}")
    notes += switch_notes(a, b)
    # a GPU that slowed its clocks in one run (harness/gpu_state.py) explains a step change
    notes += ab_notes("step", na.get("gpu_state"), nb.get("gpu_state"))
    # the step's energy (bench_nodes step_j, from session 22): information, not a verdict
    if energy := energy_note(na, nb, "step_j", "step_energy_method", "step J"):
        notes.append(energy)
    # the chain roofline (from session 23) times the GPU on the step's sizes, not the engine's code
    from .step_roofline import ab_note as chain_note
    if chain := chain_note(na.get("chain_roofline"), nb.get("chain_roofline")):
        notes.append(chain)
    noise = None
    sa, sb = spread(na.get("step_samples_us")), spread(nb.get("step_samples_us"))
    if sa is not None and sb is not None:
        noise = max(sa, sb)
    perf.append(KernelPerf("step", "decode step (graph replay)", "graph",
                           **verdict(na.get("step_us"), nb.get("step_us"), noise, threshold),
                           note="" if noise is not None else NO_SPREAD))
    if clean := clean_step_row(na, nb, threshold):
        perf.append(clean)
    elif any(slowed_windows(n) for n in (na, nb)):
        notes.append("step: replay windows slowed by a power or thermal limit, and no unslowed windows "
                     "on both sides to compare (harness bench nodes --clean-samples)")
    # a timing-only build (GGUF_HARNESS_DIAG): its step is a bound; its nodes, each replayed in a
    # graph of its own without the PDL wait or the staging, are not a decode step's
    if diag := diag_sides(a, b):
        notes.append(f"diagnostic build (timing only, values wrong by design): {diag}; "
                     f"only the decode step is compared")
        return KernelsAB(perf, checks, notes, kind="nodes")
    ma, mb = as_dict(na.get("methods")), as_dict(nb.get("methods"))
    method = next((m for m in ("graph", "eager") if isinstance(ma.get(m), dict) and isinstance(mb.get(m), dict)), None)
    if method is None:
        notes.append("no node timing method in both files: only the step is compared")
        return KernelsAB(perf, checks, notes, kind="nodes")
    ra, rb = ([r for r in as_list(m[method].get("nodes")) if isinstance(r, dict)] for m in (ma, mb))
    sn = _both(group_noise(ra), group_noise(rb))
    perf.append(KernelPerf("sum", "sum of nodes", method,
                           **verdict(ma[method].get("sum_us"), mb[method].get("sum_us"), sn, threshold),
                           note="" if sn is not None else NO_SPREAD))
    ga, gb = groups(ra), groups(rb)
    rows = []
    for name in ga.keys() & gb.keys():
        (ca, ua, noa), (cb, ub, nob) = ga[name], gb[name]
        if ca != cb:
            checks.append(KernelCheck(name, "node count", str(ca), str(cb), "count"))
        gn = _both(noa, nob)
        rows.append(KernelPerf(name, f"{name} x{cb}", method, **verdict(ua, ub, gn, threshold),
                               note="" if gn is not None else NO_SPREAD))
    rows.sort(key=lambda p: -abs((p.b_us or 0) - (p.a_us or 0)))
    perf += rows
    checks += [KernelCheck(n, "node group", "present", "missing", "missing") for n in sorted(ga.keys() - gb.keys())]
    checks += [KernelCheck(n, "node group", "missing", "present", "new") for n in sorted(gb.keys() - ga.keys())]
    return KernelsAB(perf, checks, notes, kind="nodes")
