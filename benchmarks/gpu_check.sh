#!/usr/bin/env bash
# The GPU check: the CUDA tests, then the GPU benchmark (benchmarks/bench_gpu.py), in under 8 minutes on one GPU.
#
#   bash benchmarks/gpu_check.sh                      # from anywhere, on a machine with a CUDA build of torch
#   bash benchmarks/gpu_check.sh -- --budget_s 150    # arguments after -- go to bench_gpu.py
#
# The whole check ends within GPU_CHECK_TOTAL_S (default 450 s): the CUDA tests get at most GPU_CHECK_TESTS_S, the
# benchmark what is left (its --budget_s trims repeats to fit; anything still running at the limit is stopped and the
# results measured until then are kept). Give the command that runs it a limit of about 520 s.
#
# It installs nothing from a registry: the repository goes on PYTHONPATH and runs on the interpreter's own torch,
# transformers and pytest. A package missing there can be brought as wheels in .whl/ (installed with --no-index
# into a temporary folder), e.g. transformers >= 5.24 where the interpreter's is older (hf_spectral refuses it on
# import): `pip download --no-deps transformers==5.24.0 -d .whl`. Every step has its own time limit; what was
# measured is kept if a later step fails.
#
# Environment:
#   PYTHON               interpreter with a CUDA build of torch (default: python3)
#   GPU_CHECK_TOTAL_S    wall-clock limit of the whole check in seconds (default 450)
#   GPU_CHECK_TESTS_S    limit of the CUDA tests (default 200: their flex_attention cases compile)
#   GPU_CHECK_RESULTS    folder of the results (default results/benchmarks)
#   GPU_CHECK_TESTS_DIR  where the CUDA tests are looked for (default tests)
#   GPU_CHECK_TEST_WORKERS  pytest-xdist workers for the CUDA tests where xdist is installed (default 4; 1 on a CPU)
#   GPU_CHECK_CPU=1      run the same steps on a CPU (tests skip what needs CUDA, the benchmark runs with
#                        --device cpu --tiny): checks the machinery, measures nothing
#   OUT                  when set, the results and logs are copied there too
#   HF_SPECTRAL_COMMIT   the commit the tree was copied from, recorded where no git checkout travelled
#
# Writes, in GPU_CHECK_RESULTS: gpu.md and gpu.json (gpu_tiny.* on a CPU) with the benchmark and the tests'
# outcome lines, gpu_tests.log (pytest's output) and gpu_check.log (everything this script printed).
# Exit status: 0 all passed and the benchmark completed; 1 a test failed or timed out; 2 no CUDA device;
# 3 the package or pytest cannot be imported; 4 the benchmark failed or stopped before its end.

set -u -o pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 3
PY="${PYTHON:-python3}"
TOTAL_S="${GPU_CHECK_TOTAL_S:-450}"
TESTS_S="${GPU_CHECK_TESTS_S:-200}"
RESULTS="${GPU_CHECK_RESULTS:-results/benchmarks}"
TESTS_DIR="${GPU_CHECK_TESTS_DIR:-tests}"
CPU_MODE="${GPU_CHECK_CPU:-0}"
if [ "$CPU_MODE" = "1" ]; then TEST_WORKERS="${GPU_CHECK_TEST_WORKERS:-1}"; else TEST_WORKERS="${GPU_CHECK_TEST_WORKERS:-4}"; fi
INVOKED_BY="bash benchmarks/gpu_check.sh $*"
if [ "$CPU_MODE" = "1" ]; then INVOKED_BY="GPU_CHECK_CPU=1 $INVOKED_BY"; fi
BENCH_ARGS=()
if [ "${1:-}" = "--" ]; then
    shift
    BENCH_ARGS=("$@")
elif [ "$#" -gt 0 ]; then
    echo "usage: bash benchmarks/gpu_check.sh [-- BENCH_GPU_ARGS...]: arguments for bench_gpu.py follow --, got: $*" >&2
    exit 2
fi
if [ "$CPU_MODE" = "1" ]; then NAME=gpu_tiny; else NAME=gpu; fi
mkdir -p "$RESULTS" || exit 3
LOG="$RESULTS/gpu_check.log"
TESTS_LOG="$RESULTS/gpu_tests.log"
START=$(date +%s)

# COLUMNS: pytest cuts its summary lines (the failure messages) to the terminal width.
export COLUMNS=200 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

elapsed() { echo $(( $(date +%s) - START )); }
say() { echo "GPU check [$(elapsed) s]: $*"; }

check() {
    say "repository $REPO, interpreter $PY, limit ${TOTAL_S} s (tests ${TESTS_S} s)"
    date -u
    uname -a
    if command -v nvidia-smi >/dev/null 2>&1; then
        timeout 30 nvidia-smi || say "nvidia-smi failed (exit $?)"
    else
        say "nvidia-smi not found"
    fi

    # torch first (without a CUDA device nothing below means anything on a GPU), then the package from this
    # checkout on the interpreter's own libraries (never a torch from a registry). Exit 10: no CUDA; 11: no package.
    local probe="
import sys, torch
print('python', sys.version.split()[0], sys.executable)
print('torch', torch.__version__, 'CUDA runtime', torch.version.cuda)
print('torch.cuda.is_available()', torch.cuda.is_available())
if torch.cuda.is_available():
    print('device', torch.cuda.get_device_name(0), 'capability', torch.cuda.get_device_capability(0))
elif '$CPU_MODE' != '1':
    sys.exit(10)
try:
    import hf_spectral, transformers
except Exception:
    import traceback
    traceback.print_exc()
    sys.exit(11)
print('hf_spectral from', hf_spectral.__file__)
print('transformers', transformers.__version__)
"
    timeout 180 "$PY" -c "$probe"
    local probe_status=$?
    if [ "$probe_status" -eq 11 ] && compgen -G ".whl/*.whl" >/dev/null; then
        say "hf_spectral does not import; installing the wheels in .whl/ (no index, no dependencies)"
        timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/hf_spectral_site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/hf_spectral_site"
        timeout 180 "$PY" -c "$probe"
        probe_status=$?
    fi
    case "$probe_status" in
        0) ;;
        10)
            say "STOP: torch.cuda.is_available() is False: no usable CUDA device or a CPU-only torch build. This"
            say "      check needs a GPU (GPU_CHECK_CPU=1 runs its machinery on a CPU, measuring nothing)."
            return 2 ;;
        11)
            say "STOP: hf_spectral does not import with this interpreter (error above). Nothing can be fetched"
            say "      here: bring the missing or too old package (transformers >= 5.24) as wheels in .whl/ (see"
            say "      the device notes), then run again."
            return 3 ;;
        *)
            say "STOP: '$PY' cannot import torch (exit $probe_status). Set PYTHON to the interpreter that holds the"
            say "      CUDA build of torch."
            return 3 ;;
    esac
    if ! timeout 60 "$PY" -m pytest --version; then
        say "STOP: pytest is not installed for $PY; bring it as a wheel in .whl/."
        return 3
    fi

    # CUDA tests: every test_cuda*.py file under the tests, and the tests marked `cuda` in other files.
    local status=0 files marked
    files=$(find "$TESTS_DIR" -name 'test_cuda*.py' | sort)
    marked=$(grep -rlE --include='test_*.py' 'pytest\.mark\.cuda\b' "$TESTS_DIR" | grep -v '/test_cuda' | sort)
    : >"$TESTS_LOG"
    if [ -z "$files" ] && [ -z "$marked" ]; then
        say "no CUDA tests found (tests/**/test_cuda*.py or @pytest.mark.cuda)" | tee -a "$TESTS_LOG"
    else
        say "CUDA tests: $(echo $files $marked)"
        local left=$TESTS_S started per_test=()
        # A test that hangs fails alone (pytest-timeout, where installed) instead of taking the whole run's limit.
        if "$PY" -c "import pytest_timeout" 2>/dev/null; then per_test=(--timeout=90); fi
        # Several workers (pytest-xdist, where installed): the flex_attention cases spend their time compiling on the
        # host's cores, which a single process leaves idle.
        if [ "$TEST_WORKERS" -gt 1 ] && "$PY" -c "import xdist" 2>/dev/null; then
            per_test+=(-n "$TEST_WORKERS")
        fi
        if [ -n "$files" ]; then
            started=$(date +%s)
            # shellcheck disable=SC2086
            timeout -k 10 "$left" "$PY" -m pytest -v -rA -p no:cacheprovider ${per_test[@]+"${per_test[@]}"} $files 2>&1 | tee -a "$TESTS_LOG"
            status=${PIPESTATUS[0]}
            left=$(( left - ($(date +%s) - started) ))
        fi
        if [ -n "$marked" ] && [ "$status" -ne 124 ] && [ "$left" -gt 10 ]; then
            # shellcheck disable=SC2086
            timeout -k 10 "$left" "$PY" -m pytest -v -rA -p no:cacheprovider ${per_test[@]+"${per_test[@]}"} -m cuda $marked 2>&1 | tee -a "$TESTS_LOG"
            local marked_status=${PIPESTATUS[0]}
            # pytest's 5 is "nothing collected": no test in those files carries the marker after all
            if [ "$marked_status" -ne 0 ] && [ "$marked_status" -ne 5 ]; then status=$marked_status; fi
        fi
        # A run in which every test skipped passed nothing: on a GPU that is a failure of the check.
        local all_skipped=0
        if [ "$status" -eq 0 ] && ! grep -qE '^=+ .*[0-9]+ passed' "$TESTS_LOG"; then all_skipped=1; fi
        case "$status/$all_skipped/$CPU_MODE" in
            0/1/1) say "CUDA tests: every one skipped, as on any CPU" | tee -a "$TESTS_LOG" ;;
            0/1/*) status=1; say "CUDA tests FAILED: not one ran on this GPU, every one was skipped" | tee -a "$TESTS_LOG" ;;
            0/*) say "CUDA tests passed" | tee -a "$TESTS_LOG" ;;
            124/*|137/*) say "CUDA tests STOPPED at their ${TESTS_S} s limit" | tee -a "$TESTS_LOG" ;;
            *) say "CUDA tests FAILED (pytest exit $status)" | tee -a "$TESTS_LOG" ;;
        esac
    fi

    # The benchmark gets what is left, minus a margin for its fixed costs (imports, model builds, compiles) that
    # its budget cannot trim, and for copying the results.
    local left_s=$(( TOTAL_S - $(elapsed) - 15 ))
    local budget_s=$(( left_s - 60 ))
    if [ "$budget_s" -lt 30 ]; then budget_s=30; fi
    local device_args=()
    if [ "$CPU_MODE" = "1" ]; then device_args=(--device cpu --tiny); budget_s=10; fi
    say "benchmark: budget ${budget_s} s, limit ${left_s} s"
    timeout -k 10 "$left_s" "$PY" benchmarks/bench_gpu.py ${device_args[@]+"${device_args[@]}"} --budget_s "$budget_s" \
        --out "$RESULTS" --name "$NAME" --tests_log "$TESTS_LOG" --invoked_by "$INVOKED_BY" ${BENCH_ARGS[@]+"${BENCH_ARGS[@]}"}
    local bench_status=$?
    if [ "$bench_status" -ne 0 ]; then
        say "benchmark FAILED or stopped at its limit (exit $bench_status); $RESULTS/$NAME.md keeps what was measured"
        return 4
    fi
    if [ "$status" -ne 0 ]; then return 1; fi
    return 0
}

check 2>&1 | tee "$LOG"
STATUS=${PIPESTATUS[0]}
echo "GPU check: finished in $(elapsed) s with exit status $STATUS" | tee -a "$LOG"

if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    for file in "$RESULTS/$NAME.md" "$RESULTS/$NAME.json" "$TESTS_LOG" "$LOG"; do
        if [ -f "$file" ]; then cp "$file" "$OUT/"; fi
    done
    echo "GPU check: copied the results to $OUT: $(ls "$OUT" | tr '\n' ' ')"
fi
exit "$STATUS"
