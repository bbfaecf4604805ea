"""The second synthetic path: quantise an F32 GGUF with llama.cpp's own quantiser.

llama_model_quantize (llama.h; implemented in src/llama-quant.cpp) picks the per-tensor
types of a file type the way the `llama-quantize` tool does (e.g. Q4_K_M: Q6_K for attn_v /
ffn_down on some layers, 1-D tensors and ssm_conv1d kept F32), so the result is what a user
would get from a real F32 model. No importance matrix is passed: file types that need one
(IQ2_XXS, IQ2_XS, IQ1_S, ...) are refused by llama.cpp, so they are not offered here.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

from ..errors import ConfigError, ModelError

# llama.h enum llama_ftype (values of the llama.cpp bundled with llama-cpp-python 0.3.36)
FTYPES = {"f16": 1, "q4_0": 2, "q8_0": 7, "q4_k_m": 15, "q5_k_m": 17, "q6_k": 18,
          "iq3_s": 26, "iq3_m": 27, "iq4_xs": 30}


def llama_quantize(src: str | os.PathLike, dst: str | os.PathLike, ftype: str,
                   n_threads: int = 2) -> Path:
    """Quantise GGUF `src` to `dst` as llama.cpp file type `ftype` (a key of FTYPES).

    Writes <dst>.part and renames it, so a failure leaves nothing under dst. Raises
    ConfigError (unknown ftype, missing src) or ModelError quoting llama.cpp's log when
    llama_model_quantize fails.
    """
    import llama_cpp

    from backends.llamacpp import logs
    key = ftype.lower()
    if key not in FTYPES:
        raise ConfigError(f"unknown llama.cpp file type {ftype!r} (known: {', '.join(FTYPES)})")
    src, dst = Path(src), Path(dst)
    if not src.is_file():
        raise ConfigError(f"llama_quantize: source model {src} does not exist")
    part = dst.with_name(dst.name + ".part")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[key]
    params.nthread = n_threads
    log = logs.capture()
    log.clear()
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(part).encode(), ctypes.byref(params))
    if rc != 0 or not part.is_file():
        part.unlink(missing_ok=True)
        hint = " | ".join(log.problems())
        raise ModelError(f"llama_model_quantize({src.name} -> {key}) returned {rc}"
                         + (f"; llama.cpp says: {hint}" if hint else ""))
    os.replace(part, dst)
    return dst
