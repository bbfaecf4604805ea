"""`harness bench nodes`: per-node timing of one engine decode step (harness.bench_nodes);
`harness bench kernels`: per-kernel GEMV microbenchmark (harness.bench_kernels_cmd).

    harness bench nodes [--model NAME|PATH] [--ctx 512] [--method graph,eager] [--out out] [--no-chain]

Writes out/runs/<time>-<sha>/nodes.json and nodes.html (a new folder, never overwritten) and
prints the totals by kind, the slowest nodes and the step time. Needs an NVIDIA GPU + CuPy.
"""
from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from . import models, results
from .config import MIN_CTX
from .errors import ConfigError




def add_model_args(p) -> None:
    """--model and --ctx of a command that loads the engine on one model (`harness bench
    nodes`, python -m harness.graph_edges)."""
    p.add_argument("--model", default=models.DEFAULT_MODEL, help="registry name or .gguf path")
    p.add_argument("--ctx", type=int, default=512, help="context size (KV cache length)")


def require_engine(cmd: str) -> None:
    """ConfigError naming why when the engine backend cannot load here (no CuPy, no GPU) or one of
    its GGUF_HARNESS_* switches has a bad value (backends.engine.switches.check); called before
    the model is assembled. cmd: the command named in the message."""
    from backends import registry
    from backends.engine import switches
    switches.check()
    no_gpu = registry.available_backends().get("engine")
    if no_gpu:
        raise ConfigError(f"{cmd} needs the engine backend: {no_gpu}")


def resolve_model(name: str, console: Console):
    """models.resolve(name) with a byte-count bar on `console` while a registry model is
    assembled or a file hashed."""
    from .progress import bytes_progress
    with bytes_progress(console, f"model {name}") as advance:
        return models.resolve(name, progress=advance)


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: `bench nodes` times one engine decode step node "
                       "by node, `bench kernels` the engine's GEMV kernels shape by shape")
    bsub = p.add_subparsers(dest="bench_cmd", required=True)
    from .bench_kernels_cmd import add_kernels_parser
    add_kernels_parser(bsub)
    n = bsub.add_parser("nodes", help="per-node timing of one engine decode step (GPU)")
    add_model_args(n)
    n.add_argument("--method", default="graph,eager", help="timing methods: graph, eager or both")
    n.add_argument("--steps", type=int, default=64, help="chained replays timed for the step time")
    n.add_argument("--out", default="out", help="output root (runs go to OUT/runs/...)")
    n.add_argument("--prompt-ids", default=None, metavar="1,2,3",
                   help="the prompt as token ids instead of the standard prompt tokenised by llama.cpp "
                        "(then llama-cpp-python is not needed)")
    n.add_argument("--clean-samples", type=int, default=4, metavar="N",
                   help="when a step window ran slowed (power cap, thermal), time up to N more after a "
                        "cool-down; `harness ab` compares the unslowed ones (0: none; default 4)")
    n.add_argument("--no-chain", action="store_true",
                   help="skip the chain roofline (a streaming read of each node's bytes, chained "
                        "with PDL; needs the step's bytes again in free device memory)")


def run_bench(args, console: Console) -> int:
    if args.bench_cmd == "kernels":
        from .bench_kernels_cmd import run_kernels_cmd
        return run_kernels_cmd(args, console)
    if args.bench_cmd != "nodes":
        raise ConfigError(f"unknown bench command {args.bench_cmd!r}")
    from .bench_nodes import METHODS, run_nodes
    methods = tuple(m.strip() for m in args.method.split(",") if m.strip())
    if not methods or any(m not in METHODS for m in methods):
        raise ConfigError(f"--method {args.method!r}: expected a comma list of {', '.join(METHODS)}")
    if args.ctx < MIN_CTX or args.steps < 1:
        raise ConfigError(f"need --ctx >= {MIN_CTX} and --steps >= 1")
    if not 0 <= args.clean_samples <= 20:
        raise ConfigError(f"--clean-samples {args.clean_samples}: expected 0..20")
    from .layerdiff_cmd import parse_prompt_ids
    given = parse_prompt_ids(args.prompt_ids) if args.prompt_ids is not None else None
    require_engine("harness bench nodes")  # before the model is assembled and tokenised
    results.check_out_root(args.out)  # an --out file fails now, not after the benchmark
    from .gguf_file import open_gguf
    from .machine import machine_info
    from .main_job import check_block_count, model_meta, tokenize_prompt
    from .prompt import STANDARD_PROMPT, STANDARD_PROMPT_TOKENS
    model = resolve_model(args.model, console)
    info = open_gguf(model.path)
    check_block_count(info)  # the llama.cpp tokeniser aborts on a bad one
    if given is not None:  # checked against the vocabulary before 16 GB of weights go up
        n_vocab = info.tensor("token_embd.weight").ne[1]
        if max(given) >= n_vocab:
            raise ConfigError(f"--prompt-ids: token id {max(given)} is outside the model's vocabulary [0, {n_vocab})")
        ids = given
    else:
        tok, ids = tokenize_prompt(model, STANDARD_PROMPT, STANDARD_PROMPT_TOKENS)
        tok.close()
    res = run_nodes(model, args.ctx, list(ids), methods, steps=args.steps,
                    log=lambda m: console.print(m, markup=False), chain=not args.no_chain,
                    clean=args.clean_samples)
    result = {"schema": res["schema"], "created": datetime.now(timezone.utc).isoformat(),
              "machine": machine_info(), "model": model_meta(info) | {"name": model.name,
                                                                         "sha256": model.sha256},
              "nodes": res}
    run_dir = results.new_run_dir(Path(args.out) / "runs", result["machine"].get("git", {}).get("sha"))
    results.write_json(run_dir / "nodes.json", result)
    _print(console, res)
    from reports.nodes_html import render_nodes_report
    console.print(f"result: {run_dir / 'nodes.json'}", markup=False, soft_wrap=True)
    console.print(f"report: {render_nodes_report(result, run_dir / 'nodes.html')}", markup=False,
                  soft_wrap=True)
    return 0


def _print(console: Console, res: dict) -> None:
    for name, m in res["methods"].items():
        t = Table(title=f"{name}: sum {m['sum_us']:.1f} us, step {m['step_us']:.1f} us, "
                        f"gap {m['gap_us']:.1f} us")
        for col in ("node", "kind", "formats", "us", "GB/s", "% of sum"):
            t.add_column(col, justify="left" if col in ("node", "kind", "formats") else "right")
        for r in m["top"][:10]:
            t.add_row(escape(r["name"]), r["kind"], escape(r["fmt"]), f"{r['us']:.2f}",
                      f"{r['gb_s']:.0f}" if r["gb_s"] is not None else "-", f"{r['pct']:.1f}")
        console.print(t)
        console.print("by kind: " + ", ".join(f"{g['name']} {g['us']:.0f} us ({g['pct']:.0f} %)"
                                              for g in m["by_kind"]), markup=False)
