"""End-to-end throughput (`harness verify --bench`, on by default in `harness run` with a GPU):
prefill and decode tok/s of every backend at
every context, in the same run, next to the device's copy bandwidth measured at the start.

Per backend and context: load (child process), backend.bench(prompt, n_decode, reps + 1),
close. The first repetition is a warm-up and is dropped, as llama-bench does: llama.cpp-CUDA's
first prefill measured ~12x slower than the next ones (0.09 s vs 0.0075 s, 0.5B on the H200),
which made its prefill spread 90-97 % and its mean meaningless.
Decode tok/s = n_decode / median decode seconds; effective bandwidth = decode weight bytes
per step (harness.model_bytes) / step time, as % of the copy bandwidth. Engine/llama.cpp
ratios are reported per context. Throughput is only meaningful next to a passing
verification of the same backend, so it is only run after one, into the same result.
A backend with the "memory" capability (the engine) adds its planned vs measured device
memory after the bench to the row (row["memory"], MEMORY_KEYS of its info()), and the switch
values it ran with where its info() gives them (row["switches_effective"]). Every row records
the GPU's clocks, power and clock-event (slowdown) reasons sampled while it was timed
(row["gpu_state"], harness/gpu_state.py), which `harness ab` notes when they differ, and the
decode's energy per token from the board's energy counter over the decode windows the backend
reports (row["decode_j_per_token"], row["decode_power_w"]; decode_energy): session 22 found the
engine's decode drawing ~690 W of the H200's 700 against ~420 W for a plain copy at full HBM speed,
so on a power-capped GPU J/token limits tok/s.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import replace

from .config import ModelRef, RunConfig
from .errors import HarnessError
from .gpu_state import GpuStateSampler, describe
from .jsonread import finite, finite_pos

# the engine's info() fields recorded per bench row (backends/engine/backend.py info())
MEMORY_KEYS = ("token_embd", "planned_bytes", "plan_free_bytes", "vram_limit", "bytes_resident",
               "bytes_host", "kv_bytes", "pool_bytes", "measured_bytes_load", "measured_bytes_step")


def _row(name: str, n_ctx: int, r: dict, n_prompt: int, n_decode: int, step_bytes: int,
         copy_gbs: float | None) -> dict:
    dec = statistics.median(r["decode_s"])
    pre = statistics.median(r["prefill_s"])
    row = {"backend": name, "n_ctx": n_ctx, "n_prompt": n_prompt, "n_decode": n_decode,
           "reps": len(r["decode_s"]), "prefill_tok_s": n_prompt / pre,
           "decode_tok_s": n_decode / dec, "ms_per_token": 1e3 * dec / n_decode,
           "decode_tok_s_min": n_decode / max(r["decode_s"]),
           "decode_tok_s_max": n_decode / min(r["decode_s"]),
           "bytes_per_step": step_bytes, "eff_gb_s": step_bytes / (dec / n_decode) / 1e9,
           "raw": r}
    if copy_gbs:
        row["pct_copy_bw"] = 100 * row["eff_gb_s"] / copy_gbs
    if r.get("decode_sync_s"):
        row["decode_sync_tok_s"] = n_decode / statistics.median(r["decode_sync_s"])
    return row


def bench_e2e(model: ModelRef, step_bytes: int, backends: list[str], contexts, prompt_ids,
              base: RunConfig, create, *, n_decode: int = 128, reps: int = 3,
              copy_gbs: float | None = None, mem_used=None, log=print) -> dict:
    """Rows for every backend x context; a backend that fails is recorded with its error."""
    rows, errors = [], []
    for name in backends:
        for n_ctx in contexts:
            b = None
            try:
                before = mem_used() if mem_used else None
                b = create(name)
                b.load(model, replace(base, n_ctx=n_ctx))
                with GpuStateSampler(period_s=0.02) as gpu:  # clocks / slowdown / energy while timed (20 ms: window_energy_j)
                    r = _drop_warmup(b.bench(list(prompt_ids), n_decode, reps + 1), reps)
                row = _row(name, n_ctx, r, len(prompt_ids), n_decode, step_bytes, copy_gbs)
                row["gpu_state"] = gpu.summary()
                row.update(decode_energy(r.get("decode_window"), gpu.energy_j, n_decode))
                if mem_used:
                    row["gpu_mem_used_bytes"] = mem_used() - before
                row.update(_memory(b))
                rows.append(row)
                log(f"{name} c={n_ctx}: decode {row['decode_tok_s']:.1f} tok/s "
                    f"({row['ms_per_token']:.3f} ms/token), prefill {row['prefill_tok_s']:.0f} tok/s")
                if row["gpu_state"].get("available"):
                    log(f"  GPU while timed: {describe(row['gpu_state'])}")
                if "decode_j_per_token" in row:
                    log(f"  decode energy: {row['decode_j_per_token']:.2f} J/token "
                        f"({row['decode_power_w']:.0f} W, NVML energy counter)")
            except (HarnessError, OSError, RuntimeError, ValueError) as e:
                errors.append({"backend": name, "n_ctx": n_ctx, "error": f"{type(e).__name__}: {e}"})
                log(f"{name} c={n_ctx} failed: {type(e).__name__}: {e}")
            finally:
                if b is not None:
                    try:
                        b.close()
                    except Exception:  # a dead child has nothing left to close
                        pass
    return {"rows": rows, "errors": errors, "ratios": _ratios(rows), "copy_gb_s": copy_gbs,
            "n_decode": n_decode, "reps": reps}


# which estimator made a row's energy figures (harness/gpu_state.py window_energy_j): results of
# session 22's third machine start hold the first one's (the counter interpolated at the window's
# ends; no tag), which mixed the prefill's power into the window's edges (docs/perf-notes.md)
ENERGY_METHOD = "nvml-energy-counter-lsq/1"


def decode_energy(windows, energy_j, n_decode: int) -> dict:
    """{"decode_j_per_token": J, "decode_power_w": W, "decode_energy_method": ENERGY_METHOD} of a
    bench row: the median over its repetitions of the GPU energy in each decode window ([start,
    end] in time.monotonic() s, as the backends' bench() returns them; energy_j(a, b):
    harness/gpu_state.py window_energy_j) divided by n_decode tokens, and by the window's seconds. {} when a backend gives no windows,
    a window is malformed, or any window's energy is unknown (no NVML, no energy counter, a
    window the sampler did not cover): a partial median would mix repetitions."""
    if not isinstance(windows, list) or not windows or not n_decode > 0:
        return {}
    per_token, watts = [], []
    for w in windows:
        if not (isinstance(w, (list, tuple)) and len(w) == 2
                and all(finite(t) is not None for t in w) and w[1] > w[0]):
            return {}
        e = energy_j(w[0], w[1])
        if finite(e) is None or e < 0:
            return {}
        per_token.append(e / n_decode)
        watts.append(e / (w[1] - w[0]))
    return {"decode_j_per_token": statistics.median(per_token), "decode_power_w": statistics.median(watts),
            "decode_energy_method": ENERGY_METHOD}


def _memory(backend) -> dict:
    """{"memory": planned vs measured device memory} of a backend that reports it (plus
    "switches_effective" when its info() has them: the engine's, backends/engine/switches.py),
    else {}."""
    from backends.base import CAP_MEMORY
    if CAP_MEMORY not in backend.capabilities():
        return {}
    info = backend.info()
    out = {"memory": {k: info.get(k) for k in MEMORY_KEYS}}
    if info.get("switches_effective") is not None:
        out["switches_effective"] = info["switches_effective"]
    return out


def rep_rates(n_tokens, seconds) -> list[float]:
    """Per-repetition rates [tok/s] = n_tokens / seconds[i] of a bench row's raw times (as
    read back from JSON: any entry may be of a wrong type). nan where a time or n_tokens is
    not a positive finite number."""
    if not isinstance(seconds, list):
        return []
    n = finite_pos(n_tokens)
    return [n / s if n and (s := finite_pos(t)) else math.nan for t in seconds]


def _drop_warmup(r: dict, reps: int) -> dict:
    """The per-repetition lists of a bench() result without the first (warm-up) entry.
    Raises HarnessError when a list does not hold reps + 1 values."""
    out = {}
    for k, v in r.items():
        if isinstance(v, list):
            if len(v) != reps + 1:
                raise HarnessError(f"bench returned {len(v)} values for {k}, expected {reps + 1}")
            v = v[1:]
        out[k] = v
    return out


def _ratios(rows: list[dict]) -> list[dict]:
    """engine / llamacpp decode and prefill speed ratios per context."""
    by = {(r["backend"], r["n_ctx"]): r for r in rows}
    out = []
    for (name, c), r in by.items():
        ref = by.get(("llamacpp", c))
        if name != "llamacpp" and ref:
            out.append({"backend": name, "vs": "llamacpp", "n_ctx": c,
                        "decode_ratio": r["decode_tok_s"] / ref["decode_tok_s"],
                        "prefill_ratio": r["prefill_tok_s"] / ref["prefill_tok_s"]})
    return out
