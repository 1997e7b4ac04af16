#!/usr/bin/env bash
# The GPU check, in one device call: the machine, the GPU tests, then the kernel benchmarks.
#
#   tools/gpu_check.sh              # tests, then bench (default; no extra args)
#   tools/gpu_check.sh tests [ARGS] # tests only: ARGS go to pytest (default: -m gpu tests; test files
#                                   # named without -m run every test in them, the interpreter's too)
#   tools/gpu_check.sh bench [ARGS] # bench only: ARGS go to bench.py kernels (e.g. --only attention,lora)
#   tools/gpu_check.sh step [ARGS]  # the step bench, lean and the peers: ARGS go to bench.py step
#   tools/gpu_check.sh wheels       # only install the carried wheels (the first of the step's two calls)
#   tools/gpu_check.sh dist-tests   # several GPUs (an nvidia-h100-x2 / -x4 machine): tests/test_dist_gpu.py
#                                   # (cap TESTS_TIMEOUT); log dist-tests.log
#   tools/gpu_check.sh dist-bench N[,M] [ARGS]  # bench.py step --nproc N ARGS: lean on N GPUs beside one, HF+PEFT
#                                   # through accelerate launch (cap STEP_TIMEOUT); logs dist.log, dist.json.
#                                   # Two parts, two device calls: each cap fits one call's 600 s. NVLink
#                                   # multicast stays off in both (NCCL_NVLS_ENABLE=0 ...)
#   TEST_GPUS=2,3 TEST_WORKERS=10 tools/gpu_check.sh tests   # the tests' workers spread over cards 2, 3
#   TEST_PART=1/3 tools/gpu_check.sh tests   # a third of the GPU test files (then 2/3, 3/3): one GPU no
#                                   # longer runs the suite in one call (one H200, 2026-11-28: part 1/2
#                                   # 313 s with 10 workers, part 2/2 past 500 s)
#   tools/gpu_check.sh --portable tests   # any part with LEAN_PORTABLE=1: the portable path (pointer
#                                   # loads, no TMA: the code an RTX / A100 card runs) on this GPU; its
#                                   # logs get a -portable suffix (tests-portable.log, ...)
#
# Logs and rows land in $OUT (default ./out): tests.log, bench.log, bench.json, step.log, step.json.
# The device tool returns only the last 12,000 characters, so the script ends with a recap: the
# test summary, then the bench and step tables. Budget: each part has a hard cap (TESTS_TIMEOUT,
# BENCH_TIMEOUT, STEP_TIMEOUT seconds) so one hang cannot eat the others; tests + bench take under
# 8 minutes on an H100, the step part alone up to STEP_TIMEOUT (560 s).
# Wheels (the device has no internet): tools/fetch_wheels.sh fills .whl/a (Unsloth and its needs)
# and .whl/b (bitsandbytes, liger-kernel); each call carries at most one of them (64 MiB a call).
# Whatever .whl/a, .whl/b and .whl/ hold is installed into /tmp/site, cumulatively: a warm machine
# keeps /tmp between calls and a wheel already installed there is not installed again. The kernel
# bench's Liger baseline needs carry [".whl/b"]; the step bench's two calls are written at the top
# of tools/bench_step.py.
set -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-./out}
mkdir -p "$OUT"
SUFFIX=
if [ "${1:-}" = --portable ]; then
    export LEAN_PORTABLE=1
    SUFFIX=-portable
    shift
fi
PART=${1:-all}
[ $# -gt 0 ] && shift
case "$PART" in
    all) [ $# -eq 0 ] || { echo "gpu_check.sh: extra args need a part (tests ARGS, bench ARGS)"; exit 2; } ;;
    tests|bench|step) ;;
    dist-tests) [ $# -eq 0 ] || { echo "gpu_check.sh: dist-tests takes no args"; exit 2; } ;;
    dist-bench) NPROC=${1:-}
          [[ "$NPROC" =~ ^[0-9]+(,[0-9]+)*$ ]] || { echo "gpu_check.sh: dist-bench needs the GPU count first (dist-bench 2 [ARGS])"; exit 2; }
          shift ;;
    wheels) [ $# -eq 0 ] || { echo "gpu_check.sh: wheels takes no args"; exit 2; } ;;
    *) echo "gpu_check.sh: unknown part '$PART' (all, tests, bench, step, dist-tests, dist-bench or wheels)"; exit 2 ;;
esac
# the tests part alone gets 560 s: its whole-model tests run one at a time (tests/conftest.py), and
# the whole GPU suite outlasted 400 s on the H100; beside the bench (part all) 270 s
if [ -z "${TESTS_TIMEOUT:-}" ]; then
    if [ "$PART" = tests ]; then TESTS_TIMEOUT=560; else TESTS_TIMEOUT=270; fi
fi
BENCH_TIMEOUT=${BENCH_TIMEOUT:-190}
STEP_TIMEOUT=${STEP_TIMEOUT:-560}
SITE=/tmp/site

install_wheels() {  # new wheels from .whl/a, .whl/b, .whl/ into $SITE; libcudart.so.12 copied
    shopt -s nullglob
    local -A seen=()
    local new=() w name
    for w in .whl/a/*.whl .whl/b/*.whl .whl/*.whl; do
        name=$(basename "$w")
        [ -n "${seen[$name]:-}" ] && continue  # one copy of a wheel: two stop pip
        seen[$name]=1
        [ -e "$SITE/.installed/$name" ] || new+=("$w")
    done
    if [ ${#new[@]} -gt 0 ]; then
        echo "installing into $SITE: ${new[*]##*/}"
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" "${new[@]}" || return 1
        mkdir -p "$SITE/.installed"
        for w in "${new[@]}"; do touch "$SITE/.installed/$(basename "$w")"; done
    fi
    for w in .whl/a/libcudart.so.12 .whl/b/libcudart.so.12; do  # for xformers; never pip-installed
        [ -f "$w" ] && mkdir -p "$SITE/_cudart" && cp "$w" "$SITE/_cudart/"
    done
    shopt -u nullglob
}
install_wheels || { echo "gpu_check.sh: installing the wheels into $SITE failed (pip's message above)"; exit 1; }
[ -d "$SITE" ] && export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}

nvidia-smi -L
python3 -c "import lean.kernels.arch as A; print('arch:', A.describe())" || exit 1
python3 -c "import torch, triton
print(f'torch {torch.__version__} (cuda {torch.version.cuda}), triton {triton.__version__}')"
python3 -c "import importlib.util as u
print('installed:', ', '.join(f'{m} {\"yes\" if u.find_spec(m) else \"no\"}' for m in
      ('liger_kernel', 'unsloth', 'unsloth_zoo', 'trl', 'datasets', 'xformers', 'bitsandbytes')))"
[ -f "$SITE/_cudart/libcudart.so.12" ] && echo "libcudart.so.12 in $SITE/_cudart (preloaded for Unsloth)"
[ "$PART" = wheels ] && exit 0

tests_rc=skipped
bench_rc=skipped
step_rc=skipped
dist_rc=skipped
if [ "$PART" = dist-tests ] || [ "$PART" = dist-bench ]; then
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the device notes' rule
    nvidia-smi topo -m 2>/dev/null | head -n 9
fi
if [ "$PART" = dist-tests ]; then
    echo "=== multi-GPU tests (cap ${TESTS_TIMEOUT}s)"
    timeout "$TESTS_TIMEOUT" python3 -m pytest -q --durations=10 tests/test_dist_gpu.py 2>&1 | tee "$OUT/dist-tests$SUFFIX.log"
    tests_rc=$?
fi
if [ "$PART" = dist-bench ]; then
    echo "=== bench step --nproc $NPROC (cap ${STEP_TIMEOUT}s)"
    timeout "$STEP_TIMEOUT" python3 tools/bench.py step --nproc "$NPROC" --json "$OUT/dist$SUFFIX.json" "$@" 2>&1 \
        | tee "$OUT/dist$SUFFIX.log"
    dist_rc=$?
fi
if [ "$PART" = all ] || [ "$PART" = tests ]; then
    echo "=== tests (cap ${TESTS_TIMEOUT}s)"
    per_test=()
    python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout=120)
    # compile-bound: pytest-xdist spreads the Triton compiles over the host's cores (the whole
    # GPU suite ran in 129 s with 6 workers on the H100 machine, >320 s serially)
    # -v: each worker's line names its test as it ends ("[gw2] ... FAILED tests/..."), so a run killed
    # at its cap still says which failed (the summary comes only at the end)
    # -o timeout_func_only: a test's 120 s cover its own run, not its wait for the card's lock (a whole-model
    # test waits behind the others on its card: counted, they failed a whole stretch of the suite on the x4)
    python3 -c "import pytest_timeout" 2>/dev/null && per_test+=(-o timeout_func_only=true)
    python3 -c "import xdist" 2>/dev/null && per_test+=(-n "${TEST_WORKERS:-6}" -v)
    # TEST_GPUS=2,3: the workers spread over those cards, one each (tests/conftest.py), e.g. beside
    # dist-tests on cards 0,1 of an x4 machine
    [ -n "${TEST_GPUS:-}" ] && export LEAN_TEST_GPUS=$TEST_GPUS
    args=("$@")
    if [ ${#args[@]} -eq 0 ] && [ -n "${TEST_PART:-}" ]; then
        # TEST_PART=k/n: the k-th of n shares of the GPU test files (whole-model files dealt round-robin,
        # then the kernel files): the whole suite outgrew one 600 s call on one H100
        mapfile -t files < <(python3 -c '
import pathlib, sys
sys.path.insert(0, "tests")
from conftest import BIG_GPU_FILES
k, n = map(int, sys.argv[1].split("/"))
gpu = sorted(p.name for p in pathlib.Path("tests").glob("test_*.py") if "mark.gpu" in p.read_text())
dealt = [f for f in gpu if f in BIG_GPU_FILES] + [f for f in gpu if f not in BIG_GPU_FILES]
print("\n".join(f"tests/{f}" for f in dealt[k - 1::n]) if 1 <= k <= n else "")
' "$TEST_PART")
        [ -n "${files[0]:-}" ] || { echo "gpu_check.sh: TEST_PART=$TEST_PART selects no test file (k/n, 1 <= k <= n)"; exit 2; }
        args=(-m gpu "${files[@]}")
        echo "TEST_PART $TEST_PART: ${files[*]}"
    fi
    [ ${#args[@]} -eq 0 ] && args=(-m gpu tests)  # the CPU tests run in CI; here the gpu-marked ones
    quiet=(-q)
    [[ " ${per_test[*]} " == *" -v "* ]] && quiet=()  # -q and -v cancel: the worker lines need -v alone
    timeout "$TESTS_TIMEOUT" python3 -m pytest "${quiet[@]}" --durations=10 "${per_test[@]}" "${args[@]}" 2>&1 \
        | tee "$OUT/tests$SUFFIX.log"
    tests_rc=$?
fi
if [ "$PART" = all ] || [ "$PART" = bench ]; then
    echo "=== bench kernels (cap ${BENCH_TIMEOUT}s)"
    timeout "$BENCH_TIMEOUT" python3 tools/bench.py kernels --json "$OUT/bench$SUFFIX.json" "$@" 2>&1 \
        | tee "$OUT/bench$SUFFIX.log"
    bench_rc=$?
fi
if [ "$PART" = step ]; then
    echo "=== bench step (cap ${STEP_TIMEOUT}s)"
    timeout "$STEP_TIMEOUT" python3 tools/bench.py step --json "$OUT/step$SUFFIX.json" "$@" 2>&1 | tee "$OUT/step$SUFFIX.log"
    step_rc=$?
fi

# Recap, last so it survives the 12,000-character tail: test summary, then the bench table.
echo
echo "=================================== recap${SUFFIX:+ (LEAN_PORTABLE=1)} ==================================="
if [ "$tests_rc" != skipped ]; then
    log="$OUT/tests$SUFFIX.log"
    [ "$PART" = dist-tests ] && log="$OUT/dist-tests$SUFFIX.log"
    grep -E "^(FAILED|ERROR) " "$log" | cut -c1-160 | head -20
    [ "$tests_rc" = 124 ] && grep -E "\] (FAILED|ERROR) " "$log" | cut -c1-160 | head -20  # killed: no summary
    summary=$(tail -n 1 "$log")
    [ "$tests_rc" = 124 ] && summary="killed at ${TESTS_TIMEOUT}s"
    echo "tests: rc=$tests_rc ($summary)"
fi
if [ "$bench_rc" != skipped ]; then
    [ "$bench_rc" = 124 ] && echo "bench: killed at ${BENCH_TIMEOUT}s: the rows measured so far"
    echo "bench: rc=$bench_rc"
    grep -E "^# (lean kernel bench|matmul)" "$OUT/bench$SUFFIX.log"
    if grep -q "^kernel  " "$OUT/bench$SUFFIX.log"; then
        sed -n '/^kernel  /,$p' "$OUT/bench$SUFFIX.log"
    else
        grep "^row " "$OUT/bench$SUFFIX.log"  # the table never printed: the rows as they were measured
    fi
fi
if [ "$step_rc" != skipped ]; then
    [ "$step_rc" = 124 ] && echo "step: killed at ${STEP_TIMEOUT}s: the rows measured so far"
    echo "step: rc=$step_rc"
    grep -E "^# (bench step|matmul)" "$OUT/step$SUFFIX.log"
    if grep -q "^model  " "$OUT/step$SUFFIX.log"; then
        sed -n '/^model  /,$p' "$OUT/step$SUFFIX.log"
    else
        grep "^row " "$OUT/step$SUFFIX.log"  # the table never printed: the rows as they were measured
    fi
fi
if [ "$dist_rc" != skipped ]; then
    [ "$dist_rc" = 124 ] && echo "dist: killed at ${STEP_TIMEOUT}s: the rows measured so far"
    echo "dist: rc=$dist_rc"
    if grep -q "^model  " "$OUT/dist$SUFFIX.log"; then
        sed -n '/^model  /,$p' "$OUT/dist$SUFFIX.log"
    else
        grep "^row " "$OUT/dist$SUFFIX.log" | cut -c1-300
    fi
fi
[ "$dist_rc" = skipped ] || [ "$dist_rc" = 0 ] || exit 1
[ "$tests_rc" = skipped ] || [ "$tests_rc" = 0 ] || exit 1
[ "$bench_rc" = skipped ] || [ "$bench_rc" = 0 ] || exit 1
[ "$step_rc" = skipped ] || [ "$step_rc" = 0 ] || exit 1
exit 0
