"""Run folders -> compact run records, grouped by the git commit they were run from.

Input layout (harness.results): OUT/runs/<name>/result.json (+ report.html beside it) from
`harness run/verify`, and OUT/runs/<name>/kernels.json (+ kernels.html) from `harness bench
kernels` (schema gguf-harness/kernels/1, harness/bench_kernels.py); both carry `created` and
machine.git, so they group by commit the same way. Either may be stored gzipped
(result.json.gz / kernels.json.gz, as docs/results keeps results); the plain file wins when a
folder has both.
A record keeps only what the history pages show (verdicts, bench rows, teacher-forced error
summaries, kernel rows), so many large results (per-step arrays) are not held at once.
Kernel rows: one per shape with its format and the headline GB/s (mode cold_b2b: the R
copies back to back, as in a decode step); a shape whose oracle check failed, that was not
timed (status not "ok": failed, error, unsupported) or has no cold_b2b figure keeps its row
(status and why) but gives no GB/s, so no point in the trend.
Every field is read defensively (harness.jsonread.as_dict/as_list): old, partial or
hand-edited results must still be listed. Strings stay plain; templates escape them.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from harness.jsonread import as_dict, as_list
from harness.results import read_json

from .fmt import to_float
from .view import verdict_rows

NOGIT = "nogit"
# a commit key becomes a folder name under OUT/reports: only hex shas are trusted for that
_SHA = re.compile(r"[0-9a-fA-F]{4,64}")
BENCH_FIELDS = ("prefill_tok_s", "decode_tok_s", "ms_per_token", "eff_gb_s")
ERROR_FIELDS = ("kl_mean", "kl_max", "max_abs", "top1_agreement")
KERNELS_SCHEMA = "gguf-harness/kernels/1"
KERNEL_MODE = "cold_b2b"  # the headline timing mode of harness bench kernels
KERNELS_NAME = "GEMV kernels"  # the "model" column of a bench kernels run


@dataclass
class RunRecord:
    """What the history pages need from one result.json."""

    name: str                   # run folder name (OUT/runs/<name>)
    dir: Path
    created: datetime           # UTC; the file's mtime when `created` is absent or invalid
    created_ok: bool            # False when `created` fell back to the file time
    sha: str | None             # hex sha as recorded (short or full), None without git
    dirty: bool
    model: str                  # model name as recorded
    model_sha256: str | None
    device: str                 # GPU name, or "CPU"
    reference: str              # backend every error figure is measured against
    verdicts: list[dict]        # reports.view.verdict_rows rows
    overall: str                # PASS / FAIL / ERROR / "—"
    bench: list[dict]           # {backend, n_ctx, prefill_tok_s, decode_tok_s, ...} floats
    errors: list[dict]          # teacher-forced runs: {backend, n_ctx, status, kl_mean, ...}
    kernels: list[dict]         # {format, shape, gb_s, status, note, pct_copy, pct_roofline}
    kind: str = "verify"        # "verify" (result.json) or "kernels" (kernels.json)
    file: Path | None = None    # the JSON file read (default dir / "result.json")
    variant: str = ""           # engine switches (GGUF_HARNESS_*=...) of a kernels run, or ""

    @property
    def json_file(self) -> Path:
        return self.file or self.dir / "result.json"

    @property
    def model_id(self) -> str:
        """Series identity of the model: its SHA256 when recorded (names change), else name."""
        return self.model_sha256 or self.model

    @property
    def key(self) -> str:
        """Commit group: "<sha>", "<sha>-dirty", or "nogit" (also a folder name)."""
        if self.sha is None:
            return NOGIT
        return f"{self.sha}-dirty" if self.dirty else self.sha

    @property
    def report(self) -> Path | None:
        """The run's own page (report.html; kernels.html of a kernels run) when it exists
        (never modified here)."""
        p = self.dir / ("kernels.html" if self.kind == "kernels" else "report.html")
        return p if p.is_file() else None


@dataclass
class Commit:
    """The runs of one commit (dirty runs form their own group), oldest first."""

    key: str
    sha: str | None
    dirty: bool
    runs: list[RunRecord] = field(default_factory=list)

    @property
    def label(self) -> str:
        """"<sha>+dirty", "<sha>" or "nogit"."""
        if self.sha is None:
            return NOGIT
        return f"{self.sha}+dirty" if self.dirty else self.sha

    @property
    def short(self) -> str:
        """Axis label: 7 hex digits (+dirty)."""
        if self.sha is None:
            return NOGIT
        return self.sha[:7] + ("+dirty" if self.dirty else "")

    @property
    def first(self) -> datetime:
        return min(r.created for r in self.runs)

    @property
    def models(self) -> list[str]:
        return sorted({r.model for r in self.runs})

    @property
    def overall(self) -> str:
        """FAIL if any run fails, ERROR if any other non-PASS, PASS if all pass, "—" if none
        has a verdict (same rule as a single report's overall verdict)."""
        seen = {r.overall for r in self.runs} - {"—"}
        if not seen:
            return "—"
        return "FAIL" if "FAIL" in seen else "ERROR" if seen - {"PASS"} else "PASS"


def _parse_time(text) -> datetime | None:
    """ISO-8601 `created` -> aware UTC datetime (naive times are taken as UTC)."""
    if not isinstance(text, str):
        return None
    try:
        t = datetime.fromisoformat(text)
    except ValueError:
        return None
    return (t if t.tzinfo else t.replace(tzinfo=UTC)).astimezone(UTC)


def _git(machine: dict) -> tuple[str | None, bool, str | None]:
    """(hex sha or None, dirty, problem) from machine.git; a non-hex sha is a problem."""
    git = as_dict(machine.get("git"))
    sha = git.get("sha")
    if sha in (None, "", NOGIT):
        return None, False, None
    if not isinstance(sha, str) or not _SHA.fullmatch(sha):
        return None, False, f"git sha {str(sha)[:80]!r} is not hex: listed under {NOGIT}"
    return sha.lower(), bool(git.get("dirty")), None


def _floats(row: dict, keys: tuple[str, ...]) -> dict:
    return {k: to_float(row.get(k)) for k in keys}


def _bench(result: dict) -> list[dict]:
    bench = result.get("bench")
    rows = as_list(as_dict(bench).get("rows") if isinstance(bench, dict) else bench)
    return [{"backend": str(r.get("backend", "?")), "n_ctx": r.get("n_ctx"),
             **_floats(r, BENCH_FIELDS)} for r in map(as_dict, rows) if r]


def _errors(result: dict) -> list[dict]:
    """Teacher-forced runs only: every step is compared there (a greedy run stops being
    comparable at its first divergence), so their KL / max-abs are comparable over time."""
    out = []
    for r in map(as_dict, as_list(result.get("runs"))):
        if r.get("mode") != "teacher_forced":
            continue
        out.append({"backend": str(r.get("backend", "?")), "n_ctx": r.get("n_ctx"),
                    "status": str(r.get("status", "?")),
                    **_floats(as_dict(r.get("summary")), ERROR_FIELDS)})
    return out


def _kernel(fmt: str, shape: str, gb_s: float | None, status: str = "ok", note: str = "",
            pct_copy: float | None = None, pct_roofline: float | None = None) -> dict:
    return {"format": fmt, "shape": shape, "gb_s": gb_s, "status": status, "note": note,
            "pct_copy": pct_copy, "pct_roofline": pct_roofline}


def _kernels(result: dict) -> list[dict]:
    """A kernels table inside a run result, result["kernels"]: [{format, shape, gb_s}] (a
    dict with a "rows" list is accepted); rows without a format or GB/s are dropped."""
    k = result.get("kernels")
    rows = as_list(as_dict(k).get("rows") if isinstance(k, dict) else k)
    out = []
    for r in map(as_dict, rows):
        gb_s = to_float(r.get("gb_s"))
        if r.get("format") is None or gb_s is None:
            continue
        shape = r.get("shape")
        shape = "×".join(map(str, shape)) if isinstance(shape, (list, tuple)) else shape
        out.append(_kernel(str(r["format"]), "" if shape is None else str(shape), gb_s))
    return out


def _shape_label(row: dict, fmt: str) -> str:
    """"attn_qkv [10240x5120]": the shape's name and its label without the format."""
    label = str(row.get("label") or row.get("spec") or "")
    if fmt and label.endswith(" " + fmt):
        label = label[:-len(fmt) - 1]
    name = row.get("name")
    return " ".join(str(x) for x in (name, label) if x not in (None, ""))


def bench_kernel_rows(result: dict, mode: str = KERNEL_MODE) -> list[dict]:
    """Rows of a `harness bench kernels` result (schema gguf-harness/kernels/1): one per
    shape; gb_s is modes[mode].gb_s only for a row with status "ok", a passed oracle check
    and a finite figure, else None with the reason in `note`."""
    out = []
    for r in map(as_dict, as_list(result.get("rows"))):
        if not r:
            continue
        fmt = str(r.get("fmt") or r.get("format") or "?")
        status = str(r.get("status", "?"))
        fig = as_dict(as_dict(r.get("modes")).get(mode))
        gb_s = to_float(fig.get("gb_s"))
        check = as_dict(r.get("check"))
        if status != "ok":
            note = f"{status}: {r.get('reason') or 'not timed'}"
        elif check.get("ok") is not True:
            note = "oracle check not passed: no point"
        elif gb_s is None or not math.isfinite(gb_s) or gb_s <= 0:
            note = f"{mode} not timed" if not fig else f"{mode} GB/s not a positive number"
        else:
            note = ""
        out.append(_kernel(fmt, _shape_label(r, fmt), None if note else gb_s, status, note,
                           to_float(fig.get("pct_copy")), to_float(fig.get("pct_roofline"))))
    return out


def _kernels_overall(rows: list[dict]) -> str:
    """FAIL when a shape failed (its oracle check, or its output changed while timed), ERROR
    when one raised, PASS when every shape is ok or unsupported, "—" without rows."""
    seen = {r["status"] for r in rows}
    if not seen:
        return "—"
    return "FAIL" if "failed" in seen else "ERROR" if seen - {"ok", "unsupported"} else "PASS"


def _switches(machine: dict) -> str:
    sw = as_dict(machine.get("switches"))
    return " ".join(f"{k}={v}" for k, v in sorted(sw.items(), key=lambda kv: str(kv[0])))


def _device(machine: dict) -> str:
    gpu = machine.get("gpu")
    return str(as_dict(gpu).get("name") or "GPU") if isinstance(gpu, dict) else "CPU"


def load_run(path: Path) -> tuple[RunRecord, list[str]]:
    """One OUT/runs/<name>/result.json or kernels.json (either may be gzipped, .json.gz) ->
    (record, notes about odd fields).

    Raises ValueError (not a gguf-harness result, invalid JSON, a truncated or damaged gzip
    file; the message names the file) or OSError (unreadable)."""
    path = Path(path)
    result = read_json(path)
    notes = []
    machine = as_dict(result.get("machine"))
    sha, dirty, problem = _git(machine)
    if problem:
        notes.append(problem)
    created = _parse_time(result.get("created"))
    if created is None:
        notes.append("no valid `created` time: ordered by the file's modification time")
    when = created or datetime.fromtimestamp(path.stat().st_mtime, UTC)
    if result.get("schema") == KERNELS_SCHEMA:
        rows = bench_kernel_rows(result)
        return RunRecord(
            name=path.parent.name, dir=path.parent, created=when,
            created_ok=created is not None, sha=sha, dirty=dirty, model=KERNELS_NAME,
            model_sha256=None, device=_device(machine), reference="float64 oracle (check)",
            verdicts=[], overall=_kernels_overall(rows), bench=[], errors=[], kernels=rows,
            kind="kernels", file=path, variant=_switches(machine)), notes
    model = as_dict(result.get("model"))
    name = str(model.get("name") or "?")
    sha256 = model.get("sha256")
    verdicts, overall = verdict_rows(result)
    rec = RunRecord(
        name=path.parent.name, dir=path.parent, created=when,
        created_ok=created is not None, sha=sha, dirty=dirty, model=name,
        model_sha256=sha256 if isinstance(sha256, str) and sha256 else None,
        device=_device(machine),
        reference=str(as_dict(result.get("reference")).get("backend")
                      or as_dict(result.get("settings")).get("reference") or "?"),
        verdicts=verdicts, overall=overall, bench=_bench(result), errors=_errors(result),
        kernels=_kernels(result), file=path)
    return rec, notes


def collect_runs(out_root: Path, advance: Callable[[], None] = lambda: None,
                 warn: Callable[[Path, str], None] = lambda p, m: None
                 ) -> tuple[list[RunRecord], list[tuple[Path, str]]]:
    """Load every OUT/runs/*/result.json and OUT/runs/*/kernels.json (run_files).

    Returns (records, skipped) where skipped lists (path, reason) of files that are not
    readable gguf-harness results; each skip and each odd field is also passed to `warn`.
    `advance` is called once per file (progress display)."""
    records, skipped = [], []
    for path in run_files(out_root):
        try:
            rec, notes = load_run(path)
        except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
            reason = f"{type(e).__name__}: {e}"
            skipped.append((path, reason))
            warn(path, f"skipped: {reason}")
        else:
            records.append(rec)
            for n in notes:
                warn(path, n)
        advance()
    return records, skipped


def _runs_glob(out_root: Path, name: str) -> list[Path]:
    """OUT/runs/*/<name>, or <name>.gz in a folder without <name> (results archived gzipped,
    as docs/results keeps them: harness.jsonio), sorted by path."""
    plain = set(Path(out_root).glob(f"runs/*/{name}"))
    gz = {p for p in Path(out_root).glob(f"runs/*/{name}.gz") if p.with_name(name) not in plain}
    return sorted(plain | gz)


def result_files(out_root: Path) -> list[Path]:
    """OUT/runs/*/result.json (or result.json.gz), sorted by path."""
    return _runs_glob(out_root, "result.json")


def kernel_files(out_root: Path) -> list[Path]:
    """OUT/runs/*/kernels.json (or kernels.json.gz; harness bench kernels), sorted by path."""
    return _runs_glob(out_root, "kernels.json")


def run_files(out_root: Path) -> list[Path]:
    """Every file the history reads: result.json and kernels.json runs, sorted by path."""
    return sorted(result_files(out_root) + kernel_files(out_root))


def group_commits(records: list[RunRecord]) -> list[Commit]:
    """Group by commit key; runs oldest first, commits by their earliest run (ties: key)."""
    groups: dict[str, Commit] = {}
    for r in records:
        c = groups.setdefault(r.key, Commit(r.key, r.sha, r.dirty))
        c.runs.append(r)
    for c in groups.values():
        c.runs.sort(key=lambda r: (r.created, r.name))
    return sorted(groups.values(), key=lambda c: (c.first, c.key))
