#!/usr/bin/env bash
# GPU nightly: CUDA set-up, GPU tests, verification + throughput of the real models and of the
# synthetic 27B, kernel/node benchmarks, the history report, and a regression gate against the
# previous run of each model + settings. Run by .github/workflows/gpu-nightly.yml on a
# self-hosted GPU runner, or by hand on any GPU machine. Stages, knobs and the gate's rules:
# ci/README.md.
#
#   ci/gpu-nightly.sh [--dry-run] [--skip STAGE[,STAGE]] [--only STAGE[,STAGE]]
#
# Stages, in order: setup prewarm gpu-tests verify synth-27b bench report gate. A failing stage does
# not stop the later ones (except setup: without an environment nothing else can run); the
# script exits 1 at the end if any stage or gate comparison failed, 2 on bad arguments.
# Records: OUT/ci/<UTC time>/ (stages.json, gate.tsv, git-status-*.txt, one log per stage);
# runs: OUT/runs/.
set -euo pipefail

cd "$(dirname "$0")/.."   # relative paths below (OUT, VENV, ...) are from the repository root

STAGES=(setup prewarm gpu-tests verify synth-27b bench report gate)

OUT=${OUT:-out}
VENV=${VENV:-.venv-gpu}
CUDA_ARCH=${CUDA_ARCH:-90}
GATE_THRESHOLD=${GATE_THRESHOLD:-0.05}
# whose SLOWER tok/s fails the gate: the code under test; llama.cpp and the oracle are
# references whose build does not change between commits (ci/README.md: their speed moved
# -7.7 % / +9.7 % between two runs of the same code on the H200); `all` = every backend
GATE_SLOWER_BACKENDS=${GATE_SLOWER_BACKENDS:-engine}
MODELS=${MODELS:-qwen2.5-coder-0.5b-q4_k_m qwen2.5-coder-1.5b-q4_k_m}
EXTRAS=${EXTRAS:-gpu,qwen05b,qwen15b}
WORK=${WORK:-${RUNNER_TEMP:-${TMPDIR:-/tmp}}/gguf-harness-nightly}
KEEP_SYNTH=${KEEP_SYNTH:-0}
# quant mixes of the synthetic 27B (issue #6 benchmarks ud-q4_k_m and q4_k_m; each adds ~2 min)
SYNTH_QUANTS=${SYNTH_QUANTS:-ud-q4_k_m}
MAKE=${MAKE:-make}
HARNESS=${HARNESS:-$VENV/bin/harness}
VPY=$VENV/bin/python
# Python output straight into the stage logs, in order with the child processes' output
export PYTHONUNBUFFERED=1

usage() {
    echo "usage: ci/gpu-nightly.sh [--dry-run] [--skip STAGE[,STAGE]] [--only STAGE[,STAGE]]"
    echo "stages: ${STAGES[*]}"
    echo "env: OUT VENV CUDA_ARCH GATE_THRESHOLD GATE_SLOWER_BACKENDS MODELS EXTRAS WORK KEEP_SYNTH SYNTH_QUANTS"
    echo "     MAKE HARNESS (ci/README.md)"
}

die_usage() {
    echo "gpu-nightly: error: $*" >&2
    usage >&2
    exit 2
}

DRY=0
SKIP=""
ONLY=""
while (($#)); do
    case $1 in
        --dry-run) DRY=1 ;;
        --skip) (($# > 1)) || die_usage "--skip needs STAGE[,STAGE]"; SKIP=$2; shift ;;
        --skip=*) SKIP=${1#--skip=} ;;
        --only) (($# > 1)) || die_usage "--only needs STAGE[,STAGE]"; ONLY=$2; shift ;;
        --only=*) ONLY=${1#--only=} ;;
        -h | --help) usage; exit 0 ;;
        *) die_usage "unknown argument: $1" ;;
    esac
    shift
done

in_list() {  # in_list WORD "A,B,C": WORD is one of the comma-separated items
    local item
    local -a items
    IFS=, read -r -a items <<< "$2"
    for item in "${items[@]}"; do
        [[ $item == "$1" ]] && return 0
    done
    return 1
}

for list in "$SKIP" "$ONLY"; do
    IFS=, read -r -a names <<< "$list"
    for name in "${names[@]}"; do
        in_list "$name" "$(IFS=,; echo "${STAGES[*]}")" || die_usage "unknown stage: $name"
    done
done
[[ $GATE_THRESHOLD =~ ^([0-9]+(\.[0-9]*)?|\.[0-9]+)$ ]] \
    || die_usage "GATE_THRESHOLD must be a non-negative number (a fraction: 0.05 = 5 %), got '$GATE_THRESHOLD'"
[[ $GATE_SLOWER_BACKENDS =~ ^(all|[a-z0-9_]+(,[a-z0-9_]+)*)$ ]] \
    || die_usage "GATE_SLOWER_BACKENDS must be 'all' or comma-separated backend names (engine,llamacpp,oracle), got '$GATE_SLOWER_BACKENDS'"
[[ $CUDA_ARCH =~ ^[0-9a-z\;-]+$ ]] \
    || die_usage "CUDA_ARCH must look like 90, 90a or 80;90 (CMAKE_CUDA_ARCHITECTURES), got '$CUDA_ARCH'"
read -r -a MODEL_LIST <<< "${MODELS//,/ }"
((${#MODEL_LIST[@]})) || die_usage "MODELS is empty"

selected() {  # selected STAGE: not excluded by --skip / --only
    if [[ -n $ONLY ]] && ! in_list "$1" "$ONLY"; then return 1; fi
    ! in_list "$1" "$SKIP"
}
any_selected=0
for stage in "${STAGES[@]}"; do selected "$stage" && any_selected=1; done
((any_selected)) || die_usage "--skip / --only leave no stage to run"

quote() {  # one argument as the shell would need it typed (plain when nothing is special)
    if [[ $1 =~ ^[A-Za-z0-9_./,:=+@%-]+$ ]]; then
        printf '%s' "$1"
    else
        printf "'%s'" "${1//\'/\'\\\'\'}"
    fi
}

show() {  # print a command line, "+ cmd args"
    local line="+" a
    for a in "$@"; do line+=" $(quote "$a")"; done
    printf '%s\n' "$line"
}

run() {  # show, then run unless --dry-run; returns the command's status
    show "$@"
    ((DRY)) && return 0
    "$@"
}

help_text() {  # help_text [SUBCOMMAND...]: `harness ... --help`, empty if that fails
    "$HARNESS" "$@" --help 2> /dev/null || true
}

has_subcommand() {  # has_subcommand WORD [PARENT...]: argparse's {a,b,c} of `harness PARENT... --help` lists WORD
    local choices
    choices=$(help_text "${@:2}" | grep -o '{[^}]*}' | head -n 1 | tr -d '{}' || true)
    [[ -n $choices ]] && in_list "$1" "$choices"
}

has_flag() {  # has_flag FLAG [SUBCOMMAND...]: `harness SUBCOMMAND... --help` shows FLAG
    help_text "${@:2}" | grep -Eq -- "(^|[[:space:][,])$1([][:space:]=,]|$)"
}

# ---- stages: each runs in a subshell with `set -e`; return 0 ok, 3 nothing to run, else failed

stage_setup() {
    # the Makefile's documented GPU set-up (README.md): llama-cpp-python built with CUDA
    # (CMAKE_ARGS from LLAMA_CMAKE_ARGS, no pip cache), then the project with EXTRAS
    run "$MAKE" setup "VENV=$VENV" "EXTRAS=$EXTRAS" \
        "LLAMA_CMAKE_ARGS=-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCH -DLLAVA_BUILD=OFF"
    # a CPU build of llama.cpp kept from an earlier venv would make every GPU figure wrong
    run "$VPY" -c 'import sys, llama_cpp
ok = llama_cpp.llama_supports_gpu_offload()
print(f"llama-cpp-python {llama_cpp.__version__}: GPU offload {ok}")
sys.exit(0 if ok else "llama.cpp was built without CUDA: remove the venv and run setup again")'
}

stage_prewarm() {
    # the engine's kernel builds compiled in parallel before the stages that would compile them
    # one by one on first use (`harness prewarm`; ~150 s per first run of the 27B, session 25)
    if ((DRY)); then
        echo "(only if 'harness --help' lists prewarm, otherwise: skipped: not implemented)"
        show "$HARNESS" prewarm
        return 0
    fi
    if ! has_subcommand prewarm; then
        echo "prewarm: skipped: not implemented ('harness --help' lists no prewarm command)"
        return 3
    fi
    run "$HARNESS" prewarm
}

stage_gpu_tests() {
    # the gpu tests skip without a device: make "no device" a failure, not a green skip
    run "$VPY" -c 'import sys, cupy
n = cupy.cuda.runtime.getDeviceCount()
print(f"CUDA devices: {n}")
sys.exit(0 if n > 0 else "no CUDA device: the GPU tests would only skip")'
    run "$VPY" -m pytest -m gpu -q -p no:cacheprovider --junitxml="$CI_DIR/gpu-tests.xml"
}

stage_verify() {
    local model rc=0
    for model in "${MODEL_LIST[@]}"; do
        run "$HARNESS" verify --model "$model" --backends oracle,llamacpp,engine \
            --contexts 512,2048 --bench --out "$OUT" || rc=1
    done
    return "$rc"
}

stage_synth_27b() {
    # regenerated every night (seeded, so the same bytes for the same generator code), one
    # file at a time (16.3 GB each)
    local q gguf rc=0
    run mkdir -p "$WORK"
    for q in ${SYNTH_QUANTS//,/ }; do
        # ud-q4_k_m keeps the file name of earlier nightlies: the gate pairs runs by model name
        if [[ $q == ud-q4_k_m ]]; then gguf=$WORK/qwen35-27b.gguf; else gguf=$WORK/qwen35-27b-$q.gguf; fi
        if ! run "$HARNESS" synth --preset qwen35-27b --quant "$q" --out "$gguf" --force; then
            rc=1
            continue
        fi
        # llama.cpp as the reference (the float64 oracle would need ~100 GB): the engine's ids,
        # teacher-forced KL and top-1 against llama.cpp, and both decoders' tok/s (issue #6)
        run "$HARNESS" verify --model "$gguf" --backends llamacpp,engine --reference llamacpp \
            --contexts 512,2048 --n-predict 129 --bench --out "$OUT" || rc=1
        if [[ $KEEP_SYNTH != 1 ]]; then
            run rm -f "$gguf"
        fi
    done
    return "$rc"
}

stage_bench() {
    local what model rc=0 ran=0
    local -a cmd
    if ((DRY)); then
        echo "(each only if 'harness --help' lists bench and 'harness bench --help' lists it," \
             "otherwise: skipped: not implemented; --out / --model only if its --help shows them)"
        show "$HARNESS" bench kernels --out "$OUT"
        for model in "${MODEL_LIST[@]}"; do
            show "$HARNESS" bench nodes --model "$model" --out "$OUT"
        done
        return 0
    fi
    if ! has_subcommand bench; then
        echo "bench: skipped: not implemented ('harness --help' lists no bench command)"
        return 3
    fi
    for what in kernels nodes; do
        if ! has_subcommand "$what" bench; then
            echo "bench $what: skipped: not implemented"
            continue
        fi
        cmd=("$HARNESS" bench "$what")
        if has_flag --out bench "$what"; then cmd+=(--out "$OUT"); fi
        ran=1
        if has_flag --model bench "$what"; then
            for model in "${MODEL_LIST[@]}"; do
                run "${cmd[@]}" --model "$model" || rc=1
            done
        else
            run "${cmd[@]}" || rc=1
        fi
    done
    if ((rc)); then return 1; fi
    if ((!ran)); then return 3; fi
    return 0
}

stage_report() {
    if ((DRY)); then
        echo "(only if 'harness report --help' shows --history; otherwise skipped)"
        show "$HARNESS" report --history "$OUT"
        return 0
    fi
    if ! has_flag --history report; then
        echo "report: skipped: 'harness report --help' shows no --history"
        return 3
    fi
    run "$HARNESS" report --history "$OUT"
}

stage_gate() {
    local prev new code outcome rc=0 n_cmp=0 n_fail=0
    local -a mode=()
    if ((NEW_FROM_THIS_RUN)); then
        mode=(--before "$CI_DIR/before.txt")
    else
        echo "gate: no verify stage ran in this invocation: comparing the newest result of" \
             "each model + settings with the run before it"
    fi
    if ((DRY)); then
        show "$VPY" ci/gate_pairs.py "$OUT/runs" "${mode[@]}"
        show "$HARNESS" ab PREV NEW --threshold "$GATE_THRESHOLD" --fail-on-slower "$GATE_SLOWER_BACKENDS"
        echo "(once per new result.json with an earlier run of the same model + settings;" \
             "plus --out $CI_DIR/ab for ab.json + ab.html when 'harness ab --help' shows --out)"
        return 0
    fi
    if ! has_subcommand ab; then
        echo "gate: FAILED: 'harness --help' lists no ab command; nothing can be compared"
        return 1
    fi
    local -a ab_out=()
    if has_flag --out ab; then ab_out=(--out "$CI_DIR/ab"); fi
    local pairs
    show "$VPY" ci/gate_pairs.py "$OUT/runs" "${mode[@]}"
    if ! pairs=$("$VPY" ci/gate_pairs.py "$OUT/runs" "${mode[@]}"); then
        echo "gate: FAILED: ci/gate_pairs.py could not list the comparisons"
        return 1
    fi
    printf 'outcome\trc\tprevious\tnew\n' > "$CI_DIR/gate.tsv"
    while IFS=$'\t' read -r -u 3 prev new; do
        [[ -n $new ]] || continue
        case $prev in
            -) outcome=baseline; code=0
               echo "gate: $new: no earlier run of this model + settings: baseline" ;;
            '!') outcome=unreadable; code=2
               echo "gate: $new: not a readable run result" ;;
            *) code=0
               run "$HARNESS" ab "$prev" "$new" --threshold "$GATE_THRESHOLD" \
                   --fail-on-slower "$GATE_SLOWER_BACKENDS" "${ab_out[@]}" < /dev/null || code=$?
               n_cmp=$((n_cmp + 1))
               case $code in
                   0) outcome=pass ;;
                   1) outcome=FAIL ;;
                   2) outcome=bad-input ;;
                   *) outcome=error ;;
               esac ;;
        esac
        if [[ $outcome != pass && $outcome != baseline ]]; then
            rc=1
            n_fail=$((n_fail + 1))
        fi
        printf '%s\t%s\t%s\t%s\n' "$outcome" "$code" "$prev" "$new" >> "$CI_DIR/gate.tsv"
    done 3<<< "$pairs"
    echo "gate: $n_cmp comparison(s), $n_fail failed (threshold $GATE_THRESHOLD, SLOWER fails" \
         "for: $GATE_SLOWER_BACKENDS); $CI_DIR/gate.tsv"
    return "$rc"
}

# ---- driver

STAMP=$(date -u +%Y%m%dT%H%M%SZ)
CI_DIR=$OUT/ci/$STAMP
NEW_FROM_THIS_RUN=0
if selected verify || selected synth-27b; then NEW_FROM_THIS_RUN=1; fi
declare -a REC_NAME=() REC_STATUS=() REC_SECONDS=() REC_RC=() FAILED=()

write_stages() {  # OUT/ci/<time>/stages.json, rewritten atomically after every stage
    local tmp i sep=""
    tmp=$(mktemp "$CI_DIR/.stages.json.XXXXXX")
    {
        printf '{\n "schema": "gguf-harness/ci-stages/1",\n "started": "%s",\n' "$STARTED"
        printf ' "git_sha": "%s",\n "git_dirty": %s,\n "gate_threshold": %s,\n' \
            "$GIT_SHA" "$GIT_DIRTY" "$GATE_THRESHOLD"
        printf ' "gate_slower_backends": "%s",\n "cuda_arch": "%s",\n "stages": [' \
            "$GATE_SLOWER_BACKENDS" "$CUDA_ARCH"
        for i in "${!REC_NAME[@]}"; do
            printf '%s\n  {"name": "%s", "status": "%s", "seconds": %s, "rc": %s}' \
                "$sep" "${REC_NAME[i]}" "${REC_STATUS[i]}" "${REC_SECONDS[i]}" "${REC_RC[i]}"
            sep=,
        done
        printf '\n ]\n}\n'
    } > "$tmp"
    chmod 644 "$tmp"
    mv -f "$tmp" "$CI_DIR/stages.json"
}

record() {  # record NAME STATUS SECONDS RC
    REC_NAME+=("$1"); REC_STATUS+=("$2"); REC_SECONDS+=("$3"); REC_RC+=("$4")
    if ((!DRY)); then write_stages; fi
}

run_stage() {
    local name=$1 t0 secs rc status
    if ! selected "$name"; then
        echo "stage $name: not selected"
        record "$name" not-selected 0 0
        return 0
    fi
    echo "==> stage $name"
    t0=$(date +%s)
    set +e
    if ((DRY)); then
        (set -e; "stage_${name//-/_}")
        rc=$?
    else
        (set -e; "stage_${name//-/_}") 2>&1 | tee "$CI_DIR/$name.log"
        rc=${PIPESTATUS[0]}
    fi
    set -e
    secs=$(($(date +%s) - t0))
    case $rc in
        0) status=ok ;;
        3) status=skipped ;;
        *) status=failed; FAILED+=("$name") ;;
    esac
    ((DRY)) && status=dry-run
    echo "stage $name: $secs s ($status)"
    record "$name" "$status" "$secs" "$rc"
}

git_status() {  # git_status FILE: the checkout's `git status --porcelain` (untracked too) into FILE
    git status --porcelain --untracked-files=all > "$1" 2> /dev/null || : > "$1"
}

check_checkout() {  # after the stages: did anything write into the checkout? (ci/README.md)
    git_status "$CI_DIR/git-status-end.txt"
    if ! cmp -s "$CI_DIR/git-status-start.txt" "$CI_DIR/git-status-end.txt"; then
        echo "gpu-nightly: note: the checkout changed during this run (files written into it that" \
             "git does not ignore, or edited meanwhile); git status before / after:"
        diff "$CI_DIR/git-status-start.txt" "$CI_DIR/git-status-end.txt" || true
    fi
}

if ((DRY)); then
    echo "dry run: commands are shown, not run; OUT=$OUT VENV=$VENV CUDA_ARCH=$CUDA_ARCH" \
         "GATE_THRESHOLD=$GATE_THRESHOLD GATE_SLOWER_BACKENDS=$GATE_SLOWER_BACKENDS" \
         "MODELS='${MODEL_LIST[*]}'"
else
    mkdir -p "$OUT/ci"
    # two nightlies at once would time each other: hold a lock for the whole run
    if command -v flock > /dev/null; then
        exec 9> "$OUT/ci/.lock"
        flock -n 9 || { echo "gpu-nightly: another run holds $OUT/ci/.lock" >&2; exit 1; }
    fi
    n=0
    until mkdir "$CI_DIR" 2> /dev/null; do   # never reuse an earlier run's record folder
        n=$((n + 1))
        ((n < 100)) || { echo "gpu-nightly: cannot create $OUT/ci/$STAMP-N" >&2; exit 1; }
        CI_DIR=$OUT/ci/$STAMP-$n
    done
    STARTED=$(date -u +%Y-%m-%dT%H:%M:%S+00:00)
    GIT_SHA=$(git rev-parse HEAD 2> /dev/null || true)
    [[ $GIT_SHA =~ ^[0-9a-f]*$ ]] || GIT_SHA=""
    # results record "dirty" for changed tracked files (harness.machine.git_info): say which
    git_status "$CI_DIR/git-status-start.txt"
    GIT_DIRTY=false
    if grep -qv '^??' "$CI_DIR/git-status-start.txt"; then
        GIT_DIRTY=true
        echo "gpu-nightly: note: uncommitted changes to tracked files; results will say" \
             "git ${GIT_SHA:0:10} dirty:"
        grep -v '^??' "$CI_DIR/git-status-start.txt" | head -n 20 || true
    fi
    # the results that exist now are "earlier runs" for the gate; later ones are this run's
    if [[ -d $OUT/runs ]]; then
        find "$OUT/runs" -mindepth 2 -maxdepth 2 -name result.json -type f > "$CI_DIR/before.txt"
    else
        : > "$CI_DIR/before.txt"
    fi
    echo "gpu-nightly: records in $CI_DIR"
fi

abort() {  # abort MESSAGE: record the stages after setup as not run, exit 1
    local stage
    echo "gpu-nightly: FAILED: $*" >&2
    for stage in "${STAGES[@]:1}"; do
        record "$stage" not-run 0 0
    done
    exit 1
}

for stage in "${STAGES[@]}"; do
    run_stage "$stage"
    if [[ $stage == setup ]]; then
        if in_list setup "$(IFS=,; echo "${FAILED[*]-}")"; then
            abort "setup failed; later stages need its environment: stopping"
        fi
        if ((!DRY)) && [[ ! -x $HARNESS ]]; then
            abort "no harness at $HARNESS (set VENV or HARNESS, or run setup)"
        fi
    fi
done

if ((DRY)); then
    echo "gpu-nightly: dry run: nothing was run"
    exit 0
fi
check_checkout
if ((${#FAILED[@]})); then
    echo "gpu-nightly: FAILED stage(s): ${FAILED[*]} (records: $CI_DIR)" >&2
    exit 1
fi
echo "gpu-nightly: all selected stages ok (records: $CI_DIR)"
