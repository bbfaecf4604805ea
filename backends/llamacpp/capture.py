"""Named intermediate tensors of llama.cpp's graph, through the scheduler's eval callback.

llama_context_params.cb_eval (llama.h) is ggml_backend_sched_eval_callback
(ggml/include/ggml-backend.h): called with ask=true for every graph node ("do you want to
see this one?") and, for the nodes that answered true, again with ask=false once the node
is computed (its data is then readable). Graph nodes carry the names llama.cpp's builders
give them with cb(): "<name>-<layer>" for a layer, "<name>" otherwise
(src/llama-context.cpp graph_get_cb). The same name can occur more than once in a graph
(qwen35.cpp names the projected K "Kcur" and again the roped K); every occurrence is kept
in graph order.

ggml_tensor is read through a ctypes mirror of the struct in ggml/include/ggml.h; its size is
checked against libggml (ggml_tensor_overhead() - sizeof(ggml_object)) before first use.
Only F32 tensors are copied, others are recorded as skipped. Tensors in host memory (CPU
backend) are read in place; tensors in device memory (CUDA backend) are copied out with
ggml_backend_tensor_get (ggml/include/ggml-backend.h), as llama.cpp's eval-callback example does.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Callable

import llama_cpp
import numpy as np

from harness.config import RunConfig
from harness.errors import UnsupportedError

from .backend import LlamaCppBackend

GGML_TYPE_F32 = 0
GGML_OBJECT_SIZE = 32  # sizeof(struct ggml_object): offs, size, next, type + padding (ggml.c)


class GgmlTensor(ctypes.Structure):
    """struct ggml_tensor (ggml/include/ggml.h; GGML_MAX_DIMS 4, GGML_MAX_SRC 10,
    GGML_MAX_OP_PARAMS 64, GGML_MAX_NAME 64)."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p),
                ("ne", ctypes.c_int64 * 4), ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int),
                ("op_params", ctypes.c_int32 * 16), ("flags", ctypes.c_int32),
                ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p),
                ("name", ctypes.c_char * 64), ("extra", ctypes.c_void_p),
                ("padding", ctypes.c_char * 8)]


@functools.cache
def _ggml() -> ctypes.CDLL:
    from oracles.ggml_ref import find_libggml_base
    lib = ctypes.CDLL(str(find_libggml_base()))
    lib.ggml_tensor_overhead.restype = ctypes.c_size_t
    lib.ggml_backend_buffer_is_host.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_buffer_is_host.restype = ctypes.c_bool
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                            ctypes.c_size_t]
    lib.ggml_backend_tensor_get.restype = None
    expected = lib.ggml_tensor_overhead() - GGML_OBJECT_SIZE
    if ctypes.sizeof(GgmlTensor) != expected:
        raise UnsupportedError(f"struct ggml_tensor of this libggml has {expected} bytes, the "
                               f"ctypes mirror {ctypes.sizeof(GgmlTensor)}: capture disabled")
    return lib


def read_f32(t: GgmlTensor) -> np.ndarray | None:
    """Copy of an F32 tensor in numpy order (reversed ne, strides from nb); None when the
    tensor is not F32 or has no data. Device tensors are copied to the host first (the
    whole strided extent, which is ggml_nbytes of the tensor)."""
    if t.type != GGML_TYPE_F32 or not t.data:
        return None
    ne, nb = list(t.ne), list(t.nb)
    extent = sum((n - 1) * s for n, s in zip(ne, nb)) + 4
    if t.buffer and not _ggml().ggml_backend_buffer_is_host(t.buffer):
        host = np.empty(extent, dtype=np.uint8)
        _ggml().ggml_backend_tensor_get(ctypes.addressof(t), host.ctypes.data, 0, extent)
        base = host.view(np.float32)  # extent is a multiple of 4: F32 strides are
    else:
        buf = (ctypes.c_char * extent).from_address(t.data)
        base = np.frombuffer(buf, dtype=np.float32)
    view = np.lib.stride_tricks.as_strided(base, shape=tuple(reversed(ne)),
                                           strides=tuple(reversed(nb)))
    return np.array(view, dtype=np.float32)  # copy: the graph reuses this memory


class TensorCapture:
    """The eval callback. want(name) -> bool selects nodes (default: all). After a decode,
    tensors[name] lists the float32 arrays (numpy order [ne3, ne2, ne1, ne0]) of every node
    of that name in graph order; skipped lists names seen but not copied (not F32)."""

    def __init__(self, want: Callable[[str], bool] | None = None) -> None:
        _ggml()  # ABI check before llama.cpp ever calls us
        self.want = want or (lambda name: True)
        self.tensors: dict[str, list[np.ndarray]] = {}
        self.skipped: set[str] = set()
        self.callback = llama_cpp.ggml_backend_sched_eval_callback(self._on_eval)

    def clear(self) -> None:
        self.tensors, self.skipped = {}, set()

    def _on_eval(self, t_ptr, ask: bool, _user) -> bool:
        t = ctypes.cast(t_ptr, ctypes.POINTER(GgmlTensor)).contents
        name = t.name.decode("utf-8", errors="replace")
        if ask:
            return bool(self.want(name))
        arr = read_f32(t)
        if arr is None:
            self.skipped.add(name)
        else:
            self.tensors.setdefault(name, []).append(arr)
        return True  # false would abort the graph computation

    def last(self, name: str) -> np.ndarray | None:
        """The last node of that name (graph order), or None."""
        found = self.tensors.get(name)
        return found[-1] if found else None


class CapturingLlamaCpp(LlamaCppBackend):
    """LlamaCppBackend whose context reports named intermediates into `capture` (a
    TensorCapture). Call capture.clear() before a prefill/step to keep only that call's
    tensors. Extra capability "capture"."""

    name = "llamacpp-capture"

    def __init__(self, want: Callable[[str], bool] | None = None) -> None:
        super().__init__()
        self.capture = TensorCapture(want)

    def _context_params(self, cfg: RunConfig):
        p = super()._context_params(cfg)
        p.cb_eval = self.capture.callback  # the ctypes callback object lives on self.capture
        p.cb_eval_user_data = None
        return p

    def capabilities(self) -> set[str]:
        return super().capabilities() | {"capture"}
