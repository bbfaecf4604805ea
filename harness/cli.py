"""Command line: `harness run | verify | models | report | synth | ab | bench-table | bench | plan | layerdiff | prewarm`.

Top-down map of the project:
  harness run     -> harness.run.verify_model (reference + backends, step by step)
                       -> harness.verify (greedy / teacher-forced loops), harness.metrics
                       -> backends.registry (llamacpp in a child process, oracle, engine)
                  -> harness.results (atomic JSON) -> reports.html (report.html)
  harness report --history -> reports.history (per-commit pages + trend plots over runs)
  harness models  -> harness.models (real models from PyPI chunk packages)
  harness synth   -> harness.synth_cmd -> harness.synth (synthetic GGUF files)
  harness ab      -> harness.ab_cmd -> harness.ab (A/B of two results) -> reports.ab_html
  harness bench-table -> harness.benchtable (llama-bench style pp/tg table of a result)
  harness bench   -> harness.bench_cmd -> harness.bench_nodes (engine step, node by node)
  harness plan    -> harness.plan_cmd -> harness.plan (GPU memory capacity plan)
  harness layerdiff -> harness.layerdiff_cmd -> harness.layerdiff / harness.engine_layerdiff
                     (oracle vs llama.cpp or the engine, node by node)
  harness prewarm -> harness.prewarm_cmd -> backends.engine.prewarm (kernel builds compiled in parallel)
Errors of the user's input (HarnessError) print one line and exit 2; no traceback.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from . import models
from .config import EMBD_PLACEMENTS
from .errors import ConfigError, HarnessError

# wide tables when output is a file or CI log (rich defaults to 80 columns there)
console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)


def _add_verify_args(p: argparse.ArgumentParser, *, standard: bool) -> None:
    p.add_argument("--model", default=models.DEFAULT_MODEL,
                   help="registry name or GGUF path")
    p.add_argument("--backends", default=None,
                   help="comma list (default: every backend available on this machine); "
                        "NAME@VARIANT runs a backend again under other settings, e.g. "
                        "llamacpp@no-flash-attn: the reference's agreement with itself "
                        "(variants: harness/variants.py)")
    p.add_argument("--reference", default="oracle", help="backend all others are compared to")
    p.add_argument("--n-predict", type=int, default=129, help="generated tokens")
    p.add_argument("--contexts", default="512,2048", help="context sizes, comma list")
    p.add_argument("--threads", type=int, default=2, help="CPU threads for llama.cpp")
    p.add_argument("--n-gpu-layers", type=int, default=None,
                   help="llama.cpp layers on the GPU (default: 99 with a GPU, else 0)")
    p.add_argument("--no-flash-attn", action="store_true", help="llama.cpp flash attention off")
    p.add_argument("--kv-type", default="f16", help="KV cache type: f16, f32, q8_0")
    p.add_argument("--vram-limit", type=int, default=None, metavar="BYTES",
                   help="engine: plan against min(free device memory, BYTES), emulating a "
                   "smaller card (default: the free memory)")
    p.add_argument("--embd-placement", choices=EMBD_PLACEMENTS, default="auto",
                   help="engine: token_embd in device memory, in mapped host memory (one row "
                   "per token read over PCIe), or auto (host only when the model does not fit)")
    p.add_argument("--no-teacher-forced", action="store_true", help="greedy runs only")
    p.add_argument("--out", default="out", help="output root (runs go to OUT/runs/...)")
    p.add_argument("--no-report", action="store_true", help="write result.json only")
    p.add_argument("--bench", action="store_true",
                   help="also time prefill/decode of every backend (default with a GPU)")
    p.add_argument("--no-bench", action="store_true", help="never time throughput")
    p.add_argument("--bench-decode", type=int, default=128, help="decode steps timed (128)")
    p.add_argument("--bench-reps", type=int, default=3, help="repetitions, median (3)")
    if not standard:
        p.add_argument("--prompt", default=None, help="prompt text instead of the standard one")
        p.add_argument("--prompt-tokens", type=int, default=None,
                       help="cut the prompt to this many tokens (standard prompt: 70)")
        p.add_argument("--draft", default=None, metavar="BACKEND",
                       help="one of --backends whose greedy continuations the reference "
                       "verifies in batched passes instead of n_predict sequential steps: same "
                       "ids, logits equal up to float64 summation order (harness.speculative); "
                       "a draft that fails leaves the reference sequential")


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: X)" suffix, except where the help already states its default."""

    def _get_help_string(self, action):
        text = action.help or ""
        return text if "(default" in text else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="harness", description=__doc__.split("\n")[0],
                                 formatter_class=DefaultsFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    fmt = DefaultsFormatter
    p = sub.add_parser("run", help="standard verification on the default model + report",
                       formatter_class=fmt)
    _add_verify_args(p, standard=True)
    p = sub.add_parser("verify", help="verification with every knob exposed", formatter_class=fmt)
    _add_verify_args(p, standard=False)
    p = sub.add_parser("models", help="list real models or print a model's path")
    p.add_argument("action", choices=["list", "path"], help="list the registry, or assemble "
                   "NAME once into the cache and print its path")
    p.add_argument("name", nargs="?", help="registry model name (see `harness models list`)")
    p = sub.add_parser("report", help="(re-)render report.html from a result.json, or the "
                       "per-commit history pages (--history)")
    p.add_argument("result", type=Path, nargs="?",
                   help="a result.json written by `harness run/verify`, or a nodes.json of "
                   "`harness bench nodes` (nodes.html beside it); .json or .json.gz")
    p.add_argument("--history", type=Path, nargs="?", const=Path("out"), metavar="OUT_ROOT",
                   help="read OUT_ROOT/runs/*/result.json (default out), write "
                   "OUT_ROOT/reports/<sha>/index.html and OUT_ROOT/reports/index.html")
    p = sub.add_parser("bench-table", help="llama-bench style pp/tg table of a result's bench "
                       "rows (harness.benchtable)", formatter_class=fmt)
    p.add_argument("result", type=Path,
                   help="a result.json (or .json.gz) with a bench section")
    p.add_argument("--format", choices=["md", "csv", "json"], default="md", help="output format")
    p.add_argument("--llama-bench", type=Path, action="append", metavar="FILE.json",
                   help="add the rows of a `llama-bench -o json|jsonl` file (repeatable)")
    from .synth_cmd import add_synth_parser
    add_synth_parser(sub)
    from .ab_cmd import add_ab_parser
    add_ab_parser(sub)
    from .bench_cmd import add_bench_parser
    add_bench_parser(sub)
    from .plan_cmd import add_plan_parser
    add_plan_parser(sub)
    from .layerdiff_cmd import add_layerdiff_parser
    add_layerdiff_parser(sub)
    from .prewarm_cmd import add_prewarm_parser
    add_prewarm_parser(sub)
    return ap


def _cmd_models(args) -> int:
    if args.action == "list":
        print(f"{'name':30} {'arch':8} {'bytes':>14}  {'status':10} extra")
        for m in models.REGISTRY.values():
            print(f"{m.name:30} {m.arch:8} {m.size:>14,}  {models.status(m):10} .[{m.extra}]")
        print(f"cache: {models.cache_dir()}")
        return 0
    if not args.name:
        raise HarnessError("usage: harness models path NAME")
    from .progress import bytes_progress
    with bytes_progress(console, f"model {args.name}") as advance:
        path = models.resolve(args.name, progress=advance).path
    print(path)
    return 0


def _schema(path: Path) -> str | None:
    """The "schema" of the JSON result at path, or None when it is not a gguf-harness result
    (results.read_json's ValueError / OSError propagate)."""
    from .results import read_json
    return read_json(path).get("schema")


def _cmd_report(args) -> int:
    if (args.result is None) == (args.history is None):
        raise ConfigError("harness report: give either RESULT.json or --history [OUT_ROOT]")
    if args.history is not None:
        from reports.history import build_history
        try:
            print(build_history(args.history, console).index)
        except OSError as e:  # OUT_ROOT/reports not writable, a run folder unreadable
            raise ConfigError(f"cannot write the history pages under {args.history}: {e}") \
                from None
        return 0
    from reports.html import render_report_from_json
    from reports.nodes_html import render_nodes_report_from_json
    from .ab_nodes import NODES_SCHEMA
    try:
        nodes = _schema(args.result) == NODES_SCHEMA  # a `bench nodes` result has its own page
        print(render_nodes_report_from_json(args.result) if nodes else render_report_from_json(args.result))
    except (OSError, ValueError) as e:  # missing/unreadable file, not JSON, not a result
        raise ConfigError(f"cannot render {args.result}: {e}") from None
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "models":
            return _cmd_models(args)
        if args.cmd == "report":
            return _cmd_report(args)
        if args.cmd == "bench-table":
            from .benchtable import run_bench_table
            return run_bench_table(args)
        if args.cmd == "ab":
            from .ab_cmd import run_ab
            return run_ab(args, console)
        if args.cmd == "synth":
            from .synth_cmd import run_synth
            return run_synth(args, console)
        if args.cmd == "bench":
            from .bench_cmd import run_bench
            return run_bench(args, console)
        if args.cmd == "plan":
            from .plan_cmd import run_plan
            return run_plan(args, console)
        if args.cmd == "layerdiff":
            from .layerdiff_cmd import run_layerdiff
            return run_layerdiff(args, console)
        if args.cmd == "prewarm":
            from .prewarm_cmd import run_prewarm
            return run_prewarm(args, console)
        from .main_job import run_job
        return run_job(args, console)
    except HarnessError as e:
        # escape: messages quote paths, names and model strings that may contain [markup]
        console.print(f"[bold red]error:[/] {escape(str(e))}", soft_wrap=True)
        return e.exit_code
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        return 130
    except BrokenPipeError:  # `harness ... | head`: the reader left; no traceback, the shell's code
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's exit-time flush would raise again
        return 141  # 128 + SIGPIPE, what a shell reports for a writer killed by the signal
    except OSError as e:  # the environment, not a verdict: e.g. a cache variable naming a file
        console.print(f"[bold red]error:[/] {escape(str(e))}", soft_wrap=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
