"""harness.jsonio: .json and .json.gz read the same way (docs/results stores results gzipped),
clear errors on a damaged .gz, deterministic compression, and the readers built on it
(`harness ab`, `harness report`, the history) taking .json.gz files."""
from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest

from harness import jsonio
from harness.cli import main
from harness.results import SCHEMA, read_json, write_json

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
DOC = {"schema": SCHEMA, "created": "2026-01-01T00:00:00+00:00", "n": 12345678901234567890,
       "x": [1.5, None, "é"], "nested": {"a": [{"b": True}]}}


def _gz(path: Path, data: bytes) -> Path:
    path.write_bytes(jsonio.gzip_bytes(data))
    return path


def test_load_json_round_trip_plain_and_gz(tmp_path):
    text = json.dumps(DOC, indent=1).encode()
    plain = tmp_path / "r.json"
    plain.write_bytes(text)
    gz = _gz(tmp_path / "r.json.gz", text)
    other = tmp_path / "o.json.gz"  # any gzip writer (file name and mtime in the header)
    with gzip.GzipFile(other, "wb", compresslevel=1, mtime=1234) as f:
        f.write(text)
    for p in (plain, gz, other):
        assert jsonio.load_json(p) == DOC, p
        assert read_json(p) == DOC, p
    assert jsonio.load_json(gz, parse_int=str)["n"] == "12345678901234567890"  # kwargs passed on
    # gzip told by its bytes, not only by the name
    (tmp_path / "named-plain.json").write_bytes(gz.read_bytes())
    assert jsonio.load_json(tmp_path / "named-plain.json") == DOC
    # a result written by the harness (plain, as before) reads back the same once gzipped
    write_json(tmp_path / "w.json", DOC)
    before = read_json(tmp_path / "w.json")
    assert jsonio.compress(tmp_path / "w.json") == tmp_path / "w.json.gz"
    assert not (tmp_path / "w.json").exists() and read_json(tmp_path / "w.json.gz") == before


@pytest.mark.parametrize("cut", [1, 2, 10, 0.5, -8, -1])
def test_truncated_gz_is_a_clear_error_naming_the_file(tmp_path, cut):
    data = jsonio.gzip_bytes(json.dumps(DOC).encode())
    n = int(len(data) * cut) if isinstance(cut, float) else cut % len(data)
    bad = tmp_path / "cut.json.gz"
    bad.write_bytes(data[:n])
    with pytest.raises(ValueError) as e:
        jsonio.load_json(bad)
    msg = str(e.value)
    assert msg.startswith(str(bad)) and "gzip" in msg and "\n" not in msg, msg


def test_other_bad_files_name_the_file(tmp_path):
    cases = {"text.json.gz": b'{"a": 1}',                      # a .gz name on plain text
             "junk.json.gz": jsonio.gzip_bytes(b"{") + b"junk",  # trailing garbage
             "notjson.json.gz": jsonio.gzip_bytes(b"{nope"),
             "latin1.json.gz": jsonio.gzip_bytes(b'{"a": "\xe9"}'),
             "deep.json.gz": jsonio.gzip_bytes(b"[" * 100000 + b"]" * 100000)}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=re.escape(str(tmp_path / name))):
            jsonio.load_json(tmp_path / name)
    with pytest.raises(IsADirectoryError):
        jsonio.load_json(tmp_path)


def test_a_missing_json_stored_gzipped_is_named(tmp_path):
    _gz(tmp_path / "r.json.gz", json.dumps(DOC).encode())
    with pytest.raises(FileNotFoundError, match="stored gzipped"):
        jsonio.load_json(tmp_path / "r.json")
    assert jsonio.find_json(tmp_path / "r.json") == tmp_path / "r.json.gz"
    (tmp_path / "r.json").write_text("{}")
    assert jsonio.find_json(tmp_path / "r.json") == tmp_path / "r.json"  # plain first
    assert jsonio.find_json(tmp_path / "none.json") == tmp_path / "none.json"
    assert jsonio.plain_name("a/result.json.gz") == "result.json"
    assert jsonio.json_stem("a/X.json.gz") == jsonio.json_stem("X.json") == "X"


def test_compress_is_deterministic_and_keeps_the_bytes(tmp_path):
    data = json.dumps(DOC, indent=1).encode()
    outs = []
    for d in ("one", "two"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "r.json").write_bytes(data)
        outs.append(jsonio.compress(tmp_path / d / "r.json").read_bytes())
    assert outs[0] == outs[1] == jsonio.gzip_bytes(data)
    assert outs[0][3] == 0 and outs[0][4:8] == b"\0\0\0\0"  # no FNAME flag, mtime 0
    assert gzip.decompress(outs[0]) == data
    # an existing .gz of other bytes is never overwritten, the original kept
    (tmp_path / "one" / "r.json").write_bytes(b"{}")
    with pytest.raises(ValueError, match="other contents"):
        jsonio.compress(tmp_path / "one" / "r.json")
    assert (tmp_path / "one" / "r.json").read_bytes() == b"{}"


def test_compress_command(tmp_path, capsys):
    root = tmp_path / "results"
    (root / "sub").mkdir(parents=True)
    (root / "a.json").write_text('{"a": 1}')
    (root / "sub" / "b.json").write_text('{"b": 2}')
    (root / "sub" / "c.npy").write_bytes(b"\x93NUMPY" + bytes(100))
    (root / "keep.txt").write_text("notes")
    (root / "done.json.gz").write_bytes(jsonio.gzip_bytes(b"{}"))
    assert jsonio.main(["--compress", str(root), "--check"]) == 1
    assert capsys.readouterr().out.split() == [str(root / "a.json"), str(root / "sub" / "b.json"),
                                               str(root / "sub" / "c.npy")]
    assert jsonio.main(["--compress", str(root)]) == 0
    assert "3 file(s) compressed" in capsys.readouterr().out
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*")) == [
        "a.json.gz", "done.json.gz", "keep.txt", "sub", "sub/b.json.gz", "sub/c.npy.gz"]
    assert jsonio.load_json(root / "sub" / "b.json.gz") == {"b": 2}
    assert gzip.decompress((root / "sub" / "c.npy.gz").read_bytes()) == b"\x93NUMPY" + bytes(100)
    assert jsonio.main(["--compress", str(root), "--check"]) == 0


# ---- the readers ---------------------------------------------------------------------------

# pairs of committed results (docs/results, stored gzipped), one per kind `harness ab` compares
AB_PAIRS = {
    "run": ("nightly-2026-11-29-h200-s7/verify-run1-897e202.json.gz",
            "nightly-2026-11-29-h200-s7/verify-run2-e783cc3.json.gz"),
    "kernels": ("sweeps/2026-11-29-h200-kernels-v8-pf2-a.json.gz",
                "sweeps/2026-11-29-h200-kernels-v8-pf0.json.gz"),
    "nodes": ("sweeps/2026-11-30-h200-nodes-27b-s9a-DEFAULT-1.json.gz",
              "sweeps/2026-11-30-h200-nodes-27b-s9a-KQ_IQ3S-1.json.gz"),
}


def _committed_bytes(rel: str) -> bytes:
    """The JSON text of a committed result (gunzipped)."""
    return jsonio.read_bytes(RESULTS / rel)


def test_committed_results_are_gzipped_and_found_by_their_old_names():
    """docs/perf-notes.md names the files as written (X.json); find_json gives X.json.gz."""
    for rel in (r for pair in AB_PAIRS.values() for r in pair):
        old = RESULTS / rel.removesuffix(".gz")
        assert not old.exists() and jsonio.find_json(old) == RESULTS / rel
        assert (RESULTS / rel).read_bytes()[:2] == jsonio.GZIP_MAGIC


def _ab_out(capsys, a: str, b: str, fmt: str) -> tuple[int, str]:
    code = main(["ab", a, b, "--format", fmt])
    out = capsys.readouterr().out
    if fmt == "json":  # the comparison's own time and the paths differ by design
        doc = json.loads(out)
        doc.pop("created")
        for k in ("a", "b"):
            doc[k].pop("path")
        return code, doc
    return code, out.replace(a, "<A>").replace(b, "<B>")


@pytest.mark.parametrize("kind", sorted(AB_PAIRS))
@pytest.mark.parametrize("fmt", ["json", "md", "table"])
def test_ab_on_gz_files_equals_ab_on_plain_files(kind, fmt, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for d in ("plain", "gz"):
        Path(d).mkdir()
    paths = {}
    for side, rel in zip("ab", AB_PAIRS[kind]):
        data = _committed_bytes(rel)
        Path(f"plain/{side}.json").write_bytes(data)
        _gz(Path(f"gz/{side}.json.gz"), data)  # same length as plain/a.json: same table layout
        paths[side] = (f"plain/{side}.json", f"gz/{side}.json.gz")
    plain = _ab_out(capsys, paths["a"][0], paths["b"][0], fmt)
    gz = _ab_out(capsys, paths["a"][1], paths["b"][1], fmt)
    assert gz == plain
    code, out = plain
    assert code in (0, 1) and out  # a comparison was made (not a usage error)
    if fmt == "json":
        assert out["a"]["created"] == json.loads(_committed_bytes(AB_PAIRS[kind][0]))["created"]


def test_ab_on_a_truncated_gz_is_one_line_naming_the_file(tmp_path, capsys):
    data = _committed_bytes(AB_PAIRS["run"][0])
    good = _gz(tmp_path / "a.json.gz", data)
    bad = tmp_path / "b.json.gz"
    bad.write_bytes(jsonio.gzip_bytes(data)[:-100])
    assert main(["ab", str(good), str(bad)]) == 2
    cap = capsys.readouterr()
    assert "Traceback" not in cap.out + cap.err
    err = " ".join(cap.err.split())  # rich may wrap the long line
    assert f"{bad}: truncated gzip file" in err, err
    assert main(["report", str(bad)]) == 2
    assert f"{bad}: truncated gzip file" in " ".join(capsys.readouterr().err.split())


def test_report_and_bench_table_take_gz(tmp_path, capsys):
    run = _gz(tmp_path / "run-x.json.gz", _committed_bytes(AB_PAIRS["run"][0]))
    nodes = _gz(tmp_path / "nodes-y.json.gz", _committed_bytes(AB_PAIRS["nodes"][0]))
    assert main(["report", str(run)]) == 0 and main(["report", str(nodes)]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "run-x.report.html"),
                                               str(tmp_path / "nodes-y.nodes.html")]
    folder = tmp_path / "runs" / "r1"
    folder.mkdir(parents=True)
    one = folder / "result.json.gz"
    one.write_bytes(run.read_bytes())
    assert main(["report", str(one)]) == 0
    assert capsys.readouterr().out.strip() == str(folder / "report.html")
    assert main(["bench-table", str(run)]) == 0
    gz_table = capsys.readouterr().out
    plain = tmp_path / "run-x.json"
    plain.write_bytes(jsonio.read_bytes(run))
    assert main(["bench-table", str(plain)]) == 0
    assert capsys.readouterr().out == gz_table and "| tg" in gz_table


def test_history_reads_gz_runs_and_prefers_plain(tmp_path):
    from reports.history_runs import collect_runs, run_files
    out = tmp_path / "out"
    for name in ("a", "b"):
        (out / "runs" / name).mkdir(parents=True)
    res = dict(DOC, machine={"git": {"sha": "ab" * 20, "dirty": False}})
    _gz(out / "runs" / "a" / "result.json.gz", json.dumps(res).encode())
    write_json(out / "runs" / "b" / "result.json", res)
    _gz(out / "runs" / "b" / "result.json.gz", b"not read")  # the plain file beside it wins
    _gz(out / "runs" / "b" / "kernels.json.gz", b"[]")
    files = run_files(out)
    assert [p.relative_to(out).as_posix() for p in files] == [
        "runs/a/result.json.gz", "runs/b/kernels.json.gz", "runs/b/result.json"]
    records, skipped = collect_runs(out)
    assert [r.json_file.name for r in records] == ["result.json.gz", "result.json"]
    assert [(p.name, "not a gguf-harness result" in why) for p, why in skipped] == [
        ("kernels.json.gz", True)]


def test_committed_results_are_stored_gzipped():
    """docs/results keeps results as .json.gz / .npy.gz (docs/results/README.md): a plain .json or
    .npy committed there would grow the tree past what a device call can carry beside the llama.cpp
    build. Fix with `make compress-results`. Only git-tracked files count (a scratch file is not)."""
    import shutil
    import subprocess
    root = RESULTS.parents[1]
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout: the tracked files cannot be listed")
    out = subprocess.run(["git", "ls-files", "-z", "--", "docs/results"], cwd=root,
                         capture_output=True, check=True).stdout.decode()
    tracked = [p for p in out.split("\0") if p]
    assert tracked, "git lists no files under docs/results"
    plain = [p for p in tracked if p.endswith(jsonio.COMPRESS_SUFFIXES)]
    assert plain == [], f"run `make compress-results`, then commit: {plain[:5]}"
    # and the tool agrees on the working tree's tracked files
    assert jsonio.main(["--compress", *[str(root / p) for p in tracked[:50]], "--check"]) == 0


def test_write_atomic_keeps_the_old_file_when_the_rename_fails(tmp_path, monkeypatch):
    """jsonio.write_atomic (results, reports and compress all write through it): a failure before
    the rename leaves the earlier file as it was and no temporary file behind; a success is 0644."""
    import os
    from harness import results
    assert results.write_atomic is jsonio.write_atomic
    target = tmp_path / "sub" / "r.json"
    jsonio.write_atomic(target, b"old")
    assert target.read_bytes() == b"old" and (target.stat().st_mode & 0o777) == 0o644

    def boom(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        jsonio.write_atomic(target, b"new")
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in target.parent.iterdir()) == ["r.json"]
