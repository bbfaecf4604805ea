"""JSON files that may be stored gzipped: `X.json` or `X.json.gz`, read the same way.

The committed results under docs/results/ are stored as `.json.gz` (and raw arrays as
`.npy.gz`) to keep the checkout small; the harness itself still writes plain JSON
(harness.results.write_json). Every reader of result / nodes / kernels files goes through
load_json (harness.results.read_json calls it), so `harness ab`, `harness report`,
`harness bench-table` and the history pages take either form.

    load_json(path)      the parsed document of X.json or X.json.gz (gzip told by its bytes)
    find_json(path)      X.json when it exists, else X.json.gz when that does (lookups by name)
    plain_name(path)     the file name without a trailing .gz (result.json.gz -> result.json)
    json_stem(path)      the name without .json / .json.gz (X.json.gz -> X)
    compress(path)       X -> X.gz, deterministic (no name, mtime 0, level 9); X removed

    python -m harness.jsonio --compress docs/results   (`make compress-results`)
        gzips every plain .json and .npy under the folders given, as above; --check only lists
        them and exits 1 when there are any.

Standard library only (runs without the project's virtual environment).
"""
from __future__ import annotations

import argparse
import errno
import gzip
import io
import json
import os
import sys
import tempfile
import zlib
from pathlib import Path

GZ = ".gz"
GZIP_MAGIC = b"\x1f\x8b"
MAX_BYTES = 1 << 30  # a decompressed file beyond this is refused (results are a few MB at most)
COMPRESS_SUFFIXES = (".json", ".npy")


def plain_name(path: str | Path) -> str:
    """The file name without a trailing .gz: "result.json.gz" -> "result.json"."""
    name = Path(path).name
    return name[:-len(GZ)] if name.endswith(GZ) else name


def json_stem(path: str | Path) -> str:
    """The file name without .json.gz or .json ("X.json.gz" and "X.json" -> "X"); another
    name loses its last suffix, after a .gz ("X.txt.gz" -> "X")."""
    name = plain_name(path)
    return name[:-len(".json")] if name.endswith(".json") else Path(name).stem


def find_json(path: str | Path) -> Path:
    """path when it exists; else path + ".gz" when that exists (docs/results keeps X.json as
    X.json.gz); else path unchanged, so that reading it raises FileNotFoundError naming the
    file that was asked for."""
    path = Path(path)
    if path.exists() or path.name.endswith(GZ):
        return path
    gz = path.with_name(path.name + GZ)
    return gz if gz.exists() else path


def _gunzip(path: Path, data: bytes) -> bytes:
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(data), mode="rb") as f:
            out = f.read(MAX_BYTES + 1)
    except EOFError:  # the end-of-stream marker missing: a cut-off download or copy
        raise ValueError(f"{path}: truncated gzip file (it ends before its compressed data "
                         "does: a cut-off copy or download?)") from None
    except (gzip.BadGzipFile, zlib.error) as e:  # not gzip at all, or damaged inside
        raise ValueError(f"{path}: not a readable gzip file ({e})") from None
    if len(out) > MAX_BYTES:
        raise ValueError(f"{path}: decompresses to more than {MAX_BYTES} bytes; not a result")
    return out


def read_bytes(path: str | Path) -> bytes:
    """The file's bytes, gunzipped when it is gzip (told by its first two bytes, or a .gz
    name). OSError when it cannot be read (FileNotFoundError for X.json stored as X.json.gz
    says so); ValueError naming the file when the gzip stream is truncated or damaged."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError as e:
        gz = path.with_name(path.name + GZ)
        if not path.name.endswith(GZ) and gz.exists():
            raise FileNotFoundError(errno.ENOENT, f"No such file or directory (it is stored "
                                    f"gzipped: {gz})", str(path)) from None
        raise e from None
    if data.startswith(GZIP_MAGIC) or path.name.endswith(GZ):
        return _gunzip(path, data)
    return data


def load_text(path: str | Path) -> str:
    """The file's text (UTF-8), read as read_bytes; ValueError naming the file when it is
    not UTF-8."""
    data = read_bytes(path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def load_json(path: str | Path, **loads_kwargs):
    """The JSON document of a .json or .json.gz file (loads_kwargs go to json.loads, e.g.
    parse_int). The path is read as given (find_json looks a gzipped X.json up).

    Raises OSError when the file cannot be read (missing, a folder, no permission) and
    ValueError, its message starting with the path, when it is a truncated or damaged gzip
    file, not UTF-8, not JSON, or JSON nested past Python's recursion limit."""
    text = load_text(path)
    try:
        return json.loads(text, **loads_kwargs)
    except RecursionError:  # valid JSON nested past the recursion limit: hostile, not a result
        raise ValueError(f"{path}: JSON nested too deeply") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def gzip_bytes(data: bytes) -> bytes:
    """data gzipped deterministically: level 9, no file name, mtime 0 (as `gzip -n -9`), so the
    same input always gives the same bytes."""
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", compresslevel=9, fileobj=buf, mtime=0) as f:
        f.write(data)
    return buf.getvalue()


def write_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary file in the same folder, fsync, then rename over `path` (readers see
    the old file or the new one, never a part). Creates the folder. The file is 0644 (mkstemp
    makes 0600; results are meant to be shared). Raises OSError; the temporary file is removed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def compress(path: str | Path) -> Path:
    """Write path + ".gz" (gzip_bytes, atomically), check it reads back to the same bytes, then
    remove path; returns the .gz path. An existing .gz is kept when it holds the same bytes
    (path is then only removed); ValueError (nothing changed) when it holds other bytes."""
    path = Path(path)
    data = path.read_bytes()
    gz = path.with_name(path.name + GZ)
    if gz.exists():
        if read_bytes(gz) != data:
            raise ValueError(f"{gz} exists with other contents than {path}; not overwritten")
    else:
        write_atomic(gz, gzip_bytes(data))
        if read_bytes(gz) != data:  # never remove the original on a bad copy
            gz.unlink()
            raise ValueError(f"{gz}: read back differs from {path}; {path} kept")
    path.unlink()
    return gz


def plain_files(roots: list[Path], suffixes=COMPRESS_SUFFIXES) -> list[Path]:
    """Every file under roots (folders or files) whose name ends with one of suffixes, sorted."""
    found = set()
    for root in map(Path, roots):
        for p in ([root] if root.is_file() else root.rglob("*")):
            if p.is_file() and not p.is_symlink() and p.name.endswith(tuple(suffixes)):
                found.add(p)
    return sorted(found)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m harness.jsonio",
        description="gzip the plain .json / .npy result files under the given folders "
                    "(deterministic: no name, mtime 0, level 9), removing the originals")
    ap.add_argument("--compress", nargs="+", type=Path, required=True, metavar="DIR",
                    help="folders (or files) to compress, e.g. docs/results")
    ap.add_argument("--check", action="store_true",
                    help="only list the plain files; exit 1 when there are any")
    args = ap.parse_args(argv)
    files = plain_files(args.compress)
    if args.check:
        for p in files:
            print(p)
        return 1 if files else 0
    total_in = total_out = 0
    for p in files:
        size = p.stat().st_size
        try:
            gz = compress(p)
        except (OSError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        total_in, total_out = total_in + size, total_out + gz.stat().st_size
        print(f"{p} -> {gz.name} ({size} -> {gz.stat().st_size} bytes)")
    print(f"{len(files)} file(s) compressed, {total_in} -> {total_out} bytes"
          + ("; `git add` the .gz files and `git rm` the originals" if files else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
