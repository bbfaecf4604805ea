"""Dequantised GGUF weights for the float64 oracle: exact float32 values, float64 products.

Memory choice: every matrix is dequantised once (oracles.dequant, gguf-py; equal to ggml's
to_float bit for bit) and kept as float32, which holds those values exactly. Products are
computed in float64 by chunks of weight rows: a chunk (CHUNK_BYTES of float64, 8 MiB) is
upcast and multiplied, so the temporary is bounded and the result equals a full float64
product. Resident size is 4 bytes per weight: Qwen2.5-Coder-0.5B ~1.98 GB (494 M values
without token_embd, which is read by rows), the 1.5B ~6 GB; float64 would double that.

Optional on-disk cache (cache_dir): one float32 .npy per tensor under
cache_dir/<model sha256>/<tensor name>.npy, written atomically, memory-mapped read-only
when loaded (page cache, not private memory). A cached file whose shape or dtype is wrong
is ignored and rewritten. Measured on the 2-core CI CPU (Qwen2.5-Coder-0.5B Q4_K_M, shared
machine, best of 2-4 runs): Qwen2Oracle load 5.8-6.4 s without a cache (gguf-py dequant
4.5-5.8 s of it), 7.4 s when also writing the cache (1.9 GB), 0.9 s from a warm cache;
peak RSS 2.9 GB without / 2.1 GB with the memory-mapped cache.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from harness.errors import ConfigError, ModelError
from harness.gguf_file import GGUFInfo, open_gguf
from oracles.dequant import dequantize

CHUNK_BYTES = 8 << 20  # float64 bytes of one upcast weight chunk
_SAFE_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,200}")
_HEX = re.compile(r"[0-9a-f]{1,128}")


def file_sha256(path: Path, block: int = 1 << 24) -> str:
    """Hex SHA256 of a file, read in 16 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


class GGUFWeights:
    """Tensors of one GGUF file, dequantised on first use and kept as float32.

    info: an opened harness.gguf_file.GGUFInfo (or a path, opened here).
    cache_dir: optional folder for the .npy cache; sha256: the model's SHA256 if known
    (computed from the file when a cache is used and it is not given).
    Attributes: dequant_seconds / cache_seconds (time spent dequantising / reading the cache),
    resident_bytes (float32 bytes held by loaded tensors).
    """

    def __init__(self, info: GGUFInfo | str | os.PathLike, cache_dir: str | os.PathLike | None = None,
                 sha256: str | None = None) -> None:
        self.info = info if isinstance(info, GGUFInfo) else open_gguf(info)
        self._loaded: dict[str, np.ndarray] = {}
        self._cache = None
        if cache_dir is not None:
            digest = (sha256 or file_sha256(self.info.path)).lower()
            if not _HEX.fullmatch(digest):
                raise ConfigError(f"sha256 {digest!r} is not a hex digest")
            self._cache = Path(cache_dir) / digest
        self.dequant_seconds = 0.0
        self.cache_seconds = 0.0

    def has(self, name: str) -> bool:
        return name in self.info.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        """Numpy shape (reversed GGUF ne) of a tensor; ModelError if it is missing."""
        return self.info.tensor(name).shape

    @property
    def resident_bytes(self) -> int:
        return sum(a.nbytes for a in self._loaded.values())

    def get(self, name: str) -> np.ndarray:
        """float32 values of a tensor, numpy shape [rows, cols] ([n] for 1-D). Read-only.

        Raises ModelError (missing / malformed tensor), UnsupportedError (type gguf-py
        cannot dequantise).
        """
        arr = self._loaded.get(name)
        if arr is None:
            arr = self._from_cache(name)
            if arr is None:
                arr = self._dequantize(name)
                self._to_cache(name, arr)
            arr.flags.writeable = False
            self._loaded[name] = arr
        return arr

    def _dequantize(self, name: str) -> np.ndarray:
        t0 = time.perf_counter()
        t = self.info.tensor(name)
        arr = dequantize(self.info.tensor_data(name), t.type_id, t.shape, what=f"tensor {name!r}")
        self.dequant_seconds += time.perf_counter() - t0
        return arr

    def _cache_path(self, name: str) -> Path | None:
        if self._cache is None:
            return None
        # Tensor names come from an untrusted file: never let one leave the cache folder.
        safe = _SAFE_NAME.fullmatch(name) and not name.startswith(".")
        stem = name if safe else "sha256-" + hashlib.sha256(name.encode()).hexdigest()
        return self._cache / f"{stem}.npy"

    def _from_cache(self, name: str) -> np.ndarray | None:
        path = self._cache_path(name)
        if path is None or not path.is_file():
            return None
        t0 = time.perf_counter()
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError):
            return None  # unreadable cache entry: dequantise again and overwrite it
        self.cache_seconds += time.perf_counter() - t0
        if arr.dtype != np.float32 or arr.shape != self.shape(name):
            return None
        return arr

    def _to_cache(self, name: str, arr: np.ndarray) -> None:
        path = self._cache_path(name)
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.save(f, arr, allow_pickle=False)
            os.replace(tmp, path)  # atomic: a reader never sees a half-written file
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def rows64(self, name: str, ids: Sequence[int]) -> np.ndarray:
        """float64 [len(ids), cols] rows of a 2-D tensor (embedding lookup, ggml_get_rows).

        Dequantises only the requested rows unless the whole tensor is already loaded.
        Raises ConfigError if an id is outside [0, rows).
        """
        t = self.info.tensor(name)
        idx = np.asarray(ids, dtype=np.int64).reshape(-1)
        n_rows = t.shape[0] if len(t.shape) == 2 else 0
        if idx.size and (idx.min() < 0 or idx.max() >= n_rows):
            bad = int(idx[(idx < 0) | (idx >= n_rows)][0])
            raise ConfigError(f"token id {bad} is outside [0, {n_rows}) of tensor {name!r}")
        if name in self._loaded:
            return self._loaded[name][idx].astype(np.float64)
        raw = self.info.tensor_data(name)[idx]  # [len(ids), row_bytes] uint8
        vals = dequantize(raw, t.type_id, (idx.size, t.shape[1]), what=f"tensor {name!r} rows")
        return vals.astype(np.float64)

    def vector64(self, name: str) -> np.ndarray:
        """A 1-D tensor (norm weight, bias) as float64 [n]."""
        return self.get(name).astype(np.float64).reshape(-1)

    def linear(self, name: str, x: np.ndarray, bias: str | None = None) -> np.ndarray:
        """y = x @ W^T (+ b) in float64 with W = tensor `name` (GGUF ne [k, m] -> [m, k]).

        x: [n, k]; bias: name of a [m] tensor or None. Returns float64 [n, m].
        The weight is upcast CHUNK_BYTES at a time (exact), so the float64 temporary is
        bounded. Source of the op: ggml_mul_mat + ggml_add (llama-graph.cpp build_lora_mm).
        """
        w = self.get(name)
        x = np.asarray(x, dtype=np.float64)
        m, k = w.shape
        if x.ndim != 2 or x.shape[1] != k:
            raise ConfigError(f"linear {name!r}: x shape {x.shape} does not match weight [{m}, {k}]")
        y = np.empty((x.shape[0], m), dtype=np.float64)
        step = max(1, CHUNK_BYTES // (8 * k))
        for r0 in range(0, m, step):
            wc = w[r0:r0 + step].astype(np.float64)  # [step, k]
            np.matmul(x, wc.T, out=y[:, r0:r0 + step])
        if bias is not None:
            y += self.vector64(bias)
        return y

    def check_shape(self, name: str, ne: Sequence[int]) -> None:
        """ModelError unless tensor `name` exists with GGUF dims ne (ggml order)."""
        t = self.info.tensor(name)
        if tuple(t.ne) != tuple(int(d) for d in ne):
            raise ModelError(f"{self.info.path.name}: tensor {name!r} has ne {tuple(t.ne)}, "
                             f"expected {tuple(int(d) for d in ne)}")
