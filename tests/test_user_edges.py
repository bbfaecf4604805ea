"""Edge cases found by trying the newer commands as a new user (plan, ab, bench-table,
report --history, bench nodes) with hostile input: each must end in one `error:` line on
stderr and exit 2, never a traceback, and must not touch files it was only asked to read."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from harness.cli import main
from harness.jsonio import load_json, read_bytes

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
V4 = RESULTS / "2026-11-29-h200-qwen2.5-coder-0.5b-q4_k_m-engine-v4.json.gz"  # stored gzipped


def one_error_line(err: str) -> str:
    """The stderr of a bad-input exit: exactly one line, starting with `error:`."""
    assert err.startswith("error:"), repr(err[:200])
    assert err.count("\n") == 1 and err.endswith("\n"), repr(err[:400])
    assert "Traceback" not in err
    return err


@pytest.fixture
def deep_json(tmp_path) -> Path:
    """Valid JSON nested deeper than Python's recursion limit: json.loads raises
    RecursionError, which is not a ValueError."""
    p = tmp_path / "deep.json"
    p.write_text("[" * 100_000 + "]" * 100_000)
    return p


@pytest.mark.parametrize("argv", [
    lambda deep: ["ab", str(V4), str(deep)],
    lambda deep: ["ab", str(deep), str(V4)],
    lambda deep: ["bench-table", str(deep)],
    lambda deep: ["report", str(deep)],
], ids=["ab-b", "ab-a", "bench-table", "report"])
def test_deeply_nested_result_is_bad_input(argv, deep_json, capsys):
    assert main(argv(deep_json)) == 2
    one_error_line(capsys.readouterr().err)


def test_history_skips_a_deeply_nested_result(tmp_path, capsys):
    out = tmp_path / "OUT"
    (out / "runs" / "bad").mkdir(parents=True)
    (out / "runs" / "bad" / "result.json").write_text("[" * 100_000 + "]" * 100_000)
    (out / "runs" / "good").mkdir()
    shutil.copy(V4, out / "runs" / "good" / "result.json.gz")
    before = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in (out / "runs").rglob("*")
              if p.is_file()}
    assert main(["report", "--history", str(out)]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "runs/bad/result.json" in err  # named in a warning, then skipped
    assert (out / "reports" / "index.html").is_file()
    after = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in (out / "runs").rglob("*")
             if p.is_file()}
    assert after == before


def test_bench_nodes_without_gpu_fails_before_touching_the_model(monkeypatch, capsys):
    import backends.registry
    import harness.models

    def unavailable():
        return {"llamacpp": None, "oracle": None, "engine": "no CUDA device found"}

    def no_resolve(*a, **k):
        raise AssertionError("the model was resolved before the GPU check")

    monkeypatch.setattr(backends.registry, "available_backends", unavailable)
    monkeypatch.setattr(harness.models, "resolve", no_resolve)
    assert main(["bench", "nodes"]) == 2
    err = one_error_line(capsys.readouterr().err)
    assert "no CUDA device found" in err


@pytest.mark.parametrize("text", ["", "[]", "\n\n"], ids=["empty", "empty-array", "blank-lines"])
def test_llama_bench_file_without_records_is_bad_input(text, tmp_path, capsys):
    lb = tmp_path / "lb.json"
    lb.write_text(text)
    assert main(["bench-table", str(V4), "--llama-bench", str(lb)]) == 2
    err = one_error_line(capsys.readouterr().err)
    assert "lb.json" in err


def test_error_after_a_model_lookup_is_one_line(tmp_path, capsys):
    # the transient byte-count bar used to leave an empty line before `error:` off a terminal
    assert main(["plan", "--model", str(tmp_path / "missing.gguf"), "--free", "1"]) == 2
    one_error_line(capsys.readouterr().err)


def test_synth_error_is_one_line(tmp_path, capsys):
    # the transient bytes bar of `harness synth` left an empty line before `error:` off a
    # terminal (an unknown preset is only found once the writer starts)
    assert main(["synth", "--preset", "nope", "--out", str(tmp_path / "x.gguf")]) == 2
    assert "nope" in one_error_line(capsys.readouterr().err)
    assert not list(tmp_path.iterdir())


def test_bench_out_that_is_a_file_fails_before_the_benchmark(tmp_path, monkeypatch, capsys):
    """--out FILE used to surface after the whole GPU benchmark, as a FileExistsError
    traceback from new_run_dir, with the measurements lost."""
    import backends.registry
    import harness.bench_kernels
    import harness.gpu
    import harness.models
    out = tmp_path / "out"
    out.write_text("an earlier file")

    def boom(*a, **k):
        raise AssertionError("the benchmark started before --out was checked")
    monkeypatch.setattr(harness.gpu, "require_cupy", lambda: None)
    monkeypatch.setattr(harness.bench_kernels, "run_kernels", boom)
    assert main(["bench", "kernels", "--shapes", "attn_k", "--out", str(out)]) == 2
    assert "not a folder" in one_error_line(capsys.readouterr().err)
    monkeypatch.setattr(backends.registry, "available_backends",
                        lambda: {"llamacpp": None, "oracle": None, "engine": None})
    monkeypatch.setattr(harness.models, "resolve", boom)
    assert main(["bench", "nodes", "--out", str(out)]) == 2
    assert "not a folder" in one_error_line(capsys.readouterr().err)
    assert out.read_text() == "an earlier file"


@pytest.mark.parametrize("cmd", [["verify", "--n-predict", "2", "--contexts", "128"],
                                 ["layerdiff"]])
def test_empty_out_is_bad_input(cmd, tmp_path, monkeypatch, capsys):
    # --out "$OUT" with OUT unset: Path("") is ".", so runs/ went into the working folder
    from harness.synth.presets import write_preset
    model = write_preset("qwen2-tiny", tmp_path / "m" / "tiny.gguf")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert main([*cmd, "--model", str(model), "--out", ""]) == 2
    assert "--out" in one_error_line(capsys.readouterr().err)
    assert not list(cwd.iterdir())


def test_result_json_is_still_read(capsys):
    # guard for the fixes above: a real result still gives a table
    assert main(["bench-table", str(V4), "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["test"] for r in rows} == {"pp70", "tg128"}


# ---- ci/gate_pairs.py: one malformed result in OUT/runs must not break every later gate

PAIRS = Path(__file__).resolve().parent.parent / "ci" / "gate_pairs.py"


def _gate_pairs(runs: Path, before: Path) -> list[list[str]]:
    import subprocess
    import sys
    r = subprocess.run([sys.executable, str(PAIRS), str(runs), "--before", str(before)], check=False,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    return [line.split("\t") for line in r.stdout.splitlines()]


def _bad_results() -> dict[str, str]:
    good = load_json(V4)
    out = {"deep": "[" * 100_000 + "]" * 100_000}
    for key, value in (("model", "x"), ("machine", [1]), ("prompt", 5)):
        out[f"{key}-not-an-object"] = json.dumps(good | {key: value})
    out["gpu-not-an-object"] = json.dumps(good | {"machine": good["machine"] | {"gpu": "H200"}})
    return out


@pytest.mark.parametrize("name", list(_bad_results()))
def test_gate_pairs_survives_a_malformed_result(name, tmp_path):
    runs = tmp_path / "runs"
    (runs / "good").mkdir(parents=True)
    (runs / "good" / "result.json").write_bytes(read_bytes(V4))  # a nightly's runs are plain
    (runs / "bad").mkdir()
    bad = runs / "bad" / "result.json"
    bad.write_text(_bad_results()[name])
    before = tmp_path / "before.txt"
    before.write_text("")  # both results are new in this nightly
    lines = _gate_pairs(runs, before)
    # the good one is a baseline; the bad one is either reported unreadable ('!') or a
    # baseline of its own group ('-'), never a crash
    assert ["-", str((runs / "good" / "result.json").resolve())] in lines
    assert any(line[1] == str(bad.resolve()) and line[0] in ("!", "-") for line in lines)


def test_a_backend_listed_twice_counts_once(tmp_path, capsys):
    """`--backends oracle,oracle` is the reference alone: nothing to compare (exit 2), not an
    empty result with exit 0; a repeated backend otherwise runs once."""
    from harness import main_job
    out = tmp_path / "out"
    assert main(["verify", "--backends", "oracle,oracle", "--model", "nosuch.gguf",
                 "--out", str(out)]) == 2
    assert "nothing to compare" in one_error_line(capsys.readouterr().err)
    assert not list(out.rglob("result.json"))
    assert main_job._choose_backends("oracle, oracle", "oracle", bench=True)[0] == ["oracle"]


def _hand_edited(tmp_path, edit) -> Path:
    """V4 with one hand edit (valid JSON, wrong types), written as a plain .json."""
    doc = load_json(V4)
    edit(doc)
    p = tmp_path / "edited.json"
    p.write_text(json.dumps(doc))
    return p


def _set_run(key, value):
    def edit(doc):
        doc["runs"][0][key] = value
    return edit


def _set_divergence_ids(doc):  # first-divergence token ids that are an object and a list
    d = doc["runs"][0]["summary"]["first_divergence"]
    d["ref_id"], d["id"] = {"id": 1}, [2]
    d["ref_top5"][0][0] = {"id": 1}
    doc["reference"]["ids"][0] = [3]


@pytest.mark.parametrize("edit", [_set_run("n_ctx", [512]), _set_run("n_ctx", {"a": 1}),
                                  _set_run("mode", {"x": 1})])
@pytest.mark.parametrize("side", ["a", "b"])
def test_ab_of_a_result_with_unhashable_fields_is_no_traceback(edit, side, tmp_path, capsys):
    """A hand-edited result whose run n_ctx / mode is a list or object: harness ab compares
    it (the run is then missing or new: a failure, exit 1) or refuses it, never a TypeError."""
    bad = _hand_edited(tmp_path, edit)
    argv = ["ab", str(V4), str(bad)] if side == "b" else ["ab", str(bad), str(V4)]
    assert main(argv + ["--force"]) in (1, 2)
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("edit", [_set_run("mode", {"x": 1}), _set_run("mode", [1]),
                                  _set_divergence_ids, _set_run("n_ctx", [512])])
def test_report_of_a_result_with_wrong_types_is_one_line(edit, tmp_path, capsys):
    """harness report on a hand-edited result (a run's mode an object, token ids that are
    objects or lists): fields of the wrong type read as absent or shown as text
    (harness/jsonread.py's rule), so the report renders; never a TypeError."""
    bad = _hand_edited(tmp_path, edit)
    assert main(["report", str(bad)]) == 0
    assert "Traceback" not in capsys.readouterr().err
    assert (tmp_path / "edited.report.html").stat().st_size > 0


KERNELS = RESULTS / "nightly-2026-11-29-h200-s8" / "kernels-inv2-867779a.json.gz"


def _kernels_edit(doc):  # one row with each field of the wrong type, another without modes
    rows = doc["rows"]
    rows[0]["check"] = "ok"
    rows[0]["modes"] = {m: [1] for m in rows[0]["modes"]}
    rows[1]["modes"] = 7
    if len(rows) > 2:
        mode = next(iter(rows[2]["modes"]))
        rows[2]["modes"][mode] = {"kernel": {"us": 1.0, "noise": 0.0, "n": "many"}}


@pytest.mark.parametrize("side", ["a", "b"])
def test_ab_of_hand_edited_kernels_results_is_no_traceback(side, tmp_path, capsys):
    """harness ab of two bench kernels results, one hand-edited (a row's check a string, its
    modes lists, modes a number, a sample count that is text): compared as far as it can be
    (wrong types read as absent), never an AttributeError / TypeError traceback."""
    doc = load_json(KERNELS)
    _kernels_edit(doc)
    bad = tmp_path / "kernels.json"
    bad.write_text(json.dumps(doc))
    argv = ["ab", str(KERNELS), str(bad)] if side == "b" else ["ab", str(bad), str(KERNELS)]
    assert main(argv) in (0, 1)
    assert "Traceback" not in capsys.readouterr().err


S36 = RESULTS / "2026-12-04-h200-qwen35-27b-ud-q4_k_m-engine-vs-llamacpp-s36.json.gz"


@pytest.mark.parametrize("i", [{"a": 1}, 1e300, "x", [0], True])
def test_report_of_a_step_index_of_the_wrong_type_renders(i, tmp_path, capsys):
    """A hand-edited step position ("i") that is an object, a float beyond int64, text, a
    list or a boolean: the report plots the step at its index in the list, as it does a step
    without one (TypeError / OverflowError tracebacks, or an error for a ValueError, before)."""
    doc = load_json(S36)
    for run in doc["runs"]:
        for step in (run.get("steps") or [])[1:2]:
            step["i"] = i
    p = tmp_path / "steps.json"
    p.write_text(json.dumps(doc))
    assert main(["report", str(p)]) == 0
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("preset", ["qwen2-tiny", "qwen35-tiny"])
@pytest.mark.parametrize("seed", ["-1", str(2**64)])
def test_synth_seed_out_of_range_is_one_line(preset, seed, tmp_path, capsys):
    """--seed is stored as a uint64 (harness.synth.seed): a negative or too large one is bad
    input before anything is written (a struct.error / numpy ValueError traceback before)."""
    out = tmp_path / "m.gguf"
    assert main(["synth", "--preset", preset, "--seed", seed, "--out", str(out)]) == 2
    assert "--seed" in one_error_line(capsys.readouterr().err)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("pair", [(V4, V4), (KERNELS, KERNELS)])
@pytest.mark.parametrize("bad_out", ["file", "empty"])
def test_ab_bad_out_fails_before_the_comparison(pair, bad_out, tmp_path, monkeypatch, capsys):
    """harness ab --out FILE (or an empty --out) printed the whole comparison first and only
    then failed on the folder (an empty --out wrote ab.json/ab.html into the working folder);
    now it is refused first, one line, exit 2, nothing on stdout, nothing written."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    out = tmp_path / "out"
    out.write_text("an earlier file")
    arg = str(out) if bad_out == "file" else ""
    assert main(["ab", str(pair[0]), str(pair[1]), "--out", arg]) == 2
    got = capsys.readouterr()
    assert "--out" in one_error_line(got.err)
    assert got.out == ""
    assert out.read_text() == "an earlier file"
    assert not list(cwd.iterdir())


def test_llama_bench_file_that_is_one_json_object_says_so(tmp_path, capsys):
    """A pretty-printed JSON object (e.g. a harness result given as --llama-bench by mistake)
    was read as JSONL and refused as "not JSON or JSONL: Expecting property name ... line 1";
    it is valid JSON, so the error says what it is instead."""
    lb = tmp_path / "lb.json"
    lb.write_text(json.dumps(load_json(V4), indent=1))
    assert main(["bench-table", str(V4), "--llama-bench", str(lb)]) == 2
    err = one_error_line(capsys.readouterr().err)
    assert "not JSON" not in err and "array" in err


@pytest.mark.parametrize("n_layer", [0, 513, 2**32 - 1])
def test_block_count_out_of_range_is_refused_before_llama_cpp(n_layer, tmp_path, monkeypatch,
                                                              capsys):
    """A header whose block_count is 0 (or over llama.cpp's LLAMA_MAX_LAYERS, 512) made the
    llama.cpp tokeniser child abort on a GGML_ASSERT (SIGABRT, a 40-line backtrace); the
    header is refused first, one line, exit 2."""
    import struct

    from harness import main_job
    from harness.synth.presets import write_preset
    model = write_preset("qwen2-tiny", tmp_path / "tiny.gguf")
    raw = bytearray(model.read_bytes())
    key = b"qwen2.block_count"
    at = raw.find(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    assert struct.unpack_from("<I", raw, at)[0] == 4  # GGUF UINT32
    struct.pack_into("<I", raw, at + 4, n_layer)
    model.write_bytes(bytes(raw))

    def boom(*a, **k):
        raise AssertionError("llama.cpp was started on the bad header")
    monkeypatch.setattr(main_job, "tokenize_prompt", boom)
    assert main(["verify", "--backends", "oracle", "--bench", "--model", str(model),
                 "--out", str(tmp_path / "out")]) == 2
    assert "block_count" in one_error_line(capsys.readouterr().err)
    assert main(["layerdiff", "--model", str(model), "--out", str(tmp_path / "out")]) == 2
    assert "block_count" in one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("cmd", [["verify", "--backends", "oracle", "--bench"], ["layerdiff"]])
def test_threads_beyond_ggml_max_is_bad_input(cmd, tmp_path, capsys):
    """--threads 100000 crashed the llama.cpp child (SIGSEGV while creating threads), shown as
    a run ERROR with exit 1; a count over ggml's GGML_MAX_N_THREADS (512) is bad input."""
    out = tmp_path / "out"
    assert main([*cmd, "--threads", "100000", "--model", "nosuch.gguf", "--out", str(out)]) == 2
    assert "threads" in one_error_line(capsys.readouterr().err)
    assert not list(out.rglob("*.json"))


def test_prompt_that_is_not_utf8_is_bad_input(tmp_path, monkeypatch, capsys):
    """--prompt with bytes that are not UTF-8 (Python passes them as surrogates) failed inside
    the tokeniser child ("tokenize() raised builtins.UnicodeEncodeError"); refused up front."""
    from harness import main_job

    def boom(*a, **k):
        raise AssertionError("the tokeniser was started")
    monkeypatch.setattr(main_job, "tokenize_prompt", boom)
    assert main(["verify", "--backends", "oracle", "--bench", "--prompt", "a\udcff\udcfe",
                 "--model", "nosuch.gguf", "--out", str(tmp_path / "out")]) == 2
    assert "UTF-8" in one_error_line(capsys.readouterr().err)
    assert main(["layerdiff", "--prompt", "a\udcff", "--model", "nosuch.gguf",
                 "--out", str(tmp_path / "out")]) == 2
    assert "UTF-8" in one_error_line(capsys.readouterr().err)


def test_ab_mismatch_names_a_missing_model_sha():
    """Two results without a model SHA256 were "model SHA256 differs (None vs None)"."""
    from harness import ab
    doc = {"model": {}}
    assert ab.mismatches(doc, doc)[0] == "model SHA256 missing in A and B"
    assert ab.mismatches({"model": {"sha256": "ab" * 32}}, doc)[0] == "model SHA256 missing in B"
    assert ab.mismatches({"model": {"sha256": "ab" * 32}},
                         {"model": {"sha256": "cd" * 32}})[0] == \
        "model SHA256 differs (abababababab vs cdcdcdcdcdcd)"


@pytest.mark.parametrize("spec", ["0", "-5", "7,512"])
def test_contexts_below_the_minimum_are_refused_before_the_model(spec, tmp_path, monkeypatch, capsys):
    """`--contexts 0` was refused only after the model was resolved and opened (RunConfig's
    bound); now it is bad input first: exit 2, one line, the model never looked up."""
    from harness import models

    def no_lookup(*a, **k):
        raise AssertionError("the model was resolved before --contexts was checked")
    monkeypatch.setattr(models, "resolve", no_lookup)
    out = tmp_path / "out"
    assert main(["verify", "--model", str(tmp_path / "none.gguf"), "--backends", "oracle",
                 "--contexts", spec, "--out", str(out)]) == 2
    cap = capsys.readouterr()
    err = cap.out + cap.err
    assert "--contexts must be >= 8" in err and "Traceback" not in err
    assert not out.exists() or not any(out.rglob("*.json"))  # no result written
