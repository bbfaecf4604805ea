"""`harness bench kernels`: the engine's GEMV kernels shape by shape (harness.bench_kernels).

    harness bench kernels [--shapes NAME|PATTERN|[2x]ROWSxK:FMT,...] [--formats Q6_K,...]
                          [--modes cold_b2b,cold_single,hot] [--min-samples 10]
                          [--min-time 0.05] [--max-noise 0.03] [--max-time 3] [--out out]
                          [--ggml]

Writes out/runs/<time>-<sha>/kernels.json and kernels.html (a new folder), prints a table.
Exit status: 0 when every row is "ok" or "unsupported" (a type the engine has no kernel
for), 1 when a kernel failed its oracle check or a shape raised an error, 2 for bad
arguments or no GPU. The --ggml column (harness.bench_kernels_ggml) never changes it.
"""
from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from . import results
from .errors import ConfigError


def add_kernels_parser(bsub) -> None:
    from .cli import DefaultsFormatter
    from .bench_kernels import MODES
    from .bench_stats import StopRule
    from .kernel_shapes import COLD_BYTES, MAX_COPIES
    d = StopRule()
    k = bsub.add_parser("kernels", help="per-kernel GEMV microbenchmark of the engine (GPU)",
                        formatter_class=DefaultsFormatter)
    k.add_argument("--shapes", default=None, help="comma list of table names, fnmatch patterns "
                   "or [2x]ROWSxK:FMT specs (default: the whole table, harness.kernel_shapes)")
    k.add_argument("--formats", default=None, help="keep only these GGML types, comma list")
    k.add_argument("--modes", default=",".join(MODES), help="timing modes, comma list")
    k.add_argument("--min-samples", type=int, default=d.min_samples, help="samples before a stop")
    k.add_argument("--min-time", type=float, default=d.min_time_s, help="measured s before a stop")
    k.add_argument("--max-noise", type=float, default=d.max_noise, help="(p80-p20)/median to stop at")
    k.add_argument("--max-time", type=float, default=d.max_time_s, help="wall s cap per measurement")
    k.add_argument("--cold-bytes", type=int, default=COLD_BYTES,
                   help="weight bytes of the cold back-to-back graph (R copies)")
    k.add_argument("--max-copies", type=int, default=MAX_COPIES, help="cap on R")
    k.add_argument("--seed", type=int, default=0, help="seed of the random blocks and x")
    k.add_argument("--out", default="out", help="output root (runs go to OUT/runs/...)")
    k.add_argument("--ggml", action="store_true", help="also time llama.cpp's own CUDA kernel "
                   "per shape through libggml (harness.ggml_gemv; needs llama-cpp-python "
                   "built with CUDA, else recorded as unavailable)")


def config_from_args(args):
    """(shapes, KernelsConfig) from the parsed flags; ConfigError on bad values."""
    from .bench_kernels import KernelsConfig
    from .bench_stats import StopRule
    from .errors import ConfigError
    from .kernel_shapes import select
    if args.seed < 0:  # numpy's default_rng refuses it, once per shape on the GPU machine
        raise ConfigError(f"--seed {args.seed}: expected a non-negative integer")
    shapes = select(args.shapes, args.formats)
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    rule = StopRule(min_samples=args.min_samples, min_time_s=args.min_time,
                    max_noise=args.max_noise, max_time_s=args.max_time)
    return shapes, KernelsConfig(modes=modes, rule=rule, cold_bytes=args.cold_bytes,
                                 max_copies=args.max_copies, seed=args.seed)


def run_kernels_cmd(args, console: Console) -> int:
    shapes, cfg = config_from_args(args)  # bad arguments fail before the GPU is touched
    from backends.engine import module, switches
    switches.check()  # a bad GGUF_HARNESS_* value once, not as an error row per shape
    if module.diag_defines():  # results record it (machine.switches); say it where the figures are read
        console.print(f"GGUF_HARNESS_DIAG={module.DIAG}: a timing-only build (nowait: the back-to-back copies "
                      f"overlap, the oracle check runs on one launch and passes; nostage: the kernels fail "
                      f"their oracle check and are not timed)", markup=False)
    from . import gpu
    from .bench_kernels import run_kernels
    from .errors import UnsupportedError
    from .machine import machine_info
    from .progress import Progress
    try:
        gpu.require_cupy()
    except UnsupportedError as e:
        raise ConfigError(f"harness bench kernels needs a GPU: {e}") from None
    results.check_out_root(args.out)  # an --out file fails now, not after the benchmark
    with Progress(console) as prog:
        advance = prog.task("kernels", len(shapes))
        res = run_kernels(shapes, cfg, log=lambda m: console.print(m, markup=False), advance=advance,
                          **({"ggml": True} if getattr(args, "ggml", False) else {}))
    result = dict(res, created=datetime.now(timezone.utc).isoformat(), machine=machine_info())
    run_dir = results.new_run_dir(Path(args.out) / "runs", result["machine"].get("git", {}).get("sha"))
    results.write_json(run_dir / "kernels.json", result)
    console.print(table(result))
    from reports.kernels_html import render_kernels_report
    console.print(f"result: {run_dir / 'kernels.json'}", markup=False, soft_wrap=True)
    console.print(f"report: {render_kernels_report(result, run_dir / 'kernels.html')}",
                  markup=False, soft_wrap=True)
    return 0 if all(r["status"] in ("ok", "unsupported") for r in result["rows"]) else 1


def _f(v, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def table(result: dict) -> Table:
    """Console table of a kernels result: per shape, status and per mode us / GB/s / % of
    copy bandwidth / % of roofline (names escaped: specs may come from the command line)."""
    modes = result["settings"]["modes"]
    copy = result["device"]["copy"]["gb_s"]
    t = Table(title=f"GEMV kernels (copy bandwidth {copy:.0f} GB/s)")
    for col in ("shape", "[rows x K] format", "status"):
        t.add_column(col)
    for m in modes:
        for col in ("us", "GB/s", "% copy", "% roof"):
            t.add_column(f"{m} {col}", justify="right")
    ggml = any("ggml" in r for r in result["rows"])
    if ggml:
        from .bench_kernels_ggml import TABLE_COLUMNS, table_cells
        for col in TABLE_COLUMNS:
            t.add_column(col, justify="right")
    for r in result["rows"]:
        cells = [escape(r["name"]), escape(r["label"]), escape(r["status"])]
        for m in modes:
            f = r.get("modes", {}).get(m)
            cells += ([_f(f["kernel"]["us"], 2), _f(f["gb_s"], 0), _f(f["pct_copy"]),
                       _f(f["pct_roofline"])] if f else ["-"] * 4)
        if ggml:
            cells += [escape(c) for c in table_cells(r.get("ggml"))]
        t.add_row(*cells)
    return t
