"""`harness synth`: write a synthetic GGUF model from a preset (harness.synth).

    harness synth --preset qwen35-27b --quant ud-q4_k_m --out out/q35-27b.gguf [--seed N]
    harness synth --preset qwen35-tiny --quant q4_k_m --via-llama-quantize --out t.gguf
    harness synth --preset qwen35-27b-4l --quant q4_k_m --out out/q35-27b-4l.gguf  # 27B widths, 4 layers
    harness synth --preset qwen35-27b --quant ud-q4_k_m --out q.gguf --jobs 1  # one process
    harness synth --list

qwen35 presets take any mix of harness.synth.qwen35_presets.QUANTS (written directly as
random blocks), or with --via-llama-quantize an F32 model quantised by llama.cpp's own
quantiser to that file type (harness.synth.llama_quantize.FTYPES). qwen2 presets have fixed
mixes. --jobs N worker processes write the tensor data (default: the usable CPUs,
os.sched_getaffinity); the file is the same bytes for every N (harness.synth.parallel_write).
Prints size, decode bytes (every tensor but MTP blocks), write time, MB/s and peak RSS.
"""
from __future__ import annotations

import contextlib
import os
import resource
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from .errors import ConfigError


def add_synth_parser(sub) -> None:
    p = sub.add_parser("synth", help="write a synthetic GGUF model from a preset")
    p.add_argument("--preset", help="preset name (see --list)")
    p.add_argument("--quant", default=None, help="quant mix of a qwen35 preset (default f32)")
    p.add_argument("--out", type=Path, help="output .gguf path")
    p.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    p.add_argument("--method", choices=["direct", "quantize"], default="direct",
                   help="block types as random blocks (direct) or quantised normals")
    p.add_argument("--via-llama-quantize", action="store_true",
                   help="write F32, then quantise with llama.cpp to the --quant file type")
    p.add_argument("--list", action="store_true", help="list presets and mixes, then exit")
    p.add_argument("--force", action="store_true", help="overwrite an existing --out file")
    p.add_argument("--jobs", type=int, default=None,
                   help="worker processes writing the tensors (default: usable CPUs); "
                        "same bytes for any value")


def usable_cpus() -> int:
    """CPUs this process may run on (os.sched_getaffinity; os.cpu_count where missing)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _list(console: Console) -> int:
    from .synth.llama_quantize import FTYPES
    from .synth.presets import PRESETS
    from .synth.qwen35_presets import QUANTS, SHAPES
    # stdout (the answer, for `| grep`), unlike progress and errors on the stderr console
    print(f"qwen35 presets: {', '.join(SHAPES)}; mixes: {', '.join(QUANTS)}")
    print(f"  --via-llama-quantize file types: {', '.join(FTYPES)}")
    print(f"qwen2 presets (fixed mixes): {', '.join(PRESETS)}")
    return 0


def _bar(console: Console):
    """(context manager, progress callback) showing bytes written."""
    if not console.is_terminal:  # a transient bar shows nothing there but leaves an empty line
        return contextlib.nullcontext(), lambda done, total, name: None
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )
    bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                   TimeElapsedColumn(), console=console, transient=True)
    tid = bar.add_task("writing", total=None)

    def update(done: int, total: int, name: str) -> None:
        bar.update(tid, completed=done, total=total, description=f"writing {name[:28]:28}")
    return bar, update


def _write(args, console: Console) -> Path:
    from .synth.presets import write_preset
    from .synth.qwen35_presets import SHAPES, write_qwen35_preset
    if args.preset not in SHAPES:
        if args.via_llama_quantize or args.method != "direct":
            raise ConfigError("--via-llama-quantize and --method apply to qwen35 presets only")
        bar, update = _bar(console)
        with bar:
            return write_preset(args.preset, args.out, seed=args.seed, quant=args.quant,
                                jobs=args.jobs, progress=update)
    bar, update = _bar(console)
    with bar:
        if not args.via_llama_quantize:
            return write_qwen35_preset(args.preset, args.out, args.quant or "f32", seed=args.seed,
                                       method=args.method, progress=update, jobs=args.jobs)
        from .synth.llama_quantize import llama_quantize
        f32 = args.out.with_name(args.out.name + ".f32.gguf")
        write_qwen35_preset(args.preset, f32, "f32", seed=args.seed, progress=update,
                            jobs=args.jobs)
    try:
        return llama_quantize(f32, args.out, args.quant or "q8_0", n_threads=args.jobs)
    finally:
        f32.unlink(missing_ok=True)


def run_synth(args, console: Console) -> int:
    """Handler of `harness synth`; HarnessError for bad arguments (the CLI prints it)."""
    if args.list:
        return _list(console)
    if not args.preset or not args.out:
        raise ConfigError("harness synth needs --preset and --out (or --list)")
    if args.out.is_dir():
        raise ConfigError(f"--out {args.out} is a folder; give a file path")
    if args.out.exists() and not args.force:
        raise ConfigError(f"--out {args.out} exists; use --force to overwrite it")
    if not args.out.parent.is_dir():
        raise ConfigError(f"the folder of --out does not exist: {args.out.parent}")
    if args.jobs is None:
        args.jobs = usable_cpus()
    if args.jobs < 1:
        raise ConfigError(f"--jobs must be >= 1, got {args.jobs}")
    if not 0 <= args.seed < 2**64:  # stored as the uint64 harness.synth.seed
        raise ConfigError(f"--seed must be in 0 .. 2^64-1, got {args.seed}")
    t0 = time.perf_counter()
    path = _write(args, console)
    seconds = time.perf_counter() - t0
    from .gguf_file import open_gguf
    info = open_gguf(path)
    n_all = int(info.arch_key("block_count"))
    n_layer = n_all - int(info.get(f"{info.arch}.nextn_predict_layers", 0))
    mtp = tuple(f"blk.{il}." for il in range(n_layer, n_all))
    decode = sum(t.nbytes for n, t in info.tensors.items() if not n.startswith(mtp))
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    worker_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # largest child
    workers = f", largest worker {worker_mib:,.0f} MiB" if args.jobs > 1 else ""
    console.print(f"wrote {escape(str(path))} ({info.arch}, {len(info.tensors)} tensors): "
                  f"{info.file_size:,} B, decode bytes {decode:,}, {seconds:.1f} s "
                  f"({info.file_size / seconds / 1e6:,.0f} MB/s, --jobs {args.jobs}), "
                  f"peak RSS {rss_mib:,.0f} MiB{workers}")
    return 0
