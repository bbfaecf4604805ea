"""`harness run` / `harness verify`: resolve the model, tokenise, verify, write JSON + report."""
from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from . import models, results, variants
from .config import MAX_THREADS, MIN_CTX, ProtocolConfig, RunConfig
from .errors import ConfigError, HarnessError, ModelError
from .gguf_file import open_gguf
from .machine import git_info, gpu_info
from .progress import Progress, bytes_progress
from .prompt import STANDARD_PROMPT, STANDARD_PROMPT_TOKENS
from .run import verify_model


def model_meta(info) -> dict:
    """Architecture facts and the tensor-type histogram of the GGUF (for the report)."""
    types: dict[str, int] = {}
    for t in info.tensors.values():
        types[t.type_name] = types.get(t.type_name, 0) + 1
    arch = info.arch
    keys = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
            "attention.head_count_kv", "context_length")
    return {"arch": arch, "gguf_version": info.version, "tensor_types": types,
            "n_tensors": len(info.tensors), "general_name": info.get("general.name"),
            "description": info.get("general.description"),
            **{k: info.get(f"{arch}.{k}") for k in keys}}


def _choose_backends(spec: str | None, reference: str, bench: bool = False) -> tuple[list[str], dict]:
    """(backends to run, reference first if it was not listed; unavailable ones with why).
    A reference alone is allowed only with bench (a throughput run of one backend, e.g.
    llama.cpp on a model too large for the float64 oracle). Raises ConfigError."""
    from backends.registry import available_backends
    avail = available_backends()
    if spec:
        names = list(dict.fromkeys(s.strip() for s in spec.split(",") if s.strip()))  # once each
        unknown = [n for n in names if variants.base(n) not in avail]
        if unknown:
            raise ConfigError(f"unknown backend(s) {unknown}; known: {sorted(avail)} "
                              f"(a variant: NAME@{'|'.join(sorted(variants.VARIANTS))})")
        missing = {n: avail[variants.base(n)] for n in names if avail[variants.base(n)]}
        if missing:
            raise ConfigError(f"backend(s) not available here: {missing}")
        for n in names:
            variants.overrides(n)  # a contradictory variant before the model is assembled
    else:
        names = [n for n, why in avail.items() if why is None]
    ref_base = variants.base(reference)
    if ref_base not in avail:
        raise ConfigError(f"unknown reference backend {reference!r}; known: {sorted(avail)}")
    if avail[ref_base]:
        raise ConfigError(f"reference backend {reference!r} unavailable: {avail[ref_base]}")
    variants.overrides(reference)
    if reference not in names:
        names = [reference] + names
    if len(names) < 2 and not bench:
        raise ConfigError(f"nothing to compare: give at least one backend besides the reference "
                          f"{reference!r} (or --bench for a throughput run of it alone)")
    if "engine" in {variants.base(n) for n in names}:  # a bad GGUF_HARNESS_* switch, or a timing-only build, before the model is assembled
        from backends.engine import switches
        switches.check_for("run / verify")
    return names, {n: why for n, why in avail.items() if why}


def _contexts(spec: str) -> tuple[int, ...]:
    """--contexts as sorted unique ints; ConfigError when empty or not integers."""
    try:
        values = sorted({int(x) for x in spec.split(",") if x.strip()})
    except ValueError:
        raise ConfigError(f"--contexts must be a comma list of integers, got {spec!r}") from None
    if not values:
        raise ConfigError(f"--contexts gives no context size: {spec!r}")
    if values[0] < MIN_CTX:  # RunConfig's bound, checked here before any model is resolved
        raise ConfigError(f"--contexts must be >= {MIN_CTX}, got {values[0]}")
    return tuple(values)


def check_utf8(prompt: str) -> None:
    """ConfigError when --prompt held bytes that are not UTF-8 (argv gives them as surrogates,
    which the tokeniser child cannot encode)."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError("the prompt is not valid UTF-8") from None


def _check_args(args) -> tuple[tuple[int, ...], str, int | None]:
    """Everything that can be checked before any model is touched: (contexts, prompt text,
    prompt token count or None). Raises ConfigError."""
    if args.n_predict <= 0:
        raise ConfigError(f"--n-predict must be > 0, got {args.n_predict}")
    if not 1 <= args.threads <= MAX_THREADS:
        raise ConfigError(f"--threads must be in 1 .. {MAX_THREADS}, got {args.threads}")
    for flag in ("bench_decode", "bench_reps"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    limit = getattr(args, "vram_limit", None)
    if limit is not None and limit < 1:
        raise ConfigError(f"--vram-limit must be >= 1 byte, got {limit}")
    prompt = getattr(args, "prompt", None)
    if prompt is not None and not prompt.strip():
        raise ConfigError("the prompt is empty")
    if prompt is not None:
        check_utf8(prompt)
    n_tok = getattr(args, "prompt_tokens", None)
    if n_tok is not None and n_tok < 1:
        raise ConfigError(f"--prompt-tokens must be >= 1, got {n_tok}")
    if prompt is None and n_tok is None:
        n_tok = STANDARD_PROMPT_TOKENS
    contexts = _contexts(args.contexts)
    results.check_out_root(args.out)
    return contexts, prompt if prompt is not None else STANDARD_PROMPT, n_tok


LLAMA_MAX_LAYERS = 512  # llama.cpp src/llama-hparams.h


def check_block_count(info) -> None:
    """ModelError when {arch}.block_count is present but not an integer in 1..512: llama.cpp's
    loader (the tokeniser child included) aborts on it with a GGML_ASSERT (SIGABRT)."""
    key = f"{info.arch}.block_count"
    n = info.get(key)
    if n is None:
        return
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= LLAMA_MAX_LAYERS:
        raise ModelError(f"{info.path.name}: metadata {key!r} = {n!r} is outside "
                         f"[1, {LLAMA_MAX_LAYERS}] (llama.cpp's LLAMA_MAX_LAYERS)")


def tokenize_prompt(model, text: str, n_tokens: int | None):
    """Prompt ids through llama.cpp (child process), and a detokeniser for the report."""
    from backends.registry import create
    tok = create("llamacpp", in_child=True)
    try:
        tok.load(model, RunConfig(n_ctx=64, n_batch=64, n_ubatch=64))
        ids = tok.tokenize(text)
        if n_tokens is not None:
            if len(ids) < n_tokens:
                raise ConfigError(f"the prompt gives only {len(ids)} tokens, need {n_tokens}")
            ids = ids[:n_tokens]
        if not ids:
            raise ConfigError("the prompt is empty: it tokenises to no ids")
    except BaseException:
        tok.close()  # the tokenizer's child process: nobody else holds it on this path
        raise
    return tok, ids


def run_job(args, console: Console) -> int:
    contexts, text, n_tok = _check_args(args)
    names, unavailable = _choose_backends(args.backends, args.reference, getattr(args, "bench", False))
    draft = getattr(args, "draft", None)
    if draft is not None and draft not in names:
        raise ConfigError(f"--draft {draft!r} is not among the compared backends {names}")
    if draft is not None and draft == args.reference:
        raise ConfigError(f"--draft {draft!r} is the reference itself; draft with another compared backend")
    with bytes_progress(console, f"model {args.model}") as advance:
        model = models.resolve(args.model, progress=advance)
    info = open_gguf(model.path)
    check_block_count(info)
    gpu = gpu_info()
    ngl = args.n_gpu_layers if args.n_gpu_layers is not None else (99 if gpu else 0)
    base = RunConfig(n_threads=args.threads, n_gpu_layers=ngl, flash_attn=not args.no_flash_attn,
                     kv_type=args.kv_type, vram_limit=getattr(args, "vram_limit", None),
                     embd_placement=getattr(args, "embd_placement", "auto"))
    console.print(f"model [bold]{escape(model.name)}[/] ({escape(str(info.arch))}, {model.size:,} B) "
                  f"backends {names} reference {args.reference}")
    tok, ids = tokenize_prompt(model, text, n_tok)
    try:
        proto = ProtocolConfig(prompt_ids=tuple(ids), n_predict=args.n_predict,
                               contexts=contexts,
                               teacher_forced=not args.no_teacher_forced,
                               extra={"text": text})
        from backends.registry import create
        with Progress(console) as prog:
            result = verify_model(model, model_meta(info), proto, base, names,
                                  variants.wrap_create(lambda n: create(n, in_child=(n != "oracle"))),
                                  reference=args.reference, prog=prog, draft=draft)
        result["unavailable_backends"] = unavailable
        result["prompt"]["pieces"] = _pieces(tok, result, console)
    finally:
        try:
            tok.close()
        except HarnessError:  # a dead tokenizer child: nothing left to free
            pass
    engine_run = "engine" in {variants.base(n) for n in names}
    if getattr(args, "bench", False) or (gpu and engine_run and not args.no_bench):
        result["bench"] = _bench(args, model, info, names, ids, base, gpu, console)
    run_dir = results.new_run_dir(Path(args.out) / "runs", git_info().get("sha"))
    results.write_json(run_dir / "result.json", result)
    _print_summary(console, result)
    console.print(f"result: {run_dir / 'result.json'}", markup=False, soft_wrap=True)
    if not args.no_report:
        from reports.html import render_report
        console.print(f"report: {render_report(result, run_dir / 'report.html')}", markup=False,
                      soft_wrap=True)
    failed = [v for v in result["verdicts"] if v["verdict"] != "PASS"]
    return 1 if failed else 0


def _bench(args, model, info, names, ids, base, gpu, console) -> dict:
    """Throughput of every compared backend except the oracle, same prompt, same run."""
    from backends.registry import create

    from .bench_e2e import bench_e2e
    from .model_bytes import decode_weight_bytes
    copy = mem = None
    if gpu:
        from .gpu import copy_bandwidth, memory_used
        copy, mem = copy_bandwidth(), memory_used
        console.print(f"device copy bandwidth {copy['gb_s']:.0f} GB/s (read+write)")
    backends = [n for n in names if n != "oracle"]
    out = bench_e2e(model, decode_weight_bytes(info), backends, _contexts(args.contexts), ids,
                    base, variants.wrap_create(lambda n: create(n, in_child=True)),
                    n_decode=args.bench_decode,
                    reps=args.bench_reps, copy_gbs=copy["gb_s"] if copy else None,
                    mem_used=mem, log=lambda m: console.print(m, markup=False, soft_wrap=True))
    out["copy_bandwidth"] = copy
    for r in out["ratios"]:
        console.print(f"{r['backend']} / llamacpp at c={r['n_ctx']}: decode x{r['decode_ratio']:.2f}, "
                      f"prefill x{r['prefill_ratio']:.2f}")
    return out


def _pieces(tok, result: dict, console: Console) -> dict[str, str]:
    """Token text of every id in the prompt or any run (one call to the tokenizer child).
    Cosmetic: if the tokenizer process died, the report shows ids only."""
    ids = set(result["prompt"]["ids"]) | set(result["reference"]["ids"])
    for r in result["runs"]:
        ids |= set(r.get("ids") or [])
    ids = sorted(ids)
    try:
        texts = tok.pieces(ids)
    except HarnessError as e:
        console.print(f"warning: no token texts for the report ({e})", markup=False)
        return {}
    return {str(i): b.decode("utf-8", errors="replace") for i, b in zip(ids, texts)}


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _print_summary(console: Console, result: dict) -> None:
    ref = result["reference"]
    t = Table(title=f"{escape(str(result['model']['name']))}: reference {ref['backend']} "
                    f"ids sha256 {ref['ids_sha256'][:16]}")
    for col in ("backend", "ctx", "mode", "status", "match", "top-1", "KL mean", "KL max",
                "max-abs", "loop tok/s"):
        t.add_column(col)
    for r in result["runs"]:
        s, tm = r.get("summary") or {}, r.get("timing") or {}
        t.add_row(r["backend"], str(r["n_ctx"]), r["mode"], r["status"],
                  f"{s.get('match_prefix', '-')}/{s.get('n_generated', '-')}",
                  _fmt(s.get("top1_agreement"), ".3f"), _fmt(s.get("kl_mean"), ".2e"),
                  _fmt(s.get("kl_max"), ".2e"), _fmt(s.get("max_abs"), ".3g"),
                  _fmt(tm.get("decode_tok_s"), ".1f"))
    if result["runs"]:
        console.print(t)
    else:
        console.print(f"reference-only run ({ref['backend']}): no backend compared, ids sha256 "
                      f"{ref['ids_sha256']}", markup=False)
    spec = ref.get("speculative")
    if spec:
        if spec.get("used"):
            secs = spec.get("draft_s")
            done = (f"{spec['passes']} batched pass(es), {spec['accepted']}/{spec['drafted']} draft "
                    f"tokens accepted" + (f", drafting took {secs:.1f} s" if secs is not None else ""))
        else:
            done = "sequential" + (f" ({spec['reason']})" if spec.get("reason") else "")
        failed = f"; draft failed: {spec['draft_error']}" if spec.get("draft_error") else ""
        console.print(f"reference: draft {spec['draft']}, {done}{failed}", markup=False,
                      soft_wrap=True)
    for v in result["verdicts"]:
        colour = "green" if v["verdict"] == "PASS" else "red"
        console.print(f"[{colour}]{v['verdict']}[/] {v['backend']} c={v['n_ctx']}: {escape(str(v['reason']))}",
                      soft_wrap=True)
