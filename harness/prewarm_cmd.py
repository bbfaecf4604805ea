"""`harness prewarm`: compile the engine's kernel builds ahead of use, several at once.

    harness prewarm [--jobs N] [--only TEXT] [--list]

The engine compiles each kernel build (a source and its defines) with NVRTC on first use, one
after another, and CuPy keeps the result in its on-disk cache. On a fresh machine, after a
kernel edit, or under a new GGUF_HARNESS_* switch set, the first `harness run` or `harness
bench nodes` on the 27B therefore spends minutes compiling (~150 s a run measured on the H200,
session 25, against ~40 s with the builds cached). This compiles the builds the engine selects
under the current environment (backends.engine.prewarm.builds) in parallel processes, so the
wall time is about the slowest build's. --list prints them without a GPU.

Exit status: 0 when every build compiled, 1 when one failed (its line names the error), 2 for a
bad engine switch value or no GPU.
"""
from __future__ import annotations

import os

from rich.console import Console

from .errors import ConfigError


def add_prewarm_parser(sub) -> None:
    p = sub.add_parser("prewarm", help="compile the engine's kernel builds in parallel (GPU), "
                       "so a first run does not compile them one by one")
    p.add_argument("--jobs", type=int, default=None,
                   help="compiles at once (default: one per build, at most the CPU count)")
    p.add_argument("--only", default="", help="only builds whose source name contains this text")
    p.add_argument("--list", action="store_true",
                   help="print the builds and exit (no GPU needed): the fixed ones and the gemv_kq.cu "
                   "builds the current GGUF_HARNESS_* switches select")


def run_prewarm(args, console: Console) -> int:
    from backends.engine import prewarm, switches
    from .gpu import require_cupy
    switches.check()  # a bad GGUF_HARNESS_* value: one error line, exit 2, before any compile
    if args.jobs is not None and args.jobs < 1:
        raise ConfigError(f"--jobs {args.jobs}: expected at least 1")
    todo = [b for b in prewarm.builds() if args.only in b[0]]
    if not todo:
        raise ConfigError(f"--only {args.only!r}: no build's source name contains it")
    if args.list:
        for build in todo:  # stdout, one build per line (progress and errors: stderr)
            print(prewarm.label(build))
        return 0
    require_cupy()  # UnsupportedError (exit 2): CuPy compiles for the device's architecture
    jobs = args.jobs or min(len(todo), os.cpu_count() or 1)
    console.print(f"compiling {len(todo)} engine builds, {jobs} at once "
                  "(cached afterwards; the first line can take a minute or two)", markup=False)
    return 1 if prewarm.compile_builds(todo, jobs, lambda m: console.print(m, markup=False, soft_wrap=True)) else 0
