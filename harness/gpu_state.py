"""GPU clocks, power and clock-event reasons sampled during a timed region, through NVML
(nvidia-ml-py, `pynvml`).

Why: session 21 measured the same engine build 3.5 % apart between machine starts while
llama.cpp moved 1 % (docs/perf-notes.md, session 21), with per-node sums unchanged and the step's
later samples slower. A result that records the SM / memory clocks and NVML's clock-event
("throttle") reasons while it was timed says whether a slower run was a slower build or a GPU
that lowered its clocks (power cap, thermal slowdown).

`GpuStateSampler` polls the GPU from a daemon thread every `period_s` while the timed code runs
on the caller's thread (pynvml calls go through ctypes, which releases the GIL; each poll is seven
NVML queries; its cost to the timed region has not been measured: a bench nodes A/B with the
sampler's period raised would show it). Without NVML (a CPU machine, no
nvidia-ml-py, no driver) it records why and nothing else: timing never fails for its sake.

NVML calls (nvml.h, NVIDIA Management Library reference): nvmlDeviceGetClockInfo (MHz),
nvmlDeviceGetPowerUsage (mW), nvmlDeviceGetEnforcedPowerLimit (mW), nvmlDeviceGetTemperature
(C), nvmlDeviceGetCurrentClocksEventReasons (bit mask; the older name is
nvmlDeviceGetCurrentClocksThrottleReasons), nvmlDeviceGetTotalEnergyConsumption (mJ since the
driver loaded). window_energy_j turns the last into the energy of a time window, e.g. a bench
row's decode repetitions (harness/bench_e2e.py: J per token).
"""
from __future__ import annotations

import threading
import time

from .jsonread import finite

# NVML clock-event reasons that lower clocks below what the load asks for (the others, GPU idle,
# application / user clock settings, display clock, sync boost, say why clocks are where they
# are without a slowdown). Names: pynvml's nvmlClocksEventReason<Name> constants.
SLOWDOWN_REASONS = ("SwPowerCap", "HwSlowdown", "SwThermalSlowdown", "HwThermalSlowdown",
                    "HwPowerBrakeSlowdown")
# (UserDefinedClocks is left out: nvml.h defines it as the same bit as ApplicationsClocksSetting)
ALL_REASONS = ("GpuIdle", "ApplicationsClocksSetting", "SyncBoost", "DisplayClockSetting") + SLOWDOWN_REASONS
SCHEMA = "gguf-harness/gpu-state/1"
MAX_SAMPLES = 20000  # bound on a result's raw samples (~7 minutes at the 20 ms of the bench samplers)


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
        self.device_id: str | None = None  # which GPU was sampled ("pci <bus id>" or "nvml index <i>")
        self._failed: set[str] = set()
        self._old_reasons = False
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
        """NVML's handle of CUDA device `device`: by its PCI bus id (NVML and CUDA may number
        devices apart under CUDA_VISIBLE_DEVICES), by NVML index only when CuPy cannot say the
        bus id (no CuPy, no CUDA device); an NVML error on a bus id CuPy gave propagates."""
        try:
            import cupy as cp
            bus = cp.cuda.Device(self.device).pci_bus_id
        except Exception:
            self.device_id = f"nvml index {self.device}"
            return self._nvml.nvmlDeviceGetHandleByIndex(self.device)
        self.device_id = f"pci {bus}"
        return self._nvml.nvmlDeviceGetHandleByPciBusId(bus)

    def _close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
        self._nvml, self._handle = None, None

    def _field(self, key: str, call):
        """call() or None, keeping the first failure per field in why (one query the driver
        lacks, e.g. power on some boards, leaves the others' readings)."""
        try:
            return call()
        except Exception as e:
            if key not in self._failed:
                self._failed.add(key)
                self.why = f"{key}: {type(e).__name__}: {e}"
            return None

    def _reasons_mask(self) -> int:
        """The clock-event reason mask: nvmlDeviceGetCurrentClocksEventReasons, else (a driver
        before it: NVMLError_FunctionNotFound, or an older pynvml) the ThrottleReasons name."""
        n, h = self._nvml, self._handle
        new = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None)
        if new is not None and not self._old_reasons:
            try:
                return int(new(h))
            except Exception as e:
                if "FunctionNotFound" not in type(e).__name__:
                    raise
                self._old_reasons = True
        return int(n.nvmlDeviceGetCurrentClocksThrottleReasons(h))

    def sample(self) -> dict | None:
        """One reading: t (s since __enter__), mono (time.monotonic(), s: the clock other
        processes' timestamps can be matched against), sm_mhz, mem_mhz, power_w, power_limit_w,
        temp_c, reasons (names), energy_mj (the energy counter); a field whose query failed is
        None (the first failure per field is kept in why); None without NVML."""
        if self._handle is None:
            return None
        n, h = self._nvml, self._handle
        # the board's energy counter first (mJ since the driver loaded; Volta and later), stamped
        # by the middle of its own call so the other queries' time (a few ms, stalls up to ~27 ms
        # seen) does not move its timestamp: it holds the energy at the counter's last update
        # (every ~100 ms on the H200), where power_w is NVML's averaged reading (lags ~1 s there)
        m0 = time.monotonic()
        energy = self._field("energy_mj", lambda: n.nvmlDeviceGetTotalEnergyConsumption(h))
        m1 = time.monotonic()
        out = {"t": round(time.perf_counter() - self._t0, 4), "mono": (m0 + m1) / 2, "energy_mj": energy,
               "sm_mhz": self._field("sm_mhz", lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM)),
               "mem_mhz": self._field("mem_mhz", lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM))}
        power = self._field("power_w", lambda: n.nvmlDeviceGetPowerUsage(h))
        limit = self._field("power_limit_w", lambda: n.nvmlDeviceGetEnforcedPowerLimit(h))
        out["power_w"] = None if power is None else power / 1000.0
        out["power_limit_w"] = None if limit is None else limit / 1000.0
        out["temp_c"] = self._field("temp_c", lambda: n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU))
        mask = self._field("reasons", self._reasons_mask)
        out["reasons"] = None if mask is None else reason_names(mask, n)
        return out

    def readings(self) -> list[dict]:
        """The readings kept so far (a copy; sample's dicts), oldest first."""
        return list(self._samples)

    def energy_j(self, a: float, b: float) -> float | None:
        """Joules the GPU used between time.monotonic() instants a < b (window_energy_j over
        this sampler's readings so far; None when it cannot say)."""
        return window_energy_j(self._samples, a, b)

    def _keep(self, s: dict | None) -> None:
        if s is None:
            return
        if len(self._samples) < MAX_SAMPLES:
            self._samples.append(s)
        elif not self.why:  # later windows get no energy figure: say why
            self.why = f"more than {MAX_SAMPLES} samples: the later ones were not kept"

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self._keep(self.sample())

    def __enter__(self) -> "GpuStateSampler":
        self._t0 = time.perf_counter()
        self._open()
        self._keep(self.sample())
        if self._handle is not None:
            try:
                self._thread = threading.Thread(target=self._loop, name="gpu-state", daemon=True)
                self._thread.start()
            except RuntimeError as e:  # no thread: the two end readings only
                self._thread, self.why = None, f"RuntimeError: {e}"
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            if self._thread.is_alive():  # stuck inside an NVML call: leave NVML to it
                self.why = "the sampling thread did not stop within 5 s (an NVML call hung)"
                return
        self._keep(self.sample())
        self._close()

    def summary(self, raw: bool = True, until: float | None = None) -> dict:
        """summarize(samples) plus "why" when NVML was missing or failed, and the raw samples
        (bounded by MAX_SAMPLES) when `raw`; with `until` (time.monotonic() s) the summary covers
        the readings up to then only (the raw samples stay all of them)."""
        out = summarize([s for s in self._samples if until is None or not _num(s.get("mono")) or s["mono"] <= until])
        if out["available"]:
            out["period_s"] = self.period_s  # (slowdown counts are in samples of this period)
        if self.device_id:
            out["device"] = self.device_id
        if self.why:
            out["why"] = self.why
        if raw and self._samples:
            out["samples"] = list(self._samples)
        return out


def window_energy_j(samples: list[dict], a: float, b: float) -> float | None:
    """Energy [J] used between time.monotonic() instants a < b: the mean power over the
    window (the least-squares slope of the energy counter's updates seen inside it) times b - a.
    The counter ("energy_mj" at "mono", NVML nvmlDeviceGetTotalEnergyConsumption) advances in
    steps (every ~100 ms on the H200, measured in session 22: at 50 ms sampling every other
    reading repeats the last). Assumed, not measured: a reading holds the energy up to the
    counter's last update, which happened after the reading before it; an update is placed at
    the middle of the two readings' times. Using only updates inside [a, b] keeps the power of
    the work before and after the window (a prefill, an idle gap) out, as far as the driver
    publishes the counter on time. None when fewer than three updates fall inside the window,
    they span less than half of it, the counter was never read or went backwards (a driver
    reload resets it), or a >= b. Error: each update's time is known to half a sampling period
    plus the sampling thread's jitter; the slope over all of them (not the two ends) averages
    that down (session 22, 50 ms sampling, 0.79 s windows of the 27B engine's decode: 676-700 W
    by the slope, 680-726 W by the two ends). A simulation (20 ms sampling, 100 ms updates, 4 ms
    jitter) gave no figure for most windows under 0.2 s, up to 11 % error at 0.3 s, 4 % at
    0.8 s, 1.3 % at 1.4 s."""
    pts = sorted((s["mono"], s["energy_mj"]) for s in samples
                 if isinstance(s, dict) and _num(s.get("mono")) and _num(s.get("energy_mj")))
    if not (b > a) or any(e1 < e0 for (_, e0), (_, e1) in zip(pts, pts[1:])):
        return None
    updates = [((t0 + t1) / 2, e1) for (t0, e0), (t1, e1) in zip(pts, pts[1:]) if e1 != e0]
    inside = [(t, e) for t, e in updates if a <= t <= b]
    if len(inside) < 3 or inside[-1][0] - inside[0][0] < (b - a) / 2:
        return None
    n = len(inside)
    tm = sum(t for t, _ in inside) / n
    em = sum(e for _, e in inside) / n
    slope_mj_s = (sum((t - tm) * (e - em) for t, e in inside) / sum((t - tm) ** 2 for t, _ in inside))
    return slope_mj_s / 1000.0 * (b - a)


def slowed(sample: dict) -> bool | None:
    """Whether a reading reports any SLOWDOWN_REASONS (power cap, thermal, hardware slowdown);
    None when its reasons are unknown (the query failed)."""
    reasons = sample.get("reasons") if isinstance(sample, dict) else None
    if not isinstance(reasons, list) or not all(isinstance(r, str) for r in reasons):
        return None
    return any(r in SLOWDOWN_REASONS for r in reasons)


def window_slowdown(samples: list[dict], windows) -> list[float | None]:
    """Per window [a, b] (time.monotonic() s, e.g. a benchmark's decode windows): the share of
    the readings taken inside it (a <= mono <= b) that report a slowdown reason (slowed); None for
    a window with no reading inside, one with a reading of unknown reasons, or a malformed window.
    A share of 0 means the clocks were not held back while that window ran, as far as readings
    every `period_s` can see (a window shorter than the period may hold none)."""
    out: list[float | None] = []
    for w in windows if isinstance(windows, list) else []:
        if not (isinstance(w, (list, tuple)) and len(w) == 2 and all(_num(x) for x in w) and w[1] >= w[0]):
            out.append(None)
            continue
        inside = [slowed(s) for s in samples if isinstance(s, dict) and _num(s.get("mono"))
                  and w[0] <= s["mono"] <= w[1]]
        out.append(None if not inside or None in inside else sum(inside) / len(inside))
    return out


def summarize(samples: list[dict]) -> dict:
    """{"schema", "available", "n", "sm_mhz": [min, median, max], "mem_mhz": [...],
    "power_w": [...], "power_limit_w": max, "temp_c": [...], "reasons": {name: samples with it},
    "slowdown": samples with any SLOWDOWN_REASONS} of sample dicts; available False for none. The
    clock ranges leave out samples NVML called GpuIdle (e.g. the first, before the work starts)
    unless every sample is."""
    import statistics
    if not samples:
        return {"schema": SCHEMA, "available": False}
    busy = [s for s in samples if "GpuIdle" not in (s.get("reasons") or ())] or samples

    def rng(key, of=samples):
        v = [s[key] for s in of if s.get(key) is not None]
        return [min(v), statistics.median(v), max(v)] if v else None

    reasons: dict[str, int] = {}
    for s in samples:
        for r in s.get("reasons") or ():
            reasons[r] = reasons.get(r, 0) + 1
    return {"schema": SCHEMA, "available": True, "n": len(samples), "sm_mhz": rng("sm_mhz", busy),
            "mem_mhz": rng("mem_mhz", busy), "power_w": rng("power_w"),
            "power_limit_w": max((s.get("power_limit_w") or 0) for s in samples) or None,
            "temp_c": rng("temp_c"), "reasons": reasons,
            "slowdown": sum(1 for s in samples if set(s.get("reasons") or ()) & set(SLOWDOWN_REASONS))}


def _num(x) -> bool:
    """A finite int or float, not a bool (jsonread.finite)."""
    return finite(x) is not None


def clean(state) -> dict | None:
    """A result's gpu_state as summarize() shapes it, or None when absent; a malformed one (a file
    edited or from another tool) keeps only its well-formed fields, so readers never raise:
    available True needs "n"; ranges are 3 finite numbers; reasons a {str: int} dict; counts
    (n, slowdown, each reason's) are whole numbers from 0 to n, else dropped (0 / left out)."""
    if not isinstance(state, dict):
        return None
    if state.get("available") is not True:
        why = state.get("why")
        return {"available": False, **({"why": why} if isinstance(why, str) else {})}
    def count(x, most):  # a sample count: a whole number in 0..most
        return _num(x) and x >= 0 and x == int(x) and x <= most
    n = state.get("n")
    out = {"available": True, "n": int(n) if count(n, MAX_SAMPLES) else 0}
    for key in ("sm_mhz", "mem_mhz", "power_w", "temp_c"):
        v = state.get(key)
        out[key] = list(v) if isinstance(v, list) and len(v) == 3 and all(map(_num, v)) else None
    out["power_limit_w"] = state.get("power_limit_w") if _num(state.get("power_limit_w")) else None
    r = state.get("reasons")
    out["reasons"] = ({k: int(c) for k, c in r.items() if isinstance(k, str) and count(c, out["n"])}
                      if isinstance(r, dict) else {})
    out["slowdown"] = int(state["slowdown"]) if count(state.get("slowdown"), out["n"]) else 0
    return out


def describe(state: dict | None) -> str:
    """One line for tables and A/B notes, e.g. "SM 1755-1980 MHz (median 1980), memory 3201 MHz,
    power <= 690 W of 700, 71 C; slowdown in 12 of 40 samples (SwPowerCap 12)": the clocks' range
    and median, the highest power and temperature; "no GPU state" (with why) when none was
    recorded."""
    state = clean(state)
    if not state or not state.get("available"):
        why = (state or {}).get("why")
        return "no GPU state" + (f" ({why})" if why else "")

    def span(v, unit):
        lo, med, hi = v
        return f"{lo:.0f} {unit}" if lo == hi else f"{lo:.0f}-{hi:.0f} {unit} (median {med:.0f})"

    parts = []
    if state["sm_mhz"]:
        parts.append("SM " + span(state["sm_mhz"], "MHz"))
    if state["mem_mhz"]:
        parts.append("memory " + span(state["mem_mhz"], "MHz"))
    if state["power_w"]:
        lim = state["power_limit_w"]
        parts.append(f"power <= {state['power_w'][2]:.0f} W" + (f" of {lim:.0f}" if lim else ""))
    if state["temp_c"]:
        parts.append(f"{state['temp_c'][2]:.0f} C")
    slow = state["slowdown"]
    tail = (f"slowdown in {slow} of {state['n']} samples ("
            + ", ".join(f"{r} {c}" for r, c in state["reasons"].items() if r in SLOWDOWN_REASONS)
            + ")") if slow else "no slowdown reason"
    return ", ".join(parts) + "; " + tail


def _compare(a, b) -> tuple[list[tuple[str, dict]], list[str], str | None]:
    """What ab_notes and short_note say of two gpu_state records: the (side, state) pairs slowed
    by a SLOWDOWN_REASONS reason; "median <what> clock A -> B MHz" where the medians differ by
    more than 1 %; and the side that alone has GPU state (None when both or neither have)."""
    a, b = clean(a), clean(b)
    slowed = [(side, s) for side, s in (("A", a), ("B", b)) if s and s["available"] and s["slowdown"]]
    ha, hb = bool(a and a["available"]), bool(b and b["available"])
    clocks = []
    if ha and hb:
        for key, what in (("sm_mhz", "SM clock"), ("mem_mhz", "memory clock")):
            if a[key] and b[key]:
                ma, mb = a[key][1], b[key][1]
                if ma and abs(mb - ma) > 0.01 * ma:
                    clocks.append(f"median {what} {ma:.0f} -> {mb:.0f} MHz")
    return slowed, clocks, (("A" if ha else "B") if ha != hb else None)


def ab_notes(label: str, a: dict | None, b: dict | None) -> list[str]:
    """Notes for an A/B of two timed regions: either side slowed by a SLOWDOWN_REASONS reason,
    median SM / memory clocks more than 1 % apart (then a time difference may be the GPU's, not
    the build's), or GPU state recorded on one side only (so no note is not "same clocks"). Empty
    when neither side recorded any or nothing differs."""
    slowed, clocks, only = _compare(a, b)
    return ([f"{label} {side}: {describe(s)}" for side, s in slowed] + [f"{label}: {c}" for c in clocks]
            + ([f"{label}: GPU state only in {only} (clocks not compared)"] if only else []))


def short_note(a: dict | None, b: dict | None) -> str:
    """ab_notes in a few words for a table cell, e.g. "GPU: B slowed in 12/40 samples (SwPowerCap);
    median SM clock 1980 -> 1755 MHz"; "" when nothing to say."""
    slowed, clocks, only = _compare(a, b)
    parts = [f"{side} slowed in {s['slowdown']}/{s['n']} samples ("
             + ", ".join(r for r in s["reasons"] if r in SLOWDOWN_REASONS) + ")" for side, s in slowed]
    parts += clocks + ([f"state only in {only}"] if only else [])
    return ("GPU: " + "; ".join(parts)) if parts else ""
