"""`harness` command line: bad input gives one clear line, exit code 2, no traceback and no
run folder; a good run writes result.json + report.html in a new folder every time."""
from __future__ import annotations

import json

import pytest

from harness import models
from harness.cli import main

PROMPT = "The quick brown fox jumps over the lazy dog near the river bank today"


def _run(capsys, *argv):
    code = main(list(argv))
    err = capsys.readouterr().err
    return code, err


def _no_runs(out):
    runs = out / "runs"
    return not runs.exists() or not any(runs.iterdir())


def _verify(model, out, *extra):
    return ("verify", "--model", str(model), "--backends", "oracle,llamacpp", "--contexts", "64",
            "--n-predict", "4", "--prompt", PROMPT, "--out", str(out), *extra)


def test_non_gguf_file(tmp_path, capsys):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    code, err = _run(capsys, *_verify(bad, tmp_path / "out"))
    assert code == 2 and "error:" in err and "GGUF" in err and "Traceback" not in err
    assert _no_runs(tmp_path / "out")


def test_truncated_file(tiny_qwen2_f32, tmp_path, capsys):
    cut = tmp_path / "cut.gguf"
    data = tiny_qwen2_f32.read_bytes()
    cut.write_bytes(data[: len(data) - 1000])
    code, err = _run(capsys, *_verify(cut, tmp_path / "out"))
    assert code == 2 and "Traceback" not in err
    assert "truncated" in err.lower() or "file" in err.lower()
    assert _no_runs(tmp_path / "out")


def test_unknown_tensor_type(tiny_qwen2_f32, tmp_path, capsys):
    from harness.gguf_file import open_gguf
    info = open_gguf(tiny_qwen2_f32)
    name = "output_norm.weight"
    data = bytearray(tiny_qwen2_f32.read_bytes())
    # tensor info record: name (u64 len + bytes), n_dims u32, dims u64 x n, type u32, offset u64
    key = len(name).to_bytes(8, "little") + name.encode()
    at = data.index(key) + len(key)
    n_dims = int.from_bytes(data[at:at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    assert int.from_bytes(data[type_at:type_at + 4], "little") == info.tensor(name).type_id
    data[type_at:type_at + 4] = (99).to_bytes(4, "little")
    bad = tmp_path / "badtype.gguf"
    bad.write_bytes(bytes(data))
    code, err = _run(capsys, *_verify(bad, tmp_path / "out"))
    assert code == 2 and name in err and "99" in err and "Traceback" not in err


def test_wrong_checksum(tmp_path, capsys, monkeypatch, tiny_qwen2_f32):
    pkg = tmp_path / "site" / "badsumchunk"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "data" / "p.bin").write_bytes(tiny_qwen2_f32.read_bytes())
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    size = tiny_qwen2_f32.stat().st_size
    monkeypatch.setitem(models.REGISTRY, "badsum", models.RealModel(
        "badsum", "badsum", (("badsumchunk", "data/p.bin"),), size, "0" * 64, "qwen2", ""))
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))
    code, err = _run(capsys, *_verify("badsum", tmp_path / "out"))
    assert code == 2 and "SHA256" in err and "Traceback" not in err
    assert not any((tmp_path / "cache").glob("*.gguf"))


def test_unsupported_architecture(tmp_path, capsys):
    import numpy as np
    from gguf import GGUFWriter
    p = tmp_path / "foo.gguf"
    w = GGUFWriter(str(p), "fooarch")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    code, err = _run(capsys, *_verify(p, tmp_path / "out"))
    assert code == 2 and "Traceback" not in err and err.strip()
    assert _no_runs(tmp_path / "out")


@pytest.mark.parametrize("extra,needle", [(("--n-predict", "0"), "n-predict"),
                                          (("--n-predict", "-3"), "n-predict")])
def test_bad_n_predict(tiny_qwen2_f32, tmp_path, capsys, extra, needle):
    argv = list(_verify(tiny_qwen2_f32, tmp_path / "out"))
    i = argv.index("--n-predict")
    argv[i:i + 2] = extra
    code, err = _run(capsys, *argv)
    assert code == 2 and needle in err and "Traceback" not in err


def test_empty_prompt(tiny_qwen2_f32, tmp_path, capsys):
    argv = list(_verify(tiny_qwen2_f32, tmp_path / "out"))
    argv[argv.index(PROMPT)] = "   "
    code, err = _run(capsys, *argv)
    assert code == 2 and "empty" in err and _no_runs(tmp_path / "out")


def test_unknown_backend(tiny_qwen2_f32, tmp_path, capsys):
    argv = list(_verify(tiny_qwen2_f32, tmp_path / "out"))
    argv[argv.index("oracle,llamacpp")] = "oracle,nosuch"
    code, err = _run(capsys, *argv)
    assert code == 2 and "nosuch" in err


def test_good_run_writes_new_folder_each_time(tiny_qwen2_f32, tmp_path, capsys):
    out = tmp_path / "out"
    for _ in range(2):
        code, err = _run(capsys, *_verify(tiny_qwen2_f32, out))
        assert code == 0, err
    runs = sorted((out / "runs").iterdir())
    assert len(runs) == 2, "a second run must not overwrite the first"
    for r in runs:
        res = json.loads((r / "result.json").read_text())
        assert res["schema"] == "gguf-harness/run/1"
        assert res["model"]["sha256"] and res["machine"]["versions"]["python"]
        assert [v["verdict"] for v in res["verdicts"]] == ["PASS"]
        assert (r / "report.html").stat().st_size > 1000
        assert not list(r.glob(".*")), "temporary files left behind"


def test_reference_alone_only_with_bench(tiny_qwen2_q, tmp_path, capsys):
    """One backend as its own reference is a throughput run (e.g. llama.cpp on a model too big
    for the float64 oracle): refused without --bench, recorded without verdicts with it."""
    import json
    pytest.importorskip("llama_cpp")
    base = ["verify", "--model", str(tiny_qwen2_q), "--backends", "llamacpp", "--reference",
            "llamacpp", "--contexts", "128", "--n-predict", "4", "--out", str(tmp_path), "--no-report"]
    assert main(base) == 2
    assert "nothing to compare" in capsys.readouterr().err
    assert main(base + ["--bench", "--bench-decode", "4", "--bench-reps", "1"]) == 0
    (result,) = tmp_path.glob("runs/*/result.json")
    r = json.loads(result.read_text())
    assert r["reference"]["backend"] == "llamacpp" and len(r["reference"]["ids"]) == 4
    assert r["runs"] == [] and r["verdicts"] == []
    assert [(row["backend"], row["n_ctx"]) for row in r["bench"]["rows"]] == [("llamacpp", 128)]


def test_reader_leaving_the_pipe_is_not_a_traceback(tmp_path):
    """`harness models list | head -1`: the reader closes the pipe early; the command ends with
    the shell's SIGPIPE code 141 and no traceback on stderr (cli.main's BrokenPipeError arm)."""
    import os
    import subprocess
    import sys
    code = ("import sys\nfrom harness import cli, models\n"
            "models.REGISTRY = {f'm{i}': next(iter(models.REGISTRY.values())) for i in range(20000)}\n"
            "sys.exit(cli.main(['models', 'list']))\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env={**os.environ, "GGUF_HARNESS_CACHE": str(tmp_path)})
    p.stdout.readline()
    p.stdout.close()  # the reader leaves after one line
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_cache_variable_naming_a_file_is_one_line_exit_2(capsys, tmp_path, monkeypatch):
    """GGUF_HARNESS_CACHE pointing at a file: a clear error naming the variable, not a
    FileExistsError traceback from mkdir (found by a new-user pass, session 14)."""
    f = tmp_path / "not-a-dir"
    f.write_text("x")
    monkeypatch.setenv(models.CACHE_ENV, str(f))
    code, err = _run(capsys, "models", "list")
    assert code == 2
    assert "not a directory" in err and models.CACHE_ENV in err and "Traceback" not in err


def test_os_errors_from_the_environment_are_one_line_exit_2(capsys, monkeypatch):
    """An OSError escaping a command (an unwritable or mistyped path in the environment) ends as
    `error: ...`, exit 2 (bad input), not a traceback with exit 1 (which means a FAIL verdict)."""
    from harness import cli

    def boom(args):
        raise NotADirectoryError(20, "Not a directory", "/some/file/sub")
    monkeypatch.setattr(cli, "_cmd_models", boom)
    code, err = _run(capsys, "models", "list")
    assert code == 2
    assert "Not a directory" in err and "Traceback" not in err


@pytest.mark.parametrize("cmd", [["run"], ["verify"], ["bench", "kernels"], ["layerdiff"]])
def test_help_states_each_default_once(cmd, capsys, monkeypatch):
    """A help text that says its own default ("(default: every backend ...)") got argparse's
    "(default: None)" appended as well."""
    import re
    monkeypatch.setenv("COLUMNS", "400")
    with pytest.raises(SystemExit):
        main([*cmd, "--help"])
    out = capsys.readouterr().out
    assert not re.search(r"\(default[^)]*\) *\(default", out), out
