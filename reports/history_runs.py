"""Run folders -> compact run records, grouped by the git commit they were run from.

Input layout (harness.results): OUT/runs/<name>/result.json (+ report.html beside it).
A record keeps only what the history pages show (verdicts, bench rows, teacher-forced error
summaries, kernel rows), so many large results (per-step arrays) are not held at once.
Every field is read defensively (harness.jsonread.as_dict/as_list): old, partial or
hand-edited results must still be listed. Strings stay plain; templates escape them.
"""
from __future__ import annotations

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
    kernels: list[dict]         # {format, shape, gb_s} (result["kernels"], when present)

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
        """The run's own report.html, when it exists (never modified here)."""
        p = self.dir / "report.html"
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


def _kernels(result: dict) -> list[dict]:
    """result["kernels"]: [{format, shape, gb_s}] (a dict with a "rows" list is accepted)."""
    k = result.get("kernels")
    rows = as_list(as_dict(k).get("rows") if isinstance(k, dict) else k)
    out = []
    for r in map(as_dict, rows):
        gb_s = to_float(r.get("gb_s"))
        if r.get("format") is None or gb_s is None:
            continue
        shape = r.get("shape")
        shape = "×".join(map(str, shape)) if isinstance(shape, (list, tuple)) else shape
        out.append({"format": str(r["format"]), "shape": "" if shape is None else str(shape),
                    "gb_s": gb_s})
    return out


def load_run(path: Path) -> tuple[RunRecord, list[str]]:
    """One OUT/runs/<name>/result.json -> (record, notes about odd fields).

    Raises ValueError (not a gguf-harness result, invalid JSON) or OSError (unreadable)."""
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
    model = as_dict(result.get("model"))
    name = str(model.get("name") or "?")
    sha256 = model.get("sha256")
    gpu = machine.get("gpu")
    verdicts, overall = verdict_rows(result)
    rec = RunRecord(
        name=path.parent.name, dir=path.parent,
        created=created or datetime.fromtimestamp(path.stat().st_mtime, UTC),
        created_ok=created is not None, sha=sha, dirty=dirty, model=name,
        model_sha256=sha256 if isinstance(sha256, str) and sha256 else None,
        device=str(as_dict(gpu).get("name") or "GPU") if isinstance(gpu, dict) else "CPU",
        reference=str(as_dict(result.get("reference")).get("backend")
                      or as_dict(result.get("settings")).get("reference") or "?"),
        verdicts=verdicts, overall=overall, bench=_bench(result), errors=_errors(result),
        kernels=_kernels(result))
    return rec, notes


def collect_runs(out_root: Path, advance: Callable[[], None] = lambda: None,
                 warn: Callable[[Path, str], None] = lambda p, m: None
                 ) -> tuple[list[RunRecord], list[tuple[Path, str]]]:
    """Load every OUT/runs/*/result.json (sorted by path).

    Returns (records, skipped) where skipped lists (path, reason) of files that are not
    readable gguf-harness results; each skip and each odd field is also passed to `warn`.
    `advance` is called once per file (progress display)."""
    records, skipped = [], []
    for path in result_files(out_root):
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


def result_files(out_root: Path) -> list[Path]:
    """OUT/runs/*/result.json, sorted by path."""
    return sorted(Path(out_root).glob("runs/*/result.json"))


def group_commits(records: list[RunRecord]) -> list[Commit]:
    """Group by commit key; runs oldest first, commits by their earliest run (ties: key)."""
    groups: dict[str, Commit] = {}
    for r in records:
        c = groups.setdefault(r.key, Commit(r.key, r.sha, r.dirty))
        c.runs.append(r)
    for c in groups.values():
        c.runs.sort(key=lambda r: (r.created, r.name))
    return sorted(groups.values(), key=lambda c: (c.first, c.key))
