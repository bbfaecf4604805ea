"""`harness plan`: print the GPU memory plan of a model (harness.plan) without allocating.

    harness plan [--model NAME|PATH] [--ctx 2048] [--free BYTES | --vram-limit BYTES]
                 [--embd-placement auto|host|device] [--json]

Free memory: --free as given; otherwise the GPU's cudaMemGetInfo free bytes, capped at
--vram-limit (emulates a smaller card). The plan is the one the engine loads with
(harness.plan.engine_plan, the same --vram-limit / --embd-placement as `harness verify`).
Exit 0 when the plan fits, 1 when it does not.
"""
from __future__ import annotations

import json

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from . import models
from .config import EMBD_PLACEMENTS
from .errors import ConfigError, ModelError
from .plan import MiB, budget


def add_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="GPU memory plan of a model (weights, KV, state, margin)")
    p.add_argument("--model", default=models.DEFAULT_MODEL, help="registry name or .gguf path")
    p.add_argument("--ctx", type=int, default=2048, help="context size (KV cache positions)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--free", type=int, help="plan against this many free bytes (no GPU needed)")
    g.add_argument("--vram-limit", type=int, help="cap the GPU's free bytes (emulate a smaller card)")
    p.add_argument("--embd-placement", "--embd", dest="embd", choices=EMBD_PLACEMENTS,
                   default="auto",
                   help="token_embd placement (auto: host only when the weights do not fit)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def _free_bytes(args) -> int:
    if args.free is not None:
        if args.free < 0:
            raise ConfigError("--free must be >= 0")
        return args.free
    if args.vram_limit is not None and args.vram_limit < 0:
        raise ConfigError("--vram-limit must be >= 0")
    try:
        import cupy as cp
        free = int(cp.cuda.runtime.memGetInfo()[0])
    except Exception:  # no CuPy, no driver, no device
        if args.vram_limit is None:
            raise ConfigError("no GPU here: pass --free BYTES or --vram-limit BYTES") from None
        return args.vram_limit
    return budget(free, args.vram_limit)


def run_plan(args, console: Console) -> int:
    if args.ctx < 1:
        raise ConfigError("--ctx must be >= 1")
    free = _free_bytes(args)
    from .gguf_file import open_gguf
    from .plan import engine_plan
    from .progress import bytes_progress
    with bytes_progress(console, f"model {args.model}") as advance:
        model = models.resolve(args.model, progress=advance)
    plan = engine_plan(open_gguf(model.path), args.ctx, free, placement=args.embd)
    if args.json:
        print(json.dumps({"model": model.name, "n_ctx": args.ctx, **plan.as_dict()}, indent=1))
    else:
        t = Table(title=f"{escape(model.name)}, n_ctx {args.ctx}")
        t.add_column("on the device")
        t.add_column("MiB", justify="right")
        t.add_column("bytes", justify="right")
        for name, b in plan.items:
            t.add_row(name, f"{b / MiB:,.1f}", f"{b:,}")
        t.add_row("[b]total[/]", f"{plan.need / MiB:,.1f}", f"{plan.need:,}")
        t.add_row("free", f"{plan.free / MiB:,.1f}", f"{plan.free:,}")
        console.print(t)
        for name, b in plan.host:
            console.print(f"on the host: {name} ({b:,} B, one row sent per token)", markup=False)
        word = "margin left" if plan.fits else "SHORT by"
        console.print(f"{'fits' if plan.fits else 'does not fit'}: {word} {abs(plan.margin) / MiB:,.1f} MiB "
                      f"({abs(plan.margin):,} B) beyond the safety margin", markup=False)
    if not plan.fits:
        from .plan import require_fit
        try:
            require_fit(plan, model.name)
        except ModelError as e:
            console.print(f"[bold red]error:[/] {escape(str(e))}", soft_wrap=True)
        return 1
    return 0
