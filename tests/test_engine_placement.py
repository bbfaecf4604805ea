"""Engine memory placement (issue #6 item 2): RunConfig's vram_limit / embd_placement and
their CLI flags, the plan the engine loads with (harness.plan.engine_plan, free memory
mocked: CPU), the engine's memory figures in bench rows; on a GPU, token_embd in mapped host
memory gives the same logits bit for bit with the table's bytes off the device, and a VRAM
limit below the need refuses before allocating."""
from __future__ import annotations

import numpy as np
import pytest

from harness import cli
from harness.config import ModelRef, RunConfig
from harness.errors import ConfigError, ModelError
from harness.gguf_file import open_gguf
from harness.plan import budget, engine_plan, plan_model, require_fit

from gpu_util import cupy_or_skip

BIG = 1 << 50       # free bytes that fit anything
PROMPT = [3, 17, 42, 101, 7, 250, 9, 64]
CTX = 128


# ---- settings ------------------------------------------------------------------------------

def test_run_config_defaults_leave_runs_unchanged():
    c = RunConfig()
    assert c.vram_limit is None and c.embd_placement == "auto"
    assert c.to_json()["vram_limit"] is None and c.to_json()["embd_placement"] == "auto"


@pytest.mark.parametrize("kw", [{"vram_limit": 0}, {"vram_limit": -5}, {"vram_limit": 1.5},
                                {"vram_limit": True}, {"vram_limit": "16G"},
                                {"embd_placement": "gpu"}, {"embd_placement": None}])
def test_run_config_rejects_bad_memory_settings(kw):
    with pytest.raises(ConfigError, match=next(iter(kw))):
        RunConfig(**kw)


def test_budget_caps_the_free_bytes():
    assert budget(1000, None) == 1000
    assert budget(1000, 400) == 400
    assert budget(300, 400) == 300  # a limit above the card's free memory changes nothing


# ---- the engine's planning decision (no GPU: free memory given) ---------------------------

def _needs(info, n_ctx=CTX):
    dev = plan_model(info, n_ctx, BIG, embd_on_host=False).need
    host = plan_model(info, n_ctx, BIG, embd_on_host=True).need
    return dev, host


def test_auto_keeps_token_embd_on_the_device_when_it_fits(tiny_qwen2_q):
    info = open_gguf(tiny_qwen2_q)
    dev_need, _ = _needs(info)
    p = engine_plan(info, CTX, free=BIG)
    assert not p.host and p.fits and p.need == dev_need and p.free == BIG
    p = engine_plan(info, CTX, free=BIG, vram_limit=dev_need)  # exactly enough
    assert not p.host and p.fits and p.margin == 0


def test_auto_moves_token_embd_to_the_host_under_a_smaller_limit(tiny_qwen2_q):
    info = open_gguf(tiny_qwen2_q)
    e = info.tensor("token_embd.weight")
    dev_need, host_need = _needs(info)
    assert host_need == dev_need - e.nbytes + e.row_bytes  # the table off, one staging row on
    p = engine_plan(info, CTX, free=BIG, vram_limit=dev_need - 1)
    assert [n for n, _ in p.host] == ["token_embd.weight"] and p.fits and p.free == dev_need - 1
    assert p.need == host_need
    # the real free memory caps too, whichever is smaller
    p = engine_plan(info, CTX, free=dev_need - 1, vram_limit=BIG)
    assert p.host and p.free == dev_need - 1


def test_explicit_placements(tiny_qwen2_q):
    info = open_gguf(tiny_qwen2_q)
    dev_need, host_need = _needs(info)
    assert engine_plan(info, CTX, BIG, placement="host").need == host_need  # host even when it fits
    p = engine_plan(info, CTX, BIG, vram_limit=dev_need - 1, placement="device")
    assert not p.host and not p.fits  # never moved behind the user's back
    with pytest.raises(ModelError, match=r"does not fit: .* \(short by 0.0 MiB\)"):
        require_fit(p, "engine")
    with pytest.raises(ConfigError, match="placement must be one of"):
        engine_plan(info, CTX, BIG, placement="cpu")


def test_host_placement_is_refused_for_a_tied_head(tmp_path):
    from harness.synth.qwen2 import write_qwen2
    path = write_qwen2(tmp_path / "tied.gguf", n_layer=1, n_embd=64, n_head=4, n_head_kv=2,
                       n_ff=128, n_vocab=300, n_ctx_train=128, tied=True)
    info = open_gguf(path)
    with pytest.raises(ConfigError, match="also the output head"):
        engine_plan(info, 64, BIG, placement="host")
    p = engine_plan(info, 64, free=1)  # auto: the table that is the head stays; too small
    assert not p.host and not p.fits


def test_engine_plan_step_refuses_before_allocating(tiny_qwen2_q):
    """EngineBackend._plan is what load() runs before the first allocation (free bytes from
    cudaMemGetInfo there, given here)."""
    from backends.engine import EngineBackend
    info = open_gguf(tiny_qwen2_q)
    e = EngineBackend()
    with pytest.raises(ModelError, match=r"engine: m \(--vram-limit 1,048,576 B\) does not fit: "
                                         r".* but 1\.0 MiB is free"):
        e._plan(info, "m", RunConfig(n_ctx=CTX, vram_limit=1 << 20), free=BIG)
    dev_need, host_need = _needs(info)
    plan = e._plan(info, "m", RunConfig(n_ctx=CTX, vram_limit=dev_need - 1), free=BIG)
    assert plan.host and e.planned_bytes == host_need == plan.need
    plan = e._plan(info, "m", RunConfig(n_ctx=CTX), free=BIG)
    assert not plan.host and e.planned_bytes == dev_need


# ---- command line ------------------------------------------------------------------------

def test_cli_flags_reach_the_run_config(tiny_qwen2_q, tmp_path, monkeypatch, capsys):
    from harness import main_job
    seen = {}

    class Tok:
        def close(self):
            pass

    def fake_verify(model, meta, proto, base, *a, **k):
        seen["base"] = base
        raise ConfigError("stop here")
    monkeypatch.setattr(main_job, "tokenize_prompt", lambda model, text, n: (Tok(), [1, 2, 3]))
    monkeypatch.setattr(main_job, "verify_model", fake_verify)
    argv = ["verify", "--model", str(tiny_qwen2_q), "--backends", "oracle", "--bench",
            "--contexts", "64", "--n-predict", "4", "--out", str(tmp_path / "out")]
    assert cli.main(argv + ["--vram-limit", "123456789", "--embd-placement", "host"]) == 2
    assert "stop here" in capsys.readouterr().err
    assert seen["base"].vram_limit == 123456789 and seen["base"].embd_placement == "host"
    assert cli.main(argv) == 2
    assert seen["base"].vram_limit is None and seen["base"].embd_placement == "auto"


def test_cli_rejects_bad_memory_flags(tiny_qwen2_q, tmp_path, capsys):
    argv = ["verify", "--model", str(tiny_qwen2_q), "--backends", "oracle", "--bench",
            "--out", str(tmp_path / "out")]
    assert cli.main(argv + ["--vram-limit", "0"]) == 2
    err = capsys.readouterr().err
    assert "--vram-limit must be >= 1" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as ex:  # argparse: not one of the choices
        cli.main(argv + ["--embd-placement", "gpu"])
    assert ex.value.code == 2


# ---- bench rows record the engine's memory -------------------------------------------------

def test_bench_row_records_planned_vs_measured_memory():
    from harness.bench_e2e import MEMORY_KEYS, bench_e2e

    class Fake:
        def __init__(self, name, caps):
            self.name, self.caps = name, caps

        def load(self, model, cfg):
            self.cfg = cfg

        def bench(self, prompt, n_decode, reps):
            return {"prefill_s": [0.1] * reps, "decode_s": [0.1] * reps}

        def capabilities(self):
            return self.caps

        def info(self):
            return {"token_embd": "host", "planned_bytes": 100, "measured_bytes_step": 90,
                    "vram_limit": self.cfg.vram_limit, "nodes_per_step": 7,
                    "switches_effective": {"GGUF_HARNESS_GEMV_KQ_CSPLIT": "1"}}

        def close(self):
            pass
    made = {"engine": Fake("engine", {"memory"}), "llamacpp": Fake("llamacpp", set())}
    out = bench_e2e(ModelRef("m", "m.gguf"), 1, ["engine", "llamacpp"], [512], [1, 2],
                    RunConfig(vram_limit=4096, embd_placement="host"), made.__getitem__,
                    reps=2, log=lambda m: None)
    rows = {r["backend"]: r for r in out["rows"]}
    mem = rows["engine"]["memory"]
    assert set(mem) == set(MEMORY_KEYS)
    assert mem["token_embd"] == "host" and mem["vram_limit"] == 4096 and mem["bytes_host"] is None
    assert "memory" not in rows["llamacpp"]
    assert rows["engine"]["switches_effective"] == {"GGUF_HARNESS_GEMV_KQ_CSPLIT": "1"}
    assert "switches_effective" not in rows["llamacpp"]


# ---- GPU -----------------------------------------------------------------------------------

def _load(path, **cfg):
    cupy_or_skip()
    from backends.engine import EngineBackend
    e = EngineBackend()
    e.load(ModelRef(path.stem, path), RunConfig(n_ctx=CTX, **cfg))
    return e


def _greedy(eng, steps=4) -> list[np.ndarray]:
    out = [eng.prefill(PROMPT)]
    for _ in range(steps):
        out.append(eng.step(int(np.argmax(out[-1]))))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("fixture", ["tiny_qwen2_f32", "tiny_qwen2_q"])
def test_token_embd_on_the_host_same_bits_less_device_memory(fixture, request):
    path = request.getfixturevalue(fixture)
    cp = cupy_or_skip()
    e = open_gguf(path).tensor("token_embd.weight")
    padded = -(-e.nbytes // 256) * 256  # arena.ALIGN
    dev = _load(path, embd_placement="device")
    a = _greedy(dev)
    di = dev.info()
    dev.close()
    host = _load(path, embd_placement="host")
    b = _greedy(host)
    hi = host.info()
    t = host.arena["token_embd.weight"]
    # the embedding node reads the table through the mapped host allocation
    assert cp.cuda.runtime.pointerGetAttributes(t.ptr).type == cp.cuda.runtime.memoryTypeHost
    assert host.step_exec.nodes[0].kind == "embed" and int(host.step_exec.nodes[0].args[0]) == t.ptr
    for i, (x, y) in enumerate(zip(a, b)):
        assert np.array_equal(x.view(np.uint32), y.view(np.uint32)), f"step {i}: logits differ"
    assert di["token_embd"] == "device" and hi["token_embd"] == "host"
    assert di["bytes_host"] == 0 and hi["bytes_host"] == padded
    assert di["bytes_resident"] - hi["bytes_resident"] == padded
    # the engine's own device arrays (CuPy pool, rounded to 512 B per allocation)
    assert abs(di["pool_bytes"] - hi["pool_bytes"] - e.nbytes) <= 1024, (di, hi)
    assert di["planned_bytes"] - hi["planned_bytes"] == e.nbytes - e.row_bytes
    for i in (di, hi):  # measured after load and after the step graphs ran (device-wide)
        assert isinstance(i["measured_bytes_load"], int) and isinstance(i["measured_bytes_step"], int)
    arena = host.arena
    host.close()
    assert arena.host_mem is None and arena.buf is None  # pinned and device memory released


@pytest.mark.gpu
def test_auto_placement_under_a_vram_limit_loads_with_token_embd_on_the_host(tiny_qwen2_q):
    cupy_or_skip()
    dev_need, host_need = _needs(open_gguf(tiny_qwen2_q))
    eng = _load(tiny_qwen2_q, vram_limit=dev_need - 1)
    i = eng.info()
    assert i["token_embd"] == "host" and i["vram_limit"] == dev_need - 1
    assert i["plan_free_bytes"] == dev_need - 1 and i["planned_bytes"] == host_need
    ids = [int(np.argmax(x)) for x in _greedy(eng, steps=2)]
    eng.close()
    ref = _load(tiny_qwen2_q)
    assert ref.info()["token_embd"] == "device"
    assert [int(np.argmax(x)) for x in _greedy(ref, steps=2)] == ids
    ref.close()


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["auto", "device", "host"])
def test_vram_limit_below_the_need_refuses_before_allocating(tiny_qwen2_q, placement):
    cp = cupy_or_skip()
    dev_need, host_need = _needs(open_gguf(tiny_qwen2_q))
    limit = {"device": dev_need, "auto": host_need, "host": host_need}[placement] - 1
    pool = cp.get_default_memory_pool()
    before = pool.used_bytes()
    with pytest.raises(ModelError, match=r"does not fit: needs .* MiB is free \(short by"):
        _load(tiny_qwen2_q, vram_limit=limit, embd_placement=placement)
    assert pool.used_bytes() == before  # refused before the arena or any buffer
