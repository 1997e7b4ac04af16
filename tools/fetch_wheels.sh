#!/usr/bin/env bash
# Download the peers' wheels for the device machine (it has no internet) into two carry folders.
#
#   tools/fetch_wheels.sh [PYTHON_VERSION]     # default 3.12: the device's python3 is 3.12.3
#                                              # (KINDS.md, "pip list, as a session saw it")
#
# What lands where (each folder under 60 MiB, so that either one plus the ~1 MiB working tree
# fits the device tool's 64 MiB per call; a warm machine keeps /tmp/site between calls):
#   .whl/a  unsloth 2026.10.9, unsloth_zoo 2026.10.9, trl 1.15.0, datasets 4.8.5, dill 0.4.1,
#           multiprocess 0.70.19, xformers 0.0.35 (35 MiB), and libcudart.so.12 taken out of
#           nvidia-cuda-runtime-cu12 12.8.90 (xformers links it; the cu130 torch there lacks
#           it). That wheel is NOT kept: installed, its nvidia/__init__.py would shadow torch's
#           nvidia namespace.
#   .whl/b  bitsandbytes 0.50.2 (41 MiB; unused by a bf16 step, but without it Unsloth runs
#           `ldconfig` at import) and liger-kernel 0.8.5 (0.9 MiB: here, so that a call carrying
#           .whl/b alone runs every peer but Unsloth, and `gpu_check.sh bench` has its baseline),
#           and accelerate 1.15.0 (pure Python, under 1 MiB: HF+PEFT's multi-GPU row of `bench.py
#           step --nproc N` starts through `accelerate launch`).
# Versions are PEERS.md's. Every wheel is fetched with --no-deps: the list above is exactly what
# the device lacks (PEERS.md, checked there); anything else unsloth declares it imports lazily.
# The device calls that use these folders are written at the top of tools/bench_step.py.
#
# Errors: pip's own (no network, no wheel for the platform); a folder over 60 MiB stops the
# script with the sizes. Re-running is cheap: wheels already present are not downloaded again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-3.12}
LIMIT_MIB=60

A_PKGS=(unsloth==2026.10.9 unsloth_zoo==2026.10.9 trl==1.15.0 datasets==4.8.5 dill==0.4.1
        multiprocess==0.70.19 xformers==0.0.35)
B_PKGS=(bitsandbytes==0.50.2 liger-kernel==0.8.5 accelerate==1.15.0)
CUDART=nvidia-cuda-runtime-cu12==12.8.90

# manylinux tags are matched exactly: bitsandbytes 0.50.2 ships only manylinux_2_24.
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
    PLATFORMS+=(--platform "$p")
done

fetch() {  # fetch DEST SPEC...
    local dest=$1
    shift
    mkdir -p "$dest"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" \
        --implementation cp "${PLATFORMS[@]}" -d "$dest" "$@"
}

# Wheels in .whl/ itself (an older layout) or in the other folder move to their own folder, so
# that no wheel is installed twice (two copies of one package stop pip).
shopt -s nullglob
mkdir -p .whl/a .whl/b
for w in .whl/*.whl .whl/a/*.whl .whl/b/*.whl; do
    case "$(basename "$w")" in
        bitsandbytes-*|liger_kernel-*) dest=.whl/b ;;
        *) dest=.whl/a ;;
    esac
    [ "$(dirname "$w")" = "$dest" ] || mv "$w" "$dest/"
done

fetch .whl/a "${A_PKGS[@]}"
fetch .whl/b "${B_PKGS[@]}"

if [ ! -f .whl/a/libcudart.so.12 ]; then
    tmp=$(mktemp -d)
    fetch "$tmp" "$CUDART"
    python3 - "$tmp" <<'EOF'
import glob, sys, zipfile
whl = glob.glob(f"{sys.argv[1]}/nvidia_cuda_runtime_cu12-*.whl")[0]
with zipfile.ZipFile(whl) as z:
    data = z.read("nvidia/cuda_runtime/lib/libcudart.so.12")
with open(".whl/a/libcudart.so.12", "wb") as f:
    f.write(data)
EOF
    rm -rf "$tmp"
fi

for d in .whl/a .whl/b; do
    mib=$(( $(du -sb "$d" | cut -f1) / 1048576 ))
    echo "$d: ${mib} MiB: $(cd "$d" && ls | tr '\n' ' ')"
    if [ "$mib" -ge "$LIMIT_MIB" ]; then
        echo "fetch_wheels.sh: $d holds ${mib} MiB, over ${LIMIT_MIB}: move a wheel to the other folder" >&2
        exit 1
    fi
done
