#!/usr/bin/env python3
"""Pair each new result.json with the previous run of the same model and settings.

Used by the gate stage of ci/gpu-nightly.sh, which then calls `harness ab PREV NEW` per pair.

    python ci/gate_pairs.py OUT/runs [--before LIST]

LIST: a file with one result.json path per line, the results that existed before this
nightly started. With it, "new" = every result under OUT/runs not in LIST; without it,
"new" = the newest result of each group (re-running the gate by hand on the latest runs).

Group ("same model + settings"): model name and SHA256, `settings` (backends, contexts,
n_predict, run settings, gate), the prompt's token ids, the GPU name and whether the run
has a `bench` section. Results of a different GPU or model file are not comparable: token
ids and timings may legitimately differ, so they start a new baseline instead.

The previous run of a new result is the one with the latest `created` time in its group
that is not new. Output, one line per new result, tab-separated, oldest first:

    PREV<TAB>NEW    a comparison to make
    -<TAB>NEW       no earlier run in the group (a baseline)
    !<TAB>NEW       NEW is unreadable or not a gguf-harness run result (the gate fails)

Exit codes: 0 ok (also when there is nothing to compare), 2 bad input (missing LIST, a
path containing a tab or newline). Standard library only: it runs before anything is
imported from the project.
"""
from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from pathlib import Path

RUN_SCHEMA = "gguf-harness/run/"


def _fail(msg: str) -> None:
    print(f"gate_pairs: error: {msg}", file=sys.stderr)
    sys.exit(2)


def load_run(path: Path) -> dict | None:
    """The parsed result, or None (with a warning on stderr) if it is not a readable run
    result with a `created` time."""
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: nested too deeply
        print(f"gate_pairs: warning: cannot read {path}: {e}", file=sys.stderr)
        return None
    if not isinstance(obj, dict) or not str(obj.get("schema", "")).startswith(RUN_SCHEMA):
        print(f"gate_pairs: warning: {path} is not a gguf-harness run result", file=sys.stderr)
        return None
    try:
        created = datetime.fromisoformat(str(obj["created"]))
    except (KeyError, ValueError):
        print(f"gate_pairs: warning: {path} has no valid 'created' time", file=sys.stderr)
        return None
    # naive times are the harness's UTC (results.py writes +00:00; older files may not)
    obj["_created"] = created if created.tzinfo else created.replace(tzinfo=UTC)
    return obj


def group_key(run: dict) -> str:
    """Canonical JSON of what must be equal for two runs to be compared."""
    def d(x) -> dict:  # a malformed result must not stop the gate for every later run
        return x if isinstance(x, dict) else {}
    model = d(run.get("model"))
    gpu = d(d(run.get("machine")).get("gpu")).get("name")
    key = {"model": model.get("name"), "sha256": model.get("sha256"),
           "settings": run.get("settings"), "prompt_ids": d(run.get("prompt")).get("ids"),
           "gpu": gpu, "bench": "bench" in run}
    return json.dumps(key, sort_keys=True)


def pairs(runs_dir: Path, before: set[Path] | None) -> list[tuple[str, Path]]:
    """[(previous path | '-' | '!', new path)] in order of the new runs' created times.

    before: resolved paths of the results that existed earlier, or None for "newest of
    each group". Unreadable old results are skipped; an unreadable new one yields '!'."""
    found = sorted(p.resolve() for p in runs_dir.glob("*/result.json")) if runs_dir.is_dir() else []
    runs = {p: load_run(p) for p in found}
    good = {p: r for p, r in runs.items() if r is not None}
    order = sorted(good, key=lambda p: (good[p]["_created"], str(p)))
    groups: dict[str, list[Path]] = {}
    for p in order:
        groups.setdefault(group_key(good[p]), []).append(p)
    if before is not None:
        new = {p for p in found if p not in before}
    else:
        new = {members[-1] for members in groups.values()}
    out: list[tuple[str, Path]] = [("!", p) for p in sorted(new) if good.get(p) is None]
    for p in order:
        if p not in new:
            continue
        earlier = [q for q in groups[group_key(good[p])] if q not in new
                   and good[q]["_created"] <= good[p]["_created"]]
        out.append((str(earlier[-1]) if earlier else "-", p))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", type=Path, help="the runs folder (OUT/runs)")
    ap.add_argument("--before", type=Path, default=None,
                    help="file listing the result.json paths that existed before this nightly")
    args = ap.parse_args(argv)
    before = None
    if args.before is not None:
        try:
            lines = args.before.read_text().splitlines()
        except OSError as e:
            _fail(f"cannot read --before {args.before}: {e}")
        before = {Path(line).resolve() for line in lines if line.strip()}
    result = pairs(args.runs, before)
    for prev, new in result:
        if any(c in s for s in (prev, str(new)) for c in "\t\n"):
            _fail(f"a path contains a tab or newline: {new!r}")
    for prev, new in result:
        print(f"{prev}\t{new}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
