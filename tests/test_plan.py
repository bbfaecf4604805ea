"""Capacity planner (harness.plan, `harness plan`): the source's 16 GB decision, sizes read
back independently from the GGUF headers with gguf-py, placement rules and the CLI."""
from __future__ import annotations

import json

import numpy as np
import pytest
from gguf import GGUFReader

from harness import cli
from harness.errors import ModelError
from harness.gguf_file import open_gguf
from harness.plan import Shape, plan_model, plan_sizes, require_fit

MiB = 1 << 20
# the 27B qwen35 shape (docs/sources.md §1): 16 attention layers, 48 DeltaNet layers with
# 48 value heads x 128 (state [48, 128, 128] fp32), conv kernel 4 over 2*16*128 + 48*128 channels
Q35_27B = Shape(n_embd=5120, n_ff=17408, n_vocab=248320, n_head=24, n_kv=4, head_dim=256,
                n_attn_layers=16, n_rec_layers=48, ssm_heads=48, ssm_state=128,
                conv_dim=2 * 16 * 128 + 48 * 128, d_conv=4)
SOURCE_WEIGHTS = 16_102_434_816   # decode tensors of the source's UD-Q4_K_M file
SOURCE_EMBD = 715_161_600         # token_embd [248320 x 5120] Q4_K
SOURCE_FREE = 15_802_040_320      # free bytes on the source's 16 GB card


def _item(plan, prefix):
    return next(b for n, b in plan.items if n.startswith(prefix))


def test_source_16gb_case_puts_token_embd_on_the_host_with_a_stated_margin():
    p = plan_sizes(SOURCE_WEIGHTS, SOURCE_EMBD, 5120 // 256 * 144, Q35_27B, 512, SOURCE_FREE)
    assert [n for n, _ in p.host] == ["token_embd.weight"]
    assert _item(p, "weights") == SOURCE_WEIGHTS - SOURCE_EMBD
    assert _item(p, "KV cache") == 64 * 1024 * 512              # 64 KiB per token
    assert _item(p, "recurrent state") == 2 * 48 * 4 * (48 * 128 * 128 + 3 * 10240)
    assert _item(p, "staging") == 2880                          # one Q4_K row of 5120 values
    assert p.fits and p.margin == SOURCE_FREE - sum(b for _, b in p.items)
    assert 0 < p.margin < 64 * MiB  # tight, as on the real card
    # the weights alone (16.10 GB) exceed the free 15.80 GB: keeping token_embd on the device
    # cannot fit, whatever the context
    on_device = plan_sizes(SOURCE_WEIGHTS, SOURCE_EMBD, 2880, Q35_27B, 512, SOURCE_FREE, embd_on_host=False)
    assert not on_device.fits and on_device.margin < -(SOURCE_WEIGHTS - SOURCE_FREE)


def test_over_budget_is_a_clear_error_naming_the_shortfall():
    p = plan_sizes(SOURCE_WEIGHTS, SOURCE_EMBD, 2880, Q35_27B, 2048, SOURCE_FREE)
    assert not p.fits and p.host  # host placement tried, still short: 96 MiB more KV
    with pytest.raises(ModelError, match=r"does not fit: needs .* MiB is free \(short by [0-9.,]+ MiB\)"):
        require_fit(p, "q35")
    require_fit(plan_sizes(SOURCE_WEIGHTS, SOURCE_EMBD, 2880, Q35_27B, 512, SOURCE_FREE), "q35")


def _header_facts(path):
    """Tensor bytes and KV geometry straight from gguf-py (independent of harness.gguf_file)."""
    r = GGUFReader(path)
    total = sum(int(t.n_bytes) for t in r.tensors)  # these fixtures have no MTP block
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()

    def val(key):
        f = r.fields[f"{arch}.{key}"]
        return int(np.asarray(f.parts[f.data[0]]).reshape(-1)[0])
    return arch, total, val


def test_qwen2_plan_from_the_header(tiny_qwen2_q):
    arch, total, val = _header_facts(tiny_qwen2_q)
    n_layer, n_head, n_kv = val("block_count"), val("attention.head_count"), val("attention.head_count_kv")
    head_dim = val("embedding_length") // n_head
    p = plan_model(open_gguf(tiny_qwen2_q), 100, free=1 << 40)
    assert arch == "qwen2" and p.fits and not p.host
    assert _item(p, "weights") == total
    assert _item(p, "KV cache") == 2 * 2 * 100 * n_kv * head_dim * n_layer


def test_qwen35_plan_has_state_and_kv_only_for_attention_layers(tiny_qwen35_f32):
    from oracles.qwen35_params import read_params
    prm = read_params(open_gguf(tiny_qwen35_f32))
    n_attn = sum(not r for r in prm.recurrent)
    p = plan_model(open_gguf(tiny_qwen35_f32), 64, free=1 << 40)
    assert 0 < n_attn < prm.n_layer
    assert _item(p, "KV cache") == 2 * 2 * 64 * prm.n_head_kv * prm.head_dim * n_attn
    per_layer = prm.ssm_dt_rank * prm.ssm_d_state ** 2 + (prm.ssm_d_conv - 1) * prm.conv_dim
    assert _item(p, "recurrent state") == 2 * 4 * (prm.n_layer - n_attn) * per_layer


def test_a_tied_head_keeps_token_embd_on_the_device(tmp_path):
    from harness.synth.qwen2 import write_qwen2
    path = write_qwen2(tmp_path / "tied.gguf", n_layer=1, n_embd=64, n_head=4, n_head_kv=2, n_ff=128,
                       n_vocab=300, n_ctx_train=128, tied=True)
    info = open_gguf(path)
    assert "output.weight" not in info.tensors
    p = plan_model(info, 64, free=1)  # nothing fits, yet the table that is the head stays
    assert not p.fits and not p.host


def test_cli_plan(tiny_qwen2_q, capsys):
    assert cli.main(["plan", "--model", str(tiny_qwen2_q), "--ctx", "64", "--free", str(1 << 40), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["free"] == 1 << 40 and out["need"] == sum(d["bytes"] for d in out["device"])
    assert cli.main(["plan", "--model", str(tiny_qwen2_q), "--ctx", "64", "--free", "1000"]) == 1
    assert "short by" in capsys.readouterr().err
    assert cli.main(["plan", "--model", str(tiny_qwen2_q), "--ctx", "0", "--free", "1"]) == 2


def test_cli_plan_is_the_engines_plan(tmp_path, tiny_qwen2_q, capsys):
    """`harness plan` plans as the engine loads (engine_plan): host placement on a separate
    output head, and the engine's refusal of host placement when token_embd is the head."""
    from harness.synth.qwen2 import write_qwen2
    args = ["plan", "--ctx", "64", "--free", str(1 << 40), "--json"]
    assert "output.weight" in open_gguf(tiny_qwen2_q).tensors
    assert cli.main([*args, "--model", str(tiny_qwen2_q), "--embd", "host"]) == 0  # old spelling
    out = json.loads(capsys.readouterr().out)
    assert [h["name"] for h in out["host"]] == ["token_embd.weight"]
    tied = write_qwen2(tmp_path / "tied.gguf", n_layer=1, n_embd=64, n_head=4, n_head_kv=2,
                       n_ff=128, n_vocab=300, n_ctx_train=128, tied=True)
    assert cli.main([*args, "--model", str(tied), "--embd-placement", "host"]) == 2
    assert "cannot live on the host" in capsys.readouterr().err


def test_cli_plan_needs_a_free_figure_without_a_gpu(tiny_qwen2_q, capsys, monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_cupy(name, *a, **k):
        if name == "cupy":
            raise ImportError("no cupy here")
        return real_import(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_cupy)
    assert cli.main(["plan", "--model", str(tiny_qwen2_q)]) == 2
    assert "--free" in capsys.readouterr().err
    assert cli.main(["plan", "--model", str(tiny_qwen2_q), "--ctx", "64", "--vram-limit", str(1 << 40)]) == 0


def test_mtp_block_is_not_planned_or_counted(tmp_path):
    """An MTP block's attention/FFN tensors have plain names (blk.N.attn_q...): only the block
    index says they are MTP. Neither the plan nor the decode bytes may count them."""
    import dataclasses

    from harness.model_bytes import decode_weight_bytes
    from harness.synth.qwen35 import write_qwen35
    from harness.synth.qwen35_presets import shape
    tiny = shape("qwen35-tiny")
    plain = open_gguf(write_qwen35(tmp_path / "a.gguf", tiny, "Q8_0", seed=1))
    mtp = open_gguf(write_qwen35(tmp_path / "b.gguf", dataclasses.replace(tiny, n_nextn=1), "Q8_0", seed=1))
    extra = [n for n in mtp.tensors if n not in plain.tensors]
    assert any(".nextn." not in n for n in extra)  # the trap: MTP tensors without 'nextn'
    assert decode_weight_bytes(mtp) == decode_weight_bytes(plain)
    assert _item(plan_model(mtp, 64, 1 << 40), "weights") == _item(plan_model(plain, 64, 1 << 40), "weights")


def test_block_count_must_match_the_tensors(tiny_qwen2_q):
    """A header claiming more layers than the file has tensors for would plan a KV cache for
    layers that do not exist: refused."""
    info = open_gguf(tiny_qwen2_q)
    n = info.metadata["qwen2.block_count"]
    info.metadata["qwen2.block_count"] = 1000
    with pytest.raises(ModelError, match=f"block_count gives 1000 decode layers but the file holds tensors for {n} blocks"):
        plan_model(info, 64, free=1 << 40)
