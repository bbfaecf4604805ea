"""llama-bench style throughput table: `pp<N>` / `tg<N>` rows with t/s as mean ± stdev.

    harness bench-table RESULT.json [--format md|csv|json] [--llama-bench FILE.json ...]

The layout follows llama.cpp's llama-bench (tools/llama-bench/llama-bench.cpp in
ggml-org/llama.cpp: `struct test`, `markdown_printer`, `json_printer`, `jsonl_printer`):
columns model | size | params | backend | ngl | test | t/s; test "pp<n_prompt>" (prompt
processing), "tg<n_gen>" (generation), "pp<N>+tg<M>" (both), " @ d<n_depth>" when the test
starts at a cache depth; t/s = mean ± sample standard deviation (n - 1; 0 for a single
sample) of the per-repetition rates (n_prompt + n_gen) / seconds, as its avg_ts/stddev_ts.

Rows from a result's `bench` section (harness.bench_e2e), per bench row (backend, n_ctx):
  - "pp<n_prompt>": samples n_prompt / raw.prefill_s[i];
  - "tg<n_decode>": samples n_decode / raw.decode_s[i]. The decode starts right after the
    n_prompt-token prefill, so its `n_depth` field is n_prompt (llama-bench would name it
    "tg128 @ d70"; its own tg starts on an empty cache); the name stays "tg<n_decode>".
  Every recorded repetition counts: the harness's bench runs no separate warm-up
  repetition (llama-bench does), so a cold first repetition shows as a large stdev. The
  result's own bench table (decode_tok_s, prefill_tok_s) reports medians instead.
  - model: result model name; size: the model file's bytes (llama-bench: tensor bytes);
    params: model["n_params"] when recorded, else "-";
  - backend: our backend name + " (<GPU name>)" when the machine has a GPU (not for the
    CPU-only "oracle");
  - ngl: settings.run.n_gpu_layers, for llamacpp rows only (a llama.cpp setting; "-" for
    the others);
  - ctx: an extra column, the run's n_ctx (KV cache size). llama-bench has no such column
    (its context is just large enough for the test), so imported rows show "-".

Imported llama-bench files (`llama-bench -o json`: one JSON array; `-o jsonl`: one object a
line) add rows with backend "llama-bench (<backends>)". The files are untrusted: at most
MAX_FILE_BYTES and MAX_RECORDS records, every used field type-checked; a bad file raises
ConfigError naming the file, record and field.

Formats: md (GitHub table like llama-bench's, t/s with 2 decimals), csv (header + rows,
numbers as recorded), json (list of row dicts, with the per-repetition samples_ts).
"""
from __future__ import annotations

import csv
import html
import io
import json
import math
import statistics
from pathlib import Path

from .bench_e2e import rep_rates
from .errors import ConfigError
from .jsonread import as_dict, finite, json_int

MAX_FILE_BYTES = 16 * 1024 * 1024
MAX_RECORDS = 10_000
MAX_SAMPLES = 10_000  # per record
COLUMNS = ("model", "size", "params", "backend", "ngl", "ctx", "test", "t/s")
RIGHT = frozenset({"size", "params", "ngl", "ctx", "test", "t/s"})  # right-aligned, as llama-bench
FIELDS = ("model", "size", "params", "backend", "ngl", "ctx", "test", "n_prompt", "n_gen",
          "n_depth", "avg_ts", "stddev_ts")  # csv columns; json adds samples_ts
FORMATS = ("md", "csv", "json")


def llama_test_name(n_prompt: int, n_gen: int, n_depth: int = 0) -> str:
    """llama-bench's test label: "pp512", "tg128", "pp512+tg128", + " @ d<n_depth>" if > 0."""
    if n_prompt > 0 and n_gen == 0:
        name = f"pp{n_prompt}"
    elif n_gen > 0 and n_prompt == 0:
        name = f"tg{n_gen}"
    else:
        name = f"pp{n_prompt}+tg{n_gen}"
    return f"{name} @ d{n_depth}" if n_depth > 0 else name


def ts_stats(samples: list[float]) -> tuple[float, float]:
    """(mean, sample stdev with n - 1) of per-repetition tok/s; stdev 0 for one sample."""
    mean = statistics.fmean(samples)
    return mean, (statistics.stdev(samples, mean) if len(samples) > 1 else 0.0)


def _int(x) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _rates(n_tokens, seconds) -> list[float] | None:
    """n_tokens / s for every repetition (harness.bench_e2e.rep_rates); None when n_tokens is
    not a positive int or any time is unusable."""
    if _int(n_tokens) is None or n_tokens <= 0 or not isinstance(seconds, list) or not seconds:
        return None
    rates = rep_rates(n_tokens, seconds[:MAX_SAMPLES])
    return None if any(math.isnan(r) for r in rates) else rates


def _row(common: dict, test: str, n_prompt: int, n_gen: int, n_depth: int,
         samples: list[float]) -> dict:
    mean, sd = ts_stats(samples)
    return {**common, "test": test, "n_prompt": n_prompt, "n_gen": n_gen, "n_depth": n_depth,
            "avg_ts": mean, "stddev_ts": sd, "samples_ts": samples}


def rows_from_result(result: dict) -> list[dict]:
    """Rows (dicts with FIELDS + samples_ts) from a result's bench section; [] when absent.

    Read defensively (a report of an odd result must render): bench rows without a
    backend or without positive per-repetition seconds in raw.prefill_s / raw.decode_s
    give no pp / tg row."""
    result = as_dict(result)
    model, machine = as_dict(result.get("model")), as_dict(result.get("machine"))
    gpu = as_dict(machine.get("gpu")).get("name")
    ngl = _int(as_dict(as_dict(result.get("settings")).get("run")).get("n_gpu_layers"))
    name = model.get("name")
    size, params = _int(model.get("size")), _int(model.get("n_params"))
    out: list[dict] = []
    bench_rows = as_dict(result.get("bench")).get("rows")
    for b in bench_rows if isinstance(bench_rows, list) else []:
        b = as_dict(b)
        backend = b.get("backend")
        if not isinstance(backend, str):
            continue
        label = f"{backend} ({gpu})" if isinstance(gpu, str) and backend != "oracle" else backend
        common = {"model": str(name) if name is not None else "-", "size": size,
                  "params": params, "backend": label,
                  "ngl": ngl if backend == "llamacpp" else None, "ctx": _int(b.get("n_ctx"))}
        raw = as_dict(b.get("raw"))
        n_prompt, n_decode = b.get("n_prompt"), b.get("n_decode")
        pre = _rates(n_prompt, raw.get("prefill_s"))
        if pre:
            out.append(_row(common, llama_test_name(n_prompt, 0), n_prompt, 0, 0, pre))
        dec = _rates(n_decode, raw.get("decode_s"))
        if dec:
            depth = n_prompt if _int(n_prompt) is not None and n_prompt > 0 else 0
            out.append(_row(common, llama_test_name(0, n_decode), 0, n_decode, depth, dec))
    return out


# ---- llama-bench import ---------------------------------------------------------------------

def _one_object(text: str) -> bool:
    """text is a single JSON value (not JSONL)."""
    try:
        json.loads(text, parse_int=json_int)
    except (ValueError, RecursionError):
        return False
    return True


def _records(path: Path) -> list:
    """The JSON values of a llama-bench json (array) or jsonl (object per line) file."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"cannot read llama-bench file {path}: {e.strerror or e}") from None
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"llama-bench file {path} is larger than {MAX_FILE_BYTES} bytes")
    try:
        text = data.decode("utf-8").strip()
        if text.startswith("["):
            recs = json.loads(text, parse_int=json_int)
        else:
            recs = []
            try:
                for line in text.splitlines():
                    if line.strip():
                        recs.append(json.loads(line, parse_int=json_int))
                        if len(recs) > MAX_RECORDS:
                            break
            except ValueError:  # not JSONL: say so plainly when it is one pretty-printed object
                if text.startswith("{") and _one_object(text):
                    raise ConfigError(f"llama-bench file {path} is one JSON object over several "
                                      "lines: expected a JSON array of test objects (-o json) or "
                                      "one object per line (-o jsonl)") from None
                raise
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"llama-bench file {path} is not JSON or JSONL: {msg}") from None
    if not isinstance(recs, list):
        raise ConfigError(f"llama-bench file {path}: expected a JSON array of test objects")
    if len(recs) > MAX_RECORDS:
        raise ConfigError(f"llama-bench file {path} has more than {MAX_RECORDS} records")
    if not recs:  # e.g. llama-bench died before its first test: say so rather than drop it
        raise ConfigError(f"llama-bench file {path} has no test records")
    return recs


def _record_row(rec, where: str) -> dict:
    """One llama-bench test object -> row; ConfigError naming the bad field."""
    if not isinstance(rec, dict):
        raise ConfigError(f"{where}: not a JSON object")

    def get(key, check, what):
        v = check(rec.get(key))
        if v is None:
            raise ConfigError(f"{where}: field {key!r} missing or not {what}")
        return v

    def text(x):
        return x if isinstance(x, str) else None

    def count(x):
        return x if _int(x) is not None and x >= 0 else None

    def rate(x):
        v = finite(x)
        return v if v is not None and v >= 0 else None

    n_prompt, n_gen = get("n_prompt", count, "a count"), get("n_gen", count, "a count")
    n_depth = get("n_depth", count, "a count") if "n_depth" in rec else 0  # newer builds only
    if n_prompt == 0 and n_gen == 0:
        raise ConfigError(f"{where}: n_prompt and n_gen are both 0")
    samples = rec.get("samples_ts")
    if samples is not None:
        ok = isinstance(samples, list) and len(samples) <= MAX_SAMPLES
        samples = [rate(s) for s in samples] if ok else None
        if samples is None or None in samples:
            raise ConfigError(f"{where}: field 'samples_ts' is not a list of rates")
    return {"model": get("model_type", text, "a string"),
            "size": get("model_size", count, "a byte count"),
            "params": get("model_n_params", count, "a count"),
            "backend": f"llama-bench ({get('backends', text, 'a string')})",
            "ngl": get("n_gpu_layers", _int, "an integer"), "ctx": None,
            "test": llama_test_name(n_prompt, n_gen, n_depth), "n_prompt": n_prompt,
            "n_gen": n_gen, "n_depth": n_depth, "avg_ts": get("avg_ts", rate, "a rate >= 0"),
            "stddev_ts": get("stddev_ts", rate, "a rate >= 0"), "samples_ts": samples or []}


def rows_from_llama_bench(path: Path) -> list[dict]:
    """Rows from a `llama-bench -o json` or `-o jsonl` file (fields as llama-bench's
    test::get_fields: model_type, model_size, model_n_params, backends, n_gpu_layers,
    n_prompt, n_gen, [n_depth], avg_ts, stddev_ts, [samples_ts]).

    Raises ConfigError (one line) for an unreadable, oversized or malformed file."""
    return [_record_row(r, f"llama-bench file {path}, record {i}")
            for i, r in enumerate(_records(Path(path)))]


# ---- formatting -----------------------------------------------------------------------------

def _size(n: int | None) -> str:
    # llama-bench: MiB below 1 GiB, else GiB, 2 decimals
    if n is None:
        return "-"
    return f"{n / 2**20:.2f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def _params(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 1e6:.2f} M" if n < 1_000_000_000 else f"{n / 1e9:.2f} B"


def display_cells(row: dict) -> list[str]:
    """A row's COLUMNS as display strings (plain text; callers escape for their format)."""
    def opt(v):
        return "-" if v is None else str(v)
    return [str(row["model"]), _size(row["size"]), _params(row["params"]), str(row["backend"]),
            opt(row["ngl"]), opt(row["ctx"]), row["test"],
            f"{row['avg_ts']:.2f} ± {row['stddev_ts']:.2f}"]


def _md_cell(s: str, limit: int = 120) -> str:
    # untrusted names: no pipe, newline or control character may break the table, and no
    # HTML in them may render (Markdown passes inline HTML through)
    s = "".join(c if c.isprintable() else f"\\u{ord(c):04x}" for c in s[:limit])
    return html.escape(s, quote=False).replace("|", "\\|")


def format_md(rows: list[dict]) -> str:
    """GitHub markdown table, columns padded like llama-bench's output."""
    cells = [[_md_cell(c) for c in display_cells(r)] for r in rows]
    widths = [max([len(h), 3] + [len(r[i]) for r in cells]) for i, h in enumerate(COLUMNS)]

    def line(vals):
        return "| " + " | ".join(v.rjust(w) if c in RIGHT else v.ljust(w)
                                 for v, w, c in zip(vals, widths, COLUMNS)) + " |"
    rule = ["-" * (w - 1) + ":" if c in RIGHT else "-" * w for w, c in zip(widths, COLUMNS)]
    return "\n".join([line(COLUMNS), line(rule), *map(line, cells)]) + "\n"


def _csv_cell(v):
    """Absent -> empty; a text cell that a spreadsheet would run as a formula (leading = + - @,
    tab or CR: model names are untrusted) gets a leading apostrophe (OWASP CSV injection)."""
    if v is None:
        return ""
    if isinstance(v, str) and v[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + v
    return v


def format_csv(rows: list[dict]) -> str:
    """Header FIELDS + one line per row; numbers unformatted, absent values empty, text cells
    guarded against formula injection (_csv_cell)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(FIELDS)
    w.writerows([[_csv_cell(r[k]) for k in FIELDS] for r in rows])
    return buf.getvalue()


def format_json(rows: list[dict]) -> str:
    """JSON list of row dicts (FIELDS + samples_ts); absent values null."""
    return json.dumps([{k: r[k] for k in (*FIELDS, "samples_ts")} for r in rows], indent=1) + "\n"


def render(rows: list[dict], fmt: str) -> str:
    """The table in format fmt (one of FORMATS); ConfigError for another."""
    fns = {"md": format_md, "csv": format_csv, "json": format_json}
    if fmt not in fns:
        raise ConfigError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
    return fns[fmt](rows)


def report_table(result: dict) -> dict | None:
    """{"columns", "right" (per column: right-aligned), "rows" (display strings)} for the HTML
    report; None when the result has no usable bench rows. Never raises on odd input."""
    rows = rows_from_result(result)
    if not rows:
        return None
    return {"columns": list(COLUMNS), "right": [c in RIGHT for c in COLUMNS],
            "rows": [display_cells(r) for r in rows]}


def run_bench_table(args) -> int:
    """CLI: print the table of args.result (+ args.llama_bench files) in args.format to stdout.

    ConfigError when the result cannot be read or no rows result at all."""
    from .results import read_run_result
    try:
        result = read_run_result(args.result, "bench-table")
    except (OSError, ValueError) as e:  # missing/unreadable file, not JSON, not a run result
        raise ConfigError(f"cannot read {args.result}: {e}") from None
    rows = rows_from_result(result)
    for path in args.llama_bench or []:
        rows += rows_from_llama_bench(path)
    if not rows:
        raise ConfigError(f"{args.result} has no bench rows with per-repetition times "
                          "(bench runs with a GPU or --bench) and no --llama-bench file was given")
    print(render(rows, args.format), end="")
    return 0
