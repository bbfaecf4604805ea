"""GPU clocks, power and clock-event reasons sampled during a timed region, through NVML
(nvidia-ml-py, `pynvml`).

Why: session 21 measured the same engine build 3.5 % apart between machine starts while
llama.cpp moved 1 % (docs/perf-notes.md, session 21), with per-node sums unchanged and the step's
later samples slower. A result that records the SM / memory clocks and NVML's clock-event
("throttle") reasons while it was timed says whether a slower run was a slower build or a GPU
that lowered its clocks (power cap, thermal slowdown).

`GpuStateSampler` polls the GPU from a daemon thread every `period_s` while the timed code runs
on the caller's thread (pynvml calls go through ctypes, which releases the GIL; each poll is a
few NVML queries, far below the decode loop's cost). Without NVML (a CPU machine, no
nvidia-ml-py, no driver) it records why and nothing else: timing never fails for its sake.

NVML calls (nvml.h, NVIDIA Management Library reference): nvmlDeviceGetClockInfo (MHz),
nvmlDeviceGetPowerUsage (mW), nvmlDeviceGetEnforcedPowerLimit (mW), nvmlDeviceGetTemperature
(C), nvmlDeviceGetCurrentClocksEventReasons (bit mask; the older name is
nvmlDeviceGetCurrentClocksThrottleReasons).
"""
from __future__ import annotations

import threading
import time

# NVML clock-event reasons that lower clocks below what the load asks for (the others, GPU idle,
# application / user clock settings, display clock, sync boost, say why clocks are where they
# are without a slowdown). Names: pynvml's nvmlClocksEventReason<Name> constants.
SLOWDOWN_REASONS = ("SwPowerCap", "HwSlowdown", "SwThermalSlowdown", "HwThermalSlowdown",
                    "HwPowerBrakeSlowdown")
# (UserDefinedClocks is left out: nvml.h defines it as the same bit as ApplicationsClocksSetting)
ALL_REASONS = ("GpuIdle", "ApplicationsClocksSetting", "SyncBoost", "DisplayClockSetting") + SLOWDOWN_REASONS
SCHEMA = "gguf-harness/gpu-state/1"
MAX_SAMPLES = 20000  # bound on a result's raw samples (a 10-minute region at 20 Hz = 12000)


def reason_names(mask: int, nvml) -> list[str]:
    """The names in ALL_REASONS whose pynvml constant (nvmlClocksEventReason<Name>, else the
    older nvmlClocksThrottleReason<Name>) is set in `mask`, in ALL_REASONS order; bits of
    constants this pynvml lacks are left out."""
    out = []
    for name in ALL_REASONS:
        bit = getattr(nvml, "nvmlClocksEventReason" + name, None)
        if bit is None:
            bit = getattr(nvml, "nvmlClocksThrottleReason" + name, None)
        if bit and mask & bit:
            out.append(name)
    return out


class GpuStateSampler:
    """Context manager: samples the GPU (CUDA device `device` by its PCI bus id when CuPy is
    importable, else NVML index `device`) every `period_s` seconds between __enter__ and
    __exit__, and once at each end. `summary()` afterwards: a dict (see summarize) that always
    has "available" and, without NVML, "why". Never raises for NVML's sake."""

    def __init__(self, period_s: float = 0.05, device: int = 0, nvml=None):
        if not period_s > 0:
            raise ValueError(f"GPU state period {period_s} s: expected > 0")
        self.period_s, self.device = period_s, device
        self._nvml, self._handle, self.why = nvml, None, None
        self._samples: list[dict] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def _open(self) -> None:
        try:
            if self._nvml is None:
                import pynvml  # nvidia-ml-py
                self._nvml = pynvml
            self._nvml.nvmlInit()
        except Exception as e:  # no module, no driver library, no GPU: record why, time anyway
            self.why, self._nvml = f"{type(e).__name__}: {e}", None
            return
        try:
            self._handle = self._device_handle()
        except Exception as e:
            self.why = f"{type(e).__name__}: {e}"
            self._close()

    def _device_handle(self):
        try:  # NVML and CUDA may number devices apart (CUDA_VISIBLE_DEVICES): match the bus id
            import cupy as cp
            bus = cp.cuda.Device(self.device).pci_bus_id
            return self._nvml.nvmlDeviceGetHandleByPciBusId(bus)
        except Exception:  # no CuPy or no CUDA device through it: NVML's own numbering
            return self._nvml.nvmlDeviceGetHandleByIndex(self.device)

    def _close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
        self._nvml, self._handle = None, None

    def sample(self) -> dict | None:
        """One reading: t (s since __enter__), sm_mhz, mem_mhz, power_w, power_limit_w, temp_c,
        reasons (names); None without NVML or when a query fails (the failure is kept in why)."""
        if self._handle is None:
            return None
        n, h = self._nvml, self._handle
        try:
            ev = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None) \
                or n.nvmlDeviceGetCurrentClocksThrottleReasons
            return {"t": round(time.perf_counter() - self._t0, 4),
                    "sm_mhz": n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM),
                    "mem_mhz": n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM),
                    "power_w": n.nvmlDeviceGetPowerUsage(h) / 1000.0,
                    "power_limit_w": n.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0,
                    "temp_c": n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU),
                    "reasons": reason_names(int(ev(h)), n)}
        except Exception as e:
            self.why = f"{type(e).__name__}: {e}"
            return None

    def _keep(self, s: dict | None) -> None:
        if s is not None and len(self._samples) < MAX_SAMPLES:
            self._samples.append(s)

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self._keep(self.sample())

    def __enter__(self) -> "GpuStateSampler":
        self._t0 = time.perf_counter()
        self._open()
        self._keep(self.sample())
        if self._handle is not None:
            self._thread = threading.Thread(target=self._loop, name="gpu-state", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._keep(self.sample())
        self._close()

    def summary(self, raw: bool = True) -> dict:
        """summarize(samples) plus "why" when NVML was missing or failed, and the raw samples
        (bounded by MAX_SAMPLES) when `raw`."""
        out = summarize(self._samples)
        if self.why:
            out["why"] = self.why
        if raw and self._samples:
            out["samples"] = list(self._samples)
        return out


def summarize(samples: list[dict]) -> dict:
    """{"schema", "available", "n", "sm_mhz": [min, median, max], "mem_mhz": [...],
    "power_w": [...], "power_limit_w": max, "temp_c": [...], "reasons": {name: samples with it},
    "slowdown": samples with any SLOWDOWN_REASONS} of sample dicts; available False for none."""
    import statistics
    if not samples:
        return {"schema": SCHEMA, "available": False}

    def rng(key):
        v = [s[key] for s in samples if s.get(key) is not None]
        return [min(v), statistics.median(v), max(v)] if v else None

    reasons: dict[str, int] = {}
    for s in samples:
        for r in s.get("reasons") or ():
            reasons[r] = reasons.get(r, 0) + 1
    return {"schema": SCHEMA, "available": True, "n": len(samples), "sm_mhz": rng("sm_mhz"),
            "mem_mhz": rng("mem_mhz"), "power_w": rng("power_w"),
            "power_limit_w": max((s.get("power_limit_w") or 0) for s in samples) or None,
            "temp_c": rng("temp_c"), "reasons": reasons,
            "slowdown": sum(1 for s in samples if set(s.get("reasons") or ()) & set(SLOWDOWN_REASONS))}


def describe(state: dict | None) -> str:
    """One line for tables and A/B notes, e.g. "SM 1755-1980 MHz (median 1980), memory 3201 MHz,
    power <= 690 W of 700, 71 C; slowdown in 12 of 40 samples (SwPowerCap 12)"; "no GPU state"
    (with why) when none was recorded."""
    if not state or not state.get("available"):
        why = (state or {}).get("why")
        return "no GPU state" + (f" ({why})" if why else "")

    def span(v, unit):
        lo, med, hi = v
        return f"{lo:.0f} {unit}" if lo == hi else f"{lo:.0f}-{hi:.0f} {unit} (median {med:.0f})"

    parts = []
    if state.get("sm_mhz"):
        parts.append("SM " + span(state["sm_mhz"], "MHz"))
    if state.get("mem_mhz"):
        parts.append("memory " + span(state["mem_mhz"], "MHz"))
    if state.get("power_w"):
        lim = state.get("power_limit_w")
        parts.append(f"power <= {state['power_w'][2]:.0f} W" + (f" of {lim:.0f}" if lim else ""))
    if state.get("temp_c"):
        parts.append(f"{state['temp_c'][2]:.0f} C")
    slow = state.get("slowdown") or 0
    tail = (f"slowdown in {slow} of {state.get('n')} samples ("
            + ", ".join(f"{r} {c}" for r, c in state.get("reasons", {}).items() if r in SLOWDOWN_REASONS)
            + ")") if slow else "no slowdown reason"
    return ", ".join(parts) + "; " + tail


def ab_notes(label: str, a: dict | None, b: dict | None) -> list[str]:
    """Notes for an A/B of two timed regions: either side slowed by a SLOWDOWN_REASONS reason,
    or median SM / memory clocks more than 1 % apart (then a time difference may be the GPU's,
    not the build's). Empty when neither recorded GPU state or nothing differs."""
    notes = []
    for side, s in (("A", a), ("B", b)):
        if s and s.get("available") and s.get("slowdown"):
            notes.append(f"{label} {side}: {describe(s)}")
    if a and b and a.get("available") and b.get("available"):
        for key, what in (("sm_mhz", "SM clock"), ("mem_mhz", "memory clock")):
            if a.get(key) and b.get(key):
                ma, mb = a[key][1], b[key][1]
                if ma and abs(mb - ma) > 0.01 * ma:
                    notes.append(f"{label}: median {what} {ma:.0f} -> {mb:.0f} MHz")
    return notes


def short_note(a: dict | None, b: dict | None) -> str:
    """ab_notes in a few words for a table cell, e.g. "GPU: B slowed in 12/40 samples (SwPowerCap);
    median SM clock 1980 -> 1755 MHz"; "" when nothing to say."""
    parts = []
    for side, s in (("A", a), ("B", b)):
        if s and s.get("available") and s.get("slowdown"):
            why = ", ".join(r for r in s.get("reasons", {}) if r in SLOWDOWN_REASONS)
            parts.append(f"{side} slowed in {s['slowdown']}/{s.get('n')} samples ({why})")
    parts += [n.split(": ", 1)[1] for n in ab_notes("", a, b) if n.startswith(": ")]
    return ("GPU: " + "; ".join(parts)) if parts else ""
