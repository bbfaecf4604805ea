"""The programmatic-dependent-launch contract of the engine's kernels (backends/engine/launch.py),
checked on the source text (CPU): every kernel a node may launch with PDL calls pdl_wait()
itself or through the *_body function it calls. A kernel without it would read the previous
node's output while that node still runs (a race the GPU tests may or may not catch)."""
from __future__ import annotations

import re

from backends.engine.module import KERNEL_DIR

# Launched only with plain launches, never as an engine node: hold_stream (stream hold of the
# per-node timers: executor.time_nodes, harness.gpu_timing) and stream_read (bench kernels'
# roofline, harness/roofline.py launches it with pdl_ok=False). stream_chain (the chain roofline,
# harness/step_roofline.py) is launched with PDL and scanned like the engine's kernels; its mode 0
# skips the wait on purpose (test_stream_chain_waits_before_it_reads_x_or_writes). tcr_repack_q4_k
# (engine v12's load-time repack, gemv_tcr.repack_device: a plain CuPy launch at node build, then a
# stream synchronisation) reads only weights, never a node's output.
PLAIN_ONLY = {"hold_stream", "stream_read", "tcr_repack_q4_k"}


def _block_after(text: str, start: int) -> str:
    """Text from `start` to the brace that closes the first '{' after it."""
    i = text.index("{", start)
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[start:j + 1]
    raise ValueError("unbalanced braces")


def _bodies(text: str) -> dict[str, str]:
    out = {}
    for m in re.finditer(r"__device__\s+(?:__forceinline__\s+)?void\s+(\w+_body)\b", text):
        out[m.group(1)] = _block_after(text, m.start())
    return out


def kernels_missing_wait(sources: dict[str, str]) -> list[str]:
    """Names of __global__ kernels in `sources` (file name -> CUDA text) whose body neither
    calls pdl_wait() nor calls a *_body function that does. A kernel's *_body functions are
    looked up in its own .cu file and the .cuh headers (each .cu is its own NVRTC module, and
    gemv.cu and gemv_f32.cu both define a gemv_body). Macro-generated kernels are named by
    their macro's name pattern (e.g. gemv_##MNAME...)."""
    headers = "\n".join(t for n, t in sources.items() if n.endswith(".cuh"))
    missing = []
    for name_cu, text in sources.items():
        if not name_cu.endswith(".cu"):
            continue
        bodies = _bodies(text + "\n" + headers)
        for m in re.finditer(r"__global__\s+void\s+(?:__(?:launch_bounds|cluster_dims)__\([^)]*\)[\s\\]*)*([\w#]+)\s*\(", text):
            name = m.group(1)
            if name in PLAIN_ONLY:
                continue
            body = _block_after(text, m.start())
            called = [b for b in re.findall(r"(\w+_body)\s*[<(]", body) if b in bodies]
            if "pdl_wait()" not in body and not any("pdl_wait()" in bodies[b] for b in called):
                missing.append(name)
    return missing


def _engine_sources() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(KERNEL_DIR.glob("*.cu*"))}


def test_every_engine_kernel_waits_before_reading():
    src = _engine_sources()
    assert any("__global__" in t for t in src.values())
    assert kernels_missing_wait(src) == []


def test_the_check_finds_a_kernel_without_the_wait():
    src = _engine_sources()
    misc = src["misc.cu"]
    broken = misc.replace("extern \"C\" __global__ void finish_step(u64* key, int* state) {\n    pdl_wait();",
                          "extern \"C\" __global__ void finish_step(u64* key, int* state) {")
    assert broken != misc
    assert kernels_missing_wait(dict(src, **{"misc.cu": broken})) == ["finish_step"]
    body = src["gemv.cu"].replace("    pdl_wait();     // x (and the output", "    // x (and the output")
    assert body != src["gemv.cu"]
    got = kernels_missing_wait(dict(src, **{"gemv.cu": body}))
    assert got and all(n.startswith("gemv") for n in got)


def test_plain_only_kernels_are_not_engine_nodes():
    ops_text = (KERNEL_DIR.parent / "ops.py").read_text()
    for name in PLAIN_ONLY:
        assert f'"{name}"' not in ops_text


def test_stream_chain_waits_before_it_reads_x_or_writes():
    """stream_chain.cu: in its dependent modes the wait comes before the staging of x (another
    kernel's kind of input), the bulk copy and the XOR's atomic; only mode 0 skips it."""
    text = (KERNEL_DIR / "stream_chain.cu").read_text()
    body = _block_after(text, text.index("stream_chain("))
    wait = body.index("if (mode != 0) pdl_wait();")
    for later in ("xs[k] = x[k]", "cp.async.bulk", "fold_xor("):
        assert wait < body.index(later), later
