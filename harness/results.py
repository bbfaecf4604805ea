"""Result JSON: versioned schema, atomic writes, one new folder per run (never overwritten).

Layout: out/runs/<UTC time>-<short git sha>[-N]/result.json (+ report.html beside it).
"""
from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from pathlib import Path

from .jsonio import load_json, write_atomic  # noqa: F401  (write_atomic: used here and re-exported)
from .jsonread import json_int

SCHEMA = "gguf-harness/run/1"


def check_out_root(out: str | Path, sub: str | None = "runs") -> Path:
    """The --out folder, with its `sub` folder (runs/; None: the folder alone) created;
    ConfigError (before any work) when it is empty, a file or cannot be created."""
    from .errors import ConfigError
    if not str(out).strip():  # --out "$OUT" with OUT unset: Path("") would be the cwd
        raise ConfigError("--out is empty; give a folder (default: out)")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a folder")
    try:
        (out / sub if sub else out).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create the output folder {out}: {e}") from None
    return out


def new_run_dir(root: Path, sha: str | None) -> Path:
    """Create and return a fresh run folder under root; never reuses an existing one."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    base = f"{stamp}-{(sha or 'nogit')[:10]}"
    root.mkdir(parents=True, exist_ok=True)
    for n in range(1000):
        path = root / (base if n == 0 else f"{base}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"cannot create a new run folder under {root}")


def _clean(x):
    """JSON has no NaN/Inf: write them as strings so the file stays standard JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if hasattr(x, "item") and callable(x.item):  # numpy scalars
        return _clean(x.item())
    return x


def write_json(path: Path, obj: dict) -> None:
    write_atomic(path, json.dumps(_clean(obj), indent=1, allow_nan=False).encode())


def read_json(path: Path) -> dict:
    """Load a result from a .json or .json.gz file (harness.jsonio.load_json; the path is read
    as given). OSError if it cannot be read; ValueError, naming the file, if it is a truncated
    or damaged gzip file, not JSON (nesting too deep included) or not a gguf-harness result of
    a known schema."""
    obj = load_json(path, parse_int=json_int)  # (an int beyond a float's range: inf)
    if not isinstance(obj, dict) or not str(obj.get("schema", "")).startswith("gguf-harness/"):
        raise ValueError(f"{path} is not a gguf-harness result")
    return obj


def read_run_result(path: Path, reader: str) -> dict:
    """read_json, and a run result (schema SCHEMA) only: another gguf-harness result (kernels,
    nodes, layerdiff, ab) raises ValueError naming its schema and what `reader` reads."""
    obj = read_json(path)
    if obj.get("schema") != SCHEMA:
        raise ValueError(f"{path} is a {obj.get('schema')} result; {reader} reads run results "
                         f"({SCHEMA}: result.json of harness run / verify)")
    return obj
