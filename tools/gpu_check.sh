#!/usr/bin/env bash
# The GPU check, in one device call: the machine, the GPU tests, then the kernel benchmarks.
#
#   tools/gpu_check.sh              # tests, then bench (default; no extra args)
#   tools/gpu_check.sh tests [ARGS] # tests only: ARGS go to pytest (default: tests)
#   tools/gpu_check.sh bench [ARGS] # bench only: ARGS go to bench.py (e.g. --only attention,lora)
#
# Logs and the bench rows land in $OUT (default ./out): tests.log, bench.log, bench.json.
# The device tool returns only the last 12,000 characters, so the script ends with a recap: the
# test summary, then the bench table. Budget: the whole script under 8 minutes on an H100; each
# part has a hard cap (TESTS_TIMEOUT, BENCH_TIMEOUT seconds) so one hang cannot eat the other.
# Liger-Kernel (the linear-CE baseline) travels as a wheel in .whl/ (the device has no internet):
# carry ".whl" in the device call.
set -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-./out}
mkdir -p "$OUT"
PART=${1:-all}
[ $# -gt 0 ] && shift
case "$PART" in
    all) [ $# -eq 0 ] || { echo "gpu_check.sh: extra args need a part (tests ARGS, bench ARGS)"; exit 2; } ;;
    tests|bench) ;;
    *) echo "gpu_check.sh: unknown part '$PART' (all, tests or bench)"; exit 2 ;;
esac
TESTS_TIMEOUT=${TESTS_TIMEOUT:-270}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-190}

if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

nvidia-smi -L
python3 -c "import torch, triton
print(f'torch {torch.__version__} (cuda {torch.version.cuda}), triton {triton.__version__}')"
python3 -c "import liger_kernel; print('liger-kernel importable')" 2>/dev/null \
    || echo "liger-kernel not importable"

tests_rc=skipped
bench_rc=skipped
if [ "$PART" = all ] || [ "$PART" = tests ]; then
    echo "=== tests (cap ${TESTS_TIMEOUT}s)"
    per_test=()
    python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout=120)
    # compile-bound: pytest-xdist spreads the Triton compiles over the host's cores (the whole
    # GPU suite ran in 129 s with 6 workers on the H100 machine, >320 s serially)
    python3 -c "import xdist" 2>/dev/null && per_test+=(-n "${TEST_WORKERS:-6}")
    args=("$@")
    [ ${#args[@]} -eq 0 ] && args=(-m gpu tests)  # the CPU tests run in CI; here the gpu-marked ones
    timeout "$TESTS_TIMEOUT" python3 -m pytest -q --durations=10 "${per_test[@]}" "${args[@]}" 2>&1 \
        | tee "$OUT/tests.log"
    tests_rc=$?
fi
if [ "$PART" = all ] || [ "$PART" = bench ]; then
    echo "=== bench kernels (cap ${BENCH_TIMEOUT}s)"
    timeout "$BENCH_TIMEOUT" python3 tools/bench.py kernels --json "$OUT/bench.json" "$@" 2>&1 \
        | tee "$OUT/bench.log"
    bench_rc=$?
fi

# Recap, last so it survives the 12,000-character tail: test summary, then the bench table.
echo
echo "=================================== recap ==================================="
if [ "$tests_rc" != skipped ]; then
    grep -E "^(FAILED|ERROR) " "$OUT/tests.log" | cut -c1-160 | head -20
    summary=$(tail -n 1 "$OUT/tests.log")
    [ "$tests_rc" = 124 ] && summary="killed at ${TESTS_TIMEOUT}s"
    echo "tests: rc=$tests_rc ($summary)"
fi
if [ "$bench_rc" != skipped ]; then
    [ "$bench_rc" = 124 ] && echo "bench: killed at ${BENCH_TIMEOUT}s: the rows measured so far"
    echo "bench: rc=$bench_rc"
    grep -E "^# (lean kernel bench|matmul)" "$OUT/bench.log"
    if grep -q "^kernel  " "$OUT/bench.log"; then
        sed -n '/^kernel  /,$p' "$OUT/bench.log"
    else
        grep "^row " "$OUT/bench.log"  # the table never printed: the rows as they were measured
    fi
fi
[ "$tests_rc" = skipped ] || [ "$tests_rc" = 0 ] || exit 1
[ "$bench_rc" = skipped ] || [ "$bench_rc" = 0 ] || exit 1
exit 0
