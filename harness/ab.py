"""A/B comparison of two results (schema gguf-harness/run/1): `harness ab A.json B.json`.

Pure functions on result dicts; the command line lives in harness/ab_cmd.py, the HTML page
in reports/ab_html.py.

Performance (one row per bench row present in A, keyed by (backend, n_ctx), for decode and
prefill tok/s): the samples are the per-repetition times in the row's `raw` lists
(harness/bench_e2e.py), turned into rates: decode tok/s = n_decode / raw.decode_s[i],
prefill tok/s = n_prompt / raw.prefill_s[i]. ms/token is 1000 / decode tok/s, so it gets no
verdict of its own. With A's and B's samples:
    delta  = median(B) / median(A) - 1          (tok/s: higher is better)
    spread = (max - min) / median                of one run's samples
    noise  = max(spread(A), spread(B))
    UNKNOWN  if either side has < 3 samples, or noise or delta is not finite;
    SAME     if |delta| <= max(threshold, noise)            (default threshold 0.02);
    FASTER / SLOWER by the sign of delta otherwise.
A bench row of A that B lacks is UNKNOWN, unless B's bench recorded an error for it (the
backend crashed while timed): that is a correctness failure.

Which SLOWER verdicts set the exit code (`--fail-on-slower [BACKENDS]`, exit_code()): none
by default; every backend's with a bare `--fail-on-slower` (or `all`); only the listed
backends' with `--fail-on-slower engine` (comma-separated names). SLOWER rows of the other
backends are still shown and counted, marked "not gated". The GPU nightly gates on `engine`
alone (ci/gpu-nightly.sh GATE_SLOWER_BACKENDS): llama.cpp and the oracle are references whose
build does not change between commits, so their speed changes are machine noise. Measured on
the H200 (docs/results/nightly-2026-11-29-h200-s7): two nightlies on the same code, 3 bench
repetitions each, llama.cpp's prefill tok/s at c=512 went 10510.6 -> 9702.0 (-7.69 %, noise
+-4.11 %: SLOWER, the gate failed) while the same figure at c=2048 went +9.66 % and every
engine figure stayed within +-0.3 % (SAME). Correctness failures fail for every backend.

Correctness (never a matter of noise): per run (backend, mode, n_ctx), the reference run
included, the token-id SHA256 (summary.ids_sha256 or the run's own ids_sha256, else computed
from its ids with harness.metrics.ids_sha256), the final-step logits SHA256 (of a reference
computed speculatively on one side and otherwise on the other, "not comparable": float64
summation order, harness.speculative; its ids still count) and the status;
per (backend, n_ctx) the gate verdict. A FAILURE is: a SHA that changed (or that A has and
B lacks), a run of A missing in B, a run whose status in B is not "ok", a verdict that is
FAIL/ERROR in B or missing in B. Runs or verdicts that only B has are listed, not failures.

Two results are comparable only with the same model SHA256, prompt ids (text when ids are
absent), n_predict and reference backend (teacher-forced runs are fed the reference's ids):
otherwise compare() raises ConfigError, and with force=True the SHA rows are marked
"not comparable" instead of "changed" (status, verdict and missing-run failures still count).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import metrics
from .bench_e2e import rep_rates
from .errors import ConfigError
from .gpu_state import short_note
from .jsonread import as_dict, as_list, finite_pos, key_part
from .results import SCHEMA, read_json

AB_SCHEMA = "gguf-harness/ab/1"
DEFAULT_THRESHOLD = 0.02
MIN_SAMPLES = 3
# metric -> (raw seconds key in row["raw"], row key of the token count)
PERF_METRICS = {"decode_tok_s": ("decode_s", "n_decode"),
                "prefill_tok_s": ("prefill_s", "n_prompt")}
SHA_FIELDS = ("ids_sha256", "final_logits_sha256")
BAD_VERDICTS = ("FAIL", "ERROR")

RunKey = tuple[str, str, int]  # (backend, mode, n_ctx)


@dataclass(frozen=True)
class PerfRow:
    """One performance metric of one bench row; medians in tok/s, delta/noise as fractions."""
    metric: str
    backend: str
    n_ctx: int
    a_median: float | None
    b_median: float | None
    a_n: int
    b_n: int
    a_spread: float | None
    b_spread: float | None
    delta: float | None
    noise: float | None
    tolerance: float | None
    verdict: str  # SAME | FASTER | SLOWER | UNKNOWN
    note: str = ""


@dataclass(frozen=True)
class CheckRow:
    """One correctness figure: `check` is ids_sha256 | final_logits_sha256 | status | run |
    verdict | bench; `state` is same | changed | missing in B | new in B | failed |
    not comparable | not in A."""
    check: str
    backend: str
    mode: str | None
    n_ctx: int | None
    a: str | None
    b: str | None
    state: str
    failure: bool
    note: str = ""


@dataclass
class ABResult:
    threshold: float
    comparable: bool
    mismatches: list[str]
    perf: list[PerfRow] = field(default_factory=list)
    checks: list[CheckRow] = field(default_factory=list)

    @property
    def failures(self) -> int:
        return sum(c.failure for c in self.checks)

    def count(self, verdict: str) -> int:
        return sum(p.verdict == verdict for p in self.perf)

    def to_dict(self) -> dict:
        """JSON-ready dict (schema AB_SCHEMA); counts included for readers of ab.json."""
        return {"schema": AB_SCHEMA, "threshold": self.threshold,
                "comparable": self.comparable, "mismatches": list(self.mismatches),
                "failures": self.failures,
                "counts": {v: self.count(v) for v in ("FASTER", "SLOWER", "SAME", "UNKNOWN")},
                "perf": [asdict(p) for p in self.perf],
                "checks": [asdict(c) for c in self.checks]}


ALL_BACKENDS = "all"


def known_backends() -> tuple[str, ...]:
    """Backend names a result can hold (backends.registry), for --fail-on-slower."""
    from backends.registry import TARGETS
    return tuple(TARGETS)


def parse_slower_backends(text: str) -> tuple[str, ...]:
    """`--fail-on-slower` value -> backend names, or ("all",) for every backend.

    "engine,llamacpp" -> ("engine", "llamacpp") (order kept, repeats dropped); "all" only
    alone. Raises ConfigError for an empty list or a name that is not a backend (a typo
    would otherwise never fail the gate)."""
    names = tuple(dict.fromkeys(n.strip() for n in str(text).split(",")))
    if ALL_BACKENDS in names:
        if len(names) > 1:
            raise ConfigError(f"--fail-on-slower {text!r}: '{ALL_BACKENDS}' stands alone")
        return (ALL_BACKENDS,)
    known = known_backends()
    bad = [n for n in names if n not in known]
    if not names or bad:
        what = "an empty backend name" if "" in bad or not names else \
            "unknown backend " + ", ".join(repr(n) for n in bad)
        raise ConfigError(f"--fail-on-slower {text!r}: {what}; expected a comma-separated "
                          f"list of {', '.join(known)}, or {ALL_BACKENDS}")
    return names


def _slower_gates(fail_on_slower) -> tuple[str, ...] | None:
    """() for no speed gate, None for every backend, else the gated backend names."""
    if fail_on_slower is None or fail_on_slower is False:
        return ()
    if fail_on_slower is True:
        return None
    names = ((fail_on_slower,) if isinstance(fail_on_slower, str)
             else tuple(fail_on_slower))
    names = tuple(n.strip() for name in names for n in str(name).split(","))
    return None if ALL_BACKENDS in names else names


def gates(row: PerfRow, fail_on_slower=False) -> bool:
    """True when `row` is SLOWER and its backend is gated by `fail_on_slower`: False or None
    (no speed gate), True or "all" (every backend), or backend names (a list, or one
    comma-separated string)."""
    if row.verdict != "SLOWER":
        return False
    gated = _slower_gates(fail_on_slower)
    return gated is None or row.backend in gated


def exit_code(ab: ABResult, fail_on_slower=False) -> int:
    """1 with any correctness failure (every backend), or with a SLOWER verdict of a backend
    that `fail_on_slower` gates (see gates()); else 0."""
    return 1 if ab.failures or any(gates(p, fail_on_slower) for p in ab.perf) else 0


# ---- input ------------------------------------------------------------------------------

def load_result(path: Path) -> dict:
    """Read a result of schema gguf-harness/run/1 from a .json or .json.gz file.

    Raises ConfigError (one line, naming the file) when the file cannot be read, is a
    truncated or damaged gzip file, is not JSON, or has another schema."""
    try:
        obj = read_json(Path(path))
    except (OSError, ValueError) as e:  # missing/unreadable, not JSON, not a harness result
        raise ConfigError(f"cannot read result {path}: {e}") from None
    if obj.get("schema") != SCHEMA:
        raise ConfigError(f"{path}: schema {obj.get('schema')!r} is not {SCHEMA!r}")
    return obj


def _num(x) -> float:
    """A JSON number (or "nan"/"inf" string, harness.results._clean) as float; else nan."""
    if isinstance(x, bool):
        return math.nan
    if isinstance(x, (int, float)):
        return float(x)
    try:
        return float(x) if isinstance(x, str) else math.nan
    except ValueError:
        return math.nan


# ---- comparability ----------------------------------------------------------------------

def _prompt_key(result: dict) -> object:
    p = as_dict(result.get("prompt"))
    return p.get("ids") if p.get("ids") is not None else p.get("text")


def mismatches(a: dict, b: dict) -> list[str]:
    """Reasons why A and B are not comparable (different model, prompt, n_predict or
    reference backend)."""
    out = []
    sha_a, sha_b = as_dict(a.get("model")).get("sha256"), as_dict(b.get("model")).get("sha256")
    if not sha_a or not sha_b:
        gone = " and ".join(side for side, sha in (("A", sha_a), ("B", sha_b)) if not sha)
        out.append(f"model SHA256 missing in {gone}")
    elif sha_a != sha_b:
        out.append(f"model SHA256 differs ({str(sha_a)[:12]} vs {str(sha_b)[:12]})")
    if _prompt_key(a) != _prompt_key(b):
        out.append("prompt differs")
    set_a, set_b = as_dict(a.get("settings")), as_dict(b.get("settings"))
    for key, what in (("n_predict", "n_predict"), ("reference", "reference backend")):
        if set_a.get(key) != set_b.get(key):
            # teacher-forced runs are fed the reference's ids: another reference, other SHAs
            out.append(f"{what} differs ({set_a.get(key)} vs {set_b.get(key)})")
    return out


# ---- performance ------------------------------------------------------------------------

def rate_samples(row: dict, metric: str) -> list[float]:
    """Per-repetition rates [tok/s] of `metric` from a bench row's raw seconds
    (harness.bench_e2e.rep_rates). A time that is not a positive finite number gives nan
    (which makes the noise non-finite, so the verdict is UNKNOWN)."""
    raw_key, count_key = PERF_METRICS[metric]
    row = as_dict(row)
    return rep_rates(_num(row.get(count_key)), as_dict(row.get("raw")).get(raw_key))


def spread(xs: list[float]) -> float:
    """(max - min) / median of the samples; nan when empty, inf for a zero median."""
    if not xs or any(math.isnan(x) for x in xs):
        return math.nan
    med = statistics.median(xs)
    return (max(xs) - min(xs)) / med if med > 0 else math.inf


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def perf_stats(a: list[float], b: list[float], threshold: float) -> dict:
    """Medians, sample counts, spreads, delta, noise, tolerance and verdict of B against A
    from their rate samples (rule in the module docstring); non-finite figures -> None."""
    med_a, med_b = _median(a), _median(b)
    delta = med_b / med_a - 1 if med_a and med_b is not None else math.nan
    noise = max(spread(a), spread(b)) if a and b else math.nan
    tol = max(threshold, noise) if math.isfinite(noise) else math.nan
    if min(len(a), len(b)) < MIN_SAMPLES or not (math.isfinite(noise) and math.isfinite(delta)):
        verdict = "UNKNOWN"
    elif abs(delta) <= tol:
        verdict = "SAME"
    else:
        verdict = "FASTER" if delta > 0 else "SLOWER"
    return {"a_median": _finite(med_a), "b_median": _finite(med_b), "a_n": len(a),
            "b_n": len(b), "a_spread": _finite(spread(a)), "b_spread": _finite(spread(b)),
            "delta": _finite(delta), "noise": _finite(noise), "tolerance": _finite(tol),
            "verdict": verdict}


def _bench_rows(result: dict) -> dict[tuple[str, int], dict]:
    rows = as_list(as_dict(result.get("bench")).get("rows"))
    return {(str(r.get("backend")), key_part(r.get("n_ctx"))): r for r in rows if isinstance(r, dict)}


def _bench_errors(result: dict) -> dict[tuple[str, int], str]:
    errs = as_list(as_dict(result.get("bench")).get("errors"))
    return {(str(e.get("backend")), key_part(e.get("n_ctx"))): str(e.get("error"))
            for e in errs if isinstance(e, dict)}


def perf_rows(a: dict, b: dict, threshold: float) -> tuple[list[PerfRow], list[CheckRow]]:
    """Performance rows of every bench row of A (then rows only B has, as UNKNOWN), and a
    correctness row for each of A's bench rows that crashed in B."""
    rows_a, rows_b, errs_b = _bench_rows(a), _bench_rows(b), _bench_errors(b)
    perf, checks = [], []
    for key in list(rows_a) + [k for k in rows_b if k not in rows_a]:
        ra, rb = rows_a.get(key), rows_b.get(key)
        note = ("missing in B" if rb is None else "not in A" if ra is None
                else short_note(ra.get("gpu_state"), rb.get("gpu_state")))  # a GPU that slowed
        if rb is None and key in errs_b:
            note = "crashed in B"
            checks.append(CheckRow("bench", key[0], None, key[1], "ok", "error", "failed", True,
                                   errs_b[key]))
        for metric in PERF_METRICS:
            stats = perf_stats(rate_samples(ra or {}, metric), rate_samples(rb or {}, metric),
                               threshold)
            extra = energy_note(ra, rb) if metric == "decode_tok_s" else ""
            perf.append(PerfRow(metric, key[0], key[1], **stats,
                                note="; ".join(n for n in (note, extra) if n)))
    return perf, checks


def energy_note(ra, rb, key: str = "decode_j_per_token", method_key: str = "decode_energy_method",
                unit: str = "J/token") -> str:
    """"J/token A -> B (+x.x %)" when both bench rows carry the decode's energy per token
    (harness/bench_e2e.py decode_energy, from session 22; positive finite figures only) by the
    same estimator (decode_energy_method; untagged: session 22's first), "... not compared:
    estimators differ" by different ones, "J/token only in A|B: x" when one row has it, else "":
    information beside the speed verdict, not a verdict (one median per row, no spread). key /
    method_key / unit: the same for other energy figures (bench nodes: step_j, "J/step")."""
    ja, jb = (finite_pos(r.get(key)) if isinstance(r, dict) else None for r in (ra, rb))
    if ja and jb:
        ma, mb = (str(r.get(method_key) or "untagged")[:60] for r in (ra, rb))
        if ma != mb:  # another estimator moves the figure by itself (session 22: 2-6 %)
            return f"{unit} {ja:.3g} -> {jb:.3g} not compared: estimators differ ({ma} / {mb})"
        return f"{unit} {ja:.3g} -> {jb:.3g} ({100 * (jb / ja - 1):+.1f} %)"
    if ja or jb:  # as the GPU-state note does when one side has none
        return f"{unit} only in {'A' if ja else 'B'}: {ja or jb:.3g}"
    return ""


# ---- correctness ------------------------------------------------------------------------

def _runs(result: dict) -> dict[RunKey, dict]:
    """Every run by (backend, mode, n_ctx), the reference run included."""
    out = {}
    for run in [result.get("reference")] + as_list(result.get("runs")):
        if isinstance(run, dict):
            out[(str(run.get("backend")), str(run.get("mode")), key_part(run.get("n_ctx")))] = run
    return out


def run_sha(run: dict, name: str) -> str | None:
    """A run's SHA256 `name` (ids_sha256 | final_logits_sha256) from its summary or itself;
    ids_sha256 is computed from the run's ids (harness.metrics.ids_sha256) when not stored."""
    val = as_dict(run.get("summary")).get(name) or run.get(name)
    if val is None and name == "ids_sha256" and isinstance(run.get("ids"), list) and run["ids"]:
        try:
            val = metrics.ids_sha256(run["ids"])
        except (TypeError, ValueError, OverflowError):  # hand-edited ids that are not ints
            val = None
    return str(val) if val is not None else None


def _sum_order(run: dict) -> tuple | None:
    """How a reference's float64 logits were summed: None for the sequential run, else its
    speculative pass record (harness.speculative: batched passes sum in another order, so
    float32 logits SHAs may differ in a rounding while the ids cannot)."""
    spec = as_dict(run.get("speculative"))
    if not spec.get("used"):
        return None
    return tuple(spec.get(k) for k in ("draft", "passes", "fed_tokens", "drafted", "accepted"))


def sha_check(name: str, key: RunKey, a: str | None, b: str | None,
              comparable: bool) -> CheckRow | None:
    """Row of one SHA of one run present in both; None when neither side has the SHA."""
    if a is None and b is None:
        return None
    if a is None:
        state, fail = "not in A", False
    elif b is None:
        state, fail = "missing in B", True
    elif a == b:
        state, fail = "same", False
    elif not comparable:
        state, fail = "not comparable", False
    else:
        state, fail = "changed", True
    return CheckRow(name, key[0], key[1], key[2], a, b, state, fail)


def run_checks(a: dict, b: dict, comparable: bool) -> list[CheckRow]:
    """Correctness rows of every run of A (then runs only B has)."""
    runs_a, runs_b = _runs(a), _runs(b)
    out = []
    for key, ra in runs_a.items():
        rb = runs_b.get(key)
        if rb is None:
            out.append(CheckRow("run", *key, "present", None, "missing in B", True))
            continue
        st_a, st_b = str(ra.get("status")), str(rb.get("status"))
        bad = st_b != "ok"
        out.append(CheckRow("status", *key, st_a, st_b, "failed" if bad else
                            "same" if st_a == st_b else "changed", bad,
                            str(rb.get("error") or "") if bad else ""))
        same_order = _sum_order(ra) == _sum_order(rb)
        for name in SHA_FIELDS:
            row = sha_check(name, key, run_sha(ra, name), run_sha(rb, name),
                            comparable and (same_order or name == "ids_sha256"))
            if row:
                out.append(row)
    out += [CheckRow("run", *key, None, "present", "new in B", False)
            for key in runs_b if key not in runs_a]
    return out


def _verdicts(result: dict) -> dict[tuple[str, int], dict]:
    vs = as_list(result.get("verdicts"))
    return {(str(v.get("backend")), key_part(v.get("n_ctx"))): v for v in vs if isinstance(v, dict)}


def verdict_checks(a: dict, b: dict) -> list[CheckRow]:
    """Gate verdict rows per (backend, n_ctx): FAIL/ERROR in B or missing in B fails."""
    va, vb = _verdicts(a), _verdicts(b)
    out = []
    for key in list(va) + [k for k in vb if k not in va]:
        a_v = str(va[key].get("verdict")) if key in va else None
        b_v = str(vb[key].get("verdict")) if key in vb else None
        if b_v is None:
            state, fail = "missing in B", True
        elif b_v in BAD_VERDICTS:
            state, fail = "failed", True
        else:
            state, fail = ("new in B" if a_v is None else "same" if a_v == b_v else "changed",
                           False)
        reason = str(vb[key].get("reason") or "") if key in vb else ""
        out.append(CheckRow("verdict", key[0], None, key[1], a_v, b_v, state, fail, reason))
    return out


# ---- entry point ------------------------------------------------------------------------

def compare(a: dict, b: dict, threshold: float = DEFAULT_THRESHOLD,
            force: bool = False) -> ABResult:
    """Compare result B against result A (both dicts of schema gguf-harness/run/1).

    Raises ConfigError for a negative or non-finite threshold, and when A and B are not
    comparable (mismatches()) unless force."""
    if not (math.isfinite(threshold) and threshold >= 0):
        raise ConfigError(f"--threshold must be a finite fraction >= 0, got {threshold}")
    why = mismatches(a, b)
    if why and not force:
        raise ConfigError("results are not comparable: " + "; ".join(why)
                          + " (--force compares them anyway)")
    perf, bench_checks = perf_rows(a, b, threshold)
    checks = verdict_checks(a, b) + run_checks(a, b, not why) + bench_checks
    return ABResult(threshold, not why, why, perf, checks)


def side_info(result: dict, path: Path | str | None = None) -> dict:
    """Identity of one side for headers: path, created, git, model name/SHA256, GPU, note."""
    machine = as_dict(result.get("machine"))
    model = as_dict(result.get("model"))
    return {"path": str(path) if path is not None else None, "created": result.get("created"),
            "git": as_dict(machine.get("git")).get("sha"),
            "dirty": as_dict(machine.get("git")).get("dirty"),
            "source": as_dict(machine.get("git")).get("source_sha256"),
            "gpu": as_dict(machine.get("gpu")).get("name"),
            "model": model.get("name"), "model_sha256": model.get("sha256"),
            "switches": as_dict(machine.get("switches")), "note": result.get("note")}
