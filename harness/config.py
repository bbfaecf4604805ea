"""Frozen, validated run settings. CLI flags map 1:1 to these fields."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import ConfigError

KV_TYPES = ("f16", "f32", "q8_0")
MIN_CTX = 8  # smallest n_ctx a run takes
MAX_THREADS = 512  # ggml's GGML_MAX_N_THREADS; 100000 crashed the llama.cpp child (SIGSEGV)
EMBD_PLACEMENTS = ("auto", "device", "host")  # the engine's token_embd placement (harness.plan)


@dataclass(frozen=True)
class ModelRef:
    """A GGUF file on disk plus what we know of it.

    name: registry name or the file stem; path: absolute path; sha256/size: as checked
    (None when not checked yet).
    """

    name: str
    path: Path
    sha256: str | None = None
    size: int | None = None

    def to_json(self) -> dict:
        return {"name": self.name, "path": str(self.path), "sha256": self.sha256, "size": self.size}


@dataclass(frozen=True)
class RunConfig:
    """Settings shared by every backend of one run.

    n_ctx: context size in tokens; n_batch/n_ubatch: llama.cpp batch sizes; n_threads: CPU
    threads (fixed, so runs are repeatable); n_gpu_layers: 0 = CPU, 99 = all layers;
    flash_attn: llama.cpp flash attention; kv_type: KV cache element type; seed: RNG seed
    (greedy decoding does not use it, recorded for completeness); use_extra_bufts: llama.cpp
    extra buffer types (off: ggml's AMX/repack path crashes on the CI CPUs, see README).
    Engine only: vram_limit: plan against min(the device's free bytes, this) to emulate a
    smaller card (None: the free bytes); embd_placement: token_embd in device memory
    ("device"), in page-locked host memory read one row per token ("host"), or "auto" (the
    planner's choice: the host only when the model does not fit otherwise; harness.plan).
    """

    n_ctx: int = 512
    n_batch: int = 512
    n_ubatch: int = 512
    n_threads: int = 2
    n_gpu_layers: int = 0
    flash_attn: bool = True
    kv_type: str = "f16"
    seed: int = 1
    use_extra_bufts: bool = False
    vram_limit: int | None = None
    embd_placement: str = "auto"

    def __post_init__(self) -> None:
        if self.n_ctx < MIN_CTX:
            raise ConfigError(f"n_ctx must be >= {MIN_CTX}, got {self.n_ctx}")
        if self.n_batch < 1 or self.n_ubatch < 1 or self.n_ubatch > self.n_batch:
            raise ConfigError(f"need 1 <= n_ubatch <= n_batch, got {self.n_ubatch}, {self.n_batch}")
        if not 1 <= self.n_threads <= MAX_THREADS:
            raise ConfigError(f"n_threads must be in 1 .. {MAX_THREADS}, got {self.n_threads}")
        if self.kv_type not in KV_TYPES:
            raise ConfigError(f"kv_type must be one of {KV_TYPES}, got {self.kv_type!r}")
        if self.vram_limit is not None and (isinstance(self.vram_limit, bool)
                                            or not isinstance(self.vram_limit, int)
                                            or self.vram_limit < 1):
            raise ConfigError(f"vram_limit must be a number of bytes >= 1, got {self.vram_limit!r}")
        if self.embd_placement not in EMBD_PLACEMENTS:
            raise ConfigError(f"embd_placement must be one of {EMBD_PLACEMENTS}, "
                              f"got {self.embd_placement!r}")

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ProtocolConfig:
    """What to generate: prompt ids, number of generated tokens, context sizes.

    n_predict counts generated tokens (the standard protocol: 129, i.e. 1 from the prefill
    logits plus 128 timed decode steps).
    """

    prompt_ids: tuple[int, ...]
    n_predict: int = 129
    contexts: tuple[int, ...] = (512, 2048)
    teacher_forced: bool = True
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.prompt_ids) == 0:
            raise ConfigError("the prompt is empty: give at least one token")
        if self.n_predict <= 0:
            raise ConfigError(f"n_predict must be > 0, got {self.n_predict}")
        for c in self.contexts:
            if c < len(self.prompt_ids) + self.n_predict:
                raise ConfigError(
                    f"context {c} is too small for {len(self.prompt_ids)} prompt tokens + "
                    f"{self.n_predict} generated tokens"
                )
