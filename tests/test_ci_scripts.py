"""ci/gpu-nightly.sh, ci/gate_pairs.py and .github/workflows/gpu-nightly.yml on the CPU.

The script's real stages need a GPU; here it runs as --dry-run, and end to end with a fake
`harness` (HARNESS=...) that writes result.json files and logs every call, so the stage
order, the failure handling and the gate's choice of the previous run are checked for real.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.jsonio import read_bytes

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "ci" / "gpu-nightly.sh"
PAIRS = ROOT / "ci" / "gate_pairs.py"
WORKFLOW = ROOT / ".github" / "workflows" / "gpu-nightly.yml"
STAGES = ["setup", "prewarm", "gpu-tests", "verify", "synth-27b", "bench", "report", "gate"]
Q05, Q15 = "qwen2.5-coder-0.5b-q4_k_m", "qwen2.5-coder-1.5b-q4_k_m"
KNOBS = ("OUT", "VENV", "CUDA_ARCH", "GATE_THRESHOLD", "GATE_SLOWER_BACKENDS", "MODELS", "EXTRAS",
         "WORK", "KEEP_SYNTH", "SYNTH_QUANTS", "MAKE", "HARNESS", "RUNNER_TEMP")
S7 = ROOT / "docs" / "results" / "nightly-2026-11-29-h200-s7"

# A stand-in for the `harness` command: help texts in argparse's shape, `verify` writes a
# run result the way harness.results does (OUT/runs/<folder>/result.json), every call is
# appended to $FAKE_LOG as a JSON list. FAKE_SUBS: subcommands listed by --help;
# FAKE_AB_RC: exit code of `ab`; FAKE_FAIL_MODEL: `verify` of that model exits 1;
# FAKE_TOUCH: `report` writes that file (relative to the current folder: the checkout).
FAKE = '''\
import json, os, sys, time
from datetime import datetime, timezone
from pathlib import Path
argv = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps(argv) + "\\n")
subs = os.environ.get("FAKE_SUBS", "run,verify,report,synth,ab")
if argv == ["--help"]:
    print("usage: harness [-h]\\n               {" + subs + "} ...\\n\\nCommand line: report.")
    sys.exit(0)
if argv == ["report", "--help"]:
    print("usage: harness report [-h] [--history [OUT_ROOT]] [result]")
    sys.exit(0)
if argv == ["ab", "--help"]:
    print("usage: harness ab [-h] [--threshold THRESHOLD] [--fail-on-slower] [--out OUT] a b")
    sys.exit(0)
if argv[:1] == ["verify"]:
    opt = {k: argv[argv.index(k) + 1] for k in ("--model", "--out", "--backends", "--contexts")}
    if opt["--model"] == os.environ.get("FAKE_FAIL_MODEL"):
        sys.exit(1)
    runs = Path(opt["--out"]) / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    n = len(list(runs.iterdir()))
    d = runs / f"new-{n:03d}"
    d.mkdir()
    res = {"schema": "gguf-harness/run/1", "created": datetime.now(timezone.utc).isoformat(),
           "machine": {"gpu": {"name": "NVIDIA H200"}},
           "model": {"name": Path(opt["--model"]).stem if "/" in opt["--model"] else opt["--model"],
                     "sha256": "ab" * 32},
           "settings": {"backends": opt["--backends"].split(","), "contexts": opt["--contexts"]},
           "prompt": {"ids": [1, 2, 3]}, "runs": [], "verdicts": [], "bench": {"rows": []}}
    (d / "result.json").write_text(json.dumps(res))
    sys.exit(0)
if argv[:1] == ["report"] and os.environ.get("FAKE_TOUCH"):
    Path(os.environ["FAKE_TOUCH"]).write_text("stray")
if argv[:1] == ["synth"]:
    if argv[argv.index("--quant") + 1] == os.environ.get("FAKE_SYNTH_FAIL"):
        sys.exit(2)
    Path(argv[argv.index("--out") + 1]).write_bytes(b"GGUF")
    sys.exit(0)
if argv[:1] == ["ab"]:
    sys.exit(int(os.environ.get("FAKE_AB_RC", "0")))
sys.exit(0)
'''


def _env(**over) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in KNOBS}
    env.update({k: str(v) for k, v in over.items()})
    return env


def _script(*args, script: Path = SCRIPT, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], cwd=script.parent.parent,
                          env=_env(**env), check=False, capture_output=True, text=True,
                          timeout=300)


def _result(folder: Path, model: str, created: str, gpu: str = "NVIDIA H200",
            contexts: str = "512,2048") -> Path:
    """A minimal run result of the shape the fake `verify` writes (backends from the script)."""
    backends = "oracle,llamacpp,engine" if "qwen2" in model else "llamacpp"
    res = {"schema": "gguf-harness/run/1", "created": created, "machine": {"gpu": {"name": gpu}},
           "model": {"name": model, "sha256": "ab" * 32},
           "settings": {"backends": backends.split(","), "contexts": contexts},
           "prompt": {"ids": [1, 2, 3]}, "runs": [], "verdicts": [], "bench": {"rows": []}}
    folder.mkdir(parents=True)
    (folder / "result.json").write_text(json.dumps(res))
    return (folder / "result.json").resolve()


@pytest.fixture
def fake(tmp_path):
    """(env for _script, log reader): a fake harness, OUT and WORK under tmp_path."""
    harness = tmp_path / "bin" / "harness"
    harness.parent.mkdir()
    harness.write_text(f"#!{sys.executable}\n{FAKE}")
    harness.chmod(0o755)
    log = tmp_path / "calls.jsonl"
    log.touch()
    env = {"HARNESS": harness, "OUT": tmp_path / "out", "WORK": tmp_path / "work",
           "VENV": sys.prefix, "FAKE_LOG": log}

    def calls() -> list[list[str]]:
        return [json.loads(line) for line in log.read_text().splitlines()]
    return env, calls


def _ci_dir(out: Path) -> Path:
    dirs = [d for d in (out / "ci").iterdir() if d.is_dir()]
    assert len(dirs) == 1
    return dirs[0]


def _stages(out: Path) -> dict[str, str]:
    doc = json.loads((_ci_dir(out) / "stages.json").read_text())
    assert [s["name"] for s in doc["stages"]] == STAGES
    return {s["name"]: s["status"] for s in doc["stages"]}


def _gate_rows(out: Path) -> list[list[str]]:
    lines = (_ci_dir(out) / "gate.tsv").read_text().splitlines()
    assert lines[0].split("\t") == ["outcome", "rc", "previous", "new"]
    return [line.split("\t") for line in lines[1:]]


# ---- static checks


def test_script_syntax():
    r = subprocess.run(["bash", "-n", str(SCRIPT)], check=False, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_shellcheck():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not on PATH")
    r = subprocess.run(["shellcheck", str(SCRIPT)], check=False, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


def test_workflow():
    yaml = pytest.importorskip("yaml")
    wf = yaml.safe_load(WORKFLOW.read_text())
    on = wf.get("on", wf.get(True))  # YAML 1.1 reads a bare `on` key as the boolean True
    assert on["schedule"] and all("cron" in s for s in on["schedule"])
    assert "workflow_dispatch" in on
    (job,) = wf["jobs"].values()
    assert set(job["runs-on"]) >= {"self-hosted", "gpu"}
    steps = job["steps"]
    uses = [s.get("uses", "") for s in steps]
    assert any(u.startswith("actions/checkout@") for u in uses)
    assert any("ci/gpu-nightly.sh" in s.get("run", "") for s in steps)
    (upload,) = [s for s in steps if s.get("uses", "").startswith("actions/upload-artifact@")]
    assert upload["if"] == "always()"  # the records matter most when the run failed
    assert upload["with"]["path"].rstrip("/") == "out"


# ---- --dry-run


def test_dry_run_lists_every_stage_in_order(tmp_path):
    out = tmp_path / "out"
    r = _script("--dry-run", OUT=out, GATE_THRESHOLD="0.07")
    assert r.returncode == 0, r.stderr
    heads = [line.split()[-1] for line in r.stdout.splitlines() if line.startswith("==> stage ")]
    assert heads == STAGES
    text = r.stdout
    for model in (Q05, Q15):
        assert (f"harness verify --model {model} --backends oracle,llamacpp,engine "
                f"--contexts 512,2048 --bench --out {out}") in text
    assert "-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90" in text and "make setup" in text
    assert "EXTRAS=gpu,qwen05b,qwen15b" in text
    assert "-m pytest -m gpu" in text
    assert "harness synth --preset qwen35-27b --quant ud-q4_k_m" in text
    assert "--backends llamacpp,engine --reference llamacpp --contexts 512,2048 --n-predict 129 --bench" in text
    # only the engine's SLOWER fails the gate by default (ci/README.md: references' noise)
    assert "harness ab PREV NEW --threshold 0.07 --fail-on-slower engine\n" in text
    assert "GATE_SLOWER_BACKENDS=engine" in text
    assert f"harness report --history {out}" in text
    for stage in STAGES:  # seconds are whole and may tick over on a busy machine
        assert re.search(rf"^stage {stage}: \d+ s \(dry-run\)$", text, re.MULTILINE), stage
    assert not out.exists()  # a dry run writes nothing


def test_dry_run_skip_and_only(tmp_path):
    r = _script("--skip", "gpu-tests", "--dry-run", OUT=tmp_path / "out")
    assert r.returncode == 0, r.stderr
    assert "==> stage gpu-tests" not in r.stdout and "-m pytest" not in r.stdout
    assert "stage gpu-tests: not selected" in r.stdout
    assert "==> stage setup" in r.stdout and "==> stage gate" in r.stdout
    r = _script("--only", "verify,gate", "--dry-run", OUT=tmp_path / "out",
                MODELS=f"{Q15},/m/x.gguf")
    heads = [line.split()[-1] for line in r.stdout.splitlines() if line.startswith("==> stage ")]
    assert r.returncode == 0 and heads == ["verify", "gate"]
    assert f"--model {Q15} " in r.stdout and "--model /m/x.gguf " in r.stdout
    assert Q05 not in r.stdout


@pytest.mark.parametrize("args,env", [
    (["--skip", "nosuchstage"], {}),
    (["--only"], {}),
    (["--frobnicate"], {}),
    ([], {"GATE_THRESHOLD": "five"}),
    ([], {"CUDA_ARCH": "90 $(id)"}),
    ([], {"GATE_SLOWER_BACKENDS": "engine llamacpp"}),
    ([], {"GATE_SLOWER_BACKENDS": "engine,"}),
    ([], {"GATE_SLOWER_BACKENDS": "$(id)"}),
    (["--only", "gate", "--skip", "gate"], {}),  # selects nothing
])
def test_bad_arguments_exit_2(tmp_path, args, env):
    r = _script(*args, "--dry-run", OUT=tmp_path / "out", **env)
    assert r.returncode == 2 and "error:" in r.stderr
    assert "==> stage" not in r.stdout


# ---- end to end with a fake harness


def test_nightly_gate_compares_with_previous_run(fake):
    env, calls = fake
    runs = env["OUT"] / "runs"
    _result(runs / "a-old", Q05, "2026-01-01T00:00:00+00:00")
    prev = _result(runs / "b-prev", Q05, "2026-01-02T00:00:00+00:00")
    _result(runs / "c-other-gpu", Q05, "2026-01-03T00:00:00+00:00", gpu="NVIDIA A100")
    r = _script("--skip", "setup,gpu-tests", **env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert _stages(env["OUT"]) == {"setup": "not-selected", "prewarm": "skipped", "gpu-tests": "not-selected",
                                   "verify": "ok", "synth-27b": "ok", "bench": "skipped",
                                   "report": "ok", "gate": "ok"}
    assert "bench: skipped: not implemented" in r.stdout
    assert "prewarm: skipped: not implemented" in r.stdout
    log = calls()
    verified = [c[c.index("--model") + 1] for c in log if c[0] == "verify"]
    assert verified == [Q05, Q15, str(env["WORK"] / "qwen35-27b.gguf")]
    assert ["report", "--history", str(env["OUT"])] in log
    ab = [c for c in log if c[:1] == ["ab"] and c != ["ab", "--help"]]
    assert len(ab) == 1  # 1.5B and the 27B have no earlier run: baselines
    assert ab[0][1] == str(prev) and Path(ab[0][2]).parent.name.startswith("new-")
    assert ab[0][3:] == ["--threshold", "0.05", "--fail-on-slower", "engine", "--out",
                         str(_ci_dir(env["OUT"]) / "ab")]
    doc = json.loads((_ci_dir(env["OUT"]) / "stages.json").read_text())
    assert doc["gate_slower_backends"] == "engine" and doc["gate_threshold"] == 0.05
    assert isinstance(doc["git_dirty"], bool)
    rows = _gate_rows(env["OUT"])
    assert sorted(r[0] for r in rows) == ["baseline", "baseline", "pass"]
    assert not (env["WORK"] / "qwen35-27b.gguf").exists()  # removed unless KEEP_SYNTH=1
    for stage in ("verify", "gate"):
        assert (_ci_dir(env["OUT"]) / f"{stage}.log").stat().st_size > 0


def test_nightly_synth_27b_runs_each_mix_of_synth_quants(fake):
    """SYNTH_QUANTS=ud-q4_k_m,q4_k_m: the stage synthesises and verifies each mix in turn (ud
    keeps the earlier nightlies' file name, so the gate still pairs its runs), deleting each
    file; a mix whose synth fails fails the stage but the next mix still runs."""
    env, calls = fake
    r = _script("--only", "synth-27b", SYNTH_QUANTS="ud-q4_k_m,q4_k_m", **env)
    assert r.returncode == 0, r.stdout + r.stderr
    log = calls()
    assert [c[c.index("--quant") + 1] for c in log if c[0] == "synth"] == ["ud-q4_k_m", "q4_k_m"]
    assert [c[c.index("--model") + 1] for c in log if c[0] == "verify"] == [
        str(env["WORK"] / "qwen35-27b.gguf"), str(env["WORK"] / "qwen35-27b-q4_k_m.gguf")]
    assert not list(env["WORK"].glob("*.gguf"))
    r = _script("--only", "synth-27b", SYNTH_QUANTS="nope,q4_k_m", FAKE_SYNTH_FAIL="nope", **env)
    assert r.returncode == 1 and "FAILED stage(s): synth-27b" in r.stderr
    assert [c[c.index("--model") + 1] for c in calls() if c[0] == "verify"][-1] == \
        str(env["WORK"] / "qwen35-27b-q4_k_m.gguf")


@pytest.mark.parametrize("knob", ["all", "engine,llamacpp"])
def test_nightly_passes_gate_slower_backends(fake, knob):
    env, calls = fake
    _result(env["OUT"] / "runs" / "prev", Q05, "2026-01-02T00:00:00+00:00")
    r = _script("--only", "verify,gate", MODELS=Q05, GATE_SLOWER_BACKENDS=knob, **env)
    assert r.returncode == 0, r.stdout + r.stderr
    (ab,) = [c for c in calls() if c[:1] == ["ab"] and c[1] != "--help"]
    assert ab[3:7] == ["--threshold", "0.05", "--fail-on-slower", knob]
    assert f"SLOWER fails for: {knob})" in r.stdout


def test_nightly_failed_gate_and_stage_do_not_stop_later_stages(fake):
    env, calls = fake
    runs = env["OUT"] / "runs"
    _result(runs / "prev05", Q05, "2026-01-02T00:00:00+00:00")
    r = _script("--skip", "setup,gpu-tests", FAKE_AB_RC=1, FAKE_FAIL_MODEL=Q15,
                FAKE_SUBS="run,verify,synth,ab,report", **env)
    assert r.returncode == 1
    assert "FAILED stage(s): verify gate" in r.stderr
    stages = _stages(env["OUT"])
    assert stages["verify"] == "failed" and stages["gate"] == "failed"
    assert stages["synth-27b"] == "ok" and stages["report"] == "ok"
    assert any(c[:1] == ["synth"] for c in calls())  # ran after the failed verify
    rows = _gate_rows(env["OUT"])
    assert [r[:2] for r in rows if r[0] != "baseline"] == [["FAIL", "1"]]


def test_prewarm_stage_runs_harness_prewarm_when_listed(fake):
    """The prewarm stage calls `harness prewarm` (no arguments: the builds of the environment's
    switches) when `harness --help` lists it; the dry run shows that command."""
    env, calls = fake
    r = _script("--only", "prewarm", FAKE_SUBS="run,verify,prewarm", **env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert _stages(env["OUT"])["prewarm"] == "ok"
    assert ["prewarm"] in calls()
    dry = _script("--dry-run", "--only", "prewarm", **env)
    assert re.search(r"^\+ \S*harness prewarm$", dry.stdout, re.MULTILINE), dry.stdout


def test_nightly_bad_ab_input_fails_the_gate(fake):
    env, _ = fake
    _result(env["OUT"] / "runs" / "prev", Q05, "2026-01-02T00:00:00+00:00")
    r = _script("--only", "verify,gate", FAKE_AB_RC=2, MODELS=Q05, **env)
    assert r.returncode == 1
    assert [row[:2] for row in _gate_rows(env["OUT"])] == [["bad-input", "2"]]


def test_nightly_gate_without_ab_fails(fake):
    env, _ = fake
    r = _script("--only", "gate", FAKE_SUBS="run,verify,report", **env)
    assert r.returncode == 1 and _stages(env["OUT"])["gate"] == "failed"
    assert "lists no ab command" in r.stdout


def test_gate_alone_compares_newest_with_the_one_before(fake):
    env, calls = fake
    runs = env["OUT"] / "runs"
    # folder names in the opposite order of the created times: the order must come from JSON
    newest = _result(runs / "1", Q05, "2026-01-03T00:00:00+00:00")
    before = _result(runs / "2", Q05, "2026-01-02T00:00:00+00:00")
    _result(runs / "3", Q05, "2026-01-01T00:00:00+00:00")
    r = _script("--only", "gate", **env)
    assert r.returncode == 0, r.stdout + r.stderr
    ab = [c for c in calls() if c[:1] == ["ab"] and c[1] != "--help"]
    assert [c[1:3] for c in ab] == [[str(before), str(newest)]]


def test_setup_failure_stops_the_run(fake):
    env, calls = fake
    r = _script(MAKE="false", **env)
    assert r.returncode == 1
    assert "==> stage setup" in r.stdout and "==> stage gpu-tests" not in r.stdout
    assert "setup failed" in r.stderr
    stages = _stages(env["OUT"])
    assert stages["setup"] == "failed" and stages["gate"] == "not-run"
    assert calls() == []


def test_missing_harness_stops_the_run(tmp_path):
    r = _script("--skip", "setup", OUT=tmp_path / "out", VENV=tmp_path / "no-venv")
    assert r.returncode == 1 and "no harness at" in r.stderr
    assert "==> stage gpu-tests" not in r.stdout


def test_second_run_gets_its_own_record_folder(fake):
    env, _ = fake
    for _ in range(2):
        assert _script("--only", "report", **env).returncode == 0
    folders = [d for d in (env["OUT"] / "ci").iterdir() if d.is_dir()]
    assert len(folders) == 2 and all((d / "stages.json").is_file() for d in folders)


# ---- ci/gate_pairs.py


def _pairs(runs: Path, before: Path | None = None) -> list[list[str]]:
    args = [sys.executable, str(PAIRS), str(runs)] + (["--before", str(before)] if before else [])
    r = subprocess.run(args, check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return [line.split("\t") for line in r.stdout.splitlines()]


def test_pairs_with_before_list(tmp_path):
    runs = tmp_path / "runs"
    old = _result(runs / "o1", Q05, "2026-01-01T00:00:00+00:00")
    old2 = _result(runs / "o2", Q05, "2026-01-02T00:00:00+00:00")
    other = _result(runs / "o3", Q05, "2026-01-02T00:00:00+00:00", contexts="512")
    listed = tmp_path / "before.txt"
    listed.write_text(f"{old}\n{old2}\n{other}\n")
    new05 = _result(runs / "n1", Q05, "2026-01-05T00:00:00+00:00")
    new_ctx = _result(runs / "n2", Q05, "2026-01-06T00:00:00+00:00", contexts="1024")
    bad = runs / "n3" / "result.json"
    bad.parent.mkdir()
    bad.write_text("{not json")
    assert _pairs(runs, listed) == [["!", str(bad.resolve())], [str(old2), str(new05)],
                                    ["-", str(new_ctx)]]


def test_pairs_newest_per_group_and_empty(tmp_path):
    assert _pairs(tmp_path / "missing") == []
    runs = tmp_path / "runs"
    a = _result(runs / "a", Q05, "2026-01-01T00:00:00+00:00")
    b = _result(runs / "b", Q05, "2026-01-02T00:00:00+00:00")
    c = _result(runs / "c", Q15, "2026-01-01T00:00:00+00:00")
    assert sorted(_pairs(runs)) == sorted([[str(a), str(b)], ["-", str(c)]])


def test_pairs_missing_before_file_is_bad_input(tmp_path):
    r = subprocess.run([sys.executable, str(PAIRS), str(tmp_path), "--before",
                        str(tmp_path / "nope.txt")], check=False, capture_output=True, text=True)
    assert r.returncode == 2 and "error:" in r.stderr and "Traceback" not in r.stderr


def test_readme_names_every_stage_and_knob():
    text = (ROOT / "ci" / "README.md").read_text()
    for word in STAGES + [k for k in KNOBS if k != "RUNNER_TEMP"]:
        assert f"`{word}`" in text, word
    assert "ci/gpu-nightly.sh --dry-run" in text


# ---- the checkout: what the nightly writes into it (session 7: "e783cc3 dirty")


def _checkout(tmp_path: Path) -> Path:
    """A git repository with the nightly, gate_pairs.py and the project's .gitignore."""
    repo = tmp_path / "repo"
    (repo / "ci").mkdir(parents=True)
    for f in (SCRIPT, PAIRS):
        shutil.copy2(f, repo / "ci" / f.name)
    shutil.copy(ROOT / ".gitignore", repo / ".gitignore")
    (repo / "tracked.txt").write_text("v1\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.invalid"]
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "tree"]):
        subprocess.run(git + cmd, check=True, capture_output=True)
    return repo


def _porcelain(repo: Path) -> str:
    return subprocess.run(["git", "-C", str(repo), "status", "--porcelain",
                           "--untracked-files=all"], check=True, capture_output=True,
                          text=True).stdout


def test_nightly_writes_nothing_into_the_checkout(fake, tmp_path):
    """Default OUT (out/, git-ignored): after every stage but setup, git status is empty,
    the records say so, and stages.json has git_dirty false."""
    env, _ = fake
    repo = _checkout(tmp_path)
    env = {k: v for k, v in env.items() if k != "OUT"}
    r = _script("--skip", "setup,gpu-tests", script=repo / "ci" / SCRIPT.name, **env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert _porcelain(repo) == ""
    ci = _ci_dir(repo / "out")
    assert (ci / "git-status-start.txt").read_text() == ""
    assert (ci / "git-status-end.txt").read_text() == ""
    assert json.loads((ci / "stages.json").read_text())["git_dirty"] is False
    assert "note:" not in r.stdout


def test_nightly_names_changed_tracked_and_stray_files(fake, tmp_path):
    env, _ = fake
    repo = _checkout(tmp_path)
    (repo / "tracked.txt").write_text("v2\n")  # an uncommitted edit: results say "dirty"
    r = _script("--only", "report", FAKE_TOUCH="stray.txt", script=repo / "ci" / SCRIPT.name,
                **env)
    assert r.returncode == 0, r.stdout + r.stderr
    ci = _ci_dir(env["OUT"])
    assert json.loads((ci / "stages.json").read_text())["git_dirty"] is True
    assert "uncommitted changes to tracked files" in r.stdout and " M tracked.txt" in r.stdout
    assert (ci / "git-status-start.txt").read_text() == " M tracked.txt\n"
    assert (ci / "git-status-end.txt").read_text() == " M tracked.txt\n?? stray.txt\n"
    assert "the checkout changed during this run" in r.stdout and "> ?? stray.txt" in r.stdout


@pytest.mark.skipif(not (S7 / "verify-run1-897e202.json.gz").is_file(),
                    reason="H200 session 7 records not present")
@pytest.mark.parametrize("knob,outcome", [("engine", "pass"), ("all", "FAIL")])
def test_gate_on_the_h200_results_with_the_real_harness(tmp_path, knob, outcome):
    """`--only gate` with the real `harness ab` over the two H200 nightly results of the same
    code (docs/results/nightly-2026-11-29-h200-s7): llama.cpp's prefill at c=512 is SLOWER
    (-7.69 %), every engine figure SAME. Gated on the engine it passes; on all, it fails."""
    harness = tmp_path / "bin" / "harness"
    harness.parent.mkdir()
    harness.write_text(f"#!/bin/sh\nPYTHONPATH={ROOT} exec {sys.executable} -m harness.cli \"$@\"\n")
    harness.chmod(0o755)
    out = tmp_path / "out"
    for i, name in enumerate(["verify-run1-897e202.json.gz", "verify-run2-e783cc3.json.gz"]):
        (out / "runs" / f"r{i}").mkdir(parents=True)  # stored gzipped; a nightly writes plain
        (out / "runs" / f"r{i}" / "result.json").write_bytes(read_bytes(S7 / name))
    r = _script("--only", "gate", HARNESS=harness, VENV=sys.prefix, OUT=out,
                GATE_SLOWER_BACKENDS=knob)
    assert r.returncode == (0 if outcome == "pass" else 1), r.stdout + r.stderr
    assert [row[0] for row in _gate_rows(out)] == [outcome]
    (ab_dir,) = (_ci_dir(out) / "ab").iterdir()
    doc = json.loads((ab_dir / "ab.json").read_text())
    slower = [(p["backend"], p["metric"], p["n_ctx"]) for p in doc["perf"]
              if p["verdict"] == "SLOWER"]
    assert slower == [("llamacpp", "prefill_tok_s", 512)] and doc["failures"] == 0
    assert all(p["verdict"] == "SAME" for p in doc["perf"] if p["backend"] == "engine")
