"""Shared fixtures: synthetic tiny qwen2 models (written once per session) and the real model.

Other test files may append fixtures below; keep each one documented.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

SYNTH_SEED = 1  # seed of the session's synthetic models (greedy output checked non-degenerate)
MODEL_05B_ENV = "GGUF_HARNESS_MODEL_05B"


@pytest.fixture(scope="session")
def synth_seed() -> int:
    """The seed the tiny_qwen2_* fixtures were written with."""
    return SYNTH_SEED


@pytest.fixture(scope="session")
def synth_dir(tmp_path_factory) -> Path:
    """A session-wide folder for synthetic GGUF files."""
    return tmp_path_factory.mktemp("synth")


@pytest.fixture(scope="session")
def tiny_qwen2_f32(synth_dir) -> Path:
    """Path of the "qwen2-tiny" preset (all F32): 2 layers, n_embd 64, 4/2 heads, n_ff 256,
    vocab 512, seed SYNTH_SEED."""
    from harness.synth import write_preset
    return write_preset("qwen2-tiny", synth_dir / "qwen2-tiny-f32.gguf", seed=SYNTH_SEED)


@pytest.fixture(scope="session")
def tiny_qwen2_q(synth_dir) -> Path:
    """Path of the "qwen2-tiny-q" preset: same shapes, Q5_0/Q8_0/Q4_0/Q6_K/Q4_K matrices."""
    from harness.synth import write_preset
    return write_preset("qwen2-tiny-q", synth_dir / "qwen2-tiny-q.gguf", seed=SYNTH_SEED)


def _find_model_05b() -> tuple[Path | None, str]:
    env = os.environ.get(MODEL_05B_ENV)
    if env:
        p = Path(env).expanduser()
        return (p, "") if p.is_file() else (None, f"${MODEL_05B_ENV}={env} is not a file")
    from harness import models
    m = models.REGISTRY[models.DEFAULT_MODEL]
    if models.status(m) == "missing":
        return None, (f"real model {m.name} is not installed: pip install -e '.[{m.extra}]' "
                      f"(or set ${MODEL_05B_ENV} to a copy of the file)")
    return models.resolve(m.name).path, ""


@pytest.fixture(scope="session")
def real_model_05b() -> Path:
    """Path of qwen2.5-coder-0.5b-q4_k_m.gguf: $GGUF_HARNESS_MODEL_05B, else the registry
    (assembled from its chunk packages on first use); skips when neither has it."""
    path, why = _find_model_05b()
    if path is None:
        pytest.skip(why)
    return path


@pytest.fixture(scope="session")
def tiny_qwen35_f32(synth_dir) -> Path:
    """Path of the "qwen35-tiny" preset, all F32: 8 layers (3 DeltaNet + 1 gated attention,
    twice), n_embd 256, vocab 512, seed SYNTH_SEED (harness.synth.qwen35_presets)."""
    from harness.synth.qwen35_presets import write_qwen35_preset
    return write_qwen35_preset("qwen35-tiny", synth_dir / "qwen35-tiny-f32.gguf", "f32",
                               seed=SYNTH_SEED)


@pytest.fixture(scope="session")
def tiny_qwen35_mix(synth_dir):
    """quant mix -> Path of the "qwen35-tiny" preset written in that mix of
    harness.synth.qwen35_presets.QUANTS (seed SYNTH_SEED), each file written once per session."""
    from harness.synth.qwen35_presets import write_qwen35_preset
    made: dict[str, Path] = {}

    def get(quant: str) -> Path:
        if quant not in made:
            made[quant] = write_qwen35_preset("qwen35-tiny", synth_dir / f"qwen35-tiny-mix-{quant}.gguf",
                                              quant, seed=SYNTH_SEED)
        return made[quant]
    return get
