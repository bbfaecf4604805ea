"""`harness bench nodes`: one decode step of the engine timed node by node (GPU only).

Two timings per node (backends/engine/executor.py):
  eager  one eager run with a CUDA event pair around every node, behind a kernel that holds
         the stream until every launch is queued, so host launch time is not measured;
  graph  every node replayed back to back in a CUDA graph of its own: its cost inside a
         graph (launch latency included; weights hot in L2 when they fit in it); the median
         of 5 replays, the replays kept per node (us_samples) for harness ab's spread.
Next to them the step time of the captured step graph (chained replays, as decoding runs);
step - sum(node times) is what per-node figures do not show: dependency gaps between
kernels, and weights that are cold in a real step (and how a node's early-ending SMs start the
next node: docs/perf-notes.md session 30).

Slowed samples: a GPU at its power limit lowers its clocks after the first replay window (the
H200 here at 700 W: the 27B step's first window clean, the next two capped in ~2/3 of their
readings, +3.5 % step time). Which windows were slowed is read from the GPU-state readings
(harness/gpu_state.py window_slowdown); when any was, up to `clean` more single windows are
taken, each after the GPU has cooled (no slowdown reason and power <= COOL_POWER of its limit,
at most cool_s seconds of waiting), and the windows with no slowdown reading are kept as
step_clean_samples_us: what `harness ab` compares when either side was slowed.

Result: schema gguf-harness/nodes/1, written with the HTML beside it into a new run folder.
"""
from __future__ import annotations

import re
from collections import defaultdict
from contextlib import contextmanager

SCHEMA = "gguf-harness/nodes/1"
METHODS = ("graph", "eager")
TOP_N = 20
COOL_POWER = 0.5  # share of the power limit below which a retaken step window may start
_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")


def split_name(name: str) -> tuple[int | None, str]:
    """("blk.3.ffn_down") -> (3, "ffn_down"); a node outside the layers -> (None, name)."""
    m = _LAYER.match(name)
    return (int(m.group(1)), m.group(2)) if m else (None, name)


def aggregate(rows: list[dict], step_us: float | None) -> dict:
    """Summaries of one method's node rows [{name, kind, fmt, us, bytes}] (us > 0 expected).

    Returns {"nodes": rows + gb_s (bytes / us / 1e3) and pct (of the node sum), "sum_us",
    "step_us", "gap_us" (step - sum, None without a step time), "by_kind": [{kind, n, us, pct}]
    largest first, "by_op": per node name without the layer prefix (e.g. all ffn_down),
    "top": the TOP_N slowest nodes}. Raises ValueError on an empty list or a negative time."""
    if not rows:
        raise ValueError("no node timings")
    if any(r["us"] < 0 for r in rows):
        raise ValueError("negative node time")
    total = sum(r["us"] for r in rows)
    nodes = [dict(r, gb_s=(r["bytes"] / r["us"] / 1e3) if r["us"] > 0 else None,
                  pct=100 * r["us"] / total if total > 0 else 0.0) for r in rows]

    def group(key) -> list[dict]:
        acc: dict[str, list[float]] = defaultdict(list)
        for r in nodes:
            acc[key(r)].append(r["us"])
        out = [{"name": k, "n": len(v), "us": sum(v), "pct": 100 * sum(v) / total if total else 0.0}
               for k, v in acc.items()]
        return sorted(out, key=lambda g: -g["us"])

    return {"nodes": nodes, "sum_us": total, "step_us": step_us,
            "gap_us": None if step_us is None else step_us - total,
            "by_kind": group(lambda r: r["kind"]),
            "by_op": group(lambda r: split_name(r["name"])[1]),
            "top": sorted(nodes, key=lambda r: -r["us"])[:TOP_N]}


def layer_matrix(rows: list[dict]) -> tuple[list[int], list[str], list[list[float]]]:
    """(layers, ops, us[layer][op]) of the per-layer nodes, ops in first-seen order; nodes
    outside the layers (embedding, head, argmax) are left out (they are in the totals)."""
    layers: list[int] = []
    ops: list[str] = []
    cell: dict[tuple[int, str], float] = defaultdict(float)
    for r in rows:
        layer, op = split_name(r["name"])
        if layer is None:
            continue
        if layer not in layers:
            layers.append(layer)
        if op not in ops:
            ops.append(op)
        cell[layer, op] += r["us"]
    layers.sort()
    return layers, ops, [[cell[layer, op] for op in ops] for layer in layers]


def diag_build(result) -> str | None:
    """The GGUF_HARNESS_DIAG value a nodes result's engine ran with (backends/engine/module.py: a
    timing-only build whose values are wrong by design): nodes.engine.switches_effective, else
    machine.switches (what was set); None when unset, empty, absent or malformed (hostile JSON).
    Made visible and cut to 40 characters (reports.fmt.visible; callers escape it for HTML)."""
    if not isinstance(result, dict):
        return None
    body = result.get("nodes") if isinstance(result.get("nodes"), dict) else {}
    engine = body.get("engine") if isinstance(body.get("engine"), dict) else {}
    machine = result.get("machine") if isinstance(result.get("machine"), dict) else {}
    for sw in (engine.get("switches_effective"), machine.get("switches")):
        if not isinstance(sw, dict) or "GGUF_HARNESS_DIAG" not in sw:
            continue  # the engine's record decides where it has the switch
        v = sw["GGUF_HARNESS_DIAG"]
        if not (isinstance(v, str) and v.strip(" ,")):
            return None
        from reports.fmt import visible
        return visible(v, 40, spaces=False)
    return None


def diag_sides(a: dict, b: dict) -> str:
    """"A GGUF_HARNESS_DIAG=..., B ..." for the sides of an A/B that are diagnostic builds
    (diag_build; also a kernels result, by its machine.switches), "" when neither is."""
    return ", ".join(f"{side} GGUF_HARNESS_DIAG={v}" for side, d in (("A", a), ("B", b)) if (v := diag_build(d)))


@contextmanager
def loaded_engine(model, n_ctx: int):
    """An EngineBackend loaded on `model` (harness.config.ModelRef) with n_ctx, closed on exit
    (run_nodes, harness.graph_edges). Raises UnsupportedError without CuPy/GPU, ConfigError /
    ModelError on bad input, ValueError on a bad GGUF_HARNESS_* switch value (from the engine)."""
    from backends.engine import EngineBackend

    from .config import RunConfig
    e = EngineBackend(allow_diag=True)  # GGUF_HARNESS_DIAG: a step time is what such a build is for
    e.load(model, RunConfig(n_ctx=n_ctx))
    try:
        yield e
    finally:
        e.close()


def cooled(reading: dict | None) -> bool:
    """Whether a GPU-state reading (harness/gpu_state.py GpuStateSampler.sample) shows a GPU that
    may start a clean timing window: no slowdown reason and power at most COOL_POWER of its limit
    (NVML's power reading lags the load by ~1 s, so this also waits that lag out). False for a
    reading that cannot say (None, unknown reasons or power)."""
    from .gpu_state import slowed
    if not isinstance(reading, dict) or slowed(reading) is not False:
        return False
    from .jsonread import finite
    p, lim = finite(reading.get("power_w")), finite(reading.get("power_limit_w"))
    return p is not None and lim is not None and lim > 0 and p <= COOL_POWER * lim


def retake_slowed(readings, bench_once, windows, n: int, cool_s: float = 5.0, sleep=None, now=None) -> list:
    """Up to `n` more step windows when any of `windows` ([a, b] time.monotonic() s) was slowed
    (gpu_state.window_slowdown over readings() > 0); none when no window was, or none could be
    judged (no readings: no NVML). Before each: wait (polling every 0.1 s, at most cool_s s)
    until the latest reading is `cooled`, then bench_once() (the engine's bench with one
    repetition) -> (decode seconds, its window). Returns [(decode_s, [a, b], waited_s)]."""
    import time

    from .gpu_state import window_slowdown
    sleep, now = sleep or time.sleep, now or time.monotonic
    shares = window_slowdown(readings(), windows)
    if n <= 0 or not any(x for x in shares if x is not None):
        return []
    out = []
    for _ in range(n):
        t0 = now()
        while now() - t0 < cool_s:
            last = readings()[-1:]
            if last and cooled(last[0]):
                break
            sleep(0.1)
        waited = now() - t0
        r = bench_once()
        out.append((r["decode_s"][0], r["decode_window"][0], waited))
    return out


def windows(body: dict) -> list[tuple[float, float | None]]:
    """(us, slowdown share) of each of a nodes result's step windows: the three timed ones
    (step_samples_us with step_samples_slowdown, since session 30), then the retaken ones
    (step_retakes' us and slowdown); for older files the shares are derived from the raw
    GPU-state readings and the windows they keep (gpu_state.samples, step_windows:
    gpu_state.window_slowdown). A sample that is not a finite positive number, or a share
    outside 0..1 (bools and strings included), is unknown: the window is dropped, or its share is
    None. [] when the lists do not pair up one to one (a hand-edited or damaged file cannot say
    which share is whose)."""
    from .gpu_state import window_slowdown
    from .jsonread import as_dict, as_list, finite, finite_pos
    samples = as_list(body.get("step_samples_us"))
    if "step_samples_slowdown" in body:
        shares = as_list(body.get("step_samples_slowdown"))
        retakes = [r if isinstance(r, dict) else {} for r in as_list(body.get("step_retakes"))]
        samples = samples + [r.get("us") for r in retakes]
        shares = shares + [r.get("slowdown") for r in retakes]
    else:
        readings = [s for s in as_list(as_dict(body.get("gpu_state")).get("samples")) if isinstance(s, dict)]
        wins = as_list(body.get("step_windows"))
        if not readings or len(wins) != len(samples):
            return []
        shares = window_slowdown(readings, wins)
    if len(shares) != len(samples):
        return []
    out = []
    for us, x in zip(samples, shares):
        us, x = finite_pos(us), finite(x)
        if us is not None:
            out.append((us, x if x is not None and 0 <= x <= 1 else None))
    return out


def slowed_windows(body: dict) -> int:
    """How many of a nodes result's step windows ran slowed (a share of slowdown readings > 0)."""
    return sum(1 for _, x in windows(body) if x is not None and x > 0)


def clean_samples(body: dict) -> list[float]:
    """The step samples (us) of the windows with no slowdown reading (share 0), timed and
    retaken (run_nodes records them as step_clean_samples_us)."""
    return [us for us, x in windows(body) if x == 0]


def run_nodes(model, n_ctx: int, prompt_ids: list[int], methods=METHODS, steps: int = 64,
              log=print, chain: bool = True, clean: int = 4, cool_s: float = 5.0) -> dict:
    """Load the engine on `model` (harness.config.ModelRef), feed the prompt, time the step
    graph over `steps` chained replays (median of 3) and every node with each method; with
    `chain`, also the step's chain roofline (harness/step_roofline.py: a streaming read of each
    node's bytes, chained with PDL) as "chain_roofline"; when a replay window was slowed (power
    cap, thermal), up to `clean` more windows after a cool-down (retake_slowed, module docstring).
    Raises UnsupportedError without CuPy/GPU (from the engine), ConfigError on bad input."""
    import statistics

    from .errors import ConfigError
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise ConfigError(f"node timing methods {bad or methods}: expected some of {', '.join(METHODS)}")
    if len(prompt_ids) + steps + 1 > n_ctx:
        raise ConfigError(f"n_ctx {n_ctx} too small for {len(prompt_ids)} prompt tokens + {steps} steps")
    from .bench_e2e import decode_energy
    from .gpu_state import GpuStateSampler, describe, window_slowdown
    with loaded_engine(model, n_ctx) as e:
        diag = e.info().get("switches_effective", {}).get("GGUF_HARNESS_DIAG")
        if diag:
            log(f"GGUF_HARNESS_DIAG={diag}: a timing-only build, its values are wrong by design")
        # the engine's own throughput loop: prompt, then `steps` chained step-graph replays,
        # with the GPU's clocks, power and slowdown reasons sampled while it runs
        with GpuStateSampler(period_s=0.02) as gpu:  # 20 ms: the energy windows (gpu_state.window_energy_j)
            timed = e.bench(prompt_ids, steps, 3)
            retaken = retake_slowed(gpu.readings, lambda: e.bench(prompt_ids, steps, 1), timed.get("decode_window"),
                                    clean, cool_s)
        decode_s = timed["decode_s"]
        step_us = 1e6 * statistics.median(decode_s) / steps
        # harness/gpu_state.py: clocks / slowdown while the three windows ran (the cool-downs and
        # retakes after them are left out of the summary, kept in its raw samples)
        last_end = max((w[1] for w in timed.get("decode_window") or []), default=None) if retaken else None
        state = gpu.summary(until=last_end)
        # each window's share of slowdown readings, the three timed ones and the retaken ones
        shares = window_slowdown(gpu.readings(), list(timed.get("decode_window") or [])
                                 + [w for _, w, _ in retaken])
        # the step's energy from the board's energy counter over the replays' windows (bench_e2e)
        energy = decode_energy(timed.get("decode_window"), gpu.energy_j, steps)
        log(f"step graph: {step_us:.1f} us/token ({steps} chained replays, median of 3)")
        log(f"GPU while timed: {describe(state)}")
        if energy:
            log(f"step energy: {energy['decode_j_per_token']:.3f} J ({energy['decode_power_w']:.0f} W, NVML energy counter)")
        out = {"schema": SCHEMA, "n_ctx": n_ctx, "n_prompt": len(prompt_ids), "step_us": step_us,
               # each replay sample's us per step: the spread harness ab (ab_nodes.py) judges by
               "step_samples_us": [1e6 * s / steps for s in decode_s],
               "gpu_state": state,
               **({"step_j": energy["decode_j_per_token"], "step_power_w": energy["decode_power_w"],
                   "step_energy_method": energy["decode_energy_method"]} if energy else {}),
               # the replays' windows (time.monotonic() s) beside gpu_state's samples: step_j recomputable
               "step_windows": timed.get("decode_window"),
               # slowed windows (module docstring): each window's share of slowdown readings, the
               # retaken windows, and the samples of every window with none
               "step_samples_slowdown": shares[:len(decode_s)],
               "step_retakes": [{"us": 1e6 * d / steps, "window": w, "waited_s": round(t, 3), "slowdown": x}
                                for (d, w, t), x in zip(retaken, shares[len(decode_s):])],
               "engine": e.info(), "methods": {}}
        clean_us = clean_samples(out)  # (the one reading of these fields: harness ab's, the page's)
        out.update(step_clean_samples_us=clean_us, step_clean_us=statistics.median(clean_us) if clean_us else None)
        if retaken or slowed_windows(out):
            msg = (f"{len(clean_us)} of {len(windows(out))} windows unslowed, median "
                   f"{statistics.median(clean_us):.1f} us" if clean_us else "no window unslowed")
            log(f"step graph: slowed windows (power / thermal): {len(retaken)} retaken after a cool-down; {msg}")
        if chain:  # what one kernel per node could reach on these sizes (cold, dependent, no arithmetic)
            from . import step_roofline
            try:
                out["chain_roofline"] = step_roofline.time_chain([int(n.bytes) for n in e.step_exec.nodes],
                                                                 step_us, log=log)
            except Exception as err:  # a roofline that fails costs its own figure, not the nodes result
                why = f"{type(err).__name__}: {err}"[:300]
                log(f"chain roofline failed: {why}")
                out["chain_roofline"] = {"method": step_roofline.METHOD, "why": why}
        e.reset()
        e.prefill(prompt_ids)
        for m in methods:
            rows = e.node_times(int(prompt_ids[-1]), method=m)
            out["methods"][m] = aggregate(rows, step_us)
            log(f"{m}: {len(rows)} nodes, sum {out['methods'][m]['sum_us']:.1f} us")
        return out
