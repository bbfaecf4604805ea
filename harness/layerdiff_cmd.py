"""`harness layerdiff`: where the float64 oracle and llama.cpp (or the engine) part, node by
node (harness.layerdiff.layer_diff, harness.engine_layerdiff.engine_layer_diff).

    harness layerdiff [--model NAME|PATH] [--against llamacpp|engine] [--gpu]
                      [--act-round none|q8_1|engine|llamacpp|auto]
                      [--prompt TEXT | --prompt-ids 1,2,3] [--steps N] [--tol 1e-3]
                      [--ctx 256] [--threads 2] [--out out] [--format table|json]

Inputs. The prompt is one prefill call: by default the standard 70-token prompt
(harness.prompt) tokenised by the model's own tokenizer through llama.cpp, --prompt TEXT
tokenised whole, or --prompt-ids as given. --steps N adds N single-token decode calls fed
with the oracle's own greedy continuation: the argmax after the prompt, then after each fed
step (harness.verify.generate), computed in a first oracle pass with the diff's oracle
settings (KV rounding and act_round); that pass costs one more oracle load.
--against engine (qwen2 and qwen35 models): the engine is walked token by token, so the
steps are appended to the prompt and a node's `call` is its position; positions past the
prompt count as decode. The engine node -> oracle node maps: harness.engine_layerdiff.

--act-round: the oracle's rounding of matrix-product inputs (oracles.actquant); "auto":
  engine              the rounding of the engine's GEMV (GGUF_HARNESS_GEMV: q16 -> engine,
                      q8_1 -> q8_1 for qwen2, none for qwen35 whose oracle has no q8_1
                      model), as engine_layer_diff chooses it (auto_act_round);
  llamacpp (CPU)      "llamacpp" (ggml's CPU q8_0/q8_K/f16 activations) for qwen35, none for
                      qwen2 (its oracle has no model of it);
  llamacpp --gpu      "q8_1" (CUDA mmvq/mmq int8 activations) for qwen2, none for qwen35.
  Both llama.cpp roundings leave the inputs of F32 weights as they are, so on F32 models
  auto against llama.cpp compares unrounded float64 with llama.cpp's float32 graph.

Output. A table per (phase, node name): nodes compared, over tol, not compared (llama.cpp
has no node of that name or size; the qwen35 engine keeps no buffer for it: norms fused into
GEMVs, values inside its kernels), median and max rel_rms and where the max is (layer,
call); then LayerDiff.summary() (the first bad node). rel_rms^2 is the node's NMSE.
--format json prints the JSON document instead. Either way
OUT/runs/<UTC time>-<sha>/layerdiff.json is written atomically into a new folder
(harness.results), never over an earlier one.

Exit status: 0 when every compared node is within --tol, 1 when a node is over it (or no
node could be compared), 2 for bad input or an unavailable backend (one `error:` line).
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table
from rich.text import Text

from . import models, results
from .config import MAX_THREADS, MIN_CTX
from .errors import ConfigError, UnsupportedError
from .layerdiff import DEFAULT_TOL, LayerDiff, NodeDiff

SCHEMA = "gguf-harness/layerdiff/1"
AGAINST = ("llamacpp", "engine")
ACT_ROUNDS = ("none", "q8_1", "engine", "llamacpp", "auto")
# --act-round auto against llama.cpp: (gpu, arch) -> the oracle's rounding (module doc)
AUTO_LLAMACPP = {(False, "qwen35"): "llamacpp", (True, "qwen2"): "q8_1"}
# the roundings each oracle implements besides none (oracles.qwen2.Qwen2Oracle,
# oracles.qwen35.Qwen35Oracle check the same; tests/test_layerdiff_cli.py keeps them in step)
ORACLE_ACT_ROUNDS = {"qwen2": ("engine", "q8_1"), "qwen35": ("llamacpp", "engine")}
TABLE_HEAD = ("phase", "node", "compared", "bad", "not compared", "median rel_rms",
              "max rel_rms", "worst at")


def add_layerdiff_parser(sub) -> None:
    """Register `harness layerdiff` on the CLI's subparsers."""
    from .cli import DefaultsFormatter
    p = sub.add_parser("layerdiff", help="oracle vs llama.cpp (or the engine) node by node: "
                       "where the computations part",
                       formatter_class=DefaultsFormatter)
    p.add_argument("--model", default=models.DEFAULT_MODEL, help="registry name or .gguf path")
    p.add_argument("--against", choices=AGAINST, default="llamacpp",
                   help="what the float64 oracle is compared with")
    p.add_argument("--gpu", action="store_true", help="llama.cpp on CUDA as the protocol runs "
                   "it (all layers offloaded, flash attention, f16 KV; the oracle with an f16 "
                   "KV cache); needs a CUDA build of llama.cpp")
    p.add_argument("--act-round", choices=ACT_ROUNDS, default="auto",
                   help="the oracle's rounding of matrix-product inputs; auto: the engine's GEMV "
                   "rounding with --against engine, llamacpp for qwen35 on CPU, q8_1 for qwen2 "
                   "with --gpu, else none")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--prompt", default=None, help="prompt text (default: the standard "
                   "70-token prompt), tokenised by the model's tokenizer")
    g.add_argument("--prompt-ids", default=None, metavar="1,2,3",
                   help="prompt token ids, comma list (no tokenizer needed)")
    p.add_argument("--steps", type=int, default=0, help="single-token decode calls after the "
                   "prompt, fed with the oracle's greedy continuation")
    p.add_argument("--tol", type=float, default=DEFAULT_TOL,
                   help="a node is bad when its rel_rms exceeds this")
    p.add_argument("--ctx", type=int, default=256, help="context size (KV cache positions)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads for llama.cpp")
    p.add_argument("--out", default="out", help="output root (runs go to OUT/runs/...)")
    p.add_argument("--format", choices=["table", "json"], default="table",
                   help="stdout: the summary table, or the JSON document")


def parse_prompt_ids(spec: str) -> list[int]:
    """--prompt-ids "1, 2,3" -> [1, 2, 3]. Raises ConfigError when a field is not a
    non-negative integer or no id is given."""
    fields = [s.strip() for s in spec.split(",")]
    if fields and fields[-1] == "":
        fields.pop()  # a trailing comma
    try:
        ids = [int(s) for s in fields]
    except ValueError:
        raise ConfigError(f"--prompt-ids must be a comma list of token ids, got {spec!r}") from None
    if not ids:
        raise ConfigError("--prompt-ids gives no token id")
    if min(ids) < 0:
        raise ConfigError(f"--prompt-ids: token ids are >= 0, got {min(ids)}")
    return ids


def check_args(args) -> None:
    """Everything that can be checked before a model is touched. Raises ConfigError."""
    if args.steps < 0:
        raise ConfigError(f"--steps must be >= 0, got {args.steps}")
    if not math.isfinite(args.tol) or args.tol < 0:
        raise ConfigError(f"--tol must be a finite number >= 0, got {args.tol}")
    if args.ctx < MIN_CTX:
        raise ConfigError(f"--ctx must be >= {MIN_CTX}, got {args.ctx}")
    if not 1 <= args.threads <= MAX_THREADS:
        raise ConfigError(f"--threads must be in 1 .. {MAX_THREADS}, got {args.threads}")
    if args.prompt is not None and not args.prompt.strip():
        raise ConfigError("the prompt is empty")
    if args.prompt is not None:
        from .main_job import check_utf8
        check_utf8(args.prompt)
    if args.prompt_ids is not None:
        parse_prompt_ids(args.prompt_ids)
    if args.gpu and args.against == "engine":
        raise ConfigError("--gpu selects llama.cpp on CUDA; the engine always runs on the GPU "
                          "(drop --gpu with --against engine)")
    results.check_out_root(args.out)


def check_backends(args) -> dict:
    """ConfigError when what --against / --gpu / tokenising need is not here; returns
    llama.cpp's build info ({} when llama.cpp is not used)."""
    from backends.registry import available_backends
    avail = available_backends()
    if args.against == "engine":  # a bad switch or a timing-only build before the oracle runs
        from backends.engine import switches
        switches.check_for("layerdiff")
    if args.against == "engine" and avail["engine"]:
        raise ConfigError(f"--against engine needs the engine backend (CuPy and an NVIDIA "
                          f"GPU): {avail['engine']}")
    if (args.against == "llamacpp" or args.prompt_ids is None) and avail["llamacpp"]:
        why = "--against llamacpp" if args.against == "llamacpp" else \
            "tokenising the prompt (pass --prompt-ids instead)"
        raise ConfigError(f"{why} needs llama.cpp: {avail['llamacpp']}")
    if args.against != "llamacpp":
        return {}
    from backends.llamacpp.info import build_info
    info = build_info()
    if args.gpu and not info["gpu_offload"]:
        raise ConfigError("--gpu needs llama-cpp-python built with CUDA; this build has no GPU "
                          "offload (README: make setup LLAMA_CMAKE_ARGS=\"-DGGML_CUDA=on ...\")")
    return info


def resolve_act_round(requested: str, against: str, gpu: bool, arch: str) -> str | None:
    """The oracle's act_round for --act-round `requested` ("none" -> None; "auto": module
    doc). Raises ConfigError when the oracle of `arch` does not implement that rounding."""
    if requested == "none":
        return None
    if requested != "auto":
        known = ORACLE_ACT_ROUNDS.get(arch, ())
        if requested not in known:
            raise ConfigError(f"--act-round {requested}: the {arch} oracle implements "
                              f"{', '.join(('none',) + known)}")
        return requested
    if against == "engine":
        from backends.engine import ops as eops

        from .engine_layerdiff import auto_act_round
        return auto_act_round(arch, eops.GEMV_IMPL)
    return AUTO_LLAMACPP.get((gpu, arch))


def greedy_steps(model, prompt: list[int], n: int, n_ctx: int, kv_round: str | None,
                 act_round: str | None) -> list[int]:
    """The oracle's greedy continuation: n ids (argmax of float64 logits after the prompt,
    then after each fed id; harness.verify.generate), with the diff's oracle settings.
    The oracle is freed before returning (a second one is loaded by the diff)."""
    if n == 0:
        return []
    from backends.oracle import OracleBackend

    from .config import RunConfig
    from .verify import generate
    oracle = OracleBackend(kv_round=kv_round, act_round=act_round)
    oracle.load(model, RunConfig(n_ctx=n_ctx))
    try:
        ids, _, _ = generate(oracle, prompt, n)
    finally:
        oracle.close()
    return ids


@dataclass(frozen=True)
class Settings:
    """What one layerdiff run did (recorded in the JSON)."""

    against: str
    gpu: bool
    act_round: str          # as asked on the command line
    act_round_used: str | None
    tol: float
    n_ctx: int
    n_threads: int
    steps: int


def _phase(d: NodeDiff, n_prompt: int, against: str) -> str:
    if against == "engine":
        return "prefill" if d.call < n_prompt else "decode"
    return "prefill" if d.call == 0 else "decode"


def _rank(x: float) -> float:
    return math.inf if math.isnan(x) else x  # a NaN node is the worst one


def node_rows(rep: LayerDiff, n_prompt: int, against: str) -> list[dict]:
    """One row per (phase, node name), in the order the names first occur (graph order):
    {phase, name, compared, bad, not_compared, median_rel_rms, max_rel_rms, worst_layer,
    worst_call} (rel_rms: ||out - ref|| / ||ref||; None when nothing of that name was
    compared; worst_layer -1 = the head). n_prompt: prompt tokens (phase of engine calls)."""
    groups: dict[tuple[str, str], list[NodeDiff]] = {}
    for d in rep.nodes:
        groups.setdefault((_phase(d, n_prompt, against), d.name), []).append(d)
    rows = []
    for (phase, name), ds in sorted(groups.items(), key=lambda kv: kv[0][0] != "prefill"):
        done = [d for d in ds if d.status in ("ok", "bad")]
        worst = max(done, key=lambda d: _rank(d.rel_rms), default=None)
        rows.append({
            "phase": phase, "name": name, "compared": len(done),
            "bad": sum(d.status == "bad" for d in done), "not_compared": len(ds) - len(done),
            "median_rel_rms": float(np.median([d.rel_rms for d in done])) if done else None,
            "max_rel_rms": worst.rel_rms if worst else None,
            "worst_layer": worst.layer if worst else None,
            "worst_call": worst.call if worst else None})
    return rows


def exit_code(rep: LayerDiff) -> int:
    """0 when every compared node is within tol, 1 when one is over it or none was compared."""
    return 1 if rep.first_bad is not None or not rep.compared else 0


def _sci(x: float | None) -> str:
    return "-" if x is None else f"{x:.2e}"


def _where(r: dict) -> str:
    if r["worst_layer"] is None:
        return "-"
    layer = "head" if r["worst_layer"] < 0 else f"layer {r['worst_layer']}"
    return f"{layer}, call {r['worst_call']}"


def print_table(doc: dict, out: Console) -> None:
    """The per-node-name table and the summary lines on `out`; every cell is a Text (no
    markup: names and the model's name are printed as they are)."""
    s, m = doc["settings"], doc["model"]
    vs = "the engine" if s["against"] == "engine" else \
        f"llama.cpp {'CUDA' if s['gpu'] else 'CPU'}"
    t = Table(title=Text(f"{m['name']}: float64 oracle (act_round {s['act_round_used'] or 'none'}) vs "
                         f"{vs}, {len(doc['prompt']['ids'])} prompt tokens + {s['steps']} "
                         f"steps, tol {s['tol']:g}"), title_justify="left")
    for h in TABLE_HEAD:
        t.add_column(h, justify="left" if h in ("phase", "node", "worst at") else "right")
    for r in doc["by_node"]:
        style = "bold red" if r["bad"] else ""
        t.add_row(*[Text(c, style=style) for c in (
            r["phase"], r["name"], str(r["compared"]), str(r["bad"]), str(r["not_compared"]),
            _sci(r["median_rel_rms"]), _sci(r["max_rel_rms"]), _where(r))])
    out.print(t)
    ld = doc["layerdiff"]
    missing = sorted({n["llama_name"].rsplit("-", 1)[0] if n["layer"] >= 0 else n["llama_name"]
                      for n in ld["nodes"] if n["status"] == "missing"})
    if missing:
        why = "the engine keeps no buffer for" if s["against"] == "engine" else \
            "no node of that name"
        out.print(Text(f"not compared, {why}: " + ", ".join(missing)))
    size = list(dict.fromkeys(f"{n['llama_name']} (call {n['call']})"
                              for n in ld["nodes"] if n["status"] == "size"))
    if size:
        out.print(Text("not compared, element counts differ: " + ", ".join(size)))
    if not any(n["status"] in ("ok", "bad") for n in ld["nodes"]):
        out.print(Text("no node could be compared", style="bold red"))
    out.print(Text(ld["summary"], style="bold red" if doc["exit_code"] else "bold green"))


def prompt_ids(args, model, n_vocab: int) -> tuple[str, str | None, list[int]]:
    """(source, text, ids) of the prompt: "ids" (--prompt-ids, text None), "text" (--prompt,
    tokenised whole) or "standard" (the standard prompt cut to its 70 tokens), tokenised by
    the model's tokenizer through llama.cpp in a child process (harness.main_job).
    Raises ConfigError (an id outside [0, n_vocab), a prompt that tokenises to nothing)."""
    from .errors import HarnessError
    from .main_job import tokenize_prompt
    from .prompt import STANDARD_PROMPT, STANDARD_PROMPT_TOKENS
    if args.prompt_ids is not None:
        source, text, ids = "ids", None, parse_prompt_ids(args.prompt_ids)
    else:
        source, text = ("text", args.prompt) if args.prompt is not None else \
            ("standard", STANDARD_PROMPT)
        tok, ids = tokenize_prompt(model, text,
                                   STANDARD_PROMPT_TOKENS if source == "standard" else None)
        try:
            tok.close()
        except HarnessError:  # a dead tokenizer child: nothing left to free
            pass
        ids = [int(i) for i in ids]
    if max(ids) >= n_vocab:
        raise ConfigError(f"token id {max(ids)} is outside the model's vocabulary "
                          f"(n_vocab {n_vocab})")
    return source, text, ids


def run_layerdiff(args, console: Console) -> int:
    """The `harness layerdiff` command; returns the exit code (module doc). Raises
    ConfigError / ModelError / UnsupportedError (exit 2) for bad input."""
    check_args(args)
    llama_info = check_backends(args)
    from .gguf_file import open_gguf
    from .machine import machine_info
    from .main_job import check_block_count, model_meta
    from .progress import bytes_progress
    with bytes_progress(console, f"model {args.model}") as advance:
        model = models.resolve(args.model, progress=advance)
    info = open_gguf(model.path)
    check_block_count(info)  # llama.cpp (tokeniser, --against llamacpp) aborts on a bad one
    from backends.oracle import _oracle_class
    _oracle_class(info.arch)  # UnsupportedError now for an architecture the oracle lacks
    from .engine_layerdiff import ARCHS as ENGINE_ARCHS
    if args.against == "engine" and info.arch not in ENGINE_ARCHS:
        raise UnsupportedError(f"--against engine maps {' and '.join(ENGINE_ARCHS)} nodes, "
                               f"not {info.arch}")
    act = resolve_act_round(args.act_round, args.against, args.gpu, info.arch)
    source, text, prompt = prompt_ids(args, model, int(info.tensor("token_embd.weight").ne[-1]))
    if len(prompt) + args.steps > args.ctx:
        raise ConfigError(f"{len(prompt)} prompt tokens + {args.steps} steps do not fit "
                          f"--ctx {args.ctx}")
    settings = Settings(args.against, args.gpu, args.act_round, act, args.tol, args.ctx,
                        args.threads, args.steps)
    console.print(Text(f"model {model.name} ({info.arch}, {model.size:,} B); {len(prompt)} "
                       f"prompt tokens ({source}); oracle act_round {act or 'none'}"))
    kv_round = "f16" if args.gpu or args.against == "engine" else None
    t0 = time.perf_counter()
    step_ids = greedy_steps(model, prompt, args.steps, args.ctx, kv_round, act)
    t1 = time.perf_counter()
    if step_ids:
        console.print(Text(f"steps: the oracle's greedy ids {step_ids} ({t1 - t0:.1f} s)"))
    if args.against == "engine":
        from .engine_layerdiff import engine_layer_diff
        console.print(Text(f"diffing the engine against the oracle over {len(prompt) + len(step_ids)} "
                           "positions ..."))
        rep = engine_layer_diff(model.path, prompt + step_ids, tol=args.tol, n_ctx=args.ctx,
                                act_round=act)
    else:
        from .layerdiff import layer_diff
        console.print(Text(f"diffing llama.cpp ({'CUDA' if args.gpu else 'CPU'}) against the "
                           f"oracle: 1 prefill + {len(step_ids)} steps ..."))
        rep = layer_diff(model.path, prompt, step_ids, tol=args.tol, n_ctx=args.ctx,
                         n_threads=args.threads, act_round=act, gpu=args.gpu)
    t2 = time.perf_counter()
    code = exit_code(rep)
    doc = {"schema": SCHEMA, "created": datetime.now(UTC).isoformat(),
           "machine": machine_info(),
           "model": model_meta(info) | model.to_json(),
           "settings": asdict(settings),
           "llamacpp": llama_info or None,
           "prompt": {"source": source, "text": text, "ids": prompt},
           "step_ids": step_ids,
           "seconds": {"greedy_steps": t1 - t0, "diff": t2 - t1},
           "exit_code": code,
           "by_node": node_rows(rep, len(prompt), args.against),
           "layerdiff": rep.to_json()}
    run_dir = results.new_run_dir(Path(args.out) / "runs",
                                  doc["machine"].get("git", {}).get("sha"))
    path = run_dir / "layerdiff.json"
    results.write_json(path, doc)
    if args.format == "json":
        sys.stdout.write(path.read_text() + "\n")  # the file's text: NaN written as "nan"
    else:
        width = None if sys.stdout.isatty() else 160  # wide tables in files and CI logs
        print_table(doc, Console(file=sys.stdout, width=width))
    console.print(Text(f"result: {path}"), soft_wrap=True)
    return code
