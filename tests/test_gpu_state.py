"""harness/gpu_state.py: GPU clocks / power / clock-event reasons sampled while a region is
timed (NVML through nvidia-ml-py), on a scripted fake NVML, on the real pynvml (its constants;
no NVML library on a CPU machine), and as notes in `harness ab` of both result kinds."""
from __future__ import annotations

import copy
import time

import pytest

from harness import ab, ab_nodes, gpu_state
from tests.test_ab import bench_row, result
from tests.test_ab_nodes import BASE, _doc


class FakeNVML:
    """The pynvml calls GpuStateSampler makes, answering from a script: each reading takes
    the next (sm MHz, mem MHz, power mW, temp C, reason mask) of `readings`, the last repeated."""
    NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 1, 2, 0
    # nvml.h's clock-event reason bits (as pynvml names them)
    nvmlClocksEventReasonGpuIdle = 0x1
    nvmlClocksEventReasonSwPowerCap = 0x4
    nvmlClocksEventReasonHwSlowdown = 0x8
    nvmlClocksEventReasonSwThermalSlowdown = 0x20

    def __init__(self, readings, fail_init=None, fail_lookup=False):
        self.readings, self.i, self.fail_init, self.fail_lookup = list(readings), 0, fail_init, fail_lookup
        self.inits = self.shutdowns = 0
        self.lookups = []

    def nvmlInit(self):
        if self.fail_init:
            raise self.fail_init
        self.inits += 1

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetHandleByIndex(self, i):
        self.lookups.append(("index", i))
        if self.fail_lookup:
            raise RuntimeError("NVML_ERROR_NOT_FOUND")
        return ("dev", i)

    def nvmlDeviceGetHandleByPciBusId(self, bus):
        self.lookups.append(("bus", bus))
        if self.fail_lookup:
            raise RuntimeError("NVML_ERROR_NOT_FOUND")
        return ("bus", bus)

    def _now(self):
        return self.readings[min(self.i, len(self.readings) - 1)]

    def nvmlDeviceGetClockInfo(self, h, kind):
        return self._now()[0] if kind == self.NVML_CLOCK_SM else self._now()[1]

    def nvmlDeviceGetPowerUsage(self, h):
        return self._now()[2]

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return 700_000

    def nvmlDeviceGetTemperature(self, h, kind):
        return self._now()[3]

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        mask = self._now()[4]
        self.i += 1  # the last query of a reading but the energy's: the next reading takes the next line
        return mask

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        return 100_000 * self.i  # mJ: 100 J more at every reading


def test_reason_names_decode_the_mask_in_a_fixed_order():
    n = FakeNVML([])
    assert gpu_state.reason_names(0x4 | 0x1, n) == ["GpuIdle", "SwPowerCap"]
    assert gpu_state.reason_names(0x8 | 0x20 | 0x4, n) == ["SwPowerCap", "HwSlowdown", "SwThermalSlowdown"]
    assert gpu_state.reason_names(0x1000, n) == []  # a bit this module does not name
    assert gpu_state.reason_names(0, n) == []


def test_every_reason_name_is_a_pynvml_constant():
    """ALL_REASONS are looked up by name in pynvml (nvmlClocksEventReason<Name> or the older
    nvmlClocksThrottleReason<Name>): a misspelt name would silently never be reported."""
    pynvml = pytest.importorskip("pynvml")
    bits = {}
    for name in gpu_state.ALL_REASONS:
        bit = getattr(pynvml, "nvmlClocksEventReason" + name, None) or \
            getattr(pynvml, "nvmlClocksThrottleReason" + name, None)
        assert bit, name
        bits[name] = bit
    assert len(set(bits.values())) == len(bits)  # distinct bits
    assert gpu_state.reason_names(bits["SwPowerCap"] | bits["HwThermalSlowdown"], pynvml) == \
        ["SwPowerCap", "HwThermalSlowdown"]
    assert set(gpu_state.SLOWDOWN_REASONS) <= set(gpu_state.ALL_REASONS)


def test_sampler_records_clocks_power_and_slowdowns():
    fake = FakeNVML([(1980, 3201, 400_000, 50, 0x0), (1980, 3201, 650_000, 60, 0x0),
                     (1755, 3201, 699_000, 71, 0x4), (1740, 3201, 700_000, 72, 0x4 | 0x20)])
    with gpu_state.GpuStateSampler(period_s=0.005, nvml=fake) as s:
        time.sleep(0.1)
    st = s.summary()
    assert fake.inits == 1 and fake.shutdowns == 1
    assert st["available"] and st["n"] >= 4 and "why" not in st
    assert st["sm_mhz"][0] == 1740 and st["sm_mhz"][2] == 1980 and st["mem_mhz"] == [3201, 3201, 3201]
    assert st["power_w"][2] == 700.0 and st["power_limit_w"] == 700.0 and st["temp_c"][0] == 50
    # every reading from the third on carries SwPowerCap; the fourth on also SwThermalSlowdown
    assert st["slowdown"] == st["n"] - 2 == st["reasons"]["SwPowerCap"]
    assert st["reasons"]["SwThermalSlowdown"] == st["n"] - 3
    ts = [x["t"] for x in st["samples"]]
    assert ts == sorted(ts) and len(ts) == st["n"]
    line = gpu_state.describe(st)
    assert "SM 1740-1980 MHz" in line and "memory 3201 MHz" in line and "of 700" in line
    assert f"slowdown in {st['n'] - 2} of {st['n']} samples" in line and "SwPowerCap" in line


def test_sampler_without_nvml_times_anyway_and_says_why():
    fake = FakeNVML([], fail_init=RuntimeError("NVML Shared Library Not Found"))
    with gpu_state.GpuStateSampler(nvml=fake) as s:
        pass
    st = s.summary()
    assert st["available"] is False and "NVML Shared Library Not Found" in st["why"]
    assert "samples" not in st and s.sample() is None
    assert gpu_state.describe(st).startswith("no GPU state (RuntimeError")
    assert gpu_state.describe(None) == "no GPU state"
    with pytest.raises(ValueError):
        gpu_state.GpuStateSampler(period_s=0)


def test_sampler_keeps_the_other_fields_when_one_query_fails():
    class Flaky(FakeNVML):
        def nvmlDeviceGetPowerUsage(self, h):
            if self.i >= 2:
                raise RuntimeError("Not Supported")
            return super().nvmlDeviceGetPowerUsage(h)
    fake = Flaky([(1980, 3201, 500_000, 50, 0)])
    with gpu_state.GpuStateSampler(period_s=0.005, nvml=fake) as s:
        time.sleep(0.05)
    st = s.summary()
    assert st["available"] and st["n"] > 3 and st["why"].startswith("power_w: RuntimeError: Not Supported")
    assert st["sm_mhz"] == [1980, 1980, 1980] and st["power_w"] == [500.0, 500.0, 500.0]  # the readings before
    assert sum(x["power_w"] is None for x in st["samples"]) == st["n"] - 2
    assert fake.shutdowns == 1


def test_sampler_falls_back_to_the_old_reasons_call_on_an_old_driver():
    class FunctionNotFound(Exception):  # pynvml's NVMLError_FunctionNotFound, by name
        pass
    FunctionNotFound.__name__ = "NVMLError_FunctionNotFound"

    class Old(FakeNVML):
        def nvmlDeviceGetCurrentClocksEventReasons(self, h):
            raise FunctionNotFound("Function Not Found")

        def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
            return FakeNVML.nvmlDeviceGetCurrentClocksEventReasons(self, h)
    with gpu_state.GpuStateSampler(period_s=0.005, nvml=Old([(1755, 3201, 700_000, 80, 0x4)])) as s:
        time.sleep(0.03)
    st = s.summary()
    assert st["reasons"] == {"SwPowerCap": st["n"]} and "why" not in st


def test_a_failed_device_lookup_shuts_nvml_down_and_says_why():
    fake = FakeNVML([(1980, 3201, 500_000, 50, 0)], fail_lookup=True)
    with gpu_state.GpuStateSampler(nvml=fake) as s:
        pass
    st = s.summary()
    assert fake.inits == fake.shutdowns == 1 and not st["available"] and "NVML_ERROR_NOT_FOUND" in st["why"]
    assert len(fake.lookups) == 1  # an NVML error is not answered by trying another GPU


def test_the_gpu_is_found_by_its_pci_bus_id_when_cupy_can_say_it(monkeypatch):
    import sys
    import types
    dev = types.SimpleNamespace(pci_bus_id="0000:1B:00.0")
    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda i: dev))
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    fake = FakeNVML([(1980, 3201, 500_000, 50, 0)])
    with gpu_state.GpuStateSampler(nvml=fake) as s:
        pass
    assert fake.lookups == [("bus", "0000:1B:00.0")] and s.summary()["device"] == "pci 0000:1B:00.0"
    monkeypatch.setitem(sys.modules, "cupy", None)  # no CuPy: NVML's numbering
    fake = FakeNVML([(1980, 3201, 500_000, 50, 0)])
    with gpu_state.GpuStateSampler(nvml=fake) as s:
        pass
    assert fake.lookups == [("index", 0)] and s.summary()["device"] == "nvml index 0"


def test_samples_are_bounded(monkeypatch):
    monkeypatch.setattr(gpu_state, "MAX_SAMPLES", 3)
    with gpu_state.GpuStateSampler(period_s=0.002, nvml=FakeNVML([(1980, 3201, 500_000, 50, 0)])) as s:
        time.sleep(0.05)
    assert s.summary()["n"] == 3


def test_a_hung_nvml_call_does_not_hold_exit_or_shut_nvml_under_it(monkeypatch):
    import threading
    gate = threading.Event()

    class Hangs(FakeNVML):
        def nvmlDeviceGetTemperature(self, h, kind):
            if threading.current_thread().name == "gpu-state":
                gate.wait(10)  # stuck until the test lets it go
            return 50
    monkeypatch.setattr(gpu_state.threading.Thread, "join", lambda self, timeout=None: None)  # no 5 s wait
    fake = Hangs([(1980, 3201, 500_000, 50, 0)])
    t = time.perf_counter()
    with gpu_state.GpuStateSampler(period_s=0.001, nvml=fake) as s:
        time.sleep(0.02)
    assert time.perf_counter() - t < 2 and fake.shutdowns == 0 and "did not stop" in s.summary()["why"]
    gate.set()


def test_summary_clock_ranges_leave_out_idle_samples_and_idle_is_no_slowdown():
    st = gpu_state.summarize([
        {"sm_mhz": 345, "mem_mhz": 1593, "power_w": 80.0, "power_limit_w": 700.0, "temp_c": 40, "reasons": ["GpuIdle"]},
        {"sm_mhz": 1980, "mem_mhz": 3201, "power_w": 600.0, "power_limit_w": 700.0, "temp_c": 60, "reasons": []},
        {"sm_mhz": 1900, "mem_mhz": 3201, "power_w": 690.0, "power_limit_w": 650.0, "temp_c": 70,
         "reasons": ["SwPowerCap"]}])
    assert st["sm_mhz"] == [1900, 1940.0, 1980] and st["mem_mhz"] == [3201, 3201.0, 3201]
    assert st["power_w"] == [80.0, 600.0, 690.0] and st["power_limit_w"] == 700.0 and st["temp_c"] == [40, 60, 70]
    assert st["slowdown"] == 1 and st["reasons"] == {"GpuIdle": 1, "SwPowerCap": 1}
    line = gpu_state.describe(st)
    assert line == ("SM 1900-1980 MHz (median 1940), memory 3201 MHz, power <= 690 W of 700, 70 C; "
                    "slowdown in 1 of 3 samples (SwPowerCap 1)")
    only_idle = gpu_state.summarize([{"sm_mhz": 345, "reasons": ["GpuIdle"]}])
    assert only_idle["sm_mhz"] == [345, 345, 345] and only_idle["slowdown"] == 0


def test_real_pynvml_on_this_machine():
    """With the installed nvidia-ml-py: on a machine without NVML the sampler records why and
    nothing else; with a GPU, readings with plausible clocks."""
    pytest.importorskip("pynvml")
    with gpu_state.GpuStateSampler(period_s=0.01) as s:
        time.sleep(0.05)
    st = s.summary()
    if not st["available"]:
        assert st["why"]
    else:
        assert st["n"] >= 2 and st["sm_mhz"][2] > 0 and st["mem_mhz"][2] > 0 and st["period_s"] == 0.01
        # the energy counter (Volta and later: every GPU this harness targets) on the same clock
        energies = [x["energy_mj"] for x in st["samples"]]
        assert all(isinstance(e, int) and e > 0 for e in energies) and energies == sorted(energies)
        assert all(isinstance(x["mono"], float) for x in st["samples"])


def _state(sm, slow=0, n=10, reasons=None):
    return {"available": True, "n": n, "sm_mhz": [sm, sm, sm], "mem_mhz": [3201, 3201, 3201],
            "power_w": [600.0, 650.0, 700.0], "power_limit_w": 700.0, "temp_c": [60, 65, 70],
            "reasons": reasons if reasons is not None else ({"SwPowerCap": slow} if slow else {}),
            "slowdown": slow}


def test_ab_notes_say_which_side_slowed_and_by_how_much_clocks_moved():
    assert gpu_state.ab_notes("step", _state(1980), _state(1980)) == []
    # the median decides, by more than 1 %: 2000 -> 2019.9 / 2020 no note, 2020.2 one
    a = _state(2000)
    a["sm_mhz"] = [1500.0, 2000.0, 2100.0]  # min and max far apart: only the median counts
    for mb, noted in ((2019.9, False), (2020.0, False), (2020.2, True), (1979.8, True)):
        b = _state(mb)
        b["sm_mhz"] = [1500.0, mb, 2100.0]
        assert bool(gpu_state.ab_notes("step", a, b)) == noted, mb
    notes = gpu_state.ab_notes("step", _state(1980), _state(1755, slow=7))
    assert any(n.startswith("step B: ") and "SwPowerCap 7" in n for n in notes)
    assert "step: median SM clock 1980 -> 1755 MHz" in notes
    m = _state(1980)
    m["mem_mhz"] = [2619, 2619, 2619]
    assert gpu_state.ab_notes("step", _state(1980), m) == ["step: median memory clock 3201 -> 2619 MHz"]
    assert gpu_state.ab_notes("step", None, _state(1755)) == ["step: GPU state only in B (clocks not compared)"]
    assert gpu_state.ab_notes("step", None, {"available": False, "why": "x"}) == []
    short = gpu_state.short_note(_state(1755, slow=7), _state(1980))
    assert short == "GPU: A slowed in 7/10 samples (SwPowerCap); median SM clock 1755 -> 1980 MHz"
    assert gpu_state.short_note(None, None) == "" and gpu_state.short_note(_state(1980), None) == "GPU: state only in A"


@pytest.mark.parametrize("bad", ["throttled", [1, 2], {"available": True, "sm_mhz": [1, 2], "reasons": ["SwPowerCap"],
                                                        "n": "3", "slowdown": None, "power_w": ["a", 1, 2]},
                                 {"available": True}, {"available": "yes"}])
def test_malformed_gpu_state_never_breaks_ab_or_the_reports(bad):
    """A result's gpu_state is read like the rest of a result file: a malformed one gives what
    is well formed, never an exception (harness ab, the run and nodes reports)."""
    from reports.html import render_html
    assert isinstance(gpu_state.describe(bad), str)
    gpu_state.ab_notes("step", bad, _state(1980))
    gpu_state.short_note(_state(1980), bad)
    a, b = result([1.0, 1.0, 1.0]), result([1.0, 1.0, 1.0])
    b["bench"]["rows"][0]["gpu_state"] = bad
    ab.compare(a, b)
    render_html(b)


def test_harness_ab_nodes_notes_a_throttled_run():
    a = _doc(BASE, 500.0, [499.0, 500.0, 501.0])
    b = copy.deepcopy(a)
    a["nodes"]["gpu_state"], b["nodes"]["gpu_state"] = _state(1980), _state(1755, slow=9)
    res = ab_nodes.compare_nodes(a, b)
    assert any("step B:" in n and "slowdown in 9 of 10" in n for n in res.notes)
    assert "step: median SM clock 1980 -> 1755 MHz" in res.notes
    b["nodes"]["gpu_state"] = _state(1980)
    assert not ab_nodes.compare_nodes(a, b).notes


def test_harness_ab_bench_row_note_names_a_throttled_run():
    a, b = result([1.0, 1.0, 1.0]), result([1.1, 1.1, 1.1])
    a["bench"]["rows"][0]["gpu_state"] = _state(1980)
    b["bench"]["rows"][0]["gpu_state"] = _state(1700, slow=5)
    res = ab.compare(a, b)
    row = next(p for p in res.perf if p.metric == "decode_tok_s")
    assert row.verdict == "SLOWER" and row.note.startswith("GPU: B slowed in 5/10 samples (SwPowerCap)")
    # rows without GPU state (results from before this module) keep an empty note
    assert next(p for p in ab.compare(result([1.0] * 3), result([1.0] * 3)).perf).note == ""
    assert bench_row("engine", 512, [1.0])["backend"] == "engine"


def test_bench_e2e_rows_carry_the_gpu_state_of_their_timed_region(monkeypatch):
    """bench_e2e wraps each backend's timed bench in a GpuStateSampler: with (fake) NVML the
    row records readings and logs them; a backend that fails records no row."""
    from harness import bench_e2e as be
    from harness.config import ModelRef, RunConfig
    from tests.test_bench_e2e import Fake

    fake = FakeNVML([(1980, 3201, 500_000, 55, 0)])
    monkeypatch.setattr(be, "GpuStateSampler",
                        lambda period_s: gpu_state.GpuStateSampler(period_s=period_s, nvml=fake))
    lines = []
    out = be.bench_e2e(ModelRef("m", "m.gguf"), 1_000_000, ["engine"], [512], list(range(70)),
                       RunConfig(), lambda name: Fake("engine", 0.1, 0.1), n_decode=128, reps=3,
                       log=lines.append)
    (row,) = out["rows"]
    st = row["gpu_state"]
    assert st["available"] and st["n"] >= 2 and st["sm_mhz"] == [1980, 1980, 1980]
    assert any(line.startswith("  GPU while timed: SM 1980 MHz") for line in lines)
    assert fake.shutdowns == 1


def test_html_report_lists_each_bench_rows_gpu_state_escaped():
    """The run report's "GPU while timed" section: one line per bench row with a GPU state;
    text from the result is escaped (a hostile `why` cannot inject markup); none without."""
    from reports.html import gpu_states, render_html
    res = result([1.0, 1.0, 1.0])
    assert gpu_states(res) == []
    res["bench"]["rows"][0]["gpu_state"] = _state(1755, slow=3)
    res["bench"]["rows"].append(dict(bench_row("llamacpp", 512, [2.0, 2.0, 2.0]),
                                     gpu_state={"available": False, "why": "<script>x</script>"}))
    (g1, g2) = gpu_states(res)
    assert g1["label"] == "engine c=512" and "slowdown in 3 of 10 samples (SwPowerCap 3)" in g1["text"]
    html = render_html(res)
    assert 'id="gpu-state"' in html and "slowdown in 3 of 10" in html
    assert "<script>x</script>" not in html and "&lt;script&gt;" in html


class _NodesEngine:
    """What harness/bench_nodes.run_nodes asks of a loaded engine: bench() as given, one node."""
    def __init__(self, bench):
        self.bench = bench

    def info(self):
        return {"nodes_per_step": 1, "bytes_per_step": 1}

    def reset(self):
        pass

    def prefill(self, ids):
        pass

    def node_times(self, tok, method):
        return [{"name": "blk.0.ffn_down", "kind": "gemv", "fmt": "Q4_K", "us": 900.0, "bytes": 1000}]


def test_run_nodes_records_the_gpu_state_of_the_step_it_timed(monkeypatch):
    """harness/bench_nodes.run_nodes wraps the step's chained replays in a GpuStateSampler and
    puts its summary in the result (a fake engine and NVML: the GPU path's own test needs a GPU)."""
    import contextlib

    from harness import bench_nodes

    def bench(ids, steps, reps):
        time.sleep(0.02)
        return {"decode_s": [0.064, 0.064, 0.064]}
    monkeypatch.setattr(bench_nodes, "loaded_engine", lambda model, n_ctx: contextlib.nullcontext(_NodesEngine(bench)))
    fake = FakeNVML([(1980, 3201, 500_000, 55, 0x4)])
    real = gpu_state.GpuStateSampler
    monkeypatch.setattr(gpu_state, "GpuStateSampler", lambda **kw: real(period_s=0.005, nvml=fake))
    lines = []
    out = bench_nodes.run_nodes(None, 128, [1, 2, 3], methods=("graph",), steps=64, log=lines.append, chain=False)
    st = out["gpu_state"]
    assert st["available"] and st["n"] >= 2 and st["slowdown"] == st["n"] and out["step_us"] == 1000.0
    assert any(line.startswith("GPU while timed: SM 1980 MHz") for line in lines)


def test_sampler_stamps_readings_on_the_monotonic_clock_with_the_energy_counter():
    """Each reading carries time.monotonic() (the clock backends stamp their decode windows
    with) and the energy counter; energy_j is the least-squares power of the counter's updates
    (placed between readings) times the window (computed here independently with numpy)."""
    import numpy as np
    fake = FakeNVML([(1980, 3201, 500_000, 55, 0)])
    before = time.monotonic()
    with gpu_state.GpuStateSampler(period_s=0.002, nvml=fake) as s:
        deadline = time.monotonic() + 10
        while len(s._samples) < 6 and time.monotonic() < deadline:  # (a loaded machine: wait for them)
            time.sleep(0.005)
    after = time.monotonic()
    st = s.summary()
    samples = st["samples"]
    assert st["period_s"] == 0.002 and len(samples) >= 6
    monos = [x["mono"] for x in samples]
    assert monos == sorted(monos) and before <= monos[0] and monos[-1] <= after
    energies = [x["energy_mj"] for x in samples]
    assert energies == sorted(energies) and len(set(energies)) == len(energies)  # one update per reading here
    mids = [(t0 + t1) / 2 for t0, t1 in zip(monos, monos[1:])]
    slope = np.polyfit(mids, np.array(energies[1:]) / 1000.0, 1)[0]
    a, b = mids[0], mids[-1]
    assert s.energy_j(a, b) == pytest.approx(slope * (b - a), rel=1e-6)
    assert s.energy_j(before - 10, after) is None  # the readings cover under half the window


def _stepped(p_before=400.0, p_after=600.0, switch=11.0, period=0.02, every=0.1, t0=10.0, t1=12.0):
    """Readings every `period` s of a counter that, like the H200's, advances only every `every`
    s (to the energy used up to that update), under p_before W until `switch`, p_after after."""
    def energy(t):  # J used since t0
        return p_before * (min(t, switch) - t0) + p_after * max(0.0, t - switch)
    out, t = [], t0
    while t <= t1 + 1e-9:
        last_update = t0 + every * int((t - t0) / every + 1e-9)
        out.append({"mono": t, "energy_mj": round(1000 * energy(last_update))})
        t += period
    return out


def test_window_energy_reads_the_mean_power_inside_the_window_from_a_stepped_counter():
    """window_energy_j on a counter that updates every 100 ms, read every 20 ms: the power of the
    window's own updates times its length, within the update times' uncertainty (half a
    sampling period); the power before the window (a prefill at another power) stays out. None
    when it cannot say: fewer than two updates inside, a span under half the window, a reversed
    or empty window, a counter that went backwards (driver reload) or was never read; malformed
    readings are skipped."""
    w = gpu_state.window_energy_j
    samples = _stepped()
    assert w(samples, 10.2, 10.8) == pytest.approx(400.0 * 0.6, rel=0.04)
    assert w(samples, 11.2, 11.9) == pytest.approx(600.0 * 0.7, rel=0.04)
    # starts where the power changes: the 400 W before 11.0 must not lower it
    assert w(samples, 11.0, 11.8) == pytest.approx(600.0 * 0.8, rel=0.04)
    assert w(list(reversed(samples)), 10.2, 10.8) == pytest.approx(240.0, rel=0.04)  # reading order
    assert w(samples, 10.21, 10.29) is None          # no two updates inside
    assert w(samples, 11.95, 13.0) is None            # updates span under half the window
    assert w(samples, 10.5, 10.5) is None and w(samples, 10.8, 10.2) is None
    assert w(samples + [{"mono": 12.5, "energy_mj": 5}], 10.2, 10.8) is None  # counter reset
    assert w([dict(x, energy_mj=None) for x in samples], 10.2, 10.8) is None
    junk = samples + [{"mono": "x", "energy_mj": 1}, {"mono": float("nan"), "energy_mj": 1}, "junk",
                      {"mono": 10.5, "energy_mj": True}]
    assert w(junk, 10.2, 10.8) == pytest.approx(240.0, rel=0.04)


def test_decode_energy_is_the_median_over_complete_windows_only():
    """bench_e2e.decode_energy: J per token and W from each repetition's decode window (median);
    nothing when a window is missing, malformed or unknown to the sampler (a partial median would
    mix repetitions)."""
    from harness.bench_e2e import decode_energy
    joules = {(0.0, 1.0): 600.0, (2.0, 3.0): 700.0, (4.0, 4.5): 400.0}
    got = decode_energy([[0.0, 1.0], [2.0, 3.0], [4.0, 4.5]], lambda a, b: joules.get((a, b)), 100)
    assert got["decode_j_per_token"] == pytest.approx(6.0) and got["decode_power_w"] == pytest.approx(700.0)
    assert got["decode_energy_method"] == "nvml-energy-counter-lsq/1"
    assert decode_energy(None, lambda a, b: 1.0, 100) == {}
    assert decode_energy([], lambda a, b: 1.0, 100) == {}
    assert decode_energy([[0.0, 1.0], [5.0, 6.0]], lambda a, b: joules.get((a, b)), 100) == {}
    assert decode_energy([[1.0, 0.0]], lambda a, b: 1.0, 100) == {}
    assert decode_energy([[0.0, float("inf")]], lambda a, b: 1.0, 100) == {}
    assert decode_energy([[0.0, 1.0, 2.0]], lambda a, b: 1.0, 100) == {}
    assert decode_energy([[0.0, 1.0]], lambda a, b: -5.0, 100) == {}
    assert decode_energy([[0.0, 1.0]], lambda a, b: 1.0, 0) == {}


class _FakeSampler:
    """GpuStateSampler's interface with a fixed power: energy_j(a, b) = watts x (b - a) inside
    [lo, hi], None outside (a window the sampler did not cover)."""
    def __init__(self, watts, lo=0.0, hi=100.0):
        self.watts, self.lo, self.hi = watts, lo, hi

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def summary(self, raw=True, until=None):
        self.until = until
        return {"schema": gpu_state.SCHEMA, "available": True, "n": 2, "sm_mhz": [1980, 1980, 1980],
                "mem_mhz": [3201, 3201, 3201], "power_w": [1.0, 1.0, 1.0], "power_limit_w": 700.0,
                "temp_c": [40, 40, 40], "reasons": {}, "slowdown": 0}

    def energy_j(self, a, b):
        return self.watts * (b - a) if self.lo <= a < b <= self.hi else None

    def readings(self):
        return []  # no readings: no window can be judged slowed (bench_nodes.retake_slowed retakes none)


def test_bench_e2e_rows_carry_the_decode_energy_per_token(monkeypatch):
    """A backend that reports its decode windows gets J/token and W in its row (the median over
    the repetitions, the warm-up window dropped with the warm-up repetition) and a log line; a
    backend without windows, or with one the sampler cannot say, gets neither."""
    from harness import bench_e2e as be
    from harness.config import ModelRef, RunConfig

    class Clocked:
        def __init__(self, windows):
            self.windows = windows

        def load(self, model, cfg):
            pass

        def bench(self, prompt, n_decode, reps):
            out = {"prefill_s": [0.001] * reps, "decode_s": [0.5] * reps}
            if self.windows is not None:
                out["decode_window"] = self.windows
            return out

        def capabilities(self):
            return set()

        def close(self):
            pass

    backends = {"engine": Clocked([[0.0, 5.0], [10.0, 10.5], [20.0, 20.6], [30.0, 30.4]]),
                "llamacpp": Clocked(None), "oracle": Clocked([[0.0, 5.0], [10.0, 10.5], [20.0, 20.6], [99.0, 101.0]])}
    monkeypatch.setattr(be, "GpuStateSampler", lambda period_s: _FakeSampler(600.0))
    lines = []
    out = be.bench_e2e(ModelRef("m", "m.gguf"), 1, list(backends), [512], [1, 2], RunConfig(),
                       backends.get, n_decode=100, reps=3, log=lines.append)
    rows = {r["backend"]: r for r in out["rows"]}
    eng = rows["engine"]
    assert eng["raw"]["decode_window"] == [[10.0, 10.5], [20.0, 20.6], [30.0, 30.4]]
    # 600 W over 0.5 / 0.6 / 0.4 s for 100 tokens: 3.0 / 3.6 / 2.4 J/token, median 3.0
    assert eng["decode_j_per_token"] == pytest.approx(3.0) and eng["decode_power_w"] == pytest.approx(600.0)
    assert eng["decode_energy_method"] == "nvml-energy-counter-lsq/1"
    assert any(line == "  decode energy: 3.00 J/token (600 W, NVML energy counter)" for line in lines)
    for name in ("llamacpp", "oracle"):  # no windows; one window outside what was sampled
        assert not {"decode_j_per_token", "decode_power_w"} & set(rows[name]), name


def test_html_report_gives_the_decode_energy_beside_the_gpu_state():
    from reports.html import gpu_states, render_html
    res = result([1.0, 1.0, 1.0])
    res["bench"]["rows"][0]["gpu_state"] = _state(1980)
    res["bench"]["rows"][0].update(decode_j_per_token=4.2345, decode_power_w=688.4)
    res["bench"]["rows"].append(dict(bench_row("llamacpp", 512, [2.0, 2.0, 2.0]), gpu_state=_state(1980),
                                     decode_j_per_token="<b>", decode_power_w=None))
    (g1, g2) = gpu_states(res)
    assert g1["text"].endswith("; decode 4.23 J/token at 688 W (energy counter)")
    assert "J/token" not in g2["text"]
    for bad in (-4.0, 0.0, float("nan"), 10 ** 400, True):  # positive finite figures only
        res["bench"]["rows"][1].update(decode_j_per_token=bad, decode_power_w=500.0)
        assert "J/token" not in gpu_states(res)[1]["text"], bad
    assert "decode 4.23 J/token at 688 W" in render_html(res)


def test_run_nodes_records_the_step_energy_when_the_engine_gives_its_windows(monkeypatch):
    """run_nodes: the engine's bench windows turn the energy counter into J per step and W
    (bench_e2e.decode_energy), kept with the windows, logged and shown in the nodes report."""
    import contextlib

    from harness import bench_nodes
    from reports.nodes_html import _step_energy

    def bench(ids, steps, reps):
        return {"decode_s": [0.4, 0.4, 0.4], "decode_window": [[1.0, 1.4], [2.0, 2.4], [3.0, 3.4]]}
    monkeypatch.setattr(bench_nodes, "loaded_engine", lambda model, n_ctx: contextlib.nullcontext(_NodesEngine(bench)))
    monkeypatch.setattr(gpu_state, "GpuStateSampler", lambda **kw: _FakeSampler(500.0))
    lines = []
    out = bench_nodes.run_nodes(None, 128, [1, 2, 3], methods=("graph",), steps=64, log=lines.append, chain=False)
    # 500 W x 0.4 s / 64 steps
    assert out["step_power_w"] == pytest.approx(500.0) and out["step_j"] == pytest.approx(500.0 * 0.4 / 64)
    assert out["step_energy_method"] == "nvml-energy-counter-lsq/1" and out["step_windows"] == [[1.0, 1.4], [2.0, 2.4], [3.0, 3.4]]
    assert "step energy: 3.125 J (500 W, NVML energy counter)" in lines
    assert _step_energy(out) == "; step 3.125 J at 500 W (energy counter)"
    assert _step_energy({"step_j": "x", "step_power_w": 1.0}) == ""
    assert _step_energy({"step_j": -4.0, "step_power_w": 600.0}) == ""
    assert _step_energy({"step_j": 4.0, "step_power_w": 10 ** 400}) == ""


def test_harness_ab_notes_the_decode_energy_change_beside_the_decode_verdict():
    """ab.perf_rows: the decode_tok_s row's note gives J/token of A and B when both rows have it
    (information, not a verdict); nothing for prefill or when one side lacks it or is junk."""
    a, b = result([1.0] * 3), result([1.0] * 3)
    a["bench"]["rows"][0]["decode_j_per_token"] = 4.0
    b["bench"]["rows"][0]["decode_j_per_token"] = 3.8
    perf = ab.compare(a, b).perf
    dec = next(p for p in perf if p.metric == "decode_tok_s")
    pre = next(p for p in perf if p.metric == "prefill_tok_s")
    assert dec.note == "J/token 4 -> 3.8 (-5.0 %)" and "J/token" not in pre.note
    b["bench"]["rows"][0]["decode_energy_method"] = "nvml-energy-counter-lsq/1"  # A untagged: the first estimator
    dec = next(p for p in ab.compare(a, b).perf if p.metric == "decode_tok_s")
    assert dec.note == "J/token 4 -> 3.8 not compared: estimators differ (untagged / nvml-energy-counter-lsq/1)"
    b["bench"]["rows"][0]["decode_j_per_token"] = "<junk>"
    assert next(p for p in ab.compare(a, b).perf if p.metric == "decode_tok_s").note == "J/token only in A: 4"
    assert ab.energy_note({"decode_j_per_token": 0.0}, {"decode_j_per_token": 1.5}) == "J/token only in B: 1.5"
    assert ab.energy_note({"decode_j_per_token": -1.0}, {"decode_j_per_token": 10 ** 400}) == ""
    assert ab.energy_note({}, None) == ""


def test_clean_keeps_only_whole_counts_within_the_sample_count():
    """gpu_state.clean: n, slowdown and each reason's count must be whole numbers from 0 to n
    (a hostile or hand-edited file gave "slowdown in -5 of -1 samples"); an int beyond a
    float's range is not a number."""
    st = gpu_state.clean({"available": True, "n": 10, "slowdown": 12, "reasons": {"SwPowerCap": -3, "HwSlowdown": 4,
                                                                                 "SwThermalSlowdown": 2.5}})
    assert st["n"] == 10 and st["slowdown"] == 0 and st["reasons"] == {"HwSlowdown": 4}
    st = gpu_state.clean({"available": True, "n": -1, "slowdown": -5, "reasons": {"SwPowerCap": 1}})
    assert st["n"] == 0 and st["slowdown"] == 0 and st["reasons"] == {}
    st = gpu_state.clean({"available": True, "n": 10 ** 400, "sm_mhz": [1, 2, 10 ** 400]})
    assert st["n"] == 0 and st["sm_mhz"] is None
    assert "-5" not in gpu_state.describe({"available": True, "n": -1, "slowdown": -5, "reasons": {}})


def test_results_with_ints_beyond_a_float_read_as_infinities_and_compare(tmp_path):
    """An int too large for a float is valid JSON; results.read_json reads it as a signed
    infinity (jsonread.json_int), so harness ab and the report treat it as any non-finite value
    instead of raising OverflowError."""
    import json as _json

    from harness.jsonread import json_int
    from harness.results import read_json
    from reports.html import render_html
    assert json_int("12") == 12 and json_int("-" + "9" * 320) == float("-inf")
    assert json_int("9" * 5000) == float("inf") and json_int(str(10 ** 308)) == 10 ** 308
    res = result([1.0, 1.0, 1.0])
    res["bench"]["rows"][0].update(decode_j_per_token=1, gpu_state=_state(1980))
    text = _json.dumps(res).replace('"decode_j_per_token": 1', '"decode_j_per_token": 1' + "0" * 400)
    text = text.replace('"n": 10', '"n": 1' + "0" * 400)
    path = tmp_path / "big.json"
    path.write_text(text)
    big = read_json(path)
    assert big["bench"]["rows"][0]["decode_j_per_token"] == float("inf")
    res_a = result([1.0, 1.0, 1.0])
    note = next(p for p in ab.compare(res_a, big).perf if p.metric == "decode_tok_s").note
    assert "J/token" not in note
    assert "J/token at" not in render_html(big)  # (the section text names J/token)


def test_harness_ab_nodes_notes_the_step_energy_by_the_same_estimator():
    """ab_nodes: a note with both runs' J per step (bench_nodes step_j) when the same estimator
    made them, "not compared" when not, "only in" when one run has it; none without."""
    a = _doc(BASE, 500.0, [499.0, 500.0, 501.0])
    b = copy.deepcopy(a)
    assert not any("step J" in n for n in ab_nodes.compare_nodes(a, b).notes)
    method = "nvml-energy-counter-lsq/1"
    a["nodes"].update(step_j=4.0, step_energy_method=method)
    b["nodes"].update(step_j=4.2, step_energy_method=method)
    assert "step J 4 -> 4.2 (+5.0 %)" in ab_nodes.compare_nodes(a, b).notes
    b["nodes"].pop("step_energy_method")
    assert f"step J 4 -> 4.2 not compared: estimators differ ({method} / untagged)" in ab_nodes.compare_nodes(a, b).notes
    b["nodes"]["step_j"] = "<b>x</b>"
    assert "step J only in A: 4" in ab_nodes.compare_nodes(a, b).notes


def test_window_slowdown_is_the_share_of_slowed_readings_inside_each_window():
    """gpu_state.window_slowdown: per [a, b] window, readings with mono inside it; a slowdown
    reason counts (SwPowerCap, HwSlowdown), GpuIdle does not; a window holding a reading of
    unknown reasons, none at all, or malformed bounds gives None."""
    def r(mono, reasons):
        return {"mono": mono, "reasons": reasons}
    samples = [r(1.0, []), r(1.1, ["SwPowerCap"]), r(1.2, ["GpuIdle"]), r(1.3, ["SwPowerCap", "HwSlowdown"]),
               r(2.0, None), r(2.05, []), r(3.05, ["HwSlowdown"]), "junk", {"mono": "x", "reasons": []}]
    got = gpu_state.window_slowdown(samples, [[0.95, 1.35], [1.9, 2.1], [3.0, 3.1], [4.0, 5.0],
                                              ["a", 1.0], [2.0, 1.0], [0.95, 1.05]])
    assert got == [0.5, None, 1.0, None, None, None, 0.0]
    assert gpu_state.window_slowdown(samples, None) == []
    assert gpu_state.slowed({"reasons": ["GpuIdle"]}) is False and gpu_state.slowed({}) is None
    assert gpu_state.slowed({"reasons": [["SwPowerCap"]]}) is None  # not names: unknown, not "none"


class _ReadingsSampler(_FakeSampler):
    """A sampler whose readings say which windows were slowed: a clean reading inside each window
    of `clean`, a capped one inside the others, and a cooled last reading."""
    def __init__(self, windows, clean):
        super().__init__(500.0)
        self.rs = [{"mono": (a + b) / 2, "reasons": [] if i in clean else ["SwPowerCap"], "power_w": 600.0,
                    "power_limit_w": 700.0} for i, (a, b) in enumerate(windows)]
        self.rs.append({"mono": 99.0, "reasons": [], "power_w": 90.0, "power_limit_w": 700.0})

    def readings(self):
        return list(self.rs)


def test_run_nodes_retakes_slowed_windows_and_keeps_the_unslowed_samples(monkeypatch):
    """run_nodes: of three windows the last two capped, so `clean` single windows are retaken
    (bench with reps 1) after a cool-down; the result keeps each window's share, the retakes and
    the samples of unslowed windows with their median, and the step time stays the median of the
    three; with clean=0, or no slowed window, nothing is retaken."""
    import contextlib

    from harness import bench_nodes
    windows = [[1.0, 1.4], [2.0, 2.4], [3.0, 3.4]] + [[10.0 + k, 10.4 + k] for k in range(4)]
    reps_seen = []

    def bench(ids, steps, reps):
        reps_seen.append(reps)
        if reps == 3:
            return {"decode_s": [0.384, 0.4, 0.416], "decode_window": windows[:3]}
        k = len(reps_seen) - 2
        return {"decode_s": [0.3840 + 0.0064 * k], "decode_window": [windows[3 + k]]}
    monkeypatch.setattr(bench_nodes, "loaded_engine", lambda model, n_ctx: contextlib.nullcontext(_NodesEngine(bench)))
    sampler = _ReadingsSampler(windows, clean={0, 3, 4, 5, 6})
    monkeypatch.setattr(gpu_state, "GpuStateSampler", lambda **kw: sampler)
    lines = []
    out = bench_nodes.run_nodes(None, 128, [1, 2, 3], methods=("graph",), steps=64, log=lines.append, chain=False,
                                clean=4)
    assert reps_seen == [3, 1, 1, 1, 1]
    assert sampler.until == 3.4  # the GPU summary covers the three timed windows, not the retakes
    assert out["step_us"] == pytest.approx(6250.0)  # the median of the three: 0.4 s / 64
    assert out["step_samples_slowdown"] == [0.0, 1.0, 1.0]
    assert [r["slowdown"] for r in out["step_retakes"]] == [0.0] * 4 and len(out["step_retakes"]) == 4
    want = [6000.0, 6000.0, 6100.0, 6200.0, 6300.0]  # window 0, then the four retakes
    assert out["step_clean_samples_us"] == pytest.approx(want) and out["step_clean_us"] == pytest.approx(6100.0)
    assert any("2 retaken" not in line and "4 retaken" in line and "5 of 7 windows unslowed" in line for line in lines)
    reps_seen.clear()
    out = bench_nodes.run_nodes(None, 128, [1, 2, 3], methods=("graph",), steps=64, log=lines.append, chain=False,
                                clean=0)
    assert reps_seen == [3] and out["step_retakes"] == [] and out["step_clean_samples_us"] == pytest.approx([6000.0])
    monkeypatch.setattr(gpu_state, "GpuStateSampler", lambda **kw: _ReadingsSampler(windows, clean=set(range(7))))
    reps_seen.clear()
    out = bench_nodes.run_nodes(None, 128, [1, 2, 3], methods=("graph",), steps=64, log=lines.append, chain=False)
    assert reps_seen == [3] and out["step_samples_slowdown"] == [0.0, 0.0, 0.0] and len(out["step_clean_samples_us"]) == 3


def test_summary_until_covers_the_readings_up_to_then_and_keeps_every_raw_one():
    fake = FakeNVML([(1980, 3201, 500_000, 55, 0x0)])
    with gpu_state.GpuStateSampler(period_s=0.005, nvml=fake) as g:
        time.sleep(0.03)
    rs = g.readings()
    cut = rs[1]["mono"]
    part = g.summary(until=cut)
    assert part["n"] == 2 and len(part["samples"]) == len(rs) == g.summary()["n"] > 2
