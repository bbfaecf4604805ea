"""llama.cpp's own GEMV kernels on the shapes of `harness bench kernels`, through libggml
with ctypes (issue #7 item 3; `harness bench kernels --ggml`).

Method: one ggml graph holding R mul_mats of R distinct weight copies (the same random
blocks as harness.kernel_case.GemvCase: kernel_case.case_data, same seed) times one shared
f32 column x, on ggml's CUDA backend; a gate/up pair (shape.n_mats == 2) is two mul_mats
and ggml_swiglu_split per copy, the graph llama.cpp builds for a SwiGLU FFN
(silu(gate x) * (up x)). Per-kernel time = host wall time of ggml_backend_graph_compute
(which synchronises) / R. That time includes ggml's own work per node besides the matrix
read: mul_mat_vec_q first quantises x to q8_1 (one small kernel per mul_mat), and the gaps
between nodes inside ggml's CUDA graph (measured ~2.2 us per mul_mat on an H200), plus one
host call per graph (~10 us, spread over R nodes). Nothing is subtracted.

C API used (ggml/include/ggml.h, ggml-alloc.h, ggml-backend.h, ggml-cuda.h, ggml-cpu.h of
the llama.cpp vendored by llama-cpp-python 0.3.36): ggml_init takes struct
ggml_init_params {size_t mem_size; void *mem_buffer; bool no_alloc} BY VALUE; with no_alloc
the context still holds the tensor and graph objects, sized by graph_mem(); ggml_mul_mat(ctx,
a, b) with a = the weight (ne = [K, rows], quantised) and b = x (ne = [K, 1], f32) gives
ne = [rows, 1] f32; ggml_new_graph_custom(ctx, size, false) (ggml_new_graph stops at
GGML_DEFAULT_GRAPH_SIZE = 2048 nodes); ggml_backend_alloc_ctx_tensors(ctx, backend) (NULL on
failure) before any ggml_backend_tensor_set; ggml_backend_graph_compute returns enum
ggml_status (0 = success). Every pointer-returning function gets restype c_void_p (the
default int would truncate 64-bit pointers). ggml-cuda captures its own CUDA graph after two
identical computes and keys its cache by the graph's first node: each GgmlGemv has its own
backend (freed in close(), cache with it) and warms up >= 3 times before timing.

Libraries: libggml-base.so then libggml-cuda.so (or libggml-cpu.so for backend "cpu", used
by the CPU tests), both RTLD_GLOBAL, from $LLAMA_CPP_LIB_PATH or the installed llama_cpp
package's lib directory (oracles.ggml_ref.find_libggml_base). A library that is missing or
does not load (e.g. built against a newer glibc), a missing CUDA backend or device, or a
type ggml's backend does not support raise UnsupportedError, so callers record "llama.cpp
kernels unavailable" and go on. ggml aborts the process on a failed internal assertion,
so everything it would assert on (type ids, context size, shapes) is checked here first.
"""
from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

import numpy as np

from . import bench_stats as bs
from .errors import UnsupportedError
from .kernel_shapes import CHECK_VALUES, Shape, check_rows

GGML_TYPE_F32 = 0
GGML_TYPE_COUNT = 43     # ggml.h enum ggml_type of the vendored llama.cpp (oracles/ggml_ref.py)
GGML_STATUS_SUCCESS = 0  # ggml.h enum ggml_status
MIN_WARMUP = 3           # ggml-cuda captures its CUDA graph after 2 identical computes
CTX_SLACK = 4096         # bytes on top of graph_mem (object headers are counted already)
BACKEND_LIBS = {"cuda": "libggml-cuda", "cpu": "libggml-cpu"}

c_void_p, c_size_t, c_int, c_int64, c_bool, c_char_p = (
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int64, ctypes.c_bool,
    ctypes.c_char_p)


class GgmlInitParams(ctypes.Structure):
    """struct ggml_init_params (ggml.h), passed by value to ggml_init; 24 bytes on x86-64
    (bool at offset 16, padded to 8)."""

    _fields_ = [("mem_size", c_size_t), ("mem_buffer", c_void_p), ("no_alloc", c_bool)]


# name -> (restype, argtypes); enum arguments are C ints, bool is _Bool.
BASE_PROTOTYPES: dict[str, tuple] = {
    "ggml_tensor_overhead": (c_size_t, []),
    "ggml_graph_overhead_custom": (c_size_t, [c_size_t, c_bool]),
    "ggml_init": (c_void_p, [GgmlInitParams]),
    "ggml_free": (None, [c_void_p]),
    "ggml_new_tensor_2d": (c_void_p, [c_void_p, c_int, c_int64, c_int64]),
    "ggml_set_name": (c_void_p, [c_void_p, c_char_p]),
    "ggml_nbytes": (c_size_t, [c_void_p]),
    "ggml_mul_mat": (c_void_p, [c_void_p, c_void_p, c_void_p]),
    "ggml_swiglu_split": (c_void_p, [c_void_p, c_void_p, c_void_p]),
    "ggml_new_graph_custom": (c_void_p, [c_void_p, c_size_t, c_bool]),
    "ggml_build_forward_expand": (None, [c_void_p, c_void_p]),
    "ggml_graph_n_nodes": (c_int, [c_void_p]),
    "ggml_backend_alloc_ctx_tensors": (c_void_p, [c_void_p, c_void_p]),
    "ggml_backend_buffer_free": (None, [c_void_p]),
    "ggml_backend_supports_op": (c_bool, [c_void_p, c_void_p]),
    "ggml_backend_tensor_set": (None, [c_void_p, c_void_p, c_size_t, c_size_t]),
    "ggml_backend_tensor_get": (None, [c_void_p, c_void_p, c_size_t, c_size_t]),
    "ggml_backend_graph_compute": (c_int, [c_void_p, c_void_p]),
    "ggml_backend_name": (c_char_p, [c_void_p]),
    "ggml_backend_free": (None, [c_void_p]),
}
BACKEND_PROTOTYPES: dict[str, dict[str, tuple]] = {
    "cuda": {"ggml_backend_cuda_init": (c_void_p, [c_int]),
             "ggml_backend_cuda_get_device_count": (c_int, [])},
    "cpu": {"ggml_backend_cpu_init": (c_void_p, []),
            "ggml_backend_cpu_set_n_threads": (None, [c_void_p, c_int])},
}


def declare(lib, prototypes: dict[str, tuple]) -> None:
    """Set restype / argtypes of every listed function on a CDLL; UnsupportedError naming
    the first missing symbol (an older or differently built libggml)."""
    for name, (res, args) in prototypes.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            raise UnsupportedError(f"llama.cpp kernels unavailable: {name} missing in "
                                   f"{getattr(lib, '_name', lib)}") from None
        fn.restype, fn.argtypes = res, args


def n_tensors(copies: int, n_mats: int) -> int:
    """Tensors of the graph's context: x, then per copy n_mats weights, n_mats mul_mat
    results and (pair) one swiglu result."""
    return 1 + copies * (2 * n_mats + (1 if n_mats == 2 else 0))


def graph_size(copies: int, n_mats: int) -> int:
    """ggml_new_graph_custom size (capacity of nodes and of leafs each): nodes =
    copies * (n_mats + glu), leafs = copies * n_mats + 1; their upper bound n_tensors."""
    return n_tensors(copies, n_mats)


def graph_mem(copies: int, n_mats: int, tensor_overhead: int, graph_overhead) -> int:
    """mem_size of the no_alloc context: n_tensors * ggml_tensor_overhead() +
    ggml_graph_overhead_custom(graph_size, false) + CTX_SLACK. graph_overhead: callable
    size -> bytes (the library's function)."""
    return (n_tensors(copies, n_mats) * int(tensor_overhead)
            + int(graph_overhead(graph_size(copies, n_mats))) + CTX_SLACK)


def _find(dir_: Path, stem: str) -> Path:
    hits = sorted(dir_.glob(f"{stem}.so*")) + sorted(dir_.glob(f"{stem}.dylib"))
    if not hits:
        raise UnsupportedError(f"llama.cpp kernels unavailable: no {stem}.so in {dir_}")
    return hits[0]


def lib_dir(path: str | os.PathLike | None = None) -> Path:
    """The directory holding libggml-base: `path` when given, else $LLAMA_CPP_LIB_PATH or
    the llama_cpp package's lib/ (oracles.ggml_ref.find_libggml_base)."""
    if path is not None:
        return Path(path)
    from oracles.ggml_ref import find_libggml_base
    try:
        return find_libggml_base().parent
    except UnsupportedError as e:
        raise UnsupportedError(f"llama.cpp kernels unavailable: {e}") from None


class GgmlLib:
    """libggml-base and one backend library, loaded RTLD_GLOBAL with prototypes set.
    backend: "cuda" or "cpu"; path: the library directory (lib_dir)."""

    def __init__(self, backend: str = "cuda", path: str | os.PathLike | None = None):
        if backend not in BACKEND_LIBS:
            raise UnsupportedError(f"ggml backend {backend!r}: expected one of {sorted(BACKEND_LIBS)}")
        self.backend, self.dir = backend, lib_dir(path)
        base_path = _find(self.dir, "libggml-base")
        be_path = _find(self.dir, BACKEND_LIBS[backend])
        try:
            self.base = ctypes.CDLL(str(base_path), mode=ctypes.RTLD_GLOBAL)
            self.be = ctypes.CDLL(str(be_path), mode=ctypes.RTLD_GLOBAL)
        except OSError as e:  # e.g. "version `GLIBC_2.38' not found", missing libcudart
            raise UnsupportedError(f"llama.cpp kernels unavailable: cannot load {e}") from None
        declare(self.base, BASE_PROTOTYPES)
        declare(self.be, BACKEND_PROTOTYPES[backend])
        self.paths = {"base": str(base_path), backend: str(be_path)}

    def init_backend(self, device: int = 0, n_threads: int | None = None) -> int:
        """A new backend handle (free with ggml_backend_free); UnsupportedError when there is
        no such device or the init returns NULL."""
        if self.backend == "cuda":
            n = int(self.be.ggml_backend_cuda_get_device_count())
            if not 0 <= device < n:
                raise UnsupportedError(f"llama.cpp kernels unavailable: CUDA device {device} "
                                       f"of {n} (ggml_backend_cuda_get_device_count)")
            h = self.be.ggml_backend_cuda_init(int(device))
        else:
            h = self.be.ggml_backend_cpu_init()
            if h:
                self.be.ggml_backend_cpu_set_n_threads(h, int(n_threads or os.cpu_count() or 1))
        if not h:
            raise UnsupportedError(f"llama.cpp kernels unavailable: ggml {self.backend} backend "
                                   f"init returned NULL")
        return h


_LIBS: dict[tuple, GgmlLib | UnsupportedError] = {}


def load(backend: str = "cuda", path: str | os.PathLike | None = None) -> GgmlLib:
    """GgmlLib, once per process and (backend, directory); the UnsupportedError of a failed
    load is remembered and raised again (a run does not retry per shape)."""
    key = (backend, None if path is None else str(path), os.environ.get("LLAMA_CPP_LIB_PATH"))
    if key not in _LIBS:
        try:
            _LIBS[key] = GgmlLib(backend, path)
        except UnsupportedError as e:
            _LIBS[key] = e
    got = _LIBS[key]
    if isinstance(got, UnsupportedError):
        raise got
    return got


class GgmlGemv:
    """One shape as a ggml graph of R mul_mats (module docstring). shape:
    kernel_shapes.Shape; copies: R >= 1; seed: as GemvCase's (the same blocks and x).
    Raises UnsupportedError (no library / backend / device, a type ggml or the oracle lacks)
    or RuntimeError (allocation or compute failure). Use check(), then time(), then close()
    (or a with block)."""

    def __init__(self, shape: Shape, copies: int, seed: int = 0, backend: str = "cuda",
                 device: int = 0, path=None, n_threads: int | None = None):
        from .kernel_case import case_data
        if copies < 1:
            raise ValueError(f"copies must be >= 1, got {copies}")
        if not 0 <= shape.type_id < GGML_TYPE_COUNT:
            raise UnsupportedError(f"GGML type id {shape.type_id} is outside ggml's table")
        self.shape, self.copies, self.backend_kind = shape, copies, backend
        self.host, self.x = case_data(shape, seed)  # before any library work: cheap errors first
        self.lib = load(backend, path)
        self.ctx = self.buf = self.backend = None
        try:
            self._build(device, n_threads)
        except BaseException:
            self.close()
            raise

    def _build(self, device: int, n_threads: int | None) -> None:
        L, s, R = self.lib.base, self.shape, self.copies
        self.backend = self.lib.init_backend(device, n_threads)
        self.backend_name = (L.ggml_backend_name(self.backend) or b"").decode("utf-8", "replace")
        size = graph_size(R, s.n_mats)
        mem = graph_mem(R, s.n_mats, L.ggml_tensor_overhead(),
                        lambda n: L.ggml_graph_overhead_custom(n, False))
        self.ctx = L.ggml_init(GgmlInitParams(mem, None, True))
        if not self.ctx:
            raise RuntimeError(f"ggml_init({mem} bytes, no_alloc) returned NULL")
        self.x_t = self._tensor(GGML_TYPE_F32, s.K, 1, b"x")
        self.weights, self.outs = [], []
        for i in range(R):
            ws = [self._tensor(s.type_id, s.K, s.rows, f"w{i}.{j}".encode()) for j in range(s.n_mats)]
            ys = [L.ggml_mul_mat(self.ctx, w, self.x_t) for w in ws]
            y = L.ggml_swiglu_split(self.ctx, ys[0], ys[1]) if s.n_mats == 2 else ys[0]
            if not y or not all(ys):
                raise RuntimeError("ggml_mul_mat / ggml_swiglu_split returned NULL")
            L.ggml_set_name(y, f"y{i}".encode())
            self.weights.append(ws)
            self.outs.append(y)
            self.ops = ys + ([y] if s.n_mats == 2 else [])  # one copy's nodes, for supports_op
        got = L.ggml_nbytes(self.weights[0][0])
        if got != s.matrix_bytes:  # a type id / block layout disagreement with the oracle
            raise UnsupportedError(f"ggml sizes {s.fmt} [{s.rows}x{s.K}] at {got} bytes, the "
                                   f"oracle at {s.matrix_bytes}")
        for op in self.ops:
            if not L.ggml_backend_supports_op(self.backend, op):
                raise UnsupportedError(f"ggml's {self.backend_name} backend does not support "
                                       f"this {s.fmt} {'mul_mat/swiglu' if s.n_mats == 2 else 'mul_mat'}")
        self.graph = L.ggml_new_graph_custom(self.ctx, size, False)
        if not self.graph:
            raise RuntimeError("ggml_new_graph_custom returned NULL")
        for y in self.outs:
            L.ggml_build_forward_expand(self.graph, y)
        self.n_nodes = int(L.ggml_graph_n_nodes(self.graph))
        want = R * (s.n_mats + (1 if s.n_mats == 2 else 0))
        if self.n_nodes != want:
            raise RuntimeError(f"ggml graph has {self.n_nodes} nodes, expected {want}")
        self.buf = L.ggml_backend_alloc_ctx_tensors(self.ctx, self.backend)
        if not self.buf:
            raise RuntimeError(f"ggml_backend_alloc_ctx_tensors failed ({R} copies of "
                               f"{s.n_mats * s.matrix_bytes} bytes on {self.backend_name})")
        self._set(self.x_t, np.ascontiguousarray(self.x, np.float32))
        for j, h in enumerate(self.host):
            h = np.ascontiguousarray(h)
            for ws in self.weights:
                self._set(ws[j], h)

    def _tensor(self, type_id: int, ne0: int, ne1: int, name: bytes) -> int:
        t = self.lib.base.ggml_new_tensor_2d(self.ctx, int(type_id), int(ne0), int(ne1))
        if not t:
            raise RuntimeError("ggml_new_tensor_2d returned NULL")
        self.lib.base.ggml_set_name(t, name)
        return t

    def _set(self, t: int, a: np.ndarray) -> None:
        n = int(self.lib.base.ggml_nbytes(t))
        if a.nbytes != n:
            raise RuntimeError(f"tensor of {n} bytes, data of {a.nbytes}")
        self.lib.base.ggml_backend_tensor_set(t, a.ctypes.data, 0, n)

    def output(self, copy: int = 0) -> np.ndarray:
        """float32 [rows]: the result of copy `copy` as the backend holds it now."""
        y = np.empty(self.shape.rows, np.float32)
        self.lib.base.ggml_backend_tensor_get(self.outs[copy], y.ctypes.data, 0, y.nbytes)
        return y

    def compute(self) -> None:
        """One ggml_backend_graph_compute of the whole graph (returns after the device is
        done); RuntimeError on a status other than success."""
        st = self.lib.base.ggml_backend_graph_compute(self.backend, self.graph)
        if st != GGML_STATUS_SUCCESS:
            raise RuntimeError(f"ggml_backend_graph_compute returned status {st}")

    def sample(self) -> float:
        """Host wall seconds of one graph compute (R kernels)."""
        t0 = time.perf_counter()
        self.compute()
        return time.perf_counter() - t0

    def check(self, rng: np.random.Generator, max_values: int = CHECK_VALUES) -> dict:
        """Every output NaN-poisoned, one compute, copy 0 vs the float64 oracle on
        kernel_shapes.check_rows (the engine's rows for the same rng), every other copy
        bitwise equal to copy 0 ("copies_agree"). Returns the oracles.ggml_gemv_check verdict
        + {rows_total, unwritten, subset, copies_agree}; ok needs all of them."""
        from oracles.dequant import dequantize
        from oracles.ggml_gemv_check import check_store, check_swiglu
        s = self.shape
        nan = np.full(s.rows, np.nan, np.float32)
        for y in self.outs:
            self._set(y, nan)
        self.compute()
        full = self.output(0)
        agree = all(np.array_equal(self.output(i), full, equal_nan=True)
                    for i in range(1, self.copies))
        self._rows = check_rows(s.rows, s.K, rng, max_values)
        self._y = full[self._rows]
        w = [dequantize(h[self._rows].reshape(-1), s.type_id, (len(self._rows), s.K))
             .astype(np.float64) for h in self.host]
        be = self.backend_kind
        v = (check_swiglu(self._y, w[0], w[1], self.x, self._rows, s.type_id, be)
             if s.n_mats == 2 else check_store(self._y, w[0], self.x, self._rows, s.type_id, be))
        unwritten = int(np.isnan(full).sum())
        return dict(v, ok=v["ok"] and unwritten == 0 and agree, rows_total=s.rows,
                    unwritten=unwritten, subset=len(self._rows) < s.rows, copies_agree=agree)

    def same_as_checked(self) -> bool:
        """Copy 0's output now (after the timed computes) equals the checked one bit for bit."""
        return bool(np.array_equal(self.output(0)[self._rows], self._y, equal_nan=True))

    def time(self, rule: bs.StopRule, warmup: int = MIN_WARMUP) -> dict:
        """max(warmup, MIN_WARMUP) untimed computes, then samples until `rule` stops;
        bench_stats.summarize with per = R (us per kernel)."""
        for _ in range(max(warmup, MIN_WARMUP)):
            self.compute()
        samples, verdict = bs.collect(self.sample, rule)
        return bs.summarize(samples, verdict, self.copies)

    def close(self) -> None:
        """Free the buffer, the context and the backend (idempotent)."""
        L = self.lib.base if getattr(self, "lib", None) else None
        if L is None:
            return
        if self.buf:
            L.ggml_backend_buffer_free(self.buf)
        if self.ctx:
            L.ggml_free(self.ctx)
        if self.backend:
            L.ggml_backend_free(self.backend)
        self.buf = self.ctx = self.backend = None
        self.outs, self.weights = [], []

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
